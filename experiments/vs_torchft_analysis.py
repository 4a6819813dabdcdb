"""Numbers and the markdown report of ``experiments/vs_torchft.py`` (see its docstring); the files
they go into (JSON, CSV, PNG) are written by ``vs_torchft_outputs.py``.

Definitions used in every table:

* round wall time: the time between two consecutive round lines of one site (inner phase
  + sync + evaluation + the round's bookkeeping), pooled over the sites; the first round
  of every site process (start-up, first quorum) is the warm-up and is excluded.
* bytes per round: payload bytes all sites received over the whole run (every byte sent is
  received once; resync state pulls and discarded attempts included), divided by the rounds.
  dtrain: its transport's counters (pushed chunks, pulled means, pulled state; no gRPC/HTTP2
  framing).
  torchft: ``2 (n-1)/n x params x 4`` per participant and committed-or-not sync (gloo's
  ring all-reduce of the fp32 pseudo-gradients; headers not counted).
* peak memory: each site process's own VmHWM, written as it exits (the whole process: torch,
  the task, the system's runtime); ``ru_maxrss`` from ``wait4`` for processes that cannot
  report (killed sites, the rendezvous and the lighthouse).
* per-round overhead: round wall time minus that round's inner phase, i.e. what each system
  adds to the identical computation (sync, evaluation, bookkeeping).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from dtrain.metrics import read_json_lines

__all__ = ["analyse", "report_md", "run_stats"]

KILLED = "site-1"
RESTART = "site-1-restart"


def _lines(run_dir: Path, site: str) -> list[dict]:
    """A site's metrics lines as dicts: dtrain's (``dtrain.metrics`` schema) or torchft_site's
    (its own fields), so read by the schema-free layer of the one reader (complete lines only)."""
    return read_json_lines(run_dir / site / "metrics.jsonl")


def _site_dirs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("site-"))


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _applied(system: str, d: dict) -> bool:
    return d.get("status") == "applied" if system == "dtrain" else bool(d.get("committed"))


def _site_stats(rec) -> tuple[dict, dict]:
    """Per-site facts of one run, and that run's pooled per-round samples."""
    spec = rec.spec
    run_dir = Path(rec.dir)
    sites = {}
    pool = {"walls": [], "overheads": [], "syncs": [], "inners": [], "sent_by_round": {}, "recv_by_round": {}}
    pool.update({k: [] for k in ("encode_s", "decode_s", "network_s", "wait_s")})
    for s in _site_dirs(run_dir):
        lines = _lines(run_dir, s)
        start = next((d for d in lines if d.get("event") == "start"), None)
        rounds = [d for d in lines if d.get("event") == "round"]
        times = ([start["time"]] if start else []) + [d["time"] for d in rounds]
        deltas = [b - a for a, b in zip(times, times[1:])][1:]  # drop the warm-up round
        pool["walls"] += deltas
        pool["overheads"] += [w - d["inner_s"] for w, d in zip(deltas, rounds[1:])]
        pool["syncs"] += [d["sync_s"] for d in rounds[1:]]
        pool["inners"] += [d["inner_s"] for d in rounds[1:]]
        for k in ("encode_s", "decode_s", "network_s", "wait_s"):
            pool[k] += [d[k] for d in rounds[1:] if k in d]
        for d in rounds:
            pool["sent_by_round"][d["round"]] = pool["sent_by_round"].get(d["round"], 0) + int(d.get("bytes_sent", 0))
            pool["recv_by_round"][d["round"]] = pool["recv_by_round"].get(d["round"], 0) + int(
                d.get("bytes_received", 0)
            )
        proc = rec.procs.get(s, {})
        summ_path = run_dir / s / "summary.json"
        sites[s] = {
            "rounds_logged": len(rounds),
            "rounds_applied": sum(_applied(spec.system, d) for d in rounds),
            "first_val_loss": start["val_loss"] if start else None,
            "final_val_loss": rounds[-1]["val_loss"] if rounds else None,
            "final_checksum": rounds[-1].get("checksum") if rounds else None,
            "finished": summ_path.exists(),
            "rc": proc.get("rc"),
            "peak_rss_mb": proc["maxrss_kb"] / 1024 if proc.get("maxrss_kb") else None,
            "cpu_s": proc.get("cpu_s"),
            "inner_steps": (
                rounds[-1].get("inner_steps") if spec.system == "dtrain" and rounds else len(rounds) * spec.sync_every
            ),
        }
    return sites, pool


def run_stats(recs: list) -> dict:
    """Everything the runs of one (system, scenario) say, repeats pooled (see the module
    docstring for the definitions). Per-site details are those of the first run."""
    rec = recs[0]
    spec = rec.spec
    per_run = [_site_stats(r) for r in recs]
    sites = per_run[0][0]
    pool = {k: [x for _, p in per_run for x in p[k]] for k in per_run[0][1] if isinstance(per_run[0][1][k], list)}
    # Every payload byte is counted by its receiver in the receiver's next round line:
    # pulls happen inside the puller's round, pushes reach an owner during its round or
    # before it (counted since the previous line), state pulls of a resync land in the
    # next line. The sender's count misses what an owner serves after its last line.
    # So: everything all sites received over the run, divided by the rounds.
    wire = [sum(p["recv_by_round"].values()) / spec.rounds for _, p in per_run if p["recv_by_round"]]
    finished = {s: v for s, v in sites.items() if v["finished"]}
    finals = [v["final_val_loss"] for v in finished.values() if v["final_val_loss"] is not None]
    coords = [
        v["maxrss_kb"] / 1024
        for r in recs
        for v in r.procs.values()
        if v.get("role") == "coordinator" and v.get("maxrss_kb")
    ]
    rss = [v["peak_rss_mb"] for st, _ in per_run for s, v in st.items() if v["peak_rss_mb"] and s != KILLED]
    cpu = [v["cpu_s"] for st, _ in per_run for s, v in st.items() if v.get("cpu_s") and s != KILLED]
    st = {
        "system": spec.system,
        "scenario": spec.scenario,
        "sites": spec.sites,
        "rounds": spec.rounds,
        "codec": spec.codec if spec.system == "dtrain" else "fp32 (all-reduce)",
        "repeats": len(recs),
        "error": "; ".join(r.error for r in recs if r.error) or None,
        "timed_out": any(r.timed_out for r in recs),
        "netem_backends": rec.netem_backends,
        "round_wall_s": _stats(pool["walls"]),
        "overhead_s": _stats(pool["overheads"]),
        "sync_s": _stats(pool["syncs"]),
        "inner_s": _stats(pool["inners"]),
        "sync_split_median_s": {
            k: (statistics.median(pool[k]) if pool[k] else None)
            for k in ("encode_s", "decode_s", "network_s", "wait_s")
        },
        "final_val_loss_mean": statistics.mean(finals) if finals else None,
        "final_val_loss": {s: v["final_val_loss"] for s, v in finished.items()},
        "final_val_loss_repeats": [
            statistics.mean([v["final_val_loss"] for v in st.values() if v["finished"]] or [float("nan")])
            for st, _ in per_run
        ],
        "checksums_agree": len({v["final_checksum"] for v in finished.values()}) == 1 and len(finished) > 0,
        "not_applied": {
            s: v["rounds_logged"] - v["rounds_applied"]
            for s, v in sites.items()
            if v["rounds_logged"] > v["rounds_applied"]
        },
        "bytes_per_round_total": statistics.mean(wire) if wire else None,
        "peak_rss_mb_max": max(rss) if rss else None,
        "peak_rss_mb_mean": statistics.mean(rss) if rss else None,
        "cpu_s_per_site_mean": statistics.mean(cpu) if cpu else None,
        "coordinator_rss_mb": max(coords) if coords else None,
        "wall_total_s": statistics.median(
            [x for x in (_last_round_s(r) for r in recs) if x is not None] or [float("nan")]
        ),
        "sites_detail": sites,
    }
    if spec.kill_round >= 0:
        st["fault"] = fault_stats(rec, sites)
    return st


def fault_stats(rec, sites: dict) -> dict:
    """What the kill and the restart cost (see vs_torchft.py, scenario 2)."""
    spec = rec.spec
    run_dir = Path(rec.dir)
    surv = [s for s in sites if s not in (KILLED, RESTART)]
    per = {}
    stall = (0.0, None, None)
    full_buckets = 0
    for s in surv:
        rounds = [d for d in _lines(run_dir, s) if d.get("event") == "round"]
        full_buckets = max([full_buckets] + [int(d.get("applied_buckets", 0)) for d in rounds])
        for d in rounds:
            if d["sync_s"] > stall[0]:
                stall = (d["sync_s"], s, d["round"])
        per[s] = rounds
    out_surv = {}
    for s, rounds in per.items():
        discarded = [d["round"] for d in rounds if not _applied(spec.system, d)]
        partial = (
            [d["round"] for d in rounds if _applied(spec.system, d) and int(d.get("applied_buckets", 0)) < full_buckets]
            if spec.system == "dtrain"
            else []
        )
        # Time the fault cost this survivor: whole discarded attempts (inner work + sync),
        # plus every sync beyond this run's typical one (median over its rounds).
        typical = statistics.median([d["sync_s"] for d in rounds]) if rounds else 0.0
        lost = sum(d["inner_s"] + d["sync_s"] for d in rounds if not _applied(spec.system, d))
        lost += sum(max(0.0, d["sync_s"] - typical) for d in rounds if _applied(spec.system, d))
        out_surv[s] = {
            "attempts": len(rounds),
            "discarded_rounds": discarded,
            "partial_rounds": partial,
            "inner_steps": sites[s]["inner_steps"],
            "time_lost_s": round(lost, 2),
        }
    restart = [d for d in _lines(run_dir, RESTART) if d.get("event") == "round"]
    restart_start = next((d for d in _lines(run_dir, RESTART) if d.get("event") == "start"), None)
    killed_rounds = [d for d in _lines(run_dir, KILLED) if d.get("event") == "round"]
    took_part = sum(_applied(spec.system, d) for d in killed_rounds) + sum(_applied(spec.system, d) for d in restart)
    return {
        "kill_round": spec.kill_round,
        "restart_when_survivor_finished_round": spec.kill_round + spec.restart_after - 1,
        "survivors": out_surv,
        "longest_stall_s": stall[0],
        "longest_stall_at": f"{stall[1]} round {stall[2]}",
        "killed_site_rounds_before_kill": len(killed_rounds),
        # torchft's "round" is the site's own attempt counter; its outer step is "step" (after the attempt)
        "restart_first_round": (
            None
            if not restart
            else restart[0]["round"]
            if spec.system == "dtrain"
            else restart[0]["step"] - int(bool(restart[0].get("committed")))
        ),
        "restart_first_status": restart[0].get("status") if restart else None,
        "restart_start_line_s": (restart_start["time"] - rec.t_restart) if restart_start and rec.t_restart else None,
        "rejoin_s": (restart[0]["time"] - rec.t_restart) if restart and rec.t_restart else None,
        "site1_rounds_taken_part": took_part,
        "site1_rounds_missed": spec.rounds - took_part,
        "t_kill_s": rec.t_kill - rec.t_go if rec.t_kill else None,
        "t_restart_s": rec.t_restart - rec.t_go if rec.t_restart else None,
    }


def _last_round_s(rec) -> float | None:
    """Seconds from the go signal to the last round line of any site (exit linger excluded)."""
    ts = [d["time"] for s in _site_dirs(Path(rec.dir)) for d in _lines(Path(rec.dir), s) if d.get("event") == "round"]
    return max(ts) - rec.t_go if ts and rec.t_go else None


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def analyse(records, *, mode: dict, mode_name: str, command: str, notes: list[str]) -> dict:
    profile = None
    for r in records:
        spy = Path(r.dir) / "pyspy-site-0.txt"
        if r.spec.scenario == "profile" and spy.exists():
            profile = pyspy_summary(spy)
            profile["file"] = str(spy)
            profile["command"] = getattr(r, "command", "")
    records = [r for r in records if r.spec.scenario != "profile"]
    groups: dict[str, list] = {}
    for r in records:
        groups.setdefault(f"{r.spec.system}/{r.spec.scenario}", []).append(r)
    runs = {k: run_stats(v) for k, v in groups.items()}
    comps = {}
    for scen in sorted({r.spec.scenario for r in records}):
        d, t = runs.get(f"dtrain/{scen}"), runs.get(f"torchft/{scen}")
        if not d or not t:
            continue
        c = {
            "round_wall_median": _ratio(d["round_wall_s"]["median"], t["round_wall_s"]["median"]),
            "overhead_median": _ratio(d["overhead_s"]["median"], t["overhead_s"]["median"]),
            "final_val_loss_mean": _ratio(d["final_val_loss_mean"], t["final_val_loss_mean"]),
            "bytes_per_round": _ratio(d["bytes_per_round_total"], t["bytes_per_round_total"]),
            "peak_rss_max": _ratio(d["peak_rss_mb_max"], t["peak_rss_mb_max"]),
        }
        if scen in ("healthy", "concurrent"):
            c["targets"] = {
                "round wall time dtrain <= torchft": c["round_wall_median"] is not None
                and c["round_wall_median"] <= 1.0,
                "final loss within 1%": c["final_val_loss_mean"] is not None
                and abs(c["final_val_loss_mean"] - 1) <= 0.01,
                "bytes <= 1/4": c["bytes_per_round"] is not None and c["bytes_per_round"] <= 0.25,
            }
        comps[scen] = c
    commands = []
    for r in sorted(records, key=lambda r: r.t_go):
        if getattr(r, "command", "") and r.command not in commands:
            commands.append(r.command)
    if profile is not None and profile.get("command") and profile["command"] not in commands:
        commands.append(profile["command"])
    return {
        "mode_name": mode_name,
        "mode": mode,
        "command": command,
        "commands": commands or [command],
        "notes": notes,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_1min_at_run_ends": [getattr(r, "loadavg_end", None) for r in records],
        },
        "runs": runs,
        "comparisons": comps,
        "profile": profile,
    }


# ----------------------------------------------------------------------------- outputs
def _f(v, fmt="{:.3f}"):
    return "-" if v is None else fmt.format(v)


def _table(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


UNEQUAL = [
    "Wire format: dtrain sends its default int8 codec (1 byte per value plus an fp32 scale per block) of the "
    "pseudo-gradient to each bucket's owner and pulls int8 means; torchft all-reduces fp32 (its `should_quantize` "
    "path needs triton/CUDA, not available on CPU). That is the point of the bytes target, but it also means the "
    "two systems do not apply bit-identical updates, so their losses differ slightly even when nothing fails.",
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
    "Shared machine: 2 vCPUs shared with other work. The healthy runs are sequential (AB BA), so background load "
    "can differ between the systems; the concurrent run gives "
    "both the same load but makes them share the CPUs.",
]


def _load_text(loads: list) -> str:
    xs = [x for x in loads if x is not None]
    if not xs:
        return "load average not recorded"
    some = f" (recorded for {len(xs)} of {len(loads)} runs)" if len(xs) < len(loads) else ""
    return f"1-minute load average at the end of the runs {min(xs):.1f}-{max(xs):.1f}{some}"


def report_md(res: dict) -> str:
    """The RESULTS.md section of a comparison: setup, one table per scenario, the fault table,
    the profile, what could not be made equal, notes."""
    m = res["mode"]
    lines = [
        f"## dtrain vs torchft 0.2.0 DiLoCo — `{res['mode_name']}`",
        "",
        f"Run {res['date']}.",
        "",
        "Command"
        + ("s" if len(res.get("commands", [])) > 1 else "")
        + ": "
        + "; ".join(f"`{c}`" for c in res.get("commands", [res["command"]])),
        "",
        f"Setup: {m['sites']} sites, built-in task `{m['size']}`, H = {m['sync_every']} inner steps, "
        f"{m['rounds']} rounds (fault: {m['fault_rounds']}), 1 torch thread per site, loopback unless netem; "
        f"machine: {res['machine']['cpus']} CPUs, "
        + _load_text(res["machine"].get("loadavg_1min_at_run_ends") or [])
        + ".",
        "",
    ]
    runs, comps = res["runs"], res["comparisons"]
    for scen in [s for s in ("healthy", "concurrent") if s in comps] + sorted(
        s for s in comps if s.startswith("netem")
    ):
        lines += _scenario_section(scen, runs, comps[scen])
    if "fault" in comps:
        lines += _fault_section(runs)
    prof = res.get("profile")
    if prof:
        rows = [["where dtrain site-0's CPU time goes (py-spy, active threads)", "share of samples"]]
        rows += [[k, f"{v:.1%}"] for k, v in prof["categories"].items()]
        leaves = [["top frames (self time)", "share"]] + [[f"`{k[:110]}`", f"{v:.1%}"] for k, v in prof["top_leaves"]]
        lines += [
            "### Profile of dtrain (healthy run, site-0)",
            "",
            f"{prof['samples']} samples at 100 Hz; raw file `{Path(prof['file']).name}`.",
            "",
            _table(rows),
            "",
            _table(leaves),
            "",
        ]
    lines += ["### What could not be made equal", ""] + [f"- {u}" for u in UNEQUAL] + [""]
    if res["notes"]:
        lines += ["### Notes", ""] + [f"- {n}" for n in res["notes"]] + [""]
    lines += [
        f"Outputs: `rounds.csv`, `summary.csv`, `results.json`, `loss_vs_wall.png` in `{res.get('out_dir', '--out')}`.",
        "",
    ]
    return "\n".join(lines)


def _scenario_rows(scen: str, runs: dict, c: dict) -> list[list[str]]:
    """The table of one scenario: a metric per row, dtrain, torchft, their ratio."""
    d, t = runs[f"dtrain/{scen}"], runs[f"torchft/{scen}"]
    rows = [["metric", "dtrain", "torchft", "dtrain / torchft"]]
    rows.append(
        [
            "round wall time median [min, max] (s)",
            f"{_f(d['round_wall_s']['median'])} [{_f(d['round_wall_s']['min'])}, {_f(d['round_wall_s']['max'])}]",
            f"{_f(t['round_wall_s']['median'])} [{_f(t['round_wall_s']['min'])}, {_f(t['round_wall_s']['max'])}]",
            _f(c["round_wall_median"]),
        ]
    )
    rows.append(
        [
            "per-round overhead = round wall - inner phase, median (s)",
            _f(d["overhead_s"]["median"]),
            _f(t["overhead_s"]["median"]),
            _f(c["overhead_median"]),
        ]
    )
    rows.append(
        [
            "sync time median / max (s)",
            f"{_f(d['sync_s']['median'])} / {_f(d['sync_s']['max'])}",
            f"{_f(t['sync_s']['median'])} / {_f(t['sync_s']['max'])}",
            _f(_ratio(d["sync_s"]["median"], t["sync_s"]["median"])),
        ]
    )
    rows.append(
        [
            "inner phase median (s)",
            _f(d["inner_s"]["median"]),
            _f(t["inner_s"]["median"]),
            _f(_ratio(d["inner_s"]["median"], t["inner_s"]["median"])),
        ]
    )
    rows.append(
        [
            "final val loss, mean of sites",
            _f(d["final_val_loss_mean"], "{:.4f}"),
            _f(t["final_val_loss_mean"], "{:.4f}"),
            _f(c["final_val_loss_mean"], "{:.4f}"),
        ]
    )
    for s in sorted(set(d["final_val_loss"]) | set(t["final_val_loss"])):
        rows.append(
            [
                f"final val loss {s}",
                _f(d["final_val_loss"].get(s), "{:.4f}"),
                _f(t["final_val_loss"].get(s), "{:.4f}"),
                "",
            ]
        )
    rows += _resource_rows(d, t, c)
    if scen == "healthy":
        rows += _codec_rows(runs, t)
    return rows


def _resource_rows(d: dict, t: dict, c: dict) -> list[list[str]]:
    """A scenario table's rows after the losses: bytes, memory, CPU, agreement, rounds not applied, time."""
    rows: list[list[str]] = []
    rows.append(
        [
            "bytes on the wire per round, all sites",
            _f(d["bytes_per_round_total"], "{:,.0f}"),
            _f(t["bytes_per_round_total"], "{:,.0f}"),
            _f(c["bytes_per_round"]),
        ]
    )
    rows.append(
        [
            "peak RSS per site process, max / mean (MB)",
            f"{_f(d['peak_rss_mb_max'], '{:.0f}')} / {_f(d['peak_rss_mb_mean'], '{:.0f}')}",
            f"{_f(t['peak_rss_mb_max'], '{:.0f}')} / {_f(t['peak_rss_mb_mean'], '{:.0f}')}",
            _f(c["peak_rss_max"]),
        ]
    )
    rows.append(
        [
            "CPU seconds per site process (whole life, mean)",
            _f(d["cpu_s_per_site_mean"], "{:.1f}"),
            _f(t["cpu_s_per_site_mean"], "{:.1f}"),
            _f(_ratio(d["cpu_s_per_site_mean"], t["cpu_s_per_site_mean"])),
        ]
    )
    rows.append(
        [
            "coordinator peak RSS (MB) (rendezvous / lighthouse)",
            _f(d["coordinator_rss_mb"], "{:.0f}"),
            _f(t["coordinator_rss_mb"], "{:.0f}"),
            "",
        ]
    )
    rows.append(["replicas agree at the end (checksum)", str(d["checksums_agree"]), str(t["checksums_agree"]), ""])
    rows.append(
        [
            "round lines not applied (dtrain: resynced/deferred; torchft: not committed)",
            ", ".join(f"{k}: {v}" for k, v in d["not_applied"].items()) or "none",
            ", ".join(f"{k}: {v}" for k, v in t["not_applied"].items()) or "none",
            "",
        ]
    )
    rows.append(
        [
            "time from go to the last round (s)",
            _f(d["wall_total_s"], "{:.1f}"),
            _f(t["wall_total_s"], "{:.1f}"),
            _f(_ratio(d["wall_total_s"], t["wall_total_s"])),
        ]
    )
    return rows


def _codec_rows(runs: dict, t: dict) -> list[list[str]]:
    """The healthy table's extra dtrain runs with other codecs, against torchft's healthy run."""
    rows: list[list[str]] = []
    for key, x in sorted(runs.items()):
        if key.startswith("dtrain/healthy codec="):
            codec = key.split("=", 1)[1]
            rows.append(
                [
                    f"with codec {codec}: bytes per round / round wall median (s) / final val loss",
                    f"{_f(x['bytes_per_round_total'], '{:,.0f}')} / {_f(x['round_wall_s']['median'])} / "
                    f"{_f(x['final_val_loss_mean'], '{:.4f}')}",
                    "",
                    f"{_f(_ratio(x['bytes_per_round_total'], t['bytes_per_round_total']))} / "
                    f"{_f(_ratio(x['round_wall_s']['median'], t['round_wall_s']['median']))} / "
                    f"{_f(_ratio(x['final_val_loss_mean'], t['final_val_loss_mean']), '{:.4f}')}",
                ]
            )
    return rows


def _scenario_section(scen: str, runs: dict, c: dict) -> list[str]:
    """One scenario's heading, table, dtrain's sync split, targets and problems."""
    d, t = runs[f"dtrain/{scen}"], runs[f"torchft/{scen}"]
    rows = _scenario_rows(scen, runs, c)
    sp = d["sync_split_median_s"]
    title = {
        "healthy": "healthy (loopback; the systems one after the other, repeats in AB BA order)",
        "concurrent": "concurrent (loopback; both systems' healthy runs at the same time, same background load)",
    }
    lines = [
        f"### {title.get(scen, scen)}",
        "",
        _table(rows),
        "",
        f"dtrain's sync split (median s per round): encode {_f(sp['encode_s'])}, decode {_f(sp['decode_s'])}, "
        f"network {_f(sp['network_s'])}, wait {_f(sp['wait_s'])}.",
    ]
    if d.get("netem_backends"):
        lines.append(f"netem backends: {d['netem_backends']}")
    if "targets" in c:
        lines += _target_notes(runs, d, t, c)
    for r in (d, t):
        if r["error"]:
            lines.append(f"\n{r['system']} {scen}: problem: {r['error']}")
    lines.append("")
    return lines


def _target_notes(runs: dict, d: dict, t: dict, c: dict) -> list[str]:
    """The targets met or missed, and what explains a missed wall-time or bytes target."""
    lines = [""]
    lines.append("Targets: " + "; ".join(f"{k}: **{'met' if v else 'MISSED'}**" for k, v in c["targets"].items()) + ".")
    if not c["targets"]["round wall time dtrain <= torchft"]:
        share = _ratio(t["inner_s"]["median"], t["round_wall_s"]["median"])
        lines.append(
            f"Wall time: the inner phase (the same code in both systems: same model, batches, AdamW, 1 thread) "
            f"is {_f(share, '{:.0%}')} of torchft's round; dtrain's inner phase took "
            f"{_f(_ratio(d['inner_s']['median'], t['inner_s']['median']))}x torchft's while each dtrain site used "
            f"{_f(_ratio(d['cpu_s_per_site_mean'], t['cpu_s_per_site_mean']))}x the CPU seconds. The part of a "
            f"round each system adds (round wall - inner phase) is {_f(c['overhead_median'])}x torchft's. See the "
            f"concurrent table (same background load for both) and the profile for whether the gap is dtrain's."
        )
    if not c["targets"]["bytes <= 1/4"]:
        ok = [
            k.split("=", 1)[1]
            for k, x in runs.items()
            if k.startswith("dtrain/healthy codec=")
            and (_ratio(x["bytes_per_round_total"], t["bytes_per_round_total"]) or 1) <= 0.25
        ]
        lines.append(
            f"Bytes: the `{d.get('codec', 'int8')}` codec carries one fp32 scale per block of values on "
            f"top of 1 byte per value, so it lands just above 1/4 of fp32 "
            f"({_f(c['bytes_per_round'])}); "
            + (f"{', '.join(ok)} meet(s) it (healthy table)." if ok else "no other codec was run.")
        )
    return lines


def _fault_section(runs: dict) -> list[str]:
    """The fault scenario's table: what a SIGKILL and a restart cost each system."""
    lines: list[str] = []
    d, t = runs["dtrain/fault"], runs["torchft/fault"]
    df, tf = d["fault"], t["fault"]
    rows = [
        [
            "fault: site-1 SIGKILLed in round 3 (admitted, nothing sent), restarted after round 4",
            "dtrain",
            "torchft",
        ]
    ]

    def surv(f, key, fmt=lambda v: str(v)):
        return "; ".join(f"{s}: {fmt(v[key])}" for s, v in f["survivors"].items())

    rows += [
        [
            "rounds discarded at survivors (inner work thrown away)",
            surv(df, "discarded_rounds"),
            surv(tf, "discarded_rounds"),
        ],
        ["rounds applied without some buckets at survivors", surv(df, "partial_rounds"), "n/a (all-or-nothing)"],
        ["sync attempts at survivors", surv(df, "attempts"), surv(tf, "attempts")],
        ["inner steps at survivors", surv(df, "inner_steps"), surv(tf, "inner_steps")],
        [
            "time the fault cost a survivor (s): discarded attempts + syncs beyond the median",
            surv(df, "time_lost_s"),
            surv(tf, "time_lost_s"),
        ],
        [
            "longest stall a survivor saw (s)",
            f"{_f(df['longest_stall_s'], '{:.2f}')} ({df['longest_stall_at']})",
            f"{_f(tf['longest_stall_s'], '{:.2f}')} ({tf['longest_stall_at']})",
        ],
        [
            "restarted site: go -> start line / first round (s)",
            f"{_f(df['restart_start_line_s'], '{:.1f}')} / {_f(df['rejoin_s'], '{:.1f}')}",
            f"{_f(tf['restart_start_line_s'], '{:.1f}')} / {_f(tf['rejoin_s'], '{:.1f}')}",
        ],
        [
            "restarted site's first round (status)",
            f"{df['restart_first_round']} ({df['restart_first_status']})",
            f"{tf['restart_first_round']} ({tf['restart_first_status']})",
        ],
        [
            "rounds site-1 took part in / missed",
            f"{df['site1_rounds_taken_part']} / {df['site1_rounds_missed']}",
            f"{tf['site1_rounds_taken_part']} / {tf['site1_rounds_missed']}",
        ],
        [
            "final val loss, mean of finished sites",
            _f(d["final_val_loss_mean"], "{:.4f}"),
            _f(t["final_val_loss_mean"], "{:.4f}"),
        ],
    ]
    for s in sorted(set(d["final_val_loss"]) | set(t["final_val_loss"])):
        rows.append(
            [
                f"final val loss {s}",
                _f(d["final_val_loss"].get(s), "{:.4f}"),
                _f(t["final_val_loss"].get(s), "{:.4f}"),
            ]
        )
    rows.append(["replicas agree at the end (checksum)", str(d["checksums_agree"]), str(t["checksums_agree"])])
    rows.append(
        ["time from go to the last round (s)", _f(d["wall_total_s"], "{:.1f}"), _f(t["wall_total_s"], "{:.1f}")]
    )
    lines += ["### fault", "", _table(rows), ""]
    for r in (d, t):
        if r["error"]:
            lines.append(f"{r['system']} fault: problem: {r['error']}\n")
    return lines


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
    from collections import Counter  # noqa: PLC0415

    cats: Counter = Counter()
    leaves: Counter = Counter()
    total = 0
    for line in Path(path).read_text(errors="replace").splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        frames = stack.split(";")
        joined = ";".join(frames)
        cat = next((name for name, keys in _PROFILE_CATEGORIES if any(k in joined for k in keys)), "other")
        cats[cat] += int(n)
        leaves[frames[-1]] += int(n)
    return {
        "samples": total,
        "categories": {k: v / total for k, v in cats.most_common()} if total else {},
        "top_leaves": [(k, v / total) for k, v in leaves.most_common(top)] if total else [],
    }
