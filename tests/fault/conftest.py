"""Fixtures of the multi-process fault tests: a rendezvous and N ``dtrain worker``
processes on 127.0.0.1 (port 0) from the one cluster harness
(:class:`dtrain.app.procs.Cluster`: waits for metrics lines, kill / stop / continue /
restart of sites), with short timeouts, a small corpus and a forking zygote.

Every wait is bounded; every child runs in its own session and is SIGKILLed by
the fixture's finalizer (and by an ``atexit`` hook, should pytest itself die).

Start-up cost: a fresh ``python -m dtrain worker`` spends ~5 s of CPU importing
torch (and torch._dynamo, which the first optimizer pulls in) before it does
anything, and a test starts 4-6 of them on a 2-core machine. So by default the
sites are forked from a *zygote*: a process started once per test session (this
file run as a script) that has imported torch and dtrain but nothing else (no
thread, no gRPC), and forks a fresh child per site that runs
``dtrain.app.cli.main([...])`` with its own argv, environment, log file and session.
Each site is still its own OS process (SIGKILL / SIGSTOP / exit codes work as for
a ``subprocess``). ``DTRAIN_FAULT_NO_ZYGOTE=1`` starts plain subprocesses instead.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from dtrain.app import procs
from dtrain.app.procs import Proc, child_env

REPO = Path(__file__).resolve().parents[2]

# Round timing used by the fault tests (seconds). Short, so a fault costs ~1-2 s,
# but the heartbeat timeout leaves a loaded 2-core machine some slack.
RENDEZVOUS_DEFAULTS = {
    "quorum_timeout_s": 1.0,
    "heartbeat_interval_s": 0.25,
    "heartbeat_timeout_s": 2.0,
    "reduce_timeout_s": 1.5,
    "broadcast_timeout_s": 3.0,
}
WORKER_DEFAULTS = {
    "size": "tiny",
    "sync_every": 4,
    "codec": "fp32",
    "bucket_bytes": 65536,  # tiny has ~0.47 MB of fp32 parameters: 8 buckets, several owners
    "chunk_bytes": 16384,
    "linger_s": 1.0,
    "quorum_wait_s": 30.0,
}

_LIVE: set[Proc] = set()


@atexit.register
def _kill_leftovers() -> None:  # pragma: no cover - only when a finalizer did not run
    for p in list(_LIVE):
        p.kill()


# --------------------------------------------------------------------------- zygote
def _zygote_main() -> None:  # pragma: no cover - runs in the zygote process
    """Read JSON requests ``{"id", "argv", "env", "cwd", "log"}`` on stdin, fork a
    child per request and report ``{"id", "pid"}`` and ``{"pid", "rc"}`` on stdout."""
    import ctypes

    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (imported by every torch.optim.Optimizer)

    import dtrain.app.cli  # noqa: F401
    import dtrain.app.worker  # noqa: F401
    import dtrain.tasks.builtin  # noqa: F401

    assert "grpc" not in sys.modules, "the zygote must not load gRPC before forking"
    libc = ctypes.CDLL(None, use_errno=True)
    out_fd = os.dup(1)
    out = os.fdopen(out_fd, "w", buffering=1)
    children: set[int] = set()
    buf = b""
    stdin_open = True

    def reap() -> None:
        for pid in list(children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                children.discard(pid)
                continue
            if done:
                children.discard(pid)
                out.write(json.dumps({"pid": pid, "rc": os.waitstatus_to_exitcode(status)}) + "\n")

    while stdin_open or children:
        if not stdin_open:
            time.sleep(0.02)
        elif select.select([0], [], [], 0.02)[0]:
            data = os.read(0, 65536)
            if not data:  # the test process is gone (or closed us): take every child down
                stdin_open = False
                for pid in children:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    rc = 70
                    try:
                        os.close(out_fd)  # only the zygote reports to the test process
                        os.setsid()
                        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
                        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                        os.dup2(fd, 1)
                        os.dup2(fd, 2)
                        null = os.open(os.devnull, os.O_RDONLY)
                        os.dup2(null, 0)
                        os.chdir(req["cwd"])
                        os.environ.clear()
                        os.environ.update(req["env"])
                        sys.argv = ["dtrain", *req["argv"]]
                        from dtrain.app.cli import main

                        rc = main(req["argv"])
                    except SystemExit as e:
                        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    except BaseException:
                        import traceback

                        traceback.print_exc()
                    finally:
                        try:
                            sys.stdout.flush()
                            sys.stderr.flush()
                        finally:
                            os._exit(rc)
                children.add(pid)
                out.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
        reap()
    out.flush()


class _ZygoteChild:
    """A child of the zygote, with the parts of ``subprocess.Popen`` the harness uses."""

    def __init__(self, zygote: "Zygote", pid: int) -> None:
        self._z = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._z.exit_codes.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._z.cv:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
                if not self._z.alive():
                    raise RuntimeError(f"the zygote died; pid {self.pid} is lost")
                self._z.cv.wait(0.1 if left is None else min(left, 0.1))
        return self.returncode  # type: ignore[return-value]


class Zygote:
    """The forking server (see the module docstring)."""

    def __init__(self, env: dict) -> None:
        self.popen = subprocess.Popen(  # talks over its pipes, so not dtrain.app.procs.spawn
            [sys.executable, str(Path(__file__).resolve()), "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=str(REPO),
            start_new_session=True,
        )
        self.proc = Proc("zygote", self.popen)
        _LIVE.add(self.proc)
        self.cv = threading.Condition()
        self.exit_codes: dict[int, int] = {}
        self._pids: dict[int, int] = {}
        self._next = 0
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            msg = json.loads(line)
            with self.cv:
                if "id" in msg:
                    self._pids[msg["id"]] = msg["pid"]
                else:
                    self.exit_codes[msg["pid"]] = msg["rc"]
                self.cv.notify_all()
        with self.cv:
            self.cv.notify_all()

    def spawn(self, argv: list[str], env: dict, log: Path) -> _ZygoteChild:
        with self.cv:
            self._next += 1
            rid = self._next
        req = {"id": rid, "argv": argv, "env": env, "cwd": str(REPO), "log": str(log)}
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps(req) + "\n").encode())
        self.popen.stdin.flush()
        deadline = time.monotonic() + 120  # the first request waits for the zygote's imports
        with self.cv:
            while rid not in self._pids:
                if not self.alive() or time.monotonic() > deadline:
                    raise RuntimeError("the zygote did not start a child (died or hung)")
                self.cv.wait(0.1)
            return _ZygoteChild(self, self._pids.pop(rid))

    def close(self) -> None:
        self.proc.kill()
        _LIVE.discard(self.proc)


_child_env = child_env  # the zygote's environment: that of every child


def tiny_num_buckets(bucket_bytes: int) -> int:
    """Number of buckets of the ``tiny`` built-in model at ``bucket_bytes`` (as a worker lays them out)."""
    from dtrain.buckets import BucketConfig, BucketLayout
    from dtrain.tasks.gpt import GPT, GPTConfig
    from dtrain.tasks.spec import PRESETS

    pr = PRESETS["tiny"]
    model = GPT(
        GPTConfig(
            vocab_size=256,
            context_len=pr.context_len,
            num_layers=pr.num_layers,
            num_heads=pr.num_heads,
            embed_dim=pr.embed_dim,
        )
    )
    tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
    kinds = ["param"] * len(list(model.parameters())) + ["buffer"] * (len(tensors) - len(list(model.parameters())))
    return len(
        BucketLayout([t.numel() for t in tensors], kinds, BucketConfig(bucket_bytes=bucket_bytes, chunk_bytes=16384))
    )


def wait_until(pred: Callable[[], object], timeout_s: float, what: str, diag: Callable[[], str] = lambda: "") -> object:
    """Poll ``pred`` every 50 ms until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{diag()}")
        time.sleep(0.05)


class Cluster(procs.Cluster):
    """The one harness (:class:`dtrain.app.procs.Cluster`) with the fault tests' short round
    timing, the session's small corpus and its forking zygote (None: plain subprocesses)."""

    def __init__(
        self,
        root: Path,
        corpus: Path,
        *,
        rendezvous: dict | None = None,
        worker: dict | None = None,
        zygote: "Zygote | None" = None,
    ) -> None:
        super().__init__(
            root,
            rendezvous={**RENDEZVOUS_DEFAULTS, **(rendezvous or {})},
            worker={**WORKER_DEFAULTS, "data": str(corpus), **(worker or {})},
            spawner=zygote.spawn if zygote is not None else None,
        )
        self.corpus, self.zygote = corpus, zygote


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A ~200 KB text corpus (standard-library sources), so a worker builds its task in
    milliseconds rather than reading the whole standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = ["argparse.py", "dataclasses.py", "inspect.py", "typing.py", "pathlib.py", "subprocess.py"]
    data = b"".join((root / n).read_bytes() for n in names if (root / n).is_file())[: 200 * 1024]
    assert len(data) > 100 * 1024, "standard-library sources not found"
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(data)
    return path


@pytest.fixture(scope="session")
def zygote():
    """The session's forking server, or None with ``DTRAIN_FAULT_NO_ZYGOTE=1``."""
    if os.environ.get("DTRAIN_FAULT_NO_ZYGOTE") == "1":
        yield None
        return
    z = Zygote(_child_env())
    yield z
    z.close()


@pytest.fixture
def make_cluster(tmp_path, corpus, zygote):
    """Factory of :class:`Cluster` objects; every child is killed at teardown."""
    made: list[Cluster] = []

    def make(name: str = "run", **kw) -> Cluster:
        c = Cluster(tmp_path / name, corpus, zygote=zygote, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    _zygote_main()
