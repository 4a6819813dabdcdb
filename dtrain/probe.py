"""A path probe between two sites: RTT, throughput (one TCP flow and several), path MTU and
one-way loss, measured against a small :class:`ProbeServer` on the peer.

``dtrain doctor`` (``dtrain.app.doctor``) runs it before a run; the rendezvous may run the
same functions at join (each measurement is its own function, bounded in count and time,
so a join can take only the RTT and a short flow). Standard library only, no torch.

Wire (all on one port number, TCP and UDP, like the datagram data path's port sharing):

* UDP datagrams start with ``MAGIC`` + a kind byte + an 8-byte session + a 4-byte sequence
  (17 bytes). ``E`` (echo): the server answers those 17 bytes (RTT). ``M`` (MTU probe, sent
  with don't-fragment set): the server answers the 17 bytes and the datagram's length (4
  bytes). ``L`` (loss probe): counted per session, no answer. An answer is never larger than
  its request, so the server cannot amplify a spoofed sender's traffic.
* TCP: the client sends ``MAGIC`` + a kind byte. ``S`` (sink): the server reads until EOF
  (or ``MAX_SINK_S``) and answers JSON ``{"marks": [[t_s, bytes], ...]}`` (its own
  monotonic clock, one mark per ``MARK_INTERVAL_S`` at most); the throughput is computed
  from the receiver's marks after a warm-up. ``Q`` + an 8-byte session: the server answers
  JSON ``{"received": n}``, the distinct loss probes of that session it got.

Nothing here authenticates: the server sinks bytes and echoes small datagrams; run it
only for the preflight, on a port the peers can reach.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import socket
import statistics
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

__all__ = [
    "ProbeConfig",
    "PathReport",
    "ProbeServer",
    "ProbeError",
    "measure_path",
    "measure_rtt",
    "measure_throughput",
    "measure_mtu",
    "measure_loss",
]

log = logging.getLogger(__name__)

MAGIC = b"DTPR"
_HDR = struct.Struct("!4sc8sI")  # magic, kind, session, sequence: 17 bytes
MAX_SINK_S = 120.0  # longest a sink connection is read
MARK_INTERVAL_S = 0.005
MAX_MARKS = 30_000
MAX_SESSIONS = 64  # loss sessions the server remembers (oldest dropped)
MAX_LOSS_PROBES = 100_000
MAX_CONNECTIONS = 32
_IPV4_UDP_BYTES, _IPV6_UDP_BYTES = 28, 48
# Linux's values where the socket module lacks the names
_IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
_IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)
_IP_MTU = getattr(socket, "IP_MTU", 14)
_IPV6_MTU_DISCOVER = getattr(socket, "IPV6_MTU_DISCOVER", 23)
_IPV6_PMTUDISC_DO = getattr(socket, "IPV6_PMTUDISC_DO", 2)
_IPV6_MTU = getattr(socket, "IPV6_MTU", 24)


class ProbeError(OSError):
    """The peer's probe server could not be reached or answered nonsense (the message says which)."""


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """How hard the probe measures a path (every loop below is bounded by these).

    Attributes:
        num_rtt_probes: UDP echoes for the RTT, an int in [1, 10000].
        rtt_interval_s: gap between echoes, in [0, 1] seconds.
        flow_s: how long each throughput measurement sends, in (0, 120) seconds.
        warmup_s: the first part of flow_s not counted (slow start), in [0, flow_s).
        num_flows: parallel TCP flows of the second throughput measurement, an int in [1, 64]
            (1: only the one-flow measurement).
        num_loss_probes: UDP probes of the loss burst, an int in [0, 100000] (0: no loss measurement).
        loss_interval_s: gap between loss probes, in [0, 1] seconds (pacing keeps the burst
            from overflowing a queue and calling that loss).
        min_mtu_bytes: smallest IP packet the MTU search assumes passes, an int in [576, 65535].
        max_mtu_bytes: largest IP packet the MTU search tries, an int in [min_mtu_bytes, 65535]
            (also bounded by the local route's MTU).
        mtu_tries: probes per size before it counts as too big, an int in [1, 10].
        timeout_s: connect and answer timeout, > 0 seconds.
    """

    num_rtt_probes: int = 30
    rtt_interval_s: float = 0.01
    flow_s: float = 3.0
    warmup_s: float = 1.0
    num_flows: int = 4
    num_loss_probes: int = 1000
    loss_interval_s: float = 0.001
    min_mtu_bytes: int = 576
    max_mtu_bytes: int = 9000
    mtu_tries: int = 3
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        def need(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(
            "num_rtt_probes", is_int(self.num_rtt_probes) and 1 <= self.num_rtt_probes <= 10_000, "an int in [1, 10000]"
        )
        need("rtt_interval_s", 0 <= self.rtt_interval_s <= 1, "in [0, 1] seconds")
        need("flow_s", 0 < self.flow_s < MAX_SINK_S, f"in (0, {MAX_SINK_S:g}) seconds")
        need("warmup_s", 0 <= self.warmup_s < self.flow_s, f"in [0, flow_s = {self.flow_s!r}) seconds")
        need("num_flows", is_int(self.num_flows) and 1 <= self.num_flows <= 64, "an int in [1, 64]")
        need(
            "num_loss_probes",
            is_int(self.num_loss_probes) and 0 <= self.num_loss_probes <= MAX_LOSS_PROBES,
            f"an int in [0, {MAX_LOSS_PROBES}]",
        )
        need("loss_interval_s", 0 <= self.loss_interval_s <= 1, "in [0, 1] seconds")
        need(
            "min_mtu_bytes", is_int(self.min_mtu_bytes) and 576 <= self.min_mtu_bytes <= 65535, "an int in [576, 65535]"
        )
        need(
            "max_mtu_bytes",
            is_int(self.max_mtu_bytes) and self.min_mtu_bytes <= self.max_mtu_bytes <= 65535,
            f"an int in [min_mtu_bytes = {self.min_mtu_bytes!r}, 65535]",
        )
        need("mtu_tries", is_int(self.mtu_tries) and 1 <= self.mtu_tries <= 10, "an int in [1, 10]")
        need("timeout_s", self.timeout_s > 0 and math.isfinite(self.timeout_s), "> 0 seconds")


@dataclass(frozen=True, kw_only=True)
class PathReport:
    """What the probe measured from this host to one peer (client -> peer direction).

    Attributes:
        peer: the probe server's ``host:port``.
        rtt_median_s, rtt_p90_s, rtt_min_s: round trip of UDP echoes, seconds (None: no echo came back).
        rtt_lost: echoes sent without an answer.
        throughput_one_flow_bytes_per_s: TCP goodput of one flow, payload bytes per second at
            the receiver after the warm-up (None: not measured or failed).
        throughput_flows_bytes_per_s: the same summed over ``num_flows`` parallel flows.
        num_flows: flows of the second measurement.
        mtu_bytes: largest IP packet (headers included) that crossed with don't-fragment set
            (None: no probe came back).
        loss_fraction: one-way loss of the UDP burst, in [0, 1] (None: not measured).
        num_loss_probes: probes of that burst.
        ipv6: the path is IPv6 (48 bytes of IP + UDP headers, not 28).
        notes: what could not be measured, and why.
    """

    peer: str
    rtt_median_s: float | None = None
    rtt_p90_s: float | None = None
    rtt_min_s: float | None = None
    rtt_lost: int = 0
    throughput_one_flow_bytes_per_s: float | None = None
    throughput_flows_bytes_per_s: float | None = None
    num_flows: int = 1
    mtu_bytes: int | None = None
    loss_fraction: float | None = None
    num_loss_probes: int = 0
    ipv6: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        """The report as JSON-ready values (``notes`` a list)."""
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d


# ---------------------------------------------------------------------------------- server
class ProbeServer:
    """The peer side: TCP sink and loss counter, UDP echo, on ``host:port`` (port 0: any free).

    Runs on daemon threads until :meth:`stop`; at most ``MAX_CONNECTIONS`` TCP connections at
    once (more are closed at accept), each read for at most ``MAX_SINK_S``.

    Raises:
        OSError: the TCP or UDP port cannot be bound.
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._tcp = socket.socket(family, socket.SOCK_STREAM)
        self._tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._tcp.bind((host, port))
        self._tcp.listen(64)
        self._tcp.settimeout(0.2)
        self.port = self._tcp.getsockname()[1]
        self.host = host
        self._udp = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self._udp.bind((host, self.port))
        except OSError:
            self._tcp.close()
            raise
        self._udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._udp.settimeout(0.2)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sessions: OrderedDict[bytes, set[int]] = OrderedDict()
        self._active = 0
        self._threads = [
            threading.Thread(target=self._accept_loop, name="probe-accept", daemon=True),
            threading.Thread(target=self._udp_loop, name="probe-udp", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.info("probe server on %s:%d (tcp and udp)", host, self.port)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def stop(self) -> None:
        """Stop serving (open sink connections end within ~0.2 s)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2.0)
        self._tcp.close()
        self._udp.close()

    def __enter__(self) -> ProbeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _udp_loop(self) -> None:
        while not self._stop.is_set():
            try:
                data, addr = self._udp.recvfrom(65535)
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            if len(data) < _HDR.size or data[:4] != MAGIC:
                continue
            _, kind, session, seq = _HDR.unpack_from(data)
            try:
                if kind == b"E":
                    self._udp.sendto(data[: _HDR.size], addr)
                elif kind == b"M":
                    self._udp.sendto(data[: _HDR.size] + struct.pack("!I", len(data)), addr)
                elif kind == b"L":
                    self._count(session, seq)
            except OSError:
                continue

    def _count(self, session: bytes, seq: int) -> None:
        with self._lock:
            seen = self._sessions.get(session)
            if seen is None:
                seen = self._sessions[session] = set()
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
            if len(seen) < MAX_LOSS_PROBES:
                seen.add(seq)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._tcp.accept()
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with self._lock:
                if self._active >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._active += 1
            threading.Thread(target=self._serve_conn, args=(conn,), name="probe-conn", daemon=True).start()

    def _serve_conn(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(5.0)
                head = _recv_exact(conn, 5)
                if head[:4] != MAGIC:
                    return
                if head[4:5] == b"S":
                    conn.sendall(json.dumps({"marks": self._sink(conn)}).encode())
                elif head[4:5] == b"Q":
                    session = _recv_exact(conn, 8)
                    with self._lock:
                        n = len(self._sessions.get(session, ()))
                    conn.sendall(json.dumps({"received": n}).encode())
        except OSError as e:
            log.debug("probe connection ended: %s", e)
        finally:
            with self._lock:
                self._active -= 1

    def _sink(self, conn: socket.socket) -> list[list[float]]:
        """Read until EOF; (monotonic s, bytes so far) marks, at most one per MARK_INTERVAL_S."""
        buf = bytearray(1 << 20)
        total, marks, last = 0, [], 0.0
        conn.settimeout(0.2)
        t_end = time.monotonic() + MAX_SINK_S
        while not self._stop.is_set() and time.monotonic() < t_end:
            try:
                n = conn.recv_into(buf)
            except socket.timeout:
                continue
            if n == 0:
                break
            total += n
            now = time.monotonic()
            if now - last >= MARK_INTERVAL_S and len(marks) < MAX_MARKS:
                marks.append([now, total])
                last = now
        if marks and marks[-1][1] != total:
            marks.append([time.monotonic(), total])
        return marks


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = conn.recv(n - len(out))
        if not part:
            raise ProbeError(f"connection closed after {len(out)} of {n} bytes")
        out += part
    return out


def _recv_all(conn: socket.socket, limit: int = 4 << 20) -> bytes:
    chunks, size = [], 0
    while size < limit:
        part = conn.recv(65536)
        if not part:
            break
        chunks.append(part)
        size += len(part)
    return b"".join(chunks)


# ---------------------------------------------------------------------------------- client
def _resolve(addr: str, kind: int) -> tuple:
    """(family, sockaddr) of ``host:port``."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"peer must be host:port, got {addr!r}")
    host = host.strip("[]")
    try:
        info = socket.getaddrinfo(host, int(port), type=kind)[0]
    except socket.gaierror as e:
        raise ProbeError(f"peer {addr}: cannot resolve {host!r}: {e}") from None
    return info[0], info[4]


def _udp_socket(addr: str, timeout_s: float) -> socket.socket:
    family, sockaddr = _resolve(addr, socket.SOCK_DGRAM)
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.settimeout(timeout_s)
    s.connect(sockaddr)
    return s


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def measure_rtt(addr: str, config: ProbeConfig = ProbeConfig()) -> tuple[float, float, float, int]:
    """Round trip of ``config.num_rtt_probes`` UDP echoes to the probe server at ``addr``.

    Echoes go out every ``rtt_interval_s``; answers are read until ``timeout_s`` after the
    last send or until every echo came back.

    Returns:
        (median s, p90 s, min s, number of echoes lost).

    Raises:
        ProbeError: no echo came back (no server, or UDP blocked on the path).
    """
    session = os.urandom(8)
    sent: dict[int, float] = {}
    rtts: list[float] = []
    with _udp_socket(addr, config.timeout_s) as s:
        s.setblocking(False)
        for seq in range(config.num_rtt_probes):
            sent[seq] = time.perf_counter()
            try:
                s.send(_HDR.pack(MAGIC, b"E", session, seq))
            except ConnectionRefusedError:  # an ICMP port unreachable of an earlier echo
                pass
            _drain_echoes(s, session, sent, rtts, time.perf_counter() + config.rtt_interval_s)
        last = time.perf_counter()
        _drain_echoes(s, session, sent, rtts, last + config.timeout_s, want=config.num_rtt_probes, tail_s=last)
    if not rtts:
        raise ProbeError(
            f"peer {addr}: none of {config.num_rtt_probes} UDP echoes came back within {config.timeout_s:g} s"
        )
    return statistics.median(rtts), _percentile(rtts, 0.9), min(rtts), config.num_rtt_probes - len(rtts)


def _drain_echoes(
    s: socket.socket,
    session: bytes,
    sent: dict[int, float],
    rtts: list[float],
    until: float,
    want: int | None = None,
    tail_s: float | None = None,
) -> None:
    """Read echo answers until ``until`` (perf_counter), or until ``want`` answers arrived;
    with ``tail_s`` (the last send's time) and an answer seen, no longer than 4x the largest
    RTT seen (at least 0.2 s) after it: a lost echo does not hold the wait to ``until``."""
    import select

    while True:
        end = until
        if tail_s is not None and rtts:
            end = min(until, tail_s + max(4 * max(rtts), 0.2))
        left = end - time.perf_counter()
        if left <= 0 or (want is not None and len(rtts) >= want):
            return
        ready, _, _ = select.select([s], [], [], left)
        if not ready:
            continue
        try:
            data = s.recv(64)
        except (BlockingIOError, ConnectionRefusedError):
            continue
        now = time.perf_counter()
        if len(data) >= _HDR.size:
            magic, kind, sess, seq = _HDR.unpack_from(data)
            if magic == MAGIC and kind == b"E" and sess == session and seq in sent:
                rtts.append(now - sent.pop(seq))


def measure_throughput(addr: str, num_flows: int = 1, config: ProbeConfig = ProbeConfig()) -> float:
    """TCP goodput from here to the probe server at ``addr`` over ``num_flows`` parallel flows.

    Each flow sends for ``config.flow_s``; the server's receive marks give the payload bytes
    of every flow between ``warmup_s`` after the first byte and the earliest flow's last
    mark, summed, over that window (the receiver's clock, so buffered bytes do not count).

    Returns:
        bytes per second (payload), summed over the flows.

    Raises:
        ProbeError: a flow could not connect, or the window held no data.
    """
    family, sockaddr = _resolve(addr, socket.SOCK_STREAM)
    results: list[list | BaseException] = [[] for _ in range(num_flows)]
    payload = b"\0" * (64 << 10)  # small: a slow path still sends within timeout_s

    def flow(i: int) -> None:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as c:
                c.settimeout(config.timeout_s)
                c.connect(sockaddr)
                c.sendall(MAGIC + b"S")
                t_end = time.monotonic() + config.flow_s
                while time.monotonic() < t_end:
                    c.sendall(payload)
                c.shutdown(socket.SHUT_WR)
                c.settimeout(config.timeout_s + config.flow_s)
                results[i] = json.loads(_recv_all(c))["marks"]
        except (OSError, ValueError, KeyError) as e:
            results[i] = e

    threads = [threading.Thread(target=flow, args=(i,), daemon=True) for i in range(num_flows)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=config.flow_s + 3 * config.timeout_s + 5.0)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise ProbeError(f"peer {addr}: a throughput flow failed: {errors[0]}")
    return _goodput(results, config.warmup_s, addr)


def _goodput(marks: list[list], warmup_s: float, addr: str) -> float:
    """Summed bytes per second of the flows' (t, total) marks in [first + warmup, earliest end]."""
    flows = [m for m in marks if m]
    if not flows:
        raise ProbeError(f"peer {addr}: the throughput flows delivered nothing")
    t0 = min(m[0][0] for m in flows) + warmup_s
    t1 = min(m[-1][0] for m in flows)
    if t1 - t0 <= 0.05:
        raise ProbeError(f"peer {addr}: the throughput window after the warm-up is {t1 - t0:.3f} s, too short")

    def at(m: list, t: float) -> float:
        before = [b for ts, b in m if ts <= t]
        return before[-1] if before else 0.0

    return sum(at(m, t1) - at(m, t0) for m in flows) / (t1 - t0)


def measure_mtu(addr: str, config: ProbeConfig = ProbeConfig(), rtt_s: float | None = None) -> tuple[int, bool]:
    """Path MTU to the probe server at ``addr``: a binary search over IP packet sizes with
    don't-fragment set (``IP_PMTUDISC_DO``), between ``min_mtu_bytes`` and the smaller of
    ``max_mtu_bytes`` and the local route's MTU. A size passes when the server answers one of
    ``mtu_tries`` probes within ``max(4 rtt_s, 0.2 s)``; a local ``EMSGSIZE`` (the route, or
    an ICMP "fragmentation needed" the kernel learnt) fails it at once. At most
    log2(range) sizes, so the search is bounded in probes and time.

    Returns:
        (MTU in bytes, IP + UDP headers included; whether the path is IPv6).

    Raises:
        ProbeError: not even ``min_mtu_bytes`` came back.
    """
    wait_s = max(4 * (rtt_s or 0.05), 0.2)
    session = os.urandom(8)
    with _udp_socket(addr, wait_s) as s:
        v6 = s.family == socket.AF_INET6
        level, opt, do = (
            (socket.IPPROTO_IPV6, _IPV6_MTU_DISCOVER, _IPV6_PMTUDISC_DO)
            if v6
            else (socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DO)
        )
        overhead = _IPV6_UDP_BYTES if v6 else _IPV4_UDP_BYTES
        s.setsockopt(level, opt, do)
        hi = min(config.max_mtu_bytes, _route_mtu(s, config.max_mtu_bytes))
        lo = config.min_mtu_bytes
        if not _mtu_passes(s, session, lo, overhead, config.mtu_tries, wait_s):
            raise ProbeError(f"peer {addr}: no answer to {lo}-byte UDP probes with don't-fragment set")
        if hi > lo and _mtu_passes(s, session, hi, overhead, config.mtu_tries, wait_s):
            return hi, v6
        while hi - lo > 1:  # lo passes, hi does not
            mid = (lo + hi) // 2
            if _mtu_passes(s, session, mid, overhead, config.mtu_tries, wait_s):
                lo = mid
            else:
                hi = mid
        return lo, v6


def _route_mtu(s: socket.socket, default: int) -> int:
    """The kernel's current path MTU to the connected peer (``IP_MTU``), or ``default``."""
    v6 = s.family == socket.AF_INET6
    try:
        return s.getsockopt(socket.IPPROTO_IPV6 if v6 else socket.IPPROTO_IP, _IPV6_MTU if v6 else _IP_MTU)
    except OSError:
        return default


def _mtu_passes(s: socket.socket, session: bytes, size: int, overhead: int, tries: int, wait_s: float) -> bool:
    """Whether an IP packet of ``size`` bytes crosses (an answer naming its length arrives)."""
    body = size - overhead
    for seq in range(tries):
        head = _HDR.pack(MAGIC, b"M", session, size * 16 + seq)
        try:
            s.send(head + b"\0" * (body - len(head)))
        except OSError as e:
            if e.errno == errno.EMSGSIZE:
                return False
            raise
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                data = s.recv(64)
            except socket.timeout:
                break
            except ConnectionRefusedError:
                continue
            except OSError as e:  # an ICMP "fragmentation needed" arrived: the kernel learnt a smaller MTU
                if e.errno != errno.EMSGSIZE:
                    raise
                if size > _route_mtu(s, size):
                    return False
                continue  # a late error of an earlier, larger probe
            if len(data) >= _HDR.size + 4 and data[:4] == MAGIC and data[5:13] == session:
                _, _, _, got_seq = _HDR.unpack_from(data)
                (length,) = struct.unpack_from("!I", data, _HDR.size)
                if got_seq == size * 16 + seq and length == body:
                    return True
    return False


def measure_loss(addr: str, config: ProbeConfig = ProbeConfig(), rtt_s: float | None = None) -> float:
    """One-way loss from here to the probe server at ``addr``: ``num_loss_probes`` numbered UDP
    probes paced at ``loss_interval_s``; after ``max(2 rtt_s, 0.3 s)`` the server is asked
    over TCP how many distinct ones it got.

    Returns:
        the lost fraction, in [0, 1].

    Raises:
        ProbeError: the server could not be asked.
    """
    session = os.urandom(8)
    n = config.num_loss_probes
    with _udp_socket(addr, config.timeout_s) as s:
        start = time.monotonic()
        for seq in range(n):
            wait = start + seq * config.loss_interval_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                s.send(_HDR.pack(MAGIC, b"L", session, seq) + b"\0" * 15)
            except ConnectionRefusedError:
                continue
    time.sleep(max(2 * (rtt_s or 0.1), 0.3))
    family, sockaddr = _resolve(addr, socket.SOCK_STREAM)
    try:
        with socket.socket(family, socket.SOCK_STREAM) as c:
            c.settimeout(config.timeout_s)
            c.connect(sockaddr)
            c.sendall(MAGIC + b"Q" + session)
            received = int(json.loads(_recv_all(c, 4096))["received"])
    except (OSError, ValueError, KeyError) as e:
        raise ProbeError(f"peer {addr}: could not ask for the loss count: {e}") from None
    return max(0.0, 1.0 - received / n)


def measure_path(addr: str, config: ProbeConfig = ProbeConfig()) -> PathReport:
    """Every measurement to the probe server at ``addr``, in turn: RTT, MTU, loss, one flow,
    ``config.num_flows`` flows. A measurement that fails leaves its fields None and a note;
    the whole takes about ``2 flow_s + num_loss_probes * loss_interval_s`` plus a few RTTs
    (each part bounded by its timeouts).

    Raises:
        ProbeError: the peer cannot be reached at all (no echo, no TCP connection).
    """
    notes: list[str] = []
    fields: dict = {}
    try:
        med, p90, lo, lost = measure_rtt(addr, config)
        fields.update(rtt_median_s=med, rtt_p90_s=p90, rtt_min_s=lo, rtt_lost=lost)
    except ProbeError as e:
        notes.append(f"rtt: {e}")
    rtt = fields.get("rtt_median_s")
    try:
        fields["mtu_bytes"], fields["ipv6"] = measure_mtu(addr, config, rtt)
    except (ProbeError, OSError) as e:
        notes.append(f"mtu: {e}")
    if config.num_loss_probes:
        try:
            fields.update(loss_fraction=measure_loss(addr, config, rtt), num_loss_probes=config.num_loss_probes)
        except (ProbeError, OSError) as e:
            notes.append(f"loss: {e}")
    for n, key in ((1, "throughput_one_flow_bytes_per_s"), (config.num_flows, "throughput_flows_bytes_per_s")):
        if n == 1 and key == "throughput_flows_bytes_per_s":
            fields[key] = fields.get("throughput_one_flow_bytes_per_s")
            continue
        try:
            fields[key] = measure_throughput(addr, n, config)
        except (ProbeError, OSError) as e:
            notes.append(f"throughput ({n} flow{'s' if n > 1 else ''}): {e}")
    if rtt is None and fields.get("throughput_one_flow_bytes_per_s") is None:
        raise ProbeError(f"peer {addr}: unreachable: " + "; ".join(notes))
    return PathReport(peer=addr, num_flows=config.num_flows, notes=tuple(notes), **fields)
