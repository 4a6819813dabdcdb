"""No site left behind (issue 33): a site whose θ is behind the group's round and that
finds no member to pull from never adopts the round number with its old θ; it raises
``LeftBehind`` naming itself and the round it is stuck at (the worker exits with its own
code: tests/fault/test_multiprocess_faults.py). In-process sites (one network, one
rendezvous)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dtrain.buckets import BucketConfig
from dtrain.configs import DiLoCoConfig, GroupConfig
from dtrain.diloco import DiLoCo
from dtrain.errors import LeftBehind
from dtrain.rendezvous import InprocRendezvousClient, RendezvousConfig, RendezvousCore
from dtrain.rounds.outcome import RoundStatus
from dtrain.transports.inproc import InprocNetwork, InprocTransport

pytestmark = pytest.mark.timeout(60)

H = 3
PULL_S = 1.0  # the state-pull budget: how long a site behind looks for a member


def _site(
    site_id: str,
    net: InprocNetwork,
    core: RendezvousCore,
    *,
    pull_s: float = PULL_S,
    run_rounds: int | None = None,
    bucket_bytes: int = 512,
) -> DiLoCo:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = DiLoCoConfig(
        site_id=site_id,
        sync_every=H,
        hook_optimizer=False,
        buckets=BucketConfig(bucket_bytes=bucket_bytes, chunk_bytes=min(256, bucket_bytes)),
        group=GroupConfig(state_pull_timeout_s=pull_s, run_rounds=run_rounds),
    )
    return DiLoCo(model, opt, config=cfg, transport=InprocTransport(net), rendezvous=InprocRendezvousClient(core))


def _round(d: DiLoCo, seed: int) -> None:
    """H inner steps, then the round (d.step runs it at the H-th)."""
    gen = torch.Generator().manual_seed(seed)
    opt = d.inner_optimizer
    for _ in range(H):
        d.model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        d.step()


def _together(sites: list[DiLoCo], seed: int) -> None:
    threads = [threading.Thread(target=_round, args=(d, seed + i)) for i, d in enumerate(sites)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)


def _cut_from_the_last_round(pull_s: float = PULL_S) -> tuple[DiLoCo, DiLoCo]:
    """a and b run rounds 0 and 1 together; a runs the last round (2) alone, cutting b."""
    net = InprocNetwork()
    core = RendezvousCore(RendezvousConfig(min_sites=1, quorum_timeout_s=0.3, heartbeat_interval_s=0.1))
    a, b = _site("a", net, core, pull_s=pull_s), _site("b", net, core, pull_s=pull_s)
    _together([a, b], seed=1)
    _together([a, b], seed=3)
    assert a.round == b.round == 2 and a.site_checksum() == b.site_checksum()
    _round(a, seed=5)  # the last round (2): b is cut as a straggler
    assert a.round == 3 and a.last_outcome.result.members == ("a",)
    assert a.site.last_plan.left_out == ("b",)
    return a, b


def test_the_site_that_finished_waits_for_the_straggler_it_left_out_to_catch_up():
    """a ends the run with round 2 but stays a member (serving θ) until b, cut from that
    round, resynced from it and left: both end on the same θ."""
    a, b = _cut_from_the_last_round(pull_s=20.0)
    closing = threading.Thread(target=a.close)
    try:
        closing.start()
        time.sleep(0.5)  # b is slower: it reaches the last round after a finished
        assert closing.is_alive()  # a waits for b
        _round(b, seed=6)  # missed round 2: resyncs from a
        assert b.last_outcome.status == RoundStatus.RESYNCED and b.round == 3
        assert b.site_checksum() == a.site_checksum()
        t0 = time.monotonic()
        b.close()
        closing.join(timeout=10)
        assert not closing.is_alive() and time.monotonic() - t0 < 5.0  # a left once b did, not at 20 s
    finally:
        a.close(wait=False)
        b.close(wait=False)


def test_a_site_that_missed_the_last_round_after_the_others_left_raises_left_behind():
    a, b = _cut_from_the_last_round()
    try:
        t0 = time.monotonic()
        a.close()  # a waits PULL_S for b, then leaves: nobody holds round 3's θ for b
        assert time.monotonic() - t0 >= PULL_S
        with pytest.raises(LeftBehind) as err:
            _round(b, seed=6)  # b: missed round 2, resyncs, finds no member
        e = err.value
        assert (e.site_id, e.round, e.group_round) == ("b", 2, 3)
        assert "b is left behind at round 2 (the group is at round 3)" in str(e)
        assert b.round == 2  # never the group's round number with its old θ
    finally:
        a.close(wait=False)
        b.close(wait=False)


def _ran_two_rounds_and_left(net: InprocNetwork, core: RendezvousCore) -> DiLoCo:
    """Site a, which ran rounds 0 and 1 alone and left: the group is at round 2 with no member."""
    a = _site("a", net, core)
    _round(a, seed=1)
    _round(a, seed=2)
    a.close()
    return a


def test_a_site_joining_after_every_member_left_raises_left_behind():
    net, core = InprocNetwork(), RendezvousCore(RendezvousConfig(min_sites=1, quorum_timeout_s=0.3))
    a = _ran_two_rounds_and_left(net, core)
    try:
        with pytest.raises(LeftBehind) as err:
            _site("c", net, core)  # a fresh θ (round 0) and the group at round 2
        assert (err.value.site_id, err.value.round, err.value.group_round) == ("c", 0, 2)
    finally:
        a.close(wait=False)


def test_a_site_joining_after_the_runs_last_round_is_left_behind_at_once_not_after_the_pull_budget():
    """``GroupConfig.run_rounds``: the group's next round is past the run's rounds, so every member
    finished it and none comes back with its θ; the joiner does not wait ``state_pull_timeout_s``."""
    net, core = InprocNetwork(), RendezvousCore(RendezvousConfig(min_sites=1, quorum_timeout_s=0.3))
    a = _ran_two_rounds_and_left(net, core)
    try:
        t0 = time.monotonic()
        with pytest.raises(LeftBehind) as err:
            _site("c", net, core, pull_s=30.0, run_rounds=2)
        assert time.monotonic() - t0 < 10.0  # not the 30 s budget (the test's own limit is 60 s)
        assert (err.value.site_id, err.value.round, err.value.group_round) == ("c", 0, 2)
        assert "the run ended (its 2 rounds ran) and no member is left" in str(err.value)
    finally:
        a.close(wait=False)


def test_a_site_cut_while_a_member_is_live_resyncs_to_its_theta():
    """The ordinary case is unchanged: a member is live, the site resyncs to its θ."""
    net, core = InprocNetwork(), RendezvousCore(RendezvousConfig(min_sites=1, quorum_timeout_s=0.3))
    a, b = _site("a", net, core), _site("b", net, core)
    try:
        _together([a, b], seed=1)
        _round(a, seed=5)  # b cut from round 1
        _round(b, seed=6)
        assert b.last_outcome.status == RoundStatus.RESYNCED
        assert b.round == a.round == 2 and b.site_checksum() == a.site_checksum()
    finally:
        a.close(wait=False)
        b.close(wait=False)


def _three_sites_that_will_all_miss_round_2(monkeypatch) -> list[DiLoCo]:
    """Sites a, b and c after rounds 0 and 1 together; every one will read round 2's plan past
    its reduce deadline (``plan_expired`` says so: every site stalled, the chaos smoke under
    overload)."""
    import dtrain.site as site_mod

    real = site_mod.plan_expired

    def stalled_at_round_2(plan):
        return (True, f"round {plan.round}: every site stalled (test)") if plan.round == 2 else real(plan)

    monkeypatch.setattr(site_mod, "plan_expired", stalled_at_round_2)
    net = InprocNetwork()
    core = RendezvousCore(RendezvousConfig(min_sites=3, quorum_timeout_s=5.0, heartbeat_interval_s=0.1))
    sites = [_site(s, net, core, pull_s=30.0) for s in ("a", "b", "c")]
    try:
        _together(sites, seed=1)
        _together(sites, seed=3)
    except BaseException:
        for d in sites:
            d.close(wait=False)
        raise
    return sites


def test_a_round_every_member_missed_is_void_and_every_site_goes_on_from_the_same_theta(monkeypatch):
    """Every member read round 2's plan past its reduce deadline (every site stalled: the chaos
    smoke under overload): none ran it, so no site has round 3's θ to pull. Each resync sees
    every other member skipped round 2 as it did and counts it void (θ unchanged, no outer
    step) instead of waiting for a donor at round 3 that can never exist; the next round runs
    with every site on the same θ."""
    sites = _three_sites_that_will_all_miss_round_2(monkeypatch)
    try:
        assert {d.round for d in sites} == {2}
        before = sites[0].site_checksum()
        t0 = time.monotonic()
        _together(sites, seed=5)  # round 2: every site misses it
        assert time.monotonic() - t0 < 20.0  # not the 30 s pull budget
        assert [d.last_outcome.status for d in sites] == [RoundStatus.RESYNCED] * 3
        assert [d.round for d in sites] == [3, 3, 3]
        # each site counts it void itself, or (slower to ask) takes round 3 from one that did
        voided = [d for d in sites if d.site.last_catch_up.void is not None]
        assert voided and all("skipped it too" in d.site.last_catch_up.void for d in voided)
        assert all(d.site.last_catch_up.rounds in (2, 3) for d in sites)
        assert {d.site_checksum() for d in sites} == {before}  # a void round changes no θ
        _together(sites, seed=7)  # round 3 runs with all three
        assert [d.last_outcome.status for d in sites] == [RoundStatus.APPLIED] * 3
        assert [d.round for d in sites] == [4, 4, 4]
        assert len({d.site_checksum() for d in sites}) == 1 and sites[0].site_checksum() != before
    finally:
        for d in sites:
            d.close(wait=False)


def test_a_round_one_member_ran_is_not_void_and_the_members_that_skipped_it_catch_up_from_it(monkeypatch):
    """Only b and c read round 2's plan too late; a ran it (the owners b and c refused its
    contributions, and nobody took the mean of the bucket a owns, so its θ passed the round
    unchanged at a). b and c do not count the round void on their own: a says it did not skip
    it. They pull round 3 from a, and every site runs round 3 on the same θ."""
    import dtrain.site as site_mod

    real = site_mod.plan_expired

    def late_at_b_and_c(plan):
        if plan.round == 2 and threading.current_thread().name in ("b", "c"):
            return True, "b and c stalled (test)"
        return real(plan)

    monkeypatch.setattr(site_mod, "plan_expired", late_at_b_and_c)
    net = InprocNetwork()
    core = RendezvousCore(
        RendezvousConfig(
            min_sites=3, quorum_timeout_s=5.0, heartbeat_interval_s=0.1, reduce_timeout_s=1.0, broadcast_timeout_s=2.0
        )
    )
    sites = [_site(s, net, core, pull_s=30.0, bucket_bytes=64) for s in ("a", "b", "c")]
    assert len(sites[0].state) == 3  # a bucket per member

    def together(seed: int) -> None:
        threads = [
            threading.Thread(target=_round, args=(d, seed + i), name=d.config.site_id) for i, d in enumerate(sites)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)

    try:
        together(1)
        together(3)
        together(5)  # round 2: a runs it, b and c skip it
        assert [d.last_outcome.status for d in sites] == [RoundStatus.APPLIED] + [RoundStatus.RESYNCED] * 2
        assert [d.round for d in sites] == [3, 3, 3] and len({d.site_checksum() for d in sites}) == 1
        assert [d.site.last_catch_up.void for d in sites[1:]] == [None, None]
        together(7)
        assert [d.last_outcome.status for d in sites] == [RoundStatus.APPLIED] * 3
        assert [d.round for d in sites] == [4, 4, 4] and len({d.site_checksum() for d in sites}) == 1
    finally:
        for d in sites:
            d.close(wait=False)


def test_a_void_round_is_still_found_when_every_sites_first_resync_after_it_failed(monkeypatch):
    """Every member missed round 2 and every first resync failed (the rendezvous unreachable
    for each: deferred, training on locally). The resync that follows, asked by the
    rendezvous rather than by the missed plan, still knows the plan this site skipped, so
    the round is counted void then; before, only the first resync could, and the sites
    waited for a round 3 that no θ reflects for the rest of the run."""
    from dtrain.errors import RendezvousError

    sites = _three_sites_that_will_all_miss_round_2(monkeypatch)
    try:
        before = sites[0].site_checksum()
        for d in sites:  # each site's next registration fails once
            group, register = d.site.group, d.site.group.register_with_backoff
            fails = [RendezvousError("rendezvous unreachable (test)")]

            def once(budget_s, register=register, fails=fails):
                if fails:
                    raise fails.pop()
                return register(budget_s)

            monkeypatch.setattr(group, "register_with_backoff", once)
        _together(sites, seed=5)  # round 2: missed by all, every resync fails
        assert [d.last_outcome.status for d in sites] == [RoundStatus.DEFERRED] * 3
        assert [d.round for d in sites] == [2, 2, 2]
        _together(sites, seed=7)  # the resync the rendezvous asks for: round 2 is void
        assert [d.last_outcome.status for d in sites] == [RoundStatus.RESYNCED] * 3
        assert [d.round for d in sites] == [3, 3, 3] and {d.site_checksum() for d in sites} == {before}
        _together(sites, seed=9)
        assert [d.last_outcome.status for d in sites] == [RoundStatus.APPLIED] * 3
        assert len({d.site_checksum() for d in sites}) == 1
    finally:
        for d in sites:
            d.close(wait=False)
