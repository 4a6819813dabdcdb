"""The store under the rendezvous core: what it keeps and the operations the core needs.

:class:`~dtrain.rendezvous.core.RendezvousCore` makes every decision (who is answered
what, when a round forms, with whom, why); a store keeps the facts those decisions read
and write. Two stores implement :class:`RendezvousStore`:
:class:`~dtrain.rendezvous.memory_store.MemoryStore` (in this process, the default) and
:class:`~dtrain.rendezvous.etcd_store.EtcdStore` (etcd v3; any number of front-ends and
sites share one run).

The operations are the store-level steps of the core's calls: claim a site id (refused
while another live site at another address holds it), keep a site alive (a heartbeat;
on etcd a lease keep-alive), read a site's standing for a round, mark it ready, read the
quorum view, write a round's plan once (compare-and-set: the first writer wins, and
every caller gets the plan that holds), wait for a plan (a condition variable; on etcd
a watch), and the status page's rows.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Protocol, Sequence

from dtrain.errors import PermanentError, RendezvousError
from dtrain.protocol import Member, RoundPlan

__all__ = ["SiteIdTaken", "taken_message", "Standing", "ReadyCounts", "QuorumView", "Liveness", "RendezvousStore"]


class SiteIdTaken(PermanentError, RendezvousError):
    """A live site at another address already holds this site id on this run (the etcd
    store refuses the second; its message says what to do). Permanent: a site retrying
    it would only be refused again, so it is never retried (gRPC: ALREADY_EXISTS)."""

    fix = "give each site its own site id (DiLoCoConfig.site_id; the CLI's --site-id)"


def taken_message(site_id: str, held: str, address: str, run: str, heartbeat_timeout_s: float) -> str:
    """The :class:`SiteIdTaken` text, the same from both stores."""
    return (
        f"site id {site_id!r} is held by a live site at {held} on run {run!r} "
        f"(this one is at {address}): give each site its own --site-id, or wait "
        f"{heartbeat_timeout_s}s for the other to be declared dead"
    )


@dataclass(frozen=True, kw_only=True)
class Standing:
    """What a store shows of one site for a ready for ``round`` (one read).

    Attributes:
        known: the site is registered and has not left.
        resync_reason: set when the site was declared dead (it must resync); else None.
        plan: the plan of ``round`` if one exists.
        member: whether the site is in ``plan``.
        plan_reason: why the quorum rule formed ``plan`` as it did.
        next_round: the round the store is forming (as this process knows it).
        lease: the site's lease (etcd; 0 in memory), for its ready key.
    """

    known: bool
    resync_reason: str | None = None
    plan: RoundPlan | None = None
    member: bool = False
    plan_reason: str = ""
    next_round: int = 0
    lease: int = 0


@dataclass(frozen=True, kw_only=True)
class ReadyCounts:
    """What a ready's write read back without listing anyone: enough to tell that the
    quorum cannot be complete yet (see ``core.cannot_form_yet``).

    Attributes:
        num_live: live sites.
        num_ready: sites ready for the round (live or not).
        first_ready_t: the earliest ready time (store clock, seconds), or None.
    """

    num_live: int
    num_ready: int
    first_ready_t: float | None


@dataclass(frozen=True, kw_only=True)
class QuorumView:
    """What :func:`~dtrain.rendezvous.core.decide_quorum` reads, from one store read.

    Attributes:
        live: site ids alive and in good standing.
        ready: site id -> when it became ready for the round (store clock, seconds).
        joined: how many sites are registered.
        startup_t: when the ``initial_sites``-th site joined (store clock), or None.
        first_round: whether the start-up rules apply (no plan formed here yet).
        grace_left_s: seconds a restarted in-memory rendezvous still waits for every
            live site to re-register before it forms a round (0: none).
        member: site id -> its :class:`Member` (for the plan).
    """

    live: Collection[str]
    ready: Mapping[str, float]
    joined: int
    startup_t: float | None
    first_round: bool
    grace_left_s: float
    member: Callable[[str], Member]


@dataclass(frozen=True, kw_only=True)
class Liveness:
    """A heartbeat's outcome: ``known`` False asks the site to join again; a
    ``resync_reason`` means it was declared dead and must resync."""

    known: bool
    resync_reason: str | None = None


class RendezvousStore(Protocol):
    """What :class:`~dtrain.rendezvous.core.RendezvousCore` needs from a store.

    ``now`` is the caller's monotonic time; a store whose facts other processes compare
    uses its own clock for stored times (``clock``). Every method may raise
    ``RendezvousError`` when the store cannot be reached.
    """

    blocking: bool  # its calls wait on the network: the gRPC servicer runs them on threads
    local: bool  # reads are cheap and changes wake waiters: decide on every tick

    def atomic(self) -> AbstractContextManager: ...
    def clock(self, now: float) -> float: ...
    def next_round(self) -> int: ...
    def claim(self, site_id: str, address: str, rank_addresses: Sequence[str], *, now: float) -> int: ...
    def live_members(self, now: float) -> list[Member]: ...
    def keep_alive(
        self,
        site_id: str,
        *,
        now: float,
        inner_step: int,
        last_loss: float | None,
        unreachable: Sequence[str],
    ) -> Liveness: ...
    def dead(self, now: float) -> tuple[str, ...]: ...
    def release(self, site_id: str, *, now: float) -> None: ...
    def put_reports(self, site_id: str, raws: Sequence[str], sink) -> None: ...
    def standing(self, site_id: str, round: int, *, now: float) -> Standing: ...
    def adopt(self, round: int, *, now: float) -> bool: ...
    def mark_ready(self, site_id: str, round: int, *, now: float, lease: int) -> ReadyCounts | None: ...
    def view(self, round: int, *, now: float) -> QuorumView: ...
    def put_plan(self, plan: RoundPlan, reason: str, *, now: float) -> tuple[RoundPlan, str, bool]: ...
    def wait(self, round: int, timeout_s: float) -> None: ...
    def site_rows(self, now: float, sink) -> tuple[dict[str, dict], float | None]: ...
    def close(self) -> None: ...
