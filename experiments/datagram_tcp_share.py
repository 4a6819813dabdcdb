"""What a paced datagram flow does to a competing TCP flow on the same bottleneck (netem; prints a table).

Three emulated sites, every link ``netem.rate_mbit`` (tbf) and ``netem.delay_ms`` one way. A bulk
TCP flow runs from site 0 to site 1 for ``lab.seconds``; in its middle third a datagram flow paced
like the datagram data path (:class:`~dtrain.transports.datagram_pacing.Pacer`, 1400-byte
datagrams) runs from site 2 to site 1 at ``lab.udp_mbit``: both share site 1's download cap. Per
TCP congestion control (bbr, and cubic where the machine allows it, else reno): TCP goodput
before, during and after the datagram flow, and the datagram flow's delivered rate and loss. The
datagram path sends at its round's rate whatever else shares the link (its rate controller only
acts between rounds): it is meant for provisioned links.

Needs root (netem: network namespaces).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Any

from dtrain.transports.datagram_pacing import Pacer
from experiments.common import RunResult, md_table
from experiments.lab import Point, Spec, files
from experiments.procs import loss_based_cc, netem_topology, set_link, sysctl

RATE, DELAY, SECONDS, UDP, CC = "netem.rate_mbit", "netem.delay_ms", "lab.seconds", "lab.udp_mbit", "netem.tcp_cc"
LOSSY_CC = "cubic-or-reno"  # cubic where the machine's allowed list has it, else reno
MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(fixed={SECONDS: 6.0}, grid={CC: ["bbr"], UDP: [95.0]}),
    "quick": dict(fixed={SECONDS: 9.0}, grid={UDP: [95.0]}),
    "full": dict(fixed={SECONDS: 15.0}, grid={UDP: [50.0, 95.0]}),
}


def _tcp_sink(srv: socket.socket, t0: float, bins: list[int], bin_s: float, stop: threading.Event) -> None:
    conn, _ = srv.accept()
    conn.settimeout(0.5)
    buf = bytearray(1 << 16)
    while not stop.is_set():
        try:
            n = conn.recv_into(buf)
        except socket.timeout:
            continue
        if not n:
            break
        k = int((time.monotonic() - t0) / bin_s)
        if k < len(bins):
            bins[k] += n
    conn.close()


def _tcp_source(cli: socket.socket, addr: tuple[str, int], until: float) -> None:
    cli.connect(addr)
    data = b"x" * (1 << 16)
    cli.settimeout(1.0)
    while time.monotonic() < until:
        try:
            cli.sendall(data)
        except (socket.timeout, OSError):
            break
    cli.close()


def _udp_sink(sock: socket.socket, counts: list[int], stop: threading.Event) -> None:
    sock.settimeout(0.2)
    buf = bytearray(2048)
    while not stop.is_set():
        with contextlib.suppress(socket.timeout):
            counts[0] += sock.recv_into(buf)
            counts[1] += 1


def _udp_source(sock: socket.socket, addr: tuple[str, int], rate_mbit: float, start: float, end: float) -> int:
    pacer = Pacer(rate_mbit)
    data = b"d" * 1400
    sent = 0
    time.sleep(max(0.0, start - time.monotonic()))
    while time.monotonic() < end:
        if pacer.wait(len(data), end + 1.0):
            with contextlib.suppress(OSError):
                sock.sendto(data, addr)
                sent += 1
    return sent


def one(topo, cc: str, udp_mbit: float, seconds: float, bin_s: float = 0.25) -> dict:
    sysctl(topo, "tcp_congestion_control", cc)
    srv = topo.socket(1, socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((topo.address(1), 0))
    srv.listen(1)
    usink = topo.socket(1, socket.AF_INET, socket.SOCK_DGRAM)
    usink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    usink.bind((topo.address(1), 0))
    cli = topo.socket(0, socket.AF_INET, socket.SOCK_STREAM)
    usrc = topo.socket(2, socket.AF_INET, socket.SOCK_DGRAM)
    stop = threading.Event()
    t0 = time.monotonic()
    bins = [0] * int(seconds / bin_s + 1)
    ucounts = [0, 0]
    threads = [
        threading.Thread(target=_tcp_sink, args=(srv, t0, bins, bin_s, stop), daemon=True),
        threading.Thread(target=_udp_sink, args=(usink, ucounts, stop), daemon=True),
        threading.Thread(target=_tcp_source, args=(cli, srv.getsockname(), t0 + seconds), daemon=True),
    ]
    for t in threads:
        t.start()
    a, b = t0 + seconds / 3, t0 + 2 * seconds / 3
    sent = _udp_source(usrc, usink.getsockname(), udp_mbit, a, b)
    threads[2].join(seconds + 5)
    time.sleep(0.5)
    stop.set()
    for t in threads[:2]:
        t.join(5)
    for s in (srv, usink, usrc):
        s.close()

    def goodput(lo: float, hi: float) -> float:
        ks = range(int(lo / bin_s), int(hi / bin_s))
        return sum(bins[k] for k in ks) * 8 / 1e6 / (len(ks) * bin_s)

    third = seconds / 3
    return {
        "cc": cc,
        "udp_mbit": udp_mbit,
        "tcp_before": goodput(1.0, third),  # the first second is slow start
        "tcp_during": goodput(third + 0.5, 2 * third),
        "tcp_after": goodput(2 * third + 0.5, seconds),
        "udp_delivered_mbit": ucounts[0] * 8 / 1e6 / (b - a),
        "udp_loss": 1 - ucounts[1] / sent if sent else float("nan"),
    }


def measure(point: Point) -> RunResult:
    """A TCP flow beside a paced datagram flow on three emulated sites (one topology per point)."""
    f = point.settings
    with netem_topology(3, "dgshare", "datagram_tcp_share") as topo:
        set_link(topo, delay_ms=f[DELAY], rate_mbit=f[RATE])
        cc = loss_based_cc() if f[CC] == LOSSY_CC else f[CC]
        return RunResult(row=point.row(**one(topo, cc, f[UDP], f[SECONDS])))


def report(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any], prefix: Path) -> str:
    f = m["fixed"]
    headers = ["TCP cc", "datagrams Mbit/s", "TCP before", "TCP during", "TCP after", "datagrams delivered Mbit/s"]
    mbit = ("tcp_before", "tcp_during", "tcp_after", "udp_delivered_mbit")
    table = [[r["cc"], f"{r['udp_mbit']:g}", *(f"{r[k]:.1f}" for k in mbit), f"{r['udp_loss']:.1%}"] for r in rows]
    return f"""Setup: links {f[RATE]:g} Mbit/s, {f[DELAY]:g} ms one way; TCP site 0 -> 1 for {f[SECONDS]:g} s, datagrams
site 2 -> 1 in its middle third; goodput in Mbit/s. {files(prefix)}

{md_table([*headers, "loss"], table)}"""


def verdict(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any]) -> list[str]:
    """Per TCP congestion control: the share of its goodput TCP kept while the datagram flow ran (below
    half: the datagram flow did not back off for it, as the module doc says it does not)."""
    no_yield = ": the datagram path does not yield to TCP (meant for provisioned links)."
    return [
        f"- {r['cc']}: while a paced datagram flow sent {r['udp_mbit']:g} Mbit/s, TCP kept {r['tcp_during']:.1f} of its "
        f"{r['tcp_before']:.1f} Mbit/s ({r['tcp_during'] / r['tcp_before']:.0%}) and ran at {r['tcp_after']:.1f} in "
        f"the last third{no_yield if r['tcp_during'] < 0.5 * r['tcp_before'] else '.'}"
        for r in rows
        if r["tcp_before"] > 0
    ]


SPEC = Spec(
    name="datagram_tcp_share",
    title="A paced datagram flow beside a TCP flow (netem)",
    modes={k: {"seeds": [0], **v} for k, v in MODES.items()},
    grid={CC: ["bbr", LOSSY_CC]},
    fixed={RATE: 100.0, DELAY: 40.0},
    label=lambda point: f"{point[CC]}, datagrams {point[UDP]:g} Mbit/s",
    metrics=(("tcp_before", 0.0, 1e4), ("udp_delivered_mbit", 0.0, 1e4)),
    report=report,
    verdict=verdict,
    execute=measure,
    paths=(RATE, DELAY, SECONDS, UDP, CC),
    netem=True,
)
