"""One rank of a site group, for the site-group tests (run as a module, with the
environment torchrun sets: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

A tiny MLP trained on seeded regression data; the site's global batch of
``GLOBAL_ROWS`` rows per inner step is split evenly over its ranks, so a
2-rank DDP site sees the same global batch as a 1-rank site. Writes
``OUT/<site>-rank<j>.json`` (per-round outcomes and losses) and ``.pt`` (final
flattened model parameters, gathered to full tensors).

Also importable: :func:`make_model` and :func:`batch` serve the in-process
reference run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

GLOBAL_ROWS = 8
IN_FEATURES = 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def batch(site_index: int, step: int, rows: int = GLOBAL_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * site_index + step)
    x = torch.randn(rows, IN_FEATURES, generator=g)
    y = torch.sin(x[:, :1] * 2.0) + 0.5 * x[:, 1:2]
    return x, y


def full_params(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, full (DTensors gathered), flattened and concatenated."""
    out = []
    for p in model.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out.append(t.reshape(-1).float())
    return torch.cat(out)


def _wrap(model: torch.nn.Module, parallel: str) -> torch.nn.Module:
    if parallel == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--site-index", type=int, required=True)
    ap.add_argument("--rendezvous", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--parallel", choices=("ddp", "fsdp", "none"), default="ddp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sync-every", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--bucket-bytes", type=int, default=512)
    ap.add_argument("--num-fragments", type=int, default=1, help="F: fragment rounds over each rank's slice")
    ap.add_argument("--theta-device", choices=("cpu", "model"), default="cpu")
    ap.add_argument("--ckpt-dir", default="", help="save a site-group checkpoint after every round here")
    ap.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --ckpt-dir")
    ap.add_argument("--stop-at-round", type=int, default=-1, help="every rank SIGSTOPs itself before pushing it")
    ap.add_argument("--skip-view-round", type=int, default=-1, help="rank 1 pretends it missed this round's plan")
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"site-{args.site_index}/%(process)d %(name)s: %(message)s")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, num_ranks = dist.get_rank(), dist.get_world_size()

    from dtrain.buckets import BucketConfig
    from dtrain.diloco import DiLoCo, DiLoCoConfig
    from dtrain.rendezvous.grpc import GrpcRendezvousClient
    from dtrain.sim import fast_group_config
    from dtrain.sitegroup import TorchSiteComm
    from dtrain.transports.grpc import GrpcTransport
    from dtrain.transports.grpc_common import GrpcTransportConfig

    model = make_model()
    wrapped = _wrap(model, args.parallel)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    site_id = f"site-{args.site_index}"
    cfg = DiLoCoConfig(
        site_id=site_id,
        sync_every=args.sync_every,
        buckets=BucketConfig(bucket_bytes=args.bucket_bytes, chunk_bytes=min(256, args.bucket_bytes)),
        group=fast_group_config(quorum_wait_s=60.0),
        theta_device=args.theta_device,
        num_fragments=args.num_fragments,
    )
    rdv = GrpcRendezvousClient(args.rendezvous) if rank == 0 else None
    transport = GrpcTransport(GrpcTransportConfig(bind_host="127.0.0.1"))
    d = DiLoCo(
        wrapped, opt, config=cfg, transport=transport, rendezvous=rdv, site_comm=TorchSiteComm(), _defer_join=True
    )
    resumed_from = None
    if args.resume:
        from dtrain.sitegroup.checkpoint import latest_site_checkpoint, load_site_checkpoint

        path = latest_site_checkpoint(args.ckpt_dir)
        assert path is not None, f"no checkpoint in {args.ckpt_dir}"
        assert load_site_checkpoint(path, d, wrapped, opt) == {"step": d.inner_steps}
        resumed_from = d.round
    d.join()
    if args.ckpt_dir:
        from dtrain.sitegroup.checkpoint import save_site_checkpoint

        d.on_round.append(lambda o: save_site_checkpoint(args.ckpt_dir, d, wrapped, opt, extra={"step": d.inner_steps}))
    if args.skip_view_round >= 0 and rank == 1:
        skip = args.skip_view_round
        d.site.view_hook = lambda v: (
            dataclasses.replace(v, kind="wait", plan_round=None, members=()) if v.plan_round == skip else v
        )
    if args.stop_at_round >= 0:
        stop_round = args.stop_at_round
        d.engine.fault_hook = lambda where, r: (
            os.kill(os.getpid(), signal.SIGSTOP) if where == "before_push" and r == stop_round else None
        )
    rounds: list[dict] = []
    d.on_round.append(
        lambda o: rounds.append(
            {
                "round": d.round,
                "status": o.status,
                "fragment": o.fragment,
                "result_fragment": o.result.fragment if o.result is not None else None,
                "num_buckets": len(d.layout),
                "reason": o.reason,
                "slice_checksum": o.slice_checksums[rank],
                "slice_checksums": o.slice_checksums,
                "site_checksum": o.site_checksum,
                "lost_members": o.result.lost_members if o.result is not None else [],
                "lost_notices_used": o.num_lost_notices_used,
                "calls_given_up": o.result.calls_given_up if o.result is not None else 0,
                "means_s": o.result.means_s if o.result is not None else None,
            }
        )
    )
    memory = d.diloco_numel()  # before the first round: no residuals yet
    eval_x, eval_y = batch(99, 0, rows=256)  # held out, the same at every site and rank

    def eval_loss() -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(wrapped(eval_x), eval_y))

    eval_before = eval_loss()
    losses = []
    rows = GLOBAL_ROWS // num_ranks
    for k in range(d.inner_steps, args.steps):  # the data position is the inner step
        x, y = batch(args.site_index, k)
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        loss = torch.nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        site_loss = loss.detach().clone()
        dist.all_reduce(site_loss)
        losses.append(float(site_loss) / num_ranks)
        opt.step()  # hooked: every sync_every steps a round runs on every rank
        opt.zero_grad()
    memory_after = d.diloco_numel()
    eval_after = eval_loss()
    params = full_params(model)
    d.close()
    stem = Path(args.out) / f"{site_id}-rank{rank}"
    torch.save(params, f"{stem}.pt")
    summary = {"rank": rank, "num_ranks": num_ranks, "rounds": rounds, "losses": losses, "resumed_from": resumed_from}
    summary.update(eval_before=eval_before, eval_after=eval_after)
    summary.update(
        memory=memory, memory_after=memory_after, model_numel=sum(p.numel() for p in make_model().parameters())
    )
    Path(f"{stem}.json").write_text(json.dumps(summary))
    dist.destroy_process_group()
    os._exit(0)  # skip gRPC's slow teardown of idle channels


if __name__ == "__main__":
    main()
