"""One process harness: child processes in their own session, with a log file each.

Used by ``dtrain launch`` (:mod:`dtrain.app.launch`), the experiments
(``experiments/procs.py``, ``experiments/vs_torchft.py``) and the multi-process fault
tests (``tests/fault/conftest.py``), so that spawning, signalling, stopping with a grace
period, tailing a log and waiting are written once.

Every child starts in its own session (``start_new_session``): a terminal's Ctrl-C
reaches only the parent, and a signal sent with :meth:`Proc.send` reaches the child's
whole process group (a ``netem`` wrapper such as ``ip netns exec`` and what it runs).
A :class:`Proc` made by :func:`spawn` is reaped with ``os.wait4``, so its peak RSS and
CPU time are known once it has exited (:attr:`Proc.maxrss_kb`, :attr:`Proc.cpu_s`).

Every wait is bounded: :meth:`Proc.wait` raises ``subprocess.TimeoutExpired`` past its
timeout; :func:`stop_all` sends SIGTERM (or SIGINT), waits ``grace_s``, then SIGKILLs
what is left and waits at most :data:`KILL_WAIT_S` more.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import Iterable, Mapping, Protocol, Sequence

__all__ = ["ChildHandle", "KILL_WAIT_S", "Proc", "STOP_GRACE_S", "exit_text", "spawn", "stop_all", "tail"]

log = logging.getLogger(__name__)

#: seconds a child gets to exit after SIGTERM/SIGINT before it is killed (``dtrain launch``).
STOP_GRACE_S = 15.0
#: seconds to wait for a SIGKILLed child to be reaped.
KILL_WAIT_S = 10.0
_POLL_S = 0.02


class ChildHandle(Protocol):
    """What :class:`Proc` needs of a child: a ``subprocess.Popen`` or a test's forked child."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def tail(path: str | Path, n: int = 15) -> str:
    """The last ``n`` lines of the text file ``path`` (``"(no log)"`` when it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError:
        return "(no log)"


def exit_text(rc: int | None) -> str:
    """An exit code for people: ``-9 (SIGKILL)`` for a signal, ``None`` -> ``running``."""
    if rc is None:
        return "running"
    if rc < 0:
        try:
            return f"{rc} ({signal.Signals(-rc).name})"
        except ValueError:
            pass
    return str(rc)


class Proc:
    """One child process (in its own session) and its log.

    Args:
        name: a label for messages (``site-0``, ``rendezvous``).
        handle: the child (``subprocess.Popen`` or anything with ``pid``, ``poll`` and ``wait``).
        log_path: the file its stdout and stderr go to, or None.
    """

    def __init__(self, name: str, handle: ChildHandle, log_path: Path | None = None) -> None:
        self.name = name
        self.handle = handle
        self.log = Path(log_path) if log_path is not None else None
        self.started = time.time()
        self.returncode: int | None = None
        self.maxrss_kb: int | None = None  # peak RSS in KiB, known after exit (Popen children only)
        self.cpu_s: float | None = None  # user + system CPU seconds, known after exit (Popen children only)

    @property
    def pid(self) -> int:
        return self.handle.pid

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""
        if self.returncode is not None:
            return self.returncode
        if isinstance(self.handle, subprocess.Popen):
            self._reap_popen()
        else:
            self.returncode = self.handle.poll()
        return self.returncode

    def _reap_popen(self) -> None:
        p = self.handle
        assert isinstance(p, subprocess.Popen)
        if p.returncode is not None:  # reaped elsewhere (Popen.wait)
            self.returncode = p.returncode
            return
        try:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        except ChildProcessError:  # reaped by someone else: Popen reports 0, the code is lost
            self.returncode = p.poll()
            return
        if pid:
            self.returncode = p.returncode = os.waitstatus_to_exitcode(status)
            self.maxrss_kb = ru.ru_maxrss
            self.cpu_s = ru.ru_utime + ru.ru_stime

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait until it exits; returns its exit code.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout_s`` seconds.
            RuntimeError: a handle that is not a Popen lost its child (e.g. a test's zygote died).
        """
        if not isinstance(self.handle, subprocess.Popen):
            self.returncode = self.handle.wait(timeout_s)
            return self.returncode
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"{self.name} (pid {self.pid})", timeout_s or 0.0)
            time.sleep(_POLL_S)
        return self.returncode  # type: ignore[return-value]

    def send(self, sig: int) -> bool:
        """Send ``sig`` to the child's process group; False when it has already exited."""
        if self.poll() is not None:
            return False
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def kill(self, timeout_s: float = KILL_WAIT_S) -> int | None:
        """SIGKILL its process group and reap it (None if it is still not gone after ``timeout_s``)."""
        self.send(signal.SIGKILL)
        try:
            return self.wait(timeout_s)
        except (subprocess.TimeoutExpired, RuntimeError) as e:
            log.warning("%s (pid %d) not reaped after SIGKILL: %s", self.name, self.pid, e)
            return None

    def stop(self, grace_s: float = STOP_GRACE_S, sig: int = signal.SIGTERM) -> int | None:
        """``sig``, up to ``grace_s`` seconds to exit, then SIGKILL (see :func:`stop_all`)."""
        stop_all([self], grace_s, sig)
        return self.returncode

    def tail(self, n: int = 15) -> str:
        """The last ``n`` lines of its log."""
        return tail(self.log, n) if self.log is not None else "(no log)"

    def __repr__(self) -> str:
        return f"Proc({self.name!r}, pid={self.pid}, rc={exit_text(self.returncode)})"


def spawn(
    name: str,
    argv: Sequence[str],
    log_path: str | Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    append: bool = True,
) -> Proc:
    """Start ``argv`` in its own session with stdout and stderr going to ``log_path``.

    Args:
        name: the child's label.
        argv: the command (``[sys.executable, "-m", "dtrain", "worker", ...]``).
        log_path: the log file; its directory is created. ``append=False`` truncates it.
        env: the child's whole environment (default: this process's).
        cwd: its working directory (default: this process's).

    Returns:
        The running :class:`Proc`; stdin is ``/dev/null``.

    Raises:
        OSError: the program cannot be started (not found, not executable).
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab" if append else "wb") as f:
        p = subprocess.Popen(
            list(argv),
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=str(cwd) if cwd is not None else None,
            start_new_session=True,
        )
    return Proc(name, p, log_path)


def stop_all(procs: Iterable[Proc], grace_s: float = STOP_GRACE_S, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` (SIGTERM or SIGINT) to every running child, wait up to ``grace_s``
    seconds for all of them together, then SIGKILL and reap the rest (at most
    :data:`KILL_WAIT_S` each). Children that already exited are only reaped."""
    procs = list(procs)
    for p in procs:
        p.send(sig)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except (subprocess.TimeoutExpired, RuntimeError):
            log.warning("%s (pid %d) did not exit within %.0fs of %s; killing it", p.name, p.pid, grace_s, _name(sig))
            p.kill()


def _name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)
