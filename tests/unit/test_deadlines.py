"""Deadlines derived from the observed rounds and one stall budget (``dtrain.rendezvous.deadlines``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dtrain._proto.dtrain.v1 import rendezvous_pb2 as pb
from dtrain.protocol import Member, RoundPlan
from dtrain.rendezvous import RendezvousConfig, RendezvousCore
from dtrain.rendezvous.core import aged
from dtrain.rendezvous.deadlines import DeadlineConfig, RoundTimes, derive_deadlines, quantile, since_speedup
from dtrain.rendezvous.grpc import _decision_from_proto, plan_to_proto
from dtrain.site import plan_expired, probe_report
from dtrain.status import StatusLog
from dtrain.transports.base import LinkProbe

CFG = DeadlineConfig()  # budget 5 s, q0.9, margin 1.5, 3 rounds before deriving, cap 4x the start bound


def rounds(n: int, *, spread: float = 0.2, reduce: float = 0.5, means: float = 0.8, clean: bool = True):
    return [RoundTimes(round=r, ready_spread_s=spread, reduce_s=reduce, means_s=means, clean=clean) for r in range(n)]


def test_before_min_rounds_the_start_bound_is_1_2_4_budgets() -> None:
    d = derive_deadlines(rounds(2), config=CFG)
    assert (d.quorum_timeout_s, d.reduce_timeout_s, d.broadcast_timeout_s) == (5.0, 10.0, 20.0)
    assert "start bound: 2 of 3 rounds seen" in d.reason


def test_a_fast_link_gets_deadlines_of_its_exchange_plus_the_budget() -> None:
    d = derive_deadlines(rounds(10), config=CFG)
    assert d.quorum_timeout_s == pytest.approx(0.2 * 1.5 + 5)
    assert d.reduce_timeout_s == pytest.approx(0.5 * 1.5 + 5)
    # means 0.8 * 1.5 + 5 = 6.2 < reduce + budget / 2 = 8.25
    assert d.broadcast_timeout_s == pytest.approx(0.5 * 1.5 + 5 + 2.5)
    assert d.reason.startswith("budget 5s: quorum 5.30s (q0.9 0.20s of 10 rounds)")


def test_a_link_that_slows_10x_moves_the_deadlines_within_the_quantiles_window() -> None:
    """10 rounds at 2 s of reduce, then the link slows 10x (20 s): the q0.9 (nearest rank)
    of the 12 rounds seen after two slow ones is a slow one, so the next plan's deadline
    follows after 2 rounds (the slow rounds themselves ran under the old deadline)."""
    slow_from = 10
    hist = rounds(slow_from, reduce=2.0, means=3.0)
    moved_after = None
    for k in range(1, 8):
        hist.append(RoundTimes(round=slow_from + k - 1, ready_spread_s=0.2, reduce_s=20.0, means_s=30.0))
        d = derive_deadlines(hist, config=CFG)
        if d.reduce_timeout_s > 20.0 and moved_after is None:
            moved_after = k
    assert moved_after == 2
    assert d.reduce_timeout_s == pytest.approx(20 * 1.5 + 5)  # measured: q0.9 x margin + budget
    # and recovers after shift_rounds (5) fast rounds: the window restarts after the last slow
    # one (before, the 7 slow rounds held the quantile until fast ones were 90% of 20 rounds)
    back = []
    for k in range(1, 8):
        hist.append(RoundTimes(round=100 + k, ready_spread_s=0.2, reduce_s=2.0, means_s=3.0))
        back.append(derive_deadlines(hist, config=CFG).reduce_timeout_s)
    assert back == pytest.approx([20 * 1.5 + 5] * 4 + [2 * 1.5 + 5] * 3)
    assert (
        "reduce 8.00s (q0.9 2.00s of 5 rounds, since the link sped up)"
        in derive_deadlines(hist[:-2], config=CFG).reason
    )


def test_since_speedup_restarts_the_window_after_the_last_slow_figure_once_enough_fast_ones_follow() -> None:
    fast, slow = 1.0, 10.0
    vals = [fast] * 8 + [slow] * 3 + [fast] * 4
    assert since_speedup(vals, slow, factor=2.0, rounds=5) == (vals, False)  # 4 fast since: not yet
    vals.append(fast)
    assert since_speedup(vals, slow, factor=2.0, rounds=5) == ([fast] * 5, True)
    # a figure under q / factor is fast, at or above it slow; no slow figure: nothing to restart
    assert since_speedup([4.9] * 6, 10.0, factor=2.0, rounds=5) == ([4.9] * 6, False)
    assert since_speedup([5.0] + [4.9] * 5, 10.0, factor=2.0, rounds=5) == ([4.9] * 5, True)


def test_rounds_that_were_not_clean_are_not_observations() -> None:
    """A round where something was lost ran into a deadline: its times are the deadline, not the link."""
    d = derive_deadlines(rounds(10, reduce=9.9, clean=False) + rounds(2), config=CFG)
    assert d.reduce_timeout_s == 10.0  # 2 clean rounds only: the start bound


def test_a_link_slower_than_its_deadline_backs_the_deadline_off_until_its_rounds_fit() -> None:
    """10 fast rounds derive a 5.75 s reduce deadline; then the link needs 15 s of reduce. A round
    cut by its deadline is not clean, so before censored rounds counted the deadline stayed at
    5.75 s and cut every round from then on. Now each cut doubles it until the exchange fits,
    and the rounds that fit keep it there."""
    hist = rounds(10)
    need_s, cut_rounds, deadlines = 15.0, [], []
    for r in range(10, 30):
        d = derive_deadlines(hist, config=CFG)
        deadlines.append(d.reduce_timeout_s)
        fits = need_s <= d.reduce_timeout_s
        if not fits:
            cut_rounds.append(r)
        hist.append(
            RoundTimes(
                round=r,
                ready_spread_s=0.2,
                reduce_s=need_s if fits else d.reduce_timeout_s,  # a cut round's pushes end at its deadline
                means_s=need_s + 0.3 if fits else d.reduce_timeout_s + 0.3,
                clean=fits,
                reduce_deadline_s=d.reduce_timeout_s,
                broadcast_deadline_s=d.broadcast_timeout_s,
            )
        )
    assert deadlines[:3] == pytest.approx([0.5 * 1.5 + 5, 11.5, 23.0])
    assert cut_rounds == [10, 11]  # two rounds cut, then every round fits
    assert min(deadlines[2:]) >= need_s
    assert deadlines[-1] == pytest.approx(min(need_s * 1.5 + 5, 40.0))  # derived from the 15 s rounds now
    assert "ran to its 5.75s deadline: x2" in derive_deadlines(hist[:11], config=CFG).reason


def test_a_reduce_that_backs_off_keeps_the_broadcast_window_after_it() -> None:
    """Round 0 (start bound: reduce 10 s, broadcast 20 s) ran to its reduce deadline (a push to
    an owner stalled at 30% loss) and got its means at 12 s. The reduce backs off to 20 s; the
    broadcast keeps the 10 s the means had after the reduce: 30 s, not 20 + budget/2 = 22.5 s,
    which left the late pulls and the repair 1.2 s each. With the reduce not backed off, or
    the broadcast set, nothing changes."""
    cut = RoundTimes(
        round=0, reduce_s=10.0, means_s=12.0, clean=False, reduce_deadline_s=10.0, broadcast_deadline_s=20.0
    )
    d = derive_deadlines([cut], config=CFG)
    assert (d.reduce_timeout_s, d.broadcast_timeout_s) == (20.0, 30.0)
    assert "broadcast 30.00s (reduce + the means' 10.00s window, kept when the reduce backed off)" in d.reason
    assert derive_deadlines([cut], config=CFG, overrides=(None, None, 21.0)).broadcast_timeout_s == 21.0
    assert derive_deadlines(rounds(1), config=CFG).broadcast_timeout_s == 20.0  # start bound, nothing backed off
    capped = RoundTimes(round=0, reduce_s=40.0, means_s=45.0, clean=False, reduce_deadline_s=40.0)
    d = derive_deadlines([capped], config=CFG)  # the reduce backed off to its cap: 40 s, the means 10 s after
    assert (d.reduce_timeout_s, d.broadcast_timeout_s) == (40.0, 50.0)


def test_rounds_cut_while_the_link_stalled_leave_the_window_after_min_rounds_clean_ones() -> None:
    """10 fast rounds, then the link stalls (every exchange would take 1000 s) for 4 rounds: each
    is cut at its deadline and backs the next one off up to the 40 s cap. When the link is fast
    again, its first clean rounds still see the censored rounds (a lower bound on the link of
    their time); after min_rounds (3) clean rounds the deadline is the fast link's again, not the
    cap for the rest of the 20-round window."""
    hist, deadlines = rounds(10), []
    for r in range(10, 24):
        d = derive_deadlines(hist, config=CFG)
        deadlines.append(d.reduce_timeout_s)
        need_s = 1000.0 if r < 14 else 0.5
        fits = need_s <= d.reduce_timeout_s
        hist.append(
            RoundTimes(
                round=r,
                ready_spread_s=0.2,
                reduce_s=need_s if fits else d.reduce_timeout_s,
                means_s=need_s + 0.3 if fits else d.broadcast_timeout_s,
                clean=fits,
                reduce_deadline_s=d.reduce_timeout_s,
                broadcast_deadline_s=d.broadcast_timeout_s,
            )
        )
    fast = 0.5 * 1.5 + 5
    assert deadlines[:5] == pytest.approx([fast, 11.5, 23.0, 40.0, 40.0])  # 4 cut, backed off up to the cap
    assert deadlines[5:7] == pytest.approx([23.0 * 1.5 + 5] * 2)  # 1, 2 clean rounds since: q0.9 is a cut one
    assert deadlines[7:] == pytest.approx([fast] * 7)  # 3 clean rounds since the last cut: the link's figure
    assert "q0.9 0.50s of 13 rounds" in derive_deadlines(hist[:17], config=CFG).reason


def test_a_round_cut_by_a_fault_before_its_deadline_is_not_a_censored_observation() -> None:
    """A round that lost a site's contributions but ended well before its deadline says nothing
    about the link: it neither enters the quantile nor backs the deadline off."""
    lost = RoundTimes(
        round=10, reduce_s=1.0, means_s=1.5, clean=False, reduce_deadline_s=5.75, broadcast_deadline_s=8.25
    )
    assert lost.cut("reduce_s", 0.9) is None and lost.cut("means_s", 0.9) is None
    assert derive_deadlines(rounds(10) + [lost], config=CFG) == derive_deadlines(rounds(10), config=CFG)
    # the same round at its deadline is one: the figure was at least the deadline
    at = RoundTimes(round=10, reduce_s=5.6, means_s=8.0, clean=False, reduce_deadline_s=5.75, broadcast_deadline_s=8.25)
    assert at.cut("reduce_s", 0.9) == 5.75 and at.cut("means_s", 0.9) == 8.25


def test_a_round_cut_on_a_slow_live_link_is_extrapolated_at_its_pace_past_the_start_cap() -> None:
    """Reno at 10% loss moved a quarter of a round's contributions by the 10 s start bound. The
    next deadline is what the whole would take at that pace (x margin + budget), not the 2x
    back-off capped at 40 s that cut every round of that link; once rounds run clean at ~60 s
    the measured figure sets it, above the start bound's cap (the budget is a stall beyond the
    measured exchange)."""
    cut = RoundTimes(round=0, reduce_s=10.0, means_s=20.0, clean=False, reduce_deadline_s=10.0)
    cut = dataclasses.replace(cut, broadcast_deadline_s=20.0, reduce_live=0.25)
    d = derive_deadlines([cut], config=CFG)
    assert d.reduce_timeout_s == pytest.approx(40.0 * 1.5 + 5)  # 10 s / 0.25 = 40 s at that pace
    assert d.broadcast_timeout_s == pytest.approx(80.0 * 1.5 + 5)  # the means cross the same links
    assert "25% of the slowest live link's contributions in" in d.reason
    # the next round ran clean in 60 s: with 2 of 3 rounds seen the deadline is not the start
    # bound again (which cut round 2 of a reno run and left θ unequal) but what round 1 needed
    one = RoundTimes(round=1, ready_spread_s=0.1, reduce_s=60.0, means_s=120.0)
    d = derive_deadlines([cut, one], config=CFG)
    assert d.reduce_timeout_s == pytest.approx(60.0 * 1.5 + 5) and d.broadcast_timeout_s == pytest.approx(185.0)
    assert "the slowest of 2 rounds seen needed 60.00s" in d.reason
    slow = [RoundTimes(round=r, ready_spread_s=0.1, reduce_s=60.0, means_s=120.0) for r in range(1, 4)]
    d = derive_deadlines([cut, *slow], config=CFG)
    assert d.reduce_timeout_s == pytest.approx(60.0 * 1.5 + 5) and d.broadcast_timeout_s == pytest.approx(185.0)
    # a pace is bounded per round: a link that delivered 1% extrapolates at most max_pace_factor x
    crawl = dataclasses.replace(cut, reduce_live=0.01)
    assert derive_deadlines([crawl], config=CFG).reduce_timeout_s == pytest.approx(16 * 10.0 * 1.5 + 5)


def test_a_member_that_sent_nothing_is_a_fault_not_a_pace() -> None:
    """A cut round whose live links all delivered (``reduce_live`` 1: the missing contributions
    are a silent member's) backs off as before, capped at max_factor x the start bound, so a
    partition cannot grow the deadlines without bound."""
    hist = []
    for r in range(6):
        d = derive_deadlines(hist, config=CFG) if hist else None
        deadline = d.reduce_timeout_s if d else 10.0
        hist.append(
            RoundTimes(
                round=r,
                reduce_s=deadline,
                means_s=2 * deadline,
                clean=False,
                reduce_deadline_s=deadline,
                broadcast_deadline_s=2 * deadline,
                reduce_live=1.0,
            )
        )
    assert derive_deadlines(hist, config=CFG).reduce_timeout_s == pytest.approx(40.0)


def test_backoff_is_capped_like_every_derived_deadline() -> None:
    hist = [
        RoundTimes(round=r, reduce_s=40.0, means_s=80.0, clean=False, reduce_deadline_s=40.0, broadcast_deadline_s=80.0)
        for r in range(5)
    ]
    d = derive_deadlines(hist, config=CFG)
    assert (d.reduce_timeout_s, d.broadcast_timeout_s) == (40.0, 80.0)  # 4x the start bound


def test_explicit_timeouts_override_their_derivation_and_say_so() -> None:
    d = derive_deadlines(rounds(10), config=CFG, overrides=(None, 3.0, None))
    assert d.reduce_timeout_s == 3.0 and "reduce 3.00s (set)" in d.reason
    assert d.broadcast_timeout_s == pytest.approx(max(0.8 * 1.5 + 5, 3.0 + 2.5))


def test_quantile_is_nearest_rank() -> None:
    assert quantile([5, 1, 4, 2, 3], 0.9) == 5 and quantile([5, 1, 4, 2, 3], 0.5) == 3 and quantile([7], 0.1) == 7


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("stall_budget_s", 0.0, "stall_budget_s must be a number of seconds > 0"),
        ("history_rounds", 0, "history_rounds must be an int >= 1"),
        ("quantile", 1.5, r"quantile must be in \(0, 1\]"),
        ("margin", 0.5, "margin must be a number >= 1"),
        ("cut_fraction", 0.0, r"cut_fraction must be in \(0, 1\]"),
        ("backoff", 0.5, "backoff must be a number >= 1"),
    ],
)
def test_bad_deadline_settings_name_the_field(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DeadlineConfig(**{field: value})


def _report(site: str, rnd: int, *, reduce_s: float, means_s: float, arrived: float = 1.0, live=None) -> str:
    return json.dumps(
        {
            **({} if live is None else {"reduce_live_fraction": live}),
            "site": site,
            "round": rnd,
            "seq": rnd + 1,
            "status": "applied",
            "reduce_s": reduce_s,
            "means_s": means_s,
            "reduce_arrived_fraction": arrived,
            "broadcast_arrived_fraction": 1.0,
        }
    )


def test_the_rendezvous_derives_the_next_plans_deadlines_from_the_sites_reports() -> None:
    core = RendezvousCore(RendezvousConfig(min_sites=2, deadlines=DeadlineConfig(stall_budget_s=2.0)))
    for s in ("a", "b"):
        core.join(s, f"127.0.0.1:{ord(s)}", now=0.0)
    t = 0.0
    for r in range(4):
        t += 1.0
        assert core.ready("a", r, now=t).status == "wait"
        plan = core.ready("b", r, now=t + 0.1).plan
        assert plan is not None
        if r < 3:
            assert plan.reduce_timeout_s == 4.0 and "start bound" in plan.deadline_reason
        for s, slow in (("a", 1.0), ("b", 2.0)):  # the slowest site's figures count
            core.heartbeat(s, now=t + 0.5, round_reports=[_report(s, r, reduce_s=0.4 * slow, means_s=0.6 * slow)])
    # rounds 0-2 observed: reduce q0.9 = 0.8 s, means 1.2 s, ready spread 0.1 s
    assert plan.reduce_timeout_s == pytest.approx(0.8 * 1.5 + 2.0)
    assert plan.broadcast_timeout_s == pytest.approx(max(1.2 * 1.5 + 2.0, 0.8 * 1.5 + 2.0 + 1.0))
    assert core.deadlines.quorum_timeout_s == pytest.approx(0.1 * 1.5 + 2.0)
    assert "q0.9 0.80s of 4 rounds" in core.snapshot(t)["config"]["deadline_reason"]


def test_the_rendezvous_backs_off_a_deadline_that_cut_the_last_round() -> None:
    """The rendezvous keeps the deadlines each plan it formed carried: a report of a round that ran
    to its reduce deadline with contributions missing makes the next plan's deadline twice it."""
    core = RendezvousCore(RendezvousConfig(min_sites=2, deadlines=DeadlineConfig(stall_budget_s=2.0)))
    for s in ("a", "b"):
        core.join(s, f"127.0.0.1:{ord(s)}", now=0.0)
    core.ready("a", 0, now=1.0)
    plan = core.ready("b", 0, now=1.1).plan
    assert plan is not None and plan.reduce_timeout_s == 4.0
    for s in ("a", "b"):
        core.heartbeat(s, now=6.0, round_reports=[_report(s, 0, reduce_s=4.0, means_s=4.5, arrived=0.5)])
    core.ready("a", 1, now=7.0)
    plan = core.ready("b", 1, now=7.1).plan
    assert plan is not None and plan.reduce_timeout_s == 8.0
    assert "reduce 8.00s (round 0 ran to its 4.00s deadline: x2)" in plan.deadline_reason


def test_the_rendezvous_extrapolates_a_cut_round_at_the_slowest_sites_pace() -> None:
    """Reports fold to the slowest site's: the lowest live fraction. Site b's slowest link
    delivered 25% of its contributions by the 4 s deadline: the next reduce deadline is the
    16 s the whole takes at that pace x margin + budget, past the start bound's 16 s cap."""
    core = RendezvousCore(RendezvousConfig(min_sites=2, deadlines=DeadlineConfig(stall_budget_s=2.0)))
    for s in ("a", "b"):
        core.join(s, f"127.0.0.1:{ord(s)}", now=0.0)
    core.ready("a", 0, now=1.0)
    assert core.ready("b", 0, now=1.1).plan is not None
    for s, live in (("a", 0.5), ("b", 0.25)):
        core.heartbeat(s, now=6.0, round_reports=[_report(s, 0, reduce_s=4.0, means_s=4.5, arrived=0.5, live=live)])
    core.ready("a", 1, now=7.0)
    plan = core.ready("b", 1, now=7.1).plan
    assert plan is not None and plan.reduce_timeout_s == pytest.approx(16.0 * 1.5 + 2.0)
    assert "with 25% of the slowest live link's contributions in: 16.00s at that pace" in plan.deadline_reason


def test_the_join_probe_raises_the_start_bound_until_rounds_are_measured() -> None:
    """A join probe that predicts a 100 s reduce and 200 s of means (reno at 10% loss) sizes
    round 0 to it x margin + budget, instead of the 10 / 20 s start bound that cut that round;
    a prediction from the wire is capped at max_pace_factor x the start bound; once min_rounds
    clean rounds are measured the probe no longer counts (not even in the cap)."""
    cfg = DeadlineConfig(stall_budget_s=5.0)
    d = derive_deadlines([], config=cfg, probed=(100.0, 200.0))
    assert d.reduce_timeout_s == pytest.approx(100.0 * 1.5 + 5.0)
    assert d.broadcast_timeout_s == pytest.approx(200.0 * 1.5 + 5.0)
    assert d.quorum_timeout_s == 5.0  # the quorum wait is not an exchange
    assert "reduce 155.00s (the join probe predicts 100.00s)" in d.reason
    # a fast link's prediction below the start bound changes nothing
    assert derive_deadlines([], config=cfg, probed=(0.5, 1.0)) == derive_deadlines([], config=cfg)
    # a wire figure of 1e9 s is capped at 16 x the start bound
    big = derive_deadlines([], config=cfg, probed=(1e9, 1e9))
    assert big.reduce_timeout_s == pytest.approx(16 * 10.0 * 1.5 + 5.0)
    assert big.broadcast_timeout_s == pytest.approx(16 * 20.0 * 1.5 + 5.0)
    # a measured round needing more than the probe said wins, with its own reason
    slow = [RoundTimes(round=0, reduce_s=150.0, means_s=260.0)]
    d = derive_deadlines(slow, config=cfg, probed=(100.0, 200.0))
    assert d.reduce_timeout_s == pytest.approx(150.0 * 1.5 + 5.0) and "rounds seen needed 150.00s" in d.reason
    # min_rounds clean rounds measured: the probe is history
    fast = [RoundTimes(round=r, reduce_s=1.0, means_s=2.0) for r in range(3)]
    assert derive_deadlines(fast, config=cfg, probed=(100.0, 200.0)) == derive_deadlines(fast, config=cfg)


def test_a_probe_report_predicts_the_slowest_members_share_at_its_rate() -> None:
    """8 MB over 4 sites: 2 MB to each owner. Member x streamed at 20 kB/s with 80 ms RTT
    (reno at 10% loss), y at 10 MB/s: the reduce is x's 100 s + 2 RTT, the means twice that;
    a stream cut by its time gives its average as the rate's upper bound; nothing measured:
    no report."""
    x = LinkProbe(address="x", rtt_s=0.08, rate_bytes_per_s=25e3, bytes=50_000, seconds=2.5, complete=False)
    y = LinkProbe(address="y", rtt_s=0.01, rate_bytes_per_s=10e6, bytes=1 << 20, seconds=0.1, complete=True)
    z = LinkProbe(address="z", rtt_s=0.02, rate_bytes_per_s=None, bytes=0, seconds=3.0, complete=False)
    rep = probe_report(8_000_000, [x, y, z], num_sites=4)
    assert rep is not None and rep["probe"] is True
    assert rep["rate_bytes_per_s"] == pytest.approx(20e3)  # 50 kB in 2.5 s, not the 25 kB/s of its parts
    assert rep["reduce_s"] == pytest.approx(2_000_000 / 20e3 + 0.16)
    assert rep["means_s"] == pytest.approx(2 * rep["reduce_s"])
    assert "to the slowest of 2 members" in rep["why"]
    assert probe_report(8_000_000, [z], num_sites=2) is None


def test_the_rendezvous_sizes_round_0_from_the_join_probes_and_drops_bad_ones() -> None:
    """A site's join-probe report (``dtrain.site.probe_report``) reaches the deadlines, not the
    status page; the slowest site's prediction counts; a report with a bad figure is dropped."""
    log = StatusLog()
    core = RendezvousCore(RendezvousConfig(min_sites=2, deadlines=DeadlineConfig(stall_budget_s=2.0)), reports=log)
    for s in ("a", "b"):
        core.join(s, f"127.0.0.1:{ord(s)}", now=0.0)
    probe = {"probe": True, "seq": 1, "reduce_s": 10.0, "means_s": 20.0, "why": "test"}
    core.heartbeat("a", now=0.5, round_reports=[json.dumps(probe)])
    core.heartbeat("b", now=0.5, round_reports=[json.dumps({**probe, "reduce_s": 6.0, "means_s": 12.0})])
    bad = {**probe, "reduce_s": float("nan"), "seq": 2}
    core.heartbeat("b", now=0.6, round_reports=[json.dumps(bad).replace("NaN", '"x"')])
    core.ready("a", 0, now=1.0)
    plan = core.ready("b", 0, now=1.1).plan
    assert plan is not None
    assert plan.reduce_timeout_s == pytest.approx(10.0 * 1.5 + 2.0)
    assert plan.broadcast_timeout_s == pytest.approx(20.0 * 1.5 + 2.0)
    assert "the join probe predicts 10.00s" in plan.deadline_reason
    assert log.num_dropped == 0 and log.rounds == {}  # probe reports are not round reports


# ---------------------------------------------------------------- a plan's age


def _plan(**kw):
    return RoundPlan(
        round=3,
        members=(Member(site_id="a", address="x:1"),),
        reduce_timeout_s=2.0,
        broadcast_timeout_s=4.0,
        **kw,
    )


def test_the_rendezvous_ages_a_plan_on_its_stores_clock() -> None:
    assert aged(_plan(formed_at=100.0), 101.5).age_s == 1.5
    assert aged(_plan(formed_at=100.0), 99.0).age_s == 0.0  # never negative
    assert aged(_plan(), 5.0).age_s == 0.0  # formation unknown


def test_a_plan_read_past_its_reduce_deadline_is_a_missed_round() -> None:
    assert plan_expired(_plan(age_s=1.9)) == (False, "the plan of round 3 is 1.90s old")
    expired, why = plan_expired(_plan(age_s=2.5))
    assert expired and "2.5s old, past its reduce deadline (2.0s after it formed)" in why


@pytest.mark.parametrize(
    "age_s, held_s, call_s, want",
    [
        (0.0, 1.9, 2.0, 0.1),  # a long poll held 1.9 s of a 2 s call: 0.1 s in flight at most
        (0.5, 0.0, 0.2, 0.7),  # the plan was 0.5 s old at the answer, the call took 0.2 s
        (0.0, 0.5, 15.5, 15.0),  # the site was stopped 15 s while the answer waited: the plan is 15 s old
        (0.0, 3.0, 2.0, 0.0),  # clocks disagree: never below the rendezvous's own figure
    ],
)
def test_the_client_adds_the_calls_time_not_held_at_the_rendezvous(age_s, held_s, call_s, want) -> None:
    reply = pb.ReadyReply(status="plan", reason="r", next_round=3, plan=plan_to_proto(_plan()))
    reply.plan_age_s, reply.held_s = age_s, held_s
    d = _decision_from_proto(reply, call_s)
    assert d.plan is not None and d.plan.age_s == pytest.approx(want)


def test_the_repair_window_and_the_plan_wait_follow_the_plans_deadlines_unless_set() -> None:
    """No hand-set repair budget or plan wait: the repair window is the plan's broadcast
    window (its broadcast minus its reduce timeout), the plan wait the reduce timeout of the
    last plan the site opened (5 s before any); an explicit value overrides either."""
    import torch

    from dtrain.buckets import BucketConfig, BucketLayout
    from dtrain.rounds import RoundConfig, RoundEngine
    from dtrain.rounds.recovery import MIN_REPAIR_S, repair_window_s
    from dtrain.state import GlobalState
    from dtrain.transports.inproc import InprocNetwork, InprocTransport

    lan = RoundPlan(round=0, members=(Member(site_id="a", address="x"),), reduce_timeout_s=5.1, broadcast_timeout_s=7.6)
    assert repair_window_s(None, lan) == pytest.approx(2.5)
    assert repair_window_s(3.0, lan) == 3.0
    assert (
        repair_window_s(None, RoundPlan(round=0, members=lan.members, reduce_timeout_s=4, broadcast_timeout_s=4))
        == MIN_REPAIR_S
    )
    layout = BucketLayout([64], ["w"], BucketConfig(bucket_bytes=256, chunk_bytes=64))
    engine = RoundEngine("a", GlobalState(layout, [torch.zeros(64)]), InprocTransport(InprocNetwork()), RoundConfig())
    engine.start()
    try:
        assert engine.plan_wait_s == 5.0
        plan = RoundPlan(
            round=0,
            members=(Member(site_id="a", address=engine.address),),
            reduce_timeout_s=1.5,
            broadcast_timeout_s=3.0,
        )
        engine.add_pseudo_gradient([torch.ones(64)])
        assert engine.run_round(plan).applied_buckets == len(layout)
        assert engine.plan_wait_s == 1.5
    finally:
        engine.stop(0.1)
    assert (
        RoundEngine("b", GlobalState(layout, [torch.zeros(64)]), None, RoundConfig(plan_wait_s=2.0)).plan_wait_s == 2.0
    )


def test_late_pull_waits_start_at_an_eighth_of_the_window_and_double_each_pass() -> None:
    """A late pull's wait for one answer (:func:`late_pull_timeout_s`): an eighth of the
    late-pull window in the first pass over the sources, doubled each pass (a stalled
    connection's next answer comes after its back-off; another source's may come first), at
    least 0.2 s, never past the time left."""
    from dtrain.rounds.recovery import late_pull_timeout_s

    assert late_pull_timeout_s(0, 8.0, 8.0) == pytest.approx(1.0)
    assert late_pull_timeout_s(1, 8.0, 6.0) == pytest.approx(2.0)
    assert late_pull_timeout_s(2, 8.0, 3.0) == pytest.approx(3.0)  # capped by the time left
    assert late_pull_timeout_s(0, 0.5, 0.5) == pytest.approx(0.2)  # the floor
    assert late_pull_timeout_s(3, 8.0, -1.0) == 0.0
