"""``experiments/bench_rendezvous.py --smoke``: 50 simulated sites against a
rendezvous process, 2 rounds. The figures themselves are the benchmark's
business; what is tested is that every round forms with every site, no site is
declared dead, and the figures it prints are there and consistent."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments import bench_rendezvous


@pytest.mark.timeout(120)
def test_bench_rendezvous_smoke(tmp_path: Path, capsys) -> None:
    out_path = tmp_path / "bench.json"
    assert bench_rendezvous.main(["--smoke", "--json", str(out_path)]) == 0
    doc = json.loads(out_path.read_text())  # the one output writer's form: stamp and figures
    assert doc["bench"] == "bench_rendezvous" and doc["stamp"]["commit"] and doc["args"]["smoke"] is True
    out = doc["figures"]
    assert out["sites"] == 50 and len(out["rounds"]) == 2
    for r in out["rounds"]:
        assert r["min_plan_members"] == 50 and r["num_missed"] == 0, r
        assert 0 <= r["decision_ms"] <= r["plan_median_ms"] <= r["plan_p99_ms"] <= r["plan_max_ms"], r
    assert out["declared_dead"] == [] and out["missed"] == []
    assert out["heartbeats"] > 0 and out["heartbeat_resync_answers"] == 0
    for key in ("decision_median_ms", "plan_median_ms", "plan_p99_ms", "heartbeat_median_ms", "heartbeat_p99_ms"):
        assert math.isfinite(out[key]) and out[key] >= 0, key
    printed = capsys.readouterr().out
    assert "last ready -> plan: decision median" in printed and "heartbeats:" in printed
