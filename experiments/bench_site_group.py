"""CPU cost of one round per parameter for a site group of K ranks (issue 14). Prints figures.

θ on the CPU, one torch thread per rank, in two parts:

1. **Real runs**: 2 sites x K ranks as processes (gloo inside a site, gRPC between sites on
   127.0.0.1, one rendezvous), a ~25M-parameter stack of ``nn.Linear`` layers under DDP (or
   FSDP2 with ``--parallel fsdp``), one inner step per round. Each rank records the process CPU
   seconds (all threads: robust to other load) of each step of every sync: gather, round
   (engine), scatter, allgather, checksum; and its bytes. Rounds after the first are
   summarised (median per rank, then mean over ranks).
2. **Split of one rank's slice** in one process (no network): gather, encode, decode, outer step
   (with θ_b's checksum), checksum alone, scatter, on N/K elements in buckets of 4 MiB.

"ns/param/rank" = one rank's CPU seconds of a round / the model's parameters; the issue's target
is <= 5 (a 1-process site cost 33 in the GPU check of a 101M model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from experiments import bench
from experiments.procs import free_port

REPO = Path(__file__).resolve().parents[1]

STEPS = ("gather", "round", "scatter", "allgather", "checksum")  # DiLoCo.last_cpu_s
RESULT = ("encode_s", "decode_s", "bytes_sent", "bytes_received")  # of the round's RoundResult


def make_model(num_params: int) -> torch.nn.Module:
    """A stack of square Linear layers with ~num_params parameters (width 1024)."""
    width = 1024
    layers = max(1, round(num_params / (width * width + width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from dtrain.codecs import CodecConfig
    from dtrain.diloco import DiLoCo, DiLoCoConfig
    from dtrain.rendezvous.grpc import GrpcRendezvousClient
    from dtrain.rounds import RoundConfig
    from dtrain.sim import fast_group_config
    from dtrain.sitegroup import TorchSiteComm
    from dtrain.transports.grpc import GrpcTransport
    from dtrain.transports.grpc_common import GrpcTransportConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, k = dist.get_rank(), dist.get_world_size()
    model = make_model(args.params)
    if k > 1 and args.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        ddp = fully_shard(model)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model) if k > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rounds = RoundConfig(codec=CodecConfig(name=args.codec))
    group = fast_group_config(quorum_wait_s=120.0, state_pull_timeout_s=120.0)
    cfg = DiLoCoConfig(
        site_id=f"site-{args.site_index}", sync_every=1, rounds=rounds, group=group, hook_optimizer=False
    )
    rdv = GrpcRendezvousClient(args.rendezvous, rpc_timeout_s=30.0) if rank == 0 else None
    transport = GrpcTransport(GrpcTransportConfig(bind_host="127.0.0.1"))
    d = DiLoCo(ddp, opt, config=cfg, transport=transport, rendezvous=rdv, site_comm=TorchSiteComm())
    g = torch.Generator().manual_seed(args.site_index * 100 + rank)
    records = []
    for _ in range(args.rounds):
        ddp(torch.randn(2, 1024, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        t0 = time.process_time()
        out = d.sync()
        total = time.process_time() - t0
        result = {k: getattr(out.result, k, 0) for k in RESULT}  # (no result: 0)
        records.append({"status": out.status, **d.last_cpu_s, "total": total, **result})
    numel = sum(p.numel() for p in model.parameters())
    slice_numel = sum(t.numel() for t in d.state.theta)
    print(json.dumps({"rank": rank, "numel": numel, "slice_numel": slice_numel, "rounds": records}), flush=True)
    d.close()
    dist.destroy_process_group()
    os._exit(0)


def run_sites(num_ranks: int, args: argparse.Namespace) -> list[dict]:
    """Each rank's figures (the last line it prints) of 2 sites x ``num_ranks`` rank processes."""
    from dtrain.rendezvous import RendezvousCore
    from dtrain.rendezvous.grpc import serve_rendezvous
    from dtrain.sim import fast_rendezvous_config

    cfg = fast_rendezvous_config(
        2, heartbeat_interval_s=0.5, heartbeat_timeout_s=60.0, reduce_timeout_s=60.0, broadcast_timeout_s=120.0
    )
    server = serve_rendezvous(RendezvousCore(cfg))
    procs, outs = [], []
    try:
        for site in range(2):
            port = free_port()
            for rank in range(num_ranks):
                env = dict(os.environ, PYTHONPATH=str(REPO), RANK=str(rank), WORLD_SIZE=str(num_ranks))
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
                cmd = [sys.executable, __file__, "--rank-main", "--site-index", str(site)]
                cmd += ["--rendezvous", server.address, "--params", str(args.params), "--rounds", str(args.rounds)]
                cmd += ["--codec", args.codec, "--parallel", args.parallel]
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for p in procs:
            out, err = p.communicate(timeout=900)
            if p.returncode != 0:
                raise RuntimeError(f"a rank failed ({p.returncode}): {err.decode()[-2000:]}")
            outs.append(json.loads(out.decode().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.stop(0)
    return outs


def summarise(runs: list[dict]) -> dict:
    """Median over rounds after the first, per rank; then the mean over every rank."""
    per_rank = []
    for r in runs:
        recs = [x for x in r["rounds"][1:] if x["status"] == "applied"] or r["rounds"][-1:]
        per_rank.append({k: statistics.median(x.get(k, 0.0) for x in recs) for k in (*STEPS, "total", *RESULT)})
    return {
        "numel": runs[0]["numel"],
        "slice_numel": statistics.mean(r["slice_numel"] for r in runs),
        **{k: statistics.mean(p[k] for p in per_rank) for k in per_rank[0]},
    }


def split_one_slice(numel: int, codec_name: str, repeats: int = 3) -> dict:
    """CPU seconds of each step on one rank's slice of ``numel`` elements (no network)."""
    from dtrain.buckets import BucketConfig, BucketLayout, checksum
    from dtrain.codecs import get_codec
    from dtrain.rounds import RoundEngine
    from dtrain.state import GlobalState
    from dtrain.transports.inproc import InprocNetwork, InprocTransport

    local = [torch.randn(numel)]
    layout = BucketLayout([numel], ["param"], BucketConfig())
    state = GlobalState(layout, local)
    engine = RoundEngine("bench", state, InprocTransport(InprocNetwork()))
    codec = get_codec(codec_name)
    out: dict[str, list[float]] = {k: [] for k in ("gather", "encode", "decode", "outer_step", "checksum", "scatter")}

    def timed(key, fn):
        t0 = time.process_time()
        r = fn()
        out[key].append(time.process_time() - t0)
        return r

    for _ in range(repeats):
        local[0].add_(1e-3)
        timed("gather", lambda: engine.add_pseudo_gradient(local))
        payloads = timed("encode", lambda: [codec.encode(r) for r in state.residuals])
        means = timed("decode", lambda: [codec.decode(p, numel=b.numel) for p, b in zip(payloads, layout.buckets)])
        timed("outer_step", lambda: [state.apply_mean(b, m) for b, m in enumerate(means)])
        timed("checksum", lambda: [checksum(t) for t in state.theta])
        timed("scatter", lambda: state.copy_to(local))
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = bench.parser(__doc__, quick="2M parameters, 3 rounds")
    ap.add_argument("--params", type=int, default=25_000_000)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp", help="inside a site when K > 1")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--site-index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rendezvous", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        return rank_main(args)
    if args.quick:
        args.params, args.rounds = 2_000_000, 3
    torch.set_num_threads(1)
    real = {k: summarise(run_sites(k, args)) for k in args.ranks}
    n = real[args.ranks[0]]["numel"]
    print(
        f"## Site group round cost: {n / 1e6:.1f}M parameters, codec {args.codec}, {args.parallel} inside a site, "
        "θ on the CPU, 1 thread/rank\n"
    )
    print("### 2 sites x K ranks (processes; process CPU per rank per round, median of rounds 2..)\n")
    cols = ["K", "ns/param/rank", "total ms", *[f"{s} ms" for s in STEPS], "encode ms (wall)", "decode ms (wall)"]
    cols += ["sent MB/rank", "recv MB/rank"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for k, s in real.items():
        row = [str(k), f"{1e9 * s['total'] / n:.1f}", f"{1e3 * s['total']:.0f}"]
        row += [f"{1e3 * s[x]:.0f}" for x in STEPS] + [f"{1e3 * s['encode_s']:.0f}", f"{1e3 * s['decode_s']:.0f}"]
        row += [f"{s['bytes_sent'] / 1e6:.2f}", f"{s['bytes_received'] / 1e6:.2f}"]
        print("| " + " | ".join(row) + " |")
    print("\n### Split of one rank's slice (one process, no network; ns per model parameter)\n")
    print("| K | slice elems | gather | encode | decode | outer step (+checksum) | checksum | scatter | sum |")
    print("|---|---|---|---|---|---|---|---|---|")
    split = {}
    for k in args.ranks:
        sp = split[k] = split_one_slice(-(-n // k), args.codec)
        cells = [f"{1e9 * sp[x] / n:.2f}" for x in ("gather", "encode", "decode", "outer_step", "checksum", "scatter")]
        total = sp["gather"] + sp["encode"] + sp["decode"] + sp["outer_step"] + sp["scatter"]
        print(f"| {k} | {-(-n // k)} | " + " | ".join(cells) + f" | {1e9 * total / n:.2f} |")
    bench.write(args, "bench_site_group", {"real": real, "split": split, "params": n})


if __name__ == "__main__":
    main()
