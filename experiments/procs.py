"""What the experiments' process runs share: their emulated links (:func:`netem_topology`) and a
free loopback port (:func:`free_port`).

The processes themselves (a rendezvous and N workers, on 127.0.0.1 or each inside its own
netem site) come from the one cluster harness, :class:`dtrain.app.procs.Cluster`, which the
fault tests use too.
"""

from __future__ import annotations

import os
import socket

__all__ = ["netem_topology", "free_port"]


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's pick; another process may take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
