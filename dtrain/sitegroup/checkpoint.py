"""Checkpoints of a site group with ``torch.distributed.checkpoint`` (DCP).

Every rank of the site calls :func:`save_site_checkpoint` /
:func:`load_site_checkpoint` (collectives). One checkpoint is a DCP directory
``sg-RRRRRR`` (R = rounds applied) holding:

* ``model`` and ``optim``: the rank's model and inner optimizer, through
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` (FSDP2 DTensor
  shards are saved as shards, DDP replicas once);
* ``rank<j>``: rank j's own DiLoCo slice (``GlobalState.state_dict()``: θ, the
  outer-optimizer state and the residuals of slice j, round, layout fingerprint),
  its inner-step count and the caller's ``extra`` (e.g. the data position),
  ``torch.save``-d into one bytes value (its outer state is created lazily, so a
  fresh template could not receive it tensor by tensor).

DCP writes into ``.sg-RRRRRR.tmp``; rank 0 renames it into place after every rank
finished, so a crash never leaves a partial checkpoint under the final name, and
keeps the newest ``keep``. Loading validates site, rank count, rank and the slice's
layout fingerprint on every rank before anything is applied; any mismatch raises
:class:`~dtrain.errors.CheckpointError` on every rank.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from dtrain.errors import CheckpointError

# ``diloco`` below is a :class:`dtrain.diloco.DiLoCo` of a site of K > 1 ranks (this
# module sits below it: it uses its ``comm``, ``state``, ``layout`` and step counters)
SiteDiLoCo = Any

__all__ = ["FORMAT", "save_site_checkpoint", "load_site_checkpoint", "latest_site_checkpoint"]

log = logging.getLogger(__name__)

FORMAT = "dtrain-site-group-checkpoint-v1"
_NAME = re.compile(r"^sg-(\d{6,})$")


def _dcp():
    """``torch.distributed.checkpoint`` and its state-dict helpers, imported on first use:
    the import takes ~0.5 s (it pulls in DTensor), and most workers never save a
    site-group checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict


@contextlib.contextmanager
def _no_round(diloco: SiteDiLoCo) -> Iterator[None]:
    """get_state_dict may step a stateless inner optimizer once with lr 0 to create its
    state: that step must not count as an inner step (or start a round)."""
    steps, diloco._hook_paused = diloco.inner_steps, True
    try:
        yield
    finally:
        diloco._hook_paused, diloco.inner_steps = False, steps


def _blob(diloco: SiteDiLoCo, extra: object) -> bytes:
    buf = io.BytesIO()
    torch.save(
        {
            "format": FORMAT,
            "site_id": diloco.config.site_id,
            "rank": diloco.rank,
            "num_ranks": diloco.num_ranks,
            "fingerprint": diloco.layout.fingerprint(),
            "diloco": diloco.state.state_dict(),
            "inner_steps": diloco.inner_steps,
            "extra": extra,
        },
        buf,
    )
    return buf.getvalue()


def save_site_checkpoint(
    directory: str | Path,
    diloco: SiteDiLoCo,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    extra: object = None,
    keep: int = 2,
) -> Path:
    """Save this rank's part of the site's checkpoint (every rank calls it).

    Args:
        directory: the site's checkpoint directory (the same path on every rank).
        model: this rank's module as wrapped (DDP, FSDP2 or plain).
        optimizer: this rank's inner optimizer.
        extra: per-rank, ``torch.save``-able values (data position, schedulers).
        keep: checkpoints kept (the newest), >= 1.
    Returns:
        the checkpoint directory written, ``directory/sg-RRRRRR``.
    """
    d = Path(directory)
    final, tmp = d / f"sg-{diloco.round:06d}", d / f".sg-{diloco.round:06d}.tmp"
    if diloco.rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier(group=diloco.comm.process_group)
    dcp, get_state_dict, _ = _dcp()
    with _no_round(diloco):
        model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, f"rank{diloco.rank}": _blob(diloco, extra)}
    dcp.save(state, checkpoint_id=str(tmp), process_group=diloco.comm.process_group)
    dist.barrier(group=diloco.comm.process_group)
    if diloco.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in d.iterdir() if _NAME.match(p.name))[: -max(1, keep)]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("site-group checkpoint saved: %s", final)
    dist.barrier(group=diloco.comm.process_group)
    return final


def latest_site_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete ``sg-RRRRRR`` checkpoint in ``directory``, or None."""
    d = Path(directory)
    if not d.is_dir():
        return None
    done = [p for p in d.iterdir() if _NAME.match(p.name) and (p / ".metadata").exists()]
    return max(done, key=lambda p: int(_NAME.match(p.name).group(1))) if done else None  # type: ignore[union-attr]


def _check(meta: dict, diloco: SiteDiLoCo) -> str | None:
    want = {
        "format": FORMAT,
        "site_id": diloco.config.site_id,
        "num_ranks": diloco.num_ranks,
        "rank": diloco.rank,
        "fingerprint": diloco.layout.fingerprint(),
    }
    for key, value in want.items():
        if meta.get(key) != value:
            return f"rank {diloco.rank}: {key} is {meta.get(key)!r}, this site group has {value!r}"
    return None


def load_site_checkpoint(
    path: str | Path, diloco: SiteDiLoCo, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> object:
    """Load this rank's model, inner optimizer and DiLoCo slice (every rank calls it),
    before the site joins (``DiLoCo(..., _defer_join=True)``, then ``join()``).

    Returns:
        this rank's ``extra`` as saved.
    Raises:
        CheckpointError: (every rank) unreadable, or of another site, rank count,
            rank or model layout; nothing is applied then.
    """
    key = f"rank{diloco.rank}"
    err, meta = None, {}
    dcp, get_state_dict, set_state_dict = _dcp()
    with _no_round(diloco):
        model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, key: b""}
    try:
        dcp.load(state, checkpoint_id=str(path), process_group=diloco.comm.process_group)
        meta = torch.load(io.BytesIO(state[key]), weights_only=True)
        err = _check(meta, diloco) if isinstance(meta, dict) else f"rank {diloco.rank}: not a site-group slice"
    except (RuntimeError, ValueError, KeyError, OSError, dcp.api.CheckpointException) as e:
        err = f"rank {diloco.rank}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    errs = [e for e in diloco.comm.all_gather(err) if e]
    if errs:
        raise CheckpointError(f"checkpoint {path} does not fit this site group: {errs[0]}")
    with _no_round(diloco):
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    diloco.state.load_state_dict(meta["diloco"])
    steps = int(meta["inner_steps"])
    diloco.inner_steps = steps
    diloco.note_progress()
    log.info("%s rank %d: resumed from %s (round %d)", diloco.config.site_id, diloco.rank, path, diloco.round)
    return meta["extra"]
