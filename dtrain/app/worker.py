"""The site process: a task + DiLoCo + the gRPC transport + a rendezvous client.

Its config, :class:`~dtrain.app.config.WorkerConfig` (re-exported here), lives in
``dtrain.app.config`` with the command line's other config trees (importable without torch).

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
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import blake3
import torch

from dtrain.app.config import WorkerConfig  # re-exported
from dtrain.app.gc_control import RoundCollector
from dtrain.app.shards import DataMix, ShardWatch
from dtrain.buckets import tensor_digest
from dtrain.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dtrain.diloco import DiLoCo
from dtrain.errors import CheckpointError
from dtrain.membership import SyncOutcome
from dtrain.metrics import EndLine, RoundLine, StartLine, Summary, Totals, engine_fields, write_line
from dtrain.status import round_report
from dtrain.tasks import load_task

__all__ = ["WorkerConfig", "run_worker", "theta_checksum", "outer_state_checksum"]

log = logging.getLogger(__name__)


def theta_checksum(diloco: DiLoCo) -> str:
    """One hex digest over every bucket's θ checksum (equal on consistent sites)."""
    h = hashlib.blake2b(digest_size=8)
    for c in diloco.state.checksums():
        h.update(c.encode())
    return h.hexdigest()


def outer_state_checksum(diloco: DiLoCo) -> str:
    """One hex digest (BLAKE3, 64 bits) over every bucket's outer-optimizer state (e.g. the
    SGD momentum buffers), hashed in place; equal on sites whose outer optimizers agree."""
    h = blake3.blake3()
    for b, opt in enumerate(diloco.state.optimizers):
        with diloco.state.lock(b):
            st = opt.state_dict()["state"]
            for idx in sorted(st):
                for key in sorted(st[idx]):
                    v = st[idx][key]
                    h.update(f"{b}/{idx}/{key}=".encode())
                    if torch.is_tensor(v):
                        tensor_digest(v, h)
                    else:
                        h.update(repr(v).encode())
    return h.hexdigest(length=8)


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
    from dtrain.rendezvous.connect import rendezvous_client
    from dtrain.transports.grpc import GrpcTransport

    tcfg = cfg.net.transport_config()
    if cfg.net.data_path == "datagram":
        from dtrain.transports.datagram import DatagramTransport

        transport = DatagramTransport(cfg.net.datagram_config())
    else:
        transport = GrpcTransport(tcfg)
    return transport, rendezvous_client(cfg.net.rendezvous, grpc_config=tcfg)


def run_worker(cfg: WorkerConfig, *, stop_event: threading.Event | None = None) -> dict:
    """Run one site to completion. Returns the summary dict (also written to
    ``out_dir/summary.json``).

    Raises:
        CheckpointError: ``resume`` with a corrupt or mismatched checkpoint.
        QuorumTimeout: no round could form within ``quorum_wait_s``.
    """
    torch.set_num_threads(cfg.threads)
    stop = stop_event or threading.Event()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    task = load_task(cfg.task)(cfg.task_spec)
    transport, rendezvous = _transport_and_rendezvous(cfg)

    outer = outer_factory(cfg)
    ckpt = None
    if cfg.checkpoint.resume:
        path = latest_checkpoint(cfg.resolved_checkpoint_dir)
        if path is None:
            log.warning("--resume: no checkpoint in %s; starting fresh", cfg.resolved_checkpoint_dir)
        else:
            ckpt = path
    # Load the checkpoint BEFORE joining so a rejoining site presents its saved round.
    diloco = None
    collector = RoundCollector(cfg.gc_every_rounds, site=cfg.site_id)
    t_start = time.monotonic()
    try:
        if ckpt is not None:
            from dtrain.buckets import BucketLayout

            probe_layout = BucketLayout(
                [p.numel() for p in task.model.parameters()]
                + [b.numel() for b in task.model.buffers() if b.is_floating_point()],
                ["param"] * len(list(task.model.parameters()))
                + ["buffer"] * len([b for b in task.model.buffers() if b.is_floating_point()]),
                cfg.diloco_config().buckets,
            )
            data = load_checkpoint(ckpt, site_id=cfg.site_id, fingerprint=probe_layout.fingerprint())
            try:
                task.model.load_state_dict(data["model"])
                task.optimizer.load_state_dict(data["inner_optimizer"])
                if task.scheduler is not None and data.get("inner_scheduler") is not None:
                    task.scheduler.load_state_dict(data["inner_scheduler"])
                task.batches.load_state_dict(data["batches"])
            except (RuntimeError, ValueError, KeyError) as e:
                raise CheckpointError(f"checkpoint {ckpt} does not fit this task: {e}") from e
            log.info("resuming from %s (round %d)", ckpt, data["round"])
        diloco = DiLoCo(
            task.model,
            task.optimizer,
            inner_scheduler=task.scheduler,
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
        shards = data.get("shards") if ckpt is not None else None
        collector.start()  # after set-up: what exists now is frozen
        summary = _train(cfg, task, diloco, out, stop, t_start, shards_state=shards, collector=collector)
    finally:
        collector.close()
        if diloco is not None:
            diloco.close(wait=not stop.is_set())  # first, the peers pull our last means (bounded)
        else:
            transport.stop(0.1)
    return _finish(out, transport, summary, t_start)


def _ledger(batches, first_step: int, last_step: int) -> dict:
    """The data ledger of one round: the stream's own (``take_ledger()``, the built-in
    ``BatchStream``) or, for a task whose stream has none, the inner steps' range."""
    take = getattr(batches, "take_ledger", None)
    return take() if callable(take) else {"steps": [first_step, last_step]}


def _finish(out: Path, transport, summary: Summary, t_start: float) -> dict:
    """Append the end line (bytes the transport counted after the last round line: means
    served to peers while ``DiLoCo.close`` waited for their pulls) and write ``summary.json``; returns the summary."""
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


def outer_factory(cfg) -> "Callable[[list[torch.Tensor]], torch.optim.Optimizer]":
    """The outer optimizer of ``cfg`` (``cfg.outer``): SGD with Nesterov momentum; in the
    one-step-delayed mode (F = 1, τ = H) with ``outer.delayed_momentum`` (a stale Δ)."""
    o = cfg.outer
    momentum = o.delayed_momentum if cfg.diloco.one_step_delayed else o.momentum

    def outer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=o.lr, momentum=momentum, nesterov=o.nesterov and momentum > 0)

    return outer


def _train(
    cfg: WorkerConfig,
    task,
    diloco: DiLoCo,
    out: Path,
    stop: threading.Event,
    t_start: float,
    *,
    shards_state: dict | None = None,
    collector: RoundCollector | None = None,
) -> Summary:
    """The training loop: inner phase, sync, metrics line, checkpoint, until ``cfg.rounds`` or ``stop``.

    ``shards_state``: the checkpoint's ``shards`` entry (adopted shard parts and their
    positions, ``--reassign-after-rounds``), restored before the first inner step.
    ``collector``: runs Python's garbage collection after each round (``gc_every_rounds``)."""
    metrics_path = out / "metrics.jsonl"
    val = first_val = _write_start(cfg, task, diloco, metrics_path)
    totals = Totals()
    owned_buckets = 0  # in the last round this site ran
    train_loss = float("nan")
    watch, mix = _shard_reassignment(cfg, task, shards_state)
    batches = mix if mix is not None else task.batches
    max_syncs = cfg.rounds * 4 + 10  # bound the loop even if rounds keep being deferred
    syncs = 0
    cpu_mark = _process_cpu_s()  # each line's cpu_s: the process's CPU since the line before
    streaming = diloco.streaming  # fragment rounds: one line per merged round (dtrain/streaming.py)
    # with streaming the last round starts at this step and is merged there, so every
    # configuration ends at the same inner step (rounds x H/F) as blocking rounds do
    last_step = cfg.rounds * (cfg.diloco.sync_every // cfg.diloco.num_fragments) if streaming else None
    while diloco.round < cfg.rounds and not stop.is_set() and syncs < max_syncs:
        t_inner = time.monotonic()
        waited0 = streaming.waited_s if streaming else 0.0
        first_step = diloco.inner_steps + 1
        mean_loss, merged = _inner_phase(cfg, task, diloco, stop, batches, until_step=last_step)
        inner_last = diloco.inner_steps  # before a heal (joiner state) may replace the count
        if mean_loss is None:
            break  # the summary keeps the last completed round's train loss
        if streaming and merged is None and last_step is not None and diloco.inner_steps >= last_step:
            merged = diloco.flush()  # the last round: merged at its start step (waiting counts as sync_s)
            if merged is None:
                break
        if not math.isnan(mean_loss):
            train_loss = mean_loss
        diloco.group.last_loss = train_loss
        timed = _timed_outcome(diloco, merged, t_inner=t_inner, waited0=waited0)
        if timed is None:
            continue  # streaming: no fragment round merged at this step
        inner_s, outcome, sync_s, sync_cpu = timed
        syncs += 1
        if outcome.status != "deferred" and (diloco.round % cfg.eval_every == 0 or diloco.round >= cfg.rounds):
            val = task.evaluate(task.model)
        ledger = _round_ledger(task, mix, first_step, inner_last)
        now_cpu = _process_cpu_s()
        cpu_s, cpu_mark = now_cpu - cpu_mark, now_cpu
        line = _round_line(
            cfg,
            diloco,
            outcome,
            val=val,
            train_loss=train_loss,
            inner_s=inner_s,
            sync_s=sync_s,
            cpu_s=cpu_s,
            sync_cpu=sync_cpu,
            t_start=t_start,
            data=ledger,
        )
        if watch is not None and outcome.result is not None:
            mix.apply(*watch.observe(list(outcome.result.members)))
        totals.add(line)
        owned_buckets = outcome.result.owned_buckets if outcome.result is not None else owned_buckets
        _record_round(cfg, diloco, metrics_path, line)
        _maybe_checkpoint(cfg, task, diloco, outcome, watch=watch, mix=mix)
        if collector is not None:
            collector.after_round(syncs)
    return _summary(
        cfg,
        diloco,
        stop,
        totals,
        first_val=first_val,
        val=val,
        train_loss=train_loss,
        owned_buckets=owned_buckets,
        t_start=t_start,
    )


def _write_start(cfg: WorkerConfig, task, diloco: DiLoCo, metrics_path: Path) -> float:
    """Evaluate the starting model and append the start line; returns its validation loss."""
    val = task.evaluate(task.model)
    log.info("%s: start at round %d, validation loss %.4f", cfg.site_id, diloco.round, val)
    start = StartLine(
        site=cfg.site_id, round=diloco.round, val_loss=val, params=diloco.layout.total_numel, time=time.time()
    )
    with open(metrics_path, "a") as mf:
        write_line(mf, start)
    return val


def _shard_reassignment(cfg: WorkerConfig, task, shards_state: dict | None) -> tuple[ShardWatch | None, DataMix | None]:
    """With ``--reassign-after-rounds`` and a sharded task: the watch of dead sites and the data mix
    in which survivors train parts of a dead site's shard (restored from ``shards_state``); else Nones.

    Raises:
        CheckpointError: the checkpoint's adopted shard parts do not fit this task.
    """
    if not cfg.reassign_after_rounds or task.shard_part is None:
        return None, None
    watch = ShardWatch(site_id=cfg.site_id, after_rounds=cfg.reassign_after_rounds)
    mix = DataMix(task.batches, task.shard_part)
    if shards_state is not None:
        try:
            watch.load_state_dict(shards_state["watch"])
            mix.load_state_dict(shards_state["mix"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint: its adopted shard parts do not fit this task: {e}") from e
        if mix.adoptions:
            log.info("resumed with adopted shard parts of %s", ", ".join(sorted(mix.adoptions)))
    return watch, mix


def _round_ledger(task, mix: DataMix | None, first_step: int, last_step: int) -> dict:
    """The data ledger of one round: the data mix's (adopted shard parts) or the task stream's."""
    if mix is not None:
        return mix.take_ledger(lambda: {"steps": [first_step, last_step]})
    return _ledger(task.batches, first_step, last_step)


def _process_cpu_s() -> float:
    """This process's CPU seconds so far, user + system, every thread (``os.times``, the clock of
    the sync CPU too)."""
    t = os.times()
    return t.user + t.system


def _timed_outcome(
    diloco: DiLoCo, merged: SyncOutcome | None, *, t_inner: float, waited0: float
) -> tuple[float, SyncOutcome, float, tuple[float, float] | None] | None:
    """(inner_s, outcome, sync_s, sync CPU) of the round that ends this inner phase; None:
    streaming, none merged.

    Streaming: the merged fragment round, sync_s = what the steps waited for their rounds at the
    merge (``waited0``: the pacer's wait before the phase), sync CPU None (the round ran in the
    background, its CPU mixed with the inner steps'); blocking: a round run now."""
    streaming = diloco.streaming
    if not streaming:
        return _blocking_sync(diloco, t_inner)
    sync_s = streaming.waited_s - waited0
    inner_s = time.monotonic() - t_inner - sync_s
    return None if merged is None else (inner_s, merged, sync_s, None)


def _blocking_sync(diloco: DiLoCo, t_inner: float) -> tuple[float, SyncOutcome, float, tuple[float, float]]:
    """(inner_s, the round's outcome, sync_s, sync CPU) of a blocking round run now; sync CPU: the
    process's CPU seconds (every thread) during the sync, ``(user + system, system)``."""
    inner_s = time.monotonic() - t_inner
    t_sync, cpu0 = time.monotonic(), os.times()
    outcome = diloco.sync()
    cpu1 = os.times()
    system_s = cpu1.system - cpu0.system
    return inner_s, outcome, time.monotonic() - t_sync, (cpu1.user - cpu0.user + system_s, system_s)


def _inner_phase(
    cfg: WorkerConfig, task, diloco: DiLoCo, stop: threading.Event, batches, *, until_step: int | None = None
) -> tuple[float | None, SyncOutcome | None]:
    """``sync_every`` inner-optimizer steps; returns their mean loss (None when ``stop`` was set)
    and, with streaming rounds (dtrain/streaming.py), the outcome of the fragment round merged at
    the last step: then the phase ends at the first merge (within 2H/F steps), or at inner step
    ``until_step`` (streaming: the last round's start; no step then: the mean loss is NaN)."""
    losses = []
    merged: SyncOutcome | None = None
    for _ in range(cfg.diloco.sync_every * (2 if diloco.streaming else 1)):
        if until_step is not None and diloco.inner_steps >= until_step:
            break
        batch = next(batches)
        loss = task.loss(task.model, batch)
        loss.backward()
        task.optimizer.step()
        task.optimizer.zero_grad(set_to_none=True)
        if task.scheduler is not None:
            task.scheduler.step()
        losses.append(float(loss.detach()))
        if diloco.streaming:
            diloco.group.last_loss = losses[-1]
            merged = diloco.step()  # counts the step; starts / merges fragment rounds on schedule
        else:
            diloco.inner_steps += 1
            diloco.group.inner_step = diloco.inner_steps
        if cfg.inner_step_sleep_s:
            stop.wait(cfg.inner_step_sleep_s)
        if stop.is_set() or merged is not None:
            break
    if stop.is_set():
        return None, None
    return (sum(losses) / len(losses) if losses else math.nan), merged


def _round_line(
    cfg: WorkerConfig,
    diloco: DiLoCo,
    outcome: SyncOutcome,
    *,
    val: float,
    train_loss: float,
    inner_s: float,
    sync_s: float,
    t_start: float,
    cpu_s: float | None = None,
    sync_cpu: tuple[float, float] | None = None,
    data: dict | None = None,
) -> RoundLine:
    """The metrics line of the sync that just ended (a deferred one has no round result);
    ``cpu_s``: the process's CPU seconds since the previous line; ``sync_cpu``: during the sync,
    ``(user + system, system)`` (None: streaming)."""
    res = outcome.result
    # the datagram path's wire bytes, NACKs, drops (cumulative)
    counters = getattr(diloco.engine.transport, "counters", None)
    return RoundLine(
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
        cpu_s=cpu_s,
        sync_cpu_s=None if sync_cpu is None else sync_cpu[0],
        sync_system_cpu_s=None if sync_cpu is None else sync_cpu[1],
        wall_s=time.monotonic() - t_start,
        time=time.time(),
        checksum=theta_checksum(diloco),
        outer_checksum=outer_state_checksum(diloco),
        datagram=counters() if res is not None and counters is not None else None,
        data=data,
        **(engine_fields(res) if res is not None else {}),
    )


def _record_round(cfg: WorkerConfig, diloco: DiLoCo, metrics_path: Path, line: RoundLine) -> None:
    """Append ``line`` to the metrics file, queue its report for the status page, and log it."""
    with open(metrics_path, "a") as mf:
        write_line(mf, line)
    diloco.group.report_round(round_report(line.as_dict()))  # for the rendezvous status page (heartbeat thread)
    log.info(
        "%s: round %d %s members=%s val_loss=%.4f sync_s=%.2f bytes_sent=%d",
        cfg.site_id,
        line.round,
        line.status,
        line.members,
        line.val_loss,
        line.sync_s,
        line.bytes_sent or 0,
    )


def _maybe_checkpoint(cfg: WorkerConfig, task, diloco: DiLoCo, outcome: SyncOutcome, *, watch=None, mix=None) -> None:
    """Save a checkpoint every ``checkpoint.every`` rounds (never after a deferred sync),
    with the adopted shard parts (``watch``, ``mix``) when shards are re-assigned."""
    every = cfg.checkpoint.every
    if every and outcome.status != "deferred" and diloco.round % every == 0:
        save_checkpoint(
            cfg.resolved_checkpoint_dir,
            diloco.round,
            {
                "site_id": cfg.site_id,
                "fingerprint": diloco.layout.fingerprint(),
                "model": task.model.state_dict(),
                "inner_optimizer": task.optimizer.state_dict(),
                "inner_scheduler": task.scheduler.state_dict() if task.scheduler is not None else None,
                "diloco": diloco.state_dict(),
                "batches": task.batches.state_dict(),
                "shards": {"watch": watch.state_dict(), "mix": mix.state_dict()} if watch is not None else None,
                "config": json.dumps(asdict(cfg), default=str),
            },
        )


def _summary(
    cfg: WorkerConfig,
    diloco: DiLoCo,
    stop: threading.Event,
    totals: Totals,
    *,
    first_val: float,
    val: float,
    train_loss: float,
    owned_buckets: int,
    t_start: float,
) -> Summary:
    """The run's summary after the loop ended."""
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
        fp32_bytes_per_round=4 * diloco.layout.total_numel,
        owned_buckets=owned_buckets,
        num_buckets=len(diloco.layout),
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
