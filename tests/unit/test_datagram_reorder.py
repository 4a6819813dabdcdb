"""Reordering on the datagram path (:mod:`dtrain.transports.datagram_reorder`): lateness of
overtaken datagrams, the per-path window, the grace and the end decision."""

from __future__ import annotations

import pytest

from dtrain.transports.datagram_reorder import (
    END,
    WAIT,
    ReorderWindow,
    SeqArrivals,
    end_wait_decision,
    reorder_grace_s,
)


def test_lateness_is_measured_from_the_first_higher_sequence_number() -> None:
    a = SeqArrivals()
    assert [a.note(s, t) for s, t in [(0, 0.0), (1, 0.001), (3, 0.002), (4, 0.003), (5, 0.010)]] == [0.0] * 5
    assert a.note(2, 0.032) == pytest.approx(0.030)  # overtaken by 3, which came at 0.002
    assert a.note(5, 0.040) == 0.0  # the highest again (a duplicate): not late
    assert a.note(6, 0.041) == 0.0


def test_the_kept_history_is_bounded() -> None:
    a = SeqArrivals()
    for s in range(20_000):
        a.note(s, s * 1e-3)
    assert len(a.seqs) <= 8192 and a.seqs[-1] == 19_999
    late = a.note(10, 20.0)  # older than what is kept: measured against the oldest kept high (less)
    assert 0.0 < late < 20.0 - 0.011


def test_the_window_keeps_the_largest_lateness_and_halves_each_round() -> None:
    w = ReorderWindow()
    w.observe("a", 0.02)
    w.observe("a", 0.01)
    w.observe("b", 0.0)
    assert (w.get("a"), w.get("b")) == (0.02, 0.0)
    w.new_round()
    assert w.get("a") == pytest.approx(0.01)


def test_grace_is_twice_the_window_within_its_bounds() -> None:
    assert reorder_grace_s(0.0, 0.005, 0.25) == 0.005
    assert reorder_grace_s(0.03, 0.005, 0.25) == pytest.approx(0.06)
    assert reorder_grace_s(1.0, 0.005, 0.25) == 0.25


@pytest.mark.parametrize(
    "handled,announced,now,decision,words",
    [
        (10, 10, 1.0, END, "all handled"),
        (11, 10, 1.0, END, "all handled"),
        (8, 10, 1.01, WAIT, "2 missing"),
        (8, 10, 1.05, END, "2 lost"),
        (0, None, 1.0, END, "without a count"),
    ],
)
def test_an_end_waits_for_what_it_announced_until_the_grace_passes(handled, announced, now, decision, words) -> None:
    d, why = end_wait_decision(handled, announced, 1.0, 0.05, now)
    assert d == decision and words in why
