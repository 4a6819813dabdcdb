"""Re-assigning a dead site's non-IID shard (dtrain.app.shards) and the built-in
task's shard parts."""

from __future__ import annotations

import dataclasses

import pytest
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


def test_a_shard_adopted_again_draws_new_windows_never_the_first_adoptions():
    """site-2 dies, is adopted after round 3, comes back at round 5, dies again and is adopted
    after round 8 by the same survivor with the same part: the second adoption is a stream of
    its own (issue 33: a re-adopted part restarted its stream and trained its first windows
    twice), and every survivor names the same round."""
    spec = TaskSpec(site_index=0, num_sites=3, size="tiny", seed=1, non_iid=True)
    task = build_task(spec)
    watches = [ShardWatch(site_id=s, after_rounds=1) for s in ("site-0", "site-1")]
    mix = DataMix(task.batches, task.shard_part)
    everyone, two = ["site-0", "site-1", "site-2"], ["site-0", "site-1"]
    digests = []
    for r, members in enumerate([everyone, everyone, everyone, two, two, everyone, everyone, everyone, two, two]):
        new, released = watches[0].observe(members, r)
        assert watches[1].observe(members, r)[0] == [dataclasses.replace(a, part=1) for a in new]
        mix.apply(new, released)
        if new:
            assert [(a.part, a.num_parts, a.since_round) for a in new] == [(0, 2, r)]
        for _ in range(4):
            next(mix)
        part = mix.take_ledger(lambda: {}).get("adopted", {}).get("site-2")
        if part is not None:
            digests.append((part["shard"], part["digest"], part["steps"]))
    assert [d[0].rsplit("/", 1)[1] for d in digests] == ["after_round3"] * 2 + ["after_round8"] * 2
    assert digests[2][2] == [1, 2]  # a stream of its own, from its start
    assert len({d[1] for d in digests}) == 4  # no window drawn twice
    # a checkpoint from before adoptions had a round ([index, part, num_parts]) still loads
    old = DataMix(task.batches, task.shard_part)
    old.load_state_dict(
        {
            "turn": 0,
            "parts": {"site-2": {"adoption": [2, 0, 2], "stream": build_task(spec).shard_part(2, 0, 2).state_dict()}},
        }
    )
    assert old.adoptions == {"site-2": Adoption("site-2", 2, 0, 2, 0)}
    with pytest.raises(ValueError, match="an adoption is"):
        Adoption.of_list("site-2", [2, 0])


def test_adopted_parts_are_checkpointed_and_a_resumed_site_continues_them(tmp_path):
    """The worker's checkpoint holds the ShardWatch and DataMix states (``shards``): a site
    restored from it trains the same adopted part at the same position as one that ran on,
    and the watch keeps its absence counts (no re-adoption, release when the site is back)."""
    from dtrain.checkpoint import load_checkpoint, save_checkpoint

    spec = TaskSpec(site_index=0, num_sites=3, size="tiny", seed=1, non_iid=True)

    def fresh():
        task = build_task(spec)
        return task, ShardWatch(site_id="site-0", after_rounds=1), DataMix(task.batches, task.shard_part)

    task, watch, mix = fresh()
    watch.observe(["site-0", "site-1", "site-2"])
    mix.apply(*watch.observe(["site-0", "site-1"]))
    for _ in range(5):
        next(mix)
    mix.take_ledger(lambda: {})
    save_checkpoint(
        tmp_path,
        3,
        {
            "site_id": "site-0",
            "fingerprint": "f",
            "model": {},
            "inner_optimizer": {},
            "diloco": {},
            "batches": task.batches.state_dict(),
            "shards": {"watch": watch.state_dict(), "mix": mix.state_dict()},
        },
    )
    ran_on = [next(mix) for _ in range(6)]
    want = mix.take_ledger(lambda: {})

    data = load_checkpoint(next(tmp_path.glob("*")), site_id="site-0", fingerprint="f")
    task2, watch2, mix2 = fresh()
    task2.batches.load_state_dict(data["batches"])
    watch2.load_state_dict(data["shards"]["watch"])
    mix2.load_state_dict(data["shards"]["mix"])
    assert mix2.adoptions == {"site-2": Adoption("site-2", 2, 0, 2)} and watch2.adopted == watch.adopted
    resumed = [next(mix2) for _ in range(6)]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ran_on, resumed))
    got = mix2.take_ledger(lambda: {})
    assert got == want and got["adopted"]["site-2"]["windows"] > 0, (got, want)
    assert watch2.observe(["site-0", "site-1"]) == ([], [])  # still adopted: not adopted twice
    assert watch2.observe(["site-0", "site-1", "site-2"]) == ([], ["site-2"])


def test_a_malformed_shards_state_is_refused_with_the_reason():
    task = build_task(TaskSpec(site_index=0, num_sites=3, size="tiny", seed=1, non_iid=True))
    mix = DataMix(task.batches, task.shard_part)
    with pytest.raises(ValueError, match="not a DataMix state"):
        mix.load_state_dict({"parts": {}})
    with pytest.raises(ValueError, match="not a ShardWatch state"):
        ShardWatch(site_id="site-0", after_rounds=1).load_state_dict({"absent": {"site-1": 0}})
