"""Tokens per second of the ``hf`` task (a transformers Llama built from a config) per site,
against the built-in GPT at about the same parameter count, and the runtime's share of a step.

Two measurements per task, both at ``torch.set_num_threads(1)`` (how ``dtrain launch`` runs):

* bare: the inner step alone (forward, backward, AdamW) in this process, no DiLoCo, median
  over ``steps`` steps after 3 warm-up steps: tokens / step time;
* launch: ``dtrain launch --sites S`` on 127.0.0.1 for ``rounds`` rounds of H inner steps:
  per site, tokens trained / (inner_s + sync_s) summed over its rounds (metrics.jsonl), and
  the runtime's share = sync_s / (inner_s + sync_s) plus the inner-step slowdown against
  bare (DiLoCo's per-step bookkeeping, other sites' processes on the same cores).

Usage::

    python -m experiments.hf_throughput --quick     # small (0.44 M) GPT vs small-llama (0.43 M)
    python -m experiments.hf_throughput --smoke     # seconds: tiny sizes, one 1-site launch

On the shared 2-core machine every site's process competes with the others' and with
other jobs, so the launch's tokens/s per site is about bare / sites at best.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from experiments.common import (
    ROOT,
    RunResult,
    base_parser,
    md_table,
    mode_settings,
    out_prefix,
    publish,
    run_or_load,
)

__all__ = ["main"]

MODES: dict[str, dict[str, Any]] = {
    "smoke": {
        "num_sites": 1,
        "size": "tiny",
        "hf": "tiny-llama",
        "steps": 3,
        "sync_every": 3,
        "rounds": 1,
        "seeds": [0],
        "launch_tasks": ["hf"],
    },
    "quick": {
        "num_sites": 2,
        "size": "small",
        "hf": "small-llama",
        "steps": 40,
        "sync_every": 50,
        "rounds": 4,
        "seeds": [0],
        "launch_tasks": ["builtin", "hf"],
    },
    "full": {
        "num_sites": 2,
        "size": "small",
        "hf": "small-llama",
        "steps": 100,
        "sync_every": 100,
        "rounds": 8,
        "seeds": [0],
        "launch_tasks": ["builtin", "hf"],
    },
}


def _task_args(task: str, m: dict[str, Any]) -> list[str]:
    return ["--size", m["size"], *(["--task", "hf", "--hf.config", m["hf"]] if task == "hf" else [])]


def bare(task: str, m: dict[str, Any]) -> dict[str, Any]:
    """The inner step alone: median seconds, tokens/s, parameter count, validation loss after."""
    from dtrain.tasks import HfSpec, TaskSpec, load_task

    torch.set_num_threads(1)
    hf = HfSpec(config=m["hf"]) if task == "hf" else HfSpec()
    t = load_task("hf" if task == "hf" else "")(TaskSpec(size=m["size"], hf=hf))
    times = []
    for i in range(m["steps"] + 3):
        t0 = time.perf_counter()
        t.loss(t.model, next(t.batches)).backward()
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {
        "num_params": sum(p.numel() for p in t.model.parameters()),
        "tokens_per_step": t.tokens_per_batch,
        "bare_step_s": step_s,
        "bare_tokens_per_s": t.tokens_per_batch / step_s,
        "bare_val_loss": t.evaluate(t.model),
    }


def launch(task: str, m: dict[str, Any], tokens_per_step: int) -> dict[str, Any]:
    """One ``dtrain launch``; per-site figures averaged over the sites."""
    with tempfile.TemporaryDirectory(prefix="bench_hf_") as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "dtrain", "launch", "--sites", str(m["num_sites"]), *_task_args(task, m)]
        cmd += ["--sync-every", str(m["sync_every"]), "--rounds", str(m["rounds"]), "--linger-s", "1"]
        cmd += ["--out", str(run), "--no-progress", "--no-export.final"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"dtrain launch failed ({p.returncode}):\n{p.stderr[-3000:]}")
        per_site = []
        for i in range(m["num_sites"]):
            lines = [json.loads(x) for x in (run / f"site-{i}" / "metrics.jsonl").read_text().splitlines()]
            rounds = [d for d in lines if d["event"] == "round"]
            inner = sum(d["inner_s"] for d in rounds)
            sync = sum(d["sync_s"] for d in rounds)
            steps = sum(m["sync_every"] for _ in rounds)
            summary = json.loads((run / f"site-{i}" / "summary.json").read_text())
            per_site.append((steps * tokens_per_step / (inner + sync), sync / (inner + sync), inner / steps, summary))
    return {
        "launch_tokens_per_s": statistics.mean(s[0] for s in per_site),
        "sync_share": statistics.mean(s[1] for s in per_site),
        "launch_step_s": statistics.mean(s[2] for s in per_site),
        "final_val_loss": statistics.mean(s[3]["final_val_loss"] for s in per_site),
        "first_val_loss": statistics.mean(s[3]["first_val_loss"] for s in per_site),
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = base_parser(__doc__).parse_args(argv)
    mode, m = mode_settings(args, MODES)
    prefix = out_prefix(args, "hf_throughput")

    def runner() -> list[RunResult]:
        out = []
        for task in ("builtin", "hf"):
            row: dict[str, Any] = {"experiment": "hf_throughput", "config": task, "seed": 0}
            row["model"] = f"gpt-{m['size']}" if task == "builtin" else m["hf"]
            row.update(bare(task, m))
            row["final_val_loss"] = row["bare_val_loss"]
            if task in m["launch_tasks"]:
                row.update(launch(task, m, row["tokens_per_step"]))
                row["launch_slowdown"] = row["launch_step_s"] / row["bare_step_s"]
            print(row, flush=True)
            out.append(RunResult(row=row))
        return out

    rows, _, meta = run_or_load(args, argv, "hf_throughput.py", prefix, runner)
    table = []
    for r in rows:
        launched = "launch_tokens_per_s" in r and r["launch_tokens_per_s"] not in ("", None)
        table.append(
            [
                r["model"],
                f"{int(r['num_params']) / 1e6:.2f} M",
                f"{float(r['bare_step_s']) * 1e3:.1f}",
                f"{float(r['bare_tokens_per_s']):,.0f}",
                f"{float(r['launch_step_s']) * 1e3:.1f}" if launched else "-",
                f"{float(r['launch_tokens_per_s']):,.0f}" if launched else "-",
                f"{float(r['sync_share']) * 100:.1f}%" if launched else "-",
                f"{float(r['first_val_loss']):.3f} -> {float(r['final_val_loss']):.3f}" if launched else "-",
            ]
        )
    headers = [
        "model",
        "params",
        "bare step ms",
        "bare tok/s",
        "launch step ms",
        "launch tok/s/site",
        "sync share",
        "val loss",
    ]
    body = f"""Command: `{meta["command"]}` ({meta["minutes"]:.1f} min; {meta["provenance"]}).

Setup: bytes as tokens, stdlib corpus, batch x context of size {m["size"]!r}, 1 thread per process;
launch: {m["num_sites"]} sites on 127.0.0.1 (gRPC, int8 codec), H = {m["sync_every"]}, {m["rounds"]} rounds.
tok/s/site = tokens trained / (inner_s + sync_s) over the rounds; sync share = sync_s / (inner_s + sync_s);
CSV: `{prefix.with_suffix(".csv").name}`.

{md_table(headers, table)}
"""
    publish(args, f"hf_throughput-{mode}", f"hf task vs built-in GPT: tokens per second per site ({mode})", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
