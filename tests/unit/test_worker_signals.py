"""The worker's signal handling (``dtrain.app.worker.install_signal_handlers``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(60)

_CHILD = """
import sys, threading, time
from dtrain.app.worker import install_signal_handlers
stop = threading.Event()
install_signal_handlers(stop)
print("ready", flush=True)
while not stop.wait(0.05):
    pass
print("stopped", flush=True)
"""


def test_sigusr1_prints_every_threads_stack_and_goes_on_and_sigterm_stops() -> None:
    p = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert p.poll() is None  # still running: a stack dump, not an exit
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "stopped" in out
    assert "Current thread" in err or "Thread 0x" in err, err[-2000:]
    assert "stop.wait" in err or "<module>" in err, err[-2000:]
