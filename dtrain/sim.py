"""An in-process cluster of DiLoCo sites, for tests and fast simulations.

:class:`InprocCluster` builds N sites in one process: one
:class:`~dtrain.transports.inproc.InprocNetwork` (with seeded
:class:`~dtrain.transports.inproc.InprocFaults`), one
:class:`~dtrain.rendezvous.RendezvousCore`, and per site a model from a factory
(deep copies of one instance, so every site starts from identical weights), an
inner optimizer and a :class:`~dtrain.diloco.DiLoCo` wrapper. Each site runs its
own training loop in a thread; round outcomes are collected through
``DiLoCo.on_round``.

Example::

    cluster = InprocCluster(lambda: torch.nn.Linear(4, 1),
                            lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                            ClusterConfig(num_sites=3, diloco=fast_diloco_config(sync_every=5)))
    def step(site, k):
        x, y = data(site.index, k)
        loss = ((site.model(x) - y) ** 2).mean()
        loss.backward(); site.optimizer.step(); site.optimizer.zero_grad()
    with cluster:
        cluster.run_steps(step, num_steps=20, timeout_s=30)
        assert len(set(cluster.checksums())) == 1

Faults: :meth:`InprocCluster.kill` (a site dies now), :meth:`kill_during_round`
(an owner dies after the reduce, before serving any mean),
:meth:`drop_broadcast` (a site misses means), :meth:`drop_contributions`, plus
the random ``push_loss`` / ``pull_loss`` / ``delay_s`` of ``ClusterConfig.faults``
(change them mid-run with ``cluster.network.set_faults``); :meth:`restart` brings
a killed site back (join + state pull, as a restarted process).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from dtrain.buckets import assign_owners
from dtrain.diloco import DiLoCo, DiLoCoConfig
from dtrain.membership import GroupConfig
from dtrain.rendezvous import InprocRendezvousClient, RendezvousConfig, RendezvousCore
from dtrain.rounds import RoundEngine, RoundResult
from dtrain.rounds.outcome import SyncOutcome
from dtrain.state import GlobalState, OuterOptimizerFactory, default_outer_optimizer
from dtrain.transports.base import Transport
from dtrain.transports.inproc import FaultRule, InprocFaults, InprocNetwork, InprocTransport

__all__ = [
    "ClusterConfig",
    "Site",
    "InprocCluster",
    "fast_diloco_config",
    "fast_rendezvous_config",
    "fast_group_config",
]

log = logging.getLogger(__name__)


def fast_rendezvous_config(num_sites: int, **overrides: object) -> RendezvousConfig:
    """Rendezvous timing for in-process runs: round 0 waits for all ``num_sites``.

    Rounds form as soon as every live site is ready, so the long
    ``quorum_timeout_s`` costs nothing unless a site is slow or dead; a dead
    site stops counting after ``heartbeat_timeout_s``. ``reduce_timeout_s`` is
    only waited for when a contribution is lost (the owner cannot tell).
    """
    kw: dict = dict(
        min_sites=1,
        initial_sites=num_sites,
        quorum_timeout_s=5.0,
        heartbeat_interval_s=0.05,
        heartbeat_timeout_s=1.5,
        reduce_timeout_s=1.0,
        broadcast_timeout_s=2.0,
    )
    kw.update(overrides)
    return RendezvousConfig(**kw)


def fast_group_config(**overrides: object) -> GroupConfig:
    """Group (rendezvous-client) timing for in-process runs."""
    kw: dict = dict(
        quorum_wait_s=30.0, ready_poll_s=0.2, rendezvous_retry_s=0.5, backoff_max_s=0.2, state_pull_timeout_s=10.0
    )
    kw.update(overrides)
    return GroupConfig(**kw)


def fast_diloco_config(**overrides: object) -> DiLoCoConfig:
    """DiLoCo for in-process runs: H = 4 inner steps and :func:`fast_group_config`'s
    timing; ``overrides`` are :class:`~dtrain.diloco.DiLoCoConfig` fields
    (``fast_diloco_config(sync_every=1, rounds=RoundConfig(repair=False))``)."""
    kw: dict = dict(sync_every=4, group=fast_group_config())
    kw.update(overrides)
    return DiLoCoConfig(**kw)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Shape of an in-process cluster: the component configs of its sites nested, not
    re-declared.

    Attributes:
        num_sites: number of sites N, an int >= 1; site ids are ``f"{site_prefix}{i}"``.
        diloco: every site's DiLoCo config (H, buckets, rounds, group timing, streaming);
            its ``site_id`` is replaced by each site's own, and ``hook_optimizer`` must
            stay True (the sites count inner steps through their optimizer's ``step``).
            Default :func:`fast_diloco_config`.
        rendezvous: rendezvous timing; None: :func:`fast_rendezvous_config` for ``num_sites``.
        faults: random faults of the network (seeded).
        seed: ``torch.manual_seed`` before the model factory runs once.
        site_prefix: prefix of the site ids, non-empty.
    """

    num_sites: int = 2
    diloco: DiLoCoConfig = field(default_factory=fast_diloco_config)
    rendezvous: RendezvousConfig | None = None
    faults: InprocFaults = field(default_factory=InprocFaults)
    seed: int = 0
    site_prefix: str = "site-"

    def __post_init__(self) -> None:
        if not isinstance(self.num_sites, int) or isinstance(self.num_sites, bool) or self.num_sites < 1:
            raise ValueError(f"num_sites must be an int >= 1, got {self.num_sites!r}")
        if not isinstance(self.diloco, DiLoCoConfig):
            raise ValueError(f"diloco must be a DiLoCoConfig (see fast_diloco_config), got {self.diloco!r}")
        if not self.diloco.hook_optimizer:
            raise ValueError("diloco.hook_optimizer must be True (a cluster's sites count steps through the hook)")
        if self.rendezvous is not None and not isinstance(self.rendezvous, RendezvousConfig):
            raise ValueError(f"rendezvous must be none or a RendezvousConfig, got {self.rendezvous!r}")
        if not isinstance(self.site_prefix, str) or not self.site_prefix:
            raise ValueError(f"site_prefix must be a non-empty string, got {self.site_prefix!r}")


class Site:
    """One site of an :class:`InprocCluster`.

    Attributes:
        index: position in the cluster (0-based).
        site_id: its id in plans and logs.
        model: its model (trained in place by the training callable).
        optimizer: its inner optimizer (``step()`` is hooked by DiLoCo).
        scheduler: its inner LR scheduler, or None (stepped by the training callable).
        diloco: its :class:`~dtrain.diloco.DiLoCo` wrapper.
        rendezvous: its rendezvous client (``down=True`` cuts it off).
        outcomes: every :class:`~dtrain.membership.SyncOutcome`, in order.
        error: the exception its training callable raised, if any.
        killed: set once the site was killed.
    """

    def __init__(
        self,
        index: int,
        site_id: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        diloco: DiLoCo,
        rendezvous: InprocRendezvousClient,
        *,
        scheduler: "torch.optim.lr_scheduler.LRScheduler | None" = None,
    ) -> None:
        self.index = index
        self.scheduler = scheduler
        self.site_id = site_id
        self.model = model
        self.optimizer = optimizer
        self.diloco = diloco
        self.rendezvous = rendezvous
        self.outcomes: list[SyncOutcome] = []
        self.error: BaseException | None = None
        self.killed = threading.Event()
        self.thread: threading.Thread | None = None
        diloco.on_round.append(self.outcomes.append)

    @property
    def engine(self) -> RoundEngine:
        return self.diloco.engine

    @property
    def state(self) -> GlobalState:
        return self.diloco.state

    @property
    def address(self) -> str:
        assert self.engine.address is not None
        return self.engine.address

    @property
    def results(self) -> list[RoundResult]:
        """The :class:`~dtrain.rounds.RoundResult` of every round this site ran."""
        return [o.result for o in self.outcomes if o.result is not None]

    def checksums(self) -> tuple[str, ...]:
        """Checksum of θ_b per bucket."""
        return tuple(self.state.checksums())

    def theta(self) -> torch.Tensor:
        """θ as one fp32 vector (buckets concatenated in order; a copy)."""
        return torch.cat([t.detach() for t in self.state.theta]).clone()

    def __repr__(self) -> str:
        return f"Site({self.site_id!r}, round={self.diloco.round}, killed={self.killed.is_set()})"


class InprocCluster:
    """N DiLoCo sites over one in-process network and one rendezvous.

    Args:
        model_factory: builds the model; called once after
            ``torch.manual_seed(config.seed)``, then deep-copied per site.
        optimizer_factory: builds a site's inner optimizer from its model.
        config: see :class:`ClusterConfig`.
        outer_optimizer: factory of the outer optimizer per bucket (default
            DiLoCo's SGD lr 0.7, momentum 0.9, Nesterov).
        transport_factory: ``transport_factory(i)`` -> site i's data-path transport
            (e.g. a loopback :class:`~dtrain.transports.datagram.DatagramTransport`);
            None: an :class:`~dtrain.transports.inproc.InprocTransport` on the cluster's
            network. Other transports bypass that network: its faults, :meth:`kill`
            and the drop helpers then do not reach the data path.
        scheduler_factory: builds a site's inner LR scheduler from its inner
            optimizer (``Site.scheduler``; the training callable steps it); it is
            handed to DiLoCo, so a restarted site takes a member's schedule position.

    Use as a context manager (or call :meth:`close`) so that every site
    leaves the group and stops serving.
    """

    def __init__(
        self,
        model_factory: Callable[[], torch.nn.Module],
        optimizer_factory: Callable[[torch.nn.Module], torch.optim.Optimizer],
        config: ClusterConfig | None = None,
        *,
        outer_optimizer: OuterOptimizerFactory = default_outer_optimizer,
        transport_factory: Callable[[int], Transport] | None = None,
        scheduler_factory: "Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None" = None,
    ) -> None:
        self.config = cfg = config or ClusterConfig()
        self.network = InprocNetwork(cfg.faults)
        self.core = RendezvousCore(cfg.rendezvous or fast_rendezvous_config(cfg.num_sites))
        self._dead: list[Site] = []
        torch.manual_seed(cfg.seed)
        self._proto = model_factory()
        self._optimizer_factory = optimizer_factory
        self._scheduler_factory = scheduler_factory
        self._transport_factory = transport_factory
        self._outer_optimizer = outer_optimizer
        self.sites: list[Site] = []
        self._by_address: dict[str, Site] = {}
        self.network.add_down_listener(self._on_down)
        try:
            for i in range(cfg.num_sites):
                self._add_site(i)
        except BaseException:
            self.close()
            raise

    def _add_site(self, i: int) -> Site:
        """Build site ``i`` from a copy of the initial model; it joins the group (pulling θ
        and a training position from a member when rounds already ran)."""
        cfg = self.config
        site_id = f"{cfg.site_prefix}{i}"
        model = copy.deepcopy(self._proto)
        opt = self._optimizer_factory(model)
        scheduler = self._scheduler_factory(opt) if self._scheduler_factory is not None else None
        client = InprocRendezvousClient(self.core)
        dcfg = replace(cfg.diloco, site_id=site_id)
        transport = self._transport_factory(i) if self._transport_factory else InprocTransport(self.network)
        d = DiLoCo(
            model,
            opt,
            config=dcfg,
            outer_optimizer=self._outer_optimizer,
            transport=transport,
            rendezvous=client,
            inner_scheduler=scheduler,
        )
        site = Site(i, site_id, model, opt, d, client, scheduler=scheduler)
        if i < len(self.sites):
            self.sites[i] = site
        else:
            self.sites.append(site)
        self._by_address[site.address] = site
        return site

    def restart(self, i: int) -> Site:
        """Site ``i``, killed earlier, comes back as a new process would: a fresh copy of
        the initial model and a new inner optimizer, a new address, the same site id.
        It joins the group, pulls θ from the members and takes a member's training
        position (inner step, inner optimizer and scheduler state), then replaces
        ``self.sites[i]`` (the dead one is closed without waiting). Blocks for the join
        (at most the group's ``state_pull_timeout_s`` per attempt).

        Raises:
            ValueError: site ``i`` was not killed.
        """
        old = self.sites[i]
        if not old.killed.is_set():
            raise ValueError(f"site {i} ({old.site_id}) is alive; kill it before restarting it")
        self._dead.append(old)
        return self._add_site(i)

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self.sites)

    def __getitem__(self, i: int) -> Site:
        return self.sites[i]

    @property
    def live_sites(self) -> list[Site]:
        return [s for s in self.sites if not s.killed.is_set()]

    def owners(self, site_ids: Sequence[str] | None = None) -> list[str]:
        """Owner site_id of each bucket for a round with ``site_ids`` (default: all sites)."""
        ids = list(site_ids) if site_ids is not None else [s.site_id for s in self.sites]
        return assign_owners(len(self.sites[0].state), ids)

    def checksums(self, sites: Sequence[Site] | None = None) -> list[tuple[str, ...]]:
        """Per site (default: the live ones), the θ_b checksum of every bucket."""
        return [s.checksums() for s in (self.live_sites if sites is None else sites)]

    # ------------------------------------------------------------------ running
    def run(self, fn: Callable[[Site], None], *, timeout_s: float = 60.0, sites: Sequence[Site] | None = None) -> None:
        """Run ``fn(site)`` (a site's whole training loop) in one thread per site.

        Args:
            fn: the training loop; it calls ``site.optimizer.step()`` (hooked:
                rounds run inside it) and should return soon after
                ``site.killed`` is set.
            timeout_s: the threads are joined with this overall limit.
            sites: which sites to run (default: the live ones).
        Raises:
            TimeoutError: a thread was still running at the limit (it is a
                daemon thread and is left behind; the message names the sites).
            RuntimeError: the callable of a site that was not killed raised
                (chained from the first such exception).
        """
        chosen = list(self.live_sites if sites is None else sites)

        def body(site: Site) -> None:
            try:
                fn(site)
            except BaseException as e:  # noqa: BLE001 - reported by run()
                site.error = e
                if not site.killed.is_set():
                    log.exception("%s: training callable raised", site.site_id)

        for s in chosen:
            s.error = None
            s.thread = threading.Thread(target=body, args=(s,), name=f"sim-{s.site_id}", daemon=True)
            s.thread.start()
        deadline = time.monotonic() + timeout_s
        for s in chosen:
            assert s.thread is not None
            s.thread.join(max(0.0, deadline - time.monotonic()))
        hung = [s.site_id for s in chosen if s.thread is not None and s.thread.is_alive()]
        if hung:
            raise TimeoutError(f"sites {hung} still running after {timeout_s} s")
        for s in chosen:
            if s.error is not None and not s.killed.is_set():
                raise RuntimeError(f"{s.site_id} failed: {s.error!r}") from s.error

    def run_steps(
        self,
        step_fn: Callable[[Site, int], None],
        num_steps: int,
        *,
        timeout_s: float = 60.0,
        sites: Sequence[Site] | None = None,
    ) -> None:
        """Call ``step_fn(site, k)`` for ``k in range(num_steps)`` on every site,
        stopping a site early once it is killed. See :meth:`run`."""

        def loop(site: Site) -> None:
            for k in range(num_steps):
                if site.killed.is_set():
                    return
                step_fn(site, k)

        self.run(loop, timeout_s=timeout_s, sites=sites)

    # ------------------------------------------------------------------ faults
    def _on_down(self, address: str) -> None:
        site = self._by_address.get(address)
        if site is None or site.killed.is_set():
            return
        log.warning("sim: %s killed", site.site_id)
        site.rendezvous.down = True  # its heartbeats stop reaching the rendezvous
        site.killed.set()

    def kill(self, i: int) -> None:
        """Site ``i`` dies now: unreachable, no more heartbeats; its thread stops
        at its next step (a round in progress there runs out on its own)."""
        self.network.set_down(self.sites[i].address)

    def kill_during_round(self, i: int, round: int) -> None:
        """Site ``i`` dies in round ``round`` at the moment the first peer asks it
        for a mean: after it received contributions, before anyone got its means."""
        self.network.add_rule(
            FaultRule(kind="pull_mean", dst=self.sites[i].address, round=round, action="kill_dst", times=1)
        )

    def drop_broadcast(
        self, i: int, *, round: int | None = None, bucket: int | None = None, times: int | None = None
    ) -> None:
        """Site ``i`` misses the means it pulls (from anyone, late pulls included)
        for ``round``/``bucket`` (None: any)."""
        self.network.add_rule(
            FaultRule(kind="pull_mean", sender=self.sites[i].site_id, round=round, bucket=bucket, times=times)
        )

    def drop_contributions(
        self, i: int, *, round: int | None = None, bucket: int | None = None, times: int | None = None
    ) -> None:
        """Chunks that site ``i`` pushes for ``round``/``bucket`` are lost silently."""
        self.network.add_rule(
            FaultRule(kind="push", sender=self.sites[i].site_id, round=round, bucket=bucket, times=times)
        )

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Every site leaves the group and stops serving (idempotent)."""
        for s in [*self._dead, *self.sites]:
            try:
                s.diloco.close(wait=not s.killed.is_set())  # a killed site's means are not served anyway
            except Exception as e:  # noqa: BLE001 - best effort at shutdown
                log.warning("closing %s: %s", s.site_id, e)

    def __enter__(self) -> "InprocCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
