"""What the owner's canonical reduction order costs (prints a markdown table).

An owner sums each chunk's contributions in sender-id order, whatever order they arrive in
(``dtrain.aggregation.ChunkAccumulator``), so the mean is bit-identical across runs; one ahead of
its turn is held until the senders before it arrive. Per arrival pattern: CPU time of this thread
to add every contribution and finalize one chunk (median over ``--repeats``, one torch thread),
the most decoded chunks held out of turn at once, and whether the mean equals the in-order one.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from dtrain.aggregation import AggregationConfig, ChunkAccumulator
from experiments import bench


def _run(order: list[str], senders: list[str], vals: dict[str, torch.Tensor]) -> tuple[float, int, torch.Tensor]:
    acc = ChunkAccumulator(next(iter(vals.values())).numel(), AggregationConfig(), order=senders)
    held = 0
    t = time.thread_time()
    for s in order:
        acc.add(s, vals[s], s.encode())
        held = max(held, acc.num_held)  # contributions waiting for their turn
    mean, _, _ = acc.finalize()
    return time.thread_time() - t, held, mean


def main(argv: list[str] | None = None) -> None:
    ap = bench.parser(__doc__)
    ap.add_argument("--senders", type=int, default=8)
    ap.add_argument("--numel", type=int, default=262144, help="elements per chunk (default 1 MiB of fp32)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    senders = [f"site-{i:02d}" for i in range(args.senders)]
    g = torch.Generator().manual_seed(0)
    vals = {s: torch.randn(args.numel, generator=g) for s in senders}
    patterns = {
        "in sender order": lambda rep: senders,
        "shuffled": lambda rep: random.Random(rep).sample(senders, len(senders)),
        "lowest id last (worst case)": lambda rep: senders[1:] + senders[:1],
    }
    _, _, ref = _run(senders, senders, vals)
    print(f"{args.senders} senders, chunks of {args.numel} fp32 elements ({4 * args.numel / 2**20:.2f} MiB)\n")
    print("| arrival | CPU ms per chunk (median) | most chunks held | mean equals in-order |")
    print("|---|---|---|---|")
    figures = []
    for name, make in patterns.items():
        secs, helds, means = zip(*(_run(make(rep), senders, vals) for rep in range(args.repeats)))
        ms, held = 1e3 * statistics.median(secs), max(helds)
        same = all(torch.equal(m, ref) for m in means)  # bit-identical to the in-order sum
        print(f"| {name} | {ms:.2f} | {held} | {same} |")
        figures.append({"arrival": name, "cpu_ms_per_chunk": ms, "most_held": held, "equals_in_order": same})
    bench.write(args, "bench_reduce_order", figures)


if __name__ == "__main__":
    main()
