"""What the netem emulator itself can pass: 1,400-byte UDP datagrams/s through the namespaces, no dtrain.

Without a netem qdisc in the kernel, delay is done in userspace on NFQUEUE (the compiled
``netem/delayer.c``, ``nfqueue-c``, or the Python fallback, ``nfqueue-userspace``) and the rate by
tbf. A datagram data path sends one packet per 1,400 bytes where TCP hands the kernel 64 KB at
once, so the delayer's packets/s can bound it before the link's cap does. Per delayer
(``netem.delayers``), sender processes (site i -> site i+1, a paced ``send`` loop) offer a rate
and a receiver per destination counts what arrives, on the link with no delay, with the one-way
delay, and with delay + rate cap: offered and achieved send rate, delivered datagrams/s and
Mbit/s, loss, the delayer's late releases (> 1 ms) and CPU per packet. The ceiling per setting:
the highest delivered rate with loss < 1% and >= 95% of the offer.

Needs root (netem: network namespaces).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DATAGRAM_BYTES = 1400
PORT = 47000
# netem.delayers names -> DTRAIN_NETEM_DELAYER (netem/_cdelay.py): "c" is the compiled delayer where it builds
DELAYER_ENV = {"c": "auto", "python": "python"}
DELAYER, DELAYERS = "netem.delayer", "netem.delayers"
SITES, PAIRS, DELAY, RATE_CAP = "netem.num_sites", "netem.pairs", "netem.delay_ms", "netem.rate_mbit"
OFFERED, SECONDS = "netem.offered_dps", "lab.seconds"
MODES: dict[str, dict[str, Any]] = {
    "smoke": {SITES: 2, PAIRS: [1], DELAY: 5.0, OFFERED: [2000, 8000], SECONDS: 0.5, DELAYERS: ["c"]},
    "quick": {SITES: 4, PAIRS: [1, 4], DELAY: 40.0, SECONDS: 2.0, DELAYERS: ["c", "python"]}
    | {OFFERED: [2000, 4000, 8000, 12000, 16000, 24000, 32000, 40000, 48000]},
    "full": {SITES: 4, PAIRS: [1, 2, 4], DELAY: 40.0, SECONDS: 4.0, DELAYERS: ["c", "python"]}
    | {OFFERED: [1000, 2000, 4000, 6000, 8000, 12000, 16000, 24000, 32000, 48000]},
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
            try:  # not contextlib.suppress: this loop sets the offered rate (a context manager per send costs)
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


# a sender or receiver process, ``--role send HOST SECONDS RATE`` or ``--role recv HOST SECONDS`` (stdlib only:
# it starts in ~50 ms, so the flows start together)
if __name__ == "__main__" and "--role" in sys.argv:
    role, host, seconds, *rate = sys.argv[2:]
    _send(host, float(rate[0]), float(seconds)) if role == "send" else _recv(host, float(seconds))
    sys.exit(0)


# imported after the --role check: a sender/receiver process starts on the standard library only
from experiments.common import RunResult, md_rows, md_table  # noqa: E402
from experiments.lab import Point, Spec, files  # noqa: E402
from experiments.procs import netem_topology, set_link  # noqa: E402


def _cpu_ns(pid: int | None) -> int:
    """CPU time ``pid`` has run so far (ns, /proc/PID/schedstat), 0 when unknown."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) if pid else 0
    return 0


def _delayer_counters(topo) -> tuple[int, int, int]:
    """(late releases > 1 ms, packets delayed, CPU ns of the agent + compiled delayer) so far."""
    st = topo.stats()
    sites = st.get("sites") or []
    cpu_ns = _cpu_ns(st.get("pid")) + _cpu_ns(st.get("delayer_pid"))
    return sum(s["late_1ms"] for s in sites), sum(s["delayed"] for s in sites), cpu_ns


def one(topo, m: dict[str, Any], setting: str, pairs: int, rate: float) -> dict[str, Any]:
    """One measurement: ``pairs`` flows of ``rate`` datagrams/s each; returns a CSV row."""
    load_1m = os.getloadavg()[0]
    me = [sys.executable, str(Path(__file__).resolve())]
    dsts = [(i + 1) % m[SITES] for i in range(pairs)]
    delayed_row = setting != "no delay"
    before = _delayer_counters(topo) if delayed_row else (0, 0, 0)

    def role(site: int, *args: Any) -> subprocess.Popen:
        return topo.popen(site, [*me, "--role", *map(str, args)], stdout=subprocess.PIPE, text=True)

    recv = [role(d, "recv", topo.address(d), m[SECONDS] + 60) for d in dsts]
    try:
        for p in recv:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        send = [role(i, "send", topo.address(d), m[SECONDS], rate) for i, d in enumerate(dsts)]
        sent = [json.loads(p.communicate(timeout=m[SECONDS] * 4 + 30)[0]) for p in send]
        got = [json.loads(p.communicate(timeout=m[SECONDS] + 30)[0]) for p in recv]
    finally:
        for p in recv:
            if p.poll() is None:
                p.kill()
                p.wait()
    after = _delayer_counters(topo) if delayed_row else (0, 0, 0)
    late, num_delayed, cpu_ns = (a - b for a, b in zip(after, before))
    num_sent, num_got = sum(x["sent"] for x in sent), sum(x["received"] for x in got)
    send_s = max(x["send_s"] for x in sent)
    recv_s = max(max(x["recv_s"] for x in got), 1e-9)
    return {
        "experiment": "netem_udp_ceiling",
        "config": f"{setting}, {pairs} flow(s)",
        "setting": setting,
        "delayer": "none" if setting == "no delay" else topo.backends()["delay"],
        "load_1m": load_1m,
        "flows": pairs,
        "delay_ms": 0.0 if setting == "no delay" else m[DELAY],
        "rate_cap_mbit": m[RATE_CAP] if setting == "delay + cap" else float("nan"),
        "offered_dps": rate * pairs,
        "achieved_send_dps": num_sent / max(send_s, 1e-9),
        "delivered_dps": num_got / recv_s,
        "delivered_mbit": num_got * DATAGRAM_BYTES * 8 / 1e6 / recv_s,
        "loss": 1 - num_got / num_sent if num_sent else float("nan"),
        "late_releases": late,
        "delayer_cpu_us_per_pkt": cpu_ns / 1e3 / num_delayed if num_delayed else float("nan"),
        "seed": 0,
    }


def ceilings(rows: list[dict[str, Any]], delayer: str | None = None) -> dict[tuple[str, int], dict[str, Any] | None]:
    """Per (setting, flows): the row of the highest delivered rate at loss < 1% that kept up with the
    offer (>= 95% of it: no queue growing), or None; ``delayer``: only that backend's rows (None: all)."""
    out: dict[tuple[str, int], dict[str, Any] | None] = {}
    for r in rows:
        if delayer is not None and r.get("delayer", "?") != delayer:
            continue
        key = (r["setting"], r["flows"])
        best = out.setdefault(key, None)
        kept_up = r["loss"] < 0.01 and r["delivered_dps"] >= 0.95 * r["offered_dps"]
        if kept_up and (best is None or r["delivered_dps"] > best["delivered_dps"]):
            out[key] = r
    return out


def _ceiling_cells(r: dict[str, Any], flows: int) -> list[str]:
    """A ceiling's datagrams/s, the load when it ran, its Mbit/s and per flow."""
    load = f"{r['load_1m']:.1f}" if "load_1m" in r else "?"
    return [f"{r['delivered_dps']:.0f}", load, f"{r['delivered_mbit']:.1f}", f"{r['delivered_mbit'] / flows:.1f}"]


def _fmt_us(v: float | None) -> str:
    return "-" if v is None or v != v else f"{v:.2f}"


def analyse(rows: list[dict[str, Any]]) -> str:
    table = [
        {
            "setting": r["setting"],
            "delayer": r.get("delayer", "?"),
            "load": f"{r['load_1m']:.1f}" if "load_1m" in r else "?",
            "flows": r["flows"],
            "offered dgram/s": f"{r['offered_dps']:.0f}",
            "sent dgram/s": f"{r['achieved_send_dps']:.0f}",
            "delivered dgram/s": f"{r['delivered_dps']:.0f}",
            "delivered Mbit/s": f"{r['delivered_mbit']:.1f}",
            "loss": f"{r['loss']:.2%}",
            "late releases": r["late_releases"],
            "delayer CPU us/packet": _fmt_us(r.get("delayer_cpu_us_per_pkt")),
        }
        for r in rows
    ]
    ceil = [
        [k[0], d, k[1], *(["-"] * 4 if r is None else _ceiling_cells(r, k[1]))]
        for d in dict.fromkeys(r.get("delayer", "?") for r in rows)
        for k, r in ceilings(rows, d).items()
    ]
    headers = ["setting", "delayer", "flows", "ceiling dgram/s (loss < 1%)", "load", "Mbit/s", "per flow Mbit/s"]
    intro = "Ceilings (highest delivered rate with loss < 1% and >= 95% of the offer):"
    return f"{md_rows(table)}\n\n{intro}\n\n{md_table(headers, ceil)}"


def verdict(rows: list[dict[str, Any]], rounds: list, m: dict[str, Any]) -> list[str]:
    """The delayed links' ceilings, per delayer: a rate, or "above the highest offer" when the highest
    offer still went through (the emulator is then not what limits a run at these rates)."""
    top = max((r["offered_dps"] for r in rows), default=0.0)
    lines = []
    for d in dict.fromkeys(r.get("delayer", "?") for r in rows if r["setting"] != "no delay"):
        parts = []
        for (setting, flows), r in ceilings(rows, d).items():
            if r is None:
                what = "none at the lowest offer"
            elif r["offered_dps"] >= top:
                what = f"above the highest offer ({r['delivered_dps']:,.0f}/s passed)"
            else:
                what = f"{r['delivered_dps']:,.0f}/s ({r['delivered_mbit'] / flows:.1f} Mbit/s per flow)"
            parts.append(f"{setting}, {flows} flow(s): {what}")
        lines.append(f"- {d} delayer, {m['fixed'][DELAY]:g} ms, ceiling (loss < 1%): " + "; ".join(parts) + ".")
    return lines


def run_point(point: Point) -> list[RunResult]:
    """One topology, its links walked without delay (``config`` "no delay") or through one
    delayer (``netem.delayer``: "c" or "python"); none for a delayer not in ``netem.delayers``.
    Per link and flow count the offers in turn, up to the first past the ceiling."""
    m = point.settings
    delayer, wanted = m[DELAYER], m[DELAYERS]
    if not wanted or set(wanted) - set(DELAYER_ENV):
        raise ValueError(f"{DELAYERS} must name some of {sorted(DELAYER_ENV)}, got {wanted}")
    if delayer != "none" and delayer not in wanted:
        return []
    if delayer != "none":
        os.environ["DTRAIN_NETEM_DELAYER"] = DELAYER_ENV[delayer]
    cap = dict(delay_ms=m[DELAY], rate_mbit=m[RATE_CAP])
    links = {"no delay": {}} if delayer == "none" else {"delay": dict(delay_ms=m[DELAY]), "delay + cap": cap}
    out = []
    with netem_topology(m[SITES], "udpc", "netem_udp_ceiling") as topo:
        for setting, link in links.items():
            set_link(topo, **link)
            for pairs in m[PAIRS]:
                for rate in m[OFFERED]:
                    row = one(topo, m, setting, pairs, rate / pairs)
                    out.append(RunResult(row=row))
                    print(
                        f"{setting} ({row['delayer']}, load {row['load_1m']:.1f}), {pairs} flow(s), offered {row['offered_dps']:.0f}/s: delivered "
                        f"{row['delivered_dps']:.0f}/s ({row['delivered_mbit']:.1f} Mbit/s), loss {row['loss']:.1%}",
                        flush=True,
                    )
                    if row["loss"] > 0.2:
                        break  # past the ceiling: higher offers only lose more
    return out


def report(rows: list[dict[str, Any]], rounds: list, m: dict[str, Any], prefix: Path) -> str:
    f = m["fixed"]
    return f"""Setup: {f[SITES]} netem sites, no dtrain; {DATAGRAM_BYTES}-byte UDP payloads, paced sender processes
(site i -> site i+1), one receiver process per destination, {f[SECONDS]:g} s per point. "delay": {f[DELAY]:g} ms
one way on every site (every packet through an NFQUEUE delayer: "nfqueue-c" is the compiled one,
netem/delayer.c; "nfqueue-userspace" the Python fallback in netem/_agent.py); "delay + cap": also tbf at
{f[RATE_CAP]:g} Mbit/s. Loss is what the emulator (or a receiver falling behind) dropped: no loss is configured.
"load": the 1-minute load average when the row started; "delayer CPU": CPU time of the agent and the
compiled delayer (/proc/PID/schedstat) over the packets they delayed in that row. {files(prefix)}

{analyse(rows)}
"""


# "no delay" first, on a topology of its own; then each delayer's delayed links
GRID = [{"config": d, DELAYER: d} for d in ("none", *DELAYER_ENV)]
SPEC = Spec(
    name="netem_udp_ceiling",
    title="netem's own UDP ceiling",
    modes={mode: {"seeds": [0], "grid": GRID, "fixed": v} for mode, v in MODES.items()},
    fixed={"netem.rate_mbit": 100.0},
    metrics=(("delivered_dps", 0.0, 1e7), ("loss", 0.0, 1.0)),
    report=report,
    verdict=verdict,
    execute=run_point,
    paths=(SITES, PAIRS, DELAY, RATE_CAP, OFFERED, SECONDS, DELAYER, DELAYERS),
    netem=True,
)
