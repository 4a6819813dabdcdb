"""What a site's ranks say to each other: the one thing that differs between a
one-process site and a site that is a torch.distributed group of K ranks.

:class:`~dtrain.diloco.DiLoCo` runs the same code for every K >= 1; the few steps
that need the other ranks of the site go through a :class:`SiteComm`:

* ``broadcast`` / ``all_gather``: rank 0's round decision to every rank, the
  half-round rule's views (:mod:`dtrain.sitegroup.agree`), errors that must stop
  every rank at once, the slices' checksums, per-rank metrics;
* ``sync_replicas``: the replicated parts of the model all-gathered after θ is
  written into this rank's slice (:class:`~dtrain.sitegroup.slices.SliceMap`);
* ``lost_notices``: rank 0's dead-site notices to the other ranks
  (:mod:`dtrain.sitegroup.notices`).

:class:`LocalSiteComm` (K = 1) does nothing: a broadcast returns its argument, an
all-gather a one-element list. :class:`TorchSiteComm` (K > 1) runs them over the
site's process group (gloo on CPU). A round's own collectives (decision,
agreement, resync) run on a *side* process group of the same ranks (``round=True``)
because with streaming rounds (:mod:`dtrain.streaming`) they run in a background
thread while the training loop's collectives (replicas, checksums, metrics,
checkpoints) run on the main group; two threads must never share one group
(gloo matches collectives by order). Every rank of a site must make the same calls
in the same order on each group.

Faults: a rank that dies makes the others' next collective fail after the process
group's timeout (``RuntimeError`` from torch.distributed); the site then stops
heartbeating and the other sites finish their rounds as for a dead site.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

import torch.distributed as dist

from dtrain.sitegroup.notices import LostNotices, site_store
from dtrain.sitegroup.slices import SliceMap

__all__ = ["SiteComm", "LocalSiteComm", "TorchSiteComm"]

log = logging.getLogger(__name__)


class SiteComm(Protocol):
    """The collectives of one site's K ranks (see the module docstring).

    Attributes:
        rank: this rank's index in the site, in ``[0, num_ranks)``.
        num_ranks: K >= 1.
        process_group: the site's main process group (None for K = 1).
    """

    rank: int
    num_ranks: int
    process_group: Any

    def broadcast(self, obj: Any, *, round: bool = False) -> Any: ...
    def all_gather(self, obj: Any, *, round: bool = False) -> list: ...
    def sync_replicas(self, slices: SliceMap) -> None: ...
    def lost_notices(self, on_lost: Callable[[list[str]], frozenset[str]]) -> LostNotices | None: ...
    def close(self) -> None: ...


class LocalSiteComm:
    """A one-process site (K = 1): every collective is the identity."""

    rank = 0
    num_ranks = 1
    process_group = None

    def broadcast(self, obj: Any, *, round: bool = False) -> Any:  # noqa: ARG002
        return obj

    def all_gather(self, obj: Any, *, round: bool = False) -> list:  # noqa: ARG002
        return [obj]

    def sync_replicas(self, slices: SliceMap) -> None:  # noqa: ARG002
        return None

    def lost_notices(self, on_lost: Callable[[list[str]], frozenset[str]]) -> LostNotices | None:  # noqa: ARG002
        return None

    def close(self) -> None:
        return None


class TorchSiteComm:
    """A site of K ranks over torch.distributed (every rank constructs it: collective).

    Args:
        process_group: the site's process group (default: the default group). Give it
            a timeout when it is made: a dead rank blocks collectives until then.
        store: a ``torch.distributed`` store every rank reaches, for rank 0's dead-site
            notices (default: the site's TCPStore from ``MASTER_ADDR``/``MASTER_PORT``;
            without one, ranks j > 0 wait for a dead site until the reduce deadline).
    Raises:
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, store: dist.Store | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchSiteComm needs torch.distributed initialised (init_process_group) on every rank")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.num_ranks = dist.get_world_size(process_group)
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        # the rounds' collectives: their own group, so a background round never interleaves with the loop's
        self._round_group = dist.new_group(ranks=ranks, backend="gloo")
        self._store = store
        self._src = dist.get_global_rank(process_group, 0) if process_group is not None else 0

    def _group(self, round: bool) -> dist.ProcessGroup | None:
        return self._round_group if round else self.process_group

    def broadcast(self, obj: Any, *, round: bool = False) -> Any:
        """``obj`` of rank 0 on every rank (pickled)."""
        box = [obj]
        dist.broadcast_object_list(box, src=self._src, group=self._group(round))
        return box[0]

    def all_gather(self, obj: Any, *, round: bool = False) -> list:
        """Every rank's ``obj``, in rank order (pickled)."""
        out: list = [None] * self.num_ranks
        dist.all_gather_object(out, obj, group=self._group(round))
        return out

    def sync_replicas(self, slices: SliceMap) -> None:
        """All-gather the replicated parts of the model inside the site (main group)."""
        slices.sync_replicas(self.process_group)

    def lost_notices(self, on_lost: Callable[[list[str]], frozenset[str]]) -> LostNotices | None:
        """Rank 0 posts the members its heartbeats report dead; the others poll them
        (None without a site store)."""
        store = self._store if self._store is not None else site_store()
        if store is None:
            log.warning("rank %d: no site store (MASTER_ADDR/MASTER_PORT): ranks > 0 wait out dead sites", self.rank)
            return None
        return LostNotices(store, rank=self.rank, on_lost=on_lost)

    def close(self) -> None:
        return None
