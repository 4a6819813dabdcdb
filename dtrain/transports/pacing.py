"""Send pacing shared by the data paths: a virtual-clock token bucket and its pure decision.

* :func:`pace_decision`: given the bytes about to leave, the rate, the pacer's virtual
  clock and ``now``, when they may leave (how long to wait) and why: the pure rule.
* :func:`yield_decision`: how long a second-class send (a mean) waits for the first
  class (contributions) to leave a gap: the pure rule of the two classes.
* :class:`Pacer`: those rules behind a lock, shared by every sending thread of a site.
  The datagram path paces each datagram with it (:mod:`.datagram_pacing`); the round
  engine paces a fragment round's chunk pushes and mean replies with it so that a
  Streaming DiLoCo round spreads over its overlap window instead of bursting at the
  link's rate (:func:`pace_rate_Bps`, ``RoundEngine.run_round(pace_window_s=...)``).

Torch-free, no I/O: the round engine may import it (tests/unit/test_imports.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

__all__ = ["PaceDecision", "Pacer", "pace_decision", "pace_rate_Bps", "yield_decision"]


@dataclass(frozen=True, kw_only=True)
class PaceDecision:
    """What :func:`pace_decision` decided for one send.

    Attributes:
        send: False when the bytes could not leave by the deadline (nothing reserved).
        wait_s: seconds to sleep before sending (0: at once).
        clock_s: the virtual clock after reserving the bytes (unchanged when not sent).
        reason: why, in words.
    """

    send: bool
    wait_s: float
    clock_s: float
    reason: str


def pace_decision(
    nbytes: int, *, rate_Bps: float, clock_s: float, now: float, burst_bytes: int, deadline: float
) -> PaceDecision:
    """When ``nbytes`` may leave at ``rate_Bps`` (bytes/s) with micro-bursts of ``burst_bytes``.

    The virtual clock ``clock_s`` is when the bytes reserved so far have left at the
    rate; after an idle period it is brought up to ``now − burst/rate`` (an idle pacer
    lends at most one burst). The bytes are due at ``clock + nbytes/rate``; they leave
    one burst before that (``wait_s``, 0 if already past). Due after ``deadline``:
    not sent (``send`` False; the caller decides, e.g. sends unpaced or drops).
    """
    lend = burst_bytes / rate_Bps
    t = max(clock_s, now - lend)
    due = t + nbytes / rate_Bps
    if due > deadline:
        return PaceDecision(send=False, wait_s=0.0, clock_s=clock_s, reason="due after the deadline")
    wait = due - now - lend
    if wait > 0:
        return PaceDecision(send=True, wait_s=wait, clock_s=due, reason=f"over budget: wait {wait:.4f} s")
    return PaceDecision(send=True, wait_s=0.0, clock_s=due, reason="within the burst")


def yield_decision(*, now: float, first_due: float, gap_s: float, deadline: float) -> tuple[float, str]:
    """How long a second-class send waits before it may reserve: ``(wait_s, reason)``, 0 = now.

    First-class senders (contributions) reserve their next batch as soon as the previous
    one left, so while one is active a reservation of theirs is due at ``first_due`` or
    later. A second-class send (a mean chunk) goes only once ``gap_s`` passed after the
    last first-class reservation was due with no new one: the first class left a gap (it
    finished, or is encoding or waiting). At ``deadline`` it goes regardless.
    """
    if now >= deadline:
        return 0.0, "deadline reached"
    free_at = first_due + gap_s
    if free_at <= now:
        return 0.0, "no first-class send pending"
    return min(free_at, deadline) - now, "first-class sends pending"


def pace_rate_Bps(send_bytes: float, window_s: float, *, min_rate_Bps: float = 1e5) -> float:
    """The send-rate budget that spreads ``send_bytes`` over ``window_s`` seconds
    (at least ``min_rate_Bps``, so a tiny window or estimate never stalls a round)."""
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0 seconds, got {window_s!r}")
    return max(min_rate_Bps, float(send_bytes) / window_s)


class Pacer:
    """Releases bytes at ``rate_mbit`` (thread-safe; callers sleep outside the lock).

    Two classes share the rate: first-class sends (the default) reserve in the order they
    come; a ``second`` send waits until the first class leaves a gap of ``yield_gap_s``
    (:func:`yield_decision`). The datagram path sends contributions first and means
    second: a contribution delayed holds back another owner's finalize and so every
    member, while a mean queued behind contributions costs nothing until they are out.

    Args:
        rate_mbit: initial rate, Mbit/s (> 0).
        burst_bytes: largest back-to-back burst (bytes) the virtual clock allows
            after an idle period or a late wake-up.
        yield_gap_s: seconds without a first-class reservation due after which a
            second-class send may go (>= 0).

    Attributes:
        num_waits: sends that had to wait (over the budget); a count, for tests.
        num_sends: sends reserved.
        num_yields: times a second-class send waited for the first class.
    """

    def __init__(self, rate_mbit: float, *, burst_bytes: int = 64 << 10, yield_gap_s: float = 0.005) -> None:
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit!r}")
        if not yield_gap_s >= 0:
            raise ValueError(f"yield_gap_s must be >= 0 seconds, got {yield_gap_s!r}")
        self._rate_bps = rate_mbit * 1e6 / 8.0
        self._burst = burst_bytes
        self._gap_s = yield_gap_s
        self._t = time.monotonic()
        self._first_due = float("-inf")  # when the latest first-class reservation is due
        self._lock = threading.Lock()
        self.num_waits = 0
        self.num_sends = 0
        self.num_yields = 0

    @classmethod
    def of_Bps(cls, rate_Bps: float, *, burst_bytes: int = 64 << 10) -> "Pacer":
        """A pacer of ``rate_Bps`` bytes per second."""
        return cls(rate_Bps * 8.0 / 1e6, burst_bytes=burst_bytes)

    @property
    def rate_mbit(self) -> float:
        return self._rate_bps * 8.0 / 1e6

    def set_rate(self, rate_mbit: float) -> None:
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit!r}")
        with self._lock:
            self._rate_bps = rate_mbit * 1e6 / 8.0

    def wait(self, nbytes: int, deadline: float, *, second: bool = False) -> bool:
        """Block until ``nbytes`` may leave; False (nothing reserved) if that is after ``deadline``.
        ``second``: a second-class send, which first waits for a gap in the first class's."""
        while second:
            with self._lock:
                wait_s, _ = yield_decision(
                    now=time.monotonic(), first_due=self._first_due, gap_s=self._gap_s, deadline=deadline
                )
            if wait_s <= 0:
                break
            self.num_yields += 1
            time.sleep(wait_s)
        with self._lock:
            d = pace_decision(
                nbytes,
                rate_Bps=self._rate_bps,
                clock_s=self._t,
                now=time.monotonic(),
                burst_bytes=self._burst,
                deadline=deadline,
            )
            if not d.send:
                return False
            self._t = d.clock_s
            if not second:
                self._first_due = d.clock_s
            self.num_sends += 1
            self.num_waits += d.wait_s > 0
        if d.wait_s > 0:
            time.sleep(d.wait_s)
        return True
