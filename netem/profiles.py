"""Link parameters and the named link profiles (the one place presets are defined).

A site's :class:`LinkParams` describe its access link to the emulated WAN:

* ``delay_ms`` / ``jitter_ms`` / ``loss_pct`` apply to packets *arriving at* the site,
  so a packet from site ``a`` to site ``b`` sees ``b``'s delay, jitter and loss, and a
  ping between two sites on the same profile measures ``2 * delay_ms`` and a one-way
  loss of ``loss_pct``. Between sites with different settings the round trip time is
  ``delay_a + delay_b``.
* ``rate_mbit`` caps both directions of the access link (upload and download), so a
  flow from ``a`` to ``b`` gets at most ``min(rate_a, rate_b)``. The cap counts
  Ethernet frames (1514 bytes for a full-size TCP segment), so TCP goodput is at
  most ~95.6 % of it.
* ``flap_period_s`` / ``flap_down_s``: periodic partitions. Every ``flap_period_s``
  the site is cut off from all others for ``flap_down_s``. Sites are staggered
  (site ``i`` starts its outage at ``i * period / num_sites``) so that at most one
  site is down at a time when ``flap_down_s <= period / num_sites``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["LinkParams", "Profile", "PROFILES", "get_profile"]


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}")


@dataclass(frozen=True, kw_only=True)
class LinkParams:
    """Emulated properties of one site's access link.

    Attributes:
        delay_ms: One-way delay added to every packet arriving at the site, in ms
            (0 to 10,000).
        jitter_ms: Uniform jitter: each packet's delay is drawn from
            ``[delay_ms - jitter_ms, delay_ms + jitter_ms]`` (clamped at 0); packets are
            never reordered, so dense traffic sees delays biased towards the upper end.
            0 to ``delay_ms``.
        loss_pct: Independent random loss of packets arriving at the site, percent
            (0 to 100).
        rate_mbit: Cap on each direction of the link in Mbit/s (Ethernet frame bytes),
            or None for no cap. 0.01 to 100,000.
        flap_period_s: Period of the periodic partitions in s; 0 disables them.
        flap_down_s: Length of each periodic partition in s; 0 < flap_down_s <
            flap_period_s when flapping is on.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    rate_mbit: float | None = None
    flap_period_s: float = 0.0
    flap_down_s: float = 0.0

    def __post_init__(self) -> None:
        _check_range("delay_ms", self.delay_ms, 0.0, 10_000.0)
        _check_range("jitter_ms", self.jitter_ms, 0.0, 10_000.0)
        if self.jitter_ms > self.delay_ms:
            raise ValueError(f"jitter_ms must be <= delay_ms ({self.delay_ms}), got {self.jitter_ms!r}")
        _check_range("loss_pct", self.loss_pct, 0.0, 100.0)
        if self.rate_mbit is not None:
            _check_range("rate_mbit", self.rate_mbit, 0.01, 100_000.0)
        _check_range("flap_period_s", self.flap_period_s, 0.0, 86_400.0)
        _check_range("flap_down_s", self.flap_down_s, 0.0, 86_400.0)
        if self.flap_period_s > 0 and not 0 < self.flap_down_s < self.flap_period_s:
            raise ValueError(
                "flap_down_s must be in (0, flap_period_s) when flap_period_s > 0, "
                f"got flap_down_s={self.flap_down_s!r}, flap_period_s={self.flap_period_s!r}"
            )
        if self.flap_period_s == 0 and self.flap_down_s != 0:
            raise ValueError(f"flap_down_s must be 0 when flap_period_s is 0, got {self.flap_down_s!r}")

    @property
    def needs_delay(self) -> bool:
        """True when packets must be held (delay or jitter is set)."""
        return self.delay_ms > 0 or self.jitter_ms > 0

    def replace(self, **changes: object) -> "LinkParams":
        """Return a copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LinkParams":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown LinkParams fields {sorted(unknown)}; allowed: {sorted(fields)}")
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class Profile:
    """A named preset: the link every site gets, plus what it really gives here.

    Attributes:
        name: Preset name (``lan``, ``continental``, ...).
        link: The LinkParams applied to every site.
        description: What the preset models.
        measured_here: What the preset was measured to give on the 2-vCPU dev machine
            with the userspace delayer (see netem/README.md for the commands).
    """

    name: str
    link: LinkParams
    description: str
    measured_here: str = ""


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="lan",
            link=LinkParams(),
            description="no impairment: a datacenter LAN (baseline)",
            measured_here="RTT 0.06 ms, no loss; one TCP flow ~1 Gbit/s (2 shared vCPUs)",
        ),
        Profile(
            name="continental",
            link=LinkParams(delay_ms=15.0, jitter_ms=0.5, rate_mbit=1000.0),
            description="same-continent datacenters: ~15 ms one-way, 1 Gbit/s",
            measured_here="RTT 30.4 ms; the userspace delayer limits one TCP flow to "
            "~200-600 Mbit/s here (load dependent), below the 1 Gbit/s cap",
        ),
        Profile(
            name="transatlantic",
            link=LinkParams(delay_ms=40.0, jitter_ms=1.0, loss_pct=0.1, rate_mbit=200.0),
            description="across an ocean: ~40 ms one-way, 0.1% loss, 200 Mbit/s",
            measured_here="RTT 80.6 ms, loss 0.1%; one TCP flow (bbr) ~140-280 Mbit/s "
            "(delayer and the 4 MiB send window at 80 ms RTT limit it)",
        ),
        Profile(
            name="lossy",
            link=LinkParams(delay_ms=10.0, loss_pct=10.0, rate_mbit=100.0),
            description="a bad path: 10 ms one-way, 10% random loss, 100 Mbit/s",
            measured_here="RTT 20.5 ms, loss 10%; one TCP flow (bbr) 50-85 Mbit/s; "
            "cubic/reno collapse to a few Mbit/s at such loss",
        ),
        Profile(
            name="lossy30",
            link=LinkParams(delay_ms=10.0, loss_pct=30.0, rate_mbit=100.0),
            description="a very bad path: 10 ms one-way, 30% random loss, 100 Mbit/s "
            "(the worst case of issue 32's reliability benchmark)",
            measured_here="RTT 20.5 ms, loss 30%; one TCP flow (bbr) a few Mbit/s: most of a round is retransmission",
        ),
        Profile(
            name="flaky",
            link=LinkParams(
                delay_ms=15.0,
                jitter_ms=0.5,
                loss_pct=0.5,
                rate_mbit=100.0,
                flap_period_s=10.0,
                flap_down_s=2.0,
            ),
            description="continental link that drops out: every 10 s each site is "
            "partitioned for 2 s (staggered across sites), 0.5% loss, 100 Mbit/s",
            measured_here="RTT 30.4 ms between outages, one TCP flow (bbr) ~96 Mbit/s; "
            "probes sent inside outages are all lost, outside none",
        ),
    )
}


def get_profile(name: str) -> Profile:
    """Return the preset called ``name``; ValueError naming the presets otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}") from None
