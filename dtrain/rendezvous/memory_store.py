"""The in-memory rendezvous store (the default; what ``dtrain launch`` uses).

Sites are :class:`SiteRecord` s; a site is live while its last heartbeat is within
``heartbeat_timeout_s`` (``suspect_silence_s`` once a member found it unreachable on the
data path). A site silent past that is declared dead when it next heartbeats: it must
resync. State is soft: a restarted rendezvous rebuilds membership from re-joins and
adopts the highest round a site asks for, waiting ``heartbeat_timeout_s`` for every
live site to re-register first. Thread-safe: the core holds :meth:`MemoryStore.atomic`
around each of its calls, so each is one step.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Sequence

from dtrain.protocol import Member, RoundPlan
from dtrain.rendezvous.accrual import ArrivalWindow
from dtrain.rendezvous.store import Liveness, QuorumView, ReadyCounts, SiteIdTaken, Standing, taken_message

__all__ = ["SiteRecord", "MemoryStore", "STARTUP_WAIT_S", "DEAD_CACHE_S", "NUM_PLANS_KEPT"]

log = logging.getLogger(__name__)

STARTUP_WAIT_S = 60.0  # how long a restarted rendezvous waits for initial_sites joins
DEAD_CACHE_S = 0.05  # how stale HeartbeatInfo.dead may be when no site joined, left or came back
NUM_PLANS_KEPT = 8
NUM_LEFT_KEPT = 256  # sites that left, remembered for the status page (oldest forgotten first)


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
    arrivals: ArrivalWindow | None = None  # its heartbeat inter-arrival times (the accrual detector)

    def alive(self, now: float, timeout_s: float) -> bool:
        return now - self.last_heartbeat <= timeout_s

    def member(self) -> Member:
        return Member(site_id=self.site_id, address=self.address, rank_addresses=self.rank_addresses)


class MemoryStore:
    """The rendezvous facts in this process (see the module docstring).

    Args:
        config: the run's ``RendezvousConfig`` (timeouts, ``initial_sites``).
    """

    blocking = False
    local = True

    def __init__(self, config) -> None:
        self.config = config
        self._accrual = config.accrual_for_sites()
        self.sites: dict[str, SiteRecord] = {}
        self.next = 0
        self.plans: dict[int, RoundPlan] = {}
        self._plan_members: dict[int, frozenset[str]] = {}  # round -> its plan's site ids
        self._plan_reason: dict[int, str] = {}  # round -> why the quorum rule formed its plan
        self._ready: dict[str, float] = {}  # site -> when it became ready for ``next``
        self._adopted_at: float | None = None
        # A site heartbeat before joining: it ran on through a restart of this rendezvous
        # (a fresh process joins first), so the run is under way, not resuming as a whole.
        self._survivor_seen = False
        self._last_call = 0.0  # monotonic time of the latest call (_note_call)
        self._cv = threading.Condition(threading.RLock())
        self._startup_complete_at: float | None = None  # when the initial_sites-th site joined
        self._left: dict[str, tuple[SiteRecord, float]] = {}  # site_id -> (record, when it left); status only
        self._dead_cache: tuple[float, tuple[str, ...]] | None = None  # (now, dead); see dead()
        self._live_cache: tuple[float, float, frozenset[str]] | None = None  # (since, until, live); see _live

    # ------------------------------------------------------------------ plumbing
    def atomic(self) -> threading.Condition:
        return self._cv

    def clock(self, now: float) -> float:
        return now

    def next_round(self) -> int:
        return self.next

    def _changed(self) -> None:
        self._cv.notify_all()

    def wait(self, round: int, timeout_s: float) -> None:
        with self._cv:
            if round not in self.plans and self.next <= round:
                self._cv.wait(timeout_s)

    def close(self) -> None:
        pass

    def _note_call(self, now: float) -> None:
        """Note a call at ``now`` (under the lock). A gap since the previous call longer
        than ``heartbeat_timeout_s / 2`` means this rendezvous did not run (SIGSTOP, a
        pause of its host; its sites heartbeat every ``heartbeat_interval_s``): the
        sites' heartbeat clocks move on by the gap, so that it does not declare every
        site dead for its own silence (it did, in the chaos soak's rv_stop: every site
        resynced). A site that is really gone is declared dead one timeout later."""
        gap = now - self._last_call
        if self._last_call and gap > self.config.silence_bound_s / 2:
            for rec in self.sites.values():
                rec.last_heartbeat += gap
            self._live_cache = self._dead_cache = None
            log.warning("rendezvous: no call for %.1fs (was it stopped?): sites' heartbeat clocks moved on by it", gap)
        self._last_call = max(self._last_call, now)

    def _silence_s(self, rec: SiteRecord) -> float:
        """How long ``rec`` may be silent before it is dead: once a member found it
        unreachable on the data path, ``suspect_timeout_s`` if set, else the silence at which
        φ over its own arrivals reaches ``accrual.suspect_phi``, at least ``suspect_silence_s``
        (``ArrivalWindow.suspected_silence_s``); else ``heartbeat_timeout_s`` when
        set (a fixed rule); else the silence at which the phi accrual detector over its
        own heartbeat arrivals reaches ``accrual.dead_phi`` (``dtrain.rendezvous.accrual``)."""
        if rec.suspected_by is not None:
            if self.config.suspect_timeout_s is not None:
                return self.config.suspect_timeout_s
            floor_s = self.config.suspect_silence_s
            if rec.arrivals is None:  # a fixed heartbeat_timeout_s: no arrival history kept
                return floor_s
            return rec.arrivals.suspected_silence_s(self.config.accrual.suspect_phi, floor_s=floor_s)
        if self.config.heartbeat_timeout_s is not None:
            return self.config.heartbeat_timeout_s
        return rec.arrivals.silence_s(self.config.accrual.dead_phi)

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

    # ------------------------------------------------------------------ membership
    def claim(self, site_id: str, address: str, rank_addresses: Sequence[str], *, now: float) -> int:
        """Register ``site_id`` (a re-join keeps its history) and return the next round.

        Raises:
            SiteIdTaken: a live site at another address holds ``site_id`` (its heartbeat
                is within ``heartbeat_timeout_s`` and it was not declared dead).
        """
        rec = self.sites.get(site_id)
        if rec is not None and rec.address != address and rec.alive(now, self._silence_s(rec)):
            if not rec.needs_resync:
                raise SiteIdTaken(taken_message(site_id, rec.address, address, "this run", self.config.silence_bound_s))
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
            joined_round=self.next,
            last_member_round=prev.last_member_round if prev else None,
            arrivals=ArrivalWindow(self._accrual) if self.config.heartbeat_timeout_s is None else None,
        )
        self._dead_cache = self._live_cache = None
        self._ready.pop(site_id, None)
        if self._startup_complete_at is None and len(self.sites) >= self.config.startup_sites:
            self._startup_complete_at = now
        self._changed()
        return self.next

    def live_members(self, now: float) -> list[Member]:
        live = self._live(now)  # once: a join costs O(sites), not O(sites^2)
        return [r.member() for s, r in sorted(self.sites.items()) if s in live]

    def keep_alive(
        self, site_id: str, *, now: float, inner_step: int, last_loss: float | None, unreachable: Sequence[str]
    ) -> Liveness:
        self._note_call(now)
        rec = self.sites.get(site_id)
        if rec is None:
            self._survivor_seen = True
            return Liveness(known=False)
        silence_s = self._silence_s(rec)
        if not rec.alive(now, silence_s):
            self._dead_cache = None  # it is alive again
            if not rec.needs_resync:
                rec.needs_resync = True
                self._live_cache = None
                rec.resync_reason = f"no heartbeat for {now - rec.last_heartbeat:.1f}s (> {silence_s}s): declared dead"
                if rec.suspected_by is not None:
                    rec.resync_reason += f" ({rec.suspected_by} found it unreachable)"
                log.warning("rendezvous: %s %s", site_id, rec.resync_reason)
                self._ready.pop(site_id, None)
        if rec.arrivals is not None:
            rec.arrivals.add(now - rec.last_heartbeat)
            c = self._live_cache  # its silence bound moved with its window: earlier than the cache's?
            if c is not None and now + self._silence_s(rec) < c[1]:
                self._live_cache = None
        rec.last_heartbeat = now
        if rec.suspected_by is not None:  # it answered in time (or is marked for resync above)
            rec.suspected_by = None
            self._dead_cache = self._live_cache = None
        if unreachable:
            self._suspect(site_id, unreachable, now)
        rec.inner_step = inner_step
        if last_loss is not None:
            rec.last_loss = last_loss
        self._changed()
        return Liveness(known=True, resync_reason=rec.resync_reason if rec.needs_resync else None)

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

    def dead(self, now: float) -> tuple[str, ...]:
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

    def release(self, site_id: str, *, now: float) -> None:
        rec = self.sites.pop(site_id, None)
        self._dead_cache = self._live_cache = None
        if rec is not None:
            self._left[site_id] = (rec, now)
            while len(self._left) > NUM_LEFT_KEPT:  # bounded: oldest departures forgotten first
                del self._left[min(self._left, key=lambda s: self._left[s][1])]
        self._ready.pop(site_id, None)
        self._changed()

    def put_reports(self, site_id: str, raws: Sequence[str], sink) -> None:
        sink.add_reports(site_id, list(raws))

    # ------------------------------------------------------------------ rounds
    def standing(self, site_id: str, round: int, *, now: float) -> Standing:
        """The site's standing; a ready is also a sign of life of a live site."""
        self._note_call(now)
        rec = self.sites.get(site_id)
        if rec is None:
            return Standing(known=False, next_round=self.next)
        if rec.alive(now, self._silence_s(rec)):
            rec.last_heartbeat = max(rec.last_heartbeat, now)
        if rec.needs_resync:
            return Standing(known=True, resync_reason=rec.resync_reason or "resync required", next_round=self.next)
        plan = self.plans.get(round)
        if plan is None:
            return Standing(known=True, next_round=self.next)
        members = self._plan_members.get(round)
        return Standing(
            known=True,
            plan=plan,
            member=site_id in (members if members is not None else plan.site_ids),
            plan_reason=self._plan_reason.get(round, "already formed"),
            next_round=self.next,
        )

    def adopt(self, round: int, *, now: float) -> bool:
        """A site asks for ``round`` > ``next``: this rendezvous restarted (or the run
        resumed); adopt it. A fresh store gives every site time to re-join first."""
        if round <= self.next:
            return False
        if self.next == 0 and not self.plans:
            self._adopted_at = now
        self.next = round
        self._ready.clear()
        return True

    def mark_ready(self, site_id: str, round: int, *, now: float, lease: int) -> ReadyCounts | None:
        if round == self.next:
            self._ready.setdefault(site_id, now)
        return None  # the full view is cheap here

    def view(self, round: int, *, now: float) -> QuorumView:
        self._note_call(now)
        adopted_at = self._adopted_at
        grace = 0.0
        if adopted_at is not None and not self.plans:
            grace = max(0.0, self.config.restart_grace - (now - adopted_at))
        return QuorumView(
            live=self._live(now),
            ready=self._ready if round == self.next else {},
            joined=len(self.sites),
            startup_t=self._startup_complete_at,
            first_round=self._startup_rules(now),
            grace_left_s=grace,
            member=lambda s: self.sites[s].member(),
        )

    def _startup_rules(self, now: float) -> bool:
        """Whether the start-up rules (wait for ``initial_sites`` joins) apply to the round
        being formed: to the first round formed here, unless this store adopted a round
        and a site heartbeat before it joined (the rendezvous alone restarted under a
        running run: a site dead meanwhile must not stall it; the restart grace already
        let every live site re-register); after adopting a round (a whole run resumed)
        they give up after STARTUP_WAIT_S in case a site died."""
        if self.plans:
            return False
        if self._adopted_at is None:
            return True
        return not self._survivor_seen and now - self._adopted_at < STARTUP_WAIT_S

    def put_plan(self, plan: RoundPlan, reason: str, *, now: float) -> tuple[RoundPlan, str, bool]:
        r = plan.round
        if r in self.plans or r < self.next:
            held = self.plans.get(r, plan)
            return held, self._plan_reason.get(r, reason), False
        members = frozenset(plan.site_ids)
        self.plans[r], self._plan_members[r], self._plan_reason[r] = plan, members, reason
        for d in (self.plans, self._plan_members, self._plan_reason):
            d.pop(r - NUM_PLANS_KEPT, None)
        for s in members:
            self.sites[s].rounds_joined += 1
            self.sites[s].last_member_round = r
        self.next = r + 1
        self._ready.clear()
        self._changed()
        return plan, reason, True

    # ------------------------------------------------------------------ status page
    def site_rows(self, now: float, sink) -> tuple[dict[str, dict], float | None]:
        """The status page's rows (``RendezvousCore.snapshot``'s ``sites``) and when the
        first site became ready for the round being formed."""
        timeout_s = self.config.silence_bound_s

        def entry(r: SiteRecord, left: bool) -> dict:
            return {
                "address": r.address,
                "alive": not left and r.alive(now, timeout_s if r.arrivals is None else self._silence_s(r)),
                # the accrual detector's suspicion of its silence (None: a fixed timeout)
                "phi": None
                if r.arrivals is None
                else round(max(0.0, min(r.arrivals.phi(now - r.last_heartbeat), 99.0)), 2),
                "dead_after_s": self._silence_s(r),
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
        return sites, (min(self._ready.values()) if self._ready else None)
