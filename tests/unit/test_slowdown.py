"""Emulated slow hardware for ``dtrain launch --site-slowdown`` (dtrain/app/slowdown.py, issue 34):
the option's parsing, the quota, the cgroup's files, and (as root, where the cgroup v1 cpu
controller exists) that a capped process really gets its share of a CPU."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dtrain.app.slowdown import CGROUP_CPU, CpuCaps, cgroup_unavailable, parse_slowdown, quota_us

pytestmark = pytest.mark.timeout(30)


def test_parse_slowdown() -> None:
    assert parse_slowdown(None, 3) == {} and parse_slowdown("", 3) == {}
    assert parse_slowdown("2=0.5", 3) == {2: 0.5}
    assert parse_slowdown("0=1, 2=0.25", 3) == {0: 1.0, 2: 0.25}
    for bad in ("3=0.5", "2=0", "2=1.5", "2", "x=0.5", "1=0.5,1=0.2", "-1=0.5"):
        with pytest.raises(ValueError, match="site_slowdown: .* is not I=SHARE with a site index I in \\[0, 3\\)"):
            parse_slowdown(bad, 3)


def test_quota_and_cgroup_files(tmp_path: Path) -> None:
    assert quota_us(0.5, 1) == 50_000 and quota_us(0.25, 2) == 50_000 and quota_us(1e-6, 1) == 1000
    assert "no cgroup v1 cpu controller" in cgroup_unavailable(tmp_path)
    (tmp_path / "cpu.cfs_quota_us").write_text("-1")
    assert "needs root (euid 1000)" in cgroup_unavailable(tmp_path, euid=1000)
    assert cgroup_unavailable(tmp_path, euid=0) is None
    caps = CpuCaps("run-1", root=tmp_path)
    path = caps.create(2, 0.5, 1)
    assert path == tmp_path / "dtrain" / "run-1" / "site-2"
    assert (path / "cpu.cfs_quota_us").read_text() == "50000" and (path / "cpu.cfs_period_us").read_text() == "100000"
    argv = CpuCaps.wrap(path, ["python", "-c", "pass"])
    assert argv[:2] == ["sh", "-c"] and argv[-3:] == ["python", "-c", "pass"] and str(path / "cgroup.procs") in argv[2]
    for f in path.iterdir():  # a real cgroup's files vanish with it; here they are plain files
        f.unlink()
    caps.remove()
    assert not (tmp_path / "dtrain").exists()


@pytest.mark.skipif(cgroup_unavailable() is not None, reason=f"{cgroup_unavailable()}")
def test_a_capped_process_gets_its_share_of_a_cpu() -> None:
    """A busy loop capped at 0.25 CPU for 1.2 s of wall time uses about 0.3 s of CPU (at most
    0.25 x 1.2 plus one period's slack), whatever else runs on the machine."""
    caps = CpuCaps(f"test-{uuid.uuid4().hex[:8]}")
    try:
        path = caps.create(0, 0.25, 1)
        loop = "import time,os\nt=time.monotonic()\nwhile time.monotonic()-t<1.2: pass\nprint(sum(os.times()[:2]))"
        t0 = time.monotonic()
        out = subprocess.run(
            CpuCaps.wrap(path, [sys.executable, "-c", loop]), capture_output=True, text=True, check=True
        )
        wall = time.monotonic() - t0
        cpu = float(out.stdout.split()[-1])
        assert cpu <= 0.25 * wall + 0.1, (cpu, wall)
        assert cpu >= 0.1, (cpu, wall)  # it did run
    finally:
        caps.remove()
    assert not (CGROUP_CPU / "dtrain" / caps.dir.name).exists()
