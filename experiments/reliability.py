"""Does every run end with one θ on bad links, with no timeout set? (issue 32)

Runs ``dtrain launch --sites 3 --size tiny`` many times through netem profiles (``lossy``: 10%
loss, 20 ms RTT, 100 Mbit/s; ``flaky``: a 2 s partition of each site every 10 s; ``lossy30``: 30%
loss) with no time setting at all (deadlines derived from the observed rounds and the default
stall budget, failure detection by the phi accrual detector). Read back from each run's metrics
lines and rendezvous log:

* equal θ at the end: every site's final checksum (``summary.json``, else its last round line)
  the same, and the launch exited 0;
* sites declared dead while alive: every site lives through the run, so each "declared dead"
  line of the rendezvous is a false one;
* rounds of unequal θ: a round whose applied lines disagree on the checksum;
* rounds missed (a site resynced instead of applying) and the worst sync time.

Needs root (netem: network namespaces). A run that did not end equal keeps its run directory
(the row's ``kept`` column names it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dtrain.app.procs import spawn
from dtrain.metrics import read_json_lines
from experiments.common import ROOT, RunResult, md_rows, md_table, summarize
from experiments.lab import Point, Spec, met

PROFILE, RUNS, SIZE = "netem.profile", "lab.runs", "task_spec.size"
SLOWDOWN = "slowdown"  # the profile name of the slowdown run (continental links, see SLOW)
MODES: dict[str, dict[str, Any]] = {
    "smoke": {"runs": {"lossy": 1}, "rounds": 3},
    "quick": {"runs": {SLOWDOWN: 1, "lossy": 10, "flaky": 10, "lossy30": 4}, "rounds": 4},
    "full": {"runs": {SLOWDOWN: 1, "lossy": 30, "flaky": 30, "lossy30": 10}, "rounds": 5},
}
#: the slowdown run: the built-in small GPT in fp32 through continental links whose rate drops
#: (200x: to 5 Mbit/s, the setting SLOW_MBIT) before round SLOW[0] and recovers before round SLOW[1];
#: at 1 Mbit/s (``--set slowdown.mbit=1``) a round needs more than the deadline derived before
#: (it is cut and the deadline backs off); 7 rounds after the recovery show the deadline come back
#: (``DeadlineConfig.shift_rounds``: 5 fast rounds)
SLOW, SLOW_MBIT, SLOW_ROUNDS = (4, 9), "slowdown.mbit", 16
LAUNCH_TIMEOUT_S = 300


def _launch(argv: list[str], out: Path, timeout_s: float, during=lambda: None) -> int:
    """``dtrain launch ARGV --out OUT``, ``during()`` called every 0.2 s while it runs; its exit code
    (-1: still running after ``timeout_s``, then stopped with everything it started)."""
    argv = [sys.executable, "-m", "dtrain", "launch", *argv, "--out", str(out)]
    proc = spawn("launch", argv, out.with_name(out.name + ".log"), cwd=ROOT)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            during()
            time.sleep(0.2)
    finally:
        hung = proc.poll() is None
        if hung:  # kill its process group (SIGUSR1 first: each worker prints its threads' stacks into its log)
            if proc.send(signal.SIGUSR1):
                time.sleep(2.0)
            proc.kill(30)
            # and take down its netem topology (named ``launch``), so that the next run can build its own
            argv = [sys.executable, "-m", "netem", "down", "--name", "launch"]
            subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=120)
    return -1 if hung else proc.returncode


def _round_lines(path: Path) -> list[dict[str, Any]]:
    return [d for d in read_json_lines(path) if d.get("event") == "round"]


def read_run(out: Path) -> dict[str, Any]:
    """The reliability figures of a launch's run directory (see the module docstring)."""
    by_round: dict[int, dict[str, str]] = {}
    last: dict[str, str] = {}
    missed, sync_max = 0, 0.0
    for path in sorted(out.glob("site-*/metrics.jsonl")):
        site = path.parent.name
        for d in _round_lines(path):
            if d.get("status") == "applied" and d.get("checksum"):
                by_round.setdefault(int(d["round"]), {})[site] = d["checksum"]
            elif d.get("status") == "resynced":
                missed += 1
            if d.get("checksum"):
                last[site] = d["checksum"]
            sync_max = max(sync_max, float(d.get("sync_s") or 0.0))
        summary = path.parent / "summary.json"
        if summary.exists():  # the θ it ended with: a site that joined at the run's end has no round line
            last[site] = json.loads(summary.read_text()).get("checksum") or last.get(site, "")
    log = out / "rendezvous.log"
    return {
        "sites_seen": len(last),
        "equal_at_end": len(last) == 3 and len(set(last.values())) == 1,
        "declared_dead": log.read_text().count("declared dead") if log.exists() else 0,
        "unequal_rounds": sum(len(set(sums.values())) > 1 for sums in by_round.values()),
        "rounds_missed": missed,
        "max_sync_s": round(sync_max, 2),
    }


def slowdown_once(out: Path, mbit: float) -> list[dict[str, Any]]:
    """A launch whose links slow to ``mbit`` for rounds SLOW[0]..SLOW[1]-1, then recover; per round: the
    link rate, the slowest reduce_s, the plan's reduce deadline and why, what was refused or missing."""
    state: list[float | None] = [None]

    def follow() -> None:  # every link of the launch (``netem set``) at the rate of the rounds site-0 is at
        done = max((int(d["round"]) for d in _round_lines(out / "site-0" / "metrics.jsonl")), default=-1)
        want = mbit if SLOW[0] - 1 <= done < SLOW[1] - 1 else None
        if want != state[0] and done >= 0:
            rate = want if want is not None else 1000.0  # continental's own cap: 1 Gbit/s
            argv = [sys.executable, "-m", "netem", "set", "all", "--name", "launch", "--rate-mbit", f"{rate:g}"]
            subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, timeout=60)
            state[0] = want

    argv = ["--sites", "3", "--rounds", str(SLOW_ROUNDS), "--size", "small", "--codec", "fp32", "--sync-every", "10"]
    _launch([*argv, "--netem", "continental"], out, 2 * LAUNCH_TIMEOUT_S, follow)
    lines = [d for path in sorted(out.glob("site-*/metrics.jsonl")) for d in _round_lines(path)]
    applied = summarize([d for d in lines if d.get("status") == "applied"], "round")
    return [
        {
            "round": r,
            "link_mbit": f"{mbit:g}" if SLOW[0] <= r < SLOW[1] else "1000",
            "slowest_reduce_s": round(max(float(d.get("reduce_s") or 0) for d in rs), 2),
            "reduce_deadline_s": round(float(rs[0].get("reduce_timeout_s") or 0), 2),
            "refused": sum(sum((d.get("rejected") or {}).values()) for d in rs),
            "min_reduce_arrived": min(float(d.get("reduce_arrived_fraction") or 0) for d in rs),
            "why": (rs[0].get("deadline_reason") or "").split("; ")[1] if rs[0].get("deadline_reason") else "",
        }
        for r, rs in sorted(applied.items())
    ]


def run_point(point: Point) -> list[RunResult]:
    """One profile's launches (``lab.runs`` of them; the slowdown run: one row per round); a
    launch that did not end equal keeps its run directory, named in its row's ``kept``."""
    if os.geteuid() != 0:
        raise SystemExit("reliability: needs root (netem network namespaces)")
    m, profile = point.settings, point.settings[PROFILE]
    with tempfile.TemporaryDirectory(prefix="dtrain-reliability-") as tmp:
        if profile == SLOWDOWN:
            t0 = time.monotonic()
            rows = slowdown_once(Path(tmp) / profile, float(m[SLOW_MBIT]))
            wall = {"wall_s": round(time.monotonic() - t0, 1)}
            return [RunResult(row=point.row(profile=profile, **r, **wall)) for r in rows]
        out = []
        for i in range(m[RUNS]):  # one ``dtrain launch`` through the profile with no time setting
            run = Path(tmp) / f"{profile}-{i}"
            t0 = time.monotonic()
            argv = ["--sites", "3", "--rounds", str(m["rounds"]), "--size", m[SIZE], "--netem", profile]
            code = _launch(argv, run, LAUNCH_TIMEOUT_S)
            figures = dict(exit_code=code, wall_s=round(time.monotonic() - t0, 1), **read_run(run))
            row = point.row(profile=profile, **figures, run=i)
            if not (row["equal_at_end"] and row["exit_code"] == 0) or row["unequal_rounds"]:
                row["kept"] = str(Path(tempfile.gettempdir()) / f"reliability-failed-{profile}-{i}-{os.getpid()}")
                shutil.copytree(run, row["kept"])
            print(f"reliability {profile} run {i}: exit {row['exit_code']}, equal {row['equal_at_end']}", flush=True)
            out.append(RunResult(row=row))
        return out


EQUAL, DEAD, UNEQUAL = "ended equal (exit 0)", "sites declared dead while alive", "rounds of unequal θ"


def _profiles(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per profile (the slowdown run's rows left out): runs, runs ending equal, false deaths, rounds of unequal θ."""
    out = {}
    for profile, rs in summarize([r for r in rows if r["profile"] != SLOWDOWN], "profile").items():
        out[profile] = {
            "profile": profile,
            "runs": len(rs),
            EQUAL: sum(r["equal_at_end"] and r["exit_code"] == 0 for r in rs),
            DEAD: sum(int(r["declared_dead"]) for r in rs),
            UNEQUAL: sum(int(r["unequal_rounds"]) for r in rs),
            "rounds missed (resynced)": sum(int(r["rounds_missed"]) for r in rs),
            "worst sync_s": max(float(r["max_sync_s"]) for r in rs),
            "median wall s": f"{statistics.median_high(float(r['wall_s']) for r in rs):.0f}",
        }
    return out


def report(rows: list[dict[str, Any]], rounds: list, m: dict[str, Any], prefix: Path) -> str:
    """The table (:func:`_profiles`) and the slowdown run's deadlines round by round."""
    targets = (
        "Targets (issue 32): every run ends equal; 0 sites declared dead while alive; 0 rounds of "
        "unequal θ not repaired in the same round; no user-set timeout (none is set here)."
    )
    parts = [md_rows(list(_profiles(rows).values())), targets]
    slow = [r for r in rows if r["profile"] == SLOWDOWN]
    if slow:
        cols = ["round", "link_mbit", "slowest_reduce_s", "reduce_deadline_s", "refused", "min_reduce_arrived", "why"]
        mbit = float(m["fixed"][SLOW_MBIT])
        parts += [
            f"A link that slows {1000 / mbit:.0f}x and recovers (3 sites, small, fp32, continental links at "
            f"{mbit:g} Mbit/s for rounds {SLOW[0]}-{SLOW[1] - 1}): each round's slowest reduce, the deadline its "
            "plan carried, and what the owners refused (a contribution that arrived within the budget must not "
            "be). A round that needs more than its deadline is cut there (min_reduce_arrived < 1) and backs the "
            "next deadline off.",
            md_table(cols, [[r[c] for c in cols] for r in slow]),
        ]
    return "\n\n".join(parts)


def verdict(rows: list[dict[str, Any]], rounds: list, m: dict[str, Any]) -> list[str]:
    """Per profile: how many runs ended with one θ, sites declared dead while alive, rounds of unequal θ."""
    return [
        f"- {p['profile']}: {p[EQUAL]}/{p['runs']} runs ended equal, {p[DEAD]} sites declared dead while alive, "
        f"{p[UNEQUAL]} rounds of unequal θ: {met(p[EQUAL] == p['runs'] and p[DEAD] == p[UNEQUAL] == 0)}."
        for p in _profiles(rows).values()
    ]


SPEC = Spec(
    name="reliability",
    title="Reliability: equal θ through bad links with no timeout set (issue 32)",
    modes={
        mode: {
            "seeds": [0],
            "grid": [{"config": p, PROFILE: p, RUNS: n} for p, n in v["runs"].items()],
            "fixed": {"rounds": v["rounds"]},
        }
        for mode, v in MODES.items()
    },
    fixed={SIZE: "tiny", SLOW_MBIT: 5.0},
    label=lambda point: point[PROFILE],
    metrics=(("wall_s", 0.0, 2 * LAUNCH_TIMEOUT_S),),
    report=report,
    verdict=verdict,
    execute=run_point,
    paths=(PROFILE, RUNS, SLOW_MBIT),
    netem=True,
)
