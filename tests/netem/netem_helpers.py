"""Helpers for the netem tests (imported by conftest.py before anything imports netem).

Each pytest process uses its own namespace prefix and state directory, so concurrent
runs (and `python -m netem cleanup` inside the tests) never touch each other, and the
leftover check after every test only looks at what this process could have made.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_TAG = f"{os.getpid()}"
os.environ["DTRAIN_NETEM_PREFIX"] = f"dtnetem{_TAG}-"
os.environ["DTRAIN_NETEM_STATE"] = f"/run/dtrain-netem-test{_TAG}"

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # netem/ is repository tooling, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

import netem  # noqa: E402  (after the environment above)
from netem._sys import list_namespaces  # noqa: E402

_MISSING: list[str] | None = None


def netem_missing() -> list[str]:
    global _MISSING
    if _MISSING is None:
        _MISSING = netem.missing_requirements()
    return _MISSING


def _agent_pids() -> list[int]:
    """Helper processes of this test process (their state dir names our tag): agents and
    the compiled delayers they start (``netem-delayer ... --state-dir DIR``)."""
    marker = str(netem.STATE_ROOT).encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if (b"netem._agent" in cmd or b"netem-delayer" in cmd) and marker in cmd:
                pids.append(int(entry))
    return pids


def leftovers() -> list[str]:
    """Everything of this process's harness that still exists."""
    out = [f"namespace {ns}" for ns in list_namespaces() if ns.startswith(netem.PREFIX)]
    out += [f"agent process {pid}" for pid in _agent_pids()]
    if netem.STATE_ROOT.exists():
        out += [f"state {p}" for p in [netem.STATE_ROOT, *netem.STATE_ROOT.iterdir()]]
    return out


def run_cli(*args: str, check: bool = True, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """``python -m netem ARGS`` with this process's prefix and state directory."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "netem", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
        cwd=str(REPO_ROOT),
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"netem {' '.join(args)} failed ({proc.returncode}): {proc.stdout}\n{proc.stderr}")
    return proc
