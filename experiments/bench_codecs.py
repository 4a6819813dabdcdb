"""Benchmark the codecs on a realistic pseudo-gradient (prints markdown tables).

One site of the built-in task (GPT ``base``, ``small`` with ``--quick``) trains a few warm-up
steps, then ``--inner-steps`` more: Δ = θ before − θ after
(:func:`experiments.common.pseudo_gradient`, as the codec sweep). Δ is tiled to ``--numel``
elements and cut into buckets of ``--bucket-elems`` (default 1 Mi elements = 4 MiB of fp32, the
default bucket), as the round engine calls the codecs; no bucket is longer than Δ, so none holds
a repeat zstd could exploit.

Per codec, with and without the zstd stage: compression ratio (fp32 bytes / payload bytes),
encode and decode MB/s of fp32 input on one core (CPU time of this thread, robust to other
processes; wall-clock figures go to the JSON), and relative L2 error ||x̂ − x|| / ||x||; medians
over ``--repeats``. A second table times the zstd stage alone on each codec's body.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import zstandard

from dtrain.codecs import CODEC_NAMES, HEADER_BYTES, CodecConfig, get_codec
from dtrain.tasks import TaskSpec
from experiments import bench
from experiments.common import pseudo_gradient


def bench_codec(name: str, buckets: list[torch.Tensor], repeats: int, level: int) -> dict:
    codec = get_codec(CodecConfig(name=name, zstd_level=level))
    total = sum(b.numel() for b in buckets)
    mb = total * 4 / 1e6
    cpu, wall = bench.Stopwatch(time.thread_time), bench.Stopwatch()
    for _ in range(repeats):
        with cpu("encode"), wall("encode"):
            payloads = [codec.encode(b) for b in buckets]
        with cpu("decode"), wall("decode"):
            decoded = [codec.decode(p, numel=b.numel()) for p, b in zip(payloads, buckets)]
    x, y = torch.cat(buckets).double(), torch.cat(decoded).double()
    nbytes = sum(len(p) for p in payloads)
    return {
        "codec": name,
        "zstd_level": level if name.endswith("+zstd") else None,
        "ratio": total * 4 / nbytes,
        "bytes": nbytes,
        **{f"{k}_mb_s": mb / statistics.median(cpu.laps[k]) for k in ("encode", "decode")},
        **{f"{k}_mb_s_wall": mb / statistics.median(wall.laps[k]) for k in ("encode", "decode")},
        "rel_l2": float((y - x).norm() / x.norm()),
    }


def bench_zstd_stage(base: str, buckets: list[torch.Tensor], repeats: int, level: int) -> dict:
    """Time zstd alone on the bodies the base codec produces."""
    codec = get_codec(base)
    bodies = [codec.encode(b)[HEADER_BYTES:] for b in buckets]
    mb = sum(b.numel() for b in buckets) * 4 / 1e6
    cctx = zstandard.ZstdCompressor(level=level)
    dctx = zstandard.ZstdDecompressor()
    frames = [cctx.compress(b) for b in bodies]
    comp = bench.times(lambda: [cctx.compress(b) for b in bodies], repeats, clock=time.thread_time)
    decomp = bench.times(
        lambda: [dctx.decompress(f, max_output_size=len(b)) for f, b in zip(frames, bodies)],
        repeats,
        clock=time.thread_time,
    )
    body_bytes = sum(len(b) for b in bodies)
    return {
        "body": base,
        "zstd_level": level,
        "zstd_ratio": body_bytes / sum(len(f) for f in frames),
        "compress_body_mb_s": body_bytes / 1e6 / statistics.median(comp),
        "compress_fp32_mb_s": mb / statistics.median(comp),
        "decompress_fp32_mb_s": mb / statistics.median(decomp),
    }


def main(argv: list[str] | None = None) -> int:
    ap = bench.parser(__doc__, quick="small model, 1 Mi elements, 2 repeats")
    ap.add_argument("--numel", type=int, default=16 * 1024 * 1024, help="elements of Δ")
    ap.add_argument("--bucket-elems", type=int, default=1 << 20, help="0: one bucket")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--zstd-level", type=int, default=3)
    ap.add_argument("--zstd-levels", default="1,3,9", help="levels for the zstd-stage table")
    ap.add_argument("--inner-steps", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.numel = 1 << 20 if args.numel == 16 * 1024 * 1024 else args.numel
        args.repeats, args.inner_steps = 2, 10
    size, warmup_steps = ("small", 3) if args.quick else ("base", 10)
    delta = pseudo_gradient(TaskSpec(site_index=0, num_sites=1, size=size), warmup_steps, args.inner_steps)
    print(f"# model: built-in GPT `{size}`, {delta.numel():,} parameters; Δ over {args.inner_steps} inner steps")
    x = delta.repeat(math.ceil(args.numel / delta.numel()))[: args.numel].contiguous()  # Δ tiled to --numel
    if args.bucket_elems > delta.numel() or (args.bucket_elems <= 0 and args.numel > delta.numel()):
        # A bucket longer than Δ would hold a repeat of itself, which zstd would find
        # and report as compression that real pseudo-gradients do not have.
        args.bucket_elems = 1 << (delta.numel().bit_length() - 1)
        print(f"# bucket size cut to {args.bucket_elems:,} elements (< model size)", flush=True)
    buckets = list(torch.split(x, args.bucket_elems)) if args.bucket_elems > 0 else [x]
    print(
        f"# Δ: {args.numel:,} elements ({args.numel * 4 / 2**20:.0f} MiB fp32) in {len(buckets)} bucket(s); rms "
        f"{float(x.pow(2).mean().sqrt()):.3e}, max|Δ| {float(x.abs().max()):.3e}; zstandard {zstandard.__version__}; "
        f"one thread; medians of {args.repeats}\n",
        flush=True,
    )
    row = bench.table(
        "| codec | ratio | encode MB/s | decode MB/s | rel. L2 error |",
        "| {codec} | {ratio:.2f} | {encode_mb_s:.0f} | {decode_mb_s:.0f} | {rel_l2:.2e} |",
    )
    rows = [row(bench_codec(n, buckets, args.repeats, args.zstd_level)) for b in CODEC_NAMES for n in (b, b + "+zstd")]
    levels = [int(v) for v in args.zstd_levels.split(",") if v]
    bodies = ("fp32", "bf16", "int8", "int4", "topk")
    zrows = [bench_zstd_stage(base, buckets, args.repeats, lvl) for base in bodies for lvl in levels]
    print("\nzstd stage alone (on each codec's body; MB/s of the fp32 input it stands for):\n")
    bench.table(
        "| body | level | zstd ratio | compress MB/s (body) | compress MB/s (fp32) | decompress MB/s (fp32) |",
        "| {body} | {zstd_level} | {zstd_ratio:.3f} | {compress_body_mb_s:.0f} | {compress_fp32_mb_s:.0f} "
        "| {decompress_fp32_mb_s:.0f} |",
        zrows,
    )
    bench.write(args, "bench_codecs", {"codecs": rows, "zstd_stage": zrows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
