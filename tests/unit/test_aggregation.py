"""Unbiased partial mean per chunk and the robust options (norm bound, trimmed mean)."""

from __future__ import annotations

import collections

import pytest
import torch

from dtrain.aggregation import AggregationConfig, ChunkAccumulator, partial_mean, trimmed_counts
from dtrain.errors import RejectCode, Rejected

pytestmark = pytest.mark.timeout(30)


def test_partial_mean_divides_by_the_count_that_arrived() -> None:
    got = {"a": torch.tensor([1.0, 2.0]), "c": torch.tensor([3.0, 6.0])}  # "b" never arrived
    mean, senders, rejected = partial_mean(got, AggregationConfig())
    assert torch.equal(mean, torch.tensor([2.0, 4.0]))  # / 2, not / 3
    assert senders == ("a", "c")
    assert rejected == {}
    assert partial_mean({}, AggregationConfig()) == (None, (), {})


def test_accumulator_running_sum_matches_partial_mean() -> None:
    acc = ChunkAccumulator(3, AggregationConfig())
    vals = {
        "s1": torch.tensor([1.0, 0.0, -1.0]),
        "s0": torch.tensor([2.0, 4.0, 8.0]),
        "s2": torch.tensor([0.5, 0.5, 0.5]),
    }
    for s, v in vals.items():
        assert acc.add(s, v, s.encode()) is True
    mean, senders, rejected = acc.finalize()
    assert senders == ("s0", "s1", "s2")
    assert torch.allclose(mean, torch.tensor([3.5, 4.5, 7.5]) / 3)
    assert rejected == {}


def test_accumulator_is_idempotent_and_refuses_bad_input() -> None:
    acc = ChunkAccumulator(2, AggregationConfig(max_norm=10.0))
    assert acc.add("a", torch.tensor([1.0, 1.0]), b"d1") is True
    assert acc.add("a", torch.tensor([1.0, 1.0]), b"d1") is False  # identical retry: counted once
    with pytest.raises(Rejected) as e:
        acc.add("a", torch.tensor([2.0, 2.0]), b"d2")
    assert e.value.code == RejectCode.ALREADY_EXISTS
    for bad, why in [
        (torch.tensor([1.0, float("nan")]), "NaN"),
        (torch.tensor([1.0, 2.0, 3.0]), "expected 2"),
        (torch.tensor([1.0, 2.0], dtype=torch.float64), "expected 2 float32"),
        (torch.tensor([100.0, 0.0]), "max_norm"),
    ]:
        with pytest.raises(Rejected, match=why) as e:
            acc.add("b", bad, b"x")
        assert e.value.code == RejectCode.INVALID_ARGUMENT
    mean, senders, _ = acc.finalize()
    assert senders == ("a",) and torch.equal(mean, torch.tensor([1.0, 1.0]))


def test_trimmed_mean_drops_an_outlier() -> None:
    vals = {f"s{i}": torch.tensor([1.0 + 0.1 * i, -1.0]) for i in range(4)}
    vals["evil"] = torch.tensor([1e6, -1e6])
    plain, _, _ = partial_mean(vals, AggregationConfig())
    assert plain[0] > 1e5
    cut: collections.Counter = collections.Counter()
    mean, senders, rejected = partial_mean(vals, AggregationConfig(trim_fraction=0.2), trimmed=cut)
    # 5 values, trim int(0.2*5)=1 at each end: element 0 keeps s1..s3, element 1 keeps three -1.0
    assert torch.allclose(mean, torch.tensor([1.2, -1.0]))
    assert len(senders) == 5 and rejected == {}
    # what the trim cut: element 0's lowest (s0) and highest (evil), element 1's lowest (evil)
    # and, of the tied -1.0s, the last in sender order (s3)
    assert cut == {"evil": 2, "s0": 1, "s3": 1}
    assert trimmed_counts(torch.stack([vals[k] for k in sorted(vals)]), 0).tolist() == [0] * 5


def test_norm_bound_drops_an_outlier_with_a_reason() -> None:
    vals = {f"s{i}": torch.full((4,), 1.0 + 0.1 * i) for i in range(4)}
    vals["big"] = torch.full((4,), 50.0)
    mean, senders, rejected = partial_mean(vals, AggregationConfig(norm_bound_ratio=3.0))
    assert "big" not in senders and senders == ("s0", "s1", "s2", "s3")
    assert "median" in rejected["big"] and "above bound" in rejected["big"]
    assert torch.allclose(mean, torch.full((4,), 1.15))
    # the accumulator keeps every contribution in robust mode and reports the drop
    acc = ChunkAccumulator(4, AggregationConfig(norm_bound_ratio=3.0))
    for s, v in vals.items():
        acc.add(s, v, s.encode())
    m2, s2, r2 = acc.finalize()
    assert torch.allclose(m2, mean) and s2 == senders and set(r2) == {"big"}


def test_norm_bound_needs_three_contributions_to_act() -> None:
    vals = {"a": torch.ones(2), "b": torch.full((2,), 100.0)}
    mean, senders, rejected = partial_mean(vals, AggregationConfig(norm_bound_ratio=2.0))
    assert senders == ("a", "b") and rejected == {}
    assert torch.allclose(mean, torch.full((2,), 50.5))
