"""Measurements through a topology: ping RTT, one-way UDP loss, TCP goodput.

Used by tests/netem and experiments; all traffic stays inside the topology's
namespaces and every loop is bounded in count and time.
"""

from __future__ import annotations

import math
import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

from .topology import Topology

__all__ = ["PingResult", "UdpLoss", "ping", "udp_loss", "tcp_goodput_mbit", "binomial_interval"]

_RTT_RE = re.compile(r"= ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms")
_LOSS_RE = re.compile(r"(\d+) packets transmitted, (\d+) received")


@dataclass(frozen=True, kw_only=True)
class PingResult:
    """Round trip times in ms and counts of one ``ping`` run."""

    sent: int
    received: int
    min_ms: float
    avg_ms: float
    max_ms: float


def ping(
    topo: Topology, src: int, dst: int, *, count: int = 20, interval_s: float = 0.01, timeout_s: float = 30.0
) -> PingResult:
    """``ping`` from site ``src`` to site ``dst`` (ICMP echo through the emulated links).

    Raises:
        RuntimeError: ping produced no statistics (e.g. every probe was lost).
    """
    argv = ["ping", "-n", "-q", "-c", str(count), "-i", f"{interval_s:g}", "-W", "2", topo.address(dst)]
    out = subprocess.run(topo.exec_argv(src, argv), capture_output=True, text=True, timeout=timeout_s).stdout
    counts, rtt = _LOSS_RE.search(out), _RTT_RE.search(out)
    if counts is None or rtt is None:
        raise RuntimeError(f"ping {src}->{dst} gave no RTT statistics: {out!r}")
    return PingResult(
        sent=int(counts[1]), received=int(counts[2]), min_ms=float(rtt[1]), avg_ms=float(rtt[2]), max_ms=float(rtt[3])
    )


class UdpLoss(NamedTuple):
    """What :func:`udp_loss` counted: datagrams sent, distinct ones received, and the runs of
    consecutive sequence numbers lost (independent loss of p: about ``lost * (1 - p)`` runs;
    loss applied to whole segmentation-offload writes: ``lost / segments``)."""

    sent: int
    received: int
    lost_runs: int


_UDP_SEGMENT = 103  # linux/udp.h: the send's segment size (UDP GSO)
_SEGMENT_BYTES = 1400  # the datagram data path's default datagram (dtrain.transports.datagram_config)


def udp_loss(
    topo: Topology,
    src: int,
    dst: int,
    *,
    count: int = 2000,
    interval_s: float = 0.0005,
    drain_s: float = 1.0,
    segments: int = 1,
) -> UdpLoss:
    """Send ``count`` numbered UDP datagrams from ``src`` to ``dst``; count those that arrive.

    One-way, so the loss measured is ``dst``'s ``loss_pct``. Sending is paced at
    ``interval_s`` per write; the receiver waits ``drain_s`` after the last send.
    ``segments`` > 1: each write is one ``sendmsg`` of that many 1,400-byte datagrams with
    ``UDP_SEGMENT`` (as the datagram data path sends), which the kernel may hand to the
    link as one 56 KB buffer: the emulated loss must still fall on each datagram.

    Raises:
        ValueError: ``count`` or ``segments`` < 1.
    """
    if count < 1 or segments < 1:
        raise ValueError(f"udp_loss: count and segments must be >= 1, got {count} and {segments}")
    rx = topo.socket(dst, socket.AF_INET, socket.SOCK_DGRAM)
    tx = topo.socket(src, socket.AF_INET, socket.SOCK_DGRAM)
    with rx, tx:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        rx.bind((topo.address(dst), 0))
        rx.settimeout(0.05)
        dest = rx.getsockname()
        size = _SEGMENT_BYTES if segments > 1 else 32
        if segments > 1:
            tx.setsockopt(socket.SOL_UDP, _UDP_SEGMENT, size)
        seen: set[int] = set()
        done = threading.Event()

        def receive() -> None:
            while not done.is_set():
                try:
                    data = rx.recv(2048)
                except socket.timeout:
                    continue
                seen.add(int.from_bytes(data[:4], "big"))

        t = threading.Thread(target=receive, daemon=True)
        t.start()
        start = time.monotonic()
        for k, first in enumerate(range(0, count, segments)):
            due = start + k * interval_s
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            seqs = range(first, min(count, first + segments))
            tx.sendto(b"".join(seq.to_bytes(4, "big") + bytes(size - 4) for seq in seqs), dest)
        time.sleep(drain_s)
        done.set()
        t.join(timeout=2.0)
    lost = [seq for seq in range(count) if seq not in seen]
    runs = sum(1 for i, seq in enumerate(lost) if i == 0 or lost[i - 1] != seq - 1)
    return UdpLoss(count, count - len(lost), runs)


def tcp_goodput_mbit(
    topo: Topology,
    src: int,
    dst: int,
    *,
    duration_s: float = 4.0,
    warmup_s: float = 1.5,
    congestion: str | None = "bbr",
) -> float:
    """Bulk TCP from ``src`` to ``dst`` for ``duration_s``; goodput in Mbit/s after ``warmup_s``.

    Goodput is payload bytes received between ``warmup_s`` and ``duration_s`` (receiver
    clock) divided by that window. ``congestion`` sets the sender's TCP congestion
    control per socket (None keeps the namespace default).
    """
    srv = topo.socket(dst)
    cli = topo.socket(src)
    marks: list[tuple[float, int]] = []
    with srv, cli:
        srv.bind((topo.address(dst), 0))
        srv.listen(1)
        srv.settimeout(5.0)
        if congestion:
            cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        cli.settimeout(5.0)
        cli.connect(srv.getsockname())
        conn, _ = srv.accept()
        stop = threading.Event()

        def receive() -> None:
            buf = bytearray(1 << 20)
            total = 0
            conn.settimeout(1.0)
            t0 = time.monotonic()
            while time.monotonic() - t0 < duration_s + 2.0:
                try:
                    n = conn.recv_into(buf)
                except socket.timeout:
                    if stop.is_set():
                        break
                    continue
                if n == 0:
                    break
                total += n
                marks.append((time.monotonic(), total))

        t = threading.Thread(target=receive, daemon=True)
        t.start()
        payload = b"\0" * (256 << 10)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < duration_s:
                cli.send(payload)
        except OSError:
            pass
        stop.set()
        cli.close()
        t.join(timeout=5.0)
        conn.close()
    window = [(ts, b) for ts, b in marks if ts - t0 >= warmup_s and ts - t0 <= duration_s]
    if len(window) < 2:
        return 0.0
    (ta, ba), (tb, bb) = window[0], window[-1]
    return (bb - ba) * 8 / (tb - ta) / 1e6


def binomial_interval(n: int, p: float, confidence: float = 0.99) -> tuple[int, int]:
    """Central interval [lo, hi] of Binomial(n, p) holding at least ``confidence`` mass.

    Each tail outside the interval has probability at most (1 - confidence) / 2.
    """
    if not 0 <= p <= 1 or n < 0:
        raise ValueError(f"need n >= 0 and p in [0, 1], got n={n!r}, p={p!r}")
    tail = (1 - confidence) / 2
    if p in (0.0, 1.0):
        k = int(round(n * p))
        return k, k
    logpmf = [
        math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
        for k in range(n + 1)
    ]
    pmf = [math.exp(v) for v in logpmf]
    lo, acc = 0, 0.0
    while acc + pmf[lo] <= tail:
        acc += pmf[lo]
        lo += 1
    hi, acc = n, 0.0
    while acc + pmf[hi] <= tail:
        acc += pmf[hi]
        hi -= 1
    return lo, hi
