"""The JSON-gateway etcd client against a real 3-member cluster: kv, txn, leases, watch, fail-over."""

from __future__ import annotations

import threading
import time

import pytest

from dtrain.rendezvous.etcd_client import EtcdClient, EtcdError, cmp_absent, op_put, op_range, txn_range_kvs
from tests.etcd_cluster import etcd_cluster  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)


def test_put_range_delete_and_txn(etcd_cluster) -> None:  # noqa: F811
    c = EtcdClient(etcd_cluster.endpoints)
    c.put(b"/t/a", b"1")
    c.put(b"/t/b", b"2")
    kvs, count, rev = c.range(b"/t/", prefix=True)
    assert [(kv.key, kv.value) for kv in kvs] == [(b"/t/a", b"1"), (b"/t/b", b"2")] and count == 2 and rev > 0
    ok, _ = c.txn([cmp_absent(b"/t/plan")], [op_put(b"/t/plan", b"first")], [op_range(b"/t/plan")])
    assert ok
    ok, resp = c.txn([cmp_absent(b"/t/plan")], [op_put(b"/t/plan", b"second")], [op_range(b"/t/plan")])
    assert not ok and txn_range_kvs(resp[0])[0].value == b"first"  # written once
    assert c.delete(b"/t/", prefix=True) == 3
    assert c.get(b"/t/a") is None


def test_lease_keeps_its_key_until_it_expires(etcd_cluster) -> None:  # noqa: F811
    c = EtcdClient(etcd_cluster.endpoints)
    lease = c.lease_grant(2)
    c.put(b"/l/site", b"x", lease=lease)
    assert c.lease_keepalive(lease) == 2
    assert c.get(b"/l/site").lease == lease
    deadline = time.monotonic() + 10
    while c.get(b"/l/site") is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert c.get(b"/l/site") is None  # expired with its lease
    assert c.lease_keepalive(lease) == 0


def test_watch_sees_puts_and_deletes_in_order(etcd_cluster) -> None:  # noqa: F811
    c = EtcdClient(etcd_cluster.endpoints)
    seen: list[tuple[str, bytes, bytes]] = []
    got = threading.Event()

    def on(events, rev):
        seen.extend((e.kind, e.kv.key, e.kv.value) for e in events)
        if len(seen) >= 3:
            got.set()

    _, _, rev = c.range(b"/w/", prefix=True)
    w = c.watch(b"/w/", on, prefix=True, start_revision=rev + 1)
    try:
        c.put(b"/w/1", b"a")
        c.put(b"/w/2", b"b")
        c.delete(b"/w/1")
        assert got.wait(10)
        assert seen == [("PUT", b"/w/1", b"a"), ("PUT", b"/w/2", b"b"), ("DELETE", b"/w/1", b"")]
    finally:
        w.stop()


def test_fails_over_to_a_live_member_and_names_every_dead_one(etcd_cluster) -> None:  # noqa: F811
    c = EtcdClient(etcd_cluster.endpoints, timeout_s=2.0)
    c.put(b"/f/k", b"v")
    etcd_cluster.kill(0)
    assert c.get(b"/f/k").value == b"v"  # member 0 was the current one: moved on
    dead = EtcdClient(["127.0.0.1:1"], timeout_s=1.0)
    with pytest.raises(EtcdError, match=r"no member answered within 1.0s: 127.0.0.1:1"):
        dead.get(b"/f/k")


def _etcdctl(cluster, *args: str) -> str:
    import subprocess

    env = {"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}
    argv = ["etcdctl", f"--endpoints={','.join(cluster.endpoints)}", *args]
    return subprocess.run(argv, env=env, check=True, capture_output=True, text=True, timeout=20).stdout


def test_user_and_password_authenticate_and_a_stranger_is_refused(etcd_cluster) -> None:  # noqa: F811
    from dtrain.rendezvous.etcd_client import EtcdAuth

    _etcdctl(etcd_cluster, "user", "add", "root", "--new-user-password=rootpw")
    _etcdctl(etcd_cluster, "user", "grant-role", "root", "root")
    _etcdctl(etcd_cluster, "auth", "enable")
    c = EtcdClient(etcd_cluster.endpoints, auth=EtcdAuth(username="root", password="rootpw"))
    c.put(b"/a/k", b"v")
    assert c.get(b"/a/k").value == b"v"
    lease = c.lease_grant(5)
    assert c.lease_keepalive(lease) == 5
    with pytest.raises(EtcdError, match="user name is empty|permission denied|invalid auth"):
        EtcdClient(etcd_cluster.endpoints, timeout_s=2.0).put(b"/a/k", b"x")
    with pytest.raises(EtcdError, match="authentication failed"):
        EtcdClient(etcd_cluster.endpoints, auth=EtcdAuth(username="root", password="wrong"), timeout_s=2.0).get(b"/a/k")


def test_a_watch_from_a_compacted_revision_goes_on_from_the_oldest_kept(etcd_cluster) -> None:  # noqa: F811
    c = EtcdClient(etcd_cluster.endpoints)
    first = c.put(b"/c/k", b"0")
    for i in range(1, 5):
        rev = c.put(b"/c/k", str(i).encode())
    c._post("/v3/kv/compaction", {"revision": str(rev), "physical": True})
    seen: list[bytes] = []
    got = threading.Event()

    def on(events, _rev):
        seen.extend(e.kv.value for e in events)
        if b"5" in seen:
            got.set()

    w = c.watch(b"/c/k", on, start_revision=first)  # compacted away
    try:
        time.sleep(0.3)
        c.put(b"/c/k", b"5")
        assert got.wait(10), seen
        assert seen[-1] == b"5" and b"0" not in seen  # goes on; what was compacted is gone
    finally:
        w.stop()
