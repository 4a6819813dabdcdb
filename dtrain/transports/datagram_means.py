"""The means half of the datagram data path (:class:`~.datagram.DatagramTransport`).

* **Owner side**: as soon as a bucket it owns is final (its handler's
  ``handle_pull_mean`` returns), the owner pushes the mean to every member: a meta
  datagram (chunk count, checksums), the chunks, and a final meta, interleaved member
  by member and paced; it answers a member's NACK by re-sending the listed chunks (or
  the meta, or all of it) and counts a member's MEAN_ACK as a pull (``close()``). The
  receive thread decides what a NACK asks for as it arrives (not behind the dispatch
  thread's backlog of contributions); the repair thread (:meth:`_repair_loop`) seals and
  paces the answer, so a repair waiting on the pacer never holds up what arrives after it.
* **Member side**: :meth:`DatagramMeans.pull_mean` waits for a pushed mean, NACKs
  missing chunks at most ``max_nack_rounds`` times (the steps are
  :func:`~.datagram_round.mean_wait_decision`'s) and pulls over gRPC what is still
  missing ``fallback_reserve_s`` before the deadline.

:class:`DatagramMeans` is a mixin of :class:`~.datagram.DatagramTransport`: it uses the
transport's sockets, pacer, counters and config.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from typing import Any

from dtrain.errors import PeerUnavailable, TransportError
from dtrain.protocol import BucketMean, MeanChunk, made
from dtrain.transports.datagram_reorder import reorder_grace_s
from dtrain.transports.datagram_round import (
    MeanAssembly,
    RoundState,
    decode_meta,
    encode_meta,
    mean_wait_decision,
    senders_bitmap,
)
from dtrain.transports.datagram_wire import CODEC_WIRE_NAMES, NO_CODEC, Kind, codec_id

__all__ = ["DatagramMeans"]

log = logging.getLogger(__name__)

_META_COPY_FINAL = 1
_NACK_META = 0xFFFFFFFF  # in a NACK: send the meta again
_NACK_ALL = 0xFFFFFFFE  # in a NACK: send every chunk again (nothing of the mean arrived)
_NACK_COPIES = 3  # each NACK datagram leaves 3 times: all lost 0.1% at 10% loss (twice: 1%, once a round in 2)
_FINAL_META_COPIES = 3  # a mean's final meta leaves 3 times: lost, the member waits 2 x nack_idle_s to NACK
_MAX_REPAIRS_QUEUED = 256  # NACK answers waiting for the repair thread (past it: dropped, the member NACKs again)


def _mean_chunk(rs: RoundState, h: Any, payload: bytes, bitmap: bytes) -> MeanChunk:
    """The MeanChunk a MEAN datagram (or its reassembled fragments) carries: equal to
    ``MeanChunk(chunk=h.chunk, ...)``, made without the frozen dataclass's per-field
    ``object.__setattr__``."""
    return made(
        MeanChunk,
        chunk=h.chunk,
        offset=h.offset,
        numel=h.numel,
        codec=CODEC_WIRE_NAMES[h.codec],
        payload=payload,
        senders=rs.mean_senders(bitmap),
    )


class DatagramMeans:
    """Owner push and member assembly of bucket means (see the module docstring).

    The transport provides what these methods use: ``config``, ``_handler``, ``_grpc``,
    ``_opener``, ``_counts``, ``_body_max``, ``_reorder`` (each site's observed reordering: how long
    chunks a final meta overtook may still come) and the methods ``_count``, ``_round``,
    ``_send_batch``, ``_send_sock``, ``_send_ctl``, ``_parts``.
    """

    config: Any
    _stopped: threading.Event
    _handler: Any
    _grpc: Any
    _opener: Any
    _counts: dict[str, int]
    _body_max: int
    _reorder: Any
    _rtt: Any

    # ------------------------------------------------------------------ means: owner side
    def _push_means(self, rs: RoundState, mine: list[int]) -> None:
        threads = [threading.Thread(target=self._push_mean, args=(rs, b), daemon=True) for b in mine]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _push_mean(self, rs: RoundState, b: int) -> None:
        """Wait for bucket ``b``'s mean, then send it to every member once the means finalized
        before it have left: one bucket at a time, so the first is whole at its members (and
        NACKed, repaired) while the next is still on its way, instead of all finishing together
        at the end with every repair after them."""
        assert self._handler is not None
        try:
            m = self._handler.handle_pull_mean(rs.round, b, rs.site_id, max(0.0, rs.broadcast_until - time.monotonic()))
        except TransportError as e:
            log.warning("round %d: no mean of bucket %d to push: %s", rs.round, b, e)
            return  # it takes no turn
        with rs.cv:
            rs.published[b] = m
            ticket = rs.send_tickets
            rs.send_tickets += 1
            rs.cv.wait_for(lambda: rs.send_turn == ticket, timeout=max(0.0, rs.broadcast_until - time.monotonic()))
        dests = [i for i in range(len(rs.site_ids)) if i != rs.me]
        try:
            self._send_mean(rs, m, dests, list(range(len(m.chunks))), with_meta=True, final_copies=_FINAL_META_COPIES)
        finally:
            with rs.cv:
                rs.send_turn += 1
                rs.cv.notify_all()

    def _send_mean(
        self,
        rs: RoundState,
        m: BucketMean,
        dests: list[int],
        chunks: list[int],
        *,
        with_meta: bool,
        copies: int = 1,
        final_copies: int | None = None,
        repair: bool = False,
    ) -> None:
        """Meta, the chunks, final meta; to every dest, batch by batch, paced. Each batch is
        sealed once and the same datagrams go to every dest (each member's replay window is
        its own), so a mean costs one seal per chunk, not one per chunk and member.
        ``copies``: each chunk leaves that many times (separately sealed; the member keeps
        the first that arrives); the final meta ``final_copies`` times (default: ``copies``).
        ``repair``: the answer to a NACK, paced in the first class (with contributions, ahead
        of fresh means): a member waits on it at the end of the round."""
        meta = encode_meta(m)
        socks = {d: self._send_sock(rs.plan.members[d].address) for d in dests}
        batches: list[tuple[int, list, list]] = []
        if with_meta:
            batches.append((Kind.MEAN_META, [(m.bucket, 0, 0, 0, NO_CODEC, 0, 1)], [meta]))
        chunks = list(chunks) * copies  # the copies one whole pass apart
        heads: dict[tuple[str, ...], bytes] = {}  # senders -> bitmap: nearly every chunk has the same senders
        per = self._batch_datagrams  # mean chunks sealed and sent per call (one datagram each)
        for i in range(0, len(chunks), per):
            parts = []
            for c in chunks[i : i + per]:
                ch = m.chunks[c]
                head = heads.get(ch.senders)
                if head is None:
                    head = heads[ch.senders] = senders_bitmap(ch.senders, rs.site_ids)
                parts += self._parts(head, ch.payload, (m.bucket, c, ch.offset, ch.numel, codec_id(ch.codec)))
            batches.append((Kind.MEAN, [f for f, _ in parts], [b for _, b in parts]))
        finals = copies if final_copies is None else final_copies
        batches.append((Kind.MEAN_META, [(m.bucket, _META_COPY_FINAL, 0, 0, NO_CODEC, 0, 1)] * finals, [meta] * finals))
        for kind, fields, bodies in batches:
            sealed = rs.sealer.seal_many(kind, fields, bodies)
            if kind == Kind.MEAN:
                self._count(sent=sum(len(m.chunks[f[1]].payload) for f in fields if f[5] == 0) * len(dests))
            for d in dests:
                try:
                    if not self._send_batch(
                        rs, d, socks[d], sealed, rs.broadcast_until, contribution=False, first_class=repair
                    ):
                        log.warning("round %d: mean of bucket %d: past the broadcast deadline", rs.round, m.bucket)
                        return
                except PeerUnavailable as e:
                    log.debug("round %d: mean to %s: %s", rs.round, rs.site_ids[d], e)
            if kind == Kind.MEAN and not repair:
                with rs.lock:
                    rs.mean_left[m.bucket] = max(rs.mean_left.get(m.bucket, 0), fields[-1][1] + 1)

    def _answer_nack(self, rs: RoundState, h, body: bytes) -> None:
        """Queue the answer to a member's NACK of ``h.bucket`` (number ``h.chunk``) for the repair
        thread: the chunks it lists that already left (or all of them for ``_NACK_ALL``), the
        meta if asked. A member holds a valid key but is not trusted, so what one NACK can cost
        is bounded: numbers past ``max_nack_rounds`` (an honest member never sends them) and a
        NACK number's bodies asking for more than the whole mean and its meta are not answered
        (counted ``over_budget``); a NACK's copies (same number and body) are answered once."""
        with rs.lock:
            m = rs.published.get(h.bucket)
        if m is None or not body or len(body) % 4:
            return
        if not 1 <= h.chunk <= self.config.max_nack_rounds:
            self._opener.count("over_budget")
            return
        asked = struct.unpack(f"<{len(body) // 4}I", body)
        meta = _NACK_META in asked
        with rs.lock:
            # only what already left: the rest is still on its way (a NACK of a mean in progress)
            left = min(len(m.chunks), rs.mean_left.get(h.bucket, 0))
            wanted = list(range(left)) if _NACK_ALL in asked else list(dict.fromkeys(c for c in asked if c < left))
            ledger = rs.nacks_answered.setdefault((h.sender, h.bucket, h.chunk), {})
            if hash(body) in ledger:  # the NACK's second or third copy
                return
            cost = len(wanted) + meta
            over = sum(ledger.values()) + cost > len(m.chunks) + 1
            if not over:
                ledger[hash(body)] = cost
        if over:
            self._opener.count("over_budget")
            return
        if not wanted and not meta:
            return
        # what was lost once is re-sent nack_copies times (not a whole mean asked for again):
        # at loss p a NACK round then leaves p^copies of it missing, not p, and the member
        # needs fewer NACK rounds (each costs an RTT and a wait behind the owner's pacer)
        copies = 1 if _NACK_ALL in asked else self.config.nack_copies
        try:
            self._repairs.put_nowait((rs, m, h.sender, wanted, meta, copies))
        except queue.Full:  # a NACK flood: not answered; not spent either, so a later copy may be
            with rs.lock:
                ledger.pop(hash(body), None)
            self._opener.count("over_budget")
            return
        self._count(resent=len(wanted) * copies)

    def _repair_loop(self) -> None:
        """Repair thread: sends the NACK answers :meth:`_answer_nack` queued, in order."""
        while not self._stopped.is_set():
            try:
                job = self._repairs.get(timeout=0.1)
            except queue.Empty:
                continue
            self._send_repair(*job)

    def _run_queued_repairs(self) -> None:
        """Send every queued NACK answer now, in this thread (tests; a transport not started)."""
        while True:
            try:
                job = self._repairs.get_nowait()
            except queue.Empty:
                return
            self._send_repair(*job)

    def _send_repair(
        self, rs: RoundState, m: BucketMean, dest: int, chunks: list[int], meta: bool, copies: int
    ) -> None:
        try:
            self._send_mean(rs, m, [dest], chunks, with_meta=meta, copies=copies, repair=True)
        except Exception:  # a bug must not stop the repair thread
            log.exception("round %d: NACK answer for bucket %d failed", rs.round, m.bucket)

    def _answer_ack(self, rs: RoundState, h, body: bytes) -> None:
        """A member holds our whole mean of ``h.bucket``: it counts as pulled (``close()``), or,
        when the θ_b checksum it carries differs from the mean's ``checksum_before`` (a stale
        member, which repairs next), once the member pulled the bucket's state."""
        if not (h.bucket < len(rs.owners) and rs.owners[h.bucket] == rs.site_id) or len(body) not in (0, 16):
            self._opener.count("malformed")
            return
        delivered = getattr(self._handler, "handle_mean_delivered", None)
        if delivered is not None:
            delivered(rs.round, h.bucket, rs.site_ids[h.sender], body.hex())

    # ------------------------------------------------------------------ means: member side
    def _on_mean(self, rs: RoundState, h, body: bytes) -> None:
        if not (h.bucket < len(rs.owners) and rs.owners[h.bucket] == rs.site_ids[h.sender] and h.sender != rs.me):
            self._opener.count("malformed")
            return
        nbits = (len(rs.site_ids) + 7) // 8
        with rs.cv:
            ma = rs.mean_for(h.bucket)
            was = (ma.complete(), ma.final_meta_seen)
            ma.last_arrival = rs.owner_active[h.sender] = time.monotonic()
            if h.kind == Kind.MEAN_META:
                if ma.num_chunks is None:
                    ma.num_chunks, before, after = decode_meta(body)
                    ma.checksums = (before, after)
                ma.final_meta_seen = ma.final_meta_seen or h.chunk == _META_COPY_FINAL
            elif h.chunk in ma.chunks:
                self._counts["mean_duplicates"] += 1  # held already (a NACK's answer or its copy)
            elif h.codec >= len(CODEC_WIRE_NAMES) or len(body) < nbits:
                self._opener.count("malformed")
            else:
                whole = rs.add_fragment((Kind.MEAN, h.bucket, h.chunk), h.frag, h.nfrags, body[nbits:])
                if whole is False or (whole and not rs.charge(len(whole))):
                    self._opener.count("over_budget")
                elif whole is not None:
                    ma.chunks[h.chunk] = _mean_chunk(rs, h, whole, body[:nbits])
                    self._counts["received"] += len(whole)
            ack = self._settle_assembly(rs, ma, was)
        if ack:
            self._ack_mean(rs, h.sender, h.bucket, ma.have or "")

    def _on_mean_run(self, rs: RoundState, run: list[tuple[Any, bytes]]) -> None:
        """Whole mean chunks (one datagram each) of one bucket from one sender, in arrival order,
        as ``(header, body)``: what :meth:`_on_mean` does for each, under one lock
        (:meth:`_on_mean_cols`; a body shorter than the senders bitmap is malformed)."""
        h0, nbits = run[0][0], (len(rs.site_ids) + 7) // 8
        self._on_mean_cols(
            rs,
            h0.sender,
            h0.bucket,
            [h.chunk for h, _ in run],
            [h.offset for h, _ in run],
            [h.numel for h, _ in run],
            [h.codec for h, _ in run],
            [body[nbits:] for _, body in run],
            [rs.mean_senders(body[:nbits]) if len(body) >= nbits else None for _, body in run],
        )

    def _on_mean_cols(
        self,
        rs: RoundState,
        sender: int,
        bucket: int,
        chunks: list[int],
        offsets: list[int],
        numels: list[int],
        codecs: list[int],
        payloads: list,
        senders: list[tuple[str, ...] | None],
    ) -> int:
        """Whole mean chunks of ``bucket`` from member index ``sender``, in arrival order, as
        columns (row ``i``: chunk number, offset and numel in elements, wire codec id, codec
        payload as bytes or a read-only view, the site_ids its senders bitmap names or None for
        a body too short to carry one): what :meth:`_on_mean` does for each, under one lock.
        A sender that is not the bucket's owner (or is this site) sends nothing applied: every
        row counts ``malformed``; a chunk held already counts ``mean_duplicates``, an unknown
        codec or a missing bitmap ``malformed``, a chunk past the round's buffer budget
        ``over_budget``; none of those is applied. Returns the payload bytes kept."""
        if not (bucket < len(rs.owners) and rs.owners[bucket] == rs.site_ids[sender] and sender != rs.me):
            self._opener.count("malformed", len(chunks))
            return 0
        names, num_codecs, new = CODEC_WIRE_NAMES, len(CODEC_WIRE_NAMES), object.__new__
        received = over = dup = bad = 0
        with rs.cv:
            ma = rs.mean_for(bucket)
            was = (ma.complete(), ma.final_meta_seen)
            ma.last_arrival = rs.owner_active[sender] = time.monotonic()
            have = ma.chunks
            # the whole run within the round's budget: no row's charge can fail, so the run is
            # charged once below (else row by row, as the budget runs out)
            fits = rs.buffered_bytes + sum(map(len, payloads)) <= rs.max_buffer_bytes
            for c, off, num, cd, p, who in zip(chunks, offsets, numels, codecs, payloads, senders):
                if c in have:
                    dup += 1
                    continue
                if who is None or cd >= num_codecs:
                    bad += 1
                    continue
                if not fits and not rs.charge(len(p)):
                    over += 1
                    continue
                # made(MeanChunk, chunk=c, ...) with its fields stored one by one: 0.4 against
                # 1.2 µs a chunk (no keyword dict; tests/unit/test_datagram_recv.py compares
                # the chunks with MeanChunk's own constructor)
                mc = have[c] = new(MeanChunk)
                d = mc.__dict__
                d["chunk"], d["offset"], d["numel"], d["codec"], d["payload"], d["senders"] = (
                    c,
                    off,
                    num,
                    names[cd],
                    p,
                    who,
                )
                received += len(p)
            if fits:
                rs.buffered_bytes += received
            ack = self._settle_assembly(rs, ma, was)
        self._counts["received"] += received
        self._counts["mean_duplicates"] += dup  # held already (a NACK's answer or its copy): not applied twice
        if over:
            self._opener.count("over_budget", over)
        if bad:
            self._opener.count("malformed", bad)
        if ack:
            self._ack_mean(rs, sender, bucket, ma.have or "")
        return received

    def _unpin_means(self, rs: RoundState, blob: Any, runs: list[tuple[int, list[int]]]) -> None:
        """Give the chunks of ``runs`` (bucket, chunk numbers) that :meth:`~.datagram_recv.DatagramReceive._hand_on_means` kept as
        views of ``blob`` payloads of their own: when most of a batch was not kept (duplicates,
        refusals), a view would hold the whole batch's buffer for a few bytes charged to the
        round's budget, and a flood of copies could grow a member's memory past
        ``max_round_buffer_bytes`` (up to 256 times: a batch's rows)."""
        with rs.cv:
            for bucket, chunks in runs:
                ma = rs.means.get(bucket)
                for c in chunks if ma is not None else ():
                    mc = ma.chunks.get(c)
                    if mc is not None and type(mc.payload) is memoryview and mc.payload.obj is blob:
                        ma.chunks[c] = made(MeanChunk, **{**mc.__dict__, "payload": bytes(mc.payload)})

    def _settle_assembly(self, rs: RoundState, ma: MeanAssembly, was: tuple[bool, bool]) -> bool:
        """After arrivals (under ``rs.cv``): whether to acknowledge the mean now; wakes the waiters
        when what changes their next step early did (completion, the final meta)."""
        # Acknowledge only a mean this member returns: after it fell back to gRPC, a copy
        # completed by late datagrams is not applied, and an ACK would let the owner exit
        # before the gRPC pull was served (owner_lost here, applied at the owner)
        # and only once its pull_mean said the member's θ_b checksum (the ACK carries it)
        ack = ma.complete() and not ma.acked and not ma.fallback and ma.have is not None
        ma.acked = ma.acked or ack
        if (ma.complete(), ma.final_meta_seen) != was:
            # other arrivals move a waiter's wake-up later (mean_wait_decision), which it sees
            # when it wakes; a notify per datagram woke every bucket's waiter ~5,000 times a round
            rs.cv.notify_all()
        return ack

    def pull_mean(
        self, address: str, round: int, bucket: int, *, requester: str, timeout_s: float, have_checksum: str = ""
    ) -> BucketMean:
        # have_checksum travels in the MEAN_ACK: its owner counts acknowledgements, not pulls
        rs = self._round(round)
        pushed = (
            rs is not None
            and bucket < len(rs.owners)
            and rs.by_address.get(address) == rs.owners[bucket]
            and rs.owners[bucket] != rs.site_id
        )
        if not pushed:
            # not a round of this site's (a site catching up replays a closed one): the checksum
            # asks for "unchanged" answers too (PeerSide._past_mean)
            have = have_checksum if rs is None else ""
            m = self._grpc.pull_mean(
                address, round, bucket, requester=requester, timeout_s=timeout_s, have_checksum=have
            )
            if (
                rs is not None
                and bucket < len(rs.owners)
                and rs.owners[bucket] != rs.site_id
                and rs.by_address.get(address) == rs.owners[bucket]
            ):
                # the owner counts acknowledgements
                self._ack_mean(rs, rs.index[rs.owners[bucket]], bucket, have_checksum)
            return m
        assert rs is not None
        deadline = time.monotonic() + timeout_s
        fallback_at = max(time.monotonic(), deadline - self.config.fallback_reserve_s)
        with rs.cv:  # from now on the receive thread acknowledges it once complete; if it already is: here
            ma = rs.mean_for(bucket)
            ma.have = have_checksum
            ack = self._settle_assembly(rs, ma, (ma.complete(), ma.final_meta_seen))
        if ack:
            self._ack_mean(rs, rs.index[rs.owners[bucket]], bucket, have_checksum)
        got = self._await_mean(rs, address, bucket, fallback_at)
        if got is not None:
            return got
        self._count(fallback_pulls=1)
        log.info("round %d: mean of bucket %d incomplete over datagrams: pulled over gRPC", round, bucket)
        m = self._grpc.pull_mean(
            address, round, bucket, requester=requester, timeout_s=max(0.01, deadline - time.monotonic())
        )
        # acknowledged only once it arrived here: the owner's serve does not count (its reply can
        # be lost as the owner exits: owner_lost here, applied there)
        self._ack_mean(rs, rs.index[rs.owners[bucket]], bucket, have_checksum)
        return m

    def _ack_mean(self, rs: RoundState, owner: int, bucket: int, have_checksum: str) -> None:
        """Two MEAN_ACKs of ``bucket`` to ``owner``, carrying this member's θ_b checksum (16 bytes; none:
        empty): a lost pair only makes its ``close()`` wait to its bound."""
        body = bytes.fromhex(have_checksum) if len(have_checksum) == 32 else b""
        for copy in range(2):
            self._send_ctl(rs, owner, rs.sealer.seal(Kind.MEAN_ACK, body, bucket=bucket, chunk=copy))

    def _await_mean(self, rs: RoundState, address: str, bucket: int, fallback_at: float) -> BucketMean | None:
        """Wait for a pushed mean until ``fallback_at``, NACKing missing chunks; None: pull over gRPC
        (the steps are :func:`~.datagram_round.mean_wait_decision`'s)."""
        cfg = self.config
        owner = rs.index[rs.owners[bucket]]
        rto_s = self._rtt.rto_s(rs.owners[bucket])  # the path's measured round trip, overdue after
        # by then the owner finalized (its reduce deadline) and its first datagrams crossed the path
        silent_after = rs.t0 + rs.plan.reduce_timeout_s + rto_s + cfg.nack_idle_s
        while True:
            with rs.cv:
                ma = rs.mean_for(bucket)
                now = time.monotonic()
                step = mean_wait_decision(
                    ma,
                    now,
                    fallback_at=fallback_at,
                    silent_after=silent_after,
                    nack_idle_s=cfg.nack_idle_s,
                    max_nacks=cfg.max_nack_rounds,
                    owner_active_at=rs.owner_active.get(owner, 0.0),
                    rtt_s=rto_s,
                    reorder_s=reorder_grace_s(
                        self._reorder.get(rs.owners[bucket]), cfg.reorder_grace_s, cfg.max_reorder_grace_s
                    ),
                )
                if step.action == "done":
                    return ma.to_mean(rs.round, bucket, rs.owners[bucket])
                if step.action == "pull":
                    log.debug("round %d: mean of bucket %d: %s", rs.round, bucket, step.reason)
                    ma.fallback = True  # what still arrives is not acknowledged: this member pulls over gRPC
                    return None
                if step.action == "wait":
                    rs.cv.wait(max(0.0, step.wake_at - now))
                    continue
                if ma.num_chunks is not None:
                    missing = ma.missing()
                else:  # no meta yet: the meta, and every chunk when none came either
                    missing = [_NACK_META] + ([] if ma.chunks else [_NACK_ALL])
                ma.final_meta_seen = False
                ma.nacks += 1
                ma.nack_at = now
            self._count(nacks_sent=1)
            room = self._body_max // 4
            for i in range(0, len(missing), room):
                body = struct.pack(f"<{len(missing[i : i + room])}I", *missing[i : i + room])
                # each NACK leaves _NACK_COPIES times (separately sealed, the NACK's number in the chunk field):
                # lost, the next one waits the path's RTO + nack_idle_s x 2^k; the owner answers one copy
                for _ in range(_NACK_COPIES):
                    self._send_ctl(rs, owner, rs.sealer.seal(Kind.NACK, body, bucket=bucket, chunk=ma.nacks))
