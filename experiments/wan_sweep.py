"""WAN sweep through netem: round sync time against the physical limit (issue 6 part 3).

N ``dtrain worker`` processes and a ``dtrain rendezvous``, each in its own network namespace,
talk real gRPC across emulated links (the setup the report prints). One training run per seed
walks every setting of the grid; the link changes once every site has written its line of the
previous setting's last round, and a round whose sync began before the change is left out.

Per setting and seed:

* ``engine_s``: a round's exchange time, plan to end of apply (the worker's ``round_s``), max
  over sites, mean over the measured rounds; ``sync_s``: the same for the whole ``sync()``
  call (the wait for the other sites included).
* ``limit_s``: issue 6's physical limit, 2 x B / rate + 2 x RTT (B = encoded bytes of one
  site's pseudo-gradient, RTT = 2 x one-way delay); ``ratio`` = engine_s / limit_s; also the
  ratio to the strict limit 2 x (N-1)/N x B / rate + 2 x RTT (what each site sends and
  receives when every site owns 1/N of the buckets).
* ``compute_util``: inner-phase time over inner + sync time, mean over sites.

Needs root (netem: network namespaces). ``netem.floor``: first a setting without emulation;
``netem.tcp_slow_start_after_idle``: that sysctl in every site's namespace (kernel default 1).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from pathlib import Path
from typing import Any

from experiments.common import RunResult, fmt_pm, md_rows, md_table, mean_std, read_rows, save_fig, subplots, summarize
from experiments.lab import SITES, SIZE, H, Point, Spec, decorate, files
from experiments.procs import line_record, run_sites, set_link, sites_topology, sysctl

KiB = 1024
# Buckets: small enough that every site owns some, large enough that the per-chunk cost stays small: on the 2-core
# machine, 4 sites of GPT small on 127.0.0.1 took a median 0.50 s per exchange with 64 KiB buckets of 16 KiB chunks
# (108 chunks), 0.15 s with 256/64 KiB (28), 0.09 s with 512/256 KiB, 0.07 s with the 4 MiB default (one owner).
BUCKET, CHUNK, SLEEP = "diloco.buckets.bucket_bytes", "diloco.buckets.chunk_bytes", "task.inner_step_sleep_s"
RATES, DELAYS, LOSSES = "netem.rates", "netem.delays", "netem.losses"
FLOOR, SSAI = "netem.floor", "netem.tcp_slow_start_after_idle"
WARMUP, MEASURED = "lab.warmup_rounds", "lab.measured_rounds"
# quick and full: 4 sites walk every rate x one-way delay x loss, first a setting with no emulation
WALK4 = {SITES: 4, RATES: [10.0, 50.0, 200.0], DELAYS: [0.0, 25.0, 75.0], LOSSES: [0.0, 1.0, 5.0]}
WALK4 |= {FLOOR: True, WARMUP: 1}
MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(
        seeds=[0],
        fixed={SITES: 2, SIZE: "tiny", H: 5, RATES: [50.0], DELAYS: [0.0, 25.0], LOSSES: [0.0], FLOOR: False}
        | {WARMUP: 1, MEASURED: 1, BUCKET: 64 * KiB, CHUNK: 16 * KiB}
        # tiny's 5 steps take ~0.06 s: too short for the link change to land between two exchanges
        | {SLEEP: 0.1},
    ),
    # small: 0.44 M params, int8 -> ~0.45 MB per site and round: 0.7 s of 2 x B / rate at 10 Mbit/s, 0.04 s at 200.
    "quick": dict(
        seeds=[0, 1, 2], fixed={**WALK4, SIZE: "small", H: 10, MEASURED: 1, BUCKET: 256 * KiB, CHUNK: 64 * KiB}
    ),
    # base: 3.26 M params, int8 -> ~3.3 MB per site and round.
    "full": dict(
        seeds=[0, 1, 2], fixed={**WALK4, SIZE: "base", H: 20, MEASURED: 3, BUCKET: 1024 * KiB, CHUNK: 256 * KiB}
    ),
}
CODEC = "int8"  # the worker's default; --set diloco.rounds.codec.name=sparseloco (issue 35) measures another
CODEC_PATH = "diloco.rounds.codec.name"
RENDEZVOUS = dict(quorum_timeout_s=60.0, heartbeat_interval_s=1.0, heartbeat_timeout_s=20.0)
RENDEZVOUS |= dict(reduce_timeout_s=30.0, broadcast_timeout_s=60.0)


def setting_label(rate: float | None, delay: float, loss: float) -> str:
    return f"{'no cap' if rate is None else f'{rate:g} Mbit/s'}, {delay:g} ms, {loss:g}%"


def physical_limit_s(encoded_bytes: float, rate_mbit: float | None, delay_ms: float, share: float = 1.0) -> float:
    """2 x share x B / rate + 2 x RTT, RTT = 2 x one-way delay (seconds; no cap: the RTT part only);
    ``share`` 1 is issue 6's limit, (N-1)/N what each site sends when it owns 1/N of the buckets."""
    return (0.0 if rate_mbit is None else 2 * share * encoded_bytes * 8 / (rate_mbit * 1e6)) + 2 * (2 * delay_ms / 1000)


def strict_limit_s(r: dict[str, Any]) -> float:
    """2 x (N-1)/N x B / rate + 2 x RTT (seconds) of a row's setting."""
    n = r["num_sites"]
    return physical_limit_s(r["encoded_bytes_per_site"], r["rate_mbit"], r["delay_ms"], (n - 1) / n)


def run_point(point: Point) -> list[RunResult]:
    """One seed's training run through every setting of the walk, in a topology of its own; one result per setting."""
    f, seed = point.settings, point.seed
    # the settings in the order the run walks them; with netem.floor, first one with no emulation at all
    # (the exchange's own cost on this machine)
    settings = ([(None, 0.0, 0.0)] if f.get(FLOOR) else []) + list(itertools.product(f[RATES], f[DELAYS], f[LOSSES]))
    n, per = f[SITES], f[WARMUP] + f[MEASURED]
    total = per * len(settings)
    changed_at: list[float] = []

    def link(k: int) -> None:
        rate, delay, loss = settings[k]
        set_link(topo, delay_ms=delay, loss_pct=loss, rate_mbit=rate)
        changed_at.append(time.time())
        if k:
            print(f"  seed {seed}: round {k * per}: {setting_label(*settings[k])}", flush=True)

    opts = dict(size=f[SIZE], seed=seed, rounds=total, sync_every=f[H], codec=f.get(CODEC_PATH, CODEC))
    opts |= dict(eval_every=total, bucket_bytes=f[BUCKET], chunk_bytes=f[CHUNK], quorum_wait_s=600, linger_s=2)
    opts |= dict(inner_step_sleep_s=f.get(SLEEP, 0.0))
    steps = [(k * per - 1, lambda k=k: link(k)) for k in range(1, len(settings))]
    with sites_topology(n, "wan", "wan_sweep") as topo:
        if f.get(SSAI) is not None:
            sysctl(topo, "tcp_slow_start_after_idle", int(f[SSAI]))
        link(0)
        res = run_sites(topo, n, RENDEZVOUS, opts, timeout_s=3600.0, steps=steps)
    out = []
    for k, (rate, delay, loss) in enumerate(settings):  # setting k's row (rounds k * per on) and per-round records
        label = setting_label(rate, delay, loss)
        rounds_out, kept = measured_rounds(
            res.per_site,
            range(k * per, (k + 1) * per),
            changed_at[k],
            lambda x, ok: line_record("wan_sweep", label, seed, x, LINE_KEYS, measured=ok),
            lambda r, lines: r - k * per >= f[WARMUP] and all(x["status"] == "applied" for x in lines),
        )
        every = [x for lines in kept for x in lines]
        b = nan_mean([x.get("encoded_bytes", 0) for x in every])
        e = nan_mean([max(x.get("round_s", float("nan")) for x in lines) for lines in kept])
        limit = physical_limit_s(b, rate, delay)
        row = {
            "experiment": "wan_sweep",
            "config": label,
            "seed": seed,
            "num_sites": f[SITES],
            "size": f[SIZE],
            "sync_every": f[H],
            "codec": f.get(CODEC_PATH, CODEC),
            "rate_mbit": rate,
            "delay_ms": delay,
            "loss_pct": loss,
            "rounds_measured": len(kept),
            "encoded_bytes_per_site": b,
            "bytes_per_round_site": nan_mean([x.get("bytes_sent", 0) for x in every]),
            "engine_s": e,
            "sync_s": nan_mean([max(x["sync_s"] for x in lines) for lines in kept]),
            "limit_s": limit,
            "ratio": e / limit if limit > 0 else float("nan"),
            "compute_util": nan_mean([x["inner_s"] / (x["inner_s"] + x["sync_s"]) for x in every]),
            "inner_s": nan_mean([x["inner_s"] for x in every]),
            "stale_buckets": sum(x.get("stale_buckets", 0) for x in every),
            "rejected": sum(sum(x.get("rejected", {}).values()) for x in every),
            "reduce_arrived": nan_mean([x.get("reduce_arrived_fraction", float("nan")) for x in every]),
            **res.facts(),  # of the whole run (every setting of this seed): the columns every experiment CSV has
        }
        out.append(RunResult(row=row, rounds=rounds_out))
    return out


def nan_mean(xs: list[float]) -> float:
    """The mean of ``xs``, NaN for none."""
    return statistics.fmean(xs) if xs else float("nan")


def measured_rounds(per_site, rounds, changed_at: float, record, ok=lambda r, lines: True):
    """(every line's per-round record, ``record(line, measured)``; each measured round's lines, site by site)
    over ``rounds``: measured when every site wrote its line, the exchange began after the link changed at
    ``changed_at`` (the sync call starts ``sync_s`` before the line) and ``ok(round, lines)``."""
    records, kept = [], []
    for r in rounds:
        lines = [x for i in range(len(per_site)) for x in per_site[i] if x["round"] == r]
        began_after = all(x["time"] - x["sync_s"] >= changed_at for x in lines)
        measured = len(lines) == len(per_site) and began_after and ok(r, lines)
        records += [record(x, measured) for x in lines]
        if measured:
            kept.append(lines)
    return records, kept


#: the metrics-line fields of the per-round CSV
LINE_KEYS = ("round", "site", "status", "round_s", "sync_s", "inner_s", "network_s", "wait_s", "encoded_bytes")
LINE_KEYS += ("bytes_sent", "stale_buckets")


def analyse(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """(the table, a row per setting averaged over seeds; the notes under it)."""
    groups = summarize(rows)
    table = []
    for g in groups.values():
        g0, measured = g[0], any(not math.isnan(r["ratio"]) for r in g)
        strict = fmt_pm([r["engine_s"] / strict_limit_s(r) for r in g], "{:.2f}") if measured else "—"
        table.append(
            {
                "rate Mbit/s": "no cap" if g0["rate_mbit"] is None else f"{g0['rate_mbit']:g}",
                "one-way delay ms": f"{g0['delay_ms']:g}",
                "loss %": f"{g0['loss_pct']:g}",
                "rounds measured": sum(r["rounds_measured"] for r in g),
                "B: encoded MB/site/round": f"{statistics.fmean(r['encoded_bytes_per_site'] for r in g) / 1e6:.3f}",
                "exchange s (plan→applied, max over sites)": fmt_pm([r["engine_s"] for r in g], "{:.2f}"),
                "sync s (incl. quorum wait)": fmt_pm([r["sync_s"] for r in g], "{:.2f}"),
                "physical limit s": f"{statistics.fmean(r['limit_s'] for r in g):.2f}",
                "ratio to limit": fmt_pm([r["ratio"] for r in g], "{:.2f}") if measured else "—",
                "ratio to strict limit": strict,
                "compute utilization": fmt_pm([r["compute_util"] for r in g], "{:.2f}"),
                "stale buckets": sum(r["stale_buckets"] for r in g),
                "rejected": sum(r["rejected"] for r in g),
            }
        )
    return md_rows(table), _ratio_notes(groups) + _floor_and_util_notes(rows, groups)


def _ratio_notes(groups: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The median, best and worst ratio to the physical limit (per setting, mean over seeds), and the median
    per loss rate."""
    ratios = {cfg: [r["ratio"] for r in g if not math.isnan(r["ratio"])] for cfg, g in groups.items()}
    good = sorted((statistics.fmean(v), cfg) for cfg, v in ratios.items() if v)
    if not good:
        return []
    by_loss: dict[float, list[float]] = {}
    for cfg, g in groups.items():
        by_loss.setdefault(g[0]["loss_pct"], []).extend(ratios[cfg])
    return [
        f"- Ratio to the physical limit: median {statistics.median(r for r, _ in good):.2f} over {len(good)} settings; "
        f"best {good[0][0]:.2f} ({good[0][1]}), worst {good[-1][0]:.2f} ({good[-1][1]}).",
        "- Median ratio by loss: "
        + ", ".join(f"{k:g}%: {statistics.median(v):.2f}" for k, v in sorted(by_loss.items()) if v)
        + ".",
    ]


def _floor_and_util_notes(rows: list[dict[str, Any]], groups: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The unemulated floor, the compute utilization (and at 10x H), short runs, the limit's definition."""
    notes = []
    floor = [r for r in rows if r["rate_mbit"] is None]
    if floor:
        fm, fs = mean_std([r["engine_s"] for r in floor])
        notes.append(
            f"- No emulation at all (the same processes, no cap, no delay, no loss): the exchange takes {fm:.2f} "
            f"± {fs:.2f} s. That is the round's own cost on this machine (encode, gRPC, decode, sum, apply, "
            "with every site's process sharing the cores); wherever the physical limit is below it (high rate, "
            "no delay) the ratio mostly measures this floor, not the network."
        )
    # per setting, mean over seeds (as in the table)
    capped = [g for g in groups.values() if g[0]["rate_mbit"] is not None]
    util = [mean_std([r["compute_util"] for r in g])[0] for g in capped]
    util = [u for u in util if not math.isnan(u)]
    inner = [r["inner_s"] for r in rows if r.get("inner_s") is not None and not math.isnan(r["inner_s"])]
    if util and inner:
        i10 = 10 * statistics.fmean(inner)
        u10 = [i10 / (i10 + mean_std([r["sync_s"] for r in g])[0]) for g in capped]
        u10 = [u for u in u10 if not math.isnan(u)]
        notes.append(
            f"- Compute utilization (per setting, mean over seeds) ranges over {min(util):.2f}–{max(util):.2f} (median "
            f"{statistics.median(util):.2f}) with an inner phase of {statistics.fmean(inner):.2f} s "
            f"(H = {rows[0]['sync_every']}). Utilization scales with H: with the same sync times and an inner "
            f"phase 10x longer (H = {10 * rows[0]['sync_every']}) it would be {min(u10):.2f}–{max(u10):.2f}."
        )
    short = [cfg for cfg, g in groups.items() if any(r["rounds_measured"] < 1 for r in g)]
    if short:
        notes.append(
            f"- Not measured in some run: {', '.join(short)} (the exchange had begun before the link changed, "
            "or a site did not apply the round; see the per-round CSV's `measured` column)."
        )
    return notes


def compare_default(rows: list[dict[str, Any]], default_csv: Path) -> list[str]:
    """Lines comparing ``rows`` with the same mode's default run (kernel sysctls), setting by setting."""
    if not default_csv.exists():
        return [f"- No default run to compare with ({default_csv.name} not found)."]
    base = {cfg: statistics.fmean(r["engine_s"] for r in g) for cfg, g in summarize(read_rows(default_csv)).items()}
    mine = {cfg: statistics.fmean(r["engine_s"] for r in g) for cfg, g in summarize(rows).items()}
    table = [[cfg, f"{base[cfg]:.2f}", f"{v:.2f}", f"{v / base[cfg]:.2f}"] for cfg, v in mine.items() if cfg in base]
    if not table:
        return []
    return [
        f"- Against the default run (`{default_csv.name}`, a separate run: other load), exchange s per setting "
        f"(median ratio {statistics.median(float(t[3]) for t in table):.2f}):",
        "",
        md_table(["setting", "default", "this run", "ratio"], table),
    ]


def plot(rows: list[dict[str, Any]], prefix: Path, m: dict[str, Any]) -> Path:
    losses = sorted({r["loss_pct"] for r in rows})
    rates = sorted({r["rate_mbit"] for r in rows if r["rate_mbit"] is not None})
    floor = [r["engine_s"] for r in rows if r["rate_mbit"] is None]
    fig, axes = subplots(2, len(losses), figsize=(4.2 * len(losses), 6.4), squeeze=False)
    for j, loss in enumerate(losses):
        for delay in sorted({r["delay_ms"] for r in rows}):
            here = [r for r in rows if (r["loss_pct"], r["delay_ms"]) == (loss, delay)]
            at = [[r for r in here if r["rate_mbit"] == x] for x in rates]
            e, lim, rat = ([mean_std([r[k] for r in g])[0] for g in at] for k in ("engine_s", "limit_s", "ratio"))
            (line,) = axes[0][j].plot(rates, e, marker="o", label=f"{delay:g} ms")
            axes[0][j].plot(rates, lim, ls=":", color=line.get_color())
            axes[1][j].plot(rates, rat, marker="o", label=f"{delay:g} ms")
        if floor:
            axes[0][j].axhline(statistics.fmean(floor), color="0.5", lw=0.8, ls="--", label="no emulation")
        ylabel = "exchange s (dotted: physical limit)"
        decorate(axes[0][j], "rate, Mbit/s", ylabel, f"loss {loss:g}%", legend=None, xscale="log", yscale="log")
        decorate(axes[1][j], "rate, Mbit/s", "ratio to physical limit", legend=None, xscale="log")
        axes[1][j].axhline(1.0, color="0.6", lw=0.8)
        axes[0][j].legend(fontsize=8, title="one-way delay", title_fontsize=8)
    fig.suptitle(f"WAN sweep: {m[SITES]} sites, GPT {m[SIZE]}, {CODEC}, gRPC through netem", fontsize=10)
    return save_fig(fig, prefix.with_suffix(".png"))


def report(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any], prefix: Path) -> str:
    f = m["fixed"]
    ssai = f.get(SSAI)
    png = plot(rows, prefix, f)
    return f"""Setup (as root): {f[SITES]} `dtrain worker` processes + one `dtrain rendezvous`, each in its own network namespace
(`netem.Topology`, routing hub; tbf for the rate, nftables for loss, the NFQUEUE delayer for delay), real gRPC.
Built-in GPT `{f[SIZE]}`, H = {f[H]} inner steps (real compute, {f[SITES]} processes sharing
the machine's cores), codec `{CODEC}`, {f[BUCKET] // KiB} KiB buckets of {f[CHUNK] // KiB} KiB
chunks; deadlines reduce {RENDEZVOUS["reduce_timeout_s"]:g} s / broadcast {RENDEZVOUS["broadcast_timeout_s"]:g} s
(generous: the exchange is timed, not cut). Every site's link (and the rendezvous's) gets the setting; delay and
loss apply to packets arriving at a site, so RTT = 2 x delay and a packet crossing two sites sees the loss once.
One run per seed ({m["seeds"]}) walks the grid; each setting holds {f[WARMUP]} warm-up +
{f[MEASURED]} measured round(s). Physical limit (issue 6) = 2 x B / rate + 2 x RTT with B = one site's encoded
pseudo-gradient; each site really sends 2 x (N-1)/N x B when ownership is balanced (its contributions to the other
owners, its buckets' means to the other sites): the strict limit; uneven ownership (HRW over few buckets) lies in
between. Compute utilization = inner-phase time / (inner + sync) per site. Mean ± std over seeds.
{"" if ssai is None else f"net.ipv4.tcp_slow_start_after_idle = {ssai} in every site's namespace (kernel default 1). "}
{files(prefix, png, rounds="per round and site")}

{analyse(rows)[0]}"""


def verdict(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any]) -> list[str]:
    notes = analyse(rows)[1]
    if m["fixed"].get(SSAI) is not None:  # against the run with the kernel's default, when there is one
        name = "wan_sweep" if m["mode"] == "quick" else f"wan_sweep_{m['mode']}"
        notes += compare_default(rows, Path(__file__).parent / "out" / f"{name}.csv")
    return notes


SPEC = Spec(
    name="wan_sweep",
    title="WAN sweep through netem",
    modes={k: {"grid": [{"config": "walk"}], **v} for k, v in MODES.items()},  # a run per seed
    metrics=(("engine_s", 0.0, 600.0), ("limit_s", 0.0, 600.0), ("compute_util", 0.0, 1.0)),
    report=report,
    verdict=verdict,
    execute=run_point,
    paths=(RATES, DELAYS, LOSSES, FLOOR, SSAI, WARMUP, MEASURED, SLEEP),
    netem=True,
)
