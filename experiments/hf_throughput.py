"""Tokens per second of the ``hf`` task (a transformers Llama built from a config) per site, against
the built-in GPT at about the same parameter count, and the runtime's share of a step.

Per task, at ``torch.set_num_threads(1)`` (as ``dtrain launch`` runs): bare, the inner step alone
(forward, backward, AdamW; median over ``steps`` after 3 warm-up steps): tokens / step time; and
launch, ``dtrain launch --sites S`` on 127.0.0.1 for ``rounds`` rounds of H inner steps: per site,
tokens trained / (inner_s + sync_s) over its rounds, the runtime's share sync_s / (inner_s +
sync_s) and the inner-step slowdown against bare. On a shared 2-core machine the sites compete
with each other and other jobs: the launch's tokens/s per site is about bare / sites at best.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from experiments import bench
from experiments.common import ROOT, RunResult, inner_step, md_table
from experiments.lab import ROUNDS, SITES, SIZE, H, Point, Spec, files

TASK, HF, STEPS, LAUNCH = "task", "task_spec.hf.config", "lab.steps", "lab.launch"

MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(
        fixed={SITES: 1, SIZE: "tiny", HF: "tiny-llama", STEPS: 3, H: 3, ROUNDS: 1},
        grid=[{TASK: "builtin", LAUNCH: False}, {TASK: "hf", LAUNCH: True}],
    ),
    "quick": dict(fixed={SITES: 2, SIZE: "small", HF: "small-llama", STEPS: 40, H: 50, ROUNDS: 4}),
    "full": dict(fixed={SITES: 2, SIZE: "small", HF: "small-llama", STEPS: 100, H: 100, ROUNDS: 8}),
}


def bare(f: dict[str, Any]) -> dict[str, Any]:
    """The inner step alone: median seconds, tokens/s, parameter count, validation loss after."""
    from dtrain.tasks import HfSpec, TaskSpec, load_task

    torch.set_num_threads(1)
    hf = HfSpec(config=f[HF]) if f[TASK] == "hf" else HfSpec()
    t = load_task("hf" if f[TASK] == "hf" else "")(TaskSpec(size=f[SIZE], hf=hf))
    step_s = statistics.median(bench.times(lambda: inner_step(t), f[STEPS], warmup=3))
    return {
        "num_params": sum(p.numel() for p in t.model.parameters()),
        "tokens_per_step": t.tokens_per_batch,
        "bare_step_s": step_s,
        "bare_tokens_per_s": t.tokens_per_batch / step_s,
        "bare_val_loss": t.evaluate(t.model),
    }


def launch(f: dict[str, Any], tokens_per_step: int) -> dict[str, Any]:
    """One ``dtrain launch``; per-site figures averaged over the sites."""
    from dtrain.app.procs import child_env

    with tempfile.TemporaryDirectory(prefix="bench_hf_") as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "dtrain", "launch", "--sites", str(f[SITES]), "--size", f[SIZE]]
        cmd += ["--task", "hf", "--hf.config", f[HF]] if f[TASK] == "hf" else []
        cmd += ["--sync-every", str(f[H]), "--rounds", str(f[ROUNDS]), "--linger-s", "1"]
        cmd += ["--out", str(run), "--no-progress", "--no-export.final"]
        p = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"dtrain launch failed ({p.returncode}):\n{p.stderr[-3000:]}")
        per_site = []
        for i in range(f[SITES]):
            lines = [json.loads(x) for x in (run / f"site-{i}" / "metrics.jsonl").read_text().splitlines()]
            rounds = [d for d in lines if d["event"] == "round"]
            inner = sum(d["inner_s"] for d in rounds)
            sync = sum(d["sync_s"] for d in rounds)
            steps = f[H] * len(rounds)
            summary = json.loads((run / f"site-{i}" / "summary.json").read_text())
            per_site.append((steps * tokens_per_step / (inner + sync), sync / (inner + sync), inner / steps, summary))
    return {
        "launch_tokens_per_s": statistics.mean(s[0] for s in per_site),
        "sync_share": statistics.mean(s[1] for s in per_site),
        "launch_step_s": statistics.mean(s[2] for s in per_site),
        "final_val_loss": statistics.mean(s[3]["final_val_loss"] for s in per_site),
        "first_val_loss": statistics.mean(s[3]["first_val_loss"] for s in per_site),
    }


def measure(point: Point) -> RunResult:
    """The task's bare inner step and, where the point says so, its ``dtrain launch``."""
    f = point.settings
    row = point.row(model=f"gpt-{f[SIZE]}" if f[TASK] == "builtin" else f[HF], **bare(f))
    row["final_val_loss"] = row["bare_val_loss"]
    if f[LAUNCH]:
        row.update(launch(f, row["tokens_per_step"]))
        row["launch_slowdown"] = row["launch_step_s"] / row["bare_step_s"]
    return RunResult(row=row)


def _table_row(r: dict[str, Any]) -> list[str]:
    cells = [r["model"], f"{int(r['num_params']) / 1e6:.2f} M", f"{float(r['bare_step_s']) * 1e3:.1f}"]
    cells.append(f"{float(r['bare_tokens_per_s']):,.0f}")
    if r.get("launch_tokens_per_s") in ("", None):  # the bare step only
        return cells + ["-"] * 4
    return cells + [
        f"{float(r['launch_step_s']) * 1e3:.1f}",
        f"{float(r['launch_tokens_per_s']):,.0f}",
        f"{float(r['sync_share']) * 100:.1f}%",
        f"{float(r['first_val_loss']):.3f} -> {float(r['final_val_loss']):.3f}",
    ]


def report(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any], prefix: Path) -> str:
    f = m["fixed"]
    headers = ["model", "params", "bare step ms", "bare tok/s", "launch step ms", "launch tok/s/site"]
    headers += ["sync share", "val loss"]
    return f"""Setup: bytes as tokens, stdlib corpus, batch x context of size {f[SIZE]!r}, 1 thread per process;
launch: {f[SITES]} sites on 127.0.0.1 (gRPC, int8 codec), H = {f[H]}, {f[ROUNDS]} rounds.
tok/s/site = tokens trained / (inner_s + sync_s) over the rounds; sync share = sync_s / (inner_s + sync_s);
{files(prefix)}

{md_table(headers, [_table_row(r) for r in rows])}"""


def verdict(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], m: dict[str, Any]) -> list[str]:
    """The hf model's tokens per second per site under ``dtrain launch`` against the built-in GPT's."""
    launched = [r for r in rows if r.get("launch_tokens_per_s") not in ("", None)]
    by = {r["model"].startswith("gpt-"): r for r in launched}
    if set(by) != {True, False}:
        return []
    gpt, hf = by[True], by[False]
    ratio = float(hf["launch_tokens_per_s"]) / float(gpt["launch_tokens_per_s"])
    return [
        f"- At ~{int(hf['num_params']) / 1e6:.2f} M parameters the hf model ({hf['model']}) trains "
        f"{float(hf['launch_tokens_per_s']):,.0f} tokens/s per site under `dtrain launch` against the built-in "
        f"GPT's {float(gpt['launch_tokens_per_s']):,.0f} ({ratio:.2f}x); sync share "
        f"{float(hf['sync_share']) * 100:.1f}% / {float(gpt['sync_share']) * 100:.1f}%."
    ]


SPEC = Spec(
    name="hf_throughput",
    title="hf task vs built-in GPT: tokens per second per site",
    modes={k: {"seeds": [0], **v} for k, v in MODES.items()},  # jobs 1 (the default): timings, one run at a time
    grid={TASK: ["builtin", "hf"], LAUNCH: [True]},
    label=lambda point: point[TASK],
    metrics=(("bare_tokens_per_s", 0.0, 1e9), ("final_val_loss", 0.0, 10.0)),
    report=report,
    verdict=verdict,
    execute=measure,
    paths=(TASK, HF, STEPS, LAUNCH),
)
