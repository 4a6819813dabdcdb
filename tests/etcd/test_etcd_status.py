"""The status page from the etcd store: heartbeat ages, inner steps and train losses, from
a per-site status key on the site's lease written at most every ``status_interval_s``."""

from __future__ import annotations

import time
import uuid

import pytest

from dtrain.rendezvous import RendezvousConfig
from dtrain.rendezvous.etcd_store import EtcdRendezvous, EtcdStoreConfig
from dtrain.status import StatusLog, build_status
from tests.etcd_cluster import etcd_cluster  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

CFG = RendezvousConfig(min_sites=1, heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0)


def _core(cluster, **store_kw) -> EtcdRendezvous:
    store = EtcdStoreConfig.parse(cluster.url, run=f"st-{uuid.uuid4().hex[:8]}", **store_kw)
    return EtcdRendezvous(store, CFG, reports=StatusLog())


def _status_rev(core: EtcdRendezvous, site: str) -> int:
    kv = core.store.etcd.get(core.store._k("status", site))
    return kv.mod_revision if kv is not None else 0


def test_the_status_page_from_etcd_shows_inner_steps_losses_and_heartbeat_ages(etcd_cluster) -> None:  # noqa: F811
    core = _core(etcd_cluster, status_interval_s=0.2)
    try:
        for s in ("a", "b"):
            core.join(s, f"addr-{s}", now=time.monotonic())
        core.heartbeat("a", now=time.monotonic(), inner_step=40, last_loss=3.25)
        time.sleep(0.25)  # past status_interval_s: the next heartbeat writes again
        core.heartbeat("a", now=time.monotonic(), inner_step=50, last_loss=2.75)
        core.heartbeat("b", now=time.monotonic(), inner_step=7, last_loss=None)
        now = time.monotonic()
        snap = core.snapshot(now)["sites"]
        assert (snap["a"]["inner_step"], snap["a"]["last_loss"]) == (50, 2.75)
        assert (snap["b"]["inner_step"], snap["b"]["last_loss"]) == (7, None)
        for s in ("a", "b"):
            assert snap[s]["alive"] and 0.0 <= snap[s]["heartbeat_age_s"] <= CFG.heartbeat_timeout_s
            assert snap[s]["last_heartbeat"] == pytest.approx(now - snap[s]["heartbeat_age_s"])
        page = {row["site_id"]: row for row in build_status(core.snapshot(time.monotonic()))["sites"]}
        assert (page["a"]["inner_step"], page["a"]["train_loss"]) == (50, 2.75) and page["a"]["state"] != "dead"
        core.leave("b", now=time.monotonic())
        gone = core.snapshot(time.monotonic())["sites"]["b"]
        assert gone["left"] and not gone["alive"] and gone["heartbeat_age_s"] > CFG.heartbeat_timeout_s
    finally:
        core.close()


def test_status_writes_are_bounded_per_site_and_interval(etcd_cluster) -> None:  # noqa: F811
    core = _core(etcd_cluster, status_interval_s=60.0)
    try:
        core.join("a", "addr-a", now=time.monotonic())
        core.heartbeat("a", now=time.monotonic(), inner_step=1, last_loss=4.0)
        first = _status_rev(core, "a")
        assert first > 0
        for step in range(2, 12):  # ten more heartbeats within the interval: keep-alives only
            assert core.heartbeat("a", now=time.monotonic(), inner_step=step, last_loss=4.0 - step / 10).known
        assert _status_rev(core, "a") == first
        assert core.snapshot(time.monotonic())["sites"]["a"]["inner_step"] == 1  # the last written one
        kv = core.store.etcd.get(core.store._k("status", "a"))
        assert kv.lease == core.store.etcd.get(core.store._k("alive", "a")).lease  # it dies with the site
    finally:
        core.close()
