"""One process harness: child processes in their own session, with a log file each.

Used by ``dtrain launch`` (:mod:`dtrain.app.launch`), the experiments and the
multi-process fault tests, so that spawning, signalling, stopping with a grace period,
tailing a log and waiting are written once. :class:`Cluster` is the one harness of a
``dtrain rendezvous`` and its ``dtrain worker`` processes that the experiments
(``experiments/site_failures.py``, the netem sweeps, ``chaos.py``) and the fault tests
(``tests/fault/conftest.py``, which adds its forking zygote and short timeouts) share.

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

import atexit
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from dtrain.app.config import RENDEZVOUS, WORKER
from dtrain.metrics import read_metrics

__all__ = [
    "ChildHandle",
    "Cluster",
    "KILL_WAIT_S",
    "Proc",
    "STOP_GRACE_S",
    "child_env",
    "exit_text",
    "flags",
    "spawn",
    "stop_all",
    "tail",
    "wait_for_signal",
]

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


#: the longest a main thread waits on an event without running Python (:func:`wait_for_signal`)
SIGNAL_SLICE_S = 0.5


def wait_for_signal(stop: threading.Event, timeout_s: float | None = None) -> bool:
    """Wait until ``stop`` is set (by a SIGINT/SIGTERM handler) or ``timeout_s`` seconds pass
    (None: no limit), in slices of :data:`SIGNAL_SLICE_S`; whether it was set.

    Call it on the main thread. Python runs a signal's handler on the main thread only, the
    next time that thread runs bytecode, but the kernel delivers a process's signal to any
    thread that does not block it: grpc's own threads do not. A signal delivered there does
    not wake a main thread blocked in ``stop.wait()`` with no timeout, and the process never
    stops (a ``dtrain rendezvous`` was still running 30 s after SIGTERM in a CI run). Each
    slice returns to the interpreter, which then runs the handler."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not stop.is_set():
        left = SIGNAL_SLICE_S if deadline is None else min(SIGNAL_SLICE_S, deadline - time.monotonic())
        if left <= 0:
            break
        stop.wait(left)
    return stop.is_set()


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


# ----------------------------------------------------------------------------- a cluster
#: the directory holding the ``dtrain`` package: children run ``python -m dtrain`` from it
CHECKOUT = Path(__file__).resolve().parents[2]
_LIVE: set[Proc] = set()  # every Cluster child still running: SIGKILLed at exit


@atexit.register
def _kill_leftovers() -> None:  # pragma: no cover - only when a Cluster was not closed
    for p in list(_LIVE):
        p.kill()


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a ``python -m dtrain`` child: this checkout first on
    ``PYTHONPATH``, one BLAS thread, unbuffered output, no inherited ``DTRAIN_TEST_FAULT``;
    then ``extra``."""
    env = dict(
        os.environ,
        PYTHONPATH=str(CHECKOUT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("DTRAIN_TEST_FAULT", None)
    env.update(extra or {})
    return env


def flags(opts: Mapping[str, Any], tree=WORKER) -> list[str]:
    """``{"reduce_timeout_s": 2}`` -> ``["--rendezvous.reduce-timeout-s", "2"]``: the flags of
    ``tree``'s options by path, key or short name (booleans ``--x`` / ``--no-x``; None left out)."""
    return tree.to_argv({k: v for k, v in opts.items() if v is not None})


def _site(site: int | str) -> str:
    return f"site-{site}" if isinstance(site, int) else site


class Cluster:
    """One ``dtrain rendezvous`` and its ``dtrain worker`` processes, all under ``root``.

    Layout: ``root/rendezvous-<k>.log`` (the k-th start) and ``root/<site>/`` per site (its
    ``worker.log``, ``metrics.jsonl``, ``summary.json``). Sites are named ``site-<i>``;
    every method taking a site takes that name or the index ``i``.

    Args:
        root: the directory of the run.
        num_sites: the workers' ``--num-sites`` unless :meth:`start_site` says otherwise.
        rendezvous, worker: options (by tree path, key or short name) of every rendezvous /
            worker start, under the ones a start gives.
        topo: a ``netem.Topology`` with a site per worker and one more for the rendezvous (the
            last, as ``dtrain launch --netem`` places it), or None for 127.0.0.1.
        spawner: ``(argv, env, log) -> ChildHandle`` to start ``dtrain ARGV`` some other way (a
            test's forking zygote); None: ``python -m dtrain`` subprocesses. Not with ``topo``.
        timeout_s: bound on the whole run: every :meth:`wait` raises past it.

    Every wait is bounded and raises ``TimeoutError`` naming what it waited for, with the
    tails of every log; :meth:`close` SIGKILLs every child (so does interpreter exit).
    """

    def __init__(
        self,
        root: Path,
        *,
        num_sites: int | None = None,
        rendezvous: Mapping[str, Any] | None = None,
        worker: Mapping[str, Any] | None = None,
        topo=None,
        spawner: Callable[[list[str], dict[str, str], Path], ChildHandle] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if spawner is not None and topo is not None:
            raise ValueError("spawner must be None with a netem topology (children run inside its sites)")
        self.root, self.num_sites, self.topo, self.spawner = Path(root), num_sites, topo, spawner
        self.rendezvous_defaults = dict(rendezvous or {})
        self.worker_defaults = dict(worker or {})
        self.procs: dict[str, Proc] = {}
        self.logs: dict[str, Path] = {}
        self.rv_address: str | None = None
        self._rv_starts = 0
        self.env = child_env()
        self.deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s

    # ------------------------------------------------------------------ processes
    def host(self, i: int) -> str:
        """Site ``i``'s address (``i == num_sites``: the rendezvous's site under netem)."""
        return self.topo.address(i) if self.topo is not None else "127.0.0.1"

    def spawn(self, name: str, index: int, argv: list[str], log: Path, env: Mapping[str, str] | None = None) -> Proc:
        """Start ``dtrain ARGV`` as ``name`` (inside netem site ``index`` with a topology)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**self.env, **(env or {})}
        if self.spawner is not None:
            p = Proc(name, self.spawner(argv, full_env, log), log)
        else:
            cmd = [sys.executable, "-m", "dtrain", *argv]
            if self.topo is not None:
                cmd = self.topo.exec_argv(index, cmd)
            p = spawn(name, cmd, log, env=full_env, cwd=CHECKOUT)
        self.procs[name], self.logs[name] = p, log
        _LIVE.add(p)
        return p

    def wait(self, pred: Callable[[], Any], what: str, timeout_s: float | None = None, poll_s: float = 0.05) -> Any:
        """Poll ``pred`` until it returns something truthy (returned); TimeoutError naming ``what``
        after ``timeout_s`` or past the run's bound."""
        deadline = min(self.deadline, math.inf if timeout_s is None else time.monotonic() + timeout_s)
        while True:
            v = pred()
            if v:
                return v
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}; the logs:\n{self.diag()}")
            time.sleep(poll_s)

    def start_rendezvous(self, bind: str | None = None, **opts: Any) -> str:
        """Start (or restart, e.g. on the old ``bind`` host:port) the rendezvous with
        ``RendezvousServerConfig`` options ``opts``; returns its address once it listens.

        Raises:
            RuntimeError: it exited before writing its address (with its log's tail).
        """
        self._rv_starts += 1
        addr = self.root / f"rendezvous-{self._rv_starts}.addr"
        bind = bind or f"{self.host(self.num_sites or 0) if self.topo is not None else '127.0.0.1'}:0"
        argv = ["rendezvous", "--bind", bind, "--address-file", str(addr)]
        argv += flags({**self.rendezvous_defaults, **opts}, RENDEZVOUS)
        p = self.spawn("rendezvous", self.num_sites or 0, argv, self.root / f"rendezvous-{self._rv_starts}.log")
        self.wait(
            lambda: (addr.exists() and addr.read_text().strip()) or p.poll() is not None, "the rendezvous address", 60
        )
        if p.poll() is not None:
            raise RuntimeError(f"the rendezvous exited with {exit_text(p.returncode)}:\n{p.tail()}")
        self.rv_address = addr.read_text().strip()
        return self.rv_address

    def start_site(
        self,
        index: int,
        *,
        num_sites: int | None = None,
        fault: str | None = None,
        listen: str | None = None,
        out_name: str | None = None,
        env: Mapping[str, str] | None = None,
        resume: bool = False,
        **opts: Any,
    ) -> str:
        """Start worker ``site-<index>`` with ``WorkerConfig`` options ``opts`` (site id and index,
        sites, listen address, rendezvous and out dir filled in); ``fault`` sets ``DTRAIN_TEST_FAULT``;
        ``resume`` adds ``--resume``. Returns the site's name."""
        if not self.rv_address:
            raise RuntimeError("start the rendezvous first")
        n = num_sites or self.num_sites
        if n is None:
            raise ValueError("num_sites: give it to the Cluster or to start_site")
        site = f"site-{index}"
        out = self.root / (out_name or site)
        argv = ["worker", "--site-id", site, "--site-index", str(index), "--num-sites", str(n)]
        argv += ["--listen", listen or f"{self.host(index)}:0", "--rendezvous", self.rv_address, "--out-dir", str(out)]
        argv += flags({**self.worker_defaults, **opts}, WORKER)
        if resume:
            argv.append("--resume")
        self.spawn(
            site, index, argv, out / "worker.log", {**(env or {}), **({"DTRAIN_TEST_FAULT": fault} if fault else {})}
        )
        return site

    def start(
        self, num_sites: int, *, faults: str | None = None, site_opts: dict[int, dict] | None = None, **rv_opts: Any
    ) -> list[str]:
        """Start the rendezvous (round 0 waits for ``num_sites``) and ``num_sites`` workers."""
        rv_opts.setdefault("initial_sites", num_sites)
        self.start_rendezvous(**rv_opts)
        return [
            self.start_site(i, num_sites=num_sites, fault=faults, **(site_opts or {}).get(i, {}))
            for i in range(num_sites)
        ]

    def signal(self, name: int | str, sig: int) -> None:
        """Send ``sig`` to ``name``'s process group. Raises RuntimeError when it already exited."""
        p = self.procs[_site(name)]
        if not p.send(sig):
            raise RuntimeError(f"{p.name} already exited with {exit_text(p.returncode)}")

    def kill(self, name: int | str) -> None:
        """SIGKILL ``name``'s process group and reap it."""
        self.procs[_site(name)].kill()

    def wait_exit(self, name: int | str, timeout_s: float) -> int:
        """``name``'s exit code; TimeoutError (with the logs) when it runs past ``timeout_s``."""
        try:
            return self.procs[_site(name)].wait(timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{_site(name)} did not exit within {timeout_s:.0f}s\n{self.diag()}") from None

    def wait_all_exit(self, names: list[str], timeout_s: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        return {n: self.wait_exit(n, max(0.1, deadline - time.monotonic())) for n in names}

    def exited(self, names: list[str]) -> bool:
        return all(self.procs[n].poll() is not None for n in names)

    def check_alive(self, names: list[str], ok_codes: tuple[int, ...] = (0,)) -> None:
        """RuntimeError with its log's tail if one of ``names`` exited with a code not in ``ok_codes``."""
        for n in names:
            rc = self.procs[n].poll()
            if rc is not None and rc not in ok_codes:
                raise RuntimeError(f"{n} exited with code {rc}:\n{self.tail(n)}")

    def close(self) -> None:
        """SIGKILL every child still running."""
        for p in self.procs.values():
            p.kill()
            _LIVE.discard(p)

    # ------------------------------------------------------------------ outputs
    def out_dir(self, site: int | str) -> Path:
        return self.root / _site(site)

    def lines(self, site: int | str, out_name: str | None = None) -> list[dict]:
        """The complete lines of ``site``'s metrics.jsonl so far, as dicts (start and end lines included)."""
        return [ln.as_dict() for ln in read_metrics(self.root / (out_name or _site(site)) / "metrics.jsonl")]

    def rounds(self, site: int | str, out_name: str | None = None, status: str | None = None) -> list[dict]:
        return [
            d
            for d in self.lines(site, out_name)
            if d.get("event") == "round" and (status is None or d["status"] == status)
        ]

    def by_round(self, site: int | str, status: str = "applied") -> dict[int, dict]:
        return {d["round"]: d for d in self.rounds(site, status=status)}

    def done_round(self, site: int | str, rnd: int) -> bool:
        """``site`` wrote its metrics line for round ``rnd`` or a later one."""
        return any(x["round"] >= rnd for x in self.rounds(site))

    def wait_round(self, site: int | str, rnd: int, timeout_s: float, status: str | None = "applied") -> dict:
        """Wait until ``site`` has written a round line with round >= ``rnd`` (and ``status``); returns it."""

        def done():
            return next((d for d in self.rounds(site, status=status) if d["round"] >= rnd), None)

        return self.wait(done, f"{_site(site)} to finish round {rnd} ({status})", timeout_s)

    def summary(self, site: int | str) -> dict:
        return json.loads((self.root / _site(site) / "summary.json").read_text())

    def log_text(self, name: int | str) -> str:
        try:
            return self.logs[_site(name)].read_text(errors="replace")
        except (OSError, KeyError):
            return ""

    def tail(self, name: int | str, n: int = 20) -> str:
        return tail(self.logs[_site(name)], n).rstrip("\n") if _site(name) in self.logs else "(no log)"

    def address(self, site: int | str, timeout_s: float = 60) -> str:
        """The host:port ``site``'s Peer service bound (from its log)."""

        def find():
            for ln in self.log_text(site).splitlines():
                if "peer service listening on " in ln:
                    return ln.split("peer service listening on ", 1)[1].split()[0]
            return None

        return self.wait(find, f"{_site(site)}'s peer address", timeout_s)

    def diag(self) -> str:
        """Every child's exit code and log tail."""
        return "\n".join(f"--- {n} (rc={p.poll()}) {self.logs[n]}\n{tail(self.logs[n])}" for n, p in self.procs.items())
