"""experiments/chaos.py --smoke: 3 worker processes over gRPC, 10 rounds, 5 seeded
faults (kill + restart, SIGSTOP/SIGCONT, corrupt payload, rogue flood). No hang, equal
θ among the sites that applied each round, open fds flat."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (/proc, POSIX signals)"),
]


@pytest.mark.timeout(300)
def test_chaos_smoke_has_no_hang_and_equal_checksums(tmp_path: Path) -> None:
    from experiments import chaos

    assert chaos.main(["--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "chaos.json").read_text())
    assert res["num_faults"] >= 3, res["faults"]
    assert set(res["faults"]) <= set(chaos.KINDS)
    assert res["hangs"] == [] and res["checksum_mismatch_rounds"] == []
    assert res["rounds"] == 10 and len(res["rounds_lost_at_site0"]) <= 2, res
    assert all(abs(g["fds"]) <= 8 for g in res["growth_after_warmup"].values()), res["growth_after_warmup"]
    assert res["final_val_loss"] is not None and res["final_val_loss"] < 5.0
