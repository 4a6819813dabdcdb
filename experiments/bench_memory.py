"""Extra resident memory a site needs for DiLoCo beyond plain training (prints a table).

For a model of ~25M parameters, the process's peak RSS (sampled every 2 ms from /proc/self/statm)
for plain training (model + AdamW, a few inner steps) and for the same plus DiLoCo (θ fp32 copy,
outer SGD-Nesterov momentum, error-feedback residuals, encode buffers) through a few rounds with
the given codec; the difference per parameter, against the target of 3.5 x 4 bytes per parameter
(issue 2), and the largest single temporary the round engine allocates (one bucket). One site
runs alone, so it owns and aggregates every bucket: the owner's accumulators are the worst case.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading

import torch

from dtrain import DiLoCo, DiLoCoConfig
from dtrain.codecs import CodecConfig
from dtrain.rounds import RoundConfig
from experiments import bench
from experiments.bench_site_group import make_model

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRss:
    """Samples RSS in a thread; ``peak`` is the max seen since ``reset``."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes())

    def reset(self) -> None:
        self.peak = rss_bytes()

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        model(torch.randn(8, 1024)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def trim() -> int:
    """RSS after handing freed heap pages back to the OS (glibc malloc_trim)."""
    gc.collect()
    with contextlib.suppress(OSError):  # no glibc here: RSS as it is
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_bytes()


def main(argv: list[str] | None = None) -> None:
    ap = bench.parser(__doc__)
    ap.add_argument("--params-m", type=float, default=25.0, help="model size in millions of parameters")
    ap.add_argument("--codec", default="int8+zstd")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sync-every", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sampler = PeakRss()

    model = make_model(round(args.params_m * 1e6))
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_steps(model, opt, args.sync_every * args.rounds)
    gc.collect()
    sampler.reset()
    train_steps(model, opt, args.sync_every * args.rounds)
    plain_peak = sampler.peak
    plain_trimmed = trim()
    sampler.reset()

    cfg = DiLoCoConfig(sync_every=args.sync_every, rounds=RoundConfig(codec=CodecConfig(name=args.codec)))
    diloco = DiLoCo(model, opt, config=cfg)
    train_steps(model, opt, args.sync_every * args.rounds)  # rounds run inside (hooked optimizer)
    gc.collect()
    steady = rss_bytes()
    trimmed = trim()
    diloco_peak = sampler.peak
    sampler.stop()
    bucket_bytes = max(b.numel for b in diloco.layout.buckets) * 4
    diloco.close()

    f = {"params": n, "plain_peak": plain_peak / n, "extra_peak": (diloco_peak - plain_peak) / n}  # bytes/param
    f |= {"extra_steady": (steady - plain_peak) / n, "extra_trimmed": (trimmed - plain_trimmed) / n}
    print(f"model: {n / 1e6:.1f}M parameters, codec {args.codec}, {args.rounds} rounds, H={args.sync_every}, one site")
    print("\n| measure | bytes/param | target |")
    print("|---|---|---|")
    print(f"| plain training peak RSS | {f['plain_peak']:.2f} | |")
    print(f"| extra for DiLoCo, peak during rounds | {f['extra_peak']:.2f} | <= {3.5 * 4:.1f} |")
    print(f"| extra for DiLoCo, after rounds (steady) | {f['extra_steady']:.2f} | |")
    print(f"| extra for DiLoCo, steady, both after malloc_trim | {f['extra_trimmed']:.2f} | |")
    print(f"| one bucket (largest engine temporary) | {bucket_bytes / n:.3f} ({bucket_bytes / 2**20:.1f} MiB) | |")
    print("\nexpected steady extra: θ 4 + outer momentum 4 + residual 4 = 12 bytes/param")
    bench.write(args, "bench_memory", {**f, "bucket_bytes": bucket_bytes})


if __name__ == "__main__":
    main()
