"""The compiled delayer (``netem/delayer.c``, backend ``nfqueue-c``): build it, run it, talk to it.

Why compiled: this kernel has no netem, fq or etf qdisc, so delay is done in userspace on
NFQUEUE, and the Python delayer (netfilterqueue, one callback per packet) costs ~15 us of
CPU per packet: 24-32k packets/s on a quiet core, 4-8k/s when training jobs load the
machine, below what four sites at 95 Mbit/s of 1,400-byte datagrams need (~33k/s). The C
program does the same job (per-site FIFO with due times, jitter, in-order release, bounded
queue) with one ``recv`` per packet and one batched verdict per site per wake-up.

Build: ``build_delayer()`` compiles ``delayer.c`` once with ``$CC`` (default ``gcc``) ``-O2``
against libnetfilter_queue (Debian: ``libnetfilter-queue-dev``) into a cache directory
(``$DTRAIN_NETEM_CACHE``, default ``~/.cache/dtrain-netem``), named by the hash of the
source, compiler and flags, so later topologies reuse it. Any failure (no compiler, no
headers, the binary does not run) returns None with a logged warning, and the topology
falls back to the Python delayer (backend ``nfqueue-userspace``).
``DTRAIN_NETEM_DELAYER=python`` skips the build (forces the Python delayer).

Run: :class:`CDelayer` starts the binary as a child of the agent (in the hub namespace,
inheriting its SCHED_FIFO priority) and speaks the line protocol described in
``delayer.c`` over its stdin/stdout.
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import shlex
import subprocess
import time
from pathlib import Path

from dtrain.native import compile_c

__all__ = ["CDelayer", "DELAYER_ENV", "build_delayer", "cache_dir"]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "delayer.c"
CFLAGS = ["-O2", "-Wall", "-Wextra"]
LIBS = ["-lnetfilter_queue"]
DELAYER_ENV = "DTRAIN_NETEM_DELAYER"  # "auto" (default: compiled when it builds) or "python"
REQUEST_TIMEOUT_S = 2.0
# While packets flow the delayer wakes at most once per tick (a wake-up, i.e. a context switch, costs
# ~10 us here under load, the recv + verdict of a packet ~1 us): each packet's delay grows by 0-2 ticks.
TICK_NS = 100_000


def cache_dir() -> Path:
    """Where compiled delayers are kept: ``$DTRAIN_NETEM_CACHE`` or ``~/.cache/dtrain-netem``."""
    env = os.environ.get("DTRAIN_NETEM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dtrain-netem"


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "gcc")


def build_delayer() -> Path | None:
    """The compiled delayer's path, compiling it first if the cache lacks it.

    Returns:
        Path of an executable that answered ``--version``; None (after a warning naming
        the reason) when ``DTRAIN_NETEM_DELAYER=python``, or the compiler or
        libnetfilter_queue is missing, or the build or the binary fails.
    """
    mode = os.environ.get(DELAYER_ENV, "auto")
    if mode == "python":
        logger.info("%s=python: using the Python delayer", DELAYER_ENV)
        return None
    if mode != "auto":
        logger.warning("%s=%r is neither 'auto' nor 'python'; treating it as 'auto'", DELAYER_ENV, mode)
    cc = _compiler()
    key = hashlib.sha256(SOURCE.read_bytes() + repr((cc, CFLAGS, LIBS)).encode()).hexdigest()[:16]
    out = cache_dir() / f"netem-delayer-{key}"
    try:
        if not out.exists():
            _compile(cc, out)
        version = subprocess.run([str(out), "--version"], capture_output=True, text=True, timeout=10.0)
        if version.returncode != 0 or not version.stdout.startswith("netem-delayer"):
            raise RuntimeError(f"{out} --version gave rc {version.returncode}: {version.stderr.strip()[-300:]}")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("compiled NFQUEUE delayer unavailable (%s); falling back to the Python delayer", e)
        return None
    return out


def _compile(cc: list[str], out: Path) -> None:
    """Build the delayer into ``out`` (:func:`dtrain.native.compile_c`, the C build of dtrain's
    own kernels)."""
    compile_c(cc, SOURCE, CFLAGS, LIBS, out, executable=True)


class CDelayer:
    """The compiled delayer as a child process bound to NFQUEUE queues ``0..num_sites-1``.

    Args:
        binary: Path from :func:`build_delayer`.
        num_sites: Number of queues to bind (queue ``i`` holds the packets routed to site ``i``).
        max_queue_len: Packets held per site at most (kernel queue and ring bound).
        rcvbuf_bytes: Netlink socket receive buffer.
        marker: Extra argument text that names the owner (the state dir), for leftover checks.

    Raises:
        RuntimeError: the process did not print ``ready`` within 5 s (its stderr, in the
            agent's log, says why: e.g. a queue already bound).
    """

    def __init__(self, binary: str, num_sites: int, *, max_queue_len: int, rcvbuf_bytes: int, marker: str) -> None:
        argv = [binary, "--queues", str(num_sites), "--max-queue-len", str(max_queue_len)]
        argv += ["--tick-ns", str(TICK_NS)]
        argv += ["--rcvbuf-bytes", str(rcvbuf_bytes), "--parent-pid", str(os.getpid()), "--state-dir", marker]
        self.num_sites = num_sites
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.fd = self.proc.stdout.fileno()
        self._buf = b""
        self.dead = False
        self.num_wakeups = 0
        if self._read_lines(lambda lines: lines[-1] == "ready", timeout_s=5.0) is None:
            self.kill()
            raise RuntimeError(f"compiled delayer did not start (rc {self.proc.poll()}); see the agent log")
        logger.info("compiled delayer running (pid %d, %d queues)", self.proc.pid, num_sites)

    def _read_lines(self, done, timeout_s: float) -> list[str] | None:
        """Lines until ``done(lines)`` holds; None on EOF or timeout (then marked dead on EOF)."""
        lines: list[str] = []
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                lines.append(line.decode(errors="replace"))
                if done(lines):
                    return lines
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                self.dead = True
                return None
            self._buf += chunk

    def _request(self, line: str, done) -> list[str]:
        if self.dead or self.proc.poll() is not None:
            self.dead = True
            raise RuntimeError(f"the compiled delayer exited (rc {self.proc.poll()}); see the agent log")
        self.proc.stdin.write(line.encode() + b"\n")
        lines = self._read_lines(done, REQUEST_TIMEOUT_S)
        if lines is None:
            raise RuntimeError(f"the compiled delayer did not answer {line!r}")
        if lines[-1].startswith("error"):
            raise RuntimeError(f"the compiled delayer refused {line!r}: {lines[-1]}")
        return lines

    def set_delay(
        self, site: int, delay_s: float, jitter_s: float, reorder_pct: float = 0.0, reorder_gap_s: float = 0.0
    ) -> None:
        """Site ``site``'s one-way delay and jitter (uniform ±jitter), and the share of its packets
        held ``reorder_gap_s`` longer (overtaken by the next ones), for packets queued from now on."""
        self._request(
            f"delay {site} {round(delay_s * 1e9)} {round(jitter_s * 1e9)} "
            f"{round(reorder_pct * 1e4)} {round(reorder_gap_s * 1e9)}",
            _one_line,
        )

    def stats(self) -> list[dict]:
        """Per site: delayed, held, max_held, late_1ms, max_late_ms, overflow, reordered (same keys as the
        Python delayer)."""
        lines = self._request("stats", lambda ls: ls[-1] == "end" or ls[-1].startswith("error"))
        out = []
        for line in lines[:-1]:
            if line.startswith("wakeups"):
                self.num_wakeups = int(line.split()[1])
                continue
            _, _, delayed, held, max_held, late, max_late_ns, overflow, reordered = line.split()
            out.append(
                {
                    "delayed": int(delayed),
                    "held": int(held),
                    "max_held": int(max_held),
                    "late_1ms": int(late),
                    "max_late_ms": round(int(max_late_ns) / 1e6, 3),
                    "overflow": int(overflow),
                    "reordered": int(reordered),
                }
            )
        return out

    def poll_dead(self) -> bool:
        """Drain unexpected output (the agent's loop saw the pipe readable); True once it exited."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.dead = True
            logger.error("the compiled delayer exited (rc %s); packets pass undelayed", self.proc.poll())
        else:
            logger.warning("unexpected output from the compiled delayer: %r", chunk[:200])
        return self.dead

    def close(self, timeout_s: float = 2.0) -> None:
        """Ask it to release what it holds and exit (EOF on its stdin); kill it if it does not."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc.stdout.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5.0)


def _one_line(lines: list[str]) -> bool:
    return True
