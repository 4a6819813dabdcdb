"""The one process harness (dtrain.app.procs): spawn, signal the group, stop with a grace
period, tail, wait. Children are tiny ``python -c`` programs (no torch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.app.procs import exit_text, spawn, stop_all, tail

pytestmark = pytest.mark.timeout(60)

# Prints its pid (and its child's), says "ready" and sleeps; SIGTERM -> "bye", exit 0.
GRACEFUL = """
import os, signal, subprocess, sys, time
# the grandchild gets the group's SIGINT too: its KeyboardInterrupt traceback must not go to the
# log, where it once landed inside the "bye 2" line under load
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stderr=subprocess.DEVNULL)
def bye(signum, frame):
    print("bye", signum, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
signal.signal(signal.SIGINT, bye)
print("child", child.pid, flush=True)
print("ready", flush=True)
for _ in range(600):
    time.sleep(0.1)
"""
STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
for _ in range(600):
    time.sleep(0.1)
"""


def _wait_for(path: Path, text: str, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = path.read_text() if path.exists() else ""
        if text in got:
            return got
        time.sleep(0.02)
    pytest.fail(f"{text!r} did not appear in {path}: {tail(path)!r}")


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    """The process is gone or a zombie within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("State:"))
        except (OSError, StopIteration):
            return True
        if "Z" in state.split()[1]:
            return True
        time.sleep(0.05)
    return False


def test_stop_sends_sigterm_to_the_group_and_the_child_exits_cleanly(tmp_path):
    log = tmp_path / "a" / "child.log"  # the directory is created
    p = spawn("graceful", [sys.executable, "-c", GRACEFUL], log)
    text = _wait_for(log, "ready")
    grandchild = int(text.split("child ")[1].split()[0])
    assert p.poll() is None and os.getpgid(p.pid) == p.pid  # its own session / process group
    assert p.stop(grace_s=10.0) == 0
    assert f"bye {int(signal.SIGTERM)}" in p.tail()
    assert _gone(grandchild), "the SIGTERM did not reach the child's process group"
    assert p.maxrss_kb is not None and p.maxrss_kb > 1000 and p.cpu_s is not None and p.cpu_s >= 0.0


def test_stop_kills_a_child_that_ignores_sigterm_after_the_grace_period(tmp_path):
    p = spawn("stubborn", [sys.executable, "-c", STUBBORN], tmp_path / "s.log")
    _wait_for(tmp_path / "s.log", "ready")
    t0 = time.monotonic()
    stop_all([p], grace_s=0.5)
    assert p.returncode == -signal.SIGKILL and exit_text(p.returncode) == "-9 (SIGKILL)"
    assert time.monotonic() - t0 < 10.0


def test_sigint_stop_wait_timeout_tail_and_append(tmp_path):
    log = tmp_path / "g.log"
    log.write_text("earlier run\n")
    p = spawn("graceful", [sys.executable, "-c", GRACEFUL], log, env=dict(os.environ, X="1"), cwd=tmp_path)
    _wait_for(log, "ready")
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout_s=0.1)
    assert p.stop(grace_s=10.0, sig=signal.SIGINT) == 0
    text = log.read_text()
    assert text.startswith("earlier run\n") and f"bye {int(signal.SIGINT)}" in text  # appended, not truncated
    assert tail(log, 2) == "".join(text.splitlines(keepends=True)[-2:])
    assert p.send(signal.SIGTERM) is False  # already exited: nothing sent
    assert tail(tmp_path / "missing.log") == "(no log)"


def test_kill_reaps_and_exit_codes_are_named(tmp_path):
    p = spawn("k", [sys.executable, "-c", STUBBORN], tmp_path / "k.log", append=False)
    _wait_for(tmp_path / "k.log", "ready")
    assert p.kill() == -signal.SIGKILL and p.poll() == -signal.SIGKILL
    assert exit_text(None) == "running" and exit_text(3) == "3"
    done = spawn("ok", [sys.executable, "-c", "raise SystemExit(7)"], tmp_path / "ok.log")
    assert done.wait(timeout_s=30) == 7


def test_cluster_refuses_what_it_cannot_do(tmp_path) -> None:
    """The one cluster harness: a spawner cannot run inside netem sites, a site needs its
    rendezvous first, and a wait past its bound raises naming what it waited for."""
    from dtrain.app.procs import Cluster

    with pytest.raises(ValueError, match="spawner must be None with a netem topology"):
        Cluster(tmp_path, topo=object(), spawner=lambda argv, env, log: None)
    c = Cluster(tmp_path, num_sites=2, worker={"size": "tiny"})
    with pytest.raises(RuntimeError, match="start the rendezvous first"):
        c.start_site(0)
    with pytest.raises(TimeoutError, match="timed out waiting for nothing"):
        c.wait(lambda: False, "nothing", timeout_s=0.1)
    assert c.host(1) == "127.0.0.1" and c.tail(0) == "(no log)" and c.lines(0) == []


def test_a_signal_another_thread_took_still_ends_wait_for_signal():
    """The kernel may hand a process's SIGTERM to any thread that does not block it (grpc's own
    threads do not). The C handler runs there; Python runs the handler on the main thread only
    when that thread next runs bytecode, so a main thread blocked in ``Event.wait`` is not
    woken: a ``dtrain rendezvous`` still ran 30 s after SIGTERM in a CI run. ``wait_for_signal``
    returns to the interpreter every ``SIGNAL_SLICE_S``."""
    import threading

    from dtrain.app.procs import SIGNAL_SLICE_S, wait_for_signal

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    stop = threading.Event()
    old = signal.signal(signal.SIGUSR1, lambda *_: stop.set())

    def another_thread_takes_it() -> threading.Thread:
        t = threading.Thread(
            target=lambda: (time.sleep(0.2), signal.pthread_kill(threading.get_ident(), signal.SIGUSR1))
        )
        t.start()
        return t

    try:
        t = another_thread_takes_it()
        assert stop.wait(2.0) is False  # the plain wait: the signal came at 0.2 s, the wait slept on
        t.join()
        assert stop.is_set()  # the handler ran once this thread ran bytecode again
        stop.clear()
        t = another_thread_takes_it()
        t0 = time.monotonic()
        assert wait_for_signal(stop, timeout_s=30.0) is True
        assert time.monotonic() - t0 < 0.2 + SIGNAL_SLICE_S + 5.0  # woken by a slice, not the 30 s limit
        t.join()
        stop.clear()
        assert wait_for_signal(stop, timeout_s=0.3) is False  # no signal: the limit
    finally:
        signal.signal(signal.SIGUSR1, old)
