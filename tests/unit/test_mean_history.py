"""MeanHistory: the last rounds' applied means a site keeps for a site behind (issue 33)."""

from __future__ import annotations

import pytest

from dtrain.errors import StateTransferError
from dtrain.protocol import BucketMean, MeanChunk
from dtrain.rounds.history import AppliedMean, MeanHistory, NotRetained, decode_history_info, history_info_state


def _mean(r: int, b: int, nbytes: int) -> BucketMean:
    ch = MeanChunk(chunk=0, offset=0, numel=nbytes // 4, codec="fp32", payload=b"x" * nbytes, senders=("a",))
    return BucketMean(round=r, bucket=b, owner="a", chunks=(ch,), checksum_before="s", checksum_after="t")


def _round(r: int, nbytes: int = 100) -> dict[int, AppliedMean | None]:
    return {0: AppliedMean(_mean(r, 0, nbytes), (0.7,)), 1: AppliedMean(None, (0.7,)), 2: None}


def test_keeps_the_last_rounds_by_count_and_tells_unchanged_from_unknown():
    h = MeanHistory(max_rounds=3, max_bytes=10_000)
    for r in range(5):
        h.close_round(r, _round(r))
    assert h.span() == (2, 4) and h.bytes_kept() == 300
    assert h.get(4, 0).mean.round == 4 and h.get(4, 0).lrs == (0.7,)
    assert h.get(3, 1).mean is None  # unchanged that round
    with pytest.raises(NotRetained, match="not known here"):
        h.get(3, 2)
    with pytest.raises(NotRetained, match=r"round 1 not kept here \(kept: \[2, 4\]\)"):
        h.get(1, 0)


def test_the_byte_bound_drops_the_oldest_and_a_gap_starts_again():
    h = MeanHistory(max_rounds=10, max_bytes=250)
    for r in range(4):
        h.close_round(r, _round(r))
    assert h.span() == (2, 3) and h.bytes_kept() == 200
    h.close_round(3, _round(3))  # a round kept already: ignored
    assert h.span() == (2, 3)
    h.close_round(6, _round(6))  # rounds 4, 5 missed here: nothing older can be replayed past them
    assert h.span() == (6, 6)
    h.close_round(7, _round(7, nbytes=300))  # larger than the bound alone: kept, as the only one
    assert h.span() == (7, 7) and h.bytes_kept() == 300
    h.close_round(8, _round(8))
    assert h.span() == (8, 8)


def test_zero_rounds_keeps_nothing_and_bad_bounds_are_refused():
    h = MeanHistory(max_rounds=0, max_bytes=1000)
    h.close_round(0, _round(0))
    assert h.span() is None
    with pytest.raises(ValueError, match="max_rounds and max_bytes must be >= 0"):
        MeanHistory(max_rounds=-1, max_bytes=0)


def test_the_summary_a_donor_serves_round_trips():
    h = MeanHistory(max_rounds=4, max_bytes=10_000)
    for r in range(2):
        h.close_round(r, _round(r))
    st = history_info_state(h, 2, [(0.5,), (0.5,), (0.5,)], index=4, skipped=[1, 0])
    info = decode_history_info(st)
    assert info.rounds_applied == 2 and info.span == (0, 1) and info.skipped == (0, 1)
    assert info.lrs[1] == [(0.7,), (0.7,), ()] and info.lrs_now == [(0.5,), (0.5,), (0.5,)]
    bad = type(st)(**{**st.__dict__, "optimizer_state": st.optimizer_state + b" "})
    with pytest.raises(StateTransferError, match="checksum mismatch"):
        decode_history_info(bad)
