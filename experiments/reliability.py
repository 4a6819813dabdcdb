"""Does every run end with one θ on bad links, with no timeout set? (issue 32)

Runs ``dtrain launch --sites 3 --size tiny`` many times through netem profiles (``lossy``:
10% loss, 20 ms RTT, 100 Mbit/s; ``flaky``: a 2 s partition of each site every 10 s;
``lossy30``: 30% loss) with no time setting at all: the deadlines are derived from the
observed rounds and the default stall budget, failure detection is the phi accrual
detector. Each run is read back from its metrics lines and the rendezvous log:

* equal θ at the end: every site's last round line has the same checksum (and the launch
  exited 0, which it does only then);
* sites declared dead while alive: every site lives through the run, so each "declared
  dead" line of the rendezvous is a false one;
* rounds of unequal θ: a round whose applied lines disagree on the checksum (a round is
  repaired within itself when its lines agree);
* rounds missed (a site resynced instead of applying) and the worst sync time.

Usage (root; from the repository root)::

    .venv/bin/python -m experiments.reliability --quick    # 10 lossy, 10 flaky, 4 at 30%
    .venv/bin/python -m experiments.reliability            # full: 30 / 30 / 10 (the issue's count)
    .venv/bin/python -m experiments.reliability --smoke --out /tmp/x --results none   # CI: 1 lossy run

Writes ``OUT/reliability[_MODE].csv`` (one row per run) and puts its table into RESULTS.md.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from experiments.common import RunResult, base_parser, md_table, mode_settings, out_prefix, publish, run_or_load

ROOT = Path(__file__).resolve().parent.parent
MODES: dict[str, dict[str, Any]] = {
    "smoke": {"runs": {"lossy": 1}, "rounds": 3, "size": "tiny", "slowdown": False},
    "quick": {"runs": {"lossy": 10, "flaky": 10, "lossy30": 4}, "rounds": 4, "size": "tiny", "slowdown": True},
    "full": {"runs": {"lossy": 30, "flaky": 30, "lossy30": 10}, "rounds": 5, "size": "tiny", "slowdown": True},
}
#: the slowdown run: the built-in small GPT in fp32 through continental links whose rate drops
#: 200x (to 5 Mbit/s) before round SLOW[0] and recovers before round SLOW[1]
SLOW, SLOW_MBIT, SLOW_ROUNDS = (4, 9), 5.0, 13
LAUNCH_TIMEOUT_S = 300


def launch_once(profile: str, *, rounds: int, size: str, out: Path) -> dict[str, Any]:
    """One ``dtrain launch`` through ``profile`` with no time setting; its figures."""
    argv = [sys.executable, "-m", "dtrain", "launch", "--sites", "3", "--rounds", str(rounds), "--size", size]
    argv += ["--netem", profile, "--out", str(out)]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        code = proc.wait(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = -1  # a hung run: stop the launch and everything it started, and its topology
        _stop(proc)
    return {"profile": profile, "exit_code": code, "wall_s": round(time.monotonic() - t0, 1), **read_run(out)}


def _stop(proc: subprocess.Popen) -> None:
    """Kill a launch's process group and take down its netem topology (named ``launch``), so the
    next run can build its own."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)
    argv = [sys.executable, "-m", "netem", "down", "--name", "launch"]
    subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=120)


def read_run(out: Path) -> dict[str, Any]:
    """The reliability figures of a launch's run directory (see the module docstring)."""
    by_round: dict[int, dict[str, str]] = {}
    last: dict[str, str] = {}
    missed = 0
    sync_max = 0.0
    for path in sorted(out.glob("site-*/metrics.jsonl")):
        site = path.parent.name
        for text in path.read_text().splitlines():
            try:
                d = json.loads(text)
            except ValueError:
                continue
            if d.get("event") != "round":
                continue
            if d.get("status") == "applied" and d.get("checksum"):
                by_round.setdefault(int(d["round"]), {})[site] = d["checksum"]
            elif d.get("status") == "resynced":
                missed += 1
            if d.get("checksum"):
                last[site] = d["checksum"]
            sync_max = max(sync_max, float(d.get("sync_s") or 0.0))
    log = out / "rendezvous.log"
    dead = log.read_text().count("declared dead") if log.exists() else 0
    unequal = sum(1 for sums in by_round.values() if len(set(sums.values())) > 1)
    return {
        "sites_seen": len(last),
        "equal_at_end": len(last) == 3 and len(set(last.values())) == 1,
        "declared_dead": dead,
        "unequal_rounds": unequal,
        "rounds_missed": missed,
        "max_sync_s": round(sync_max, 2),
    }


def _rounds_done(out: Path) -> int:
    """Rounds site-0 has written a line for (-1: none yet)."""
    path = out / "site-0" / "metrics.jsonl"
    done = -1
    for text in path.read_text().splitlines() if path.exists() else ():
        try:
            d = json.loads(text)
        except ValueError:
            continue
        if d.get("event") == "round":
            done = max(done, int(d["round"]))
    return done


def _set_rate(mbit: float) -> None:
    """Change every link of the running launch's topology (``python -m netem set``)."""
    argv = [sys.executable, "-m", "netem", "set", "all", "--name", "launch", "--rate-mbit", f"{mbit:g}"]
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, timeout=60)


def slowdown_once(out: Path) -> list[dict[str, Any]]:
    """A launch whose links slow 200x for rounds SLOW[0]..SLOW[1]-1, then recover; per round:
    the link rate, the slowest site's reduce_s, the plan's reduce deadline and why, and what
    was refused or missing (nothing should be: every contribution arrives within the budget)."""
    argv = [sys.executable, "-m", "dtrain", "launch", "--sites", "3", "--rounds", str(SLOW_ROUNDS), "--size", "small"]
    argv += ["--codec", "fp32", "--sync-every", "10", "--netem", "continental", "--out", str(out)]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 2 * LAUNCH_TIMEOUT_S
        state = None
        while proc.poll() is None and time.monotonic() < deadline:
            done = _rounds_done(out)
            want = SLOW_MBIT if SLOW[0] - 1 <= done < SLOW[1] - 1 else None
            if want != state and done >= 0:
                _set_rate(want if want is not None else 1000.0)  # continental's own cap: 1 Gbit/s
                state = want
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            _stop(proc)
    rows = []
    lines = _lines(out)
    for r in sorted({d["round"] for d in lines}):
        rs = [d for d in lines if d["round"] == r and d.get("status") == "applied"]
        if not rs:
            continue
        rows.append(
            {
                "round": r,
                "link_mbit": "5" if SLOW[0] <= r < SLOW[1] else "1000",
                "slowest_reduce_s": round(max(float(d.get("reduce_s") or 0) for d in rs), 2),
                "reduce_deadline_s": round(float(rs[0].get("reduce_timeout_s") or 0), 2),
                "refused": sum(sum((d.get("rejected") or {}).values()) for d in rs),
                "min_reduce_arrived": min(float(d.get("reduce_arrived_fraction") or 0) for d in rs),
                "why": (rs[0].get("deadline_reason") or "").split("; ")[1] if rs[0].get("deadline_reason") else "",
            }
        )
    return rows


def _lines(out: Path) -> list[dict[str, Any]]:
    got = []
    for path in sorted(out.glob("site-*/metrics.jsonl")):
        for text in path.read_text().splitlines():
            try:
                d = json.loads(text)
            except ValueError:
                continue
            if d.get("event") == "round":
                got.append(d)
    return got


def run_all(settings: dict[str, Any]) -> list[RunResult]:
    results = []
    with tempfile.TemporaryDirectory(prefix="dtrain-reliability-") as tmp:
        if settings.get("slowdown"):
            for row in slowdown_once(Path(tmp) / "slowdown"):
                print(json.dumps(row), flush=True)
                results.append(RunResult(row={"profile": "slowdown", **row}))
        for profile, n in settings["runs"].items():
            for i in range(n):
                row = launch_once(
                    profile, rounds=settings["rounds"], size=settings["size"], out=Path(tmp) / f"{profile}-{i}"
                )
                row["run"] = i
                if not (row["equal_at_end"] and row["exit_code"] == 0) or row["unequal_rounds"]:
                    kept = settings["out"] / f"reliability-failed-{profile}-{i}"  # its logs, for whoever looks
                    shutil.rmtree(kept, ignore_errors=True)
                    shutil.copytree(Path(tmp) / f"{profile}-{i}", kept)
                    row["kept"] = str(kept)
                print(json.dumps(row), flush=True)
                results.append(RunResult(row=row))
    return results


def _true(v: Any) -> bool:
    """A boolean cell, from a run (bool) or read back from its CSV ("True")."""
    return v is True or str(v) == "True"


def report(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The table: per profile, runs, runs ending equal, false deaths, unequal rounds; and
    the slowdown run's deadlines round by round."""
    slow = [r for r in rows if r["profile"] == "slowdown"]
    rows = [r for r in rows if r["profile"] != "slowdown"]
    table = []
    for profile in dict.fromkeys(r["profile"] for r in rows):
        rs = [r for r in rows if r["profile"] == profile]
        table.append(
            [
                profile,
                len(rs),
                sum(_true(r["equal_at_end"]) and int(r["exit_code"]) == 0 for r in rs),
                sum(int(r["declared_dead"]) for r in rs),
                sum(int(r["unequal_rounds"]) for r in rs),
                sum(int(r["rounds_missed"]) for r in rs),
                max(float(r["max_sync_s"]) for r in rs),
                f"{sorted(float(r['wall_s']) for r in rs)[len(rs) // 2]:.0f}",
            ]
        )
    head = [
        "profile",
        "runs",
        "ended equal (exit 0)",
        "sites declared dead while alive",
        "rounds of unequal θ",
        "rounds missed (resynced)",
        "worst sync_s",
        "median wall s",
    ]
    targets = (
        "Targets (issue 32): every run ends equal; 0 sites declared dead while alive; 0 rounds of "
        "unequal θ not repaired in the same round; no user-set timeout (none is set here)."
    )
    parts = [
        f"`{meta.get('command', '')}` — {meta.get('provenance', '')}, {meta.get('minutes', '?')} min, "
        f"load {os.getloadavg()[0]:.1f}",
        md_table(head, table),
        targets,
    ]
    if slow:
        cols = ["round", "link_mbit", "slowest_reduce_s", "reduce_deadline_s", "refused", "min_reduce_arrived", "why"]
        parts += [
            f"A link that slows 200x and recovers (3 sites, small, fp32, continental links at 5 Mbit/s for "
            f"rounds {SLOW[0]}-{SLOW[1] - 1}): each round's slowest reduce, the deadline its plan carried, and "
            "what the owners refused (a contribution that arrived within the budget must not be).",
            md_table(cols, [[r[c] for c in cols] for r in slow]),
        ]
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = base_parser(__doc__)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("reliability: needs root (netem network namespaces)")
    _mode, settings = mode_settings(args, MODES)
    prefix = out_prefix(args, "reliability")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    settings["out"] = Path(args.out)
    rows, _rounds, meta = run_or_load(args, argv, "reliability.py", prefix, lambda: run_all(settings))
    publish(
        args, "reliability", "Reliability: equal θ through bad links with no timeout set (issue 32)", report(rows, meta)
    )
    runs = [r for r in rows if r["profile"] != "slowdown"]
    bad = [r for r in runs if not (_true(r["equal_at_end"]) and int(r["exit_code"]) == 0)]
    return 1 if bad and _mode == "smoke" else 0


if __name__ == "__main__":
    raise SystemExit(main())
