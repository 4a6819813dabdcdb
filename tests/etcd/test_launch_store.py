"""``dtrain launch --store etcd://...``: launch's rendezvous is a stateless front-end on a
real 3-member etcd cluster; the run's rounds are formed (and kept) in etcd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dtrain.rendezvous.etcd_store import EtcdStoreConfig
from tests.etcd_cluster import etcd_cluster  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 3


@pytest.mark.timeout(150)
def test_launch_runs_its_sites_on_an_etcd_store(etcd_cluster, tmp_path: Path) -> None:  # noqa: F811
    run = f"launch-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "dtrain", "launch", "--sites", "2", "--size", "tiny", "--sync-every", "5"]
    argv += ["--rounds", str(ROUNDS), "--linger-s", "1", "--no-progress", "--http-bind", "off", "--out", str(out)]
    argv += ["--store", f"{etcd_cluster.url}/{run}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    try:
        p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"dtrain launch --store did not finish in 120 s\n{(e.stdout or '')[-2000:]}")
    assert p.returncode == 0, f"stdout:\n{p.stdout[-2000:]}\nstderr:\n{p.stderr[-3000:]}"
    assert "θ checksums agree across sites" in p.stdout
    summaries = [json.loads((out / f"site-{i}" / "summary.json").read_text()) for i in range(2)]
    assert [s["rounds_joined"] for s in summaries] == [ROUNDS, ROUNDS]
    assert json.loads((out / "launch.json").read_text())["store"] == f"{etcd_cluster.url}/{run}"
    etcd = EtcdStoreConfig.parse(f"{etcd_cluster.url}/{run}").client()
    nxt = etcd.get(f"/dtrain/{run}/next".encode())
    assert nxt is not None and int(nxt.value) == ROUNDS, "the rounds were not formed in etcd"
    plan = json.loads(etcd.get(f"/dtrain/{run}/plan/{ROUNDS - 1:012d}".encode()).value)
    assert [m[0] for m in plan["members"]] == ["site-0", "site-1"]
    rv_log = (out / "rendezvous.log").read_text()
    assert "rendezvous: round 0 formed with ['site-0', 'site-1']" in rv_log
