"""Round scalars as TensorBoard event files (``dtrain worker --tensorboard DIR``), beside
metrics.jsonl and the rendezvous's Prometheus endpoint.

Each site writes under ``DIR/<site_id>`` (one TensorBoard run per site), one scalar per
numeric field of the site's status-page report of a round (:func:`dtrain.status.round_report`,
so the same figures as the status page and ``/metrics``), tagged ``round/<field>`` at step =
the round number; ``contributed`` is 1.0 or 0.0, ``members`` becomes ``round/num_members``,
``rejected`` ``round/rejected`` (the sum over reject codes). A field that is None (no
validation this round) is not written. The event files are flushed after every round, so
a crashed site leaves what it reported.

The writer is ``torch.utils.tensorboard.SummaryWriter``, which needs the optional
``tensorboard`` package (``pip install 'dtrain[tensorboard]'``); ``WorkerConfig`` refuses
``tensorboard`` at construction when it is missing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from dtrain.status import REPORT_FIELDS, round_report

__all__ = ["TensorBoardSink", "round_scalars"]

#: numeric report fields that are not a round's scalars (the step, a clock)
_SKIP = {"round", "time"}
#: the kinds of REPORT_FIELDS that are scalars (text, lists and counts are not; members and
#: rejected are summarized below)
_SCALAR_KINDS = {"num", "int", "bool"}


def round_scalars(metrics_line: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of one round's metrics line: tag -> value (pure; what the sink writes).

    The numeric and boolean fields of the line's status-page report (``REPORT_FIELDS``),
    ``num_members`` and ``rejected`` (summed over codes); non-finite and None values left out.
    """
    rep = round_report(metrics_line)
    out: dict[str, float] = {}
    for key, kind in REPORT_FIELDS.items():
        if key in _SKIP or kind not in _SCALAR_KINDS or rep.get(key) is None:
            continue
        v = float(rep[key])
        if math.isfinite(v):
            out[f"round/{key}"] = v
    if "members" in rep:
        out["round/num_members"] = float(len(rep["members"]))
    if "rejected" in rep:
        out["round/rejected"] = float(sum((rep["rejected"] or {}).values()))
    return out


class TensorBoardSink:
    """Writes each round's scalars of one site under ``log_dir/<site_id>``.

    Args:
        log_dir: the run's TensorBoard directory (created if missing).
        site_id: this site's id (the TensorBoard run name).

    Raises:
        ImportError: the tensorboard package is missing (the message says how to install it).
    """

    def __init__(self, log_dir: str | Path, site_id: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's module imports tensorboard
            raise ImportError(
                f"--tensorboard needs the tensorboard package: pip install 'dtrain[tensorboard]' ({e})"
            ) from e
        self.path = Path(log_dir) / site_id
        self._writer = SummaryWriter(log_dir=str(self.path), flush_secs=10)

    def add_round(self, metrics_line: Mapping[str, Any]) -> None:
        """Write the round's scalars (step = its ``round``) and flush."""
        step = int(metrics_line["round"])
        wall = metrics_line.get("time")
        for tag, value in round_scalars(metrics_line).items():
            self._writer.add_scalar(tag, value, global_step=step, walltime=wall)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
