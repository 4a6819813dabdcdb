"""Two stateless ``dtrain rendezvous`` front-ends (gRPC) on one etcd cluster: sites list
both; the front-end they use is stopped mid-run; the next round forms through the other
with no re-join and no resync, within heartbeat timeout + one quorum timeout."""

from __future__ import annotations

import concurrent.futures as cf
import time
import uuid

import pytest

from dtrain.rendezvous import SiteIdTaken
from dtrain.rendezvous.connect import FailoverRendezvousClient, rendezvous_client
from dtrain.rendezvous.etcd_store import EtcdRendezvous, EtcdStoreConfig
from dtrain.rendezvous.grpc import serve_rendezvous
from tests.etcd_cluster import FAST_RENDEZVOUS, etcd_cluster  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

CFG = FAST_RENDEZVOUS


class _Heartbeats:
    """Each client's site heartbeats every ``every_s`` from a thread, as a live site does
    (``dtrain.membership.Group``): without it the test's sites were live only for the 2 s
    heartbeat timeout after their join, and on a loaded machine the steps between round 0 and
    round 1 took longer (CI: round 1 never formed, both sites dead)."""

    def __init__(self, clients: dict, every_s: float = 0.3) -> None:
        import threading

        self.clients, self.every_s, self.stop = clients, every_s, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            for s, c in self.clients.items():
                try:
                    c.heartbeat(s)
                except Exception:  # noqa: BLE001 - a front-end going down mid-call: the next beat fails over
                    pass

    def __enter__(self) -> "_Heartbeats":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def _all_ready(clients, r: int):
    with cf.ThreadPoolExecutor(len(clients)) as ex:
        futs = {s: ex.submit(c.ready, s, r, 10.0) for s, c in clients.items()}
        return {s: f.result() for s, f in futs.items()}


def test_the_next_round_forms_through_the_other_front_end(etcd_cluster) -> None:  # noqa: F811
    store = EtcdStoreConfig.parse(etcd_cluster.url, run=f"fe-{uuid.uuid4().hex[:8]}")
    cores = [EtcdRendezvous(store, CFG) for _ in range(2)]
    servers = [serve_rendezvous(c) for c in cores]
    spec = ",".join(s.address for s in servers)
    clients = {s: rendezvous_client(spec) for s in ("a", "b", "c")}
    try:
        assert all(isinstance(c, FailoverRendezvousClient) for c in clients.values())
        for s, c in clients.items():
            c.join(s, f"addr-{s}")
        with _Heartbeats(clients):
            with (
                rendezvous_client(servers[1].address) as twin,
                pytest.raises(SiteIdTaken, match="'a' is held by a live site at addr-a"),
            ):
                twin.join("a", "addr-elsewhere")  # through the other front-end: the same store says no
            assert {d.plan.site_ids for d in _all_ready(clients, 0).values()} == {("a", "b", "c")}
            servers[0].stop(0)  # the front-end every site uses
            t0 = time.monotonic()
            for s, c in clients.items():
                hb = c.heartbeat(s)
                assert hb.known and not hb.resync_required  # the lease lives in etcd, not in the front-end
            got = _all_ready(clients, 1)
            took_s = time.monotonic() - t0
        why = {s: (d.status, d.reason, round(took_s, 2)) for s, d in got.items()}
        assert all(d.status == "plan" for d in got.values()), why
        assert {d.plan.site_ids for d in got.values()} == {("a", "b", "c")}, why
        assert {d.plan.round for d in got.values()} == {1}
        assert took_s < CFG.heartbeat_timeout_s + CFG.quorum_timeout_s
        assert all(c._current == 1 for c in clients.values())  # they all moved to the second
    finally:
        for c in clients.values():
            c.close()
        for s in servers:
            s.stop(0)
        for c in cores:
            c.close()


def _start_frontend(tmp_path, name: str, url: str):
    import subprocess
    import sys

    addr, http = tmp_path / f"{name}.addr", tmp_path / f"{name}.http"
    argv = [sys.executable, "-m", "dtrain", "rendezvous", "--store", url, "--bind", "127.0.0.1:0"]
    argv += ["--address-file", str(addr), "--http-bind", "127.0.0.1:0", "--http-address-file", str(http)]
    argv += ["--initial-sites", "2", "--quorum-timeout-s", "1", "--heartbeat-interval-s", "0.3"]
    argv += ["--heartbeat-timeout-s", "2"]
    log = open(tmp_path / f"{name}.log", "wb")
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not addr.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert addr.exists(), (tmp_path / f"{name}.log").read_text()
    return p, addr.read_text().strip(), http.read_text().strip()


def test_rendezvous_processes_on_etcd_share_rounds_and_the_status_page(etcd_cluster, tmp_path) -> None:  # noqa: F811
    import json
    import os
    import signal
    import urllib.request

    url = f"{etcd_cluster.url}/procs"
    procs = []
    try:
        for name in ("fe1", "fe2"):
            procs.append(_start_frontend(tmp_path, name, url))
        clients = {s: rendezvous_client(f"{procs[0][1]},{procs[1][1]}") for s in ("a", "b")}
        for s, c in clients.items():
            c.join(s, f"addr-{s}")
        with _Heartbeats(clients):
            assert {d.plan.site_ids for d in _all_ready(clients, 0).values()} == {("a", "b")}
            report = json.dumps({"round": 0, "seq": 1, "site": "a", "status": "applied", "val_loss": 2.5})
            assert clients["a"].heartbeat("a", round_reports=[report]).known
            with urllib.request.urlopen(procs[1][2] + "/api/status", timeout=10) as resp:  # the other front-end's
                doc = json.loads(resp.read())
            assert [s["site_id"] for s in doc["sites"]] == ["a", "b"]
            assert doc["next_round"] == 1
            row = next(r for r in doc["rounds"] if r["round"] == 0)
            assert row["members"] == ["a", "b"], row
            assert next(s for s in doc["sites"] if s["site_id"] == "a")["val_loss"] == 2.5
            os.killpg(procs[0][0].pid, signal.SIGKILL)  # the front-end the sites use
            got = _all_ready(clients, 1)
            assert {d.plan.site_ids for d in got.values()} == {("a", "b")}, got
        for c in clients.values():
            c.close()
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def test_a_member_asking_while_its_round_forms_elsewhere_gets_the_plan(etcd_cluster) -> None:  # noqa: F811
    """The race behind a CI failure: a site's ``ready`` reads its standing from etcd before the
    round's plan is written, and the plan (formed through another call) reaches this process's
    watch before the round count is read. The site is a member, so it gets the plan; it was told
    "round 1 already ran" and sent to resync while the others ran the round it belonged to."""
    from dtrain.protocol import Member, RoundPlan

    store_cfg = EtcdStoreConfig.parse(etcd_cluster.url, run=f"race-{uuid.uuid4().hex[:8]}")
    core = EtcdRendezvous(store_cfg, CFG)
    try:
        for s in ("a", "b", "c"):
            core.join(s, f"addr-{s}", now=time.monotonic())
        store = core.store
        store._start_watch()  # noqa: SLF001 - the watch first, as a serving front-end has it
        members = tuple(Member(site_id=s, address=f"addr-{s}") for s in ("a", "b", "c"))
        plan = RoundPlan(round=0, members=members, reduce_timeout_s=10.0, broadcast_timeout_s=20.0)
        read = store.etcd.txn

        def read_then_plan_arrives(*args, **kw):
            out = read(*args, **kw)
            with store._cv:  # noqa: SLF001 - what the watch does when the plan arrives
                store._add_plan(plan, "all 3 live sites are ready")  # noqa: SLF001
            return out

        store.etcd.txn = read_then_plan_arrives
        d = core.ready("c", 0, now=time.monotonic())
        assert (d.status, d.reason, d.plan) == ("plan", "all 3 live sites are ready", plan), d
    finally:
        core.close()
