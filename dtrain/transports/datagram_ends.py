"""The datagram path's sender ends at an owner: when a sender's part of a bucket (BUCKET_END)
or of its whole push (SEND_END) ends here, given reordering (:mod:`.datagram_reorder` holds
the pure rules: the grace and :func:`~.datagram_reorder.end_wait_decision`).

A mixin of :class:`~dtrain.transports.datagram.DatagramTransport`, run on its dispatch
thread: it counts what was handed to the handler per sender and bucket, keeps each end
waiting until that many were handled or the grace passed, feeds the reordering each
overtaken contribution shows into the path's :class:`~.datagram_reorder.ReorderWindow`, and
ends the sender's part with the handler's ``handle_sender_done``. Every end that ends short
is counted (``ends_short``, ``end_missing``), and every contribution handled after its end
ended (``late_after_end``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from dtrain.transports.datagram_reorder import WAIT, end_wait_decision, reorder_grace_s
from dtrain.transports.datagram_round import RoundState

__all__ = ["DatagramEnds"]

log = logging.getLogger("dtrain.transports.datagram")


class DatagramEnds:
    """Sender ends at an owner (see the module docstring).

    The transport provides what these methods use: ``config``, ``_handler``, ``_reorder``,
    ``_lock``, ``_rounds``, ``_dispatch``, ``_drained_at``, ``_ends_due``, ``_ends_waiting``
    and ``_count``.
    """

    config: Any
    _handler: Any
    _reorder: Any
    _lock: Any
    _rounds: dict
    _dispatch: Any
    _drained_at: float
    _ends_due: float
    _ends_waiting: bool
    _count: Any  # the transport's counter method

    def _note_handled(self, rs: RoundState, sender: int, buckets: Sequence[int]) -> None:
        """Dispatch thread: contributions of ``sender`` to ``buckets`` (one entry each) were handed
        to the handler. One that comes after its own end (it was among those the end announced)
        measures the path's reordering; after the end already ended, it also counts
        ``late_after_end``. An end waiting for it may end now."""
        now = time.monotonic()
        handled = rs.handled
        for b in buckets:
            handled[(sender, b)] = handled.get((sender, b), 0) + 1
        handled[(sender, -1)] = handled.get((sender, -1), 0) + len(buckets)
        if not (rs.ends or rs.ended):
            return
        late_s, num_late, waiting = 0.0, 0, False
        for b in set(buckets):
            n_b = buckets.count(b)
            for key, n in (((sender, b), n_b), ((sender, -1), len(buckets))):
                end = rs.ends.get(key)
                waiting |= end is not None
                end = end or rs.ended.get(key)
                if end is None or end[0] is None:
                    continue
                # of these contributions, the ones among those the end announced came after it
                after = min(n_b, end[0] - (handled[key] - n))
                if after > 0:
                    late_s = max(late_s, now - end[1])
                    num_late += after if key not in rs.ends else 0
                    break  # its bucket's end, else its push's
        if late_s:
            self._reorder.observe(rs.site_ids[sender], late_s)
        if num_late:
            self._count(late_after_end=num_late)
        if waiting:
            self._check_ends(rs, 0.0, sender)

    def _end_sender(self, rs: RoundState, sender: int, bucket: int, announced: int | None) -> None:
        """Dispatch thread: ``sender`` ended ``bucket`` (-1: its push) after ``announced``
        contributions; it ends here once they were handled or the grace passed (:meth:`_check_ends`)."""
        key = (sender, bucket)
        if key in rs.ends:  # another copy while it waits (a later push's end: the larger count)
            old, at = rs.ends[key]
            rs.ends[key] = (max(old or 0, announced or 0) if announced is not None else old, at)
            return
        ended = rs.ended.get(key)
        if ended is not None and ended[0] == announced:
            return  # a copy of an end that ended
        now = time.monotonic()
        if announced is not None and rs.handled.get(key, 0) < announced:
            self._count(ends_waited=1)
            self._ends_waiting = True
        rs.ends[key] = (announced, now)
        self._check_ends(rs, 0.0, sender)

    def _check_ends(self, rs: RoundState, horizon: float, sender: int | None = None) -> None:
        """End (``handle_sender_done``) the waiting ends of ``sender`` (None: every sender) that
        :func:`~.datagram_reorder.end_wait_decision` says end by ``horizon``: a time up to which every
        datagram that reached the socket was read and handled (0.0: unknown, as in the middle of a
        dispatch batch: then only ends whose contributions were all handled end). So a receiver
        kept off the CPU does not take what waits unread in its socket for lost. Notes when the
        next end is due."""
        done = getattr(self._handler, "handle_sender_done", None)
        cfg = self.config
        for key, (announced, at) in list(rs.ends.items()):
            if sender is not None and key[0] != sender:
                continue
            site = rs.site_ids[key[0]]
            grace = reorder_grace_s(self._reorder.get(site), cfg.reorder_grace_s, cfg.max_reorder_grace_s)
            handled = rs.handled.get(key, 0)
            decision, why = end_wait_decision(handled, announced, at, grace, horizon)
            if decision == WAIT:
                self._ends_due = min(self._ends_due, at + grace)
                continue
            del rs.ends[key]
            rs.ended[key] = (announced, at)
            if announced is not None and handled < announced:
                self._count(ends_short=1, end_missing=announced - handled)
            log.debug("round %d: %s's end of %s: %s", rs.round, site, "its push" if key[1] < 0 else key[1], why)
            if done is not None:
                done(rs.round, site, None if key[1] < 0 else (key[1],))

    def _check_all_ends(self) -> None:
        """Dispatch thread, between batches, when an end's grace may have passed: every round's
        waiting ends, judged up to the receive thread's last empty read (when nothing it queued
        waits; that time is read first: it is set after what it read was queued)."""
        drained = self._drained_at
        horizon = drained if self._dispatch.empty() else 0.0
        self._ends_due = float("inf")
        with self._lock:
            rounds = [rs for rs in self._rounds.values() if rs.ends]
        for rs in rounds:
            try:
                self._check_ends(rs, horizon)
            except Exception:
                log.exception("datagram dispatch failed")
        with self._lock:
            self._ends_waiting = any(rs.ends for rs in self._rounds.values())
        now = time.monotonic()
        if self._ends_due <= now:  # due, but what arrived by then is not all read: look again soon
            self._ends_due = now + 0.002
