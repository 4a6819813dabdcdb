"""Faults in fragment rounds (Streaming DiLoCo, dtrain/streaming.py): an owner killed
mid-fragment, a site killed between fragments, a straggler cut from a fragment's round.
Every round here overlaps τ = 1 inner step; survivors end with equal checksums."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dtrain.buckets import BucketConfig, assign_owners
from dtrain.rounds import BucketOutcome
from dtrain.sim import ClusterConfig, InprocCluster, Site, fast_diloco_config, fast_rendezvous_config

BUCKETS = BucketConfig(bucket_bytes=8, chunk_bytes=8)  # 4 buckets of 2 elements; F = 2: (0, 1), (2, 3)
P = 8


class Vec(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(P))


def inner_sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1)


def _cluster(**kw) -> InprocCluster:
    cfg = ClusterConfig(
        num_sites=3, diloco=fast_diloco_config(sync_every=4, buckets=BUCKETS, num_fragments=2, overlap_steps=1), **kw
    )
    return InprocCluster(Vec, inner_sgd, cfg)


def _step(site: Site, k: int) -> None:
    g = torch.Generator().manual_seed(k + 100 * site.index)
    site.model.w.grad = torch.randn(P, generator=g)
    site.optimizer.step()  # rounds start at steps 2, 4, 6, ... and merge one step later
    site.model.w.grad = None


def _close_all(c: InprocCluster) -> None:
    for s in c.live_sites:  # merge the rounds still in flight before comparing θ
        s.diloco.close()


@pytest.mark.timeout(60)
def test_owner_killed_mid_fragment_keeps_its_buckets_alike():
    """Round 1 syncs fragment 0 (buckets 0, 1): its owner of bucket 0 dies once a peer asks it
    for the mean. Survivors keep θ_0 as it was (the initial zeros) alike, the other bucket of the
    fragment is applied, fragment 1 is untouched by the round, and the next rounds go on without
    the dead site."""
    with _cluster() as c:
        ids = [s.site_id for s in c.sites]
        owner0 = assign_owners(2, ids)[0]  # owner of the fragment's first bucket (bucket 0)
        victim = ids.index(owner0)
        c.kill_during_round(victim, round=1)
        c.run_steps(_step, 12, timeout_s=50)
        _close_all(c)
        survivors = c.live_sites
        assert victim not in [s.index for s in survivors] and len(survivors) == 2
        for s in survivors:
            r1 = next(r for r in s.results if r.round == 1)
            assert r1.fragment == 0 and r1.buckets == [0, 1]
            assert r1.bucket_outcome[0] is BucketOutcome.OWNER_LOST
            later = [r for r in s.results if r.round > 1]
            assert later and all(r.members == tuple(x.site_id for x in survivors) for r in later[-2:])
        assert len(set(c.checksums())) == 1
        assert all(s.diloco.round == survivors[0].diloco.round >= 5 for s in survivors)


@pytest.mark.timeout(60)
def test_site_killed_between_fragments_is_dropped_and_the_rest_end_equal():
    """Site 2 dies after merging round 1 (step 5), before round 2 (fragment 1) starts: the others
    form the next fragment rounds without it once the rendezvous holds it dead."""
    with _cluster() as c:

        def step(site: Site, k: int) -> None:
            if k == 5 and site.index == 2:
                assert not site.diloco.streaming.in_flight  # between two fragment rounds
                c.kill(2)
                return
            _step(site, k)

        c.run_steps(step, 12, timeout_s=50)
        _close_all(c)
        live = c.live_sites
        assert [s.index for s in live] == [0, 1]
        assert c.sites[2].diloco.round == 2
        assert all(s.diloco.round == 6 for s in live)
        assert live[0].results[-1].members == ("site-0", "site-1")
        assert len(set(c.checksums())) == 1


@pytest.mark.timeout(60)
def test_a_straggler_cut_from_a_fragment_round_resyncs_that_fragment_only():
    """Site 2 is late for round 1 (fragment 0): the others run it without it; site 2 finds the
    round missed, pulls the state, and resets only fragment 0 (whose θ changed); fragment 1 keeps
    its local progress and its residuals (the same objects as before the round). All end equal."""
    rdv = fast_rendezvous_config(3, quorum_timeout_s=0.8, heartbeat_timeout_s=10.0)
    seen: dict[str, object] = {}
    resynced = threading.Event()
    with _cluster(rendezvous=rdv) as c:

        def step(site: Site, k: int) -> None:
            if site.index != 2 and k == 5:  # round 2 starts once site 2 is back (it misses round 1 only)
                assert resynced.wait(20.0)
            if site.index == 2 and k == 3:
                seen["residuals_before"] = list(site.state.residuals)
                time.sleep(2.0)  # step 4 (round 1's start) comes after the quorum timeout
            if site.index == 2 and k == 5:  # after step 5: round 1's outcome was merged
                st = site.state
                seen["status"] = site.outcomes[-1].status
                w = site.model.w.detach()
                seen["frag0_reset"] = torch.equal(w[:4], torch.cat([st.theta[0], st.theta[1]]).detach())
                seen["frag1_local"] = not torch.equal(w[4:], torch.cat([st.theta[2], st.theta[3]]).detach())
                before = seen.pop("residuals_before")
                seen["frag1_residuals"] = st.residuals[2] is before[2] and st.residuals[3] is before[3]
                resynced.set()
            _step(site, k)

        c.run_steps(step, 12, timeout_s=50)
        _close_all(c)
        assert seen == {"status": "resynced", "frag0_reset": True, "frag1_local": True, "frag1_residuals": True}
        r1 = [next(r for r in s.results if r.round == 1) for s in c.sites[:2]]
        assert all(r.members == ("site-0", "site-1") for r in r1)
        assert len(set(c.checksums())) == 1
        assert len({s.diloco.round for s in c.sites}) == 1
