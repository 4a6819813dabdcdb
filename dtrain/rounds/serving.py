"""The peer-facing side of :class:`~dtrain.rounds.engine.RoundEngine` (its
``PeerHandler`` methods): validating incoming contributions for the rounds this site
owns buckets in, stopping waiting for members that are lost, and serving means and
bucket state to peers. Kept apart from the engine's own round steps (``engine.py``);
``RoundEngine`` inherits it and holds the state these methods read.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Iterable, Sequence

import torch

from dtrain.codecs.base import CheckedRun, equal_runs
from dtrain.errors import (
    CodecError,
    DecodeBoundExceeded,
    PeerTimeout,
    RejectCode,
    Rejected,
)
from dtrain.protocol import BucketMean, BucketState, Contribution, ContributionRun
from dtrain.rounds.history import AppliedMean, NotRetained, history_info_state
from dtrain.rounds.means import ascending_runs
from dtrain.rounds.owner import OpenRound
from dtrain.rounds.types import BucketOutcome
from dtrain.transports.pacing import Pacer

__all__ = ["PeerSide"]

log = logging.getLogger(__name__)

#: ``plan_wait_s`` before this site opened any round (the derived rule's start: 5 s, the former default).
PLAN_WAIT_START_S = 5.0


class _Owned:
    """The engine's threading around one round's owner-side books."""

    def __init__(self, books: OpenRound) -> None:
        self.books = books
        self.cv = threading.Condition()
        self.done = {b: threading.Event() for b in books.mine}  # mean of owned bucket b published
        self.published = threading.Event()  # every owned bucket's mean published
        self.pacer: Pacer | None = None  # a paced fragment round's send budget (the engine sets it)
        # owned bucket -> (θ_b snapshot, broadcast residual) from before its mean was applied,
        # until the commit rule keeps or withdraws the mean (PeerSide._commit)
        self.rollback: dict[int, tuple] = {}
        # sender -> the parts (i of its push's k streams) that ended (PeerSide.handle_push_ended)
        self.parts_ended: dict[str, set[int]] = {}


class PeerSide:
    """The ``PeerHandler`` methods of a round engine (mixed into ``RoundEngine``).

    Uses the engine's ``_cv``, ``_open`` (round -> its ``_Owned`` books), ``_means``, ``_skipped``, ``_voided``, ``_bres``,
    ``_banned``, ``_reject_streak``, ``state``, ``config``, ``codec``, ``mean_pulls``, ``log`` and ``fault_hook``.
    """

    @property
    def plan_wait_s(self) -> float:
        """How long a request for a round not open here waits for this site to open it:
        ``RoundConfig.plan_wait_s`` when set, else the reduce timeout of the last plan this
        site opened (a push later than that is late anyway; the plans' deadlines follow the
        link, :mod:`dtrain.rendezvous.deadlines`), :data:`PLAN_WAIT_START_S` before the first."""
        v = self.config.plan_wait_s
        return v if v is not None else getattr(self, "_last_reduce_timeout_s", PLAN_WAIT_START_S)

    @property
    def banned(self) -> frozenset[str]:
        """The members excluded for repeat offences (:meth:`_note_rejections`): their
        contributions are refused from then on."""
        return frozenset(self._banned)

    def _note_rejections(self, books: OpenRound) -> None:
        """Count a round towards excluding a member whose contributions were refused for
        what they carried and none was counted: a name some chunks of which were counted
        is a member sending (a spoofer with the token claiming its name, as the chaos
        soak's corrupt action does, got an honest site-0 excluded before)."""
        counted = books.counted_senders()
        for s in books.members:
            if s == self.site_id:
                continue
            if s in books.faulty_senders and s not in counted:
                self._reject_streak[s] = self._reject_streak.get(s, 0) + 1
                if self._reject_streak[s] >= self.config.max_consecutive_rejections and s not in self._banned:
                    self._banned.add(s)
                    self.log.error(
                        "excluding %s: contributions rejected in %d consecutive rounds", s, self._reject_streak[s]
                    )
            else:
                self._reject_streak[s] = 0

    # ------------------------------------------------------------------ PeerHandler
    def _round_for(self, rnd: int, timeout_s: float) -> _Owned:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                owned = self._open.get(rnd)
                if owned is not None:
                    return owned
                if rnd in self._skipped:
                    raise Rejected(RejectCode.ABORTED, f"round {rnd} is not run here: {self._skipped[rnd]}")
                if rnd < self.state.rounds_applied:
                    raise Rejected(
                        RejectCode.FAILED_PRECONDITION,
                        f"round {rnd} is over here (next round is {self.state.rounds_applied})",
                    )
                left = deadline - time.monotonic()
                if left <= 0 or rnd > self.state.rounds_applied + 1:
                    raise Rejected(
                        RejectCode.FAILED_PRECONDITION,
                        f"round {rnd} is not open here (next round is {self.state.rounds_applied})",
                    )
                self._cv.wait(left)

    def handle_contribution(self, c: Contribution) -> None:
        self._handle_one(c, None)

    def handle_contributions(self, cs: Sequence[Contribution]) -> list[Rejected | None]:
        """:meth:`handle_contribution` for each of ``cs`` in order (a datagram receiver's
        backlog, usually one sender's :class:`~dtrain.protocol.ContributionRun`): the same
        checks, effects and refusals, one per item (None: counted or an identical retry). A
        run of chunks of one bucket in ascending order (gaps allowed: datagrams lost) is
        decoded in one pass (:meth:`Codec.decode_chunks`) and checked and counted in one
        pass (:meth:`_handle_run`); a run that does not decode is decoded (and refused)
        chunk by chunk. Items are taken in stretches that share sender, round, codec and claim
        (:meth:`ContributionRun.stretches`)."""
        out: list[Rejected | None] = []
        for run in ContributionRun.stretches(cs):
            for i, j, values in self._decode_runs(run):
                if values is None:
                    out += [self._try_one(c, None) for c in run[i:j]]
                else:
                    out += self._handle_run(run[i:j], values)
        return out

    def _try_one(self, c: Contribution, values: torch.Tensor | None) -> Rejected | None:
        try:
            self._handle_one(c, values)
        except Rejected as e:
            return e
        return None

    def _decode_runs(self, run: ContributionRun) -> list[tuple[int, int, torch.Tensor | CheckedRun | None]]:
        """``run`` cut into consecutive spans ``(start, end, values)``: ``values`` is the
        decoded concatenation of a stretch (>= 2) of chunks of one bucket in ascending order
        in this round's codec (a :class:`CheckedRun` where the codec checks it without
        decoding: the owner's sum then decodes it in place), or None for a span to take chunk
        by chunk (not in such a stretch, or it did not decode)."""
        if run.codec != self.codec.name:
            return [(0, len(run), None)]
        out: list[tuple[int, int, torch.Tensor | CheckedRun | None]] = []
        payloads = run.payloads()
        for i, j in equal_runs(run.buckets):
            if j - i < 2:
                out.append((i, j, None))
                continue
            for a, b in ascending_runs(run.chunks[i:j]):
                dec: torch.Tensor | CheckedRun | None = None
                if b - a >= 2:
                    ps, ns = payloads[i + a : i + b], run.numels[i + a : i + b]
                    try:
                        dec = self.codec.checked_run(ps, ns) or self.codec.decode_chunks(ps, ns)
                    except CodecError:
                        pass
                out.append((i + a, i + b, dec))
        return out

    def _handle_run(self, run: ContributionRun, values: torch.Tensor | CheckedRun) -> list[Rejected | None]:
        """:meth:`_handle_one` for each contribution of a decoded run (:meth:`_decode_runs`), one
        pass: the refused chunks are recorded and logged as :meth:`_handle_one` does."""
        try:
            owned = self._round_for(run.round, self.plan_wait_s)
        except Rejected as e:
            return [e] * len(run)
        out = self._accept_run(owned, run, values)
        for k, r in enumerate(out):
            if r is not None:
                self._refused(owned, run[k], r)
        return out

    def _accept_run(
        self, owned: _Owned, run: ContributionRun, values: torch.Tensor | CheckedRun
    ) -> list[Rejected | None]:
        """:meth:`_accept` for each contribution of ``run``, chunks of one bucket in ascending
        order in this round's codec, ``values`` their decoded concatenation: the checks per
        run (:meth:`OpenRound.check_run`), the values' checks and the sums per run
        (:meth:`OpenRound.accept_run`). A run that is not plain (a banned sender, a chunk
        that fails :meth:`OpenRound.check`, chunk indices not ascending) is taken chunk
        by chunk. Returns per chunk None (counted or an identical retry) or its refusal."""
        books, bucket = owned.books, run.buckets[0]
        plain = run.sender not in self._banned and run.codec == self.codec.name
        plain = plain and ascending_runs(run.chunks) == [(0, len(run))] and books.check_run(run)
        if not plain:
            out: list[Rejected | None] = []
            pos = 0
            for c in run:
                try:
                    self._accept(owned, c, _tensor(values)[pos : pos + c.numel])
                    out.append(None)
                except Rejected as e:
                    out.append(e)
                pos += c.numel
            return out
        with owned.cv:  # each payload is its own key: a retry is compared byte for byte (OpenRound)
            res = books.accept_run(run.sender, bucket, run.chunks, values, run.payloads(), now=time.monotonic())
            if any(r is True for r in res) and books.awaited(bucket) == 0:
                owned.cv.notify_all()
        return [r if isinstance(r, Rejected) else None for r in res]

    def accept_own(self, owned: _Owned, cs: Sequence[Contribution]) -> list[Rejected | None]:
        """:meth:`_accept` for each of this site's own contributions ``cs`` to the buckets it
        owns (refusals are returned, not recorded as a peer's): runs of chunks in ascending
        order are decoded, checked and counted in one pass each, as a peer's (:meth:`_accept_run`)."""
        out: list[Rejected | None] = []
        for run in ContributionRun.stretches(cs):
            for i, j, values in self._decode_runs(run):
                if values is not None:
                    out += self._accept_run(owned, run[i:j], values)
                    continue
                for c in run[i:j]:
                    try:
                        self._accept(owned, c)
                        out.append(None)
                    except Rejected as e:
                        out.append(e)
        return out

    def _handle_one(self, c: Contribution, values: torch.Tensor | None) -> None:
        owned = self._round_for(c.round, self.plan_wait_s)
        try:
            self._accept(owned, c, values)
        except Rejected as e:
            self._refused(owned, c, e)
            raise

    def _refused(self, owned: _Owned, c: Contribution, e: Rejected) -> None:
        """Count and (the first few of each code per round) log a refused contribution."""
        where = (c.bucket, c.chunk, c.payload)
        with owned.cv:
            example = owned.books.reject(c.sender, e.code, e.reason, where=where)
        # the first few of each code per round are logged; the rest are counted (RoundResult.rejected)
        (self.log.warning if example else self.log.debug)(
            "round %d: rejected chunk b%d c%d from %s: %s %s",
            c.round,
            c.bucket,
            c.chunk,
            c.sender,
            e.code,
            e.reason,
        )

    def _accept(self, owned: _Owned, c: Contribution, values: torch.Tensor | None = None) -> None:
        """Check and count ``c``; ``values``: its payload already decoded (None: decoded here)."""
        if c.sender in self._banned:
            raise Rejected(
                RejectCode.PERMISSION_DENIED, f"{c.sender} is excluded after repeated rejected contributions"
            )
        owned.books.check(c)
        if c.codec != self.codec.name:
            raise Rejected(RejectCode.INVALID_ARGUMENT, f"codec {c.codec!r} but this round uses {self.codec.name!r}")
        try:
            if values is None:
                values = self.codec.decode(c.payload, numel=c.numel)
        except DecodeBoundExceeded as e:  # a decompression bomb, or a body past max_decoded_bytes
            raise Rejected(RejectCode.RESOURCE_EXHAUSTED, f"undecodable payload: {e}") from e
        except CodecError as e:
            raise Rejected(RejectCode.INVALID_ARGUMENT, f"undecodable payload: {e}") from e
        with owned.cv:
            if owned.books.accept(c.sender, c.bucket, c.chunk, values, c.payload, now=time.monotonic()):
                if owned.books.awaited(c.bucket) == 0:
                    owned.cv.notify_all()

    def members_lost(self, site_ids: Iterable[str], *, round: int | None = None, why: str = "") -> frozenset[str]:
        """Stop waiting for contributions from ``site_ids`` in every round open here
        (or only in ``round``).

        Called with the sites the rendezvous holds dead (no heartbeat within its
        timeout, or left; ``HeartbeatInfo.dead``), and by the data path for one
        round (``round``): a push this site sent was refused as unreachable, or a
        push stream from a member broke before it ended (``why`` says which;
        :meth:`member_unreachable`, :meth:`handle_push_ended`). For each owned bucket not yet
        finalized, the chunks those members have not sent no longer count as
        missing: a bucket that now lacks nothing else is finalized at once, with
        the contributions that did arrive (as at the reduce deadline), instead of
        waiting out the reduce deadline. Contributions a lost member still sends
        before its bucket is finalized are counted as usual; later ones are
        refused as late and stay in the sender's residual. Sites that are not
        members of a round, and this site itself, are ignored
        (:meth:`OpenRound.members_lost`). Returns the members newly lost in some
        open round (empty when the call changed nothing).
        """
        lost = set(site_ids) - {self.site_id}
        changed: set[str] = set()
        if not lost:
            return frozenset()
        self.mean_pulls.forget(lost)
        with self._cv:
            rounds = [o for r, o in self._open.items() if round is None or r == round]
        for owned in rounds:
            with owned.cv:
                new = owned.books.members_lost(lost)
                if new:
                    owned.cv.notify_all()
            changed |= new
            if new:
                self.log.warning(
                    "round %d: %s %s: not waiting for their contributions",
                    owned.books.round,
                    ", ".join(sorted(new)),
                    why or "declared dead by the rendezvous",
                )
        return frozenset(changed)

    def handle_mean_delivered(self, round: int, bucket: int, member: str, have_checksum: str) -> None:
        """``member`` holds this site's mean of ``bucket`` for ``round`` without having pulled
        it (the datagram path pushes means; the member acknowledged the whole mean). It then
        counts as pulled, so ``close()`` stops waiting for it; when its θ_b checksum
        (``have_checksum``, hex; empty: not said) differs from the mean's ``checksum_before``,
        only once it pulled the bucket's state (its repair). Unknown means are ignored."""
        with self._cv:
            m = self._means.get((round, bucket))
        if m is not None:
            stale = bool(have_checksum) and have_checksum != m.checksum_before
            try:
                self.mean_pulls.record(round, bucket, member, m, needs_state=stale)
            except Rejected as e:  # an acknowledgement after this owner withdrew the mean
                self.log.warning("round %d: %s acknowledged bucket %d too late: %s", round, member, bucket, e.reason)

    def handle_sender_done(self, round: int, sender: str, buckets: Sequence[int] | None = None) -> None:
        """``sender`` sent everything it will send this site for ``round`` (of ``buckets``
        only, when given).

        Called by a transport that knows (the datagram path, on the sender's SEND_END,
        or its BUCKET_END after each bucket): the chunks of ``sender`` still missing
        there were lost, not late, so they no longer count as missing and a bucket
        lacking nothing else is finalized at once instead of at the reduce deadline.
        """
        with self._cv:
            owned = self._open.get(round)
        if owned is None:
            return
        with owned.cv:
            if owned.books.sender_done(sender, buckets):
                owned.cv.notify_all()

    def handle_push_ended(
        self,
        sender: str,
        round: int,
        num_accepted: int,
        *,
        at_deadline: bool = False,
        part: tuple[int, int] = (0, 1),
    ) -> None:
        """A push stream from ``sender`` for ``round`` ended after ``num_accepted``
        chunks. A member sends everything it owes this owner in one push, so once the
        push has ended (``part`` = (i, k): this stream is part i of a push sent as k
        streams; the push ended when each of its k parts has ended once) while the member
        still owes chunks of open buckets, it broke (the member died or its connection
        dropped): it is lost for that round here (:meth:`members_lost`); the rendezvous
        decides about later rounds. What it sent before counts; a retried stream's chunks
        count too while their bucket is open.

        A stream that ends short at the reduce deadline (within ``max(0.5 s, 10%)`` of it,
        the sites' clocks agreeing on a plan's formation only so well) ran out of the
        sender's own time: the deadline explains it, not a death, and these buckets finalize
        then anyway. Losing the sender there made the members hold its buckets
        OWNER_LOST while their owner applied them, and had it declared dead while alive (a
        30%-loss launch of the reliability benchmark). ``at_deadline``: the transport saw the
        stream end at its call's own deadline (the sender's, ``_at_call_deadline`` of the gRPC
        transport), which says the same even when the sender reckoned its deadline earlier
        than this owner did (a plan read late over a lossy link)."""
        with self._cv:
            owned = self._open.get(round)
        if owned is None or not self.config.short_push_is_loss:
            return
        with owned.cv:
            ended = owned.parts_ended.setdefault(sender, set())
            ended.add(part[0])
            if len(ended) < part[1]:  # other streams of this push still run
                return
            owed = owned.books.owed(sender)
            books = owned.books
        margin_s = max(0.5, 0.1 * books.reduce_timeout_s)
        if owed and (at_deadline or time.monotonic() >= books.finalize_at - margin_s):
            self.log.info(
                "round %d: %s's push stream ended %d short at the reduce deadline: its own deadline, not a loss",
                round,
                sender,
                owed,
            )
            return
        if owed:
            why = f"its push stream ended after {num_accepted} chunk(s), {owed} short"
            self.members_lost([sender], round=round, why=why)
            self._note_unreachable(sender)

    def _note_unreachable(self, site_id: str) -> None:
        """Tell the site's membership (``on_unreachable``, set by the Group) so the
        rendezvous hears of it with the next heartbeat."""
        if self.on_unreachable is not None and site_id != self.site_id:
            self.on_unreachable(site_id)

    def handle_pull_mean(
        self, round: int, bucket: int, requester: str, timeout_s: float, *, have_checksum: str = ""
    ) -> BucketMean:
        """The blocking form of :meth:`poll_pull_mean` (the in-process transports): waits on
        the engine's condition, which every change :meth:`poll_pull_mean` depends on notifies."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        with self._cv:
            while True:
                now = time.monotonic()
                m = self.poll_pull_mean(
                    round, bucket, requester, waited_s=now - t0, last=now >= deadline, have_checksum=have_checksum
                )
                if m is not None:
                    return m
                wake = deadline if round in self._open else min(deadline, t0 + self.plan_wait_s)
                self._cv.wait(max(0.0, wake - now))

    def poll_pull_mean(
        self, round: int, bucket: int, requester: str, *, waited_s: float, last: bool, have_checksum: str = ""
    ) -> BucketMean | None:
        """Answer a mean pull now without blocking: the mean, or None when it may still come
        (call again after :attr:`mean_listeners` fire). Never waits for a lock held long.

        Args:
            waited_s: how long the pull has waited so far; a round that is not open here
                after ``plan_wait_s`` is refused.
            last: the pull's wait is over: raise instead of returning None.
            have_checksum: the requester's θ_b checksum before applying ("" = not sent).
                When it differs from the mean's ``checksum_before``, the requester will
                repair the bucket whole: :meth:`MeanPulls.record` then waits for its state pull.
        Raises:
            Rejected: FAILED_PRECONDITION (round over, or not open here), INVALID_ARGUMENT
                (bucket out of range), NOT_FOUND (not the owner and no copy here).
            PeerTimeout: ``last`` and the owned bucket is not finalized yet.
        """
        self.mean_pulls.heard(round, requester)
        with self._cv:
            m = self._means.get((round, bucket))
            owned = self._open.get(round)
            applied = self.state.rounds_applied
        if m is not None:
            return self._reply_mean(owned, round, bucket, requester, m, have_checksum)
        if owned is None:
            with self._cv:
                skipped = self._skipped.get(round)
            if skipped is not None and not (have_checksum and round in self._voided):  # a void round's replay
                raise Rejected(RejectCode.ABORTED, f"round {round} is not run here: {skipped}")
            if round < applied:
                return self._past_mean(round, bucket, applied, have_checksum)
            if last or waited_s >= self.plan_wait_s or round > applied + 1:
                raise Rejected(
                    RejectCode.FAILED_PRECONDITION, f"round {round} is not open here (next round is {applied})"
                )
            return None
        owners = owned.books.owners
        if not 0 <= bucket < len(owners):
            raise Rejected(RejectCode.INVALID_ARGUMENT, f"bucket {bucket} out of range [0, {len(owners)})")
        if owners[bucket] == self.site_id and not owned.done[bucket].is_set():
            if last:
                raise PeerTimeout(f"round {round} bucket {bucket} not finalized within {waited_s:.2f} s")
            return None
        with self._cv:  # our own mean, or one of a peer's we may have cached
            m = self._means.get((round, bucket))
        if m is None:
            raise Rejected(RejectCode.NOT_FOUND, f"no mean for round {round} bucket {bucket} here")
        return self._reply_mean(owned, round, bucket, requester, m, have_checksum)

    def _past_mean(self, round: int, bucket: int, applied: int, have_checksum: str) -> BucketMean:
        """A closed round's mean from :attr:`history` (a site catching up replays it). A bucket
        that passed the round unchanged answers a mean without chunks, but only to a pull that
        says its θ_b checksum (a site catching up does): a member's late pull of that round
        from another member would read it as the owner's empty mean.

        Raises:
            Rejected: FAILED_PRECONDITION (the round is not kept, or its mean unknown here).
        """
        try:
            am = self.history.get(round, bucket)
        except NotRetained as e:
            raise Rejected(
                RejectCode.FAILED_PRECONDITION, f"round {round} is over here (next is {applied}): {e}"
            ) from e
        if am.mean is not None:
            return am.mean
        if not have_checksum:
            raise Rejected(RejectCode.FAILED_PRECONDITION, f"round {round} is over here (next round is {applied})")
        return BucketMean(round=round, bucket=bucket, owner="", chunks=(), checksum_before="", checksum_after="")

    def _reply_mean(
        self, owned: _Owned | None, round: int, bucket: int, requester: str, m: BucketMean, have_checksum: str = ""
    ) -> BucketMean:
        """Record the pull and, in a paced fragment round, wait for the reply's share of the budget.
        A transport whose members acknowledge the means they got (``acknowledges_means``) records
        the acknowledgement instead (:meth:`handle_mean_delivered`): this reply may still be lost."""
        self.mean_pulls.take(round, bucket)  # the commit rule: from here the mean may be applied there
        if owned is not None and owned.pacer is not None:
            owned.pacer.wait(sum(len(c.payload) for c in m.chunks), owned.books.broadcast_until)
        if getattr(self.transport, "acknowledges_means", False):
            return m
        stale = bool(have_checksum) and have_checksum != m.checksum_before
        return self.mean_pulls.record(round, bucket, requester, m, needs_state=stale)

    def skip_round(self, round: int, why: str) -> None:
        """This site, a member of ``round``'s plan, will not run it (its plan expired before
        it read it, ``dtrain.site.plan_expired``): peers' pushes and mean pulls for it are
        refused at once (ABORTED: its buckets are owner-lost for them) instead of waiting
        ``plan_wait_s`` for a round that never opens here."""
        with self._cv:
            self._skipped[round] = why
            for old in [r for r in self._skipped if r < round - 4]:
                del self._skipped[old]
            self._cv.notify_all()
        self._means_changed()

    def void_round(self, round: int, why: str) -> None:
        """Count ``round`` as run with θ unchanged: no site ran it (every member skipped it,
        :func:`dtrain.rounds.catchup.decide_void`), so no site will ever hold a θ that
        reflects it, and the members must agree on the round that follows without one. Every
        bucket passes it as a bucket with no mean does (no outer step, no outer LR
        scheduler step), and the history keeps it so: a site that catches up across it
        replays it as unchanged. θ must be at ``round`` (``rounds_applied == round``) and no
        round may be open.

        Raises:
            ValueError: θ is not at ``round``.
        """
        st = self.state
        if st.rounds_applied != round:
            raise ValueError(f"void_round({round}): θ is at round {st.rounds_applied}, not {round}")
        unchanged = {}
        for b in range(len(st)):
            with st.lock(b):
                unchanged[b] = AppliedMean(None, tuple(float(g["lr"]) for g in st.optimizers[b].param_groups))
        self.history.close_round(round, unchanged)  # first: a site that sees round + 1 here can replay it
        with self._cv:  # as a round closes (RoundEngine._close)
            self._voided.add(round)
            for old in [r for r in self._voided if r < round - 4]:
                self._voided.discard(old)
            for b in range(len(st)):
                st.bucket_round[b] = round + 1
            st.rounds_applied = round + 1
            self._cv.notify_all()
        self._means_changed()
        self.log.warning("round %d counted void (θ unchanged): %s", round, why)

    def _commit(self, run, b: int) -> bool:  # run: the engine's _Run of this round
        """The commit rule for an owned bucket whose mean this site applied: keep it once a
        member took it; otherwise (nobody by the broadcast deadline, or no member left) roll
        θ_b back and give the bucket OWNER_LOST, as every member that could not get it does
        (:meth:`MeanPulls.settle <dtrain.rounds.pulls.MeanPulls.settle>`). Returns whether kept."""
        snap, bres = run.owned.rollback.pop(b)
        until = run.owned.books.broadcast_until
        self.mean_pulls.wait_settled(run.round, b, until=until)
        with self.state.lock(b):  # no state pull reads θ_b between the decision and the roll-back
            keep, why = self.mean_pulls.settle(run.round, b, until=until)
            if keep:
                return True
            self.state.restore_bucket(b, snap)
        if bres is not None:
            self._bres[b] = bres
        with self._cv:
            self._means.pop((run.round, b), None)
        run.member.withdrawn(b, why)
        self.log.warning("round %d: bucket %d %s: mean withdrawn: %s", run.round, b, BucketOutcome.OWNER_LOST, why)
        return False

    def _means_changed(self) -> None:
        for fn in list(self.mean_listeners):
            try:
                fn()
            except Exception:  # noqa: BLE001 - a listener must not break the round
                log.exception("mean listener failed")

    def handle_pull_state(self, bucket: int, requester: str) -> BucketState:
        if bucket == len(self.state) + 1:  # two past the last: what this site keeps for a site behind
            lrs_now = [tuple(float(g["lr"]) for g in o.param_groups) for o in self.state.optimizers]
            with self._cv:
                skipped = tuple(self._skipped)
            return history_info_state(self.history, self.state.rounds_applied, lrs_now, index=bucket, skipped=skipped)
        if bucket == len(self.state):  # one past the last bucket: the training position
            position = self.position_source(bucket) if self.position_source is not None else None
            if position is None:
                raise Rejected(RejectCode.NOT_FOUND, "no training position here")
            return position
        if not 0 <= bucket < len(self.state):
            raise Rejected(RejectCode.INVALID_ARGUMENT, f"bucket {bucket} out of range [0, {len(self.state)})")
        if self.fault_hook is not None:
            self.fault_hook("serve_state", bucket)
        with self.state.lock(bucket):  # the commit rule: the state read and its taking are one step
            st = self.state.bucket_state(bucket)
            self.mean_pulls.record_state(bucket, requester)
        with self._cv:
            m = self._means.get((st.rounds_applied - 1, bucket))
        if m is None:
            if self.mean_pulls.withdrew(st.rounds_applied - 1, bucket):
                # a member whose pull of that mean failed learns it keeps θ_b as this owner does
                return replace(st, extra={**st.extra, "withdrawn_round": st.rounds_applied - 1})
            return st
        # A site that missed this mean learns from a repair which of its chunks
        # the mean included (those are consumed, never sent again; docs/ARCHITECTURE.md, "The residual rule").
        return replace(
            st, extra={**st.extra, "mean_round": m.round, "mean_senders": [list(ch.senders) for ch in m.chunks]}
        )


def _tensor(values: torch.Tensor | CheckedRun) -> torch.Tensor:
    return values if isinstance(values, torch.Tensor) else values.tensor()
