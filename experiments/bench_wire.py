"""The hand codec of the Peer bulk messages (dtrain/transports/grpc_wire.py) against the generated
protobuf classes, on the same messages, in one process.

Per payload size, ``--reps`` timings after a warm-up (median) of: contribution encode
(``encode_contribution`` vs ``pb.ContributionChunk(...).SerializeToString()``), contribution
decode (``decode_contribution`` vs ``FromString`` and taking ``.payload``), and the mean stream
in ``--part-bytes`` parts (``mean_to_wire`` / ``mean_from_wire`` vs the same ``pb.MeanPart``
messages, payload joined). Printed: MB/s of payload; "copies", the time over that of one plain
copy of the payload (``bytes(memoryview(p))`` is 1.0); "py-heap", the peak Python-heap allocation
(tracemalloc) over the payload size (a lower bound for the generated classes, whose arena
tracemalloc does not see). Both codecs' outputs are checked equal before anything is timed.
"""

from __future__ import annotations

import os
import statistics
import tracemalloc

from dtrain._proto.dtrain.v1 import peer_pb2 as pb
from dtrain.protocol import BucketMean, Contribution, MeanChunk
from dtrain.transports import grpc_wire as wire
from experiments import bench

MiB = 1 << 20


# the generated-class path: the same messages through protobuf's classes
def pb_encode_contribution(c: Contribution) -> bytes:
    return pb.ContributionChunk(
        round=c.round,
        bucket=c.bucket,
        chunk=c.chunk,
        offset=c.offset,
        numel=c.numel,
        codec=c.codec,
        sender=c.sender,
        payload=c.payload,
    ).SerializeToString()


def pb_decode_contribution(data: bytes) -> Contribution:
    m = pb.ContributionChunk.FromString(data)
    return Contribution(
        round=m.round,
        bucket=m.bucket,
        chunk=m.chunk,
        offset=m.offset,
        numel=m.numel,
        codec=m.codec,
        sender=m.sender,
        payload=m.payload,
    )


def pb_mean_to_wire(mean: BucketMean, part_bytes: int) -> list[bytes]:
    header = pb.MeanHeader(
        round=mean.round,
        bucket=mean.bucket,
        owner=mean.owner,
        checksum_before=mean.checksum_before,
        checksum_after=mean.checksum_after,
        num_chunks=len(mean.chunks),
    )
    out = []
    for i, ch in enumerate(mean.chunks):
        chunk = pb.MeanChunkHeader(
            chunk=ch.chunk,
            offset=ch.offset,
            numel=ch.numel,
            codec=ch.codec,
            senders=list(ch.senders),
            payload_bytes=len(ch.payload),
        )
        for off in range(0, len(ch.payload), part_bytes):
            part = pb.MeanPart(data=ch.payload[off : off + part_bytes])
            if i == 0 and off == 0:
                part.header.CopyFrom(header)
            if off == 0:
                part.chunk.CopyFrom(chunk)
            out.append(part.SerializeToString())
    return out


def pb_mean_from_wire(parts: list[bytes]) -> BucketMean:
    header, chunks = None, []  # chunks: (chunk header, its payload pieces) in stream order
    for raw in parts:
        m = pb.MeanPart.FromString(raw)
        if m.HasField("header"):
            header = m.header
        if m.HasField("chunk"):
            chunks.append((m.chunk, []))
        chunks[-1][1].append(m.data)
    return BucketMean(
        round=header.round,
        bucket=header.bucket,
        owner=header.owner,
        chunks=tuple(
            MeanChunk(
                chunk=c.chunk,
                offset=c.offset,
                numel=c.numel,
                codec=c.codec,
                payload=b"".join(pieces),
                senders=tuple(c.senders),
            )
            for c, pieces in chunks
        ),
        checksum_before=header.checksum_before,
        checksum_after=header.checksum_after,
    )


def measure(size: int, part_bytes: int, reps: int) -> list[dict]:
    payload = os.urandom(size)
    c = Contribution(
        round=7, bucket=3, chunk=0, offset=0, numel=size // 4, codec="fp32", sender="site-1", payload=payload
    )
    chunk = MeanChunk(chunk=0, offset=0, numel=size // 4, codec="fp32", payload=payload, senders=("a", "b"))
    mean = BucketMean(
        round=7, bucket=3, owner="site-0", chunks=(chunk,), checksum_before="0" * 16, checksum_after="1" * 16
    )
    hand_c, pb_c = wire.encode_contribution(c), pb_encode_contribution(c)
    assert wire.decode_contribution(pb_c) == c and pb_decode_contribution(hand_c) == c
    hand_parts = list(wire.mean_to_wire(mean, part_bytes))
    pb_parts = pb_mean_to_wire(mean, part_bytes)
    assert hand_parts == pb_parts, "the hand codec's MeanParts differ from protobuf's"
    assert wire.mean_from_wire(pb_parts) == mean and pb_mean_from_wire(hand_parts) == mean
    view = memoryview(payload)
    copy_s = statistics.median(bench.times(lambda: bytes(view), reps, warmup=1))  # one copy into a new bytes object
    cases = [
        ("contribution encode", lambda: wire.encode_contribution(c), lambda: pb_encode_contribution(c)),
        ("contribution decode", lambda: wire.decode_contribution(hand_c), lambda: pb_decode_contribution(pb_c)),
        (
            "mean stream encode",
            lambda: list(wire.mean_to_wire(mean, part_bytes)),
            lambda: pb_mean_to_wire(mean, part_bytes),
        ),
        ("mean stream decode", lambda: wire.mean_from_wire(hand_parts), lambda: pb_mean_from_wire(pb_parts)),
    ]
    rows = []
    for name, hand, gen in cases:
        for codec, fn in (("hand", hand), ("protobuf", gen)):
            s = statistics.median(bench.times(fn, reps, warmup=1))
            tracemalloc.start()
            fn()
            heap = tracemalloc.get_traced_memory()[1]  # the peak
            tracemalloc.stop()
            r = {"operation": name, "codec": codec, "ms": s * 1e3, "mb_s": size / s / 1e6, "copies": s / copy_s}
            rows.append({**r, "heap": heap / size})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = bench.parser(__doc__)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--part-bytes", type=int, default=1 * MiB, help="MeanPart payload size (GrpcTransportConfig)")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    if args.reps < 1 or args.part_bytes < 1 or min(args.sizes_mib) < 1:
        ap.error("--reps, --part-bytes and --sizes-mib must be >= 1")
    row = bench.table(
        "| payload MiB | operation | codec | ms | MB/s | copies | py-heap |",
        "| {mib} | {operation} | {codec} | {ms:.2f} | {mb_s:.0f} | {copies:.1f} | {heap:.1f}x |",
    )
    figures = [row({"mib": mib, **r}) for mib in args.sizes_mib for r in measure(mib * MiB, args.part_bytes, args.reps)]
    bench.write(args, "bench_wire", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
