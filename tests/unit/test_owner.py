"""The owner side of one open round (dtrain.rounds.owner.OpenRound), built directly with
an injected clock: which buckets are due when, what a lost member changes, how late,
retried and conflicting contributions are answered, and that the mean does not depend
on the order contributions arrive in."""

from __future__ import annotations

import hashlib
import zlib

import pytest
import torch

from dtrain.aggregation import AggregationConfig
from dtrain.errors import RejectCode, Rejected
from dtrain.protocol import Contribution, Member, RoundPlan
from dtrain.rounds.owner import CLOSE_COMPLETE, CLOSE_DEADLINE, Closing, OpenRound
from dtrain.rounds.types import MAX_REJECT_EXAMPLES_PER_CODE

pytestmark = pytest.mark.timeout(30)

T0 = 100.0  # the clock when the round opened (any origin: time is passed in)
REDUCE_S = 10.0
# bucket 0: two chunks of 4 elements; bucket 1: one chunk of 3; bucket 2 (owned by b): one of 2
CHUNKS = [((0, 4), (4, 4)), ((0, 3),), ((0, 2),)]
OWNERS = ["a", "a", "b"]


def _round(members=("a", "b", "c"), owners=OWNERS, chunks=CHUNKS, **agg) -> OpenRound:
    plan = RoundPlan(
        round=3,
        members=tuple(Member(site_id=s, address=f"inproc:{i}") for i, s in enumerate(members)),
        reduce_timeout_s=REDUCE_S,
        broadcast_timeout_s=2 * REDUCE_S,
    )
    return OpenRound(
        plan=plan, owners=owners, site_id="a", chunks=chunks, aggregation=AggregationConfig(**agg), opened_at=T0
    )


def _values(sender: str, bucket: int, chunk: int, scale: float = 1.0) -> torch.Tensor:
    n = CHUNKS[bucket][chunk][1]
    seed = zlib.crc32(f"{sender}/{bucket}/{chunk}".encode())
    return scale * torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _digest(v: torch.Tensor) -> bytes:
    return hashlib.blake2b(v.numpy().tobytes(), digest_size=16).digest()


def _send(o: OpenRound, sender: str, bucket: int, chunk: int, now: float = T0 + 1, v: torch.Tensor | None = None):
    v = _values(sender, bucket, chunk) if v is None else v
    return o.accept(sender, bucket, chunk, v, _digest(v), now=now)


def _send_bucket(o: OpenRound, sender: str, bucket: int, now: float = T0 + 1) -> None:
    for c in range(len(CHUNKS[bucket])):
        assert _send(o, sender, bucket, c, now) is True


def test_complete_bucket_is_due_at_once_and_its_mean_divides_by_the_senders() -> None:
    o = _round()
    assert o.mine == (0, 1) and o.expected == 3 * 3  # 3 chunks owned x 3 members
    assert o.due(T0 + 1) is None  # nothing arrived, deadline far
    for s in ("a", "b", "c"):
        _send_bucket(o, s, 0)
    assert o.awaited(0) == 0 and o.awaited(1) == 3
    decision = o.due(T0 + 1)
    assert decision == Closing((0,), CLOSE_COMPLETE)
    assert o.due(T0 + 1) == decision  # a pure decision: asking again changes nothing
    o.close(decision.buckets)
    assert o.due(T0 + 1) is None and not o.all_closed
    reductions = o.finalize(0)
    for red in reductions:
        want = sum(_values(s, 0, red.chunk) for s in ("a", "b", "c")) / 3
        assert red.senders == ("a", "b", "c") and torch.allclose(red.mean, want, atol=1e-6)
    # the digests each finalized chunk counted are public, per sender
    assert o.digests[(0, 1)] == {s: _digest(_values(s, 0, 1)) for s in ("a", "b", "c")}
    assert o.reduce_arrived_fraction == pytest.approx(6 / 9)
    with pytest.raises(ValueError, match="finalized already"):
        o.finalize(0)
    with pytest.raises(ValueError, match="not closed"):
        o.finalize(1)


def test_the_live_fraction_counts_only_members_that_sent_something() -> None:
    """A slow link delivers part of a sender's chunks; a dead or partitioned member sends
    none. The live fraction reads the slowest live sender's share as its link's pace (what the
    rendezvous extrapolates a cut round from) and leaves the silent one out, so a fault never
    reads as a slow link."""
    o = _round()  # a owns buckets 0 (2 chunks) and 1 (1 chunk): 3 chunks per sender
    _send_bucket(o, "a", 0)
    _send_bucket(o, "a", 1)
    assert o.reduce_live_fraction == 1.0  # only its own: no link read yet
    assert _send(o, "b", 0, 0) is True  # b delivered 1 of its 3 chunks; c nothing (partitioned)
    assert o.reduce_live_fraction == pytest.approx(1 / 3)
    assert o.reduce_arrived_fraction == pytest.approx(4 / 9)  # c's missing chunks count here
    _send_bucket(o, "c", 1)
    assert o.reduce_live_fraction == pytest.approx(1 / 3)  # b and c both sent 1 of 3
    _send(o, "c", 0, 0)
    assert o.reduce_live_fraction == pytest.approx(1 / 3)  # the slowest live sender: b
    assert _round(owners=["b", "b", "b"]).reduce_live_fraction == 1.0  # owns nothing


def test_reduce_deadline_closes_every_remaining_bucket_over_what_arrived() -> None:
    o = _round()
    _send(o, "a", 0, 0)
    _send(o, "c", 0, 0)
    assert o.due(T0 + REDUCE_S - 1e-6) is None
    decision = o.due(T0 + REDUCE_S)
    assert decision == Closing((0, 1), CLOSE_DEADLINE)
    o.close(decision.buckets)
    assert o.all_closed and o.due(T0 + REDUCE_S + 5) is None
    c0, c1 = o.finalize(0)
    assert c0.senders == ("a", "c")
    assert torch.allclose(c0.mean, (_values("a", 0, 0) + _values("c", 0, 0)) / 2)  # / 2 arrived, not / 3 members
    assert c1.mean is None and c1.senders == ()  # nothing arrived for this chunk
    (b1,) = o.finalize(1)
    assert b1.mean is None


def test_a_lost_member_stops_being_awaited() -> None:
    o = _round()
    for s in ("a", "c"):
        _send_bucket(o, s, 0)
        _send_bucket(o, s, 1)
    assert o.due(T0 + 1) is None and o.awaited(0) == 2 and o.awaited(1) == 1
    assert o.members_lost({"zed", "a"}) == frozenset()  # a non-member and this site itself: ignored
    assert o.members_lost({"b"}) == frozenset({"b"})
    assert o.members_lost({"b"}) == frozenset()  # already lost
    assert o.lost == {"b"}
    assert o.due(T0 + 1) == Closing((0, 1), CLOSE_COMPLETE)  # long before the deadline


def test_a_lost_members_chunk_that_arrives_before_finalize_is_counted() -> None:
    o = _round()
    _send_bucket(o, "a", 1)
    o.members_lost({"b", "c"})
    assert o.due(T0 + 1) == Closing((1,), CLOSE_COMPLETE)
    # c is lost, but its chunk arrives before the bucket closes: counted, nothing goes negative
    assert _send(o, "c", 1, 0) is True
    assert o.awaited(1) == 0
    o.close((1,))
    (red,) = o.finalize(1)
    assert red.senders == ("a", "c")
    assert torch.allclose(red.mean, (_values("a", 1, 0) + _values("c", 1, 0)) / 2)
    # after the close, a chunk of b (lost, never counted here) is late
    with pytest.raises(Rejected, match="already finalized") as e:
        _send(o, "b", 1, 0)
    assert e.value.code is RejectCode.FAILED_PRECONDITION


def test_a_member_that_leaves_mid_round_counts_for_what_it_sent() -> None:
    o = _round()
    assert _send(o, "b", 0, 0) is True  # b sends its first chunk of bucket 0, then dies
    for s in ("a", "c"):
        _send_bucket(o, s, 0)
    assert o.awaited(0) == 1  # b's second chunk
    o.members_lost({"b"})
    assert o.awaited(0) == 0
    decision = o.due(T0 + 2)
    assert decision == Closing((0,), CLOSE_COMPLETE)
    o.close(decision.buckets)
    c0, c1 = o.finalize(0)
    assert c0.senders == ("a", "b", "c") and c1.senders == ("a", "c")


def test_an_identical_retry_after_close_is_a_no_op_and_a_different_payload_is_refused() -> None:
    o = _round()
    for s in ("a", "b", "c"):
        _send_bucket(o, s, 1)
    v = _values("b", 1, 0)
    assert _send(o, "b", 1, 0, v=v) is False  # retry while open: counted once
    o.close(o.due(T0 + 1).buckets)
    assert _send(o, "b", 1, 0, now=T0 + REDUCE_S + 1, v=v) is False  # retry after close (and deadline)
    with pytest.raises(Rejected, match="already counted in its mean") as e:
        _send(o, "b", 1, 0, v=-v)
    assert e.value.code is RejectCode.ALREADY_EXISTS
    (red,) = o.finalize(1)
    assert red.senders == ("a", "b", "c")
    assert torch.allclose(red.mean, sum(_values(s, 1, 0) for s in "abc") / 3)
    # while open, a different payload from a counted sender is refused the same way
    assert _send(o, "a", 0, 0, v=torch.zeros(4)) is True
    with pytest.raises(Rejected, match="already accepted") as e:
        _send(o, "a", 0, 0, v=torch.ones(4))
    assert e.value.code is RejectCode.ALREADY_EXISTS


def test_a_late_contribution_is_refused() -> None:
    o = _round()
    _send(o, "a", 0, 0)
    # past the reduce deadline, before the finalizer closed the bucket
    with pytest.raises(Rejected, match="reduce deadline passed 0.500 s ago") as e:
        _send(o, "b", 0, 0, now=T0 + REDUCE_S + 0.5)
    assert e.value.code is RejectCode.FAILED_PRECONDITION
    assert _send(o, "a", 0, 0, now=T0 + REDUCE_S + 0.5) is False  # an identical retry still is a no-op
    o.close(o.due(T0 + REDUCE_S + 0.5).buckets)
    with pytest.raises(Rejected, match="round 3 bucket 1 is already finalized") as e:
        _send(o, "b", 1, 0, now=T0 + 1)  # closed: late whatever the clock says
    assert e.value.code is RejectCode.FAILED_PRECONDITION
    assert o.arrived == 1


def test_check_refuses_what_does_not_fit_the_round() -> None:
    o = _round()

    def contribution(**kw) -> Contribution:
        fields = dict(round=3, bucket=0, chunk=1, offset=4, numel=4, codec="fp32", sender="b", payload=b"")
        return Contribution(**{**fields, **kw})

    o.check(contribution())
    for kw, code, why in [
        (dict(sender="mallory"), RejectCode.PERMISSION_DENIED, "mallory is not a member of round 3"),
        (dict(bucket=7), RejectCode.INVALID_ARGUMENT, r"bucket 7 out of range \[0, 3\)"),
        (dict(bucket=2, chunk=0, offset=0, numel=2), RejectCode.FAILED_PRECONDITION, "owned by b, not a"),
        (dict(chunk=2), RejectCode.INVALID_ARGUMENT, r"chunk 2 out of range \[0, 2\) of bucket 0"),
        (dict(offset=5), RejectCode.INVALID_ARGUMENT, "covers offset 4 numel 4, got offset 5 numel 4"),
    ]:
        with pytest.raises(Rejected, match=why) as e:
            o.check(contribution(**kw))
        assert e.value.code is code


def test_rejections_are_counted_by_code_with_a_few_examples() -> None:
    o = _round()
    for i in range(12):
        kept = o.reject("c", RejectCode.INVALID_ARGUMENT, f"bad chunk {i}")
        assert kept is (i < MAX_REJECT_EXAMPLES_PER_CODE)
    o.reject("b", RejectCode.FAILED_PRECONDITION, "late")
    assert o.rejections.by_code() == {"FAILED_PRECONDITION": 1, "INVALID_ARGUMENT": 12}
    assert o.rejections.example_reasons()["INVALID_ARGUMENT"] == [f"bad chunk {i}" for i in range(5)]
    assert o.faulty_senders == {"c"}  # a late chunk is no fault of the sender's


def _orders_sum_differently(vals: dict[str, torch.Tensor], orders: list[list[str]]) -> bool:
    sums = []
    for order in orders:
        acc = torch.zeros_like(next(iter(vals.values())))
        for s in order:
            acc += vals[s]
        sums.append(acc)
    return not all(torch.equal(sums[0], x) for x in sums[1:])


@pytest.mark.parametrize("robust", [False, True])
def test_the_mean_is_bit_identical_whatever_the_arrival_order(robust: bool) -> None:
    """Owners sum in sender-id order, so two runs with the same contributions give the same θ
    even when the network delivers them in another order (fp32 addition is not associative)."""
    members = ("s0", "s1", "s2", "s3", "s4", "s5")
    chunks = [((0, 4096),)]
    g = torch.Generator().manual_seed(5)
    vals = {
        s: torch.randn(4096, generator=g) * torch.pow(10.0, torch.empty(4096).uniform_(-6, 6, generator=g))
        for s in members
    }
    arrivals = [
        ["s0", "s1", "s2", "s3", "s4", "s5"],
        ["s5", "s3", "s1", "s4", "s0", "s2"],
        ["s2", "s4", "s5", "s0", "s3", "s1"],  # s1 last: everything before it waits out of turn
    ]
    assert _orders_sum_differently(vals, arrivals)  # the arrival order would change the bits
    means = []
    for arrival in arrivals:
        o = OpenRound(
            plan=RoundPlan(
                round=0,
                members=tuple(Member(site_id=s, address="x") for s in members),
                reduce_timeout_s=1.0,
                broadcast_timeout_s=2.0,
            ),
            owners=["s0"],
            site_id="s0",
            chunks=chunks,
            aggregation=AggregationConfig(trim_fraction=0.2) if robust else AggregationConfig(),
            opened_at=0.0,
        )
        for s in arrival:
            assert o.accept(s, 0, 0, vals[s].clone(), _digest(vals[s]), now=0.5)
        o.close(o.due(0.5).buckets)
        (red,) = o.finalize(0)
        assert red.senders == members
        means.append(red.mean)
    for m in means[1:]:
        assert torch.equal(m, means[0])


def test_the_mean_over_a_subset_is_bit_identical_whatever_the_arrival_order() -> None:
    """A member that never sends leaves a gap in the order: the rest still sum alike."""
    members = ("a", "b", "c", "d")
    g = torch.Generator().manual_seed(9)
    vals = {
        s: torch.randn(512, generator=g) * torch.pow(10.0, torch.randint(-5, 6, (512,), generator=g).float())
        for s in "acd"
    }
    arrivals = [["a", "c", "d"], ["d", "c", "a"], ["c", "d", "a"]]
    assert _orders_sum_differently(vals, arrivals)
    means = []
    for arrival in arrivals:
        o = _round(members=members, owners=["a"], chunks=[((0, 512),)])
        for s in arrival:
            o.accept(s, 0, 0, vals[s], _digest(vals[s]), now=T0)
        o.close(o.due(T0 + REDUCE_S).buckets)  # b never sends: closed at the deadline
        (red,) = o.finalize(0)
        assert red.senders == ("a", "c", "d")
        means.append(red.mean)
    assert all(torch.equal(m, means[0]) for m in means[1:])


def test_a_senders_bucket_end_closes_only_that_bucket_and_counts_nothing_twice() -> None:
    """BUCKET_END (sender_done with buckets): the sender's chunks still missing in that bucket were
    lost, so the bucket stops waiting for them; its other buckets still wait; a chunk of it that
    arrives after is counted without going below zero; its SEND_END later changes only the rest."""
    o = _round()
    for s in ("a", "b"):
        _send_bucket(o, s, 0)
        _send_bucket(o, s, 1)
    assert _send(o, "c", 0, 0) is True  # c's chunk 1 of bucket 0 is lost
    assert o.awaited(0) == 1 and o.awaited(1) == 1
    assert o.sender_done("c", [0]) is True
    assert o.awaited(0) == 0 and o.awaited(1) == 1  # bucket 1 still waits for c
    assert o.due(T0 + 1) == Closing((0,), CLOSE_COMPLETE)
    assert o.sender_done("c", [0]) is False  # a repeat (its second copy) changes nothing
    assert o.sender_done("zed", [0]) is False and o.sender_done("a", [1]) is False  # non-member, this site
    o.close((0,))
    (r0, r1) = o.finalize(0)
    assert r0.senders == ("a", "b", "c") and r1.senders == ("a", "b")  # the lost chunk stays out
    assert o.sender_done("c") is True  # its SEND_END: bucket 1 no longer waits either
    assert o.awaited(1) == 0 and o.due(T0 + 1) == Closing((1,), CLOSE_COMPLETE)
    # c's chunk of bucket 1 that still arrives before the close is counted, once
    assert _send(o, "c", 1, 0) is True and o.awaited(1) == 0
    o.close((1,))
    assert o.finalize(1)[0].senders == ("a", "b", "c")
