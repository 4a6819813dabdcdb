"""One-step-delayed rounds (F = 1, τ = H) against blocking rounds: outer-momentum sweep (issue 15).

In the one-step-delayed mode (DiLoCoX, arXiv 2506.21263; ``DiLoCoConfig`` F = 1,
``overlap_steps`` = H) round r's averaged pseudo-gradient is applied one round late, so
the outer optimizer steps with a Δ that is one round stale. DiLoCo's outer Nesterov
momentum 0.9 (arXiv 2311.08105) amplifies that staleness: through netem the mode ended
31 % above blocking rounds. This script measures, in-process (``dtrain.sim``: N sites,
real rounds over the in-process transport), the final loss of the delayed mode for a
sweep of outer momenta against blocking rounds at DiLoCo's 0.9, with paired seeds (the
same initial model and data per seed in every configuration), and picks the momentum
that ``OuterConfig.delayed_momentum`` / :func:`dtrain.state.delayed_outer_optimizer`
default to.

Task: a 16-32-1 tanh MLP regressing ``tanh(x @ w)`` (fresh Gaussian x per step and site,
AdamW lr 3e-3 inside), loss = MSE on 2048 held-out points of θ after the last round.

Usage::

    .venv/bin/python experiments/delayed_momentum.py --quick   # 4 sites, 3 seeds (~2 min on 2 cores)
    .venv/bin/python experiments/delayed_momentum.py --smoke --out /tmp/x --results none
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dtrain.buckets import BucketConfig  # noqa: E402
from dtrain.sim import ClusterConfig, InprocCluster, Site, fast_diloco_config  # noqa: E402
from experiments.common import (  # noqa: E402
    RunResult,
    base_parser,
    fmt_pm,
    md_table,
    mode_settings,
    out_prefix,
    publish,
    run_or_load,
)

MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(num_sites=2, sync_every=4, rounds=4, seeds=[0], momenta=[0.0, 0.9], lrs=[0.7]),
    "quick": dict(
        num_sites=4, sync_every=8, rounds=30, seeds=[0, 1, 2], momenta=[0.0, 0.3, 0.5, 0.7, 0.9], lrs=[0.7, 1.0, 1.4]
    ),
    "full": dict(
        num_sites=4,
        sync_every=8,
        rounds=60,
        seeds=[0, 1, 2, 3, 4],
        momenta=[0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9],
        lrs=[0.5, 0.7, 1.0, 1.4],
    ),
}
OUTER_LR = 0.7  # DiLoCo's outer learning rate (Nesterov SGD)


def final_loss(
    m: dict[str, Any], *, delayed: bool, momentum: float, lr: float, seed: int, update: str = "stale"
) -> float:
    """θ's held-out loss after ``rounds`` x H inner steps (blocking or one-step-delayed rounds)."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(5 + seed))
    h = m["sync_every"]
    cfg = ClusterConfig(
        num_sites=m["num_sites"],
        diloco=fast_diloco_config(
            sync_every=h,
            buckets=BucketConfig(bucket_bytes=256, chunk_bytes=256),
            overlap_steps=h if delayed else 0,
            delayed_update=update,
        ),
        seed=seed,
    )
    cluster = InprocCluster(
        lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)),
        lambda mod: torch.optim.AdamW(mod.parameters(), lr=3e-3),
        cfg,
        outer_optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum, nesterov=momentum > 0),
    )
    gens = [torch.Generator().manual_seed(100 * seed + i) for i in range(m["num_sites"])]

    def step(site: Site, k: int) -> None:
        x = torch.randn(32, 16, generator=gens[site.index])
        loss = ((site.model(x) - torch.tanh(x @ w_true)) ** 2).mean()
        loss.backward()
        site.optimizer.step()
        site.optimizer.zero_grad()

    with cluster:
        cluster.run_steps(step, m["rounds"] * h, timeout_s=600)
        for s in cluster.sites:
            s.diloco.close()
        model = cluster.sites[0].model
        cluster.sites[0].state.copy_to([p.data for p in model.parameters()])
        x = torch.randn(2048, 16, generator=torch.Generator().manual_seed(99))
        with torch.no_grad():
            return float(((model(x) - torch.tanh(x @ w_true)) ** 2).mean())


def configs(m: dict[str, Any]) -> list[tuple[str, bool, float, float, str]]:
    """(label, delayed, outer momentum, outer lr, delayed_update): blocking at DiLoCo's (0.9, 0.7),
    the delayed mode over the sweep, with the stale and the eager merge."""
    out = [("blocking", False, 0.9, OUTER_LR, "stale")]
    for upd in ("stale", "eager"):
        out += [(f"delayed {upd} m={mo:g} lr={lr:g}", True, mo, lr, upd) for lr in m["lrs"] for mo in m["momenta"]]
    return out


def analyse(rows: list[dict[str, Any]]) -> tuple[str, list[str], tuple[float, float, float, str]]:
    base = {r["seed"]: r["final_loss"] for r in rows if r["config"] == "blocking"}
    table, best = [], (float("inf"), 0.9, OUTER_LR, "stale")
    for label in dict.fromkeys(r["config"] for r in rows):
        g = [r for r in rows if r["config"] == label]
        ratios = [r["final_loss"] / base[r["seed"]] - 1 for r in g]  # paired by seed
        mean = statistics.fmean(ratios)
        if g[0]["delayed"] and mean < best[0]:
            best = (mean, g[0]["outer_momentum"], g[0]["outer_lr"], g[0]["delayed_update"])
        table.append(
            [
                label,
                g[0]["outer_momentum"],
                g[0]["outer_lr"],
                fmt_pm([r["final_loss"] for r in g], "{:.4f}"),
                fmt_pm([100 * x for x in ratios], "{:+.1f}") + " %",
            ]
        )
    md = md_table(["config", "outer momentum", "outer lr", "final loss", "vs blocking (paired by seed)"], table)
    notes = [
        f"- Lowest delayed-mode loss: {best[3]} merge, outer momentum {best[1]:g}, lr {best[2]:g}: "
        f"{100 * best[0]:+.1f} % of "
        "blocking rounds at DiLoCo's momentum 0.9, lr 0.7 "
        f"({'within' if best[0] <= 0.01 else '**not** within'} 1 %)."
    ]
    return md, notes, best


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = base_parser(__doc__).parse_args(argv)
    mode, m = mode_settings(args, MODES, overrides=())
    prefix = out_prefix(args, "delayed_momentum")

    def runner() -> list[RunResult]:
        out = []
        for seed in m["seeds"]:
            for label, delayed, mo, lr, upd in configs(m):
                loss = final_loss(m, delayed=delayed, momentum=mo, lr=lr, seed=seed, update=upd)
                print(f"seed {seed} {label}: {loss:.4f}", flush=True)
                row = dict(
                    experiment="delayed_momentum",
                    config=label,
                    delayed=delayed,
                    delayed_update=upd,
                    outer_momentum=mo,
                    outer_lr=lr,
                )
                out.append(RunResult(row={**row, "seed": seed, "final_loss": loss, **m}))
        return out

    rows, _, meta = run_or_load(args, argv, "delayed_momentum.py", prefix, runner)
    for r in rows:  # CSV round trip: text back to values
        r["delayed"] = r["delayed"] in (True, "True", "true", "1")
        for k in ("outer_momentum", "outer_lr", "final_loss"):
            r[k] = float(r[k])
    md, notes, _ = analyse(rows)
    body = f"""Command: `{meta["command"]}` ({meta["minutes"]:.1f} min; {meta["provenance"]}).

Setup: in-process (`dtrain.sim`), {m["num_sites"]} sites, H = {m["sync_every"]}, {m["rounds"]} rounds,
outer Nesterov SGD (blocking: DiLoCo's lr {OUTER_LR}, momentum 0.9); one-step-delayed = F = 1, τ = H; seeds {m["seeds"]} (paired).
CSV: `{prefix.with_suffix(".csv").name}`.

{md}

{chr(10).join(notes)}
"""
    publish(args, f"delayed_momentum-{mode}", f"One-step-delayed rounds: outer momentum ({mode})", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
