"""Membership and quorum: pure decisions plus a thread-safe core.

The rendezvous knows who is alive (heartbeats), who is ready for round r, and
forms each round's quorum. Decisions are pure functions of the state and
``now`` that return the decision and a reason string, which is logged on both
sides. The gRPC service (``dtrain.rendezvous.grpc``) and the in-process client
(:class:`InprocRendezvousClient`) both wrap :class:`RendezvousCore`.

Quorum rule (docs/ARCHITECTURE.md, "One round", step 2): once the first site is ready for round r, the
round admits every live site ready within ``quorum_timeout_s`` after it, or all
live sites as soon as they are all ready, with at least ``min_sites``. Round 0
additionally waits until ``initial_sites`` sites have joined, so sites that
start together form one group, never two. State is soft: a restarted
rendezvous rebuilds membership from re-joins and adopts the highest round a
site asks for.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from dtrain.errors import RendezvousError
from dtrain.protocol import HeartbeatInfo, JoinInfo, Member, ReadyDecision, RoundPlan

__all__ = [
    "RendezvousConfig",
    "SiteRecord",
    "decide_quorum",
    "ReportSink",
    "NullReportSink",
    "RendezvousCore",
    "InprocRendezvousClient",
    "SiteIdTaken",
]

log = logging.getLogger(__name__)


class SiteIdTaken(RendezvousError):
    """A live site at another address already holds this site id on this run (the etcd
    store refuses the second; its message starts with "site id" and says what to do)."""


@dataclass(frozen=True, kw_only=True)
class RendezvousConfig:
    """Membership and round timing.

    Attributes:
        min_sites: fewest sites a round may have (>= 1).
        initial_sites: round 0 starts only once this many sites joined
            (None: ``min_sites``).
        quorum_timeout_s: after the first site is ready, how long the others
            have to become ready before they are cut as stragglers.
        heartbeat_interval_s: how often sites heartbeat.
        heartbeat_timeout_s: a site silent this long is dead (> interval).
        reduce_timeout_s: plan deadline for owners to finalize (from plan receipt).
        broadcast_timeout_s: plan deadline for pulling means (> reduce_timeout_s).
        suspect_timeout_s: a site that a member reported unreachable on the data path
            (a refused push or mean pull, a push stream that broke) is dead once silent
            this long, instead of ``heartbeat_timeout_s`` (none: 1.5 ×
            ``heartbeat_interval_s``); in (``heartbeat_interval_s``, ``heartbeat_timeout_s``].
            A suspected site that heartbeats in time is cleared.
    """

    min_sites: int = 1
    initial_sites: int | None = None
    quorum_timeout_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    reduce_timeout_s: float = 10.0
    broadcast_timeout_s: float = 20.0
    suspect_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.min_sites, int) or self.min_sites < 1:
            raise ValueError(f"min_sites must be an int >= 1, got {self.min_sites!r}")
        if self.initial_sites is not None and (
            not isinstance(self.initial_sites, int) or self.initial_sites < self.min_sites
        ):
            raise ValueError(
                f"initial_sites must be an int >= min_sites ({self.min_sites}) or None, got {self.initial_sites!r}"
            )
        for name in (
            "quorum_timeout_s",
            "heartbeat_interval_s",
            "heartbeat_timeout_s",
            "reduce_timeout_s",
            "broadcast_timeout_s",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
        if not self.heartbeat_timeout_s > self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be > heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        st = self.suspect_timeout_s
        if st is not None and not (
            isinstance(st, (int, float)) and self.heartbeat_interval_s < st <= self.heartbeat_timeout_s
        ):
            raise ValueError(
                f"suspect_timeout_s must be None or in (heartbeat_interval_s, heartbeat_timeout_s] = "
                f"({self.heartbeat_interval_s}, {self.heartbeat_timeout_s}], got {st!r}"
            )
        if not self.broadcast_timeout_s > self.reduce_timeout_s:
            raise ValueError(
                f"broadcast_timeout_s ({self.broadcast_timeout_s}) must be > reduce_timeout_s ({self.reduce_timeout_s})"
            )

    @property
    def suspect_silence_s(self) -> float:
        """How long a suspected site may be silent (``suspect_timeout_s`` resolved)."""
        if self.suspect_timeout_s is not None:
            return self.suspect_timeout_s
        return min(1.5 * self.heartbeat_interval_s, self.heartbeat_timeout_s)

    @property
    def startup_sites(self) -> int:
        return self.initial_sites if self.initial_sites is not None else self.min_sites


@dataclass(kw_only=True)
class SiteRecord:
    """What the rendezvous knows of one site."""

    site_id: str
    address: str
    joined_at: float
    rank_addresses: tuple[str, ...] = ()
    last_heartbeat: float
    needs_resync: bool = False
    resync_reason: str = ""
    rounds_joined: int = 0
    inner_step: int = 0
    last_loss: float | None = None
    joined_round: int = 0  # next_round when it (re)joined
    last_member_round: int | None = None  # newest round whose quorum admitted it
    extra: dict = field(default_factory=dict)
    suspected_by: str | None = None  # a member that found it unreachable (cleared by its next heartbeat)

    def alive(self, now: float, timeout_s: float) -> bool:
        return now - self.last_heartbeat <= timeout_s


def decide_quorum(
    *,
    round: int,
    live: set[str],
    ready: dict[str, float],
    joined_ever: int,
    now: float,
    config: RendezvousConfig,
    startup_complete_at: float | None = None,
    first_round: bool | None = None,
) -> tuple[list[str] | None, str]:
    """Decide whether round ``round`` starts now and with whom.

    Args:
        round: the round being formed.
        live: site_ids alive and in good standing.
        ready: site_id -> time it became ready for ``round`` (monotonic seconds).
        joined_ever: how many sites are registered (for the round-0 start rule).
        now: the current monotonic time, seconds.
        startup_complete_at: when the ``initial_sites``-th site joined (monotonic
            seconds). Round 0's quorum timeout counts from it if that is later than
            the first ready, so a site that took longer to start up is not cut
            from the very first round of a group it started together with.
        first_round: whether this is the first round this rendezvous forms
            (default: ``round == 0``). The start-up rules (wait for
            ``initial_sites`` joins) apply to it, so a run resumed from
            checkpoints at round k starts together too.
    Returns:
        ``(members, reason)``: the sorted admitted site_ids, or None to wait.
    """
    ready_live = {s: t for s, t in ready.items() if s in live}
    if not ready_live:
        return None, "no live site is ready"
    if first_round is None:
        first_round = round == 0
    if first_round and joined_ever < config.startup_sites:
        label = f"round {round}" if round == 0 else f"round {round} (the first after a restart)"
        return None, f"{label} waits for {config.startup_sites} sites to join ({joined_ever} so far)"
    first = min(ready_live.values())
    if first_round and startup_complete_at is not None:
        first = max(first, startup_complete_at)
    waited = now - first
    if set(ready_live) >= live:
        if len(ready_live) >= config.min_sites:
            return sorted(ready_live), f"all {len(ready_live)} live sites are ready"
        return None, f"only {len(ready_live)} live site(s), min_sites is {config.min_sites}"
    if waited >= config.quorum_timeout_s:
        if len(ready_live) >= config.min_sites:
            cut = sorted(live - set(ready_live))
            return sorted(
                ready_live
            ), f"quorum timeout {config.quorum_timeout_s}s: admitting {len(ready_live)}, cutting {cut}"
        return (
            None,
            f"only {len(ready_live)} of {len(live)} live sites ready after {waited:.1f}s, min_sites is {config.min_sites}",
        )
    return (
        None,
        f"{len(ready_live)} of {len(live)} live sites ready; waiting up to {config.quorum_timeout_s - waited:.1f}s more",
    )


class ReportSink(Protocol):
    """Where the core puts what the status page shows (``dtrain.status.StatusLog``
    implements it). Called under the core's lock; must not block."""

    def site_joined(self, site_id: str) -> None: ...
    def add_reports(self, site_id: str, raws: list[str]) -> int: ...
    def add_plan(self, round: int, members: list[str], now: float) -> None: ...
    def snapshot(self) -> dict: ...


class NullReportSink:
    """A :class:`ReportSink` that keeps nothing (a rendezvous without a status page)."""

    def site_joined(self, site_id: str) -> None:
        pass

    def add_reports(self, site_id: str, raws: list[str]) -> int:
        return 0

    def add_plan(self, round: int, members: list[str], now: float) -> None:
        pass

    def snapshot(self) -> dict:
        return {"rounds": {}, "plans": {}, "totals": {}, "num_dropped": 0}


STARTUP_WAIT_S = 60.0  # how long a restarted rendezvous waits for initial_sites joins
DEAD_CACHE_S = 0.05  # how stale HeartbeatInfo.dead may be when no site joined, left or came back


class RendezvousCore:
    """Thread-safe rendezvous state. ``now`` is ``time.monotonic()`` seconds.

    Besides membership it hands the sites' per-round reports
    (``heartbeat(round_reports=...)``) and the round plans to ``reports``, a
    :class:`ReportSink` (``dtrain.status.StatusLog`` for the status page; by
    default one that keeps nothing), and remembers the sites that left;
    ``snapshot()`` copies all of it under the lock for ``dtrain.status.build_status``.
    """

    def __init__(self, config: RendezvousConfig | None = None, *, reports: "ReportSink | None" = None) -> None:
        self.config = config or RendezvousConfig()
        self.sites: dict[str, SiteRecord] = {}
        self.next_round = 0
        self.plans: dict[int, RoundPlan] = {}
        self._plan_members: dict[int, frozenset[str]] = {}  # round -> its plan's site ids
        self._plan_reason: dict[int, str] = {}  # round -> why the quorum rule formed its plan
        self._ready: dict[str, float] = {}
        self._adopted_at: float | None = None
        # A site heartbeat before joining: it ran on through a restart of this rendezvous
        # (a fresh process joins first), so the run is under way, not resuming as a whole.
        self._survivor_seen = False
        self._last_call = 0.0  # monotonic time of the latest call (_clock)
        self._cv = threading.Condition()
        self._last_reason = ""
        self._startup_complete_at: float | None = None  # when the initial_sites-th site joined
        self.status_log: ReportSink = reports if reports is not None else NullReportSink()
        self._left: dict[str, tuple[SiteRecord, float]] = {}  # site_id -> (record, when it left); status page only
        self._dead_cache: tuple[float, tuple[str, ...]] | None = None  # (now, HeartbeatInfo.dead); see _dead
        self._live_cache: tuple[float, float, frozenset[str]] | None = None  # (since, until, live); see _live

    def _changed(self) -> None:
        self._cv.notify_all()

    def _clock(self, now: float) -> None:
        """Note a call at ``now`` (under the lock). A gap since the previous call longer
        than ``heartbeat_timeout_s / 2`` means this rendezvous did not run (SIGSTOP, a
        pause of its host; its sites heartbeat every ``heartbeat_interval_s``): the
        sites' heartbeat clocks move on by the gap, so that it does not declare every
        site dead for its own silence (it did, in the chaos soak's rv_stop: every site
        resynced). A site that is really gone is declared dead one timeout later."""
        gap = now - self._last_call
        if self._last_call and gap > self.config.heartbeat_timeout_s / 2:
            for rec in self.sites.values():
                rec.last_heartbeat += gap
            self._live_cache = self._dead_cache = None
            log.warning("rendezvous: no call for %.1fs (was it stopped?): sites' heartbeat clocks moved on by it", gap)
        self._last_call = max(self._last_call, now)

    def wait_for_change(self, timeout_s: float) -> None:
        with self._cv:
            self._cv.wait(timeout_s)

    def _live(self, now: float) -> frozenset[str]:
        """Sites alive and in good standing at ``now``. Every Ready needs it, so it
        is kept until the first of them could expire (a later heartbeat only delays
        that) or a site joins, leaves or is marked for resync: exact, and O(sites)
        only every few seconds."""
        c = self._live_cache
        if c is not None and c[0] <= now < c[1]:
            return c[2]
        live = [
            (s, r.last_heartbeat + self._silence_s(r))
            for s, r in self.sites.items()
            if r.last_heartbeat + self._silence_s(r) >= now and not r.needs_resync
        ]
        expires = min((t for _, t in live), default=now)
        result = frozenset(s for s, _ in live)
        self._live_cache = (now, expires, result)
        return result

    def _silence_s(self, rec: SiteRecord) -> float:
        """How long ``rec`` may be silent before it is dead: shorter once a member
        found it unreachable on the data path."""
        return self.config.suspect_silence_s if rec.suspected_by is not None else self.config.heartbeat_timeout_s

    def _suspect(self, reporter: str, site_ids: Sequence[str], now: float) -> None:
        """``reporter``'s data path found ``site_ids`` unreachable: each is dead once
        silent for ``suspect_silence_s`` (the rendezvous confirms by its heartbeats)."""
        for s in site_ids:
            rec = self.sites.get(s)
            if s == reporter or rec is None or rec.suspected_by is not None or rec.needs_resync:
                continue
            rec.suspected_by = reporter
            self._dead_cache = self._live_cache = None
            log.info("rendezvous: %s reports %s unreachable (silent for %.1f s)", reporter, s, now - rec.last_heartbeat)

    def join(self, site_id: str, address: str, *, now: float, rank_addresses: Sequence[str] = ()) -> JoinInfo:
        with self._cv:
            self._clock(now)
            rec = self.sites.get(site_id)
            if rec is not None:
                log.info("rendezvous: %s re-joined from %s", site_id, address)
            left = self._left.pop(site_id, (None, 0.0))[0]
            prev = rec or left
            self.sites[site_id] = SiteRecord(
                site_id=site_id,
                address=address,
                rank_addresses=tuple(rank_addresses),
                joined_at=now,
                last_heartbeat=now,
                rounds_joined=prev.rounds_joined if prev else 0,
                joined_round=self.next_round,
                last_member_round=prev.last_member_round if prev else None,
            )
            self.status_log.site_joined(site_id)
            self._dead_cache = self._live_cache = None
            self._ready.pop(site_id, None)
            if self._startup_complete_at is None and len(self.sites) >= self.config.startup_sites:
                self._startup_complete_at = now
            live = self._live(now)  # once: a join costs O(sites), not O(sites^2)
            others = tuple(
                Member(site_id=s, address=r.address, rank_addresses=r.rank_addresses)
                for s, r in sorted(self.sites.items())
                if s != site_id and s in live
            )
            self._changed()
            log.info(
                "rendezvous: %s joined (%s); next round %d; %d other live sites",
                site_id,
                address,
                self.next_round,
                len(others),
            )
            return JoinInfo(
                next_round=self.next_round,
                members=others,
                heartbeat_interval_s=self.config.heartbeat_interval_s,
                needs_state=self.next_round > 0 and bool(others),
            )

    def heartbeat(
        self,
        site_id: str,
        *,
        now: float,
        inner_step: int = 0,
        last_loss: float | None = None,
        round_reports: Sequence[str] = (),
        unreachable: Sequence[str] = (),
    ) -> HeartbeatInfo:
        """Record liveness and progress of ``site_id``.

        ``round_reports`` are the site's per-round JSON reports for the status
        page (``dtrain.status.parse_report``); bad ones are dropped and logged,
        never failing the heartbeat. An unknown site's reports are ignored (it
        must join again and resend them). ``unreachable``: sites its data path found
        gone; each is dead once silent for ``suspect_silence_s`` instead of
        ``heartbeat_timeout_s`` (a suspected site that heartbeats in time is cleared).
        """
        with self._cv:
            self._clock(now)
            rec = self.sites.get(site_id)
            if rec is None:
                self._survivor_seen = True
                return HeartbeatInfo(
                    known=False, resync_required=False, next_round=self.next_round, reason="unknown site: join again"
                )
            silence_s = self._silence_s(rec)
            if not rec.alive(now, silence_s):
                self._dead_cache = None  # it is alive again
            if not rec.alive(now, silence_s) and not rec.needs_resync:
                rec.needs_resync = True
                self._live_cache = None
                rec.resync_reason = f"no heartbeat for {now - rec.last_heartbeat:.1f}s (> {silence_s}s): declared dead"
                if rec.suspected_by is not None:
                    rec.resync_reason += f" ({rec.suspected_by} found it unreachable)"
                log.warning("rendezvous: %s %s", site_id, rec.resync_reason)
                self._ready.pop(site_id, None)
            rec.last_heartbeat = now
            if rec.suspected_by is not None:  # it answered in time (or is marked for resync above)
                rec.suspected_by = None
                self._dead_cache = self._live_cache = None
            if unreachable:
                self._suspect(site_id, unreachable, now)
            rec.inner_step = inner_step
            if last_loss is not None:
                rec.last_loss = last_loss
            if round_reports:
                self.status_log.add_reports(site_id, list(round_reports))
            self._changed()
            return HeartbeatInfo(
                known=True,
                resync_required=rec.needs_resync,
                next_round=self.next_round,
                reason=rec.resync_reason,
                dead=self._dead(now),
            )

    def _dead(self, now: float) -> tuple[str, ...]:
        """Sites silent past the timeout, and those that left (sorted). Every
        heartbeat answers it, so it is kept for ``DEAD_CACHE_S`` unless a site
        joins, leaves or comes back: 1,000 sites heartbeating once a second then
        cost O(sites) a few times a second instead of O(sites^2)."""
        c = self._dead_cache
        if c is not None and 0.0 <= now - c[0] < DEAD_CACHE_S:
            return c[1]
        dead = tuple(
            sorted({s for s, r in self.sites.items() if r.last_heartbeat + self._silence_s(r) < now} | set(self._left))
        )
        self._dead_cache = (now, dead)
        return dead

    def leave(self, site_id: str, *, now: float) -> None:
        with self._cv:
            self._clock(now)
            rec = self.sites.pop(site_id, None)
            self._dead_cache = self._live_cache = None
            if rec is not None:
                self._left[site_id] = (rec, now)
                while len(self._left) > 256:  # bounded: oldest departures forgotten first
                    del self._left[min(self._left, key=lambda s: self._left[s][1])]
            self._ready.pop(site_id, None)
            self._changed()
            log.info("rendezvous: %s left", site_id)

    def ready(self, site_id: str, round: int, *, now: float) -> ReadyDecision:
        with self._cv:
            self._clock(now)
            rec = self.sites.get(site_id)
            if rec is None:
                return ReadyDecision(status="wait", reason="unknown site: join first", next_round=self.next_round)
            rec.last_heartbeat = (
                max(rec.last_heartbeat, now) if rec.alive(now, self._silence_s(rec)) else rec.last_heartbeat
            )
            if rec.needs_resync:
                return ReadyDecision(
                    status="missed", reason=rec.resync_reason or "resync required", next_round=self.next_round
                )
            plan = self.plans.get(round)
            if plan is not None:
                members = self._plan_members.get(round)
                if site_id in (members if members is not None else plan.site_ids):
                    # every member learns why the round formed as it did (a cut straggler, say),
                    # whichever call formed it
                    why = self._plan_reason.get(round, "already formed")
                    return ReadyDecision(status="plan", reason=why, next_round=self.next_round, plan=plan)
                return ReadyDecision(
                    status="missed",
                    reason=f"round {round} started without {site_id} (straggler)",
                    next_round=self.next_round,
                )
            if round < self.next_round:
                return ReadyDecision(status="missed", reason=f"round {round} already ran", next_round=self.next_round)
            if round > self.next_round:
                log.warning(
                    "rendezvous: %s asks for round %d, ahead of %d: adopting it (rendezvous restarted?)",
                    site_id,
                    round,
                    self.next_round,
                )
                if self.next_round == 0 and not self.plans:
                    self._adopted_at = now  # a fresh (restarted) core: give every site time to re-join
                self.next_round = round
                self._ready.clear()
            self._ready.setdefault(site_id, now)
            return self._decide(now)

    def decide(self, *, now: float) -> int:
        """Re-run the quorum decision for round ``next_round`` (forming its plan
        when the rule says so at ``now``) and return ``next_round``.

        The gRPC service calls this once per change or tick instead of calling
        ``ready`` for every waiting site; it costs nothing while no site is ready.
        """
        with self._cv:
            self._clock(now)
            if self._ready:
                self._decide(now)
            return self.next_round

    def poll(self, site_id: str, round: int, *, now: float) -> ReadyDecision:
        """Re-evaluate a pending ``ready`` (long-poll loop); same answers as ``ready``."""
        return self.ready(site_id, round, now=now)

    def _startup_rules(self, now: float) -> bool:
        """Whether the start-up rules (wait for ``initial_sites`` joins) apply to the round
        being formed: to the first round formed here, unless this core adopted a round
        and a site heartbeat before it joined (the rendezvous alone restarted under a
        running run: a site dead meanwhile must not stall it; the restart grace already
        let every live site re-register); after adopting a round (a whole run resumed)
        they give up after STARTUP_WAIT_S in case a site died."""
        if self.plans:
            return False
        if self._adopted_at is None:
            return True
        return not self._survivor_seen and now - self._adopted_at < STARTUP_WAIT_S

    def _decide(self, now: float) -> ReadyDecision:
        adopted_at = self._adopted_at
        if adopted_at is not None and now - adopted_at < self.config.heartbeat_timeout_s:
            reason = (
                f"rendezvous restarted: waiting {self.config.heartbeat_timeout_s - (now - adopted_at):.1f}s more "
                f"for every live site to re-register before round {self.next_round}"
            )
            if reason.split(":")[0] != self._last_reason.split(":")[0]:
                log.info("rendezvous: %s", reason)
                self._last_reason = reason
            return ReadyDecision(status="wait", reason=reason, next_round=self.next_round)
        members, reason = decide_quorum(
            round=self.next_round,
            live=self._live(now),
            ready=self._ready,
            joined_ever=len(self.sites),
            now=now,
            config=self.config,
            startup_complete_at=self._startup_complete_at,
            first_round=self._startup_rules(now),
        )
        if members is None:
            if reason != self._last_reason:
                log.info("rendezvous: round %d: %s", self.next_round, reason)
                self._last_reason = reason
            return ReadyDecision(status="wait", reason=reason, next_round=self.next_round)
        plan = RoundPlan(
            round=self.next_round,
            members=tuple(
                Member(site_id=s, address=self.sites[s].address, rank_addresses=self.sites[s].rank_addresses)
                for s in members
            ),
            reduce_timeout_s=self.config.reduce_timeout_s,
            broadcast_timeout_s=self.config.broadcast_timeout_s,
            datagram_key=os.urandom(32),  # the round's datagram AEAD key (protocol.RoundPlan)
        )
        self.plans[plan.round] = plan
        self._plan_members[plan.round] = frozenset(members)
        self._plan_reason[plan.round] = reason
        self.plans.pop(plan.round - 8, None)
        self._plan_members.pop(plan.round - 8, None)
        self._plan_reason.pop(plan.round - 8, None)
        for s in members:
            self.sites[s].rounds_joined += 1
            self.sites[s].last_member_round = plan.round
        self.status_log.add_plan(plan.round, list(members), now)
        self.next_round += 1
        self._ready.clear()
        self._last_reason = ""
        log.info("rendezvous: round %d formed with %s: %s", plan.round, list(members), reason)
        self._changed()
        return ReadyDecision(status="plan", reason=reason, next_round=self.next_round, plan=plan)

    def snapshot(self, now: float) -> dict:
        """Read-only copy of the state for status pages and tests; holds the lock
        only while copying (no formatting, no I/O).

        Returns ``now``, ``next_round``, ``config`` (timing, seconds),
        ``first_ready_at`` (when the first site became ready for ``next_round``,
        or None), ``sites`` (site_id -> address, alive, needs_resync,
        resync_reason, heartbeat_age_s, last_heartbeat, rounds_joined,
        inner_step, last_loss, joined_round, last_member_round, ready_since,
        left; sites that left have ``left`` True) and ``status`` (the
        :class:`~dtrain.status.StatusLog` snapshot). Times are monotonic seconds.
        """
        with self._cv:
            c = self.config

            def entry(r: SiteRecord, left: bool) -> dict:
                return {
                    "address": r.address,
                    "alive": not left and r.alive(now, c.heartbeat_timeout_s),
                    "needs_resync": r.needs_resync,
                    "resync_reason": r.resync_reason,
                    "heartbeat_age_s": now - r.last_heartbeat,
                    "last_heartbeat": r.last_heartbeat,
                    "rounds_joined": r.rounds_joined,
                    "inner_step": r.inner_step,
                    "last_loss": r.last_loss,
                    "joined_round": r.joined_round,
                    "last_member_round": r.last_member_round,
                    "ready_since": None if left else self._ready.get(r.site_id),
                    "left": left,
                }

            sites = {s: entry(r, True) for s, (r, _) in self._left.items()}
            sites.update({s: entry(r, False) for s, r in self.sites.items()})
            return {
                "now": now,
                "next_round": self.next_round,
                "config": {
                    "heartbeat_interval_s": c.heartbeat_interval_s,
                    "heartbeat_timeout_s": c.heartbeat_timeout_s,
                    "quorum_timeout_s": c.quorum_timeout_s,
                    "reduce_timeout_s": c.reduce_timeout_s,
                    "broadcast_timeout_s": c.broadcast_timeout_s,
                    "min_sites": c.min_sites,
                },
                "first_ready_at": min(self._ready.values()) if self._ready else None,
                "sites": sites,
                "status": self.status_log.snapshot(),
            }


class InprocRendezvousClient:
    """Client of a :class:`RendezvousCore` in the same process (tests, simulations).

    Same methods as ``dtrain.rendezvous.grpc.GrpcRendezvousClient``.
    """

    def __init__(self, core: RendezvousCore) -> None:
        self.core = core
        self.down = False  # tests flip this to emulate an unreachable rendezvous

    def _check(self) -> None:
        if self.down:
            from dtrain.errors import RendezvousError

            raise RendezvousError("rendezvous unreachable (inproc down)")

    def join(self, site_id: str, address: str, rank_addresses: Sequence[str] = ()) -> JoinInfo:
        self._check()
        return self.core.join(site_id, address, now=time.monotonic(), rank_addresses=rank_addresses)

    def heartbeat(
        self,
        site_id: str,
        inner_step: int = 0,
        last_loss: float | None = None,
        round_reports: Sequence[str] = (),
        unreachable: Sequence[str] = (),
    ) -> HeartbeatInfo:
        self._check()
        return self.core.heartbeat(
            site_id,
            now=time.monotonic(),
            inner_step=inner_step,
            last_loss=last_loss,
            round_reports=round_reports,
            unreachable=unreachable,
        )

    def ready(self, site_id: str, round: int, timeout_s: float) -> ReadyDecision:
        self._check()
        deadline = time.monotonic() + timeout_s
        while True:
            d = self.core.ready(site_id, round, now=time.monotonic())
            left = deadline - time.monotonic()
            if d.status != "wait" or left <= 0:
                return d
            self.core.wait_for_change(min(left, 0.05))

    def leave(self, site_id: str) -> None:
        self._check()
        self.core.leave(site_id, now=time.monotonic())
