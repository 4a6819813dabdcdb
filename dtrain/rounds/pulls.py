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
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, TypeVar

__all__ = ["MeanPulls", "PullWait"]

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


class MeanPulls:
    """Per round: the (member, bucket) pairs still to pull this site's means. Thread-safe."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._missing: dict[int, set[tuple[str, int]]] = {}
        self._until: dict[int, float] = {}
        self._served: dict[int, set[tuple[str, int]]] = {}
        self._needs_state: dict[int, set[tuple[str, int]]] = {}  # round -> pulls waiting for a state pull

    def expect(self, round: int, *, buckets: Iterable[int], pullers: Iterable[str], until: float) -> None:
        """Round ``round``: each of ``pullers`` should pull the mean of each of ``buckets``
        (the buckets this site owns) by ``until`` (``time.monotonic()`` seconds, the
        round's broadcast deadline here). Pulls already served count."""
        with self._cv:
            want = {(m, b) for m in pullers for b in buckets}
            self._missing[round] = want - self._served.get(round, set())
            self._until[round] = until
            for old in sorted(self._missing)[:-_KEEP_ROUNDS]:
                self._missing.pop(old, None)
                self._until.pop(old, None)
            for old in [r for r in self._served if r < round - _KEEP_ROUNDS]:
                del self._served[old]
            for old in [r for r in self._needs_state if r < round - _KEEP_ROUNDS]:
                del self._needs_state[old]
            self._cv.notify_all()

    def record(self, round: int, bucket: int, requester: str, mean: T, *, needs_state: bool = False) -> T:
        """Note that ``requester`` got the mean of ``bucket`` of ``round``; returns ``mean``.

        ``needs_state``: the requester's θ_b was stale, so it will pull the bucket's state
        next; the pull counts only once :meth:`record_state` sees that."""
        with self._cv:
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

    def record_state(self, bucket: int, requester: str) -> None:
        """``requester`` pulled the whole state of ``bucket``: its stale pulls of that bucket count."""
        with self._cv:
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

    def latest_round(self) -> int:
        """The latest round with expected pulls (-1 when none)."""
        with self._cv:
            return max(self._missing, default=-1)

    def time_left_s(self, now: float) -> float:
        """Seconds from ``now`` to the latest round's broadcast deadline (0: none, or passed):
        how long a pull already served may still be streaming its reply to the member."""
        with self._cv:
            r = max(self._until, default=None)
            return max(0.0, self._until[r] - now) if r is not None else 0.0

    def wait_pulled(self, *, timeout_s: float | None = None) -> PullWait:
        """Wait until every expected pull of the latest round was served.

        Args:
            timeout_s: longest wait in seconds; None waits until that round's
                broadcast deadline (after it no member pulls any more).
        Returns:
            a :class:`PullWait`; ``missing`` names who did not pull what.
        """
        t0 = time.monotonic()
        with self._cv:
            r = max(self._missing, default=-1)
            if r < 0:
                return PullWait(round=-1, reason="nothing to wait for")
            end = self._until[r] if timeout_s is None else t0 + max(0.0, timeout_s)
            while self._missing.get(r) and time.monotonic() < end:
                self._cv.wait(end - time.monotonic())
            missing: dict[str, list[int]] = {}
            for m, b in sorted(self._missing.get(r, ())):
                missing.setdefault(m, []).append(b)
        return PullWait(
            round=r, missing=missing, waited_s=time.monotonic() - t0, reason="deadline" if missing else "all pulled"
        )
