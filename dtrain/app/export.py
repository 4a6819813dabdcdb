"""Export of the agreed θ as safetensors in the Hugging Face layout (``--export.every``,
``--export.final``; :class:`~dtrain.app.config.ExportConfig`).

An export is a directory ``OUT_DIR/export/round-NNNNNN`` (every ``export.every`` rounds)
or ``OUT_DIR/export/final`` (when the run has trained all its rounds) holding:

* ``model.safetensors``: θ under the model's own parameter names (``state_dict()`` keys,
  fp32 as trained, buffers included), metadata ``format=pt`` (what ``transformers``
  requires) and ``dtrain_site``, ``dtrain_round``, ``dtrain_checksum`` (the site's θ
  checksum of that round, as in metrics.jsonl). Tensors that share storage (tied
  weights) are written once, under the first name in ``state_dict()`` order (for a
  ``transformers`` model the input embedding, which ``from_pretrained`` ties back);
* whatever ``Task.export_files`` writes beside it: ``config.json`` (and ``tokenizer.json``),
  so the ``hf`` task's export loads with ``AutoModelForCausalLM.from_pretrained(dir)``.

θ, not the model: the export copies θ (``DiLoCo.state``) into the model's tensors, reads the
state dict, and puts the model's own values back, so an export taken while the model has
moved on from θ (streaming fragments, delayed momentum) still holds the agreed θ, bit for
bit. A site group (K > 1) does this on every rank (a collective: every rank calls
:func:`export_theta`; replicated parts are all-gathered inside the site) and rank 0 writes
the full state dict (``torch.distributed.checkpoint.state_dict``, FSDP2 shards gathered
to rank 0's CPU). The directory appears whole: it is written under a temporary name and
renamed (an older export of the same name is replaced).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import torch

from dtrain.diloco import DiLoCo
from dtrain.rounds.outcome import RoundStatus, SyncOutcome

__all__ = ["export_theta", "maybe_export", "final_export", "theta_state_dict", "write_export", "FINAL"]

log = logging.getLogger(__name__)

FINAL = "final"


def _full_state_dict(module: torch.nn.Module, num_ranks: int) -> dict[str, torch.Tensor]:
    """The model's full state dict on CPU (rank 0 of a site group; other ranks get {})."""
    if num_ranks == 1:
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def theta_state_dict(module: torch.nn.Module, diloco: DiLoCo) -> dict[str, torch.Tensor]:
    """θ as the model's full state dict (CPU tensors, the model's names; rank 0 of a site
    group, {} on the other ranks). Every rank of a site group must call it (collective).

    The model is left as it was: its tensors are saved, θ written in, the state dict
    read, and the saved values written back.
    """
    local = diloco.local_tensors()
    saved = [t.detach().clone() for t in local]
    slices = diloco.slices
    try:
        diloco.state.copy_to(local)
        if slices is not None:
            slices.sync_replicas()
        full = _full_state_dict(module, diloco.num_ranks)
        # copies: the values must not follow the model when it is restored below
        return {k: v.detach().clone() for k, v in full.items()}
    finally:
        with torch.no_grad():
            for t, s in zip(local, saved):
                t.copy_(s)
        if slices is not None:
            slices.sync_replicas()


def _deduplicated(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the later names of tensors that share storage (tied weights)."""
    out, seen = {}, set()
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype) if v.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        out[k] = v.contiguous()
    return out


def write_export(
    directory: Path, state: dict[str, torch.Tensor], *, metadata: dict[str, str], export_files=None
) -> Path:
    """Write ``model.safetensors`` (``state``, shared tensors once) and ``export_files(dir)``
    into ``directory``, atomically (a temporary sibling renamed into place).

    Returns:
        ``directory``.
    Raises:
        OSError: the directory cannot be written (nothing is left half-written there).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        save_file(_deduplicated(state), str(tmp / "model.safetensors"), metadata={"format": "pt", **metadata})
        if export_files is not None:
            export_files(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def export_theta(cfg, task, module: torch.nn.Module, diloco: DiLoCo, name: str, *, checksum: str) -> Path | None:
    """Export θ to ``cfg.resolved_export_dir / name`` (every rank of a site group calls
    it; rank 0 writes). Returns the directory on rank 0, None on the others."""
    state = theta_state_dict(module, diloco)
    if diloco.rank != 0:
        return None
    meta = {"dtrain_site": cfg.site_id, "dtrain_round": str(diloco.model_round), "dtrain_checksum": checksum}
    path = write_export(
        cfg.resolved_export_dir / name, state, metadata=meta, export_files=getattr(task, "export_files", None)
    )
    log.info("%s: exported θ of round %d to %s", cfg.site_id, diloco.model_round, path)
    return path


def maybe_export(cfg, task, module: torch.nn.Module, diloco: DiLoCo, outcome: SyncOutcome) -> Path | None:
    """Export every ``export.every`` rounds (never after a deferred sync; every rank)."""
    every = cfg.export.every
    if not every or outcome.status == RoundStatus.DEFERRED or diloco.model_round % every:
        return None
    checksum = outcome.site_checksum or diloco.site_checksum()
    return export_theta(cfg, task, module, diloco, f"round-{diloco.model_round:06d}", checksum=checksum)


def final_export(cfg, task, module: torch.nn.Module, diloco: DiLoCo) -> Path | None:
    """With ``export.final``, export to ``final`` once the run trained all its rounds
    (the same decision on every rank: it follows ``model_round``, not a signal)."""
    if not cfg.export.final or diloco.model_round < cfg.rounds:
        return None
    return export_theta(cfg, task, module, diloco, FINAL, checksum=diloco.site_checksum())
