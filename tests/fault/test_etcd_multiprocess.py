"""Worker processes on etcd directly (``--rendezvous etcd://...``, no rendezvous process),
on a real 3-member etcd cluster: healthy rounds agree; with 2 of 3 etcd members killed
no round forms and the sites keep training locally, saying why in their logs; with the
members restarted, rounds resume and θ checksums agree."""

from __future__ import annotations

import time
from urllib.parse import urlencode

import pytest

from tests.etcd_cluster import etcd_cluster  # noqa: F401  (fixture)
from tests.fault.conftest import RENDEZVOUS_DEFAULTS, wait_until


def _etcd_rendezvous(cluster, run: str, num_sites: int, **timing) -> str:
    timing = {**RENDEZVOUS_DEFAULTS, "initial_sites": num_sites, **timing}
    return f"{cluster.url}/{run}?{urlencode(timing)}"


def _sites_on_etcd(make_cluster, cluster, run: str, rounds: int, *, until_round: int | None = None, **timing):
    """Three worker processes on etcd directly; with ``until_round``, once each applied it."""
    c = make_cluster(worker={"rounds": rounds})
    c.rv_address = _etcd_rendezvous(cluster, run, 3, **timing)
    sites = [c.start_site(i, num_sites=3) for i in range(3)]
    for s in sites if until_round is not None else ():
        c.wait_round(s, until_round, 90)
    return c, sites


def _agree(c, sites, rnd):
    lines = {s: c.by_round(s).get(rnd) for s in sites}
    assert all(lines.values()), f"round {rnd} not applied everywhere: {sorted(k for k, v in lines.items() if v)}"
    sums = {s: d["checksum"] for s, d in lines.items()}
    assert len(set(sums.values())) == 1, f"θ checksums differ in round {rnd}: {sums}"
    return lines


@pytest.mark.timeout(120)
def test_sites_on_etcd_directly_agree_every_round(make_cluster, etcd_cluster) -> None:  # noqa: F811
    rounds = 3
    c, sites = _sites_on_etcd(make_cluster, etcd_cluster, "healthy", rounds)
    codes = c.wait_all_exit(sites, 90)
    assert codes == {s: 0 for s in sites}, c.diag()
    for r in range(rounds):
        assert all(d["members"] == sites for d in _agree(c, sites, r).values())


@pytest.mark.timeout(180)
def test_no_round_without_an_etcd_majority_then_rounds_resume(make_cluster, etcd_cluster) -> None:  # noqa: F811
    rounds = 5
    # min_sites=3: the sites reach etcd again seconds apart (each call waits out its 3 s
    # deadline); the first back must not form a round alone after one quorum timeout
    c, sites = _sites_on_etcd(make_cluster, etcd_cluster, "majority", rounds, until_round=1, min_sites=3)
    etcd_cluster.kill(0)
    etcd_cluster.kill(1)
    t_down = time.time()
    wait_until(
        lambda: all("training on locally" in c.log_text(s) for s in sites),
        60,
        "every site to say it trains on locally",
        c.diag,
    )
    applied_while_down = {s: max(c.by_round(s)) for s in sites}
    t_up = time.time()
    etcd_cluster.restart(0)
    etcd_cluster.restart(1)
    etcd_cluster.wait_for_leader(30.0)
    codes = c.wait_all_exit(sites, 120)
    assert codes == {s: 0 for s in sites}, c.diag()
    # a round whose plan formed before the kill may finish on the data path; none starts after
    settled = t_down + RENDEZVOUS_DEFAULTS["broadcast_timeout_s"] + 1.0
    for s in sites:
        log = c.log_text(s)
        assert "rendezvous unreachable" in log and "no member answered" in log, log[-3000:]
        assert max(c.by_round(s)) == rounds - 1
        assert [d for d in c.rounds(s, status="deferred") if t_down <= d["time"] <= t_up], f"{s} deferred no round"
        assert not [d["round"] for d in c.rounds(s, status="applied") if settled <= d["time"] <= t_up]
    # Rounds resume once etcd has a majority again, with every site. (A site once missed
    # round 2 here at high load: its ready key from before the outage outlived it and the
    # first site back formed the round with it while it trained on locally. A ready now
    # counts only while its site keeps asking: test_store_contract's stale-ready test.)
    for r in range(max(applied_while_down.values()) + 1, rounds):
        assert all(d["members"] == sites for d in _agree(c, sites, r).values())
    assert len({c.summary(s)["checksum"] for s in sites}) == 1


@pytest.mark.timeout(150)
def test_rounds_go_on_when_the_etcd_leader_is_killed_mid_run(make_cluster, etcd_cluster) -> None:  # noqa: F811
    rounds = 5
    # leases (4 s) and the quorum timeout (3 s) outlive an election plus a loaded machine's pauses
    timing = {"heartbeat_timeout_s": 4.0, "quorum_timeout_s": 3.0}
    c, sites = _sites_on_etcd(make_cluster, etcd_cluster, "leader", rounds, until_round=1, **timing)
    old = etcd_cluster.wait_for_leader()
    etcd_cluster.kill(old)
    assert etcd_cluster.wait_for_leader() != old
    codes = c.wait_all_exit(sites, 90)
    assert codes == {s: 0 for s in sites}, c.diag()
    for r in range(rounds):
        _agree(c, sites, r)
    for s in sites:  # the election (~1 s) hid inside the etcd client's deadline: no round deferred
        assert c.rounds(s, status="deferred") == [], c.rounds(s, status="deferred")
        assert c.summary(s)["rounds_joined"] == rounds


@pytest.mark.timeout(150)
def test_sites_fail_over_to_the_other_rendezvous_front_end(make_cluster, etcd_cluster, tmp_path) -> None:  # noqa: F811
    """Two ``dtrain rendezvous --store etcd://...`` processes serve one run; three worker
    processes list both. SIGKILL the one they use after round 1: no site restarts or
    resyncs, every round applies with one θ, and the rounds after the kill waited for
    their plan no longer than the heartbeat timeout plus one quorum timeout (+1 s)."""
    import os
    import signal
    import subprocess
    import sys

    from dtrain.app.config import RENDEZVOUS
    from dtrain.app.procs import child_env as _child_env
    from tests.fault.conftest import REPO

    rounds = 5
    timing = {**RENDEZVOUS_DEFAULTS, "initial_sites": 3}
    fronts = []
    try:
        for name in ("fe1", "fe2"):
            addr = tmp_path / f"{name}.addr"
            argv = [sys.executable, "-m", "dtrain", "rendezvous", "--store", f"{etcd_cluster.url}/fo"]
            argv += ["--bind", "127.0.0.1:0", "--address-file", str(addr), *RENDEZVOUS.to_argv(timing)]
            with open(tmp_path / f"{name}.log", "wb") as log:
                p = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, env=_child_env(), cwd=REPO, start_new_session=True
                )
            fronts.append((p, addr))
        wait_until(lambda: all(a.exists() for _, a in fronts), 60, "both front-ends' address files")
        c = make_cluster(worker={"rounds": rounds})
        c.rv_address = ",".join(a.read_text().strip() for _, a in fronts)
        sites = [c.start_site(i, num_sites=3) for i in range(3)]
        for s in sites:
            c.wait_round(s, 1, 90)
        os.killpg(fronts[0][0].pid, signal.SIGKILL)
        t_kill = time.time()
        codes = c.wait_all_exit(sites, 90)
        assert codes == {s: 0 for s in sites}, c.diag()
        bound_s = RENDEZVOUS_DEFAULTS["heartbeat_timeout_s"] + RENDEZVOUS_DEFAULTS["quorum_timeout_s"] + 1.0
        for r in range(rounds):
            _agree(c, sites, r)
        for s in sites:
            assert c.summary(s)["rounds_joined"] == rounds
            assert c.rounds(s, status="resynced") == [] and c.rounds(s, status="deferred") == []
            after = [d for d in c.rounds(s, status="applied") if d["time"] > t_kill]
            assert after and all(d["quorum_s"] <= bound_s for d in after), [(d["round"], d["quorum_s"]) for d in after]
            assert "failed over to" in c.log_text(s)
    finally:
        for p, _ in fronts:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
