#!/usr/bin/env python3
"""Optional GPU check: ``dtrain.DiLoCo`` around models that live on a CUDA device.

dtrain keeps θ, the outer-optimizer state and the residuals per bucket, as fp32 tensors on
the CPU (``--diloco.theta-device cpu``, the default) or on the model's device
(``model``), and copies between them and the model's parameters (``BucketLayout.gather`` /
``scatter``), so a model on any device should work unchanged. This script checks that on a
GPU, over the in-process transport (no network), for each θ placement, and prints figures:

1. 3 sites train the built-in GPT ``small`` (fp32, then bf16 parameters) on the device
   with AdamW, H = 20, 5 rounds: validation loss must fall, every site's θ checksum must
   agree, and every site's device parameters must equal θ (cast to the model dtype).
2. One site, a ~100 M-parameter MLP on the device: seconds per round and ns per parameter
   (gather, Δ and encode, outer Nesterov step, scatter, checksums), median of 3 rounds, with
   the engine's encode and decode times, to show what the outer step costs next to GPU inner
   steps and what keeping θ on the device saves (issue 36).

Exit code 0 when every check holds, 1 otherwise. Runs on CPU too (``--device cpu``)
with the same checks, which is how it is tested before using a GPU.

    python scripts/gpu_check.py --device cuda
    python scripts/gpu_check.py --device cpu --big-width 512 --theta-devices model   # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dtrain.buckets import BucketConfig  # noqa: E402
from dtrain.codecs import CodecConfig  # noqa: E402
from dtrain.rounds import RoundConfig  # noqa: E402
from dtrain.sim import ClusterConfig, InprocCluster, fast_diloco_config  # noqa: E402
from dtrain.tasks import TaskSpec, build_task  # noqa: E402
from dtrain.tasks.builtin import make_optimizer  # noqa: E402


def check_training(device: str, dtype: torch.dtype, theta_device: str, rounds: int = 5, h: int = 20) -> bool:
    tasks = [build_task(TaskSpec(size="small", seed=0, site_index=i, num_sites=3)) for i in range(3)]
    lr = TaskSpec(size="small", site_index=0, num_sites=3).resolved_lr

    def model_factory():
        return tasks[0].model.to(device=device, dtype=dtype)

    cfg = ClusterConfig(
        num_sites=3,
        diloco=fast_diloco_config(
            sync_every=h,
            buckets=BucketConfig(bucket_bytes=256 << 10, chunk_bytes=64 << 10),
            rounds=RoundConfig(codec=CodecConfig(name="int8")),
            theta_device=theta_device,
        ),
    )
    ok = True
    with InprocCluster(model_factory, lambda m: make_optimizer(m, lr), cfg) as c:
        first = tasks[0].evaluate(c.sites[0].model)

        def step(site, k: int) -> None:
            task = tasks[site.index]
            loss = task.loss(site.model, next(task.batches))
            loss.backward()
            site.optimizer.step()  # every H-th step runs a round
            site.optimizer.zero_grad(set_to_none=True)

        t = time.perf_counter()
        c.run_steps(step, h * rounds, timeout_s=600)
        wall = time.perf_counter() - t
        finals = [tasks[s.index].evaluate(s.model) for s in c.sites]
        sums = c.checksums()
        same = True
        for s in c.sites:
            tensors = s.diloco.local_tensors()  # the model's parameters and buffers, on the device
            for b in range(len(s.state)):
                on_device = s.state.layout.gather(b, tensors).cpu()  # copied to fp32
                same &= bool(torch.equal(on_device, s.state.theta[b].detach().to(dtype).float().cpu()))
        rounds_done = [s.diloco.round for s in c.sites]
        dev = str(next(c.sites[0].model.parameters()).device)
        theta_on = str(c.sites[0].state.theta[0].device)
    print(
        f"[{dtype}] params on {dev}, θ on {theta_on} (theta_device={theta_device}): val loss {first:.4f} -> {statistics.fmean(finals):.4f} (sites "
        f"{', '.join(f'{v:.4f}' for v in finals)}), rounds {rounds_done}, {wall:.1f} s, "
        f"θ checksums agree: {len(set(sums)) == 1}, device params == θ: {same}"
    )
    if not (statistics.fmean(finals) < first - 1.0):
        print(f"FAIL [{dtype}, theta_device={theta_device}]: validation loss did not fall by 1 nat")
        ok = False
    if len(set(sums)) != 1:
        print(f"FAIL [{dtype}, theta_device={theta_device}]: θ checksums differ: {sums}")
        ok = False
    if not same:
        print(f"FAIL [{dtype}, theta_device={theta_device}]: a site's device parameters differ from θ")
        ok = False
    if rounds_done != [rounds] * 3:
        print(f"FAIL [{dtype}, theta_device={theta_device}]: rounds {rounds_done}, expected {rounds}")
        ok = False
    return ok


def time_big_round(device: str, width: int, depth: int, theta_device: str) -> None:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]

    def factory():
        return torch.nn.Sequential(*layers).to(device)

    cfg = ClusterConfig(
        num_sites=1,
        diloco=fast_diloco_config(
            sync_every=1, rounds=RoundConfig(codec=CodecConfig(name="int8")), theta_device=theta_device
        ),
    )
    with InprocCluster(factory, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), cfg) as c:
        site = c.sites[0]
        n = sum(p.numel() for p in site.model.parameters())
        x = torch.randn(64, width, device=device)
        times = []

        def step(s, k: int) -> None:
            loss = s.model(x).pow(2).mean()
            loss.backward()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            s.optimizer.step()  # H = 1: AdamW step + a round
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            s.optimizer.zero_grad(set_to_none=True)

        c.run_steps(step, 4, timeout_s=900)
        res = site.results
        theta_on = str(site.state.theta[0].device)
    med = statistics.median(times[1:])
    print(
        f"[{n / 1e6:.0f} M params on {device}, θ on {theta_on} (theta_device={theta_device})] optimizer.step() incl. one round, median of 3: "
        f"{med:.2f} s ({med / n * 1e9:.1f} ns/param); engine {statistics.median(r.total_s for r in res[1:]):.2f} s, "
        f"encode {statistics.median(r.encode_s for r in res[1:]):.2f} s, "
        f"decode and step {statistics.median(r.decode_s for r in res[1:]):.2f} s"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--big-width", type=int, default=4096, help="width of the timing MLP (depth 6: ~100 M params)")
    ap.add_argument("--big-depth", type=int, default=6)
    ap.add_argument(
        "--theta-devices",
        nargs="+",
        default=["cpu", "model"],
        choices=["cpu", "model"],
        help="DiLoCoConfig.theta_device values to check and time, in turn",
    )
    a = ap.parse_args()
    torch.set_num_threads(min(8, torch.get_num_threads()))
    print(
        f"torch {torch.__version__}, device {a.device}"
        + (f" ({torch.cuda.get_device_name(0)})" if a.device.startswith("cuda") else "")
    )
    ok = True
    for theta_device in a.theta_devices:
        ok &= check_training(a.device, torch.float32, theta_device)
        ok &= check_training(a.device, torch.bfloat16, theta_device)
    for theta_device in a.theta_devices:
        time_big_round(a.device, a.big_width, a.big_depth, theta_device)
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
