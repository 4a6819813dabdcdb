"""The member side of one round (dtrain.rounds.member.MemberRound), built directly with an
injected clock: every transition (mean arrived or missing, owner lost, pull timed out,
the verdicts, repaired), the transitions it refuses, and the outcomes and counts a
RoundResult takes from it."""

from __future__ import annotations

import pytest

from dtrain.protocol import BucketMean, MeanChunk, Member, RoundPlan
from dtrain.rounds.member import InvalidTransition, MemberRound, Phase
from dtrain.rounds.types import BucketOutcome, RoundResult

pytestmark = pytest.mark.timeout(30)

T0 = 100.0  # the clock when the round opened (any origin: time is passed in)
BROADCAST_S = 20.0
ROUND = 7
# bucket 0 is this site's ("a"), 1 and 4 are b's, 2 is c's, 3 is outside this (fragment) round
OWNERS = ["a", "b", "c", "", "b"]
NUM_CHUNKS = [2, 1, 2, 1, 3]


class Clock:
    """The injected clock: ``now`` moves only when a test advances it."""

    def __init__(self, t: float = T0) -> None:
        self.now = t

    def advance(self, s: float) -> float:
        self.now += s
        return self.now


def _round(broadcast_s: float = BROADCAST_S, owners=OWNERS, num_chunks=NUM_CHUNKS) -> MemberRound:
    plan = RoundPlan(
        round=ROUND,
        members=tuple(Member(site_id=s, address=f"inproc:{i}") for i, s in enumerate(("a", "b", "c"))),
        reduce_timeout_s=broadcast_s / 2,
        broadcast_timeout_s=broadcast_s,
    )
    return MemberRound(plan=plan, owners=owners, site_id="a", num_chunks=num_chunks, opened_at=T0)


def _mean(b: int, chunks: int | None = None, before: str = "before", after: str = "after") -> BucketMean:
    n = NUM_CHUNKS[b] if chunks is None else chunks
    return BucketMean(
        round=ROUND,
        bucket=b,
        owner=OWNERS[b],
        chunks=tuple(
            MeanChunk(chunk=c, offset=4 * c, numel=4, codec="fp32", payload=b"", senders=("a", "b", "c"))
            for c in range(n)
        ),
        checksum_before=before,
        checksum_after=after,
    )


def _repair_extra(num_chunks: int, round: int = ROUND) -> dict:
    return {"mean_round": round, "mean_senders": [["b", "c"]] * num_chunks}


# ---------------------------------------------------------------------- set-up and queries
def test_the_buckets_of_the_round_are_split_into_own_and_remote() -> None:
    mr = _round()
    assert mr.active == (0, 1, 2, 4)
    assert mr.mine == (0,)
    assert mr.remote == (1, 2, 4)
    assert [mr.phase(b) for b in mr.active] == [Phase.OWN, Phase.AWAITING, Phase.AWAITING, Phase.AWAITING]
    assert mr.broadcast_until == T0 + BROADCAST_S
    assert [mr.outcome(b) for b in mr.active] == [None] * 4


@pytest.mark.parametrize(
    "owners, num_chunks, site, match",
    [
        (["a", "b"], [1, 1, 1], "a", "owners has 2 entries, num_chunks 3"),
        (["a", "b"], [1, 1], "z", "site_id 'z' is not a member of round 7"),
        (["a", "x"], [1, 1], "a", r"owners\[1\] = 'x' is not a member of round 7"),
    ],
)
def test_a_round_that_does_not_fit_its_plan_is_refused(owners, num_chunks, site, match) -> None:
    plan = RoundPlan(
        round=ROUND,
        members=(Member(site_id="a", address="inproc:0"), Member(site_id="b", address="inproc:1")),
        reduce_timeout_s=1.0,
        broadcast_timeout_s=2.0,
    )
    with pytest.raises(ValueError, match=match):
        MemberRound(plan=plan, owners=owners, site_id=site, num_chunks=num_chunks, opened_at=T0)


def test_a_bucket_outside_the_round_is_refused_by_name() -> None:
    mr = _round()
    with pytest.raises(ValueError, match=r"bucket 3 is not synchronised by round 7: active buckets \[0, 1, 2, 4\]"):
        mr.mean_arrived(3, _mean(3))
    with pytest.raises(ValueError, match="bucket 9 is not"):
        mr.outcome(9)


# ---------------------------------------------------------------------- pulls
def test_pull_decision_waits_until_the_broadcast_deadline_on_the_injected_clock() -> None:
    mr, clock = _round(), Clock()
    assert mr.pull_decision(1, clock.advance(1.5)) == (BROADCAST_S - 1.5, "")
    assert mr.pull_decision(1, clock.advance(BROADCAST_S - 1.5)) == (0.0, "broadcast deadline passed")
    assert mr.pull_decision(2, clock.advance(3.0)) == (0.0, "broadcast deadline passed")


def test_an_unreachable_owner_is_not_pulled_from_and_its_missing_buckets_are_owner_lost() -> None:
    mr, clock = _round(), Clock()
    mr.mean_arrived(4, _mean(4))  # arrived before b was found gone: unaffected
    assert mr.member_unreachable("b") is True
    assert mr.member_unreachable("b") is False  # once per round
    assert mr.unreachable == {"b"}
    assert mr.pull_decision(1, clock.now) == (0.0, "owner b unreachable in this round")
    assert mr.pull_decision(2, clock.now) == (BROADCAST_S, "")  # c's bucket: pulled as usual
    assert mr.is_owner_lost(1) and not mr.is_owner_lost(4) and not mr.is_owner_lost(2)
    mr.mean_missing(1, "owner b unreachable in this round")
    assert mr.no_mean(1) is BucketOutcome.OWNER_LOST
    assert mr.why(1) == "no mean from b: owner b unreachable in this round"
    assert mr.applied(4, before="before", after="after") is BucketOutcome.APPLIED


@pytest.mark.parametrize("site", ["a", "z"])
def test_member_unreachable_refuses_this_site_and_non_members(site: str) -> None:
    with pytest.raises(ValueError, match=f"site_id '{site}' must be another member of round 7"):
        _round().member_unreachable(site)


@pytest.mark.parametrize(
    "broadcast_s, left_s, lost",
    [
        (20.0, 1.1, False),  # 5% of 20 s is 1 s: a timeout with 1.1 s left is a lost reply
        (20.0, 1.0, True),
        (20.0, 0.0, True),
        (0.5, 0.06, False),  # 5% of 0.5 s is 0.025 s: the 0.05 s floor counts
        (0.5, 0.05, True),
    ],
)
def test_a_pull_timing_out_near_the_broadcast_deadline_loses_its_owner(broadcast_s, left_s, lost) -> None:
    mr, clock = _round(broadcast_s=broadcast_s), Clock()
    assert mr.pull_timed_out(2, clock.advance(broadcast_s - left_s)) is lost
    assert mr.is_owner_lost(2) is lost
    mr.mean_missing(2, "timed out")
    assert mr.late_pull_sources(2) == (["b"] if lost else ["c", "b"])
    assert mr.no_mean(2) is (BucketOutcome.OWNER_LOST if lost else BucketOutcome.STALE)


def test_an_owner_heard_from_in_the_broadcast_is_repaired_from_not_lost_at_the_deadline() -> None:
    """The owner asked this site for a mean of this round (alive behind a lossy link): a pull
    timing out at the deadline may be a lost reply of a mean a member took, so the bucket is
    STALE and repaired from it; its state then says it withdrew the mean (OWNER_LOST, residual
    whole) or kept it (REPAIRED)."""
    mr, clock = _round(), Clock()
    assert mr.pull_timed_out(2, clock.advance(BROADCAST_S), owner_heard=True) is False
    mr.mean_missing(2, "deadline exceeded")
    assert mr.late_pull_sources(2) == ["c", "b"]  # the owner first: alive
    assert mr.no_mean(2) is BucketOutcome.STALE
    assert mr.repair_sources(2) == ["c"]
    with pytest.raises(InvalidTransition, match="only its owner c can withdraw a mean"):
        mr.withdrawal_confirmed(2, "b")
    assert mr.withdrawal_confirmed(2, "c") is BucketOutcome.OWNER_LOST
    assert mr.why(2).startswith("c withdrew its mean (nobody took it): its mean never arrived from c")
    assert mr.is_owner_lost(2) and mr.mean_of(2) == ([], None)  # no chunk included: residual kept whole
    with pytest.raises(InvalidTransition, match="not a stale bucket owned elsewhere"):
        mr.withdrawal_confirmed(2, "c")


def test_a_state_of_this_round_with_no_mean_and_our_checksum_says_the_owner_holds_theta_as_we_do() -> None:
    mr = _round()
    mr.mean_missing(2, "timed out")
    assert mr.no_mean(2) is BucketOutcome.STALE
    kw = dict(checksum="same", have_checksum="same", rounds_applied=ROUND + 1, extra={})
    assert mr.withdrawal_decision(2, "c", **kw) is True  # never applied, alike
    assert mr.withdrawal_decision(2, "b", **kw) is False  # not its owner
    assert mr.withdrawal_decision(2, "c", **{**kw, "have_checksum": "other"}) is False  # θ_b differs
    assert mr.withdrawal_decision(2, "c", **{**kw, "rounds_applied": ROUND + 2}) is False  # moved on
    assert mr.withdrawal_decision(2, "c", **{**kw, "extra": {"mean_round": ROUND}}) is False  # it applied it
    assert mr.withdrawal_decision(2, "c", **{**kw, "have_checksum": "x", "extra": {"withdrawn_round": ROUND}})


def test_a_withdrawal_is_refused_for_a_mean_that_arrived() -> None:
    mr = _round()
    mr.mean_arrived(2, _mean(2))
    mr.stale(2, "differs before applying")
    with pytest.raises(InvalidTransition, match="only one that never arrived here"):
        mr.withdrawal_confirmed(2, "c")
    assert mr.outcome(2) is BucketOutcome.STALE


def test_a_late_pull_asks_the_owner_then_the_members_and_a_late_mean_clears_owner_lost() -> None:
    mr = _round()
    mr.mean_arrived(2, _mean(2))
    mr.mean_missing(1, "reply lost")
    mr.mean_missing(4, "reply lost")
    assert mr.missing() == [1, 4]
    assert mr.phase(1) is Phase.MISSING
    assert mr.late_pull_sources(1) == ["b", "c"]
    mr.owner_lost(1)  # b refused the late pull
    assert mr.is_owner_lost(1)
    assert mr.late_pull_sources(1) == ["c"]
    mr.mean_arrived(1, _mean(1))  # c kept a copy
    assert mr.phase(1) is Phase.ARRIVED and not mr.is_owner_lost(1)
    assert mr.missing() == [4]
    assert mr.applied(1, before="before", after="after") is BucketOutcome.APPLIED


def test_broadcast_arrived_fraction_counts_own_and_arrived_buckets() -> None:
    mr = _round()
    assert mr.broadcast_arrived_fraction == 1 / 4
    mr.mean_arrived(1, _mean(1))
    mr.mean_missing(2, "x")
    assert mr.broadcast_arrived_fraction == 2 / 4
    mr.mean_arrived(2, _mean(2))
    assert mr.broadcast_arrived_fraction == 3 / 4
    assert _round(owners=["", "", "", "", ""]).broadcast_arrived_fraction == 1.0


# ---------------------------------------------------------------------- verdicts
@pytest.mark.parametrize(
    "mean, outcome, why",
    [
        (_mean(0), BucketOutcome.APPLIED, ""),
        (_mean(0, chunks=0), BucketOutcome.EMPTY, ""),
        (None, BucketOutcome.STALE, "its finalizer did not publish its mean"),
    ],
)
def test_an_owned_bucket_gets_its_outcome_from_what_its_finalizer_published(mean, outcome, why) -> None:
    mr = _round()
    assert mr.published(0, mean) is outcome
    assert mr.outcome(0) is outcome and mr.why(0) == why
    assert mr.mean(0) is mean
    assert mr.to_repair() == []  # an owner does not repair its own bucket


@pytest.mark.parametrize(
    "before, after, outcome, why",
    [
        ("before", "after", BucketOutcome.APPLIED, ""),
        ("other", "after", BucketOutcome.STALE, "differs from owner c before applying (kept stale)"),
        ("before", "other", BucketOutcome.STALE, "checksum after apply differs from owner c"),
    ],
)
def test_applied_compares_the_checksums_with_the_owners(before, after, outcome, why) -> None:
    mr = _round()
    mr.mean_arrived(2, _mean(2))
    assert mr.differs_before(2, before) is (before != "before")
    assert mr.applied(2, before=before, after=after) is outcome
    assert (mr.outcome(2), mr.why(2)) == (outcome, why)


def test_an_empty_mean_is_empty_and_cannot_be_applied() -> None:
    mr = _round()
    mr.mean_arrived(1, _mean(1, chunks=0))
    with pytest.raises(InvalidTransition, match="applied: bucket 1 of round 7: its mean has no chunks"):
        mr.applied(1, before="before", after="before")
    assert mr.empty(1) is BucketOutcome.EMPTY
    mr.mean_arrived(2, _mean(2))
    with pytest.raises(InvalidTransition, match="empty: bucket 2 of round 7: its mean has chunks"):
        mr.empty(2)


def test_a_missed_mean_is_stale_and_repaired_only_from_its_owner_with_this_rounds_mean() -> None:
    mr = _round()
    mr.mean_missing(2, "reply lost")
    assert mr.no_mean(2) is BucketOutcome.STALE
    assert mr.why(2) == "its mean never arrived from c: reply lost"
    assert mr.to_repair() == [2]
    assert mr.repair_sources(2) == ["c"]
    assert mr.mean_of(2) == ([], None)
    bad = [
        {},
        {"mean_round": ROUND - 1, "mean_senders": [["b"]] * 2},
        {"mean_round": ROUND, "mean_senders": "b,c"},
        {"mean_round": ROUND, "mean_senders": [["b"]] * 3},  # bucket 2 has 2 chunks
        {"mean_round": ROUND, "mean_senders": [["b"], "c"]},
    ]
    for extra in bad:
        assert mr.repair_decision(2, "any", extra) == (False, "its state does not reflect this round's mean"), extra
    assert mr.repair_decision(2, "any", {"mean_round": ROUND, "mean_senders": []}) == (True, "")  # an empty mean
    assert mr.repair_decision(2, "any", _repair_extra(2)) == (True, "")
    assert mr.repaired(2, "c", checksum="any", extra=_repair_extra(2)) is BucketOutcome.REPAIRED
    assert mr.repaired_from(2) == "c"
    assert mr.mean_of(2) == ([["b", "c"], ["b", "c"]], None)
    assert mr.to_repair() == []


def test_a_stale_bucket_whose_mean_arrived_is_repaired_from_a_member_with_the_owners_checksum() -> None:
    mr = _round()
    mr.mean_arrived(4, _mean(4))
    assert mr.stale(4, "bad mean from b: truncated") is BucketOutcome.STALE
    assert mr.why(4) == "bad mean from b: truncated"
    assert mr.repair_sources(4) == ["b", "c"]
    ok, why = mr.repair_decision(4, "wrong", {})
    assert not ok and why == "its checksum wrong is not the owner's after the mean (after)"
    assert mr.repair_decision(4, "after", {}) == (True, "")
    assert mr.repaired(4, "c", checksum="after", extra={}) is BucketOutcome.REPAIRED
    assert (mr.outcome(4), mr.why(4), mr.repaired_from(4)) == (BucketOutcome.REPAIRED, "", "c")
    assert mr.mean_of(4) == ([("a", "b", "c")] * 3, _mean(4))


def test_mean_of_is_the_mean_only_when_it_is_whole() -> None:
    mr = _round()
    mr.mean_arrived(4, _mean(4, chunks=2))  # 2 of bucket 4's 3 chunks
    senders, whole = mr.mean_of(4)
    assert senders == [("a", "b", "c")] * 2 and whole is None
    mr.published(0, _mean(0))
    assert mr.mean_of(0) == ([("a", "b", "c")] * 2, _mean(0))


# ---------------------------------------------------------------------- refused transitions
def test_repaired_is_refused_for_a_bucket_that_was_never_stale() -> None:
    mr = _round()
    mr.mean_arrived(1, _mean(1))
    with pytest.raises(InvalidTransition, match=r"repaired: bucket 1 of round 7 is not a stale bucket .*outcome None"):
        mr.repaired(1, "b", checksum="after", extra={})
    mr.applied(1, before="before", after="after")
    with pytest.raises(InvalidTransition, match="is not a stale bucket owned elsewhere .*outcome applied"):
        mr.repaired(1, "b", checksum="after", extra={})
    mr.published(0, None)  # own and stale: not repaired by itself
    with pytest.raises(InvalidTransition, match=r"bucket 0 .*not a stale bucket owned elsewhere \(owner a"):
        mr.repair_sources(0)


def test_repaired_is_refused_twice_from_this_site_or_a_non_member_or_with_the_wrong_state() -> None:
    mr = _round()
    mr.mean_arrived(1, _mean(1))
    mr.stale(1, "differs")
    with pytest.raises(InvalidTransition, match="repaired: bucket 1 from 'a': not another member"):
        mr.repaired(1, "a", checksum="after", extra={})
    with pytest.raises(InvalidTransition, match="repaired: bucket 1 from 'z': not another member"):
        mr.repaired(1, "z", checksum="after", extra={})
    with pytest.raises(InvalidTransition, match="repaired: bucket 1 from c: its checksum x is not the owner's"):
        mr.repaired(1, "c", checksum="x", extra={})
    assert mr.outcome(1) is BucketOutcome.STALE  # a refused transition changes nothing
    mr.repaired(1, "c", checksum="after", extra={})
    with pytest.raises(InvalidTransition, match="outcome repaired"):
        mr.repaired(1, "b", checksum="after", extra={})


@pytest.mark.parametrize(
    "setup, call, match",
    [
        (
            [],
            lambda mr: mr.mean_arrived(0, _mean(0)),
            "mean_arrived: bucket 0 of round 7 is own, expected awaiting or missing",
        ),
        ([], lambda mr: mr.published(1, _mean(1)), "published: bucket 1 of round 7 is awaiting, expected own"),
        ([], lambda mr: mr.no_mean(1), "no_mean: bucket 1 of round 7 is awaiting, expected missing"),
        ([], lambda mr: mr.stale(1, "x"), "stale: bucket 1 of round 7 is awaiting, expected arrived"),
        (
            [],
            lambda mr: mr.late_pull_sources(1),
            "late_pull_sources: bucket 1 of round 7 is awaiting, expected missing",
        ),
        (["arrive"], lambda mr: mr.mean_arrived(1, _mean(1)), "mean_arrived: bucket 1 of round 7 is arrived"),
        (
            ["arrive"],
            lambda mr: mr.mean_missing(1, "x"),
            "mean_missing: bucket 1 of round 7 is arrived, expected awaiting",
        ),
        (["arrive"], lambda mr: mr.no_mean(1), "no_mean: bucket 1 of round 7 is arrived, expected missing"),
        (["arrive"], lambda mr: mr.owner_lost(1), "owner_lost: bucket 1 of round 7 is arrived"),
        (["arrive"], lambda mr: mr.pull_timed_out(1, T0), "pull_timed_out: bucket 1 of round 7 is arrived"),
        (
            ["miss"],
            lambda mr: mr.mean_missing(1, "x"),
            "mean_missing: bucket 1 of round 7 is missing, expected awaiting",
        ),
        (["miss"], lambda mr: mr.pull_decision(1, T0), "pull_decision: bucket 1 of round 7 is missing"),
        (
            ["miss"],
            lambda mr: mr.differs_before(1, "x"),
            "differs_before: bucket 1 of round 7 is missing, expected arrived",
        ),
        (
            ["arrive", "apply"],
            lambda mr: mr.stale(1, "x"),
            "stale: bucket 1 of round 7 already has its outcome applied",
        ),
        (["miss", "verdict"], lambda mr: mr.mean_arrived(1, _mean(1)), "already has its outcome stale"),
        (["miss", "verdict"], lambda mr: mr.no_mean(1), "no_mean: bucket 1 of round 7 already has its outcome stale"),
    ],
)
def test_impossible_transitions_are_refused_and_change_nothing(setup, call, match) -> None:
    mr = _round()
    steps = {
        "arrive": lambda: mr.mean_arrived(1, _mean(1)),
        "miss": lambda: mr.mean_missing(1, "reply lost"),
        "apply": lambda: mr.applied(1, before="before", after="after"),
        "verdict": lambda: mr.no_mean(1),
    }
    for s in setup:
        steps[s]()
    state = (mr.phase(1), mr.outcome(1), mr.why(1), mr.mean(1), mr.is_owner_lost(1))
    with pytest.raises(InvalidTransition, match=match):
        call(mr)
    assert (mr.phase(1), mr.outcome(1), mr.why(1), mr.mean(1), mr.is_owner_lost(1)) == state


def test_outcomes_are_refused_while_a_bucket_has_none() -> None:
    mr = _round()
    mr.published(0, _mean(0))
    with pytest.raises(InvalidTransition, match=r"round 7: buckets \[1, 2, 4\] have no outcome yet"):
        mr.outcomes()


# ---------------------------------------------------------------------- the outcome mapping
def test_a_round_with_every_outcome_gives_the_counts_of_its_result() -> None:
    """Buckets 0 (own) APPLIED, 1 OWNER_LOST, 2 REPAIRED, 4 STALE; then with an empty own
    mean, EMPTY: RoundResult's counts follow from MemberRound.outcomes()."""
    mr, clock = _round(), Clock()
    mr.published(0, _mean(0))
    clock.advance(BROADCAST_S - 0.5)
    assert mr.pull_timed_out(1, clock.now) is True  # b hung: 0.5 s left < 1 s
    mr.mean_missing(1, "deadline exceeded")
    mr.mean_missing(2, "reply lost")
    mr.mean_arrived(4, _mean(4))
    assert mr.no_mean(1) is BucketOutcome.OWNER_LOST
    assert mr.no_mean(2) is BucketOutcome.STALE
    assert mr.applied(4, before="before", after="other") is BucketOutcome.STALE
    assert mr.to_repair() == [2, 4]
    mr.repaired(2, "c", checksum="x", extra=_repair_extra(2))
    assert mr.outcomes() == [
        BucketOutcome.APPLIED,
        BucketOutcome.OWNER_LOST,
        BucketOutcome.REPAIRED,
        BucketOutcome.STALE,
    ]
    assert mr.broadcast_arrived_fraction == 2 / 4
    res = RoundResult(round=ROUND, members=("a", "b", "c"))
    res.count_outcomes(mr.outcomes())
    assert (res.applied_buckets, res.repaired_buckets, res.stale_buckets, res.skipped_buckets) == (1, 1, 2, 1)
    assert res.bucket_outcomes == {"applied": 1, "empty": 0, "owner_lost": 1, "stale": 1, "repaired": 1}

    mr2 = _round(owners=["a", "b", "", "", ""])
    mr2.published(0, _mean(0, chunks=0))
    mr2.mean_arrived(1, _mean(1, chunks=0))
    mr2.empty(1)
    res2 = RoundResult(round=ROUND, members=("a", "b", "c"))
    res2.count_outcomes(mr2.outcomes())
    assert res2.bucket_outcomes == {"applied": 0, "empty": 2, "owner_lost": 0, "stale": 0, "repaired": 0}
    assert res2.skipped_buckets == 2
