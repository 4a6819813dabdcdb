"""What the netem emulator itself can pass: 1,400-byte UDP datagrams/s through the namespaces, no dtrain.

On this machine the kernel has no netem qdisc, so delay is done by one userspace helper
(``netem/_agent.py``: NFQUEUE, one Python callback per packet, for every site) and the rate
by tbf. A datagram data path sends one packet per 1,400 bytes where TCP hands the kernel
64 KB at once, so the helper's packets/s bound the datagram path long before the 100
Mbit/s cap does. This script measures that bound.

Per setting, ``--pairs`` sender processes (site i -> site (i + 1) mod N, each in its own
namespace, a plain paced ``send`` loop) offer ``rate`` datagrams/s each for ``--seconds``; a
receiver process per destination counts what arrives. Settings: the link with no delay
(routing and filters only, no helper), with the one-way delay (every packet through the
helper), and delay + rate cap (the datagram_vs_grpc link). Per setting and offered rate:
offered and achieved send rate, delivered datagrams/s and Mbit/s (UDP payload), loss, and
the helper's late releases (> 1 ms).

The "ceiling" printed per setting is the highest delivered aggregate rate with loss < 1% and
delivered >= 95% of offered (the load at which the emulator adds neither loss nor a growing
queue of its own).

Usage (as root)::

    .venv/bin/python experiments/netem_udp_ceiling.py --quick
    .venv/bin/python experiments/netem_udp_ceiling.py --smoke --out /tmp/x --results none
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

DATAGRAM_BYTES = 1400
PORT = 47000
MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(num_sites=2, pairs=[1], delay=5.0, rate_cap=100.0, offered=[2000, 8000], seconds=0.5, seeds=[0]),
    "quick": dict(
        num_sites=4,
        pairs=[1, 4],
        delay=40.0,
        rate_cap=100.0,
        offered=[2000, 4000, 8000, 12000, 16000, 24000, 32000, 40000, 48000],
        seconds=2.0,
        seeds=[0],
    ),
    "full": dict(
        num_sites=4,
        pairs=[1, 2, 4],
        delay=40.0,
        rate_cap=100.0,
        offered=[1000, 2000, 4000, 6000, 8000, 12000, 16000, 24000, 32000, 48000],
        seconds=4.0,
        seeds=[0],
    ),
}


def _send(host: str, rate: float, seconds: float) -> None:
    """Sender role: paced batches of at most 16 datagrams; prints {"sent", "send_s"}."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    s.connect((host, PORT))
    payload = bytearray(DATAGRAM_BYTES)
    n, t0 = 0, time.monotonic()
    total = int(rate * seconds)
    while n < total:
        due = t0 + n / rate
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        for _ in range(min(16, total - n)):
            payload[:8] = n.to_bytes(8, "little")
            try:
                s.send(payload)
            except OSError:  # ENOBUFS: a local drop, counted as sent
                pass
            n += 1
    print(json.dumps({"sent": n, "send_s": time.monotonic() - t0}), flush=True)


def _recv(host: str, seconds: float) -> None:
    """Receiver role: prints "ready", then {"received", "first", "last"} after ``seconds`` of silence bound."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    s.bind((host, PORT))
    s.settimeout(0.5)
    print("ready", flush=True)
    buf = bytearray(65536)
    n, first, last = 0, 0.0, 0.0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            s.recv_into(buf)
        except socket.timeout:
            if n:
                break
            continue
        last = time.monotonic()
        first = first or last
        n += 1
    print(json.dumps({"received": n, "recv_s": last - first}), flush=True)


def _role(argv: list[str]) -> int:
    """A sender or receiver process (stdlib only: it starts in ~50 ms, so the flows start together)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["send", "recv"])
    ap.add_argument("--host")
    ap.add_argument("--rate", type=float, default=0.0)
    ap.add_argument("--seconds", type=float)
    a = ap.parse_args(argv)
    _send(a.host, a.rate, a.seconds) if a.role == "send" else _recv(a.host, a.seconds)
    return 0


if __name__ == "__main__" and "--role" in sys.argv:
    sys.exit(_role(sys.argv[1:]))

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.common import (  # noqa: E402
    RunResult,
    base_parser,
    md_table,
    mode_settings,
    out_prefix,
    publish,
    run_or_load,
)
from experiments.procs import netem_topology  # noqa: E402


def _late(topo, dsts: list[int]) -> int:
    """Packets the helper released more than 1 ms late so far, over the destination sites."""
    sites = topo.stats().get("sites") or []
    return sum(sites[d]["late_1ms"] for d in set(dsts) if d < len(sites))


def one(topo, m: dict[str, Any], setting: str, pairs: int, rate: float) -> dict[str, Any]:
    """One measurement: ``pairs`` flows of ``rate`` datagrams/s each; returns a CSV row."""
    me = [sys.executable, str(Path(__file__).resolve())]
    n = m["num_sites"]
    dsts = [(i + 1) % n for i in range(pairs)]
    before = _late(topo, dsts) if setting != "no delay" else 0
    recv = [
        topo.popen(
            d,
            me + ["--role", "recv", "--host", topo.address(d), "--seconds", str(m["seconds"] + 60)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for d in dsts
    ]
    try:
        for p in recv:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        send = [
            topo.popen(
                i,
                me + ["--role", "send", "--host", topo.address(d), "--rate", str(rate), "--seconds", str(m["seconds"])],
                stdout=subprocess.PIPE,
                text=True,
            )
            for i, d in enumerate(dsts)
        ]
        sent = [json.loads(p.communicate(timeout=m["seconds"] * 4 + 30)[0]) for p in send]
        got = [json.loads(p.communicate(timeout=m["seconds"] + 30)[0]) for p in recv]
    finally:
        for p in recv:
            if p.poll() is None:
                p.kill()
                p.wait()
    late = _late(topo, dsts) - before if setting != "no delay" else 0
    num_sent = sum(x["sent"] for x in sent)
    num_got = sum(x["received"] for x in got)
    send_s = max(x["send_s"] for x in sent)
    recv_s = max(max(x["recv_s"] for x in got), 1e-9)
    return {
        "experiment": "netem_udp_ceiling",
        "config": f"{setting}, {pairs} flow(s)",
        "setting": setting,
        "flows": pairs,
        "delay_ms": 0.0 if setting == "no delay" else m["delay"],
        "rate_cap_mbit": m["rate_cap"] if setting == "delay + cap" else float("nan"),
        "offered_dps": rate * pairs,
        "achieved_send_dps": num_sent / max(send_s, 1e-9),
        "delivered_dps": num_got / recv_s,
        "delivered_mbit": num_got * DATAGRAM_BYTES * 8 / 1e6 / recv_s,
        "loss": 1 - num_got / num_sent if num_sent else float("nan"),
        "late_releases": late,
        "seed": 0,
    }


def sweep(topo, m: dict[str, Any]) -> list[RunResult]:
    from netem.profiles import LinkParams  # noqa: PLC0415

    links = {
        "no delay": LinkParams(),
        "delay": LinkParams(delay_ms=m["delay"]),
        "delay + cap": LinkParams(delay_ms=m["delay"], rate_mbit=m["rate_cap"]),
    }
    out = []
    for setting, params in links.items():
        topo.set_link(None, params)
        for pairs in m["pairs"]:
            for rate in m["offered"]:
                row = one(topo, m, setting, pairs, rate / pairs)
                out.append(RunResult(row=row))
                print(
                    f"{setting}, {pairs} flow(s), offered {row['offered_dps']:.0f}/s: delivered "
                    f"{row['delivered_dps']:.0f}/s ({row['delivered_mbit']:.1f} Mbit/s), loss {row['loss']:.1%}",
                    flush=True,
                )
                if row["loss"] > 0.2:
                    break  # past the ceiling: higher offers only lose more
    return out


def ceilings(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any] | None]:
    """Per (setting, flows): the row with the highest delivered rate at loss < 1% that kept up with
    the offer (delivered >= 95% of offered: no queue growing in the helper); None: none."""
    out: dict[tuple[str, int], dict[str, Any] | None] = {}
    for r in rows:
        key = (r["setting"], r["flows"])
        best = out.get(key)
        if (
            r["loss"] < 0.01
            and r["delivered_dps"] >= 0.95 * r["offered_dps"]
            and (best is None or r["delivered_dps"] > best["delivered_dps"])
        ):
            out[key] = r
        else:
            out.setdefault(key, None)
    return out


def analyse(rows: list[dict[str, Any]]) -> str:
    table = md_table(
        [
            "setting",
            "flows",
            "offered dgram/s",
            "sent dgram/s",
            "delivered dgram/s",
            "delivered Mbit/s",
            "loss",
            "late releases",
        ],
        [
            [
                r["setting"],
                r["flows"],
                f"{r['offered_dps']:.0f}",
                f"{r['achieved_send_dps']:.0f}",
                f"{r['delivered_dps']:.0f}",
                f"{r['delivered_mbit']:.1f}",
                f"{r['loss']:.2%}",
                r["late_releases"],
            ]
            for r in rows
        ],
    )
    ceil = md_table(
        ["setting", "flows", "ceiling dgram/s (loss < 1%)", "Mbit/s", "per flow Mbit/s"],
        [
            [k[0], k[1], "-", "-", "-"]
            if r is None
            else [
                k[0],
                k[1],
                f"{r['delivered_dps']:.0f}",
                f"{r['delivered_mbit']:.1f}",
                f"{r['delivered_mbit'] / k[1]:.1f}",
            ]
            for k, r in ceilings(rows).items()
        ],
    )
    return table + "\n\nCeilings (highest delivered rate with loss < 1% and >= 95% of the offer):\n\n" + ceil


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--role" in argv:
        return _role(argv)
    ap = base_parser(__doc__)
    args = ap.parse_args(argv)
    mode, m = mode_settings(args, MODES)
    prefix = out_prefix(args, "netem_udp_ceiling")

    def runner() -> list[RunResult]:
        with netem_topology(m["num_sites"], "udpc", "netem_udp_ceiling") as topo:
            return sweep(topo, m)

    rows, _, meta = run_or_load(args, argv, "netem_udp_ceiling.py", prefix, runner)
    body = f"""Command: `{meta["command"]}` (as root; {meta["minutes"]:.1f} min; {meta["provenance"]}).

Setup: {m["num_sites"]} netem sites, no dtrain; {DATAGRAM_BYTES}-byte UDP payloads, paced sender processes
(site i -> site i+1), one receiver process per destination, {m["seconds"]:g} s per point. "delay": {m["delay"]:g} ms
one way on every site (every packet through the userspace NFQUEUE helper); "delay + cap": also tbf at
{m["rate_cap"]:g} Mbit/s. Loss is what the emulator (or a receiver falling behind) dropped: no loss is configured.
CSV: `{prefix.with_suffix(".csv").name}`.

{analyse(rows)}
"""
    publish(args, f"netem_udp_ceiling-{mode}", f"netem's own UDP ceiling ({mode})", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
