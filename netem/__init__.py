"""Emulated WAN sites for dtrain tests and experiments (repository tooling, not in the wheel).

N sites live in Linux network namespaces joined through a routing hub namespace, with per-site
delay, jitter, loss, rate caps and partitions (see netem/README.md)::

    from netem import Topology, PROFILES
    with Topology(num_sites=3, profile="transatlantic", name="dt") as topo:
        subprocess.run(topo.exec_argv(0, ["ping", "-c", "3", topo.address(1)]))
"""

from ._sys import PREFIX, STATE_ROOT, CommandError
from .probe import Capabilities, NetemUnavailable, choose_backends, missing_requirements, probe
from .profiles import PROFILES, LinkParams, Profile, get_profile
from .topology import SUBNET, Topology, TopologyConfig, cleanup_all, list_topologies

__all__ = [
    "PREFIX",
    "STATE_ROOT",
    "SUBNET",
    "CommandError",
    "Capabilities",
    "NetemUnavailable",
    "LinkParams",
    "Profile",
    "PROFILES",
    "Topology",
    "TopologyConfig",
    "choose_backends",
    "cleanup_all",
    "get_profile",
    "list_topologies",
    "missing_requirements",
    "probe",
]
