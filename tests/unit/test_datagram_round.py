"""The member's next step about a pushed mean (``mean_wait_decision``): wait, re-request, or
pull over gRPC, from what has arrived and ``now``."""

from __future__ import annotations

import pytest

from dtrain.protocol import MeanChunk
from dtrain.transports.datagram_round import MeanAssembly, mean_wait_decision

pytestmark = pytest.mark.timeout(10)

KW = dict(fallback_at=100.0, silent_after=10.0, nack_idle_s=0.05, max_nacks=3)


def _chunk(c: int) -> MeanChunk:
    return MeanChunk(chunk=c, offset=c, numel=1, codec="fp32", payload=b"", senders=("a",))


def test_a_mean_of_which_nothing_arrived_is_pulled_soon_after_the_owners_reduce_deadline() -> None:
    m = MeanAssembly()
    step = mean_wait_decision(m, 5.0, **KW)
    assert step.action == "wait" and step.wake_at == 10.0  # the owner may still be reducing
    assert mean_wait_decision(m, 10.0, **KW).action == "nack"  # all of it asked for once
    m.nacks, m.nack_at = 1, 10.0
    step = mean_wait_decision(m, 10.05, **KW)
    assert step.action == "wait" and step.wake_at == pytest.approx(10.1)
    step = mean_wait_decision(m, 10.1, **KW)
    assert step.action == "pull" and "unanswered" in step.reason  # at 10.1 s, not at fallback_at (100 s)


def test_a_nack_that_brought_nothing_waits_a_round_trip_before_the_owner_counts_as_silent() -> None:
    """On a transoceanic path (RTO 0.3 s) the answer to a NACK cannot come within 2 x
    nack_idle_s (0.1 s): the mean was pulled over gRPC before its answer could arrive."""
    m = MeanAssembly(nacks=1, nack_at=10.0)
    step = mean_wait_decision(m, 10.2, **KW, rtt_s=0.3)
    assert step.action == "wait" and step.wake_at == pytest.approx(10.0 + 0.3 + 0.1)
    assert mean_wait_decision(m, 10.4, **KW, rtt_s=0.3).action == "pull"


def test_arriving_chunks_are_waited_for_then_re_requested_a_bounded_number_of_times() -> None:
    m = MeanAssembly(num_chunks=3, chunks={0: _chunk(0)}, last_arrival=20.0)
    step = mean_wait_decision(m, 20.05, **KW)
    assert step.action == "wait" and step.wake_at == pytest.approx(20.1)  # 2 x nack_idle_s of quiet
    step = mean_wait_decision(m, 20.1, **KW)
    assert step.action == "nack" and "2 chunks missing" in step.reason
    m.final_meta_seen = True  # the owner sent everything: 5 ms of quiet is enough
    assert mean_wait_decision(m, 20.006, **KW).action == "nack"
    m.nacks, m.nack_at, m.final_meta_seen = 3, 20.2, False
    # the last resend has time to arrive: 4 x nack_idle_s; nothing came since that NACK, so no
    # quiet is waited for on top (an answer on its way shows as arrivals)
    step = mean_wait_decision(m, 20.2, **KW)
    assert step.action == "wait" and step.wake_at == pytest.approx(20.405)
    m.last_arrival = 20.3  # part of an answer came: then the usual 2 x nack_idle_s of quiet
    step = mean_wait_decision(m, 20.405, **KW)
    assert step.action == "wait" and step.wake_at == pytest.approx(20.5)
    step = mean_wait_decision(m, 20.5, **KW)
    assert step.action == "pull" and "3 NACKs spent" in step.reason


def test_each_nack_waits_twice_as_long_for_its_answer() -> None:
    """An owner slowed down (busy CPU) is not asked again every 150 ms: the k-th NACK's answer
    gets nack_idle_s x 2^(k-1) (at most 64x) before the next NACK, plus the quiet."""
    kw = dict(KW, max_nacks=10)
    for nacks, wait_s in ((1, 0.05), (2, 0.1), (3, 0.2), (5, 0.8), (7, 3.2), (9, 3.2)):
        m = MeanAssembly(num_chunks=3, chunks={0: _chunk(0)}, last_arrival=20.0, nacks=nacks, nack_at=20.0)
        step = mean_wait_decision(m, 20.0, **kw)
        assert step.action == "wait" and step.wake_at == pytest.approx(20.0 + wait_s + 0.1), (nacks, step)
        assert mean_wait_decision(m, 20.0 + wait_s + 0.1, **kw).action == "nack"


def test_complete_is_done_and_the_fallback_reserve_ends_any_wait() -> None:
    m = MeanAssembly(num_chunks=1, chunks={0: _chunk(0)}, last_arrival=1.0)
    assert mean_wait_decision(m, 1000.0, **KW).action == "done"
    assert mean_wait_decision(MeanAssembly(), 100.0, **KW).action == "pull"
    step = mean_wait_decision(MeanAssembly(last_arrival=99.95), 99.96, **KW)
    assert step.action == "wait" and step.wake_at == 100.0  # never past the reserve


def test_while_the_owner_still_sends_other_means_quiet_on_one_bucket_is_not_loss() -> None:
    m = MeanAssembly(num_chunks=3, chunks={0: _chunk(0)}, last_arrival=20.0)
    step = mean_wait_decision(m, 20.5, owner_active_at=20.45, **KW)  # the owner sent something 50 ms ago
    assert step.action == "wait" and step.wake_at == pytest.approx(20.55)
    assert mean_wait_decision(m, 20.55, owner_active_at=20.45, **KW).action == "nack"
    m.final_meta_seen = True  # the owner said it sent all of this bucket: missing chunks are lost
    assert mean_wait_decision(m, 20.5, owner_active_at=20.49, **KW).action == "nack"
    empty = MeanAssembly()  # nothing of this bucket yet, but the owner is busy with others
    step = mean_wait_decision(empty, 10.0, owner_active_at=9.99, **KW)
    assert step.action == "wait" and step.wake_at == pytest.approx(10.09)


def test_a_nacks_answer_is_waited_for_at_least_an_rtt_unless_its_final_meta_came() -> None:
    """With the path's RTT given, no NACK goes again before its answer could have come back
    (rtt_s + nack_idle_s); once the answer's final meta arrived the answer is whole, and what
    still misses is asked for 5 ms after its last datagram."""
    kw = dict(KW, max_nacks=10, rtt_s=0.08)
    m = MeanAssembly(num_chunks=3, chunks={0: _chunk(0)}, last_arrival=20.0, nacks=1, nack_at=20.0)
    step = mean_wait_decision(m, 20.0, **kw)
    assert step.action == "wait" and step.wake_at == pytest.approx(20.0 + 0.08 + 0.05 + 0.1)
    m.final_meta_seen, m.last_arrival = True, 20.09  # the answer (and its final meta) came at 20.09
    step = mean_wait_decision(m, 20.091, **kw)
    assert step.action == "wait" and step.wake_at == pytest.approx(20.095)
    assert mean_wait_decision(m, 20.095, **kw).action == "nack"


def test_received_contributions_and_mean_chunks_equal_their_dataclasses() -> None:
    """The receive path builds Contribution and MeanChunk without their frozen constructors (a
    datagram's worth of CPU each): the objects must be the dataclasses' own, field for field, and
    a field added to either dataclass must be added there too (this test then fails)."""
    import dataclasses

    from dtrain.protocol import Contribution, MeanChunk, Member, RoundPlan
    from dtrain.transports.datagram_means import _mean_chunk
    from dtrain.transports.datagram_recv import _contribution
    from dtrain.transports.datagram_round import RoundState, senders_bitmap
    from dtrain.transports.datagram_wire import Header, codec_id

    plan = RoundPlan(
        round=5,
        members=tuple(Member(site_id=f"s{i}", address=f"127.0.0.1:{9000 + i}") for i in range(3)),
        reduce_timeout_s=5,
        broadcast_timeout_s=5,
        datagram_key=bytes(32),
    )
    rs = RoundState(plan, ["s0", "s1"], "s0", run=7, max_buffer_bytes=1 << 20)
    h = Header(b"DG", 1, 1, 7, 5, 1, 3, 3 * 1280, 1280, codec_id("int8"), 2, 99, 0, 1)
    c = _contribution(rs, h, b"payload", 4096)
    want = Contribution(
        round=5, bucket=1, chunk=3, offset=3840, numel=1280, codec="int8", sender="s2", payload=b"p", tokens=4096
    )
    assert c == dataclasses.replace(want, payload=b"payload") and type(c) is Contribution
    assert set(vars(c)) == {f.name for f in dataclasses.fields(Contribution)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.chunk = 4  # type: ignore[misc]
    bits = senders_bitmap(("s0", "s2"), rs.site_ids)
    m = _mean_chunk(rs, h, b"mean", bits)
    assert m == MeanChunk(chunk=3, offset=3840, numel=1280, codec="int8", payload=b"mean", senders=("s0", "s2"))
    assert set(vars(m)) == {f.name for f in dataclasses.fields(MeanChunk)} and hash(m) == hash(dataclasses.replace(m))
    assert _mean_chunk(rs, h, b"x", bits).senders is m.senders  # decoded once per bitmap and round


def test_after_the_final_meta_missing_chunks_wait_for_the_paths_reordering() -> None:
    """On a path that reorders (the owner's observed reordering grace, here 60 ms), chunks the
    final meta overtook are waited for that long before a NACK asks for them again."""
    m = MeanAssembly(num_chunks=3, chunks={0: _chunk(0)}, last_arrival=20.0, final_meta_seen=True)
    step = mean_wait_decision(m, 20.01, **KW, reorder_s=0.06)
    assert step.action == "wait" and step.wake_at == pytest.approx(20.06)
    assert mean_wait_decision(m, 20.06, **KW, reorder_s=0.06).action == "nack"
    assert mean_wait_decision(m, 20.01, **KW).action == "nack"  # in order: 5 ms
