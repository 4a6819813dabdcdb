"""Steps 4 and 6 of a round at a member (a mixin of :class:`~dtrain.rounds.engine.RoundEngine`):
the late pulls of means that did not arrive by the broadcast deadline, and the repair of
stale buckets, pulled whole from their owner or a member with the owner's checksum.

Both run within the round's repair window (:func:`repair_window_s`): the plan's broadcast
window unless ``RoundConfig.repair_timeout_s`` is set.

Uses the engine's ``state``, ``transport``, ``config``, ``site_id`` and ``log``; ``run`` is the
engine's per-round ``_Run`` (typed ``Any`` here: the engine imports this module, not the reverse).
"""

from __future__ import annotations

import time
from typing import Any

from dtrain.errors import PeerUnavailable, RejectCode, StateTransferError, TransportError
from dtrain.protocol import RoundPlan

__all__ = ["MIN_REPAIR_S", "Recovery", "repair_window_s"]

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


class Recovery:
    """The late-pull and repair steps of :class:`~dtrain.rounds.engine.RoundEngine`."""

    def _late_pulls(self, run: Any) -> None:
        """Step 4: for each missing mean, the owner once more (a lost reply), then
        members that may hold it (owner slow or gone), within ~1 s."""
        missing = run.member.missing()
        if not missing:
            return
        late_until = time.monotonic() + min(1.0, self._repair_timeout_s(run))
        for b in missing:
            owner = run.owners[b]
            for sid in run.member.late_pull_sources(b):
                if time.monotonic() > late_until:
                    break
                try:
                    m = self.transport.pull_mean(
                        run.plan.address_of(sid),
                        run.round,
                        b,
                        requester=self.site_id,
                        timeout_s=max(0.05, late_until - time.monotonic()),
                        # to the owner only: a member holding a copy is not who we repair from
                        have_checksum=self.state.checksum(b) if sid == owner and self.config.repair else "",
                    )
                except PeerUnavailable:
                    if sid == owner:
                        run.member.owner_lost(b)
                    continue
                except TransportError as e:
                    if e.code is RejectCode.ABORTED:  # the owner withdrew the mean
                        run.member.owner_lost(b)
                        break
                    continue
                run.member.mean_arrived(b, m)
                break

    def _repair_timeout_s(self, run: Any) -> float:
        """``RoundConfig.repair_timeout_s`` when set, else the round's own broadcast window, the
        plan's broadcast minus its reduce timeout (derived from the run's observed exchange,
        :mod:`dtrain.rendezvous.deadlines`: a repair pulls a few buckets' state as the broadcast
        pulled every mean), at least :data:`MIN_REPAIR_S`."""
        return repair_window_s(self.config.repair_timeout_s, run.plan)

    def _repair(self, run: Any) -> None:
        """Step 6: pull stale buckets whole from their owner (or a member with the
        owner's checksum), within the repair window (:meth:`_repair_timeout_s`); repaired ones become REPAIRED, and
        a missed mean its owner withdrew becomes OWNER_LOST (``withdrawal_confirmed``).

        A bucket whose mean this site never got is pulled from its owner only, and only
        a state that reflects this round's mean is taken; its ``mean_senders`` (which
        chunks the mean included) settle the residual (``MemberRound.repair_decision``).
        """
        stale = run.member.to_repair()
        if not stale or not self.config.repair:
            return
        deadline = time.monotonic() + self._repair_timeout_s(run)
        for b in stale:
            for src in run.member.repair_sources(b):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if self._repair_from(run, b, src, left):
                    self.log.info("round %d: bucket %d %s from %s", run.round, b, run.member.outcome(b), src)
                    break

    def _repair_from(self, run: Any, b: int, src: str, timeout_s: float) -> bool:
        """Pull bucket ``b`` whole from ``src`` and load it if it is the state wanted."""
        try:
            st = self.transport.pull_state(run.plan.address_of(src), b, requester=self.site_id, timeout_s=timeout_s)
            theta, opt = self.state.decode_bucket_state(st)
        except (TransportError, StateTransferError) as e:
            self.log.warning("round %d: repair of bucket %d from %s failed: %s", run.round, b, src, e)
            return False
        have, kw = self.state.checksum(b), dict(checksum=st.checksum, rounds_applied=st.rounds_applied, extra=st.extra)
        withdrawn = run.member.withdrawal_decision(b, src, have_checksum=have, **kw)  # θ_b as the owner holds it
        if not withdrawn:
            ok, why = run.member.repair_decision(b, st.checksum, st.extra)
            if not ok:
                self.log.warning("round %d: repair of bucket %d from %s: %s", run.round, b, src, why)
                return False
        resid = self.state.residuals[b]
        self.state.load_bucket(b, theta, opt, st.rounds_applied)
        self.state.residuals[b] = resid
        if withdrawn:
            run.member.withdrawal_confirmed(b, src)
        else:
            run.member.repaired(b, src, checksum=st.checksum, extra=st.extra)
        return True
