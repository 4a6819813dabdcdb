"""Real ``dtrain rendezvous`` + ``dtrain worker`` processes for the experiments.

:class:`ProcRun` starts one rendezvous and N workers as separate processes talking
gRPC, on 127.0.0.1 or, given a :class:`netem.Topology` with N + 1 sites, each inside
its own emulated site (the rendezvous in the last one, as ``dtrain launch --netem``
does). It reads the workers' ``metrics.jsonl`` files while they run, waits with a
bound on every wait, kills sites, and kills everything left on :meth:`close`.
Processes come from the one harness (:mod:`dtrain.app.procs`), metrics lines from the
one reader (:mod:`dtrain.metrics`, as dicts).

Used by ``site_failures.py`` (127.0.0.1), ``wan_sweep.py`` and ``netem_loss.py``
(through netem).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from dtrain.app.config import RENDEZVOUS, WORKER
from dtrain.app.procs import Proc, spawn, tail
from dtrain.metrics import read_metrics
from dtrain.options import Tree
from experiments.common import ROOT

__all__ = ["ProcRun", "flags", "netem_topology"]


def flags(opts: dict[str, Any], tree: Tree = WORKER) -> list[str]:
    """``{"reduce_timeout_s": 2}`` -> ``["--rendezvous.reduce-timeout-s", "2"]``: the flags of
    ``tree``'s options by path, key or short name (booleans ``--x`` / ``--no-x``; None
    values are left out)."""
    return tree.to_argv({k: v for k, v in opts.items() if v is not None})


def netem_topology(num_sites: int, name: str, script: str, *, mtu_bytes: int = 1500):
    """A ``netem.Topology`` of ``num_sites`` sites (profile ``lan``; links of ``mtu_bytes``; use it
    as a context manager), named ``name`` + this process's id, so that runs on one machine do not
    collide.

    ``netem/`` is repository tooling, imported from this checkout. Raises SystemExit naming
    ``script`` and what is missing (root, ``ip netns``, netfilterqueue, ...) when links cannot
    be emulated here.
    """
    import netem  # noqa: PLC0415

    missing = netem.missing_requirements()
    if missing:
        raise SystemExit(f"{script}: netem cannot emulate links here: missing {', '.join(missing)}")
    return netem.Topology(num_sites=num_sites, profile="lan", name=f"{name}{os.getpid()}"[:20], mtu_bytes=mtu_bytes)


class ProcRun:
    """The processes of one multi-site run, with logs and site directories under ``root``.

    Args:
        root: directory for ``rendezvous.log``, ``site-<i>.log`` and ``site-<i>/``.
        num_sites: number of workers.
        timeout_s: bound on the whole run: :meth:`wait` raises TimeoutError past it.
        topo: a netem Topology with at least ``num_sites + 1`` sites, or None for 127.0.0.1.
    """

    def __init__(self, root: Path, num_sites: int, *, timeout_s: float, topo=None) -> None:
        self.root, self.num_sites, self.topo = root, num_sites, topo
        self.procs: dict[str, Proc] = {}
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.env.pop("DTRAIN_TEST_FAULT", None)
        self.deadline = time.monotonic() + timeout_s
        self.rv = ""

    def host(self, i: int) -> str:
        """Site ``i``'s address (``i == num_sites``: the rendezvous)."""
        return self.topo.address(i) if self.topo is not None else "127.0.0.1"

    def spawn(self, name: str, index: int, argv: list[str], env: dict[str, str] | None = None) -> None:
        """Start ``python -m dtrain ARGV`` as ``name``, inside site ``index`` under netem."""
        cmd = [sys.executable, "-m", "dtrain", *argv]
        if self.topo is not None:
            cmd = self.topo.exec_argv(index, cmd)
        self.procs[name] = spawn(name, cmd, self.root / f"{name}.log", env={**self.env, **(env or {})}, cwd=ROOT)

    def wait(self, pred: Callable[[], bool], what: str, poll_s: float = 0.05) -> None:
        """Poll ``pred`` until true; TimeoutError naming ``what`` past the run's bound."""
        while not pred():
            if time.monotonic() > self.deadline:
                tails = "\n".join(f"--- {n}.log:\n{self.tail(n, 5)}" for n in self.procs)
                raise TimeoutError(f"timed out waiting for {what}; last log lines:\n{tails}")
            time.sleep(poll_s)

    def start_rendezvous(self, opts: dict[str, Any], *, bind: str | None = None) -> str:
        """Start the rendezvous with RendezvousConfig fields ``opts``; returns its host:port.
        ``bind``: the host:port to listen on (a restart on the old address); default a free port."""
        addr = self.root / "rendezvous.addr"
        addr.unlink(missing_ok=True)
        self.spawn(
            "rendezvous",
            self.num_sites,
            [
                "rendezvous",
                "--bind",
                bind or f"{self.host(self.num_sites)}:0",
                "--address-file",
                str(addr),
                *flags(opts, RENDEZVOUS),
            ],
        )

        def ready() -> bool:
            if self.procs["rendezvous"].poll() is not None:
                raise RuntimeError(f"the rendezvous exited: {self.tail('rendezvous')}")
            return addr.exists() and bool(addr.read_text().strip())

        self.wait(ready, "the rendezvous address")
        self.rv = addr.read_text().strip()
        return self.rv

    def start_site(
        self, i: int, opts: dict[str, Any], *, env: dict[str, str] | None = None, resume: bool = False
    ) -> None:
        """Start worker ``site-<i>`` with WorkerConfig fields ``opts`` (site id, index, listen
        address, rendezvous and out dir are filled in)."""
        argv = [
            "worker",
            "--site-id",
            f"site-{i}",
            "--site-index",
            str(i),
            "--num-sites",
            str(self.num_sites),
            "--listen",
            f"{self.host(i)}:0",
            "--rendezvous",
            self.rv,
            "--out-dir",
            str(self.root / f"site-{i}"),
            *flags(opts),
        ]
        if resume:
            argv.append("--resume")
        self.spawn(f"site-{i}", i, argv, env)

    def tail(self, name: str, n: int = 20) -> str:
        return tail(self.root / f"{name}.log", n).rstrip("\n")

    def lines(self, i: int) -> list[dict[str, Any]]:
        """Site ``i``'s metrics lines so far, as dicts (a half-written last line is skipped)."""
        return [ln.as_dict() for ln in read_metrics(self.root / f"site-{i}" / "metrics.jsonl")]

    def rounds(self, i: int) -> list[dict[str, Any]]:
        return [x for x in self.lines(i) if x.get("event") == "round"]

    def done_round(self, i: int, r: int) -> bool:
        """Site ``i`` wrote its metrics line for round ``r`` or a later one."""
        return any(x["round"] >= r for x in self.rounds(i))

    def exited(self, names: list[str]) -> bool:
        return all(self.procs[n].poll() is not None for n in names)

    def check_alive(self, names: list[str]) -> None:
        """RuntimeError with its log tail if one of ``names`` exited with a non-zero code."""
        for n in names:
            rc = self.procs[n].poll()
            if rc not in (None, 0):
                raise RuntimeError(f"{n} exited with code {rc}:\n{self.tail(n)}")

    def kill(self, i: int) -> None:
        """SIGKILL site ``i``'s process group and reap it."""
        self.procs[f"site-{i}"].kill()

    def close(self) -> None:
        """SIGKILL every process still running."""
        for p in self.procs.values():
            p.kill()
