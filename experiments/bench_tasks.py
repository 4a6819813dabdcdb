"""Measure the built-in task: step time per preset and a validation-loss curve (prints a table).

Runs at ``torch.set_num_threads(1)`` unless ``--threads`` says otherwise, as ``dtrain launch``
runs its workers on a small machine. Speed targets are measured, not asserted.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch

from dtrain.tasks import PRESETS, TaskSpec, build_task
from experiments import bench
from experiments.common import inner_step


def _step(task) -> tuple[float, float]:
    """One inner step: (wall s, process CPU s; on a busy machine the better estimate of an idle core's)."""
    t0, c0 = time.perf_counter(), time.process_time()
    inner_step(task)
    return time.perf_counter() - t0, time.process_time() - c0


def _timed_site(args: tuple[str, str, int, int, float, float, int]) -> list[tuple[float, int, float]]:
    """Train one site (no synchronisation) for ``seconds``; ``(wall s, step, val loss)`` every ``every_s``."""
    size, data, site, num_sites, seconds, every_s, threads = args
    torch.set_num_threads(threads)
    task = build_task(TaskSpec(site_index=site, num_sites=num_sites, size=size, data=data))
    curve = [(0.0, 0, task.evaluate(task.model))]
    t0 = time.perf_counter()
    step, next_eval = 0, every_s
    while (now := time.perf_counter() - t0) < seconds:
        _step(task)
        step += 1
        if now >= next_eval:
            curve.append((now, step, task.evaluate(task.model)))
            next_eval += every_s
    curve.append((time.perf_counter() - t0, step, task.evaluate(task.model)))
    return curve


def main(argv: list[str] | None = None) -> None:
    ap = bench.parser(__doc__)
    ap.add_argument("--sizes", default=",".join(PRESETS), help="comma-separated presets")
    ap.add_argument("--data", default="stdlib")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60, help="timed steps (after 5 warm-up steps)")
    ap.add_argument("--curve", type=int, default=0, help="train this many steps and print val loss")
    ap.add_argument("--every", type=int, default=100, help="evaluate every this many steps (--curve)")
    ap.add_argument("--sites", type=int, default=0, help="run this many sites concurrently (no sync)")
    ap.add_argument("--seconds", type=float, default=60.0, help="training seconds per site (--sites)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    if args.sites:
        size = args.sizes.split(",")[0]
        jobs = [(size, args.data, i, args.sites, args.seconds, 10.0, args.threads) for i in range(args.sites)]
        with mp.get_context("spawn").Pool(args.sites) as pool:
            curves = pool.map(_timed_site, jobs)
        for i, curve in enumerate(curves):
            points = "  ".join(f"{t:.0f}s/{step}:{val:.3f}" for t, step, val in curve)
            print(f"site {i} ({size}, wall s/step:val loss): {points}", flush=True)
        return

    figures = []
    for size in args.sizes.split(","):
        task = build_task(TaskSpec(site_index=0, num_sites=1, size=size, data=args.data))
        if args.curve:
            t0 = time.perf_counter()
            print(f"{size}: step 0 val {task.evaluate(task.model):.3f}", flush=True)
            for i in range(1, args.curve + 1):
                _step(task)
                if i % args.every == 0 or i == args.curve:
                    val = task.evaluate(task.model)
                    print(f"{size}: step {i} val {val:.3f} ({time.perf_counter() - t0:.1f} s)", flush=True)
            continue
        for _ in range(5):  # warm-up
            _step(task)
        walls, cpus = zip(*(_step(task) for _ in range(args.steps)))
        med, cpu_med = statistics.median(walls), statistics.median(cpus)
        (eval_s,) = bench.times(lambda: task.evaluate(task.model), 1)
        print(
            f"{size:6s} params {task.info['num_params'] / 1e6:.3f} M  B x T {task.info['batch_size']} x "
            f"{task.info['context_len']}  step median {med * 1e3:.1f} ms (mean {statistics.mean(walls) * 1e3:.1f}, "
            f"CPU {cpu_med * 1e3:.1f})  "
            f"{task.tokens_per_batch / med:,.0f} tok/s  evaluate {eval_s * 1e3:.0f} ms  threads {args.threads}",
            flush=True,
        )
        figures.append({"size": size, "step_s": med, "cpu_s": cpu_med, "tok_s": task.tokens_per_batch / med})
    bench.write(args, "bench_tasks", figures)


if __name__ == "__main__":
    main()
