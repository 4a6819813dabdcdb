"""Low-level helpers: running ip/tc/nft/iptables, namespaces, processes, names.

Everything the harness creates is named with :data:`PREFIX` (namespaces) and lives
under :data:`STATE_ROOT` (state files); nothing is created in the root namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

__all__ = [
    "PREFIX",
    "STATE_ROOT",
    "NETNS_DIR",
    "CommandError",
    "run",
    "ns_cmd",
    "list_namespaces",
    "ns_pids",
    "delete_namespace",
    "in_namespace",
    "proc_start_time",
    "pid_alive",
    "terminate",
    "check_name",
]

logger = logging.getLogger(__name__)

PREFIX = os.environ.get("DTRAIN_NETEM_PREFIX", "dtnetem-")
"""Every namespace of the harness is called ``<PREFIX><topology>-<role>``; the default
``dtnetem-`` can be changed with DTRAIN_NETEM_PREFIX (tests isolate themselves that
way), but it must start with ``dtnetem`` so cleanup never touches foreign names."""
if not re.fullmatch(r"dtnetem[a-z0-9-]*", PREFIX):
    raise ValueError(f"DTRAIN_NETEM_PREFIX must match dtnetem[a-z0-9-]*, got {PREFIX!r}")
STATE_ROOT = Path(os.environ.get("DTRAIN_NETEM_STATE", "/run/dtrain-netem"))
NETNS_DIR = Path("/run/netns")
_NAME_RE = re.compile(r"^[a-z0-9]{1,20}$")
_CLONE_NEWNET = 0x40000000


class CommandError(RuntimeError):
    """A system command (ip, tc, nft, iptables, ethtool) failed; message has its stderr."""

    def __init__(self, argv: list[str], returncode: int, stderr: str) -> None:
        self.argv = argv
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(f"`{' '.join(argv)}` failed (rc {returncode}): {stderr.strip()}")


def check_name(name: str) -> str:
    """Validate a topology name: 1-20 chars of [a-z0-9]; ValueError otherwise."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"name must match [a-z0-9]{{1,20}}, got {name!r}")
    return name


def run(
    argv: list[str], *, input: str | None = None, check: bool = True, timeout_s: float = 30.0
) -> subprocess.CompletedProcess:
    """Run ``argv`` and capture its output.

    Raises:
        CommandError: when ``check`` and the command exits non-zero.
        FileNotFoundError: when the program does not exist.
    """
    logger.debug("run: %s%s", " ".join(argv), " <<input" if input else "")
    proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise CommandError(argv, proc.returncode, proc.stderr or proc.stdout)
    return proc


def ns_cmd(ns: str | None, argv: list[str]) -> list[str]:
    """``argv`` run inside namespace ``ns`` (or as is when ``ns`` is None)."""
    return argv if ns is None else ["ip", "netns", "exec", ns, *argv]


def list_namespaces() -> list[str]:
    """Names of all network namespaces under /run/netns."""
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []


def ns_pids(ns: str) -> list[int]:
    """PIDs of processes whose network namespace is ``ns`` (like ``ip netns pids``)."""
    try:
        target = os.stat(NETNS_DIR / ns)
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            pids.append(int(entry))
    return pids


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and ')': split after the last ')'.
    return data[data.rindex(b")") + 2 :].split()


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (guards against PID reuse)."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """True when ``pid`` runs (and, if given, started at ``start_time``); zombies count as dead."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in (b"Z", b"X"):
        return False
    return start_time is None or int(fields[19]) == start_time


def terminate(
    pid: int, *, start_time: int | None = None, grace_s: float = 2.0, popen: subprocess.Popen | None = None
) -> None:
    """SIGTERM ``pid``, then SIGKILL after ``grace_s``; reap it if it is our child."""
    if pid_alive(pid, start_time):
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if (popen.poll() is not None) if popen is not None else not pid_alive(pid):
                    break
                time.sleep(0.01)
            else:
                continue
            break
    if popen is not None:
        try:
            popen.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            logger.error("process %d did not exit after SIGKILL", pid)


def delete_namespace(ns: str) -> None:
    """Kill every process in ``ns``, then delete it (its links, qdiscs and rules go with it).

    Raises:
        CommandError: when the namespace still exists after ``ip netns delete``.
    """
    for pid in ns_pids(ns):
        if pid == os.getpid():
            continue
        logger.warning("killing process %d left in namespace %s", pid, ns)
        terminate(pid, grace_s=1.0)
    proc = run(["ip", "netns", "delete", ns], check=False)
    if proc.returncode != 0 and (NETNS_DIR / ns).exists():
        raise CommandError(["ip", "netns", "delete", ns], proc.returncode, proc.stderr)


_libc = None


def _setns_fd(fd: int, what: str) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns({what}): {os.strerror(err)}")


@contextlib.contextmanager
def in_namespace(ns: str):
    """Run the body with the calling *thread* in network namespace ``ns``.

    Sockets created inside the body stay in ``ns`` after it ends (that is the point:
    ``with in_namespace(n): s = socket.socket()`` gives a socket of site ``n``). The
    thread returns to its previous namespace afterwards, even on an exception.
    """
    old = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        new = os.open(NETNS_DIR / ns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns_fd(new, ns)
        finally:
            os.close(new)
        try:
            yield
        finally:
            _setns_fd(old, "previous namespace")
    finally:
        os.close(old)
