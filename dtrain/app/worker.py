"""The site process: a task + DiLoCo + a transport + a rendezvous client, for a site
of K >= 1 ranks (one process, or one rank of a torch.distributed group under torchrun).

Its config, :class:`~dtrain.app.config.WorkerConfig` (re-exported here), lives in
``dtrain.app.config`` with the command line's other config trees (importable without torch).

``run_worker(config)`` trains for ``rounds`` rounds of ``sync_every`` inner steps,
evaluates after each round, writes one JSON line of metrics per round to
``<out_dir>/metrics.jsonl`` and a ``summary.json`` at the end (rank 0 of a site group
writes the site's, with per-rank figures gathered from every rank), and checkpoints
every ``checkpoint_every`` rounds (:mod:`dtrain.app.checkpoints`). The same loop runs
every K: what differs is set up by :mod:`dtrain.app.ranks` (process group, data shard,
DDP/FSDP2) and carried out by the wrapper's site communication
(:mod:`dtrain.sitegroup.comm`). SIGTERM/SIGINT end it cleanly (leave the group, stop
serving). See ``docs/METRICS.md`` for the metrics fields.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash

from dtrain.app import checkpoints, export
from dtrain.app.config import WorkerConfig  # re-exported
from dtrain.app.gc_control import RoundCollector
from dtrain.app.ranks import in_site_group, init_site_process_group, rank_config, wrap_model
from dtrain.app.shards import DataMix, ShardWatch
from dtrain.buckets import tensor_digest
from dtrain.diloco import DiLoCo
from dtrain.errors import CheckpointError
from dtrain.metrics import EndLine, RoundLine, StartLine, Summary, Totals, engine_fields, write_line
from dtrain.rounds.outcome import RoundStatus, SyncOutcome
from dtrain.sitegroup import LocalSiteComm, SiteComm, TorchSiteComm, combine_checksums
from dtrain.state import outer_sgd
from dtrain.status import round_report
from dtrain.tasks import load_task

__all__ = ["WorkerConfig", "run_worker", "outer_state_checksum"]

log = logging.getLogger(__name__)

# Fields of a round line summed over a site's ranks; the other engine fields are rank 0's.
_SUMMED = ("bytes_sent", "bytes_received", "encoded_bytes", "encoded_fp32_bytes", "owned_buckets")
# Per-rank lists a site group's line adds (``rank_<field>``, rank order).
_PER_RANK = ("bytes_sent", "bytes_received", "reduce_arrived_fraction", "broadcast_arrived_fraction")


def outer_state_checksum(diloco: DiLoCo) -> str:
    """One hex digest (XXH3, 64 bits) over every bucket's outer-optimizer state of this
    rank's slice (e.g. the SGD momentum buffers), hashed in place; equal on sites whose
    outer optimizers agree. A metric, not a trust decision (nothing is accepted or refused
    by it), so a non-cryptographic hash at memory speed (~5x BLAKE3's on one core; a full
    pass over the outer state every round, docs/DECISIONS.md "Round engine CPU")."""
    h = xxhash.xxh3_64()
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
    return h.hexdigest()


def fault_hook_from_env(site_id: str):
    """Test-only fault injection from ``DTRAIN_TEST_FAULT``.

    Format: ``SITE:PHASE:ROUND:ACTION`` (several separated by ``;``), e.g.
    ``site-2:mid_push:2:kill``. PHASE is ``before_push``, ``mid_push`` or
    ``before_pull`` (ROUND is the round), or ``serve_state`` (ROUND is the bucket
    index whose state a peer pulls from this site, e.g. a joining site); ACTION
    is ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself), ``raise`` (a RuntimeError in the
    round, as a bug would) or ``sleep=SECONDS``.
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
                elif action == "raise":
                    raise RuntimeError(f"test fault injection: raise at {phase} of round {rnd}")
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


def _site_comm(cfg: WorkerConfig) -> SiteComm:
    """The site's ranks: torch.distributed under torchrun (``WORLD_SIZE`` > 1), else one process."""
    if not in_site_group():
        return LocalSiteComm()
    init_site_process_group(timeout_s=max(60.0, cfg.diloco.group.quorum_wait_s))
    return TorchSiteComm()


def _restarted(dcfg):
    """A site group restarted by torchrun (``TORCHELASTIC_RESTART_COUNT`` > 0) joins as the
    same site while the rendezvous may still hold its dead predecessor live: unless the user
    set ``takeover_s``, it tries again for ``quorum_wait_s`` instead of giving up at once."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" or dcfg.group.takeover_s > 0:
        return dcfg
    return dataclasses.replace(dcfg, group=dataclasses.replace(dcfg.group, takeover_s=dcfg.group.quorum_wait_s))


@dataclass
class _Run:
    """What one worker's loop works on (this rank's)."""

    cfg: WorkerConfig
    task: Any
    module: torch.nn.Module  # the model as called (DDP-wrapped or FSDP2-sharded for K > 1)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    diloco: DiLoCo
    out: Path
    stop: threading.Event
    t_start: float
    collector: RoundCollector | None = None
    watch: ShardWatch | None = None
    mix: DataMix | None = None
    tb: Any = None  # TensorBoardSink (rank 0 with --tensorboard)

    @property
    def rank0(self) -> bool:
        return self.diloco.rank == 0

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"


def run_worker(cfg: WorkerConfig, *, stop_event: threading.Event | None = None) -> dict:
    """Run this site (this rank of it) to completion. Returns the summary dict (rank 0
    also writes ``out_dir/summary.json``).

    Raises:
        CheckpointError: ``resume`` with a corrupt or mismatched checkpoint (every rank).
        QuorumTimeout: no round could form within ``quorum_wait_s`` (every rank).
    """
    torch.set_num_threads(cfg.threads)
    stop = stop_event or threading.Event()
    comm = _site_comm(cfg)
    try:
        return _run(rank_config(cfg, comm.rank, comm.num_ranks), comm, stop)
    finally:
        if comm.num_ranks > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _run(cfg: WorkerConfig, comm: SiteComm, stop: threading.Event) -> dict:
    rank, k = comm.rank, comm.num_ranks
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    task = load_task(cfg.task)(cfg.task_spec)
    module, optimizer, scheduler = task.model, task.optimizer, task.scheduler
    if k > 1:
        module, optimizer, scheduler = wrap_model(task.model, task.optimizer, cfg.parallel, task.scheduler)
    transport, rendezvous = _transport_and_rendezvous(cfg)
    name = cfg.site_id if k == 1 else f"{cfg.site_id}/{rank}"
    collector = RoundCollector(cfg.gc_every_rounds, site=name)
    t_start = time.monotonic()
    diloco, trained = None, False
    try:
        diloco = DiLoCo(
            module,
            optimizer,
            inner_scheduler=scheduler,
            config=_restarted(_with_tokens(cfg.diloco_config(), task.tokens_per_batch * k)),
            outer_optimizer=outer_factory(cfg),
            transport=transport,
            rendezvous=rendezvous if rank == 0 else None,
            site_comm=comm,
            _defer_join=True,  # a checkpoint first, so a rejoining site presents its saved round
        )
        shards = checkpoints.resume(cfg, task, module, optimizer, scheduler, diloco)
        diloco.join()
        align_data_position(task.batches, diloco.inner_steps, site=name)
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":  # a restarted group runs without faults
            diloco.engine.fault_hook = fault_hook_from_env(name)
        collector.start()  # after set-up: what exists now is frozen
        run = _Run(cfg, task, module, optimizer, scheduler, diloco, out, stop, t_start, collector)
        if cfg.tensorboard and rank == 0:
            from dtrain.app.tensorboard_sink import TensorBoardSink

            run.tb = TensorBoardSink(cfg.tensorboard, cfg.site_id)
        summary = _train(run, shards_state=shards)
        trained = True
    finally:
        collector.close()
        if diloco is not None:
            # first, the peers pull our last means (bounded); after an error at once: closing
            # waits in collectives, which the site group's other ranks (still in the round's
            # own) would never join, so they hung until gloo's 300 s timeout
            diloco.close(wait=trained and not stop.is_set())
        else:
            transport.stop(0.1)
    return _finish(run, summary)


def _with_tokens(c, tokens_per_step: int):
    """The site's tokens per inner step (the task's tokens per batch x its ranks: the unit of a
    round's claim) unless ``diloco.tokens_per_step`` was given."""
    return c if c.tokens_per_step != 1 else dataclasses.replace(c, tokens_per_step=max(1, int(tokens_per_step)))


def align_data_position(batches, inner_steps: int, *, site: str) -> int:
    """After the join: move this site's own batch stream on to batch ``inner_steps`` when
    it stands before it (a stream without ``skip_to``, a task's own, is left alone).
    Returns the number of batches skipped.

    The data cursor of a site's own shard is its inner step count: the worker draws one
    batch of its own stream per inner step (adopted parts are drawn besides, never
    instead of a step's own batch), so the stream never stands past the inner step count,
    and the batches of inner steps ``1..n`` are the stream's first ``n`` at most. A site
    that rejoins takes the donor's inner step count with its training position
    (:meth:`dtrain.diloco.DiLoCo._heal`; equal on every site: every round is H steps),
    so, restarted without a checkpoint (stream at 0) or with a stale one, it skips the
    batches of the rounds it was down for instead of training its shard's first windows
    again (issue 33: the same window digests twice in the data ledger). The skipped
    range is in the next round's ledger (``skipped``, with the reason); while the site was
    down its peers trained parts of its shard instead (``--reassign-after-rounds``). No
    peer or rendezvous keeps another site's cursor: the inner step count every position
    carries is the cursor.
    """
    skip = getattr(batches, "skip_to", None)
    behind = inner_steps - getattr(batches, "step", inner_steps)
    if not callable(skip) or behind <= 0:
        return 0
    n = skip(inner_steps, reason="rounds this site was not training (rejoined at the group's inner step)")
    log.info("%s: data stream moved on %d batches to batch %d (the group's inner step)", site, n, inner_steps)
    return n


def _ledger(batches, first_step: int, last_step: int) -> dict:
    """The data ledger of one round: the stream's own (``take_ledger()``, the built-in
    ``BatchStream``) or, for a task whose stream has none, the inner steps' range."""
    take = getattr(batches, "take_ledger", None)
    return take() if callable(take) else {"steps": [first_step, last_step]}


def _finish(run: _Run, summary: Summary) -> dict:
    """Append the end line (bytes the transports counted after the last round line: means
    served to peers while ``DiLoCo.close`` waited for their pulls; summed over the ranks)
    and write ``summary.json`` (rank 0); returns the summary."""
    diloco, tr = run.diloco, run.diloco.engine.transport
    counts = diloco.comm.all_gather((tr.bytes_sent(), tr.bytes_received(), diloco.diloco_numel()["total"]))
    sent, received = sum(c[0] for c in counts), sum(c[1] for c in counts)
    end = EndLine(
        site=summary.site,
        round=summary.rounds,
        bytes_sent=max(0, sent - summary.bytes_sent),
        bytes_received=max(0, received - summary.bytes_received),
        wall_s=time.monotonic() - run.t_start,
        time=time.time(),
    )
    summary = dataclasses.replace(
        summary,
        bytes_sent=summary.bytes_sent + end.bytes_sent,
        bytes_received=summary.bytes_received + end.bytes_received,
    )
    d = summary.as_dict()
    if diloco.num_ranks > 1:
        d.update(rank=diloco.rank, ranks=diloco.num_ranks, parallel=run.cfg.parallel)
        d["diloco_numel_per_rank"] = [c[2] for c in counts]
    if run.rank0:
        with open(run.metrics_path, "a") as mf:
            write_line(mf, end)
        (run.out / "summary.json").write_text(json.dumps(d, indent=2))
        if run.tb is not None:
            run.tb.close()
        log.info("%s: done: %s", summary.site, d)
    return d


def outer_factory(cfg) -> "Callable[[list[torch.Tensor]], torch.optim.Optimizer]":
    """The outer optimizer of ``cfg`` (``cfg.outer``): SGD with Nesterov momentum; in the
    one-step-delayed mode (F = 1, τ = H) with ``outer.delayed_momentum`` (a stale Δ)."""
    o = cfg.outer
    momentum = o.delayed_momentum if cfg.diloco.one_step_delayed else o.momentum

    def outer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return outer_sgd(params, lr=o.lr, momentum=momentum, nesterov=o.nesterov and momentum > 0)

    return outer


def _train(run: _Run, *, shards_state: dict | None = None) -> Summary:
    """The training loop: inner phase, sync, metrics line, checkpoint, until ``cfg.rounds`` or ``stop``.

    ``shards_state``: the checkpoint's ``shards`` entry (adopted shard parts and their
    positions, ``--reassign-after-rounds``), restored before the first inner step."""
    cfg, diloco = run.cfg, run.diloco
    val = first_val = _write_start(run)
    totals = Totals()
    owned_buckets = 0  # in the last round this site ran (over its ranks)
    train_loss = float("nan")
    run.watch, run.mix = _shard_reassignment(cfg, run.task, shards_state, diloco.rank, diloco.num_ranks)
    batches = run.mix if run.mix is not None else run.task.batches
    max_syncs = cfg.rounds * 4 + 10  # bound the loop even if rounds keep being deferred
    syncs = 0
    cpu_mark = _process_cpu_s()  # each line's cpu_s: the process's CPU since the line before
    streaming = diloco.streaming  # fragment rounds: one line per merged round (dtrain/streaming.py)
    last_started = _last_round_started(diloco, cfg.rounds) if streaming else None
    diloco.start_inner_phase()  # setup (joining, the first evaluation) is not inner-step time
    while diloco.model_round < cfg.rounds and not run.stop.is_set() and syncs < max_syncs:
        t_inner = time.monotonic()
        waited0 = streaming.waited_s if streaming else 0.0
        first_step = diloco.inner_steps + 1
        mean_loss, merged = _inner_phase(run, batches, last_started=last_started)
        inner_last = diloco.inner_steps  # before a heal (joiner state) may replace the count
        if mean_loss is None:
            break  # the summary keeps the last completed round's train loss
        if streaming and merged is None and last_started is not None and last_started():
            merged = diloco.flush()  # the last round: merged at its start step (waiting counts as sync_s)
            if merged is None:
                break
        if not math.isnan(mean_loss):
            train_loss = mean_loss
        diloco.note_progress(last_loss=train_loss)
        timed = _timed_outcome(diloco, merged, t_inner=t_inner, waited0=waited0)
        if timed is None:
            continue  # streaming: no fragment round merged at this step
        inner_s, outcome, sync_s, sync_cpu = timed
        syncs += 1
        if outcome.status != RoundStatus.DEFERRED and (
            diloco.model_round % cfg.eval_every == 0 or diloco.model_round >= cfg.rounds
        ):
            val = run.task.evaluate(run.module)
        ledger = _round_ledger(run.task, run.mix, first_step, inner_last)
        now_cpu = _process_cpu_s()
        cpu_s, cpu_mark = now_cpu - cpu_mark, now_cpu
        times = {"inner_s": inner_s, "sync_s": sync_s, "cpu_s": cpu_s, "round_steps": inner_last - first_step + 1}
        line, extra = _round_line(
            run, outcome, val=val, train_loss=train_loss, times=times, sync_cpu=sync_cpu, data=ledger
        )
        if run.watch is not None and outcome.result is not None:
            run.mix.apply(*run.watch.observe(list(outcome.result.members), outcome.result.round))
        totals.add(line)
        owned_buckets = (line.owned_buckets or 0) if outcome.result is not None else owned_buckets
        _record_round(run, line, extra)
        _maybe_checkpoint(run, outcome)
        export.maybe_export(cfg, run.task, run.module, diloco, outcome)
        if run.collector is not None:
            run.collector.after_round(syncs)
    # a member the last round left stale takes its means again before θ is exported or reported
    behind = diloco.catch_up_last_round() if not run.stop.is_set() else None
    if behind is None:
        export.final_export(cfg, run.task, run.module, diloco)
    return _summary(run, totals, first_val=first_val, val=val, train_loss=train_loss, owned_buckets=owned_buckets)


def _write_start(run: _Run) -> float:
    """Evaluate the starting model and append the start line (rank 0); returns its validation loss."""
    diloco = run.diloco
    val = run.task.evaluate(run.module)
    params = sum(diloco.comm.all_gather(diloco.layout.total_numel))
    log.info("%s: start at round %d, validation loss %.4f", run.cfg.site_id, diloco.round, val)
    if run.rank0:
        start = StartLine(site=run.cfg.site_id, round=diloco.round, val_loss=val, params=params, time=time.time())
        extra = {"ranks": diloco.num_ranks} if diloco.num_ranks > 1 else {}
        with open(run.metrics_path, "a") as mf:
            mf.write(json.dumps({**start.as_dict(), **extra}) + "\n")
    return val


def _shard_reassignment(
    cfg: WorkerConfig, task, shards_state: dict | None, rank: int = 0, num_ranks: int = 1
) -> tuple[ShardWatch | None, DataMix | None]:
    """With ``--reassign-after-rounds`` and a sharded task: the watch of dead sites and the data mix
    in which survivors train parts of a dead site's shard (restored from ``shards_state``); else Nones.
    Rank j of a site group adopts its part of rank j's shard of the dead site (shard
    ``index * K + j``: :func:`dtrain.app.ranks.rank_config`).

    Raises:
        CheckpointError: the checkpoint's adopted shard parts do not fit this task.
    """
    if not cfg.reassign_after_rounds or task.shard_part is None:
        return None, None
    watch = ShardWatch(site_id=cfg.site_id, after_rounds=cfg.reassign_after_rounds)
    make_part = task.shard_part
    if num_ranks > 1:
        make_part = lambda index, part, parts, since: task.shard_part(index * num_ranks + rank, part, parts, since)  # noqa: E731
    mix = DataMix(task.batches, make_part)
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


def _last_round_started(diloco: DiLoCo, rounds: int) -> Callable[[], bool]:
    """Streaming: whether the run's last fragment round has started, so the run ends there and
    merges it (``DiLoCo.flush``). Fixed periods: at inner step ``rounds`` x H/F, as blocking
    rounds end at rounds x H; time-based rounds (``round_window_s``: the steps of a period
    are the window's): once round ``rounds - 1`` has started, however many steps that took
    (:attr:`~dtrain.streaming.StreamingSync.started_round`, the same on every rank)."""
    streaming = diloco.streaming
    assert streaming is not None
    if diloco.config.round_window_s is None:
        last_step = rounds * diloco.period_steps
        return lambda: diloco.inner_steps >= last_step
    return lambda: streaming.started_round is not None and streaming.started_round >= rounds - 1


def _inner_phase(
    run: _Run, batches, *, last_started: Callable[[], bool] | None = None
) -> tuple[float | None, SyncOutcome | None]:
    """``sync_every`` inner-optimizer steps (each stepping the LR scheduler); returns the mean
    loss over the site's ranks (None when ``stop`` was set on any rank) and, with streaming
    rounds (dtrain/streaming.py), the outcome of the fragment round merged at the last step:
    then the phase ends at the first merge (within 2H/F steps), or once ``last_started()``
    (streaming: the last round has started, :func:`_last_round_started`; no step then: the
    mean loss is NaN).

    A one-process site stops at the step ``stop`` is set; the ranks of a site group stop
    together at the end of the phase (one rank stopping alone would leave the others in a
    collective)."""
    cfg, diloco, stop = run.cfg, run.diloco, run.stop
    alone = diloco.num_ranks == 1
    losses = []
    merged: SyncOutcome | None = None
    t0 = time.monotonic()
    for n in range(cfg.diloco.sync_every * (2 if diloco.streaming else 1)):
        if last_started is not None and last_started():
            break
        # blocking rounds: sync_every steps, or with round_window_s those that fit (decided after the first)
        if n and not diloco.streaming and n >= diloco.phase_target(n, time.monotonic() - t0):
            break
        t_step = time.monotonic()
        batch = next(batches)
        loss = run.task.loss(run.module, batch)
        loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        if run.scheduler is not None:
            run.scheduler.step()
        losses.append(float(loss.detach()))
        step_s = time.monotonic() - t_step
        if diloco.streaming:
            diloco.note_progress(last_loss=losses[-1])
            merged = diloco.step()  # counts the step; starts / merges fragment rounds on schedule
        else:
            diloco.inner_steps += 1
            diloco.round_steps += 1  # the round's token claim (DiLoCo.sync)
            diloco.note_progress()
        if cfg.inner_step_sleep_s:
            stop.wait(cfg.inner_step_sleep_s)
        if cfg.slowdown < 1:  # emulated slow hardware: the step (its emulated compute too) to 1/slowdown
            stop.wait((1 / cfg.slowdown - 1) * (step_s + cfg.inner_step_sleep_s))
        if merged is not None or (alone and stop.is_set()):
            break
    if not diloco.streaming:  # the step time time-based rounds plan the next phase with
        diloco.note_phase(len(losses), time.monotonic() - t0)
    mine = (sum(losses) / len(losses)) if losses else math.nan
    ranks = diloco.comm.all_gather((mine, stop.is_set()))
    if any(s for _, s in ranks):
        stop.set()
        return None, None
    finite = [x for x, _ in ranks if not math.isnan(x)]
    return (sum(finite) / len(finite) if finite else math.nan), merged


def _site_figures(ranks: list[dict], key: str) -> float | None:
    """A figure summed over the ranks (None when every rank has None)."""
    vals = [r[key] for r in ranks if r[key] is not None]
    return sum(vals) if vals else None


def _site_engine_fields(ranks: list[dict]) -> dict:
    """The line's engine fields: rank 0's, with bytes and owned buckets summed over the ranks."""
    engine = dict(ranks[0]["engine"]) if ranks[0]["engine"] is not None else {}
    if engine:
        for key in _SUMMED:
            engine[key] = sum(int(r["engine"][key] or 0) for r in ranks if r["engine"] is not None)
    return engine


def _site_counters(ranks: list[dict]) -> dict | None:
    """The datagram path's counters summed over the ranks (rank 0's non-numbers). A rank's
    transport adds a counter when it first counts one (``rejected_<code>``), so a key one rank
    has and another lacks counts 0 at the other."""
    first = ranks[0]["datagram"]
    if first is None or len(ranks) == 1:
        return first
    counters = [r["datagram"] for r in ranks if r["datagram"] is not None]
    numbers = {k for c in counters for k, v in c.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {**first, **{k: sum(c.get(k, 0) for c in counters) for k in numbers}}


def _round_line(
    run: _Run,
    outcome: SyncOutcome,
    *,
    val: float,
    train_loss: float,
    times: dict[str, float],
    sync_cpu: tuple[float, float] | None = None,
    data: dict | None = None,
) -> tuple[RoundLine, dict]:
    """The site's metrics line of the sync that just ended (a deferred one has no round
    result), and the site-group fields it adds for K > 1 (docs/METRICS.md, "Site groups").
    Every rank's figures are gathered (a collective); CPU seconds and bytes are the site's
    (summed over its ranks), the other engine fields rank 0's. ``times``: ``inner_s``,
    ``sync_s`` and ``cpu_s`` (the process's CPU seconds since the previous line);
    ``sync_cpu``: during the sync, ``(user + system, system)`` (None: streaming)."""
    diloco, res = run.diloco, outcome.result
    counters = getattr(diloco.engine.transport, "counters", None)  # the datagram path's (cumulative)
    mine = {
        "engine": engine_fields(res) if res is not None else None,
        "cpu_s": times["cpu_s"],
        "sync_cpu_s": None if sync_cpu is None else sync_cpu[0],
        "sync_system_cpu_s": None if sync_cpu is None else sync_cpu[1],
        "outer_checksum": outer_state_checksum(diloco),
        "datagram": counters() if res is not None and counters is not None else None,
        "data": data,
    }
    ranks = diloco.comm.all_gather(mine)
    k = len(ranks)
    line = RoundLine(
        site=run.cfg.site_id,
        round=(res.round if res else diloco.model_round - 1),
        status=outcome.status.value,
        reason=outcome.reason,
        members=list(res.members) if res else [],
        val_loss=val,
        train_loss=train_loss,
        inner_steps=diloco.inner_steps,
        round_steps=times["round_steps"],
        tokens_per_s=diloco.config.tokens_per_step * times["round_steps"] / times["inner_s"]
        if times["inner_s"] > 0
        else None,
        inner_s=times["inner_s"],
        sync_s=times["sync_s"],
        quorum_s=outcome.quorum_s,
        cpu_s=_site_figures(ranks, "cpu_s"),
        sync_cpu_s=_site_figures(ranks, "sync_cpu_s"),
        sync_system_cpu_s=_site_figures(ranks, "sync_system_cpu_s"),
        wall_s=time.monotonic() - run.t_start,
        time=time.time(),
        checksum=outcome.site_checksum,
        outer_checksum=ranks[0]["outer_checksum"]
        if k == 1
        else combine_checksums([r["outer_checksum"] for r in ranks]),
        datagram=_site_counters(ranks),
        data=data if k == 1 else {"ranks": [r["data"] for r in ranks]},
        **_site_engine_fields(ranks),
    )
    extra: dict = {}
    if k > 1:
        extra = {"ranks": k, "slice_checksums": outcome.slice_checksums, "rank_cpu_s": [r["cpu_s"] for r in ranks]}
        if res is not None:
            for key in _PER_RANK:
                extra[f"rank_{key}"] = [r["engine"][key] if r["engine"] else 0 for r in ranks]
    return line, extra


def _record_round(run: _Run, line: RoundLine, extra: dict) -> None:
    """(Rank 0) append ``line`` to the metrics file, queue its report for the status page, and log it."""
    if not run.rank0:
        return
    d = {**line.as_dict(), **extra}
    with open(run.metrics_path, "a") as mf:
        mf.write(json.dumps(d) + "\n")
        mf.flush()
    group = run.diloco.group
    if group is not None:
        group.report_round(round_report(d))  # for the rendezvous status page (heartbeat thread)
    if run.tb is not None:
        run.tb.add_round(d)  # the same figures as TensorBoard scalars
    log.info(
        "%s: round %d %s members=%s val_loss=%.4f sync_s=%.2f bytes_sent=%d",
        run.cfg.site_id,
        line.round,
        line.status,
        line.members,
        line.val_loss,
        line.sync_s,
        line.bytes_sent or 0,
    )


def _maybe_checkpoint(run: _Run, outcome: SyncOutcome) -> None:
    """Save a checkpoint every ``checkpoint.every`` rounds (never after a deferred sync; every
    rank of a site group), with the adopted shard parts when shards are re-assigned."""
    every = run.cfg.checkpoint.every
    if every and outcome.status != RoundStatus.DEFERRED and run.diloco.model_round % every == 0:
        shards = {"watch": run.watch.state_dict(), "mix": run.mix.state_dict()} if run.watch is not None else None
        checkpoints.save(run.cfg, run.task, run.module, run.optimizer, run.scheduler, run.diloco, shards=shards)


def _summary(
    run: _Run, totals: Totals, *, first_val: float, val: float, train_loss: float, owned_buckets: int
) -> Summary:
    """The run's summary after the loop ended (a collective for K > 1: every rank calls it)."""
    diloco = run.diloco
    wall = time.monotonic() - run.t_start
    sizes = diloco.comm.all_gather((len(diloco.layout), diloco.layout.total_numel))
    # compression_ratio: the codec's ratio over every contribution this site encoded;
    # bytes_sent also counts means an owner serves, so it is not a compression measure.
    return Summary(
        site=run.cfg.site_id,
        rounds=diloco.round,
        first_val_loss=first_val,
        final_val_loss=val,
        final_train_loss=train_loss,
        checksum=diloco.site_checksum(),
        wall_s=wall,
        sync_share=totals.sync_s / wall if wall > 0 else 0.0,
        fp32_bytes_per_round=4 * sum(n for _, n in sizes),
        owned_buckets=owned_buckets,
        num_buckets=sum(b for b, _ in sizes),
        interrupted=run.stop.is_set(),
        compression_ratio=totals.compression_ratio,
        **dataclasses.asdict(totals),
    )


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGTERM/SIGINT set ``stop``; the training loop ends after the current step. SIGUSR1
    prints every thread's Python stack to stderr (the site's worker.log under ``dtrain
    launch``) and goes on: what a hung worker is waiting on (the reliability harness sends
    it before killing a launch that overran)."""

    def handler(signum, frame):  # noqa: ARG001
        log.warning("signal %d: stopping after the current step", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
