"""Throughput of the gRPC transport on loopback against a raw-socket baseline.

For each payload size (default 1, 16 and 128 MiB), in the same run:

* push: one ``GrpcTransport.push`` of ``--chunk-bytes`` contributions to a peer that discards
  them, vs a raw TCP ``sendall`` of the same bytes to a peer that acknowledges with one byte;
* pull: one ``GrpcTransport.pull_mean`` (streamed in ``--part-bytes`` parts), vs a raw TCP
  receive into one reused buffer (``raw``) and into new ``--chunk-bytes`` buffers kept until the
  call ends (``raw-fresh``: what a transport that returns the payload must do; first-touch page
  faults cost more than the copy here).

The server runs in its own process; gRPC and raw calls alternate, so load changes hit both
alike. Per figure, ``--reps`` timed calls after a warm-up: MiB/s of the median and best call,
the gRPC/raw ratio of both (target >= 0.70), and both processes' CPU time per MiB (user+sys).
"""

from __future__ import annotations

import os
import socket
import statistics
import struct
import sys
import threading
import time
from typing import Callable

from experiments import bench

MiB = 1 << 20


def _grpc_server(conn, sizes_mib: list[int], part_bytes: int, chunk_bytes: int, options: tuple) -> None:
    from dtrain.protocol import BucketMean, MeanChunk
    from dtrain.transports.grpc import GrpcTransport, GrpcTransportConfig

    blob = os.urandom(max(sizes_mib) * MiB)
    means: dict[int, BucketMean] = {}

    class Sink:
        def handle_contribution(self, c) -> None:
            pass

        def handle_pull_mean(self, round, bucket, requester, timeout_s, *, have_checksum=""):  # bucket = size in MiB
            if bucket not in means:
                n = bucket * MiB
                chunks = tuple(
                    MeanChunk(chunk=i, offset=off // 4, numel=min(chunk_bytes, n - off) // 4, codec="fp32",
                              payload=blob[off : off + chunk_bytes], senders=("a", "b"))
                    for i, off in enumerate(range(0, n, chunk_bytes))
                )  # fmt: skip
                means[bucket] = BucketMean(round=round, bucket=bucket, owner="srv", chunks=chunks, checksum_before="",
                                           checksum_after="")  # fmt: skip
            return means[bucket]

    t = GrpcTransport(GrpcTransportConfig(part_bytes=part_bytes, extra_options=options))
    conn.send(t.start(Sink()))
    bench.answer(conn)
    t.stop(0)


def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def _raw_server(conn, sizes_mib: list[int]) -> None:
    blob = os.urandom(max(sizes_mib) * MiB)
    sink = bytearray(len(blob))
    lsock = socket.create_server(("127.0.0.1", 0), backlog=1)
    conn.send(lsock.getsockname())
    threading.Thread(target=bench.answer, args=(conn,)).start()  # answers until "stop"
    s, _ = lsock.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = bytearray(9)
    while True:
        try:
            _recv_exact(s, memoryview(header))
        except ConnectionError:
            break
        op, n = struct.unpack("!cQ", header)
        if op == b"P":  # client pushes n bytes; ack with one byte
            _recv_exact(s, memoryview(sink)[:n])
            s.sendall(b"k")
        else:  # client pulls n bytes
            s.sendall(memoryview(blob)[:n])
    s.close()
    lsock.close()


def _measure(calls: dict[str, tuple[Callable[[], None], bench.Server]], reps: int) -> dict[str, tuple[float, ...]]:
    """Seconds per call (median, best) and CPU seconds per call (client + server) of each function."""
    for fn, _ in calls.values():
        fn()  # warm-up: connection, first-use allocations
    wall, cpu = bench.Stopwatch(), dict.fromkeys(calls, 0.0)
    for _ in range(reps):  # alternate so that a change in machine load hits both alike
        for name, (fn, server) in calls.items():
            s0, c0 = server.ask(), time.process_time()
            with wall(name):
                fn()
            cpu[name] += time.process_time() - c0 + server.ask() - s0
    return {name: (statistics.median(wall.laps[name]), min(wall.laps[name]), cpu[name] / reps) for name in calls}


def _row(size_mib: int, direction: str, baseline: str, g: tuple, r: tuple, reps: int) -> dict:
    row = {"size_mib": size_mib, "direction": direction, "baseline": baseline, "reps": reps}
    for name, (median_s, best_s, cpu_s) in (("grpc", g), ("raw", r)):
        row[f"{name}_median_mib_s"], row[f"{name}_best_mib_s"] = size_mib / median_s, size_mib / best_s
        row[f"{name}_cpu_ms_per_mib"] = 1000 * cpu_s / size_mib
    return {**row, "ratio_median": r[0] / g[0], "ratio_best": r[1] / g[1]}


def main(argv: list[str] | None = None) -> int:
    ap = bench.parser(__doc__)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--reps", type=int, default=7, help="timed calls per figure (at least 20 for sizes < 16 MiB)")
    ap.add_argument("--chunk-bytes", type=int, default=1 * MiB, help="contribution / mean chunk size")
    ap.add_argument("--part-bytes", type=int, default=1 * MiB, help="streamed part size of a pulled mean")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=INT",
                    help="extra gRPC channel/server argument (repeatable), e.g. grpc.http2.write_buffer_size=4194304")  # fmt: skip
    args = ap.parse_args(argv)

    from dtrain.protocol import Contribution
    from dtrain.transports.grpc import GrpcTransport, GrpcTransportConfig

    options = tuple((k, int(v)) for k, v in (o.split("=", 1) for o in args.option))
    grpc_srv = bench.Server(_grpc_server, args.sizes_mib, args.part_bytes, args.chunk_bytes, options)
    raw_srv = bench.Server(_raw_server, args.sizes_mib)
    client = GrpcTransport(GrpcTransportConfig(part_bytes=args.part_bytes, extra_options=options))
    raw = socket.create_connection(raw_srv.address)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    blob = os.urandom(max(args.sizes_mib) * MiB)
    sink = bytearray(len(blob))
    ack = bytearray(1)

    rows = []
    try:
        for size in args.sizes_mib:
            n = size * MiB
            view = memoryview(blob)
            cs = [
                Contribution(round=1, bucket=0, chunk=i, offset=off // 4, numel=min(args.chunk_bytes, n - off) // 4,
                             codec="fp32", sender="bench", payload=bytes(view[off : off + args.chunk_bytes]))
                for i, off in enumerate(range(0, n, args.chunk_bytes))
            ]  # fmt: skip

            def grpc_push() -> None:
                assert client.push(grpc_srv.address, cs, timeout_s=300) == len(cs)

            def grpc_pull() -> None:
                mean = client.pull_mean(grpc_srv.address, 1, size, requester="bench", timeout_s=300)
                assert sum(len(c.payload) for c in mean.chunks) == n

            def raw_push() -> None:
                raw.sendall(struct.pack("!cQ", b"P", n))
                raw.sendall(view[:n])
                _recv_exact(raw, memoryview(ack))

            def raw_pull() -> None:
                raw.sendall(struct.pack("!cQ", b"G", n))
                _recv_exact(raw, memoryview(sink)[:n])

            def raw_pull_fresh() -> None:
                # Like a transport that hands the payload out: new chunk buffers, kept
                # until the call ends (first-touch page faults included, as for gRPC).
                raw.sendall(struct.pack("!cQ", b"G", n))
                kept = []
                for off in range(0, n, args.chunk_bytes):
                    buf = bytearray(min(args.chunk_bytes, n - off))
                    _recv_exact(raw, memoryview(buf))
                    kept.append(buf)

            reps = args.reps if size >= 16 else max(args.reps, 20)
            push = _measure({"grpc": (grpc_push, grpc_srv), "raw": (raw_push, raw_srv)}, reps)
            rows.append(_row(size, "push", "raw", push["grpc"], push["raw"], reps))
            pull = _measure(
                {"grpc": (grpc_pull, grpc_srv), "raw": (raw_pull, raw_srv), "fresh": (raw_pull_fresh, raw_srv)}, reps
            )
            rows.append(_row(size, "pull", "raw", pull["grpc"], pull["raw"], reps))
            rows.append(_row(size, "pull", "raw-fresh", pull["grpc"], pull["fresh"], reps))
    finally:
        client.stop(0)
        raw.close()
        grpc_srv.stop()
        raw_srv.stop()

    print(f"gRPC transport vs raw TCP, 127.0.0.1; chunk {args.chunk_bytes} B, part {args.part_bytes} B\n")
    bench.table(
        "| size MiB | dir | baseline | gRPC MiB/s (median) | raw MiB/s (median) | ratio (median) | gRPC MiB/s (best) "
        "| raw MiB/s (best) | ratio (best) | gRPC CPU ms/MiB | raw CPU ms/MiB |",
        "| {size_mib} | {direction} | {baseline} | {grpc_median_mib_s:.0f} | {raw_median_mib_s:.0f} | {ratio_median:.2f} "
        "| {grpc_best_mib_s:.0f} | {raw_best_mib_s:.0f} | {ratio_best:.2f} | {grpc_cpu_ms_per_mib:.2f} "
        "| {raw_cpu_ms_per_mib:.2f} |",
        rows,
    )
    bench.write(args, "bench_transport", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
