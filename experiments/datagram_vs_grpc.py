"""The datagram data path against gRPC (BBR and cubic) through netem packet loss (issue 16).

N ``dtrain worker`` processes and a ``dtrain rendezvous`` in their own network namespaces; every
site's link has the same rate cap, one-way delay (RTT = 2 x delay) and random loss. One training
run per data path walks the loss grid (each loss holds for a warm-up and the measured rounds,
changed between exchanges as in ``wan_sweep.py``):

* ``gRPC (BBR)`` / ``gRPC (cubic)``: the default data path with that TCP congestion control in
  every namespace (reno, also loss-based, where the machine does not allow cubic);
* ``datagram``: ``--data-path datagram`` (paced, sealed UDP datagrams, never retransmitted;
  lost mean chunks re-requested, then pulled over gRPC), ``--max-rate-mbit`` just under the cap.

Per data path and loss: ``engine_s`` = a round's exchange time (max ``total_s`` over sites),
``limit_s`` = 2 x B / rate + 2 x RTT (B = one site's encoded pseudo-gradient), ``ratio``; payload
bytes sent per site and round and, for the datagram path, wire bytes (headers, tags, re-sent
chunks and control datagrams included); ``delivered`` = fraction of a site's chunks a mean
included; ``drift`` = rounds whose θ checksums differed between sites (``warmup_drift_rounds``:
the unmeasured warm-up round's) and stale buckets; ``left_behind`` = sites that ended the run
behind (``EXIT_LEFT_BEHIND``), on the last loss setting's row. CPU: ``sites_sync_cpu_s`` (kernel
part ``sites_sync_system_cpu_s``) = the sites' CPU seconds in their syncs, summed over sites
(median over rounds); ``machine_busy_*`` = this machine's ``/proc/stat`` over the setting's
rounds. The sites' sync CPU over the cores is a floor under a round's exchange here (the
report's CPU verdict).

Needs root (netem: network namespaces). ``netem.mtu_bytes`` sets every link's MTU (default 1500)
and ``--max-datagram-bytes`` to 100 less; ``net.grpc.num_channels_per_peer`` the TCP connections
per peer (a gRPC push as that many streams; default 1); a run at other settings writes files and a
RESULTS.md section of its own.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from dtrain.app.cli import EXIT_LEFT_BEHIND
from dtrain.tasks.builtin import build_task
from dtrain.tasks.spec import PRESETS, Preset, Task, TaskSpec
from dtrain.transports.datagram import max_datagram_bytes_for_mtu
from experiments.common import RunResult, md_rows, read_rows, save_fig, subplots
from experiments.lab import SITES, SIZE, H, Point, Spec, decorate, files, met
from experiments.netem_udp_ceiling import ceilings
from experiments.procs import SitesRun, line_record, loss_based_cc, run_sites, set_link, sites_topology, sysctl
from experiments.wan_sweep import measured_rounds, nan_mean, physical_limit_s
from netem.topology import MAX_MTU_BYTES, MIN_MTU_BYTES

_LOSS_CC = loss_based_cc()
PATHS = (
    ("gRPC (BBR)", "grpc", "bbr"),
    (f"gRPC ({_LOSS_CC})", "grpc", _LOSS_CC),
    ("datagram", "datagram", "bbr"),  # its gRPC control plane keeps the kernel's default
)
TASK = "task_spec.task"
RATE, DELAY, LOSSES, MTU = "netem.rate_mbit", "netem.delay_ms", "netem.losses", "netem.mtu_bytes"
MEASURED, SLEEP, DATA_PATH, CC = "lab.measured_rounds", "task.inner_step_sleep_s", "net.data_path", "netem.tcp_cc"
CHANNELS = "net.grpc.num_channels_per_peer"  # TCP connections per peer; a gRPC push goes as that many streams
# "set": the rendezvous's time settings below (they bound a run's time: a loss-based TCP at 20% loss
# needs minutes a round); "derived": none set, every deadline derived (issue 32's reno check:
# --set lab.deadlines=derived --set 'netem.losses=[10]')
DEADLINES = "lab.deadlines"
LINK = {RATE: 100.0, MTU: 1500, DEADLINES: "set", SLEEP: 0.0, CHANNELS: 1}


def wide_task(spec: TaskSpec) -> Task:
    """The built-in task at about 9.7 M parameters whatever ``spec.size`` says (int8: ~9.8 MB of
    pseudo-gradient per site and round, the issue's >= 8 MB): 4 layers of width 448, short windows
    so that an inner step stays cheap on a shared machine. Quick and full runs' ``task_spec.task``."""
    wide = Preset(num_layers=4, num_heads=8, embed_dim=448, context_len=32, batch_size=2, lr=3e-4, num_val_batches=2)
    PRESETS.setdefault("wide", wide)
    return build_task(replace(spec, size="wide", context_len=None, batch_size=None))


WIDE = {SITES: 4, TASK: "experiments.datagram_vs_grpc:wide_task", SIZE: "tiny", DELAY: 40.0}
WIDE |= {LOSSES: [0.0, 1.0, 5.0, 10.0, 20.0]}
MODES: dict[str, dict[str, Any]] = {
    # smoke: as in wan_sweep's smoke, an inner phase long enough that the link change lands between two
    # exchanges (a 40 ms one let the next round start first, once in four runs, leaving the 5% row unmeasured)
    "smoke": dict(seeds=[0])
    | {"fixed": {SITES: 2, TASK: "", SIZE: "tiny", H: 2, DELAY: 5.0, LOSSES: [0.0, 5.0], MEASURED: 1, SLEEP: 0.1}},
    "quick": dict(seeds=[0], fixed={**WIDE, H: 1, MEASURED: 1}),
    "full": dict(seeds=[0, 1, 2], fixed={**WIDE, H: 5, MEASURED: 3}),
}


def _checked(f: dict[str, Any]) -> dict[str, Any]:
    """The run's settings by path (the spec's ``fixed`` gives the optional ones); ValueError naming a bad one."""
    if not all(0.0 <= x < 100.0 for x in f[LOSSES]):
        raise ValueError(f"{LOSSES} must be percents in [0, 100), got {f[LOSSES]!r}")
    if not MIN_MTU_BYTES <= f[MTU] <= MAX_MTU_BYTES:
        raise ValueError(f"{MTU} must be in [{MIN_MTU_BYTES}, {MAX_MTU_BYTES}], got {f[MTU]}")
    if f[DEADLINES] not in ("set", "derived"):
        raise ValueError(f"{DEADLINES} must be 'set' or 'derived', got {f[DEADLINES]!r}")
    return f


RENDEZVOUS = dict(quorum_timeout_s=60.0, heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0)
RENDEZVOUS |= dict(reduce_timeout_s=30.0, broadcast_timeout_s=60.0)


def machine_cpu() -> dict[str, float]:
    """This machine's CPU seconds so far, all cores (``/proc/stat``): ``busy`` (user, nice, system, irq,
    softirq, steal), ``softirq`` (the kernel's packet work: much of netem's cost), ``idle``; ``{}`` without it."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    v += [0] * (8 - len(v))
    user, nice, system, idle, iowait, irq, softirq, steal = (x / tick for x in v[:8])
    return {"busy": user + nice + system + irq + softirq + steal, "softirq": softirq, "idle": idle + iowait}


def cpu_window(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """The machine's CPU between two :func:`machine_cpu` samples: ``busy_fraction`` of every core's
    time (0..1), ``busy_s`` and ``softirq_s`` (CPU seconds, all cores); NaNs without samples."""
    if not a or not b:
        return {"busy_fraction": float("nan"), "busy_s": float("nan"), "softirq_s": float("nan")}
    busy, total = b["busy"] - a["busy"], (b["busy"] + b["idle"]) - (a["busy"] + a["idle"])
    return {
        "busy_fraction": busy / total if total > 0 else float("nan"),
        "busy_s": busy,
        "softirq_s": b["softirq"] - a["softirq"],
    }


def run_point(point: Point) -> list[RunResult]:
    """One data path's training run through every loss setting, in a topology of its own; one result per loss."""
    m, label, seed = _checked(point.settings), point.config, point.seed
    data_path, n, per = m[DATA_PATH], m[SITES], 1 + m[MEASURED]
    total = per * len(m[LOSSES])
    changed_at: list[float] = []
    # the machine's CPU after the first round (start-up left out), at each later link change and at the end
    cpu_at: list[dict[str, float]] = []

    def link(k: int) -> None:
        set_link(topo, delay_ms=m[DELAY], loss_pct=m[LOSSES][k], rate_mbit=m[RATE])
        changed_at.append(time.time())
        if k:  # after the first round's CPU sample
            cpu_at.append(machine_cpu())
            print(f"  {label}: round {k * per}: loss {m[LOSSES][k]:g}%", flush=True)

    opts = dict(task=m[TASK] or None, size=m[SIZE], seed=seed, rounds=total, sync_every=m[H])
    # no linger_s: close() waits for every member's pull or MEAN_ACK up to the broadcast
    # deadline (a 3 s linger let an owner exit before a member 3 s behind got the last
    # round's means: that bucket ended owner_lost there, applied elsewhere, and θ differed)
    opts |= dict(codec="int8", eval_every=total, quorum_wait_s=600, data_path=data_path, max_rate_mbit=0.95 * m[RATE])
    opts |= dict(max_datagram_bytes=max_datagram_bytes_for_mtu(m[MTU]) if data_path == "datagram" else None)
    opts |= {"inner_step_sleep_s": m[SLEEP], CHANNELS: m[CHANNELS]}
    steps = [(0, lambda: cpu_at.append(machine_cpu()))]
    steps += [(k * per - 1, lambda k=k: link(k)) for k in range(1, len(m[LOSSES]))]
    steps += [(total - 1, lambda: cpu_at.append(machine_cpu()))]
    rv = RENDEZVOUS if m[DEADLINES] == "set" else {"heartbeat_interval_s": 1.0}
    with sites_topology(n, "dgvs", "datagram_vs_grpc", mtu_bytes=m[MTU]) as topo:
        sysctl(topo, "tcp_congestion_control", m[CC])
        link(0)
        # a site left behind by the last round (it exits EXIT_LEFT_BEHIND, never "done" on another
        # θ) is this run's figure, not a harness failure
        res = run_sites(topo, n, rv, opts, timeout_s=3600.0, steps=steps, ok=(0, EXIT_LEFT_BEHIND))
    cpu = [cpu_window(a, b) for a, b in zip(cpu_at, cpu_at[1:])]  # the first setting's without its warm-up
    cpu += [cpu_window({}, {})] * (len(m[LOSSES]) - len(cpu))
    return [_result(m, label, seed, k, loss, res, changed_at[k], cpu[k]) for k, loss in enumerate(m[LOSSES])]


def _wire_sent(per_site: dict[int, list[dict]], i: int, r: int) -> float:
    """Datagram wire bytes site i sent in round r (from the cumulative counters)."""
    lines = {x["round"]: x for x in per_site[i]}
    now, before = lines.get(r, {}).get("datagram"), lines.get(r - 1, {}).get("datagram")
    if now is None:
        return float("nan")
    return now["wire_sent"] - (before["wire_sent"] if before else 0)


def _result(m, label, seed, k, loss, res: SitesRun, changed_at, cpu) -> RunResult:
    """One loss setting's row: its measured rounds' figures; ``cpu``: :func:`cpu_window` over
    its rounds (its warm-up round included, but the first setting's)."""
    n, per, per_site = m[SITES], 1 + m[MEASURED], res.per_site
    keys = ("round", "site", "status", "round_s", "bytes_sent", "included_fraction")
    config = f"{label}, loss {loss:g}%"
    rounds = range(k * per + 1, (k + 1) * per)  # the first round of each setting is the warm-up
    rounds_out, kept = measured_rounds(
        per_site, rounds, changed_at, lambda x, ok: line_record("datagram_vs_grpc", config, seed, x, keys, measured=ok)
    )
    every = [x for lines in kept for x in lines]

    # the median over measured rounds of the sites' CPU seconds, summed over sites (NaN: an older dtrain's line)
    def cpu_s(key: str) -> float:
        per_round = [sum(float("nan") if x.get(key) is None else float(x[key]) for x in lines) for lines in kept]
        return statistics.median(per_round) if per_round else float("nan")

    # the warm-up round is not measured, but its θ must agree too (issue 32: no round of unequal θ)
    warm = [x for i in range(n) for x in per_site[i] if x["round"] == k * per]
    b = nan_mean([x.get("encoded_bytes", 0) for x in every])
    limit = physical_limit_s(b, m[RATE], m[DELAY])
    e = nan_mean([max(x.get("round_s", float("nan")) for x in lines) for lines in kept])
    row = {
        "experiment": "datagram_vs_grpc",
        "config": config,
        "path": label,
        "seed": seed,
        "num_sites": n,
        "sync_every": m[H],
        "codec": "int8",
        "rate_mbit": m[RATE],
        "delay_ms": m[DELAY],
        "loss_pct": loss,
        "rounds_measured": len(kept),
        "encoded_bytes_per_site": b,
        "engine_s": e,
        "limit_s": limit,
        "ratio": e / limit if limit > 0 else float("nan"),
        "bytes_per_round_site": nan_mean([x.get("bytes_sent", 0) for x in every]),
        "wire_bytes_per_round_site": nan_mean(
            [_wire_sent(per_site, i, lines[0]["round"]) for lines in kept for i in range(n)]
        ),
        "delivered": nan_mean([x.get("included_fraction", float("nan")) for x in every]),
        "drift_rounds": sum(len({x["checksum"] for x in lines}) > 1 for lines in kept),
        "warmup_drift_rounds": int(len(warm) == n and len({x["checksum"] for x in warm}) > 1),
        "stale_buckets": sum(x.get("stale_buckets", 0) for x in every),
        "skipped_buckets": sum(x.get("skipped_buckets", 0) for x in every),
        "rejected": 0,
        "sync_s": e,
        **res.facts(),
        # CPU: what the sites' syncs and whole round cycles cost (CPU s per round, summed over sites),
        # and how busy the machine was over this setting's rounds (the emulator's kernel work included)
        "sites_sync_cpu_s": cpu_s("sync_cpu_s"),
        "sites_sync_system_cpu_s": cpu_s("sync_system_cpu_s"),
        "sites_cycle_cpu_s": cpu_s("cpu_s"),
        "machine_busy_fraction": cpu["busy_fraction"],
        "machine_busy_s_per_round": cpu["busy_s"] / (per - (k == 0)),
        "machine_softirq_s_per_round": cpu["softirq_s"] / (per - (k == 0)),
        "cpu_cores": os.cpu_count() or 1,
        # the end of the run is the last setting's
        "left_behind": sum(rc == EXIT_LEFT_BEHIND for rc in res.rcs.values()) if k == len(m[LOSSES]) - 1 else 0,
    }
    return RunResult(row=row, rounds=rounds_out)


def emulator_rate_mbit(ceiling_csv: Path, num_sites: int) -> tuple[float, str] | None:
    """Per-site rate the netem emulator itself passed (``netem_udp_ceiling.py``, the "delay + cap"
    setting with the most flows: its loss-free aggregate over ``num_sites`` senders), or None."""
    rows = read_rows(ceiling_csv) if ceiling_csv.exists() else []
    best = [(k[1], r) for k, r in ceilings(rows).items() if k[0] == "delay + cap" and r is not None]
    if not best:
        return None
    flows, r = max(best)
    return r["delivered_mbit"] / num_sites, f"{r['delivered_dps']:.0f} datagrams/s over {flows} flows"


def verdicts(rows: list[dict[str, Any]], emu: tuple[float, str] | None) -> str:
    """The speed target (<= 1.2x up to 10% loss) against the nominal limit and the emulator-bound one."""
    dg = sorted((r for r in rows if r["path"] == "datagram" and r["loss_pct"] <= 10), key=lambda r: r["loss_pct"])
    if not dg:
        return ""
    worst = max(dg, key=lambda r: r["ratio"])
    at = "" if worst["ratio"] <= 1.2 else f" (worst {worst['ratio']:.2f}x at {worst['loss_pct']:g}%)"
    lines = [f"Target (datagram <= 1.2x the limit up to 10% loss), nominal limit: {_within(worst['ratio'])}{at}."]
    if emu is not None:
        rate, what = emu
        lims = [physical_limit_s(r["encoded_bytes_per_site"], min(r["rate_mbit"], rate), r["delay_ms"]) for r in dg]
        ratios = [(r["engine_s"] / lim, r["loss_pct"], lim) for r, lim in zip(dg, lims)]
        w = max(ratios)
        lines.append(
            f"Against the emulator's measured ceiling ({what}: {rate:.1f} Mbit/s per site of {rows[0]['num_sites']}, "
            f"limit {w[2]:.2f} s): "
            + ", ".join(f"{x:.2f}x at {loss:g}%" for x, loss, _ in ratios)
            + f"; {_within(w[0])}."
        )
    return "\n\n".join(lines)


def _within(ratio: float, target: float = 1.2) -> str:
    """The speed target's judgement: **met**, or by how much a ``ratio`` to the limit missed it."""
    return met(ratio <= target, f"missed by {ratio / target:.1f}x")


def analyse(rows: list[dict[str, Any]]) -> str:
    table = [
        {
            "loss": f"{r['loss_pct']:g}%",
            "data path": r["path"],
            "exchange s": f"{r['engine_s']:.2f}",
            "limit s": f"{r['limit_s']:.2f}",
            "ratio": f"{r['ratio']:.2f}",
            "payload MB/site": f"{r['bytes_per_round_site'] / 1e6:.2f}",
            "wire MB/site": "-"
            if r["wire_bytes_per_round_site"] != r["wire_bytes_per_round_site"]
            else f"{r['wire_bytes_per_round_site'] / 1e6:.2f}",
            "delivered": f"{r['delivered']:.3f}",
            "drift rounds (warm-up) / stale / skipped buckets": f"{r['drift_rounds']} ({r.get('warmup_drift_rounds', '-')}) / "
            f"{r['stale_buckets']} / {r.get('skipped_buckets', '-')}",
            "sites left behind at the end": str(r.get("left_behind", "-")),
            "CPU s/round: sites' syncs (kernel) / machine (busy)": _cpu_cell(r),
        }
        for r in sorted(rows, key=lambda r: (r["loss_pct"], r["path"], r["seed"]))
    ]
    return md_rows(table)


def _cpu_cell(r: dict[str, Any]) -> str:
    """``S (K) / M (B%)``: the sites' sync CPU s per round (summed over sites) and its kernel part, the
    machine's busy CPU s per round and its busy share of all cores; ``-`` for rows before these existed."""
    keys = ("sites_sync_cpu_s", "sites_sync_system_cpu_s", "machine_busy_s_per_round", "machine_busy_fraction")
    sync, kernel, busy, frac = (r.get(k) for k in keys)
    if not all(isinstance(v, (int, float)) and v == v for v in (sync, kernel, busy, frac)):
        return "-"
    return f"{sync:.2f} ({kernel:.2f}) / {busy:.2f} ({frac:.0%})"


def cpu_verdict(rows: list[dict[str, Any]]) -> str:
    """What the machine's CPU allowed the datagram rows (up to 10% loss): the sites' sync CPU per
    round over the cores is a floor under a round's syncs on this machine, whatever the network."""
    dg = [r for r in rows if r["path"] == "datagram" and r["loss_pct"] <= 10 and _cpu_cell(r) != "-"]
    if not dg:
        return ""
    cores = dg[0].get("cpu_cores") or 1
    floors = [r["sites_sync_cpu_s"] / cores / r["limit_s"] for r in dg]
    busy = [r["machine_busy_fraction"] for r in dg]
    softirq = [r["machine_softirq_s_per_round"] for r in dg]
    return (
        f"CPU: the machine's {cores} cores were {min(busy):.0%}-{max(busy):.0%} busy over the datagram rows up to 10% "
        f"loss. The {dg[0]['num_sites']} sites' syncs used {min(r['sites_sync_cpu_s'] for r in dg):.2f}-"
        f"{max(r['sites_sync_cpu_s'] for r in dg):.2f} CPU s per round (median over rounds, summed over sites), "
        f"{min(r['sites_sync_system_cpu_s'] / r['sites_sync_cpu_s'] for r in dg):.0%}-"
        f"{max(r['sites_sync_system_cpu_s'] / r['sites_sync_cpu_s'] for r in dg):.0%} of it in the kernel (socket "
        "calls and the emulated links' packet work done in the sending threads); the machine's softirq, packet work "
        f"outside any process, adds {min(softirq):.2f}-{max(softirq):.2f} s per round. On {cores} cores the syncs "
        f"alone cannot take less than {min(floors):.2f}-{max(floors):.2f}x the limit, whatever the network does."
    )


def plot(rows: list[dict[str, Any]], prefix: Path) -> Path:
    fig, ax = subplots(figsize=(6, 3.6))
    for label, _, _ in PATHS:
        pts = sorted((r["loss_pct"], r["ratio"]) for r in rows if r["path"] == label)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.axhline(1.2, color="grey", linestyle=":", label="target 1.2x")
    decorate(ax, "packet loss (%)", "exchange time / physical limit", legend=10)  # 10: matplotlib's "medium"
    return save_fig(fig, prefix.with_suffix(".png"))


def report(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any], prefix: Path) -> str:
    lm = _checked(m["fixed"])
    png = plot(rows, prefix)
    # the emulator's ceiling was measured in 1,400-byte datagrams per second: it bounds those only
    ceiling = Path(__file__).parent / "out" / "netem_udp_ceiling.csv"
    emu = emulator_rate_mbit(ceiling, lm[SITES]) if lm[MTU] == 1500 else None
    deadlines = ", ".join(f"{k} {v:g}" for k, v in RENDEZVOUS.items()) + " (set: they bound a run's time)"
    if lm[DEADLINES] == "derived":
        deadlines = "none set, every one derived by the rendezvous (`dtrain.rendezvous.deadlines`, default budget)"
    k = lm[CHANNELS]  # the setup's sentence on num_channels_per_peer: none at the default, 1
    channels = (
        f"\nTCP connections per peer: {k} (`--net.grpc.num-channels-per-peer {k}`: a gRPC push goes as {k} streams)."
    )
    return f"""Setup (as root): {lm[SITES]} `dtrain worker` processes + one `dtrain rendezvous` in netem namespaces; every link
{lm[RATE]:g} Mbit/s, {lm[DELAY]:g} ms one way (RTT {2 * lm[DELAY]:g} ms), MTU {lm[MTU]} bytes, random loss of packets arriving at a
site; task `{lm[TASK] or lm[SIZE]}`, H = {lm[H]}, int8; 1 warm-up + {lm[MEASURED]} measured round(s)
per loss. Limit = 2 x B / rate + 2 x RTT. The datagram path runs at `--max-rate-mbit {0.95 * lm[RATE]:g}
--max-datagram-bytes {max_datagram_bytes_for_mtu(lm[MTU])}`. Deadlines: {deadlines}.{channels if k != 1 else ""}
{files(prefix, png)}

{analyse(rows)}

{verdicts(rows, emu)}

{cpu_verdict(rows)}"""


SPEC = Spec(
    name="datagram_vs_grpc",
    title="Datagram path vs gRPC through netem",
    # one run per data path and seed, walking the losses
    modes={k: {"grid": [{"config": a, DATA_PATH: b, CC: c} for a, b, c in PATHS], **v} for k, v in MODES.items()},
    fixed=LINK,
    metrics=(("engine_s", 0.0, 600.0), ("limit_s", 0.0, 600.0), ("delivered", 0.0, 1.0)),
    report=report,
    verdict=lambda rows, rounds, m: [],  # its verdicts are paragraphs of the report (data path, CPU floor)
    execute=run_point,
    paths=(TASK, RATE, DELAY, LOSSES, MTU, MEASURED, SLEEP, DATA_PATH, CC, DEADLINES, CHANNELS),
    netem=True,
)
