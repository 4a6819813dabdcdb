"""One torchft 0.2.0 replica group (one site) training dtrain's built-in task with DiLoCo.

Started by :mod:`experiments.vs_torchft` (its pre-warmed ``_child`` calls :func:`main`) as its own OS
process, one per site, next to a ``torchft_lighthouse``. It trains exactly what a ``dtrain worker``
trains: the task of ``dtrain.tasks.build_task`` (same model and seeded initial weights, data shard and order,
validation batches, inner AdamW), DiLoCo (arXiv 2311.08105) through ``torchft.local_sgd.DiLoCo``
with one fragment, H = ``sync_every``, outer ``SGD(lr=0.7, momentum=0.9, nesterov=True)``, and
``torch.set_num_threads(threads)``.

torchft is configured as its documentation recommends for DiLoCo: ``Manager(use_async_quorum=False,
init_sync=False, min_replica_size=1)``, a replica group of one process with its own ``TCPStore``,
``ProcessGroupGloo``, the recommended timeouts (:data:`TIMEOUT`, :data:`QUORUM_TIMEOUT`, :data:`PG_TIMEOUT`)
and the default HTTP checkpoint transport for live recovery; the Manager's state dict holds the model
and the inner optimizer.

Output (``--out-dir``), shaped as a dtrain worker's (docs/METRICS.md): ``metrics.jsonl`` with a
``start`` line and one ``round`` line per sync attempt (``round`` = 0-based attempt, ``step`` =
torchft's committed outer steps, ``bytes_sent`` = the ring all-reduce estimate), and
``summary.json`` (``ru_maxrss_kb``: this process's peak RSS).

``--kill-at-round K`` (test fault) SIGKILLs this process in sync attempt K after the quorum
formed, before its first all-reduce (where dtrain's ``before_push`` fault fires).
``--barrier-dir DIR``: write ``DIR/ready-<index>`` once the Manager heartbeats, then wait for
``DIR/go`` (dtrain's rendezvous does the same with ``initial_sites``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import resource
import signal
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

log = logging.getLogger("torchft_site")
# torchft's recommendations (its docs, examples/diloco/README.md): Manager timeout (collectives,
# should_commit, recovery; also its connect timeout) 30 s, quorum timeout 300 s (DiLoCo: >> one round), gloo 5 s.
TIMEOUT, QUORUM_TIMEOUT, PG_TIMEOUT = timedelta(seconds=30), timedelta(seconds=300), timedelta(seconds=5)


def ring_allreduce_bytes(numel: int, num_participants: int, elem_bytes: int = 4) -> int:
    """Payload bytes ONE participant sends in gloo's ring all-reduce (reduce-scatter, then
    all-gather) of ``numel`` elements: ``2 (n - 1) / n`` of the tensor; 0 when alone."""
    n = num_participants
    return int(round(2 * (n - 1) / n * numel * elem_bytes)) if n > 1 else 0


def _checksum(model) -> str:
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--site-index", type=int, required=True)
    p.add_argument("--num-sites", type=int, required=True)
    p.add_argument("--lighthouse", required=True, help="http://host:port of torchft_lighthouse")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--size", default="small")
    p.add_argument("--data", default="stdlib")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=10, help="outer steps to commit")
    p.add_argument("--sync-every", type=int, default=20, help="H inner steps per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1", help="address this site advertises and binds its store on")
    p.add_argument("--kill-at-round", type=int, default=-1, help="test fault: SIGKILL in this sync attempt (-1: never)")
    p.add_argument("--barrier-dir", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # to stderr
    t_start = time.monotonic()
    import torch
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo  # the harness checked that it imports (vs_torchft.torchft_problem)

    from dtrain.app.config import OuterConfig
    from dtrain.tasks import TaskSpec, build_task
    from experiments.procs import wait_until

    torch.set_num_threads(a.threads)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    site = f"site-{a.site_index}"
    task = build_task(TaskSpec(site_index=a.site_index, num_sites=a.num_sites, seed=a.seed, data=a.data, size=a.size))
    model, inner = task.model, task.optimizer
    o = OuterConfig()  # a dtrain worker's default outer optimizer
    outer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, nesterov=o.nesterov)
    store = TCPStore(a.host, 0, is_master=True, wait_for_workers=False)
    manager, state = _manager(a, site, task, store.port)
    if a.barrier_dir:  # every Manager heartbeats before any asks for a quorum
        (Path(a.barrier_dir) / f"ready-{a.site_index}").write_text(str(os.getpid()))
        if not wait_until((Path(a.barrier_dir) / "go").exists, 120):
            print("torchft_site: start barrier timed out", file=sys.stderr)
            return 3
    with open(out / "metrics.jsonl", "a", buffering=1) as metrics:
        with DiLoCo(
            manager, [model], inner, outer, sync_every=a.sync_every, backup_device=torch.device("cpu"), pin_memory=False
        ):
            summary = _train(a, site, task, manager, state, metrics, t_start)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    manager.shutdown(wait=False)
    return 0


def _manager(a: argparse.Namespace, site: str, task, store_port: int):
    """This site's torchft Manager (one replica group of one rank), its all-reduce wrapped to count calls
    and to SIGKILL this process in attempt ``--kill-at-round`` once admitted; (manager, counters)."""
    from torchft import Manager, ProcessGroupGloo

    model, inner = task.model, task.optimizer

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner_optim": inner.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner_optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=PG_TIMEOUT),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        use_async_quorum=False,
        replica_id=site,
        store_addr=a.host,
        store_port=store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=a.lighthouse,
        hostname=a.host,
        timeout=TIMEOUT,
        quorum_timeout=QUORUM_TIMEOUT,
        connect_timeout=TIMEOUT,
        init_sync=False,
    )
    state = {"attempt": 0, "allreduce_calls": 0}
    real_allreduce = manager.allreduce

    def allreduce(tensor, *args, **kwargs):
        state["allreduce_calls"] += 1
        if state["attempt"] == a.kill_at_round:
            manager.wait_quorum()  # admitted to the round, nothing sent yet
            log.warning("test fault: SIGKILL in sync attempt %d before the all-reduce", a.kill_at_round)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_allreduce(tensor, *args, **kwargs)

    manager.allreduce = allreduce  # DiLoCo looks it up on the instance
    return manager, state


def _train(a: argparse.Namespace, site: str, task, manager, state: dict, metrics, t_start: float) -> dict:
    """Sync attempts until ``--rounds`` are committed (at most 4 x rounds + 10 attempts), one metrics line
    per attempt (inside DiLoCo's context); returns the site's summary."""
    model, inner = task.model, task.optimizer
    numel = sum(p.numel() for p in model.parameters())
    val = first_val = task.evaluate(model)
    start = {"site": site, "event": "start", "round": manager.current_step(), "val_loss": val}
    start |= {"wall_s": time.monotonic() - t_start, "params": numel, "time": time.time(), "pid": os.getpid()}
    metrics.write(json.dumps(start) + "\n")
    totals = Counter(bytes_sent=0, sync_s=0.0, inner_s=0.0, committed=0)
    train_loss = float("nan")
    while manager.current_step() < a.rounds and state["attempt"] < 4 * a.rounds + 10:
        t_inner = time.monotonic()
        losses = []
        step_before = manager.current_step()
        calls_before = state["allreduce_calls"]
        for _ in range(a.sync_every):
            loss = task.loss(model, next(task.batches))
            loss.backward()
            losses.append(float(loss.detach()))
            t_step = time.monotonic()
            inner.step()  # the H-th: the DiLoCo post-step hook runs quorum, all-reduce, outer step
            sync_s = time.monotonic() - t_step  # the sync: the H-th step's (the last one assigned)
            inner.zero_grad(set_to_none=True)
        inner_s = time.monotonic() - t_inner - sync_s
        train_loss = sum(losses) / len(losses)
        committed = manager.current_step() > step_before
        members = manager.num_participants()
        val = task.evaluate(model)
        sent = ring_allreduce_bytes(numel, members) if state["allreduce_calls"] > calls_before else 0
        totals.update(bytes_sent=sent, sync_s=sync_s, inner_s=inner_s, committed=int(committed))
        line = {
            "site": site,
            "event": "round",
            "round": state["attempt"],
            "step": manager.current_step(),
            "status": "applied" if committed else "discarded",
            "committed": committed,
            "members": members,
            "quorum_id": manager._quorum_id,
            "val_loss": val,
            "train_loss": train_loss,
            "inner_s": inner_s,
            "sync_s": sync_s,
            "wall_s": time.monotonic() - t_start,
            "time": time.time(),
            "checksum": _checksum(model),
            "bytes_sent": sent,
            "bytes_received": sent,
            "errored": repr(manager.errored().original_exception) if manager.errored() else None,
        }
        metrics.write(json.dumps(line) + "\n")
        state["attempt"] += 1
    wall = time.monotonic() - t_start
    return {
        "site": site,
        "system": "torchft",
        "rounds": manager.current_step(),
        "first_val_loss": first_val,
        "final_val_loss": val,
        "final_train_loss": train_loss,
        "checksum": _checksum(model),
        "wall_s": wall,
        "sync_share": totals["sync_s"] / wall if wall > 0 else 0.0,
        "fp32_bytes_per_round": 4 * numel,
        "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "attempts": state["attempt"],
        **totals,
    }
