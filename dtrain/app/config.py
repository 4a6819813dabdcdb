"""The command line's config trees: :class:`WorkerConfig` (``dtrain worker``),
:class:`RendezvousServerConfig` (``dtrain rendezvous``) and :class:`LaunchConfig`
(``dtrain launch``), and their :class:`~dtrain.options.Tree` s (flags, TOML keys, help).

A site's tree nests the library's component configs as they are, so every option a
library user can set is a flag and a TOML key::

    WorkerConfig            task, rounds, out_dir, eval_every, threads, linger_s, ...
      task_spec: TaskSpec       --task-spec.size (alias --size), --task-spec.data, ...
      diloco: DiLoCoConfig      --diloco.sync-every (alias --sync-every)
        buckets: BucketConfig   --diloco.buckets.bucket-bytes
        rounds: RoundConfig     --diloco.rounds.repair / --no-diloco.rounds.repair
          codec, broadcast_codec: CodecConfig   --diloco.rounds.codec.name (alias --codec)
          aggregation: AggregationConfig        --diloco.rounds.aggregation.trim-fraction
        group: GroupConfig      --diloco.group.quorum-wait-s (alias --quorum-wait-s)
      outer: OuterConfig        --outer.lr (alias --outer-lr)
      net: NetConfig            --net.listen (alias --listen), --net.rendezvous, TLS files
        grpc: GrpcTransportConfig   --net.grpc.num-attempts, keepalive, ...
        datagram: DatagramTransportConfig  --net.datagram.max-rate-mbit (alias --max-rate-mbit)
      checkpoint: CheckpointConfig  --checkpoint.every (alias --checkpoint-every)
      export: ExportConfig      --export.every, --export.dir (safetensors of the agreed θ)

The aliases are the flat names of the earlier command line and README (``--sync-every``,
TOML ``sync_every = 500``); both forms keep working. Fields the program sets itself are
hidden (:data:`WORKER_HIDDEN`, :data:`PER_SITE`). Importing this module loads no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, get_args

from dtrain.codecs.config import CodecConfig
from dtrain.configs import DiLoCoConfig, RoundConfig
from dtrain.options import HostPort, Tree, UsageError
from dtrain.probe import ProbeConfig
from dtrain.rendezvous.core import RendezvousConfig
from dtrain.tasks.spec import TaskSpec
from dtrain.transports.datagram_config import DatagramTransportConfig
from dtrain.transports.grpc_config import GrpcTransportConfig, TlsConfig

__all__ = [
    "CheckpointConfig",
    "DOCTOR",
    "DoctorConfig",
    "ExportConfig",
    "LAUNCH",
    "LaunchConfig",
    "NetConfig",
    "OuterConfig",
    "PER_SITE",
    "RENDEZVOUS",
    "RendezvousServerConfig",
    "WORKER",
    "WorkerConfig",
    "check_task",
]


def check_task(ref: str) -> None:
    """Import a ``module:function`` task reference now, so a bad one is a usage error
    naming ``task`` (the built-in task, ``''``, is not imported: it loads torch).

    Raises:
        UsageError: the module or function cannot be found.
    """
    if not ref.strip():
        return
    if ref.strip() == "hf":  # not imported here either (torch); only whether transformers is there
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            raise UsageError("task 'hf' needs the transformers package: pip install 'dtrain[hf]'")
        return
    from dtrain.tasks import load_task

    try:
        load_task(ref)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _need(obj: object, cond: bool, name: str, allowed: str) -> None:
    if not cond:
        raise ValueError(f"{name} must be {allowed}, got {getattr(obj, name)!r}")


def _need_files(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        v = getattr(obj, name)
        _need(obj, v is None or Path(v).is_file(), name, "an existing file")


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer optimizer: SGD with Nesterov momentum on each bucket of θ (DiLoCo,
    arXiv 2311.08105: lr 0.7, momentum 0.9, Nesterov).

    Attributes:
        lr: outer learning rate, a finite number > 0.
        momentum: outer momentum, in [0, 1).
        nesterov: Nesterov momentum (ignored when momentum is 0).
        delayed_momentum: outer momentum in the one-step-delayed mode (F = 1, τ = H),
            whose Δ is one round stale; in [0, 1) (0.7: the best of a sweep,
            experiments/delayed_momentum.py); other modes use ``momentum``.
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    delayed_momentum: float = 0.7

    def __post_init__(self) -> None:
        _need(self, self.lr > 0 and math.isfinite(self.lr), "lr", "a finite number > 0 (outer_lr)")
        _need(self, 0 <= self.momentum < 1, "momentum", "in [0, 1) (outer_momentum)")
        _need(self, 0 <= self.delayed_momentum < 1, "delayed_momentum", "in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints of a site (model, inner and outer optimizer, residuals, data position).

    Attributes:
        dir: checkpoint directory (none: OUT_DIR/checkpoints).
        every: rounds between checkpoints, an int >= 0 (0 = never).
        resume: continue from the latest checkpoint in ``dir`` (a fresh start if none).
    """

    dir: str | None = None
    every: int = 0
    resume: bool = False

    def __post_init__(self) -> None:
        _need(
            self,
            isinstance(self.every, int) and not isinstance(self.every, bool) and self.every >= 0,
            "every",
            "an int >= 0 (checkpoint_every; 0 = never)",
        )


DataPath = Literal["grpc", "datagram"]


def _rendezvous_spec(value: object) -> str:
    """``NetConfig.rendezvous`` checked and normalized (a HostPort becomes its text)."""
    if isinstance(value, HostPort):
        return str(value)
    text = str(value) if value is not None else ""
    if text.startswith(("etcd://", "etcds://")):
        from dtrain.rendezvous.etcd_store import EtcdStoreConfig, timing_from_url

        EtcdStoreConfig.parse(text)
        timing_from_url(text)
        return text
    parts = [p.strip() for p in text.split(",")]
    return ",".join(str(HostPort.parse(p, "rendezvous")) for p in parts)


@dataclass(frozen=True, kw_only=True)
class NetConfig:
    """Where a site listens and whom it dials; the shared token and TLS files.

    Attributes:
        listen: host:port the Peer service binds (port 0 = any free port).
        advertise: host:port peers dial (none: the bound address).
        rendezvous: host:port of the rendezvous service; several, comma-separated, for
            front-ends of one run on an etcd store (the site fails over between them); or
            etcd://host:port,...[/run][?quorum_timeout_s=..&initial_sites=..] for etcd
            directly, with no rendezvous process (the query sets the run's timing).
        token_file: file holding the shared token (none: no token).
        tls_cert: this site's certificate chain, PEM (none: plaintext).
        tls_key: the private key of tls_cert, PEM.
        tls_ca: CA bundle, PEM, that verifies peers (mutual TLS when all three are set).
        data_path: how contributions and means travel: "grpc" (default) or "datagram"
            (paced, sealed UDP on the same port number, never retransmitted; meant for
            provisioned links; control, state pulls and repair stay on gRPC; a chunk
            becomes one datagram, and codecs with +zstd or topk are refused; sparseloco is
            fixed-size and cut in whole top-k chunks per datagram).
        grpc: gRPC channel and server settings.
        datagram: the datagram path's settings (rate, datagram size, NACKs, buffers);
            used with data_path "datagram". Its max_datagram_bytes sets the chunk size,
            so every site of a run must use the same value.
    """

    listen: HostPort = HostPort("127.0.0.1", 0)
    advertise: HostPort | None = None
    rendezvous: str = "127.0.0.1:29400"
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    data_path: DataPath = "grpc"
    grpc: GrpcTransportConfig = field(default_factory=GrpcTransportConfig)
    datagram: DatagramTransportConfig = field(default_factory=DatagramTransportConfig)

    def __post_init__(self) -> None:
        for name in ("listen", "advertise"):
            object.__setattr__(self, name, HostPort.coerce(getattr(self, name), name))
        _need(self, self.listen is not None, "listen", "host:port")
        object.__setattr__(self, "rendezvous", _rendezvous_spec(self.rendezvous))
        _need_files(self, ("token_file", "tls_cert", "tls_key", "tls_ca"))
        _need(self, self.data_path in get_args(DataPath), "data_path", f"one of {get_args(DataPath)}")

    def transport_config(self) -> GrpcTransportConfig:
        """``grpc`` with the bind address, advertised host, token and TLS filled in."""
        tls = None
        if self.tls_cert or self.tls_key or self.tls_ca:
            tls = TlsConfig(
                cert_path=self.tls_cert,
                key_path=self.tls_key,
                ca_path=self.tls_ca,
                mutual=bool(self.tls_cert and self.tls_key and self.tls_ca),
            )
        token = Path(self.token_file).read_text().strip() if self.token_file else None
        return replace(
            self.grpc,
            bind_host=self.listen.host,
            bind_port=self.listen.port,
            advertise_host=self.advertise.host if self.advertise else None,
            token=token,
            tls=tls,
        )

    def datagram_config(self) -> DatagramTransportConfig:
        """``datagram`` with its gRPC half from :meth:`transport_config`."""
        return replace(self.datagram, grpc=self.transport_config())


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """Export of the agreed θ as safetensors in the Hugging Face layout (``dtrain.app.export``):
    a directory with ``model.safetensors`` and the task's ``config.json`` (and tokenizer), which
    ``AutoModelForCausalLM.from_pretrained`` loads for the ``hf`` task.

    Attributes:
        dir: export directory (none: OUT_DIR/export); rounds go to ``round-NNNNNN``, the
            end of the run to ``final``.
        every: rounds between exports, an int >= 0 (0 = none during the run).
        final: export to ``final`` once the run has trained all its rounds (not after a stop).
    """

    dir: str | None = None
    every: int = 0
    final: bool = True

    def __post_init__(self) -> None:
        _need(
            self,
            isinstance(self.every, int) and not isinstance(self.every, bool) and self.every >= 0,
            "every",
            "an int >= 0",
        )


def _worker_diloco() -> DiLoCoConfig:
    # zstd adds only ~5% on int8 pseudo-gradients (experiments/bench_codecs.py)
    return DiLoCoConfig(
        sync_every=50, rounds=RoundConfig(codec=CodecConfig(name="int8", zstd_level=1)), hook_optimizer=False
    )


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Everything one site needs (``dtrain worker``; ``run_worker(config)``).

    Attributes:
        task: task function, module:function returning a Task ('' = the built-in GPT,
            hf = a transformers causal LM from task_spec.hf.config).
        rounds: rounds to train, an int >= 1 (with sync_every 50 and size small: ~1 min
            of training for 3 sites on 2 cores).
        out_dir: directory of metrics.jsonl, summary.json and (by default) checkpoints.
        eval_every: rounds between evaluations, an int >= 1.
        threads: torch threads, an int >= 1.
        linger_s: longest wait after the last round for the peers to pull this site's
            means, >= 0 (DiLoCo.close; none: until the last round's broadcast deadline;
            the wait ends as soon as every member pulled).
        inner_step_sleep_s: sleep after every inner step, in [0, 3600) (0 = none);
            emulates a slower site in fault tests and experiments.
        slowdown: this site's compute share in (0, 1]: after each inner step it sleeps
            (1 / slowdown - 1) x that step's own time, so it trains at that share of its
            speed whatever the machine's load (emulated slow hardware; ``dtrain launch
            --site-slowdown I=SHARE --slowdown-by stretch`` sets it per site). 1: none.
        parallel: how the ranks of a site group (torchrun --nproc-per-node K, K > 1)
            train: ddp or fsdp (FSDP2); a single process ignores it.
        gc_every_rounds: Python's cyclic garbage collection runs between rounds, after
            every this many rounds, never inside one (``dtrain.app.gc_control``, as
            torchtitan's ``training.gc_freq``); an int >= 0, 0 = Python's automatic
            collector, which can stop every thread of the site for 0.2-0.7 s mid-round.

        tensorboard: also write each round's scalars (the status page's figures) as
            TensorBoard event files under DIR/<site_id> (none: off; needs the
            ``tensorboard`` package: pip install 'dtrain[tensorboard]').
        reassign_after_rounds: with ``task_spec.non_iid``, re-assign the shard of a
            site absent from this many consecutive rounds to the survivors (each trains
            a part of it besides its own); an int >= 0, 0 = never
            (``dtrain.app.shards``; needs a task with ``shard_part``).
        task_spec: what the task builds (shard, seed, data, model size).
        diloco: the DiLoCo wrapper: H, buckets, round behaviour, membership.
        outer: the outer optimizer.
        net: addresses, token and TLS, gRPC settings.
        checkpoint: checkpointing and resuming.
        export: safetensors exports of the agreed θ.
    """

    task: str = ""
    rounds: int = 20
    out_dir: str = "runs/site-0"
    eval_every: int = 1
    threads: int = 1
    linger_s: float | None = None
    inner_step_sleep_s: float = 0.0
    slowdown: float = 1.0
    parallel: Literal["ddp", "fsdp"] = "ddp"
    gc_every_rounds: int = 1
    tensorboard: str | None = None

    reassign_after_rounds: int = 0
    task_spec: TaskSpec = field(default_factory=TaskSpec)
    diloco: DiLoCoConfig = field(default_factory=_worker_diloco)
    outer: OuterConfig = field(default_factory=OuterConfig)
    net: NetConfig = field(default_factory=NetConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    def __post_init__(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        _need(self, is_int(self.rounds) and self.rounds >= 1, "rounds", "an int >= 1")
        _need(self, is_int(self.eval_every) and self.eval_every >= 1, "eval_every", "an int >= 1")
        _need(self, is_int(self.threads) and self.threads >= 1, "threads", "an int >= 1")
        _need(
            self,
            self.linger_s is None or self.linger_s >= 0,
            "linger_s",
            "none (the broadcast deadline) or >= 0 seconds",
        )
        _need(self, 0 <= self.inner_step_sleep_s < 3600, "inner_step_sleep_s", "in [0, 3600) seconds")
        _need(self, 0 < self.slowdown <= 1, "slowdown", "a compute share in (0, 1]")
        _need(
            self,
            is_int(self.reassign_after_rounds) and self.reassign_after_rounds >= 0,
            "reassign_after_rounds",
            "an int >= 0",
        )
        if self.reassign_after_rounds and not self.task and not self.task_spec.non_iid:
            raise ValueError(
                "reassign_after_rounds needs task_spec.non_iid (--non-iid): with IID data every site "
                f"trains the whole corpus and there is no dead site's shard to re-assign (got {self.reassign_after_rounds})"
            )
        _need(self, isinstance(self.task, str), "task", "'module:function', 'hf' or ''")
        if (self.task.strip() == "hf") != (self.task_spec.hf.config is not None):
            raise ValueError(
                "task 'hf' and hf.config go together: --task hf --hf.config PATH|preset "
                f"(got task={self.task!r}, hf.config={self.task_spec.hf.config!r})"
            )
        _need(self, self.parallel in ("ddp", "fsdp"), "parallel", "one of ddp, fsdp")
        _need(
            self,
            is_int(self.gc_every_rounds) and self.gc_every_rounds >= 0,
            "gc_every_rounds",
            "an int >= 0 (0: Python's automatic collector)",
        )
        if self.net.data_path == "datagram":
            self.diloco_config()  # the codec must fit one datagram per chunk (loads the codecs)
        if self.tensorboard is not None:
            import importlib.util

            _need(self, bool(self.tensorboard), "tensorboard", "a directory or none")
            if importlib.util.find_spec("tensorboard") is None:
                raise ValueError(
                    f"tensorboard: writing to {self.tensorboard!r} needs the tensorboard package, which is not "
                    "installed: pip install 'dtrain[tensorboard]' (or tensorboard), or drop --tensorboard"
                )

    @property
    def site_id(self) -> str:
        return self.diloco.site_id

    def diloco_config(self) -> DiLoCoConfig:
        """The DiLoCo config the worker runs: it counts inner steps itself (no optimizer
        hook), the automatic bucket size follows the run's configured number of sites,
        ``close()`` waits at most ``linger_s``, and a site that joins once the run is over
        knows it (``GroupConfig.run_rounds``: ``rounds``)."""
        buckets = replace(self.diloco.buckets, num_sites=self.task_spec.num_sites)
        if self.net.data_path == "datagram":  # a chunk is one datagram
            from dtrain.transports.datagram import datagram_chunk_bytes

            rounds = self.diloco.rounds
            try:  # both a contribution and a mean of one chunk must fit a datagram
                one = min(
                    datagram_chunk_bytes(c, self.net.datagram.max_datagram_bytes)
                    for c in (rounds.codec, rounds.broadcast_codec or rounds.codec)
                )
            except ValueError as e:
                raise ValueError(f"data_path 'datagram' needs a fixed-size codec: {e}") from None
            buckets = replace(buckets, chunk_bytes=min(buckets.chunk_bytes, one))
        group = replace(self.diloco.group, run_rounds=self.rounds)
        return replace(self.diloco, hook_optimizer=False, buckets=buckets, close_timeout_s=self.linger_s, group=group)

    @property
    def resolved_checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.out_dir) / "checkpoints"

    @property
    def resolved_export_dir(self) -> Path:
        return Path(self.export.dir) if self.export.dir else Path(self.out_dir) / "export"


#: Fields of a site's tree that are not options, and why.
WORKER_HIDDEN = {
    "diloco.hook_optimizer": "fixed by the worker (it counts inner steps itself)",
    "diloco.close_timeout_s": "set from linger_s",
    "diloco.group.run_rounds": "set from rounds",
    "diloco.buckets.num_sites": "set from task_spec.num_sites (the run's configured sites)",
    "net.grpc.bind_host": "set from net.listen",
    "net.grpc.bind_port": "set from net.listen",
    "net.grpc.advertise_host": "set from net.advertise",
    "net.grpc.token": "read from net.token_file",
    "net.grpc.tls": "set from net.tls_cert, net.tls_key and net.tls_ca",
    "net.grpc.extra_options": "library only (raw gRPC argument pairs)",
    "net.datagram.grpc": "set from net.grpc and the addresses, token and TLS of net",
}

#: The earlier flat names (flags and TOML keys) of the worker's options.
WORKER_ALIASES = {
    "site_id": "diloco.site_id",
    **{n: f"task_spec.{n}" for n in ("site_index", "num_sites", "seed", "data", "size", "non_iid")},
    **{n: f"task_spec.{n}" for n in ("lr", "batch_size", "context_len", "text_field", "tokenizer")},
    "hf.config": "task_spec.hf.config",
    **{
        n: f"net.{n}"
        for n in (
            "listen",
            "advertise",
            "rendezvous",
            "token_file",
            "tls_cert",
            "tls_key",
            "tls_ca",
            "data_path",
        )
    },
    **{n: f"net.datagram.{n}" for n in ("max_rate_mbit", "max_datagram_bytes")},
    "sync_every": "diloco.sync_every",
    "codec": "diloco.rounds.codec.name",
    "zstd_level": "diloco.rounds.codec.zstd_level",
    **{n: f"diloco.rounds.codec.{n}" for n in ("sparse_k", "sparse_chunk", "sparse_bits")},
    "error_feedback_decay": "diloco.rounds.error_feedback_decay",
    "sparse_mean": "diloco.rounds.aggregation.sparse_mean",
    "token_weighted": "diloco.rounds.aggregation.token_weighted",
    "round_window_s": "diloco.round_window_s",
    "broadcast_codec": "diloco.rounds.broadcast_codec.name",
    "max_norm": "diloco.rounds.aggregation.max_norm",
    "bucket_bytes": "diloco.buckets.bucket_bytes",
    "chunk_bytes": "diloco.buckets.chunk_bytes",
    "quorum_wait_s": "diloco.group.quorum_wait_s",
    "outer_lr": "outer.lr",
    "outer_momentum": "outer.momentum",
    "nesterov": "outer.nesterov",
    "checkpoint_dir": "checkpoint.dir",
    "checkpoint_every": "checkpoint.every",
    "resume": "checkpoint.resume",
}

WORKER = Tree(WorkerConfig, hidden=WORKER_HIDDEN, aliases=WORKER_ALIASES)


@dataclass(frozen=True, kw_only=True)
class RendezvousServerConfig:
    """The membership service process (``dtrain rendezvous``).

    Attributes:
        bind: host:port to listen on (port 0: any free port).
        address_file: write the bound host:port here once listening.
        token_file: file holding the shared token (none: no token).
        http_bind: serve the read-only status page (/, /api/status, /metrics) on this
            host:port (port 0: any free port; no authentication: keep it on 127.0.0.1
            or a private address); none or off: no page.
        http_address_file: write the status page's URL here once listening.
        http_refresh_s: status page refresh interval, in [0.5, 600].
        store: where membership lives: none (in memory, this process) or
            etcd://host:port,host:port,...[/run] (etcd v3; several front-ends may serve one run).
        etcd_user: etcd user of the store (none: no authentication).
        etcd_password_file: file holding etcd_user's password.
        etcd_ca: CA bundle, PEM, that verifies etcd's certificate (set: https to etcd).
        etcd_cert: client certificate, PEM, for etcd's client-certificate authentication.
        etcd_key: the private key of etcd_cert, PEM.
        rendezvous: membership and round timing.
    """

    bind: HostPort = HostPort("127.0.0.1", 29400)
    address_file: str | None = None
    token_file: str | None = None
    http_bind: HostPort | None = None
    http_address_file: str | None = None
    http_refresh_s: float = 2.0
    store: str | None = None
    etcd_user: str | None = None
    etcd_password_file: str | None = None
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)

    def __post_init__(self) -> None:
        for name in ("bind", "http_bind"):
            object.__setattr__(self, name, HostPort.coerce(getattr(self, name), name))
        _need(self, self.bind is not None, "bind", "host:port")
        _need(self, 0.5 <= self.http_refresh_s <= 600, "http_refresh_s", "in [0.5, 600] seconds")
        _need(
            self,
            self.store is None or self.store.startswith(("etcd://", "etcds://")),
            "store",
            "none (in memory) or etcd://host:port[,host:port...][/run]",
        )
        _need_files(self, ("token_file", "etcd_password_file", "etcd_ca", "etcd_cert", "etcd_key"))


_RDV_FIELDS = (
    "min_sites",
    "initial_sites",
    "quorum_timeout_s",
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
    "reduce_timeout_s",
    "broadcast_timeout_s",
)

#: the one time figure a user may state (every deadline is derived from it and the observed rounds)
_RDV_ALIASES = {**{n: f"rendezvous.{n}" for n in _RDV_FIELDS}, "stall_budget_s": "rendezvous.deadlines.stall_budget_s"}

RENDEZVOUS = Tree(RendezvousServerConfig, aliases=_RDV_ALIASES)


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """A rendezvous and N sites on this machine (``dtrain launch``).

    Attributes:
        sites: number of sites (workers), 1..64.
        ranks_per_site: K > 1: each site is one torchrun group of K ranks (DDP or FSDP2
            by worker.parallel), 1..64.
        max_restarts: with ranks_per_site > 1: torchrun restarts of a site's group, >= 0.
        out: run directory (none: runs/<timestamp>).
        netem: run each site in its own network namespace behind emulated links with
            this profile (root only; see netem/).
        progress: a live progress bar on a terminal.
        http_bind: the rendezvous's status page: host:port, off, or auto (default: 127.0.0.1
            on a free port; off with netem); the URL is printed at start.
        http_port: status page on 127.0.0.1:PORT (shorthand for http_bind), 0..65535.
        store: where the rendezvous launch starts keeps membership: none (in memory) or
            etcd://host:port[,host:port...][/run][?ca_file=..&username=..&password_file=..]
            (etcd v3: the rendezvous is a stateless front-end on it; not with netem).
        site_slowdown: emulated slow hardware, I=SHARE[,I=SHARE...]: site I trains at SHARE
            (in (0, 1]) of its speed (``dtrain.app.slowdown``); none: every site at full speed.
        slowdown_by: how: cgroup (the cgroup v1 cpu controller caps the site at SHARE x
            worker.threads x ranks_per_site CPUs; root, refused at start where unavailable)
            or stretch (the worker sleeps (1/SHARE - 1) x each inner step's time after it).
        worker: the settings of every site.
        rendezvous: membership and round timing (initial_sites: default the number of sites).
    """

    sites: int = 3
    ranks_per_site: int = 1
    max_restarts: int = 0
    out: str | None = None
    netem: str | None = None
    progress: bool = True
    http_bind: str = "auto"
    http_port: int | None = None
    store: str | None = None
    site_slowdown: str | None = None
    slowdown_by: Literal["cgroup", "stretch"] = "cgroup"
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)

    def __post_init__(self) -> None:
        _need(self, isinstance(self.sites, int) and 1 <= self.sites <= 64, "sites", "an int in [1, 64]")
        _need(
            self,
            isinstance(self.ranks_per_site, int) and 1 <= self.ranks_per_site <= 64,
            "ranks_per_site",
            "an int in [1, 64]",
        )
        _need(self, isinstance(self.max_restarts, int) and self.max_restarts >= 0, "max_restarts", "an int >= 0")
        word = str(self.http_bind).strip().lower()
        if word in ("auto", "off", "none"):  # none: what a TOML user may write for off
            object.__setattr__(self, "http_bind", "off" if word == "none" else word)
        if self.http_bind != "auto" and self.http_port is not None:
            raise ValueError(
                f"http_port and http_bind: give one of them, got {self.http_port!r} and {self.http_bind!r}"
            )
        if self.http_bind not in ("auto", "off"):
            HostPort.parse(self.http_bind, "http_bind")
        _need(self, self.http_port is None or 0 <= self.http_port <= 65535, "http_port", "in [0, 65535]")
        _need(
            self,
            self.store is None or self.store.startswith(("etcd://", "etcds://")),
            "store",
            "none (in memory) or etcd://host:port[,host:port...][/run]",
        )
        if self.store is not None and self.netem:
            raise ValueError("store: an etcd store is not reachable from netem's namespaces; drop --store or --netem")
        _need(self, self.slowdown_by in ("cgroup", "stretch"), "slowdown_by", "one of cgroup, stretch")
        from dtrain.app.slowdown import parse_slowdown

        parse_slowdown(self.site_slowdown, self.sites)  # UsageError naming site_slowdown

    def status_page_bind(self) -> HostPort | None:
        """The rendezvous's status page address, or None (off).

        Default: 127.0.0.1 on a free port, but off with ``netem``, where 127.0.0.1 inside
        the rendezvous's namespace is not reachable from this machine's browser.
        """
        if self.http_port is not None:
            return HostPort("127.0.0.1", self.http_port)
        if self.http_bind == "auto":
            return None if self.netem else HostPort("127.0.0.1", 0)
        return None if self.http_bind == "off" else HostPort.parse(self.http_bind, "http_bind")


#: Worker fields launch sets for each site itself (not launch options).
PER_SITE = (
    "diloco.site_id",
    "task_spec.site_index",
    "task_spec.num_sites",
    "net.listen",
    "net.advertise",
    "net.rendezvous",
    "out_dir",
    "checkpoint.dir",
    "export.dir",
)

LAUNCH = Tree(
    LaunchConfig,
    hidden={
        **{f"worker.{p}": why for p, why in WORKER_HIDDEN.items()},
        **{f"worker.{p}": "set per site by launch" for p in PER_SITE},
    },
    aliases={**WORKER_ALIASES, **_RDV_ALIASES},
    flatten=("worker",),
)


@dataclass(frozen=True, kw_only=True)
class DoctorConfig:
    """A preflight of the paths between sites (``dtrain doctor``; ``dtrain.app.doctor``).

    Attributes:
        serve: serve the probe (TCP and UDP on listen's port) for peers to measure against.
        listen: host:port the probe server binds with serve.
        serve_s: with serve, stop after this many seconds, > 0 (none: until SIGINT/SIGTERM).
        peer: probe servers to measure, host:port, comma-separated (without serve).
        json: print one JSON document (kernel settings, each peer's figures and advice).
        model_params: parameters the run synchronises, an int >= 0, for the codec advice
            (0: no codec advice).
        sync_budget_s: longest acceptable exchange per round for the codec advice, > 0 seconds.
        probe: how hard the probe measures (counts, durations, MTU range, timeouts).
    """

    serve: bool = False
    listen: HostPort = HostPort("0.0.0.0", 29401)
    serve_s: float | None = None
    peer: str = ""
    json: bool = False
    model_params: int = 0
    sync_budget_s: float = 10.0
    probe: ProbeConfig = field(default_factory=ProbeConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "listen", HostPort.coerce(self.listen, "listen"))
        _need(self, self.serve_s is None or self.serve_s > 0, "serve_s", "none or > 0 seconds")
        _need(
            self,
            isinstance(self.model_params, int) and not isinstance(self.model_params, bool) and self.model_params >= 0,
            "model_params",
            "an int >= 0",
        )
        _need(self, self.sync_budget_s > 0, "sync_budget_s", "> 0 seconds")
        if self.serve and self.peer:
            raise ValueError(f"peer: give peers or serve, not both (got serve and peer {self.peer!r})")
        self.peer_list()

    def peer_list(self) -> list[str]:
        """The peers as ``host:port`` strings (each checked by HostPort.parse)."""
        return [str(HostPort.parse(p.strip(), "peer")) for p in self.peer.split(",") if p.strip()]


DOCTOR = Tree(DoctorConfig)
