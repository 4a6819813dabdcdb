"""The owner side of one open round: which contributions were accepted, which buckets
are due to be finalized, and the partial means (docs/ARCHITECTURE.md, "One round", step 3: reduce, finalize).

:class:`OpenRound` is the bookkeeping of one round at one site, for the buckets this
site owns, as a state machine whose methods are its transitions (in the manner of
hivemind's ``TensorPartReducer``: ``accumulate_part`` / ``on_sender_failed`` /
``finalize``):

* :meth:`~OpenRound.accept` — count one validated contribution to one chunk;
  :meth:`~OpenRound.accept_run` — the same for a sender's run of neighbouring chunks;
* :meth:`~OpenRound.reject` — count one refused contribution (by code);
* :meth:`~OpenRound.members_lost` — stop awaiting members the rendezvous holds dead;
* :meth:`~OpenRound.due` — the buckets to finalize at time ``now``, with a reason: a
  bucket that awaits nothing more at once, every remaining one at the reduce deadline;
* :meth:`~OpenRound.close` — accept nothing more for those buckets;
* :meth:`~OpenRound.finalize` — the unbiased partial mean of each chunk of a closed
  bucket, summed in sender-id order (:class:`~dtrain.aggregation.BucketAccumulator`).

Time is passed in (``now``, on the clock of ``opened_at``), never read here; nothing
here blocks, sends or logs. It is not thread-safe: the round engine holds its lock
around every call, except :meth:`~OpenRound.finalize` of a closed bucket, which
touches only that bucket's accumulators (no other transition does once it is closed).
"""

from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from dtrain.aggregation import AggregationConfig, BucketAccumulator, BucketReduction, ChunkReduction, claim_decision
from dtrain.codecs.base import CheckedRun
from dtrain.errors import RejectCode, Rejected
from dtrain.protocol import Contribution, ContributionRun, RoundPlan
from dtrain.rounds.types import MAX_REFUSALS_NAMED, RejectionTally

__all__ = [
    "OpenRound",
    "Closing",
    "BucketReduction",
    "ChunkReduction",
    "SENDER_FAULTS",
    "CLOSE_COMPLETE",
    "CLOSE_DEADLINE",
]

#: Rejections that say the sender sent something wrong (they count towards excluding
#: it); late, stale-round or not-a-member rejections are about timing or membership.
SENDER_FAULTS = frozenset({RejectCode.INVALID_ARGUMENT, RejectCode.RESOURCE_EXHAUSTED, RejectCode.ALREADY_EXISTS})

#: :attr:`Closing.reason` of buckets that await nothing more.
CLOSE_COMPLETE = "complete: every awaited contribution arrived"
#: :attr:`Closing.reason` of the buckets still open at the reduce deadline.
CLOSE_DEADLINE = "reduce deadline passed"


@dataclass(frozen=True)
class Closing:
    """A decision of :meth:`OpenRound.due`: finalize ``buckets`` now, because ``reason``."""

    buckets: tuple[int, ...]
    reason: str


def payload_digest(payload: bytes | memoryview | None) -> str | None:
    """The hex blake2b-128 of a contribution's payload, as round results name it (None: none)."""
    return None if payload is None else hashlib.blake2b(payload, digest_size=16).hexdigest()


class OpenRound:
    """Owner-side bookkeeping of one open round at one site.

    Args:
        plan: the round plan (members; ``reduce_timeout_s`` and
            ``broadcast_timeout_s`` count from ``opened_at``).
        owners: owner site id per bucket (``assign_owners`` over the members).
        site_id: this site; it owns the buckets where ``owners[b] == site_id``.
        chunks: per bucket, its chunks as ``(offset, numel)`` pairs
            (``BucketLayout.buckets[b].chunks``).
        aggregation: the robust-aggregation options (and token weighting).
        opened_at: when the round opened here, seconds on the caller's clock.
        tokens: this site's own token claim this round (its weight with
            ``aggregation.token_weighted``; 0: none, it does not contribute).

    Attributes:
        digests: per finalized chunk ``(bucket, chunk)``, sender -> the payload the mean
            counted from it (its bytes, or a read-only view of the message that carried
            them: kept while this round's books are, about one byte per parameter of the
            owned buckets per sender at int8). An identical retry, also after close, is
            recognised by comparing payloads byte for byte; its blake2b-128 is taken only
            for :meth:`refused`. (Callers may pass any bytes-like key instead: tests do.)
        rejections: refused contributions by code, with a few example reasons.
        faulty_senders: senders refused for something they sent wrong (:data:`SENDER_FAULTS`).
        refusals: ``(bucket, chunk, sender, payload)`` of refused contributions to
            chunks this site owns, at most :data:`MAX_REFUSALS_NAMED` (see :meth:`refused`).
        lost: members declared dead during the round (no longer awaited).
        claims: token weighting: sender -> the token claim accepted from it this round.
        weights: sender -> its weight factor, claim / the reference claim (this site's
            own, else the first accepted), a float32 number (1.0 for a claim equal to it).
        refused_claims: sender -> why its claim was refused (every chunk of it refused).
    """

    def __init__(
        self,
        *,
        plan: RoundPlan,
        owners: Sequence[str],
        site_id: str,
        chunks: Sequence[Sequence[tuple[int, int]]],
        aggregation: AggregationConfig,
        opened_at: float,
        tokens: int = 0,
        full_round_tokens: int = 0,
    ) -> None:
        if len(owners) != len(chunks):
            raise ValueError(f"owners has {len(owners)} entries, chunks {len(chunks)}: one per bucket expected")
        self.round = plan.round
        self.members = frozenset(plan.site_ids)
        self.owners = tuple(owners)
        self.site_id = site_id
        self.chunks = [tuple(cs) for cs in chunks]
        self.reduce_timeout_s = plan.reduce_timeout_s
        self.finalize_at = opened_at + plan.reduce_timeout_s
        self.broadcast_until = opened_at + plan.broadcast_timeout_s
        self.mine = tuple(b for b, o in enumerate(owners) if o == site_id)
        order = sorted(self.members)
        self.token_weighted = aggregation.token_weighted
        self.max_weight_ratio = aggregation.max_weight_ratio
        self.full_round_tokens = full_round_tokens  # the claim bound's unit (claim_decision); 0: unknown
        self.claims: dict[str, int] = {}
        self.weights: dict[str, float] = {}
        self.refused_claims: dict[str, str] = {}
        self._ref_claim = 0
        self._claims_lock = threading.Lock()  # check() runs on the push threads, outside the round's lock
        if self.token_weighted and tokens > 0:
            self._register_claim(site_id, tokens)
        w = self.weights if self.token_weighted else None
        self._acc = {
            b: BucketAccumulator([n for _, n in self.chunks[b]], aggregation, order=order, weights=w) for b in self.mine
        }
        self.expected = sum(len(self.chunks[b]) for b in self.mine) * len(self.members)
        self.arrived = 0
        self._arrived_from: collections.Counter[str] = collections.Counter()  # sender -> chunks counted
        self.lost: set[str] = set()
        self.finished: set[str] = set()  # members whose transport said they sent everything (sender_done)
        # (sender, bucket) pairs no longer awaited: the sender is lost or finished, or said it sent
        # all of that bucket (sender_done with buckets); its missing chunks there count as lost
        self._not_awaited: set[tuple[str, int]] = set()
        self.rejections = RejectionTally()
        self.faulty_senders: set[str] = set()
        self.refusals: list[tuple[int, int, str, bytes]] = []
        self.dropped: set[str] = set()  # senders a robust option dropped at finalize (engine._note_dropped)
        self.trimmed: collections.Counter[str] = collections.Counter()  # sender -> elements a trimmed mean cut
        self.digests: dict[tuple[int, int], dict[str, bytes]] = {}
        self.closed: set[int] = set()
        self._missing = {b: len(self.chunks[b]) * len(self.members) for b in self.mine}
        self._complete = [b for b, m in self._missing.items() if m == 0]

    # ------------------------------------------------------------------ queries
    @property
    def all_closed(self) -> bool:
        return len(self.closed) == len(self.mine)

    @property
    def reduce_arrived_fraction(self) -> float:
        """Of the contributions expected at this site's buckets, those counted."""
        return self.arrived / self.expected if self.expected else 1.0

    @property
    def reduce_live_fraction(self) -> float:
        """Of the contributions expected at this site's buckets from the slowest other member
        that sent at least one of them, those counted (1.0 when none sent any, or this site
        owns nothing): the share its link delivered by the time it was read. A member that
        sent nothing (dead, partitioned, or sitting the round out) is left out, so a fault
        does not read as a slow link; the rendezvous extrapolates a cut round's exchange from
        this (``dtrain.rendezvous.deadlines``)."""
        per_sender = sum(len(self.chunks[b]) for b in self.mine)
        live = [n for s, n in self._arrived_from.items() if s != self.site_id and n > 0]
        return min(1.0, min(live) / per_sender) if live and per_sender else 1.0

    def awaited(self, bucket: int) -> int:
        """Contributions bucket ``bucket`` still waits for (0 once closed or complete)."""
        return 0 if bucket in self.closed else self._missing[bucket]

    def owed(self, sender: str) -> int:
        """Chunks of open buckets here that member ``sender`` has not sent (0 for a
        non-member, a lost member or this site)."""
        if sender not in self.members or sender in self.lost or sender == self.site_id:
            return 0
        return sum(
            1
            for b in self.mine
            if b not in self.closed
            for c in range(len(self.chunks[b]))
            if self._acc[b].digest(c, sender) is None
        )

    def counted(self, bucket: int, chunk: int, sender: str) -> bytes | None:
        """The digest of the payload counted from ``sender`` for an owned chunk (None: none)."""
        if bucket in self.closed:
            return self.digests.get((bucket, chunk), {}).get(sender)
        return self._acc[bucket].digest(chunk, sender)

    def check(self, c: Contribution) -> None:
        """Refuse a contribution that does not fit this round (before decoding it).

        Raises:
            Rejected: PERMISSION_DENIED (sender not a member), INVALID_ARGUMENT
                (bucket or chunk out of range, offset/numel not the chunk's),
                FAILED_PRECONDITION (bucket not owned here). The reason names the
                field, the expected and the found value.
        """
        if c.sender not in self.members:
            raise Rejected(RejectCode.PERMISSION_DENIED, f"{c.sender} is not a member of round {c.round}")
        if not 0 <= c.bucket < len(self.owners):
            raise Rejected(RejectCode.INVALID_ARGUMENT, f"bucket {c.bucket} out of range [0, {len(self.owners)})")
        if self.owners[c.bucket] != self.site_id:
            raise Rejected(
                RejectCode.FAILED_PRECONDITION,
                f"bucket {c.bucket} is owned by {self.owners[c.bucket]}, not {self.site_id}",
            )
        chunks = self.chunks[c.bucket]
        if not 0 <= c.chunk < len(chunks):
            raise Rejected(
                RejectCode.INVALID_ARGUMENT, f"chunk {c.chunk} out of range [0, {len(chunks)}) of bucket {c.bucket}"
            )
        off, n = chunks[c.chunk]
        if (c.offset, c.numel) != (off, n):
            raise Rejected(
                RejectCode.INVALID_ARGUMENT,
                f"chunk {c.chunk} of bucket {c.bucket} covers offset {off} numel {n}, got offset {c.offset} numel {c.numel}",
            )
        if self.token_weighted:
            self._check_claim(c.sender, c.tokens)

    def check_run(self, run: ContributionRun) -> bool:
        """Whether ``run`` is of one bucket and every contribution of it passes :meth:`check`,
        with :meth:`check`'s effects (a first token claim registered); False: not, and checking
        each with :meth:`check` names which and why. One pass over the columns."""
        bucket, sender = run.buckets[0], run.sender
        if sender not in self.members or not 0 <= bucket < len(self.owners) or self.owners[bucket] != self.site_id:
            return False
        if run.buckets.count(bucket) != len(run):
            return False
        chunks = self.chunks[bucket]
        last = len(chunks) - 1
        for c, o, n in zip(run.chunks, run.offsets, run.numels):
            if not 0 <= c <= last or chunks[c] != (o, n):
                return False
        if self.token_weighted:
            try:
                self._check_claim(sender, run.tokens)
            except Rejected:
                return False
        return True

    def _check_claim(self, sender: str, tokens: int) -> None:
        """Token weighting: the sender's claim is the one it made on its earlier chunks of this
        round, or, on its first, within the bound (:func:`~dtrain.aggregation.claim_decision`
        against the claims accepted so far); a refused claim refuses every chunk of it.

        Raises:
            Rejected: INVALID_ARGUMENT, naming the claim and the bound or the earlier claim.
        """
        with self._claims_lock:
            refused = self.refused_claims.get(sender)
            if refused is not None:
                raise Rejected(RejectCode.INVALID_ARGUMENT, refused)
            had = self.claims.get(sender)
            if had is not None:
                if tokens != had:
                    raise Rejected(
                        RejectCode.INVALID_ARGUMENT,
                        f"{sender} claims {tokens} tokens, {had} on its earlier chunks of round {self.round}",
                    )
                return
            ok, reason = claim_decision(
                tokens, list(self.claims.values()), self.max_weight_ratio, self.full_round_tokens
            )
            if not ok:
                self.refused_claims[sender] = f"round {self.round}: {sender} {reason}"
                raise Rejected(RejectCode.INVALID_ARGUMENT, self.refused_claims[sender])
            self._register_claim(sender, tokens)

    def _register_claim(self, sender: str, tokens: int) -> None:
        if self._ref_claim == 0:  # fixed at the first claim: every factor is relative to one value
            self._ref_claim = tokens
        self.claims[sender] = tokens
        self.weights[sender] = float(np.float32(tokens / self._ref_claim))

    # ------------------------------------------------------------------ transitions
    def accept(self, sender: str, bucket: int, chunk: int, values: torch.Tensor, digest: bytes, *, now: float) -> bool:
        """Count a contribution that passed :meth:`check` and decoded to ``values``.

        Returns:
            True when counted; False for an identical retry of a chunk already
            counted (also after its bucket closed): a no-op.
        Raises:
            Rejected: FAILED_PRECONDITION when the bucket is closed or the reduce
                deadline passed (a late contribution; it stays in the sender's
                residual); ALREADY_EXISTS for a different payload from a sender
                already counted; INVALID_ARGUMENT for bad values
                (:meth:`BucketAccumulator.add`).
        """
        if bucket in self.closed:
            return self._closed_answer(sender, bucket, chunk, digest)
        acc = self._acc[bucket]
        if now >= self.finalize_at and acc.digest(chunk, sender) != digest:
            raise self._late(bucket, now)
        if not acc.add(sender, chunk, values, digest):
            return False
        self._counted(sender, bucket, 1)
        return True

    def accept_run(
        self,
        sender: str,
        bucket: int,
        chunks: Sequence[int],
        values: torch.Tensor | CheckedRun,
        digests: Sequence[bytes | None],
        *,
        now: float,
    ) -> list[bool | Rejected | None]:
        """:meth:`accept` for each of ``sender``'s contributions to ``chunks`` of ``bucket``
        (ascending; each passed :meth:`check`), in one pass (:meth:`BucketAccumulator.add_run`).

        Args:
            values: 1-D fp32, the chunks' decoded values concatenated in that order (or
                a :class:`~dtrain.codecs.base.CheckedRun` of them, decoded where summed).
            digests: per chunk, its payload's digest; None skips the chunk.
        Returns:
            Per chunk what :meth:`accept` returns (True, False) or raises (the
            :class:`Rejected`, same code and reason), or None for a skipped chunk.
        """
        out: list[bool | Rejected | None] = [None] * len(digests)
        if bucket in self.closed:
            for j, d in enumerate(digests):
                if d is not None:
                    try:
                        out[j] = self._closed_answer(sender, bucket, chunks[j], d)
                    except Rejected as e:
                        out[j] = e
            return out
        acc = self._acc[bucket]
        if now >= self.finalize_at:
            digests = list(digests)
            for j, d in enumerate(digests):
                if d is not None and acc.digest(chunks[j], sender) != d:
                    out[j], digests[j] = self._late(bucket, now), None
        counted = 0
        for j, r in enumerate(acc.add_run(sender, chunks, values, digests)):
            if r is not None:
                out[j] = r
                counted += r is True
        if counted:
            self._counted(sender, bucket, counted)
        return out

    def _closed_answer(self, sender: str, bucket: int, chunk: int, digest: bytes) -> bool:
        """A contribution to a closed bucket: False for an identical retry, else refused."""
        counted = self.digests.get((bucket, chunk), {}).get(sender)
        if counted == digest:
            return False
        if counted is not None:
            raise Rejected(
                RejectCode.ALREADY_EXISTS,
                f"a different contribution from {sender} for round {self.round} bucket {bucket} chunk {chunk} "
                "was already counted in its mean",
            )
        raise Rejected(
            RejectCode.FAILED_PRECONDITION,
            f"round {self.round} bucket {bucket} is already finalized (late or stale contribution)",
        )

    def _late(self, bucket: int, now: float) -> Rejected:
        return Rejected(
            RejectCode.FAILED_PRECONDITION,
            f"round {self.round} bucket {bucket}: reduce deadline passed {now - self.finalize_at:.3f} s ago "
            "(late contribution)",
        )

    def _counted(self, sender: str, bucket: int, num: int) -> None:
        """``num`` new contributions of ``sender`` to ``bucket`` were counted."""
        self.arrived += num
        self._arrived_from[sender] += num
        if (sender, bucket) not in self._not_awaited:  # no longer awaited: counted, not missing
            self._missing[bucket] -= num
            if self._missing[bucket] == 0:
                self._complete.append(bucket)

    def reject(
        self, sender: str, code: RejectCode, reason: str, *, where: tuple[int, int, bytes] | None = None
    ) -> bool:
        """Count a refused contribution; returns whether ``reason`` was kept as one of
        the few examples of ``code`` (the caller logs those). ``where``: its bucket,
        chunk and payload digest, kept in :attr:`refusals` when this site owns that chunk."""
        if code in SENDER_FAULTS:
            self.faulty_senders.add(sender)
        if where is not None and len(self.refusals) < MAX_REFUSALS_NAMED:
            b, c, digest = where
            if b in self.mine and 0 <= c < len(self.chunks[b]):
                self.refusals.append((b, c, sender, digest))
        return self.rejections.add(code, reason)

    def counted_senders(self) -> set[str]:
        """Senders with a contribution counted in a closed bucket's mean and none dropped
        at finalize by a robust option."""
        return {s for by_sender in self.digests.values() for s in by_sender} - self.dropped

    def refused(self) -> list[dict]:
        """:attr:`refusals` as ``RoundResult.rejected_senders`` entries: bucket, chunk,
        sender, ``digest`` (:func:`payload_digest`) of the refused payload and ``counted``,
        that of the payload the finalized mean counted from that sender for that chunk (None:
        none)."""
        out = []
        for b, c, s, d in self.refusals:
            counted = self.digests.get((b, c), {}).get(s)  # final once the bucket closed
            out.append(
                {"bucket": b, "chunk": c, "sender": s, "digest": payload_digest(d), "counted": payload_digest(counted)}
            )
        return out

    def members_lost(self, site_ids: Iterable[str]) -> frozenset[str]:
        """Stop awaiting ``site_ids`` (members the rendezvous holds dead).

        For each open bucket, the chunks they have not sent no longer count as
        missing, so a bucket that lacks nothing else becomes due at once. What they
        already sent, or still send before the bucket closes, is counted as usual.
        Non-members and this site are ignored. Returns the members newly lost.
        """
        new = frozenset((set(site_ids) & self.members) - self.lost - self.finished - {self.site_id})
        if not new:
            return new
        self.lost |= new
        self._stop_awaiting(new)
        return new

    def sender_done(self, sender: str, buckets: Iterable[int] | None = None) -> bool:
        """``sender`` sent everything it will send here this round (the datagram path's
        SEND_END), or all of ``buckets`` (its BUCKET_END): its chunks still missing there
        were lost, not late, so they no longer count as missing and a bucket that lacks
        nothing else becomes due at once. A sender can only end its own contribution
        early: what it sends after is refused as late once the bucket closed. Returns
        whether anything changed (False for this site, non-members, repeats)."""
        if sender == self.site_id or sender not in self.members or sender in self.lost or sender in self.finished:
            return False
        if buckets is None:
            self.finished.add(sender)
            return self._stop_awaiting(frozenset({sender})) or True
        return self._stop_awaiting(frozenset({sender}), buckets)

    def _stop_awaiting(self, senders: frozenset[str], buckets: Iterable[int] | None = None) -> bool:
        """The open buckets (of ``buckets``; None: all owned here) no longer count ``senders``'
        unsent chunks as missing. Whether a bucket's count changed."""
        changed = False
        for b in self.mine if buckets is None else [b for b in buckets if b in self._acc]:
            if b in self.closed:
                continue
            acc = self._acc[b]
            for s in senders:
                if (s, b) in self._not_awaited:
                    continue
                self._not_awaited.add((s, b))
                self._missing[b] -= sum(1 for c in range(len(self.chunks[b])) if acc.digest(c, s) is None)
                changed = True
            if self._missing[b] == 0 and b not in self._complete:
                self._complete.append(b)
        return changed

    def due(self, now: float) -> Closing | None:
        """The buckets to finalize at time ``now`` (a pure decision; nothing changes).

        Every open bucket once ``now`` reaches the reduce deadline
        (:data:`CLOSE_DEADLINE`); before it, the open buckets that await nothing more
        (:data:`CLOSE_COMPLETE`), in the order they became complete; None when there
        is nothing to finalize yet (or every bucket is closed).
        """
        if now >= self.finalize_at:
            rest = tuple(b for b in self.mine if b not in self.closed)
            return Closing(rest, CLOSE_DEADLINE) if rest else None
        ready = tuple(b for b in self._complete if b not in self.closed)
        return Closing(ready, CLOSE_COMPLETE) if ready else None

    def close(self, buckets: Iterable[int]) -> None:
        """Accept nothing more for ``buckets`` (identical retries stay no-ops); their
        digests become final in :attr:`digests`."""
        for b in buckets:
            if b in self.closed:
                continue
            self.closed.add(b)
            acc = self._acc[b]
            for c in range(len(self.chunks[b])):
                self.digests[(b, c)] = acc.digests(c)
        self._complete = [b for b in self._complete if b not in self.closed]

    def finalize(self, bucket: int) -> BucketReduction:
        """The partial mean of every chunk of closed bucket ``bucket`` (a ``Sequence`` of
        :class:`ChunkReduction`, held as columns); frees its accumulators (call once per bucket).

        Raises:
            ValueError: the bucket is not closed, or was finalized already.
        """
        if bucket not in self.closed:
            raise ValueError(f"bucket {bucket} is not closed in round {self.round}")
        acc = self._acc.pop(bucket, None)
        if acc is None:
            raise ValueError(f"bucket {bucket} of round {self.round} was finalized already")
        out = acc.finalize()
        self.trimmed.update(acc.trimmed)
        return out
