"""One in-process multi-site training run's settings (:class:`RunSpec`), the input of
:func:`experiments.common.run_inproc`; it builds the run's ``TaskSpec`` and ``ClusterConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from dtrain.buckets import BucketConfig
from dtrain.codecs import CodecConfig
from dtrain.configs import AggregationConfig
from dtrain.rounds import RoundConfig
from dtrain.sim import ClusterConfig, fast_diloco_config, fast_rendezvous_config
from dtrain.tasks import TaskSpec
from dtrain.tasks.builtin import make_evaluate
from dtrain.tasks.data import load_corpus, val_batches
from dtrain.transports.datagram import DatagramTransport, DatagramTransportConfig, datagram_chunk_bytes
from dtrain.transports.grpc import GrpcTransportConfig
from dtrain.transports.inproc import InprocFaults

KiB = 1024


def knob(path: str, default: Any) -> Any:
    """A :class:`RunSpec` field and the config-tree path that sets it (a ``dtrain worker`` /
    ``dtrain rendezvous`` option, or ``inproc.*``: what only the in-process cluster has)."""
    return field(default=default, metadata={"path": path})


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One in-process multi-site training run. The fields are the config tree's knobs of the same
    name (``TaskSpec``, ``CodecConfig``, ``RoundConfig``, ``AggregationConfig``, ``BucketConfig``,
    the rendezvous deadlines; :data:`experiments.lab.TREE_FIELDS` maps each to its path), plus:

    Attributes:
        experiment, config, extra: the CSV row's experiment, setting label (rows with the same
            label are seeds of one setting) and (name, value) columns.
        seed: model init, data order (``TaskSpec.seed``) and the network's fault RNG.
        decay_steps: None: the run's inner steps minus the warmup.
        restart_after_round: -1: no restart; else the last site is killed after it applied
            this many rounds and restarted (``InprocCluster.restart``) once site 0 applied
            ``down_rounds`` more.
        broadcast_codec, broadcast_sparse_k: the means' codec and its ``sparse_k`` (None: as
            the contributions').
        push_loss, pull_loss: probability that a contribution chunk / a pulled mean is lost
            (``InprocFaults``).
        outer_lr, outer_momentum: outer SGD-Nesterov (DiLoCo arXiv 2311.08105: 0.7, 0.9).
        num_val_batches, eval_every: the fixed validation set's batches; evaluate site 0's θ
            every this many rounds (0: only at the end).
        track_drift: record the max pairwise L2 distance of θ between sites per round.
        timeout_s, own_session: limit of the whole run; processes it spawns (DDP ranks) call
            :func:`experiments.common.own_session`.
        datagram_drop: None: the in-process network; a probability in [0, 1): the datagram data
            path on 127.0.0.1 (one chunk per datagram), every received datagram dropped with it.
    """

    experiment: str
    config: str
    seed: int = 0
    num_sites: int = knob("task_spec.num_sites", 4)
    size: str = knob("task_spec.size", "tiny")
    data: str = knob("task_spec.data", "stdlib")
    batch_size: int | None = knob("task_spec.batch_size", None)
    context_len: int | None = knob("task_spec.context_len", None)
    lr: float | None = knob("task_spec.lr", None)
    non_iid: bool = knob("task_spec.non_iid", False)
    lr_schedule: str = knob("task_spec.lr_schedule", "constant")
    warmup_steps: int = knob("task_spec.warmup_steps", 100)
    decay_steps: int | None = knob("task_spec.decay_steps", None)
    restart_after_round: int = knob("inproc.restart_after_round", -1)
    down_rounds: int = knob("inproc.down_rounds", 5)
    sync_every: int = knob("diloco.sync_every", 10)
    rounds: int = knob("rounds", 20)
    codec: str = knob("diloco.rounds.codec.name", "fp32")
    zstd_level: int = knob("diloco.rounds.codec.zstd_level", 1)
    topk_fraction: float = knob("diloco.rounds.codec.topk_fraction", 0.01)
    sparse_k: int = knob("diloco.rounds.codec.sparse_k", 64)
    sparse_chunk: int = knob("diloco.rounds.codec.sparse_chunk", 4096)
    sparse_bits: int = knob("diloco.rounds.codec.sparse_bits", 2)
    broadcast_codec: str | None = knob("diloco.rounds.broadcast_codec.name", None)
    broadcast_sparse_k: int | None = knob("diloco.rounds.broadcast_codec.sparse_k", None)
    error_feedback: bool = knob("diloco.rounds.error_feedback", True)
    error_feedback_decay: float = knob("diloco.rounds.error_feedback_decay", 1.0)
    sparse_mean: bool = knob("diloco.rounds.aggregation.sparse_mean", False)
    broadcast_error_feedback: bool = knob("diloco.rounds.broadcast_error_feedback", False)
    repair: bool = knob("diloco.rounds.repair", True)
    push_loss: float = knob("inproc.push_loss", 0.0)
    pull_loss: float = knob("inproc.pull_loss", 0.0)
    bucket_bytes: int = knob("diloco.buckets.bucket_bytes", 32 * KiB)
    chunk_bytes: int = knob("diloco.buckets.chunk_bytes", 4 * KiB)
    reduce_timeout_s: float = knob("rendezvous.reduce_timeout_s", 1.0)
    broadcast_timeout_s: float = knob("rendezvous.broadcast_timeout_s", 2.0)
    heartbeat_timeout_s: float = knob("rendezvous.heartbeat_timeout_s", 1.5)
    outer_lr: float = knob("outer.lr", 0.7)
    outer_momentum: float = knob("outer.momentum", 0.9)
    num_val_batches: int = knob("inproc.num_val_batches", 16)
    eval_every: int = knob("eval_every", 1)
    track_drift: bool = knob("inproc.track_drift", True)
    timeout_s: float = knob("inproc.timeout_s", 3600.0)
    own_session: bool = knob("inproc.own_session", False)
    extra: tuple[tuple[str, Any], ...] = ()
    datagram_drop: float | None = knob("inproc.datagram_drop", None)

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, allowed: str) -> None:
            if not cond:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        need(isinstance(self.rounds, int) and self.rounds >= 1, "rounds", "an int >= 1")
        need(isinstance(self.num_val_batches, int) and self.num_val_batches >= 1, "num_val_batches", "an int >= 1")
        need(isinstance(self.eval_every, int) and self.eval_every >= 0, "eval_every", "an int >= 0")
        need(self.timeout_s > 0, "timeout_s", "> 0 seconds")
        need(self.datagram_drop is None or 0.0 <= self.datagram_drop < 1.0, "datagram_drop", "None or in [0, 1)")
        need(
            self.restart_after_round == -1 or 0 < self.restart_after_round < self.rounds - self.down_rounds,
            "restart_after_round",
            "-1 or in (0, rounds - down_rounds)",
        )
        # Build the component configs once so a bad value fails here, naming its field (they check
        # num_sites, sync_every and the rendezvous timeouts).
        self.task_spec(0)
        self.cluster_config()

    def _by_path(self, prefix: str) -> dict[str, Any]:
        """The fields whose config path is ``prefix`` + NAME, by NAME: the keyword arguments of the
        component config at ``prefix`` (``task_spec.`` -> ``TaskSpec``) that the spec sets directly."""
        n = len(prefix)
        paths = {f.name: f.metadata.get("path", "") for f in fields(self)}
        return {p[n:]: getattr(self, name) for name, p in paths.items() if p.startswith(prefix) and "." not in p[n:]}

    def task_spec(self, site_index: int) -> TaskSpec:
        kw = self._by_path("task_spec.")
        kw["decay_steps"] = self.decay_steps or max(1, self.sync_every * self.rounds - self.warmup_steps)
        return TaskSpec(site_index=site_index, seed=self.seed, **kw)

    def evaluator(self) -> Callable[[torch.nn.Module], float]:
        """A model's mean validation loss on the run's fixed validation set (``num_val_batches``
        batches of site 0's batch size and context length), the same for every site and method."""
        ts = self.task_spec(0)
        batches = val_batches(
            load_corpus(self.data).val,
            batch_size=ts.resolved_batch_size,
            context_len=ts.resolved_context_len,
            num_batches=self.num_val_batches,
        )
        return make_evaluate(batches)

    def datagram_transport(self, i: int) -> DatagramTransport:
        """Site i's datagram data path on 127.0.0.1 with ``datagram_drop`` injected at its receiver (the
        ``transport_factory`` of :class:`dtrain.sim.InprocCluster`)."""
        cfg = DatagramTransportConfig(
            grpc=GrpcTransportConfig(bind_host="127.0.0.1", bind_port=0),
            max_rate_mbit=200.0,
            rtt_s=0.01,
            nack_idle_s=0.02,
            fallback_reserve_s=min(1.0, self.broadcast_timeout_s / 4),
            test_drop=self.datagram_drop or 0.0,
            test_drop_seed=self.seed * 100 + i,
        )
        return DatagramTransport(cfg)

    def _codec(self, name: str, sparse_k: int) -> CodecConfig:
        """The codec ``name`` with the spec's parameters that belong to it (a codec refuses another's)."""
        base = name.removesuffix("+zstd")
        kw: dict = {"topk_fraction": self.topk_fraction} if base == "topk" else {}
        if base == "sparseloco":
            kw = dict(sparse_k=sparse_k, sparse_chunk=self.sparse_chunk, sparse_bits=self.sparse_bits)
        return CodecConfig(name=name, zstd_level=self.zstd_level, **kw)

    def columns(self) -> dict[str, Any]:
        """The settings columns of the run's CSV row: every field but the run's plumbing, then ``extra``."""
        skip = ("extra", "timeout_s", "own_session")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip} | dict(self.extra)

    def cluster_config(self) -> ClusterConfig:
        codec = self._codec(self.codec, self.sparse_k)
        mean_codec = self._codec(self.broadcast_codec or self.codec, self.broadcast_sparse_k or self.sparse_k)
        return ClusterConfig(
            num_sites=self.num_sites,
            diloco=fast_diloco_config(
                sync_every=self.sync_every,
                buckets=BucketConfig(
                    bucket_bytes=self.bucket_bytes,
                    chunk_bytes=self.chunk_bytes
                    if self.datagram_drop is None
                    else min(self.bucket_bytes, datagram_chunk_bytes(codec), datagram_chunk_bytes(mean_codec)),
                ),
                rounds=RoundConfig(
                    codec=codec,
                    broadcast_codec=None
                    if self.broadcast_codec is None and self.broadcast_sparse_k is None
                    else mean_codec,
                    aggregation=AggregationConfig(sparse_mean=self.sparse_mean),
                    **self._by_path("diloco.rounds."),  # error feedback (decay, the means'), repair
                ),
            ),
            rendezvous=fast_rendezvous_config(self.num_sites, **self._by_path("rendezvous.")),
            faults=InprocFaults(push_loss=self.push_loss, pull_loss=self.pull_loss, seed=self.seed),
            seed=self.seed,
        )
