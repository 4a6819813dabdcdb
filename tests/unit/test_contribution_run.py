"""One sender's contributions as columns (dtrain.protocol.ContributionRun, what the datagram
receive thread hands on) and the owner's one-pass check of a run (OpenRound.check_run): a run's
items are the Contributions it stands for, runs join and split only where sender, round, codec
and claim agree, and check_run passes exactly the runs whose every chunk passes OpenRound.check,
with check's effects."""

from __future__ import annotations

import pytest

from dtrain.aggregation import AggregationConfig
from dtrain.errors import Rejected
from dtrain.protocol import Contribution, ContributionRun, MeanChunk, Member, RoundPlan, made
from dtrain.rounds.owner import OpenRound

pytestmark = pytest.mark.timeout(30)

# bucket 0 (owned by a): three chunks of 4 elements; bucket 1 owned by b
CHUNKS = [((0, 4), (4, 4), (8, 4)), ((0, 4),)]


def _c(chunk: int, *, sender: str = "b", bucket: int = 0, tokens: int = 0, codec: str = "int8", **kw) -> Contribution:
    off, n = CHUNKS[bucket][min(chunk, len(CHUNKS[bucket]) - 1)]
    fields = dict(offset=off, numel=n, payload=bytes([chunk]) * (chunk + 3))
    fields.update(kw)
    return Contribution(round=3, bucket=bucket, chunk=chunk, codec=codec, sender=sender, tokens=tokens, **fields)


def test_a_run_of_views_into_one_buffer_stands_for_its_contributions() -> None:
    cs = [_c(0), _c(1), _c(2)]
    view = memoryview(b"".join(c.payload for c in cs)).toreadonly()  # as the receive thread hands them on
    bounds = [0, 3, 7, 12]
    run = ContributionRun(
        round=3,
        sender="b",
        codec="int8",
        tokens=0,
        buckets=[0, 0, 0],
        chunks=[0, 1, 2],
        offsets=[0, 4, 8],
        numels=[4, 4, 4],
        payloads=[view[a:b] for a, b in zip(bounds, bounds[1:])],
    )
    assert len(run) == 3 and list(run) == cs and run[1] == cs[1] and run[-1] == cs[2]
    assert all(isinstance(p, memoryview) and p.readonly for p in run.payloads())
    sub = run[1:]
    assert isinstance(sub, ContributionRun) and list(sub) == cs[1:] and sub.chunks == [1, 2]
    assert ContributionRun.concat(cs) is not None and list(ContributionRun.concat(cs)) == cs
    assert list(ContributionRun.concat([run[:1], cs[1], run[2:]])) == cs


def test_a_run_refuses_columns_that_do_not_line_up() -> None:
    common = dict(round=3, sender="b", codec="int8", tokens=0, buckets=[0, 0], chunks=[0, 1], offsets=[0, 4])
    with pytest.raises(ValueError, match="columns of unequal length"):
        ContributionRun(numels=[4], payloads=[b"", b""], **common)
    with pytest.raises(ValueError, match="1 payloads for 2 contributions"):
        ContributionRun(numels=[4, 4], payloads=[b""], **common)


@pytest.mark.parametrize(
    "other",
    [dict(sender="c"), dict(tokens=5), dict(codec="fp32"), dict(round=4)],
    ids=["sender", "claim", "codec", "round"],
)
def test_runs_join_and_split_only_where_sender_round_codec_and_claim_agree(other: dict) -> None:
    odd = _c(1)
    odd = Contribution(**{**odd.__dict__, **other})
    cs = [_c(0), odd, _c(2)]
    assert ContributionRun.concat(cs) is None
    stretches = ContributionRun.stretches(cs)
    assert [list(r) for r in stretches] == [[cs[0]], [odd], [cs[2]]]
    assert [list(r) for r in ContributionRun.stretches([_c(0), _c(1), odd])] == [[_c(0), _c(1)], [odd]]
    assert ContributionRun.concat([]) is None and ContributionRun.stretches([]) == []


def _round(token_weighted: bool = False) -> OpenRound:
    plan = RoundPlan(
        round=3,
        members=tuple(Member(site_id=s, address=f"inproc:{i}") for i, s in enumerate("abc")),
        reduce_timeout_s=10.0,
        broadcast_timeout_s=20.0,
    )
    agg = AggregationConfig(token_weighted=token_weighted)
    return OpenRound(
        plan=plan, owners=["a", "b"], site_id="a", chunks=CHUNKS, aggregation=agg, opened_at=0.0, tokens=100
    )


def _checks_each(o: OpenRound, cs: list[Contribution]) -> list[str | None]:
    out: list[str | None] = []
    for c in cs:
        try:
            o.check(c)
            out.append(None)
        except Rejected as e:
            out.append(f"{e.code.name}: {e.reason}")
    return out


BAD = {
    "not a member": dict(sender="z"),
    "bucket out of range": dict(bucket=5),
    "bucket not owned here": dict(bucket=1),
    "chunk out of range": dict(chunk=7),
    "offset not the chunk's": dict(offset=5),
    "numel not the chunk's": dict(numel=3),
}


@pytest.mark.parametrize("bad", [None, *BAD], ids=["plain", *BAD])
def test_check_run_passes_exactly_the_runs_whose_every_chunk_passes_check(bad: str | None) -> None:
    cs = [_c(0), _c(1), _c(2)]
    if bad is not None:  # the last chunk bad (a run's sender is every chunk's)
        at = range(3) if "sender" in BAD[bad] else [2]
        cs = [Contribution(**{**c.__dict__, **BAD[bad]}) if i in at else c for i, c in enumerate(cs)]
    run = ContributionRun.concat(cs)
    assert run is not None
    each = _checks_each(_round(), cs)
    assert _round().check_run(run) is all(r is None for r in each)
    if bad is not None:  # the per-chunk checks name why (what the owner records, chunk by chunk)
        assert any(r is not None for r in each)


def test_check_run_registers_a_claim_as_check_does_and_refuses_one_out_of_bound() -> None:
    ok = ContributionRun.concat([_c(0, tokens=100), _c(1, tokens=100)])
    o = _round(token_weighted=True)
    assert o.check_run(ok) is True
    assert o.claims == {"a": 100, "b": 100}  # the owner's own, and the run's first claim
    assert o.check_run(ContributionRun.concat([_c(2, tokens=101)])) is False  # not the claim it made
    with pytest.raises(Rejected, match="claims 101 tokens, 100 on its earlier chunks"):
        o.check(_c(2, tokens=101))


def test_made_equals_the_frozen_constructor_and_stays_frozen() -> None:
    """``protocol.made`` (the fast path the engine, means and datagram receive use per chunk) builds
    the object the frozen dataclass's constructor builds: equal, same hash, still frozen."""
    import dataclasses

    fields = dict(chunk=2, offset=8, numel=4, codec="int8", payload=b"\x01\x02", senders=("a", "b"))
    fast, slow = made(MeanChunk, **fields), MeanChunk(**fields)
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert dataclasses.asdict(fast) == dataclasses.asdict(slow)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.chunk = 3  # type: ignore[misc]
    c = _c(1)
    assert made(Contribution, **dataclasses.asdict(c)) == c
