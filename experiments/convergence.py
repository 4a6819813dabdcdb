"""Convergence (issue 18): DiLoCo against DDP at enough rounds, and fault effects resolved below noise.

Every method trains the built-in GPT on the stdlib source with the same per-site batches and
inner steps per site (inner AdamW at the preset's lr):

* **Convergence**, IID and non-IID shards: DDP (gloo all-reduce every step, N processes)
  against DiLoCo with N sites at H = 10, 50, 100, with the outer Nesterov SGD lr 0.7 /
  momentum 0.9 (Douillard et al., arXiv 2311.08105) and with the plain average (lr 1,
  momentum 0), against one site alone and one site with N times the batch.
* **Faults**, paired by seed against the fault-free run (warmup + cosine inner LR): 10% chunk
  loss on reduce and broadcast, the last site killed and restarted (``InprocCluster.restart``),
  and the int8, int4 and top-k codecs against fp32; seeds are added in waves until the SE of
  each paired change is <= ``SE_TARGET_PP`` percentage points, the seed cap or the budget.
* **Outer lr / momentum sweep** at H = 50, one seed, the best few confirmed on more seeds.
* **Diagnosis** of a DiLoCo-vs-DDP gap: the warmup + cosine inner LR for both, and DiLoCo at
  the sweep's best outer setting.

**Side runs** (``--set convergence.side=KIND:ARGS``, :func:`side_points`) write
``OUT/convergence_convergence-side=...[_MODE].csv``; a ``--replot`` of the mode merges every side
run beside its CSV (:func:`merge`; so are the pre-lab script's ``convergence_faults*``,
``convergence_outer*`` and ``convergence_netem*``). KIND:ARGS: ``faults:A:B`` (with
``convergence.fault_names``, ``.fault_steps``, ``.tag``), ``outer:ITEMS:A:B``,
``sweep:LR/M,...:A:B``, ``rerun-diloco``, ``long:STEPS:ITEMS[:A:B]``, ``netem:A:B`` (as root).
ITEMS: ``LR/M[@H]`` (DiLoCo at H = h_main, or H, with this outer lr / momentum), ``ddp``, or
``big`` (1 site, N times the batch: DDP's stand-in, within 2% of DDP along the 4000-step curve);
``fault_names``: runs of the fault table, :data:`ALIASES`, or ``convergence_report.SPARSE`` rows.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import re
import time
from pathlib import Path
from typing import Any, Sequence

from experiments import convergence_netem
from experiments import convergence_report as rep
from experiments.common import RunResult, load_meta, own_session, read_rows, run_inproc
from experiments.convergence_report import (
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
from experiments.diloco_sanity import run_ddp
from experiments.lab import FIELD_PATHS, Point, Spec, stamp_of

# The knobs a run may override (--set); the rest of a mode is its plan's shape.
FIXED = {
    "rendezvous.heartbeat_timeout_s": 1.5,  # a side run on a loaded machine may take a generous one
    "convergence.side": None,
    "convergence.fault_names": None,
    "convergence.fault_steps": None,
    "convergence.tag": None,  # only names a side run's CSV
}
SITES, SIZE, VAL = "task_spec.num_sites", "task_spec.size", "inproc.num_val_batches"
STEPS, BUDGET, REDUCE = "convergence.total_steps", "convergence.budget_min", "rendezvous.reduce_timeout_s"
DATA = ("iid", "non-iid")  # every mode's data settings (``grid_data``: those with the whole grid)
MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(
        seeds=[0],
        jobs=2,
        # reduce deadline 1 s: a lossy round waits its whole deadline (a lost chunk looks late), 4 rounds a run;
        # under load a 0.5 s deadline once cut a chunk that was only late (sync_s 0.86 s against 0.35 s)
        fixed={SITES: 2, SIZE: "tiny", "task_spec.batch_size": 4, "task_spec.context_len": 16, VAL: 4}
        | {STEPS: 8, BUDGET: 2.0, REDUCE: 1.0},
        hs=[2, 4],
        h_main=2,
        grid_data=["iid"],  # non-iid: the baselines and h_main only (its own grid is the quick mode's business)
        both_outers_hs=[2, 4],
        sweep=dict(total_steps=8, lrs=[1.0], moms=[0.0, 0.9], confirm=1, confirm_seeds=[1]),
        faults=dict(total_steps=8, first_seeds=2, step_seeds=1, max_seeds=3, restart_after=1, down_rounds=1),
        diagnosis_outers=[NESTEROV, AVERAGE],
    ),
    # Sized for the shared 2-core machine under other jobs' load (nice 10): ~1500 CPU-seconds.
    "quick": dict(
        seeds=[0],
        jobs=8,  # more runnable processes than the cores: each in-process run sleeps in its GIL handoffs
        fixed={SITES: 4, SIZE: "tiny", VAL: 32, STEPS: 4000, BUDGET: 25.0, REDUCE: 0.5},  # 80 rounds at H = 50
        hs=[10, 50, 100],
        h_main=50,
        grid_data=["iid"],  # the other data settings: DDP, 1 site and DiLoCo at h_main only
        both_outers_hs=[50],  # other H: Nesterov 0.7/0.9 only
        sweep=dict(total_steps=1000, lrs=[0.3, 0.5, 0.7, 1.0], moms=[0.0, 0.5, 0.9], confirm=1, confirm_seeds=[1, 2]),
        faults=dict(total_steps=1000, first_seeds=4, step_seeds=4, max_seeds=16, restart_after=5, down_rounds=5),
        diagnosis_outers=[NESTEROV],
    ),
    "full": dict(
        seeds=[0, 1, 2],
        jobs=4,
        fixed={SITES: 4, SIZE: "small", VAL: 32, STEPS: 8000, BUDGET: 240.0, REDUCE: 1.0},
        hs=[10, 50, 100],
        h_main=50,
        grid_data=["iid", "non-iid"],
        both_outers_hs=[10, 50, 100],
        sweep=dict(
            total_steps=4000, lrs=[0.3, 0.5, 0.7, 1.0], moms=[0.0, 0.5, 0.7, 0.9], confirm=3, confirm_seeds=[1, 2, 3]
        ),
        faults=dict(total_steps=4000, first_seeds=6, step_seeds=4, max_seeds=30, restart_after=20, down_rounds=5),
        diagnosis_outers=[NESTEROV, AVERAGE],
    ),
}


#: the RunSpec fields the plan and the report read as knobs (from their config paths)
KNOB_FIELDS = ("num_sites", "size", "batch_size", "context_len", "num_val_batches", "reduce_timeout_s")
KNOB_FIELDS += ("heartbeat_timeout_s",)


def knobs(m: dict[str, Any]) -> dict[str, Any]:
    """The mode's settings (``--set`` applied) as the flat knobs the plan and the report read."""
    f = m["fixed"]
    k = dict(m, seeds={d: list(m["seeds"]) for d in DATA}, side=f["convergence.side"])
    k |= {key: f.get(FIELD_PATHS[key]) for key in KNOB_FIELDS}
    k["total_steps"], k["budget_min"] = f.get(STEPS), f.get(BUDGET)
    if f["convergence.fault_steps"]:
        k["faults"] = dict(m["faults"], total_steps=f["convergence.fault_steps"])
    for h in k["hs"]:
        for steps in (k["total_steps"], k["sweep"]["total_steps"], k["faults"]["total_steps"]):
            if steps % h:
                raise SystemExit(f"{steps} inner steps is not a multiple of H={h}")
    return k


# ---------------------------------------------------------------------------- points
def _spec(m: dict[str, Any], section: str, data: str, method: str, seed: int, steps: int, **kw: Any) -> Point:
    """One run; ``kw`` overrides RunSpec fields (sync_every, outer_lr, codec, ...), held by config path."""
    h = kw.pop("sync_every", steps)
    rounds = kw.pop("rounds", steps // h)
    eval_steps = max(1, steps // 20)  # ~20 points per curve, on the same steps for every method
    fields = {f: m[f] for f in KNOB_FIELDS} | dict(  # the mode's knobs, then what every run of the plan shares
        non_iid=data == "non-iid",
        sync_every=h,
        rounds=rounds,
        bucket_bytes=64 * 1024,
        chunk_bytes=16 * 1024,
        broadcast_timeout_s=2 * m["reduce_timeout_s"],
        eval_every=max(1, eval_steps // h) if h > 1 else eval_steps,
        track_drift=False,
        timeout_s=max(3600.0, 0.5 * steps * max(1, kw.get("num_sites", m["num_sites"]))),  # bound on one run
        own_session=True,
    )
    settings = {FIELD_PATHS[k]: v for k, v in (fields | kw).items()}
    extra = (("section", section), ("data", data), ("method", method), ("H", h))
    return Point("convergence", f"{section} | {data} | {method}", seed, settings, extra)


def _diloco(
    m: dict[str, Any], section: str, data: str, h: int, outer: tuple[float, float], seed: int, steps: int, **kw: Any
) -> Point:
    """DiLoCo with N sites at H = h and the outer SGD (lr, momentum) = ``outer``."""
    kw = dict(sync_every=h, outer_lr=outer[0], outer_momentum=outer[1], **kw)
    return _spec(m, section, data, diloco_label(h, outer), seed, steps, **kw)


def _baselines(m: dict[str, Any], section: str, data: str, seed: int, steps: int, **kw: Any) -> list[Point]:
    """DDP, one site alone and one site with N times the batch (the last two as 1-site DiLoCo with lr 1,
    momentum 0: plain training; H = h_main only sets how often it is evaluated)."""
    h, n = m["h_main"], m["num_sites"]
    one = dict(num_sites=1, sync_every=h, outer_lr=1.0, outer_momentum=0.0, **kw)
    big = m.get("batch_size") or 8
    same_windows = max(1, m["num_val_batches"] // n)  # the same validation windows (evenly spaced)
    return [
        _spec(m, section, data, DDP, seed, steps, sync_every=1, rounds=steps, **kw),
        _spec(m, section, data, ALONE, seed, steps, **one),
        _spec(m, section, data, BIG, seed, steps, batch_size=big * n, num_val_batches=same_windows, **one),
    ]


def convergence_points(m: dict[str, Any]) -> list[Point]:
    """Every data setting: DDP, 1 site, DiLoCo at h_main with both outers; the ``grid_data``
    settings also the 4x batch and every H (both outers at ``both_outers_hs``, else Nesterov)."""
    steps, h_main, points = m["total_steps"], m["h_main"], []
    for data, seeds in m["seeds"].items():
        grid = data in m["grid_data"]
        for seed in seeds:
            points += _baselines(m, "convergence", data, seed, steps)[: 3 if grid else 2]
            for h in m["hs"] if grid else [h_main]:
                for outer in (NESTEROV, AVERAGE) if h in m["both_outers_hs"] or h == h_main else (NESTEROV,):
                    points.append(_diloco(m, "convergence", data, h, outer, seed, steps))
    return points


def sweep_points(m: dict[str, Any], grid: Sequence[tuple[float, float]], seeds: Sequence[int]) -> list[Point]:
    sw, h = m["sweep"], m["h_main"]
    return [_diloco(m, "sweep", "iid", h, outer, seed, sw["total_steps"]) for outer in grid for seed in seeds]


def fault_points(m: dict[str, Any], names: Sequence[str], seeds: Sequence[int]) -> list[Point]:
    f, h = m["faults"], m["h_main"]
    by_name = {
        FAULT_FREE: {},
        LOSS10: dict(push_loss=0.1, pull_loss=0.1),
        RESTART: dict(restart_after_round=f["restart_after"], down_rounds=f["down_rounds"]),
        **{k: dict(codec=c, broadcast_error_feedback=c == "topk") for k, c in CODECS.items()},
        **SPARSE,
    }
    return [
        _spec(m, "faults", "iid", name, seed, f["total_steps"], sync_every=h, lr_schedule="cosine", **by_name[name])
        for name in names
        for seed in seeds
    ]


def diagnosis_points(m: dict[str, Any], best: tuple[float, float] | None) -> list[Point]:
    """Where DiLoCo loses to DDP: the inner warmup + cosine LR for both; DiLoCo at the sweep's best outer."""
    steps, h, seed = m["total_steps"], m["h_main"], 0
    points = _baselines(m, "diagnosis: cosine inner LR", "iid", seed, steps, lr_schedule="cosine")[:1]
    for outer in m["diagnosis_outers"]:
        points.append(_diloco(m, "diagnosis: cosine inner LR", "iid", h, outer, seed, steps, lr_schedule="cosine"))
    if best is not None and best not in (NESTEROV, AVERAGE):
        points.append(_diloco(m, "convergence", "iid", h, best, seed, steps))
    return points


def item_points(m: dict[str, Any], section: str, items: Sequence[str], seeds: Sequence[int], steps: int) -> list[Point]:
    """One run per item and seed over ``steps`` inner steps (iid): ``ddp`` (DDP), ``big`` (1 site,
    N times the batch) or ``LR/M[@H]`` (DiLoCo at H = h_main, or H, with outer lr LR, momentum M)."""
    points = []
    for item in items:
        if item in ("ddp", "big"):
            points += [_baselines(m, section, "iid", seed, steps)[0 if item == "ddp" else 2] for seed in seeds]
        else:
            outer, _, h = item.partition("@")
            lr, mom = (float(x) for x in outer.split("/"))
            points += [_diloco(m, section, "iid", int(h or m["h_main"]), (lr, mom), seed, steps) for seed in seeds]
    return points


def legacy_long(rows: list[dict[str, Any]], rounds: list[dict[str, Any]]) -> None:
    """Rows of section ``LONG`` (before one section per step count) go to ``long STEPS``."""
    renamed = {}
    for r in rows:
        if r["section"] == LONG:
            r["section"] = f"{LONG} {int(r['inner_steps'])}"
            new = f"{r['section']} | {r['data']} | {r['method']}"
            renamed[r["config"]], r["config"] = new, new
    for x in rounds:
        x["config"] = renamed.get(x["config"], x["config"])


# ---------------------------------------------------------------------------- analysis helpers
def unresolved(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Faults whose paired change (as the fault table shows it) still has SE > SE_TARGET_PP."""
    facts = rep.fault_table(rows)[1]
    return [name for name in (LOSS10, RESTART, *CODECS) if not facts.get(name, (0.0, math.inf, 0))[1] <= SE_TARGET_PP]


def sweep_best(rows: Sequence[dict[str, Any]], k: int) -> list[tuple[float, float]]:
    """The k (lr, momentum) settings with the lowest seed-0 final loss in the sweep."""
    pts = sorted(
        (r["final_val_loss"], (float(r["outer_lr"]), float(r["outer_momentum"])))
        for r in rows
        if r["section"] == "sweep" and r["seed"] == 0
    )
    return [p for _, p in pts[:k]]


# ---------------------------------------------------------------------------- running
def _order(points: list[Point]) -> list[Point]:
    """DDP first (each in a thread beside the rest), the rest longest first: fewer idle cores at the end."""
    work = ("diloco.sync_every", "rounds", "task_spec.num_sites")  # inner steps x sites
    longest_first = sorted(points, key=lambda p: math.prod(p.settings[k] for k in work), reverse=True)
    return [p for p in points if _is_ddp(p)] + [p for p in longest_first if not _is_ddp(p)]


def _is_ddp(point: Point) -> bool:
    return dict(point.extra).get("method") == DDP


def phases(rows: Sequence[dict[str, Any]], m: dict[str, Any]) -> list[Point]:
    """Phase 1: convergence, sweep, first fault seeds, diagnosis; phase 2: the sweep's best on more seeds
    and DiLoCo at the best outer; then fault seeds in waves while a fault's SE > SE_TARGET_PP and seeds
    and budget last. A side run: its runs only."""
    k = knobs(m)
    f, sw = k["faults"], k["sweep"]
    if not rows:
        m["t0"] = time.monotonic()
        if k["side"]:
            return _order(side_points(k))
        grid = [(lr, mom) for lr in sw["lrs"] for mom in sw["moms"]]
        names = [FAULT_FREE, LOSS10, RESTART, *CODECS]
        points = convergence_points(k) + sweep_points(k, grid, [0]) + fault_points(k, names, range(f["first_seeds"]))
        return _order(points + diagnosis_points(k, None))
    if k["side"]:
        return []
    more = []
    if not any(r["section"] == "sweep" and r["seed"] != 0 for r in rows):  # phase 2 not run yet
        best = sweep_best(rows, sw["confirm"] + 1)
        confirm = [p for p in best if p != NESTEROV][: sw["confirm"]] + [NESTEROV]
        more += sweep_points(k, confirm, sw["confirm_seeds"])
        more += diagnosis_points(k, best[0] if best else None)[1 + len(k["diagnosis_outers"]) :]
    todo = unresolved(rows)
    seeds = 1 + max((int(r["seed"]) for r in fault_rows(rows, FAULT_FREE)), default=-1)
    budget_left = k["budget_min"] - (time.monotonic() - m["t0"]) / 60
    if todo and seeds < f["max_seeds"] and budget_left > 0:
        more += fault_points(k, [FAULT_FREE, *todo], range(seeds, min(f["max_seeds"], seeds + f["step_seeds"])))
    if more:
        print(f"convergence: unresolved {todo}; {budget_left:.1f} min of budget left", flush=True)
    return _order(more)


def run_point(point: Point) -> RunResult | list[RunResult]:
    """One run: DDP, the in-process DiLoCo run, or (side run ``netem:A:B``) ``convergence_netem.run``."""
    side = str(point.settings.get("convergence.side") or "")
    if side.startswith("netem:"):
        a, b = (int(x) for x in side.split(":")[1:3])
        s, h = point.settings, point.settings["diloco.sync_every"]
        m = {f: s.get(FIELD_PATHS[f]) for f in ("num_sites", "size", "batch_size", "context_len")}
        return convergence_netem.run(m | {"h_main": h, "faults": {"total_steps": s["rounds"] * h}}, range(a, b), 1800.0)
    spec = point.run_spec()
    if _is_ddp(point):
        return run_ddp(spec)
    if mp.parent_process() is not None:  # a worker process: its CPU share its own (``own_session``)
        own_session()
    return run_inproc(spec)


# ---------------------------------------------------------------------------- side runs
ALIASES = {"fault-free": FAULT_FREE, "loss10": LOSS10, "restart": RESTART, "topk": "topk + error feedback"}


def side_points(k: dict[str, Any]) -> list[Point]:
    """The runs of side run ``convergence.side`` = ``KIND:ARGS`` (see the module doc)."""
    kind, _, rest = str(k["side"]).partition(":")
    if kind == "faults":
        a, b = (int(x) for x in rest.split(":"))
        names = _fault_names(k["fixed"]["convergence.fault_names"] or "fault-free,loss10,restart,int8,int4,topk")
        return fault_points(k, names, range(a, b))
    if kind in ("outer", "sweep"):  # ITEM,ITEM,...:A:B, seeds A..B-1; sweep: over the sweep's steps
        items, a, b = rest.rsplit(":", 2)
        section, steps = ("convergence", k["total_steps"]) if kind == "outer" else ("sweep", k["sweep"]["total_steps"])
        return item_points(k, section, items.split(","), range(int(a), int(b)), steps)
    if kind == "rerun-diloco":
        points = convergence_points(k) + diagnosis_points(k, None)
        return [p for p in points if p.settings["task_spec.num_sites"] > 1 and not _is_ddp(p)]
    if kind == "long":  # STEPS:ITEMS[:A:B], seeds A..B-1 (default 0), a section (a table) per step count
        steps, items, *seeds = rest.split(":")
        span = range(int(seeds[0]), int(seeds[1])) if seeds else range(1)
        return item_points(k, f"{LONG} {steps}", items.split(","), span, int(steps))
    if kind == "netem":
        a, _ = (int(x) for x in rest.split(":"))
        h = k["h_main"]
        settings = {
            "convergence.side": k["side"],
            **{FIELD_PATHS[f]: k[f] for f in ("num_sites", "size", "batch_size", "context_len")},
            "diloco.sync_every": h,
            "rounds": k["faults"]["total_steps"] // h,
        }
        return [Point("convergence", f"{convergence_netem.NETEM} | iid | pairs", a, settings)]
    raise SystemExit(f"convergence.side: unknown kind {kind!r}; known: faults, outer, sweep, rerun-diloco, long, netem")


def _fault_names(text: str) -> list[str]:
    """``convergence.fault_names``: comma-separated run names or aliases (``ALIASES``); a name with
    a comma in it ("1 site down, restarted") is put back together from its pieces."""
    known = [FAULT_FREE, LOSS10, RESTART, *CODECS, *SPARSE]
    out, acc = [], ""
    for piece in text.split(","):
        acc = f"{acc},{piece}" if acc else piece.strip()
        name = ALIASES.get(acc, acc)
        if name in known:
            out.append(name)
            acc = ""
    if acc:
        raise SystemExit(f"convergence.fault_names: unknown run {acc!r}; known: {known} or {sorted(ALIASES)}")
    return out


#: the side runs' CSVs a --replot merges: the lab's (``--set convergence.side=...``) and the script's
SIDE_FILES = ("convergence_convergence-side=", "convergence_faults", "convergence_outer", "convergence_netem")


def side_files(prefix: Path) -> list[Path]:
    """The side-run CSVs beside ``prefix`` (``OUT/convergence[_MODE]``) of its mode, oldest first."""
    mode = prefix.name.removeprefix("convergence")  # "", "_smoke" or "_full"
    out = [p for name in SIDE_FILES for p in prefix.parent.glob(name + "*.csv") if not p.stem.endswith("_rounds")]
    out = [p for p in out if (p.stem.endswith(mode) if mode else not p.stem.endswith(("_smoke", "_full")))]
    return sorted(out, key=lambda p: p.stat().st_mtime)


def ran_at(meta: dict[str, Any]) -> str:
    """When a saved run ran, as sortable text (``YYYY-MM-DD HH:MM``; a pre-lab script's
    provenance gives the date alone): the first date (and time) its stamp names."""
    when = re.search(r"(\d{4}-\d\d-\d\d)(?: (\d\d:\d\d))?", stamp_of(meta))
    return f"{when.group(1)} {when.group(2) or '00:00'}" if when else ""


def merge(prefix: Path, rows: list, rounds: list, meta: dict[str, Any]) -> tuple[list, list, dict[str, Any]]:
    """``--replot`` of a mode: the rows of the side runs saved beside its CSV added, oldest run first;
    of two rows of the same config and seed the newer run's stays (:func:`ran_at`: a side run
    redone after the mode's replaces its row, an older one only adds what the mode did not run);
    their stamps after the mode's own."""
    if prefix.name not in ("convergence", "convergence_smoke", "convergence_full"):
        return rows, rounds, meta  # a side run's own replot
    stamp = stamp_of(meta)
    when = dict.fromkeys(((r["config"], r["seed"]) for r in rows), ran_at(meta))
    sides = [(p, load_meta(p.with_suffix(""))) for p in side_files(prefix)]
    for csv_path, more in sorted(sides, key=lambda side: ran_at(side[1])):  # stable: file time breaks ties
        extra, t = csv_path.with_suffix(""), ran_at(more)
        new = [r for r in read_rows(csv_path) if when.get((r["config"], r["seed"]), "") <= t]
        keys = {(r["config"], r["seed"]) for r in new}
        when |= dict.fromkeys(keys, t)
        rows = [r for r in rows if (r["config"], r["seed"]) not in keys] + new
        rounds_path = extra.with_name(extra.name + "_rounds.csv")
        got = read_rows(rounds_path) if rounds_path.exists() else []
        rounds = [x for x in rounds if (x["config"], x["seed"]) not in keys]
        rounds += [x for x in got if (x["config"], x["seed"]) in keys]
        if new and more.get("command", "\0") not in stamp:  # not already counted in the main file's meta
            stamp += f" Merged: {stamp_of(more)}"
    legacy_long(rows, rounds)
    return rows, rounds, {"stamp": stamp}


def report(rows: list, rounds: list, m: dict[str, Any], prefix: Path) -> str:
    """The section: setup, scope, tables and plots (``convergence_report.report``)."""
    k = knobs(m)
    if k["side"]:
        return f"Side run `{k['side']}`: {len(rows)} runs in `{prefix.name}.csv`; a `--replot` of the mode merges them."
    return rep.report(rows, rounds, k, prefix, m["mode"])


def claims(rows: list, rounds: list, m: dict[str, Any]) -> list[str]:
    """One statement per claim of issue 18 (``convergence_report.claims_of``)."""
    k = knobs(m)
    return [] if k["side"] else ["**Claims**", "", rep.claims_of(rows, k)]


SPEC = Spec(
    name="convergence",
    title="Convergence (issue 18)",
    modes=MODES,
    fixed=FIXED,
    metrics=(("final_val_loss", 0.0, 10.0),),
    report=report,
    verdict=claims,
    execute=run_point,
    paths=tuple(p for p in FIXED if p.startswith("convergence.")) + (STEPS, BUDGET),
    phases=phases,
    beside=_is_ddp,
    jobs_fn=lambda point: not str(point.settings.get("convergence.side") or "").startswith("netem"),  # in this process
    merge=merge,
)
