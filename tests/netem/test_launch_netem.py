"""`dtrain launch --netem PROFILE`: real gRPC traffic between site namespaces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.metrics import RoundLine, read_metrics

pytestmark = pytest.mark.netem


@pytest.mark.timeout(240)
# (the lossy profile's 3-site launch, with no time setting at all, is
# tests/netem/test_experiments_netem.py::test_reliability_smoke)
@pytest.mark.parametrize("profile", ["transatlantic"])
def test_three_site_launch_through_emulated_links_agrees(profile: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dtrain",
            "launch",
            "--sites",
            "3",
            "--size",
            "tiny",
            "--rounds",
            "3",
            "--sync-every",
            "5",
            "--out",
            str(out),
            "--no-progress",
            "--netem",
            profile,
            "--reduce-timeout-s",
            "8",
            "--broadcast-timeout-s",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checksums agree" in proc.stdout
    summaries = [json.loads((out / f"site-{i}" / "summary.json").read_text()) for i in range(3)]
    assert len({s["checksum"] for s in summaries}) == 1
    assert all(s["rounds"] == 3 for s in summaries)
    assert all(s["final_val_loss"] < s["first_val_loss"] - 0.5 for s in summaries)
    for i in range(3):
        lines = read_metrics(out / f"site-{i}" / "metrics.jsonl")
        rounds = [ln.as_dict() for ln in lines if isinstance(ln, RoundLine)]
        assert [r["round"] for r in rounds] == [0, 1, 2]
        assert all(len(r["members"]) == 3 for r in rounds), [r["members"] for r in rounds]
    launch = json.loads((out / "launch.json").read_text())
    assert launch["netem"] == profile
