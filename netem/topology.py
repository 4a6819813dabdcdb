"""N emulated WAN sites: one network namespace per site, joined through a hub router.

Layout (nothing is created in the root namespace)::

    dtnetem-<name>-hub     router: ports s0..s{N-1}, 198.19.255.254 on each;
                           loss/partition/delay rules on its forward hook, download tbf
    dtnetem-<name>-s<i>    eth0 = 198.18.0.<i+1>/32, route 198.18.0.0/15 via the hub;
                           upload tbf

The hub routes rather than bridges: the delay must happen before a packet enters the
receiver's namespace (the receiving kernel timestamps it there), and NFQUEUE sees
routed packets on the standard FORWARD hook, while bridged frames would need the
host-wide br_netfilter module.

State lives in /run/dtrain-netem/<name>/ (state.json, topology.json, agent.sock,
agent.log, lock), so later processes (the CLI) can attach to a running topology.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import ipaddress
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import _cdelay, _rules
from ._sys import (
    PREFIX,
    STATE_ROOT,
    CommandError,
    check_name,
    delete_namespace,
    in_namespace,
    list_namespaces,
    ns_cmd,
    pid_alive,
    proc_start_time,
    run,
    terminate,
)
from .probe import NetemUnavailable, choose_backends, probe
from .profiles import PROFILES, LinkParams, Profile, get_profile

__all__ = ["Topology", "TopologyConfig", "cleanup_all", "list_topologies", "SUBNET"]

logger = logging.getLogger(__name__)

SUBNET = ipaddress.ip_network("198.18.0.0/15")
HUB_ADDRESS = "198.19.255.254"  # the hub's address on every port: the sites' gateway
MAX_SITES = 200
MIN_MTU_BYTES, MAX_MTU_BYTES = 1280, 9000  # IPv6's minimum; jumbo frames
NFQUEUE_DELAY = ("nfqueue-c", "nfqueue-userspace")  # delay backends that hold packets on NFQUEUE in the agent
_REPO_ROOT = Path(__file__).resolve().parent.parent
_counter = itertools.count()


@dataclass(frozen=True, kw_only=True)
class TopologyConfig:
    """How to build a topology.

    Attributes:
        num_sites: Number of sites (namespaces), 1 to 200.
        profile: Name of a preset in ``netem.PROFILES`` applied to every site.
        name: Topology name, [a-z0-9]{1,20}; namespaces are ``dtnetem-<name>-...``.
        kernel_netem: None = use the kernel netem qdisc where it exists, False = always
            use the fallbacks (tbf, nftables, userspace delayer), True = require netem.
        persistent: True = outlive this process (the CLI's ``up``): no signal handlers,
            no atexit teardown, and the helper process does not watch this process.
        filter_backend: "nftables" or "iptables" for loss/partitions; None = nftables
            where it works (iptables is the fallback).
        mtu_bytes: MTU of every site's link (both veth ends), bytes, in [1280, 9000]:
            1500 = Ethernet, 9000 = jumbo frames (provisioned links such as a cloud VPC's,
            whose MTU may be 8896 even between regions).
    """

    num_sites: int
    profile: str = "lan"
    name: str
    kernel_netem: bool | None = None
    persistent: bool = False
    filter_backend: str | None = None
    mtu_bytes: int = 1500

    def __post_init__(self) -> None:
        if not isinstance(self.num_sites, int) or not 1 <= self.num_sites <= MAX_SITES:
            raise ValueError(f"num_sites must be an int in [1, {MAX_SITES}], got {self.num_sites!r}")
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {self.profile!r}")
        check_name(self.name)
        if self.kernel_netem not in (None, True, False):
            raise ValueError(f"kernel_netem must be None, True or False, got {self.kernel_netem!r}")
        if self.filter_backend not in (None, "nftables", "iptables"):
            raise ValueError(f"filter_backend must be None, 'nftables' or 'iptables', got {self.filter_backend!r}")
        if not isinstance(self.mtu_bytes, int) or not MIN_MTU_BYTES <= self.mtu_bytes <= MAX_MTU_BYTES:
            raise ValueError(f"mtu_bytes must be an int in [{MIN_MTU_BYTES}, {MAX_MTU_BYTES}], got {self.mtu_bytes!r}")


# ---------------------------------------------------------------- signal / exit safety net
_LIVE: list["Topology"] = []
_PREV_HANDLERS: dict[int, object] = {}
_LIVE_LOCK = threading.RLock()


def _on_signal(signum, frame) -> None:
    prev = _PREV_HANDLERS.get(signum, signal.SIG_DFL)
    logger.warning("signal %d: tearing down %d netem topologies", signum, len(_LIVE))
    for topo in list(_LIVE):
        try:
            topo.close()
        except Exception:
            logger.exception("teardown of %s failed", topo.name)
    if callable(prev):
        prev(signum, frame)
    elif signum == signal.SIGINT:
        raise KeyboardInterrupt
    else:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _register(topo: "Topology") -> None:
    with _LIVE_LOCK:
        if not _LIVE and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                current = signal.getsignal(sig)
                if current is signal.SIG_IGN or current is None:
                    continue
                _PREV_HANDLERS[sig] = current
                signal.signal(sig, _on_signal)
        _LIVE.append(topo)


def _unregister(topo: "Topology") -> None:
    with _LIVE_LOCK:
        if topo in _LIVE:
            _LIVE.remove(topo)
        if not _LIVE and _PREV_HANDLERS:
            if threading.current_thread() is threading.main_thread():
                for sig, handler in _PREV_HANDLERS.items():
                    if signal.getsignal(sig) is _on_signal:
                        signal.signal(sig, handler)
                _PREV_HANDLERS.clear()


@atexit.register
def _close_all_at_exit() -> None:
    for topo in list(_LIVE):
        try:
            topo.close()
        except Exception:
            logger.exception("teardown of %s at exit failed", topo.name)


# ---------------------------------------------------------------- the topology
class Topology:
    """N sites in network namespaces with emulated WAN links between them.

    Use as a context manager; everything is removed on exit, on an exception, and on
    SIGINT/SIGTERM (handlers are installed while a topology is up and chain to the
    previous ones). A helper process (``netem._agent``) delays packets and schedules
    periodic partitions; it tears the topology down if this process dies abruptly.

    Example::

        with Topology(num_sites=3, profile="transatlantic", name="dt") as topo:
            argv = topo.exec_argv(0, ["ping", "-c", "3", topo.address(1)])
            topo.set_link(2, loss_pct=5.0)
            topo.partition(1, True)

    Args:
        num_sites: Number of sites, 1 to 200.
        profile: A preset name (``lan``, ``continental``, ``transatlantic``, ``lossy``,
            ``flaky``) applied to every site.
        name: Topology name, [a-z0-9]{1,20}; default a unique one for this process.
        kernel_netem, persistent, filter_backend: see :class:`TopologyConfig`.
        mtu_bytes: see :class:`TopologyConfig`; None: the profile's (``Profile.mtu_bytes``).

    Raises:
        NetemUnavailable: not root, no ``ip netns``, or the profile needs a property no
            backend can emulate here (the message says which).
        ValueError: bad arguments, or a topology of that name already exists.
        CommandError: a system command failed while building (everything built so far
            is removed first).
    """

    def __init__(
        self,
        num_sites: int,
        profile: str = "lan",
        *,
        name: str | None = None,
        kernel_netem: bool | None = None,
        persistent: bool = False,
        filter_backend: str | None = None,
        mtu_bytes: int | None = None,
    ) -> None:
        if mtu_bytes is None:
            mtu_bytes = get_profile(profile).mtu_bytes if profile in PROFILES else 1500
        if name is None:
            name = f"t{os.getpid()}x{next(_counter)}"
        self.config = TopologyConfig(
            num_sites=num_sites,
            profile=profile,
            name=name,
            kernel_netem=kernel_netem,
            persistent=persistent,
            filter_backend=filter_backend,
            mtu_bytes=mtu_bytes,
        )
        self._init_names()
        self._lock = threading.RLock()
        self._closed = False
        self._owned = not persistent
        self._agent_popen: subprocess.Popen | None = None
        self._agent: dict | None = None
        self._links = [LinkParams() for _ in range(num_sites)]
        self._pairs: set[tuple[int, int]] = set()
        self._flap_epoch = time.time()
        if self.state_dir.exists() or any(ns in list_namespaces() for ns in self._all_ns()):
            raise ValueError(
                f"a netem topology named {name!r} already exists; remove it with "
                f"`python -m netem down --name {name}` (or `python -m netem cleanup`)"
            )
        self._caps = probe()
        self._backends = choose_backends(self._caps, kernel_netem=kernel_netem, filter_backend=filter_backend)
        self._delayer_binary: Path | None = None
        if self._backends["delay"] != "netem" and self._caps.iptables_nfqueue:
            self._delayer_binary = _cdelay.build_delayer()  # None: the Python delayer (warning logged)
            if self._delayer_binary is not None:
                self._backends = choose_backends(
                    self._caps, kernel_netem=kernel_netem, filter_backend=filter_backend, compiled_delayer=True
                )
        if self._owned:
            _register(self)
        try:
            self._build()
            self._set_all(get_profile(profile).link)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ naming
    def _init_names(self) -> None:
        name = self.config.name
        self.name = name
        self.num_sites = self.config.num_sites
        self.hub_namespace = f"{PREFIX}{name}-hub"
        self.site_namespaces = [f"{PREFIX}{name}-s{i}" for i in range(self.num_sites)]
        self.state_dir = STATE_ROOT / name
        self._addresses = [str(SUBNET.network_address + i + 1) for i in range(self.num_sites)]

    def _all_ns(self) -> list[str]:
        return [*self.site_namespaces, self.hub_namespace]

    def _site(self, site: int) -> int:
        if not isinstance(site, int) or isinstance(site, bool) or not 0 <= site < self.num_sites:
            raise ValueError(f"site must be an int in [0, {self.num_sites - 1}], got {site!r}")
        return site

    # ------------------------------------------------------------------ public API
    def address(self, site: int) -> str:
        """Site ``site``'s IPv4 address (inside its namespace), e.g. ``198.18.0.1``."""
        return self._addresses[self._site(site)]

    def addresses(self) -> list[str]:
        return list(self._addresses)

    def namespace(self, site: int) -> str:
        """Name of site ``site``'s network namespace (for ``ip netns exec``)."""
        return self.site_namespaces[self._site(site)]

    def exec_argv(self, site: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside site ``site`` (``ip netns exec NS ...``)."""
        return ns_cmd(self.namespace(site), list(argv))

    def popen(self, site: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside site ``site``; kwargs go to :class:`subprocess.Popen`."""
        return subprocess.Popen(self.exec_argv(site, argv), **kwargs)

    def socket(
        self, site: int, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM, proto: int = 0
    ) -> socket.socket:
        """A socket created inside site ``site``'s namespace (usable from this process)."""
        with in_namespace(self.namespace(site)):
            return socket.socket(family, type, proto)

    def link(self, site: int) -> LinkParams:
        """The current LinkParams of site ``site``."""
        with self._mutation(write=False):
            return self._links[self._site(site)]

    def backends(self) -> dict[str, str | None]:
        """Which backend emulates each property: delay, jitter, reorder, loss, rate, partition, flap."""
        return dict(self._backends)

    @property
    def flap_epoch(self) -> float:
        """Wall-clock start of the periodic-partition schedule (reset by set_link on change)."""
        return self._flap_epoch

    def set_link(self, site: int | None, params: LinkParams | str | None = None, **changes) -> None:
        """Change site ``site``'s link (or every site's when ``site`` is None), live.

        Args:
            site: Site index, or None for all sites.
            params: New LinkParams, or a profile name whose link to start from; None
                starts from the current link.
            **changes: LinkParams fields to change, e.g. ``delay_ms=50, loss_pct=1``.

        Changing flap_period_s/flap_down_s restarts the outage schedule: site ``i``'s
        first outage begins ``i * period / num_sites`` after the call.

        Raises:
            ValueError: bad site or field values.
            NetemUnavailable: a property with no backend here is set non-zero.
        """
        with self._mutation():
            sites = range(self.num_sites) if site is None else [self._site(site)]
            new = list(self._links)
            for i in sites:
                base = self._links[i]
                if isinstance(params, str):
                    base = get_profile(params).link
                elif isinstance(params, Profile):
                    base = params.link
                elif params is not None:
                    base = params
                new[i] = base.replace(**changes) if changes else base
            self._apply(new)

    def set_profile(self, profile: str) -> None:
        """Give every site the link of preset ``profile``."""
        self.set_link(None, profile)

    def partition(self, site: int, on: bool = True, *, peers: Iterable[int] | None = None) -> None:
        """Cut site ``site`` off from ``peers`` (default: every other site), or restore it.

        While cut, packets in both directions are dropped in the hub (existing TCP
        connections stall and retransmit, new ones time out); ``on=False`` restores.
        Independent of periodic (flap) partitions.

        Raises:
            ValueError: bad site/peers. NetemUnavailable: no partition backend here.
        """
        with self._mutation():
            site = self._site(site)
            others = range(self.num_sites) if peers is None else [self._site(p) for p in peers]
            pairs = {tuple(sorted((site, j))) for j in others if j != site}
            self._require("partition")
            new = (self._pairs | pairs) if on else (self._pairs - pairs)
            self._apply_partitions(new)

    def partitions(self) -> set[tuple[int, int]]:
        """Site pairs currently cut by :meth:`partition` (not counting flap outages)."""
        with self._mutation(write=False):
            return set(self._pairs)

    def stats(self) -> dict:
        """Helper-process statistics: packets delayed/held per site, sites in an outage."""
        if not self._agent_alive():
            return {"agent": None}
        return self._agent_request({"op": "stats"})

    def status(self) -> dict:
        """Everything known about this topology, JSON-serialisable."""
        with self._mutation(write=False):
            st = self._state()
        st["agent_alive"] = self._agent_alive()
        st["stats"] = self.stats() if st["agent_alive"] else None
        return st

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Topology":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the helper process, delete every namespace (links, qdiscs and rules go
        with them) and the state directory. Idempotent.

        Raises:
            CommandError: something could not be removed (after trying everything).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        errors: list[BaseException] = []
        try:
            self._stop_agent()
        except Exception as e:
            errors.append(e)
        for ns in self._all_ns():
            try:
                delete_namespace(ns)
            except Exception as e:
                errors.append(e)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            STATE_ROOT.rmdir()  # only when no other topology is left
        _unregister(self)
        if errors:
            for e in errors[1:]:
                logger.error("netem teardown: %s", e)
            raise errors[0]

    @property
    def closed(self) -> bool:
        return self._closed

    @classmethod
    def attach(cls, name: str) -> "Topology":
        """A handle on the running topology ``name`` (made by ``up`` or another process).

        The handle does not own the topology: it is not torn down when this process
        exits; call :meth:`close` to remove it.

        Raises:
            ValueError: no topology of that name.
        """
        check_name(name)
        path = STATE_ROOT / name / "state.json"
        if not path.exists():
            raise ValueError(f"no netem topology named {name!r} (no {path})")
        st = json.loads(path.read_text())
        self = cls.__new__(cls)
        self.config = TopologyConfig(**st["config"])
        self._init_names()
        self._lock = threading.RLock()
        self._closed = False
        self._owned = False
        self._agent_popen = None
        self._caps = None
        self._load_state(st)
        return self

    # ------------------------------------------------------------------ state
    def _state(self) -> dict:
        return {
            "config": dataclasses.asdict(self.config),
            "hub_namespace": self.hub_namespace,
            "site_namespaces": self.site_namespaces,
            "addresses": self._addresses,
            "backends": self._backends,
            "links": [p.to_dict() for p in self._links],
            "partitions": sorted(list(p) for p in self._pairs),
            "flap_epoch": self._flap_epoch,
            "agent": self._agent,
        }

    def _load_state(self, st: dict) -> None:
        self._backends = st["backends"]
        self._links = [LinkParams.from_dict(d) for d in st["links"]]
        self._pairs = {tuple(p) for p in st["partitions"]}
        self._flap_epoch = st["flap_epoch"]
        self._agent = st["agent"]

    def _write_state(self) -> None:
        tmp = self.state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(self._state(), indent=1))
        tmp.replace(self.state_dir / "state.json")

    @contextlib.contextmanager
    def _mutation(self, write: bool = True):
        """Serialise changes across threads and processes; reload state others wrote."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"netem topology {self.name!r} is closed")
            with open(self.state_dir / "lock", "a+") as lockf:
                fcntl.flock(lockf, fcntl.LOCK_EX)
                path = self.state_dir / "state.json"
                if path.exists():
                    self._load_state(json.loads(path.read_text()))
                yield
                if write:
                    self._write_state()

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=False)
        (self.state_dir / "topology.json").write_text(
            json.dumps(
                {
                    "name": self.name,
                    "hub_namespace": self.hub_namespace,
                    "site_namespaces": self.site_namespaces,
                    "addresses": self._addresses,
                    "backends": self._backends,
                    "delayer_binary": None if self._delayer_binary is None else str(self._delayer_binary),
                }
            )
        )
        hub = self.hub_namespace
        gw = HUB_ADDRESS
        run(["ip", "netns", "add", hub])
        run(["ip", "-n", hub, "link", "set", "lo", "up"])
        run(ns_cmd(hub, ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]))
        if not self._caps.ethtool:
            why = [n for n in self._caps.notes if n.startswith("ethtool")]
            logger.warning("%s: offloads stay on (%s): loss and delay fall on whole 64 KB writes", self.name, why)
        for i, ns in enumerate(self.site_namespaces):
            port, addr = _rules.hub_port(i), self._addresses[i]
            run(["ip", "netns", "add", ns])
            run(["ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", _rules.SITE_IF, "netns", ns])
            if self._caps.ethtool:  # per-packet loss/delay instead of 64 KB GSO lumps
                run(ns_cmd(hub, _rules.offloads_off_argv(port)))
                run(ns_cmd(ns, _rules.offloads_off_argv(_rules.SITE_IF)))
            if self.config.mtu_bytes != 1500:
                run(["ip", "-n", hub, "link", "set", port, "mtu", str(self.config.mtu_bytes)])
                run(["ip", "-n", ns, "link", "set", _rules.SITE_IF, "mtu", str(self.config.mtu_bytes)])
            run(["ip", "-n", hub, "addr", "add", f"{gw}/32", "dev", port])
            run(["ip", "-n", hub, "link", "set", port, "up"])
            run(["ip", "-n", hub, "route", "add", f"{addr}/32", "dev", port, "src", gw])
            run(["ip", "-n", ns, "addr", "add", f"{addr}/32", "dev", _rules.SITE_IF])
            run(["ip", "-n", ns, "link", "set", _rules.SITE_IF, "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            run(["ip", "-n", ns, "route", "add", f"{gw}/32", "dev", _rules.SITE_IF])
            run(["ip", "-n", ns, "route", "add", str(SUBNET), "via", gw, "dev", _rules.SITE_IF, "src", addr])
        if self._uses_iptables():
            run(
                ns_cmd(hub, ["iptables-restore", "--noflush"]),
                input=_rules.ipt_hub_base(filters=self._backends["partition"] == "iptables"),
            )
        if self._backends["partition"] == "nftables":
            run(ns_cmd(hub, ["nft", "-f", "-"]), input=_rules.nft_hub_base())
        self._agent = None
        self._write_state()
        logger.info("netem topology %s up: %d sites, backends %s", self.name, self.num_sites, self._backends)

    def _uses_iptables(self) -> bool:
        return self._backends["delay"] in NFQUEUE_DELAY or self._backends["partition"] == "iptables"

    def _set_all(self, link: LinkParams) -> None:
        with self._mutation():
            self._apply([link] * self.num_sites)

    # ------------------------------------------------------------------ applying
    def _require(self, prop: str) -> None:
        if self._backends.get(prop) is None:
            notes = "; ".join(self._caps.notes) if self._caps else ""
            raise NetemUnavailable(f"no backend can emulate {prop} here (backends {self._backends}); {notes}")

    def _apply(self, new: list[LinkParams]) -> None:
        """Make the kernel and the agent match ``new`` (called with the mutation lock)."""
        old = self._links
        b = self._backends
        for p in new:
            if p.needs_delay:
                self._require("delay")
            if p.reorder_pct > 0:
                self._require("reorder")
            if p.loss_pct > 0:
                self._require("loss")
            if p.flap_period_s > 0:
                self._require("flap")
        changed = [i for i in range(self.num_sites) if new[i] != old[i]]
        if not changed:
            return
        flap_changed = any(
            (new[i].flap_period_s, new[i].flap_down_s) != (old[i].flap_period_s, old[i].flap_down_s) for i in changed
        )
        if flap_changed:
            self._flap_epoch = time.time()
        userspace = b["delay"] in NFQUEUE_DELAY
        needs_agent = any(p.flap_period_s > 0 for p in new) or (userspace and any(p.needs_delay for p in new))
        self._links = new
        # 1. the agent learns delays before packets are queued to it
        if needs_agent:
            self._ensure_agent()
        if self._agent_alive():
            self._agent_request({"op": "config", "links": [p.to_dict() for p in new], "flap_epoch": self._flap_epoch})
        hub = self.hub_namespace
        for i in changed:
            o, n = old[i], new[i]
            port = _rules.hub_port(i)
            if n.rate_mbit != o.rate_mbit:
                self._tc(self.site_namespaces[i], _rules.tbf_argv(_rules.SITE_IF, n.rate_mbit, self.config.mtu_bytes))
            if b["delay"] == "netem":
                self._tc(hub, _rules.netem_argv(port, n))
            elif n.rate_mbit != o.rate_mbit:
                self._tc(hub, _rules.tbf_argv(port, n.rate_mbit, self.config.mtu_bytes))

        def differs(attr: str) -> bool:
            return any(getattr(new[i], attr) != getattr(old[i], attr) for i in changed)

        if userspace and any(new[i].needs_delay != old[i].needs_delay for i in changed):
            run(
                ns_cmd(hub, ["iptables-restore", "--noflush"]),
                input=_rules.ipt_chain("DTN-DELAY", _rules.ipt_delay_rules(new)),
            )
        if b["loss"] == "nftables" and differs("loss_pct"):
            run(ns_cmd(hub, ["nft", "-f", "-"]), input=_rules.nft_chain("loss", _rules.loss_matches(new)))
        elif b["loss"] == "iptables" and differs("loss_pct"):
            run(
                ns_cmd(hub, ["iptables-restore", "--noflush"]),
                input=_rules.ipt_chain("DTN-LOSS", _rules.ipt_loss_rules(new)),
            )

    def _tc(self, ns: str, argv: list[str]) -> None:
        proc = run(ns_cmd(ns, argv), check=False)
        if proc.returncode != 0:
            if argv[2] == "del" and (
                "No such file" in proc.stderr or "handle of zero" in proc.stderr or "Invalid handle" in proc.stderr
            ):
                return  # there was no qdisc to delete
            raise CommandError(ns_cmd(ns, argv), proc.returncode, proc.stderr)

    def _apply_partitions(self, pairs: set[tuple[int, int]]) -> None:
        if self._backends["partition"] == "nftables":
            run(
                ns_cmd(self.hub_namespace, ["nft", "-f", "-"]),
                input=_rules.nft_chain("part", _rules.part_matches(pairs)),
            )
        else:
            run(
                ns_cmd(self.hub_namespace, ["iptables-restore", "--noflush"]),
                input=_rules.ipt_chain("DTN-PART", _rules.ipt_part_rules(pairs)),
            )
        self._pairs = pairs

    # ------------------------------------------------------------------ the agent
    def _agent_alive(self) -> bool:
        a = self._agent
        return a is not None and pid_alive(a["pid"], a["start_time"])

    def _ensure_agent(self) -> None:
        if self._agent_alive():
            return
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        argv = [sys.executable, "-m", "netem._agent", "--state-dir", str(self.state_dir)]
        if self._owned:
            argv += ["--watch-pid", str(os.getpid())]
        log = open(self.state_dir / "agent.log", "ab")
        try:
            popen = subprocess.Popen(
                ns_cmd(self.hub_namespace, argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
                cwd="/",
            )
        finally:
            log.close()
        self._agent_popen = popen
        deadline = time.monotonic() + 15.0
        while True:
            if popen.poll() is not None:
                tail = (self.state_dir / "agent.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"netem agent exited with {popen.returncode}: {tail}")
            try:
                self._agent = {"pid": popen.pid, "start_time": proc_start_time(popen.pid)}
                self._agent_request({"op": "ping"}, timeout_s=1.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    terminate(popen.pid, popen=popen)
                    self._agent = None
                    raise RuntimeError("netem agent did not come up within 15 s") from None
                time.sleep(0.02)
        logger.info("netem agent for %s started (pid %d)", self.name, popen.pid)

    def _agent_request(self, req: dict, timeout_s: float = 10.0) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(self.state_dir / "agent.sock"))
            s.sendall(json.dumps(req).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError("netem agent closed the connection")
                buf += chunk
        resp = json.loads(buf)
        if not resp.get("ok"):
            raise RuntimeError(f"netem agent refused {req.get('op')}: {resp.get('error')}")
        return resp

    def _stop_agent(self) -> None:
        a = self._agent
        if a is not None:
            terminate(a["pid"], start_time=a["start_time"], popen=self._agent_popen)
        elif self._agent_popen is not None:
            terminate(self._agent_popen.pid, popen=self._agent_popen)


# ---------------------------------------------------------------- module-level helpers
def list_topologies() -> list[str]:
    """Names of the topologies with a state directory under /run/dtrain-netem."""
    if not STATE_ROOT.exists():
        return []
    return sorted(p.name for p in STATE_ROOT.iterdir() if (p / "topology.json").exists() or (p / "state.json").exists())


def cleanup_all() -> list[str]:
    """Remove every leftover of the harness, by its own name prefix only.

    Stops helper processes recorded in /run/dtrain-netem/*/state.json (only when the
    PID still runs ``netem._agent``), deletes every namespace called ``dtnetem-*``
    (killing processes left inside it) and removes /run/dtrain-netem. Other
    namespaces, links and rules are never touched.

    Returns:
        What was removed, one line each.
    """
    removed = []
    if STATE_ROOT.exists():
        for d in sorted(STATE_ROOT.iterdir()):
            try:
                agent = json.loads((d / "state.json").read_text()).get("agent")
            except (OSError, ValueError):
                agent = None
            if agent and pid_alive(agent["pid"], agent["start_time"]):
                try:
                    cmdline = Path(f"/proc/{agent['pid']}/cmdline").read_bytes()
                except OSError:
                    cmdline = b""
                if b"netem._agent" in cmdline:
                    terminate(agent["pid"], start_time=agent["start_time"])
                    removed.append(f"agent process {agent['pid']}")
    for ns in list_namespaces():
        if ns.startswith(PREFIX):
            delete_namespace(ns)
            removed.append(f"namespace {ns}")
    if STATE_ROOT.exists():
        for d in sorted(STATE_ROOT.iterdir()):
            removed.append(f"state {d}")
        shutil.rmtree(STATE_ROOT, ignore_errors=True)
    return removed
