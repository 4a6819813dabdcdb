"""A site's membership in a training group: join, heartbeats, rounds, resync.

:class:`Group` ties a :class:`~dtrain.rounds.RoundEngine` to a rendezvous client
(in-process or gRPC). ``sync(tensors)`` asks for the next round's plan, computes
the pseudo-gradient only once admitted, runs the round and reports what
happened. It never raises for peer faults; it raises ``QuorumTimeout`` when no
quorum of ``min_sites`` forms within ``quorum_wait_s``.
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from dtrain.configs import GroupConfig
from dtrain.errors import PermanentError, QuorumTimeout, RendezvousError, StateTransferError
from dtrain.protocol import HeartbeatInfo, JoinInfo, ReadyDecision
from dtrain.rounds import RoundEngine, RoundResult
from dtrain.state import pull_full_state
from dtrain.status import MAX_REPORTS_PER_HEARTBEAT

__all__ = ["RendezvousClient", "GroupConfig", "SyncOutcome", "Group"]

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
    ) -> HeartbeatInfo: ...
    def ready(self, site_id: str, round: int, timeout_s: float) -> ReadyDecision: ...
    def leave(self, site_id: str) -> None: ...


@dataclass(kw_only=True)
class SyncOutcome:
    """What ``Group.sync`` did.

    ``status``: ``"applied"`` (a round ran; reset the model to θ),
    ``"resynced"`` (cut or declared dead: Δ discarded, θ pulled from members;
    reset the model to θ) or ``"deferred"`` (rendezvous unreachable: keep
    training locally and try again later; the model is NOT reset).
    ``quorum_s``: seconds this sync waited for the rendezvous's decision (the
    round's plan, or "missed"): the quorum forming, i.e. the slowest member
    finishing its inner phase.
    """

    status: str
    reason: str
    result: RoundResult | None = None
    quorum_s: float = 0.0


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
        self._reports: deque[tuple[int, str]] = deque(maxlen=MAX_REPORTS_PER_HEARTBEAT)  # (seq, JSON), unsent
        self._reports_lock = threading.Lock()
        self._report_seq = 0
        self._unreachable: set[str] = set()  # found gone by the data path, not yet reported
        # The members θ was last pulled from (join or resync), for DiLoCo's position heal;
        # empty when the last join or resync pulled nothing.
        self.donors: list = []
        # Called (heartbeat thread) with the members the rendezvous holds dead, after
        # the engine stopped waiting for them (``SiteGroupDiLoCo`` posts a lost notice).
        self.on_members_lost: Callable[[list[str]], None] | None = None
        engine.on_unreachable = self.report_unreachable
        # a rendezvous client without ``unreachable`` (an older one) gets heartbeats without the reports
        self._client_takes_unreachable = "unreachable" in inspect.signature(rendezvous.heartbeat).parameters
        self.joined = False

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
        """Register with the rendezvous and, when rounds already ran, pull θ and
        outer-optimizer state from the members (a joining or restarted site).

        Raises:
            RendezvousError: unreachable for ``timeout_s``.
            StateTransferError: no member could provide a consistent state.
        """
        addr = self.engine.address
        assert addr is not None, "start the engine before joining"
        info = self._call_with_backoff(self.register, timeout_s)
        self._hb_interval_s = info.heartbeat_interval_s
        self.donors = []
        if info.needs_state and self.engine.state.rounds_applied < info.next_round:
            log.info(
                "%s joins at round %d: pulling state from %s",
                self.site_id,
                info.next_round,
                [m.site_id for m in info.members],
            )
            info = self._pull_state(info)
        self.joined = True
        self._rejoin_needed.clear()
        self._resync_needed.clear()
        if self._hb_thread is None:
            self._hb_thread = threading.Thread(
                target=self._heartbeat_loop, name=f"heartbeat-{self.site_id}", daemon=True
            )
            self._hb_thread.start()
        return info

    def register(self) -> JoinInfo:
        """One ``join`` call to the rendezvous with this site's address(es).

        Raises:
            RendezvousError: the rendezvous is unreachable.
        """
        kw = {"rank_addresses": self.rank_addresses} if self.rank_addresses else {}
        return self.rendezvous.join(self.site_id, self.engine.address or "", **kw)

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

    def report_unreachable(self, site_id: str) -> None:
        """The data path found ``site_id`` gone (the round engine calls this): the
        heartbeat thread tells the rendezvous at once, which then holds it dead
        sooner if it stays silent (``RendezvousConfig.suspect_timeout_s``). Never blocks."""
        with self._reports_lock:
            self._unreachable.add(site_id)
        self._hb_kick.set()

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            self._hb_kick.wait(self._hb_interval_s)
            self._hb_kick.clear()
            if self._stop.is_set():
                break
            with self._reports_lock:
                pending = list(self._reports)
                unreachable, self._unreachable = sorted(self._unreachable), set()
            kw = {"round_reports": [raw for _, raw in pending]} if pending else {}
            if unreachable and self._client_takes_unreachable:
                kw["unreachable"] = unreachable
            try:
                hb = self.rendezvous.heartbeat(self.site_id, inner_step=self.inner_step, last_loss=self.last_loss, **kw)
            except RendezvousError as e:
                log.debug("heartbeat failed: %s", e)
                with self._reports_lock:  # report them with the next heartbeat
                    self._unreachable.update(unreachable)
                continue
            if hb.known and pending:
                with self._reports_lock:  # delivered: drop them (newer ones may have arrived meanwhile)
                    while self._reports and self._reports[0][0] <= pending[-1][0]:
                        self._reports.popleft()
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

    def _pull_state(self, info: JoinInfo) -> JoinInfo:
        """Pull θ and outer-optimizer state from ``info.members`` within
        ``state_pull_timeout_s``. When every donor failed (they died or left), the
        rendezvous is asked again for the current members; with none left, the site
        only adopts the group's round number. Returns the last JoinInfo.

        Raises:
            StateTransferError: no consistent state within ``state_pull_timeout_s``.
            RendezvousError: the rendezvous unreachable when asked again.
        """
        st = self.engine.state
        deadline = time.monotonic() + self.config.state_pull_timeout_s
        while True:
            if not info.members:
                st.rounds_applied = max(st.rounds_applied, info.next_round)
                return info
            self.donors = list(info.members)
            try:
                pull_full_state(
                    st,
                    self.engine.transport,
                    list(info.members),
                    requester=self.site_id,
                    timeout_s=max(0.1, deadline - time.monotonic()),
                    min_round=info.next_round,
                )
                return info
            except StateTransferError as e:
                if time.monotonic() + 0.2 >= deadline:
                    raise
                log.warning(
                    "%s: state pull failed (%s); asking the rendezvous for the current members", self.site_id, e
                )
            time.sleep(0.2)
            info = self._call_with_backoff(self.register, 60.0)

    def resync(self) -> None:
        """Discard local progress and pull θ and outer-optimizer state from members."""
        st = self.engine.state
        st.residuals = [None] * len(st)
        self.donors = []
        info = self._call_with_backoff(self.register, 60.0)
        self._pull_state(info)
        self._resync_needed.clear()

    def leave(self) -> None:
        self._stop.set()
        self._hb_kick.set()
        try:
            self.rendezvous.leave(self.site_id)
        except RendezvousError as e:
            log.warning("leave failed: %s", e)

    # ------------------------------------------------------------------ rounds
    def sync(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        buckets: Sequence[int] | None = None,
        fragment: int | None = None,
        pace_window_s: float | None = None,
    ) -> SyncOutcome:
        """Take part in the next round with the model's current ``tensors``.

        Args:
            tensors: the local tensors Δ is measured from (``θ − tensors``).
            buckets: a fragment round (Streaming DiLoCo): only these buckets are
                measured, sent and applied (:meth:`RoundEngine.run_round`); None: all.
            fragment: the fragment's index, recorded in ``RoundResult.fragment``.
            pace_window_s: spread this site's sends over this many seconds from the
                round's start (:meth:`RoundEngine.run_round`); None: unpaced.

        Returns a :class:`SyncOutcome`; see its ``status`` for what the caller
        must do with the model.
        Raises:
            QuorumTimeout: no round formed within ``quorum_wait_s``.
        """
        waited_since = time.monotonic()
        kind, d, reason = self.next_decision()
        # seconds waited for the rendezvous's decision (0 when none was asked for)
        quorum_s = time.monotonic() - waited_since if kind in ("plan", "missed") else 0.0
        if kind == "plan":
            assert d is not None and d.plan is not None
            ok = self.engine.add_pseudo_gradient(list(tensors), buckets)
            res = self.engine.run_round(d.plan, contribute=ok, buckets=buckets, pace_window_s=pace_window_s)
            res.fragment = fragment
            return SyncOutcome(status="applied", reason=reason, result=res, quorum_s=quorum_s)
        if kind == "deferred":
            return SyncOutcome(status="deferred", reason=reason)
        r = self.engine.state.rounds_applied
        if kind == "missed":
            log.warning("%s missed round %d: %s; resynchronising", self.site_id, r, reason)
        try:
            self.resync()
        except (RendezvousError, StateTransferError) as e:
            prefix = f"missed round {r} ({reason}); " if kind == "missed" else ""
            return SyncOutcome(status="deferred", reason=f"{prefix}resync failed: {e}", quorum_s=quorum_s)
        return SyncOutcome(status="resynced", reason=reason, quorum_s=quorum_s)

    def next_decision(self) -> tuple[str, ReadyDecision | None, str]:
        """Wait for the rendezvous's decision about this site's next round.

        Returns:
            ``(kind, decision, reason)``: kind ``"plan"`` (``decision.plan`` is
            the round to run), ``"missed"`` (the group moved on: resynchronise),
            ``"resync"`` (declared dead by the rendezvous: resynchronise) or
            ``"deferred"`` (rendezvous unreachable: train on locally).
        Raises:
            QuorumTimeout: no round formed within ``quorum_wait_s``.
        """
        st = self.engine.state
        if self._resync_needed.is_set():
            return "resync", None, "declared dead by the rendezvous; state pulled"
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
                    return "deferred", None, f"rendezvous unreachable: {e}"
                time.sleep(min(0.5, self.config.rendezvous_retry_s))
                continue
            if d.status == "plan" and d.plan is not None:
                return "plan", d, d.reason
            if d.status == "missed":
                return "missed", d, d.reason
            if d.reason != last_reason:
                log.info("%s waiting for round %d: %s", self.site_id, r, d.reason)
                last_reason = d.reason
            if time.monotonic() - waited_since > self.config.quorum_wait_s:
                raise QuorumTimeout(f"no quorum for round {r} within {self.config.quorum_wait_s}s: {d.reason}")
