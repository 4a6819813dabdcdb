"""Steps 4 and 6 of a round at a member (a mixin of :class:`~dtrain.rounds.engine.RoundEngine`):
the late pulls of means that did not arrive by the broadcast deadline, and the repair of
stale buckets, pulled whole from their owner or a member with the owner's checksum.

Both run within the round's repair window (:func:`repair_window_s`: the plan's broadcast
window unless ``RoundConfig.repair_timeout_s`` is set) after the broadcast deadline: the late
pulls its first half (at least ~1 s), the repairs until its end; each over every bucket at once.

Uses the engine's ``state``, ``transport``, ``config``, ``site_id`` and ``log``; ``run`` is the
engine's per-round ``_Run`` (typed ``Any`` here: the engine imports this module, not the reverse).
"""

from __future__ import annotations

import time
from typing import Any

from dtrain.errors import PeerTimeout, PeerUnavailable, RejectCode, StateTransferError, TransportError
from dtrain.protocol import RoundPlan
from dtrain.rounds.fanout import Fanout

__all__ = ["MIN_REPAIR_S", "Recovery", "late_pull_timeout_s", "repair_window_s"]

#: The shortest derived repair window, seconds (a plan whose broadcast and reduce timeouts are
#: set equal by hand would otherwise leave none).
MIN_REPAIR_S = 0.5


def repair_window_s(explicit_s: float | None, plan: RoundPlan) -> float:
    """A round's window for late pulls and repairs after its broadcast deadline, seconds:
    ``explicit_s`` (``RoundConfig.repair_timeout_s``) when set, else the plan's broadcast
    window, its broadcast minus its reduce timeout (both derived by the rendezvous from the
    run's observed exchange and the stall budget: :mod:`dtrain.rendezvous.deadlines`), at
    least :data:`MIN_REPAIR_S`."""
    if explicit_s is not None:
        return explicit_s
    return max(MIN_REPAIR_S, plan.broadcast_timeout_s - plan.reduce_timeout_s)


def late_pull_timeout_s(pass_no: int, window_s: float, left_s: float) -> float:
    """The wait for one late pull's answer in pass ``pass_no`` (0, 1, ...) over a missing
    mean's sources, seconds: an eighth of the late-pull window, doubled with each pass (a
    stalled TCP connection is in retransmission back-off, RFC 6298 5.5: the next source's fresh
    request is often answered first), at least 0.2 s, never past the ``left_s`` that remain.
    The doubling stops at pass 30 (sources that fail at once pass after pass overflowed
    ``2.0 ** pass_no``, and the step failed)."""
    return max(0.0, min(left_s, max(0.2, window_s / 8.0) * 2.0 ** min(pass_no, 30)))


class Recovery:
    """The late-pull and repair steps of :class:`~dtrain.rounds.engine.RoundEngine`.

    Both work on every bucket at once (one :class:`~dtrain.rounds.fanout.Fanout` over the
    buckets): a bucket whose source stalls no longer holds the others' turn. Measured at 30%
    loss (``reliability``): one by one, a stale bucket's 9 s repair left the next one's source
    past the round, and the site's θ differed for the round."""

    def _late_pulls(self, run: Any) -> None:
        """Step 4: for each missing mean, its owner once more (a lost reply), then the members
        that may hold it (the owner slow or gone; a member that closed the round serves it from
        its history), pass after pass with doubling waits (:func:`late_pull_timeout_s`), for the
        first half of the repair window after the broadcast deadline (at least ~1 s)."""
        missing = run.member.missing()
        if not missing:
            return
        window = self._repair_timeout_s(run)
        now = time.monotonic()
        late_until = max(now + min(1.0, window), run.member.broadcast_until + window / 2.0)
        self._each_bucket(
            run, missing, lambda b: self._late_pull(run, b, late_until, late_until - now), "late", late_until
        )

    def _late_pull(self, run: Any, b: int, late_until: float, window_s: float) -> None:
        """One missing mean's passes over its sources until ``late_until``; a source that
        answered that it has no such mean is not asked again."""
        with run.lock:
            sources = run.member.late_pull_sources(b)
            owner = run.owners[b]
        pass_no = 0
        while sources and time.monotonic() < late_until:
            for sid in list(sources):
                left = late_until - time.monotonic()
                if left <= 0:
                    return
                try:
                    m = self.transport.pull_mean(
                        run.plan.address_of(sid),
                        run.round,
                        b,
                        requester=self.site_id,
                        timeout_s=max(0.05, late_pull_timeout_s(pass_no, window_s, left)),
                        # to the owner only: a member holding a copy is not who we repair from
                        have_checksum=self.state.checksum(b) if sid == owner and self.config.repair else "",
                    )
                except PeerUnavailable:
                    sources.remove(sid)
                    if sid == owner:
                        with run.lock:
                            run.member.owner_lost(b)
                    continue
                except TransportError as e:
                    if e.code is RejectCode.ABORTED:  # the owner withdrew the mean
                        with run.lock:
                            run.member.owner_lost(b)
                        return
                    if not isinstance(e, PeerTimeout) and e.code is not RejectCode.DEADLINE_EXCEEDED:
                        sources.remove(sid)  # it answered: it has no such mean
                    continue
                with run.lock:
                    run.member.mean_arrived(b, m)
                    run.res.late_means += 1
                return
            pass_no += 1

    def _each_bucket(self, run: Any, buckets: list[int], step: Any, what: str, until: float) -> None:
        """``step(b)`` for every bucket at once (at most ``num_pull_threads`` threads); each
        step bounds itself by ``until`` (``time.monotonic()`` seconds), so every answer is in
        by then (the fan-out gives a step up only 5 s past it: a transport that overran its
        timeout). A step that raises is a bug, logged, never a hang."""
        fan = Fanout(step, buckets, max(1, self.config.num_pull_threads), f"{what}-{run.round}")
        for b, answer in fan.wait(until, lambda b: False, lambda b, late: None):
            if isinstance(answer, BaseException):
                self.log.error("round %d: %s step of bucket %d failed: %r", run.round, what, b, answer)

    def _repair_timeout_s(self, run: Any) -> float:
        """``RoundConfig.repair_timeout_s`` when set, else the round's own broadcast window, the
        plan's broadcast minus its reduce timeout (derived from the run's observed exchange,
        :mod:`dtrain.rendezvous.deadlines`: a repair pulls a few buckets' state as the broadcast
        pulled every mean), at least :data:`MIN_REPAIR_S`."""
        return repair_window_s(self.config.repair_timeout_s, run.plan)

    def _repair(self, run: Any) -> None:
        """Step 6: pull stale buckets whole from their owner (or a member with the
        owner's checksum), all at once, until the broadcast deadline + the repair window
        (:meth:`_repair_timeout_s`); repaired ones become REPAIRED, and
        a missed mean its owner withdrew becomes OWNER_LOST (``withdrawal_confirmed``).

        A bucket whose mean this site never got is pulled from its owner only, and only
        a state that reflects this round's mean is taken; its ``mean_senders`` (which
        chunks the mean included) settle the residual (``MemberRound.repair_decision``).
        """
        stale = run.member.to_repair()
        if not stale or not self.config.repair:
            return
        # the window counts from the broadcast deadline: the late pulls took their half of it
        deadline = max(run.member.broadcast_until + self._repair_timeout_s(run), time.monotonic() + MIN_REPAIR_S)
        self._each_bucket(run, stale, lambda b: self._repair_bucket(run, b, deadline), "repair", deadline)

    def _repair_bucket(self, run: Any, b: int, deadline: float) -> None:
        """Stale bucket ``b`` from its sources in order until one gives the state wanted."""
        with run.lock:
            sources = run.member.repair_sources(b)
        for src in sources:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._repair_from(run, b, src, left):
                with run.lock:
                    outcome = run.member.outcome(b)
                self.log.info("round %d: bucket %d %s from %s", run.round, b, outcome, src)
                return

    def _repair_from(self, run: Any, b: int, src: str, timeout_s: float) -> bool:
        """Pull bucket ``b`` whole from ``src`` and load it if it is the state wanted."""
        try:
            st = self.transport.pull_state(run.plan.address_of(src), b, requester=self.site_id, timeout_s=timeout_s)
            theta, opt = self.state.decode_bucket_state(st)
        except (TransportError, StateTransferError) as e:
            self.log.warning("round %d: repair of bucket %d from %s failed: %s", run.round, b, src, e)
            return False
        have, kw = self.state.checksum(b), dict(checksum=st.checksum, rounds_applied=st.rounds_applied, extra=st.extra)
        with run.lock:  # the member's books are shared by the buckets' repair threads
            withdrawn = run.member.withdrawal_decision(b, src, have_checksum=have, **kw)  # θ_b as the owner holds it
            ok, why = (True, "") if withdrawn else run.member.repair_decision(b, st.checksum, st.extra)
        if not ok:
            self.log.warning("round %d: repair of bucket %d from %s: %s", run.round, b, src, why)
            return False
        resid = self.state.residuals[b]
        self.state.load_bucket(b, theta, opt, st.rounds_applied)
        self.state.residuals[b] = resid
        with run.lock:
            if withdrawn:
                run.member.withdrawal_confirmed(b, src)
            else:
                run.member.repaired(b, src, checksum=st.checksum, extra=st.extra)
        return True
