"""The labels and row selectors of ``experiments/convergence.py`` (issue 18), shared by
its runner and its report (:mod:`experiments.convergence_report`) without an import cycle.

Percent changes (``common.pct_deltas``) are of the final validation loss (nats/byte): 100·(L / L_base − 1), paired
by seed; SE = std / √n (inf for one value).
"""

from __future__ import annotations

from typing import Any, Sequence

SE_TARGET_PP = 0.2  # percentage points: the standard error a fault's paired change must reach
DDP, ALONE, BIG = "DDP", "1 site", "1 site, 4x batch"
NESTEROV, AVERAGE = (0.7, 0.9), (1.0, 0.0)
LONG = "long"  # the --long-check runs' section
FAULT_FREE, LOSS10, RESTART = "fault-free (fp32)", "10% chunk loss", "1 site down, restarted"
CODECS = {"int8": "int8", "int4": "int4", "topk + error feedback": "topk"}
#: SparseLoCo rows (issue 35): chunked top-k, 2-bit values, error feedback decay β, and the
#: paper's outer step (SGD lr α = 1, no momentum) unless a row says otherwise; the owners
#: re-sparsify each mean with their own error feedback unless a row says otherwise.
_SL = dict(
    codec="sparseloco", error_feedback_decay=0.95, outer_lr=1.0, outer_momentum=0.0, broadcast_error_feedback=True
)
SPARSE = {
    "int4+zstd": dict(codec="int4+zstd"),
    "sparseloco k=32/4096": dict(_SL, sparse_k=32),
    "sparseloco k=64/4096": dict(_SL, sparse_k=64),
    "sparseloco k=128/4096": dict(_SL, sparse_k=128),
    "sparseloco k=64, Nesterov 0.7/0.9, β 1": dict(_SL, error_feedback_decay=1.0, outer_lr=0.7, outer_momentum=0.9),
    "sparseloco k=64, int8 means": dict(_SL, broadcast_codec="int8", broadcast_error_feedback=False),
    "sparseloco k=64, means at k=256": dict(_SL, broadcast_sparse_k=256),
    "sparseloco k=128, means at k=512": dict(_SL, sparse_k=128, broadcast_sparse_k=512),
    "sparseloco k=32, means at k=128": dict(_SL, sparse_k=32, broadcast_sparse_k=128),
    "sparseloco k=128 α 2, means at k=512": dict(_SL, sparse_k=128, broadcast_sparse_k=512, outer_lr=2.0),
    "sparseloco k=128 α 4, means at k=512": dict(_SL, sparse_k=128, broadcast_sparse_k=512, outer_lr=4.0),
    "sparseloco k=128 datagram 0%, means at k=512": dict(_SL, sparse_k=128, broadcast_sparse_k=512, datagram_drop=0.0),
    "sparseloco k=128 datagram 10%, means at k=512": dict(_SL, sparse_k=128, broadcast_sparse_k=512, datagram_drop=0.1),
    "sparseloco k=64, means without EF": dict(_SL, broadcast_error_feedback=False),
    "sparseloco k=64 sparse-mean": dict(_SL, sparse_mean=True),
    "sparseloco k=128 sparse-mean": dict(_SL, sparse_k=128, sparse_mean=True),
    "sparseloco k=64 sparse-mean int8-means": dict(
        _SL, sparse_mean=True, broadcast_codec="int8", broadcast_error_feedback=False
    ),
    "sparseloco k=64 sparse-mean β1": dict(_SL, sparse_mean=True, error_feedback_decay=1.0),
}


def outer_name(outer: tuple[float, float]) -> str:
    if outer == AVERAGE:
        return "average"
    return f"Nesterov {outer[0]:g}/{outer[1]:g}" if outer[1] else f"SGD lr {outer[0]:g}"


def diloco_label(h: int, outer: tuple[float, float]) -> str:
    return f"DiLoCo H={h}, {outer_name(outer)}"


def fault_rows(rows: Sequence[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["section"] == "faults" and r["method"] == name]
