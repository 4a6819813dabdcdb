"""How fast the command line answers: wall time of ``python -m dtrain ARGS`` for --help and
usage errors (median of N runs), and the import time ``-X importtime`` reports.

Prints one line per command: median and min wall seconds, exit code, and which heavy
modules (torch, grpc, numpy, matplotlib) the process imported (from ``-X importtime``).
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experiments import bench

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "grpc", "numpy", "matplotlib")
COMMANDS = [["--help"], *([sub, "--help"] for sub in ("launch", "worker", "rendezvous", "report"))]
COMMANDS += [  # usage errors
    ["launch", "--sites", "0"],
    ["worker", "--sync-every", "0"],
    ["worker", "--no-such-flag"],
    ["rendezvous", "--min-sites", "0"],
]


def _run(repo: Path, args: list[str], importtime: bool = False) -> tuple[float, float, int, str]:
    """(wall s, CPU s of the child, exit code, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(repo))
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "dtrain", *args]
    t0, c0 = time.perf_counter(), bench.cpu_s(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    return time.perf_counter() - t0, bench.cpu_s(resource.RUSAGE_CHILDREN) - c0, p.returncode, p.stderr


def _imports(stderr: str) -> tuple[float, list[str]]:
    """(total cumulative import seconds of top-level imports, heavy modules imported)."""
    rows = [ln.split("|") for ln in stderr.splitlines() if ln.startswith("import time:") and "|" in ln]
    # A top-level import's name is indented by one space, a nested one's by more.
    total_us = sum(int(p[1]) for p in rows if p[1].strip().isdigit() and not p[2].rstrip().startswith("  "))
    heavy = {p[2].strip().split(".")[0] for p in rows} & set(HEAVY)
    return total_us / 1e6, sorted(heavy)


def main() -> int:
    ap = bench.parser(__doc__, smoke="one run per command")
    ap.add_argument("--repo", type=Path, default=ROOT, help="checkout whose dtrain to run (default: this one)")
    ap.add_argument("--runs", type=int, default=5, help="runs per command (default 5)")
    a = ap.parse_args()
    runs = 1 if a.smoke else a.runs
    if not 1 <= runs <= 50:
        ap.error(f"--runs must be in [1, 50], got {a.runs}")
    figures = []
    print(f"repo {a.repo}, {runs} runs each")
    print(f"{'command':30} {'wall med':>8} {'min':>5} {'CPU med':>7} {'rc':>3} {'imports':>7}  heavy modules")
    for args in COMMANDS:
        timed = [_run(a.repo, args) for _ in range(runs)]
        walls, cpus, rc = [t[0] for t in timed], [t[1] for t in timed], timed[-1][2]
        imp_s, heavy = _imports(_run(a.repo, args, importtime=True)[3])
        figures.append(
            {"command": args, "walls_s": walls, "cpus_s": cpus, "rc": rc, "imports_s": imp_s, "heavy": heavy}
        )
        print(
            f"{' '.join(args):30} {statistics.median(walls):8.2f} {min(walls):5.2f} {statistics.median(cpus):7.2f} "
            f"{rc:3d} {imp_s:7.2f}  {', '.join(heavy) or '-'}"
        )
    print("seconds; imports: the top-level imports' cumulative time by -X importtime (one run)")
    bench.write(a, "cli_startup", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
