"""One-step-delayed rounds (F = 1, τ = H) against blocking rounds: outer-momentum sweep (issue 15).

In the one-step-delayed mode (DiLoCoX, arXiv 2506.21263; F = 1, ``overlap_steps`` = H) round r's
averaged pseudo-gradient is applied one round late, and DiLoCo's outer Nesterov momentum 0.9
(arXiv 2311.08105) amplifies that staleness (through netem the mode ended 31 % above blocking
rounds). In process (``dtrain.sim``: N sites, real rounds), the final loss of the delayed mode
over a sweep of outer momenta and learning rates against blocking rounds at 0.9, paired by seed:
it picks the default of ``OuterConfig.delayed_momentum``. Task: a 16-32-1 tanh MLP regressing
``tanh(x @ w)`` (fresh Gaussian x per step and site, AdamW lr 3e-3), loss = MSE on 2048 held-out
points of θ after the last round.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from dtrain.buckets import BucketConfig
from dtrain.sim import ClusterConfig, InprocCluster, Site, fast_diloco_config
from experiments.common import RunResult, fmt_pm, md_table, summarize
from experiments.lab import ROUNDS, SITES, H, Point, Spec, files

OUTER_LR = 0.7  # DiLoCo's outer learning rate (Nesterov SGD)
MOMENTUM, LR, OVERLAP, UPDATE = "outer.momentum", "outer.lr", "diloco.overlap_steps", "diloco.delayed_update"
DELAYED = "delayed"  # the sweep's switch: τ = H (one-step-delayed) or 0 (blocking)


def sweep(momenta: list[float], lrs: list[float]) -> list[dict[str, Any]]:
    """Blocking rounds at DiLoCo's (momentum 0.9, lr 0.7), then the one-step-delayed mode (τ = H,
    ``diloco.overlap_steps`` set from H by the spec) over the sweep, with the stale and the eager merge."""
    blocking = {"config": "blocking", MOMENTUM: 0.9, LR: OUTER_LR, UPDATE: "stale", DELAYED: False}
    return [blocking] + [
        {"config": f"delayed {upd} m={mo:g} lr={lr:g}", MOMENTUM: mo, LR: lr, UPDATE: upd, DELAYED: True}
        for upd in ("stale", "eager")
        for lr in lrs
        for mo in momenta
    ]


MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(seeds=[0], fixed={SITES: 2, H: 4, ROUNDS: 4}, grid=sweep([0.0, 0.9], [0.7])),
    "quick": dict(seeds=[0, 1, 2], fixed={SITES: 4, H: 8, ROUNDS: 30})
    | {"grid": sweep([0.0, 0.3, 0.5, 0.7, 0.9], [0.7, 1.0, 1.4])},
    "full": dict(seeds=[0, 1, 2, 3, 4], fixed={SITES: 4, H: 8, ROUNDS: 60})
    | {"grid": sweep([0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9], [0.5, 0.7, 1.0, 1.4])},
}


def final_loss(point: Point) -> RunResult:
    """θ's held-out loss after ``rounds`` x H inner steps (blocking or one-step-delayed rounds)."""
    f, seed = point.settings, point.seed
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(5 + seed))
    h, n, momentum = f[H], f[SITES], f[MOMENTUM]
    cfg = ClusterConfig(
        num_sites=n,
        diloco=fast_diloco_config(
            sync_every=h,
            buckets=BucketConfig(bucket_bytes=256, chunk_bytes=256),
            overlap_steps=f[OVERLAP],
            delayed_update=f[UPDATE],
        ),
        seed=seed,
    )
    cluster = InprocCluster(
        lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)),
        lambda mod: torch.optim.AdamW(mod.parameters(), lr=3e-3),
        cfg,
        outer_optimizer=lambda p: torch.optim.SGD(p, lr=f[LR], momentum=momentum, nesterov=momentum > 0),
    )
    gens = [torch.Generator().manual_seed(100 * seed + i) for i in range(n)]

    def step(site: Site, k: int) -> None:
        x = torch.randn(32, 16, generator=gens[site.index])
        ((site.model(x) - torch.tanh(x @ w_true)) ** 2).mean().backward()
        site.optimizer.step()
        site.optimizer.zero_grad()

    with cluster:
        cluster.run_steps(step, f[ROUNDS] * h, timeout_s=600)
        for s in cluster.sites:
            s.diloco.close()
        model = cluster.sites[0].model
        cluster.sites[0].state.copy_to([p.data for p in model.parameters()])
        x = torch.randn(2048, 16, generator=torch.Generator().manual_seed(99))
        with torch.no_grad():
            loss = float(((model(x) - torch.tanh(x @ w_true)) ** 2).mean())
    return RunResult(row=point.row(final_loss=loss))


def analyse(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    base = {r["seed"]: r["final_loss"] for r in rows if r["config"] == "blocking"}
    table, best = [], (float("inf"), 0.9, OUTER_LR, "stale")
    for label, g in summarize(rows).items():
        ratios = [r["final_loss"] / base[r["seed"]] - 1 for r in g]  # paired by seed
        mean = statistics.fmean(ratios)
        if g[0][DELAYED] and mean < best[0]:
            best = (mean, g[0][MOMENTUM], g[0][LR], g[0][UPDATE])
        loss = fmt_pm([r["final_loss"] for r in g], "{:.4f}")
        table.append([label, g[0][MOMENTUM], g[0][LR], loss, fmt_pm([100 * x for x in ratios], "{:+.1f}") + " %"])
    md = md_table(["config", "outer momentum", "outer lr", "final loss", "vs blocking (paired by seed)"], table)
    return md, [
        f"- Lowest delayed-mode loss: {best[3]} merge, outer momentum {best[1]:g}, lr {best[2]:g}: "
        f"{100 * best[0]:+.1f} % of blocking rounds at DiLoCo's momentum 0.9, lr 0.7 "
        f"({'within' if best[0] <= 0.01 else '**not** within'} 1 %)."
    ]


def report(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any], prefix: Path) -> str:
    f = m["fixed"]
    return f"""Setup: in-process (`dtrain.sim`), {f[SITES]} sites, H = {f[H]}, {f[ROUNDS]} rounds,
outer Nesterov SGD (blocking: DiLoCo's lr {OUTER_LR}, momentum 0.9); one-step-delayed = F = 1, τ = H; seeds {m["seeds"]} (paired).
{files(prefix)}

{analyse(rows)[0]}"""


SPEC = Spec(
    name="delayed_momentum",
    title="One-step-delayed rounds: outer momentum",
    modes=MODES,
    # F = 1, τ = H: the one-step-delayed mode; blocking rounds overlap nothing
    derive=lambda s: {OVERLAP: s[H] if s[DELAYED] else 0},
    metrics=(("final_loss", 0.0, 10.0),),
    report=report,
    verdict=lambda rows, rounds, m: analyse(rows)[1],
    execute=final_loss,
    paths=(MOMENTUM, LR, OVERLAP, UPDATE, DELAYED),
)
