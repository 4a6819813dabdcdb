"""The one runner of the lab: a :class:`Spec` declares an experiment, :func:`run` runs it.

An experiment over in-process DiLoCo runs (:func:`experiments.common.run_inproc`) is a
short declarative :class:`Spec`: its modes (smoke / quick / full), its grid and fixed
settings as overrides of the config tree by dotted path (``{"diloco.rounds.codec.name":
["fp32", "int8"]}``, the paths of ``dtrain worker`` / ``dtrain rendezvous`` flags and TOML
keys, plus ``inproc.*`` for what only the in-process cluster has: injected loss, a kill
and restart, the validation set), the metrics it reports and the named functions that
turn rows into its table (``report``) and its verdict lines (``verdict``). :func:`run`
expands the grid over the seeds, runs every point (``jobs`` at a time), writes
``OUT/NAME[_MODE].csv`` and ``..._rounds.csv``, and puts one section into RESULTS.md,
stamped with the commit, date, command and machine load it came from (a rerun replaces
its own section: :func:`experiments.common.update_results`).

``python -m experiments run NAME [--mode smoke|quick|full]`` is the command line
(:mod:`experiments.__main__`); :data:`SPECS` names every spec.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from experiments.common import (
    OUT_DIR,
    RESULTS_MD,
    ROOT,
    RunResult,
    RunSpec,
    load_meta,
    quiet_logging,
    read_rows,
    run_many,
    save_meta,
    update_results,
    write_csv,
)

__all__ = ["SPECS", "MODES", "TREE_FIELDS", "Spec", "load_spec", "run", "check_rows", "stamp", "main"]

#: every experiment written as a spec (module ``experiments.NAME`` holds ``SPEC``)
SPECS = ("codec_sweep", "loss_sweep")
MODES = ("smoke", "quick", "full")

#: config-tree path (``dtrain worker`` / ``dtrain rendezvous`` option) -> field of the in-process run;
#: ``inproc.*``: settings only the in-process cluster has (``RunSpec`` documents each)
TREE_FIELDS: dict[str, str] = {
    "rounds": "rounds",
    "eval_every": "eval_every",
    "task_spec.num_sites": "num_sites",
    "task_spec.size": "size",
    "task_spec.data": "data",
    "task_spec.batch_size": "batch_size",
    "task_spec.context_len": "context_len",
    "task_spec.lr": "lr",
    "task_spec.non_iid": "non_iid",
    "task_spec.lr_schedule": "lr_schedule",
    "task_spec.warmup_steps": "warmup_steps",
    "task_spec.decay_steps": "decay_steps",
    "diloco.sync_every": "sync_every",
    "diloco.buckets.bucket_bytes": "bucket_bytes",
    "diloco.buckets.chunk_bytes": "chunk_bytes",
    "diloco.rounds.codec.name": "codec",
    "diloco.rounds.codec.zstd_level": "zstd_level",
    "diloco.rounds.codec.topk_fraction": "topk_fraction",
    "diloco.rounds.codec.sparse_k": "sparse_k",
    "diloco.rounds.codec.sparse_chunk": "sparse_chunk",
    "diloco.rounds.codec.sparse_bits": "sparse_bits",
    "diloco.rounds.error_feedback_decay": "error_feedback_decay",
    "diloco.rounds.aggregation.sparse_mean": "sparse_mean",
    "diloco.rounds.error_feedback": "error_feedback",
    "diloco.rounds.broadcast_error_feedback": "broadcast_error_feedback",
    "diloco.rounds.repair": "repair",
    "outer.lr": "outer_lr",
    "outer.momentum": "outer_momentum",
    "rendezvous.reduce_timeout_s": "reduce_timeout_s",
    "rendezvous.broadcast_timeout_s": "broadcast_timeout_s",
    "rendezvous.heartbeat_timeout_s": "heartbeat_timeout_s",
    "inproc.push_loss": "push_loss",
    "inproc.pull_loss": "pull_loss",
    "inproc.datagram_drop": "datagram_drop",
    "inproc.restart_after_round": "restart_after_round",
    "inproc.down_rounds": "down_rounds",
    "inproc.num_val_batches": "num_val_batches",
    "inproc.track_drift": "track_drift",
}

Rows = list[dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class Spec:
    """One experiment, declared.

    Attributes:
        name: the module and file name (``OUT/NAME[_MODE].csv``; the RESULTS.md key NAME-MODE).
        title: the RESULTS.md section title (the mode is appended).
        modes: per mode: ``seeds`` (list), ``jobs``, ``fixed`` and ``grid`` (merged over the
            spec's own, by path), and any knob the spec's functions read (``m[...]``).
        grid: path -> values; every combination is one configuration (in the order given). A
            mode may instead give a list of points (path -> value dicts; a point's ``config``
            key, if any, is its label): configurations that are not a product.
        fixed: path -> value for every run.
        label: grid point (path -> value) -> the configuration's label (the ``config`` column).
        derive: grid point -> more path -> value settings (e.g. a flag that follows the codec).
        columns: grid point -> extra CSV columns (the swept variable under a short name).
        metrics: (column, low, high): the numbers every row reports, and the range a sane
            run's value lies in (the smoke test checks them: finite and in range).
        after_runs: (results, mode settings) -> None, extra measurements added to the rows.
        report: (rows, per-round rows, mode settings, csv prefix) -> the section's body under
            the stamp: setup, table, plots (the analysis; a spec's own function).
        verdict: (rows, per-round rows, mode settings) -> verdict lines, one per claim (a named
            function).
    """

    name: str
    title: str
    modes: dict[str, dict[str, Any]]
    grid: dict[str, list[Any]] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)
    label: Callable[[dict[str, Any]], str]
    derive: Callable[[dict[str, Any]], dict[str, Any]] = lambda point: {}
    columns: Callable[[dict[str, Any]], dict[str, Any]] = lambda point: {}
    metrics: tuple[tuple[str, float, float], ...]
    after_runs: Callable[[list[RunResult], dict[str, Any]], None] | None = None
    report: Callable[[Rows, Rows, dict[str, Any], Path], str]
    verdict: Callable[[Rows, Rows, dict[str, Any]], list[str]]

    def __post_init__(self) -> None:
        used = {p for m in self.modes.values() for pt in _points_of(m) for p in (*m.get("fixed", {}), *pt)} - {"config"}
        bad = sorted((used | set(self.fixed) | set(self.grid)) - set(TREE_FIELDS))
        if bad:
            raise ValueError(f"{self.name}: unknown config paths {bad}; allowed: {sorted(TREE_FIELDS)}")
        if set(self.modes) != set(MODES):
            raise ValueError(f"{self.name}: modes must be {MODES}, got {sorted(self.modes)}")

    def settings(self, mode: str) -> dict[str, Any]:
        """The mode's settings with the spec's fixed settings and grid merged under its own."""
        m = dict(self.modes[mode])
        m["fixed"] = {**self.fixed, **m.get("fixed", {})}
        grid = m.get("grid", {})
        m["grid"] = grid if isinstance(grid, list) else {**self.grid, **grid}
        m["mode"] = mode
        return m

    def run_specs(self, m: dict[str, Any]) -> list[RunSpec]:
        """One :class:`RunSpec` per grid point and seed (configurations in grid order, seeds inner)."""
        out = []
        for point in _points_of(m):
            point = dict(point)
            config = point.pop("config", None) or self.label(point)
            settings = {**m["fixed"], **point, **self.derive(point)}
            kw = {TREE_FIELDS[p]: v for p, v in settings.items()}
            extra = tuple(self.columns(point).items())
            for seed in m["seeds"]:
                out.append(RunSpec(experiment=self.name, config=config, seed=seed, extra=extra, **kw))
        return out


def _points_of(m: dict[str, Any]) -> list[dict[str, Any]]:
    """A mode's configurations: its list of points, or every combination of its grid."""
    grid = m.get("grid", {})
    if isinstance(grid, list):
        return grid
    paths = list(grid)
    return [dict(zip(paths, values)) for values in itertools.product(*(grid[p] for p in paths))]


def load_spec(name: str) -> Spec:
    """``experiments.NAME.SPEC``; SystemExit naming the allowed names for an unknown one."""
    if name not in SPECS:
        raise SystemExit(f"unknown spec {name!r}; allowed: {', '.join(SPECS)}")
    import importlib

    return importlib.import_module(f"experiments.{name}").SPEC


def _git(*args: str) -> str:
    try:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def code_version() -> str:
    """The commit checked out, ``+dirty`` when tracked files differ from it (taken before a run
    writes its outputs, some of which are tracked)."""
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def stamp(command: str, minutes: float, load_before: tuple[float, ...], version: str) -> str:
    """The provenance line of a RESULTS.md section: the code's ``version`` (:func:`code_version`),
    UTC date, command, wall minutes, machine load (1-min load average before and after against
    the CPU count), machine and library versions."""
    import torch

    after = os.getloadavg()
    return (
        f"Commit `{version}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, command `{command}` "
        f"({minutes:.1f} min); load average {load_before[0]:.1f} before, {after[0]:.1f} after, on "
        f"{os.cpu_count()} CPUs ({platform.machine()}); torch {torch.__version__}, Python {platform.python_version()}."
    )


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
) -> tuple[Rows, str]:
    """Run ``spec`` in ``mode`` (or, ``replot``, read its CSV back); write the CSVs; publish
    the section into ``results`` (a path, or ``none``). Returns (rows, section body).

    Raises:
        SystemExit: ``seeds`` or ``jobs`` below 1 (naming the flag), before anything runs.
    """
    for flag, v in (("--seeds", seeds), ("--jobs", jobs)):
        if v is not None and v < 1:
            raise SystemExit(f"{flag} must be >= 1, got {v}")
    m = spec.settings(mode)
    if seeds is not None:
        m["seeds"] = list(range(seeds))
    m["jobs"] = jobs or m.get("jobs", 1)
    prefix = out / (spec.name if mode == "quick" else f"{spec.name}_{mode}")
    rounds_path = prefix.with_name(prefix.name + "_rounds.csv")
    if replot:
        rows, meta = read_rows(prefix.with_suffix(".csv")), load_meta(prefix)
        rounds = read_rows(rounds_path) if rounds_path.exists() else []
    else:
        runs = spec.run_specs(m)
        load, version = os.getloadavg(), code_version()
        t0 = time.perf_counter()
        print(f"{spec.name} ({mode}): {len(runs)} runs, {m['jobs']} at a time", flush=True)
        res = run_many(runs, jobs=m["jobs"], verbose=verbose)
        if spec.after_runs is not None:
            spec.after_runs(res, m)
        rows, rounds = [r.row for r in res], [x for r in res for x in r.rounds]
        write_csv(prefix.with_suffix(".csv"), rows)
        write_csv(rounds_path, rounds)
        meta = {"stamp": stamp(command, (time.perf_counter() - t0) / 60, load, version)}
        save_meta(prefix, meta)
    lines = spec.verdict(rows, rounds, m)
    body = f"{meta['stamp']}\n\n{spec.report(rows, rounds, m, prefix)}\n\n" + "\n".join(lines)
    print(body)
    if str(results).lower() != "none":
        update_results(Path(results), f"{spec.name}-{mode}", f"{spec.title} ({mode})", body)
    return rows, body


def check_rows(spec: Spec, rows: Rows) -> list[str]:
    """What is wrong with ``rows`` as a pipeline's output: a missing metric, a value that is not a
    finite number, or one outside the spec's range (an empty list: nothing)."""
    bad = []
    for r in rows:
        for col, lo, hi in spec.metrics:
            v = r.get(col)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not lo <= v <= hi:
                bad.append(f"{r.get('config')} seed {r.get('seed')}: {col} = {v!r}, not in [{lo}, {hi}]")
    return bad


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
    argv = list(argv) if argv is not None else None
    a = ap.parse_args(argv)
    if a.cmd == "list":
        for name in SPECS:
            print(f"{name}: {load_spec(name).title}")
        return 0
    quiet_logging(a.verbose)
    shown = [x for x in (argv if argv is not None else []) if x != "--replot"]
    command = shlex.join([".venv/bin/python", "-m", "experiments", *shown])
    run(
        load_spec(a.spec),
        a.mode,
        out=a.out,
        results=a.results,
        seeds=a.seeds,
        jobs=a.jobs,
        replot=a.replot,
        verbose=a.verbose,
        command=command,
    )
    return 0
