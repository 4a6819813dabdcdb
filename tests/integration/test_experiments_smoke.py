"""The experiment scripts in their smallest mode (``--smoke``), so they do not rot.

Each runs in this process (one torch import for all three) with its output and its
RESULTS.md redirected to a temporary directory. The measurements themselves are not
tested here; what is: the CSV has one row per run with the documented columns and
sane values, the per-round CSV and the plots exist, and the RESULTS.md section
carries the command that produced it.
"""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path

import pytest

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


def _run(script: str, tmp_path: Path) -> tuple[list[dict], Path, str]:
    mod = importlib.import_module(f"experiments.{script}")
    results = tmp_path / "RESULTS.md"
    assert mod.main(["--smoke", "--out", str(tmp_path), "--results", str(results)]) == 0
    rows = read_rows(tmp_path / f"{script}_smoke.csv")
    return rows, results, results.read_text()


def _check_rows(rows: list[dict], experiment: str) -> None:
    for r in rows:
        assert RUN_COLUMNS <= set(r), RUN_COLUMNS - set(r)
        assert r["experiment"] == experiment
        assert math.isfinite(r["final_val_loss"]) and 0 < r["final_val_loss"] < 10
        assert r["rounds_done"] >= 1 and r["wall_s"] > 0
        assert r["bytes_total"] > 0 or r["num_sites"] == 1


@pytest.mark.timeout(120)
def test_loss_sweep_smoke(tmp_path: Path) -> None:
    rows, _, md = _run("loss_sweep", tmp_path)
    # smoke: loss 0% and 30% with repair, 30% with repair off; one seed, 2 sites, 2 rounds
    assert [(r["config"], r["seed"]) for r in rows] == [("loss 0%", 0), ("loss 30%", 0), ("loss 30% repair off", 0)]
    _check_rows(rows, "loss_sweep")
    assert all(r["rounds_done"] == 2 and r["num_sites"] == 2 for r in rows)
    assert rows[0]["stale_buckets"] == 0 and rows[0]["consistent"] is True  # no loss: every θ equal
    assert rows[0]["max_drift"] == 0.0
    assert rows[1]["push_loss"] == rows[1]["pull_loss"] == 0.3 and rows[1]["reduce_arrived"] < 1.0
    rounds = read_rows(tmp_path / "loss_sweep_smoke_rounds.csv")
    assert len(rounds) == 6 and {"round", "drift", "val_loss", "stale_buckets", "rejected"} <= set(rounds[0])
    for png in ("loss_sweep_smoke.png", "loss_sweep_smoke_drift.png"):
        assert (tmp_path / png).stat().st_size > 5000
    assert "## Chunk-loss sweep (smoke)" in md
    assert "`.venv/bin/python -m experiments.loss_sweep --smoke" in md
    assert "| 30 | 1 |" in md  # the 30% row of the table
    # --replot: nothing runs, the same CSV gives the same table
    csv_before = (tmp_path / "loss_sweep_smoke.csv").read_text()
    mod = importlib.import_module("experiments.loss_sweep")
    assert mod.main(["--smoke", "--replot", "--out", str(tmp_path), "--results", str(tmp_path / "RESULTS.md")]) == 0
    assert (tmp_path / "loss_sweep_smoke.csv").read_text() == csv_before
    assert (tmp_path / "RESULTS.md").read_text().count("## Chunk-loss sweep (smoke)") == 1


@pytest.mark.timeout(120)
def test_codec_sweep_smoke(tmp_path: Path) -> None:
    rows, _, md = _run("codec_sweep", tmp_path)
    assert [r["codec"] for r in rows] == ["fp32", "int8+zstd"]
    _check_rows(rows, "codec_sweep")
    fp32, int8 = rows
    # int8 + zstd: one byte per element plus scales and headers, so about 4x fewer bytes than fp32
    assert 3.0 < fp32["bytes_per_round_site"] / int8["bytes_per_round_site"] < 6.0
    assert int8["bench_rel_err"] > 0 and fp32["bench_rel_err"] == 0
    assert (tmp_path / "codec_sweep_smoke.png").stat().st_size > 5000
    assert "## Codec sweep (smoke)" in md and "`int8+zstd`" in md


@pytest.mark.timeout(180)
def test_diloco_sanity_smoke(tmp_path: Path) -> None:
    rows, _, md = _run("diloco_sanity", tmp_path)
    assert [(r["method"], r["H"]) for r in rows] == [("ddp", 1), ("diloco", 1), ("diloco", 2), ("alone", 4)]
    _check_rows(rows, "diloco_sanity")
    ddp, h1, h2, alone = rows
    assert alone["num_sites"] == 1 and alone["bytes_total"] == 0 and alone["inner_steps"] == 4
    assert ddp["inner_steps"] == h1["inner_steps"] == h2["inner_steps"] == 4
    assert ddp["tokens_per_site"] == h2["tokens_per_site"]
    # ring all-reduce: 2 (N-1)/N * 4 bytes per parameter per step, N = 2
    assert ddp["bytes_per_round_site"] == 4 * ddp["num_params"]
    assert h2["rounds_done"] == 2 and h2["bytes_total"] < h1["bytes_total"]
    assert (tmp_path / "diloco_sanity_smoke.png").stat().st_size > 5000
    assert "## DiLoCo sanity table (smoke)" in md


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


@pytest.mark.timeout(30)
def test_site_failures_report_from_rows(tmp_path: Path) -> None:
    """The table, verdicts and plot of site_failures.py for every scenario (the smoke run
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
    png = sf.plot(rounds, tmp_path / "sf", sf.MODES["quick"])
    assert png.stat().st_size > 5000


@pytest.mark.timeout(240)
def test_site_failures_smoke(tmp_path: Path) -> None:
    """Real processes: 4 workers + a rendezvous, no fault and an owner that SIGKILLs itself
    mid-push in round 1 (``DTRAIN_TEST_FAULT``); 4 short rounds."""
    rows, _, md = _run("site_failures", tmp_path)
    assert [r["config"] for r in rows] == ["no fault", "owner killed mid-round"]
    _check_rows(rows, "site_failures")
    clean, owner = rows
    assert clean["rounds_done"] == 4 and clean["rounds_lost"] == 0 and clean["skipped_buckets"] == 0
    assert clean["survivors_consistent"] is True and clean["first_val_loss"] > clean["final_val_loss"]
    # site-1 died while owning buckets: the survivors skip those buckets in that round, lose no round and agree
    assert owner["rounds_lost"] == 0 and owner["skipped_buckets"] > 0 and owner["survivors_consistent"] is True
    assert "site-1=-9" in owner["exit_codes"] and "site-0=0" in owner["exit_codes"]
    assert (tmp_path / "site_failures_smoke.png").stat().st_size > 5000
    assert "## Site failures (smoke)" in md and "owner killed mid-round: rounds lost 0 (target none: **met**)" in md


@pytest.mark.timeout(120)
def test_delayed_momentum_smoke(tmp_path: Path) -> None:
    """The one-step-delayed sweep runs end to end: blocking, then each merge at each momentum,
    every loss finite and the section names the best delayed variant."""
    from experiments import delayed_momentum  # noqa: PLC0415

    assert delayed_momentum.main(["--smoke", "--out", str(tmp_path), "--results", "none"]) == 0
    rows = read_rows(tmp_path / "delayed_momentum_smoke.csv")
    assert [r["config"] for r in rows] == [
        "blocking",
        "delayed stale m=0 lr=0.7",
        "delayed stale m=0.9 lr=0.7",
        "delayed eager m=0 lr=0.7",
        "delayed eager m=0.9 lr=0.7",
    ]
    assert all(math.isfinite(r["final_loss"]) and r["final_loss"] > 0 for r in rows)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "script",
    [
        "loss_sweep",
        "codec_sweep",
        "diloco_sanity",
        "site_failures",
        "wan_sweep",
        "netem_loss",
        "streaming",
        "delayed_momentum",
    ],
)
def test_bad_counts_are_refused_naming_the_flag(script: str, tmp_path: Path) -> None:
    """--seeds 0 / --sites 0 / --jobs 0 stop with one line naming the flag, before anything runs."""
    mod = importlib.import_module(f"experiments.{script}")
    for flag in ("--seeds", "--sites", "--jobs"):
        with pytest.raises(SystemExit, match=f"{flag} must be >= 1, got 0"):
            mod.main(["--smoke", flag, "0", "--out", str(tmp_path), "--results", "none"])
    assert not any(tmp_path.iterdir())  # nothing was written


@pytest.mark.timeout(300)  # two runs of ~15 s each; building 3 tasks alone took 13 s at load 70
def test_datagram_val_loss_smoke(tmp_path: Path) -> None:
    rows, _, md = _run("datagram_val_loss", tmp_path)
    # smoke: one seed, 3 sites, 3 rounds; the same seed with no loss and with 10% datagram loss
    assert [(r["seed"], r["loss"]) for r in rows] == [(0, 0.0), (0, 0.1)]
    _check_rows(rows, "datagram_val_loss")
    clean, lossy = rows
    assert clean["reduce_arrived"] == 1.0 and 0.8 < lossy["reduce_arrived"] < 0.99  # the loss was injected
    for r in rows:
        assert r["consistent"] is True and r["stale_buckets"] == 0 and r["rounds_done"] == 3
        assert r["final_val_loss"] < r["first_val_loss"] - 1.0  # both trained (tiny: 5.4 -> ~3.1)
        assert r["chunk_bytes"] > 4096  # one int8 chunk per datagram, not the 4 KiB default
    d = lossy["final_val_loss"] / clean["final_val_loss"] - 1
    assert abs(d) < 0.03, d  # same init and data: 10% loss moves the loss by well under 3% here
    assert "## Datagram path: validation loss at 10% loss (smoke)" in md
    # the table's seed-0 row shows both final losses (to 4 decimals; the CSV keeps more digits,
    # so the last digit may round either way)
    row = re.search(r"^\| 0 \| ([0-9.]+) \| ([0-9.]+) \|", md, re.M)
    assert row is not None, md
    assert float(row[1]) == pytest.approx(clean["final_val_loss"], abs=1.1e-4)
    assert float(row[2]) == pytest.approx(lossy["final_val_loss"], abs=1.1e-4)
    assert "Mean d over 1 seeds" in md and "unresolved at SE inf%" in md


@pytest.mark.timeout(420)  # ~45 s on an idle 2-core machine; 217 s at load average 60
def test_convergence_smoke(tmp_path: Path) -> None:
    """experiments/convergence.py --smoke: every method of every section has a row, losses fall,
    the fault-free baseline is paired with every fault, and the report states every claim."""
    from experiments import convergence as c

    rows, _, md = _run("convergence", tmp_path)
    _check_rows(rows, "convergence")
    methods = {(r["section"], r["data"], r["method"]) for r in rows}
    diloco = {c.diloco_label(h, o) for h in (2, 4) for o in (c.NESTEROV, c.AVERAGE)}
    for data in ("iid", "non-iid"):
        assert {("convergence", data, x) for x in {c.DDP, c.ALONE, c.BIG} | diloco} <= methods
    faults = [c.FAULT_FREE, c.LOSS10, c.RESTART, *c.CODECS]
    assert {("faults", "iid", x) for x in faults} <= methods
    assert {r["method"] for r in rows if r["section"] == "sweep" and r["seed"] == 0} == {
        c.diloco_label(2, (lr, mo)) for lr in (0.7, 1.0) for mo in (0.0, 0.9)
    }
    for r in rows:
        assert r["final_val_loss"] < r["first_val_loss"] - 0.01, r["config"]  # every run learned something
        assert r["consistent"] is True, r["config"]
    by = {(r["section"], r["data"], r["method"], r["seed"]): r for r in rows}
    ddp, one, big = (by["convergence", "iid", x, 0] for x in (c.DDP, c.ALONE, c.BIG))
    assert ddp["inner_steps"] == one["inner_steps"] == big["inner_steps"] == 8
    assert big["tokens_per_site"] == 2 * one["tokens_per_site"]  # N = 2 sites' tokens
    assert one["bytes_total"] == big["bytes_total"] == 0
    # paired by seed: each fault has the fault-free run of the same seeds
    seeds = {k[3] for k in by if k[:3] == ("faults", "iid", c.FAULT_FREE)}
    assert len(seeds) >= 2
    for x in faults:
        assert {k[3] for k in by if k[:3] == ("faults", "iid", x)} == seeds
    # int8 changes the fault-free run's loss by far less than top-k keeping 1% of each chunk
    d = {x: c.pct_deltas(c.fault_rows(rows, x), c.fault_rows(rows, c.FAULT_FREE)) for x in faults[1:]}
    assert max(abs(v) for v in d["int8"]) < min(abs(v) for v in d["topk + error feedback"])
    # a curve per run: DDP evaluated every step, DiLoCo H=2 every round
    rounds = read_rows(tmp_path / "convergence_smoke_rounds.csv")
    curve = [x for x in rounds if x["config"] == ddp["config"] and x["seed"] == 0]
    assert [x["round"] for x in curve] == list(range(8)) and curve[-1]["val_loss"] == pytest.approx(
        ddp["final_val_loss"], rel=1e-5
    )
    for name in ("convergence_iid", "convergence_non-iid", "diagnosis_iid"):
        assert (tmp_path / f"convergence_smoke_{name}.png").stat().st_size > 5000
    assert "## Convergence (issue 18, smoke)" in md and "`.venv/bin/python -m experiments.convergence --smoke" in md
    for claim in ("DiLoCo vs DDP (iid", "DiLoCo vs DDP (non-iid", "10% chunk loss ≤ 0.5%", "int4 no regression"):
        assert claim in md
    assert md.count("→ **") >= 8  # a verdict per claim
    # side runs: an outer setting over the convergence steps and a fault rerun, merged by --replot
    # (a rerun replaces the row of the same config and seed; nothing is counted twice)
    base = ["--smoke", "--out", str(tmp_path), "--results", "none"]
    assert c.main([*base, "--outer-check", "1/0.5,1/0@4:0:1"]) == 0
    outer = {r["method"]: r for r in read_rows(tmp_path / "convergence_outer_smoke.csv")}
    assert outer[c.diloco_label(4, c.AVERAGE)]["H"] == 4 and outer[c.diloco_label(2, (1.0, 0.5))]["H"] == 2
    assert c._fault_names("fault-free,1 site down, restarted,topk") == [
        c.FAULT_FREE,
        c.RESTART,
        "topk + error feedback",
    ]
    assert c.main([*base, "--fault-seeds", "1:2", "--fault-names", "fault-free", "--fault-name-tag", "_re"]) == 0
    again = read_rows(tmp_path / "convergence_faults_re_smoke.csv")
    assert again[0]["final_val_loss"] == by["faults", "iid", c.FAULT_FREE, 1]["final_val_loss"]  # deterministic
    assert c.main([*base, "--long-check", "16:0.7/0.9,big,ddp", "--fault-name-tag", "_long"]) == 0
    assert c.main([*base, "--rerun-diloco", "--fault-name-tag", "_rr"]) == 0
    rerun = {(r["config"], r["seed"]): r for r in read_rows(tmp_path / "convergence_outer_rr_smoke.csv")}
    assert {r["method"] for r in rerun.values()} == diloco  # every DiLoCo run, no baseline
    assert all(
        r["final_val_loss"] == by[r["section"], r["data"], r["method"], 0]["final_val_loss"] for r in rerun.values()
    )
    results = tmp_path / "RESULTS.md"
    assert c.main(["--smoke", "--out", str(tmp_path), "--results", str(results), "--replot"]) == 0
    md2 = results.read_text()
    assert f"| {c.diloco_label(2, (1.0, 0.5))} | 0 | 4 | 8 |" in md2  # in the iid convergence table
    assert "--outer-check 1/0.5,1/0@4:0:1" in md2 and "--fault-name-tag _re" in md2
    assert f"| {c.FAULT_FREE} | {len(seeds)} |" in md2
    assert f"| {c.diloco_label(2, c.NESTEROV)} | 0 | 4 | 8 |" in md2  # replaced by its rerun, not doubled
    # the long check has its own table per step count, against DDP when DDP ran at that length
    assert "**Longer: 16 inner steps per site**, iid, against DDP" in md2
    assert "- Longer (16 inner steps, 8 rounds), against DDP: " in md2
    assert f"| {c.DDP} | 0 | 16 | 16 |" in md2 and "1 site with 2x the batch against DDP there" in md2
    assert (tmp_path / "convergence_smoke_long16_iid.png").stat().st_size > 5000


def test_datagram_val_loss_verdict_is_judged_at_the_issues_standard_error() -> None:
    """--target-se only stops adding seeds: the verdict always compares with the issue's 0.2% SE
    (a 0.15% stopping rule once printed 'SE 0.15% <= 0.1%')."""
    from experiments.datagram_val_loss import verdict

    assert verdict(0.0017, 0.0015) == "met (mean d +0.17% <= 0.5%, SE 0.15% <= 0.20%)"
    assert verdict(0.0017, 0.0025).startswith("unresolved at SE 0.25%")
    assert verdict(0.006, 0.001).startswith("missed by 0.10 percentage points")


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


def test_datagram_vs_grpc_mtu_sets_the_datagram_size_and_is_checked() -> None:
    """``--mtu-bytes``: an MTU outside the emulator's range is refused naming the flag, before
    any namespace is made (the datagram size it implies: ``max_datagram_bytes_for_mtu``)."""
    from experiments.datagram_vs_grpc import main

    for bad in ("1000", "9001"):
        with pytest.raises(SystemExit, match=r"--mtu-bytes must be in \[1280, 9000\], got " + bad):
            main(["--smoke", "--mtu-bytes", bad, "--results", "none"])


def test_datagram_val_loss_mtu_sets_the_workers_datagram_and_chunk() -> None:
    """``--mtu-bytes`` with ``--netem``: the workers' datagrams are the MTU less 100 B and a chunk
    fills one; at 1,500 the options are the default ones; without ``--netem`` it is refused."""
    from dtrain.transports.datagram import datagram_chunk_bytes
    from experiments.datagram_val_loss import NETEM_WORKER, main, netem_worker

    assert netem_worker(1500) is NETEM_WORKER and "max_datagram_bytes" not in NETEM_WORKER
    jumbo = netem_worker(9000)
    assert jumbo["max_datagram_bytes"] == 8900 and jumbo["chunk_bytes"] == datagram_chunk_bytes("int8", 8900)
    assert jumbo["bucket_bytes"] >= jumbo["chunk_bytes"]  # the worker refuses a chunk larger than its bucket
    with pytest.raises(SystemExit, match=r"--mtu-bytes .* only with --netem; got 9000"):
        main(["--smoke", "--mtu-bytes", "9000", "--results", "none"])
    with pytest.raises(SystemExit, match=r"--mtu-bytes must be in \[1280, 9000\].*got 100"):
        main(["--smoke", "--netem", "--mtu-bytes", "100", "--results", "none"])
