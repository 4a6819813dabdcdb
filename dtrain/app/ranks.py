"""The ranks of a site: a site that is a torch.distributed group of K ranks, set up.

``torchrun --nproc-per-node K -m dtrain worker ...`` starts K ranks, each running the
one worker loop (:func:`dtrain.app.worker.run_worker`). This module holds what differs
for K > 1 before that loop starts: joining the site's gloo process group from
torchrun's environment (:func:`init_site_process_group`), the rank's data shard and
listen port (:func:`rank_config`), wrapping the model for DDP or FSDP2
(:func:`wrap_model`, which rebuilds the inner optimizer and its LR scheduler over the
sharded parameters), and how ``dtrain launch --ranks-per-site K`` wraps a worker
command (:func:`torchrun_argv`: one torchrun group per site, its rendezvous on
127.0.0.1 at a port of its own, ``--max-restarts`` restarts the whole group when a
rank dies).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "PARALLEL_MODES",
    "in_site_group",
    "init_site_process_group",
    "rank_config",
    "wrap_model",
    "torchrun_argv",
]

log = logging.getLogger(__name__)

PARALLEL_MODES = ("ddp", "fsdp")


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


def _rebuilt_scheduler(scheduler, optimizer: torch.optim.Optimizer):
    """The same LR schedule over ``optimizer`` (a rebuilt inner optimizer), at the same
    position: a ``LambdaLR`` (the built-in tasks' warmup + cosine) is made again with its
    own lambdas and state.

    Raises:
        ValueError: another scheduler type (it cannot follow a rebuilt optimizer here).
    """
    if scheduler is None:
        return None
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        raise ValueError(
            f"parallel='fsdp' rebuilds the inner optimizer over the sharded parameters, and the task's "
            f"{type(scheduler).__name__} cannot follow it: give the task a LambdaLR scheduler, or use parallel='ddp'"
        )
    state = scheduler.state_dict()
    new = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=list(scheduler.lr_lambdas))
    new.load_state_dict(state)
    for group, lr in zip(optimizer.param_groups, new.get_last_lr()):
        group["lr"] = lr
    return new


def wrap_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer, parallel: str, scheduler=None):
    """Wrap a task's model for a site group.

    ``"ddp"``: ``DistributedDataParallel`` (the optimizer and scheduler are kept).
    ``"fsdp"``: FSDP2 ``fully_shard`` on every element of every ``nn.ModuleList`` (the
    transformer blocks) and on the root; the optimizer is rebuilt over the sharded
    parameters with the same groups and settings, and its LR ``scheduler`` (if any)
    over the rebuilt optimizer at the same position.

    Returns:
        ``(module to call, optimizer, scheduler)``.
    Raises:
        ValueError: ``parallel`` not one of :data:`PARALLEL_MODES`, or a scheduler
            that cannot follow a rebuilt optimizer.
    """
    if parallel == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model), optimizer, scheduler
    if parallel != "fsdp":
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    from torch.distributed.fsdp import fully_shard

    old_names = {id(p): n for n, p in model.named_parameters()}
    for m in list(model.modules()):
        if isinstance(m, torch.nn.ModuleList):
            for block in m:
                fully_shard(block)
    fully_shard(model)
    new_optimizer = _rebuilt_optimizer(optimizer, old_names, model)
    return model, new_optimizer, _rebuilt_scheduler(scheduler, new_optimizer)


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


def rank_config(cfg, rank: int, num_ranks: int):
    """The worker config of rank ``rank`` of a site of ``num_ranks``: a fixed ``listen``
    port P becomes P + rank; the task's data shard becomes ``site_index * K + rank`` of
    ``num_sites * K`` (every rank trains its own shard). Unchanged for K = 1."""
    if num_ranks == 1:
        return cfg
    listen = cfg.net.listen
    listen = dataclasses.replace(listen, port=listen.port + rank if listen.port else 0)
    ts = cfg.task_spec
    spec = dataclasses.replace(ts, site_index=ts.site_index * num_ranks + rank, num_sites=ts.num_sites * num_ranks)
    return dataclasses.replace(cfg, net=dataclasses.replace(cfg.net, listen=listen), task_spec=spec)
