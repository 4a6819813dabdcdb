"""What the experiments' process runs share: the emulated links (:func:`netem_problem`,
:func:`netem_topology`, :func:`sites_topology`, :func:`set_link`, :func:`sysctl`), one run of N
worker sites through them (:func:`run_sites`, on the cluster harness the fault tests use too,
:class:`dtrain.app.procs.Cluster`) and its per-round records (:func:`line_record`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

from dtrain.app.procs import Cluster

#: metrics-line fields that count something: 0 where a line has none (any other field: NaN)
COUNTS = frozenset({"bytes_sent", "bytes_received", "encoded_bytes", "stale_buckets"})


def netem_problem() -> str | None:
    """None when the repository's netem package (``netem/``, repository tooling imported from this
    checkout) can build topologies here, else what is missing (root, ``ip netns``, ...)."""
    if os.geteuid() != 0:
        return "netem needs root (network namespaces)"
    try:
        from netem import missing_requirements  # noqa: PLC0415
    except Exception as e:
        return f"the netem package is not importable ({type(e).__name__}: {e})"
    try:
        missing = missing_requirements()
    except Exception as e:
        return f"netem probe failed ({type(e).__name__}: {e})"
    return f"netem requirements missing: {', '.join(missing)}" if missing else None


def netem_topology(num_sites: int, name: str, script: str, *, mtu_bytes: int = 1500):
    """A ``netem.Topology`` of ``num_sites`` LAN sites with links of ``mtu_bytes`` (a context manager),
    named ``name`` + this process's id; SystemExit naming ``script`` where links cannot be emulated."""
    if why := netem_problem():
        raise SystemExit(f"{script}: netem cannot emulate links here: {why}")
    import netem  # noqa: PLC0415

    return netem.Topology(num_sites=num_sites, profile="lan", name=f"{name}{os.getpid()}"[:20], mtu_bytes=mtu_bytes)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's pick; another process may take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(done: Callable[[], bool], timeout_s: float, poll_s: float = 0.02) -> bool:
    """Poll ``done()`` every ``poll_s`` seconds until it holds (True); False once ``timeout_s`` seconds passed."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def sites_topology(n: int, name: str, script: str, *, mtu_bytes: int = 1500):
    """:func:`netem_topology` for ``n`` worker sites and their rendezvous (the last); ValueError below 2."""
    if n < 2:
        raise ValueError(f"{script}: task_spec.num_sites must be >= 2 (an exchange needs two sites), got {n}")
    return netem_topology(n + 1, name, script, mtu_bytes=mtu_bytes)


def set_link(topo, **link: Any) -> None:
    """Every site's link of ``topo`` set live to ``netem.profiles.LinkParams(**link)`` (the rest: defaults)."""
    from netem.profiles import LinkParams  # noqa: PLC0415

    topo.set_link(None, LinkParams(**link))


def sysctl(topo, key: str, value: Any) -> None:
    """``sysctl -w net.ipv4.KEY=VALUE`` in every site's namespace of ``topo`` (the rendezvous's too)."""
    for i in range(topo.num_sites):
        subprocess.run(topo.exec_argv(i, ["sysctl", "-q", "-w", f"net.ipv4.{key}={value}"]), check=True, timeout=10)


def loss_based_cc() -> str:
    """cubic where this machine allows it; else reno (also loss-based AIMD). The allowed list is
    global (``net.ipv4.tcp_allowed_congestion_control``), so it is read, never changed."""
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
    return "cubic" if not allowed.exists() or "cubic" in allowed.read_text().split() else "reno"


@dataclass
class SitesRun:
    """What one run of N worker sites left: every site's round lines (``per_site[i]``), site 0's
    start lines, its wall seconds, each site's exit code and what ``watch`` gave (or None)."""

    per_site: dict[int, list[dict]]
    starts: list[dict]
    wall_s: float
    rcs: dict[str, int | None]
    watched: Any = None

    @property
    def lines(self) -> list[dict]:
        """Every site's round lines, site by site."""
        return [x for i in sorted(self.per_site) for x in self.per_site[i]]

    def facts(self) -> dict[str, Any]:
        """The columns every run's CSV row has, of the whole run: site 0's validation loss at the
        start and after its last round and its rounds, the wall seconds, every site's bytes sent."""
        return {
            "first_val_loss": self.starts[0]["val_loss"] if self.starts else float("nan"),
            "final_val_loss": self.per_site[0][-1]["val_loss"] if self.per_site[0] else float("nan"),
            "rounds_done": len(self.per_site[0]),
            "wall_s": self.wall_s,
            "bytes_total": sum(x.get("bytes_sent", 0) for x in self.lines),
        }


def line_record(experiment: str, config: str, seed: int, x: dict, keys: Sequence[str], **cols: Any) -> dict:
    """A per-round record of metrics line ``x``: experiment, config, seed, each of ``keys`` (``"col=key"``:
    ``key`` as ``col``; missing: a count 0, else NaN), then ``cols``."""
    out: dict[str, Any] = {"experiment": experiment, "config": config, "seed": seed}
    for k in keys:
        col, _, key = k.partition("=")
        out[col] = x.get(key or col, 0 if (key or col) in COUNTS else float("nan"))
    return out | cols


def run_sites(
    topo,
    n: int,
    rendezvous: dict[str, Any],
    worker: dict[str, Any] | Callable[[int], dict[str, Any]],
    *,
    timeout_s: float,
    steps: Sequence[tuple[int, Callable[[], None]]] = (),
    watch: Callable[[Cluster], ContextManager] | None = None,
    drive: Callable[[Cluster], None] | None = None,
    ok: tuple[int, ...] = (0,),
    poll_s: float = 0.05,
) -> SitesRun:
    """One ``dtrain rendezvous`` (``rendezvous``'s options; round 0 waits for all ``n``) and ``n``
    ``dtrain worker`` sites (``worker``'s options, or site i's: ``worker(i)``) in ``topo`` (None:
    127.0.0.1), run to the end or as ``drive(cluster)`` runs it (its faults and wait; sites still
    running then are killed). ``steps``: (round r, f) in order, f called once every site has written
    its line of round r. ``watch``: a context manager of the started cluster held while the sites run
    (its value: ``watched``). A site exiting with a code not in ``ok`` raises RuntimeError with its log;
    every child is gone on return; the run's files are in a temporary directory, removed then."""
    with tempfile.TemporaryDirectory(prefix="dtrain-sites-") as d:
        with contextlib.closing(Cluster(Path(d), num_sites=n, timeout_s=timeout_s, topo=topo)) as run:
            names = [f"site-{i}" for i in range(n)]
            t0 = time.monotonic()
            run.start_rendezvous(**{"initial_sites": n, "min_sites": n, **rendezvous})
            for i in range(n):
                run.start_site(i, **(worker(i) if callable(worker) else worker))
            with watch(run) if watch is not None else contextlib.nullcontext() as watched:
                for rnd, step in steps:
                    run.wait(
                        lambda rnd=rnd: run.check_alive(names) or all(run.done_round(i, rnd) for i in range(n)),
                        f"every site to finish round {rnd}",
                        poll_s=poll_s,
                    )
                    step()
                if drive is not None:
                    drive(run)
                else:
                    run.wait(
                        lambda: run.check_alive(names, ok) or run.exited(names), "the sites to finish", poll_s=poll_s
                    )
            rcs = {x: run.procs[x].poll() for x in names}
        wall = time.monotonic() - t0
        per_site = {i: run.rounds(i) for i in range(n)}
        starts = [x for x in run.lines(0) if x.get("event") == "start"]
    return SitesRun(per_site, starts, wall, rcs, watched)
