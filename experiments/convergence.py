"""Convergence (issue 18): DiLoCo against DDP at enough rounds, and fault effects resolved below noise.

Every method trains the built-in byte-level GPT on the stdlib source with the same per-site
batches and the same number of inner steps per site (inner AdamW at the preset's lr):

* **Convergence**, IID and non-IID shards (``TaskSpec.non_iid``): DDP (gloo all-reduce of
  the gradients every step, N processes; ``diloco_sanity.run_ddp``) against DiLoCo with N
  sites at H = 10, 50, 100, each with the outer Nesterov SGD lr 0.7 / momentum 0.9
  (Douillard et al., arXiv 2311.08105) and with the plain average (lr 1, momentum 0),
  against one site alone and one site with N times the batch. One loss-vs-steps plot per
  data setting.
* **Faults**, paired by seed against the fault-free run (reduction is bit-reproducible,
  so a fault-free run is deterministic per seed): 10% chunk loss on reduce and broadcast
  (in-process, ``InprocFaults``), the last of N sites killed and restarted after
  ``down_rounds`` rounds (``InprocCluster.restart``: the site rejoins through the
  rendezvous and pulls θ and a member's training position), and the int8, int4 and top-k
  (error feedback on both sides) codecs against fp32. Seeds are added in waves until the
  standard error of the paired change is at most ``SE_TARGET_PP`` percentage points (or
  the mode's seed cap / time budget ends it: "unresolved at SE Y"). These runs use the
  warmup + cosine inner LR (``lr_schedule="cosine"``): a decayed LR at the end keeps two
  diverged trajectories' final losses closer, which is what makes the SE small.
* **Outer lr / momentum sweep** at H = 50 (lr 0.3-1.0, momentum 0-0.9), one seed, the best
  few confirmed on more seeds, so the defaults are the best measured ones.
* **Diagnosis** of a DiLoCo-vs-DDP gap: the same comparison with the warmup + cosine inner
  LR for both, and DiLoCo at the sweep's best outer setting.

Usage (from the repository root)::

    .venv/bin/python -m experiments.convergence --quick    # 4 sites, tiny, 4000 steps: ~30 min on 2 cores
    .venv/bin/python -m experiments.convergence            # full: small model, 8000 steps, more seeds
    .venv/bin/python -m experiments.convergence --smoke --out /tmp/x --results none   # CI: seconds

Writes ``OUT/convergence[_MODE].csv`` (one row per run; ``section``, ``data``, ``method``
columns), ``..._rounds.csv`` (validation loss per evaluated round / step), one PNG per
data setting, and the section "Convergence (issue 18)" of ``experiments/RESULTS.md``.
"""

from __future__ import annotations

import concurrent.futures as cf
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from experiments import convergence_netem
from experiments.common import (
    RunResult,
    RunSpec,
    base_parser,
    load_meta,
    mean_se,
    mode_of,
    mode_settings,
    out_prefix,
    pct_deltas,
    publish,
    quiet_logging,
    read_rows,
    run_many,
    run_or_load,
)
from experiments.convergence_labels import (
    ALONE,
    AVERAGE,
    BIG,
    CODECS,
    DDP,
    FAULT_FREE,
    LONG,
    LOSS10,
    NESTEROV,
    RESTART,
    SE_TARGET_PP,
    SPARSE,
    diloco_label,
    fault_rows,
)
from experiments.convergence_report import report
from experiments.diloco_sanity import run_ddp

MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(
        num_sites=2,
        size="tiny",
        batch_size=4,
        context_len=16,
        num_val_batches=4,
        total_steps=8,
        hs=[2, 4],
        h_main=2,
        seeds={"iid": [0], "non-iid": [0]},
        grid_data=["iid"],  # non-iid: the baselines and h_main only (its own grid is the quick mode's business)
        both_outers_hs=[2, 4],
        sweep=dict(total_steps=8, lrs=[1.0], moms=[0.0, 0.9], confirm=1, confirm_seeds=[1]),
        faults=dict(total_steps=8, first_seeds=2, step_seeds=1, max_seeds=3, restart_after=1, down_rounds=1),
        diagnosis_outers=[NESTEROV, AVERAGE],
        budget_min=2.0,
        jobs=2,
        # 1 s: a lossy round waits its whole reduce deadline (a lost chunk looks late), 4 rounds a run;
        # under load a 0.5 s deadline once cut a chunk that was only late (sync_s 0.86 s against 0.35 s)
        reduce_timeout_s=1.0,
    ),
    # Sized for the shared 2-core machine under other jobs' load (nice 10): ~1500 CPU-seconds.
    "quick": dict(
        num_sites=4,
        size="tiny",
        num_val_batches=32,
        total_steps=4000,  # 80 rounds at H = 50
        hs=[10, 50, 100],
        h_main=50,
        seeds={"iid": [0], "non-iid": [0]},
        grid_data=["iid"],  # the other data settings: DDP, 1 site and DiLoCo at h_main only
        both_outers_hs=[50],  # other H: Nesterov 0.7/0.9 only
        sweep=dict(total_steps=1000, lrs=[0.3, 0.5, 0.7, 1.0], moms=[0.0, 0.5, 0.9], confirm=1, confirm_seeds=[1, 2]),
        faults=dict(total_steps=1000, first_seeds=4, step_seeds=4, max_seeds=16, restart_after=5, down_rounds=5),
        diagnosis_outers=[NESTEROV],
        budget_min=25.0,
        jobs=8,  # more runnable processes than the cores: each in-process run sleeps in its GIL handoffs
        reduce_timeout_s=0.5,
    ),
    "full": dict(
        num_sites=4,
        size="small",
        num_val_batches=32,
        total_steps=8000,
        hs=[10, 50, 100],
        h_main=50,
        seeds={"iid": [0, 1, 2], "non-iid": [0, 1, 2]},
        grid_data=["iid", "non-iid"],
        both_outers_hs=[10, 50, 100],
        sweep=dict(
            total_steps=4000, lrs=[0.3, 0.5, 0.7, 1.0], moms=[0.0, 0.5, 0.7, 0.9], confirm=3, confirm_seeds=[1, 2, 3]
        ),
        faults=dict(total_steps=4000, first_seeds=6, step_seeds=4, max_seeds=30, restart_after=20, down_rounds=5),
        diagnosis_outers=[NESTEROV, AVERAGE],
        budget_min=240.0,
        jobs=4,
        reduce_timeout_s=1.0,
    ),
}


# ---------------------------------------------------------------------------- specs
def _spec(m: dict[str, Any], *, section: str, data: str, method: str, seed: int, steps: int, **kw: Any) -> RunSpec:
    """One run; ``kw`` overrides RunSpec fields (sync_every, num_sites, outer_lr, codec, ...)."""
    h = kw.pop("sync_every", steps)
    rounds = kw.pop("rounds", steps // h)
    eval_steps = max(1, steps // 20)  # ~20 points per curve, on the same steps for every method
    fields = dict(
        experiment="convergence",
        config=f"{section} | {data} | {method}",
        seed=seed,
        num_sites=m["num_sites"],
        size=m["size"],
        batch_size=m.get("batch_size"),
        context_len=m.get("context_len"),
        non_iid=data == "non-iid",
        sync_every=h,
        rounds=rounds,
        bucket_bytes=64 * 1024,
        chunk_bytes=16 * 1024,
        reduce_timeout_s=m["reduce_timeout_s"],
        broadcast_timeout_s=2 * m["reduce_timeout_s"],
        heartbeat_timeout_s=m.get("heartbeat_timeout_s") or 1.5,
        num_val_batches=m["num_val_batches"],
        eval_every=max(1, eval_steps // h) if h > 1 else eval_steps,
        track_drift=False,
        timeout_s=max(3600.0, 0.5 * steps * max(1, kw.get("num_sites", m["num_sites"]))),  # bound on one run
        own_session=True,
        extra=(("section", section), ("data", data), ("method", method), ("H", h)),
    )
    fields.update(kw)
    return RunSpec(**fields)


def _diloco(
    m: dict[str, Any], section: str, data: str, h: int, outer: tuple[float, float], seed: int, steps: int, **kw: Any
) -> RunSpec:
    """DiLoCo with N sites at H = h and the outer SGD (lr, momentum) = ``outer``."""
    return _spec(
        m,
        section=section,
        data=data,
        method=diloco_label(h, outer),
        seed=seed,
        steps=steps,
        sync_every=h,
        outer_lr=outer[0],
        outer_momentum=outer[1],
        **kw,
    )


def _baselines(m: dict[str, Any], section: str, data: str, seed: int, steps: int, **kw: Any) -> list[RunSpec]:
    """DDP, one site alone and one site with N times the batch (the last two as 1-site
    DiLoCo with lr 1, momentum 0: θ becomes the local model every round, i.e. plain training;
    H = h_main only sets how often it is evaluated)."""
    h, n = m["h_main"], m["num_sites"]
    one = dict(num_sites=1, sync_every=h, outer_lr=1.0, outer_momentum=0.0, **kw)
    big = m.get("batch_size") or 8
    return [
        _spec(m, section=section, data=data, method=DDP, seed=seed, steps=steps, sync_every=1, rounds=steps, **kw),
        _spec(m, section=section, data=data, method=ALONE, seed=seed, steps=steps, **one),
        _spec(
            m,
            section=section,
            data=data,
            method=BIG,
            seed=seed,
            steps=steps,
            batch_size=big * n,
            num_val_batches=max(1, m["num_val_batches"] // n),  # the same validation windows (evenly spaced)
            **one,
        ),
    ]


def convergence_specs(m: dict[str, Any]) -> list[RunSpec]:
    """Every data setting: DDP, 1 site, DiLoCo at h_main with both outers; the ``grid_data``
    settings also the 4x batch and every H (both outers at ``both_outers_hs``, else Nesterov)."""
    steps, h_main, specs = m["total_steps"], m["h_main"], []
    for data, seeds in m["seeds"].items():
        grid = data in m["grid_data"]
        for seed in seeds:
            specs += _baselines(m, "convergence", data, seed, steps)[: 3 if grid else 2]
            for h in m["hs"] if grid else [h_main]:
                for outer in (NESTEROV, AVERAGE) if h in m["both_outers_hs"] or h == h_main else (NESTEROV,):
                    specs.append(_diloco(m, "convergence", data, h, outer, seed, steps))
    return specs


def sweep_specs(m: dict[str, Any], grid: Sequence[tuple[float, float]], seeds: Sequence[int]) -> list[RunSpec]:
    sw, h = m["sweep"], m["h_main"]
    return [_diloco(m, "sweep", "iid", h, outer, seed, sw["total_steps"]) for outer in grid for seed in seeds]


def fault_specs(m: dict[str, Any], names: Sequence[str], seeds: Sequence[int]) -> list[RunSpec]:
    f, h = m["faults"], m["h_main"]
    by_name = {
        FAULT_FREE: {},
        LOSS10: dict(push_loss=0.1, pull_loss=0.1),
        RESTART: dict(restart_after_round=f["restart_after"], down_rounds=f["down_rounds"]),
        **{k: dict(codec=c, broadcast_error_feedback=c == "topk") for k, c in CODECS.items()},
        **SPARSE,
    }
    return [
        _spec(
            m,
            section="faults",
            data="iid",
            method=name,
            seed=seed,
            steps=f["total_steps"],
            sync_every=h,
            lr_schedule="cosine",
            **by_name[name],
        )
        for name in names
        for seed in seeds
    ]


def diagnosis_specs(m: dict[str, Any], best: tuple[float, float] | None) -> list[RunSpec]:
    """Where DiLoCo loses to DDP: the inner warmup + cosine LR for both; DiLoCo at the sweep's best outer."""
    steps, h, seed = m["total_steps"], m["h_main"], 0
    specs = _baselines(m, "diagnosis: cosine inner LR", "iid", seed, steps, lr_schedule="cosine")[:1]
    for outer in m["diagnosis_outers"]:
        specs.append(_diloco(m, "diagnosis: cosine inner LR", "iid", h, outer, seed, steps, lr_schedule="cosine"))
    if best is not None and best not in (NESTEROV, AVERAGE):
        specs.append(_diloco(m, "convergence", "iid", h, best, seed, steps))
    return specs


def item_specs(
    m: dict[str, Any], section: str, items: Sequence[str], seeds: Sequence[int], steps: int
) -> list[RunSpec]:
    """One run per item and seed over ``steps`` inner steps (iid): ``ddp`` (DDP), ``big`` (1 site,
    N times the batch) or ``LR/M[@H]`` (DiLoCo at H = h_main, or H, with outer lr LR, momentum M)."""
    specs = []
    for item in items:
        for seed in seeds:
            if item in ("ddp", "big"):
                specs.append(_baselines(m, section, "iid", seed, steps)[0 if item == "ddp" else 2])
            else:
                outer, _, h = item.partition("@")
                lr, mom = (float(x) for x in outer.split("/"))
                specs.append(_diloco(m, section, "iid", int(h or m["h_main"]), (lr, mom), seed, steps))
    return specs


def long_section(steps: int) -> str:
    """The section of the --long-check runs over ``steps`` inner steps (one table per step count)."""
    return f"{LONG} {steps}"


def long_specs(m: dict[str, Any], text: str) -> list[RunSpec]:
    """``--long-check STEPS:ITEMS[:A:B]``: ``item_specs`` over STEPS inner steps for seeds A..B-1
    (default seed 0), section ``long_section(STEPS)`` (its own table)."""
    steps, items, *seeds = text.split(":")
    span = range(int(seeds[0]), int(seeds[1])) if seeds else range(1)
    return item_specs(m, long_section(int(steps)), items.split(","), span, int(steps))


def legacy_long(rows: list[dict[str, Any]], rounds: list[dict[str, Any]]) -> None:
    """Rows of section ``LONG`` (the first --long-check runs, before one section per step
    count) move to ``long_section(inner_steps)``, their per-round rows with them."""
    renamed = {}
    for r in rows:
        if r["section"] == LONG:
            r["section"] = long_section(int(r["inner_steps"]))
            new = f"{r['section']} | {r['data']} | {r['method']}"
            renamed[r["config"]], r["config"] = new, new
    for x in rounds:
        x["config"] = renamed.get(x["config"], x["config"])


# ---------------------------------------------------------------------------- analysis helpers
def unresolved(rows: Sequence[dict[str, Any]], m: dict[str, Any]) -> list[str]:
    """Faults whose paired change still has SE > SE_TARGET_PP."""
    base = fault_rows(rows, FAULT_FREE)
    out = []
    for name in (LOSS10, RESTART, *CODECS):
        se = mean_se(pct_deltas(fault_rows(rows, name), base))[1]
        if not se <= SE_TARGET_PP:
            out.append(name)
    return out


def sweep_best(rows: Sequence[dict[str, Any]], k: int) -> list[tuple[float, float]]:
    """The k (lr, momentum) settings with the lowest seed-0 final loss in the sweep."""
    pts = sorted(
        (r["final_val_loss"], (float(r["outer_lr"]), float(r["outer_momentum"])))
        for r in rows
        if r["section"] == "sweep" and r["seed"] == 0
    )
    return [p for _, p in pts[:k]]


# ---------------------------------------------------------------------------- running
def _ddp_all(specs: Sequence[RunSpec]) -> list[RunResult]:
    """Every DDP run at once, each in its own thread (each is N spawned processes)."""
    if not specs:
        return []
    t0 = time.perf_counter()

    def one(s: RunSpec) -> RunResult:
        r = run_ddp(s)
        print(f"[DDP {time.perf_counter() - t0:6.0f}s] {s.config} seed {s.seed}: val {r.row['final_val_loss']:.4f}")
        return r

    with cf.ThreadPoolExecutor(len(specs)) as ex:
        return list(ex.map(one, specs))


def run_phase(specs: Sequence[RunSpec], m: dict[str, Any], verbose: bool) -> list[RunResult]:
    """The DDP runs in threads beside the in-process runs (``jobs`` at a time): a DDP rank
    waits in every all-reduce for the slowest rank, and on a 2-core machine shared with
    other jobs those waits would otherwise leave the cores to the others."""
    ddp = [s for s in specs if dict(s.extra)["method"] == DDP]
    rest = [s for s in specs if dict(s.extra)["method"] != DDP]
    rest.sort(key=lambda s: -s.sync_every * s.rounds * s.num_sites)  # longest first: fewer idle cores at the end
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(_ddp_all, ddp)
        out = run_many(rest, jobs=m["jobs"], verbose=verbose, own_sessions=True) if rest else []
        return fut.result() + out


def run_all(m: dict[str, Any], verbose: bool) -> list[RunResult]:
    """Phase 1: convergence, sweep, first fault seeds, cosine diagnosis. Phase 2: the sweep's
    best on more seeds and DiLoCo at the best outer setting. Then fault seeds in waves until every
    fault's SE <= SE_TARGET_PP, the seed cap or the time budget."""
    t0 = time.monotonic()
    f, sw = m["faults"], m["sweep"]
    grid = [(lr, mom) for lr in sw["lrs"] for mom in sw["moms"]]
    names = [FAULT_FREE, LOSS10, RESTART, *CODECS]
    seeds = list(range(f["first_seeds"]))
    specs = convergence_specs(m) + sweep_specs(m, grid, [0]) + fault_specs(m, names, seeds)
    specs += diagnosis_specs(m, None)
    print(f"convergence: phase 1, {len(specs)} runs", flush=True)
    results = run_phase(specs, m, verbose)
    rows = [r.row for r in results]
    best = sweep_best(rows, sw["confirm"] + 1)
    confirm = [p for p in best if p != NESTEROV][: sw["confirm"]] + [NESTEROV]
    more = (
        sweep_specs(m, confirm, sw["confirm_seeds"])
        + diagnosis_specs(m, best[0] if best else None)[1 + len(m["diagnosis_outers"]) :]
    )
    while True:
        todo = unresolved(rows, m)
        budget_left = m["budget_min"] - (time.monotonic() - t0) / 60
        if todo and len(seeds) < f["max_seeds"] and budget_left > 0:
            new = list(range(len(seeds), min(f["max_seeds"], len(seeds) + f["step_seeds"])))
            seeds += new
            more += fault_specs(m, [FAULT_FREE, *todo], new)
        if not more:
            break
        print(f"convergence: {len(more)} more runs (unresolved: {todo}; {budget_left:.1f} min of budget)", flush=True)
        got = run_phase(more, m, verbose)
        results += got
        rows += [r.row for r in got]
        more = []
    return results


EXTRA = ("convergence_faults", "convergence_outer", "convergence_netem")  # side runs' CSVs (then a --fault-name-tag)


def _side_files(args) -> list[Path]:
    """This mode's side-run CSVs in OUT (``EXTRA`` + tag [+ ``_MODE``]), oldest first."""
    mode, out = mode_of(args), []
    for name in EXTRA:
        for p in Path(args.out).glob(name + "*.csv"):
            if p.stem.endswith("_rounds") or (p.stem.endswith(("_smoke", "_full")) != (mode != "quick")):
                continue
            if mode == "quick" or p.stem.endswith("_" + mode):
                out.append(p)
    return sorted(out, key=lambda p: p.stat().st_mtime)


def _merge_extra(args, rows: list, rounds: list, meta: dict[str, Any]) -> None:
    """Add the rows of the side runs (``--fault-seeds``, ``--outer-check``) saved beside this
    mode's CSV (``--replot`` only), oldest file first: a side run's row replaces the row of
    the same config and seed already there (a rerun on a quieter machine supersedes)."""
    if not args.replot:
        return
    for csv_path in _side_files(args):
        extra = csv_path.with_suffix("")
        new = read_rows(csv_path)
        keys = {(r["config"], r["seed"]) for r in new}
        rows[:] = [r for r in rows if (r["config"], r["seed"]) not in keys] + new
        rounds_path = extra.with_name(extra.name + "_rounds.csv")
        got = read_rows(rounds_path) if rounds_path.exists() else []
        rounds[:] = [x for x in rounds if (x["config"], x["seed"]) not in keys] + got
        more = load_meta(extra)
        if more["command"] in meta["command"]:
            continue  # already counted in the main file's meta (merged before)
        meta["command"] += f"` and `{more['command']}"
        meta["minutes"] += more["minutes"]
        meta["provenance"] += f"; `{more['command'].split('convergence.py ', 1)[-1]}`: {more['provenance']}"


ALIASES = {"fault-free": FAULT_FREE, "loss10": LOSS10, "restart": RESTART, "topk": "topk + error feedback"}


def _fault_names(text: str) -> list[str]:
    """``--fault-names``: comma-separated run names or aliases (``ALIASES``); a name with a
    comma in it ("1 site down, restarted") is put back together from its pieces."""
    known = [FAULT_FREE, LOSS10, RESTART, *CODECS, *SPARSE]
    out, acc = [], ""
    for piece in text.split(","):
        acc = f"{acc},{piece}" if acc else piece.strip()
        name = ALIASES.get(acc, acc)
        if name in known:
            out.append(name)
            acc = ""
    if acc:
        raise SystemExit(f"--fault-names: unknown run {acc!r}; known: {known} or {sorted(ALIASES)}")
    return out


def _side_run(args, argv: Sequence[str], m: dict[str, Any], name: str, specs: Sequence[RunSpec]) -> int:
    """Run only ``specs`` into ``OUT/name[_MODE].csv`` (a side run; ``--replot`` merges it)."""
    run_or_load(args, argv, "convergence.py", out_prefix(args, name), lambda: run_phase(specs, m, args.verbose))
    return 0


def _settings(text: str) -> tuple[list[tuple[float, float]], range]:
    """``"LR/M,LR/M,...:A:B"`` -> the (outer lr, momentum) settings and seeds A..B-1."""
    items, seeds = _items(text)
    return [(float(x.split("/")[0]), float(x.split("/")[1])) for x in items], seeds


def _items(text: str) -> tuple[list[str], range]:
    """``"ITEM,ITEM,...:A:B"`` -> the items and seeds A..B-1."""
    items, a, b = text.rsplit(":", 2)
    return items.split(","), range(int(a), int(b))


def _parser():
    """The common flags (``base_parser``) and this script's side runs."""
    ap = base_parser(__doc__)
    ap.add_argument("--total-steps", type=int, help="inner steps per site of the convergence runs")
    ap.add_argument("--budget-min", type=float, help="stop adding fault seeds after this many minutes")
    ap.add_argument(
        "--fault-seeds",
        help="A:B: run only the fault section's runs for seeds A..B-1 into OUT/convergence_faults*.csv "
        "(a later --replot of the same mode adds them to its tables)",
    )
    ap.add_argument(
        "--fault-names",
        help="with --fault-seeds: comma-separated runs or aliases fault-free, loss10, restart, int8, int4, "
        "topk, or the issue-35 rows (convergence_labels.SPARSE: int4+zstd, sparseloco ...; default: "
        "fault-free, loss10, restart, int8, int4, topk)",
    )
    ap.add_argument(
        "--fault-steps", type=int, help="with --fault-seeds: inner steps per site (default per mode; 4000 = 80 rounds)"
    )
    ap.add_argument("--fault-name-tag", default="", help="with --fault-seeds or --outer-check: suffix of the CSV name")
    ap.add_argument(
        "--outer-check",
        help="ITEM,ITEM,...:A:B: run only these over the convergence runs' inner steps (iid) for seeds A..B-1 "
        "into OUT/convergence_outer*.csv (a later --replot of the same mode adds them to the convergence table); "
        "ITEM: LR/M[@H] (DiLoCo at H = h_main, or H, with this outer lr / momentum), ddp, or big (1 site, N times "
        "the batch)",
    )
    ap.add_argument(
        "--sweep-confirm",
        help="LR/M,LR/M,...:A:B: run only these outer settings of the sweep for seeds A..B-1 "
        "into OUT/convergence_sweep*.csv",
    )
    ap.add_argument(
        "--rerun-diloco",
        action="store_true",
        help="run only the convergence and diagnosis sections' DiLoCo runs (those whose late contributions a "
        "loaded machine makes the reduce deadline refuse) into OUT/convergence_outer*.csv; a later --replot "
        "replaces the rows of the same config and seed",
    )
    ap.add_argument(
        "--long-check",
        help="STEPS:ITEMS[:A:B]: run only, over STEPS inner steps (iid, seeds A..B-1, default seed 0; section "
        "'long STEPS', a table per step count), ITEMS = comma-separated outer settings LR/M of DiLoCo at H = h_main, "
        "'ddp' and 'big' (1 site with N times the batch: DDP's stand-in, within 2%% of DDP all along the "
        "4000-step curve) into OUT/convergence_outer*.csv",
    )
    ap.add_argument(
        "--netem-pairs",
        help="A:B: run only the fault table's setup over gRPC through netem (as root; convergence_netem.py) at "
        "0%%, 10%% and again 0%% packet loss for seeds A..B-1 into OUT/convergence_netem*.csv (a later --replot "
        "adds its table and claim)",
    )
    ap.add_argument(
        "--reduce-timeout-s",
        type=float,
        help="the in-process rounds' reduce deadline (broadcast: twice it; default per mode). A run that refuses "
        "nothing is bit-identical at any deadline, so a side run on a loaded machine may take a generous one",
    )
    ap.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        help="the in-process rendezvous' heartbeat timeout (default 1.5 s): on a loaded machine a starved "
        "heartbeat thread gets a live site dropped from a round (a resync); a side run may take a generous one",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    quiet_logging(args.verbose)
    mode, m = mode_settings(
        args, MODES, ("size", "jobs", "total_steps", "budget_min", "reduce_timeout_s", "heartbeat_timeout_s")
    )
    if args.seeds is not None:
        m["seeds"] = {k: list(range(args.seeds)) for k in m["seeds"]}
    if args.fault_steps:
        m["faults"] = dict(m["faults"], total_steps=args.fault_steps)
    for h in m["hs"]:
        for steps in (m["total_steps"], m["sweep"]["total_steps"], m["faults"]["total_steps"]):
            if steps % h:
                raise SystemExit(f"{steps} inner steps is not a multiple of H={h}")
    if args.outer_check or args.rerun_diloco or args.long_check:
        if args.long_check:
            specs = long_specs(m, args.long_check)
        elif args.rerun_diloco:
            specs = [s for s in convergence_specs(m) + diagnosis_specs(m, None) if s.num_sites > 1]
            specs = [s for s in specs if dict(s.extra)["method"] != DDP]
        else:
            items, seeds = _items(args.outer_check)
            specs = item_specs(m, "convergence", items, seeds, m["total_steps"])
        return _side_run(args, argv, m, "convergence_outer" + args.fault_name_tag, specs)
    if args.netem_pairs:
        a, b = (int(x) for x in args.netem_pairs.split(":"))
        prefix = out_prefix(args, "convergence_netem" + args.fault_name_tag)
        run_or_load(args, argv, "convergence.py", prefix, lambda: convergence_netem.run(m, range(a, b), 1800.0))
        return 0
    if args.sweep_confirm:
        grid, seeds = _settings(args.sweep_confirm)
        specs = sweep_specs(m, grid, seeds)
        return _side_run(args, argv, m, "convergence_sweep", specs)
    if args.fault_seeds:
        a, b = (int(x) for x in args.fault_seeds.split(":"))
        names = _fault_names(args.fault_names) if args.fault_names else [FAULT_FREE, LOSS10, RESTART, *CODECS]
        specs = fault_specs(m, names, range(a, b))
        return _side_run(args, argv, m, "convergence_faults" + args.fault_name_tag, specs)
    prefix = out_prefix(args, "convergence")
    rows, rounds, meta = run_or_load(args, argv, "convergence.py", prefix, lambda: run_all(m, args.verbose))
    _merge_extra(args, rows, rounds, meta)
    legacy_long(rows, rounds)
    body = report(rows, rounds, m, meta, prefix, mode)
    title = "Convergence (issue 18)" if mode == "quick" else f"Convergence (issue 18, {mode})"
    publish(args, f"convergence-{mode}", title, body)
    print(f"convergence ({mode}): {len(rows)} runs, {statistics.fmean(r['wall_s'] for r in rows):.1f} s wall each")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
