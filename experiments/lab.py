"""The one runner of the lab: a :class:`Spec` declares an experiment, :func:`run` runs it.

A spec gives its modes (smoke / quick / full), its grid and fixed settings as overrides of the
config tree by dotted path (``{"diloco.rounds.codec.name": ["fp32", "int8"]}``: the paths of
``dtrain worker`` / ``dtrain rendezvous`` flags and TOML keys, plus ``inproc.*`` for what only the
in-process cluster has), its metrics, and the named functions that turn rows into its table
(``report``) and verdict lines (``verdict``). :func:`run` expands the grid over the seeds, runs
every point (``jobs`` at a time; by default the in-process DiLoCo run,
:func:`experiments.common.run_inproc`, else the spec's ``execute`` of one :class:`Point`), writes
``OUT/NAME[_MODE].csv`` and ``..._rounds.csv``, and puts one section, stamped with the commit,
date, command and machine load, into RESULTS.md (:func:`experiments.common.update_results`).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import importlib
import itertools
import json
import math
import os
import re
import shlex
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Sequence

from experiments import bench
from experiments.common import (
    OUT_DIR,
    RESULTS_MD,
    RunResult,
    RunSpec,
    code_version,
    fmt_pm,
    load_meta,
    mean_std,
    paired_deltas,
    quiet_logging,
    read_rows,
    run_inproc,
    run_many,
    save_meta,
    typed,
    update_results,
    write_csv,
)

#: every experiment written as a spec (module ``experiments.NAME`` holds ``SPEC``)
SPECS = tuple(
    "codec_sweep loss_sweep delayed_momentum diloco_sanity site_failures datagram_val_loss netem_loss streaming "
    "wan_sweep datagram_vs_grpc heterogeneous reliability netem_udp_ceiling hf_throughput datagram_mean_loss "
    "catch_up datagram_tcp_share convergence chaos vs_torchft".split()
)
MODES = ("smoke", "quick", "full")
#: the config paths of the sites, the model size, H and the rounds: what most specs set
SITES, SIZE, H, ROUNDS = "task_spec.num_sites", "task_spec.size", "diloco.sync_every", "rounds"

#: config-tree path (``dtrain worker`` / ``dtrain rendezvous`` option, or ``inproc.*``) -> ``RunSpec`` field
TREE_FIELDS = {f.metadata["path"]: f.name for f in fields(RunSpec) if "path" in f.metadata}
#: ``RunSpec`` field -> its config path (the inverse of :data:`TREE_FIELDS`)
FIELD_PATHS = {f: p for p, f in TREE_FIELDS.items()}

Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class Point:
    """One run of a spec: the configuration's label, the seed, its settings by config path (fixed, grid
    point, ``derive``'s) and ``extra``, the spec's ``columns`` of the point (copied into the CSV row)."""

    experiment: str
    config: str
    seed: int
    settings: dict[str, Any]
    extra: tuple[tuple[str, Any], ...] = ()

    def run_spec(self, **override: Any) -> RunSpec:
        """The in-process run of these settings (paths of :data:`TREE_FIELDS`), ``override`` by field."""
        kw = {TREE_FIELDS[p]: v for p, v in self.settings.items() if p in TREE_FIELDS}
        return RunSpec(
            experiment=self.experiment, config=self.config, seed=self.seed, extra=self.extra, **(kw | override)
        )

    def row(self, **measured: Any) -> dict[str, Any]:
        """A CSV row: experiment, config, seed, the settings by path, the extra columns, ``measured``."""
        head = {"experiment": self.experiment, "config": self.config, "seed": self.seed}
        return {**head, **self.settings, **dict(self.extra), **measured}


def run_point(point: Point) -> RunResult:
    """The default ``execute``: the in-process DiLoCo run of the point (:func:`experiments.common.run_inproc`)."""
    return run_inproc(point.run_spec())


@dataclass(frozen=True, kw_only=True)
class Spec:
    """One experiment, declared.

    Attributes:
        name: the module and file name (``OUT/NAME[_MODE].csv``; the RESULTS.md key NAME-MODE).
        title: the RESULTS.md section title (the mode is appended).
        modes: per mode: ``seeds`` (list), ``jobs``, ``fixed`` and ``grid`` (merged over the
            spec's own, by path), and any knob the spec's functions read (``m[...]``).
        grid: path -> values; every combination is one configuration (in the order given). A
            mode may instead give a list of points (path -> value dicts, a ``config`` key their label).
        fixed: path -> value for every run.
        label: grid point -> the configuration's label (the ``config`` column) where it gives none.
        derive: a configuration's settings (fixed and grid point, by path) -> more settings (a flag
            that follows the codec, τ that follows H); it may raise ValueError on a bad setting.
        columns: grid point -> extra CSV columns (the swept variable under a short name).
        metrics: (column, low, high): the numbers every row reports, and the range a sane
            run's value lies in (the smoke test checks them: finite and in range).
        after_runs: (results, mode settings) -> None, extra measurements added to the rows.
        report: (rows, per-round rows, mode settings, csv prefix) -> the section's body under
            the stamp: setup, table, plots.
        verdict: (rows, per-round rows, mode settings) -> verdict lines, one per claim.
        execute: a module-level function (runs go to worker processes) of one :class:`Point`
            returning its :class:`RunResult`, or a list of them (one row per setting a run walks);
            default: the in-process DiLoCo run.
        paths: the config paths ``execute`` reads beyond :data:`TREE_FIELDS`.
        jobs_fn: which points may run ``jobs`` at a time: the others run first, one at a time
            (a DDP baseline's ranks each want a core). None: every point.
        netem: its runs need emulated links (root, ``ip netns``): its smoke is in tests/netem/.
        phases: runs in phases instead of grid x seeds: (rows so far, mode settings) -> the next
            points, [] when done; asked first with no rows (its answer is :meth:`points`), then after
            each phase (a sweep's best confirmed; a seed at a time until an SE is reached).
        beside: which points run each in a thread of this process beside the others (a DDP
            baseline's ranks wait in every all-reduce; the cores would idle). None: none.
        merge: on ``--replot``: (csv prefix, rows, per-round rows, meta) -> the same with the
            rows of the spec's side runs saved beside it added (their commands in the stamp)."""

    name: str
    title: str
    modes: dict[str, dict[str, Any]]
    grid: dict[str, list[Any]] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)
    label: Callable[[dict[str, Any]], str] = lambda point: _unlabelled(point)
    derive: Callable[[dict[str, Any]], dict[str, Any]] = lambda point: {}
    columns: Callable[[dict[str, Any]], dict[str, Any]] = lambda point: {}
    metrics: tuple[tuple[str, float, float], ...]
    after_runs: Callable[[list[RunResult], dict[str, Any]], None] | None = None
    report: Callable[[Rows, Rows, dict[str, Any], Path], str]
    verdict: Callable[[Rows, Rows, dict[str, Any]], list[str]]
    execute: Callable[[Point], RunResult] = run_point
    paths: tuple[str, ...] = ()
    jobs_fn: Callable[[Point], bool] | None = None
    phases: Callable[[Rows, dict[str, Any]], list[Point]] | None = None
    beside: Callable[[Point], bool] | None = None
    merge: Callable[[Path, Rows, Rows, dict[str, Any]], tuple[Rows, Rows, dict[str, Any]]] | None = None
    netem: bool = False

    def __post_init__(self) -> None:
        used = {p for m in self.modes.values() for pt in _points_of(m) for p in (*m.get("fixed", {}), *pt)} - {"config"}
        allowed = set(TREE_FIELDS) | set(self.paths)
        bad = sorted((used | set(self.fixed) | set(self.grid)) - allowed)
        if bad:
            raise ValueError(f"{self.name}: unknown config paths {bad}; allowed: {sorted(allowed)}")
        if set(self.modes) != set(MODES):
            raise ValueError(f"{self.name}: modes must be {MODES}, got {sorted(self.modes)}")

    def settings(self, mode: str) -> dict[str, Any]:
        """The mode's settings with the spec's fixed settings and grid merged under its own."""
        m = self.modes[mode]
        grid = m.get("grid", {})
        fixed = {**self.fixed, **m.get("fixed", {})}
        return m | {"fixed": fixed, "grid": grid if isinstance(grid, list) else {**self.grid, **grid}, "mode": mode}

    def points(self, m: dict[str, Any], seeds: Sequence[int] | None = None) -> list[Point]:
        """One :class:`Point` per grid point and seed (grid order, seeds inner; ``seeds``: these, not the
        mode's), each built into its ``RunSpec`` here when it runs in-process, so a bad setting fails
        before anything runs. A spec with ``phases`` (and no ``seeds``): its first phase."""
        if self.phases is not None and seeds is None:
            return self.phases([], m)
        out = []
        for point in _points_of(m):
            point = dict(point)
            config = point.pop("config", None) or self.label(point)
            settings = {**m["fixed"], **point}
            settings |= self.derive(settings)
            extra = tuple(self.columns(point).items())
            for seed in m["seeds"] if seeds is None else seeds:
                p = Point(self.name, config, seed, settings, extra)
                if self.execute is run_point:
                    p.run_spec()
                out.append(p)
        return out


def _unlabelled(point: dict[str, Any]) -> str:
    raise ValueError(f"grid point {point} has no 'config' and its spec no label")


def _points_of(m: dict[str, Any]) -> list[dict[str, Any]]:
    """A mode's configurations: its list of points, or every combination of its grid."""
    grid = m.get("grid", {})
    if isinstance(grid, list):
        return grid
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def load_spec(name: str) -> Spec:
    """``experiments.NAME.SPEC``; SystemExit naming the allowed names for an unknown one."""
    if name not in SPECS:
        raise SystemExit(f"unknown spec {name!r}; allowed: {', '.join(SPECS)}")
    return importlib.import_module(f"experiments.{name}").SPEC


def stamp(command: str, minutes: float, load_before: tuple[float, ...], version: str) -> str:
    """The provenance line of a RESULTS.md section: ``version`` (:func:`code_version`), UTC date, command,
    wall minutes, 1-min load average before and after against the CPUs, machine and library versions."""
    st = bench.stamp(load_before[0], commit=version)
    return (
        f"Commit `{st['commit']}`, {st['date']}, command `{command}` ({minutes:.1f} min); load average "
        f"{st['load_before']:.1f} before, {st['load_after']:.1f} after, on {st['cpus']} CPUs ({st['machine']}); "
        f"torch {st['torch']}, Python {st['python']}."
    )


def grid_conflicts(m: dict[str, Any], overrides: dict[str, Any]) -> list[str]:
    """The overridden paths some grid point of the mode's settings ``m`` sets to another value (the
    point would win, so the override would be ignored there); a point that sets the same value agrees."""
    return sorted({p for point in _points_of(m) for p, v in point.items() if p in overrides and v != overrides[p]})


def run(
    spec: Spec,
    mode: str,
    *,
    out: Path = OUT_DIR,
    results: str = str(RESULTS_MD),
    seeds: int | None = None,
    jobs: int | None = None,
    replot: bool = False,
    verbose: bool = False,
    command: str = "",
    overrides: dict[str, Any] | None = None,
) -> tuple[Rows, str]:
    """Run ``spec`` in ``mode`` (``replot``: read its CSVs back), write the CSVs and publish the section
    into ``results`` (a path, or ``none``); returns (rows, section body). ``overrides``: path -> value
    over the mode's fixed settings (they name the CSV files and the section). SystemExit before
    anything runs for ``seeds`` or ``jobs`` below 1, an unknown path, or one the mode's grid sets."""
    for flag, v in (("--seeds", seeds), ("--jobs", jobs)):
        if v is not None and v < 1:
            raise SystemExit(f"{flag} must be >= 1, got {v}")
    overrides = overrides or {}
    allowed = set(TREE_FIELDS) | set(spec.paths)
    if set(overrides) - allowed:
        raise SystemExit(f"--set: unknown path(s) {sorted(set(overrides) - allowed)}; allowed: {sorted(allowed)}")
    m = spec.settings(mode)
    if gridded := grid_conflicts(m, overrides):
        raise SystemExit(
            f"--set: {gridded} vary per grid point in {spec.name}'s {mode} mode; --set overrides fixed settings only"
        )
    m["fixed"].update(overrides)
    if seeds is not None:
        m["seeds"] = list(range(seeds))
    m["jobs"] = jobs or m.get("jobs", 1)
    tag = ",".join(f"{p}={v}" for p, v in overrides.items())
    # no dot (Path.suffix), no slash, space or bracket: "outer.lr=0.5,x=[1, 2]" -> "outer-lr=0-5_x=-1_-2-"
    name = spec.name + (re.sub(r"[^\w=+-]", "-", f"_{tag}".replace(",", "_")) if tag else "")
    prefix = out / file_stem(name if mode == "quick" else f"{name}_{mode}")
    rounds_path = prefix.with_name(prefix.name + "_rounds.csv")
    if replot:
        rows, meta = read_rows(prefix.with_suffix(".csv")), load_meta(prefix)
        rounds = read_rows(rounds_path) if rounds_path.exists() else []
        if spec.merge is not None:
            rows, rounds, meta = spec.merge(prefix, rows, rounds, meta)
    else:
        runs = spec.points(m)
        load, version = os.getloadavg(), code_version()
        t0 = time.perf_counter()
        print(f"{spec.name} ({mode}): {len(runs)} runs, {m['jobs']} at a time", flush=True)
        res = _run_phased(spec, runs, m, verbose) if spec.phases else _run_all(spec, runs, m["jobs"], verbose)
        if spec.after_runs is not None:
            spec.after_runs(res, m)
        rows, rounds = [r.row for r in res], [x for r in res for x in r.rounds]
        write_csv(prefix.with_suffix(".csv"), rows)
        write_csv(rounds_path, rounds)
        meta = {"stamp": stamp(command, (time.perf_counter() - t0) / 60, load, version)}
        save_meta(prefix, meta)
    lines = spec.verdict(rows, rounds, m)
    body = f"{stamp_of(meta)}\n\n{spec.report(rows, rounds, m, prefix)}\n\n" + "\n".join(lines)
    print(body)
    if str(results).lower() != "none":
        title = f"{spec.title} ({mode}" + "".join(f", {p} {v}" for p, v in overrides.items()) + ")"
        update_results(Path(results), f"{spec.name}-{mode}" + (f"-{tag}" if tag else ""), title, body)
    return rows, body


#: a run's file stem at most (a file name may have 255 bytes; "_rounds.csv" / "_meta.json" are added)
MAX_STEM_BYTES = 200


def file_stem(name: str) -> str:
    """``name`` as the stem of a run's files: itself when it fits :data:`MAX_STEM_BYTES`, else its
    start and ``_h`` + 12 hex digits of its SHA-256 (long ``--set`` values, e.g. a list of run
    names, made a name the file system refused after the runs had run)."""
    raw = name.encode()
    if len(raw) <= MAX_STEM_BYTES:
        return name
    head = raw[: MAX_STEM_BYTES - 14].decode(errors="ignore")
    return f"{head}_h{hashlib.sha256(raw).hexdigest()[:12]}"


def stamp_of(meta: dict[str, Any]) -> str:
    """The stamp saved with a run (a pre-lab script's saved its command, minutes and provenance)."""
    if "stamp" in meta:
        return meta["stamp"]
    return f"Command `{meta['command']}` ({meta['minutes']:.1f} min; {meta['provenance']})."


def _run_all(spec: Spec, runs: list[Point], jobs: int, verbose: bool) -> list[RunResult]:
    """Every point's result in the order of ``runs``: those ``beside`` picks each in a thread from the
    start, those ``jobs_fn`` holds back first one at a time, then the rest ``jobs`` at a time."""
    side = [i for i, p in enumerate(runs) if spec.beside is not None and spec.beside(p)]
    par = [i for i, p in enumerate(runs) if i not in side and (spec.jobs_fn is None or spec.jobs_fn(p))]
    seq = [i for i in range(len(runs)) if i not in set(par) | set(side)]
    out: dict[int, RunResult | list[RunResult]] = {}
    with cf.ThreadPoolExecutor(max(1, len(side))) as ex:
        futs = {i: ex.submit(spec.execute, runs[i]) for i in side}
        for idx, n in ((seq, 1), (par, jobs)):
            out.update(zip(idx, run_many([runs[i] for i in idx], jobs=n, verbose=verbose, fn=spec.execute)))
        out.update((i, f.result()) for i, f in futs.items())
    return [r for i in range(len(runs)) for r in (out[i] if isinstance(out[i], list) else [out[i]])]


def _run_phased(spec: Spec, runs: list[Point], m: dict[str, Any], verbose: bool) -> list[RunResult]:
    """The first phase (``runs``), then each next one ``spec.phases`` gives until it gives none."""
    out: list[RunResult] = []
    while runs:
        out += _run_all(spec, runs, m["jobs"], verbose)
        runs = spec.phases([r.row for r in out], m)
        if runs:
            print(f"{spec.name}: {len(runs)} more runs", flush=True)
    return out


def check_rows(spec: Spec, rows: Rows) -> list[str]:
    """What is wrong with ``rows``: a missing metric, or a value not finite or outside the spec's range."""
    bad = []
    for r in rows:
        for col, lo, hi in spec.metrics:
            v = r.get(col)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not lo <= v <= hi:
                bad.append(f"{r.get('config')} seed {r.get('seed')}: {col} = {v!r}, not in [{lo}, {hi}]")
    return bad


# ---------------------------------------------------------------------------- what the specs' reports share
def met(ok: bool, miss: str = "NOT met") -> str:
    """A verdict line's judgement in bold: ``**met**``, else ``**NOT met**`` (or ``miss``)."""
    return f"**{'met' if ok else miss}**"


def files(prefix: Path, *pngs: Path, rounds: str = "") -> str:
    """The sentence naming a section's files: the CSV, the per-round CSV as ``rounds`` (none: not named), the plots."""
    out = f"CSV: `{prefix.with_suffix('.csv').name}`" + (f", {rounds}: `{prefix.name}_rounds.csv`" if rounds else "")
    if pngs:
        out += f"; plot{'s' if len(pngs) > 1 else ''}: " + ", ".join(f"`{p.name}`" for p in pngs)
    return out + "."


def ppl_changes(rows: Rows, base: Rows) -> list[float]:
    """Per row paired by seed with ``base``: the perplexity change exp(Δ final val loss) − 1 (a fraction)."""
    return [math.exp(d) - 1 for d in paired_deltas(rows, base)]


def loss_columns(rows: Rows, base: Rows, vs: str, final: str = "final val loss") -> dict[str, str]:
    """A configuration's table cells ``final`` (mean ± std over its rows), the final val loss's Δ against
    ``base`` paired by seed (``Δ loss vs VS (paired)``) and the perplexity change in % it is."""
    d = paired_deltas(rows, base)
    return {
        final: fmt_pm([r["final_val_loss"] for r in rows]),
        f"Δ loss vs {vs} (paired)": fmt_pm(d, "{:+.4f}"),
        "Δ perplexity %": fmt_pm([math.exp(x) - 1 for x in d], "{:+.2f}", 100),
    }


def ppl_target(ppl: Sequence[float], target_pct: float) -> str:
    """A perplexity change over seeds (fractions) against a target (%): the mean, its std and standard
    error, **met** or not by the mean, and whether mean + 1 SE is within the target too."""
    mu, sd = mean_std(ppl)
    se = sd / math.sqrt(len(ppl))
    up = (mu + se) * 100
    return (
        f"perplexity change {mu * 100:+.2f}% (std {sd * 100:.2f}%, standard error {se * 100:.2f}% over {len(ppl)} "
        f"seeds); target ≤ {target_pct:g}%: {met(mu * 100 <= target_pct)} by the mean; mean + 1 SE = {up:+.2f}%, "
        + ("also within it" if up <= target_pct else f"not resolved at {len(ppl)} seeds")
    )


def decorate(ax, xlabel: str = "", ylabel: str = "", title: str = "", *, legend: float | None = 8, **kw: Any) -> None:
    """A plot's axis labels, title (10-point), ``ax.set(**kw)`` (scales, limits, ticks) and a legend of
    ``legend``-point text (None: none)."""
    ax.set(xlabel=xlabel, ylabel=ylabel, **kw)
    if title:
        ax.set_title(title, fontsize=10)
    if legend:
        ax.legend(fontsize=legend)


def seeds_and_mean(ax, x: float, ys: Sequence[float], color: Any, label: str | None = None, **kw: Any) -> None:
    """The seeds' values ``ys`` at ``x`` as faint dots and their mean ± std as a point with error bars (``kw``)."""
    ax.scatter([x] * len(ys), ys, s=12, color=color, alpha=0.4)
    mu, sd = mean_std(ys)
    ax.errorbar([x], [mu], yerr=[sd], color=color, capsize=3, label=label, **{"marker": "o", **kw})


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments run NAME [--mode M] ...`` / ``python -m experiments list``."""
    ap = argparse.ArgumentParser(prog="python -m experiments", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the specs")
    r = sub.add_parser("run", help="run one spec")
    r.add_argument("spec", choices=SPECS)
    r.add_argument("--mode", choices=MODES, default="quick", help="smoke: seconds, measures nothing (CI)")
    r.add_argument("--seeds", type=int, help="number of seeds, 0..n-1 (default per mode)")
    r.add_argument("--jobs", type=int, help="runs at a time, each in its own process")
    r.add_argument("--out", type=Path, default=OUT_DIR, help="directory for the CSV and PNG files")
    r.add_argument("--results", default=str(RESULTS_MD), help="RESULTS.md to update, or 'none'")
    r.add_argument("--replot", action="store_true", help="run nothing: redo the section from the CSV files")
    r.add_argument("--verbose", action="store_true", help="log the library's INFO lines")
    r.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a fixed setting by config path (repeatable), e.g. --set outer.lr=1",
    )
    a = ap.parse_args(argv)
    if a.cmd == "list":
        for name in SPECS:
            print(f"{name}: {load_spec(name).title}")
        return 0
    quiet_logging(a.verbose)
    shown = [x for x in (argv if argv is not None else []) if x != "--replot"]
    command = shlex.join([".venv/bin/python", "-m", "experiments", *shown])
    opts = {k: getattr(a, k) for k in ("out", "results", "seeds", "jobs", "replot", "verbose")}
    run(load_spec(a.spec), a.mode, command=command, overrides=_parse_sets(a.set), **opts)
    return 0


def _parse_sets(items: list[str]) -> dict[str, Any]:
    """``["outer.lr=1", "netem.rates=[10,50]", ...]`` -> ``{"outer.lr": 1, "netem.rates": [10, 50]}``:
    a JSON value as such (numbers, true/false, null, lists), anything else as a CSV cell reads."""
    out = {}
    for item in items:
        path, eq, value = item.partition("=")
        if not eq or not path:
            raise SystemExit(f"--set takes PATH=VALUE, got {item!r}")
        try:
            out[path] = json.loads(value)
        except ValueError:
            out[path] = typed(value)
    return out
