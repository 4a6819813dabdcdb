"""Measure what each profile really gives on this machine: ``python -m netem.report``.

For every profile (2 sites, site 0 -> site 1): ping RTT (50 probes), one-way UDP loss
(2,000 probes), bulk TCP goodput (bbr) at the profile's own rate cap and at a 40 Mbit/s
cap, and the helper's packet count. Prints a Markdown table (and JSON with --json).
Needs root; takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import time

from .measure import binomial_interval, ping, tcp_goodput_mbit, udp_loss
from .profiles import PROFILES
from .topology import Topology

__all__ = ["measure_profile", "main"]


def measure_profile(name: str, *, duration_s: float = 4.0) -> dict:
    """Measure profile ``name`` on a fresh 2-site topology (periodic outages switched off)."""
    link = PROFILES[name].link
    t0 = time.monotonic()
    with Topology(2, name) as topo:
        up_s = time.monotonic() - t0
        if link.flap_period_s:
            topo.set_link(None, flap_period_s=0.0, flap_down_s=0.0)
        rtt = ping(topo, 0, 1, count=50, interval_s=0.01)
        sent, received, _ = udp_loss(topo, 0, 1, count=2000, drain_s=0.3 + link.delay_ms / 500)
        own = tcp_goodput_mbit(topo, 0, 1, duration_s=duration_s, warmup_s=1.5)
        topo.set_link(None, rate_mbit=40.0)
        capped = tcp_goodput_mbit(topo, 0, 1, duration_s=duration_s, warmup_s=1.5)
        stats = topo.stats()
        backends = topo.backends()
    lo, hi = binomial_interval(sent, link.loss_pct / 100)
    return {
        "profile": name,
        "up_s": round(up_s, 2),
        "delay_ms": link.delay_ms,
        "rtt_avg_ms": rtt.avg_ms,
        "rtt_min_ms": rtt.min_ms,
        "rtt_max_ms": rtt.max_ms,
        "loss_pct_set": link.loss_pct,
        "loss_pct_measured": round(100 * (sent - received) / sent, 3),
        "loss_99_interval": [lo, hi],
        "rate_mbit": link.rate_mbit,
        "goodput_own_cap_mbit": round(own, 1),
        "goodput_at_40_mbit": round(capped, 1),
        "backends": backends,
        "agent": stats.get("sites"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m netem.report", description=__doc__)
    ap.add_argument("--profiles", nargs="*", default=sorted(PROFILES), choices=sorted(PROFILES))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = [measure_profile(p) for p in args.profiles]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        "| profile | set: one-way delay / loss / cap | ping RTT avg (min-max) | one-way loss "
        "(2,000 probes) | TCP goodput at own cap | at 40 Mbit/s cap |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        cap = "none" if r["rate_mbit"] is None else f"{r['rate_mbit']:g} Mbit/s"
        print(
            f"| {r['profile']} | {r['delay_ms']:g} ms / {r['loss_pct_set']:g}% / {cap} "
            f"| {r['rtt_avg_ms']:.2f} ms ({r['rtt_min_ms']:.2f}-{r['rtt_max_ms']:.2f}) "
            f"| {r['loss_pct_measured']:g}% | {r['goodput_own_cap_mbit']:g} Mbit/s "
            f"| {r['goodput_at_40_mbit']:g} Mbit/s |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
