"""The member side of one round at one site: what became of each bucket the round
synchronises (docs/ARCHITECTURE.md, "One round": broadcast, late pulls, apply and
verify, repair), the counterpart of the owner side's :class:`~dtrain.rounds.owner.OpenRound`.

:class:`MemberRound` holds every per-bucket fact of one round at one site (whose is
the bucket, whether its mean arrived and why not, whether its owner is
lost, its :class:`~dtrain.rounds.types.BucketOutcome` and why, who repaired it) as a
state machine whose methods are its transitions. A bucket owned elsewhere goes

    AWAITING --mean_arrived--> ARRIVED
    AWAITING --mean_missing--> MISSING --mean_arrived--> ARRIVED   (a late pull)

and then gets its outcome once (step 5, apply and verify):

* :meth:`~MemberRound.no_mean` (MISSING) — OWNER_LOST when its owner is lost
  (:meth:`~MemberRound.member_unreachable`, :meth:`~MemberRound.owner_lost`,
  :meth:`~MemberRound.pull_timed_out`), else STALE (it missed a mean its owner applied);
* :meth:`~MemberRound.empty` (ARRIVED, a mean with no chunks) — EMPTY;
* :meth:`~MemberRound.applied` (ARRIVED) — APPLIED, or STALE when θ_b's checksum
  before or after differs from the owner's;
* :meth:`~MemberRound.stale` (ARRIVED) — STALE for a reason the engine found (its θ_b
  differs before applying and will be repaired, or the mean is undecodable);

and STALE --:meth:`~MemberRound.repaired`--> REPAIRED (step 6), or, for a mean that
never arrived, STALE --:meth:`~MemberRound.withdrawal_confirmed`--> OWNER_LOST when the
owner's state says it withdrew that mean. A bucket this site
owns gets its outcome from :meth:`~MemberRound.published` (the mean its finalizer
published). The decisions are pure and take ``now`` where time matters
(:meth:`~MemberRound.pull_decision`, :meth:`~MemberRound.pull_timed_out`) and the
states pulled for a repair as they came (:meth:`~MemberRound.repair_decision`);
the queries give the round's :class:`~dtrain.rounds.types.RoundResult` its outcomes
and ``broadcast_arrived_fraction``.

Nothing here reads a clock, blocks, sends or logs. It is not thread-safe: the round
engine holds its round lock around the calls made while its pull threads run. An
impossible transition (a second verdict, a repair of a bucket that is not stale, a
mean for a bucket this site owns, ...) raises :class:`InvalidTransition`, naming the
bucket, the transition and the state it found.
"""

from __future__ import annotations

import enum
from typing import Sequence

from dtrain.protocol import BucketMean, RoundPlan
from dtrain.rounds.types import BucketOutcome

__all__ = ["MemberRound", "Phase", "InvalidTransition", "PULL_TIMEOUT_OWNER_LOST_S"]

#: A pull that timed out with at most max(this, 5% of the broadcast timeout) left
#: before the broadcast deadline counts as its owner lost (:meth:`MemberRound.pull_timed_out`).
PULL_TIMEOUT_OWNER_LOST_S = 0.05


class Phase(enum.Enum):
    """Where the mean of a bucket stands at this site before its outcome is given."""

    AWAITING = "awaiting"  # owned elsewhere; no pull has answered yet
    ARRIVED = "arrived"  # its mean arrived (from its owner or a member)
    MISSING = "missing"  # a pull of it failed; a late pull may still get it
    OWN = "own"  # this site owns it: its finalizer publishes the mean

    def __str__(self) -> str:
        return self.value


class InvalidTransition(ValueError):
    """A transition of :class:`MemberRound` that the bucket's state does not allow."""


class _Fate:
    """What became of one bucket at this site in one round (mutable; MemberRound's own)."""

    __slots__ = ("owner", "mean", "missing", "owner_lost", "outcome", "why", "repaired_from", "repaired_senders")

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.mean: BucketMean | None = None
        self.missing: str | None = None  # why its mean did not arrive (None: no pull failed, or it came later)
        self.owner_lost = False  # its owner could not be reached: nobody gets this mean
        self.outcome: BucketOutcome | None = None
        self.why = ""  # why the outcome (STALE, OWNER_LOST); "" otherwise
        self.repaired_from: str | None = None
        self.repaired_senders: list | None = None  # a repaired missed bucket: its state's mean_senders


class MemberRound:
    """Member-side bookkeeping of one round at one site: the fate of each bucket.

    Args:
        plan: the round plan (members in order, ``broadcast_timeout_s`` counting from
            ``opened_at``).
        owners: owner site id per bucket (``assign_owners`` over the active buckets);
            ``""`` for a bucket outside this round (a fragment round). Every other
            entry must be a member.
        site_id: this site (a member); it owns the buckets where ``owners[b] == site_id``.
        num_chunks: per bucket, its number of chunks (``len(BucketLayout.buckets[b].chunks)``).
        opened_at: when the round opened here, seconds on the caller's clock.

    Raises:
        ValueError: ``owners`` and ``num_chunks`` differ in length, ``site_id`` is not a
            member, or an owner is not a member (naming the bucket and the members).
    """

    def __init__(
        self, *, plan: RoundPlan, owners: Sequence[str], site_id: str, num_chunks: Sequence[int], opened_at: float
    ) -> None:
        if len(owners) != len(num_chunks):
            raise ValueError(f"owners has {len(owners)} entries, num_chunks {len(num_chunks)}: one per bucket expected")
        members = plan.site_ids
        if site_id not in members:
            raise ValueError(f"site_id {site_id!r} is not a member of round {plan.round}: {list(members)}")
        for b, o in enumerate(owners):
            if o and o not in members:
                raise ValueError(f"owners[{b}] = {o!r} is not a member of round {plan.round}: {list(members)}")
        self.round = plan.round
        self.members = members
        self.site_id = site_id
        self.owners = tuple(owners)
        self.num_chunks = tuple(num_chunks)
        self.broadcast_timeout_s = plan.broadcast_timeout_s
        self.broadcast_until = opened_at + plan.broadcast_timeout_s
        self.active = tuple(b for b, o in enumerate(owners) if o)
        self.mine = tuple(b for b in self.active if owners[b] == site_id)
        self.remote = tuple(b for b in self.active if owners[b] != site_id)
        self.unreachable: set[str] = set()  # members the data path found gone in this round
        self._fate = {b: _Fate(owners[b]) for b in self.active}

    # ------------------------------------------------------------------ queries
    def phase(self, b: int) -> Phase:
        """Where bucket ``b``'s mean stands (see :class:`Phase`)."""
        f = self._get(b)
        if f.owner == self.site_id:
            return Phase.OWN
        if f.mean is not None:
            return Phase.ARRIVED
        return Phase.AWAITING if f.missing is None else Phase.MISSING

    def owner(self, b: int) -> str:
        return self._get(b).owner

    def mean(self, b: int) -> BucketMean | None:
        """The mean of bucket ``b`` this site has (arrived, or published here), or None."""
        return self._get(b).mean

    def missing(self) -> list[int]:
        """The buckets whose pull failed and whose mean has not arrived since, ascending."""
        return [b for b in self.remote if self.phase(b) is Phase.MISSING]

    def is_owner_lost(self, b: int) -> bool:
        return self._get(b).owner_lost

    def outcome(self, b: int) -> BucketOutcome | None:
        """Bucket ``b``'s outcome (None: not given yet)."""
        return self._get(b).outcome

    def why(self, b: int) -> str:
        """Why bucket ``b`` is STALE or OWNER_LOST ("" for the other outcomes)."""
        return self._get(b).why

    def repaired_from(self, b: int) -> str | None:
        """The site bucket ``b`` was repaired from (None: not repaired)."""
        return self._get(b).repaired_from

    def outcomes(self) -> list[BucketOutcome]:
        """One outcome per active bucket, ascending (``RoundResult.count_outcomes``).

        Raises:
            InvalidTransition: some active bucket has no outcome yet (named).
        """
        pending = [b for b in self.active if self._fate[b].outcome is None]
        if pending:
            raise InvalidTransition(f"round {self.round}: buckets {pending} have no outcome yet")
        return [self._fate[b].outcome for b in self.active]  # type: ignore[misc]

    @property
    def broadcast_arrived_fraction(self) -> float:
        """Of the active buckets, those whose mean this site has or owns (1.0 when none)."""
        if not self.active:
            return 1.0
        arrived = sum(1 for b in self.remote if self._fate[b].mean is not None)
        return (arrived + len(self.mine)) / len(self.active)

    def mean_of(self, b: int) -> tuple[list, BucketMean | None]:
        """Who bucket ``b``'s mean included, per chunk (a list of sender tuples; for a
        repaired missed bucket the repair's ``mean_senders``; ``[]`` when unknown), and the
        mean this site has when it is whole (one entry per chunk; None otherwise)."""
        f = self._get(b)
        if f.mean is None:
            return (f.repaired_senders or []), None
        whole = len(f.mean.chunks) == self.num_chunks[b]
        return [ch.senders for ch in f.mean.chunks], (f.mean if whole else None)

    def differs_before(self, b: int, checksum: str) -> bool:
        """Whether θ_b's checksum here before applying differs from the owner's (ARRIVED only)."""
        return checksum != self._arrived(b, "differs_before")[1].checksum_before

    def late_pull_sources(self, b: int) -> list[str]:
        """Whom to ask for the mean of MISSING bucket ``b``, in order: its owner (unless
        lost: a lost reply), then the other members (who keep this round's means)."""
        self._expect(b, "late_pull_sources", Phase.MISSING)
        owner = self._fate[b].owner
        others = [s for s in self.members if s not in (self.site_id, owner)]
        return others if self._fate[b].owner_lost else [owner] + others

    def to_repair(self) -> list[int]:
        """The STALE buckets owned elsewhere, ascending (a repair pulls them whole)."""
        return [b for b in self.remote if self._fate[b].outcome is BucketOutcome.STALE]

    def repair_sources(self, b: int) -> list[str]:
        """Whom to pull STALE bucket ``b`` from, in order: its owner, then (unless its mean
        never arrived: only the owner has a state that reflects that mean) the other members."""
        f = self._stale(b, "repair_sources")
        if f.mean is None:
            return [f.owner]
        return [f.owner] + [s for s in self.members if s not in (f.owner, self.site_id)]

    # ------------------------------------------------------------------ decisions
    def pull_decision(self, b: int, now: float) -> tuple[float, str]:
        """Whether to pull bucket ``b``'s mean from its owner at time ``now``:
        ``(timeout_s, "")`` to wait at most ``timeout_s`` for its answer, or ``(0.0, why)``
        not to (its owner is unreachable in this round, or the broadcast deadline passed)."""
        f = self._expect(b, "pull_decision", Phase.AWAITING)
        if f.owner in self.unreachable:
            return 0.0, f"owner {f.owner} unreachable in this round"
        left = self.broadcast_until - now
        if left <= 0:
            return 0.0, "broadcast deadline passed"
        return left, ""

    def repair_decision(self, b: int, checksum: str, extra: dict) -> tuple[bool, str]:
        """Whether a state of STALE bucket ``b`` pulled for its repair (θ_b's ``checksum``,
        the state's ``extra``) is the one wanted: ``(True, "")``, or ``(False, why)``.

        With the owner's mean here, the state must have the checksum after it. Without
        (the mean never arrived), it must reflect this round's mean: ``extra`` has
        ``mean_round`` = this round and ``mean_senders``, a list of lists, one per chunk
        (or none: an empty mean), so that the residual is settled by what that mean included.
        """
        f = self._stale(b, "repair_decision")
        if f.mean is not None:
            if checksum != f.mean.checksum_after:
                return False, f"its checksum {checksum} is not the owner's after the mean ({f.mean.checksum_after})"
            return True, ""
        ms = extra.get("mean_senders")
        if (
            extra.get("mean_round") != self.round
            or not isinstance(ms, list)
            or len(ms) not in (0, self.num_chunks[b])
            or not all(isinstance(x, list) for x in ms)
        ):
            return False, "its state does not reflect this round's mean"
        return True, ""

    # ------------------------------------------------------------------ transitions: pulls
    def mean_arrived(self, b: int, mean: BucketMean) -> None:
        """AWAITING or MISSING -> ARRIVED: bucket ``b``'s mean arrived (from its owner or,
        in a late pull, a member); its owner is no longer lost for it."""
        f = self._expect(b, "mean_arrived", Phase.AWAITING, Phase.MISSING)
        f.mean, f.missing, f.owner_lost = mean, None, False

    def mean_missing(self, b: int, why: str) -> None:
        """AWAITING -> MISSING: the pull of bucket ``b``'s mean by the broadcast deadline failed (``why``)."""
        f = self._expect(b, "mean_missing", Phase.AWAITING)
        f.missing = why

    def member_unreachable(self, site_id: str) -> bool:
        """The data path found member ``site_id`` gone in this round: its buckets whose
        mean has not arrived are owner-lost (no pull waits for them). Returns False when it
        was already (nothing changed).

        Raises:
            ValueError: ``site_id`` is this site or not a member.
        """
        if site_id == self.site_id or site_id not in self.members:
            raise ValueError(f"site_id {site_id!r} must be another member of round {self.round}: {list(self.members)}")
        if site_id in self.unreachable:
            return False
        self.unreachable.add(site_id)
        for b in self.remote:
            f = self._fate[b]
            if f.owner == site_id and f.mean is None and f.outcome is None:
                f.owner_lost = True
        return True

    def owner_lost(self, b: int) -> None:
        """AWAITING or MISSING: bucket ``b``'s owner could not be reached for its mean (it
        refused a late pull): nobody gets this mean."""
        self._expect(b, "owner_lost", Phase.AWAITING, Phase.MISSING).owner_lost = True

    def pull_timed_out(self, b: int, now: float, *, owner_heard: bool = False) -> bool:
        """AWAITING: the owner did not answer the pull of bucket ``b`` by ``now``.

        Near the broadcast deadline (at most max(:data:`PULL_TIMEOUT_OWNER_LOST_S`, 5% of
        the broadcast timeout) left) and with no sign of the owner in this round's broadcast,
        the owner is stopped, hung or far behind: owner-lost, so that no late pull or repair
        waits on it and the round ends at its deadline. ``owner_heard``: the owner asked this
        site for a mean of this round (``MeanPulls.heard_from``): it is alive behind a slow or
        lossy link and may have applied the mean (a member took it, and this reply was lost),
        so the bucket is retried and repaired from it instead: its state says whether it kept
        the mean (REPAIRED) or withdrew it (:meth:`withdrawal_confirmed`). Earlier than near
        the deadline it is a lost reply (retried and repaired). The price of an owner stopped
        after it asked: ``repair_timeout_s`` once. Returns whether the owner is now lost for
        ``b``."""
        f = self._expect(b, "pull_timed_out", Phase.AWAITING)
        near = self.broadcast_until - now <= max(PULL_TIMEOUT_OWNER_LOST_S, 0.05 * self.broadcast_timeout_s)
        if near and not owner_heard:
            f.owner_lost = True
        return f.owner_lost

    # ------------------------------------------------------------------ transitions: outcomes
    def published(self, b: int, mean: BucketMean | None) -> BucketOutcome:
        """OWN -> APPLIED (the finalizer published ``mean`` and applied it here), EMPTY (a
        mean with no chunks: applied nowhere) or STALE (``mean`` None: not published in time)."""
        f = self._expect(b, "published", Phase.OWN)
        f.mean = mean
        if mean is None:
            return self._give(f, BucketOutcome.STALE, "its finalizer did not publish its mean")
        return self._give(f, BucketOutcome.APPLIED if mean.chunks else BucketOutcome.EMPTY)

    def withdrawn(self, b: int, why: str) -> BucketOutcome:
        """OWN -> OWNER_LOST: this site withdrew its own mean of ``b`` (no member took it:
        the commit rule, ``MeanPulls.settle``); θ_b is rolled back, as every member keeps it."""
        f = self._expect(b, "withdrawn", Phase.OWN)
        return self._give(f, BucketOutcome.OWNER_LOST, f"mean withdrawn: {why}")

    def no_mean(self, b: int) -> BucketOutcome:
        """MISSING -> OWNER_LOST (its owner is lost: every survivor keeps θ_b alike) or
        STALE (the owner may have applied the mean this site missed: repaired from it)."""
        f = self._expect(b, "no_mean", Phase.MISSING)
        if f.owner_lost:
            return self._give(f, BucketOutcome.OWNER_LOST, f"no mean from {f.owner}: {f.missing}")
        return self._give(f, BucketOutcome.STALE, f"its mean never arrived from {f.owner}: {f.missing}")

    def empty(self, b: int) -> BucketOutcome:
        """ARRIVED -> EMPTY: the mean has no chunks (some chunk got no contribution)."""
        f, m = self._arrived(b, "empty")
        if m.chunks:
            raise InvalidTransition(f"empty: bucket {b} of round {self.round}: its mean has chunks")
        return self._give(f, BucketOutcome.EMPTY)

    def applied(self, b: int, *, before: str, after: str) -> BucketOutcome:
        """ARRIVED -> APPLIED, or STALE when θ_b's checksum here ``before`` applying or
        ``after`` differs from the owner's (the mean was applied on top of a stale θ_b:
        keep-stale, or θ_b differs after)."""
        f, m = self._arrived(b, "applied")
        if not m.chunks:
            raise InvalidTransition(f"applied: bucket {b} of round {self.round}: its mean has no chunks (empty)")
        if before != m.checksum_before:
            return self._give(f, BucketOutcome.STALE, f"differs from owner {f.owner} before applying (kept stale)")
        if after != m.checksum_after:
            return self._give(f, BucketOutcome.STALE, f"checksum after apply differs from owner {f.owner}")
        return self._give(f, BucketOutcome.APPLIED)

    def stale(self, b: int, why: str) -> BucketOutcome:
        """ARRIVED -> STALE because ``why`` (θ_b differs from the owner's before applying and
        is repaired instead, or the mean is undecodable)."""
        return self._give(self._arrived(b, "stale")[0], BucketOutcome.STALE, why)

    def repaired(self, b: int, src: str, *, checksum: str, extra: dict) -> BucketOutcome:
        """STALE -> REPAIRED: bucket ``b`` was pulled whole from ``src`` and loaded; the
        state (its ``checksum`` and ``extra``) must be one :meth:`repair_decision` accepts.
        A bucket whose mean never arrived keeps the state's ``mean_senders`` (:meth:`mean_of`).

        Raises:
            InvalidTransition: the bucket is not STALE, ``src`` is not another member, or
                the state is not the one wanted.
        """
        f = self._stale(b, "repaired")
        if src == self.site_id or src not in self.members:
            raise InvalidTransition(f"repaired: bucket {b} from {src!r}: not another member of round {self.round}")
        ok, why = self.repair_decision(b, checksum, extra)
        if not ok:
            raise InvalidTransition(f"repaired: bucket {b} from {src}: {why}")
        if f.mean is None:
            f.repaired_senders = list(extra["mean_senders"])
        f.repaired_from = src
        return self._give(f, BucketOutcome.REPAIRED)

    def withdrawal_decision(
        self, b: int, src: str, *, checksum: str, have_checksum: str, rounds_applied: int, extra: dict
    ) -> bool:
        """Whether a state pulled from ``src`` for the repair of STALE bucket ``b``, whose mean
        never arrived here, says its owner holds θ_b as this site does: it withdrew the mean
        (``extra["withdrawn_round"]`` is this round) or never applied one (its state is of this
        round, carries no ``mean_round``, and its ``checksum`` is this site's ``have_checksum``).
        Then :meth:`withdrawal_confirmed`, not a repair."""
        f = self._get(b)
        if src != f.owner or f.mean is not None or f.outcome is not BucketOutcome.STALE:
            return False
        if extra.get("withdrawn_round") == self.round:
            return True
        return rounds_applied == self.round + 1 and checksum == have_checksum and "mean_round" not in extra

    def withdrawal_confirmed(self, b: int, src: str) -> BucketOutcome:
        """STALE (its mean never arrived here) -> OWNER_LOST: its owner ``src`` answered the
        repair with a state whose ``withdrawn_round`` is this round: it withdrew the mean (the
        commit rule: nobody took it), so this site keeps θ_b as the owner does (the engine
        loads the owner's θ_b) and the residual is kept whole, as for any owner-lost bucket.

        Raises:
            InvalidTransition: the bucket is not STALE, its mean arrived here (a mean that
                arrived was taken: the owner cannot have withdrawn it), or ``src`` is not its owner.
        """
        f = self._stale(b, "withdrawal_confirmed")
        if f.mean is not None or src != f.owner:
            raise InvalidTransition(
                f"withdrawal_confirmed: bucket {b} of round {self.round} from {src}: only its owner {f.owner}"
                " can withdraw a mean, and only one that never arrived here"
            )
        f.owner_lost = True
        return self._give(f, BucketOutcome.OWNER_LOST, f"{src} withdrew its mean (nobody took it): {f.why}")

    # ------------------------------------------------------------------ internals
    def _get(self, b: int) -> _Fate:
        f = self._fate.get(b)
        if f is None:
            raise ValueError(
                f"bucket {b!r} is not synchronised by round {self.round}: active buckets {list(self.active)}"
            )
        return f

    def _expect(self, b: int, transition: str, *phases: Phase) -> _Fate:
        f = self._get(b)
        if f.outcome is not None:
            raise InvalidTransition(
                f"{transition}: bucket {b} of round {self.round} already has its outcome {f.outcome}"
            )
        p = self.phase(b)
        if p not in phases:
            raise InvalidTransition(
                f"{transition}: bucket {b} of round {self.round} is {p}, expected {' or '.join(map(str, phases))}"
            )
        return f

    def _arrived(self, b: int, transition: str) -> tuple[_Fate, BucketMean]:
        f = self._expect(b, transition, Phase.ARRIVED)
        assert f.mean is not None  # ARRIVED
        return f, f.mean

    def _stale(self, b: int, transition: str) -> _Fate:
        f = self._get(b)
        if f.owner == self.site_id or f.outcome is not BucketOutcome.STALE:
            raise InvalidTransition(
                f"{transition}: bucket {b} of round {self.round} is not a stale bucket owned elsewhere"
                f" (owner {f.owner}, outcome {f.outcome})"
            )
        return f

    @staticmethod
    def _give(f: _Fate, outcome: BucketOutcome, why: str = "") -> BucketOutcome:
        f.outcome, f.why = outcome, why
        return outcome
