"""One round (outer step) as a state machine, written against ``Transport``.

Phases (DESIGN.md, "One round"): reduce (each site streams Δ_b + residual_b,
encoded per chunk, to owner(b)); finalize (the owner averages per chunk over
what arrived and validated, unbiased; arXiv 2507.07114); broadcast (sites pull
the encoded means); apply (every site, the owner included, runs the outer
optimizer on the same decoded bytes); verify and repair (checksums against the
owner's; stale buckets are pulled whole).

:class:`RoundEngine` is one site's engine. It is also the site's
``PeerHandler``: it validates incoming contributions for the rounds it runs and
serves means and bucket state. ``run_round`` blocks; ``start_round`` runs it in
a background thread so a caller can overlap it with computation (the way
Streaming DiLoCo, arXiv 2501.18512, overlaps communication with τ inner steps).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import logging
import threading
import time
from dataclasses import replace
from typing import Callable, Iterable, Iterator

import torch

from dtrain.aggregation import ChunkAccumulator
from dtrain.buckets import assign_owners
from dtrain.codecs import get_codec
from dtrain.errors import (
    CodecError,
    PeerTimeout,
    PeerUnavailable,
    RejectCode,
    Rejected,
    StateTransferError,
    TransportError,
)
from dtrain.protocol import BucketMean, BucketState, Contribution, MeanChunk, RoundPlan
from dtrain.rounds.types import RoundConfig, RoundResult
from dtrain.state import GlobalState
from dtrain.transports.base import Transport

__all__ = ["RoundConfig", "RoundResult", "RoundEngine"]

log = logging.getLogger(__name__)

# Rejections that say the sender sent something wrong (and count towards excluding
# it); late, stale-round or not-a-member rejections are about timing or membership.
_SENDER_FAULTS = (RejectCode.INVALID_ARGUMENT, RejectCode.RESOURCE_EXHAUSTED, RejectCode.ALREADY_EXISTS)


class _OpenRound:
    """Owner-side bookkeeping of one round."""

    def __init__(self, plan: RoundPlan, owners: list[str], site_id: str, engine: "RoundEngine", t0: float) -> None:
        self.plan = plan
        self.owners = owners
        self.members = set(plan.site_ids)
        self.lost: set[str] = set()  # members the rendezvous declared dead during the round
        self.finished: set[str] = set()  # members whose transport said they sent everything
        self.finalize_at = t0 + plan.reduce_timeout_s
        self.broadcast_until = t0 + plan.broadcast_timeout_s
        layout = engine.state.layout
        cfg = engine.config.aggregation
        self.mine = [b for b, o in enumerate(owners) if o == site_id]
        self.acc: dict[tuple[int, int], ChunkAccumulator] = {
            (b, c): ChunkAccumulator(n, cfg) for b in self.mine for c, (_, n) in enumerate(layout.buckets[b].chunks)
        }
        self.expected = len(self.acc) * len(self.members)
        self.arrived = 0
        self.rejected: dict[str, int] = {}
        self.rejected_senders: set[str] = set()
        # Per owned bucket: contributions still expected, closed (no more accepted),
        # done (mean published). A bucket is finalized as soon as every member's
        # every chunk arrived, or at the reduce deadline.
        self.bucket_missing = {b: len(layout.buckets[b].chunks) * len(self.members) for b in self.mine}
        self.complete: list[int] = [b for b, m in self.bucket_missing.items() if m == 0]
        self.closed: set[int] = set()
        self.done = {b: threading.Event() for b in self.mine}
        self.final_digests: dict[tuple[int, int], dict[str, bytes]] = {}
        self.finalized = threading.Event()  # every owned bucket is closed
        self.published = threading.Event()  # every owned bucket's mean is available
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)


class RoundEngine:
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
        self._cv = threading.Condition()
        self._open: dict[int, _OpenRound] = {}
        self._means: dict[tuple[int, int], BucketMean] = {}
        self._bres: dict[int, torch.Tensor] = {}  # broadcast-side error feedback per owned bucket
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

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        self.address = self.transport.start(self)
        # Round 0's bytes include what arrived before it started (a faster peer's push).
        self._bytes_mark = (self.transport.bytes_sent(), self.transport.bytes_received())
        return self.address

    def stop(self, grace_s: float = 1.0) -> None:
        self.transport.stop(grace_s)

    @property
    def banned(self) -> frozenset[str]:
        return frozenset(self._banned)

    # ------------------------------------------------------------------ PeerHandler
    def _round_for(self, rnd: int, timeout_s: float) -> _OpenRound:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                o = self._open.get(rnd)
                if o is not None:
                    return o
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
        o = self._round_for(c.round, self.config.plan_wait_s)
        try:
            self._accept(o, c)
        except Rejected as e:
            with o.lock:
                o.rejected[e.reason] = o.rejected.get(e.reason, 0) + 1
                if e.code in _SENDER_FAULTS:
                    o.rejected_senders.add(c.sender)
            log.warning(
                "round %d: rejected chunk b%d c%d from %s: %s %s",
                c.round,
                c.bucket,
                c.chunk,
                c.sender,
                e.code,
                e.reason,
            )
            raise

    def _accept(self, o: _OpenRound, c: Contribution) -> None:
        if c.sender in self._banned:
            raise Rejected(
                RejectCode.PERMISSION_DENIED, f"{c.sender} is excluded after repeated rejected contributions"
            )
        if c.sender not in o.members:
            raise Rejected(RejectCode.PERMISSION_DENIED, f"{c.sender} is not a member of round {c.round}")
        layout = self.state.layout
        if not 0 <= c.bucket < len(layout):
            raise Rejected(RejectCode.INVALID_ARGUMENT, f"bucket {c.bucket} out of range [0, {len(layout)})")
        if o.owners[c.bucket] != self.site_id:
            raise Rejected(
                RejectCode.FAILED_PRECONDITION,
                f"bucket {c.bucket} is owned by {o.owners[c.bucket]}, not {self.site_id}",
            )
        chunks = layout.buckets[c.bucket].chunks
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
        if c.codec != self.codec.name:
            raise Rejected(RejectCode.INVALID_ARGUMENT, f"codec {c.codec!r} but this round uses {self.codec.name!r}")
        try:
            values = self.codec.decode(c.payload, numel=n)
        except CodecError as e:
            code = (
                RejectCode.RESOURCE_EXHAUSTED if "zstd" in str(e) or "bound" in str(e) else RejectCode.INVALID_ARGUMENT
            )
            raise Rejected(code, f"undecodable payload: {e}") from e
        digest = hashlib.blake2b(c.payload, digest_size=16).digest()
        with o.cv:
            if c.bucket in o.closed:
                if o.final_digests.get((c.bucket, c.chunk), {}).get(c.sender) == digest:
                    return  # an identical retry of a chunk the mean already counts
                raise Rejected(
                    RejectCode.FAILED_PRECONDITION,
                    f"round {c.round} bucket {c.bucket} is already finalized (late or stale contribution)",
                )
            if o.acc[(c.bucket, c.chunk)].add(c.sender, values, digest):
                o.arrived += 1
                if c.sender in o.lost or c.sender in o.finished:
                    return  # no longer awaited (members_lost, sender_done): counted in the mean, not in what is missing
                o.bucket_missing[c.bucket] -= 1
                if o.bucket_missing[c.bucket] == 0:
                    o.complete.append(c.bucket)
                    o.cv.notify_all()

    def members_lost(self, site_ids: Iterable[str]) -> None:
        """Stop waiting for contributions from ``site_ids`` in every round open here.

        Called with the sites the rendezvous holds dead (no heartbeat within its
        timeout, or left; ``HeartbeatInfo.dead``). For each owned bucket not yet
        finalized, the chunks those members have not sent no longer count as
        missing: a bucket that now lacks nothing else is finalized at once, with
        the contributions that did arrive (as at the reduce deadline), instead of
        waiting out the reduce deadline. Contributions a lost member still sends
        before its bucket is finalized are counted as usual; later ones are
        refused as late and stay in the sender's residual. Sites that are not
        members of a round, and this site itself, are ignored.
        """
        lost = set(site_ids) - {self.site_id}
        if not lost:
            return
        with self._cv:
            rounds = list(self._open.values())
        for o in rounds:
            with o.cv:
                new = (lost & o.members) - o.lost - o.finished
                if not new:
                    continue
                o.lost |= new
                for b in o.mine:
                    if b in o.closed:
                        continue
                    for c in range(len(self.state.layout.buckets[b].chunks)):
                        o.bucket_missing[b] -= sum(1 for s in new if s not in o.acc[(b, c)].senders)
                    if o.bucket_missing[b] == 0 and b not in o.complete:
                        o.complete.append(b)
                o.cv.notify_all()
            log.warning(
                "round %d: %s declared dead by the rendezvous: not waiting for their contributions",
                o.plan.round,
                ", ".join(sorted(new)),
            )

    def handle_sender_done(self, round: int, sender: str) -> None:
        """``sender`` sent everything it will send this site for ``round``.

        Called by a transport that knows (the datagram path, on the sender's
        SEND_END): the chunks of ``sender`` still missing were lost, not late, so
        they no longer count as missing and a bucket lacking nothing else is
        finalized at once instead of at the reduce deadline.
        """
        with self._cv:
            o = self._open.get(round)
        if o is None:
            return
        with o.cv:
            if sender == self.site_id or sender not in o.members or sender in o.lost or sender in o.finished:
                return
            o.finished.add(sender)
            for b in o.mine:
                if b in o.closed:
                    continue
                nchunks = len(self.state.layout.buckets[b].chunks)
                o.bucket_missing[b] -= sum(1 for c in range(nchunks) if sender not in o.acc[(b, c)].senders)
                if o.bucket_missing[b] == 0 and b not in o.complete:
                    o.complete.append(b)
            o.cv.notify_all()

    def handle_pull_mean(self, round: int, bucket: int, requester: str, timeout_s: float) -> BucketMean:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            m = self._means.get((round, bucket))
        if m is not None:
            return m
        o = self._round_for(round, min(timeout_s, self.config.plan_wait_s))
        if not 0 <= bucket < len(o.owners):
            raise Rejected(RejectCode.INVALID_ARGUMENT, f"bucket {bucket} out of range [0, {len(o.owners)})")
        if o.owners[bucket] != self.site_id:
            with self._cv:  # a peer asking us for a mean we may have cached
                m = self._means.get((round, bucket))
            if m is None:
                raise Rejected(RejectCode.NOT_FOUND, f"no mean for round {round} bucket {bucket} here")
            return m
        if not o.done[bucket].wait(max(0.0, deadline - time.monotonic())):
            raise PeerTimeout(f"round {round} bucket {bucket} not finalized within {timeout_s:.2f} s")
        with self._cv:
            m = self._means.get((round, bucket))
        if m is None:
            raise Rejected(RejectCode.NOT_FOUND, f"no mean for round {round} bucket {bucket} here")
        return m

    def handle_pull_state(self, bucket: int, requester: str) -> BucketState:
        if not 0 <= bucket < len(self.state):
            raise Rejected(RejectCode.INVALID_ARGUMENT, f"bucket {bucket} out of range [0, {len(self.state)})")
        if self.fault_hook is not None:
            self.fault_hook("serve_state", bucket)
        st = self.state.bucket_state(bucket)
        with self._cv:
            m = self._means.get((st.rounds_applied - 1, bucket))
        if m is None:
            return st
        # A site that missed this mean learns from a repair which of its chunks
        # the mean included (those are consumed, never sent again; DESIGN.md).
        return replace(
            st, extra={**st.extra, "mean_round": m.round, "mean_senders": [list(ch.senders) for ch in m.chunks]}
        )

    # ------------------------------------------------------------------ owner: finalize
    def _finalize(self, o: _OpenRound, res: RoundResult) -> None:
        """Owner side: publish each owned bucket's mean as soon as it is complete,
        and every remaining one at the reduce deadline."""
        while True:
            with o.cv:
                while not o.complete and time.monotonic() < o.finalize_at and len(o.closed) < len(o.mine):
                    o.cv.wait(max(0.0, o.finalize_at - time.monotonic()))
                if time.monotonic() >= o.finalize_at:
                    batch = [b for b in o.mine if b not in o.closed]
                else:
                    batch = [b for b in o.complete if b not in o.closed]
                o.complete.clear()
                for b in batch:
                    o.closed.add(b)
                    for c in range(len(self.state.layout.buckets[b].chunks)):
                        o.final_digests[(b, c)] = dict(o.acc[(b, c)]._digests)
                if len(o.closed) == len(o.mine):
                    o.finalized.set()
            self._finalize_buckets(o, res, batch)
            if o.finalized.is_set():
                break
        res.reduce_arrived_fraction = (o.arrived / o.expected) if o.expected else 1.0
        o.published.set()
        with self._cv:
            self._cv.notify_all()

    def _finalize_buckets(self, o: _OpenRound, res: RoundResult, buckets: list[int]) -> None:
        r = o.plan.round
        t_enc = 0.0
        for b in buckets:
            bucket = self.state.layout.buckets[b]
            means: list[tuple[int, torch.Tensor, tuple[str, ...]]] = []
            complete = True
            for c in range(len(bucket.chunks)):
                mean, senders, dropped = o.acc[(b, c)].finalize()
                for s, why in dropped.items():
                    o.rejected[why] = o.rejected.get(why, 0) + 1
                    o.rejected_senders.add(s)
                    log.warning("round %d: dropped contribution of %s to b%d c%d: %s", r, s, b, c, why)
                if mean is None:
                    complete = False
                    break
                means.append((c, mean, senders))
            before = self.state.checksum(b)
            if not complete:
                # Some chunk got nothing at all: nobody applies this bucket and nobody's
                # contribution counts as included, so it stays in every residual.
                bm = BucketMean(
                    round=r, bucket=b, owner=self.site_id, chunks=(), checksum_before=before, checksum_after=before
                )
                log.warning("round %d: bucket %d has a chunk with no contributions; not applied", r, b)
            else:
                t = time.perf_counter()
                full = torch.empty(bucket.numel, dtype=torch.float32)
                chunks = []
                use_bres = self.config.broadcast_error_feedback and not self.bcodec.lossless
                bres = self._bres.get(b) if use_bres else None
                src = torch.empty(bucket.numel, dtype=torch.float32)
                for c, mean, _ in means:
                    off, n = bucket.chunks[c]
                    src[off : off + n] = mean if bres is None else mean + bres[off : off + n]
                # one encoding pass per bucket (many small chunks on the datagram path)
                payloads = self.bcodec.encode_chunks(src, bucket.chunks, generator=self._gen)
                for (c, _, senders), payload in zip(means, payloads):
                    off, n = bucket.chunks[c]
                    mean = src[off : off + n]
                    dec = self.bcodec.decode(payload, numel=n)
                    if use_bres:
                        if bres is None:
                            bres = self._bres.setdefault(b, torch.zeros(bucket.numel))
                        bres[off : off + n] = mean - dec
                    full[off : off + n] = dec
                    chunks.append(
                        MeanChunk(
                            chunk=c, offset=off, numel=n, codec=self.bcodec.name, payload=payload, senders=senders
                        )
                    )
                t_enc += time.perf_counter() - t
                after = self.state.apply_mean(b, full)
                bm = BucketMean(
                    round=r,
                    bucket=b,
                    owner=self.site_id,
                    chunks=tuple(chunks),
                    checksum_before=before,
                    checksum_after=after,
                )
            with self._cv:
                self._means[(r, b)] = bm
                self.state.bucket_round[b] = r + 1
            with o.cv:
                for c in range(len(bucket.chunks)):
                    o.acc.pop((b, c), None)  # free memory
            o.done[b].set()
        res.encode_s += t_enc

    # ------------------------------------------------------------------ site: one round
    def start_round(self, plan: RoundPlan, contribute: bool = True) -> "cf.Future[RoundResult]":
        """Run :meth:`run_round` in a background thread; returns its future."""
        ex = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"round-{plan.round}")
        fut = ex.submit(self.run_round, plan, contribute)
        ex.shutdown(wait=False)
        return fut

    def run_round(self, plan: RoundPlan, contribute: bool = True) -> RoundResult:
        """Run round ``plan.round``; the residuals must already hold Δ + residual.

        Before calling, the caller adds this round's pseudo-gradient Δ_b into
        ``state.residuals[b]`` (see :meth:`add_pseudo_gradient`). On return, θ
        holds the new global parameters for every bucket whose mean arrived (or
        was repaired); buckets whose owner died keep θ_b (alike on every
        survivor) and this site's contribution stays in its residual.

        Never raises for peer failures: they are recorded in the result. Returns
        after the broadcast deadline + ``repair_timeout_s`` at the latest.

        Args:
            plan: the round plan from the rendezvous (this site must be a member).
            contribute: False to take part without sending (e.g. non-finite Δ).
        """
        t0 = time.monotonic()
        r = plan.round
        if self.site_id not in plan.site_ids:
            raise ValueError(f"{self.site_id} is not a member of round {r}: {plan.site_ids}")
        layout = self.state.layout
        owners = assign_owners(len(layout), plan.site_ids)
        o = _OpenRound(plan, owners, self.site_id, self, t0)
        res = RoundResult(round=r, members=plan.site_ids, owned_buckets=len(o.mine), contributed=contribute)
        sent0, recv0 = self._bytes_mark or (self.transport.bytes_sent(), self.transport.bytes_received())
        with self._cv:
            self._open[r] = o
            # Means of earlier rounds were kept only for peers' late pulls; every
            # member of this round has finished those rounds, so drop them.
            for key in [k for k in self._means if k[0] < r]:
                del self._means[key]
            self._cv.notify_all()
        self.transport.begin_round(plan, owners, self.site_id)  # datagram path: key, buffers, mean pushes
        finalizer = threading.Thread(target=self._finalize, args=(o, res), name=f"finalize-{r}", daemon=True)
        finalizer.start()

        # ---- reduce: encode per chunk and stream to owners
        if self.fault_hook is not None:
            self.fault_hook("before_push", r)
        payloads: dict[tuple[int, int], bytes] = {}
        enc_lock = threading.Lock()
        if contribute:
            by_owner: dict[str, list[int]] = {}
            for b, ow in enumerate(owners):
                by_owner.setdefault(ow, []).append(b)

            def chunks_for(bs: list[int], remote: bool = False) -> Iterator[Contribution]:
                first = True
                for b in bs:
                    v = self.state.residuals[b]
                    if v is None:
                        continue
                    t = time.perf_counter()
                    # one pass per bucket (many small chunks on the datagram path)
                    encoded = self.codec.encode_chunks(v, layout.buckets[b].chunks, generator=self._gen)
                    with enc_lock:
                        res.encode_s += time.perf_counter() - t
                    for c, ((off, n), payload) in enumerate(zip(layout.buckets[b].chunks, encoded)):
                        with enc_lock:
                            res.encoded_bytes += len(payload)
                            res.encoded_fp32_bytes += 4 * n
                            if not self.codec.lossless:
                                payloads[(b, c)] = payload
                        yield Contribution(
                            round=r,
                            bucket=b,
                            chunk=c,
                            offset=off,
                            numel=n,
                            codec=self.codec.name,
                            sender=self.site_id,
                            payload=payload,
                        )
                        if remote and first and self.fault_hook is not None:
                            self.fault_hook("mid_push", r)
                        first = False

            def push(ow: str, bs: list[int]) -> None:
                if ow == self.site_id:
                    for cn in chunks_for(bs):
                        try:
                            self._accept(o, cn)
                        except Rejected as e:
                            res.errors.append(f"own chunk b{cn.bucket} c{cn.chunk} rejected: {e}")
                    return
                t = time.perf_counter()
                try:
                    self.transport.push(
                        plan.address_of(ow),
                        chunks_for(bs, remote=True),
                        timeout_s=max(0.01, o.finalize_at - time.monotonic()),
                    )
                except TransportError as e:
                    res.errors.append(f"push to {ow}: {e}")
                    log.warning("round %d: push to %s failed: %s", r, ow, e)
                with enc_lock:
                    res.network_s += time.perf_counter() - t

            with cf.ThreadPoolExecutor(max_workers=max(1, min(8, len(by_owner)))) as ex:
                list(ex.map(lambda kv: push(*kv), by_owner.items()))

        # ---- broadcast: pull the means of the buckets others own
        got: dict[int, BucketMean] = {}

        owner_down: set[int] = set()  # buckets whose owner could not be reached at all

        def pull(b: int) -> tuple[int, BucketMean | None, str]:
            addr = plan.address_of(owners[b])
            try:
                left = o.broadcast_until - time.monotonic()
                if left <= 0:
                    return b, None, "broadcast deadline passed"
                return b, self.transport.pull_mean(addr, r, b, requester=self.site_id, timeout_s=left), ""
            except PeerUnavailable as e:
                owner_down.add(b)
                return b, None, str(e)
            except PeerTimeout as e:
                # No answer by the broadcast deadline (owner stopped, hung or far behind):
                # treated like a dead owner for this round, so that no late pull or repair
                # waits on it again and the round ends at its deadline. A timeout well
                # before the deadline is a lost reply (the in-process transport's
                # pull_loss): the owner is alive, so the bucket is retried and repaired.
                if o.broadcast_until - time.monotonic() <= max(0.05, 0.05 * plan.broadcast_timeout_s):
                    owner_down.add(b)
                return b, None, str(e)
            except TransportError as e:
                return b, None, str(e)

        remote = [b for b in range(len(layout)) if owners[b] != self.site_id]
        if self.fault_hook is not None:
            self.fault_hook("before_pull", r)
        t = time.perf_counter()
        missing: dict[int, str] = {}
        with cf.ThreadPoolExecutor(max_workers=self.config.num_pull_threads) as ex:
            for b, m, err in ex.map(pull, remote):
                if m is not None:
                    got[b] = m
                else:
                    missing[b] = err
        res.network_s += time.perf_counter() - t
        finalizer.join(timeout=max(0.0, o.broadcast_until - time.monotonic()) + 1.0)

        # late pulls: the owner once more (a lost reply), then members that may
        # hold the mean (owner slow or gone)
        if missing:
            late_until = time.monotonic() + min(1.0, self.config.repair_timeout_s)
            for b in list(missing):
                sources = [owners[b]] + [p.site_id for p in plan.members if p.site_id not in (self.site_id, owners[b])]
                for sid in sources:
                    if time.monotonic() > late_until:
                        break
                    if sid == owners[b] and b in owner_down:
                        continue
                    try:
                        m = self.transport.pull_mean(
                            plan.address_of(sid),
                            r,
                            b,
                            requester=self.site_id,
                            timeout_s=max(0.05, late_until - time.monotonic()),
                        )
                    except PeerUnavailable:
                        if sid == owners[b]:
                            owner_down.add(b)
                        continue
                    except TransportError:
                        continue
                    got[b] = m
                    missing.pop(b)
                    owner_down.discard(b)
                    break
        for b, why in missing.items():
            log.warning("round %d: no mean for bucket %d from %s: %s", r, b, owners[b], why)

        # ---- apply, verify, repair
        stale: list[int] = []
        missed: list[int] = []  # stale because its mean never arrived
        for b in remote:
            m = got.get(b)
            if m is None:
                with self._cv:
                    self.state.bucket_round[b] = r + 1
                if b in owner_down:
                    # Its owner is gone: nobody got this mean, every survivor keeps θ_b alike.
                    res.skipped_buckets += 1
                else:
                    # The owner may have applied a mean we missed: stale, repaired from it.
                    stale.append(b)
                    missed.append(b)
                continue
            with self._cv:
                self._means[(r, b)] = m
            if not m.chunks:
                res.skipped_buckets += 1
                with self._cv:
                    self.state.bucket_round[b] = r + 1
                continue
            if self.state.checksum(b) != m.checksum_before:
                log.warning("round %d: bucket %d differs from owner %s before applying: stale", r, b, owners[b])
                stale.append(b)
                if self.config.repair:
                    continue  # pulled whole below
                # Keep-stale (arXiv 2507.07114 §4.2): apply the mean to our own θ_b, so
                # the drift stays what was missed instead of growing every round.
            t = time.perf_counter()
            try:
                full = self._decode_mean(b, m)
            except (CodecError, ValueError) as e:
                log.warning("round %d: bad mean for bucket %d from %s: %s", r, b, owners[b], e)
                res.errors.append(f"bad mean b{b}: {e}")
                if b not in stale:
                    stale.append(b)
                continue
            res.decode_s += time.perf_counter() - t
            after = self.state.apply_mean(b, full)
            with self._cv:
                self.state.bucket_round[b] = r + 1
            if b in stale:
                continue
            if after != m.checksum_after:
                log.warning("round %d: bucket %d checksum after apply differs from owner %s: stale", r, b, owners[b])
                stale.append(b)
            else:
                res.applied_buckets += 1
        res.applied_buckets += sum(
            1 for b in o.mine if self._means.get((r, b)) is not None and self._means[(r, b)].chunks
        )
        res.skipped_buckets += sum(
            1 for b in o.mine if self._means.get((r, b)) is not None and not self._means[(r, b)].chunks
        )
        res.stale_buckets = len(stale)
        repaired_senders: dict[int, list[list[str]]] = {}
        if stale and self.config.repair:
            res.repaired_buckets = self._repair(plan, owners, stale, got, missed, repaired_senders)

        # ---- residuals (error feedback). A chunk that a finalized mean included is
        # consumed (less the codec's error). A chunk that was not included (lost, late,
        # rejected) keeps u − A, where A is the mean that was applied to that chunk: the
        # owner divided by the senders that arrived, so A already stood in for this
        # contribution once; keeping all of u would count it twice (a systematic
        # overshoot of ~p·(N−1)/N under chunk loss p). Summed over sites this makes
        # N·A = Σ_i u_i − Σ_i residual_i, so over rounds the applied means add up to
        # the true mean of every Δ, less what is still in the residuals. Where no mean
        # was applied (owner gone, empty chunk) u stays whole. A site that missed the
        # mean and was repaired learns from the owner which chunks were included, but
        # not A: a non-included chunk of such a bucket keeps u whole.
        mine_total = mine_in = 0
        for b in range(len(layout)):
            v = self.state.residuals[b]
            if v is None:
                continue
            chunks = layout.buckets[b].chunks
            m = self._means.get((r, b)) if owners[b] == self.site_id else got.get(b)
            applied: BucketMean | None = None
            if m is not None:
                senders = [ch.senders for ch in m.chunks]
                applied = m if len(m.chunks) == len(chunks) else None
            else:
                senders = repaired_senders.get(b, [])
            included = [c < len(senders) and self.site_id in senders[c] for c in range(len(chunks))]
            if contribute:
                mine_total += len(chunks)
                mine_in += sum(included)
            if not self.config.error_feedback:
                self.state.residuals[b] = None
                continue
            for c, (off, n) in enumerate(chunks):
                if included[c]:
                    if self.codec.lossless:
                        v[off : off + n] = 0.0
                    else:
                        v[off : off + n] -= self.codec.decode(payloads[(b, c)], numel=n)
                elif applied is not None:
                    try:
                        v[off : off + n] -= self.bcodec.decode(applied.chunks[c].payload, numel=n)
                    except CodecError as e:  # a bad mean was not applied here either
                        log.warning("round %d: mean of b%d c%d undecodable, residual kept whole: %s", r, b, c, e)
        res.included_fraction = mine_in / mine_total if mine_total else 1.0
        res.broadcast_arrived_fraction = (len(got) + len(o.mine)) / len(layout) if len(layout) else 1.0

        # ---- bookkeeping
        self._note_rejections(o)
        res.rejected = dict(o.rejected)
        res.lost_members = sorted(o.lost)
        with self._cv:
            self.state.rounds_applied = r + 1
            self._open.pop(r, None)
            self._cv.notify_all()
        sent1, recv1 = self.transport.bytes_sent(), self.transport.bytes_received()
        res.bytes_sent, res.bytes_received = sent1 - sent0, recv1 - recv0
        self._bytes_mark = (sent1, recv1)
        res.total_s = time.monotonic() - t0
        res.wait_s = max(0.0, res.total_s - res.encode_s - res.decode_s - res.network_s)
        return res

    def _decode_mean(self, b: int, m: BucketMean) -> torch.Tensor:
        bucket = self.state.layout.buckets[b]
        if len(m.chunks) != len(bucket.chunks):
            raise ValueError(f"mean has {len(m.chunks)} chunks, bucket {b} has {len(bucket.chunks)}")
        full = torch.empty(bucket.numel, dtype=torch.float32)
        for ch, (off, n) in zip(m.chunks, bucket.chunks):
            if (ch.offset, ch.numel) != (off, n):
                raise ValueError(f"mean chunk {ch.chunk} covers {ch.offset}+{ch.numel}, expected {off}+{n}")
            if ch.codec != self.bcodec.name:
                raise ValueError(f"mean codec {ch.codec!r}, expected {self.bcodec.name!r}")
            full[off : off + n] = self.bcodec.decode(ch.payload, numel=n)
        return full

    def _repair(
        self,
        plan: RoundPlan,
        owners: list[str],
        stale: list[int],
        got: dict[int, BucketMean],
        missed: list[int],
        senders_out: dict[int, list[list[str]]],
    ) -> int:
        """Pull stale buckets whole from their owner (or a member with the owner's checksum).

        A bucket whose mean this site never got (``missed``) is pulled from its owner
        only, and only a state that reflects this round's mean is taken; its
        ``mean_senders`` go to ``senders_out[b]`` (which chunks the mean included).
        """
        deadline = time.monotonic() + self.config.repair_timeout_s
        repaired = 0
        r = plan.round
        for b in stale:
            want = got[b].checksum_after if b in got else None
            if b in missed:
                sources = [owners[b]]
            else:
                sources = [owners[b]] + [m.site_id for m in plan.members if m.site_id not in (owners[b], self.site_id)]
            for src in sources:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    st = self.transport.pull_state(plan.address_of(src), b, requester=self.site_id, timeout_s=left)
                    theta, opt = self.state.decode_bucket_state(st)
                except (TransportError, StateTransferError) as e:
                    log.warning("repair of bucket %d from %s failed: %s", b, src, e)
                    continue
                if want is not None and st.checksum != want:
                    continue
                if b in missed:
                    ms = st.extra.get("mean_senders")
                    nchunks = len(self.state.layout.buckets[b].chunks)
                    if (
                        st.extra.get("mean_round") != r
                        or not isinstance(ms, list)
                        or len(ms) not in (0, nchunks)
                        or not all(isinstance(x, list) for x in ms)
                    ):
                        log.warning(
                            "repair of bucket %d from %s: its state does not reflect round %d's mean", b, src, r
                        )
                        continue
                    senders_out[b] = ms
                resid = self.state.residuals[b]
                self.state.load_bucket(b, theta, opt, st.rounds_applied)
                self.state.residuals[b] = resid
                repaired += 1
                log.info("repaired bucket %d from %s", b, src)
                break
        return repaired

    def _note_rejections(self, o: _OpenRound) -> None:
        for s in o.members:
            if s == self.site_id:
                continue
            if s in o.rejected_senders:
                self._reject_streak[s] = self._reject_streak.get(s, 0) + 1
                if self._reject_streak[s] >= self.config.max_consecutive_rejections and s not in self._banned:
                    self._banned.add(s)
                    log.error(
                        "excluding %s: contributions rejected in %d consecutive rounds", s, self._reject_streak[s]
                    )
            else:
                self._reject_streak[s] = 0

    # ------------------------------------------------------------------ helpers for callers
    def add_pseudo_gradient(self, tensors: list[torch.Tensor]) -> bool:
        """Set residual_b ← residual_b + (θ_b − local_b) for every bucket.

        Args:
            tensors: the model's current (local) tensors, as the layout expects.
        Returns:
            False, with every residual cleared, when any value is non-finite
            (the site then contributes nothing this round; DESIGN.md).
        """
        layout = self.state.layout
        tmp: torch.Tensor | None = None
        ok = True
        for b in range(len(layout)):
            n = layout.buckets[b].numel
            if tmp is None or tmp.numel() < n:
                tmp = torch.empty(n, dtype=torch.float32)
            local = layout.gather(b, tensors, out=tmp[:n])
            ref = self.state.theta[b].detach()
            low = [s for s in layout.buckets[b].segments if tensors[s.tensor_index].dtype != torch.float32]
            if low:
                # a bf16/fp16 model was reset to θ rounded to its dtype: measure Δ from there,
                # so rounding alone is not mistaken for progress.
                ref = ref.clone()
                for sg in low:
                    sl = slice(sg.bucket_offset, sg.bucket_offset + sg.numel)
                    ref[sl] = ref[sl].to(tensors[sg.tensor_index].dtype).float()
            delta = ref - local
            r = self.state.residuals[b]
            if r is None or not self.config.error_feedback:
                self.state.residuals[b] = delta
            else:
                r.add_(delta)
            if not bool(torch.isfinite(self.state.residuals[b]).all()):
                ok = False
        if not ok:
            log.error("non-finite pseudo-gradient or residual: dropped, this site contributes nothing this round")
            self.state.residuals = [None] * len(layout)
        return ok
