"""``dtrain worker`` under torchrun: one rank of a site that is a torch.distributed group.

``torchrun --nproc-per-node K -m dtrain worker ...`` starts K ranks; each calls
:func:`run_site_worker` (``dtrain worker`` hands over when ``WORLD_SIZE > 1``). The
ranks form a gloo process group through torchrun's own rendezvous; the built-in
task trains with DDP or FSDP2 (``--parallel ddp|fsdp``), each rank on its own
data shard (``site_index * K + rank`` of ``num_sites * K``); the outer sync runs
through :class:`~dtrain.sitegroup.SiteGroupDiLoCo`. Rank 0 writes the site's
``metrics.jsonl`` (one line per round: the site checksum, bytes summed over ranks
and per rank) and ``summary.json``, and reports rounds to the status page.

:func:`torchrun_argv` is how ``dtrain launch --ranks-per-site K`` wraps a worker
command: one torchrun group per site, its rendezvous on 127.0.0.1 at a port of
its own, ``--max-restarts`` restarts the whole group when a rank dies.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain.app.gc_control import RoundCollector
from dtrain.metrics import EndLine, RoundLine, StartLine, Summary, Totals, engine_fields, parse_line, write_line
from dtrain.sitegroup import SiteGroupDiLoCo, SiteSyncOutcome, combine_checksums
from dtrain.sitegroup.checkpoint import latest_site_checkpoint, load_site_checkpoint, save_site_checkpoint
from dtrain.status import round_report
from dtrain.tasks import load_task

__all__ = [
    "PARALLEL_MODES",
    "in_site_group",
    "init_site_process_group",
    "wrap_model",
    "run_site_worker",
    "torchrun_argv",
]

log = logging.getLogger(__name__)

PARALLEL_MODES = ("ddp", "fsdp")
# Bytes fields of a RoundResult summed over a site's ranks in its metrics line.
_SUMMED = ("bytes_sent", "bytes_received", "encoded_bytes", "encoded_fp32_bytes", "owned_buckets")


def in_site_group() -> bool:
    """True when torchrun (or the like) started this process as one of K > 1 ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def torchrun_argv(worker_argv: list[str], *, num_ranks: int, max_restarts: int = 0) -> list[str]:
    """The command that runs ``worker_argv`` (``[python, -m, dtrain, worker, ...]``)
    as one torchrun group of ``num_ranks`` ranks on this machine.

    ``--standalone``: torchrun's agent binds its own c10d rendezvous store on a port the
    kernel picks (``localhost:0``) and hands it to the ranks (``MASTER_PORT``,
    ``TORCHELASTIC_USE_AGENT_STORE``), so no port is chosen here and then bound later by
    another process (a port picked free and passed as ``--master-port`` could be taken in
    between).

    Raises:
        ValueError: ``worker_argv`` is not a ``python -m dtrain ...`` command.
    """
    if len(worker_argv) < 3 or worker_argv[1:3] != ["-m", "dtrain"]:
        raise ValueError(f"worker_argv must start with [python, '-m', 'dtrain'], got {worker_argv[:3]!r}")
    return [
        worker_argv[0],
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(num_ranks),
        "--standalone",
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.5",
        "-m",
        "dtrain",
        *worker_argv[3:],
    ]


def _rebuilt_optimizer(optimizer: torch.optim.Optimizer, old_names: dict[int, str], model: torch.nn.Module):
    """The same optimizer over ``model``'s new (sharded) parameters, group by group."""
    new = dict(model.named_parameters())
    groups = []
    for g in optimizer.param_groups:
        opts = {k: v for k, v in g.items() if k != "params"}
        groups.append({**opts, "params": [new[old_names[id(p)]] for p in g["params"]]})
    return type(optimizer)(groups)  # every group carries all of its options


def wrap_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer, parallel: str):
    """Wrap a task's model for a site group.

    ``"ddp"``: ``DistributedDataParallel`` (the optimizer is kept). ``"fsdp"``:
    FSDP2 ``fully_shard`` on every element of every ``nn.ModuleList`` (the
    transformer blocks) and on the root; the optimizer is rebuilt over the
    sharded parameters with the same groups and settings.

    Returns:
        ``(module to call, optimizer)``.
    Raises:
        ValueError: ``parallel`` not one of :data:`PARALLEL_MODES`.
    """
    if parallel == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model), optimizer
    if parallel != "fsdp":
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    from torch.distributed.fsdp import fully_shard

    old_names = {id(p): n for n, p in model.named_parameters()}
    for m in list(model.modules()):
        if isinstance(m, torch.nn.ModuleList):
            for block in m:
                fully_shard(block)
    fully_shard(model)
    return model, _rebuilt_optimizer(optimizer, old_names, model)


def init_site_process_group(*, timeout_s: float) -> None:
    """Join the site's gloo process group from torchrun's environment.

    Under a torchrun restart (``TORCHELASTIC_RESTART_COUNT`` > 0) the ranks meet
    under a store prefix of their own attempt: with torchrun's static rendezvous
    (``--master-addr/--master-port``) the restarted ranks otherwise read the dead
    attempt's gloo addresses from the same store and fail in ``connectFullMesh``
    (Connection refused; reproduced with torch 2.13, see docs/DECISIONS.md).
    """
    timeout = timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        dist.init_process_group("gloo", timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"dtrain/attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


def _outer_factory(cfg):
    from dtrain.app.worker import outer_factory  # noqa: PLC0415 (worker imports this module's users lazily too)

    return outer_factory(cfg)


def run_site_worker(cfg, *, parallel: str = "ddp", stop_event: threading.Event | None = None) -> dict:
    """Run this rank of a site group to completion (every rank calls it).

    Args:
        cfg: the site's ``WorkerConfig`` (a fixed ``listen`` port P becomes P + rank).
        parallel: ``"ddp"`` or ``"fsdp"`` (see :func:`wrap_model`).
    Returns:
        the summary dict (rank 0 also writes ``out_dir/summary.json``).
    Raises:
        QuorumTimeout: (every rank) no round formed within ``quorum_wait_s``.
        CheckpointError: (every rank) ``resume`` with a checkpoint of another site,
            rank count or model.
    """
    from dtrain.app.worker import _transport_and_rendezvous, fault_hook_from_env

    torch.set_num_threads(cfg.threads)
    init_site_process_group(timeout_s=max(60.0, cfg.diloco.group.quorum_wait_s))
    rank, k = dist.get_rank(), dist.get_world_size()
    listen = cfg.net.listen
    listen = dataclasses.replace(listen, port=listen.port + rank if listen.port else 0)
    cfg = dataclasses.replace(cfg, net=dataclasses.replace(cfg.net, listen=listen))
    ts = cfg.task_spec
    spec = dataclasses.replace(ts, site_index=ts.site_index * k + rank, num_sites=ts.num_sites * k)
    task = load_task(cfg.task)(spec)
    module, optimizer = wrap_model(task.model, task.optimizer, parallel)
    transport, rendezvous = _transport_and_rendezvous(cfg)
    stop = stop_event or threading.Event()
    diloco = None
    collector = RoundCollector(cfg.gc_every_rounds, site=f"{cfg.site_id}/{rank}")
    try:
        diloco = SiteGroupDiLoCo(
            module,
            optimizer,
            config=cfg.diloco_config(),
            transport=transport,
            rendezvous=rendezvous if rank == 0 else None,
            outer_optimizer=_outer_factory(cfg),
            defer_join=True,
        )
        _maybe_resume(cfg, task, module, optimizer, diloco)
        diloco.join()
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":  # a restarted group runs without faults
            diloco.engine.fault_hook = fault_hook_from_env(f"{cfg.site_id}/{rank}")
        t_start = time.monotonic()
        collector.start()  # after set-up: what exists now is frozen
        summary = _train(cfg, task, module, optimizer, diloco, stop, parallel, collector)
        linger_s = cfg.linger_s if cfg.linger_s is not None else 3.0
        time.sleep(linger_s if not stop.is_set() else 0.0)  # let peers finish pulling our means
        return _finish(cfg, diloco, summary, t_start)
    finally:
        collector.close()
        if diloco is not None:
            diloco.close()
        else:
            transport.stop(0.1)
        if dist.is_initialized():
            dist.destroy_process_group()


def _maybe_resume(cfg, task, module, optimizer, diloco: SiteGroupDiLoCo) -> None:
    """``--resume``: every rank loads its slice, model shard, inner optimizer and data
    position from the newest site-group checkpoint (dtrain.sitegroup.checkpoint)."""
    if not cfg.checkpoint.resume:
        return
    path = latest_site_checkpoint(cfg.resolved_checkpoint_dir)
    if path is None:
        if diloco.rank == 0:
            log.warning("--resume: no site-group checkpoint in %s; starting fresh", cfg.resolved_checkpoint_dir)
        return
    extra = load_site_checkpoint(path, diloco, module, optimizer)
    task.batches.load_state_dict(extra["batches"])
    if task.scheduler is not None and extra.get("inner_scheduler") is not None:
        task.scheduler.load_state_dict(extra["inner_scheduler"])


def _maybe_checkpoint(cfg, task, module, optimizer, diloco: SiteGroupDiLoCo, out: SiteSyncOutcome) -> None:
    """Every ``checkpoint.every`` rounds (never after a deferred sync), on every rank."""
    every = cfg.checkpoint.every
    if every and out.status != "deferred" and diloco.round % every == 0:
        extra = {
            "batches": task.batches.state_dict(),
            "inner_scheduler": task.scheduler.state_dict() if task.scheduler is not None else None,
        }
        save_site_checkpoint(cfg.resolved_checkpoint_dir, diloco, module, optimizer, extra=extra)


def _inner_phase(cfg, task, module, optimizer, diloco: SiteGroupDiLoCo, stop: threading.Event) -> float:
    losses = []
    for _ in range(diloco.period_steps):  # H, or H/F with fragment rounds
        loss = task.loss(module, next(task.batches))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        diloco.inner_steps += 1
        if diloco.group is not None:
            diloco.group.inner_step = diloco.inner_steps
        if cfg.inner_step_sleep_s:
            time.sleep(cfg.inner_step_sleep_s)
    # the site's train loss: the mean over its ranks (a collective, so no rank stops alone)
    t = torch.tensor([sum(losses) / len(losses), float(stop.is_set())])
    dist.all_reduce(t)
    if diloco.group is not None:
        diloco.group.last_loss = float(t[0]) / diloco.num_ranks
    if float(t[1]) > 0:
        stop.set()
    return float(t[0]) / diloco.num_ranks


def _round_line(cfg, out: SiteSyncOutcome, results: list[dict | None], base: dict[str, Any]) -> dict:
    """The site's metrics line: the schema's RoundLine (rank 0's engine fields, bytes and
    owned buckets summed over the ranks) plus the site-group fields (docs/METRICS.md,
    "Site groups"). ``base`` carries ``outer_checksum``, combined over the ranks."""
    engine = dict(results[0]) if results[0] is not None else {}
    if engine:
        for key in _SUMMED:
            engine[key] = sum(int(r[key]) for r in results if r is not None)
    line = RoundLine(
        site=cfg.site_id, status=out.status, reason=out.reason, checksum=out.site_checksum, **base, **engine
    ).as_dict()
    line.update(ranks=len(results), slice_checksums=out.slice_checksums)
    if engine:
        for key in ("bytes_sent", "bytes_received", "reduce_arrived_fraction", "broadcast_arrived_fraction"):
            line[f"rank_{key}"] = [r[key] if r else 0 for r in results]
    return line


def _train(
    cfg,
    task,
    module,
    optimizer,
    diloco: SiteGroupDiLoCo,
    stop: threading.Event,
    parallel: str,
    collector: RoundCollector | None = None,
) -> Summary:
    from dtrain.app.worker import outer_state_checksum

    out_dir = Path(cfg.out_dir)
    rank0 = diloco.rank == 0
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
    metrics = out_dir / "metrics.jsonl"
    t_start = time.monotonic()
    val = first_val = task.evaluate(module)
    params = sum(diloco._all_gather(sum(t.numel() for t in diloco.local)))
    if rank0:
        start = StartLine(site=cfg.site_id, round=diloco.round, val_loss=val, params=params, time=time.time())
        with open(metrics, "a") as mf:
            mf.write(json.dumps({**start.as_dict(), "ranks": diloco.num_ranks}) + "\n")
    totals = Totals()
    train_loss, syncs, out = float("nan"), 0, None
    num_buckets = sum(diloco._all_gather(len(diloco.layout)))
    owned_buckets = 0  # the site's (over its ranks), in the last round it ran
    while diloco.round < cfg.rounds and not stop.is_set() and syncs < cfg.rounds * 4 + 10:
        t0 = time.monotonic()
        train_loss = _inner_phase(cfg, task, module, optimizer, diloco, stop)
        if stop.is_set():
            break
        t1 = time.monotonic()
        out = diloco.sync()
        t2 = time.monotonic()
        syncs += 1
        if out.status != "deferred" and (diloco.round % cfg.eval_every == 0 or diloco.round >= cfg.rounds):
            val = task.evaluate(module)
        mine = (engine_fields(out.result) if out.result else None, outer_state_checksum(diloco))
        results, outer = (list(x) for x in zip(*diloco._all_gather(mine)))
        base = {
            "round": out.result.round if out.result else diloco.round - 1,
            "members": list(out.result.members) if out.result else [],
            "val_loss": val,
            "train_loss": train_loss,
            "inner_steps": diloco.inner_steps,
            "inner_s": t1 - t0,
            "sync_s": t2 - t1,
            "quorum_s": out.quorum_s,
            "wall_s": t2 - t_start,
            "time": time.time(),
            "outer_checksum": combine_checksums(outer),  # as the θ checksum: one per site
        }
        line = _round_line(cfg, out, results, base)
        owned_buckets = line["owned_buckets"] if out.result is not None else owned_buckets
        _maybe_checkpoint(cfg, task, module, optimizer, diloco, out)
        totals.add(parse_line(line))
        if rank0:
            with open(metrics, "a") as mf:
                mf.write(json.dumps(line) + "\n")
            assert diloco.group is not None
            diloco.group.report_round(round_report(line))
            log.info(
                "%s: round %d %s members=%s val_loss=%.4f", cfg.site_id, base["round"], out.status, line["members"], val
            )
        if collector is not None:
            collector.after_round(syncs)
    wall = time.monotonic() - t_start
    summary = Summary(
        site=cfg.site_id,
        rounds=diloco.round,
        first_val_loss=first_val,
        final_val_loss=val,
        final_train_loss=train_loss,
        checksum=out.site_checksum if out is not None else None,
        wall_s=wall,
        sync_share=totals.sync_s / wall if wall > 0 else 0.0,
        fp32_bytes_per_round=4 * params,
        owned_buckets=owned_buckets,
        num_buckets=num_buckets,
        interrupted=stop.is_set(),
        compression_ratio=totals.compression_ratio,
        **dataclasses.asdict(totals),
    )
    return summary


def _finish(cfg, diloco: SiteGroupDiLoCo, summary: Summary, t_start: float) -> dict:
    """Every rank: sum the bytes the ranks' transports counted after the last round line
    (means served during ``linger_s``); rank 0 appends the end line and writes
    ``summary.json``. Returns the summary with the site-group fields."""
    tr = diloco.engine.transport
    sent, received = (sum(x) for x in zip(*diloco._all_gather((tr.bytes_sent(), tr.bytes_received()))))
    end = EndLine(
        site=summary.site,
        round=summary.rounds,
        bytes_sent=max(0, sent - summary.bytes_sent),
        bytes_received=max(0, received - summary.bytes_received),
        wall_s=time.monotonic() - t_start,
        time=time.time(),
    )
    summary = dataclasses.replace(
        summary,
        bytes_sent=summary.bytes_sent + end.bytes_sent,
        bytes_received=summary.bytes_received + end.bytes_received,
    )
    d = summary.as_dict()
    d.update(rank=diloco.rank, ranks=diloco.num_ranks, parallel=cfg.parallel)
    d["diloco_numel_per_rank"] = diloco._all_gather(diloco.diloco_numel()["total"])
    if diloco.rank == 0:
        out_dir = Path(cfg.out_dir)
        with open(out_dir / "metrics.jsonl", "a") as mf:
            write_line(mf, end)
        (out_dir / "summary.json").write_text(json.dumps(d, indent=2))
        log.info("%s: done: %s", cfg.site_id, d)
    return d
