"""One site's round engine (outer step), written against ``Transport``.

Steps of :meth:`RoundEngine.run_round` (docs/ARCHITECTURE.md, "One round"), each a method:

1. ``_open_round`` — register the round (owner-side books: :class:`~dtrain.rounds.owner.OpenRound`;
   member side, each bucket's fate: :class:`~dtrain.rounds.member.MemberRound`, whose
   transitions steps 3-6 call) and start the finalizer thread (``_finalize_loop``:
   publishes each owned bucket's mean as soon as :meth:`OpenRound.due` says so, ``_publish``);
2. ``_reduce`` — encode Δ_b + residual_b per chunk and stream it to owner(b);
3. ``_broadcast`` — pull the means of the buckets other sites own;
4. ``_late_pulls`` — once more from the owner (a lost reply), then from members,
   pass after pass for half the repair window (this step and step 6 live in
   :mod:`dtrain.rounds.recovery`);
5. ``_apply_and_verify`` — every site, the owner included, applies the same decoded
   bytes and compares checksums with the owner's; each bucket gets its
   :class:`~dtrain.rounds.types.BucketOutcome`;
6. ``_repair`` — stale buckets are pulled whole (θ_b and outer-optimizer state);
7. ``_settle_residuals`` — error feedback (:mod:`dtrain.rounds.error_feedback`);
8. ``_close`` — rejection accounting, exclusion of repeat offenders, the result.

:class:`RoundEngine` is also the site's ``PeerHandler``: it validates incoming
contributions for the rounds it runs and serves means and bucket state.
``run_round`` blocks; ``start_round`` runs it in a background thread so a caller can
overlap it with computation (the way Streaming DiLoCo, arXiv 2501.18512, overlaps
communication with τ inner steps).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from dtrain.buckets import assign_owners
from dtrain.codecs import get_codec
from dtrain.errors import CodecError, PeerTimeout, PeerUnavailable, RejectCode, TransportError
from dtrain.protocol import BucketMean, BucketState, RoundPlan
from dtrain.rounds import error_feedback
from dtrain.rounds.fanout import Fanout
from dtrain.rounds.history import AppliedMean, MeanHistory
from dtrain.rounds.means import checked_mean, encode_mean
from dtrain.rounds.member import MemberRound, Phase
from dtrain.rounds.owner import BucketReduction, OpenRound
from dtrain.rounds.pulls import MeanPulls
from dtrain.rounds.recovery import Recovery, repair_window_s
from dtrain.rounds.reduce import Reduce
from dtrain.rounds.serving import PeerSide, _Owned
from dtrain.rounds.sitelog import SiteLog
from dtrain.rounds.types import BucketOutcome, RoundConfig, RoundResult, compact_senders
from dtrain.state import GlobalState
from dtrain.transports.base import Transport
from dtrain.transports.pacing import Pacer, pace_rate_Bps

__all__ = ["RoundConfig", "RoundResult", "RoundEngine"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Run:
    """What one ``run_round`` at this site carries from step to step."""

    plan: RoundPlan
    owners: list[str]  # per bucket; "" for a bucket outside this round (a fragment round)
    active: tuple[int, ...]  # the buckets this round synchronises, ascending
    owned: _Owned
    member: MemberRound  # the member side: each bucket's mean, owner, outcome (under `lock` while threads pull)
    res: RoundResult
    contribute: bool
    t0: float
    opened: float  # when the round's deadlines count from (the plan's formation, or t0)
    bytes0: tuple[int, int]
    pacer: Pacer | None = None  # a fragment round's send budget (pace_window_s); None: unpaced
    tokens: int = 0  # this site's token claim, on every contribution it sends (0: none)
    payloads: dict[tuple[int, int], bytes] = field(default_factory=dict)  # lossy codec: what this site sent
    settled: dict[int, torch.Tensor] = field(default_factory=dict)  # residuals the encode settled in place
    encoded: dict[int, tuple[torch.Tensor, Any]] = field(default_factory=dict)  # taken from _encoded, not yet cut
    fan: "Fanout | None" = None  # the pushes or the mean pulls while they run (under `lock`)
    lock: threading.Lock = field(default_factory=threading.Lock)  # res counters written from threads

    @property
    def round(self) -> int:
        return self.plan.round

    def add(self, **amounts: float) -> None:
        with self.lock:
            for k, v in amounts.items():
                setattr(self.res, k, getattr(self.res, k) + v)


class RoundEngine(PeerSide, Reduce, Recovery):
    """One site's round engine and peer handler.

    Args:
        site_id: this site's id (as in the plans).
        state: θ, outer optimizers and residuals.
        transport: how to reach peers; ``start()`` is called by :meth:`start`.
        config: see :class:`RoundConfig`.
    """

    def __init__(
        self, site_id: str, state: GlobalState, transport: Transport, config: RoundConfig | None = None
    ) -> None:
        self.site_id = site_id
        self.state = state
        self.transport = transport
        self.config = config or RoundConfig()
        self.codec = get_codec(self.config.codec)
        self.bcodec = get_codec(self.config.broadcast_codec or self.config.codec)
        self.address: str | None = None
        self.log = SiteLog(log, site_id)
        self._cv = threading.Condition()
        self._open: dict[int, _Owned] = {}
        self._runs: dict[int, _Run] = {}  # the rounds this site runs now, member side (under _cv)
        self._means: dict[tuple[int, int], BucketMean] = {}
        self._bres: dict[int, torch.Tensor] = {}  # broadcast-side error feedback per owned bucket
        self._skipped: dict[int, str] = {}  # rounds this site was a member of and will not run (skip_round)
        self._voided: set[int] = set()  # of those, the ones it passed as void (void_round)
        # bucket -> (the residual it settled, its body): encoded ahead by add_pseudo_gradient, not
        # yet taken by a run_round (dtrain/rounds/reduce.py); under _cv
        self._encoded: dict[int, tuple[torch.Tensor, Any]] = {}
        self._reject_streak: dict[str, int] = {}
        self._banned: set[str] = set()
        # Test-only fault injection: called as fault_hook(phase, round) at
        # "before_push", "mid_push" (after the first chunk to a remote owner) and "before_pull";
        # and as fault_hook("serve_state", bucket) before serving a peer's state pull of a bucket.
        self.fault_hook: "Callable[[str, int], None] | None" = None
        self._gen = torch.Generator().manual_seed(
            int.from_bytes(hashlib.blake2b(site_id.encode(), digest_size=4).digest(), "big")
        )
        # Transport counters when the previous round's result was taken. A round's
        # bytes are everything since then: an owner serves a late peer's mean pull (and
        # receives early pushes) outside its own run_round, and those bytes are real.
        self._bytes_mark: tuple[int, int] | None = None
        self._wire_ratio = 1.0  # encoded / fp32 bytes of the last round (a paced round's estimate)
        self.last_pacer: Pacer | None = None  # the last paced round's pacer (its counts: tests, logs)
        self._site_pacer: Pacer | None = None  # shared by the paced rounds (rate set per round)
        # Who pulled which of this site's means, per round (what DiLoCo.close() waits for).
        self.mean_pulls = MeanPulls()
        # The last rounds' applied means, for a site behind to replay (dtrain.rounds.catchup).
        self.history = MeanHistory(self.config.history_rounds, self.config.history_bytes)
        self.full_round_tokens = 0  # what a site trains in a full round (DiLoCo sets it): the claim bound
        # a site group's rank j (DiLoCo sets it): which members hold the extra buckets (assign_owners)
        self.owner_rotation: int | None = None
        self.unrepaired: list[int] = []  # the last round's buckets owned elsewhere left STALE (θ_b unlike the owner's)
        # Called (no arguments, from any thread; must not block) when a mean is published
        # or a round opens or closes here: the gRPC server wakes the PullMean calls that
        # wait for a bucket as coroutines (PeerSide.poll_pull_mean).
        self.mean_listeners: "list[Callable[[], None]]" = []
        # Called with a site the data path found gone (push refused, stream broken);
        # the Group reports it to the rendezvous, which confirms it for later rounds.
        self.on_unreachable: "Callable[[str], None] | None" = None
        # The site's training position at the start of its next round (DiLoCo sets it):
        # called with index len(state), it gives the answer of a PullState of that bucket
        # index (``state.position_state``; None: no position), what a joiner heals from.
        self.position_source: "Callable[[int], BucketState | None] | None" = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        self.address = self.transport.start(self)
        # Round 0's bytes include what arrived before it started (a faster peer's push).
        self._bytes_mark = (self.transport.bytes_sent(), self.transport.bytes_received())
        return self.address

    def stop(self, grace_s: float = 1.0) -> None:
        self.transport.stop(grace_s)

    # ------------------------------------------------------------------ site: one round
    def start_round(
        self,
        plan: RoundPlan,
        contribute: bool = True,
        buckets: Sequence[int] | None = None,
        *,
        pace_window_s: float | None = None,
        tokens: int = 0,
    ) -> "cf.Future[RoundResult]":
        """Run :meth:`run_round` in a background thread; returns its future."""
        ex = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"round-{plan.round}")
        fut = ex.submit(self.run_round, plan, contribute, buckets, pace_window_s=pace_window_s, tokens=tokens)
        ex.shutdown(wait=False)
        return fut

    def run_round(
        self,
        plan: RoundPlan,
        contribute: bool = True,
        buckets: Sequence[int] | None = None,
        *,
        pace_window_s: float | None = None,
        tokens: int = 0,
    ) -> RoundResult:
        """Run round ``plan.round``; the residuals must already hold Δ + residual.

        Before calling, the caller adds this round's pseudo-gradient Δ_b into
        ``state.residuals[b]`` (see :meth:`add_pseudo_gradient`). On return, θ
        holds the new global parameters for every bucket whose mean arrived (or
        was repaired); buckets whose owner died keep θ_b (alike on every
        survivor) and this site's contribution stays in its residual. Each
        bucket's :class:`BucketOutcome` is in ``RoundResult.bucket_outcome``.

        Never raises for peer failures: they are recorded in the result. Returns
        after the broadcast deadline + the repair window (``RoundConfig.repair_timeout_s``, or
        derived from the plan: :meth:`_repair_timeout_s`) at the latest.

        Args:
            plan: the round plan from the rendezvous (this site must be a member).
            contribute: False to take part without sending (e.g. non-finite Δ).
            buckets: the buckets this round synchronises (a fragment of Streaming
                DiLoCo, arXiv 2501.18512; every member must pass the same ones);
                None: all. Owners are assigned over these buckets only; the others
                are neither sent, applied nor settled, and their ``bucket_round``
                advances unchanged at the close (θ_b reflects this round: it had
                nothing for b). ``RoundResult.bucket_outcome`` then has one entry per
                bucket of ``RoundResult.buckets``.
            pace_window_s: spread what this site sends in the round (its chunk pushes
                and the means it serves) over this many seconds from the round's start
                (a Streaming DiLoCo round overlapping τ inner steps): a send-rate budget
                of the estimated bytes / the window (:meth:`_pacer`); a send that would
                be due after the reduce / broadcast deadline leaves unpaced. None: unpaced.
            tokens: tokens (samples) this site trained since its last round of these buckets:
                its claim on every contribution (its weight where ``token_weighted``); 0: none.
        """
        try:
            run = self._open_round(plan, contribute, buckets, tokens)
        except BaseException:
            self._unsettle_ahead(range(len(self.state)) if buckets is None else buckets)
            raise
        try:
            self._adopt_ahead(run)  # what add_pseudo_gradient encoded ahead: this run's to send and settle
            if pace_window_s is not None:
                run.pacer = run.owned.pacer = self.last_pacer = self._pacer(run, pace_window_s)
            finalizer = threading.Thread(
                target=self._finalize_loop, args=(run,), name=f"finalize-{run.round}", daemon=True
            )
            finalizer.start()
            self._reduce(run)
            run.res.reduce_s = time.monotonic() - run.opened
            self._broadcast(run)
            finalizer.join(timeout=max(0.0, run.owned.books.broadcast_until - time.monotonic()) + 1.0)
            self._late_pulls(run)
            run.res.means_s = time.monotonic() - run.opened
            self._apply_and_verify(run)
            self._repair(run)
        finally:  # even on an error: a residual the encode settled in place is settled or restored
            self._settle_residuals(run)
        return self._close(run)

    def _open_round(self, plan: RoundPlan, contribute: bool, buckets: Sequence[int] | None, tokens: int) -> _Run:
        """Step 1: the owner-side books of this round, registered for peers' requests. The
        deadlines count from the plan's formation when the plan says when that was
        (``RoundPlan.formed_local_s``: a site that read it late has less time), else from now."""
        t0 = time.monotonic()
        opened = t0 if plan.formed_local_s is None else min(t0, plan.formed_local_s)
        r = plan.round
        if self.site_id not in plan.site_ids:
            raise ValueError(f"{self.site_id} is not a member of round {r}: {plan.site_ids}")
        layout = self.state.layout
        active = tuple(range(len(layout))) if buckets is None else tuple(sorted(set(buckets)))
        if active and not 0 <= active[0] <= active[-1] < len(layout):
            raise ValueError(f"round {r}: buckets {list(active)} out of range [0, {len(layout)})")
        owners = [""] * len(layout)
        for b, ow in zip(active, assign_owners(len(active), plan.site_ids, rotate=self.owner_rotation)):
            owners[b] = ow
        books = OpenRound(
            plan=plan,
            owners=owners,
            site_id=self.site_id,
            chunks=[b.chunks for b in layout.buckets],
            aggregation=self.config.aggregation,
            opened_at=opened,
            tokens=tokens if contribute else 0,
            full_round_tokens=self.full_round_tokens,
        )
        owned = _Owned(books)
        member = MemberRound(
            plan=plan,
            owners=owners,
            site_id=self.site_id,
            num_chunks=[len(b.chunks) for b in layout.buckets],
            opened_at=opened,
        )
        self.mean_pulls.expect(
            r,
            buckets=books.mine,
            pullers=[s for s in plan.site_ids if s != self.site_id],
            until=books.broadcast_until,
            serve_until=books.broadcast_until + repair_window_s(self.config.repair_timeout_s, plan),
        )
        res = RoundResult(
            round=r,
            members=plan.site_ids,
            owned_buckets=len(books.mine),
            contributed=contribute,
            buckets=list(active),
            reduce_timeout_s=plan.reduce_timeout_s,
            broadcast_timeout_s=plan.broadcast_timeout_s,
            deadline_reason=plan.deadline_reason,
            tokens=tokens,
        )
        bytes0 = self._bytes_mark or (self.transport.bytes_sent(), self.transport.bytes_received())
        with self._cv:
            self._open[r] = owned
            # Means of earlier rounds were kept only for peers' late pulls; every
            # member of this round has finished those rounds, so drop them.
            for key in [k for k in self._means if k[0] < r]:
                del self._means[key]
            self._cv.notify_all()
        self._means_changed()
        # the datagram path: key, buffers, mean pushes ("" owns a bucket outside a fragment round)
        self.transport.begin_round(plan, owners, self.site_id)
        run = _Run(
            plan=plan,
            owners=owners,
            active=active,
            owned=owned,
            member=member,
            res=res,
            contribute=contribute,
            t0=t0,
            opened=opened,
            bytes0=bytes0,
            tokens=tokens,
        )
        with self._cv:
            self._runs[r] = run
            if plan.reduce_timeout_s > 0:
                self._last_reduce_timeout_s = plan.reduce_timeout_s  # plan_wait_s's derived value
        return run

    def _pacer(self, run: _Run, window_s: float) -> Pacer:
        """The site's pacer at this round's rate: (fp32 bytes of the chunks it pushes + of the
        means it serves, times the last round's encoded/fp32 ratio) spread over ``window_s``.

        One pacer per site, its rate reset per paced round: the means of the previous round
        still served to a late puller share the budget with this round's pushes (they
        overlap when τ = H/F), so the two never add up to twice the rate."""
        layout, me = self.state.layout, self.site_id
        push = sum(4 * layout.buckets[b].numel for b in run.active if run.owners[b] != me)
        serve = sum(4 * layout.buckets[b].numel for b in run.owned.books.mine) * (len(run.plan.site_ids) - 1)
        rate = pace_rate_Bps((push + serve) * self._wire_ratio, window_s)
        self.log.debug("round %d: paced at %.2f MB/s over %.2f s", run.round, rate / 1e6, window_s)
        if self._site_pacer is None:
            self._site_pacer = Pacer.of_Bps(rate)
        else:
            self._site_pacer.set_rate(rate * 8.0 / 1e6)
        return self._site_pacer

    # ------------------------------------------------------------------ owner: finalize
    def _finalize_loop(self, run: _Run) -> None:
        """Owner side (its own thread): publish each owned bucket's mean as soon as
        it is due (complete, or every remaining one at the reduce deadline)."""
        owned, books = run.owned, run.owned.books
        while True:
            with owned.cv:
                closing = books.due(time.monotonic())
                while closing is None and not books.all_closed:
                    owned.cv.wait(max(0.0, books.finalize_at - time.monotonic()))
                    closing = books.due(time.monotonic())
                if closing is None:
                    break
                books.close(closing.buckets)
            self.log.debug("round %d: finalizing buckets %s: %s", run.round, list(closing.buckets), closing.reason)
            self._publish(run, closing.buckets)
        with owned.cv:
            run.res.reduce_arrived_fraction = books.reduce_arrived_fraction
            run.res.reduce_live_fraction = books.reduce_live_fraction
        owned.published.set()
        with self._cv:
            self._cv.notify_all()

    def _publish(self, run: _Run, buckets: Iterable[int]) -> None:
        """Finalize closed buckets: encode each mean, apply it here, make it pullable."""
        owned, r = run.owned, run.round
        for b in buckets:
            reductions = owned.books.finalize(b)
            self._note_dropped(run, b, reductions)
            before = self.state.checksum(b)
            if not reductions.complete:
                # Some chunk got nothing at all: nobody applies this bucket and nobody's
                # contribution counts as included, so it stays in every residual.
                bm = BucketMean(
                    round=r, bucket=b, owner=self.site_id, chunks=(), checksum_before=before, checksum_after=before
                )
                self.log.warning("round %d: bucket %d %s: a chunk has no contributions", r, b, BucketOutcome.EMPTY)
            else:
                t = time.perf_counter()
                bres = self._mean_residual(b)
                if len(run.plan.site_ids) > 1:  # kept until a member takes the mean (the commit rule)
                    owned.rollback[b] = (self.state.snapshot_bucket(b), None if bres is None else bres.clone())
                chunks, full = encode_mean(
                    self.bcodec, self.state.layout.buckets[b], reductions, residual=bres, generator=self._gen
                )
                t2 = time.perf_counter()
                run.add(encode_s=t2 - t)
                after = self.state.apply_mean(b, full)  # decodes an undecoded mean in the step's pass
                run.add(decode_s=time.perf_counter() - t2)
                bm = BucketMean(
                    round=r, bucket=b, owner=self.site_id, chunks=chunks, checksum_before=before, checksum_after=after
                )
            with self._cv:
                self._means[(r, b)] = bm
                self.state.bucket_round[b] = r + 1
                self._cv.notify_all()
            owned.done[b].set()
            self._means_changed()

    def _mean_residual(self, b: int) -> torch.Tensor | None:
        """The owner's broadcast error feedback of bucket ``b`` (None when off)."""
        if not self.config.broadcast_error_feedback or self.bcodec.lossless:
            return None
        return self._bres.setdefault(b, torch.zeros(self.state.layout.buckets[b].numel))

    def _note_dropped(self, run: _Run, b: int, reductions: BucketReduction) -> None:
        """Count contributions the robust options dropped at finalize as rejected."""
        for c, dropped in reductions.dropped.items():
            for s, why in dropped.items():
                with run.owned.cv:
                    run.owned.books.dropped.add(s)
                    example = run.owned.books.reject(s, RejectCode.INVALID_ARGUMENT, why)
                (self.log.warning if example else self.log.debug)(
                    "round %d: dropped contribution of %s to b%d c%d: %s", run.round, s, b, c, why
                )

    def member_unreachable(self, run: _Run, site_id: str, why: str) -> None:
        """The data path found ``site_id`` gone in this round (a refused connection,
        UNAVAILABLE after the retries): stop waiting for its contributions, and for
        the means of the buckets it owns (they will not come: no pull waits for
        them, they are OWNER_LOST here). Later rounds: the rendezvous decides."""
        with run.lock:
            if not run.member.member_unreachable(site_id):
                return
        self.log.warning("round %d: %s unreachable: %s", run.round, site_id, why)
        self.members_lost([site_id], round=run.round, why=f"unreachable ({why})")
        self._note_unreachable(site_id)

    def members_lost(self, site_ids: Iterable[str], *, round: int | None = None, why: str = "") -> frozenset[str]:
        """:meth:`PeerSide.members_lost` (stop waiting for their contributions), and on the
        member side stop waiting for the means they own: their pulls in flight are given up
        (:meth:`_broadcast`) instead of waiting out the broadcast deadline."""
        site_ids = list(site_ids)
        changed = super().members_lost(site_ids, round=round, why=why)
        self._owners_lost(site_ids, round)
        return changed

    # ------------------------------------------------------------------ site: broadcast
    def _broadcast(self, run: _Run) -> None:
        """Step 3: pull the means of the buckets others own, until the broadcast deadline.

        The pulls of an owner declared lost meanwhile (:meth:`members_lost`: the rendezvous
        holds it dead, or rank 0's notice) are given up at once instead of at the deadline (a
        stopped owner's kernel still accepts the call): those buckets go MISSING with their
        owner lost, so the late pulls ask the other members and, if none has the mean, every
        survivor keeps θ_b alike (the owner withdraws a mean no member took: the commit rule)."""
        if self.fault_hook is not None:
            self.fault_hook("before_pull", run.round)
        t = time.perf_counter()
        fan: Fanout[int, tuple[int, BucketMean | None, str]] = Fanout(
            lambda b: self._pull_from_owner(run, b),
            run.member.remote,
            self.config.num_pull_threads,
            f"pull-{run.round}",
        )
        for b, answer in self._wait_fanout(run, fan, run.member.broadcast_until, lambda b: run.owners[b], "pull"):
            if isinstance(answer, BaseException):  # a bug in a transport: a missing mean, never a hang
                answer = (b, None, repr(answer))
            with run.lock:
                if run.member.phase(b) is not Phase.AWAITING:  # given up (_wait_fanout)
                    continue
                if answer[1] is not None:
                    run.member.mean_arrived(b, answer[1])
                else:
                    run.member.mean_missing(b, answer[2])
        run.add(network_s=time.perf_counter() - t)

    def _wait_fanout(
        self, run: _Run, fan: "Fanout", deadline: float, owner_of: Callable[[object], str], what: str
    ) -> list[tuple[object, object]]:
        """Wait for the pushes or pulls of ``fan`` (keys: owners, or buckets whose owner is
        ``owner_of(key)``); returns the answers ``(key, result or exception)``. Those to an
        owner declared lost meanwhile (:meth:`_owners_lost` wakes the wait) are given up at
        once (:meth:`Fanout.wait`). A given-up pull's bucket goes MISSING: its late pull asks
        the other members."""

        def given_up(key: object, late: bool) -> None:
            owner = owner_of(key)
            with run.lock:
                run.res.calls_given_up += 1
                if what == "pull":
                    run.member.mean_missing(key, "no answer" if late else f"owner {owner} lost while pulled from")
            self.log.info(
                "round %d: %s %s given up: owner %s %s", run.round, what, key, owner, "late" if late else "lost"
            )

        with run.lock:
            run.fan = fan
        fan.wake()  # an owner declared lost before run.fan was set: looked at once
        answers = fan.wait(deadline, lambda key: owner_of(key) in run.member.unreachable, given_up)
        with run.lock:
            run.fan = None
        for key, answer in answers:
            if isinstance(answer, BaseException):
                self.log.error("round %d: %s %r failed: %r", run.round, what, key, answer)
        return answers

    def _owners_lost(self, site_ids: Iterable[str], round: int | None) -> None:
        """Members declared lost (:meth:`members_lost`): in the rounds this site runs (or
        ``round``), their buckets whose mean has not arrived are owner-lost and their pulls
        in flight are given up (:meth:`_broadcast`)."""
        with self._cv:
            runs = [run for r, run in self._runs.items() if round is None or r == round]
        for run in runs:
            with run.lock:
                lost = [s for s in site_ids if s in run.plan.site_ids and s != self.site_id]
                for s in lost:
                    run.member.member_unreachable(s)
                if lost and run.fan is not None:
                    run.fan.wake()

    def _pull_from_owner(self, run: _Run, b: int) -> tuple[int, BucketMean | None, str]:
        owner = run.owners[b]
        with run.lock:
            left, why = run.member.pull_decision(b, time.monotonic())
        if left <= 0:
            return b, None, why
        try:
            addr = run.plan.address_of(owner)
            # our θ_b checksum: if stale, the owner waits at its close for our repair too
            have = self.state.checksum(b) if self.config.repair else ""
            m = self.transport.pull_mean(addr, run.round, b, requester=self.site_id, timeout_s=left, have_checksum=have)
            return b, m, ""
        except PeerUnavailable as e:
            self.member_unreachable(run, owner, f"mean pull refused: {e}")
            return b, None, str(e)
        except PeerTimeout as e:
            # No answer by the broadcast deadline (owner stopped, hung or far behind):
            # treated like a lost owner for this round, so that no late pull or repair
            # waits on it again and the round ends at its deadline. A timeout well
            # before the deadline is a lost reply (the in-process transport's
            # pull_loss): the owner is alive, so the bucket is retried and repaired.
            heard = self.config.repair and owner in self.mean_pulls.heard_from(run.round)
            with run.lock:
                if run.member.phase(b) is Phase.AWAITING:  # not given up meanwhile (_wait_fanout)
                    run.member.pull_timed_out(b, time.monotonic(), owner_heard=heard)
            return b, None, str(e)
        except TransportError as e:
            if e.code is RejectCode.ABORTED:  # the owner withdrew the mean: nobody applies it
                with run.lock:
                    run.member.owner_lost(b)
            return b, None, str(e)

    # ------------------------------------------------------------------ site: apply, verify
    def _apply_and_verify(self, run: _Run) -> None:
        """Step 5: apply every mean that arrived; give each bucket its outcome (``run.member``)."""
        r = run.round
        for b in run.active:
            if run.owners[b] == self.site_id:
                with self._cv:
                    m = self._means.get((r, b))
                if m is not None and b in run.owned.rollback and not self._commit(run, b):
                    continue
                # published by the finalizer (which applied it); unpublished only if it overran
                run.member.published(b, m)
                continue
            self._apply_remote(run, b)
        run.res.broadcast_arrived_fraction = run.member.broadcast_arrived_fraction

    def _apply_remote(self, run: _Run, b: int) -> None:
        """Apply the mean of bucket ``b`` (owned elsewhere), if it arrived; give it its outcome."""
        r, owner, member = run.round, run.owners[b], run.member
        m = member.mean(b)
        if m is None:
            with self._cv:
                self.state.bucket_round[b] = r + 1
            # OWNER_LOST: nobody got this mean, every survivor keeps θ_b alike; STALE: the
            # owner may have applied a mean we missed: repaired from it
            outcome = member.no_mean(b)
            self.log.warning("round %d: bucket %d %s: %s", r, b, outcome, member.why(b))
            return
        with self._cv:
            self._means[(r, b)] = m
        if not m.chunks:
            with self._cv:
                self.state.bucket_round[b] = r + 1
            member.empty(b)
            return
        before = self.state.checksum(b)
        stale_before = member.differs_before(b, before)
        if stale_before and self.config.repair:
            self._stale(run, b, f"differs from owner {owner} before applying")  # pulled whole
            return
        # Keep-stale (arXiv 2507.07114 §4.2) applies the mean to our own θ_b, so the
        # drift stays what was missed instead of growing every round.
        t = time.perf_counter()
        try:
            full = checked_mean(self.bcodec, self.state.layout.buckets[b], m)  # decoded by the step where it can
        except (CodecError, ValueError) as e:
            run.res.errors.append(f"bad mean b{b}: {e}")
            self._stale(run, b, f"bad mean from {owner}: {e}")
            return
        after = self.state.apply_mean(b, full)
        run.add(decode_s=time.perf_counter() - t)  # with the step, which decodes a checked mean in its pass
        with self._cv:
            self.state.bucket_round[b] = r + 1
        if member.applied(b, before=before, after=after) is BucketOutcome.STALE:
            self.log.warning("round %d: bucket %d %s: %s", r, b, BucketOutcome.STALE, member.why(b))

    def _stale(self, run: _Run, b: int, why: str) -> None:
        run.member.stale(b, why)
        self.log.warning("round %d: bucket %d %s: %s", run.round, b, BucketOutcome.STALE, why)

    # ------------------------------------------------------------------ site: residuals
    def _settle_residuals(self, run: _Run) -> None:
        """Step 7: error feedback; each chunk of each residual is consumed, reduced by
        the applied mean, or kept whole (:mod:`dtrain.rounds.error_feedback`)."""
        layout = self.state.layout
        self._cut_unsent(run)
        num_mine = num_included = 0
        for b in run.active:
            v = self.state.residuals[b]
            if v is None:
                continue
            chunks = layout.buckets[b].chunks
            senders, applied = run.member.mean_of(b)
            included = error_feedback.included_chunks(self.site_id, senders, len(chunks))
            if run.contribute:
                num_mine += len(chunks)
                num_included += sum(included)
            if not self.config.error_feedback:
                self.state.residuals[b] = None
                continue
            bad = error_feedback.settle_bucket(
                v,
                chunks,
                included,
                codec=self.codec,
                sent=lambda c, b=b: run.payloads[(b, c)],
                bcodec=self.bcodec,
                mean_payloads=None if applied is None else [ch.payload for ch in applied.chunks],
                settled_in_place=run.settled.pop(b, None) is v,  # (not when v was replaced since)
            )
            for c, e in bad:  # a bad mean was not applied here either
                self.log.warning("round %d: mean of b%d c%d undecodable, residual kept whole: %s", run.round, b, c, e)
        run.res.included_fraction = num_included / num_mine if num_mine else 1.0

    # ------------------------------------------------------------------ site: close
    def _close(self, run: _Run) -> RoundResult:
        """Step 8: account for rejections, exclude repeat offenders, finish the result."""
        res, books = run.res, run.owned.books
        res.count_outcomes(run.member.outcomes())
        self.unrepaired = run.member.to_repair()
        for b in run.active:
            if run.member.outcome(b) in (BucketOutcome.APPLIED, BucketOutcome.REPAIRED):
                res.mean_senders[str(b)] = compact_senders(run.member.mean_of(b)[0])
        with run.owned.cv:
            self._note_rejections(books)
            res.rejected = books.rejections.by_code()
            res.rejected_examples = books.rejections.example_reasons()
            res.rejected_senders = books.refused()
            res.lost_members = sorted(books.lost)
            res.claims, res.weight_refused = dict(books.claims), dict(books.refused_claims)
            res.trimmed = dict(sorted(books.trimmed.items()))
        if res.rejected:
            self.log.warning(
                "round %d: refused %d contribution(s) as owner: %s", run.round, books.rejections.total, res.rejected
            )
        self.history.close_round(run.round, self._applied_means(run))
        with self._cv:
            if len(run.active) < len(self.state):  # a fragment round: the other buckets pass it unchanged
                for b in set(range(len(self.state))) - set(run.active):
                    self.state.bucket_round[b] = run.round + 1
            self.state.rounds_applied = run.round + 1
            self._open.pop(run.round, None)
            self._runs.pop(run.round, None)
            self._cv.notify_all()
        self._means_changed()
        sent1, recv1 = self.transport.bytes_sent(), self.transport.bytes_received()
        res.bytes_sent, res.bytes_received = sent1 - run.bytes0[0], recv1 - run.bytes0[1]
        self._bytes_mark = (sent1, recv1)
        if res.encoded_fp32_bytes:  # the next paced round's estimate of its wire bytes
            self._wire_ratio = res.encoded_bytes / res.encoded_fp32_bytes
        res.total_s = time.monotonic() - run.t0
        res.wait_s = max(0.0, res.total_s - res.encode_s - res.decode_s - res.network_s)
        return res

    def _applied_means(self, run: _Run) -> dict[int, AppliedMean | None]:
        """What the round did to each bucket, for :attr:`history`: the mean the group applied
        (an owner's own, or the one that arrived; a site that was stale still knows it), None
        for unchanged (owner lost, empty, outside the fragment), or unknown (no mean here)."""
        out: dict[int, AppliedMean | None] = {}
        active = set(run.active)
        for b in range(len(self.state)):
            lrs = tuple(float(g["lr"]) for g in self.state.optimizers[b].param_groups)
            if b not in active or run.member.outcome(b) in (BucketOutcome.EMPTY, BucketOutcome.OWNER_LOST):
                out[b] = AppliedMean(None, lrs)
                continue
            if run.owners[b] == self.site_id:
                with self._cv:
                    m = self._means.get((run.round, b))
            else:
                m = run.member.mean(b)
            out[b] = AppliedMean(m, lrs) if m is not None and m.chunks else None
        return out
