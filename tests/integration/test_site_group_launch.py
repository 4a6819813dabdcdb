"""``dtrain launch --sites 2 --ranks-per-site 2`` end to end (issue 14): each site is
one torchrun group of 2 ranks (gloo), the built-in tiny GPT trained with FSDP2 or
DDP inside a site; plus SIGKILL of one rank of site-1 mid-round with
``--max-restarts 1``: torchrun restarts the group, every rank pulls its slice from
the same rank of site-0, and the site rejoins.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SITES = ["site-0", "site-1"]
BASE = ["--sites", "2", "--ranks-per-site", "2", "--size", "tiny", "--sync-every", "5", "--linger-s", "1"]


def _env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("DTRAIN_TEST_FAULT", None)
    env.update(extra)
    return env


def _lines(run_dir: Path, site: str) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / site / "metrics.jsonl").read_text().splitlines()]


def _launch(args: list[str], run_dir: Path, timeout_s: float, watch=None, **env: str) -> tuple[int, str, str]:
    cmd = [sys.executable, "-m", "dtrain", "launch", *args, "--out", str(run_dir), "--no-progress"]
    p = subprocess.Popen(cmd, cwd=REPO, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while watch is not None and p.poll() is None and time.monotonic() < deadline:
            if watch(run_dir):
                break
            time.sleep(0.3)
        out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"dtrain launch did not finish within {timeout_s}s\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
    return p.returncode, out, err


@pytest.mark.timeout(150)
def test_launch_two_sites_of_two_fsdp_ranks(tmp_path: Path) -> None:
    rounds = 4
    seen: dict = {}

    def watch(run_dir: Path) -> bool:  # the status page while the run is live
        url_file = run_dir / "status.url"
        if not url_file.exists():
            return False
        try:
            with urllib.request.urlopen(url_file.read_text().strip() + "api/status", timeout=2) as r:
                doc = json.loads(r.read())
        except OSError:
            return False
        reported = {s["site_id"]: s.get("last_reported_round") for s in doc["sites"]}
        if set(reported) == set(SITES) and all(v is not None for v in reported.values()):
            seen.update(reported)
            return True
        return False

    args = [*BASE, "--parallel", "fsdp", "--rounds", str(rounds)]
    rc, out, err = _launch(args, tmp_path, 120, watch=watch)
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err[-3000:]}"
    assert "θ checksums agree across sites" in out
    assert set(seen) == set(SITES), "the status page never showed both sites' round reports"
    rows = [ln for ln in out.splitlines() if ln.startswith("site-")]
    assert len(rows) == 2 and rows[0].split()[2] == rows[1].split()[2]  # one θ checksum per site, equal
    for s in SITES:
        summ = json.loads((tmp_path / s / "summary.json").read_text())
        assert summ["ranks"] == 2 and summ["parallel"] == "fsdp" and summ["rounds"] == rounds
        assert summ["final_val_loss"] < summ["first_val_loss"] - 0.5
        assert sum(summ["diloco_numel_per_rank"]) == 3 * json.loads(
            (tmp_path / s / "metrics.jsonl").read_text().splitlines()[0]
        )["params"]
        lines = _lines(tmp_path, s)[1:]
        assert [d["round"] for d in lines] == list(range(rounds))
        for d in lines:
            assert d["status"] == "applied" and d["members"] == SITES and d["ranks"] == 2
            assert len(d["rank_bytes_sent"]) == 2 and d["bytes_sent"] == sum(d["rank_bytes_sent"])
            assert len(d["slice_checksums"]) == 2
    per_round = zip(*(_lines(tmp_path, s)[1:] for s in SITES))
    for a, b in per_round:
        assert a["checksum"] == b["checksum"] and a["slice_checksums"] == b["slice_checksums"], (a, b)
