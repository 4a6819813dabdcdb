"""Which members pulled which of an owner's means: what ``DiLoCo.close()`` waits for.

An owner that stops serving right after its last round leaves the slower members
without its means: they get UNAVAILABLE, skip those buckets, and their θ ends up
different from everyone else's. The round engine therefore tells a
:class:`MeanPulls` ledger, per round, which buckets this site owns and which
members should pull them (:meth:`MeanPulls.expect`), and records every mean it
serves (:meth:`MeanPulls.record`; on a transport whose members acknowledge the means
they got, ``Transport.acknowledges_means``, each acknowledgement instead); a closing site waits on
:meth:`MeanPulls.wait_pulled` until nothing is missing or a deadline passes.
Members the rendezvous declares dead are no longer waited for
(:meth:`MeanPulls.forget`).

A member whose θ_b differed from the mean's ``checksum_before`` when it pulled (it
says so with the pull's ``have_checksum``) will repair the bucket whole from this
owner right after: its pull is recorded with ``needs_state=True`` and counts only
once this site served it the bucket's state (:meth:`MeanPulls.record_state`).
Without that, an owner could exit between the two pulls of its last round, and
the member's repair would be refused (θ unequal at the end of a run).

The same ledger decides whether an owner keeps the mean it applied (the commit rule,
docs/DECISIONS.md "An owner commits a mean only once it left"): the owner applies its
mean when it publishes it, and keeps it once the mean left this site (a pull served, a
member's acknowledgement, a state pull of the bucket) or every other member is gone; a
mean no member took by the broadcast deadline is withdrawn (:meth:`MeanPulls.settle`), the owner
rolls θ_b back, and every later pull of it is refused (ABORTED). Members that could not
get it treat the bucket as owner-lost, so every site keeps θ_b alike in the same round
(an owner cut off during the reduce, or one stopped while the others finished, no longer
applies a mean alone).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, TypeVar

from dtrain.errors import RejectCode, Rejected

__all__ = ["MeanPulls", "PullWait", "commit_decision"]

T = TypeVar("T")

_KEEP_ROUNDS = 2  # the ledger keeps the latest rounds only (a site serves the current one)
_MAX_SERVED_PER_ROUND = 1 << 16  # requester names come from the wire: bound what is kept


@dataclass(frozen=True, kw_only=True)
class PullWait:
    """What :meth:`MeanPulls.wait_pulled` found.

    Attributes:
        round: the round waited on (-1: no round was expected, nothing to wait for).
        missing: per member, the owned buckets whose mean it did not pull (empty: all pulled).
        waited_s: seconds spent waiting.
        reason: ``"all pulled"``, ``"deadline"`` or ``"nothing to wait for"``.
    """

    round: int
    missing: dict[str, list[int]] = field(default_factory=dict)
    waited_s: float = 0.0
    reason: str = ""


def commit_decision(*, taken: bool, pullers_left: int, now: float, until: float) -> tuple[bool | None, str]:
    """Whether an owner keeps (True), withdraws (False) or still waits (None) on a mean it
    applied, with the reason.

    Args:
        taken: the mean left this site (a pull was served, or a member acknowledged it).
        pullers_left: members still expected to take it (not lost, not yet served). A
            member is no longer expected once it is lost on evidence of its death (the
            rendezvous declared it dead, it refused a connection, its push stream broke:
            ``PeerSide.members_lost``); such a member resyncs if it comes back, so the mean
            is kept. A member cut off by a partition only times out: it stays expected,
            and the mean is withdrawn at the deadline, as that member treats it.
        now, until: ``time.monotonic()`` seconds; ``until`` is the round's broadcast deadline.
    """
    if taken:
        return True, "a member took the mean"
    if pullers_left <= 0:  # each was lost on evidence (declared dead, refused, stream broken): it resyncs
        return True, "every other member is gone (it resyncs from the survivors)"
    if now >= until:
        return False, f"no member took the mean by the broadcast deadline ({pullers_left} expected)"
    return None, f"waiting {until - now:.2f}s more for a member to take the mean"


class MeanPulls:
    """Per round: the (member, bucket) pairs still to pull this site's means, and which
    of this site's means left it (the commit rule, :meth:`settle`). Thread-safe."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._missing: dict[int, set[tuple[str, int]]] = {}
        self._until: dict[int, float] = {}
        self._serve_until: dict[int, float] = {}  # round -> end of its members' late pulls and repairs
        self._served: dict[int, set[tuple[str, int]]] = {}
        self._needs_state: dict[int, set[tuple[str, int]]] = {}  # round -> pulls waiting for a state pull
        self._taken: dict[int, set[int]] = {}  # round -> buckets whose mean left this site
        self._withdrawn: dict[int, set[int]] = {}  # round -> buckets whose mean this owner withdrew
        self._heard: dict[int, set[str]] = {}  # round -> sites that asked this site for a mean of it

    def expect(
        self,
        round: int,
        *,
        buckets: Iterable[int],
        pullers: Iterable[str],
        until: float,
        serve_until: float | None = None,
    ) -> None:
        """Round ``round``: each of ``pullers`` should pull the mean of each of ``buckets``
        (the buckets this site owns) by ``until`` (``time.monotonic()`` seconds, the
        round's broadcast deadline here: the commit rule's). Pulls already served count.
        ``serve_until`` (default ``until``): when the members' late pulls and repairs of the
        round end (the broadcast deadline + the repair window): how long a closing site
        keeps serving a member that has not pulled (:meth:`wait_pulled`)."""
        with self._cv:
            want = {(m, b) for m in pullers for b in buckets}
            self._missing[round] = want - self._served.get(round, set())
            self._until[round] = until
            self._serve_until[round] = max(until, until if serve_until is None else serve_until)
            for old in sorted(self._missing)[:-_KEEP_ROUNDS]:
                self._missing.pop(old, None)
                self._until.pop(old, None)
                self._serve_until.pop(old, None)
            for old in [r for r in self._served if r < round - _KEEP_ROUNDS]:
                del self._served[old]
            for old in [r for r in self._needs_state if r < round - _KEEP_ROUNDS]:
                del self._needs_state[old]
            for book in (self._taken, self._withdrawn, self._heard):
                for old in [r for r in book if r < round - _KEEP_ROUNDS]:
                    del book[old]
            self._cv.notify_all()

    def heard(self, round: int, requester: str) -> None:
        """``requester`` asked this site for a mean of ``round`` (answered or not): it was
        alive in that round's broadcast (:meth:`heard_from`)."""
        with self._cv:
            seen = self._heard.setdefault(round, set())
            if len(seen) < _MAX_SERVED_PER_ROUND:
                seen.add(requester)

    def heard_from(self, round: int) -> frozenset[str]:
        """The sites that asked this site for a mean of ``round`` so far. A member whose pull
        from an owner timed out at the broadcast deadline asks this: an owner heard from in the
        broadcast is alive behind a slow or lossy link, and may have applied the mean whose reply
        was lost, so the bucket is repaired from it rather than taken as owner-lost
        (``MemberRound.pull_timed_out``). The requester is the pull's own claim: a forged one
        costs the repair budget, never a wrong θ (the repair checks the owner's state)."""
        with self._cv:
            return frozenset(self._heard.get(round, ()))

    def withdrew(self, round: int, bucket: int) -> bool:
        """Whether this owner withdrew its mean of ``bucket`` in ``round`` (:meth:`settle`)."""
        with self._cv:
            return bucket in self._withdrawn.get(round, ())

    def record(self, round: int, bucket: int, requester: str, mean: T, *, needs_state: bool = False) -> T:
        """Note that ``requester`` got the mean of ``bucket`` of ``round``; returns ``mean``.

        ``needs_state``: the requester's θ_b was stale, so it will pull the bucket's state
        next; the pull counts only once :meth:`record_state` sees that.

        Raises:
            Rejected: ABORTED when this owner withdrew that mean (:meth:`settle`); the
                requester then treats the bucket as owner-lost, so it is not waited for.
        """
        with self._cv:
            try:
                self._take(round, bucket)
            except Rejected:
                self._missing.get(round, set()).discard((requester, bucket))
                self._cv.notify_all()
                raise
            if needs_state:
                waiting = self._needs_state.setdefault(round, set())
                if len(waiting) < _MAX_SERVED_PER_ROUND:
                    waiting.add((requester, bucket))
                return mean
            served = self._served.setdefault(round, set())
            if len(served) < _MAX_SERVED_PER_ROUND:
                served.add((requester, bucket))
            missing = self._missing.get(round)
            if missing is not None:
                missing.discard((requester, bucket))
                if not missing:
                    self._cv.notify_all()
        return mean

    def take(self, round: int, bucket: int) -> None:
        """This site's mean of ``bucket`` in ``round`` leaves it now (a pull is answered
        with it, before the answer is known to arrive): the commit rule keeps it.

        Raises:
            Rejected: ABORTED when this owner already withdrew it (:meth:`settle`).
        """
        with self._cv:
            self._take(round, bucket)

    def _take(self, round: int, bucket: int) -> None:
        if bucket in self._withdrawn.get(round, ()):
            raise Rejected(
                RejectCode.ABORTED,
                f"round {round} bucket {bucket}: the owner withdrew its mean (no member took it in time)",
            )
        self._taken.setdefault(round, set()).add(bucket)
        self._cv.notify_all()

    def record_state(self, bucket: int, requester: str) -> None:
        """``requester`` pulled the whole state of ``bucket``: its stale pulls of that bucket
        count, and a mean of it this site applied and has not withdrawn counts as taken (the
        state reflects it). The caller holds the bucket's state lock while reading the state
        and calling this, so a withdrawal (:meth:`settle`) falls wholly before or after it."""
        with self._cv:
            for r in self._missing:
                if bucket not in self._withdrawn.get(r, ()):
                    self._taken.setdefault(r, set()).add(bucket)
            for r, waiting in self._needs_state.items():
                if (requester, bucket) in waiting:
                    waiting.discard((requester, bucket))
                    self._served.setdefault(r, set()).add((requester, bucket))
                    missing = self._missing.get(r)
                    if missing is not None:
                        missing.discard((requester, bucket))
            self._cv.notify_all()

    def forget(self, site_ids: Iterable[str]) -> None:
        """Stop waiting for ``site_ids`` (declared dead or gone) in every round."""
        gone = set(site_ids)
        with self._cv:
            for r, missing in self._missing.items():
                self._missing[r] = {(m, b) for m, b in missing if m not in gone}
            self._cv.notify_all()

    def _decision(self, round: int, bucket: int, until: float) -> tuple[bool | None, str]:
        left = sum(1 for _m, b in self._missing.get(round, ()) if b == bucket)
        taken = bucket in self._taken.get(round, ())
        return commit_decision(taken=taken, pullers_left=left, now=time.monotonic(), until=until)

    def wait_settled(self, round: int, bucket: int, *, until: float) -> None:
        """Block until :meth:`settle` of ``bucket`` in ``round`` would decide: a member took
        the mean, ``until`` (``time.monotonic()`` seconds) passed, or no member is left."""
        with self._cv:
            while self._decision(round, bucket, until)[0] is None:
                self._cv.wait(max(0.0, until - time.monotonic()))

    def settle(self, round: int, bucket: int, *, until: float) -> tuple[bool, str]:
        """The commit rule for this site's own mean of ``bucket`` in ``round`` (which it
        applied), decided now by :func:`commit_decision`: keep it (True) once a member took
        it; withdraw it (False) when ``until`` (the broadcast deadline) passed or no expected
        member is left: every later :meth:`record` of it raises ABORTED, and
        :meth:`record_state` no longer counts as taking it. Before ``until`` with members
        still expected it keeps waiting (:meth:`wait_settled`) first. The caller holds the
        bucket's state lock around this and its roll-back, which :meth:`record_state`'s
        caller holds around reading the state. Returns ``(keep, reason)``."""
        self.wait_settled(round, bucket, until=until)
        with self._cv:
            keep, why = self._decision(round, bucket, until)
            if keep is None:  # cannot happen after wait_settled unless the clock stepped back
                keep, why = False, f"undecided at the deadline: {why}"
            if not keep:
                self._withdrawn.setdefault(round, set()).add(bucket)
            return keep, why

    def latest_round(self) -> int:
        """The latest round with expected pulls (-1 when none)."""
        with self._cv:
            return max(self._missing, default=-1)

    def time_left_s(self, now: float) -> float:
        """Seconds from ``now`` to the end of the latest round's late pulls and repairs
        (``serve_until`` of :meth:`expect`; 0: none, or passed): how long a pull already
        served may still be streaming its reply to the member."""
        with self._cv:
            r = max(self._serve_until, default=None)
            return max(0.0, self._serve_until[r] - now) if r is not None else 0.0

    def wait_pulled(self, *, timeout_s: float | None = None) -> PullWait:
        """Wait until every expected pull of the latest round was served.

        Args:
            timeout_s: longest wait in seconds; None waits until the end of that round's
                late pulls and repairs (``serve_until`` of :meth:`expect`: the broadcast
                deadline + the repair window; after it no member pulls any more). Until the
                broadcast deadline alone, a run's last round left a member behind at 10%
                loss: its late pulls came after the owner had left.
        Returns:
            a :class:`PullWait`; ``missing`` names who did not pull what.
        """
        t0 = time.monotonic()
        with self._cv:
            r = max(self._missing, default=-1)
            if r < 0:
                return PullWait(round=-1, reason="nothing to wait for")
            end = self._serve_until[r] if timeout_s is None else t0 + max(0.0, timeout_s)
            while self._missing.get(r) and time.monotonic() < end:
                self._cv.wait(end - time.monotonic())
            missing: dict[str, list[int]] = {}
            for m, b in sorted(self._missing.get(r, ())):
                missing.setdefault(m, []).append(b)
        return PullWait(
            round=r, missing=missing, waited_s=time.monotonic() - t0, reason="deadline" if missing else "all pulled"
        )
