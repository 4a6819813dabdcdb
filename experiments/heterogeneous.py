"""Sites of different speed (issue 34): wall-clock time to a fixed validation loss.

``dtrain worker`` processes and a ``dtrain rendezvous`` on 127.0.0.1 train the built-in GPT; the
last site runs at a share of the others' speed (the worker's ``--slowdown``: each inner step
stretched to 1/share of its time, as ``dtrain launch --site-slowdown`` sets; not the cgroup cap,
which 4 workers on 2 cores never reach). Each inner step also sleeps ``compute_s`` (emulated
compute), so the exchange is a small part of a round, as on real hardware. Configurations:
``lockstep`` (H inner steps a round everywhere: the fast sites wait for the slow one); ``straggler
cut`` (the same with a quorum timeout that cuts the slow site every round); ``time + weighted``
(time-based rounds, a window of H fast steps' time with H the bound, token-weighted means);
``homogeneous`` (equal sites with the same total throughput, (3 + share) / 4 each; lockstep).

Measured per run: the wall time from the end of site-0's round 0 to its first round with
validation loss <= ``target_loss`` (the run stops there), the rounds to it, the slow site's steps
per round; θ must agree after every round all sites applied.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dtrain.app.procs import Cluster
from experiments.common import RunResult, fmt_pm, md_rows, mean_se, save_fig, subplots, summarize
from experiments.lab import ROUNDS, SITES, SIZE, H, Point, Spec, decorate, files, met
from experiments.procs import SitesRun, line_record, run_sites

LOCKSTEP, CUT, TIMED, HOMO = "lockstep", "straggler cut", "time + weighted", "homogeneous"
MODE, SHARE, COMPUTE, TARGET = "hetero.mode", "hetero.share", "hetero.compute_s", "hetero.target_loss"

RENDEZVOUS = dict(
    heartbeat_interval_s=0.25, heartbeat_timeout_s=3.0, reduce_timeout_s=3.0, broadcast_timeout_s=6.0, min_sites=2
)
STEP_S = 0.008  # the tiny model's own inner step on this machine under load (s), besides compute_s
WORKER = dict(codec="int8", bucket_bytes=65536, chunk_bytes=16384, linger_s=2, quorum_wait_s=120)

ALL = {MODE: [LOCKSTEP, CUT, TIMED, HOMO], SHARE: [0.5, 0.25]}
MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(seeds=[0], grid={MODE: [TIMED], SHARE: [0.5]})
    | {"fixed": {SITES: 2, SIZE: "tiny", H: 6, ROUNDS: 2, COMPUTE: 0.005, TARGET: 5.0}},
    "quick": dict(
        seeds=[0, 1], grid=ALL, fixed={SITES: 4, SIZE: "tiny", H: 20, ROUNDS: 40, COMPUTE: 0.05, TARGET: 2.65}
    ),
    "full": dict(
        seeds=[0, 1, 2], grid=ALL, fixed={SITES: 4, SIZE: "small", H: 50, ROUNDS: 60, COMPUTE: 0.05, TARGET: 2.3}
    ),
}


def _site_options(f: dict[str, Any], seed: int, i: int) -> dict[str, Any]:
    """Worker options of site ``i`` (the last site is the slow one)."""
    n, mode, share = f[SITES], f[MODE], f[SHARE]
    opts: dict[str, Any] = dict(size=f[SIZE], seed=seed, rounds=f[ROUNDS], sync_every=f[H], **WORKER)
    opts["inner_step_sleep_s"] = f[COMPUTE]
    if mode == HOMO:
        opts["slowdown"] = (n - 1 + share) / n
    elif i == n - 1:
        opts["slowdown"] = share
    if mode == TIMED:
        # the fast sites' H steps: compute_s plus the tiny model's own step (~8 ms measured under load)
        opts["diloco.round_window_s"] = f[H] * (f[COMPUTE] + STEP_S)
        opts["sync_every"] = 2 * f[H]  # the bound
        opts["token_weighted"] = True
    return opts


def run_hetero(point: Point) -> RunResult:
    """One run of the point's configuration; see the module docstring."""
    f, n = point.settings, point.settings[SITES]
    # the slow site is cut when the others wait at most 0.3 of its extra time for it
    extra_s = f[H] * (f[COMPUTE] + STEP_S) * (1 / f[SHARE] - 1)
    quorum = 0.3 * extra_s if f[MODE] == CUT else 30.0
    res = run_sites(
        None,
        n,
        {"quorum_timeout_s": quorum, **RENDEZVOUS},
        lambda i: _site_options(f, point.seed, i),
        timeout_s=600,
        drive=lambda run: run.wait(lambda: _done(run, n, f[TARGET]), "the target loss or the end", poll_s=0.5),
    )
    return _measure(point, res)


def _done(run: Cluster, n: int, target: float) -> bool:
    """Every site finished, or site-0 reported a round at or below the target (the run stops there)."""
    if all(run.procs[f"site-{i}"].poll() is not None for i in range(n)):
        return True
    return any(x.get("event") == "round" and (x.get("val_loss") or math.inf) <= target for x in run.lines(0))


def _measure(point: Point, res: SitesRun) -> RunResult:
    f, n, per_site = point.settings, point.settings[SITES], res.per_site
    site0, slow = per_site[0], per_site[n - 1]
    t_ref = site0[0]["time"] if site0 else math.nan
    reached = next((x for x in site0 if x.get("val_loss") is not None and x["val_loss"] <= f[TARGET]), None)
    applied_slow = [x for x in slow if x["status"] == "applied"]
    row = point.row(
        num_sites=n,
        sync_every=f[H],
        codec=WORKER["codec"],
        **res.facts() | {"first_val_loss": site0[0]["val_loss"] if site0 else math.nan},  # after its first round
        time_to_target_s=(reached["time"] - t_ref) if reached else math.nan,
        rounds_to_target=reached["round"] if reached else -1,
        bytes_per_round_site=res.facts()["bytes_total"] / max(1, len(site0)) / n,
        sync_s=sum(x["sync_s"] for x in site0),
        stale_buckets=sum(x.get("stale_buckets", 0) for x in res.lines),
        rejected=sum(sum((x.get("rejected") or {}).values()) for x in res.lines),
        slow_rounds_applied=len(applied_slow),
        slow_steps_per_round=sum(x.get("round_steps") or 0 for x in applied_slow) / max(1, len(applied_slow)),
        fast_steps_per_round=sum(x.get("round_steps") or 0 for x in site0) / max(1, len(site0)),
        consistent=_consistent(per_site),
    )
    rounds = [
        line_record(point.experiment, point.config, point.seed, x, ("round",), t_s=x["time"] - t_ref)
        | {k: x.get(k) for k in ("val_loss", "round_steps")}
        for x in site0
    ]
    return RunResult(row=row, rounds=rounds)


def _consistent(per_site: dict[int, list[dict[str, Any]]]) -> bool:
    """θ's checksum is the same at every site that applied a round, for every round (the sites' last
    lines may be of different rounds: a run stops at the target)."""
    by_round: dict[int, set[str]] = {}
    for x in (x for xs in per_site.values() for x in xs if x["status"] == "applied"):
        by_round.setdefault(x["round"], set()).add(x["checksum"])
    return bool(by_round) and all(len(cs) == 1 for cs in by_round.values())


def analyse(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    table, verdicts = [], []
    for share, group in summarize(rows, key=SHARE).items():
        t = {}  # configuration -> mean time to the target; NaN when a seed did not reach it (no verdict on it)
        for c, rs in summarize(group, key=MODE).items():
            ts = [r["time_to_target_s"] for r in rs]
            reached, (mu, se) = sum(1 for x in ts if not math.isnan(x)), mean_se(ts)
            t[c] = mu if reached == len(ts) else math.nan
            time_cell = "not reached by every seed" if math.isnan(t[c]) else f"{mu:.1f} ± {se:.1f}"
            rounds_to = [r["rounds_to_target"] for r in rs if r["rounds_to_target"] >= 0]
            table.append(
                {
                    "slow share": f"{share:g}",
                    "configuration": c,
                    "time to target (s, mean ± SE)": time_cell,
                    "reached": f"{reached}/{len(ts)}",
                    "rounds to target": fmt_pm(rounds_to, "{:.1f}"),
                    "val loss at stop": fmt_pm([r["final_val_loss"] for r in rs], "{:.3f}"),
                    "slow site steps/round": fmt_pm([r["slow_steps_per_round"] for r in rs], "{:.1f}"),
                    "slow site rounds applied": fmt_pm([r["slow_rounds_applied"] for r in rs], "{:.1f}"),
                    "θ agrees": "yes" if all(r["consistent"] for r in rs) else "NO",
                }
            )
        a, c, h = (t.get(k, math.nan) for k in (LOCKSTEP, TIMED, HOMO))
        if any(k in t and math.isnan(t[k]) for k in (LOCKSTEP, TIMED, HOMO)):
            verdicts.append(f"- share {share:g}: a seed did not reach the target within the rounds run: no verdict")
        if not math.isnan(a + c):
            verdicts.append(
                f"- share {share:g}: time + weighted reaches the loss {a / c:.2f}x sooner than lockstep "
                f"(target >= 1.5x): {met(a / c >= 1.5)}"
            )
        if not math.isnan(c + h):
            verdicts.append(
                f"- share {share:g}: time + weighted takes {c / h:.2f}x the homogeneous reference's time "
                f"(target <= 1.15x): {met(c <= 1.15 * h)}"
            )
    return md_rows(table), verdicts


def plot(rounds: list[dict[str, Any]], prefix: Path) -> Path:
    fig, ax = subplots(figsize=(7, 4))
    for c, rs in summarize(rounds).items():
        seed0 = [r for r in rs if r["seed"] == rs[0]["seed"]]
        ax.plot([r["t_s"] for r in seed0], [r["val_loss"] for r in seed0], marker=".", label=c)
    decorate(ax, "wall time since site-0's round 0 (s)", "validation loss (site-0, first seed)", legend=7)
    return save_fig(fig, prefix.with_name(prefix.name + ".png"))


def report(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any], prefix: Path) -> str:
    f = m["fixed"]
    png = plot(rounds, prefix)
    return f"""Setup: {f[SITES]} `dtrain worker` processes + one `dtrain rendezvous` on 127.0.0.1 (gRPC, int8),
built-in GPT `{f[SIZE]}`, H = {f[H]}, {f[ROUNDS]} rounds, each inner step followed by {f[COMPUTE]:g} s of emulated
compute; the last site at the given share of the others' speed (its steps stretched, `--slowdown`); the homogeneous
reference runs every site at (n - 1 + share) / n. Time-based rounds: a window of H x ({f[COMPUTE]:g} + {STEP_S}) s,
at most 2H steps, token-weighted means. Time to target: from site-0's round-0 line (every process started) to its
first round with validation loss <= {f[TARGET]:g}; mean ± standard error over seeds {m["seeds"]}. The rows
per share cover different claims: "slow site rounds applied" below the rounds run means it was cut and resynced.
{files(prefix, png)}

{analyse(rows)[0]}"""


SPEC = Spec(
    name="heterogeneous",
    title="Sites of different speed",
    modes=MODES,  # jobs 1 (the default): one run's processes share the cores
    label=lambda point: f"{point[MODE]}, share {point[SHARE]:g}",
    columns=lambda point: {"share": point[SHARE]},
    metrics=(("final_val_loss", 0.0, 10.0), ("wall_s", 0.0, 3600.0), ("rounds_done", 1, 1000)),
    report=report,
    verdict=lambda rows, rounds, m: analyse(rows)[1],
    execute=run_hetero,
    paths=(MODE, SHARE, COMPUTE, TARGET),
)
