"""Send and receive loop rate of the datagram data path on 127.0.0.1 (prints a table).

Two :class:`~dtrain.transports.datagram.DatagramTransport` sites on loopback; the sender pushes
``--mbytes`` MB of int8 contributions, one datagram each, with the pacer's ceiling at
``--rate-mbit``; the receiver's handler only counts. Figures:

* send: payload Mbit/s from the first to the last datagram leaving the sender (sealing, pacing
  and ``send`` included); receive: payload Mbit/s handed to the handler (receive,
  authenticate, dispatch), first to last arrival; delivered: the fraction that arrived (the
  rest the kernel dropped at a full socket buffer); the same per datagram in µs of wall time;
* the loops' rates per CPU-second of their own thread (robust to other load: what one free
  core would reach), and as CPU µs per datagram sent / received (the issue's target: <= 3);
* each loop alone (``isolated``): CPU µs per datagram of one unpaced ``push`` of 6,000
  contributions to a plain socket (with and without UDP segmentation offload), and of the
  receive thread while another process sends it 20,000 sealed contributions in bursts of 46
  (one ``send`` each; or each burst as one GSO write, as the compiled loop sends, read with
  ``recvmmsg`` and with coalesced reads, ``gro``);
* the receive thread's hand-on alone (``hand_on_cpu_us``): CPU µs per datagram of handing an opened
  batch of 16, 64 or 256 whole chunks on, an owner's contributions and a member's mean chunks, in
  columns (one compiled pass) against row by row;
* the CPU per datagram-sized int8 chunk of decoding one pseudo-gradient chunk by chunk against
  ``Codec.decode_chunks`` (what an owner, each applied mean and the residual settling pay).

Both loops are single Python threads; the issue's target is >= 200 Mbit/s per site.
"""

from __future__ import annotations

import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import numpy as np
import torch

from dtrain.codecs import get_codec
from dtrain.protocol import Contribution, Member, RoundPlan
from dtrain.transports.datagram import DatagramTransport, DatagramTransportConfig, datagram_chunk_bytes
from dtrain.transports.datagram_wire import Kind, Sealer, codec_id, contribution_body
from dtrain.transports.grpc import GrpcTransportConfig
from experiments import bench
from experiments.procs import wait_until

LOOPS = {
    "auto": "compiled (auto)",
    "on": "compiled",
    "off": "Python",
    "sendmmsg": "compiled, no GSO",
    "recvmmsg": "compiled, no GRO",
}


class CountingHandler:
    """A peer handler that only counts contributions (nothing pulls means here)."""

    def __init__(self) -> None:
        self.num = 0
        self.bytes = 0
        self.first = 0.0
        self.last = 0.0
        self.lock = threading.Lock()

    def handle_contribution(self, c: Contribution) -> None:
        now = time.monotonic()
        with self.lock:
            if not self.num:
                self.first = now
            self.num += 1
            self.bytes += len(c.payload)
            self.last = now


def _contributions(mbytes: float, round: int) -> list[Contribution]:
    codec = get_codec("int8")
    n = datagram_chunk_bytes("int8") // 4
    payload = codec.encode(torch.randn(n))
    count = int(mbytes * 1e6 / len(payload))
    return [
        Contribution(
            round=round, bucket=0, chunk=i, offset=i * n, numel=n, codec="int8", sender="site-a", payload=payload
        )
        for i in range(count)
    ]


def _config(**kw) -> DatagramTransportConfig:
    """The config with the fields this checkout has (``gso`` is newer), so that this script, run
    with ``PYTHONPATH`` at an older checkout, measures that checkout the same way."""
    have = DatagramTransportConfig.__dataclass_fields__
    return DatagramTransportConfig(grpc=GrpcTransportConfig(bind_host="127.0.0.1", bind_port=0), **{
        k: v for k, v in kw.items() if k in have
    })  # fmt: skip


def _plan(addr_a: str, addr_b: str, key: bytes, round: int = 0) -> RoundPlan:
    """Round ``round`` of the two sites site-a and site-b, sealed with ``key``."""
    members = (Member(site_id="site-a", address=addr_a), Member(site_id="site-b", address=addr_b))
    return RoundPlan(round=round, members=members, reduce_timeout_s=60, broadcast_timeout_s=60, datagram_key=key)


def run_one(
    rate_mbit: float, mbytes: float, round: int, native: str = "auto", gso: bool = True, gro: bool = True
) -> dict:
    cfg = _config(max_rate_mbit=rate_mbit, rtt_s=0.05, native=native, gso=gso, gro=gro)
    a, b = DatagramTransport(cfg), DatagramTransport(cfg)
    handler = CountingHandler()
    addr_b = b.start(handler)
    addr_a = a.start(CountingHandler())
    plan = _plan(addr_a, addr_b, os.urandom(32), round)
    a.begin_round(plan, [], "site-a")
    b.begin_round(plan, [], "site-b")
    cs = _contributions(mbytes, round)
    recv_clock = time.pthread_getcpuclockid(next(t for t in b._threads if t.name.startswith("dgram-recv")).ident)
    recv_cpu0 = time.clock_gettime(recv_clock)
    send_cpu0 = time.thread_time()
    t0 = time.monotonic()
    a.push(addr_b, cs, timeout_s=120)
    send_s = time.monotonic() - t0
    send_cpu = time.thread_time() - send_cpu0
    wait_until(lambda: handler.num >= len(cs), 5, poll_s=0.05)
    recv_cpu = time.clock_gettime(recv_clock) - recv_cpu0
    recv_s = max(1e-9, handler.last - handler.first)
    payload = sum(len(c.payload) for c in cs)
    out = {
        "ceiling_mbit": rate_mbit,
        "datagrams": len(cs),
        "send_mbit": payload * 8 / 1e6 / send_s,
        "recv_mbit": handler.bytes * 8 / 1e6 / recv_s,
        "delivered": handler.num / len(cs),
        "send_us": send_s / len(cs) * 1e6,
        "recv_us": recv_s / max(1, handler.num) * 1e6,
        "send_cpu_mbit": payload * 8 / 1e6 / max(send_cpu, 1e-9),
        "recv_cpu_mbit": handler.bytes * 8 / 1e6 / max(recv_cpu, 1e-9),
        "send_cpu_us": send_cpu / len(cs) * 1e6,
        "recv_cpu_us": recv_cpu / max(1, handler.num) * 1e6,
    }
    a.stop(0)
    b.stop(0)
    return out


def isolated_push_cpu_us(num: int = 6000, *, gso: bool, native: str = "on") -> float:
    """CPU µs (this thread) per datagram of one unpaced ``push`` of ``num`` int8 contributions
    to a plain UDP socket of this process (nothing reads them in Python: the send path alone)."""
    a = DatagramTransport(_config(max_rate_mbit=20_000.0, native=native, gso=gso, report_wait_s=0.01))
    addr_a = a.start(CountingHandler())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sink:
        sink.bind(("127.0.0.1", 0))
        sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        addr_b = f"127.0.0.1:{sink.getsockname()[1]}"
        a.begin_round(_plan(addr_a, addr_b, os.urandom(32)), [], "site-a")
        cs = _contributions(num * 1332 / 1e6, 0)
        t0 = time.thread_time()
        a.push(addr_b, cs, timeout_s=60)
        cpu = time.thread_time() - t0
    a.stop(0)
    return cpu / len(cs) * 1e6


_BLAST = """
import socket, struct, sys, time
blob = sys.stdin.buffer.read()
gso, gap_s = sys.argv[2] == "gso", float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(('127.0.0.1', int(sys.argv[1])))
i, burst, sent, t0 = 0, [], 0, time.monotonic()
while i < len(blob):
    (n,) = struct.unpack_from('<H', blob, i)
    burst.append(blob[i + 2 : i + 2 + n])
    i += 2 + n
    if len(burst) == 46 or i >= len(blob):
        if gso and len(burst) > 1:  # as the compiled loop sends a burst of equal-sized datagrams
            s.sendmsg([b''.join(burst)], [(socket.SOL_UDP, 103, struct.pack('H', len(burst[0])))])
        else:
            for d in burst:
                s.send(d)
        sent += sum(map(len, burst))
        burst = []
        if gap_s:
            time.sleep(gap_s)
print(sent * 8 / (time.monotonic() - t0) / 1e9)
"""


class RecvFigures(NamedTuple):
    """:func:`isolated_recv_cpu_us`'s figures."""

    cpu_us: float  # CPU µs of the receive thread per datagram delivered
    delivered: float  # fraction of the datagrams sent that reached the handler
    offered_gbit: float  # the sender's rate, Gbit/s of datagrams (bursts and gaps together)
    handled_gbit: float  # the rate the handler got them at, first to last, Gbit/s of datagrams


def isolated_recv_cpu_us(
    num: int = 20_000, native: str = "on", *, gso: bool, gro: bool, gap_s: float = 0.0015
) -> RecvFigures:
    """The receive thread's CPU per datagram while another process sends it ``num`` sealed int8
    contributions in bursts of 46, ``gap_s`` apart (1.5 ms: ~0.31 Gbit/s, a paced sender's
    bursts; 0: back to back, as fast as the sender can, the condition of
    :func:`isolated_push_cpu_us`): each datagram with its own ``send``, or (``gso``) each burst
    as one UDP segmentation offload write, as the compiled loop sends; ``gro``: the receiver's
    ``DatagramTransportConfig.gro``. A wake-up of the thread costs the same however few
    datagrams it reads, so the CPU per datagram falls as the rate rises."""
    b, handler = DatagramTransport(_config(native=native, gro=gro)), CountingHandler()
    addr_b = b.start(handler)
    key = os.urandom(32)
    b.begin_round(_plan("127.0.0.1:1", addr_b, key), [], "site-b")
    payload = contribution_body(0, _contributions(0.002, 0)[0].payload)  # the claim, then the codec payload
    sealer = Sealer(key, run=0, round=0, sender=0, native=b._native)
    blob = bytearray()
    numel = datagram_chunk_bytes("int8") // 4
    for at in range(0, num, 46):
        k = min(46, num - at)
        fields = [(i // 500, i % 500, 0, numel, codec_id("int8"), 0, 1) for i in range(at, at + k)]
        sb = sealer.seal_many(Kind.CONTRIB, fields, [payload] * k)
        for d in map(sb.datagram, range(k)):
            blob += struct.pack("<H", len(d)) + d
    clock = time.pthread_getcpuclockid(next(t for t in b._threads if t.name.startswith("dgram-recv")).ident)
    cpu0 = time.clock_gettime(clock)
    sender = [sys.executable, "-c", _BLAST, addr_b.rsplit(":", 1)[1], "gso" if gso else "send", repr(gap_s)]
    offered = float(subprocess.run(sender, input=blob, check=True, capture_output=True).stdout)
    # every datagram handled, or none for 0.5 s (some lost): the thread's idle wake-ups after
    # the last one are not charged to the datagrams
    seen = [handler.num, time.monotonic()]

    def settled() -> bool:
        if handler.num != seen[0]:
            seen[:] = [handler.num, time.monotonic()]
        return handler.num >= num or time.monotonic() - seen[1] > 0.5

    wait_until(settled, 10, poll_s=0.01)
    cpu = time.clock_gettime(clock) - cpu0
    b.stop(0)
    wire_bits = (len(blob) - 2 * num) * 8 * handler.num / num
    handled = wire_bits / max(handler.last - handler.first, 1e-9) / 1e9
    return RecvFigures(cpu / max(1, handler.num) * 1e6, handler.num / num, offered, handled)


def native_read_cpu_us(*, gso: bool, gro: bool, num: int = 20_000) -> float:
    """CPU µs per datagram of the compiled loop's read alone: ``num`` 1,400-byte datagrams are
    queued on a socket first (one ``send`` each, or ``gso``: 40 a UDP segmentation offload
    write), then read in 256-row batches with ``recvmmsg`` or (``gro``) coalesced reads."""
    import numpy as np

    from dtrain.transports.datagram_native import native

    lib = native("on")
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    state = lib.gro_state()
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 << 20)
        rx.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_TIMESTAMPNS", 35), 1)
        if gro:
            rx.setsockopt(socket.SOL_UDP, 104, 1)  # UDP_GRO
        rx.bind(("127.0.0.1", 0))
        tx.connect(rx.getsockname())
        d = os.urandom(1400)
        for _ in range(num // 40 if gso else num):
            if gso:
                tx.sendmsg([d * 40], [(socket.SOL_UDP, 103, struct.pack("H", 1400))])
            else:
                tx.send(d)
        buf, lens = np.zeros((256, 1401), np.uint8), np.zeros(256, np.uint32)
        ts, drops = np.zeros(256, np.int64), np.zeros(1, np.uint32)
        got, t0 = 0, time.thread_time()
        while got < num:
            n = (
                lib.recv_gro(state, rx.fileno(), buf, lens, ts, drops)
                if gro
                else lib.recv(rx.fileno(), buf, lens, ts, drops)
            )
            if n <= 0:
                break
            got += n
        return (time.thread_time() - t0) / max(got, 1) * 1e6
    finally:
        lib.gro_free(state)
        rx.close()
        tx.close()


def hand_on_cpu_us(kind: str, rows: int, *, columns: bool = True, reps: int = 60) -> float:
    """CPU µs per datagram of the receive thread's hand-on alone (``DatagramReceive._hand_on``,
    after the batch was read and opened) for a batch of ``rows`` whole int8 chunks of 1,280 bytes
    from one site of four: ``kind`` ``"mean"`` (a member's: one owner's bucket means) or
    ``"contrib"`` (an owner's: contributions); ``columns``: the compiled columns pass where the
    checkout has it (``_hand_on_means`` / ``_hand_on_plain``), else row by row. Median of ``reps``
    batches, each new (its own sequence numbers; a mean batch in a new round state)."""
    from dtrain.transports.datagram_round import senders_bitmap

    sites = ("site-a", "site-b", "site-c", "site-d")
    key = bytes(range(32))
    t = DatagramTransport(_config(native="on"))
    t.start(CountingHandler())
    if not columns:
        setattr(t, "_hand_on_means" if kind == "mean" else "_hand_on_plain", lambda *a: False)
    members = tuple(Member(site_id=s, address=f"127.0.0.1:{9 + i}") for i, s in enumerate(sites))
    owners = [sites[b % 2] for b in range(8)]  # site-c, this site, owns none: nothing of its own to push
    sealer = Sealer(key, run=0, round=3, sender=0)
    bitmap = senders_bitmap(sites, sites)
    batches = []
    for _ in range(reps):
        fields = [(0, i, 320 * i, 320, codec_id("int8"), 0, 1) for i in range(rows)]
        bodies = [bitmap + bytes(1280) if kind == "mean" else contribution_body(0, bytes(1280))] * rows
        sealed = sealer.seal_many(Kind.MEAN if kind == "mean" else Kind.CONTRIB, fields, bodies)
        buf, lens, ts = np.zeros((256, 1401), np.uint8), np.zeros(256, np.uint32), np.zeros(256, np.int64)
        for i in range(rows):
            d = sealed.datagram(i)
            buf[i, : len(d)], lens[i], ts[i] = np.frombuffer(d, np.uint8), len(d), time.time_ns()
        batches.append((buf, lens, ts))
    times = []
    try:
        for r, (buf, lens, ts) in enumerate(batches):
            if r == 0 or kind == "mean":  # a mean's chunks arrive once a round
                with t._lock:
                    t._rounds.pop(3, None)
                plan = RoundPlan(
                    round=3, members=members, reduce_timeout_s=60, broadcast_timeout_s=60, datagram_key=key
                )
                t.begin_round(plan, owners, "site-c")
            opened = t._opener.open_batch(buf, lens, rows, None)
            c0 = time.thread_time()
            t._hand_on(buf, lens, ts, opened, [])
            times.append(time.thread_time() - c0)
    finally:
        t.stop(0)
    return statistics.median(times) / rows * 1e6


def decode_cpu_us(numel: int, *, batch: bool) -> float:
    """CPU µs (this thread) per datagram-sized int8 chunk of decoding ``numel`` elements: one ``decode``
    per chunk, or ``decode_chunks`` over them (what an owner, each applied mean and the residuals pay)."""
    codec = get_codec("int8")
    step = datagram_chunk_bytes("int8") // 4
    chunks = [(o, min(step, numel - o)) for o in range(0, numel, step)]
    payloads = codec.encode_chunks(torch.randn(numel, generator=torch.Generator().manual_seed(0)), chunks)
    numels = [n for _, n in chunks]
    t0 = time.thread_time()
    if batch:
        codec.decode_chunks(payloads, numels)
    else:
        for p, n in zip(payloads, numels):
            codec.decode(p, numel=n)
    return (time.thread_time() - t0) / len(chunks) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = bench.parser(__doc__, quick="8 MB at one ceiling")
    p.add_argument("--mbytes", type=float, default=64.0, help="payload MB per run")
    p.add_argument("--rate-mbit", type=float, nargs="*", default=[200.0, 400.0, 1000.0], help="pacer ceilings")
    p.add_argument(
        "--loops",
        nargs="*",
        default=["auto", "off"],
        choices=list(LOOPS),
        help="DatagramTransportConfig.native per row: the compiled batch loop where it builds, and the Python loop "
        "(sendmmsg: the compiled loop without UDP segmentation offload; recvmmsg: without coalesced reads)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rates, mbytes = ([400.0], 8.0) if args.quick else (args.rate_mbit, args.mbytes)
    print(f"datagram loop on 127.0.0.1, {mbytes:g} MB of int8 per run")
    row = bench.table(
        "| loop | ceiling Mbit/s | datagrams | send Mbit/s | receive Mbit/s | delivered | send µs/dgram | recv µs/dgram "
        "| send loop Mbit/s per CPU-s | recv loop Mbit/s per CPU-s | send CPU µs/dgram | recv CPU µs/dgram |",
        "| {name} | {ceiling_mbit:.0f} | {datagrams} | {send_mbit:.0f} | {recv_mbit:.0f} | {delivered:.3f} | {send_us:.1f} "
        "| {recv_us:.1f} | {send_cpu_mbit:.0f} | {recv_cpu_mbit:.0f} | {send_cpu_us:.1f} | {recv_cpu_us:.1f} |",
    )
    figures = []
    for i, (loop, rate) in enumerate((loop, rate) for rate in rates for loop in args.loops):
        native = "on" if loop in ("sendmmsg", "recvmmsg") else loop
        r = run_one(rate, mbytes, round=i, native=native, gso=loop != "sendmmsg", gro=loop != "recvmmsg")
        figures.append(row({"loop": loop, **r}, name=LOOPS[loop]))
    iso = {}
    if "auto" in args.loops or "on" in args.loops:
        has_gso = "gso" in DatagramTransportConfig.__dataclass_fields__  # an older checkout: sendmmsg only
        iso = {
            "push_gso_us": isolated_push_cpu_us(gso=True) if has_gso else None,
            "push_sendmmsg_us": isolated_push_cpu_us(gso=False),
        }
        iso["recv_us"], iso["recv_delivered"], *_ = isolated_recv_cpu_us(gso=False, gro=True)
        iso["recv_gso_recvmmsg_us"], *_ = isolated_recv_cpu_us(gso=True, gro=False)
        has_gro = "gro" in DatagramTransportConfig.__dataclass_fields__  # an older checkout: recvmmsg only
        iso["recv_gso_gro_us"], *_ = isolated_recv_cpu_us(gso=True, gro=True) if has_gro else (None,)
        # back to back, as the push above is measured: the fixed cost of a wake-up spread over more datagrams
        unpaced = isolated_recv_cpu_us(gso=True, gro=has_gro, gap_s=0.0)
        iso["recv_unpaced"] = unpaced._asdict()
        if has_gro:
            for sender in ("send", "gso"):
                for how in ("recvmmsg", "gro"):
                    reads = [native_read_cpu_us(gso=sender == "gso", gro=how == "gro") for _ in range(5)]
                    iso[f"read_{sender}_{how}_us"] = statistics.median(reads)
        gso = f"{iso['push_gso_us']:.2f} (UDP GSO), " if has_gso else ""
        gro = f", with UDP GRO {iso['recv_gso_gro_us']:.2f}" if has_gro else ""
        print(
            f"\ncompiled loop, each side alone, CPU µs per datagram: unpaced push {gso}"
            f"{iso['push_sendmmsg_us']:.2f} (sendmmsg); receive thread {iso['recv_us']:.2f} from a sender "
            f"of one send per datagram (delivered {iso['recv_delivered']:.3f}); from a GSO sender "
            f"(as dtrain sends) with recvmmsg {iso['recv_gso_recvmmsg_us']:.2f}{gro}, in bursts 1.5 ms apart; "
            f"from the GSO sender unpaced ({unpaced.offered_gbit:.1f} Gbit/s offered) {unpaced.cpu_us:.2f} "
            f"(delivered {unpaced.delivered:.3f} at {unpaced.handled_gbit:.2f} Gbit/s; "
            f"{1400 * 8 / unpaced.cpu_us / 1e3:.1f} Gbit/s per CPU-second)"
        )
        if has_gro:
            print(
                "the read alone (20,000 queued, medians of 5), CPU µs per datagram: from a per-datagram sender "
                f"recvmmsg {iso['read_send_recvmmsg_us']:.2f}, GRO {iso['read_send_gro_us']:.2f}; from a GSO sender "
                f"recvmmsg {iso['read_gso_recvmmsg_us']:.2f}, GRO {iso['read_gso_gro_us']:.2f}"
            )
    hand_on = {
        f"{kind}_{rows}_{how}_us": hand_on_cpu_us(kind, rows, columns=how == "columns")
        for kind in ("contrib", "mean")
        for rows in (16, 64, 256)
        for how in ("columns", "rows")
    }
    print(
        "\nthe receive thread's hand-on alone, CPU µs per datagram (medians of 60 batches of 16 / 64 / 256 rows), "
        "columns against rows:"
        + "".join(
            f"\n  {who}: "
            + ", ".join(
                f"{hand_on[f'{kind}_{r}_columns_us']:.2f} / {hand_on[f'{kind}_{r}_rows_us']:.2f}" for r in (16, 64, 256)
            )
            for kind, who in (("contrib", "an owner's contributions"), ("mean", "a member's mean chunks"))
        )
    )
    numel = 1 << 20 if args.quick else 10_000_000
    per_chunk, batched = decode_cpu_us(numel, batch=False), decode_cpu_us(numel, batch=True)
    print(
        f"\nint8 decode of {numel:,} elements in datagram chunks, CPU µs per chunk: one decode each "
        f"{per_chunk:.1f}, decode_chunks {batched:.1f} ({per_chunk / batched:.1f}x)"
    )
    decode = {"numel": numel, "per_chunk_us": per_chunk, "batched_us": batched}
    bench.write(args, "bench_datagram", {"loops": figures, "isolated": iso, "hand_on": hand_on, "decode": decode})
    return 0


if __name__ == "__main__":
    sys.exit(main())
