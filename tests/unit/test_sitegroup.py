"""Pure parts of the site group (issue 14): the half-round rule, per-rank plans,
slices, checksums and rank addresses through the rendezvous and its proto."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtrain.errors import SiteGroupError
from dtrain.protocol import Member, RoundPlan
from dtrain.rendezvous import RendezvousConfig, RendezvousCore
from dtrain.rendezvous.grpc import plan_from_proto, plan_to_proto
from dtrain.sitegroup import RankView, SliceMap, combine_checksums, decide_agreement, rank_donors, rank_plan


def _views(n=2, **change):
    vs = [RankView(rank=j, kind="plan", plan_round=3, members=("site-0", "site-1"), rounds_applied=3) for j in range(n)]
    if change:
        vs[-1] = dataclasses.replace(vs[-1], **change)
    return vs


def test_agreement_when_every_rank_holds_the_same_plan():
    ok, why = decide_agreement(_views())
    assert ok and "round 3" in why


@pytest.mark.parametrize(
    "change, word",
    [
        ({"kind": "wait", "plan_round": None, "members": ()}, "decision"),
        ({"plan_round": 4}, "round 4"),
        ({"members": ("site-0",)}, "members"),
        ({"rounds_applied": 2}, "applied 2 rounds"),
    ],
)
def test_a_rank_that_disagrees_keeps_the_whole_site_out(change, word):
    ok, why = decide_agreement(_views(**change))
    assert not ok and word in why and "rank 1" in why


def test_no_plan_is_no_agreement():
    vs = [RankView(rank=j, kind="missed", plan_round=None, members=(), rounds_applied=3) for j in range(2)]
    assert decide_agreement(vs) == (False, "no plan (missed)")


def _plan(k0=2, k1=2):
    def member(i, k):
        addrs = tuple(f"h{i}:{100 + j}" for j in range(k)) if k > 1 else ()
        return Member(site_id=f"site-{i}", address=f"h{i}:100", rank_addresses=addrs)

    return RoundPlan(round=5, members=(member(0, k0), member(1, k1)), reduce_timeout_s=1.0, broadcast_timeout_s=2.0)


def test_rank_plan_uses_each_members_same_rank():
    p = rank_plan(_plan(), 1, 2)
    assert [m.address for m in p.members] == ["h0:101", "h1:101"]
    assert p.round == 5 and p.site_ids == ("site-0", "site-1")
    assert [m.address for m in rank_plan(_plan(1, 1), 0, 1).members] == ["h0:100", "h1:100"]


def test_rank_plan_refuses_sites_with_other_rank_counts():
    with pytest.raises(SiteGroupError, match="site-1 runs 1 ranks per site, this site 2"):
        rank_plan(_plan(2, 1), 0, 2)
    assert [m.site_id for m in rank_donors(_plan(2, 1).members, 1, 2)] == ["site-0"]


def test_member_rank_address():
    m = Member(site_id="s", address="a")
    assert m.num_ranks == 1 and m.rank_address(0) == "a"
    with pytest.raises(KeyError, match="no rank 1"):
        m.rank_address(1)


def test_combined_checksum_depends_on_rank_order():
    assert combine_checksums(["a", "b"]) != combine_checksums(["b", "a"])
    assert combine_checksums(["a", "b"]) == combine_checksums(["a", "b"])


def test_slices_partition_replicated_tensors_as_views():
    ts = [torch.arange(7.0), torch.arange(5.0).reshape(5, 1) + 100, torch.zeros(0), torch.arange(4.0) + 200]
    kinds = ["param", "param", "param", "buffer"]
    everything = sorted(float(v) for t in ts for v in t.reshape(-1))
    seen, seen_kinds = [], []
    for k in range(3):
        local, lk = SliceMap(ts, kinds, k, 3).local()
        assert sum(t.numel() for t in local) == (6 if k < 2 else 4)  # S = ceil(16 / 3)
        seen += [float(v) for t in local for v in t]
        seen_kinds += lk
    assert sorted(seen) == everything  # disjoint and complete
    assert seen_kinds == ["param", "param", "param", "buffer"]
    local, _ = SliceMap(ts, kinds, 1, 3).local()  # elements 6..11: ts[0][6], ts[1][0..4]
    local[1].add_(0.5)  # views: writes reach the model's tensors
    assert ts[1].reshape(-1).tolist() == [100.5, 101.5, 102.5, 103.5, 104.5]


def test_slices_refuse_a_bad_rank():
    with pytest.raises(ValueError, match="rank must be in"):
        SliceMap([torch.zeros(2)], ["param"], 2, 2)


def test_rank_addresses_travel_through_the_rendezvous_and_its_proto():
    core = RendezvousCore(RendezvousConfig(min_sites=2))
    core.join("site-0", "h0:1", now=0.0, rank_addresses=("h0:1", "h0:2"))
    info = core.join("site-1", "h1:1", now=0.0)
    assert info.members == (Member(site_id="site-0", address="h0:1", rank_addresses=("h0:1", "h0:2")),)
    core.ready("site-0", 0, now=0.1)
    d = core.ready("site-1", 0, now=0.1)
    assert d.plan is not None
    assert plan_from_proto(plan_to_proto(d.plan)) == d.plan
    assert d.plan.members[1].rank_addresses == ()  # a single-process site's plan is as before


def test_torchrun_argv_wraps_a_worker_command():
    from dtrain.app.ranks import torchrun_argv

    argv = torchrun_argv(["py", "-m", "dtrain", "worker", "--site-id", "s"], num_ranks=2, max_restarts=1)
    assert argv[:3] == ["py", "-m", "torch.distributed.run"]
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    # torchrun's agent binds its own rendezvous port: none is picked here to race for
    assert "--standalone" in argv and "--master-port" not in argv
    assert argv[argv.index("--max-restarts") + 1] == "1"
    assert argv[-5:] == ["-m", "dtrain", "worker", "--site-id", "s"]
    with pytest.raises(ValueError, match="worker_argv must start with"):
        torchrun_argv(["py", "worker.py"], num_ranks=2)


def test_worker_config_refuses_an_unknown_parallel_mode():
    from dtrain.app.worker import WorkerConfig

    with pytest.raises(ValueError, match="parallel"):
        WorkerConfig(parallel="tp")


@pytest.mark.timeout(20)
def test_lost_notices_reach_the_other_ranks_through_a_store():
    import time as _time

    import torch.distributed as dist

    from dtrain.sitegroup.notices import LostNotices

    store = dist.HashStore()
    got: list[list[str]] = []

    def on_lost(ids):
        got.append(ids)
        return frozenset(ids) if len(got) == 1 else frozenset()  # the repeat changes nothing

    rank0 = LostNotices(store, rank=0, on_lost=lambda ids: frozenset())
    rank1 = LostNotices(store, rank=1, on_lost=on_lost, poll_s=0.01)
    try:
        rank0.post(["site-2", "site-1"])
        rank0.post(["site-1", "site-2"])  # the same set again: not posted
        rank0.post(["site-1", "site-2", "site-3"])
        deadline = _time.monotonic() + 10
        while rank1.num_received < 2 and _time.monotonic() < deadline:
            _time.sleep(0.01)
        assert rank0.num_posted == 2
        assert got == [["site-1", "site-2"], ["site-1", "site-2", "site-3"]]
        assert (rank1.num_received, rank1.num_used) == (2, 1)
        assert rank1.lost == {"site-1", "site-2", "site-3"}
    finally:
        rank1.close()
        rank0.close()


@pytest.mark.parametrize("num_fragments", [2, 3])
def test_each_ranks_fragments_partition_its_own_buckets_contiguously(num_fragments):
    from dtrain.buckets import BucketConfig, BucketLayout
    from dtrain.streaming import fragment_buckets

    tensors = [torch.zeros(40, 7), torch.zeros(7), torch.zeros(1, 40), torch.zeros(1)]
    kinds = ["param"] * len(tensors)
    cfg = BucketConfig(bucket_bytes=256, chunk_bytes=128)
    for rank in range(2):
        local, local_kinds = SliceMap(tensors, kinds, rank, 2).local()
        layout = BucketLayout([t.numel() for t in local], local_kinds, cfg)
        frags = fragment_buckets(len(layout), num_fragments)
        assert len(frags) == num_fragments and all(frags)
        flat = [b for f in frags for b in f]
        assert flat == list(range(len(layout)))  # disjoint, covering, in order (contiguous groups)
        assert max(map(len, frags)) - min(map(len, frags)) <= 1


def test_rank_plan_keeps_every_field_of_the_site_plan_but_the_addresses():
    """A copy field by field once dropped the datagram key: every site group on the datagram
    path then crashed at round 0 ("datagram key must be 32 bytes, got 0")."""
    import dataclasses

    from dtrain.protocol import Member, RoundPlan

    key = bytes(range(32))
    plan = RoundPlan(
        round=3,
        members=(
            Member(site_id="a", address="h:1", rank_addresses=("h:1", "h:2")),
            Member(site_id="b", address="h:3", rank_addresses=("h:3", "h:4")),
        ),
        reduce_timeout_s=1.5,
        broadcast_timeout_s=2.5,
        datagram_key=key,
    )
    mine = rank_plan(plan, 1, 2)
    assert [m.address for m in mine.members] == ["h:2", "h:4"]
    for f in dataclasses.fields(RoundPlan):
        if f.name != "members":
            assert getattr(mine, f.name) == getattr(plan, f.name), f.name
    assert mine.datagram_key == key
    # a one-process site's plan (rank 0 of 1) is its own plan
    single = dataclasses.replace(plan, members=(Member(site_id="a", address="h:1"), Member(site_id="b", address="h:3")))
    assert rank_plan(single, 0, 1) == single


def test_a_site_lines_datagram_counters_sum_every_ranks_even_a_counter_one_rank_lacks():
    """A rank's transport adds ``rejected_<code>`` when it first refuses something: rank 1 may
    have one that rank 0 lacks (a K = 2 site refused late datagrams after a stall crashed its
    round line with a KeyError)."""
    from dtrain.app.worker import _site_counters

    ranks = [
        {"datagram": {"datagrams_sent": 10, "rate_mbit": 100.0, "path": "udp"}},
        {"datagram": {"datagrams_sent": 5, "rate_mbit": 50.0, "rejected_failed_precondition": 3, "path": "udp"}},
    ]
    assert _site_counters(ranks) == {
        "datagrams_sent": 15,
        "rate_mbit": 150.0,
        "rejected_failed_precondition": 3,
        "path": "udp",
    }
    assert _site_counters(ranks[:1]) is ranks[0]["datagram"]
    assert _site_counters([{"datagram": None}, ranks[1]]) is None
