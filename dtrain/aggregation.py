"""Unbiased partial aggregation of pseudo-gradient chunks at their owner.

The owner of a bucket averages, per chunk, only the contributions that arrived
and validated before the deadline, dividing by their *count* rather than by the
number of members. This is the unbiased reduce of Weintraub, Banner & Orda,
"Distributed Training under Packet Loss" (arXiv 2507.07114, §4, "unbiased
reduce-scatter"): with independent losses, E[mean] equals the full mean.

Robust options (off by default):
  * ``max_norm``: absolute L2 bound per contribution, checked on arrival.
  * ``norm_bound_ratio``: at finalize, contributions whose L2 norm exceeds
    ``ratio x median norm`` are dropped (needs >= 3 contributions to act).
  * ``trim_fraction``: coordinate-wise trimmed mean dropping that fraction of
    the largest and the smallest values per element (Yin et al., "Byzantine-
    robust distributed learning", ICML 2018, trimmed mean with beta).
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from dtrain.configs import AggregationConfig
from dtrain.errors import RejectCode, Rejected

__all__ = ["AggregationConfig", "ChunkAccumulator", "partial_mean"]

log = logging.getLogger(__name__)


def partial_mean(
    contributions: dict[str, torch.Tensor], config: AggregationConfig
) -> tuple[torch.Tensor | None, tuple[str, ...], dict[str, str]]:
    """Mean over the contributions that are present and pass the robust checks.

    Args:
        contributions: sender -> fp32 1-D tensor, all of the same length.
        config: robust options.
    Returns:
        ``(mean, included_senders, rejected)``: ``mean`` is None when nothing is
        left; ``rejected`` maps sender -> reason for contributions dropped here.
    """
    rejected: dict[str, str] = {}
    items = sorted(contributions.items())
    if config.norm_bound_ratio is not None and len(items) >= 3:
        norms = {s: float(torch.linalg.vector_norm(v)) for s, v in items}
        med = (
            sorted(norms.values())[len(norms) // 2]
            if len(norms) % 2
            else sum(sorted(norms.values())[len(norms) // 2 - 1 : len(norms) // 2 + 1]) / 2
        )
        bound = config.norm_bound_ratio * med
        kept = []
        for s, v in items:
            if norms[s] > bound:
                rejected[s] = f"norm {norms[s]:.4g} above bound {bound:.4g} ({config.norm_bound_ratio} x median)"
            else:
                kept.append((s, v))
        items = kept
    if not items:
        return None, (), rejected
    senders = tuple(s for s, _ in items)
    stack = torch.stack([v for _, v in items])
    k = int(config.trim_fraction * len(items))
    if k > 0 and len(items) - 2 * k >= 1:
        srt, _ = torch.sort(stack, dim=0)
        mean = srt[k : len(items) - k].mean(dim=0)
    else:
        mean = stack.sum(dim=0) / len(items)
    return mean, senders, rejected


class ChunkAccumulator:
    """Collects the contributions to one chunk of one bucket for one round.

    The sum is taken in a canonical order, whatever order contributions arrive in:
    sender ids sorted. Without robust options it keeps a running fp32 sum over the
    contiguous prefix of ``order`` that has arrived, and holds a contribution that
    arrives ahead of its turn until the senders before it arrive or :meth:`finalize`
    (memory: one chunk, plus the contributions that arrived out of turn); with them it
    keeps every contribution until :meth:`finalize`. Either way two owners given the
    same contributions compute a bit-identical mean.
    Thread-safety: callers hold the owning round's lock.

    Args:
        numel: elements of the chunk.
        config: robust options.
        order: the senders expected (the round's members); None folds nothing before
            :meth:`finalize` (every contribution is kept until then).
    """

    def __init__(self, numel: int, config: AggregationConfig, order: Iterable[str] | None = None) -> None:
        self.numel = numel
        self.config = config
        self._order = sorted(order) if order is not None else []
        self._next = 0  # senders self._order[:self._next] are in self._sum
        self._sum: torch.Tensor | None = None
        self._kept: dict[str, torch.Tensor] = {}  # robust: every contribution; else: arrived out of turn
        self._digests: dict[str, bytes] = {}

    @property
    def senders(self) -> tuple[str, ...]:
        return tuple(sorted(self._digests))

    @property
    def num_held(self) -> int:
        """Contributions held as tensors: every one with robust options, else those that
        arrived ahead of their turn in the sum."""
        return len(self._kept)

    @property
    def digests(self) -> dict[str, bytes]:
        """Sender -> digest of the payload counted from it (a copy)."""
        return dict(self._digests)

    def add(self, sender: str, values: torch.Tensor, digest: bytes) -> bool:
        """Add one contribution. Returns False for an identical retry (idempotent).

        Raises:
            Rejected: wrong length or dtype, non-finite values, norm over
                ``max_norm`` (INVALID_ARGUMENT); a *different* payload from a
                sender already counted (ALREADY_EXISTS).
        """
        if sender in self._digests:
            if self._digests[sender] == digest:
                return False
            raise Rejected(
                RejectCode.ALREADY_EXISTS, f"a different contribution from {sender} for this chunk was already accepted"
            )
        if values.dtype != torch.float32 or values.dim() != 1 or values.numel() != self.numel:
            raise Rejected(
                RejectCode.INVALID_ARGUMENT,
                f"contribution has {values.numel()} {values.dtype} values, expected {self.numel} float32",
            )
        if not bool(torch.isfinite(values).all()):
            raise Rejected(RejectCode.INVALID_ARGUMENT, "contribution contains NaN or Inf values")
        if self.config.max_norm is not None:
            norm = float(torch.linalg.vector_norm(values))
            if norm > self.config.max_norm:
                raise Rejected(
                    RejectCode.INVALID_ARGUMENT,
                    f"contribution norm {norm:.4g} exceeds max_norm {self.config.max_norm:.4g}",
                )
        self._kept[sender] = values
        self._digests[sender] = digest
        if not self.config.robust:
            while self._next < len(self._order) and self._order[self._next] in self._kept:
                self._fold(self._kept.pop(self._order[self._next]))
                self._next += 1
        return True

    def _fold(self, values: torch.Tensor) -> None:
        if self._sum is None:
            self._sum = values.clone()
        else:
            self._sum.add_(values)

    def finalize(self) -> tuple[torch.Tensor | None, tuple[str, ...], dict[str, str]]:
        """The unbiased partial mean; see :func:`partial_mean` for the result."""
        if self.config.robust:
            return partial_mean(self._kept, self.config)
        for sender in sorted(self._kept):
            self._fold(self._kept.pop(sender))
        if self._sum is None:
            return None, (), {}
        senders = self.senders
        return self._sum / len(senders), senders, {}
