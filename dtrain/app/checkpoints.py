"""A worker's checkpoints, for a site of any K: save every ``checkpoint.every`` rounds,
resume the newest with ``checkpoint.resume``.

Two backends, one choice by K (what each holds is the same: the model, the inner
optimizer and its LR scheduler, DiLoCo's state, the data position and the adopted
shard parts):
* K = 1: one atomic file per checkpoint (:mod:`dtrain.checkpoint`, ``torch.save``);
* K > 1: a torch.distributed.checkpoint directory per checkpoint, every rank writing its
  model shard and its DiLoCo slice (:mod:`dtrain.sitegroup.checkpoint`).
A checkpoint is loaded before the site joins, so a rejoining site presents its saved
round; one of another site, rank count or model is refused (``CheckpointError``, on
every rank).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from typing import Any

import torch

from dtrain.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dtrain.diloco import DiLoCo
from dtrain.errors import CheckpointError
from dtrain.sitegroup.checkpoint import latest_site_checkpoint, load_site_checkpoint, save_site_checkpoint

__all__ = ["resume", "save"]

log = logging.getLogger(__name__)


def resume(cfg, task, module: torch.nn.Module, optimizer, scheduler, diloco: DiLoCo) -> dict | None:
    """``--resume``: load the newest checkpoint of ``cfg.resolved_checkpoint_dir`` into the
    model, the inner optimizer and scheduler, the data stream and ``diloco`` (before it
    joins). Returns the checkpoint's adopted shard parts (``shards``), None without.

    Raises:
        CheckpointError: a corrupt checkpoint, or one of another site, rank count or model.
    """
    if not cfg.checkpoint.resume:
        return None
    d = cfg.resolved_checkpoint_dir
    path = latest_checkpoint(d) if diloco.num_ranks == 1 else latest_site_checkpoint(d)
    if path is None:
        if diloco.rank == 0:
            log.warning("--resume: no checkpoint in %s; starting fresh", d)
        return None
    if diloco.num_ranks > 1:
        extra = load_site_checkpoint(path, diloco, module, optimizer)
    else:
        data = load_checkpoint(path, site_id=cfg.site_id, fingerprint=diloco.layout.fingerprint())
        try:
            module.load_state_dict(data["model"])
            optimizer.load_state_dict(data["inner_optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {path} does not fit this task: {e}") from e
        diloco.load_state_dict(data["diloco"])
        diloco.state.copy_to(diloco.local_tensors())
        extra = data
    try:
        if scheduler is not None and extra.get("inner_scheduler") is not None:
            scheduler.load_state_dict(extra["inner_scheduler"])
        task.batches.load_state_dict(extra["batches"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} does not fit this task: {e}") from e
    log.info("%s: resuming from %s (round %d)", cfg.site_id, path, diloco.round)
    return extra.get("shards")


def save(cfg, task, module: torch.nn.Module, optimizer, scheduler, diloco: DiLoCo, *, shards: Any = None) -> None:
    """Save a checkpoint of this site now (every rank calls it for K > 1).

    Args:
        shards: the adopted shard parts (``{"watch", "mix"}`` state dicts) or None.
    """
    if diloco.streaming is not None:  # θ, the outer state and the round number of one round, on every rank
        diloco.streaming.wait_in_flight()
    extra = {
        "batches": task.batches.state_dict(),
        "inner_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "shards": shards,
    }
    if diloco.num_ranks > 1:
        save_site_checkpoint(cfg.resolved_checkpoint_dir, diloco, module, optimizer, extra=extra)
        return
    save_checkpoint(
        cfg.resolved_checkpoint_dir,
        diloco.round,
        {
            "site_id": cfg.site_id,
            "fingerprint": diloco.layout.fingerprint(),
            "model": module.state_dict(),
            "inner_optimizer": optimizer.state_dict(),
            "diloco": diloco.state_dict(),
            "config": json.dumps(asdict(cfg), default=str),
            **extra,
        },
    )
