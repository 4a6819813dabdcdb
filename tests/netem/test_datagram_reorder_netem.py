"""The datagram data path through a reordering link (netem ``reorder_pct`` / ``reorder_gap_ms``):
3 sites, each a process in its namespace (``datagram_site.py``), 2 rounds of fp32 means, first on
clean 5 ms links, then with 20% of every site's arriving packets held 2 ms longer (overtaken by
the few packets behind them, contributions by their own BUCKET_END included). The means are the
fault-free means bit for bit (θ's checksums equal), every contribution is included and none
refused; the owners' ends waited for what they had not yet handled; junk (replayed copies of a
sealed datagram and a forged one) is dropped and counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from netem import Topology

pytestmark = [pytest.mark.netem, pytest.mark.timeout(90)]

SITE = Path(__file__).with_name("datagram_site.py")
PORT = 29650


def test_reordered_datagrams_give_the_fault_free_means() -> None:
    key = os.urandom(32).hex()
    with Topology(3, "lan", kernel_netem=False) as topo:
        hosts = ",".join(topo.address(i) for i in range(3))
        env = {**os.environ, "PYTHONPATH": str(SITE.parents[2])}
        argv = [sys.executable, str(SITE), "--hosts", hosts, "--port", str(PORT), "--key", key]
        procs = [
            topo.popen(i, [*argv, "--index", str(i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            for i in range(3)
        ]
        try:
            for p in procs:
                assert p.stdout.readline().strip() == "ready"
            clean = _phase(procs, topo, delay_ms=5.0)
            reordered = _phase(procs, topo, delay_ms=5.0, reorder_pct=20.0, reorder_gap_ms=2.0)
            held_back = sum(s["reordered"] for s in topo.stats()["sites"])
            assert all(p.wait(timeout=30) == 0 for p in procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert held_back > 100, held_back  # the delayer did reorder
    for run in (clean, reordered):
        assert all(f == 1.0 for site in run for f in site["included"]), [s["included"] for s in run]
        assert all(not r for site in run for r in site["rejected"]), [s["rejected"] for s in run]
        assert all(site["counters"]["rejected"] == 0 for site in run)
        assert all(site["counters"]["late_after_end"] == 0 for site in run)
    # θ after each round: the same at every site, and the same as without reordering
    assert all(site["checksums"] == clean[0]["checksums"] for site in clean + reordered)
    assert sum(site["counters"]["ends_waited"] for site in clean) == 0  # one FIFO: nothing to wait for
    assert sum(site["counters"]["ends_waited"] for site in reordered) > 0  # an end overtook a contribution
    for run in (clean, reordered):
        junk = run[1]["counters"]
        assert junk["dropped_replayed"] == 2 and junk["dropped_forged"] == 1, junk


def _phase(procs: list, topo: Topology, **link) -> list[dict]:
    """Set every site's link, start the next phase at every site, return their JSON lines."""
    topo.set_link(None, **link)
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return [json.loads(p.stdout.readline()) for p in procs]
