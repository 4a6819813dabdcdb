"""scripts/gpu_check.py on the CPU (how it is tried before a GPU is lent, so it does not rot
between the rare runs on one): both ``theta_device`` settings train, agree and are timed. On
the CPU both put θ on the CPU: this keeps the script running; a placement bug on a device is
for tests/unit/test_theta_device.py (with CUDA) and the script's run on a GPU."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_gpu_check_runs_on_the_cpu_for_both_theta_device_settings() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--big-width", "256",
         "--big-depth", "2"],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.rstrip().endswith("ALL CHECKS PASSED")
    for mode in ("cpu", "model"):
        trained = [ln for ln in out.stdout.splitlines() if f"(theta_device={mode}): val loss" in ln]
        assert len(trained) == 2, out.stdout  # fp32 and bf16 parameters
        for ln in trained:
            first, final = map(float, re.search(r"val loss ([\d.]+) -> ([\d.]+)", ln).groups())
            assert final < first - 1.0 and "θ checksums agree: True" in ln and "device params == θ: True" in ln
        (timed,) = [ln for ln in out.stdout.splitlines() if f"(theta_device={mode})] optimizer.step()" in ln]
        ns = float(re.search(r"\(([\d.]+) ns/param\)", timed).group(1))
        assert math.isfinite(ns) and ns > 0, timed
