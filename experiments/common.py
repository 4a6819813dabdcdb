"""Shared helpers of the lab (:mod:`experiments.lab`) and its specs: one in-process run
(:func:`run_inproc`: N DiLoCo sites training the built-in GPT as threads over
:class:`dtrain.sim.InprocCluster`), several in worker processes (:func:`run_many`), and the
CSV, markdown and RESULTS.md helpers. Measurements are figures to print and plot, never asserts.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import csv
import itertools
import json
import logging
import math
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from dtrain.sim import InprocCluster, Site
from dtrain.tasks import TaskSpec, build_task
from dtrain.tasks.builtin import make_optimizer, make_scheduler
from experiments.runspec import RunSpec

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "experiments" / "out"
RESULTS_MD = ROOT / "experiments" / "RESULTS.md"
#: 64 KiB buckets of 16 KiB chunks (each chunk encoded on its own): the in-process sweeps' layout
BUCKETS_64K = {"diloco.buckets.bucket_bytes": 64 * 1024, "diloco.buckets.chunk_bytes": 16 * 1024}


def quiet_logging(verbose: bool = False) -> None:
    """Library warnings (one per lost chunk) would drown the progress lines."""
    logging.basicConfig(level=logging.INFO if verbose else logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("dtrain").setLevel(logging.INFO if verbose else logging.ERROR)


# ---------------------------------------------------------------------------- one run
@dataclass
class RunResult:
    """``row``: one CSV row; ``rounds``: one dict per round (see :func:`run_inproc`)."""

    row: dict[str, Any]
    rounds: list[dict[str, Any]] = field(default_factory=list)


def _max_pairwise_l2(thetas: Sequence[torch.Tensor]) -> float:
    return max((float(torch.linalg.vector_norm(a - b)) for a, b in itertools.combinations(thetas, 2)), default=0.0)


class _Recorder:
    """Per-round facts gathered from every site's ``on_round`` callback (site threads)."""

    def __init__(self, spec: RunSpec, evaluate) -> None:
        self.spec = spec
        self.evaluate = evaluate
        self.lock = threading.Lock()
        self.pending: dict[int, dict[int, torch.Tensor]] = {}  # round -> site -> θ
        self.drift: dict[int, float] = {}
        self.val: dict[int, float] = {}
        self.callback_s = [0.0] * spec.num_sites

    def hook(self, site: Site):
        def on_round(outcome) -> None:
            t0 = time.perf_counter()
            res = outcome.result
            rnd = res.round if res is not None else site.diloco.round - 1
            every = self.spec.eval_every
            if site.index == 0 and every and (rnd + 1) % every == 0 and rnd + 1 < self.spec.rounds:
                self.val[rnd] = self.evaluate(site.model)  # the model was just reset to θ
            if self.spec.track_drift:
                theta = site.theta()
                with self.lock:
                    got = self.pending.setdefault(rnd, {})
                    got[site.index] = theta
                    if len(got) == self.spec.num_sites:
                        self.drift[rnd] = _max_pairwise_l2(list(self.pending.pop(rnd).values()))
            self.callback_s[site.index] += time.perf_counter() - t0

        return on_round


def _round_records(spec: RunSpec, results: list[list[Any]], rec: _Recorder, final0: float) -> list[dict[str, Any]]:
    """One record per round over the sites' ``RoundResult`` lists (site 0's final validation loss: ``final0``)."""
    per_round = [[x[r] for x in results if r < len(x)] for r in range(max((len(x) for x in results), default=0))]
    return [
        {
            "experiment": spec.experiment,
            "config": spec.config,
            "seed": spec.seed,
            "round": rr[0].round,
            "val_loss": rec.val.get(rr[0].round, final0 if r == len(results[0]) - 1 else float("nan")),
            "drift": rec.drift.get(rr[0].round, float("nan")),
            "bytes_total": sum(x.bytes_sent + x.bytes_received for x in rr),
            "round_s": statistics.fmean(x.total_s for x in rr),
            "stale_buckets": sum(x.stale_buckets for x in rr),
            "repaired_buckets": sum(x.repaired_buckets for x in rr),
            "rejected": sum(sum(x.rejected.values()) for x in rr),
            "reduce_arrived": statistics.fmean(x.reduce_arrived_fraction for x in rr),
            "broadcast_arrived": statistics.fmean(x.broadcast_arrived_fraction for x in rr),
        }
        for r, rr in enumerate(per_round)
    ]


def train_with_restart(
    cluster: InprocCluster,
    step: Callable[[Site, int], None],
    spec: RunSpec,
    hook: Callable[[Site], Callable[[Any], None]],
) -> None:
    """Every site trains until its training position (``DiLoCo.inner_steps``) reaches H·rounds
    (``step(site, k)`` at position k); with ``spec.restart_after_round`` the last site dies
    after that round and comes back (``InprocCluster.restart``) once site 0 applied
    ``spec.down_rounds`` more rounds, with ``hook(site)`` among its ``on_round`` callbacks.

    The loop follows the site's own position, not a count of its own: a site cut from a round
    resyncs to a member's position, which can move it a round back or forth (issue 18).

    Raises:
        TimeoutError / RuntimeError: as ``InprocCluster.run``; also a restarted site's failure."""
    total = spec.sync_every * spec.rounds
    victim = spec.num_sites - 1 if spec.restart_after_round >= 0 else -1
    restart_step = spec.restart_after_round * spec.sync_every
    deadline = time.monotonic() + spec.timeout_s
    errors: list[BaseException] = []

    def come_back() -> Site:
        cluster.kill(victim)
        while cluster.sites[0].diloco.round < spec.restart_after_round + spec.down_rounds:
            if time.monotonic() > deadline or cluster.sites[0].thread is None or not cluster.sites[0].thread.is_alive():
                raise TimeoutError(f"site 0 did not reach round {spec.restart_after_round + spec.down_rounds}")
            time.sleep(0.01)
        site = cluster.restart(victim)
        site.diloco.on_round.append(hook(site))
        return site

    def loop(site: Site) -> None:
        offset, restarting = 0, False  # offset: a restarted site that pulled no position starts at its round
        try:
            while not site.killed.is_set() and site.diloco.inner_steps + offset < total:
                k = site.diloco.inner_steps + offset
                if site.index == victim and not restarting and k >= restart_step:
                    restarting = True  # from here on the killed site's errors are raised below, not by run()
                    site = come_back()
                    offset = 0 if site.diloco.inner_steps else site.diloco.round * spec.sync_every
                    continue
                step(site, k)
        except BaseException as e:  # noqa: BLE001 - the dead site's thread: raised below
            if not restarting:
                raise
            errors.append(e)

    cluster.run(loop, timeout_s=spec.timeout_s)
    if errors:
        raise RuntimeError(f"restarted site {victim} failed: {errors[0]!r}") from errors[0]


def run_inproc(spec: RunSpec) -> RunResult:
    """Train ``spec.num_sites`` sites for ``spec.rounds`` rounds; measure. Raises TimeoutError /
    RuntimeError from ``InprocCluster.run`` (a site hung or failed).

    Row fields (sums over sites and rounds unless said otherwise): the spec's fields,
    ``num_params``, ``first_val_loss`` (θ at the start), ``final_val_loss`` (mean over sites of
    each site's θ after the last round), ``val_loss_site_spread`` (max − min over sites),
    ``rounds_done`` (rounds site 0 applied), ``resyncs`` / ``deferred``, ``wall_s``, ``inner_s``
    and ``sync_s`` (mean per site; sync = time inside ``DiLoCo.sync``, the quorum wait included),
    ``round_s`` (mean engine time of a round), ``bytes_sent`` (reduce pushes), ``bytes_received``
    (means and repairs pulled), ``bytes_total``, ``bytes_per_round_site``, ``encode_s``,
    ``decode_s``, ``stale_buckets``, ``repaired_buckets``, ``skipped_buckets``, ``rejected``,
    ``reduce_arrived`` / ``broadcast_arrived`` (mean fractions), ``max_drift`` / ``final_drift``
    (max pairwise ‖θ_i − θ_j‖₂), ``theta_norm``, ``consistent`` (θ checksums equal at the end)."""
    torch.set_num_threads(1)
    t_build = time.perf_counter()
    tasks = [build_task(spec.task_spec(i)) for i in range(spec.num_sites)]
    ts = spec.task_spec(0)
    evaluate = spec.evaluator()

    def outer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=spec.outer_lr, momentum=spec.outer_momentum, nesterov=spec.outer_momentum > 0)

    cluster = InprocCluster(
        lambda: tasks[0].model,
        lambda m: make_optimizer(m, ts.resolved_lr),
        spec.cluster_config(),
        outer_optimizer=outer,
        transport_factory=None if spec.datagram_drop is None else spec.datagram_transport,
        scheduler_factory=None if ts.lr_schedule == "constant" else (lambda o: make_scheduler(o, ts)),
    )
    rec = _Recorder(spec, evaluate)
    inner_s, sync_s = [0.0] * spec.num_sites, [0.0] * spec.num_sites
    with cluster:
        for s in cluster.sites:
            s.diloco.on_round.append(rec.hook(s))
        first_val = evaluate(cluster.sites[0].model)
        build_s = time.perf_counter() - t_build

        def step(site: Site, k: int) -> None:
            task = tasks[site.index]
            t0 = time.perf_counter()
            task.loss(site.model, next(task.batches)).backward()
            t1 = time.perf_counter()
            cb0 = rec.callback_s[site.index]
            site.optimizer.step()  # hooked: every H-th step runs a round
            site.optimizer.zero_grad(set_to_none=True)
            if site.scheduler is not None:
                site.scheduler.step()
            t2 = time.perf_counter()
            if (k + 1) % spec.sync_every == 0:
                inner_s[site.index] += t1 - t0
                sync_s[site.index] += (t2 - t1) - (rec.callback_s[site.index] - cb0)
            else:
                inner_s[site.index] += t2 - t0

        t_run = time.perf_counter()
        train_with_restart(cluster, step, spec, rec.hook)
        wall = time.perf_counter() - t_run
        finals = [evaluate(s.model) for s in cluster.sites]
        thetas = [s.theta() for s in cluster.sites]
        consistent = len(set(cluster.checksums())) == 1

    results = [s.results for s in cluster.sites]
    rounds = _round_records(spec, results, rec, finals[0])
    statuses = [o.status for s in cluster.sites for o in s.outcomes]
    f = dict(
        num_params=sum(p.numel() for p in cluster.sites[0].model.parameters()),
        tokens_per_batch=tasks[0].tokens_per_batch,
        first_val=first_val,
        finals=finals,
        build_s=build_s,
        wall=wall,
        inner_s=inner_s,
        sync_s=sync_s,
        rounds_done=cluster.sites[0].diloco.round,
        thetas=thetas,
        consistent=consistent,
    )
    return RunResult(row=_run_row(spec, results, statuses, rounds, f), rounds=rounds)


def _run_row(
    spec: RunSpec, results: list[list[Any]], statuses: list[str], rounds: list[dict[str, Any]], f: dict[str, Any]
) -> dict[str, Any]:
    """The run's CSV row (see :func:`run_inproc`) from the sites' round results and ``f``, what else it measured."""
    n, H, finals, thetas, rounds_done = spec.num_sites, spec.sync_every, f["finals"], f["thetas"], f["rounds_done"]
    flat = [x for per_site in results for x in per_site]
    drifts = [d["drift"] for d in rounds if not math.isnan(d["drift"])]
    bytes_sent = sum(x.bytes_sent for x in flat)
    bytes_received = sum(x.bytes_received for x in flat)
    return spec.columns() | {
        "chunk_bytes": spec.cluster_config().diloco.buckets.chunk_bytes,  # the datagram path sets its own
        "num_params": f["num_params"],
        "inner_steps": H * spec.rounds,
        "tokens_per_site": H * spec.rounds * f["tokens_per_batch"],
        "first_val_loss": f["first_val"],
        "final_val_loss": statistics.fmean(finals),
        "val_loss_site_spread": max(finals) - min(finals),
        "rounds_done": rounds_done,
        "resyncs": statuses.count("resynced"),
        "deferred": statuses.count("deferred"),
        "build_s": f["build_s"],
        "wall_s": f["wall"],
        "inner_s": statistics.fmean(f["inner_s"]),
        "sync_s": statistics.fmean(f["sync_s"]),
        "round_s": statistics.fmean(x.total_s for x in flat) if flat else 0.0,
        "bytes_sent": bytes_sent,
        "bytes_received": bytes_received,
        "bytes_total": bytes_sent + bytes_received,
        "bytes_per_round_site": (bytes_sent + bytes_received) / max(1, rounds_done) / n,
        "encode_s": sum(x.encode_s for x in flat),
        "decode_s": sum(x.decode_s for x in flat),
        "stale_buckets": sum(x.stale_buckets for x in flat),
        "repaired_buckets": sum(x.repaired_buckets for x in flat),
        "skipped_buckets": sum(x.skipped_buckets for x in flat),
        "rejected": sum(sum(x.rejected.values()) for x in flat),
        "reduce_arrived": statistics.fmean(x.reduce_arrived_fraction for x in flat) if flat else 0.0,
        "broadcast_arrived": statistics.fmean(x.broadcast_arrived_fraction for x in flat) if flat else 0.0,
        "max_drift": max(drifts) if drifts else float("nan"),
        "final_drift": _max_pairwise_l2(thetas),
        "theta_norm": float(torch.linalg.vector_norm(thetas[0])),
        "consistent": f["consistent"],
    }


def pseudo_gradient(spec: TaskSpec, warmup_steps: int, inner_steps: int) -> torch.Tensor:
    """Δ = θ_0 − θ_H (fp32, flat) of one site of the built-in task ``spec``: θ_0 after ``warmup_steps``
    inner steps (past the first, atypically large updates), θ_H after ``inner_steps`` more."""
    task = build_task(spec)
    for _ in range(warmup_steps):
        inner_step(task)
    before = torch.cat([p.detach().reshape(-1) for p in task.model.parameters()]).clone()
    for _ in range(inner_steps):
        inner_step(task)
    return before - torch.cat([p.detach().reshape(-1) for p in task.model.parameters()])


def inner_step(task) -> None:
    """One inner step of a built task: its loss on its next batch, backward, its optimizer's step."""
    task.loss(task.model, next(task.batches)).backward()
    task.optimizer.step()
    task.optimizer.zero_grad(set_to_none=True)


def own_session() -> None:
    """Put this process into a session of its own: with autogroup scheduling CPU is shared between
    sessions first, so N workers in the caller's session would share one session's CPU."""
    with contextlib.suppress(OSError):  # already a session or process-group leader
        os.setsid()


def _init_worker(verbose: bool) -> None:
    torch.set_num_threads(1)
    quiet_logging(verbose)


def run_many(specs: Sequence[RunSpec], *, jobs: int = 1, verbose: bool = False, fn=run_inproc) -> list[RunResult]:
    """``fn(spec)`` for every spec, ``jobs`` at a time in spawned processes (1: in this one), a progress
    line per finished run; the results in the order of ``specs`` (a run may give a list: several rows)."""
    t0 = time.perf_counter()
    out: list[RunResult | None] = [None] * len(specs)

    def report(i: int, res: RunResult | list[RunResult]) -> None:
        out[i] = res
        done = sum(r is not None for r in out)
        rows = [one.row for one in (res if isinstance(res, list) else [res])]
        if not rows:
            return
        r = rows[-1]  # one line per run: its last row (of a run with several, e.g. one per round)
        shown = ("final_val_loss", "rounds_done", "wall_s", "stale_buckets", "rejected")
        figures = "  ".join(f"{k} {r[k]:.4g}" for k in shown if isinstance(r.get(k), (int, float)))
        figures += f"  ({len(rows)} rows)" if len(rows) > 1 else ""
        elapsed = time.perf_counter() - t0
        print(f"[{done}/{len(specs)} {elapsed:6.0f}s] {r['config']:<24s} seed {r['seed']}: {figures}", flush=True)

    if jobs <= 1:
        for i, s in enumerate(specs):
            report(i, fn(s))
    else:
        with cf.ProcessPoolExecutor(
            max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=_init_worker, initargs=(verbose,)
        ) as ex:
            futs = {ex.submit(fn, s): i for i, s in enumerate(specs)}
            for f in cf.as_completed(futs):
                report(futs[f], f.result())
    return [r for r in out if r is not None]


# ---------------------------------------------------------------------------- tables
def write_csv(path: Path, rows: Iterable[dict[str, Any]]) -> list[str]:
    """Write ``rows`` (dicts; columns = union of keys in first-seen order). Returns the columns."""
    rows = list(rows)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    return cols


def typed(v: str) -> Any:
    """A CSV cell or a ``--set`` value as the number, boolean, None or text it spells."""
    if v in ("True", "False"):
        return v == "True"
    if v == "None" or v == "":
        return None
    for conv in (int, float):
        with contextlib.suppress(ValueError):
            return conv(v)
    return v


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a CSV written by :func:`write_csv`, with numbers, booleans and None restored."""
    with open(path, newline="") as f:
        return [{k: typed(v) for k, v in r.items()} for r in csv.DictReader(f)]


def save_meta(prefix: Path, meta: dict[str, Any]) -> None:
    """What produced the CSVs at ``prefix`` (command, minutes, provenance): for ``--replot``."""
    prefix.with_name(prefix.name + "_meta.json").write_text(json.dumps(meta, indent=1))


def load_meta(prefix: Path) -> dict[str, Any]:
    return json.loads(prefix.with_name(prefix.name + "_meta.json").read_text())


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value); NaNs dropped."""
    xs = [float(x) for x in xs if not math.isnan(float(x))]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def mean_se(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (inf below two values: no spread measured); NaNs dropped."""
    mu, sd = mean_std(xs)
    return mu, (sd / math.sqrt(len(xs)) if len(xs) > 1 else float("inf"))


def fmt_pm(xs: Sequence[float], fmt: str = "{:.4f}", scale: float = 1.0) -> str:
    """``"mean ± std"`` of ``xs`` times ``scale`` (a sign in ``fmt`` applies to the mean only)."""
    m, s = mean_std(xs)
    return f"{fmt.format(m * scale)} ± {fmt.format(s * scale).lstrip('+')}"


def summarize(rows: Sequence[dict[str, Any]], key: str = "config") -> dict[str, list[dict[str, Any]]]:
    """Group rows by ``row[key]`` keeping first-seen order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    return groups


def paired_deltas(rows: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]], pct: bool = False) -> list[float]:
    """Per row whose seed the base has: final val loss − the base row's (``pct``: 100·(ratio − 1))."""
    by_seed = {b["seed"]: float(b["final_val_loss"]) for b in base}
    d = [(float(r["final_val_loss"]), by_seed[r["seed"]]) for r in rows if r["seed"] in by_seed]
    return [100 * (x / b - 1) if pct else x - b for x, b in d]


def per_round_mean(
    rounds: Sequence[dict[str, Any]], config: str, metric: str, keep: Callable[[dict[str, Any]], bool] = lambda r: True
) -> tuple[list[int], list[float], list[float], list[float]]:
    """Per round of ``config``'s records (those ``keep`` takes, NaNs out): rounds, mean, min and max of ``metric``."""
    by_round: dict[int, list[float]] = {}
    for r in rounds:
        if r["config"] == config and keep(r) and not math.isnan(r[metric]):
            by_round.setdefault(r["round"], []).append(r[metric])
    xs = sorted(by_round)
    ys = [by_round[x] for x in xs]
    return xs, [statistics.fmean(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def md_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table of rows given as header -> cell (the headers are the first row's keys)."""
    return md_table(list(rows[0]), [list(r.values()) for r in rows]) if rows else "(no runs)"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def code_version() -> str:
    """The commit checked out, ``+dirty`` when tracked files differ from it (taken before a run writes)."""
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def subplots(*args: Any, **kwargs: Any):
    """``matplotlib.pyplot.subplots`` on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_fig(fig, path: Path) -> Path:
    """Lay out, write ``path`` (PNG, 90 dpi: small files for the repository) and free ``fig``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def update_results(path: Path, key: str, title: str, body: str) -> None:
    """Put ``body`` under ``## title`` in the RESULTS.md at ``path``, between ``<!-- begin KEY -->``
    and ``<!-- end KEY -->``: a rerun replaces its own section in place, a new key is appended."""
    begin, end = f"<!-- begin {key} -->", f"<!-- end {key} -->"
    section = f"{begin}\n## {title}\n\n{body.strip()}\n{end}\n"
    intro = "# Experiment results\n\nOne section per experiment and mode, each with the command that produced it.\n"
    text = path.read_text() if path.exists() else intro
    if end in text and (begin not in text or text.index(end) < text.index(begin)):
        # An end marker without its begin (another writer cut it off): drop that orphan, from its title on.
        i = text.index(end)
        start = text.rfind(f"## {title}", 0, i)
        text = text[: start if start >= 0 else i].rstrip("\n") + "\n\n" + text[i + len(end) :].lstrip("\n")
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(with_index(text))


INDEX_BEGIN, INDEX_END = "<!-- begin index -->", "<!-- end index -->"


def _anchor(title: str) -> str:
    """The anchor a markdown renderer (GitHub) gives the heading ``title``."""
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def _stamp_of(body: str) -> str:
    """``commit C, DATE`` from a section's stamp or older provenance line; ``no stamp`` without one."""
    commit = re.search(r"[Cc]ommit `?([0-9a-f]{7,40})(\+dirty)?", body)
    date = re.search(r"\b(20\d\d-\d\d-\d\d)\b", body)
    if commit is None:
        return "**no stamp**"
    return f"commit `{commit[1]}{commit[2] or ''}`, {date[1] if date else 'undated'}"


def _headline(body: str) -> str:
    """A section's headline: its ``Headline:`` line (a hand-written section names its current
    figure so), else its first verdict line (``- ...``), else its first line with a bold verdict."""
    lines = body.splitlines()
    candidates = (
        [ln[len("Headline:") :].strip() for ln in lines if ln.startswith("Headline:")]
        + [ln[2:].strip() for ln in lines if ln.startswith("- ")]
        + [ln.strip() for ln in lines if "**" in ln and not ln.startswith(("|", "Provenance", "Command"))]
    )
    return next((x for x in candidates if x), "")


def with_index(text: str) -> str:
    """``text`` (a RESULTS.md) with its index regenerated after the first paragraph: per ``## `` section a
    link, the commit and date its stamp names (``no stamp``: rerun or remove it) and :func:`_headline`."""
    if INDEX_BEGIN in text and INDEX_END in text:
        head, rest = text.split(INDEX_BEGIN, 1)
        text = head.rstrip("\n") + "\n\n" + rest.split(INDEX_END, 1)[1].lstrip("\n")
    parts = text.split("\n## ")
    lines = []
    for part in parts[1:]:
        title, _, body = part.partition("\n")
        body = body.split("<!-- end ", 1)[0]
        verdict = _headline(body)
        verdict = verdict if len(verdict) <= 160 else verdict[:157] + "..."
        lines.append(f"| [{title}](#{_anchor(title)}) | {_stamp_of(body)} | {verdict} |")
    index = "\n".join(
        [INDEX_BEGIN, "## Summary", "", "| section | produced by | headline |", "|---|---|---|", *lines, INDEX_END]
    )
    intro, begin, rest = parts[0].partition("<!-- begin ")  # the first section's begin marker stands above its title
    head = intro.rstrip("\n") + "\n\n" + index + "\n\n" + (begin + rest).lstrip("\n")
    return head + "".join("\n## " + x for x in parts[1:])
