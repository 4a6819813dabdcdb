"""Atomic per-site checkpoints: model, inner optimizer, DiLoCo state, data position.

Files are ``ckpt-RRRRRR.pt`` in the checkpoint directory, written to a temporary
name and renamed into place (``os.replace``), so a crash never leaves a partial
file under the final name. Loading validates the format tag, the site and the
model's bucket-layout fingerprint before anything is applied; a corrupt or
mismatched checkpoint raises :class:`~dtrain.errors.CheckpointError` and the
caller's objects are left untouched.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

from dtrain.errors import CheckpointError

__all__ = ["FORMAT", "save_checkpoint", "latest_checkpoint", "load_checkpoint"]

log = logging.getLogger(__name__)

FORMAT = "dtrain-checkpoint-v1"
_NAME = re.compile(r"^ckpt-(\d{6,})\.pt$")


def save_checkpoint(directory: str | Path, round: int, payload: dict, *, keep: int = 2) -> Path:
    """Write ``payload`` for ``round`` atomically and keep the newest ``keep`` files.

    Args:
        directory: checkpoint directory (created if missing).
        round: the number of rounds applied (names the file).
        payload: a dict of tensors / plain values (``torch.save``-able).
    Returns:
        the path written.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"ckpt-{round:06d}.pt"
    tmp = d / f".{path.name}.tmp-{os.getpid()}"
    try:
        torch.save({"format": FORMAT, "round": round, **payload}, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a partial file behind, under any name
        raise
    _fsync_dir(d)  # make the rename itself durable
    olds = sorted(p for p in d.iterdir() if _NAME.match(p.name))[:-keep] if keep > 0 else []
    for p in olds:
        p.unlink(missing_ok=True)
    log.info("checkpoint saved: %s", path)
    return path


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest ``ckpt-*.pt`` in ``directory``, or None."""
    d = Path(directory)
    if not d.is_dir():
        return None
    found = sorted(p for p in d.iterdir() if _NAME.match(p.name))
    return found[-1] if found else None


def load_checkpoint(path: str | Path, *, site_id: str, fingerprint: str) -> dict:
    """Read and validate a checkpoint; nothing is applied here.

    Raises:
        CheckpointError: unreadable/corrupt file, wrong format tag, another
            site's checkpoint, or a different model layout (fingerprint).
    """
    p = Path(path)
    try:
        data = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read means corrupt
        raise CheckpointError(f"checkpoint {p} is corrupt or unreadable ({_first_line(e)})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {p} is not a {FORMAT} file (format={data.get('format') if isinstance(data, dict) else None!r})"
        )
    if data.get("site_id") != site_id:
        raise CheckpointError(f"checkpoint {p} belongs to site {data.get('site_id')!r}, not {site_id!r}")
    if data.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {p} was written for another model/bucket layout "
            f"(fingerprint {data.get('fingerprint')!r}, this run {fingerprint!r})"
        )
    for key in ("model", "inner_optimizer", "diloco", "batches"):
        if key not in data:
            raise CheckpointError(f"checkpoint {p} lacks {key!r}")
    return data
