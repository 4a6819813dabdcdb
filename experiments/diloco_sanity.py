"""DiLoCo sanity table: H in {1, 10, 50, 100} against a data-parallel baseline.

DiLoCo (Douillard et al., arXiv 2311.08105) claims equal or better loss than fully
synchronous data-parallel training with about H times fewer bytes. Both train the built-in
GPT with N sites/ranks, the same inner AdamW, per-site batches, inner steps and tokens (the
report prints the setup):

* DDP: N spawned processes, gradients averaged every step (gloo all-reduce on 127.0.0.1).
  Bytes: the ring formula 2·(N−1)/N · 4 · P per rank per step (P parameters; loopback
  traffic of other processes makes a measurement unreliable).
* DiLoCo: N in-process sites, fp32, outer SGD (lr 0.7, momentum 0.9, Nesterov). Bytes:
  measured payload (contributions pushed + means pulled, chunk headers included).
* Reference: one site alone, same steps and batch size (no communication).
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from dtrain.tasks import build_task
from experiments.common import (
    BUCKETS_64K,
    RunResult,
    RunSpec,
    fmt_pm,
    md_rows,
    mean_std,
    own_session,
    paired_deltas,
    run_inproc,
    save_fig,
    subplots,
    summarize,
)
from experiments.lab import ROUNDS, SITES, H, Point, Spec, decorate, files, met
from experiments.procs import free_port
from experiments.torchft_site import ring_allreduce_bytes

DDP = "DDP (all-reduce every step)"
ALONE = "1 site alone (no sync)"
EVAL = "eval_every"
OUTER_LR, OUTER_M, METHOD = "outer.lr", "outer.momentum", "baseline.method"
SMALL = {"task_spec.batch_size": 4, "task_spec.context_len": 16}  # the smoke's short windows


def methods(total_steps: int, hs: list[int]) -> list[dict[str, Any]]:
    """DDP, DiLoCo at every H, and one site alone (outer lr 1, no momentum, one round at the end: plain
    training), ``total_steps`` inner steps per site each."""
    bad = [h for h in hs if total_steps % h]
    if bad:
        raise ValueError(f"total steps {total_steps} is not a multiple of H={bad[0]}")
    ddp = {"config": DDP, METHOD: "ddp", H: 1, ROUNDS: total_steps, EVAL: 0}
    diloco = [{"config": f"DiLoCo H={h}", METHOD: "diloco", H: h, ROUNDS: total_steps // h} for h in hs]
    for d in diloco:  # about 20 evaluations per run
        d[EVAL] = max(1, d[ROUNDS] // 20)
    alone = {"config": ALONE, METHOD: "alone", SITES: 1, H: total_steps, ROUNDS: 1, EVAL: 0}
    return [ddp, *diloco, alone | {OUTER_LR: 1.0, OUTER_M: 0.0}]


MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(seeds=[0], jobs=1, total_steps=4, grid=methods(4, [1, 2]))
    | {"fixed": {SITES: 2, "task_spec.size": "tiny", "inproc.num_val_batches": 2, **SMALL}},
    "quick": dict(seeds=[0, 1, 2], jobs=2, total_steps=200, grid=methods(200, [1, 10, 50, 100]))
    | {"fixed": {SITES: 4, "task_spec.size": "tiny", "inproc.num_val_batches": 16}},
    "full": dict(seeds=[0, 1, 2], jobs=max(1, (os.cpu_count() or 2) // 4), total_steps=2000)
    | {"grid": methods(2000, [1, 10, 50, 100, 500])}
    | {"fixed": {SITES: 4, "task_spec.size": "small", "inproc.num_val_batches": 32}},
}


def run_method(point: Point) -> RunResult:
    """The DDP baseline's ranks (:func:`run_ddp`) or the in-process DiLoCo run of the point."""
    spec = point.run_spec()
    return run_ddp(spec) if point.settings[METHOD] == "ddp" else run_inproc(spec)


def _ddp_worker(rank: int, spec: RunSpec, port: int, out_path: str) -> None:
    """One data-parallel rank: the same task and inner optimizer as a DiLoCo site. It leaves through a
    last barrier and ``os._exit(0)``: with torch 2.13 gloo's threads outlive ``destroy_process_group()``,
    and a normal exit's C++ destructors with them alive once ended in SIGABRT under load."""
    faulthandler.enable(all_threads=True)  # a native abort prints every thread's Python stack
    torch.set_num_threads(1)
    if spec.own_session:
        own_session()  # a rank's CPU share is its own on a machine shared by sessions (autogroup)
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group(
        "gloo", init_method=url, rank=rank, world_size=spec.num_sites, timeout=timedelta(seconds=300)
    )
    try:
        task = build_task(spec.task_spec(rank))  # same init on every rank (seed only); shard = rank
        params = list(task.model.parameters())
        flat = torch.zeros(sum(p.numel() for p in params))
        evaluate = spec.evaluator()
        first = evaluate(task.model) if rank == 0 else float("nan")
        curve: list[tuple[int, float]] = []  # (inner steps done, val loss) every spec.eval_every steps
        comm_s = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(spec.rounds):
            task.loss(task.model, next(task.batches)).backward()
            t = time.perf_counter()
            torch.cat([p.grad.reshape(-1) for p in params], out=flat)
            dist.all_reduce(flat)  # sum over ranks
            flat.div_(spec.num_sites)
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(g.view_as(p))
            comm_s += time.perf_counter() - t
            task.optimizer.step()
            task.optimizer.zero_grad(set_to_none=True)
            if task.scheduler is not None:
                task.scheduler.step()
            if rank == 0 and spec.eval_every and (step + 1) % spec.eval_every == 0 and step + 1 < spec.rounds:
                curve.append((step + 1, evaluate(task.model)))
        wall = time.perf_counter() - t0
        if rank == 0:
            result = dict(first_val_loss=first, final_val_loss=evaluate(task.model), wall_s=wall, comm_s=comm_s)
            result |= dict(num_params=flat.numel(), tokens_per_batch=task.tokens_per_batch, curve=curve)
            Path(out_path).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ddp(spec: RunSpec) -> RunResult:
    """N spawned ranks, ``spec.rounds`` steps each: a row shaped like a DiLoCo row and, as ``rounds``,
    rank 0's validation loss every ``spec.eval_every`` steps (``round`` = step − 1) and at the end."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ddp.json")
        tmp.spawn(_ddp_worker, args=(spec, free_port(), out), nprocs=spec.num_sites, join=True)
        res = json.loads(Path(out).read_text())
    n, p, steps = spec.num_sites, res["num_params"], spec.rounds
    per_rank_step = ring_allreduce_bytes(p, n)
    row = spec.columns() | {
        "codec": "fp32 (gloo all-reduce)",
        "num_params": p,
        "inner_steps": steps,
        "tokens_per_site": steps * res["tokens_per_batch"],
        "first_val_loss": res["first_val_loss"],
        "final_val_loss": res["final_val_loss"],
        "val_loss_site_spread": 0.0,
        "rounds_done": steps,
        **dict.fromkeys(("resyncs", "deferred", "bytes_received", "stale_buckets", "repaired_buckets"), 0),
        **dict.fromkeys(("skipped_buckets", "rejected"), 0),
        "build_s": time.perf_counter() - t0 - res["wall_s"],
        "wall_s": res["wall_s"],
        "inner_s": res["wall_s"] - res["comm_s"],
        "sync_s": res["comm_s"],
        "round_s": res["comm_s"] / steps,
        **dict.fromkeys(("bytes_sent", "bytes_total"), per_rank_step * n * steps),
        "bytes_per_round_site": per_rank_step,
        **dict.fromkeys(("encode_s", "decode_s"), 0.0),
        "consistent": True,
    }
    rounds = [
        {"experiment": spec.experiment, "config": spec.config, "seed": spec.seed, "round": k - 1, "val_loss": v}
        for k, v in [*res["curve"], (steps, res["final_val_loss"])]
    ]
    return RunResult(row=row, rounds=rounds)


def analyse(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
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
            {
                "method": cfg,
                "runs": len(g),
                "rounds": g[0]["rounds_done"],
                "inner steps/site": g[0]["inner_steps"],
                "final val loss": fmt_pm([r["final_val_loss"] for r in g]),
                "Δ loss vs DDP (paired)": "—" if cfg == DDP else fmt_pm(d, "{:+.4f}"),
                "MB sent per site": f"{bytes_site / 1e6:.2f}",
                "fewer bytes than DDP": {DDP: "1", ALONE: "— (no network)"}.get(cfg, f"{ratio:.1f}x (H = {h})"),
                "wall s": fmt_pm([r["wall_s"] for r in g], "{:.0f}"),
                "sync/comm s": fmt_pm([r["sync_s"] for r in g], "{:.1f}"),
            }
        )
        if cfg not in (DDP, ALONE):
            dm, ds = mean_std(d)
            loss_ok = dm <= max(ds, ddp_loss[1])  # equal (within the spread over seeds) or better
            bytes_ok = 0.8 * h <= ratio <= 1.25 * h
            vs_alone = statistics.fmean(r["final_val_loss"] for r in g) - alone[0]
            verdicts.append(
                f"- H={h}: Δ loss vs DDP {dm:+.4f} ± {ds:.4f} → loss {'equal or better' if loss_ok else '**worse**'}; "
                f"{ratio:.1f}x fewer bytes (H = {h}) → {'≈ H' if bytes_ok else '**not ≈ H**'}. Claim "
                f"{met(loss_ok and bytes_ok)}."
                + (f" Against one site alone ({alone[0]:.4f}): {vs_alone:+.4f}." if math.isfinite(alone[0]) else "")
            )
    return md_rows(table), verdicts


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
        name = "DDP" if cfg == DDP else f"H={g[0]['H']}"
        ax.annotate(name, (mx, my[0]), textcoords="offset points", xytext=(6, 4), fontsize=8)
        if cfg == DDP:
            ax.axhline(my[0], color="black", lw=0.8, ls="--")
    if levels:  # axhline does not widen the y range
        lo, hi = ax.get_ylim()
        pad = 0.05 * (hi - lo)
        ax.set_ylim(min(lo, min(levels) - pad), max(hi, max(levels) + pad))
    title = "DiLoCo vs data-parallel: same steps and tokens"
    decorate(ax, "MB sent per site (log)", "final validation loss (nats/token)", title, xscale="log")
    return save_fig(fig, prefix.with_suffix(".png"))


def report(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any], prefix: Path) -> str:
    f, steps = m["fixed"], m["total_steps"]
    n, lr, mom = f[SITES], f[OUTER_LR], f[OUTER_M]
    hs = [int(r["H"]) for r in rows if r["method"] == "diloco"]
    png = plot(rows, prefix)
    return f"""Setup: {n} sites, built-in GPT `{f["task_spec.size"]}` ({rows[0]["num_params"]:,} parameters) on the stdlib source,
{steps} inner steps per site for every method (same per-site batches and tokens: {rows[0]["tokens_per_site"]:,}
per site), inner AdamW at the preset's lr. DDP: {n} processes, gradients all-reduced (gloo, 127.0.0.1)
every step; bytes by the ring formula 2·(N−1)/N·4·P per rank per step. DiLoCo: in-process sites, fp32 codec, outer
SGD lr {lr:g} momentum {mom:g}{" Nesterov" if mom else ""}; bytes measured (payload + 32-byte chunk headers). Mean ± std over seeds
{m["seeds"]}; Δ paired by seed. "Equal or better" = mean Δ ≤ max(std of Δ, std of DDP's loss). {files(prefix, png)}

{analyse(rows)[0]}

Context: DiLoCo's claim comes from long runs (H = 500 and tens of thousands of inner steps per worker in the
paper). Here every site takes {steps} steps from scratch, so DiLoCo gets at most
{steps // min(hs)} outer steps; what this table can show is whether the byte count scales as 1/H
(it does, by construction of the rounds) and whether merging the sites helps at all (against one site alone).
Running it again with `--set outer.lr=1 --set outer.momentum=0` (plain model averaging) separates the merging
from the outer optimizer: with few rounds, Nesterov momentum 0.9 at lr 0.7 re-applies a large part of earlier
rounds' updates."""


SPEC = Spec(
    name="diloco_sanity",
    title="DiLoCo sanity table",
    modes=MODES,
    fixed={"diloco.rounds.codec.name": "fp32", **BUCKETS_64K, "inproc.track_drift": False, OUTER_LR: 0.7, OUTER_M: 0.9},
    columns=lambda point: {"method": point[METHOD], "H": point[H]},
    metrics=(("final_val_loss", 0.0, 10.0), ("bytes_per_round_site", 0.0, 1e12)),  # alone: no bytes
    report=report,
    verdict=lambda rows, rounds, m: analyse(rows)[1],
    execute=run_method,
    paths=(METHOD,),
    jobs_fn=lambda point: point.settings[METHOD] != "ddp",  # DDP's ranks want every core: one run at a time
)
