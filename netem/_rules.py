"""Rendering of the emulation rules (pure functions: no side effects, unit-testable).

The hub namespace routes between the sites (``s<i>`` is its veth port to site ``i``,
``eth0`` the site's end). Where each property is emulated, for a packet to site ``i``:

* loss and partitions: an nftables ``inet`` table on the hub's forward hook (priority
  -10), fallback iptables rules in the hub's FORWARD chain. Packets vanish "in the
  network": senders get no local error. Only forwarded IP traffic is affected.
* delay and jitter: an iptables ``FORWARD -o s<i> -j NFQUEUE --queue-num <i>`` rule in
  the hub and the userspace delayer (netem/_agent.py), or kernel netem on ``s<i>``.
  Delaying in the hub (not at the receiver's INPUT) matters: the receiving kernel
  timestamps packets as they enter its namespace (ping, SO_TIMESTAMP, TCP RTT).
* rate: tbf on the site's ``eth0`` (upload) and on the hub port ``s<i>`` (download);
  with kernel netem the download shaping is netem's ``rate`` instead.
* per packet: both veth ends have segmentation offloads off (TSO, GSO, UDP GSO, GRO;
  :func:`offloads_off_argv`), so the kernel cuts a 64 KB TCP or ``UDP_SEGMENT`` write
  into wire-sized packets before the hub, and each one is lost, delayed or reordered on
  its own, as on a NIC's wire. With UDP GSO left on, a 10% loss dropped whole writes of
  40 datagrams: the same mean loss, in lumps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .profiles import LinkParams

__all__ = [
    "NFT_TABLE",
    "IPT_CHAINS",
    "SITE_IF",
    "hub_port",
    "offloads_off_argv",
    "nft_hub_base",
    "nft_chain",
    "part_matches",
    "loss_matches",
    "isolate_pairs",
    "ipt_hub_base",
    "ipt_chain",
    "ipt_part_rules",
    "ipt_loss_rules",
    "ipt_delay_rules",
    "tbf_argv",
    "netem_argv",
    "flap_down_sites",
    "flap_next_change",
]

NFT_TABLE = "dtrain_netem"
IPT_CHAINS = ("DTN-FWD", "DTN-PART", "DTN-FLAP", "DTN-LOSS", "DTN-DELAY")
SITE_IF = "eth0"


def hub_port(site: int) -> str:
    """Name of the hub's veth port to site ``site``."""
    return f"s{site}"


def offloads_off_argv(dev: str) -> list[str]:
    """``ethtool`` argv turning ``dev``'s segmentation offloads off: TCP (``tso``), generic
    (``gso``), UDP (``tx-udp-segmentation``; ``gso off`` leaves it on) and ``gro``."""
    return ["ethtool", "-K", dev, "tso", "off", "gso", "off", "gro", "off", "tx-udp-segmentation", "off"]


def isolate_pairs(sites: Iterable[int], num_sites: int) -> set[tuple[int, int]]:
    """The site pairs to cut so that each of ``sites`` is cut off from every other site."""
    return {tuple(sorted((s, j))) for s in sites for j in range(num_sites) if j != s}


def _pair_ports(pairs: Iterable[tuple[int, int]]) -> list[tuple[str, str]]:
    out = []
    for a, b in sorted(set(tuple(sorted(p)) for p in pairs)):
        out += [(hub_port(a), hub_port(b)), (hub_port(b), hub_port(a))]
    return out


# ---------------------------------------------------------------- nftables (hub forward hook)


def nft_hub_base() -> str:
    """The hub table: a forward base chain (before iptables' filter) jumping to part/flap/loss."""
    return (
        f"table inet {NFT_TABLE} {{\n"
        "  chain part { }\n"
        "  chain flap { }\n"
        "  chain loss { }\n"
        "  chain c_forward {\n"
        "    type filter hook forward priority -10; policy accept;\n"
        "    jump part\n"
        "    jump flap\n"
        "    jump loss\n"
        "  }\n"
        "}\n"
    )


def nft_chain(chain: str, matches: Iterable[str]) -> str:
    """An nft script that atomically replaces the rules of ``chain`` (one transaction)."""
    lines = [f"flush chain inet {NFT_TABLE} {chain}"]
    lines += [f"add rule inet {NFT_TABLE} {chain} {m} drop" for m in matches]
    return "\n".join(lines) + "\n"


def part_matches(pairs: Iterable[tuple[int, int]]) -> list[str]:
    """nft matches dropping both directions between each pair of sites."""
    return [f'iifname "{a}" oifname "{b}"' for a, b in _pair_ports(pairs)]


def _ppm(loss_pct: float) -> int:
    return int(round(loss_pct * 10_000))


def loss_matches(links: Sequence[LinkParams]) -> list[str]:
    """nft matches dropping ``loss_pct`` of the packets forwarded to each site."""
    return [
        f'oifname "{hub_port(i)}" numgen random mod 1000000 < {_ppm(p.loss_pct)}'
        for i, p in enumerate(links)
        if p.loss_pct > 0
    ]


# ---------------------------------------------------------------- iptables (hub FORWARD)


def ipt_hub_base(*, filters: bool) -> str:
    """iptables-restore input creating the hub chains; ``filters``: loss/partitions too."""
    decl = "".join(f":{c} - [0:0]\n" for c in IPT_CHAINS)
    jumps = "".join(f"-A DTN-FWD -j {c}\n" for c in IPT_CHAINS[1:] if filters or c == "DTN-DELAY")
    return f"*filter\n{decl}-A FORWARD -j DTN-FWD\n{jumps}COMMIT\n"


def ipt_chain(chain: str, rules: Iterable[str]) -> str:
    """iptables-restore --noflush input that atomically replaces ``chain``'s rules."""
    body = "".join(f"-A {chain} {r}\n" for r in rules)
    return f"*filter\n:{chain} - [0:0]\n{body}COMMIT\n"


def ipt_part_rules(pairs: Iterable[tuple[int, int]]) -> list[str]:
    """FORWARD drops for both directions of each cut pair (fallback partitions)."""
    return [f"-i {a} -o {b} -j DROP" for a, b in _pair_ports(pairs)]


def ipt_loss_rules(links: Sequence[LinkParams]) -> list[str]:
    """FORWARD random drops of ``loss_pct`` of the packets to each site (fallback loss)."""
    return [
        f"-o {hub_port(i)} -m statistic --mode random --probability {p.loss_pct / 100:.6f} -j DROP"
        for i, p in enumerate(links)
        if p.loss_pct > 0
    ]


def ipt_delay_rules(links: Sequence[LinkParams]) -> list[str]:
    """NFQUEUE hand-off to the userspace delayer: queue ``i`` holds packets to site ``i``."""
    return [f"-o {hub_port(i)} -j NFQUEUE --queue-num {i} --queue-bypass" for i, p in enumerate(links) if p.needs_delay]


# ---------------------------------------------------------------- tc


def tbf_argv(dev: str, rate_mbit: float | None, mtu_bytes: int = 1500) -> list[str]:
    """``tc`` argv installing a tbf rate cap on ``dev`` (or deleting the root qdisc).

    burst: at least 16 full frames (``mtu_bytes`` + 14 bytes of Ethernet header; a frame
    larger than the burst would never pass) and 2 ms at the rate (so timer granularity does not
    eat throughput); queue: 50 ms at the rate, at least 64 KiB.
    """
    if rate_mbit is None:
        return ["tc", "qdisc", "del", "dev", dev, "root"]
    rate_bps = rate_mbit * 1e6 / 8
    burst = max(16 * (mtu_bytes + 14), int(rate_bps * 0.002))
    limit = max(64 * 1024, int(rate_bps * 0.05)) + burst
    return [
        "tc",
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{rate_mbit:g}mbit",
        "burst",
        str(burst),
        "limit",
        str(limit),
    ]


def netem_argv(dev: str, link: LinkParams) -> list[str]:
    """``tc`` argv for kernel netem on a hub port: delay, jitter, loss and rate in one qdisc."""
    if not (link.needs_delay or link.loss_pct > 0 or link.rate_mbit is not None):
        return ["tc", "qdisc", "del", "dev", dev, "root"]
    argv = ["tc", "qdisc", "replace", "dev", dev, "root", "netem", "limit", "100000"]
    if link.needs_delay:
        argv += ["delay", f"{link.delay_ms:g}ms"]
        if link.jitter_ms > 0:
            argv += [f"{link.jitter_ms:g}ms"]
    if link.loss_pct > 0:
        argv += ["loss", f"{link.loss_pct:g}%"]
    if link.rate_mbit is not None:
        argv += ["rate", f"{link.rate_mbit:g}mbit"]
    return argv


# ---------------------------------------------------------------- periodic partitions


def _flap_phase(link: LinkParams, site: int, num_sites: int, epoch: float, now: float) -> float:
    """Position of ``now`` within ``site``'s flap period, in s (0 = outage starts)."""
    offset = site * link.flap_period_s / num_sites
    return (now - epoch - offset) % link.flap_period_s


def flap_down_sites(links: Sequence[LinkParams], epoch: float, now: float) -> list[int]:
    """Sites inside a periodic outage at wall-clock time ``now`` (schedule starts at ``epoch``)."""
    n = len(links)
    return [i for i, p in enumerate(links) if p.flap_period_s > 0 and _flap_phase(p, i, n, epoch, now) < p.flap_down_s]


def flap_next_change(links: Sequence[LinkParams], epoch: float, now: float) -> float | None:
    """Wall-clock time of the next outage start or end after ``now`` (None: no flapping)."""
    n = len(links)
    best = None
    for i, p in enumerate(links):
        if p.flap_period_s <= 0:
            continue
        phase = _flap_phase(p, i, n, epoch, now)
        wait = p.flap_down_s - phase if phase < p.flap_down_s else p.flap_period_s - phase
        t = now + max(wait, 1e-6)
        best = t if best is None else min(best, t)
    return best
