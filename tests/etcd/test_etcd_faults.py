"""The etcd rendezvous under etcd faults (a real 3-member cluster): the leader killed
mid-round (rounds go on after etcd elects another), 2 of 3 members killed (no round
forms; every call says why), then restarted (rounds resume)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from dataclasses import replace

import pytest

from dtrain.errors import RendezvousError
from dtrain.rendezvous import RendezvousConfig
from dtrain.rendezvous.etcd_store import EtcdRendezvousClient, EtcdStoreConfig
from tests.etcd_cluster import etcd_cluster  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(90)

CFG = RendezvousConfig(
    min_sites=1,
    initial_sites=2,
    quorum_timeout_s=1.0,
    heartbeat_interval_s=0.5,
    heartbeat_timeout_s=8.0,  # the leases outlive the faults below
    reduce_timeout_s=10.0,
    broadcast_timeout_s=20.0,
)


def _pair(cluster, cfg: RendezvousConfig = CFG):
    store = EtcdStoreConfig.parse(cluster.url, run=f"f-{uuid.uuid4().hex[:8]}", timeout_s=1.0)
    a, b = EtcdRendezvousClient(store, cfg), EtcdRendezvousClient(store, cfg)
    a.join("a", "addr-a")
    b.join("b", "addr-b")
    return a, b


def _round(a, b, r: int, timeout_s: float = 10.0):
    """Both ready for round r (b in the background); returns a's and b's decisions."""
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(1) as ex:
        fb = ex.submit(b.ready, "b", r, timeout_s)
        da = a.ready("a", r, timeout_s)
        return da, fb.result()


def _retry_round(a, b, r: int, budget_s: float):
    """The worker's behaviour (``Group.next_decision``): on a RendezvousError keep going and ask
    again, and ask again while the answer is "wait" (no plan yet)."""
    deadline = time.monotonic() + budget_s
    errors = []
    while time.monotonic() < deadline:
        try:
            da, db = _round(a, b, r, timeout_s=min(10.0, max(0.1, deadline - time.monotonic())))
        except RendezvousError as e:
            errors.append(str(e))
            time.sleep(0.2)
            continue
        if da.status == db.status == "plan":
            return (da, db), errors
        errors.append(f"a: {da.status} ({da.reason}); b: {db.status} ({db.reason})")
    raise AssertionError(f"round {r} did not form within {budget_s}s: {errors[-3:]}")


@contextlib.contextmanager
def _heartbeats(*clients):
    """Each client's site heartbeats every interval on a thread, as a worker's does: its etcd
    lease (``heartbeat_timeout_s``) outlives a fault only while it is kept alive. Without them
    a slow election on a loaded machine let both leases lapse mid-test."""
    stop = threading.Event()

    def beat(client, site: str) -> None:
        while not stop.wait(CFG.heartbeat_interval_s):
            try:
                client.heartbeat(site)
            except RendezvousError:
                pass  # etcd is electing or has no majority: the next beat tries again

    threads = [threading.Thread(target=beat, args=(c, s), daemon=True) for c, s in zip(clients, "ab")]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(5)


def test_rounds_go_on_when_the_etcd_leader_is_killed(etcd_cluster) -> None:  # noqa: F811
    # min_sites=2: an election can delay one site's ready past the 1 s quorum timeout on a
    # loaded machine, and the rule would then rightly form round 2 with the other alone
    a, b = _pair(etcd_cluster, replace(CFG, min_sites=2))
    try:
        with _heartbeats(a, b):
            for r in range(2):
                assert {d.plan.site_ids for d in _round(a, b, r)} == {("a", "b")}
            leader = etcd_cluster.wait_for_leader()
            assert a.ready("a", 2, 0.1).status == "wait"  # mid-round: a is ready, b not yet
            etcd_cluster.kill(leader)
            t0 = time.monotonic()
            (da, db), errors = _retry_round(a, b, 2, budget_s=30.0)
            pause_s = time.monotonic() - t0
            assert da.plan.site_ids == db.plan.site_ids == ("a", "b") and da.plan.round == 2
            log = logging.getLogger(__name__)
            log.info("leader kill: round 2 formed %.2fs later (%d errors)", pause_s, len(errors))
            assert {d.plan.round for d in _round(a, b, 3)} == {3}
    finally:
        a.close()
        b.close()


def test_no_round_without_an_etcd_majority_and_rounds_resume_after(etcd_cluster, caplog) -> None:  # noqa: F811
    a, b = _pair(etcd_cluster)
    try:
        with _heartbeats(a, b):
            assert {d.plan.round for d in _round(a, b, 0)} == {0}
            etcd_cluster.kill(0)
            etcd_cluster.kill(1)
            with pytest.raises(RendezvousError, match="no member answered") as err:
                _round(a, b, 1, timeout_s=2.0)
            assert "127.0.0.1" in str(err.value)  # names the members it tried
            etcd_cluster.restart(0)
            etcd_cluster.restart(1)
            etcd_cluster.wait_for_leader(30.0)
            (da, db), _ = _retry_round(a, b, 1, budget_s=30.0)
            assert da.plan == db.plan and da.plan.round == 1 and da.plan.site_ids == ("a", "b")
    finally:
        a.close()
        b.close()
