"""The chunk-loss sweep's 10% point again, over real gRPC through netem packet loss (issue 6 part 1).

N ``dtrain worker`` processes and a ``dtrain rendezvous`` in their own network namespaces; every
link has a 10 ms one-way delay, a 100 Mbit/s cap and either no loss or 10% random loss of the
packets arriving at each site (the ``lossy`` profile); the training mirrors the in-process quick
sweep's (``loss_sweep.py``). TCP retransmits lost packets, so packet loss becomes delay: a
contribution is lost only when it misses the reduce deadline (error feedback then keeps it). The
0% setting runs twice per seed: "0% (repeat)" is the noise floor of every paired difference.

Needs root (netem: network namespaces).
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from experiments.common import RunResult, fmt_pm, md_rows, mean_std, per_round_mean, save_fig, subplots, summarize
from experiments.lab import ROUNDS, SITES, SIZE, H, Point, Spec, decorate, files, loss_columns, ppl_changes, ppl_target
from experiments.loss_sweep import PAPER_PPL_AT_10, TARGET_PPL_AT_10
from experiments.procs import SitesRun, line_record, run_sites, set_link, sites_topology

BASE, REPEAT, TEN = "loss 0%", "loss 0% (repeat)", "loss 10%"
LOSS = "netem.loss_pct"


def settings(repeat: bool) -> list[dict[str, Any]]:
    """0% and 10% packet loss; with ``repeat`` 0% twice (the second: the noise floor of a paired d)."""
    configs = [(BASE, 0.0), (REPEAT, 0.0), (TEN, 10.0)] if repeat else [(BASE, 0.0), (TEN, 10.0)]
    return [{"config": config, LOSS: loss} for config, loss in configs]


MODES: dict[str, dict[str, Any]] = {
    # smoke: 3 rounds, not 2. At 10% loss the first round sets up its TCP connections, and a lost SYN
    # (1 s retransmit) can push both sites past the 1 s reduce deadline: the member then keeps θ_b
    # (owner_lost) while the owner applied its own mean, and it finds the bucket stale next round.
    # With 2 rounds that next round was the last, the owner exited before the repair and the run
    # ended with θ unequal (1 of 9 smoke runs, logs kept with --logs); a third round repairs it.
    "smoke": dict(seeds=[0], grid=settings(False), fixed={SITES: 2, SIZE: "tiny", H: 2, ROUNDS: 3}),
    "quick": dict(seeds=[0, 1, 2], grid=settings(True), fixed={SITES: 4, SIZE: "tiny", H: 10, ROUNDS: 16}),
    "full": dict(seeds=[0, 1, 2, 3, 4], grid=settings(True), fixed={SITES: 4, SIZE: "small", H: 50, ROUNDS: 40}),
}
LINK = dict(delay_ms=10.0, rate_mbit=100.0)  # the ``lossy`` profile's delay and rate
RENDEZVOUS = dict(quorum_timeout_s=5.0, heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0)
RENDEZVOUS |= dict(reduce_timeout_s=1.0, broadcast_timeout_s=2.0)
WORKER = dict(codec="fp32", bucket_bytes=64 * 1024, chunk_bytes=16 * 1024, quorum_wait_s=120, linger_s=2)


def run_one(
    topo,
    m: dict[str, Any],
    config: str,
    loss_pct: float,
    seed: int,
    timeout_s: float,
    *,
    worker: dict[str, Any] | None = None,
    rendezvous: dict[str, Any] | None = None,
) -> RunResult:
    """One run at ``loss_pct``; ``worker`` / ``rendezvous``: options replacing ``WORKER`` /
    ``RENDEZVOUS`` (``convergence_netem`` runs the convergence fault table's setup this way)."""
    worker = WORKER if worker is None else worker
    set_link(topo, loss_pct=loss_pct, **LINK)
    opts = dict(size=m["size"], seed=seed, rounds=m["rounds"], sync_every=m["sync_every"], eval_every=m["rounds"])
    rv = {"min_sites": 2, **(rendezvous or RENDEZVOUS)}
    res = run_sites(topo, m["num_sites"], rv, {**opts, **worker}, timeout_s=timeout_s)
    return _measure(config, seed, m, worker, loss_pct, res)


def _measure(config, seed, m, worker, loss_pct, res: SitesRun) -> RunResult:
    """The run's row (first ``m``: num_sites, size, sync_every, rounds) and every site's rounds from their lines."""
    n, per_site, allr = m["num_sites"], res.per_site, res.lines
    reasons: Counter = Counter()
    for x in allr:
        for why, count in x.get("rejected", {}).items():
            reasons[re.sub(r"\d+", "N", why)] += count  # one entry per kind of reason, not per round and bucket
    # over the lines that have the figure: a resynced line (a site that joined late or was cut, caught up) has none
    mean = lambda k: statistics.fmean([x[k] for x in allr if k in x] or [float("nan")])  # noqa: E731
    row = {
        "experiment": "netem_loss",
        "config": config,
        "seed": seed,
        **m,
        "codec": worker["codec"],
        "loss_pct": loss_pct,
        **LINK,
        **res.facts(),
        "rounds_applied": sum(1 for x in allr if x["status"] == "applied"),
        "resynced": sum(1 for x in allr if x["status"] == "resynced"),
        "bytes_per_round_site": sum(x.get("bytes_sent", 0) for x in allr) / max(1, len(allr)),
        "sync_s": mean("sync_s"),
        "exchange_s": mean("round_s"),
        "stale_buckets": sum(x.get("stale_buckets", 0) for x in allr),
        "repaired_buckets": sum(x.get("repaired_buckets", 0) for x in allr),
        "rejected": sum(sum(x.get("rejected", {}).values()) for x in allr),
        "rejected_reasons": "; ".join(f"{k} x{v}" for k, v in sorted(reasons.items())),
        "reduce_arrived": mean("reduce_arrived_fraction"),
        "broadcast_arrived": mean("broadcast_arrived_fraction"),
        "included": mean("included_fraction"),
        "consistent": len({per_site[i][-1]["checksum"] for i in range(n) if per_site[i]}) == 1,
        "checksum": per_site[0][-1]["checksum"] if per_site[0] else "",  # θ after the last round: equal runs, equal θ
    }
    keys = ("round", "site", "status", "sync_s", "round_s", "reduce_arrived=reduce_arrived_fraction")
    rounds = [line_record("netem_loss", config, seed, x, (*keys, "stale_buckets", "val_loss")) for x in allr]
    return RunResult(row=row, rounds=rounds)


def analyse(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    groups = summarize(rows)
    base = groups.get(BASE, [])
    table = [
        {
            "setting": cfg,
            "runs": len(g),
            **loss_columns(g, base, "0%", final="final val loss (site-0)"),
            "reduce arrived": f"{statistics.fmean(r['reduce_arrived'] for r in g):.3f}",
            "broadcast arrived": f"{statistics.fmean(r['broadcast_arrived'] for r in g):.3f}",
            "stale buckets/round (all sites)": fmt_pm(
                [r["stale_buckets"] / max(1, r["rounds_done"]) for r in g], "{:.2f}"
            ),
            "rejected": sum(r["rejected"] for r in g),
            "exchange s/round": fmt_pm([r["exchange_s"] for r in g], "{:.2f}"),
            "sync s/round": fmt_pm([r["sync_s"] for r in g], "{:.2f}"),
            "MB sent/round/site": f"{statistics.fmean(r['bytes_per_round_site'] for r in g) / 1e6:.3f}",
            "rounds": min(r["rounds_done"] for r in g),
            "θ equal on all sites": "yes" if all(r["consistent"] for r in g) else "NO",
        }
        for cfg, g in groups.items()
    ]
    md = md_rows(table)
    notes = []
    ten = groups.get(TEN, [])
    if ten and base:
        noise = ""
        if REPEAT in groups:
            nm, ns = mean_std(ppl_changes(groups[REPEAT], base))
            noise = f"; the 0% repeat (noise floor) gives {nm * 100:+.2f}% ± {ns * 100:.2f}%"
        notes.append(
            f"- 10% packet loss over gRPC against 0%: {ppl_target(ppl_changes(ten, base), TARGET_PPL_AT_10)} "
            f"(the paper reports <= {PAPER_PPL_AT_10}%){noise}."
        )
        s0 = statistics.fmean(r["exchange_s"] for r in base)
        s10 = statistics.fmean(r["exchange_s"] for r in ten)
        notes.append(
            f"- What the loss costs instead: the exchange takes {s10:.2f} s per round against {s0:.2f} s "
            f"({s10 / s0:.1f}x; TCP retransmissions), and {1 - statistics.fmean(r['reduce_arrived'] for r in ten):.1%} "
            "of the contribution chunks missed the 1 s reduce deadline (kept by error feedback)."
        )
        late = [(r["seed"], int(r.get("resynced") or 0)) for r in ten if int(r.get("resynced") or 0)]
        if late:
            notes.append(
                "- Site rounds resynced at 10% (a site that joined late or was cut caught up from a donor; the "
                f"exchange figures leave those lines out), per seed: {', '.join(f'seed {s}: {n}' for s, n in late)}."
            )
        why: Counter = Counter()
        for item in (x for r in ten for x in str(r.get("rejected_reasons") or "").split("; ") if x):
            reason, _, count = item.rpartition(" x")
            why[reason] += int(count)
        if why:
            notes.append(
                f"- Rejected at 10% over {len(ten)} runs (logged by the owners, never applied; the sender keeps "
                f"them in its residual): {'; '.join(f'{k}: {v}' for k, v in sorted(why.items()))}."
            )
    return md, notes


def plot(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], prefix: Path) -> Path:
    fig, (ax1, ax2) = subplots(1, 2, figsize=(9.0, 3.6))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    for k, cfg in enumerate(configs):
        vals = [r["final_val_loss"] for r in rows if r["config"] == cfg]
        ax1.bar(k, mean_std(vals)[0], yerr=mean_std(vals)[1], capsize=4)
        ax1.plot([k] * len(vals), vals, "k.", ms=4)
        xs, mean, _, _ = per_round_mean(rounds, cfg, "round_s")
        ax2.plot([x + 1 for x in xs], mean, marker="o", ms=3, label=cfg)
    lo, hi = min(r["final_val_loss"] for r in rows), max(r["final_val_loss"] for r in rows)
    ax1.set_ylim(lo - 0.05 - (hi - lo), hi + 0.05 + (hi - lo))
    ax1.set_xticks(range(len(configs)), configs, fontsize=8)
    decorate(ax1, ylabel="final validation loss (site-0)", legend=None)
    decorate(ax2, "round", "exchange s (mean over sites, seeds)")
    fig.suptitle("gRPC through netem: 10 ms, 100 Mbit/s, packet loss", fontsize=10)
    return save_fig(fig, prefix.with_suffix(".png"))


def run_point(point: Point) -> RunResult:
    """One run of the point in a topology of its own (the sites and the rendezvous each a namespace)."""
    f = point.settings
    m = {"num_sites": f[SITES], "size": f[SIZE], "sync_every": f[H], "rounds": f[ROUNDS]}
    with sites_topology(f[SITES], "nloss", "netem_loss") as topo:
        return run_one(topo, m, point.config, f[LOSS], point.seed, 900.0)


def report(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any], prefix: Path) -> str:
    f = m["fixed"]
    png = plot(rows, rounds, prefix)
    return f"""Setup (as root): {f[SITES]} `dtrain worker` processes + one `dtrain rendezvous`, each in its own network namespace,
real gRPC; every link {LINK["delay_ms"]:g} ms one-way, {LINK["rate_mbit"]:g} Mbit/s, and the loss shown
(random, of packets arriving at a site; nftables). Built-in GPT `{f[SIZE]}`, H = {f[H]},
{f[ROUNDS]} rounds, `{WORKER["codec"]}` with error feedback, 64 KiB buckets of 16 KiB chunks, reduce deadline
{RENDEZVOUS["reduce_timeout_s"]:g} s, broadcast deadline {RENDEZVOUS["broadcast_timeout_s"]:g} s (in quick: the
in-process chunk-loss sweep's quick setup). Δ is paired by seed against the 0% run; mean ± std over seeds {m["seeds"]}. "Reduce
arrived": the fraction of contribution chunks an owner had by its deadline. {files(prefix, png)}

{analyse(rows)[0]}"""


SPEC = Spec(
    name="netem_loss",
    title="Packet loss over gRPC through netem",
    modes=MODES,  # jobs 1 (the default): one emulated WAN at a time
    metrics=(("final_val_loss", 0.0, 10.0), ("reduce_arrived", 0.0, 1.0), ("exchange_s", 0.0, 600.0)),
    report=report,
    verdict=lambda rows, rounds, m: analyse(rows)[1],
    execute=run_point,
    paths=(LOSS,),
    netem=True,
)
