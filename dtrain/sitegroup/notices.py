"""Dead-site notices inside a site group, through the site's torch.distributed store.

Only local rank 0 heartbeats, so only it learns from the rendezvous that a member
site died (``HeartbeatInfo.dead``). Without a notice the other ranks would wait
for the dead site's contributions to their slice until the reduce deadline.
Rank 0 :meth:`LostNotices.post`s each new dead set under numbered keys of a
``torch.distributed.Store`` (the TCPStore torchrun or ``init_process_group``
already runs for the site, under a prefix of its own); ranks j > 0 poll the
counter (``Store.add(key, 0)`` reads without blocking) from a daemon thread and
hand every notice to their engine's ``members_lost``. No collective is involved,
so a notice reaches a rank that is inside its round's reduce.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import timedelta
from typing import Callable, Sequence

import torch.distributed as dist

__all__ = ["LostNotices", "site_store"]

log = logging.getLogger(__name__)

_COUNT = "count"


class LostNotices:
    """Rank 0 posts dead sites; the other ranks poll and apply them.

    Args:
        store: a store every rank of the site reaches (e.g. a
            ``dist.PrefixStore`` over torchrun's TCPStore); the keys are
            ``count`` and ``notice_<n>``.
        rank: this rank in the site group; rank 0 posts, the others poll.
        on_lost: called (poll thread) with a notice's site_ids; returns the
            members it newly stopped waiting for (``RoundEngine.members_lost``).
        poll_s: seconds between two reads of the counter, > 0.

    Attributes:
        num_received: notices this rank read (ranks j > 0).
        num_used: those that made this rank's engine stop waiting for a member
            in an open round (the notice ended a wait that would have run to the
            reduce deadline).
        lost: every site a notice named here.

    A store error (the store's host gone) stops the poll thread with a warning:
    the rank then waits for dead sites until the reduce deadline, as before.
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        on_lost: Callable[[list[str]], frozenset[str]],
        poll_s: float = 0.1,
    ) -> None:
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0 seconds, got {poll_s!r}")
        self.store = store
        self.rank = rank
        self.on_lost = on_lost
        self.poll_s = poll_s
        self.num_posted = 0
        self.num_received = 0
        self.num_used = 0
        self.lost: set[str] = set()
        self._last_posted: tuple[str, ...] = ()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if rank != 0:
            self._thread = threading.Thread(target=self._poll, name=f"lost-notices-{rank}", daemon=True)
            self._thread.start()

    def post(self, site_ids: Sequence[str]) -> None:
        """(Rank 0) publish ``site_ids`` as dead unless it repeats the last notice."""
        ids = tuple(sorted(set(site_ids)))
        if not ids or ids == self._last_posted:
            return
        try:
            self.store.set(f"notice_{self.num_posted + 1}", json.dumps(ids))
            self.store.add(_COUNT, 1)  # only after the notice is there: a reader never waits on it
        except (RuntimeError, dist.DistStoreError) as e:  # the store's host is gone
            log.warning("rank 0: could not post the lost notice %s: %s", ids, e)
            return
        self.num_posted += 1
        self._last_posted = ids
        self.lost.update(ids)

    def _poll(self) -> None:
        seen = 0
        while not self._stop.wait(self.poll_s):
            try:
                count = self.store.add(_COUNT, 0)
                for n in range(seen + 1, count + 1):
                    ids = json.loads(self.store.get(f"notice_{n}"))
                    self._apply(ids)
                    seen = n
            except (RuntimeError, dist.DistStoreError) as e:
                if not self._stop.is_set():
                    log.warning("rank %d: lost notices stopped (store unreachable): %s", self.rank, e)
                return

    def _apply(self, ids: list[str]) -> None:
        self.num_received += 1
        self.lost.update(ids)
        new = self.on_lost(ids)
        if new:
            self.num_used += 1
            log.info("rank %d: lost notice %s: not waiting for their contributions", self.rank, sorted(new))

    def close(self) -> None:
        """Stop polling (bounded: one poll interval plus a store call)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 5.0)


def site_store(*, timeout_s: float = 30.0) -> dist.Store | None:
    """A client of the site's own TCPStore (torchrun's, or the one ``init_process_group``
    started on rank 0 for ``env://``) from ``MASTER_ADDR``/``MASTER_PORT``, under a
    prefix per torchrun attempt (a restarted group does not replay the dead attempt's
    notices); None without that environment."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"dtrain/lost/attempt_{attempt}", base)
