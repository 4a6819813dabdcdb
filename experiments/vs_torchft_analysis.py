"""The measurement logic of the torchft comparison (:mod:`experiments.vs_torchft`): its numbers,
tables, verdict and plot, from the rows (one per run of one system) and the per-round lines
(every metrics line of every site, and one ``exit`` line per process) the runs left.

Definitions used in every table:

* round wall time: the time between two consecutive round lines of one site (inner phase
  + sync + evaluation + the round's bookkeeping), pooled over the sites; the first round
  of every site process (start-up, first quorum) is the warm-up and is excluded.
* bytes per round: payload bytes all sites received over the whole run (every byte sent is
  received once, in the receiver's next round line; a sender's count would miss what an owner
  serves after its last line; resync state pulls and discarded attempts included), divided by the rounds.
  dtrain: its transport's counters (pushed chunks, pulled means, pulled state; no gRPC/HTTP2
  framing).
  torchft: ``2 (n-1)/n x params x 4`` per participant and committed-or-not sync (gloo's
  ring all-reduce of the fp32 pseudo-gradients; headers not counted).
* peak memory: each site process's own VmHWM, written as it exits (the whole process: torch,
  the task, the system's runtime); the rendezvous's and the lighthouse's VmHWM read while
  they run; ``ru_maxrss`` from ``wait4`` for a killed site (not in the tables).
* per-round overhead: round wall time minus that round's inner phase, i.e. what each system
  adds to the identical computation (sync, evaluation, bookkeeping).
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from experiments.common import md_table, save_fig, subplots, summarize
from experiments.lab import Rows, decorate

# the settings of a run, by config path (the spec's grid and fixed settings)
SITES, SIZE, DATA, ROUNDS = "task_spec.num_sites", "task_spec.size", "task_spec.data", "rounds"
SYNC_EVERY, CODEC, BUCKET_BYTES = "diloco.sync_every", "diloco.rounds.codec.name", "diloco.buckets.bucket_bytes"
SYSTEM, SCENARIO, REPEAT, NETEM = "vs.system", "vs.scenario", "vs.repeat", "netem.profile"
KILL_ROUND, RESTART_AFTER, TIMEOUT_S, PYSPY = "vs.kill_round", "vs.restart_after", "vs.timeout_s", "vs.pyspy"
# what a mode runs (its fixed settings; ``--set`` overrides them)
SCENARIOS, REPEATS, EXTRA_CODECS, PROFILE = "vs.scenarios", "vs.repeats", "vs.extra_codecs", "vs.profile"
NETEM_PROFILES, NETEM_ROUNDS, FAULT_ROUNDS = "vs.netem_profiles", "vs.netem_rounds", "vs.fault_rounds"

KILLED_SITE = 1  # the fault scenario's: its process, and the process of its replacement
KILLED, RESTART = f"site-{KILLED_SITE}", f"site-{KILLED_SITE}-restart"
SPLIT = ("encode_s", "decode_s", "network_s", "wait_s")
WALL_TARGET = "round wall time dtrain <= torchft"


def lines_by_run(rounds: Rows) -> dict[str, dict[str, Rows]]:
    """run -> process (``site-0``, ``site-1-restart``, ``rendezvous``, ...) -> its lines in order."""
    return {run: summarize(lines, "site") for run, lines in summarize(rounds, "run").items()}


def _events(lines: Rows, event: str) -> Rows:
    return [d for d in lines if d.get("event") == event]


def _sites(procs: dict[str, Rows]) -> list[str]:
    return sorted(s for s in procs if s.startswith("site-"))


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _applied(system: str, d: dict) -> bool:
    return d.get("status") == "applied" if system == "dtrain" else bool(d.get("committed"))


def _num(d: dict, key: str) -> float:
    """A line's number; 0 where the line has none (a cell read back from the CSV as None)."""
    return d.get(key) or 0


def _site_stats(row: dict, procs: dict[str, Rows]) -> tuple[dict, dict]:
    """Per-site facts of one run, and that run's pooled per-round samples."""
    system = row[SYSTEM]
    sites = {}
    pool: dict[str, list] = {k: [] for k in ("walls", "overheads", "received", "sync_s", "inner_s", *SPLIT)}
    for s in _sites(procs):
        start = next(iter(_events(procs[s], "start")), None)
        rounds = _events(procs[s], "round")
        end = next(iter(_events(procs[s], "exit")), {})
        times = ([start["t"]] if start else []) + [d["t"] for d in rounds]
        deltas = [b - a for a, b in zip(times, times[1:])][1:]  # drop the warm-up round
        pool["walls"] += deltas
        pool["overheads"] += [w - d["inner_s"] for w, d in zip(deltas, rounds[1:])]
        for k in ("sync_s", "inner_s", *SPLIT):
            pool[k] += [d[k] for d in rounds[1:] if d.get(k) is not None]
        pool["received"] += [int(_num(d, "bytes_received")) for d in rounds]
        sites[s] = {
            "not_applied": sum(not _applied(system, d) for d in rounds),
            "final_val_loss": rounds[-1]["val_loss"] if rounds else None,
            "finished": bool(end.get("finished")),
            "peak_rss_mb": end["maxrss_kb"] / 1024 if end.get("maxrss_kb") else None,
            "cpu_s": end.get("cpu_s"),
            "inner_steps": (
                rounds[-1].get("inner_steps") if system == "dtrain" and rounds else len(rounds) * row[SYNC_EVERY]
            ),
        }
    return sites, pool


def run_stats(rows: Rows, runs: dict[str, dict[str, Rows]]) -> dict:
    """Everything the runs of one (system, scenario) say, repeats pooled (see the module
    docstring for the definitions). Per-site details are those of the first run."""
    row = rows[0]
    per_run = [_site_stats(r, runs.get(r["run"], {})) for r in rows]
    sites = per_run[0][0]
    pool = {k: [x for _, p in per_run for x in p[k]] for k in per_run[0][1]}
    wire = [sum(p["received"]) / row[ROUNDS] for _, p in per_run if p["received"]]
    finished = {s: v for s, v in sites.items() if v["finished"]}
    finals = [v["final_val_loss"] for v in finished.values() if v["final_val_loss"] is not None]
    ends = [d for r in rows for p in runs.get(r["run"], {}).values() for d in _events(p, "exit")]
    coords = [d["maxrss_kb"] / 1024 for d in ends if d.get("role") == "coordinator" and d.get("maxrss_kb")]
    rss = [v["peak_rss_mb"] for st, _ in per_run for s, v in st.items() if v["peak_rss_mb"] and s != KILLED]
    cpu = [v["cpu_s"] for st, _ in per_run for s, v in st.items() if v.get("cpu_s") and s != KILLED]
    walls = [x for x in (_last_round_s(runs.get(r["run"], {})) for r in rows) if x is not None]
    st = {
        "system": row[SYSTEM],
        "error": "; ".join(str(r["error"]) for r in rows if r.get("error")) or None,
        "netem_backends": row.get("netem_backends"),
        "round_wall_s": _stats(pool["walls"]),
        "overhead_s": _stats(pool["overheads"]),
        "sync_s": _stats(pool["sync_s"]),
        "inner_s": _stats(pool["inner_s"]),
        "sync_split_median_s": {k: (statistics.median(pool[k]) if pool[k] else None) for k in SPLIT},
        "final_val_loss_mean": statistics.mean(finals) if finals else None,
        "final_val_loss": {s: v["final_val_loss"] for s, v in finished.items()},
        "checksums_agree": bool(row.get("checksums_agree")),
        "not_applied": {s: v["not_applied"] for s, v in sites.items() if v["not_applied"]},
        "bytes_per_round_total": statistics.mean(wire) if wire else None,
        "peak_rss_mb_max": max(rss) if rss else None,
        "peak_rss_mb_mean": statistics.mean(rss) if rss else None,
        "cpu_s_per_site_mean": statistics.mean(cpu) if cpu else None,
        "coordinator_rss_mb": max(coords) if coords else None,
        "wall_total_s": statistics.median(walls) if walls else None,
    }
    if row[SCENARIO] == "fault":
        st["fault"] = fault_stats(row, runs.get(row["run"], {}), sites)
    return st


def fault_stats(row: dict, procs: dict[str, Rows], sites: dict) -> dict:
    """What the kill and the restart cost (see :mod:`experiments.vs_torchft`, scenario ``fault``)."""
    system = row[SYSTEM]
    per = {s: _events(procs[s], "round") for s in sites if s not in (KILLED, RESTART)}
    full_buckets = max([0] + [int(_num(d, "applied_buckets")) for rounds in per.values() for d in rounds])
    stall = max(((d["sync_s"], s, d["round"]) for s, rounds in per.items() for d in rounds), default=(0.0, None, None))
    out_surv = {}
    for s, rounds in per.items():
        applied = [d for d in rounds if _applied(system, d)]
        partial = [d["round"] for d in applied if int(_num(d, "applied_buckets")) < full_buckets]
        # Time the fault cost this survivor: whole discarded attempts (inner work + sync),
        # plus every sync beyond this run's typical one (median over its rounds).
        typical = statistics.median([d["sync_s"] for d in rounds]) if rounds else 0.0
        lost = sum(d["inner_s"] + d["sync_s"] for d in rounds if not _applied(system, d))
        lost += sum(max(0.0, d["sync_s"] - typical) for d in applied)
        out_surv[s] = {
            "attempts": len(rounds),
            "discarded_rounds": [d["round"] for d in rounds if not _applied(system, d)],
            "partial_rounds": partial if system == "dtrain" else [],
            "inner_steps": sites[s]["inner_steps"],
            "time_lost_s": round(lost, 2),
        }
    restart = _events(procs.get(RESTART, []), "round")
    restart_start = next(iter(_events(procs.get(RESTART, []), "start")), None)
    took_part = sum(_applied(system, d) for d in _events(procs.get(KILLED, []), "round") + restart)
    t_restart = row.get("t_restart_s")
    return {
        "kill_round": row[KILL_ROUND],
        "restart_when_survivor_finished_round": row[KILL_ROUND] + row[RESTART_AFTER] - 1,
        "survivors": out_surv,
        "longest_stall_s": stall[0],
        "longest_stall_at": f"{stall[1]} round {stall[2]}",
        # torchft's "round" is the site's own attempt counter; its outer step is "step" (after the attempt)
        "restart_first_round": (
            None
            if not restart
            else restart[0]["round"]
            if system == "dtrain"
            else restart[0]["step"] - int(bool(restart[0].get("committed")))
        ),
        "restart_first_status": restart[0].get("status") if restart else None,
        "restart_start_line_s": restart_start["t"] - t_restart if restart_start and t_restart is not None else None,
        "rejoin_s": restart[0]["t"] - t_restart if restart and t_restart is not None else None,
        "site1_rounds_taken_part": took_part,
        "site1_rounds_missed": row[ROUNDS] - took_part,
    }


def _last_round_s(procs: dict[str, Rows]) -> float | None:
    """Seconds from the go signal to the last round line of any site (exit linger excluded)."""
    ts = [d["t"] for s in _sites(procs) for d in _events(procs[s], "round")]
    return max(ts) if ts else None


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def analyse(rows: Rows, rounds: Rows) -> dict:
    """The runs' statistics by ``system/scenario``, the dtrain / torchft ratios by scenario (with
    the targets of the healthy and concurrent ones), and the py-spy profile if one was taken."""
    runs = lines_by_run(rounds)
    prof = [d for d in rounds if d.get("event") == "pyspy"]
    groups: dict[str, Rows] = {}
    for r in rows:
        if r[SCENARIO] != "profile":
            groups.setdefault(f"{r[SYSTEM]}/{r[SCENARIO]}", []).append(r)
    stats = {k: run_stats(v, runs) for k, v in groups.items()}
    comps = {}
    for scen in sorted({r[SCENARIO] for r in rows}):
        d, t = stats.get(f"dtrain/{scen}"), stats.get(f"torchft/{scen}")
        if not d or not t:
            continue
        wall = _ratio(d["round_wall_s"]["median"], t["round_wall_s"]["median"])
        loss = _ratio(d["final_val_loss_mean"], t["final_val_loss_mean"])
        wire = _ratio(d["bytes_per_round_total"], t["bytes_per_round_total"])
        c = {"round_wall_median": wall, "final_val_loss_mean": loss, "bytes_per_round": wire}
        if scen in ("healthy", "concurrent"):
            c["targets"] = {
                WALL_TARGET: wall is not None and wall <= 1.0,
                "final loss within 1%": loss is not None and abs(loss - 1) <= 0.01,
                "bytes <= 1/4": wire is not None and wire <= 0.25,
            }
        comps[scen] = c
    profile = {
        "samples": sum(int(d["samples"]) for d in prof if d["kind"] == "total"),
        "categories": {d["name"]: d["share"] for d in prof if d["kind"] == "category"},
        "top_leaves": [(d["name"], d["share"]) for d in prof if d["kind"] == "leaf"],
    }
    return {"runs": stats, "comparisons": comps, "profile": profile if prof else None}


# ----------------------------------------------------------------------------- the section
def _f(v, fmt="{:.3f}"):
    return "-" if v is None else fmt.format(v)


UNEQUAL = [
    "Wire format: dtrain sends its default int8 codec (1 byte per value plus an fp32 scale per block: a little over "
    "1/4 of fp32's bytes) of the pseudo-gradient to each bucket's owner and pulls int8 means; torchft all-reduces fp32 "
    "(its `should_quantize` path needs triton/CUDA, not available on CPU). That is the point of the bytes target, but "
    "it also means the two systems do not apply bit-identical updates, so their losses differ slightly even when "
    "nothing fails.",
    "Bytes: dtrain's are measured payload bytes (no gRPC/HTTP2/TCP framing); torchft's are computed from the "
    "tensor sizes (ring factor 2(n-1)/n, no gloo headers). Control traffic (rendezvous/lighthouse, heartbeats, "
    "quorum, should_commit) is excluded on both sides.",
    "Per-round extra work: a dtrain worker hashes θ and its outer-optimizer state every round (two checksums); "
    "the torchft site hashes its parameters once. Both evaluate the same validation batches every round.",
    "Recovery state: a restarted dtrain site pulls θ and the outer-optimizer state, then the training position "
    "(inner step count, inner AdamW state, LR schedulers) of that round from a donor; torchft heals the model, the inner AdamW state and DiLoCo's θ/outer state from a peer. A "
    "restarted torchft replica first runs H inner steps from its fresh weights before it asks for a quorum and "
    "is healed (those steps are overwritten).",
    "Timeouts: dtrain sets none (its deadlines are derived from the observed rounds and the default 5 s stall "
    "budget, starting at quorum 5 s / reduce 10 s / broadcast 20 s; a site is dead by the phi accrual detector "
    "over its heartbeats, or at once when the data path finds it gone); torchft uses its documented "
    "recommendations: lighthouse (--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000, heartbeat "
    "dead after 5 s), Manager timeout 30 s, quorum timeout 300 s, ProcessGroupGloo timeout 5 s. Stalls after "
    "a kill mostly measure these choices.",
    "Start-up: every site process is pre-warmed (imports done) and starts on a go-file; torchft sites also wait "
    "until every Manager heartbeats (a barrier dtrain gets from its rendezvous's initial_sites). Round 0 is "
    "excluded from the per-round times.",
    "Communication pattern: at dtrain's default bucket size (4 MiB) the small model's 1.75 MB of fp32 parameters "
    "are one bucket, so one site owns it (receives the others' int8 pseudo-gradients, serves the int8 mean); torchft "
    "issues one gloo ring all-reduce per parameter tensor (28 tensors, not bucketized by default). Both are each "
    "system's defaults.",
    "Coordinators: torchft's lighthouse logic is Rust, but its `torchft_lighthouse` entry point is Python and "
    "imports torch, hence its RSS; dtrain's rendezvous does not import torch.",
]


def _load_text(loads: list) -> str:
    xs = [x for x in loads if x is not None]
    if not xs:
        return "load average not recorded"
    some = f" (recorded for {len(xs)} of {len(loads)} runs)" if len(xs) < len(loads) else ""
    return f"1-minute load average at the end of the runs {min(xs):.1f}-{max(xs):.1f}{some}"


def report(rows: Rows, rounds: Rows, m: dict[str, Any], prefix: Path, notes: list[str]) -> str:
    """The RESULTS.md section of a comparison under the runner's stamp: setup, one table per
    scenario, the fault table, the profile, what could not be made equal, ``notes``, the plot."""
    f, res = m["fixed"], analyse(rows, rounds)
    runs, comps = res["runs"], res["comparisons"]
    png = plot(rows, rounds, prefix.with_name(prefix.name + "_loss_vs_wall.png"))
    load = _load_text([r.get("loadavg_end") for r in rows])
    lines = [
        _headline(rows, rounds, m, runs, comps),
        "",
        f"Setup: {f[SITES]} sites, built-in task `{f[SIZE]}`, H = {f[SYNC_EVERY]} inner steps, "
        f"{f[ROUNDS]} rounds (fault: {f[FAULT_ROUNDS]}), 1 torch thread per site, loopback unless netem; {load}.",
        "",
    ]
    scens = [s for s in ("healthy", "concurrent") if s in comps] + sorted(s for s in comps if s.startswith("netem"))
    for scen in scens:
        lines += _scenario_section(scen, runs, comps[scen])
    if "fault" in comps:
        lines += _fault_section(runs)
    lines += _profile_section(res["profile"])
    lines += ["### What could not be made equal", ""] + [f"- {u}" for u in UNEQUAL] + [""]
    if notes:
        lines += ["### Notes", ""] + [f"- {n}" for n in notes] + [""]
    csv = f"CSV: `{prefix.name}.csv` (one row per run), `{prefix.name}_rounds.csv` (every metrics line of every site)"
    return "\n".join([*lines, f"{csv}; plot: `{png.name}`."])


def _headline(rows: Rows, rounds: Rows, m: dict[str, Any], runs: dict, comps: dict) -> str:
    """The section's ``Headline:`` (the RESULTS.md index): the first scenario's verdict and, with
    the fault scenario, the longest stall a survivor saw on each side."""
    parts = [verdict(rows, rounds, m)[0].removeprefix("- ")]
    if "fault" in comps:
        d, t = runs["dtrain/fault"]["fault"], runs["torchft/fault"]["fault"]
        parts.append(
            f"fault: longest survivor stall after a SIGKILL {_f(d['longest_stall_s'], '{:.2f}')} s, "
            f"torchft {_f(t['longest_stall_s'], '{:.2f}')} s."
        )
    return "Headline: " + " ".join(parts)


def profile_wanted(rows: Rows, m: dict[str, Any]) -> bool:
    """Whether to sample dtrain's site-0 with py-spy in one more healthy run: ``vs.profile`` ``always``, or
    ``auto`` when the healthy runs missed the wall-time target (median of each system's medians)."""
    how = m["fixed"][PROFILE]
    if how != "auto":
        return how == "always"
    med = {
        sy: [r["round_wall_median_s"] for r in rows if (r[SYSTEM], r[SCENARIO]) == (sy, "healthy")]
        for sy in ("dtrain", "torchft")
    }
    if not all(med.values()) or any(x is None for xs in med.values() for x in xs):
        return False
    return statistics.median(med["dtrain"]) > statistics.median(med["torchft"])


def verdict(rows: Rows, rounds: Rows, m: dict[str, Any]) -> list[str]:
    """The issue's targets (7), per scenario of both systems on loopback: dtrain's median round no
    longer than torchft's, final loss within 1%, bytes per round at most 1/4 of torchft's."""
    comps = analyse(rows, rounds)["comparisons"]
    out = []
    for scen, c in comps.items():
        if "targets" in c:
            got = ", ".join(f"**{'met' if v else 'MISSED'}** ({k})" for k, v in c["targets"].items())
            nums = " / ".join(_f(c[k]) for k in ("round_wall_median", "final_val_loss_mean", "bytes_per_round"))
            out.append(f"- {scen}: {got}; dtrain / torchft: round wall, final loss, bytes = {nums}.")
    return out or ["- no healthy or concurrent scenario ran both systems: no target judged."]


def _scenario_rows(scen: str, runs: dict) -> list[list[str]]:
    """The table of one scenario: a metric per row, dtrain, torchft, their ratio."""
    d, t = runs[f"dtrain/{scen}"], runs[f"torchft/{scen}"]

    def row(metric: str, get, fmt: str = "{:.3f}", ratio: str | None = "{:.3f}", cell=None) -> list[str]:
        """``get``: a system's figure: its cell, formatted with ``fmt`` (or ``cell``'s), and the ratio's."""
        cells = [cell(x) if cell else _f(get(x), fmt) for x in (d, t)]
        return [metric, *cells, _f(_ratio(get(d), get(t)), ratio) if ratio else ""]

    def med(key: str):
        return lambda x: x[key]["median"]

    def parts(key: str, form: str, *names: str, fmt: str = "{:.3f}"):
        return lambda x: form.format(*(_f(x[key][n], fmt) for n in names))

    w, loss, sites = "round_wall_s", "{:.4f}", sorted(set(d["final_val_loss"]) | set(t["final_val_loss"]))
    rows = [
        ["metric", "dtrain", "torchft", "dtrain / torchft"],
        row("round wall time median [min, max] (s)", med(w), cell=parts(w, "{} [{}, {}]", "median", "min", "max")),
        row("per-round overhead = round wall - inner phase, median (s)", med("overhead_s")),
        row("sync time median / max (s)", med("sync_s"), cell=parts("sync_s", "{} / {}", "median", "max")),
        row("inner phase median (s)", med("inner_s")),
        row("final val loss, mean of sites", lambda x: x["final_val_loss_mean"], loss, loss),
        *(row(f"final val loss {s}", lambda x, s=s: x["final_val_loss"].get(s), loss, None) for s in sites),
        row("bytes on the wire per round, all sites", lambda x: x["bytes_per_round_total"], "{:,.0f}"),
        row(
            "peak RSS per site process, max / mean (MB)",
            lambda x: x["peak_rss_mb_max"],
            cell=lambda x: f"{_f(x['peak_rss_mb_max'], '{:.0f}')} / {_f(x['peak_rss_mb_mean'], '{:.0f}')}",
        ),
        row("CPU seconds per site process (whole life, mean)", lambda x: x["cpu_s_per_site_mean"], "{:.1f}"),
        row("coordinator peak RSS (MB) (rendezvous / lighthouse)", lambda x: x["coordinator_rss_mb"], "{:.0f}", None),
        row("replicas agree at the end (checksum)", lambda x: x["checksums_agree"], "{}", None),
        row(
            "round lines not applied (dtrain: resynced/deferred; torchft: not committed)",
            lambda x: ", ".join(f"{k}: {v}" for k, v in x["not_applied"].items()) or "none",
            "{}",
            None,
        ),
        row("time from go to the last round (s)", lambda x: x["wall_total_s"], "{:.1f}"),
    ]
    # the healthy table: dtrain's runs with other codecs, three figures each (get, cell format, ratio format)
    codecs = sorted(k for k in runs if k.startswith("dtrain/healthy codec=")) if scen == "healthy" else []
    figs = ((lambda x: x["bytes_per_round_total"], "{:,.0f}", "{:.3f}"), (med(w), "{:.3f}", "{:.3f}"))
    figs += ((lambda x: x["final_val_loss_mean"], loss, loss),)
    for key in codecs:
        metric = f"with codec {key.split('=', 1)[1]}: bytes per round / round wall median (s) / final val loss"
        cell = " / ".join(_f(get(runs[key]), fmt) for get, fmt, _ in figs)
        rows.append([metric, cell, "", " / ".join(_f(_ratio(get(runs[key]), get(t)), fmt) for get, _, fmt in figs)])
    return rows


def _scenario_section(scen: str, runs: dict, c: dict) -> list[str]:
    """One scenario's heading, table, dtrain's sync split, a missed wall target's note and problems (a missed
    bytes target: the "Wire format" caveat says why, the healthy table's codec rows what meets it)."""
    d, t = runs[f"dtrain/{scen}"], runs[f"torchft/{scen}"]
    rows = _scenario_rows(scen, runs)
    sp = d["sync_split_median_s"]
    title = {
        "healthy": "healthy (loopback; the systems one after the other, repeats in AB BA order)",
        "concurrent": "concurrent (loopback; both systems' healthy runs at the same time, same background load)",
    }
    split = ", ".join(f"{k.removesuffix('_s')} {_f(sp[k])}" for k in SPLIT)
    lines = [f"### {title.get(scen, scen)}", "", md_table(rows[0], rows[1:]), ""]
    lines.append(f"dtrain's sync split (median s per round): {split}.")
    if d.get("netem_backends"):
        lines.append(f"netem backends: {d['netem_backends']}")
    if "targets" in c and not c["targets"][WALL_TARGET]:  # the figure behind a missed wall target that no row has
        share = _f(_ratio(t["inner_s"]["median"], t["round_wall_s"]["median"]), "{:.0%}")
        lines += [
            "",
            f"Wall time: the inner phase (the same code in both systems: same model, batches, AdamW, 1 thread) is "
            f"{share} of torchft's round. The inner-phase, overhead and CPU rows say where dtrain's extra time goes; "
            "the concurrent table (same background load for both) and the profile whether the gap is dtrain's.",
        ]
    return lines + [f"\n{r['system']} {scen}: problem: {r['error']}" for r in (d, t) if r["error"]] + [""]


def _fault_section(runs: dict) -> list[str]:
    """The fault scenario's table: what a SIGKILL and a restart cost each system."""
    d, t = runs["dtrain/fault"], runs["torchft/fault"]
    sites = sorted(set(d["final_val_loss"]) | set(t["final_val_loss"]))
    k, back = d["fault"]["kill_round"], d["fault"]["restart_when_survivor_finished_round"]
    head = f"fault: site-1 SIGKILLed in round {k} (admitted, nothing sent), restarted after round {back}"

    def row(metric: str, cell, torchft: str | None = None) -> list[str]:
        return [metric, cell(d, d["fault"]), cell(t, t["fault"]) if torchft is None else torchft]

    def surv(key: str):
        return lambda x, f: "; ".join(f"{s}: {v[key]}" for s, v in f["survivors"].items())

    def pair(a: str, b: str, fmt: str = "{}"):
        return lambda x, f: f"{_f(f[a], fmt)} / {_f(f[b], fmt)}"

    rows = [
        [head, "dtrain", "torchft"],
        row("rounds discarded at survivors (inner work thrown away)", surv("discarded_rounds")),
        row("rounds applied without some buckets at survivors", surv("partial_rounds"), "n/a (all-or-nothing)"),
        row("sync attempts at survivors", surv("attempts")),
        row("inner steps at survivors", surv("inner_steps")),
        row("time the fault cost a survivor (s): discarded attempts + syncs beyond the median", surv("time_lost_s")),
        row(
            "longest stall a survivor saw (s)",
            lambda x, f: f"{_f(f['longest_stall_s'], '{:.2f}')} ({f['longest_stall_at']})",
        ),
        row("restarted site: go -> start line / first round (s)", pair("restart_start_line_s", "rejoin_s", "{:.1f}")),
        row(
            "restarted site's first round (status)",
            lambda x, f: f"{f['restart_first_round']} ({f['restart_first_status']})",
        ),
        row("rounds site-1 took part in / missed", pair("site1_rounds_taken_part", "site1_rounds_missed")),
        row("final val loss, mean of finished sites", lambda x, f: _f(x["final_val_loss_mean"], "{:.4f}")),
        *(row(f"final val loss {s}", lambda x, f, s=s: _f(x["final_val_loss"].get(s), "{:.4f}")) for s in sites),
        row("replicas agree at the end (checksum)", lambda x, f: str(x["checksums_agree"])),
        row("time from go to the last round (s)", lambda x, f: _f(x["wall_total_s"], "{:.1f}")),
    ]
    lines = ["### fault", "", md_table(rows[0], rows[1:]), ""]
    return lines + [f"{r['system']} fault: problem: {r['error']}\n" for r in (d, t) if r["error"]]


_PROFILE_CATEGORIES = [  # (name, substrings of a frame; the first category whose substring is in the stack wins)
    ("checksums of θ and outer state (every round)", ("theta_checksum", "outer_state_checksum")),
    ("validation loss (every round)", ("evaluate (",)),
    (
        "sync: round engine (encode, reduce, finalize, pull, apply)",
        ("run_round", "dtrain/rounds/", "dtrain/codecs", "dtrain/aggregation.py", "dtrain/state.py"),
    ),
    ("sync: waiting for the quorum (rendezvous client)", ("dtrain/rendezvous/grpc.py", "membership.py")),
    ("gRPC transport threads", ("grpc",)),
    ("inner steps (forward, backward, AdamW)", ("_train (",)),
    ("start-up (task, imports, join)", ("build_task", "load_corpus", "run_worker", "_prewarmed_main", "<module>")),
]


def pyspy_summary(path: Path, top: int = 12) -> dict:
    """Shares of py-spy samples (active threads only) by category and by leaf frame."""
    cats, leaves = Counter(), Counter()
    for line in Path(path).read_text(errors="replace").splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if n.isdigit():
            cat = next((name for name, keys in _PROFILE_CATEGORIES if any(k in stack for k in keys)), "other")
            cats[cat] += int(n)
            leaves[stack.rpartition(";")[2]] += int(n)
    total = sum(cats.values())
    return {
        "samples": total,
        "categories": {k: v / total for k, v in cats.most_common()} if total else {},
        "top_leaves": [(k, v / total) for k, v in leaves.most_common(top)] if total else [],
    }


def _profile_section(prof: dict | None) -> list[str]:
    """Where dtrain's site-0 spent its CPU in the profiled run (py-spy), by category and by frame."""
    if not prof:
        return []
    cats = [[k, f"{v:.1%}"] for k, v in prof["categories"].items()]
    leaves = [[f"`{k[:110]}`", f"{v:.1%}"] for k, v in prof["top_leaves"]]
    head = ["### Profile of dtrain (healthy run, site-0)", "", f"{prof['samples']} samples at 100 Hz.", ""]
    cats_md = md_table(["where dtrain site-0's CPU time goes (py-spy, active threads)", "share of samples"], cats)
    return head + [cats_md, "", md_table(["top frames (self time)", "share"], leaves), ""]


def plot(rows: Rows, rounds: Rows, path: Path) -> Path:
    """Validation loss over wall time since the go signal, a panel per scenario, every site of both
    systems (repeats drawn faintly, site-0 only); the kill and the restart of the fault scenario."""
    runs = lines_by_run(rounds)
    order = {"healthy": 0, "concurrent": 1, "fault": 2}
    scens = {r[SCENARIO] for r in rows if " codec=" not in r[SCENARIO] and r[SCENARIO] != "profile"}
    scens = sorted(scens, key=lambda sc: (order.get(sc, 3), sc))
    ncol = min(3, max(1, len(scens)))
    nrow = max(1, (len(scens) + ncol - 1) // ncol)
    fig, axes = subplots(nrow, ncol, figsize=(6.0 * ncol, 4.4 * nrow), squeeze=False)
    for ax, scen in zip(axes.flat, scens):
        _plot_scenario(ax, scen, [r for r in rows if r[SCENARIO] == scen], runs)
    for ax in list(axes.flat)[len(scens) :]:
        ax.set_visible(False)
    fig.suptitle(
        "dtrain vs torchft 0.2.0 DiLoCo\nvalidation loss over wall time (same task, H, optimizers)", fontsize=10
    )
    return save_fig(fig, path)


def _plot_scenario(ax, scen: str, rows: Rows, runs: dict[str, dict[str, Rows]]) -> None:
    """One panel of :func:`plot`: the loss curves of one scenario's runs."""
    colors = {"dtrain": "tab:blue", "torchft": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    later, start_loss, marks = [], None, []  # y range: everything after each site's first round
    for r in rows:
        procs, system, repeat = runs.get(r["run"], {}), r[SYSTEM], r[REPEAT]
        for k, s in enumerate(_sites(procs)):
            if repeat and s != "site-0":  # repeats: one line each (replicas agree), drawn faintly
                continue
            pts = [(d["t"], d["val_loss"]) for d in procs[s] if d["event"] in ("start", "round") and d["val_loss"]]
            if not pts:
                continue
            start_loss = start_loss or pts[0][1]
            later += [y for _, y in pts[2:]]
            xs, ys = zip(*pts)
            ax.plot(
                xs,
                ys,
                styles[k % len(styles)],
                color=colors[system],
                marker="o" if system == "dtrain" else "s",
                markersize=3.5,
                markerfacecolor="none",
                linewidth=0.9 if repeat else 1.3,
                alpha=0.45 if repeat else 1.0,
                label=f"{system} {s}" + (f" (repeat {repeat})" if repeat else ""),
            )
        marks += [
            (r[c], f"{system} {what}", colors[system])
            for c, what in (("t_kill_s", "kill"), ("t_restart_s", "restart"))
            if r.get(c) is not None
        ]
    if later:
        lo, hi = min(later), max(later)
        ax.set_ylim(lo - 0.05 * (hi - lo) - 0.01, hi + 0.25 * (hi - lo) + 0.01)
    for n, (x, what, col) in enumerate(marks):
        ax.axvline(x, color=col, linestyle=":", alpha=0.7)
        y = ax.get_ylim()[1] - (0.03 + 0.2 * (n % 4)) * (ax.get_ylim()[1] - ax.get_ylim()[0])
        ax.text(x, y, f" {what}", rotation=90, va="top", fontsize=7, color=col)
    title = f"{scen} (all sites start at loss {start_loss:.2f}, above the plot)" if start_loss else scen
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    decorate(ax, "wall time since the sites were started (s)", "validation loss (nats/byte)", legend=7)
