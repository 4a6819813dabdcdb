"""Measure the built-in task: step time per preset and a validation-loss curve.

Usage (prints a table; no asserts — speed targets are measured, not tested)::

    python -m dtrain.tasks.bench                      # step times of tiny, small, base
    python -m dtrain.tasks.bench --sizes small --curve 1000 --every 100

Runs at ``torch.set_num_threads(1)`` unless ``--threads`` says otherwise, because
that is how ``dtrain launch`` runs its workers on a small machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dtrain.tasks import PRESETS, TaskSpec, build_task

__all__ = ["main"]


def _step(task) -> float:
    t0 = time.perf_counter()
    loss = task.loss(task.model, next(task.batches))
    loss.backward()
    task.optimizer.step()
    task.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(PRESETS), help="comma-separated presets")
    ap.add_argument("--data", default="stdlib")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60, help="timed steps (after 5 warm-up steps)")
    ap.add_argument("--curve", type=int, default=0, help="train this many steps and print val loss")
    ap.add_argument("--every", type=int, default=100, help="evaluate every this many steps (--curve)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

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
        for _ in range(5):
            _step(task)
        times = [_step(task) for _ in range(args.steps)]
        med = statistics.median(times)
        t0 = time.perf_counter()
        task.evaluate(task.model)
        eval_s = time.perf_counter() - t0
        print(
            f"{size:6s} params {task.info['num_params'] / 1e6:.3f} M  B x T {task.info['batch_size']} x "
            f"{task.info['context_len']}  step median {med * 1e3:.1f} ms (mean {statistics.mean(times) * 1e3:.1f})  "
            f"{task.tokens_per_batch / med:,.0f} tok/s  evaluate {eval_s * 1e3:.0f} ms  threads {args.threads}",
            flush=True,
        )


if __name__ == "__main__":
    main()
