"""The datagram path's round-trip time to each peer, measured, for its timers.

The data path's timers that wait for a peer's answer (a NACK's answer, the REPORT a SEND_END
asks for, the first datagram of an owner's mean after its reduce deadline) must cover the
path's round trip. A fixed figure is wrong on one side or the other: 0.1 s is 100x a LAN's
round trip and less than a transoceanic one's (150-300 ms), where a NACK whose answer
cannot come within it was taken for an owner gone silent and its mean pulled over gRPC.

:class:`RttEstimator` keeps, per peer, the smoothed round trip and its variation of RFC 6298
(section 2: ``SRTT``, ``RTTVAR``, ``alpha = 1/8``, ``beta = 1/4``, ``RTO = SRTT + max(G,
4 RTTVAR)``), from samples the transport takes where an answer follows a request at once:
a SEND_END and the owner's REPORT. A SEND_END leaves in several copies, and the REPORT names
the copy it answers (its chunk field), so a sample is never matched to the wrong copy: the
ambiguity Karn's rule avoids by not sampling retransmissions (RFC 6298 section 3) does not
arise, and a path longer than the estimate is measured from its first round on. A sample measures the peer's response, its dispatch queue included, which is
what a NACK's answer waits behind too; not a SEND_END that waited at the peer for the round's
key (its plan came later): that REPORT names no copy and gives no sample (``HELD_COPY``). Before a peer's first sample its figures are the
transport's configured ``rtt_s`` (``SRTT = rtt_s``, ``RTTVAR = rtt_s / 2``, RFC 6298 2.1's
start). Pure and torch-free; thread-safe.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

__all__ = ["RttEstimate", "RttEstimator"]

ALPHA, BETA, K = 1.0 / 8.0, 1.0 / 4.0, 4.0  # RFC 6298 section 2
CLOCK_GRANULARITY_S = 0.001  # G: the clock the samples are read from (time.monotonic) is finer


@dataclass(frozen=True)
class RttEstimate:
    """One peer's round trip, seconds.

    Attributes:
        srtt_s: smoothed round trip (RFC 6298 ``SRTT``).
        rttvar_s: its variation (``RTTVAR``).
        rto_s: how long an answer may take before it is overdue (``SRTT + max(G, 4 RTTVAR)``),
            clamped to the estimator's ``[min_rto_s, max_rto_s]``.
        samples: samples taken so far (0: the configured start figures).
    """

    srtt_s: float
    rttvar_s: float
    rto_s: float
    samples: int


class RttEstimator:
    """Per peer (a site id): :class:`RttEstimate` from the samples :meth:`observe` gets.

    Args:
        initial_s: the round trip assumed before a peer's first sample, seconds > 0 (the
            transport's ``rtt_s``).
        min_rto_s: least ``rto_s``, seconds >= 0: an answer is not overdue sooner (a LAN's
            round trip is microseconds; the peer's scheduler is not).
        max_rto_s: most ``rto_s``, seconds >= ``min_rto_s``: a burst of slow answers does not
            push the timers past what the round's deadlines leave.

    Raises:
        ValueError: a bound out of range (named).
    """

    def __init__(self, initial_s: float, *, min_rto_s: float = 0.01, max_rto_s: float = 3.0) -> None:
        if not (math.isfinite(initial_s) and initial_s > 0):
            raise ValueError(f"initial_s must be seconds > 0, got {initial_s!r}")
        if not (0 <= min_rto_s <= max_rto_s and math.isfinite(max_rto_s)):
            raise ValueError(f"need 0 <= min_rto_s <= max_rto_s, got {min_rto_s!r}, {max_rto_s!r}")
        self.initial_s, self.min_rto_s, self.max_rto_s = initial_s, min_rto_s, max_rto_s
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[float, float, int]] = {}  # peer -> (srtt, rttvar, samples)

    def observe(self, peer: str, sample_s: float) -> None:
        """One round-trip sample to ``peer``, seconds; a negative or non-finite one is ignored."""
        if not (math.isfinite(sample_s) and sample_s >= 0):
            return
        with self._lock:
            got = self._peers.get(peer)
            if got is None:  # RFC 6298 2.2: the first measurement
                self._peers[peer] = (sample_s, sample_s / 2.0, 1)
                return
            srtt, var, n = got
            var = (1.0 - BETA) * var + BETA * abs(srtt - sample_s)  # 2.3: RTTVAR before SRTT
            srtt = (1.0 - ALPHA) * srtt + ALPHA * sample_s
            self._peers[peer] = (srtt, var, n + 1)

    def get(self, peer: str) -> RttEstimate:
        """``peer``'s estimate (the start figures before its first sample)."""
        with self._lock:
            srtt, var, n = self._peers.get(peer, (self.initial_s, self.initial_s / 2.0, 0))
        rto = min(self.max_rto_s, max(self.min_rto_s, srtt + max(CLOCK_GRANULARITY_S, K * var)))
        return RttEstimate(srtt_s=srtt, rttvar_s=var, rto_s=rto, samples=n)

    def rto_s(self, peer: str) -> float:
        """``peer``'s ``rto_s``: how long its answer may take before it is overdue."""
        return self.get(peer).rto_s

    def summary_ms(self) -> dict[str, dict[str, float]]:
        """Per peer with a sample: ``{"srtt": ms, "rto": ms, "samples": n}`` (metrics lines)."""
        with self._lock:
            peers = [p for p, (_, _, n) in self._peers.items() if n]
        out = {}
        for p in sorted(peers):
            e = self.get(p)
            out[p] = {"srtt": round(e.srtt_s * 1e3, 3), "rto": round(e.rto_s * 1e3, 3), "samples": e.samples}
        return out

    def worst_srtt_s(self) -> float | None:
        """The largest measured ``srtt_s`` over the peers with a sample, or None."""
        with self._lock:
            got = [srtt for srtt, _, n in self._peers.values() if n]
        return max(got) if got else None
