"""The 3-member etcd fixture: a leader, every member answering, a killed leader replaced."""

from __future__ import annotations

import pytest

from tests.etcd_cluster import etcd_cluster  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)


def test_cluster_has_one_leader_and_three_members(etcd_cluster) -> None:  # noqa: F811
    leader = etcd_cluster.wait_for_leader()
    statuses = [etcd_cluster.status(i) for i in range(3)]
    assert all(s is not None for s in statuses)
    assert len({s["leader"] for s in statuses}) == 1  # all agree on one leader
    assert statuses[leader]["header"]["member_id"] == statuses[leader]["leader"]
    assert etcd_cluster.url.startswith("etcd://127.0.0.1:") and etcd_cluster.url.count(",") == 2


def test_killing_the_leader_elects_another(etcd_cluster) -> None:  # noqa: F811
    old = etcd_cluster.wait_for_leader()
    etcd_cluster.kill(old)
    new = etcd_cluster.wait_for_leader()
    assert new != old
    etcd_cluster.restart(old)
    assert etcd_cluster.wait_for_leader() in (0, 1, 2)
