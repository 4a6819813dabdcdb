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
* ``reorder_pct`` / ``reorder_gap_ms``: reordering. That share of the packets arriving at
  the site is held ``reorder_gap_ms`` longer than its delay, so the packets that arrive
  within the gap after it overtake it (netem's ``reorder`` turned around: there the
  reordered packets skip the delay). A property of the userspace delayers (NFQUEUE); a
  topology on kernel netem refuses it (``Topology(kernel_netem=False)`` uses them).
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
        reorder_pct: Share of the packets arriving at the site that are held
            ``reorder_gap_ms`` longer, percent (0 to 100): the packets arriving within the
            gap after one overtake it. Needs ``reorder_gap_ms`` > 0.
        reorder_gap_ms: How much longer a reordered packet is held, ms (0 to 10,000;
            > 0 exactly when ``reorder_pct`` > 0).
        flap_period_s: Period of the periodic partitions in s; 0 disables them.
        flap_down_s: Length of each periodic partition in s; 0 < flap_down_s <
            flap_period_s when flapping is on.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    rate_mbit: float | None = None
    reorder_pct: float = 0.0
    reorder_gap_ms: float = 0.0
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
        _check_range("reorder_pct", self.reorder_pct, 0.0, 100.0)
        _check_range("reorder_gap_ms", self.reorder_gap_ms, 0.0, 10_000.0)
        if (self.reorder_pct > 0) != (self.reorder_gap_ms > 0):
            raise ValueError(
                "reorder_pct and reorder_gap_ms must both be > 0 (reordering) or both 0, "
                f"got reorder_pct={self.reorder_pct!r}, reorder_gap_ms={self.reorder_gap_ms!r}"
            )
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
        """True when packets must be held (delay, jitter or reordering is set)."""
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.reorder_pct > 0

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
            with the userspace delayer (see netem/README.md for the commands), or, for a
            preset not measured, what this machine's emulator can reach of it.
        mtu_bytes: The links' MTU, bytes, in [1280, 9000]; a topology built from the preset
            uses it unless told another (``Topology(mtu_bytes=...)``).
        per_flow_mbit: A cap the modelled network puts on each flow (one 5-tuple), Mbit/s, or
            None. The emulator caps a site's whole link (``link.rate_mbit``), not a flow: a preset
            with a per-flow cap sets the link's rate to it, which is the same for one flow.
        source: Where the figures come from (documentation, or how a class value was chosen).
    """

    name: str
    link: LinkParams
    description: str
    measured_here: str = ""
    mtu_bytes: int = 1500
    per_flow_mbit: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.mtu_bytes, int) or not 1280 <= self.mtu_bytes <= 9000:
            raise ValueError(f"mtu_bytes must be an int in [1280, 9000], got {self.mtu_bytes!r}")
        if self.per_flow_mbit is not None and self.link.rate_mbit != self.per_flow_mbit:
            raise ValueError(
                f"link.rate_mbit must equal per_flow_mbit ({self.per_flow_mbit}), got {self.link.rate_mbit}"
            )


# Documented limits of cloud networks (read 2026-12-03):
# - AWS, "Amazon EC2 instance network bandwidth" (docs.aws.amazon.com/AWSEC2/latest/UserGuide/
#   ec2-instance-network-bandwidth.html): single-flow traffic (one TCP/UDP 5-tuple) is limited to
#   5 Gbps when the instances are not in the same cluster placement group.
# - AWS, "Network maximum transmission unit (MTU) for your EC2 instance": traffic between regions
#   (VPC peering across regions, internet gateway) leaves with MTU 1,500 bytes unless it goes
#   through a transit gateway; jumbo frames (9,001) only inside a VPC / placement group.
# - Google Cloud, "Maximum transmission unit" (cloud.google.com/vpc/docs/mtu): a VPC network's
#   default MTU is 1,460 bytes (configurable 1,300-8,896).
# RTT classes: the providers publish live inter-region round-trip times (GCP: Network Intelligence
# Center, Performance Dashboard; AWS: Network Manager, Infrastructure Performance); the figures
# change, so the classes here are derived from what does not: light in fibre covers ~200 km per ms
# (1 ms of RTT per 100 km of path), and a path runs ~1.3-1.8x the great-circle distance.
_RTT_NOTE = "RTT class value: great-circle distance at 1 ms RTT per 100 km of fibre, times ~1.5 path stretch"
_EMULATOR_REACH = (
    "RTT and MTU are emulated as given; a multi-Gbit/s rate is not: one TCP flow through the userspace "
    "delayer reaches a few hundred Mbit/s on this 2-vCPU machine (window- and CPU-bound)"
)
_MEASURED = "measured 2026-12-03 with `python -m netem.report` at load average ~13: "


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
        Profile(
            name="cloud-continent",
            link=LinkParams(delay_ms=12.5, jitter_ms=0.5),
            description="two cloud regions on one continent (e.g. Iowa - South Carolina, Frankfurt - "
            "Belgium, ~1,000-1,500 km): RTT 25 ms, GCP's default VPC MTU 1,460",
            mtu_bytes=1460,
            source=f"MTU: Google Cloud 'Maximum transmission unit' (default VPC MTU 1,460). {_RTT_NOTE} "
            "(1,300 km -> 13 ms floor -> ~20-25 ms)",
            measured_here=_MEASURED
            + "RTT 25.4 ms (24.5-26.0), one TCP flow (bbr, no cap) 842 Mbit/s. "
            + _EMULATOR_REACH,
        ),
        Profile(
            name="cloud-cross-coast",
            link=LinkParams(delay_ms=32.5, jitter_ms=1.0, rate_mbit=5000.0),
            description="across North America (e.g. AWS us-east-1 - us-west-2, ~3,700 km): RTT 65 ms, "
            "MTU 1,500 between regions, 5 Gbit/s per flow",
            mtu_bytes=1500,
            per_flow_mbit=5000.0,
            source="AWS 'Amazon EC2 instance network bandwidth' (single flow 5 Gbps outside a cluster "
            "placement group) and 'Network MTU for your EC2 instance' (1,500 between regions unless "
            f"through a transit gateway). {_RTT_NOTE} (3,700 km -> 37 ms floor -> ~55-67 ms)",
            measured_here=_MEASURED
            + "RTT 65.3 ms (63.5-67.0), one TCP flow 342 Mbit/s of the 5,000. "
            + _EMULATOR_REACH,
        ),
        Profile(
            name="cloud-transoceanic",
            link=LinkParams(delay_ms=45.0, jitter_ms=1.0, rate_mbit=5000.0),
            description="across the North Atlantic (e.g. AWS us-east-1 - eu-west-1, ~5,500 km): RTT 90 ms, "
            "MTU 1,500 between regions, 5 Gbit/s per flow",
            mtu_bytes=1500,
            per_flow_mbit=5000.0,
            source="AWS as cloud-cross-coast (per-flow cap, inter-region MTU). "
            f"{_RTT_NOTE} (5,500 km -> 55 ms floor -> ~75-95 ms)",
            measured_here=_MEASURED + "RTT 90.4 ms (88.8-92.1), one TCP flow 243 Mbit/s of the 5,000 (the 4 MiB "
            "send window allows ~260 at 90 ms). " + _EMULATOR_REACH,
        ),
    )
}


def get_profile(name: str) -> Profile:
    """Return the preset called ``name``; ValueError naming the presets otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}") from None
