"""Site failures with real processes: kill, restart, kill an owner mid-round, kill two (issue 6 part 2).

4 ``dtrain worker`` processes and a ``dtrain rendezvous`` on 127.0.0.1 (gRPC). Scenarios:

* ``no fault``: the reference;
* ``kill 1, restart``: SIGKILL site-3 once it finished round k; restart it (``--resume``) once
  site-0 finished round k + m: it pulls θ and the outer state and joins the next round;
* ``owner killed mid-round``: site-1 SIGKILLs itself in round k right after its first
  contribution chunk went out (``DTRAIN_TEST_FAULT=site-1:mid_push:k:kill``); not restarted;
* ``kill 2 at once``: SIGKILL site-2 and site-3 after round k; not restarted.

Reported per run: site-0's validation loss and its change against the no-fault run of the same
seed, rounds lost (rounds a survivor did not apply; target: none), and the time beyond the
round's deadline a survivor spent in a round (target: under 1 s), the extra quorum wait after a
death apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtrain.app.procs import Cluster
from experiments.common import (
    RunResult,
    fmt_pm,
    md_rows,
    mean_std,
    paired_deltas,
    per_round_mean,
    save_fig,
    subplots,
    summarize,
)
from experiments.lab import ROUNDS, SITES, SIZE, H, Point, Spec, decorate, files, met
from experiments.procs import SitesRun, line_record, run_sites

NO_FAULT, RESTART, OWNER, TWO = "no fault", "kill 1, restart", "owner killed mid-round", "kill 2 at once"
SCENARIOS = [NO_FAULT, RESTART, OWNER, TWO]
RENDEZVOUS = dict(quorum_timeout_s=1.0, heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0)
RENDEZVOUS |= dict(reduce_timeout_s=1.5, broadcast_timeout_s=3.0, min_sites=2)
SCENARIO, KILL, DOWN, SLEEP = "fault.scenario", "fault.kill_round", "fault.down_rounds", "task.inner_step_sleep_s"

# A restarted worker needs ~8-20 s (2 cores) to start: each of the tiny model's inner steps also sleeps (emulated
# compute), so rounds last >= 1 s and the restarted site is back for a good part of the run. CI: the owner killed
# mid-round against no fault, 4 sites, a few short rounds (~1 min: 10 process starts).
MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(seeds=[0], grid={SCENARIO: [NO_FAULT, OWNER]})
    | {"fixed": {SITES: 4, SIZE: "tiny", H: 2, ROUNDS: 4, KILL: 1, DOWN: 1, SLEEP: 0.05}},
    "quick": dict(seeds=[0, 1, 2], fixed={SITES: 4, SIZE: "tiny", H: 10, ROUNDS: 24, KILL: 3, DOWN: 2, SLEEP: 0.1}),
    "full": dict(seeds=[0, 1, 2, 3, 4])
    | {"fixed": {SITES: 4, SIZE: "small", H: 50, ROUNDS: 40, KILL: 8, DOWN: 5, SLEEP: 0.02}},
}
TIMEOUT_S = 900.0  # bound on one run
WORKER = dict(codec="fp32", bucket_bytes=65536, chunk_bytes=16384, checkpoint_every=1, linger_s=2, quorum_wait_s=120)


def _drive(run: Cluster, f: dict[str, Any], opts: dict[str, Any]) -> None:
    """Strike the scenario's fault (and restart site-3 with ``opts``), and wait for the survivors to finish."""
    if f[SCENARIO] in (RESTART, TWO):
        run.wait(lambda: run.done_round(3, f[KILL]), f"site-3 round {f[KILL]}")
    if f[SCENARIO] == RESTART:
        run.kill(3)
        run.wait(lambda: run.done_round(0, f[KILL] + f[DOWN]), "site-0 to go on")
        run.start_site(3, resume=True, **opts)
    elif f[SCENARIO] == TWO:
        run.kill(2)
        run.kill(3)
    alive = [f"site-{i}" for i in range(f[SITES]) if f[SCENARIO] != OWNER or i != 1]
    alive = ["site-0", "site-1"] if f[SCENARIO] == TWO else alive
    run.wait(lambda: run.exited(alive), "the sites to finish")


def run_failure(point: Point) -> RunResult:
    """One run of the point's scenario; see the module docstring."""
    f, seed = point.settings, point.seed
    if f[ROUNDS] < f[KILL] + 2:
        raise ValueError(f"rounds must be >= {f[KILL] + 2} (faults strike in round {f[KILL]}), got {f[ROUNDS]}")
    opts = dict(size=f[SIZE], seed=seed, rounds=f[ROUNDS], sync_every=f[H], **WORKER, inner_step_sleep_s=f[SLEEP])
    owner_fault = {"fault": f"site-1:mid_push:{f[KILL]}:kill"} if f[SCENARIO] == OWNER else {}
    res = run_sites(
        None,
        f[SITES],
        RENDEZVOUS,
        lambda i: opts | (owner_fault if i == 1 else {}),
        timeout_s=TIMEOUT_S,
        drive=lambda run: _drive(run, f, opts),
    )
    return _measure(point, res)


def _measure(point: Point, res: SitesRun) -> RunResult:
    """The run's row and site-0's rounds from the sites' round lines."""
    f, seed, per_site = point.settings, point.seed, res.per_site
    survivors = {NO_FAULT: range(4), RESTART: range(3), OWNER: (0, 2, 3), TWO: (0, 1)}[f[SCENARIO]]
    lost, early, detail = 0, 0, []
    for i in survivors:
        rounds = per_site[i]
        applied = {x["round"] for x in rounds if x["status"] == "applied"}
        status = {x["round"]: x["status"] for x in rounds}
        missed = sorted(set(range(f[ROUNDS])) - applied)
        # Rounds before the fault that a survivor missed are start-up effects (a site still importing
        # torch when round 0 forms), not what the fault cost: counted apart.
        lost += sum(1 for r in missed if r >= f[KILL])
        early += sum(1 for r in missed if r < f[KILL])
        detail += [f"site-{i}:r{r}:{status.get(r, 'missing')}" for r in missed]
    lines = [x for i in survivors for x in per_site[i]]
    longest = max([0.0, *(x.get("round_s", 0.0) for x in lines)])
    site0, facts = per_site[0], res.facts()  # site-0's first and final val loss, wall s, every site's bytes
    restarted = per_site[3] if f[SCENARIO] == RESTART else []
    back = [x["round"] for x in restarted if x["round"] > f[KILL] and x["status"] == "applied"]  # once back
    row: dict[str, Any] = {
        "experiment": "site_failures",
        "config": f[SCENARIO],
        "seed": seed,
        "num_sites": f[SITES],
        "size": f[SIZE],
        "sync_every": f[H],
        "rounds": f[ROUNDS],
        "kill_round": f[KILL],
        "down_rounds": f[DOWN],
        "codec": "fp32",
        **facts,
        "rounds_done": max((x["round"] + 1 for x in site0), default=0),
        "rounds_lost": lost,
        "rounds_missed_before_fault": early,
        "missed_detail": " ".join(detail),
        "inner_step_sleep_s": f[SLEEP],
        "max_round_s": longest,
        "max_beyond_deadline_s": max(0.0, longest - RENDEZVOUS["broadcast_timeout_s"]),
        "max_quorum_wait_s": max([0.0, *(x["sync_s"] - x.get("round_s", x["sync_s"]) for x in lines)]),
        "sync_s": sum(x["sync_s"] for x in site0),
        "bytes_per_round_site": facts["bytes_total"] / max(1, f[ROUNDS]) / f[SITES],
        "stale_buckets": sum(x.get("stale_buckets", 0) for x in lines),
        "skipped_buckets": sum(x.get("skipped_buckets", 0) for x in lines),
        "rejected": sum(sum(x.get("rejected", {}).values()) for x in lines),
        "restarted_first_round": min(back, default=-1),
        "restarted_rounds": len(back),
        "exit_codes": " ".join(f"{n}={c}" for n, c in sorted(res.rcs.items())),
        "survivors_consistent": len({per_site[i][-1]["checksum"] for i in survivors if per_site[i]}) == 1,
    }
    keys = ("round", "status", "val_loss", "members", "sync_s", "round_s")
    rounds_out = [
        line_record("site_failures", f[SCENARIO], seed, x | {"members": len(x.get("members", []))}, keys) for x in site0
    ]
    return RunResult(row=row, rounds=rounds_out)


def analyse(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    groups = summarize(rows)
    base = groups[NO_FAULT]
    table, verdicts = [], []
    for cfg, g in groups.items():
        d = paired_deltas(g, base)
        lost, over = sum(r["rounds_lost"] for r in g), max(r["max_beyond_deadline_s"] for r in g)
        row = {
            "scenario": cfg,
            "runs": len(g),
            "final val loss (site-0)": fmt_pm([r["final_val_loss"] for r in g]),
            "Δ vs no fault (paired)": "—" if cfg == NO_FAULT else fmt_pm(d, "{:+.4f}"),
            "rounds lost from the fault on (survivors)": lost,
            "rounds missed before it": sum(r["rounds_missed_before_fault"] for r in g),
            f"longest round s (deadline {RENDEZVOUS['broadcast_timeout_s']:g})": f"{max(r['max_round_s'] for r in g):.2f}",
            "max s beyond deadline": f"{over:.2f}",
            "max quorum wait s": f"{max(r['max_quorum_wait_s'] for r in g):.2f}",
            "wall s": fmt_pm([r["wall_s"] for r in g], "{:.0f}"),
            "stale buckets": sum(r["stale_buckets"] for r in g),
            "skipped buckets": sum(r["skipped_buckets"] for r in g),
            "rejected": sum(r["rejected"] for r in g),
            "survivors' θ equal": "yes" if all(r["survivors_consistent"] for r in g) else "NO",
        }
        table.append(row)
        firsts = ", ".join(str(r["restarted_first_round"]) for r in g)
        back = (
            f" The restarted site took part again from round {firsts} (per seed; -1: not before the others finished)."
        )
        if cfg != NO_FAULT:
            verdicts.append(
                f"- {cfg}: rounds lost {lost} (target none: {met(lost == 0)}); longest time beyond a round's deadline "
                f"{over:.2f} s (target < 1 s: {met(over < 1)}); final val loss change {mean_std(d)[0]:+.4f} nats."
                + (back if cfg == RESTART else "")
            )
    return md_rows(table), verdicts


def plot(rounds: list[dict[str, Any]], prefix: Path, f: dict[str, Any]) -> Path:
    """Site-0's validation loss per round, one line per scenario; ``f``: the mode's fixed settings."""
    fig, ax = subplots(figsize=(6.4, 4.2))
    for cfg in SCENARIOS:
        xs, mean, _, _ = per_round_mean(rounds, cfg, "val_loss", lambda r: r["status"] == "applied")
        if xs:
            ax.plot([x + 1 for x in xs], mean, marker="o", ms=3, label=cfg, ls="-" if cfg == NO_FAULT else "--")
    ax.axvline(f[KILL] + 1, color="0.6", lw=0.8, ls=":")
    title = f"Site failures: {f[SITES]} sites, faults at round {f[KILL]}"
    decorate(ax, "round (site-0)", "validation loss, mean over seeds", title)
    return save_fig(fig, prefix.with_suffix(".png"))


def report(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any], prefix: Path) -> str:
    f = m["fixed"]
    scenarios = {r["config"] for r in rows}
    restart = f" the restarted site is down for {f[DOWN]} rounds of site-0." if RESTART in scenarios else ""
    png = plot(rounds, prefix, f)
    return f"""Setup: {f[SITES]} `dtrain worker` processes + one `dtrain rendezvous` on 127.0.0.1 (gRPC), built-in GPT
`{f[SIZE]}`, H = {f[H]}, {f[ROUNDS]} rounds, fp32, checkpoints every round, each inner step
followed by a {f[SLEEP]:g} s sleep (emulated compute: rounds last long enough for a restarted worker's
start-up, ~10 s, to span a few rounds, not the rest of the run); rendezvous timing
{", ".join(f"{k} {v}" for k, v in RENDEZVOUS.items())}. Faults after / in round {f[KILL]};{restart}
Mean ± std over seeds {m["seeds"]}; Δ paired by seed. "Beyond
deadline": a survivor's round engine time (from its plan to the end of apply and repair) minus the broadcast
deadline. "Rounds lost": rounds from the fault's round on that a survivor did not apply; rounds a site missed
before the fault (start-up: still importing torch when round 0 formed) are counted apart. "Quorum wait": the time from asking for a round to getting its plan (waiting for slower sites, and
after a death for up to quorum_timeout_s = {RENDEZVOUS["quorum_timeout_s"]} s, until the rendezvous stops waiting for
a site whose heartbeats have not yet timed out). "Skipped buckets": buckets whose owner died in the round (every
survivor keeps θ_b alike; contributions stay in the residuals). {files(prefix, png)}

{analyse(rows)[0]}"""


SPEC = Spec(
    name="site_failures",
    title="Site failures",
    modes=MODES,  # jobs 1 (the default): processes of one run share the cores
    grid={SCENARIO: SCENARIOS},
    label=lambda point: point[SCENARIO],
    metrics=(("final_val_loss", 0.0, 10.0), ("rounds_lost", 0, 1000), ("max_round_s", 0.0, 600.0)),
    report=report,
    verdict=lambda rows, rounds, m: analyse(rows)[1],
    execute=run_failure,
    paths=(SCENARIO, KILL, DOWN, SLEEP),
)
