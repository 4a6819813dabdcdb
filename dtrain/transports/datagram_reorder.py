"""Reordering on the datagram data path: how long a sender's end waits for what it overtook.

A sender ends a bucket (BUCKET_END) or its whole push (SEND_END) right after the last
datagram, unpaced. On one FIFO every contribution before the end was handled when the end
is; on a WAN a reordered contribution can arrive after its own end (netem ``reorder``,
ECMP, link bonding). The end therefore says how many contributions it ends (``announced``:
the sender's running count for that owner and bucket, or for the whole round), and the owner
ends the sender's part only once it handled that many, or once a grace passed since the
end arrived (the rest were lost), never the end alone.

The grace follows the path's observed reordering (:class:`ReorderWindow`): how late a
contribution came after the first datagram of a higher sequence number from the same
sender (:class:`SeqArrivals`, measured as they arrive), and after its own end. It is
``2x`` that, at least ``floor_s`` and at most ``cap_s`` (:func:`reorder_grace_s`), so an
in-order path pays ``floor_s`` only when a datagram was really lost, once per bucket end.

Pure and torch-free: the transport's dispatch thread calls :func:`end_wait_decision`.
"""

from __future__ import annotations

import bisect
import threading

__all__ = [
    "END",
    "WAIT",
    "ReorderWindow",
    "SeqArrivals",
    "end_wait_decision",
    "reorder_grace_s",
]

END = "end"
WAIT = "wait"

_MAX_ADVANCES = 8192  # arrivals of new highest sequence numbers kept per sender and round (oldest half dropped)


class SeqArrivals:
    """Arrival times of one sender's datagrams at this receiver in one round, by sequence
    number: how late each overtaken one came. Not thread-safe (the receive thread's).

    The sender numbers its datagrams once per round; a datagram whose number is below the
    highest seen so far was overtaken, and its lateness is its arrival time less the arrival
    of the first datagram with a higher number (kept as the increasing run of new highs).
    """

    __slots__ = ("hi", "seqs", "times")

    def __init__(self) -> None:
        self.hi = -1
        self.seqs: list[int] = []
        self.times: list[float] = []

    def note(self, seq: int, t: float) -> float:
        """A datagram numbered ``seq`` arrived at ``t`` (seconds); its lateness in seconds
        (0.0 in order or a duplicate of the highest; one older than the kept history
        is measured against the oldest kept high: less than it was)."""
        if seq > self.hi:
            self.hi = seq
            self.seqs.append(seq)
            self.times.append(t)
            self.trim()
            return 0.0
        i = bisect.bisect_right(self.seqs, seq)  # the first kept high above seq (it exists: seq < hi)
        return max(0.0, t - self.times[i]) if i < len(self.seqs) else 0.0

    def trim(self) -> None:
        """Keep at most the newest ``_MAX_ADVANCES`` highs (a caller that appends in order itself,
        as the receive thread does per datagram, calls this once per batch)."""
        if len(self.seqs) > _MAX_ADVANCES:
            del self.seqs[: -_MAX_ADVANCES // 2], self.times[: -_MAX_ADVANCES // 2]


class ReorderWindow:
    """The largest reordering lateness seen per sending site, across rounds (thread-safe).

    :meth:`observe` keeps the maximum; :meth:`new_round` halves every estimate, so a path
    that stopped reordering returns to the floor within a few rounds while one that keeps
    reordering is measured again each round."""

    def __init__(self) -> None:
        self._s: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, site: str, late_s: float) -> None:
        if late_s > 0.0:
            with self._lock:
                if late_s > self._s.get(site, 0.0):
                    self._s[site] = late_s

    def get(self, site: str) -> float:
        """Seconds (0.0: no reordering seen from ``site``)."""
        with self._lock:
            return self._s.get(site, 0.0)

    def new_round(self) -> None:
        with self._lock:
            self._s = {k: v / 2 for k, v in self._s.items() if v > 1e-4}


def reorder_grace_s(observed_s: float, floor_s: float, cap_s: float) -> float:
    """How long a sender's end waits for contributions still missing: twice the path's observed
    reordering lateness, within ``[floor_s, cap_s]`` (seconds)."""
    return min(cap_s, max(floor_s, 2.0 * observed_s))


def end_wait_decision(
    handled: int, announced: int | None, arrived_at: float, grace_s: float, now: float
) -> tuple[str, str]:
    """Whether a sender's end (of one bucket, or of its push) ends its part now.

    Args:
        handled: contributions of that sender (to that bucket, or in the round) handled here.
        announced: how many the end says were sent (None: it did not say; it ends at once).
        arrived_at: when the end was handled (``time.monotonic()`` seconds).
        grace_s: :func:`reorder_grace_s` for that sender.
        now: ``time.monotonic()``.
    Returns:
        ``(END, reason)`` or ``(WAIT, reason)``: all announced contributions were handled,
        or the grace passed (the rest were lost), or some may still be in flight.
    """
    if announced is None:
        return END, "end without a count"
    if handled >= announced:
        return END, "all handled"
    missing = announced - handled
    left = arrived_at + grace_s - now
    if left <= 0:
        return END, f"{missing} lost: the {grace_s * 1e3:.1f} ms reordering grace passed"
    return WAIT, f"{missing} missing, maybe reordered: {left * 1e3:.1f} ms of grace left"
