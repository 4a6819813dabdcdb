"""Codec sweep: bytes per round against final validation loss, per pseudo-gradient codec.

N in-process DiLoCo sites train the built-in GPT once per codec (fp32, bf16, int8, int4, topk:
1% of each chunk with error feedback, each with and without the zstd stage; the means go back
with the same codec). For each: bytes per round (contributions pushed + means pulled), final
validation loss and its change against fp32 with the same seed (paired), the encode/decode
seconds the round engine recorded, and a micro-benchmark of encoding and decoding one real
pseudo-gradient of the whole model in the same chunks. topk runs with broadcast error feedback
on: the mean of N top-k contributions has up to N·k non-zeros, and its top-k loses the rest for
good otherwise.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

import torch

from dtrain.tasks import TaskSpec
from experiments.bench_codecs import bench_codec
from experiments.common import (
    BUCKETS_64K,
    RunResult,
    fmt_pm,
    md_rows,
    mean_std,
    pseudo_gradient,
    save_fig,
    subplots,
    summarize,
)
from experiments.lab import ROUNDS, SITES, SIZE, H, Spec, files, loss_columns, ppl_changes, seeds_and_mean
from experiments.loss_sweep import SMALL, VAL  # the smoke's short windows, the validation batches

CODEC = "diloco.rounds.codec.name"
ALL = [c + z for c in ["fp32", "bf16", "int8", "int4", "topk"] for z in ("", "+zstd")]
MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(seeds=[0], jobs=1, bench_repeats=1, grid={CODEC: ["fp32", "int8+zstd"]})
    | {"fixed": {SITES: 2, SIZE: "tiny", H: 2, ROUNDS: 2, VAL: 2, **SMALL}},
    "quick": dict(seeds=[0, 1, 2], jobs=2, bench_repeats=5, grid={CODEC: ALL})
    | {"fixed": {SITES: 4, SIZE: "tiny", H: 10, ROUNDS: 12, VAL: 16}},
    "full": dict(seeds=[0, 1, 2, 3, 4], jobs=max(1, (os.cpu_count() or 2) // 4), bench_repeats=10)
    | {"grid": {CODEC: ALL + ["fp16", "fp16+zstd"]}, "fixed": {SITES: 4, SIZE: "small", H: 50, ROUNDS: 30, VAL: 32}},
}


def add_bench(results: list[RunResult], m: dict[str, Any]) -> None:
    """``bench_*`` columns of every row (:func:`~experiments.bench_codecs.bench_codec` on a real Δ cut in
    the runs' chunks): CPU s of this thread to encode / decode all of Δ (median), bytes, rel. L2 error."""
    f = m["fixed"]
    torch.set_num_threads(1)
    spec = TaskSpec(site_index=0, seed=0, **{p[len("task_spec.") :]: f.get(p) for p in (SITES, SIZE, *SMALL)})
    # Δ = θ_0 − θ_H of one site after H inner steps from a briefly trained model
    delta = pseudo_gradient(spec, f["diloco.sync_every"], f["diloco.sync_every"])
    chunks, mb = list(torch.split(delta, BUCKETS_64K["diloco.buckets.chunk_bytes"] // 4)), delta.numel() * 4 / 1e6
    for name in m["grid"][CODEC]:
        b = bench_codec(name, chunks, m["bench_repeats"], f["diloco.rounds.codec.zstd_level"])
        cols = {"encode_s": mb / b["encode_mb_s"], "decode_s": mb / b["decode_mb_s"], "bytes": b["bytes"]}
        for r in results:
            if r.row["codec"] == name:
                r.row.update({f"bench_{k}": v for k, v in (cols | {"rel_err": b["rel_l2"]}).items()})


def findings(rows: list[dict[str, Any]], rounds: list[dict[str, Any]] | None = None, m: Any = None) -> list[str]:
    """Verdict lines under the table."""
    groups = summarize(rows)
    base = groups.get("fp32", [])
    bpr = {c: statistics.fmean(r["bytes_per_round_site"] for r in g) for c, g in groups.items()}  # bytes/round/site
    out, noise = [], 0.0
    if "fp32+zstd" in groups:
        nm, ns = mean_std(ppl_changes(groups["fp32+zstd"], base))
        noise = abs(nm) + ns
        out.append(
            f"- **Noise floor**: `fp32+zstd` does the same arithmetic as `fp32` (zstd is lossless), so its "
            f"perplexity change {nm * 100:+.2f}% ± {ns * 100:.2f}% is run-to-run noise (owners sum contributions "
            "in arrival order; the short runs amplify fp32 rounding differences)."
        )
    ok, bad = [], []
    for codec, g in groups.items():
        if codec == "fp32":
            continue
        dp = mean_std(ppl_changes(g, base))[0]
        what = f"`{codec}` ({bpr['fp32'] / bpr[codec]:.1f}x fewer bytes, {dp * 100:+.2f}%)"
        (ok if dp <= max(noise, 0.005) else bad).append(what)
    if ok:
        out.append(f"- Within max(noise, 0.5%) of fp32's perplexity: {', '.join(ok)}.")
    if bad:
        out.append(f"- Worse than that: {', '.join(bad)}.")
    if "topk" in groups:
        err = groups["topk"][0]["bench_rel_err"]
        out.append(
            f"- `topk` keeps 1% of each chunk: one round delivers {100 * (1 - err**2):.0f}% of a pseudo-gradient's "
            f"energy (relative L2 error {err:.2f}); error feedback sends the rest in later rounds, which in "
            "runs this short (and with outer Nesterov momentum on the sparse means) costs a lot of loss."
        )
    plain = {c: c.removesuffix("+zstd") for c in groups if c.endswith("+zstd")}
    zs = [f"{p} {bpr[p] / bpr[c]:.2f}x" for c, p in plain.items() if p in groups]
    if zs:
        out.append(f"- What the zstd stage (level 1) adds on top of each codec: {', '.join(zs)}.")
    return out


def analyse(rows: list[dict[str, Any]]) -> str:
    groups = summarize(rows)
    base = groups.get("fp32", [])
    bpr = {c: statistics.fmean(r["bytes_per_round_site"] for r in g) for c, g in groups.items()}  # bytes/round/site
    table = []
    for codec, g in groups.items():
        per_round = lambda k: [r[k] / max(1, r["rounds_done"]) / r["num_sites"] for r in g]  # noqa: E731
        bb = {k[len("bench_") :]: v for k, v in g[0].items() if k.startswith("bench_")}
        table.append(
            {
                "codec": f"`{codec}`",
                "runs": len(g),
                "kB/round/site": f"{bpr[codec] / 1e3:.1f}",
                "vs fp32": f"{bpr.get('fp32', float('nan')) / bpr[codec]:.1f}x",
                **loss_columns(g, base, "fp32"),
                "encode ms/round/site (rounds)": fmt_pm(per_round("encode_s"), "{:.1f}", 1e3),
                "decode ms/round/site (rounds)": fmt_pm(per_round("decode_s"), "{:.1f}", 1e3),
                "encode ms (bench, whole Δ)": f"{bb.get('encode_s', float('nan')) * 1e3:.1f}",
                "decode ms (bench, whole Δ)": f"{bb.get('decode_s', float('nan')) * 1e3:.1f}",
                "rel. L2 error (bench)": f"{bb.get('rel_err', float('nan')):.2e}",
                "sync s/round": fmt_pm([r["sync_s"] / max(1, r["rounds_done"]) for r in g], "{:.2f}"),
                "rejected": sum(r["rejected"] for r in g),
            }
        )
    return md_rows(table)


def plot(rows: list[dict[str, Any]], prefix: Path) -> Path:
    groups = summarize(rows)
    base = groups.get("fp32", [])
    names = list(groups)
    fig, (a1, a2) = subplots(1, 2, figsize=(10, 4.2))
    kb = [statistics.fmean(r["bytes_per_round_site"] for r in groups[c]) / 1e3 for c in names]
    colors = ["tab:orange" if c.endswith("+zstd") else "tab:blue" for c in names]
    a1.bar(range(len(names)), kb, color=colors)
    for i, c in enumerate(names):
        a1.text(i, kb[i], f"{kb[i]:.0f}", ha="center", va="bottom", fontsize=7)
        seeds_and_mean(a2, i, [100 * x for x in ppl_changes(groups[c], base)], colors[i])
    a2.axhline(0, color="0.6", lw=0.8)
    a2.set_yscale("symlog", linthresh=1.0)  # linear within ±1%, logarithmic beyond
    a1.set(yscale="log", ylabel="kB per round per site (log)")
    a1.set_title("Bytes on the wire per round (blue: plain, orange: +zstd)", fontsize=9)
    a2.set_ylabel("Δ perplexity vs fp32 (%, symlog)")
    a2.set_title("Final validation perplexity change, paired by seed (mean ± std)", fontsize=9)
    for ax in (a1, a2):
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    return save_fig(fig, prefix.with_suffix(".png"))


def report(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any], prefix: Path) -> str:
    """Setup, the table (:func:`analyse`) and the plot of one sweep."""
    f = m["fixed"]
    png = plot(rows, prefix)
    return f"""Setup: {f["task_spec.num_sites"]} sites as threads over the in-process transport (no faults), built-in GPT
`{f["task_spec.size"]}` ({rows[0]["num_params"]:,} parameters) on the stdlib source, H = {f["diloco.sync_every"]},
{f["rounds"]} rounds, 64 KiB buckets of 16 KiB chunks (each chunk encoded on its own, 32-byte header), zstd level
{f["diloco.rounds.codec.zstd_level"]}, topk keeps 1% per chunk with error feedback on both sides. Means are sent back
with the same codec. Δ against fp32 with the same seed (same data and init). Mean ± std over seeds {m["seeds"]}.
"Bench" columns: CPU time of one thread to encode / decode one real pseudo-gradient of the whole model (H inner
steps) chunk by chunk, median of {m["bench_repeats"]}. Encode/decode "rounds" columns: what the round engine recorded
(contribution and mean encoding; mean decoding; owners' decoding of contributions is not timed by the engine). The
engine's times are wall-clock inside a process whose site threads share one GIL: several times the single-thread CPU
times of the bench columns. {files(prefix, png)}

{analyse(rows)}
"""


SPEC = Spec(
    name="codec_sweep",
    title="Codec sweep",
    modes=MODES,
    fixed={**BUCKETS_64K, "diloco.rounds.codec.zstd_level": 1, "inproc.track_drift": False},
    label=lambda point: point[CODEC],
    # the mean of N top-k contributions has up to N·k non-zeros: its top-k loses the rest unless fed back
    derive=lambda point: {"diloco.rounds.broadcast_error_feedback": point[CODEC].startswith("topk")},
    columns=lambda point: {"zstd": point[CODEC].endswith("+zstd"), "base_codec": point[CODEC].split("+")[0]},
    metrics=(("final_val_loss", 0.0, 10.0), ("bytes_per_round_site", 1.0, 1e12), ("bench_rel_err", 0.0, 1.0)),
    after_runs=add_bench,
    report=report,
    verdict=findings,
)
