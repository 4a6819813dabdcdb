"""A site's membership in a training group: registration, heartbeats, round decisions.

:class:`Group` ties a :class:`~dtrain.rounds.RoundEngine` to a rendezvous client
(in-process or gRPC): it registers the site (every rank's Peer address), heartbeats
(progress, round reports for the status page, members the data path found gone), and
asks for the decision about the site's next round (:meth:`Group.next_decision`). The
round itself, the state pulls of a join or a resync and the ranks of a site group are
:class:`dtrain.site.Site`'s; only local rank 0 of a site holds a Group.
"""

from __future__ import annotations

import enum
import inspect
import json
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Mapping, Protocol, Sequence

from dtrain.configs import GroupConfig
from dtrain.errors import PermanentError, QuorumTimeout, RendezvousError
from dtrain.protocol import HEARTBEATS_IN_FLIGHT, HeartbeatInfo, JoinInfo, ReadyDecision
from dtrain.rendezvous.store import SiteIdTaken
from dtrain.rounds import RoundEngine
from dtrain.status import MAX_REPORTS_PER_HEARTBEAT

__all__ = ["RendezvousClient", "GroupConfig", "Decision", "Group"]

log = logging.getLogger(__name__)


class RendezvousClient(Protocol):
    def join(self, site_id: str, address: str, rank_addresses: Sequence[str] = ()) -> JoinInfo: ...
    def heartbeat(
        self,
        site_id: str,
        inner_step: int = 0,
        last_loss: float | None = None,
        round_reports: Sequence[str] = (),
        unreachable: Sequence[str] = (),
        rounds_done: int | None = None,
        catch_up_eta_s: float | None = None,
    ) -> HeartbeatInfo: ...
    def ready(self, site_id: str, round: int, timeout_s: float) -> ReadyDecision: ...
    def leave(self, site_id: str) -> None: ...


class Decision(enum.StrEnum):
    """What the rendezvous decided about this site's next round (:meth:`Group.next_decision`).

    | decision | the site then |
    |---|---|
    | PLAN | runs the round of the plan |
    | MISSED | was cut (a straggler) or the group moved on: resynchronises |
    | RESYNC | was declared dead by the rendezvous: resynchronises |
    | DEFERRED | the rendezvous was unreachable for ``rendezvous_retry_s``: trains on locally |
    """

    PLAN = "plan"
    MISSED = "missed"
    RESYNC = "resync"
    DEFERRED = "deferred"


class Group:
    """One site's group membership.

    Args:
        engine: the site's round engine (already started, so it has an address).
        rendezvous: a rendezvous client.
        config: see :class:`GroupConfig`.
        rank_addresses: for a site group (``dtrain.sitegroup``), every rank's
            Peer address, rank 0's first; registered with the rendezvous so that
            plans carry them. Empty for a single-process site.
    """

    def __init__(
        self,
        engine: RoundEngine,
        rendezvous: RendezvousClient,
        config: GroupConfig | None = None,
        *,
        rank_addresses: Sequence[str] = (),
    ) -> None:
        self.engine = engine
        self.rank_addresses = tuple(rank_addresses)
        self.rendezvous = rendezvous
        self.config = config or GroupConfig()
        self.site_id = engine.site_id
        self.inner_step = 0
        self.last_loss: float | None = None
        self._resync_needed = threading.Event()
        self._rejoin_needed = threading.Event()
        self._stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._hb_interval_s = 1.0
        self._hb_kick = threading.Event()  # send a heartbeat now (a round report is waiting)
        self._hb_seq = 0  # heartbeats sent
        self._hb_answered = 0  # the newest heartbeat whose answer was handled
        self._hb_answer_lock = threading.Lock()
        self._hb_answer_cv = threading.Condition()  # notified after each handled answer
        self._reports: deque[tuple[int, str]] = deque(maxlen=MAX_REPORTS_PER_HEARTBEAT)  # (seq, JSON), unsent
        self._reports_lock = threading.Lock()
        self._report_seq = 0
        self._unreachable: set[str] = set()  # found gone by the data path, not yet reported
        # Called (heartbeat thread) with the members the rendezvous holds dead, after
        # the engine stopped waiting for them (a site group's rank 0 posts a lost notice).
        self.on_members_lost: Callable[[list[str]], None] | None = None
        engine.on_unreachable = self.report_unreachable
        # a rendezvous client without ``unreachable`` (an older one) gets heartbeats without the reports
        self._client_takes_unreachable = "unreachable" in inspect.signature(rendezvous.heartbeat).parameters
        self._client_takes_rounds_done = "rounds_done" in inspect.signature(rendezvous.heartbeat).parameters
        self._client_takes_catch_up = "catch_up_eta_s" in inspect.signature(rendezvous.heartbeat).parameters
        self.rounds_done = 0  # rounds this site finished (note_rounds_done), told with each heartbeat
        # while this site pulls state: seconds until its pull should end (None: no estimate yet)
        self.catch_up_eta: Callable[[], float | None] | None = None
        self.joined = False
        self.dead: frozenset[str] = frozenset()  # the sites the last heartbeat named dead or left
        self.behind: frozenset[str] | None = None  # members still finishing the newest round (None: no answer yet)

    # ------------------------------------------------------------------ membership
    def _call_with_backoff(self, fn, budget_s: float):
        deadline = time.monotonic() + budget_s
        delay = 0.1
        while True:
            try:
                return fn()
            except PermanentError:
                raise  # a wrong token, a taken site id: retrying cannot help
            except RendezvousError as e:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("rendezvous unreachable (%s); retrying in %.1fs", e, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.config.backoff_max_s)

    def join(self, timeout_s: float = 60.0) -> JoinInfo:
        """Register with the rendezvous and start heartbeating. The state pull of a
        joining site is :meth:`dtrain.site.Site.join`'s.

        Raises:
            RendezvousError: unreachable for ``timeout_s``.
        """
        assert self.engine.address is not None, "start the engine before joining"
        info = self._register_taking_over(timeout_s)
        self._hb_interval_s = info.heartbeat_interval_s
        self.joined = True
        self._rejoin_needed.clear()
        self._resync_needed.clear()
        if self._hb_thread is None:
            self._hb_thread = threading.Thread(
                target=self._heartbeat_loop, name=f"heartbeat-{self.site_id}", daemon=True
            )
            self._hb_thread.start()
        return info

    def _register_taking_over(self, timeout_s: float) -> JoinInfo:
        """:meth:`register_with_backoff`; a ``SiteIdTaken`` refusal is tried again for
        ``config.takeover_s`` (a restarted incarnation waits for its predecessor to be
        declared dead), then raised."""
        deadline = time.monotonic() + self.config.takeover_s
        while True:
            try:
                return self.register_with_backoff(timeout_s)
            except SiteIdTaken as e:
                if time.monotonic() + 0.5 > deadline:
                    raise
                log.warning("%s: %s; trying again (takeover_s %.1f s)", self.site_id, e, self.config.takeover_s)
                time.sleep(0.5)

    def register_with_backoff(self, budget_s: float) -> JoinInfo:
        """:meth:`register`, retried with backoff for up to ``budget_s`` seconds.

        Raises:
            RendezvousError: still unreachable after ``budget_s``; ``SiteIdTaken`` at once.
        """
        return self._call_with_backoff(self.register, budget_s)

    def resync_needed(self) -> None:
        """Make the next :meth:`next_decision` answer ``"resync"`` (a failed resync is tried again)."""
        self._resync_needed.set()

    def resync_done(self) -> None:
        """The site re-registered to resynchronise: the rendezvous's demand is met."""
        self._resync_needed.clear()

    def register(self) -> JoinInfo:
        """One ``join`` call to the rendezvous with this site's address(es).

        Raises:
            RendezvousError: the rendezvous is unreachable.
        """
        kw = {"rank_addresses": self.rank_addresses} if self.rank_addresses else {}
        return self.rendezvous.join(self.site_id, self.engine.address or "", **kw)

    def beat_and_wait(self, timeout_s: float) -> bool:
        """Send a heartbeat now and wait up to ``timeout_s`` seconds for an answer to one
        sent from here on. Returns whether one was handled (``dead`` and ``behind`` are
        then at least that fresh); False on timeout (the rendezvous is slow or gone)."""
        with self._hb_answer_cv:
            after = self._hb_seq
            self._hb_kick.set()
            return self._hb_answer_cv.wait_for(lambda: self._hb_answered > after, timeout=timeout_s)

    def note_rounds_done(self, n: int) -> None:
        """This site finished ``n`` rounds (its θ has ``n`` rounds applied): the heartbeat
        thread tells the rendezvous at once, which holds round r + 1 for a member still
        finishing round r within its deadlines instead of cutting it as a straggler."""
        if n > self.rounds_done:
            self.rounds_done = n
            self._hb_kick.set()

    def report_round(self, report: Mapping[str, Any]) -> None:
        """Queue one round's report for the rendezvous's status page
        (``dtrain.status.round_report``); the heartbeat thread sends it at once and
        again on later heartbeats until the rendezvous took it. Never blocks on
        the network; when more than ``MAX_REPORTS_PER_HEARTBEAT`` are unsent the
        oldest are dropped."""
        with self._reports_lock:
            self._report_seq += 1
            self._reports.append((self._report_seq, json.dumps({**report, "seq": self._report_seq})))
        self._hb_kick.set()

    def report_probe(self, report: Mapping[str, Any]) -> None:
        """Queue a join-probe report (``dtrain.site.probe_report``) to go with the next
        heartbeat, as :meth:`report_round` does, but outside the round reports' numbering:
        their ``seq`` numbers the site's metrics lines from 1, and the status page finds each
        report's line by it."""
        with self._reports_lock:
            self._reports.append((self._report_seq, json.dumps(dict(report))))
        self._hb_kick.set()

    def report_unreachable(self, site_id: str) -> None:
        """The data path found ``site_id`` gone (the round engine calls this): the
        heartbeat thread tells the rendezvous at once, which then holds it dead
        sooner if it stays silent (``RendezvousConfig.suspect_timeout_s``). Never blocks."""
        with self._reports_lock:
            self._unreachable.add(site_id)
        self._hb_kick.set()

    def _heartbeat_loop(self) -> None:
        """Every ``heartbeat_interval_s`` (or at once when kicked), send a heartbeat on a
        thread of its own, without waiting for the previous one: on a lossy link one
        heartbeat stalled in a TCP retransmission must not hold back the next (the
        rendezvous's accrual detector reads the arrivals), up to ``HEARTBEATS_IN_FLIGHT``
        out at once (a tick with all of them out sends none)."""
        out: list[threading.Thread] = []
        while not self._stop.is_set():
            self._hb_kick.wait(self._hb_interval_s)
            self._hb_kick.clear()
            if self._stop.is_set():
                break
            out = [t for t in out if t.is_alive()]
            if len(out) >= HEARTBEATS_IN_FLIGHT:
                continue
            with self._reports_lock:
                pending = list(self._reports)
                unreachable, self._unreachable = sorted(self._unreachable), set()
                self._hb_seq += 1
                seq = self._hb_seq
            t = threading.Thread(
                target=self._beat, args=(seq, pending, unreachable), name=f"heartbeat-{self.site_id}-{seq}", daemon=True
            )
            t.start()
            out.append(t)
        for t in out:  # a heartbeat in flight must not re-register the site after it left
            t.join(timeout=max(0.0, 2.0 / max(1, len(out))))

    def _beat(self, seq: int, pending: list[tuple[int, str]], unreachable: list[str]) -> None:
        """One heartbeat and what its answer says (its own thread; answers older than one
        already handled are dropped)."""
        kw: dict = {"round_reports": [raw for _, raw in pending]} if pending else {}
        if unreachable and self._client_takes_unreachable:
            kw["unreachable"] = unreachable
        if self._client_takes_rounds_done:  # always, 0 included: this site says how far it is
            kw["rounds_done"] = self.rounds_done
        eta_fn = self.catch_up_eta
        eta = eta_fn() if eta_fn is not None else None
        if eta is not None and self._client_takes_catch_up:
            kw["catch_up_eta_s"] = eta
        try:
            hb = self.rendezvous.heartbeat(self.site_id, inner_step=self.inner_step, last_loss=self.last_loss, **kw)
        except RendezvousError as e:
            log.debug("heartbeat failed: %s", e)
            with self._reports_lock:  # report them with the next heartbeat
                self._unreachable.update(unreachable)
            return
        with self._hb_answer_lock:
            if seq < self._hb_answered or self._stop.is_set():
                return  # a newer answer was handled; or left meanwhile ("unknown" is the leave)
            self._hb_answered = seq
            self._heartbeat_answered(hb, pending)
        with self._hb_answer_cv:
            self._hb_answer_cv.notify_all()

    def _heartbeat_answered(self, hb: HeartbeatInfo, pending: list[tuple[int, str]]) -> None:
        if hb.known and pending:
            with self._reports_lock:  # delivered: drop them (newer ones may have arrived meanwhile)
                while self._reports and self._reports[0][0] <= pending[-1][0]:
                    self._reports.popleft()
        if hb.known:
            self.dead = frozenset(hb.dead)
            self.behind = frozenset(hb.behind)
        if hb.known and hb.dead:
            self.engine.members_lost(hb.dead)
            if self.on_members_lost is not None:  # a site group's rank 0 tells its other ranks
                self.on_members_lost(list(hb.dead))
        if not hb.known:
            self._rejoin_needed.set()
            try:  # a restarted rendezvous: register again, keep our state
                self.register()
                self._rejoin_needed.clear()
                log.info("%s re-registered with a restarted rendezvous", self.site_id)
            except RendezvousError:
                pass
        elif hb.resync_required:
            if not self._resync_needed.is_set():
                log.warning("%s must resynchronise: %s", self.site_id, hb.reason)
            self._resync_needed.set()

    def leave(self) -> None:
        """Stop heartbeating and tell the rendezvous this site leaves (nothing to tell when
        it never joined: e.g. its checkpoint was refused before the join)."""
        self._stop.set()
        self._hb_kick.set()
        if self._hb_thread is not None and self._hb_thread is not threading.current_thread():
            # a heartbeat in flight must not re-register the site after it left (it would stay
            # live until the heartbeat timeout, and peers waiting for it to leave would wait)
            self._hb_thread.join(timeout=2.0)
        if not self.joined:
            return
        try:
            self.rendezvous.leave(self.site_id)
        except RendezvousError as e:
            log.warning("leave failed: %s", e)

    # ------------------------------------------------------------------ rounds
    def next_decision(self) -> tuple[Decision, ReadyDecision | None, str]:
        """Wait for the rendezvous's decision about this site's next round.

        Returns:
            ``(kind, decision, reason)``: a :class:`Decision` (with ``PLAN``,
            ``decision.plan`` is the round to run), the rendezvous's answer and why.
        Raises:
            QuorumTimeout: no round formed within ``quorum_wait_s``.
        """
        st = self.engine.state
        if self._resync_needed.is_set():
            return Decision.RESYNC, None, "declared dead by the rendezvous; state pulled"
        waited_since = time.monotonic()
        unreachable_since: float | None = None
        last_reason = ""
        while True:
            r = st.rounds_applied
            try:
                d = self.rendezvous.ready(self.site_id, r, self.config.ready_poll_s)
                unreachable_since = None
            except RendezvousError as e:
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since > self.config.rendezvous_retry_s:
                    return Decision.DEFERRED, None, f"rendezvous unreachable: {e}"
                time.sleep(min(0.5, self.config.rendezvous_retry_s))
                continue
            if d.status == "plan" and d.plan is not None:
                return Decision.PLAN, d, d.reason
            if d.status == "missed":
                return Decision.MISSED, d, d.reason
            if d.reason != last_reason:
                log.info("%s waiting for round %d: %s", self.site_id, r, d.reason)
                last_reason = d.reason
            if time.monotonic() - waited_since > self.config.quorum_wait_s:
                raise QuorumTimeout(f"no quorum for round {r} within {self.config.quorum_wait_s}s: {d.reason}")
