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

import dataclasses
import logging
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Collection, Mapping, Protocol, Sequence

from dtrain.errors import RendezvousError
from dtrain.protocol import HeartbeatInfo, JoinInfo, ReadyDecision, RoundPlan
from dtrain.rendezvous.accrual import AccrualConfig
from dtrain.rendezvous.deadlines import (
    DeadlineBook,
    DeadlineConfig,
    Deadlines,
    derive_deadlines,
    read_probe_report,
    read_round_report,
)
from dtrain.rendezvous.memory_store import MemoryStore, SiteRecord
from dtrain.rendezvous.store import ReadyCounts, RendezvousStore, SiteIdTaken, taken_message

__all__ = [
    "RendezvousConfig",
    "SiteRecord",
    "decide_quorum",
    "cannot_form_yet",
    "taken_message",
    "ReportSink",
    "NullReportSink",
    "RendezvousCore",
    "SiteIdTaken",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RendezvousConfig:
    """Membership and round timing.

    Attributes:
        min_sites: fewest sites a round may have (>= 1).
        initial_sites: round 0 starts only once this many sites joined
            (None: ``min_sites``).
        quorum_timeout_s: after the first site is ready, how long the others
            have to become ready before they are cut as stragglers. None (default):
            derived each round from the observed ready spread and ``deadlines``'
            stall budget (``dtrain.rendezvous.deadlines``); a number is an override.
        heartbeat_interval_s: how often sites heartbeat.
        heartbeat_timeout_s: a site silent this long is dead: a fixed rule (> interval), an
            override. None (default): the phi accrual detector (``accrual``) decides per
            site from its own heartbeat arrivals, so a site behind a slow or lossy link is
            given the silence its arrivals show, and a regular one is found dead sooner;
            where one figure is needed (the etcd store's lease TTL, a restarted
            rendezvous's grace) :attr:`silence_bound_s` stands for it.
        accrual: the phi accrual detector's parameters (used when ``heartbeat_timeout_s``
            is None; Hayashibara et al. 2004, ``dtrain.rendezvous.accrual``).
        reduce_timeout_s: plan deadline for owners to finalize, seconds after the plan
            formed. None (default): derived (``deadlines``); a number is an override.
        broadcast_timeout_s: plan deadline for pulling means, seconds after the plan
            formed (> reduce_timeout_s). None (default): derived; a number is an override.
        deadlines: how deadlines are derived from the observed rounds: the one figure a
            user may state is ``deadlines.stall_budget_s``, the stall a round may cost
            beyond its measured exchange (``dtrain.rendezvous.deadlines.DeadlineConfig``).
        suspect_timeout_s: a site that a member reported unreachable on the data path
            (a refused push or mean pull, a push stream that broke) is dead once silent
            this long, instead of ``heartbeat_timeout_s`` (none: 1.5 ×
            ``heartbeat_interval_s``); in (``heartbeat_interval_s``, ``heartbeat_timeout_s``].
            A suspected site that heartbeats in time is cleared.
        restart_grace_s: how long a fresh in-memory rendezvous that is asked for a round > 0
            (it restarted under a running run, or the run resumed from checkpoints) waits for
            every live site to re-register before it forms that round, seconds >= 0; None:
            :attr:`silence_bound_s` (a live site heartbeats within it). ``dtrain launch`` sets
            0: it never restarts its rendezvous under running sites, and the first round a
            rendezvous forms already waits for ``initial_sites`` (every site) to join.
    """

    min_sites: int = 1
    initial_sites: int | None = None
    quorum_timeout_s: float | None = None
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float | None = None
    accrual: AccrualConfig = field(default_factory=AccrualConfig)
    reduce_timeout_s: float | None = None
    broadcast_timeout_s: float | None = None
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)
    suspect_timeout_s: float | None = None
    restart_grace_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.min_sites, int) or self.min_sites < 1:
            raise ValueError(f"min_sites must be an int >= 1, got {self.min_sites!r}")
        if self.initial_sites is not None and (
            not isinstance(self.initial_sites, int) or self.initial_sites < self.min_sites
        ):
            raise ValueError(
                f"initial_sites must be an int >= min_sites ({self.min_sites}) or None, got {self.initial_sites!r}"
            )
        v = self.heartbeat_interval_s
        if not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"heartbeat_interval_s must be a number of seconds > 0, got {v!r}")
        for name in ("quorum_timeout_s", "reduce_timeout_s", "broadcast_timeout_s"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{name} must be none (derived) or a number of seconds > 0, got {v!r}")
        if not isinstance(self.deadlines, DeadlineConfig):
            raise ValueError(f"deadlines must be a DeadlineConfig, got {self.deadlines!r}")
        ht = self.heartbeat_timeout_s
        if ht is not None and not (isinstance(ht, (int, float)) and ht > self.heartbeat_interval_s):
            raise ValueError(
                f"heartbeat_timeout_s must be none (the accrual detector) or a number of seconds > "
                f"heartbeat_interval_s ({self.heartbeat_interval_s}), got {ht!r}"
            )
        if not isinstance(self.accrual, AccrualConfig):
            raise ValueError(f"accrual must be an AccrualConfig, got {self.accrual!r}")
        st = self.suspect_timeout_s
        if st is not None and not (
            isinstance(st, (int, float)) and self.heartbeat_interval_s < st <= self.silence_bound_s
        ):
            raise ValueError(
                f"suspect_timeout_s must be None or in (heartbeat_interval_s, heartbeat_timeout_s] = "
                f"({self.heartbeat_interval_s}, {self.silence_bound_s}], got {st!r}"
            )
        g = self.restart_grace_s
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < float("inf")):
            raise ValueError(f"restart_grace_s must be none (the silence bound) or seconds >= 0, got {g!r}")
        bt, rt = self.broadcast_timeout_s, self.reduce_timeout_s
        if bt is not None and rt is not None and not bt > rt:
            raise ValueError(f"broadcast_timeout_s ({bt}) must be > reduce_timeout_s ({rt})")

    @property
    def overrides(self) -> tuple[float | None, float | None, float | None]:
        """The explicit (quorum, reduce, broadcast) timeouts; None where derived."""
        return self.quorum_timeout_s, self.reduce_timeout_s, self.broadcast_timeout_s

    def start_deadlines(self) -> Deadlines:
        """The deadlines before any round was observed (the start bound, or the overrides)."""
        return derive_deadlines((), config=self.deadlines, overrides=self.overrides)

    @property
    def silence_bound_s(self) -> float:
        """One figure for "silent this long is dead" where a per-site one cannot serve:
        ``heartbeat_timeout_s`` when set, else 5 heartbeat intervals (the accrual
        detector's first estimate, with its acceptable pause, is below it)."""
        if self.heartbeat_timeout_s is not None:
            return self.heartbeat_timeout_s
        return 5.0 * self.heartbeat_interval_s

    def accrual_for_sites(self) -> AccrualConfig:
        """``accrual`` with its first interval set to ``heartbeat_interval_s``."""
        return dataclasses.replace(self.accrual, first_interval_s=self.heartbeat_interval_s)

    @property
    def suspect_silence_s(self) -> float:
        """How long a suspected site may be silent (``suspect_timeout_s`` resolved)."""
        if self.suspect_timeout_s is not None:
            return self.suspect_timeout_s
        return min(1.5 * self.heartbeat_interval_s, self.silence_bound_s)

    @property
    def restart_grace(self) -> float:
        """``restart_grace_s`` resolved (None: :attr:`silence_bound_s`)."""
        return self.silence_bound_s if self.restart_grace_s is None else float(self.restart_grace_s)

    @property
    def startup_sites(self) -> int:
        return self.initial_sites if self.initial_sites is not None else self.min_sites


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
    quorum_timeout_s: float | None = None,
    finishing: Collection[str] = (),
    hold_until: float | None = None,
    catching_up: Mapping[str, float] | None = None,
    finished_late: Mapping[str, float] | None = None,
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
        quorum_timeout_s: the quorum wait for this round (the rendezvous's derived
            deadline, ``dtrain.rendezvous.deadlines``); None: ``config``'s, or its start bound.
        finishing, hold_until: live members of the previous round that are not ready and
            whose heartbeats have not said they finished it (``rounds_done``), and the time (``now``'s clock) that round may
            still legitimately run to (its formation + broadcast deadline + stall budget: a
            member behind a slow link may still be repairing it). None of them is cut as a
            straggler before ``hold_until``: a site still in the previous round within its
            deadlines is slow on the link, not late (the 30%-loss launch cut a site still
            within round r's deadline from round r + 1).
        catching_up: live sites pulling state (a join or a resync) -> when their pull is
            expected to end (``now``'s clock; from the progress their heartbeats report). One
            whose pull ends after this round's quorum wait is not waited for: the round forms
            once every other live site is ready, instead of holding each round of a long pull
            for the quorum wait and cutting it then (a pull of 10 rounds held 10 rounds). A
            pull about to end is waited for as any live site.
        finished_late: live members of the previous round that said they finished it after
            the first site was ready for this one -> when they should be ready (``now``'s
            clock: when they finished plus the inner phase the ready members took from their
            finish to their ready). Each is waited for until then plus the quorum wait: the
            hold above waited for it to finish, and cutting it as it finished bought nothing
            (a lossy30 site, held for round r - 1, was cut from round r the moment it finished
            r - 1, then spent 55 s resyncing).
    Returns:
        ``(members, reason)``: the sorted admitted site_ids, or None to wait.
    """
    wait_s = quorum_timeout_s if quorum_timeout_s is not None else config.start_deadlines().quorum_timeout_s
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
    pulling = sorted(
        s for s, end in (catching_up or {}).items() if s in live and s not in ready_live and end > first + wait_s
    )
    if pulling:
        live = live - set(pulling)
    if set(ready_live) >= live:
        if len(ready_live) >= config.min_sites:
            if pulling:
                return sorted(ready_live), (
                    f"all {len(ready_live)} live sites ready but {pulling} pulling state past the quorum wait: "
                    "not waited for"
                )
            return sorted(ready_live), f"all {len(ready_live)} live sites are ready"
        return None, f"only {len(ready_live)} live site(s), min_sites is {config.min_sites}"
    not_ready = live - set(ready_live)
    held = _held(round, not_ready, now, wait_s, finishing, hold_until, finished_late) if waited >= wait_s else None
    if held:
        return None, f"{len(ready_live)} of {len(live)} live sites ready; {held}"
    if waited >= wait_s:
        if len(ready_live) >= config.min_sites:
            cut = sorted(live - set(ready_live))
            return sorted(ready_live), f"quorum timeout {wait_s}s: admitting {len(ready_live)}, cutting {cut}"
        return (
            None,
            f"only {len(ready_live)} of {len(live)} live sites ready after {waited:.1f}s, min_sites is {config.min_sites}",
        )
    return (
        None,
        f"{len(ready_live)} of {len(live)} live sites ready; waiting up to {wait_s - waited:.1f}s more",
    )


def _held(
    round: int,
    not_ready: set[str],
    now: float,
    wait_s: float,
    finishing: Collection[str],
    hold_until: float | None,
    finished_late: Mapping[str, float] | None,
) -> str | None:
    """Why the quorum wait, over, still holds for a live member of the previous round that is
    not ready (:func:`decide_quorum`'s ``finishing`` / ``hold_until`` and ``finished_late``);
    None when it does not."""
    held = sorted(set(finishing) & not_ready)
    if held and hold_until is not None and now < hold_until:
        return (
            f"{held} still finishing round {round - 1} within its deadlines: waiting up to {hold_until - now:.1f}s more"
        )
    late = {s: at + wait_s for s, at in (finished_late or {}).items() if s in not_ready}
    if late and now < max(late.values()):
        return (
            f"{sorted(late)} finished round {round - 1} late: waiting for its inner phase, up to "
            f"{max(late.values()) - now:.1f}s more"
        )
    return None


def aged(plan: RoundPlan, now: float) -> RoundPlan:
    """``plan`` with ``age_s`` = ``now - plan.formed_at`` (both on the store's clock; 0 when
    the formation time is unknown, never negative)."""
    if not plan.formed_at:
        return plan
    return dataclasses.replace(plan, age_s=max(0.0, now - plan.formed_at))


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


WAKE_JITTER_S = 0.2  # spread of remote waiters' wake-ups at a quorum timeout (seconds)
MIN_WAKE_S = 0.05  # a waiting client looks again no sooner than this (seconds)
LOCAL_WAKE_S = 0.05  # a local waiter re-evaluates at least this often (seconds)


def cannot_form_yet(
    counts: ReadyCounts, *, now: float, config: RendezvousConfig, quorum_timeout_s: float | None = None
) -> tuple[str | None, float]:
    """Why :func:`decide_quorum` must answer "wait" on these counts alone: fewer ready
    than live and the earliest ready less than ``quorum_timeout_s`` ago. Returns
    ``(reason, seconds until the quorum timeout)``, or ``(None, 0)``: read the full view."""
    if counts.first_ready_t is None or counts.num_ready >= counts.num_live:
        return None, 0.0
    wait_s = quorum_timeout_s if quorum_timeout_s is not None else config.start_deadlines().quorum_timeout_s
    left_s = wait_s - (now - counts.first_ready_t)
    if left_s <= 0:
        return None, 0.0
    return f"{counts.num_ready} of {counts.num_live} live sites ready; waiting up to {left_s:.1f}s more", left_s


class RendezvousCore:
    """The rendezvous: every membership and quorum decision, over a store.

    The store (:class:`~dtrain.rendezvous.store.RendezvousStore`) keeps the facts:
    :class:`~dtrain.rendezvous.memory_store.MemoryStore` by default (``now`` is
    ``time.monotonic()`` seconds), or ``dtrain.rendezvous.etcd_store.EtcdStore``
    (stored times are wall-clock; ``now`` only orders this process's checks). Besides
    membership it hands the sites' per-round reports (``heartbeat(round_reports=...)``)
    and the round plans to ``reports``, a :class:`ReportSink` (``dtrain.status.StatusLog``
    for the status page; by default one that keeps nothing); ``snapshot()`` copies the
    state for ``dtrain.status.build_status``.

    Raises (from its calls): :class:`SiteIdTaken` when a live site at another address
    holds a site id; ``RendezvousError`` when the store cannot be reached.
    """

    def __init__(
        self,
        config: RendezvousConfig | None = None,
        *,
        reports: "ReportSink | None" = None,
        store: RendezvousStore | None = None,
    ) -> None:
        self.config = config or RendezvousConfig()
        self.store: RendezvousStore = store if store is not None else MemoryStore(self.config)
        self.status_log: ReportSink = reports if reports is not None else NullReportSink()
        self.blocking = self.store.blocking
        self._last_reason = ""
        self._lock = threading.Lock()  # this process's scheduling only (below)
        self._pending: set[int] = set()  # rounds this process saw a ready for and no plan yet
        self._next_check = 0.0  # monotonic time decide() looks again (remote stores)
        # What the rounds showed and the join probes predicted, and the deadlines derived from it
        self.book = DeadlineBook(self.config.deadlines, self.config.overrides)
        # Per recent round: its members and when it may still run to (formation + broadcast
        # deadline + stall budget); per site, the rounds it finished (decide_quorum's hold)
        self._formed: dict[int, tuple[frozenset[str], float]] = {}
        self._done: dict[str, int] = {}
        self._done_at: dict[str, tuple[int, float]] = {}  # site -> (rounds_done, when it rose: this core's clock)
        # per site pulling state: (its expected seconds to go, when it said so on ``now``'s clock)
        self._catching: dict[str, tuple[float, float]] = {}

    @property
    def next_round(self) -> int:
        return self.store.next_round()

    def close(self) -> None:
        self.store.close()

    # ------------------------------------------------------------------ membership
    def join(self, site_id: str, address: str, *, now: float, rank_addresses: Sequence[str] = ()) -> JoinInfo:
        with self.store.atomic():
            nxt = self.store.claim(site_id, address, rank_addresses, now=now)
            self.status_log.site_joined(site_id)
            others = tuple(m for m in self.store.live_members(now) if m.site_id != site_id)
        log.info("rendezvous: %s joined (%s); next round %d; %d other live sites", site_id, address, nxt, len(others))
        return JoinInfo(
            next_round=nxt,
            members=others,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            needs_state=nxt > 0 and bool(others),
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
        rounds_done: int | None = None,
        catch_up_eta_s: float | None = None,
    ) -> HeartbeatInfo:
        """Record liveness and progress of ``site_id``.

        ``rounds_done``: how many rounds the site finished (its last finished round + 1;
        None: the client does not say): a member of round r that says it has not finished
        it is not cut from round r + 1 before r's deadlines passed (:func:`decide_quorum`'s
        hold); a site that never says is cut at the quorum timeout as before.

        ``catch_up_eta_s``: the site is pulling state and expects to be done in this many
        seconds (None: not pulling, or no estimate yet; a non-finite or negative one is
        ignored): a round whose quorum wait would end before that does not wait for it
        (:func:`decide_quorum`'s ``catching_up``).

        ``round_reports`` are the site's per-round JSON reports for the status
        page (``dtrain.status.parse_report``); bad ones are dropped and logged,
        never failing the heartbeat. An unknown site's reports are ignored (it
        must join again and resend them). ``unreachable``: sites its data path found
        gone; each is dead once silent for ``suspect_silence_s`` instead of
        ``heartbeat_timeout_s`` (a suspected site that heartbeats in time is cleared;
        the in-memory store only).
        """
        with self.store.atomic():
            got = self.store.keep_alive(
                site_id, now=now, inner_step=inner_step, last_loss=last_loss, unreachable=unreachable
            )
            nxt = self.store.next_round()
            if not got.known:
                return HeartbeatInfo(
                    known=False, resync_required=False, next_round=nxt, reason="unknown site: join again"
                )
            if rounds_done is not None:
                with self._lock:
                    if site_id in self._done or len(self._done) < 1 << 16:  # ids from the wire: bounded
                        if rounds_done > self._done.get(site_id, 0):
                            self._done_at[site_id] = (rounds_done, now)  # when it finished (_finished_late)
                        self._done[site_id] = max(self._done.get(site_id, 0), rounds_done)
            with self._lock:
                eta = catch_up_eta_s
                if eta is None or not (math.isfinite(eta) and eta >= 0):
                    self._catching.pop(site_id, None)
                elif site_id in self._catching or len(self._catching) < 1 << 16:
                    self._catching[site_id] = (float(eta), now)
            round_reports = [raw for raw in round_reports if not self._observe_probe(site_id, raw)]
            if round_reports:
                self.store.put_reports(site_id, round_reports, self.status_log)
                for raw in round_reports:
                    self._observe_report(raw)
            dead = self.store.dead(now)
            return HeartbeatInfo(
                known=True,
                resync_required=got.resync_reason is not None,
                next_round=nxt,
                reason=got.resync_reason or "",
                dead=dead,
                behind=self._behind(dead),
            )

    def _catching_up(self, now: float, t: float) -> dict[str, float]:
        """The sites pulling state -> when their pull should end, on the store's clock ``t``
        (``now`` is the same instant on this core's clock)."""
        with self._lock:
            return {s: t + (at + eta - now) for s, (eta, at) in self._catching.items()}

    def leave(self, site_id: str, *, now: float) -> None:
        with self._lock:
            self._catching.pop(site_id, None)
        with self.store.atomic():
            self.store.release(site_id, now=now)
        log.info("rendezvous: %s left", site_id)

    # ------------------------------------------------------------------ rounds
    def ready(self, site_id: str, round: int, *, now: float) -> ReadyDecision:
        """Mark ``site_id`` ready for ``round`` (its first ready time is kept) and
        decide the quorum when this could complete it."""
        with self._lock:
            self._catching.pop(site_id, None)  # asking for a round: its pull, if any, is over
        with self.store.atomic():
            st = self.store.standing(site_id, round, now=now)
            if not st.known:
                return ReadyDecision(status="wait", reason="unknown site: join first", next_round=st.next_round)
            if st.resync_reason is not None:
                return ReadyDecision(status="missed", reason=st.resync_reason, next_round=st.next_round)
            if st.plan is not None:
                if st.member:  # every member learns why the round formed as it did, whichever call formed it
                    plan = aged(st.plan, self.store.clock(now))
                    return ReadyDecision(status="plan", reason=st.plan_reason, next_round=st.next_round, plan=plan)
                reason = f"round {round} started without {site_id} (straggler)"
                return ReadyDecision(status="missed", reason=reason, next_round=st.next_round)
            if round < st.next_round:
                return ReadyDecision(status="missed", reason=f"round {round} already ran", next_round=st.next_round)
            if round > st.next_round and self.store.adopt(round, now=now):
                log.warning(
                    "rendezvous: %s asks for round %d, ahead of %d: adopting it (rendezvous restarted?)",
                    site_id,
                    round,
                    st.next_round,
                )
            counts = self.store.mark_ready(site_id, round, now=now, lease=st.lease)
            with self._lock:
                self._pending.add(round)
            return self._decide(round, now, counts)

    def poll(self, site_id: str, round: int, *, now: float) -> ReadyDecision:
        """Re-evaluate a pending ``ready`` (long-poll loop); same answers as ``ready``."""
        return self.ready(site_id, round, now=now)

    def decide(self, *, now: float) -> int:
        """Re-run the quorum decision for the newest round this process saw a ready for
        (forming its plan when the rule says so) and return ``next_round``.

        The gRPC service calls this once per change or tick instead of calling ``ready``
        for every waiting site. It costs nothing while no ready is pending; on a remote
        store it looks only once the quorum timeout (or a heartbeat interval) passed.
        """
        with self.store.atomic():
            nxt = self.store.next_round()
            with self._lock:
                self._pending = {r for r in self._pending if r >= nxt}
                pending = max(self._pending, default=None)
                due = self.store.local or time.monotonic() >= self._next_check
            if pending is None or not due:
                return nxt
            try:
                self._decide(pending, now, None)
            except RendezvousError as e:
                log.warning("rendezvous: deciding round %d failed: %s", pending, e)
                self._schedule(self.config.heartbeat_interval_s)
            return self.store.next_round()

    def _decide(self, round: int, now: float, counts: ReadyCounts | None) -> ReadyDecision:
        """``decide_quorum`` on what the store shows; the plan written once if it holds."""
        t = self.store.clock(now)
        if counts is not None:
            why, left_s = cannot_form_yet(
                counts, now=t, config=self.config, quorum_timeout_s=self.deadlines.quorum_timeout_s
            )
            if why is not None:
                self._schedule(left_s)
                return ReadyDecision(status="wait", reason=why, next_round=max(self.store.next_round(), round))
        view = self.store.view(round, now=now)
        if view.grace_left_s > 0:
            reason = (
                f"rendezvous restarted: waiting {view.grace_left_s:.1f}s more "
                f"for every live site to re-register before round {round}"
            )
            return self._wait(round, reason, log_prefix=reason.split(":")[0])
        finishing, hold_until = self._still_finishing(round - 1)
        late = self._finished_late(round - 1, view.ready, now, t)
        members, reason = decide_quorum(
            round=round,
            live=view.live,
            ready=view.ready,
            joined_ever=view.joined,
            now=t,
            config=self.config,
            startup_complete_at=view.startup_t,
            first_round=view.first_round,
            quorum_timeout_s=self.deadlines.quorum_timeout_s,
            finishing=finishing,
            hold_until=hold_until,
            catching_up=self._catching_up(now, t),
            finished_late=late,
        )
        if members is None:
            if not self.store.local:  # (a local store is decided on every tick: no O(sites) here)
                first = min(view.ready.values(), default=t)
                if view.first_round and view.startup_t is not None:
                    first = max(first, view.startup_t)
                late_until = max(late.values(), default=0.0) + self.deadlines.quorum_timeout_s
                self._schedule(max(first + self.deadlines.quorum_timeout_s, hold_until or 0.0, late_until) - t)
            return self._wait(round, f"round {round}: {reason}", log_prefix=f"round {round}: {reason[:12]}")
        everyone = set(members) >= set(view.live)  # else a straggler was cut: the spread is not known
        ready = [view.ready[s] for s in members if s in view.ready]
        self._observe(round, ready_spread_s=(max(ready) - min(ready)) if everyone and ready else None)
        d = self.deadlines
        plan = RoundPlan(
            round=round,
            members=tuple(view.member(s) for s in members),
            reduce_timeout_s=d.reduce_timeout_s,
            broadcast_timeout_s=d.broadcast_timeout_s,
            deadline_reason=d.reason,
            datagram_key=os.urandom(32),  # the round's datagram AEAD key (protocol.RoundPlan)
            left_out=tuple(sorted(set(view.live) - set(members))),
            formed_at=t,
        )
        plan, reason, won = self.store.put_plan(plan, reason, now=now)
        self._note_formed(plan)
        # the deadlines it runs under: a round that runs to one of them is a censored observation
        self._observe(
            plan.round, reduce_deadline_s=plan.reduce_timeout_s, broadcast_deadline_s=plan.broadcast_timeout_s
        )
        if won:  # else another writer formed it first, perhaps with other members: theirs holds
            self.status_log.add_plan(plan.round, list(plan.site_ids), now)
            log.info("rendezvous: round %d formed with %s: %s", plan.round, list(plan.site_ids), reason)
        self._last_reason = ""
        return ReadyDecision(status="plan", reason=reason, next_round=self.store.next_round(), plan=plan)

    def _note_formed(self, plan: RoundPlan) -> None:
        """Remember ``plan``'s members and how long it may run (decide_quorum's hold)."""
        end = plan.formed_at + plan.broadcast_timeout_s + self.config.deadlines.stall_budget_s
        with self._lock:
            self._formed[plan.round] = (frozenset(plan.site_ids), end)
            for r in [r for r in self._formed if r < plan.round - 2]:
                del self._formed[r]

    def _behind(self, dead: Sequence[str]) -> tuple[str, ...]:
        """The members of the newest round formed here that have not finished it and are not
        dead or gone (``HeartbeatInfo.behind``); () when none was formed here."""
        with self._lock:
            if not self._formed:
                return ()
            r = max(self._formed)
            members = self._formed[r][0]
            return tuple(sorted(s for s in members if s in self._done and self._done[s] <= r and s not in dead))

    def _finished_late(self, round: int, ready: Mapping[str, float], now: float, t: float) -> dict[str, float]:
        """Members of ``round`` (formed here) not ready for the next one whose heartbeats said
        they finished ``round`` after the first site was ready for the next -> when they should
        be ready, on the store's clock ``t`` (``now`` is the same instant on this core's clock):
        their finish plus the median inner phase of the ready members (their ready minus their
        finish); {} when none finished late or no ready member's finish was heard."""
        with self._lock:
            got = self._formed.get(round)
            if got is None or not ready:
                return {}
            fin = {s: t + (at - now) for s, (n, at) in self._done_at.items() if s in got[0] and n == round + 1}
        phases = sorted(ready[s] - fin[s] for s in ready if s in fin and ready[s] >= fin[s])
        first = min(ready.values())
        if not phases:
            return {}
        inner = phases[len(phases) // 2]
        return {s: f + inner for s, f in fin.items() if s not in ready and f > first}

    def _still_finishing(self, round: int) -> tuple[list[str], float | None]:
        """The members of ``round`` (formed here) whose heartbeats have not said they finished
        it (``rounds_done`` <= ``round``), and the time it may still run to; ``([], None)`` when
        this process did not form it (another front-end did, or before a restart)."""
        with self._lock:
            got = self._formed.get(round)
            if got is None:
                return [], None
            members, end = got
            return sorted(s for s in members if s in self._done and self._done[s] <= round), end

    # ------------------------------------------------------------------ deadlines
    def _observe(self, round: int, **figures: float | bool | None) -> None:
        """Fold a round's figures into the deadline book (:meth:`DeadlineBook.observe`)."""
        self.book.observe(round, **figures)

    @property
    def deadlines(self) -> Deadlines:
        """The next round's deadlines, derived from what the rounds showed."""
        return self.book.deadlines

    def _observe_probe(self, site_id: str, raw: str) -> bool:
        """Whether ``raw`` is a site's join-probe report (:func:`~.deadlines.read_probe_report`);
        a valid one's predicted figures raise the start bound until rounds are measured."""
        is_probe, figures, why = read_probe_report(raw)
        if not is_probe:
            return False
        if figures is None:
            log.warning("rendezvous: dropped a join probe report from %s: %s", site_id, why)
            return True
        log.info("rendezvous: %s's join probe: %s", site_id, why)
        self.book.probe(site_id, figures)
        return True

    def _observe_report(self, raw: str) -> None:
        """A site's round report: its phase times and whether everything arrived
        (:func:`~.deadlines.read_round_report`; malformed ones are ignored here, the status
        log says why)."""
        got = read_round_report(raw)
        if got is not None:
            rnd, figures = got
            self._observe(rnd, **figures)

    def _wait(self, round: int, reason: str, log_prefix: str | None = None) -> ReadyDecision:
        """A "wait" answer, logged once per distinct reason (``log_prefix``: once per kind)."""
        key = log_prefix if log_prefix is not None else reason
        if key != self._last_reason:
            log.info("rendezvous: %s", reason)
            self._last_reason = key
        text = reason.removeprefix(f"round {round}: ")
        return ReadyDecision(status="wait", reason=text, next_round=max(self.store.next_round(), round))

    def _schedule(self, until_timeout_s: float) -> None:
        """When ``decide`` should look again on a remote store: at the quorum timeout
        (plus a random delay of up to ``WAKE_JITTER_S``, so the waiters do not all read
        the full view at once: the first forms the plan and the others' watches deliver
        it), or within a heartbeat interval (a site that dies while others wait shrinks
        the live set)."""
        if self.store.local:
            return
        jitter = random.uniform(0.0, WAKE_JITTER_S)
        until = min(max(0.0, until_timeout_s) + jitter, self.config.heartbeat_interval_s)
        with self._lock:
            self._next_check = time.monotonic() + until + 0.01

    def wait(self, round: int, timeout_s: float) -> None:
        """Block until round ``round``'s plan may be there (the store's wake-up: a change
        in memory, the watch on etcd), the next ``decide`` is due, or ``timeout_s``."""
        if self.store.local:
            self.store.wait(round, min(timeout_s, LOCAL_WAKE_S))
            return
        with self._lock:
            until_check = self._next_check - time.monotonic()
        self.store.wait(round, max(MIN_WAKE_S, min(timeout_s, until_check)))

    def wait_for_change(self, timeout_s: float) -> None:
        """Block until something changed (a local store) or ``timeout_s`` passed."""
        self.store.wait(self.store.next_round(), timeout_s)

    # ------------------------------------------------------------------ status page
    def snapshot(self, now: float) -> dict:
        """Read-only copy of the state for status pages and tests (no formatting).

        Returns ``now``, ``next_round``, ``config`` (timing, seconds),
        ``first_ready_at`` (when the first site became ready for ``next_round``,
        or None), ``sites`` (site_id -> address, alive, needs_resync,
        resync_reason, heartbeat_age_s, last_heartbeat, rounds_joined,
        inner_step, last_loss, joined_round, last_member_round, ready_since,
        left; sites that left have ``left`` True) and ``status`` (the
        :class:`~dtrain.status.StatusLog` snapshot). Times are ``now``'s clock.
        """
        c = self.config
        with self.store.atomic():
            sites, first_ready_at = self.store.site_rows(now, self.status_log)
            return {
                "now": now,
                "next_round": self.store.next_round(),
                "config": {
                    "heartbeat_interval_s": c.heartbeat_interval_s,
                    "heartbeat_timeout_s": c.silence_bound_s,
                    "failure_detector": "fixed" if c.heartbeat_timeout_s is not None else "accrual",
                    "dead_phi": c.accrual.dead_phi,
                    "quorum_timeout_s": self.deadlines.quorum_timeout_s,
                    "reduce_timeout_s": self.deadlines.reduce_timeout_s,
                    "broadcast_timeout_s": self.deadlines.broadcast_timeout_s,
                    "deadline_reason": self.deadlines.reason,
                    "min_sites": c.min_sites,
                },
                "first_ready_at": first_ready_at,
                "sites": sites,
                "status": self.status_log.snapshot(),
            }
