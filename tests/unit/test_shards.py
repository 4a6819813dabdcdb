"""Re-assigning a dead site's non-IID shard (dtrain.app.shards) and the built-in
task's shard parts."""

from __future__ import annotations

import torch

from dtrain.app.shards import Adoption, DataMix, ShardWatch, shard_index
from dtrain.tasks import TaskSpec
from dtrain.tasks.builtin import build_task


def test_shard_of_a_site_absent_for_n_rounds_is_split_among_the_survivors_until_it_is_back():
    w0 = ShardWatch(site_id="site-0", after_rounds=2)
    w1 = ShardWatch(site_id="site-1", after_rounds=2)
    everyone = ["site-0", "site-1", "site-2"]
    for w in (w0, w1):
        assert w.observe(everyone) == ([], [])
        assert w.observe(["site-0", "site-1"]) == ([], [])  # absent once: not yet
    assert w0.observe(["site-0", "site-1"]) == ([Adoption("site-2", 2, 0, 2)], [])
    assert w1.observe(["site-1", "site-0"]) == ([Adoption("site-2", 2, 1, 2)], [])
    assert w0.observe(["site-0", "site-1"]) == ([], [])  # adopted once
    assert w0.observe(everyone) == ([], ["site-2"])  # back: its own again
    assert w0.adopted == {}


def test_odd_site_ids_are_never_adopted():
    w = ShardWatch(site_id="a", after_rounds=1)
    w.observe(["a", "b"])
    assert w.observe(["a"]) == ([], []) and w.observe(["a"]) == ([], [])
    assert shard_index("site-12") == 12 and shard_index("b") is None


def test_data_mix_interleaves_own_and_adopted_parts_and_reports_their_ledgers():
    spec = TaskSpec(site_index=0, num_sites=3, size="tiny", seed=1, non_iid=True)
    task = build_task(spec)
    assert task.shard_part is not None
    mix = DataMix(task.batches, task.shard_part)
    mix.apply([Adoption("site-2", 2, 0, 2)], [])
    for _ in range(4):
        next(mix)
    entry = mix.take_ledger(lambda: {})
    assert entry["steps"] == [1, 2]  # own stream: every other batch
    adopted = entry["adopted"]["site-2"]
    assert adopted["steps"] == [1, 2] and adopted["shard"].endswith("/site2of3/non_iid/part0of2")
    # part 0 of site 2's shard lies inside site 2's own shard
    own2 = build_task(TaskSpec(site_index=2, num_sites=3, size="tiny", seed=1, non_iid=True)).batches.tokens
    part = mix.parts["site-2"].tokens
    assert part.numel() < own2.numel() and torch.equal(part, own2[: part.numel()])
    mix.apply([], ["site-2"])
    next(mix)
    assert "adopted" not in mix.take_ledger(lambda: {})
    assert build_task(TaskSpec(site_index=0, num_sites=3, size="tiny")).shard_part is None  # IID: nothing to adopt
