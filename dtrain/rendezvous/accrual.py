"""Failure detection that adapts to each site's heartbeat arrivals: the phi accrual detector.

A fixed silence ("dead after 5 s without a heartbeat") is either too slow for a healthy
LAN or too quick for a site behind a lossy, high-latency link, whose heartbeats arrive
late and bunched (a TCP retransmission after a lost segment). The phi accrual detector
(Hayashibara, Défago, Yared, Katayama, "The φ Accrual Failure Detector", SRDS 2004; as in
Akka's ``PhiAccrualFailureDetector`` and Cassandra's ``FailureDetector``) instead keeps
the recent inter-arrival times of each site's heartbeats and turns the current silence
into a suspicion level

    φ(t) = -log10(1 - F(t)),  F = the normal CDF with the window's mean μ and std σ,

so φ = 8 means "a silence this long happens once in 10^8 intervals of this site". A site
is *suspected* once φ passes ``suspect_phi`` and *dead* once it passes ``dead_phi``;
both are silences computed in closed form (:func:`silence_for_phi`), so the rendezvous
keeps comparing ``last_heartbeat + silence`` with ``now`` as before. Akka's two guards
are kept: ``min_std_s`` (σ never below it: a perfectly regular sender is not declared
dead a hair after its mean) and ``acceptable_pause_s`` (added to μ: GC or scheduler
pauses that should never count).

Everything here is pure: no clock, no lock; the store calls it under its own lock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import NormalDist

__all__ = ["AccrualConfig", "ArrivalWindow", "phi", "silence_for_phi"]

_NORMAL = NormalDist()


@dataclass(frozen=True, kw_only=True)
class AccrualConfig:
    """Parameters of the phi accrual detector (Hayashibara et al. 2004; the names follow
    Akka's ``akka.remote.watch-failure-detector``).

    Attributes:
        dead_phi: φ at which a silent site is declared dead (Akka's ``threshold``, 8-12 in
            practice; 8: a false declaration once per 10^8 heartbeat intervals if arrivals
            were normal).
        suspect_phi: φ at which a site is shown as suspected on the status page (< dead_phi).
        window: how many recent inter-arrival times are kept (Akka: 1,000; here 100 ≈ 100 s).
        min_std_s: the smallest σ used, seconds (Akka ``min-std-deviation``, 100 ms).
        acceptable_pause_s: a pause added to μ, seconds (Akka ``acceptable-heartbeat-pause``):
            a stall this long (a GC, a loaded host, one lost TCP segment's retransmission)
            never counts towards φ.
        first_interval_s: the interval assumed before any was measured (the store passes
            the configured heartbeat interval), with σ = ``first_interval_s / 4``, as in Akka.
        max_silence_s: a site silent this long is dead whatever its φ (a bound for a site
            whose window learnt very irregular arrivals), seconds.
        warmup_gaps: until this many inter-arrival times were measured, a site is given at
            least ``warmup_silence_s``: a new site's window has not yet seen its link's stalls
            (measured: through the ``flaky`` profile's 2 s partitions, the first one silenced
            a site's heartbeats for 4.9-5.8 s, 20-30 s into the run, past a bound learnt from
            regular 1 s arrivals; once a few partitions are in the window, σ covers them).
        warmup_silence_s: the least silence allowed during the warm-up, seconds.
    """

    dead_phi: float = 8.0
    suspect_phi: float = 3.0
    window: int = 100
    min_std_s: float = 0.1
    acceptable_pause_s: float = 3.0
    first_interval_s: float = 1.0
    max_silence_s: float = 30.0
    warmup_gaps: int = 30
    warmup_silence_s: float = 10.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.dead_phi) and self.dead_phi > 0):
            raise ValueError(f"dead_phi must be a finite number > 0, got {self.dead_phi!r}")
        if not (0 < self.suspect_phi < self.dead_phi):
            raise ValueError(f"suspect_phi must be in (0, dead_phi={self.dead_phi}), got {self.suspect_phi!r}")
        if not (isinstance(self.window, int) and self.window >= 2):
            raise ValueError(f"window must be an int >= 2, got {self.window!r}")
        if not (isinstance(self.warmup_gaps, int) and self.warmup_gaps >= 0):
            raise ValueError(f"warmup_gaps must be an int >= 0, got {self.warmup_gaps!r}")
        if not (isinstance(self.warmup_silence_s, (int, float)) and 0 <= self.warmup_silence_s <= self.max_silence_s):
            raise ValueError(
                f"warmup_silence_s must be in [0, max_silence_s={self.max_silence_s}] seconds, "
                f"got {self.warmup_silence_s!r}"
            )
        for name in ("min_std_s", "first_interval_s", "max_silence_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
        if not (isinstance(self.acceptable_pause_s, (int, float)) and self.acceptable_pause_s >= 0):
            raise ValueError(f"acceptable_pause_s must be a number of seconds >= 0, got {self.acceptable_pause_s!r}")


def phi(silence_s: float, *, mean_s: float, std_s: float) -> float:
    """φ of a silence of ``silence_s`` seconds for arrivals with mean ``mean_s`` and std
    ``std_s`` (normal model): ``-log10(1 - F(silence_s))``; ``inf`` where 1 - F underflows."""
    tail = 1.0 - _NORMAL.cdf((silence_s - mean_s) / std_s)
    return math.inf if tail <= 0.0 else -math.log10(tail)


def silence_for_phi(level: float, *, mean_s: float, std_s: float) -> float:
    """The silence, seconds, at which :func:`phi` reaches ``level`` (its inverse):
    ``mean_s + std_s · Φ⁻¹(1 - 10^-level)``."""
    return mean_s + std_s * _NORMAL.inv_cdf(1.0 - 10.0 ** (-level))


class ArrivalWindow:
    """The recent heartbeat inter-arrival times of one site, and the silences its φ
    thresholds stand for (mutable; the owner's lock guards it). The owner keeps the time
    of the last arrival (the store's ``last_heartbeat``) and passes the silence."""

    __slots__ = ("config", "_gaps", "_sum", "_sumsq")

    def __init__(self, config: AccrualConfig) -> None:
        self.config = config
        self._gaps: deque[float] = deque()
        self._sum = 0.0
        self._sumsq = 0.0

    def __len__(self) -> int:
        return len(self._gaps)

    def add(self, gap_s: float) -> None:
        """A heartbeat arrived ``gap_s`` seconds after the previous one (<= 0: ignored)."""
        if not gap_s > 0:
            return
        self._gaps.append(gap_s)
        self._sum += gap_s
        self._sumsq += gap_s * gap_s
        if len(self._gaps) > self.config.window:
            old = self._gaps.popleft()
            self._sum -= old
            self._sumsq -= old * old

    def stats(self) -> tuple[float, float]:
        """``(μ, σ)`` of the window, seconds, before the guards; while fewer than two
        gaps were measured, ``first_interval_s`` and a quarter of it."""
        n = len(self._gaps)
        if n < 2:
            first = self.config.first_interval_s
            return first, first / 4.0
        mean = self._sum / n
        var = max(0.0, self._sumsq / n - mean * mean)
        return mean, math.sqrt(var)

    def _guarded(self) -> tuple[float, float]:
        mean, std = self.stats()
        c = self.config
        return mean + c.acceptable_pause_s, max(std, c.min_std_s)

    def silence_s(self, level: float) -> float:
        """How long this site may be silent before φ reaches ``level``, seconds (Akka's
        guards: σ >= ``min_std_s``, μ + ``acceptable_pause_s``; at least ``warmup_silence_s``
        before ``warmup_gaps`` gaps; at most ``max_silence_s``)."""
        mean, std = self._guarded()
        c = self.config
        bound = silence_for_phi(level, mean_s=mean, std_s=std)
        if len(self._gaps) < c.warmup_gaps:
            bound = max(bound, c.warmup_silence_s)
        return min(c.max_silence_s, bound)

    def suspected_silence_s(self, level: float, *, floor_s: float) -> float:
        """How long a site a member found unreachable may be silent: the silence at which φ
        over its own arrivals reaches ``level`` (the suspect level) without the pause guard, at
        least ``floor_s``; ``floor_s`` while the window is warming up. A site whose heartbeats
        arrive regularly (a LAN: σ at its floor) gets ``floor_s``, and a killed one is dead
        that soon; one behind a lossy link, whose gaps spread (TCP retransmits), gets the tail
        its own arrivals show (a 30%-loss launch declared a live site dead 2 s after a
        member's push stream from it broke)."""
        if len(self._gaps) < self.config.warmup_gaps:
            return floor_s
        mean, std = self.stats()
        bound = silence_for_phi(level, mean_s=mean, std_s=max(std, self.config.min_std_s))
        return min(self.config.max_silence_s, max(floor_s, bound))

    def phi(self, silence_s: float) -> float:
        """φ of a silence of ``silence_s`` seconds."""
        mean, std = self._guarded()
        return phi(silence_s, mean_s=mean, std_s=std)
