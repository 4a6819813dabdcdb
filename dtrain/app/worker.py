"""The site process: a task + DiLoCo + the gRPC transport + a rendezvous client.

``run_worker(config)`` trains for ``rounds`` rounds of ``sync_every`` inner
steps, evaluates after each round, writes one JSON line of metrics per round to
``<out_dir>/metrics.jsonl`` and a ``summary.json`` at the end, and checkpoints
every ``checkpoint_every`` rounds. SIGTERM/SIGINT end it cleanly (leave the
group, stop serving). See ``docs/METRICS.md`` for the metrics fields.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dtrain.aggregation import AggregationConfig
from dtrain.buckets import BucketConfig
from dtrain.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dtrain.codecs import CodecConfig
from dtrain.diloco import DiLoCo, DiLoCoConfig
from dtrain.errors import CheckpointError
from dtrain.membership import GroupConfig, SyncOutcome
from dtrain.metrics import EndLine, RoundLine, StartLine, Summary, Totals, engine_fields, write_line
from dtrain.rounds import RoundConfig
from dtrain.status import round_report
from dtrain.tasks import TaskSpec, load_task

__all__ = ["WorkerConfig", "run_worker", "theta_checksum", "outer_state_checksum"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Everything one site needs (the CLI's ``dtrain worker`` flags).

    Attributes:
        site_id: unique site name.
        site_index, num_sites: which data shard this site trains on, of how many.
        listen: ``host:port`` the Peer service binds (port 0 = any free port).
        advertise: ``host:port`` peers dial (default: the bound address).
        rendezvous: ``host:port`` of the rendezvous service.
        task: ``""`` (built-in GPT) or ``module:function`` returning a Task.
        data, size, non_iid, seed, lr, batch_size, context_len: see ``TaskSpec``.
        rounds: rounds to train; sync_every: H inner steps per round.
        codec: pseudo-gradient codec (``fp32``, ``bf16``, ``fp16``, ``int8``,
            ``int4``, ``topk``, each optionally ``+zstd``); zstd_level 1..22.
        outer_lr, outer_momentum, nesterov: outer SGD (DiLoCo arXiv 2311.08105:
            0.7, 0.9, True).
        bucket_bytes, chunk_bytes: see ``BucketConfig``.
        quorum_wait_s: give up (exit 3) when no round forms for this long.
        token_file: file holding the shared token; tls_cert/tls_key/tls_ca: PEM
            files (server cert/key, CA for verifying peers; mutual TLS when all set).
        out_dir: metrics and summary; checkpoint_dir (default out_dir/checkpoints);
            checkpoint_every: rounds between checkpoints (0 = never); resume:
            continue from the latest checkpoint.
        eval_every: rounds between evaluations; threads: torch threads.
        max_norm: owner's per-contribution L2 bound (None = off).
        linger_s: seconds to keep serving after the last round (peers may still pull).
        inner_step_sleep_s: sleep after every inner step, seconds (0 = none); emulates
            a slower site in fault tests and experiments.
        parallel: how the ranks of a site group (``torchrun --nproc-per-node K``,
            K > 1) train: ``ddp`` or ``fsdp`` (FSDP2); a single process ignores it.
    """

    site_id: str = "site-0"
    site_index: int = 0
    num_sites: int = 1
    listen: str = "127.0.0.1:0"
    advertise: str | None = None
    rendezvous: str = "127.0.0.1:29400"
    task: str = ""
    data: str = "stdlib"
    size: str = "small"
    non_iid: bool = False
    seed: int = 0
    lr: float | None = None
    batch_size: int | None = None
    context_len: int | None = None
    rounds: int = 20  # with sync_every 50 and size small: ~1 min of training for 3 sites on 2 cores
    sync_every: int = 50
    codec: str = "int8"  # zstd adds only ~5% on int8 pseudo-gradients (experiments/bench_codecs.py)
    zstd_level: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    bucket_bytes: int = 4 << 20
    chunk_bytes: int = 1 << 20
    quorum_wait_s: float = 300.0
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    out_dir: str = "runs/site-0"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    eval_every: int = 1
    threads: int = 1
    max_norm: float | None = None
    linger_s: float = 3.0
    inner_step_sleep_s: float = 0.0
    parallel: str = "ddp"

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, allowed: str) -> None:
            if not cond:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        need(isinstance(self.site_id, str) and bool(self.site_id), "site_id", "a non-empty string")
        need(isinstance(self.rounds, int) and self.rounds >= 1, "rounds", "an int >= 1")
        need(
            isinstance(self.sync_every, int) and self.sync_every >= 1,
            "sync_every",
            "an int >= 1 (H inner steps per round)",
        )
        need(
            isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0,
            "checkpoint_every",
            "an int >= 0 (0 = never)",
        )
        need(isinstance(self.eval_every, int) and self.eval_every >= 1, "eval_every", "an int >= 1")
        need(isinstance(self.threads, int) and self.threads >= 1, "threads", "an int >= 1")
        need(self.outer_lr > 0 and math.isfinite(self.outer_lr), "outer_lr", "a finite number > 0")
        need(0 <= self.outer_momentum < 1, "outer_momentum", "in [0, 1)")
        need(self.quorum_wait_s > 0, "quorum_wait_s", "> 0 seconds")
        need(self.linger_s >= 0, "linger_s", ">= 0 seconds")
        need(0 <= self.inner_step_sleep_s < 3600, "inner_step_sleep_s", "in [0, 3600) seconds")
        need(self.parallel in ("ddp", "fsdp"), "parallel", "one of ddp, fsdp")
        for name in ("listen", "rendezvous") + (("advertise",) if self.advertise else ()):
            v = getattr(self, name)
            host, _, port = str(v).rpartition(":")
            need(bool(host) and port.isdigit() and 0 <= int(port) <= 65535, name, "host:port with port in [0, 65535]")
        for name in ("token_file", "tls_cert", "tls_key", "tls_ca"):
            v = getattr(self, name)
            need(v is None or Path(v).is_file(), name, "an existing file")
        # Validate the nested component configs now so a bad flag fails at start-up.
        self.task_spec()
        self.diloco_config()

    def task_spec(self) -> TaskSpec:
        return TaskSpec(
            site_index=self.site_index,
            num_sites=self.num_sites,
            seed=self.seed,
            data=self.data,
            non_iid=self.non_iid,
            size=self.size,
            lr=self.lr,
            batch_size=self.batch_size,
            context_len=self.context_len,
        )

    def diloco_config(self) -> DiLoCoConfig:
        return DiLoCoConfig(
            site_id=self.site_id,
            sync_every=self.sync_every,
            buckets=BucketConfig(bucket_bytes=self.bucket_bytes, chunk_bytes=self.chunk_bytes),
            rounds=RoundConfig(
                codec=CodecConfig(name=self.codec, zstd_level=self.zstd_level),
                aggregation=AggregationConfig(max_norm=self.max_norm),
            ),
            group=GroupConfig(quorum_wait_s=self.quorum_wait_s),
            hook_optimizer=False,
        )

    @property
    def resolved_checkpoint_dir(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.out_dir) / "checkpoints"


def theta_checksum(diloco: DiLoCo) -> str:
    """One hex digest over every bucket's θ checksum (equal on consistent sites)."""
    h = hashlib.blake2b(digest_size=8)
    for c in diloco.state.checksums():
        h.update(c.encode())
    return h.hexdigest()


def outer_state_checksum(diloco: DiLoCo) -> str:
    """One hex digest over every bucket's outer-optimizer state (e.g. the SGD
    momentum buffers); equal on sites whose outer optimizers agree."""
    h = hashlib.blake2b(digest_size=8)
    for b, opt in enumerate(diloco.state.optimizers):
        with diloco.state.lock(b):
            st = opt.state_dict()["state"]
            for idx in sorted(st):
                for key in sorted(st[idx]):
                    v = st[idx][key]
                    h.update(f"{b}/{idx}/{key}=".encode())
                    h.update(
                        v.detach().cpu().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode()
                    )
    return h.hexdigest()


def fault_hook_from_env(site_id: str):
    """Test-only fault injection from ``DTRAIN_TEST_FAULT``.

    Format: ``SITE:PHASE:ROUND:ACTION`` (several separated by ``;``), e.g.
    ``site-2:mid_push:2:kill``. PHASE is ``before_push``, ``mid_push`` or
    ``before_pull`` (ROUND is the round), or ``serve_state`` (ROUND is the bucket
    index whose state a peer pulls from this site, e.g. a joining site); ACTION
    is ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself) or ``sleep=SECONDS``.
    Each rule fires once. Returns None when unset. Bad specs raise ValueError.
    """
    spec = os.environ.get("DTRAIN_TEST_FAULT", "").strip()
    if not spec:
        return None
    rules = []
    for part in spec.split(";"):
        try:
            site, phase, rnd, action = part.split(":")
            rules.append((site, phase, int(rnd), action))
        except ValueError:
            raise ValueError(f"DTRAIN_TEST_FAULT must be SITE:PHASE:ROUND:ACTION[;...], got {part!r}") from None

    fired: set[int] = set()
    lock = threading.Lock()

    def hook(phase: str, rnd: int) -> None:
        for i, (site, ph, r, action) in enumerate(rules):
            if site == site_id and ph == phase and r == rnd:
                with lock:  # each rule fires once (several push threads reach mid_push)
                    if i in fired:
                        continue
                    fired.add(i)
                log.warning("test fault injection: %s at %s of round %d", action, phase, rnd)
                logging.shutdown()
                if action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif action == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif action.startswith("sleep="):
                    time.sleep(float(action.split("=", 1)[1]))

    return hook


def _transport_and_rendezvous(cfg: WorkerConfig):
    from dtrain.rendezvous.grpc import GrpcRendezvousClient
    from dtrain.transports.grpc import GrpcTransport
    from dtrain.transports.grpc_common import GrpcTransportConfig, TlsConfig

    token = Path(cfg.token_file).read_text().strip() if cfg.token_file else None
    tls = None
    if cfg.tls_cert or cfg.tls_key or cfg.tls_ca:
        tls = TlsConfig(
            cert_path=cfg.tls_cert,
            key_path=cfg.tls_key,
            ca_path=cfg.tls_ca,
            mutual=bool(cfg.tls_cert and cfg.tls_key and cfg.tls_ca),
        )
    host, _, port = cfg.listen.rpartition(":")
    adv_host = cfg.advertise.rpartition(":")[0] if cfg.advertise else None
    tcfg = GrpcTransportConfig(bind_host=host, bind_port=int(port), advertise_host=adv_host, token=token, tls=tls)
    return GrpcTransport(tcfg), GrpcRendezvousClient(cfg.rendezvous, config=tcfg)


def run_worker(cfg: WorkerConfig, *, stop_event: threading.Event | None = None) -> dict:
    """Run one site to completion. Returns the summary dict (also written to
    ``out_dir/summary.json``).

    Raises:
        CheckpointError: ``resume`` with a corrupt or mismatched checkpoint.
        QuorumTimeout: no round could form within ``quorum_wait_s``.
    """
    from dtrain.app.site_worker import in_site_group, run_site_worker

    if in_site_group():  # one rank of a site group under torchrun
        return run_site_worker(cfg, parallel=cfg.parallel, stop_event=stop_event)
    torch.set_num_threads(cfg.threads)
    stop = stop_event or threading.Event()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    task = load_task(cfg.task)(cfg.task_spec())
    transport, rendezvous = _transport_and_rendezvous(cfg)

    def outer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            params, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.nesterov and cfg.outer_momentum > 0
        )

    ckpt = None
    if cfg.resume:
        path = latest_checkpoint(cfg.resolved_checkpoint_dir)
        if path is None:
            log.warning("--resume: no checkpoint in %s; starting fresh", cfg.resolved_checkpoint_dir)
        else:
            ckpt = path
    # Load the checkpoint BEFORE joining so a rejoining site presents its saved round.
    diloco = None
    t_start = time.monotonic()
    try:
        if ckpt is not None:
            from dtrain.buckets import BucketLayout

            probe_layout = BucketLayout(
                [p.numel() for p in task.model.parameters()]
                + [b.numel() for b in task.model.buffers() if b.is_floating_point()],
                ["param"] * len(list(task.model.parameters()))
                + ["buffer"] * len([b for b in task.model.buffers() if b.is_floating_point()]),
                BucketConfig(bucket_bytes=cfg.bucket_bytes, chunk_bytes=cfg.chunk_bytes),
            )
            data = load_checkpoint(ckpt, site_id=cfg.site_id, fingerprint=probe_layout.fingerprint())
            try:
                task.model.load_state_dict(data["model"])
                task.optimizer.load_state_dict(data["inner_optimizer"])
                task.batches.load_state_dict(data["batches"])
            except (RuntimeError, ValueError, KeyError) as e:
                raise CheckpointError(f"checkpoint {ckpt} does not fit this task: {e}") from e
            log.info("resuming from %s (round %d)", ckpt, data["round"])
        diloco = DiLoCo(
            task.model,
            task.optimizer,
            config=cfg.diloco_config(),
            outer_optimizer=outer,
            transport=transport,
            rendezvous=rendezvous,
            _defer_join=ckpt is not None,
        )
        diloco.engine.fault_hook = fault_hook_from_env(cfg.site_id)
        if ckpt is not None:
            diloco.load_state_dict(data["diloco"])
            diloco.state.copy_to(diloco._tensors_and_kinds()[0])
            diloco.join()
        summary = _train(cfg, task, diloco, out, stop, t_start)
    finally:
        if diloco is not None:
            time.sleep(cfg.linger_s if not stop.is_set() else 0.0)  # let peers finish pulling our means
            diloco.close()
        else:
            transport.stop(0.1)
    return _finish(out, transport, summary, t_start)


def _finish(out: Path, transport, summary: Summary, t_start: float) -> dict:
    """Append the end line (bytes the transport counted after the last round line: means
    served to peers during ``linger_s``) and write ``summary.json``; returns the summary."""
    end = EndLine(
        site=summary.site,
        round=summary.rounds,
        bytes_sent=max(0, transport.bytes_sent() - summary.bytes_sent),
        bytes_received=max(0, transport.bytes_received() - summary.bytes_received),
        wall_s=time.monotonic() - t_start,
        time=time.time(),
    )
    with open(out / "metrics.jsonl", "a") as mf:
        write_line(mf, end)
    summary = dataclasses.replace(
        summary,
        bytes_sent=summary.bytes_sent + end.bytes_sent,
        bytes_received=summary.bytes_received + end.bytes_received,
    )
    d = summary.as_dict()
    (out / "summary.json").write_text(json.dumps(d, indent=2))
    log.info("%s: done: %s", summary.site, d)
    return d


def _train(cfg: WorkerConfig, task, diloco: DiLoCo, out: Path, stop: threading.Event, t_start: float) -> Summary:
    metrics_path = out / "metrics.jsonl"
    fp32_bytes = 4 * diloco.layout.total_numel
    val = task.evaluate(task.model)
    first_val = val
    log.info("%s: start at round %d, validation loss %.4f", cfg.site_id, diloco.round, val)
    start = StartLine(
        site=cfg.site_id, round=diloco.round, val_loss=val, params=diloco.layout.total_numel, time=time.time()
    )
    with open(metrics_path, "a") as mf:
        write_line(mf, start)
    totals = Totals()
    train_loss = float("nan")
    max_syncs = cfg.rounds * 4 + 10  # bound the loop even if rounds keep being deferred
    syncs = 0
    while diloco.round < cfg.rounds and not stop.is_set() and syncs < max_syncs:
        t_inner = time.monotonic()
        losses = []
        for _ in range(cfg.sync_every):
            batch = next(task.batches)
            loss = task.loss(task.model, batch)
            loss.backward()
            task.optimizer.step()
            task.optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            diloco.inner_steps += 1
            diloco.group.inner_step = diloco.inner_steps
            if cfg.inner_step_sleep_s:
                stop.wait(cfg.inner_step_sleep_s)
            if stop.is_set():
                break
        if stop.is_set():
            break
        train_loss = sum(losses) / len(losses)
        diloco.group.last_loss = train_loss
        inner_s = time.monotonic() - t_inner
        t_sync = time.monotonic()
        outcome: SyncOutcome = diloco.sync()
        sync_s = time.monotonic() - t_sync
        syncs += 1
        res = outcome.result
        if outcome.status != "deferred" and (diloco.round % cfg.eval_every == 0 or diloco.round >= cfg.rounds):
            val = task.evaluate(task.model)
        line = RoundLine(
            site=cfg.site_id,
            round=(res.round if res else diloco.round - 1),
            status=outcome.status,
            reason=outcome.reason,
            members=list(res.members) if res else [],
            val_loss=val,
            train_loss=train_loss,
            inner_steps=diloco.inner_steps,
            inner_s=inner_s,
            sync_s=sync_s,
            quorum_s=outcome.quorum_s,
            wall_s=time.monotonic() - t_start,
            time=time.time(),
            checksum=theta_checksum(diloco),
            outer_checksum=outer_state_checksum(diloco),
            **(engine_fields(res) if res is not None else {}),
        )
        totals.add(line)
        with open(metrics_path, "a") as mf:
            write_line(mf, line)
        diloco.group.report_round(round_report(line.as_dict()))  # for the rendezvous status page (heartbeat thread)
        log.info(
            "%s: round %d %s members=%s val_loss=%.4f sync_s=%.2f bytes_sent=%d",
            cfg.site_id,
            line.round,
            outcome.status,
            line.members,
            val,
            sync_s,
            line.bytes_sent or 0,
        )
        if cfg.checkpoint_every and outcome.status != "deferred" and diloco.round % cfg.checkpoint_every == 0:
            save_checkpoint(
                cfg.resolved_checkpoint_dir,
                diloco.round,
                {
                    "site_id": cfg.site_id,
                    "fingerprint": diloco.layout.fingerprint(),
                    "model": task.model.state_dict(),
                    "inner_optimizer": task.optimizer.state_dict(),
                    "diloco": diloco.state_dict(),
                    "batches": task.batches.state_dict(),
                    "config": json.dumps(asdict(cfg)),
                },
            )
    wall = time.monotonic() - t_start
    # compression_ratio: the codec's ratio over every contribution this site encoded;
    # bytes_sent also counts means an owner serves, so it is not a compression measure.
    return Summary(
        site=cfg.site_id,
        rounds=diloco.round,
        first_val_loss=first_val,
        final_val_loss=val,
        final_train_loss=train_loss,
        checksum=theta_checksum(diloco),
        wall_s=wall,
        sync_share=totals.sync_s / wall if wall > 0 else 0.0,
        fp32_bytes_per_round=fp32_bytes,
        interrupted=stop.is_set(),
        compression_ratio=totals.compression_ratio,
        **dataclasses.asdict(totals),
    )


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGTERM/SIGINT set ``stop``; the training loop ends after the current step."""

    def handler(signum, frame):  # noqa: ARG001
        log.warning("signal %d: stopping after the current step", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
