"""Which elements of a site's synchronised tensors each rank of a site group syncs.

A site group is the K ranks (torch.distributed processes) of one site. Rank j of
every site holds θ, the outer-optimizer state and the residuals of *slice j*
only, and exchanges that slice with rank j of the other sites:

* a sharded tensor (an FSDP2 ``DTensor`` parameter, ``torch.distributed.fsdp.
  fully_shard``) contributes its local shard (``to_local()``) to its own rank's
  slice: the shards already partition it;
* replicated tensors (DDP parameters, FSDP2 buffers, plain modules) are
  flattened end to end into one virtual vector of R elements, and rank j takes
  elements ``[j*S, min(R, (j+1)*S))`` with ``S = ceil(R / K)``. After a round each
  rank writes its new θ slice into its part and :meth:`SliceMap.sync_replicas`
  all-gathers the parts inside the site so every replica ends equal.

Slices are views of the model's tensors: writing θ into them writes the model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["Piece", "SliceMap", "is_sharded", "local_part"]

log = logging.getLogger(__name__)


def is_sharded(t: torch.Tensor) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (e.g. an FSDP2 parameter)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed tensors
        return False
    return isinstance(t, DTensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``t``: a DTensor's local shard, else ``t`` itself
    (detached; it shares storage with the model, so writes reach the model)."""
    d = t.detach()
    return d.to_local() if is_sharded(d) else d


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of flattened replicated tensor ``tensor_index``."""

    tensor_index: int
    start: int
    stop: int


class SliceMap:
    """The slice of each rank of a site group.

    Args:
        tensors: the site's synchronised tensors (parameters, then averaged
            buffers), as the model holds them: DTensors or plain tensors,
            contiguous, floating point.
        kinds: ``"param"`` or ``"buffer"`` per tensor (as ``BucketLayout`` takes).
        rank: this rank's index in the site group, in ``[0, num_ranks)``.
        num_ranks: K, the ranks of the site group (>= 1).

    Raises:
        ValueError: ``rank`` outside ``[0, num_ranks)``, or lengths differ.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], kinds: Sequence[str], rank: int, num_ranks: int) -> None:
        if num_ranks < 1 or not 0 <= rank < num_ranks:
            raise ValueError(f"rank must be in [0, num_ranks), got rank={rank!r}, num_ranks={num_ranks!r}")
        if len(tensors) != len(kinds):
            raise ValueError(f"tensors and kinds differ in length ({len(tensors)} != {len(kinds)})")
        self.rank = rank
        self.num_ranks = num_ranks
        self._tensors = list(tensors)
        self._kinds = list(kinds)
        self._sharded = [i for i, t in enumerate(tensors) if is_sharded(t)]
        self._replicated = [i for i, t in enumerate(tensors) if not is_sharded(t)]
        self.replicated_numel = sum(tensors[i].numel() for i in self._replicated)
        self.part_numel = -(-self.replicated_numel // num_ranks)  # S = ceil(R / K)
        self._pieces = [self._pieces_of(k) for k in range(num_ranks)]

    def _pieces_of(self, k: int) -> list[Piece]:
        lo, hi = k * self.part_numel, min(self.replicated_numel, (k + 1) * self.part_numel)
        pieces, off = [], 0
        for i in self._replicated:
            n = self._tensors[i].numel()
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                pieces.append(Piece(i, a - off, b - off))
            off += n
        return pieces

    def _view(self, p: Piece) -> torch.Tensor:
        return self._tensors[p.tensor_index].detach().view(-1)[p.start : p.stop]

    def local(self) -> tuple[list[torch.Tensor], list[str]]:
        """This rank's slice: its DTensor shards, then its part of the replicated
        tensors, as views of the model's tensors, with their kinds."""
        out = [local_part(self._tensors[i]) for i in self._sharded]
        kinds = [self._kinds[i] for i in self._sharded]
        for p in self._pieces[self.rank]:
            out.append(self._view(p))
            kinds.append(self._kinds[p.tensor_index])
        return out, kinds

    def sync_replicas(self, group: dist.ProcessGroup | None = None) -> None:
        """All-gather every rank's part of the replicated tensors inside the site,
        so every replica holds every rank's θ part (a collective: all K ranks call it).

        Parts travel as fp32 of ``part_numel`` elements (the last one padded) and
        are cast back to each tensor's dtype.
        """
        if self.num_ranks == 1 or self.replicated_numel == 0:
            return
        device = self._tensors[self._replicated[0]].device  # NCCL needs device tensors
        mine = torch.zeros(self.part_numel, dtype=torch.float32, device=device)
        off = 0
        for p in self._pieces[self.rank]:
            v = self._view(p)
            mine[off : off + v.numel()].copy_(v)
            off += v.numel()
        parts = [torch.empty_like(mine) for _ in range(self.num_ranks)]
        dist.all_gather(parts, mine, group=group)
        with torch.no_grad():
            for k, part in enumerate(parts):
                if k == self.rank:
                    continue
                off = 0
                for p in self._pieces[k]:
                    v = self._view(p)
                    v.copy_(part[off : off + v.numel()])
                    off += v.numel()
