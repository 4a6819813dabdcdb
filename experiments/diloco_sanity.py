"""DiLoCo sanity table: H in {1, 10, 50, 100} against a data-parallel baseline.

DiLoCo (Douillard et al., arXiv 2311.08105) claims equal or better loss than fully
synchronous data-parallel training with about H times fewer bytes. Here both train the
built-in byte-level GPT (stdlib source) with N sites/ranks, the same inner optimizer
(AdamW, the preset's lr, weight decay 0.1), the same per-site batches, the same total
inner steps and tokens:

* DDP: N processes (``torch.multiprocessing`` spawn), gradients averaged every step with
  ``torch.distributed.all_reduce`` over gloo on 127.0.0.1 (one flat fp32 buffer).
  Bytes: a ring all-reduce sends 2·(N−1)/N · 4 · P bytes per rank per step (P
  parameters); that formula is what the table shows (gloo's CPU all-reduce moves about
  this much; loopback traffic of other processes makes a measurement unreliable).
* DiLoCo: N sites as threads over the in-process transport, fp32 codec, outer SGD
  (lr 0.7, momentum 0.9, Nesterov), H inner steps per round. Bytes: measured payload
  bytes (contributions pushed + means pulled, chunk headers included).
* Reference: one site alone with the same steps and batch size (no communication; a
  quarter of the tokens), to show what merging the sites buys at all.

Usage (from the repository root)::

    .venv/bin/python -m experiments.diloco_sanity --quick    # 4 sites, tiny, 3 seeds, 200 steps
    .venv/bin/python -m experiments.diloco_sanity            # full: small model, 2000 steps
    .venv/bin/python -m experiments.diloco_sanity --smoke --out /tmp/x --results none

Writes ``OUT/diloco_sanity[_MODE].csv``, ``..._rounds.csv``, ``....png`` and puts its
table into ``experiments/RESULTS.md``.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from dtrain.tasks import build_task
from dtrain.tasks.builtin import make_evaluate
from dtrain.tasks.data import load_corpus, val_batches
from experiments.common import (
    RunResult,
    RunSpec,
    base_parser,
    fmt_pm,
    md_table,
    mean_std,
    mode_settings,
    out_prefix,
    own_session,
    paired_deltas,
    publish,
    quiet_logging,
    run_many,
    run_or_load,
    save_fig,
    subplots,
    summarize,
)

DDP = "DDP (all-reduce every step)"
ALONE = "1 site alone (no sync)"

MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(
        num_sites=2,
        size="tiny",
        batch_size=4,
        context_len=16,
        total_steps=4,
        hs=[1, 2],
        seeds=[0],
        jobs=1,
        num_val_batches=2,
    ),
    "quick": dict(
        num_sites=4, size="tiny", total_steps=200, hs=[1, 10, 50, 100], seeds=[0, 1, 2], jobs=2, num_val_batches=16
    ),
    "full": dict(
        num_sites=4,
        size="small",
        total_steps=2000,
        hs=[1, 10, 50, 100, 500],
        seeds=[0, 1, 2],
        jobs=max(1, (os.cpu_count() or 2) // 4),
        num_val_batches=32,
    ),
}


def h_label(h: int, m: dict[str, Any]) -> str:
    outer = "" if outer_tag(m) == "" else f" (outer lr {m['outer_lr']:g}, momentum {m['outer_momentum']:g})"
    return f"DiLoCo H={h}{outer}"


def outer_tag(m: dict[str, Any]) -> str:
    """ "" for DiLoCo's outer SGD (lr 0.7, momentum 0.9), else a file/section suffix naming the setting."""
    if (m["outer_lr"], m["outer_momentum"]) == (0.7, 0.9):
        return ""
    return f"outer-lr{m['outer_lr']:g}-m{m['outer_momentum']:g}"


def make_specs(m: dict[str, Any]) -> tuple[list[RunSpec], list[RunSpec]]:
    common = dict(
        experiment="diloco_sanity",
        num_sites=m["num_sites"],
        size=m["size"],
        batch_size=m.get("batch_size"),
        context_len=m.get("context_len"),
        codec="fp32",
        bucket_bytes=64 * 1024,
        chunk_bytes=16 * 1024,
        num_val_batches=m["num_val_batches"],
        track_drift=False,
    )
    diloco, ddp = [], []
    for h in m["hs"]:
        if m["total_steps"] % h:
            raise SystemExit(f"total steps {m['total_steps']} is not a multiple of H={h}")
        rounds = m["total_steps"] // h
        for seed in m["seeds"]:
            diloco.append(
                RunSpec(
                    config=h_label(h, m),
                    seed=seed,
                    sync_every=h,
                    rounds=rounds,
                    outer_lr=m["outer_lr"],
                    outer_momentum=m["outer_momentum"],
                    eval_every=max(1, rounds // 20),
                    extra=(("method", "diloco"), ("H", h)),
                    **common,
                )
            )
    for seed in m["seeds"]:
        # Reference: what one site reaches on its own with the same steps and batch size (outer SGD lr 1,
        # no momentum, one round at the end: θ becomes the local model, i.e. plain training).
        diloco.append(
            RunSpec(
                **{**common, "num_sites": 1},
                config=ALONE,
                seed=seed,
                sync_every=m["total_steps"],
                rounds=1,
                outer_lr=1.0,
                outer_momentum=0.0,
                eval_every=0,
                extra=(("method", "alone"), ("H", m["total_steps"])),
            )
        )
    for seed in m["seeds"]:
        ddp.append(
            RunSpec(
                config=DDP,
                seed=seed,
                sync_every=1,
                rounds=m["total_steps"],
                eval_every=0,
                extra=(("method", "ddp"), ("H", 1)),
                **common,
            )
        )
    return diloco, ddp


# ---------------------------------------------------------------------------- DDP baseline
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, spec: RunSpec, port: int, out_path: str) -> None:
    """One data-parallel rank: the same task and inner optimizer as a DiLoCo site.

    Teardown: every rank meets in a last barrier (so none closes its gloo connections while
    rank 0 still evaluates), destroys the process group, and then leaves with ``os._exit(0)``
    without finalizing the interpreter. With torch 2.13, gloo's threads (``gloo_tcp_loop``,
    two ``pt_gloo_runloop``; on rank 0 also the TCPStore server ``pt_tcpstore_uv``) still run
    after ``destroy_process_group()`` returns (listed in /proc/self/task), so a normal exit
    finalizes the interpreter and runs C++ destructors with them alive; under load that ended
    once in "terminate called without an active exception" (SIGABRT). A rank that raises
    still goes through spawn's error path.
    """
    faulthandler.enable(all_threads=True)  # a native abort prints every thread's Python stack
    torch.set_num_threads(1)
    if spec.own_session:
        own_session()  # a rank's CPU share is its own on a machine shared by sessions (autogroup)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=spec.num_sites,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        task = build_task(spec.task_spec(rank))  # same init on every rank (seed only); shard = rank
        params = list(task.model.parameters())
        flat = torch.zeros(sum(p.numel() for p in params))
        ts = spec.task_spec(0)
        evaluate = make_evaluate(
            val_batches(
                load_corpus(spec.data).val,
                batch_size=ts.resolved_batch_size,
                context_len=ts.resolved_context_len,
                num_batches=spec.num_val_batches,
            )
        )
        first = evaluate(task.model) if rank == 0 else float("nan")
        curve: list[tuple[int, float]] = []  # (inner steps done, val loss) every spec.eval_every steps
        comm_s = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(spec.rounds):
            loss = task.loss(task.model, next(task.batches))
            loss.backward()
            t = time.perf_counter()
            torch.cat([p.grad.reshape(-1) for p in params], out=flat)
            dist.all_reduce(flat)  # sum over ranks
            flat.div_(spec.num_sites)
            off = 0
            for p in params:
                p.grad.copy_(flat[off : off + p.numel()].view_as(p))
                off += p.numel()
            comm_s += time.perf_counter() - t
            task.optimizer.step()
            task.optimizer.zero_grad(set_to_none=True)
            if task.scheduler is not None:
                task.scheduler.step()
            if rank == 0 and spec.eval_every and (step + 1) % spec.eval_every == 0 and step + 1 < spec.rounds:
                curve.append((step + 1, evaluate(task.model)))
        wall = time.perf_counter() - t0
        if rank == 0:
            Path(out_path).write_text(
                json.dumps(
                    {
                        "first_val_loss": first,
                        "final_val_loss": evaluate(task.model),
                        "wall_s": wall,
                        "comm_s": comm_s,
                        "num_params": flat.numel(),
                        "tokens_per_batch": task.tokens_per_batch,
                        "curve": curve,
                    }
                )
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ddp(spec: RunSpec) -> RunResult:
    """N spawned ranks, ``spec.rounds`` steps each; returns a row shaped like a DiLoCo row and,
    as ``rounds``, rank 0's validation loss every ``spec.eval_every`` steps (``round`` = step − 1)
    and at the end. The task's inner LR scheduler (``spec.lr_schedule``) is stepped every step."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ddp.json")
        tmp.spawn(_ddp_worker, args=(spec, _free_port(), out), nprocs=spec.num_sites, join=True)
        res = json.loads(Path(out).read_text())
    n, p, steps = spec.num_sites, res["num_params"], spec.rounds
    per_rank_step = round(2 * (n - 1) / n * 4 * p)  # ring all-reduce, fp32
    row: dict[str, Any] = {k: v for k, v in spec.__dict__.items() if k not in ("extra", "timeout_s", "own_session")}
    row.update(dict(spec.extra))
    row.update(
        {
            "codec": "fp32 (gloo all-reduce)",
            "num_params": p,
            "inner_steps": steps,
            "tokens_per_site": steps * res["tokens_per_batch"],
            "first_val_loss": res["first_val_loss"],
            "final_val_loss": res["final_val_loss"],
            "val_loss_site_spread": 0.0,
            "rounds_done": steps,
            "resyncs": 0,
            "deferred": 0,
            "build_s": time.perf_counter() - t0 - res["wall_s"],
            "wall_s": res["wall_s"],
            "inner_s": res["wall_s"] - res["comm_s"],
            "sync_s": res["comm_s"],
            "round_s": res["comm_s"] / steps,
            "bytes_sent": per_rank_step * n * steps,
            "bytes_received": 0,
            "bytes_total": per_rank_step * n * steps,
            "bytes_per_round_site": per_rank_step,
            "encode_s": 0.0,
            "decode_s": 0.0,
            "stale_buckets": 0,
            "repaired_buckets": 0,
            "skipped_buckets": 0,
            "rejected": 0,
            "consistent": True,
        }
    )
    curve = [*res["curve"], (steps, res["final_val_loss"])]
    rounds = [
        {"experiment": spec.experiment, "config": spec.config, "seed": spec.seed, "round": k - 1, "val_loss": v}
        for k, v in curve
    ]
    return RunResult(row=row, rounds=rounds)


# ---------------------------------------------------------------------------- report
def analyse(rows: list[dict[str, Any]], m: dict[str, Any]) -> tuple[str, list[str]]:
    groups = summarize(rows)
    base = groups[DDP]
    ddp_bytes = statistics.fmean(r["bytes_total"] / r["num_sites"] for r in base)
    ddp_loss = mean_std([r["final_val_loss"] for r in base])
    alone = mean_std([r["final_val_loss"] for r in groups.get(ALONE, [])])
    table, verdicts = [], []
    for cfg, g in groups.items():
        d = paired_deltas(g, base)
        bytes_site = statistics.fmean(r["bytes_total"] / r["num_sites"] for r in g)
        ratio = ddp_bytes / bytes_site if bytes_site else float("inf")
        h = int(g[0]["H"])
        table.append(
            [
                cfg,
                len(g),
                g[0]["rounds_done"],
                g[0]["inner_steps"],
                fmt_pm([r["final_val_loss"] for r in g]),
                "—" if cfg == DDP else fmt_pm(d, "{:+.4f}"),
                f"{bytes_site / 1e6:.2f}",
                "1" if cfg == DDP else ("— (no network)" if cfg == ALONE else f"{ratio:.1f}x (H = {h})"),
                fmt_pm([r["wall_s"] for r in g], "{:.0f}"),
                fmt_pm([r["sync_s"] for r in g], "{:.1f}"),
            ]
        )
        if cfg not in (DDP, ALONE):
            dm, ds = mean_std(d)
            loss_ok = dm <= max(ds, ddp_loss[1])  # equal (within the spread over seeds) or better
            bytes_ok = 0.8 * h <= ratio <= 1.25 * h
            verdicts.append(
                f"- H={h}: Δ loss vs DDP {dm:+.4f} ± {ds:.4f} → loss {'equal or better' if loss_ok else '**worse**'}; "
                f"{ratio:.1f}x fewer bytes (H = {h}) → {'≈ H' if bytes_ok else '**not ≈ H**'}. Claim "
                f"{'**met**' if loss_ok and bytes_ok else '**NOT met**'}."
                + (
                    f" Against one site alone ({alone[0]:.4f}): {statistics.fmean(r['final_val_loss'] for r in g) - alone[0]:+.4f}."
                    if math.isfinite(alone[0])
                    else ""
                )
            )
    md = md_table(
        [
            "method",
            "runs",
            "rounds",
            "inner steps/site",
            "final val loss",
            "Δ loss vs DDP (paired)",
            "MB sent per site",
            "fewer bytes than DDP",
            "wall s",
            "sync/comm s",
        ],
        table,
    )
    return md, verdicts


def plot(rows: list[dict[str, Any]], prefix: Path) -> Path:
    from matplotlib import colormaps

    groups = summarize(rows)
    fig, ax = subplots(figsize=(6.4, 4.4))
    levels: list[float] = []
    for i, (cfg, g) in enumerate(groups.items()):
        if cfg == ALONE:  # no bytes: a level, not a point on the log axis
            level = mean_std([r["final_val_loss"] for r in g])[0]
            ax.axhline(level, color="tab:red", lw=0.8, ls=":", label=cfg)
            levels.append(level)
            continue
        x = [r["bytes_total"] / r["num_sites"] / 1e6 for r in g]
        y = [r["final_val_loss"] for r in g]
        mx, my = statistics.fmean(x), mean_std(y)
        color = "black" if cfg == DDP else colormaps["viridis"](i / max(1, len(groups) - 1))
        ax.scatter(x, y, s=12, color=color, alpha=0.4)
        ax.errorbar([mx], [my[0]], yerr=[my[1]], marker="s" if cfg == DDP else "o", color=color, capsize=3, label=cfg)
        ax.annotate(
            "DDP" if cfg == DDP else f"H={g[0]['H']}",
            (mx, my[0]),
            textcoords="offset points",
            xytext=(6, 4),
            fontsize=8,
        )
        if cfg == DDP:
            ax.axhline(my[0], color="black", lw=0.8, ls="--")
    if levels:  # axhline does not widen the y range
        lo, hi = ax.get_ylim()
        pad = 0.05 * (hi - lo)
        ax.set_ylim(min(lo, min(levels) - pad), max(hi, max(levels) + pad))
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per site (log)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title("DiLoCo vs data-parallel: same steps and tokens", fontsize=10)
    ax.legend(fontsize=8)
    p = save_fig(fig, prefix.with_suffix(".png"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = base_parser(__doc__)
    ap.add_argument("--total-steps", type=int, help="inner steps per site (a multiple of every H)")
    ap.add_argument("--hs", help="comma-separated H values")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="outer SGD learning rate (DiLoCo: 0.7)")
    ap.add_argument(
        "--outer-momentum",
        type=float,
        default=0.9,
        help="outer Nesterov momentum (DiLoCo: 0.9; 0 = plain SGD; lr 1 + momentum 0 = model averaging)",
    )
    args = ap.parse_args(argv)
    quiet_logging(args.verbose)
    mode, m = mode_settings(args, MODES, ("size", "jobs", "total_steps"))
    if args.hs:
        m["hs"] = [int(x) for x in args.hs.split(",")]
    m["outer_lr"], m["outer_momentum"] = args.outer_lr, args.outer_momentum
    tag = outer_tag(m)
    diloco_specs, ddp_specs = make_specs(m)
    prefix = out_prefix(args, "diloco_sanity" + (f"_{tag}" if tag else ""))

    def runner():
        print(
            f"diloco_sanity ({mode}): {len(diloco_specs)} DiLoCo runs ({m['jobs']} at a time), "
            f"{len(ddp_specs)} DDP runs",
            flush=True,
        )
        results = run_many(ddp_specs, jobs=1, verbose=args.verbose, fn=run_ddp)
        return results + run_many(diloco_specs, jobs=m["jobs"], verbose=args.verbose)

    rows, _, meta = run_or_load(args, argv, "diloco_sanity.py", prefix, runner)
    png = plot(rows, prefix)
    md, verdicts = analyse(rows, m)
    body = f"""Command: `{meta["command"]}` ({meta["minutes"]:.1f} min; {meta["provenance"]}).

Setup: {m["num_sites"]} sites, built-in GPT `{m["size"]}` ({rows[0]["num_params"]:,} parameters) on the stdlib source,
{m["total_steps"]} inner steps per site for every method (same per-site batches and tokens: {rows[0]["tokens_per_site"]:,}
per site), inner AdamW at the preset's lr. DDP: {m["num_sites"]} processes, gradients all-reduced (gloo, 127.0.0.1)
every step; bytes by the ring formula 2·(N−1)/N·4·P per rank per step. DiLoCo: in-process sites, fp32 codec, outer
SGD lr {m["outer_lr"]:g} momentum {m["outer_momentum"]:g}{" Nesterov" if m["outer_momentum"] else ""}; bytes measured (payload + 32-byte chunk headers). Mean ± std over seeds
{m["seeds"]}; Δ paired by seed. "Equal or better" = mean Δ ≤ max(std of Δ, std of DDP's loss). CSV:
`{prefix.with_suffix(".csv").name}`; plot: `{png.name}`.

{md}

{chr(10).join(verdicts)}

Context: DiLoCo's claim comes from long runs (H = 500 and tens of thousands of inner steps per worker in the
paper). Here every site takes {m["total_steps"]} steps from scratch, so DiLoCo gets at most
{m["total_steps"] // min(m["hs"])} outer steps; what this table can show is whether the byte count scales as 1/H
(it does, by construction of the rounds) and whether merging the sites helps at all (against one site alone).
Running it again with `--outer-lr 1 --outer-momentum 0` (plain model averaging) separates the merging from the
outer optimizer: with few rounds, Nesterov momentum 0.9 at lr 0.7 re-applies a large part of earlier rounds'
updates.
"""
    publish(
        args,
        f"diloco_sanity-{mode}" + (f"-{tag}" if tag else ""),
        f"DiLoCo sanity table ({mode}"
        + (f", outer lr {m['outer_lr']:g}, momentum {m['outer_momentum']:g})" if tag else ")"),
        body,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
