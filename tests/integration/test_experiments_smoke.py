"""The lab's smokes, so that no experiment rots: every spec (``python -m experiments run NAME
--mode smoke``), each in this process with its output and its RESULTS.md redirected to a
temporary directory.

A smoke checks the pipeline, never a measurement: it runs, writes one CSV row per run with
the documented columns, the numbers it reports are finite and in range, its plots exist and
its RESULTS.md section is there once, stamped with the command that produced it. A verdict
is a measurement (one seed's noise can flip it), so no smoke asserts one.
"""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path

import pytest

from experiments import lab
from experiments.common import read_rows, update_results

# The columns every per-run CSV has (issue 6: configuration, seed, final validation
# loss, rounds, wall time, bytes, sync seconds, stale buckets, rejected contributions).
RUN_COLUMNS = {
    "experiment",
    "config",
    "seed",
    "num_sites",
    "sync_every",
    "codec",
    "final_val_loss",
    "first_val_loss",
    "rounds_done",
    "wall_s",
    "bytes_total",
    "bytes_per_round_site",
    "sync_s",
    "stale_buckets",
    "rejected",
}

# Specs with their own ``execute`` whose rows are in-process DiLoCo (and DDP) run rows all the same.
RUN_ROWS = {"convergence"}

# Specs whose smoke is a test of its own: what it checks is the system under faults, not the pipeline.
SMOKED_ELSEWHERE = {"chaos": "tests/fault/test_chaos_smoke.py", "vs_torchft": "test_vs_torchft_smoke (below)"}
# The specs that run on this host; those through emulated links (root) have their smokes in tests/netem/.
LOCAL_SPECS = [n for n in lab.SPECS if not lab.load_spec(n).netem and n not in SMOKED_ELSEWHERE]
# A spec's smoke time limit where 120 s is not enough under load (s).
# (at load average 60 convergence took 217 s)
SPEC_TIMEOUT_S = {"diloco_sanity": 180, "site_failures": 240, "datagram_val_loss": 300, "convergence": 420}


def _pipeline_checks(md: str, title: str, out: Path) -> None:
    """The section is there once with its command, and every plot it names exists."""
    assert md.count(f"## {title}") == 1, md[:2000]
    assert re.search(r"`\.venv/bin/python -m experiments[ .]", md), md[:2000]
    section = md.split(f"## {title}", 1)[1]
    for png in re.findall(r"`([\w.-]+\.png)`", section):
        assert (out / png).stat().st_size > 5000, png


def _run_spec(name: str, tmp_path: Path) -> None:
    spec = lab.load_spec(name)
    results = tmp_path / "RESULTS.md"
    rows, _ = lab.run(
        spec, "smoke", out=tmp_path, results=str(results), command=f".venv/bin/python -m experiments run {name}"
    )
    written = read_rows(tmp_path / f"{name}_smoke.csv")  # the CSV keeps 6 significant digits
    metric = spec.metrics[0][0]
    assert [r[metric] for r in written] == pytest.approx([r[metric] for r in rows], rel=1e-5)
    first = [(p.config, p.seed) for p in spec.points(spec.settings("smoke"))]  # a phased spec: its first phase
    assert [(r["config"], r["seed"]) for r in rows][: len(first)] == first and (spec.phases or len(rows) == len(first))
    for r in rows:  # an in-process DiLoCo run reports every documented column; any other its metrics
        need = RUN_COLUMNS if spec.execute is lab.run_point or name in RUN_ROWS else {"experiment", "config", "seed"}
        assert need <= set(r), need - set(r)
        assert r["experiment"] == name and r.get("rounds_done", 1) >= 1 and r.get("wall_s", 1) > 0
    assert lab.check_rows(spec, rows) == []
    md = results.read_text()
    _pipeline_checks(md, f"{spec.title} (smoke)", tmp_path)
    assert "Commit `" in md and "load average" in md  # the stamp
    # --replot: nothing runs, the same CSV gives the same section, in place
    csv_before = (tmp_path / f"{name}_smoke.csv").read_text()
    lab.run(spec, "smoke", out=tmp_path, results=str(results), replot=True)
    assert (tmp_path / f"{name}_smoke.csv").read_text() == csv_before
    assert results.read_text().count(f"## {spec.title} (smoke)") == 1


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.timeout(SPEC_TIMEOUT_S.get(n, 120))) for n in LOCAL_SPECS],
)
def test_smoke(name: str, tmp_path: Path) -> None:
    """Each experiment in its smallest mode: it runs and its outputs are whole (see the module doc)."""
    _run_spec(name, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vs_torchft_smoke(tmp_path: Path) -> None:
    """The torchft comparison's smoke (2 sites, tiny, H = 5, 4 rounds, healthy only, both systems as
    processes on 127.0.0.1), and the figures its tables rest on. torchft is no dtrain dependency and
    CI does not install it: skipped (naming the install command) where torchft 0.2.x does not import."""
    from experiments import vs_torchft
    from experiments.vs_torchft_analysis import analyse

    why = vs_torchft.torchft_problem()
    if why:
        pytest.skip(f"{why}; to run this test: {vs_torchft.INSTALL_HINT}")
    rounds_n, sites = 4, 2
    _run_spec("vs_torchft", tmp_path)
    rows = read_rows(tmp_path / "vs_torchft_smoke.csv")
    lines = read_rows(tmp_path / "vs_torchft_smoke_rounds.csv")
    assert [r["vs.system"] for r in rows] == ["dtrain", "torchft"]
    for r in rows:
        assert not r["error"] and not r["timed_out"] and r["checksums_agree"], r
        ends = [d for d in lines if d["run"] == r["run"] and d["event"] == "exit" and d["role"] == "site"]
        assert [d["site"] for d in ends] == [f"site-{i}" for i in range(sites)] and all(d["rc"] == 0 for d in ends)
        assert all(50 < d["maxrss_kb"] / 1024 < 4000 and d["maxrss_source"] == "VmHWM" for d in ends), ends
        for i in range(sites):
            mine = [d for d in lines if d["run"] == r["run"] and d["site"] == f"site-{i}"]
            done = [d for d in mine if d["event"] == "round" and d["status"] == "applied"]
            assert len(done) == rounds_n and done[-1]["val_loss"] < mine[0]["val_loss"] - 0.5, (r["run"], i)
    res = analyse(rows, lines)
    d, t = res["runs"]["dtrain/healthy"], res["runs"]["torchft/healthy"]
    assert d["round_wall_s"]["n"] == t["round_wall_s"]["n"] == sites * (rounds_n - 1)  # warm-up round excluded
    # torchft's bytes are the ring all-reduce of the fp32 parameters: 2 (n-1)/n x P x 4 per site.
    params = next(x["params"] for x in lines if x["event"] == "start")
    assert t["bytes_per_round_total"] == sites * round(2 * (sites - 1) / sites * params * 4)
    # dtrain sends int8 (+ per-block scales) both ways: a little over 1/4 of torchft's fp32.
    assert 0.24 < res["comparisons"]["healthy"]["bytes_per_round"] < 0.30
    # Same task, same start, same optimizers: the final losses agree closely.
    assert abs(res["comparisons"]["healthy"]["final_val_loss_mean"] - 1) < 0.02


@pytest.mark.timeout(60)
def test_every_spec_declares_known_paths_and_every_mode() -> None:
    """A spec's settings are config-tree paths the runner knows, in every mode; each knows its metrics."""
    for name in lab.SPECS:
        spec = lab.load_spec(name)
        for mode in lab.MODES:
            runs = spec.points(spec.settings(mode))
            assert runs and len({(r.config, r.seed) for r in runs}) == len(runs), (name, mode)
        assert spec.metrics and all(lo < hi for _, lo, hi in spec.metrics)
    with pytest.raises(ValueError, match=r"unknown config paths \['diloco.no_such'\]"):
        lab.Spec(
            name="x",
            title="x",
            modes={m: {"seeds": [0]} for m in lab.MODES},
            grid={"diloco.no_such": [1]},
            label=str,
            metrics=(),
            report=lambda *a: "",
            verdict=lambda *a: [],
        )


def test_check_rows_names_what_is_out_of_range() -> None:
    spec = lab.load_spec("codec_sweep")
    good = {"config": "fp32", "seed": 0, "final_val_loss": 3.0, "bytes_per_round_site": 1e5, "bench_rel_err": 0.0}
    assert lab.check_rows(spec, [good]) == []
    bad = lab.check_rows(spec, [{**good, "final_val_loss": float("nan"), "bench_rel_err": 2.0}])
    assert bad == [
        "fp32 seed 0: final_val_loss = nan, not in [0.0, 10.0]",
        "fp32 seed 0: bench_rel_err = 2.0, not in [0.0, 1.0]",
    ]


@pytest.mark.timeout(10)
def test_update_results_replaces_own_section_only(tmp_path: Path) -> None:
    p = tmp_path / "RESULTS.md"
    p.write_text("# Experiment results\n\n## Someone else's section\n\nkeep me\n")
    update_results(p, "x-quick", "X (quick)", "first")
    update_results(p, "y-quick", "Y (quick)", "other")
    update_results(p, "x-quick", "X (quick)", "second")
    text = p.read_text()
    assert "keep me" in text and "other" in text and "second" in text and "first" not in text
    assert text.count("## X (quick)") == 1
    assert text.index("## Someone else's section") < text.index("## X (quick)") < text.index("## Y (quick)")
    # a section whose begin marker another writer cut off is replaced, not duplicated
    p.write_text(text.replace("<!-- begin x-quick -->\n", ""))
    update_results(p, "x-quick", "X (quick)", "third")
    text = p.read_text()
    assert text.count("## X (quick)") == 1 and "third" in text and "second" not in text and "other" in text
    # the index at the top: a line per section, linked, with what its stamp names
    update_results(p, "z-quick", "Z (quick)", "Commit `abc1234+dirty`, 2026-12-03 07:00 UTC, command `x`.\n\n- **met**")
    text = p.read_text()
    assert text.count("<!-- begin index -->") == 1 and text.index("## Summary") < text.index("## Someone else's")
    assert "| [X (quick)](#x-quick) | **no stamp** |  |" in text
    assert "| [Z (quick)](#z-quick) | commit `abc1234+dirty`, 2026-12-03 | **met** |" in text
    # the headline: a section's "Headline:" line, else its first verdict line, else its first bold verdict
    update_results(p, "h-quick", "H (quick)", "Commit `abc1234`, 2026-12-03.\n\nHeadline: 3.2x\n\n- **met**")
    update_results(p, "b-quick", "B (quick)", "Commit `abc1234`, 2026-12-03.\n\n| a |\nTarget: **missed by 2x**.")
    text = p.read_text()
    assert "| [H (quick)](#h-quick) | commit `abc1234`, 2026-12-03 | 3.2x |" in text
    assert "| [B (quick)](#b-quick) | commit `abc1234`, 2026-12-03 | Target: **missed by 2x**. |" in text


@pytest.mark.timeout(30)
def test_site_failures_report_from_rows(tmp_path: Path) -> None:
    """The table, verdicts and plot of site_failures for every scenario (the smoke run
    below covers two), on hand-made rows."""
    sf = importlib.import_module("experiments.site_failures")
    base = dict(
        experiment="site_failures",
        seed=0,
        final_val_loss=2.9,
        rounds_lost=0,
        rounds_missed_before_fault=0,
        max_round_s=1.0,
        max_beyond_deadline_s=0.0,
        max_quorum_wait_s=0.4,
        wall_s=20.0,
        stale_buckets=0,
        skipped_buckets=0,
        rejected=0,
        survivors_consistent=True,
        restarted_first_round=-1,
    )
    rows = [
        dict(base, config=sf.NO_FAULT),
        dict(base, config=sf.RESTART, final_val_loss=2.95, restarted_first_round=7),
        dict(base, config=sf.OWNER, skipped_buckets=2),
        dict(base, config=sf.TWO, rounds_lost=1, max_beyond_deadline_s=1.5),
    ]
    md, verdicts = sf.analyse(rows)
    assert "| kill 1, restart | 1 | 2.9500 ± 0.0000 | +0.0500 ± 0.0000 | 0 | 0 | 1.00 | 0.00 |" in md
    assert any("kill 1, restart: rounds lost 0 (target none: **met**)" in v and "from round 7" in v for v in verdicts)
    assert any(
        "kill 2 at once: rounds lost 1 (target none: **NOT met**)" in v and "< 1 s: **NOT met**" in v for v in verdicts
    )
    rounds = [
        dict(config=c, seed=0, round=r, status="applied", val_loss=3.0 - 0.01 * r)
        for c in sf.SCENARIOS
        for r in range(4)
    ]
    png = sf.plot(rounds, tmp_path / "sf", sf.MODES["quick"]["fixed"])
    assert png.stat().st_size > 5000


@pytest.mark.timeout(60)
def test_the_runner_refuses_bad_counts_naming_the_flag(tmp_path: Path) -> None:
    for kw, flag in (("seeds", "--seeds"), ("jobs", "--jobs")):
        with pytest.raises(SystemExit, match=f"{flag} must be >= 1, got 0"):
            lab.run(lab.load_spec("codec_sweep"), "smoke", out=tmp_path, results="none", **{kw: 0})
    with pytest.raises(SystemExit, match="unknown spec 'nope'; allowed: codec_sweep"):
        lab.load_spec("nope")
    assert not any(tmp_path.iterdir())


def test_datagram_val_loss_verdict_is_judged_at_the_issues_standard_error() -> None:
    """--target-se only stops adding seeds: the verdict always compares with the issue's 0.2% SE
    (a 0.15% stopping rule once printed 'SE 0.15% <= 0.1%')."""
    from experiments.datagram_val_loss import verdict

    assert verdict(0.0017, 0.0015) == "met (mean d +0.17% <= 0.5%, SE 0.15% <= 0.20%)"
    assert verdict(0.0017, 0.0025).startswith("unresolved at SE 0.25%")
    assert verdict(0.006, 0.001).startswith("missed by 0.10 percentage points")
    # one seed: no SE; +0.51% is no miss at that noise (the smoke once read "missed by 0.01 points")
    assert verdict(0.0051, math.inf).startswith("unresolved at SE inf%")
    assert verdict(0.02, 0.004).startswith("missed by 1.50 percentage points")  # far beyond twice the SE


def test_datagram_vs_grpc_cpu_floor_from_the_sites_sync_cpu() -> None:
    """The CPU window of two /proc/stat samples, and the floor a round's syncs have on N cores:
    the sites' sync CPU seconds over the cores, against the limit (8 CPU s on 2 cores vs 2 s: 2x)."""
    from experiments.datagram_vs_grpc import _cpu_cell, cpu_verdict, cpu_window, machine_cpu

    w = cpu_window({"busy": 10.0, "softirq": 1.0, "idle": 30.0}, {"busy": 25.0, "softirq": 2.5, "idle": 35.0})
    assert w == {"busy_fraction": 0.75, "busy_s": 15.0, "softirq_s": 1.5}
    assert math.isnan(cpu_window({}, {"busy": 1.0, "softirq": 0.0, "idle": 1.0})["busy_fraction"])
    now = machine_cpu()  # this machine (Linux): counters that only grow
    assert now["busy"] > 0 and now["idle"] >= 0 and machine_cpu()["busy"] >= now["busy"]
    row = {
        "path": "datagram",
        "loss_pct": 10.0,
        "num_sites": 4,
        "cpu_cores": 2,
        "limit_s": 2.0,
        "sites_sync_cpu_s": 8.0,
        "sites_sync_system_cpu_s": 2.0,
        "machine_busy_s_per_round": 9.5,
        "machine_busy_fraction": 0.95,
        "machine_softirq_s_per_round": 1.0,
    }
    assert _cpu_cell(row) == "8.00 (2.00) / 9.50 (95%)"
    assert _cpu_cell({**row, "machine_busy_fraction": float("nan")}) == "-"  # a row of an older run
    v = cpu_verdict([row, {**row, "loss_pct": 20.0, "sites_sync_cpu_s": 100.0}])  # 20%: not judged
    assert "95%-95% busy" in v and "8.00-8.00 CPU s per round" in v and "25%-25% of it in the kernel" in v
    assert "cannot take less than 2.00-2.00x the limit" in v
    assert cpu_verdict([{**row, "sites_sync_cpu_s": None}]) == ""


def test_datagram_vs_grpc_mtu_sets_the_datagram_size_and_is_checked(tmp_path: Path) -> None:
    """``netem.mtu_bytes``: an MTU outside the emulator's range is refused naming the path, before
    any namespace is made (the datagram size it implies: ``max_datagram_bytes_for_mtu``)."""
    from experiments.datagram_vs_grpc import run_point

    spec = lab.load_spec("datagram_vs_grpc")
    for bad in (1000, 9001):
        point = spec.points(
            spec.settings("smoke") | {"fixed": {**spec.settings("smoke")["fixed"], "netem.mtu_bytes": bad}}
        )[0]
        with pytest.raises(ValueError, match=rf"netem.mtu_bytes must be in \[1280, 9000\], got {bad}"):
            run_point(point)
    smoke = spec.settings("smoke")
    point = spec.points(smoke | {"fixed": {**smoke["fixed"], "lab.deadlines": "fast"}})[0]
    with pytest.raises(ValueError, match=r"lab.deadlines must be 'set' or 'derived', got 'fast'"):
        run_point(point)


def test_datagram_val_loss_mtu_sets_the_workers_datagram_and_chunk(tmp_path: Path) -> None:
    """``netem.mtu_bytes`` with ``netem.enabled``: the workers' datagrams are the MTU less 100 B and
    a chunk fills one; at 1,500 the options are the default ones; without netem, or outside the
    emulator's range, it is refused naming the path before anything runs."""
    from dtrain.transports.datagram import datagram_chunk_bytes
    from experiments.datagram_val_loss import NETEM_WORKER, netem_worker

    assert netem_worker(1500) is NETEM_WORKER and "max_datagram_bytes" not in NETEM_WORKER
    jumbo = netem_worker(9000)
    assert jumbo["max_datagram_bytes"] == 8900 and jumbo["chunk_bytes"] == datagram_chunk_bytes("int8", 8900)
    assert jumbo["bucket_bytes"] >= jumbo["chunk_bytes"]  # the worker refuses a chunk larger than its bucket
    spec = lab.load_spec("datagram_val_loss")
    for sets, msg in (
        ({"netem.mtu_bytes": 9000}, r"netem.mtu_bytes must be .* only with netem.enabled; got 9000"),
        ({"netem.enabled": True, "netem.mtu_bytes": 100}, r"netem.mtu_bytes must be in \[1280, 9000\].*got 100"),
    ):
        with pytest.raises(ValueError, match=msg):
            lab.run(spec, "smoke", out=tmp_path, results="none", overrides=sets)
    assert not any(tmp_path.iterdir())


def test_set_overrides_parse_json_and_unknown_paths_are_refused(tmp_path: Path) -> None:
    """``--set PATH=VALUE``: JSON values as such, other text as a CSV cell; a path the spec does not
    know stops the run naming it, before anything runs or is written."""
    assert lab._parse_sets(["outer.lr=1", "netem.rates=[10, 50]", "diloco.rounds.codec.name=int8", "x=true"]) == {
        "outer.lr": 1,
        "netem.rates": [10, 50],
        "diloco.rounds.codec.name": "int8",
        "x": True,
    }
    with pytest.raises(SystemExit, match="--set takes PATH=VALUE, got 'outer.lr'"):
        lab._parse_sets(["outer.lr"])
    with pytest.raises(SystemExit, match=r"--set: unknown path\(s\) \['netem.rates'\]"):
        lab.run(lab.load_spec("diloco_sanity"), "smoke", out=tmp_path, results="none", overrides={"netem.rates": [1]})
    # a path the mode's grid sets per point: the grid would win, so --set is refused, not ignored
    with pytest.raises(SystemExit, match=r"--set: \['lab.runs'\] vary per grid point in reliability's quick mode"):
        lab.run(lab.load_spec("reliability"), "quick", out=tmp_path, results="none", overrides={"lab.runs": 0})
    assert not any(tmp_path.iterdir())
    # a grid point that sets the same value agrees: diloco_sanity's "1 site alone" runs at outer lr 1,
    # momentum 0, so plain model averaging for every DiLoCo point may be asked for; lr 0.5 may not
    m = lab.load_spec("diloco_sanity").settings("quick")
    assert lab.grid_conflicts(m, {"outer.lr": 1.0, "outer.momentum": 0.0}) == []
    assert lab.grid_conflicts(m, {"outer.lr": 0.5, "outer.momentum": 0.0}) == ["outer.lr"]
    m = lab.load_spec("codec_sweep").settings("quick")  # a grid of paths to values, every combination a point
    assert lab.grid_conflicts(m, {"diloco.rounds.codec.name": "int8"}) == ["diloco.rounds.codec.name"]


def test_reliability_reads_a_site_that_joined_as_the_run_ended_by_its_final_theta(tmp_path: Path) -> None:
    """The reliability benchmark's reading of a run directory: a site that could join only as
    the run ended (30% loss) caught up and has no round line; its summary's checksum is the θ
    it ended with, so the run ends equal when that checksum is the others'. Rounds whose
    applied lines differ are counted, and a resync is a missed round."""
    import json

    from experiments.reliability import read_run

    def site(name: str, rounds: list[dict], checksum: str) -> None:
        d = tmp_path / name
        d.mkdir()
        lines = [{"event": "start"}, *({"event": "round", **r} for r in rounds), {"event": "end"}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (d / "summary.json").write_text(json.dumps({"checksum": checksum}))

    site(
        "site-0",
        [{"round": 0, "status": "applied", "checksum": "a"}, {"round": 1, "status": "applied", "checksum": "b"}],
        "b",
    )
    site(
        "site-1",
        [
            {"round": 0, "status": "applied", "checksum": "x"},
            {"round": 1, "status": "resynced", "checksum": "b", "sync_s": 9.5},
        ],
        "b",
    )
    site("site-2", [], "b")
    got = read_run(tmp_path)
    assert got == {
        "sites_seen": 3,
        "equal_at_end": True,
        "declared_dead": 0,
        "unequal_rounds": 1,
        "rounds_missed": 1,
        "max_sync_s": 9.5,
    }
    (tmp_path / "site-2" / "summary.json").write_text(json.dumps({"checksum": "c"}))
    assert read_run(tmp_path)["equal_at_end"] is False


def test_convergence_replot_keeps_the_newer_run_of_a_config_and_seed(tmp_path: Path) -> None:
    """A mode rerun after its side runs keeps its own rows; a side run redone after the mode
    replaces the mode's row; a side run's other seeds are added either way."""
    from experiments.common import save_meta, write_csv
    from experiments.convergence import merge

    prefix = tmp_path / "convergence"

    def row(config: str, seed: int, loss: float) -> dict:
        return {"section": "faults", "config": config, "seed": seed, "final_val_loss": loss}

    mode = [row("int8", 0, 1.0), row("topk", 0, 3.0)]
    write_csv(prefix.with_name("convergence.csv"), mode)
    meta = {"stamp": "Commit `new`, 2026-12-05 18:17 UTC, command `mode`."}
    old = [row("int8", 0, 9.0), row("int8", 1, 1.1)]
    write_csv(tmp_path / "convergence_faults_old.csv", old)
    write_csv(tmp_path / "convergence_faults_old_rounds.csv", [dict(r, round=0) for r in old])
    save_meta(tmp_path / "convergence_faults_old", {"command": "old", "minutes": 1.0, "provenance": "2026-12-01, x"})
    redo = [row("topk", 0, 2.5)]
    write_csv(tmp_path / "convergence_faults_redo.csv", redo)
    save_meta(tmp_path / "convergence_faults_redo", {"stamp": "Commit `later`, 2026-12-05 19:02 UTC, command `redo`."})

    mode_rounds = [dict(r, round=0) for r in mode]
    rows, rounds, merged = merge(prefix, read_rows(prefix.with_name("convergence.csv")), mode_rounds, meta)
    by_key = {(r["config"], r["seed"]): r["final_val_loss"] for r in rows}
    assert by_key == {("int8", 0): 1.0, ("int8", 1): 1.1, ("topk", 0): 2.5}
    # the rounds follow their rows: the mode's int8 seed 0, the old side run's seed 1, nothing of redo's
    assert sorted((x["config"], x["seed"], x["final_val_loss"]) for x in rounds) == [
        ("int8", 0, 1.0),
        ("int8", 1, 1.1),
    ]
    assert "Merged: Command `old`" in merged["stamp"] and "command `redo`" in merged["stamp"]


def test_a_long_set_names_its_files_within_the_file_systems_limit() -> None:
    from experiments.lab import MAX_STEM_BYTES, file_stem

    assert file_stem("convergence_outer-lr=1") == "convergence_outer-lr=1"
    long = "convergence_convergence-fault_names=" + "_".join(
        f"sparseloco-k={k}-α-2_-means-at-k={4 * k}" for k in range(9)
    )
    stem = file_stem(long)
    assert len(stem.encode()) <= MAX_STEM_BYTES and stem.startswith("convergence_convergence-fault_names=sparseloco")
    assert stem == file_stem(long) != file_stem(long + "x")  # the same run finds its files again; another does not
