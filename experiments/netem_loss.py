"""The chunk-loss sweep's 10% point again, over real gRPC through netem packet loss.

Issue 6 part 1 asks for one point of the in-process chunk-loss sweep (``loss_sweep.py``)
to be repeated over the gRPC transport with real packet loss. Here 4 ``dtrain worker``
processes and one ``dtrain rendezvous`` run in their own network namespaces
(``netem.Topology``, as ``dtrain launch --netem``); every link has a 10 ms one-way
delay, a 100 Mbit/s cap and either no loss or 10% random loss of the packets arriving
at each site (the ``lossy`` profile). The training setup mirrors the in-process quick
sweep: built-in GPT ``tiny``, H = 10, 16 rounds, ``fp32`` with error feedback, 64 KiB
buckets of 16 KiB chunks, reduce deadline 1 s, broadcast deadline 2 s.

What differs from the in-process sweep: TCP retransmits lost packets, so packet loss
becomes delay; a contribution is lost only when it misses the reduce deadline (then
error feedback keeps it for the next round, as with seeded chunk loss). The 0% setting
runs twice per seed: the "0% (repeat)" row is the noise floor of every paired difference
(the owners sum in sender-id order, so with every chunk in, a rerun's means are
bit-identical; what is left is the timing of which chunks miss a deadline).

Usage (from the repository root, as root)::

    .venv/bin/python -m experiments.netem_loss --quick   # 4 sites, tiny, 3 seeds
    .venv/bin/python -m experiments.netem_loss           # full: small, H = 50, 40 rounds, 5 seeds
    .venv/bin/python -m experiments.netem_loss --smoke --out /tmp/x --results none   # CI: 2 sites, 3 rounds

Writes ``OUT/netem_loss[_MODE].csv`` (one row per run), ``..._rounds.csv``, ``....png``
and puts its table into ``experiments/RESULTS.md``.
"""

from __future__ import annotations

import math
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from dtrain.app.procs import Cluster
from experiments.common import (
    RunResult,
    base_parser,
    fmt_pm,
    md_table,
    mean_std,
    mode_settings,
    out_prefix,
    paired_deltas,
    publish,
    run_or_load,
    save_fig,
    subplots,
)
from experiments.procs import netem_topology

PAPER_PPL_AT_10 = 0.8  # % perplexity change at 10% packet loss, arXiv 2507.07114
TARGET_PPL_AT_10 = 0.5  # % (issue 6)
KiB = 1024
BASE, REPEAT = "loss 0%", "loss 0% (repeat)"
MODES: dict[str, dict[str, Any]] = {
    # smoke: 3 rounds, not 2. At 10% loss the first round sets up its TCP connections, and a lost SYN
    # (1 s retransmit) can push both sites past the 1 s reduce deadline: the member then keeps θ_b
    # (owner_lost) while the owner applied its own mean, and it finds the bucket stale next round.
    # With 2 rounds that next round was the last, the owner exited before the repair and the run
    # ended with θ unequal (1 of 9 smoke runs, logs kept with --logs); a third round repairs it.
    "smoke": dict(num_sites=2, size="tiny", sync_every=2, rounds=3, seeds=[0], losses=[0.0, 10.0], repeat=False),
    "quick": dict(num_sites=4, size="tiny", sync_every=10, rounds=16, seeds=[0, 1, 2], losses=[0.0, 10.0], repeat=True),
    "full": dict(
        num_sites=4, size="small", sync_every=50, rounds=40, seeds=[0, 1, 2, 3, 4], losses=[0.0, 10.0], repeat=True
    ),
}
LINK = dict(delay_ms=10.0, rate_mbit=100.0)  # the ``lossy`` profile's delay and rate
RENDEZVOUS = {
    "quorum_timeout_s": 5.0,
    "heartbeat_interval_s": 0.5,
    "heartbeat_timeout_s": 5.0,
    "reduce_timeout_s": 1.0,
    "broadcast_timeout_s": 2.0,
}
WORKER = dict(codec="fp32", bucket_bytes=64 * KiB, chunk_bytes=16 * KiB, quorum_wait_s=120, linger_s=2)


def label(loss_pct: float) -> str:
    return f"loss {loss_pct:g}%"


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
    from netem.profiles import LinkParams  # noqa: PLC0415

    n = m["num_sites"]
    worker = WORKER if worker is None else worker
    topo.set_link(None, LinkParams(loss_pct=loss_pct, **LINK))
    with tempfile.TemporaryDirectory(prefix="dtrain-netemloss-") as d:
        root = (
            Path(m["logs"]) / f"{config.replace(' ', '_').replace('%', 'pct')}-seed{seed}" if m.get("logs") else Path(d)
        )
        root.mkdir(parents=True, exist_ok=True)
        run = Cluster(root, num_sites=n, timeout_s=timeout_s, topo=topo)
        t0 = time.monotonic()
        names = [f"site-{i}" for i in range(n)]
        try:
            run.start_rendezvous(**{"initial_sites": n, "min_sites": 2, **(rendezvous or RENDEZVOUS)})
            opts = dict(
                size=m["size"],
                seed=seed,
                rounds=m["rounds"],
                sync_every=m["sync_every"],
                eval_every=m["rounds"],
                **worker,
            )
            for i in range(n):
                run.start_site(i, **opts)

            def done() -> bool:
                run.check_alive(names)
                return run.exited(names)

            run.wait(done, "the sites to finish")
        finally:
            run.close()
        wall = time.monotonic() - t0
        per_site = {i: run.rounds(i) for i in range(n)}
        start = [x for x in run.lines(0) if x.get("event") == "start"]
    allr = [x for i in range(n) for x in per_site[i]]
    site0 = per_site[0]
    reasons: dict[str, int] = {}
    for x in allr:
        for why, count in x.get("rejected", {}).items():
            key = re.sub(r"\d+", "N", why)  # one entry per kind of reason, not per round and bucket
            reasons[key] = reasons.get(key, 0) + count
    mean = lambda k: statistics.fmean(x.get(k, float("nan")) for x in allr) if allr else float("nan")  # noqa: E731
    row = {
        "experiment": "netem_loss",
        "config": config,
        "seed": seed,
        "num_sites": n,
        "size": m["size"],
        "sync_every": m["sync_every"],
        "rounds": m["rounds"],
        "codec": worker["codec"],
        "loss_pct": loss_pct,
        "delay_ms": LINK["delay_ms"],
        "rate_mbit": LINK["rate_mbit"],
        "first_val_loss": start[0]["val_loss"] if start else float("nan"),
        "final_val_loss": site0[-1]["val_loss"] if site0 else float("nan"),
        "rounds_done": len(site0),
        "rounds_applied": sum(1 for x in allr if x["status"] == "applied"),
        "wall_s": wall,
        "bytes_total": sum(x.get("bytes_sent", 0) for x in allr),
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
        "checksum": site0[-1]["checksum"] if site0 else "",  # θ after the last round: equal runs, equal θ
    }
    rounds = [
        {
            "experiment": "netem_loss",
            "config": config,
            "seed": seed,
            "round": x["round"],
            "site": x["site"],
            "status": x["status"],
            "sync_s": x["sync_s"],
            "round_s": x.get("round_s", float("nan")),
            "reduce_arrived": x.get("reduce_arrived_fraction", float("nan")),
            "stale_buckets": x.get("stale_buckets", 0),
            "val_loss": x["val_loss"],
        }
        for x in allr
    ]
    return RunResult(row=row, rounds=rounds)


def analyse(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["config"], []).append(r)
    base = groups.get(BASE, [])
    table = []
    for cfg, g in groups.items():
        d = paired_deltas(g, base)
        table.append(
            [
                cfg,
                len(g),
                fmt_pm([r["final_val_loss"] for r in g]),
                fmt_pm(d, "{:+.4f}"),
                fmt_pm([math.exp(x) - 1 for x in d], "{:+.2f}", 100),
                f"{statistics.fmean(r['reduce_arrived'] for r in g):.3f}",
                f"{statistics.fmean(r['broadcast_arrived'] for r in g):.3f}",
                fmt_pm([r["stale_buckets"] / max(1, r["rounds_done"]) for r in g], "{:.2f}"),
                sum(r["rejected"] for r in g),
                fmt_pm([r["exchange_s"] for r in g], "{:.2f}"),
                fmt_pm([r["sync_s"] for r in g], "{:.2f}"),
                f"{statistics.fmean(r['bytes_per_round_site'] for r in g) / 1e6:.3f}",
                min(r["rounds_done"] for r in g),
                "yes" if all(r["consistent"] for r in g) else "NO",
            ]
        )
    md = md_table(
        [
            "setting",
            "runs",
            "final val loss (site-0)",
            "Δ loss vs 0% (paired)",
            "Δ perplexity %",
            "reduce arrived",
            "broadcast arrived",
            "stale buckets/round (all sites)",
            "rejected",
            "exchange s/round",
            "sync s/round",
            "MB sent/round/site",
            "rounds",
            "θ equal on all sites",
        ],
        table,
    )
    notes = []
    ten = groups.get(label(10.0), [])
    if ten and base:
        ppl, sd = mean_std([math.exp(x) - 1 for x in paired_deltas(ten, base)])
        noise = ""
        if REPEAT in groups:
            nm, ns = mean_std([math.exp(x) - 1 for x in paired_deltas(groups[REPEAT], base)])
            noise = f"; the 0% repeat (noise floor) gives {nm * 100:+.2f}% ± {ns * 100:.2f}%"
        se = sd / math.sqrt(len(ten))
        verdict = "met" if ppl * 100 <= TARGET_PPL_AT_10 else "NOT met"
        sure = (
            "also within it"
            if (ppl + se) * 100 <= TARGET_PPL_AT_10
            else f"not within it: {len(ten)} seeds cannot resolve a 0.5% difference here"
        )
        notes.append(
            f"- 10% packet loss over gRPC: perplexity change {ppl * 100:+.2f}% ± {sd * 100:.2f}% (std; standard "
            f"error {se * 100:.2f}%) against 0% (target <= {TARGET_PPL_AT_10}%: **{verdict}** by the mean; "
            f"mean + 1 SE = {(ppl + se) * 100:+.2f}%, {sure}; the paper reports <= {PAPER_PPL_AT_10}%){noise}."
        )
        s0 = statistics.fmean(r["exchange_s"] for r in base)
        s10 = statistics.fmean(r["exchange_s"] for r in ten)
        notes.append(
            f"- What the loss costs instead: the exchange takes {s10:.2f} s per round against {s0:.2f} s "
            f"({s10 / s0:.1f}x; TCP retransmissions), and {1 - statistics.fmean(r['reduce_arrived'] for r in ten):.1%} "
            "of the contribution chunks missed the 1 s reduce deadline (kept by error feedback)."
        )
        why: dict[str, int] = {}
        for r in ten:
            for item in str(r.get("rejected_reasons") or "").split("; "):
                if item:
                    reason, _, count = item.rpartition(" x")
                    why[reason] = why.get(reason, 0) + int(count)
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
        by: dict[int, list[float]] = {}
        for x in rounds:
            if x["config"] == cfg:
                by.setdefault(x["round"], []).append(
                    x["round_s"] if "round_s" in x else x["total_s"]
                )  # older CSVs: total_s
        xs = sorted(by)
        ax2.plot([x + 1 for x in xs], [statistics.fmean(by[x]) for x in xs], marker="o", ms=3, label=cfg)
    lo = min(r["final_val_loss"] for r in rows)
    hi = max(r["final_val_loss"] for r in rows)
    ax1.set_ylim(lo - 0.05 - (hi - lo), hi + 0.05 + (hi - lo))
    ax1.set_xticks(range(len(configs)), configs, fontsize=8)
    ax1.set_ylabel("final validation loss (site-0)")
    ax2.set_xlabel("round")
    ax2.set_ylabel("exchange s (mean over sites, seeds)")
    ax2.legend(fontsize=8)
    fig.suptitle("gRPC through netem: 10 ms, 100 Mbit/s, packet loss", fontsize=10)
    return save_fig(fig, prefix.with_suffix(".png"))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = base_parser(__doc__)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="bound on one run, seconds")
    ap.add_argument("--logs", type=Path, help="keep each run's logs and metrics under this directory")
    args = ap.parse_args(argv)
    mode, m = mode_settings(args, MODES)
    m["logs"] = args.logs
    if m["num_sites"] < 2:
        raise SystemExit(f"--sites must be >= 2, got {m['num_sites']}")
    if args.timeout_s <= 0:
        raise SystemExit(f"--timeout-s must be > 0 seconds, got {args.timeout_s}")
    configs = [(label(x), x) for x in m["losses"]]
    if m["repeat"]:
        configs.insert(1, (REPEAT, 0.0))
    prefix = out_prefix(args, "netem_loss")

    def runner() -> list[RunResult]:
        out = []
        with netem_topology(m["num_sites"] + 1, "nloss", "netem_loss") as topo:
            for seed in m["seeds"]:
                for cfg, loss in configs:
                    res = run_one(topo, m, cfg, loss, seed, args.timeout_s)
                    r = res.row
                    print(
                        f"{cfg:<18s} seed {seed}: val {r['final_val_loss']:.4f} rounds {r['rounds_done']} "
                        f"exchange {r['exchange_s']:.2f}s reduce arrived {r['reduce_arrived']:.3f} "
                        f"stale {r['stale_buckets']} wall {r['wall_s']:.0f}s",
                        flush=True,
                    )
                    out.append(res)
        return out

    rows, rounds, meta = run_or_load(args, argv, "netem_loss.py", prefix, runner)
    png = plot(rows, rounds, prefix)
    md, notes = analyse(rows)
    body = f"""Command: `{meta["command"]}` (as root; {meta["minutes"]:.1f} min; {meta["provenance"]}).

Setup: {m["num_sites"]} `dtrain worker` processes + one `dtrain rendezvous`, each in its own network namespace,
real gRPC; every link {LINK["delay_ms"]:g} ms one-way, {LINK["rate_mbit"]:g} Mbit/s, and the loss shown
(random, of packets arriving at a site; nftables). Built-in GPT `{m["size"]}`, H = {m["sync_every"]},
{m["rounds"]} rounds, `{WORKER["codec"]}` with error feedback, 64 KiB buckets of 16 KiB chunks, reduce deadline
{RENDEZVOUS["reduce_timeout_s"]:g} s, broadcast deadline {RENDEZVOUS["broadcast_timeout_s"]:g} s (in --quick: the
in-process chunk-loss sweep's quick setup). Δ is paired by seed against the 0% run; mean ± std over seeds {m["seeds"]}. "Reduce
arrived": the fraction of contribution chunks an owner had by its deadline. CSV: `{prefix.with_suffix(".csv").name}`;
plot: `{png.name}`.

{md}

{chr(10).join(notes)}
{"- Smoke mode: a check that the script runs end to end; 3 rounds measure nothing." if mode == "smoke" else ""}
"""
    publish(args, f"netem_loss-{mode}", f"Packet loss over gRPC through netem ({mode})", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
