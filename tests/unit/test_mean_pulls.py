"""The ledger of served means that ``DiLoCo.close()`` waits on (``dtrain.rounds.pulls``)."""

from __future__ import annotations

import threading
import time

import pytest

from dtrain.errors import RejectCode, Rejected
from dtrain.rounds.pulls import MeanPulls, commit_decision

pytestmark = pytest.mark.timeout(30)


def test_nothing_expected_returns_at_once() -> None:
    w = MeanPulls().wait_pulled(timeout_s=5.0)
    assert w.round == -1 and not w.missing and w.reason == "nothing to wait for"


def test_wait_ends_when_every_member_pulled_every_owned_bucket() -> None:
    p = MeanPulls()
    p.expect(3, buckets=[0, 2], pullers=["b", "c"], until=time.monotonic() + 20)
    p.record(3, 0, "b", object())
    got: list = []

    def pull_rest() -> None:
        time.sleep(0.05)
        for who, b in (("b", 2), ("c", 0), ("c", 2)):
            got.append(p.record(3, b, who, (who, b)))  # returns the mean it was given

    t = threading.Thread(target=pull_rest)
    t.start()
    w = p.wait_pulled()
    t.join()
    assert w.round == 3 and w.missing == {} and w.reason == "all pulled"
    assert w.waited_s < 10  # ended by the pulls, not by the 20 s deadline
    assert got == [("b", 2), ("c", 0), ("c", 2)]


def test_wait_names_who_did_not_pull_what_at_the_deadline() -> None:
    p = MeanPulls()
    p.expect(1, buckets=[4, 5], pullers=["b", "c"], until=time.monotonic() + 0.2)
    p.record(1, 4, "b", None)
    p.record(1, 9, "b", None)  # a bucket it does not own here (a cached mean): not expected
    p.record(0, 5, "c", None)  # another round
    w = p.wait_pulled()  # None: until the broadcast deadline
    assert w.reason == "deadline" and w.missing == {"b": [5], "c": [4, 5]}
    assert 0.1 <= w.waited_s < 5


def test_a_closing_owner_serves_a_member_that_has_not_pulled_until_its_late_pulls_end() -> None:
    """``serve_until`` (the broadcast deadline + the repair window): the close waits for a
    member that has not pulled past the broadcast deadline, through its late pulls, and
    its late pull there ends the wait. The commit rule still decides at the broadcast
    deadline: a mean nobody took by then is withdrawn, and a late pull of it is answered
    ABORTED (the member holds θ_b as owner-lost), which ends the wait for it too."""
    now = time.monotonic()
    for withdrawn in (False, True):
        p = MeanPulls()
        p.expect(2, buckets=[0], pullers=["b"], until=now + 0.1, serve_until=now + 20)
        assert p.time_left_s(now) == pytest.approx(20, abs=0.5)
        if withdrawn:
            keep, why = p.settle(2, 0, until=now + 0.1)
            assert keep is False, why
        answers: list = []

        def late_pull(p: MeanPulls = p, answers: list = answers) -> None:
            time.sleep(0.4)  # past the broadcast deadline: a late pull
            try:
                answers.append(p.record(2, 0, "b", "mean"))
            except Rejected as e:
                answers.append(e.code)

        t = threading.Thread(target=late_pull)
        t.start()
        w = p.wait_pulled()
        t.join()
        assert answers == [RejectCode.ABORTED if withdrawn else "mean"]
        assert w.missing == {} and 0.3 <= w.waited_s < 10, w


def test_explicit_timeout_bounds_the_wait_and_zero_does_not_wait() -> None:
    p = MeanPulls()
    p.expect(0, buckets=[0], pullers=["b"], until=time.monotonic() + 60)
    assert p.wait_pulled(timeout_s=0).missing == {"b": [0]}
    t0 = time.monotonic()
    assert p.wait_pulled(timeout_s=0.1).reason == "deadline"
    assert time.monotonic() - t0 < 5


def test_pulls_before_the_round_opened_here_count_and_dead_members_are_not_awaited() -> None:
    p = MeanPulls()
    p.record(2, 0, "b", None)  # a fast peer's pull, served before expect() (a race of threads)
    p.expect(2, buckets=[0, 1], pullers=["b", "c"], until=time.monotonic() + 60)
    p.record(2, 1, "b", None)
    p.forget(["c"])  # the rendezvous declared c dead
    w = p.wait_pulled(timeout_s=5)
    assert w.missing == {} and w.waited_s < 1


def test_only_the_latest_round_is_waited_on_and_old_rounds_are_dropped() -> None:
    p = MeanPulls()
    for r in range(5):
        p.expect(r, buckets=[0], pullers=["b"], until=time.monotonic() + 60)
    p.record(4, 0, "b", None)
    assert p.latest_round() == 4 and p.wait_pulled(timeout_s=1).missing == {}
    assert len(p._missing) <= 2 and len(p._served) <= 3  # bounded memory


def test_time_left_is_the_latest_rounds_deadline() -> None:
    """``DiLoCo.close()`` lets served replies stream until then (a served pull is not yet a received one)."""
    p = MeanPulls()
    assert p.time_left_s(time.monotonic()) == 0.0
    now = time.monotonic()
    p.expect(1, buckets=[0], pullers=["b"], until=now + 2.0)
    p.expect(2, buckets=[0], pullers=["b"], until=now + 7.0)
    assert p.time_left_s(now) == pytest.approx(7.0)
    assert p.time_left_s(now + 10.0) == 0.0


def test_a_stale_members_pull_counts_only_once_it_pulled_the_buckets_state() -> None:
    # the member's θ_b differed from the mean's checksum_before: it repairs from this owner next,
    # so an owner closing after its last round must wait for that state pull too
    p = MeanPulls()
    p.expect(7, buckets=[0, 1], pullers=["b"], until=time.monotonic() + 20)
    p.record(7, 0, "b", None)
    p.record(7, 1, "b", None, needs_state=True)
    w = p.wait_pulled(timeout_s=0.05)
    assert w.reason == "deadline" and w.missing == {"b": [1]}
    p.record_state(0, "b")  # a state pull of another bucket does not count for bucket 1
    assert p.wait_pulled(timeout_s=0).missing == {"b": [1]}
    threading.Timer(0.05, p.record_state, args=(1, "b")).start()
    w = p.wait_pulled()
    assert w.missing == {} and w.reason == "all pulled" and w.waited_s < 10


def test_a_stale_pull_before_the_round_opened_here_still_waits_for_the_state() -> None:
    p = MeanPulls()
    p.record(2, 3, "c", None, needs_state=True)
    p.expect(2, buckets=[3], pullers=["c"], until=time.monotonic() + 20)
    assert p.wait_pulled(timeout_s=0).missing == {"c": [3]}
    p.record_state(3, "c")
    assert p.wait_pulled(timeout_s=0).reason == "all pulled"


# ---------------------------------------------------------------- the commit rule (MeanPulls.settle)


@pytest.mark.parametrize(
    "taken, left, now, keep, why",
    [
        (True, 0, 99.0, True, "a member took the mean"),
        (True, 2, 0.0, True, "a member took the mean"),
        (False, 0, 0.0, True, "every other member is gone (it resyncs from the survivors)"),
        (False, 2, 10.0, False, "no member took the mean by the broadcast deadline (2 expected)"),
        (False, 1, 9.5, None, "waiting 0.50s more for a member to take the mean"),
    ],
)
def test_commit_decision(taken: bool, left: int, now: float, keep: bool | None, why: str) -> None:
    assert commit_decision(taken=taken, pullers_left=left, now=now, until=10.0) == (keep, why)


def test_a_mean_is_kept_once_a_member_pulled_it() -> None:
    p = MeanPulls()
    p.expect(1, buckets=[0], pullers=["b", "c"], until=time.monotonic() + 20)
    threading.Timer(0.05, lambda: p.record(1, 0, "c", "mean")).start()
    t0 = time.monotonic()
    assert p.settle(1, 0, until=time.monotonic() + 20) == (True, "a member took the mean")
    assert time.monotonic() - t0 < 5.0  # woken by the pull, not the deadline
    assert p.record(1, 0, "b", "mean") == "mean"  # later pulls are served as before


def test_a_mean_nobody_took_by_the_deadline_is_withdrawn_and_later_pulls_are_refused_aborted() -> None:
    p = MeanPulls()
    p.expect(1, buckets=[0, 1], pullers=["b"], until=time.monotonic() + 20)
    keep, why = p.settle(1, 0, until=time.monotonic() + 0.1)
    assert (keep, why) == (False, "no member took the mean by the broadcast deadline (1 expected)")
    with pytest.raises(Rejected) as e:
        p.record(1, 0, "b", "mean")
    assert e.value.code is RejectCode.ABORTED and "withdrew" in e.value.reason
    assert p.record(1, 1, "b", "other") == "other"  # only that bucket
    assert p.withdrew(1, 0) and not p.withdrew(1, 1) and not p.withdrew(2, 0)


def test_who_asked_for_a_mean_is_heard_per_round_and_old_rounds_are_dropped() -> None:
    p = MeanPulls()
    p.heard(5, "b")
    p.heard(5, "b")
    p.heard(6, "c")
    assert p.heard_from(5) == {"b"} and p.heard_from(6) == {"c"} and p.heard_from(7) == frozenset()
    p.expect(9, buckets=[0], pullers=["b"], until=time.monotonic() + 1)  # keeps rounds >= 9 - 2
    assert p.heard_from(5) == frozenset() and p.heard_from(6) == frozenset()


def test_a_mean_is_kept_at_once_when_every_other_member_is_gone() -> None:
    p = MeanPulls()
    p.expect(4, buckets=[2], pullers=["b", "c"], until=time.monotonic() + 20)
    p.forget(["b", "c"])
    t0 = time.monotonic()
    assert p.settle(4, 2, until=time.monotonic() + 20) == (
        True,
        "every other member is gone (it resyncs from the survivors)",
    )
    assert time.monotonic() - t0 < 5.0
