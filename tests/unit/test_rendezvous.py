"""Quorum decisions (pure, with ``now``) and the rendezvous core's membership rules."""

from __future__ import annotations

import pytest

from dtrain.rendezvous import RendezvousConfig, RendezvousCore, SiteIdTaken, decide_quorum

pytestmark = pytest.mark.timeout(30)

CFG = RendezvousConfig(
    min_sites=2,
    initial_sites=3,
    quorum_timeout_s=5.0,
    heartbeat_interval_s=1.0,
    heartbeat_timeout_s=3.0,
    reduce_timeout_s=10.0,
    broadcast_timeout_s=20.0,
)


def _decide(
    *,
    round: int = 1,
    live: set[str],
    ready: dict[str, float],
    joined: int = 3,
    now: float = 100.0,
    config: RendezvousConfig = CFG,
):
    return decide_quorum(round=round, live=live, ready=ready, joined_ever=joined, now=now, config=config)


def test_all_live_sites_ready_starts_at_once() -> None:
    members, reason = _decide(live={"a", "b", "c"}, ready={"c": 99.9, "a": 99.0, "b": 100.0})
    assert members == ["a", "b", "c"]
    assert "all 3 live sites are ready" in reason


def test_waits_for_stragglers_until_the_quorum_timeout() -> None:
    members, reason = _decide(live={"a", "b", "c"}, ready={"a": 98.0, "b": 99.0}, now=100.0)
    assert members is None
    assert "2 of 3" in reason and "3.0s more" in reason


def test_quorum_timeout_cuts_a_straggler_and_names_it() -> None:
    members, reason = _decide(live={"a", "b", "c"}, ready={"a": 94.0, "b": 99.0}, now=100.0)
    assert members == ["a", "b"]
    assert "quorum timeout" in reason and "'c'" in reason


def test_min_sites_not_met_says_why() -> None:
    members, reason = _decide(live={"a", "b", "c"}, ready={"a": 90.0}, now=100.0)
    assert members is None
    assert "min_sites is 2" in reason and "1 of 3" in reason
    members, reason = _decide(live={"a"}, ready={"a": 90.0}, now=100.0)
    assert members is None
    assert "only 1 live site(s), min_sites is 2" == reason


def test_dead_or_unknown_ready_sites_do_not_count() -> None:
    members, reason = _decide(live={"a", "b"}, ready={"a": 99.0, "b": 99.5, "ghost": 90.0})
    assert members == ["a", "b"]
    members, reason = _decide(live={"a"}, ready={"ghost": 90.0})
    assert members is None and reason == "no live site is ready"


def test_round_zero_waits_for_initial_sites() -> None:
    members, reason = _decide(round=0, live={"a", "b"}, ready={"a": 0.0, "b": 0.0}, joined=2, now=1000.0)
    assert members is None
    assert "round 0 waits for 3 sites to join (2 so far)" == reason
    members, _ = _decide(round=0, live={"a", "b", "c"}, ready={"a": 0.0, "b": 0.0, "c": 1.0}, joined=3, now=1.0)
    assert members == ["a", "b", "c"]
    # later rounds do not wait for initial_sites
    members, _ = _decide(round=1, live={"a", "b"}, ready={"a": 0.0, "b": 0.0}, joined=2, now=1.0)
    assert members == ["a", "b"]


def _core(**kw) -> RendezvousCore:
    base = dict(
        min_sites=1,
        initial_sites=2,
        quorum_timeout_s=5.0,
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=3.0,
        reduce_timeout_s=10.0,
        broadcast_timeout_s=20.0,
    )
    base.update(kw)
    return RendezvousCore(RendezvousConfig(**base))


def test_core_forms_a_round_with_a_plan() -> None:
    core = _core()
    j = core.join("a", "addr-a", now=0.0)
    assert j.next_round == 0 and j.members == () and not j.needs_state
    assert core.ready("a", 0, now=0.1).status == "wait"  # round 0 waits for initial_sites=2
    core.join("b", "addr-b", now=0.2)
    d = core.ready("b", 0, now=0.3)
    assert d.status == "plan" and d.plan is not None
    assert d.plan.round == 0 and d.plan.site_ids == ("a", "b")
    assert d.plan.address_of("b") == "addr-b"
    assert (d.plan.reduce_timeout_s, d.plan.broadcast_timeout_s) == (10.0, 20.0)
    again = core.ready("a", 0, now=0.4)  # a's long poll sees the same plan
    assert again.status == "plan" and again.plan == d.plan
    assert core.next_round == 1
    j = core.join("c", "addr-c", now=0.5)
    assert j.next_round == 1 and j.needs_state and {m.site_id for m in j.members} == {"a", "b"}


def test_silent_site_is_told_to_resync_on_its_next_heartbeat() -> None:
    core = _core()
    core.join("a", "addr-a", now=0.0)
    core.join("b", "addr-b", now=0.0)
    hb = core.heartbeat("a", now=2.5)  # within heartbeat_timeout_s=3
    assert hb.known and not hb.resync_required
    hb = core.heartbeat("b", now=3.5)  # silent for 3.5 s > 3 s
    assert hb.known and hb.resync_required
    assert "no heartbeat for 3.5s" in hb.reason and "declared dead" in hb.reason
    # b is not live until it re-joins: round 0 cannot count it, and ready says missed
    d = core.ready("b", 0, now=3.6)
    assert d.status == "missed" and "declared dead" in d.reason
    # after re-joining (the resync path) it is in good standing again
    core.join("b", "addr-b", now=3.7)
    assert not core.heartbeat("b", now=3.8).resync_required


def test_heartbeat_lists_the_sites_held_dead_or_gone() -> None:
    """``HeartbeatInfo.dead``: sites silent for longer than heartbeat_timeout_s (3 s here)
    and sites that left; a silent site that heartbeats again leaves the list."""
    core = _core()
    for s in ("a", "b", "c"):
        core.join(s, f"addr-{s}", now=0.0)
    assert core.heartbeat("a", now=2.0).dead == ()
    core.leave("c", now=2.5)
    assert core.heartbeat("a", now=2.9).dead == ("c",)
    assert core.heartbeat("a", now=3.5).dead == ("b", "c")  # b silent since 0.0
    core.heartbeat("b", now=3.6)  # back (and told to resync): alive again
    assert core.heartbeat("a", now=3.7).dead == ("c",)
    core.join("c", "addr-c", now=3.8)  # a site that left and joins again is no longer gone
    assert core.heartbeat("a", now=3.9).dead == ()


def test_a_site_reported_unreachable_is_dead_once_silent_for_the_suspect_timeout() -> None:
    """A member's data path found c gone (heartbeat ``unreachable``): c is dead once
    silent for 1.5 × heartbeat_interval_s (1.5 s) instead of heartbeat_timeout_s (3 s),
    so the next round forms without it at once; a suspected site that heartbeats in
    time is cleared (b), and one that heartbeats too late must resync."""
    core = _core(min_sites=1, initial_sites=3)
    for s in ("a", "b", "c"):
        core.join(s, f"addr-{s}", now=0.0)
    for s in ("a", "b", "c"):
        core.ready(s, 0, now=0.1)
    assert core.next_round == 1
    core.heartbeat("b", now=1.0)
    hb = core.heartbeat("a", now=1.2, unreachable=["b", "c", "a", "nobody"])
    assert hb.dead == ()  # c silent for 1.2 s < 1.5 s
    assert core.ready("a", 1, now=1.3).status == "wait"  # c and b are live: waited for
    core.heartbeat("b", now=1.4)  # b answers in time: cleared
    assert core.heartbeat("a", now=1.7).dead == ("c",)  # c silent (since its ready) for 1.6 s > 1.5 s
    core.ready("b", 1, now=1.75)
    d = core.ready("a", 1, now=1.8)
    assert d.status == "plan" and d.plan.site_ids == ("a", "b")  # not waiting for c's 3 s timeout
    assert core.heartbeat("a", now=3.2).dead == ("c",)  # b, silent for 1.45 s, is not suspected any more
    hb = core.heartbeat("c", now=3.3)
    assert hb.resync_required and "(a found it unreachable)" in hb.reason


def test_suspect_timeout_must_lie_between_interval_and_timeout() -> None:
    with pytest.raises(ValueError, match="suspect_timeout_s"):
        RendezvousConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0, suspect_timeout_s=0.5)
    with pytest.raises(ValueError, match="suspect_timeout_s"):
        RendezvousConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0, suspect_timeout_s=6.0)
    assert RendezvousConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0).suspect_silence_s == 1.5


def test_unknown_site_heartbeat_asks_to_join() -> None:
    core = _core()
    hb = core.heartbeat("x", now=1.0)
    assert not hb.known and "join" in hb.reason


def test_restarted_core_adopts_the_round_a_site_asks_for() -> None:
    core = _core(initial_sites=1)  # a fresh (restarted) core knows nothing
    core.join("a", "addr-a", now=0.0)
    core.join("b", "addr-b", now=0.0)
    assert core.next_round == 0
    d = core.ready("a", 7, now=0.1)
    assert core.next_round == 7
    assert d.status == "wait"
    # every known site is ready, but a restarted core first waits heartbeat_timeout_s
    # so that sites it has not heard from yet can re-register
    d = core.ready("b", 7, now=0.2)
    assert d.status == "wait" and "restarted" in d.reason
    core.join("c", "addr-c", now=1.0)  # a third survivor re-registers during the grace
    assert core.ready("c", 7, now=1.1).status == "wait"
    for s in ("a", "b", "c"):
        core.heartbeat(s, now=2.0)
    d = core.ready("a", 7, now=3.2)
    assert d.status == "plan" and d.plan.round == 7 and d.plan.site_ids == ("a", "b", "c")
    assert core.next_round == 8


def test_round_zero_quorum_timeout_counts_from_the_last_initial_join() -> None:
    core = _core(initial_sites=3, quorum_timeout_s=1.0)
    for s in ("a", "b"):
        core.join(s, f"addr-{s}", now=0.0)
        assert core.ready(s, 0, now=0.1).status == "wait"
    core.join("c", "addr-c", now=2.0)  # a slow starter
    assert core.ready("a", 0, now=2.1).status == "wait"  # was: formed without c
    assert core.ready("c", 0, now=2.5).plan.site_ids == ("a", "b", "c")


def test_ready_for_a_round_that_already_ran_says_missed() -> None:
    core = _core(initial_sites=1)
    core.join("a", "addr-a", now=0.0)
    for r in range(10):
        assert core.ready("a", r, now=float(r)).status == "plan"
    # the plan of round 0 is no longer kept (only the last 8): "already ran"
    d = core.ready("a", 0, now=11.0)
    assert d.status == "missed" and d.reason == "round 0 already ran" and d.next_round == 10
    # a site that was not in a round that ran is told it started without it
    core.join("b", "addr-b", now=11.0)
    d = core.ready("b", 9, now=11.1)
    assert d.status == "missed" and "started without b" in d.reason


def test_leave_removes_the_site() -> None:
    core = _core(initial_sites=1)
    core.join("a", "addr-a", now=0.0)
    core.join("b", "addr-b", now=0.0)
    core.leave("b", now=0.1)
    d = core.ready("a", 0, now=0.2)
    assert d.status == "plan" and d.plan.site_ids == ("a",)


def test_first_round_after_a_restart_waits_for_initial_sites() -> None:
    """A run resumed from checkpoints at round 5: the fresh rendezvous applies the
    start-up rule to the first round it forms, not only to round 0."""
    core = _core(initial_sites=3, quorum_timeout_s=1.0, heartbeat_timeout_s=3.0)
    for s in ("a", "b"):
        core.join(s, f"addr-{s}", now=0.0)
        assert core.ready(s, 5, now=0.1).status == "wait"
    for t in (2.0, 4.0):
        core.heartbeat("a", now=t)
        core.heartbeat("b", now=t)
    d = core.ready("a", 5, now=4.1)  # past the restart grace, but only 2 of 3 joined
    assert d.status == "wait" and "waits for 3 sites to join" in d.reason
    core.join("c", "addr-c", now=4.5)
    assert core.ready("c", 5, now=4.6).plan.site_ids == ("a", "b", "c")


def test_a_resumed_run_with_no_restart_grace_forms_its_first_round_once_every_site_joined() -> None:
    """``dtrain launch --resume`` sets restart_grace_s 0: its rendezvous never restarts under
    running sites, and the start-up rule already waits for every site (fresh-user finding: its
    first round waited the 5 s grace with every site joined and ready)."""
    core = _core(initial_sites=2, quorum_timeout_s=1.0, heartbeat_timeout_s=5.0, restart_grace_s=0.0)
    core.join("a", "addr-a", now=0.0)
    assert "waits for 2 sites to join" in core.ready("a", 5, now=0.1).reason
    core.join("b", "addr-b", now=0.2)
    d = core.ready("b", 5, now=0.3)
    assert d.status == "plan" and d.plan.site_ids == ("a", "b"), d.reason
    # the default grace is the silence bound (5 s here): the same resume waits for it
    core = _core(initial_sites=2, quorum_timeout_s=1.0, heartbeat_timeout_s=5.0)
    core.join("a", "addr-a", now=0.0)
    core.ready("a", 5, now=0.1)
    core.join("b", "addr-b", now=0.2)
    assert "restarted" in core.ready("b", 5, now=0.3).reason
    with pytest.raises(ValueError, match="restart_grace_s must be none"):
        _core(restart_grace_s=-1.0)


def test_rendezvous_restarted_under_running_sites_does_not_wait_for_a_dead_one() -> None:
    """Only the rendezvous restarted (its survivors heartbeat before they re-join; the
    chaos soak's rv_kill): a site that died meanwhile must not hold the next round for
    STARTUP_WAIT_S (it did: 14 s in a soak, until the dead site was restarted). After
    the restart grace the usual quorum rule forms the round without it."""
    core = _core(initial_sites=3, quorum_timeout_s=1.0, heartbeat_timeout_s=3.0)
    for s in ("a", "b"):
        assert not core.heartbeat(s, now=0.0).known  # running sites, unknown to the fresh core
        core.join(s, f"addr-{s}", now=0.05)
        assert core.ready(s, 5, now=0.1).status == "wait"
    for t in (1.0, 2.0, 3.0):
        core.heartbeat("a", now=t)
        core.heartbeat("b", now=t)
    assert "restarted" in core.ready("a", 5, now=2.9).reason  # the grace: every live site may re-join
    d = core.ready("a", 5, now=3.2)
    assert d.status == "plan" and d.plan.site_ids == ("a", "b"), d.reason


def test_a_rendezvous_that_was_stopped_does_not_declare_every_site_dead() -> None:
    """SIGSTOP of the rendezvous for longer than heartbeat_timeout_s (the chaos soak's
    rv_stop): on SIGCONT its first call saw every site silent past the timeout and
    declared them all dead, so every site resynced. Its own silence does not count now;
    a site that really stopped is declared dead one timeout later."""
    core = _core(heartbeat_timeout_s=3.0)
    for s in ("a", "b"):
        core.join(s, f"addr-{s}", now=0.0)
    for t in (0.5, 1.0):
        core.heartbeat("a", now=t)
        core.heartbeat("b", now=t)
    hb = core.heartbeat("a", now=5.0)  # stopped from 1.0 to 5.0
    assert hb.dead == () and not hb.resync_required, hb
    assert not core.heartbeat("b", now=5.1).resync_required
    for t in (5.5, 6.5, 7.5):  # b stops for real after 5.1
        hb = core.heartbeat("a", now=t)
    assert "b" not in hb.dead
    assert core.heartbeat("a", now=8.7).dead == ("b",)


def test_every_member_learns_why_the_round_formed_whichever_call_formed_it() -> None:
    # The gRPC service forms plans through decide() (once per change), so a member's own
    # ready() finds the plan already formed: it must still get the quorum rule's reason.
    core = _core(initial_sites=3, quorum_timeout_s=1.0)
    for s in ("a", "b", "c"):
        core.join(s, f"addr-{s}", now=0.0)
    core.ready("a", 0, now=0.1)
    core.ready("b", 0, now=0.2)
    assert core.decide(now=1.3) == 1  # the quorum timeout cut c
    reasons = {s: core.ready(s, 0, now=1.4) for s in ("a", "b", "c")}
    assert reasons["a"].status == reasons["b"].status == "plan"
    assert "cutting ['c']" in reasons["a"].reason and reasons["a"].reason == reasons["b"].reason
    assert reasons["c"].status == "missed" and "straggler" in reasons["c"].reason


def test_a_site_id_held_by_a_live_site_at_another_address_is_refused_naming_the_holder() -> None:
    core = _core()
    core.join("a", "addr-a", now=0.0)
    with pytest.raises(SiteIdTaken, match="'a' is held by a live site at addr-a") as e:
        core.join("a", "addr-x", now=2.9)  # a's heartbeat (0.0) is within heartbeat_timeout_s=3
    assert "this one is at addr-x" in str(e.value)
    assert core.snapshot(3.0)["sites"]["a"]["address"] == "addr-a"  # the holder is untouched
    assert core.join("a", "addr-a", now=3.0).next_round == 0  # the holder's own re-join is fine


def test_a_restarted_site_at_a_new_address_is_accepted_once_the_old_one_is_dead() -> None:
    core = _core()
    core.join("a", "addr-a", now=0.0)
    core.join("b", "addr-b", now=0.0)
    for t in (1.0, 2.0, 3.0):  # the rendezvous hears from b all along (a gap of its own would not count)
        core.heartbeat("b", now=t)
    core.join("a", "addr-a2", now=3.5)  # a silent for 3.5 s > 3 s: dead, its id is free
    assert [m.address for m in core.join("c", "addr-c", now=3.6).members] == ["addr-a2", "addr-b"]
    for t in (4.5, 5.5, 6.5):
        core.heartbeat("c", now=t)
    core.heartbeat("b", now=7.0)  # b silent for 4 s: declared dead (must resync) ...
    assert core.heartbeat("b", now=7.0).resync_required
    core.join("b", "addr-b2", now=7.1)  # ... so a restarted b at a new address is accepted
    assert core.snapshot(7.2)["sites"]["b"]["address"] == "addr-b2"


def test_a_member_still_finishing_the_previous_round_is_held_not_cut_until_that_round_may_end() -> None:
    """decide_quorum's hold: c, live and still in round 0 (no report of it finished), is not cut
    from round 1 at the quorum timeout but only once round 0 may no longer run (hold_until); a
    dead site or one that finished round 0 (a straggler on compute) is cut at the timeout."""
    live, ready = {"a", "b", "c"}, {"a": 94.0, "b": 94.5}
    members, reason = decide_quorum(
        round=1, live=live, ready=ready, joined_ever=3, now=100.0, config=CFG, finishing=["c"], hold_until=104.0
    )
    assert members is None
    assert (
        reason == "2 of 3 live sites ready; ['c'] still finishing round 0 within its deadlines: waiting up to 4.0s more"
    )
    members, reason = decide_quorum(
        round=1, live=live, ready=ready, joined_ever=3, now=104.0, config=CFG, finishing=["c"], hold_until=104.0
    )
    assert members == ["a", "b"] and "cutting ['c']" in reason
    for finishing in ([], ["d"]):  # c finished round 0 / the one still in it is not live
        members, _ = decide_quorum(
            round=1, live=live, ready=ready, joined_ever=3, now=100.0, config=CFG, finishing=finishing, hold_until=104.0
        )
        assert members == ["a", "b"]


def test_a_site_whose_state_pull_ends_after_the_quorum_wait_is_not_waited_for() -> None:
    """decide_quorum's catching_up: j is live (registered, heartbeating) but pulling state. A pull
    that ends after the quorum wait would end (first ready + wait) does not hold the round: it
    forms as soon as every other live site is ready. A pull about to end is waited for as
    before (it gets into the round), and a site with no estimate is waited for as before."""
    live, ready = {"a", "b", "j"}, {"a": 99.0, "b": 99.5}
    wait_s = CFG.start_deadlines().quorum_timeout_s
    kw = dict(round=7, live=live, ready=ready, joined_ever=3, now=100.0, config=CFG)
    members, reason = decide_quorum(**kw, catching_up={"j": 99.0 + wait_s + 30.0})
    assert members == ["a", "b"], reason
    assert reason == "all 2 live sites ready but ['j'] pulling state past the quorum wait: not waited for"
    for catching in ({"j": 99.0 + wait_s - 1.0}, {}, {"x": 10**6}):  # about to end / no estimate / not live
        members, reason = decide_quorum(**kw, catching_up=catching)
        assert members is None and "2 of 3 live sites ready" in reason, (catching, reason)


def test_the_core_forms_rounds_without_a_joiner_whose_pull_has_long_to_go() -> None:
    """A joiner's heartbeats say when its pull should end (catch_up_eta_s): 60 s to go does not
    hold round 3 (a and b ready); once it asks for a round, or says nothing, it counts again."""
    core = _core(min_sites=1, initial_sites=2, quorum_timeout_s=5.0)
    for s in ("a", "b"):
        core.join(s, f"addr-{s}", now=0.0)
        core.ready(s, 0, now=0.1)
    core.join("j", "addr-j", now=0.5)
    core.heartbeat("j", now=0.6, catch_up_eta_s=60.0)
    for s in ("a", "b"):
        core.heartbeat(s, now=0.9, rounds_done=1)
    assert core.ready("a", 1, now=1.0).status == "wait"
    d = core.ready("b", 1, now=1.1)
    assert d.status == "plan" and d.plan.site_ids == ("a", "b") and d.plan.left_out == ("j",), d
    assert "pulling state past the quorum wait" in d.reason
    core.heartbeat("j", now=1.5)  # no estimate any more: waited for as any live site
    core.heartbeat("j", now=1.6, catch_up_eta_s=float("nan"))  # a bad one is ignored (as none)
    for s in ("a", "b"):
        core.heartbeat(s, now=1.9, rounds_done=2)
        core.ready(s, 2, now=2.0)
    assert core.ready("a", 2, now=2.1).status == "wait"


def test_the_core_holds_round_r_plus_1_for_a_member_that_has_not_finished_round_r() -> None:
    """Round 0 forms at 0.1 (broadcast 20 s, stall budget 5 s: it may run to 25.1). a and b finish
    round 0 (their heartbeats say rounds_done=1) and are ready for round 1 at 1.0; c heartbeats
    without having finished it: at the quorum timeout (6.0) it is held. Once its heartbeat says it
    finished round 0 (at 7.0), it gets the inner phase a and b took (0.1 s) plus the quorum wait
    (5 s): held to 12.1, then cut as a straggler on compute."""
    core = _core(min_sites=1, initial_sites=3)
    for s in ("a", "b", "c"):
        core.join(s, f"addr-{s}", now=0.0)
    for s in ("a", "b", "c"):
        core.ready(s, 0, now=0.1)
    for s in ("a", "b"):
        core.heartbeat(s, now=0.9, rounds_done=1)
        core.ready(s, 1, now=1.0)
    core.heartbeat("c", now=2.0, rounds_done=0)  # c says how far it is: not done with round 0
    core.heartbeat("c", now=4.5, rounds_done=0)
    d = core.ready("a", 1, now=6.6)
    assert d.status == "wait" and "['c'] still finishing round 0" in d.reason, d.reason
    core.heartbeat("c", now=7.0, rounds_done=1)
    d = core.ready("a", 1, now=7.1)
    assert d.status == "wait" and "['c'] finished round 0 late: waiting for its inner phase, up to 5.0s" in d.reason
    d = core.ready("a", 1, now=12.2)
    assert d.status == "plan" and d.plan.site_ids == ("a", "b"), d


def test_a_member_that_finished_the_previous_round_late_gets_its_inner_phase_and_joins() -> None:
    """As above, but c is ready at 8.0, within the inner phase it was given: round 1 forms with
    all three, where it used to be cut the moment it finished round 0 (and then resync)."""
    core = _core(min_sites=1, initial_sites=3)
    for s in ("a", "b", "c"):
        core.join(s, f"addr-{s}", now=0.0)
        core.ready(s, 0, now=0.1)
    for s in ("a", "b"):
        core.heartbeat(s, now=0.9, rounds_done=1)
        core.ready(s, 1, now=2.9)  # an inner phase of 2 s
    core.heartbeat("c", now=4.0, rounds_done=0)
    core.heartbeat("c", now=7.0, rounds_done=1)
    d = core.ready("a", 1, now=9.0)  # past the quorum wait (2.9 + 5)
    assert d.status == "wait" and "up to 5.0s more" in d.reason, d.reason  # 7.0 + 2 + 5 - 9
    d = core.ready("c", 1, now=9.5)
    assert d.status == "plan" and d.plan.site_ids == ("a", "b", "c"), d


def test_decide_quorum_waits_for_a_late_finisher_until_its_inner_phase_and_the_quorum_wait_end() -> None:
    live, ready = {"a", "b", "c"}, {"a": 94.0, "b": 94.5}
    wait_s = CFG.start_deadlines().quorum_timeout_s
    kw = dict(round=1, live=live, ready=ready, joined_ever=3, config=CFG)
    members, reason = decide_quorum(**kw, now=100.0, finished_late={"c": 99.0})
    assert members is None
    assert reason == (
        f"2 of 3 live sites ready; ['c'] finished round 0 late: waiting for its inner phase, up to {wait_s - 1:.1f}s more"
    )
    for late in ({"c": 99.0 - wait_s}, {}, {"d": 200.0}, {"a": 200.0}):  # over / none / not live / already ready
        members, reason = decide_quorum(**kw, now=100.0, finished_late=late)
        assert members == ["a", "b"] and "cutting ['c']" in reason, (late, reason)


def test_a_heartbeat_names_the_members_still_finishing_the_newest_round() -> None:
    """HeartbeatInfo.behind: the live members of the newest round formed here whose heartbeats
    have not said they finished it; a dead or gone member is not waited for."""
    core = _core(min_sites=1, initial_sites=3)
    for s in ("a", "b", "c"):
        core.join(s, f"addr-{s}", now=0.0)
    assert core.heartbeat("a", now=0.05).behind == ()  # no round formed yet
    for s in ("a", "b", "c"):
        core.heartbeat(s, now=0.06, rounds_done=0)
        core.ready(s, 0, now=0.1)
    assert core.heartbeat("a", now=0.5, rounds_done=1).behind == ("b", "c")
    assert core.heartbeat("b", now=0.6, rounds_done=1).behind == ("c",)
    core.leave("c", now=0.7)
    assert core.heartbeat("a", now=0.8).behind == ()


def test_a_site_whose_heartbeats_do_not_say_how_far_it_is_is_never_held_nor_waited_for() -> None:
    """A client that sends no rounds_done (an older one, or a test's bare client) is cut at the
    quorum timeout as before and never listed as behind."""
    core = _core(min_sites=1, initial_sites=2)
    for s in ("a", "b"):
        core.join(s, f"addr-{s}", now=0.0)
        core.ready(s, 0, now=0.1)
    core.heartbeat("a", now=0.5, rounds_done=1)
    assert core.heartbeat("b", now=0.6).behind == ()
    core.ready("a", 1, now=1.0)
    core.heartbeat("b", now=5.5)
    d = core.ready("a", 1, now=6.2)
    assert d.status == "plan" and d.plan.site_ids == ("a",), d
