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
from pathlib import Path

import pytest

from experiments.common import read_rows, update_results

# The columns every per-run CSV has (issue 6: configuration, seed, final validation
# loss, rounds, wall time, bytes, sync seconds, stale buckets, rejected contributions).
RUN_COLUMNS = {
    "experiment", "config", "seed", "num_sites", "sync_every", "codec", "final_val_loss", "first_val_loss",
    "rounds_done", "wall_s", "bytes_total", "bytes_per_round_site", "sync_s", "stale_buckets", "rejected",
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
        assert r["rounds_done"] >= 1 and r["bytes_total"] > 0 and r["wall_s"] > 0


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
    assert "`.venv/bin/python experiments/loss_sweep.py --smoke" in md
    assert "| 30 | 1 |" in md  # the 30% row of the table


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
    assert [(r["method"], r["H"]) for r in rows] == [("ddp", 1), ("diloco", 1), ("diloco", 2)]
    _check_rows(rows, "diloco_sanity")
    ddp, h1, h2 = rows
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
