"""``python -m netem``: build, change, use and remove emulated WAN topologies.

    python -m netem up --sites 3 --profile transatlantic [--name dt]
    python -m netem status [--name dt] [--json]
    python -m netem set 1 --delay-ms 80 --loss-pct 1      # site 1 only
    python -m netem set all --profile lossy                # every site
    python -m netem set 2 --partition on                   # cut site 2 off
    python -m netem exec 0 -- ping -c 3 198.18.0.2
    python -m netem down [--name dt]
    python -m netem cleanup                                # every leftover (dtnetem-* only)

``up`` leaves the topology running (state in /run/dtrain-netem/<name>/, the helper
process detached), so later invocations find it by name.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from ._sys import PREFIX, check_name, delete_namespace, list_namespaces
from .probe import NetemUnavailable
from .profiles import PROFILES, LinkParams
from .topology import Topology, cleanup_all, list_topologies

# LinkParams fields that `set` takes as plain numbers (rate_mbit also takes "none")
_FLOAT_FIELDS = ("delay_ms", "jitter_ms", "loss_pct", "reorder_pct", "reorder_gap_ms", "flap_period_s", "flap_down_s")

__all__ = ["main"]

DEFAULT_NAME = "dt"


def _rate(text: str) -> float | None:
    return None if text.lower() in ("none", "0", "off") else float(text)


def _on_off(text: str) -> bool:
    if text.lower() in ("on", "1", "true", "yes"):
        return True
    if text.lower() in ("off", "0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m netem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="log what is run")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def named(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--name", default=DEFAULT_NAME, help=f"topology name (default {DEFAULT_NAME})")
        return p

    up = named(sub.add_parser("up", help="build a topology and leave it running"))
    up.add_argument("--sites", type=int, required=True, help="number of sites")
    up.add_argument("--profile", default="lan", choices=sorted(PROFILES))
    up.add_argument("--mtu-bytes", type=int, help="every link's MTU, 1280-9000 (default: the profile's, mostly 1500)")
    up.add_argument("--no-kernel-netem", action="store_true", help="use the fallbacks even where the kernel has netem")
    named(sub.add_parser("down", help="remove a topology"))
    st = sub.add_parser("status", help="show one topology (--name) or list all")
    st.add_argument("--name", default=None)
    st.add_argument("--json", action="store_true")
    s = named(sub.add_parser("set", help="change a site's link (live)"))
    s.add_argument("site", help="site index or 'all'")
    s.add_argument("--profile", choices=sorted(PROFILES), help="start from this preset's link")
    for field in _FLOAT_FIELDS:
        s.add_argument("--" + field.replace("_", "-"), type=float, dest=field)
    s.add_argument(
        "--rate-mbit", type=_rate, dest="rate_mbit", default=argparse.SUPPRESS, help="Mbit/s, or 'none' for no cap"
    )
    s.add_argument("--partition", type=_on_off, help="on: cut the site off; off: restore")
    ex = named(sub.add_parser("exec", help="run a command inside a site: exec SITE -- CMD"))
    ex.add_argument("site", type=int)
    sub.add_parser("cleanup", help="remove every leftover of the harness (dtnetem-* only)")
    return ap


def _print_topology(st: dict) -> None:
    cfg = st["config"]
    print(f"topology {cfg['name']}: {cfg['num_sites']} sites, profile {cfg['profile']}")
    print("backends: " + ", ".join(f"{k}={v}" for k, v in st["backends"].items()))
    defaults = LinkParams().to_dict()
    for i, (ns, addr, link) in enumerate(zip(st["site_namespaces"], st["addresses"], st["links"])):
        changed = {k: v for k, v in link.items() if v != defaults[k]}
        desc = " ".join(f"{k}={v}" for k, v in changed.items()) or "no impairment"
        print(f"  site {i}: {addr:<15} {ns:<28} {desc}")
    if st["partitions"]:
        print("partitioned pairs: " + ", ".join(f"{a}-{b}" for a, b in st["partitions"]))
    stats = st.get("stats") or {}
    if stats.get("flap_down"):
        print(f"in a periodic outage now: sites {stats['flap_down']}")
    print(f"helper process: {'running' if st.get('agent_alive') else 'not running'}")


def _cmd_set(args: argparse.Namespace) -> None:
    topo = Topology.attach(args.name)
    site = None if args.site == "all" else int(args.site)
    changes = {f: getattr(args, f) for f in _FLOAT_FIELDS if getattr(args, f) is not None}
    if hasattr(args, "rate_mbit"):
        changes["rate_mbit"] = args.rate_mbit
    if args.profile or changes:
        topo.set_link(site, args.profile, **changes)
    if args.partition is not None:
        sites = range(topo.num_sites) if site is None else [site]
        for i in sites:
            topo.partition(i, args.partition)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:  # `exec SITE [--name N] -- CMD ...`: everything after -- is the command
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.cmd == "up":
            topo = Topology(
                args.sites,
                args.profile,
                name=args.name,
                persistent=True,
                kernel_netem=False if args.no_kernel_netem else None,
                mtu_bytes=args.mtu_bytes,
            )
            _print_topology(topo.status())
        elif args.cmd == "down":
            check_name(args.name)
            try:
                Topology.attach(args.name).close()
            except ValueError:  # no state: remove namespaces of that exact name, if any
                leftovers = [ns for ns in list_namespaces() if ns.startswith(f"{PREFIX}{args.name}-")]
                if not leftovers:
                    raise
                for ns in leftovers:
                    delete_namespace(ns)
        elif args.cmd == "status":
            names = [args.name] if args.name else list_topologies()
            states = [Topology.attach(n).status() for n in names]
            if args.json:
                print(json.dumps(states if args.name is None else states[0], indent=1))
            elif not states:
                print("no netem topologies")
            for st in [] if args.json else states:
                _print_topology(st)
        elif args.cmd == "set":
            _cmd_set(args)
        elif args.cmd == "exec":
            if not command:
                raise ValueError("exec needs a command: exec SITE [--name N] -- CMD [ARGS...]")
            argv2 = Topology.attach(args.name).exec_argv(args.site, command)
            os.execvp(argv2[0], argv2)
        elif args.cmd == "cleanup":
            for line in cleanup_all():
                print("removed " + line)
    except (ValueError, NetemUnavailable, RuntimeError) as e:
        print(f"netem: {e}", file=sys.stderr)
        return 2
    return 0
