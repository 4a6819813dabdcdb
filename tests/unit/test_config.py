"""Bad configuration raises ValueError naming the field and the allowed values."""

from __future__ import annotations

import re

import pytest

from dtrain.aggregation import AggregationConfig
from dtrain.buckets import BucketConfig
from dtrain.codecs import CodecConfig
from dtrain.diloco import DiLoCoConfig
from dtrain.membership import GroupConfig
from dtrain.rendezvous import RendezvousConfig
from dtrain.rounds import RoundConfig
from dtrain.sim import ClusterConfig
from dtrain.transports.inproc import FaultRule, InprocFaults

pytestmark = pytest.mark.timeout(30)

# (constructor, kwargs, words the message must contain: the field and the allowed values)
CASES = [
    (DiLoCoConfig, {"sync_every": 0}, ["sync_every", ">= 1"]),
    (DiLoCoConfig, {"sync_every": -5}, ["sync_every", ">= 1"]),
    (DiLoCoConfig, {"buffers": "sum"}, ["buffers", "average", "local"]),
    (DiLoCoConfig, {"site_id": ""}, ["site_id", "non-empty"]),
    (CodecConfig, {"name": "int3"}, ["codec name", "'int3'", "fp32", "int8", "int4", "topk", "+zstd"]),
    (BucketConfig, {"bucket_bytes": 0}, ["bucket_bytes", ">= 4"]),
    (BucketConfig, {"bucket_bytes": 1 << 20, "chunk_bytes": 2 << 20}, ["chunk_bytes", "[4, bucket_bytes=1048576]"]),
    (BucketConfig, {"chunk_bytes": 0}, ["chunk_bytes", "[4, bucket_bytes="]),
    (BucketConfig, {"num_sites": 0}, ["num_sites", ">= 1"]),
    (BucketConfig, {"min_buckets_per_site": 0}, ["min_buckets_per_site", ">= 1"]),
    (
        BucketConfig,
        {"min_bucket_bytes": 1 << 20, "max_bucket_bytes": 1 << 10},
        ["max_bucket_bytes", ">= min_bucket_bytes"],
    ),
    (DiLoCoConfig, {"close_timeout_s": -1.0}, ["close_timeout_s", "None", ">= 0"]),
    (
        RendezvousConfig,
        {"reduce_timeout_s": 20.0, "broadcast_timeout_s": 20.0},
        ["broadcast_timeout_s", "must be > reduce_timeout_s"],
    ),
    (
        RendezvousConfig,
        {"reduce_timeout_s": 30.0, "broadcast_timeout_s": 20.0},
        ["broadcast_timeout_s", "must be > reduce_timeout_s"],
    ),
    (
        RendezvousConfig,
        {"heartbeat_interval_s": 5.0, "heartbeat_timeout_s": 5.0},
        ["heartbeat_timeout_s", "> heartbeat_interval_s"],
    ),
    (RendezvousConfig, {"min_sites": 0}, ["min_sites", ">= 1"]),
    (RendezvousConfig, {"min_sites": 3, "initial_sites": 2}, ["initial_sites", ">= min_sites (3)"]),
    (RendezvousConfig, {"quorum_timeout_s": 0}, ["quorum_timeout_s", "> 0"]),
    (AggregationConfig, {"trim_fraction": 0.6}, ["trim_fraction", "[0, 0.5)"]),
    (AggregationConfig, {"norm_bound_ratio": 0.5}, ["norm_bound_ratio", ">= 1"]),
    (AggregationConfig, {"max_norm": 0.0}, ["max_norm", "> 0"]),
    (RoundConfig, {"repair_timeout_s": 0}, ["repair_timeout_s", "> 0"]),
    (RoundConfig, {"codec": CodecConfig(name="topk"), "error_feedback": False}, ["'topk'", "error_feedback=True"]),
    (GroupConfig, {"quorum_wait_s": -1}, ["quorum_wait_s", "> 0"]),
    (InprocFaults, {"push_loss": 1.0}, ["push_loss", "[0, 1)"]),
    (FaultRule, {"kind": "pull", "action": "drop"}, ["kind", "push", "pull_mean", "pull_state"]),
    (ClusterConfig, {"num_sites": 0}, ["num_sites", ">= 1"]),
    (ClusterConfig, {"diloco": DiLoCoConfig(hook_optimizer=False)}, ["diloco.hook_optimizer", "True"]),
    (ClusterConfig, {"diloco": 4}, ["diloco", "DiLoCoConfig"]),
    (ClusterConfig, {"site_prefix": ""}, ["site_prefix", "non-empty"]),
]


@pytest.mark.parametrize(
    "cls,kwargs,words", CASES, ids=[f"{c.__name__}-{'-'.join(k)}-{i}" for i, (c, k, _) in enumerate(CASES)]
)
def test_bad_config_names_field_and_allowed_values(cls, kwargs, words) -> None:
    with pytest.raises(ValueError) as e:
        cls(**kwargs)
    msg = str(e.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_defaults_are_valid_and_frozen() -> None:
    for cls in (
        DiLoCoConfig,
        CodecConfig,
        BucketConfig,
        RendezvousConfig,
        AggregationConfig,
        RoundConfig,
        GroupConfig,
        InprocFaults,
    ):
        cfg = cls()
        with pytest.raises(Exception, match=re.compile("frozen|cannot assign", re.I)):
            setattr(cfg, next(iter(cfg.__dataclass_fields__)), None)
    assert DiLoCoConfig().sync_every == 500
    assert BucketConfig().bucket_bytes is None and BucketConfig().chunk_bytes == 1 << 20  # None: automatic size
    assert (BucketConfig().min_bucket_bytes, BucketConfig().max_bucket_bytes) == (64 << 10, 4 << 20)


def test_configs_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        BucketConfig(4096)  # type: ignore[misc]
    with pytest.raises(TypeError):
        RendezvousConfig(2)  # type: ignore[misc]


def test_a_cluster_nests_the_component_configs_and_re_declares_none_of_their_fields() -> None:
    import dataclasses

    import torch

    from dtrain.sim import InprocCluster, fast_diloco_config, fast_group_config

    own = {f.name for f in dataclasses.fields(ClusterConfig)}
    for component in (DiLoCoConfig, RendezvousConfig, GroupConfig):  # (InprocFaults.seed seeds the faults)
        assert not own & {f.name for f in dataclasses.fields(component)}, component.__name__
    assert ClusterConfig().diloco == fast_diloco_config() and ClusterConfig().diloco.group == fast_group_config()
    assert ClusterConfig().diloco.sync_every == 4
    cfg = ClusterConfig(num_sites=2, diloco=fast_diloco_config(sync_every=3, buffers="local"), site_prefix="s")
    with InprocCluster(lambda: torch.nn.Linear(2, 1), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), cfg) as c:
        got = [s.diloco.config for s in c.sites]
    assert [g.site_id for g in got] == ["s0", "s1"]
    assert all(dataclasses.replace(g, site_id=cfg.diloco.site_id) == cfg.diloco for g in got)


def test_reassigning_shards_without_non_iid_data_is_refused_naming_both_fields() -> None:
    """--reassign-after-rounds re-assigns a dead site's non-IID shard; with IID data it used to be
    ignored without a word (a fresh user's trial)."""
    import pytest

    from dtrain.app.config import WorkerConfig
    from dtrain.tasks import TaskSpec

    with pytest.raises(ValueError, match=r"reassign_after_rounds needs task_spec.non_iid \(--non-iid\)"):
        WorkerConfig(reassign_after_rounds=2)
    cfg = WorkerConfig(reassign_after_rounds=2, task_spec=TaskSpec(non_iid=True, num_sites=3))
    assert cfg.reassign_after_rounds == 2
