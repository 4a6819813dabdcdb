"""Cleanup on every kind of exit, the CLI, and `cleanup` touching only its own names."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from netem_helpers import REPO_ROOT, leftovers, run_cli

from netem import Topology
from netem._sys import list_namespaces

pytestmark = pytest.mark.netem

_CHILD = textwrap.dedent("""
    import faulthandler, signal, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks where it is stuck
    # Ctrl-C as in a terminal, whatever the test runner inherited: a background job of a
    # non-interactive shell (how CI may start .ci/run) starts with SIGINT ignored, Python
    # then installs no KeyboardInterrupt handler, netem rightly leaves an ignored signal
    # alone, and the SIGINT below would be ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {repo!r})
    from netem import Topology
    def body(topo):
        topo.set_link(None, delay_ms=5.0)  # starts the helper process
        print("ready", topo.status()["agent"]["pid"], flush=True)
        time.sleep(60)
    if {use_with}:
        with Topology(2, "lan", name={name!r}) as topo:
            body(topo)
    else:
        body(Topology(2, "lan", name={name!r}))
""")


def _start_child(name: str, use_with: bool) -> tuple[subprocess.Popen, int]:
    code = _CHILD.format(repo=str(REPO_ROOT), name=name, use_with=use_with)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("ready"), (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, int(line.split()[1])


def _realtime_processes() -> list[str]:
    """Processes running under a real-time policy (they can starve everything else)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.sched_getscheduler(int(entry)) & ~os.SCHED_RESET_ON_FORK in (os.SCHED_FIFO, os.SCHED_RR):
                    out.append(f"{entry} {Path(f'/proc/{entry}/cmdline').read_bytes()[:120]!r}")
            except OSError:
                continue
    return out


def _communicate_or_explain(proc: subprocess.Popen, timeout_s: float) -> str:
    """The child's stderr once it exited; if it does not within ``timeout_s``, fail with where it
    was (its Python stacks, via SIGUSR1 + faulthandler), the load and the real-time processes."""
    try:
        return proc.communicate(timeout=timeout_s)[1]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2.0)
        proc.kill()
        err = proc.communicate()[1]
        pytest.fail(
            f"child still running {timeout_s:.0f} s after the signal; load {Path('/proc/loadavg').read_text().strip()};"
            f" real-time processes {_realtime_processes()}; leftovers {leftovers()}; its stderr:\n{err[-6000:]}"
        )


def _wait_clean(timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    return leftovers()


@pytest.mark.timeout(20)
def test_exception_in_with_block_removes_everything():
    with pytest.raises(RuntimeError, match="boom"):
        with Topology(2, "lan") as topo:
            topo.set_link(None, delay_ms=2.0)
            namespaces = [*topo.site_namespaces, topo.hub_namespace]
            assert set(namespaces) <= set(list_namespaces())
            raise RuntimeError("boom")
    assert not set(namespaces) & set(list_namespaces())
    assert topo.closed


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "sig, use_with",
    [
        (signal.SIGTERM, False),  # after cleanup, the default action: killed by SIGTERM
        (signal.SIGINT, True),  # after cleanup, KeyboardInterrupt (Python exits with -SIGINT)
    ],
)
def test_signal_tears_down(sig, use_with):
    proc, agent_pid = _start_child(f"sig{int(sig)}", use_with)
    assert os.sched_getscheduler(agent_pid) == os.SCHED_FIFO  # delayer runs real-time
    proc.send_signal(sig)
    err = _communicate_or_explain(proc, 15.0)
    assert proc.returncode == -sig, err[-2000:]
    assert "tearing down 1 netem topologies" in err, err[-2000:]
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in err
    assert leftovers() == []


@pytest.mark.timeout(30)
def test_sigkilled_owner_is_cleaned_up_by_the_helper():
    proc, agent_pid = _start_child("killed", False)
    proc.kill()
    proc.wait(timeout=5)
    assert _wait_clean(10.0) == []


@pytest.mark.timeout(20)
def test_name_collision_is_refused():
    with Topology(1, "lan", name="dup") as topo:
        with pytest.raises(ValueError, match="already exists"):
            Topology(1, "lan", name="dup")
        assert topo.address(0) == "198.18.0.1"


@pytest.mark.timeout(90)
def test_cli_up_set_exec_status_down():
    name = "cli"
    run_cli("up", "--sites", "2", "--profile", "continental", "--name", name)
    try:
        st = json.loads(run_cli("status", "--name", name, "--json").stdout)
        assert st["agent_alive"], st  # the helper outlives `up`
        assert [link["delay_ms"] for link in st["links"]] == [15.0, 15.0]
        run_cli("set", "1", "--delay-ms", "5", "--jitter-ms", "0", "--name", name)
        out = run_cli(
            "exec", "0", "--name", name, "--", "ping", "-n", "-c", "5", "-i", "0.05", st["addresses"][1]
        ).stdout
        avg = float(re.search(r"= [\d.]+/([\d.]+)/", out)[1])
        assert abs(avg - 20.0) <= 0.1 * 20 + 2, out  # 15 ms to site 0 + 5 ms to site 1
        run_cli("set", "1", "--partition", "on", "--name", name)
        blocked = run_cli(
            "exec",
            "0",
            "--name",
            name,
            "--",
            "ping",
            "-n",
            "-c",
            "2",
            "-i",
            "0.1",
            "-W",
            "1",
            st["addresses"][1],
            check=False,
        )
        assert blocked.returncode == 1 and "100% packet loss" in blocked.stdout, blocked.stdout
        run_cli("set", "all", "--partition", "off", "--rate-mbit", "none", "--name", name)
        st = json.loads(run_cli("status", "--name", name, "--json").stdout)
        assert st["partitions"] == [] and st["links"][1]["rate_mbit"] is None
        assert "topology cli: 2 sites" in run_cli("status").stdout
    finally:
        run_cli("down", "--name", name)
    assert leftovers() == []
    assert run_cli("set", "0", "--delay-ms", "1", "--name", name, check=False).returncode == 2


@pytest.mark.timeout(60)
def test_cleanup_removes_only_its_own_prefix():
    foreign = f"dtnetemkeep{os.getpid()}"  # looks similar, but is not ours
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        run_cli("up", "--sites", "2", "--profile", "transatlantic", "--name", "left")
        assert any(ns.startswith(os.environ["DTRAIN_NETEM_PREFIX"]) for ns in list_namespaces())
        out = run_cli("cleanup").stdout
        assert "removed agent process" in out and "removed namespace" in out, out
        assert leftovers() == []
        assert foreign in list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", foreign], check=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("required", [False, True])
def test_without_root_the_tests_skip_or_fail_with_the_reason(required):
    env = dict(os.environ, PYTHONPATH=f"{REPO_ROOT}/tests/netem{os.pathsep}{REPO_ROOT}")
    env.pop("DTRAIN_NETEM_REQUIRED", None)
    if required:
        env["DTRAIN_NETEM_REQUIRED"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rsf",
            "-p",
            "fake_nonroot_plugin",
            "-p",
            "no:cacheprovider",
            "tests/netem/test_netem_partition.py",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(REPO_ROOT),
        timeout=50,
    )
    out = proc.stdout
    assert "netem harness unavailable: not root (euid 1000)" in out, out[-3000:]
    if required:
        assert proc.returncode == 1 and "3 errors" in out, out[-3000:]  # fails at setup
    else:
        assert proc.returncode == 0 and "3 skipped" in out, out[-3000:]
