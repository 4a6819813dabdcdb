"""Two stateless ``dtrain rendezvous`` front-ends (gRPC) on one etcd cluster: sites list
both; the front-end they use is stopped mid-run; the next round forms through the other
with no re-join and no resync, within heartbeat timeout + one quorum timeout."""

from __future__ import annotations

import concurrent.futures as cf
import time
import uuid

import pytest

from dtrain.rendezvous import RendezvousConfig
from dtrain.rendezvous.connect import FailoverRendezvousClient, rendezvous_client
from dtrain.rendezvous.etcd_store import EtcdRendezvous, EtcdStoreConfig
from dtrain.rendezvous.grpc import serve_rendezvous
from tests.etcd_cluster import etcd_cluster  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

CFG = RendezvousConfig(
    min_sites=1,
    initial_sites=3,
    quorum_timeout_s=1.0,
    heartbeat_interval_s=0.3,
    heartbeat_timeout_s=2.0,
    reduce_timeout_s=10.0,
    broadcast_timeout_s=20.0,
)


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
        assert {d.plan.site_ids for d in _all_ready(clients, 0).values()} == {("a", "b", "c")}
        servers[0].stop(0)  # the front-end every site uses
        t0 = time.monotonic()
        for s, c in clients.items():
            hb = c.heartbeat(s)
            assert hb.known and not hb.resync_required  # the lease lives in etcd, not in the front-end
        got = _all_ready(clients, 1)
        took_s = time.monotonic() - t0
        assert {d.plan.site_ids for d in got.values()} == {("a", "b", "c")}
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
