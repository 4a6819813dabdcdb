"""The means half of the datagram data path (:class:`~.datagram.DatagramTransport`).

* **Owner side**: as soon as a bucket it owns is final (its handler's
  ``handle_pull_mean`` returns), the owner pushes the mean to every member: a meta
  datagram (chunk count, checksums), the chunks, and a final meta, interleaved member
  by member and paced; it answers a member's NACK by re-sending the listed chunks (or
  the meta, or all of it) and counts a member's MEAN_ACK as a pull (``close()``).
* **Member side**: :meth:`DatagramMeans.pull_mean` waits for a pushed mean, NACKs
  missing chunks at most ``max_nack_rounds`` times (the steps are
  :func:`~.datagram_round.mean_wait_decision`'s) and pulls over gRPC what is still
  missing ``fallback_reserve_s`` before the deadline.

:class:`DatagramMeans` is a mixin of :class:`~.datagram.DatagramTransport`: it uses the
transport's sockets, pacer, counters and config.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from typing import Any

from dtrain.errors import PeerUnavailable, TransportError
from dtrain.protocol import BucketMean, MeanChunk
from dtrain.transports.datagram_round import (
    RoundState,
    decode_meta,
    encode_meta,
    mean_wait_decision,
    senders_bitmap,
    senders_from_bitmap,
)
from dtrain.transports.datagram_wire import CODEC_WIRE_NAMES, Kind, codec_id

__all__ = ["DatagramMeans"]

log = logging.getLogger(__name__)

_META_COPY_FINAL = 1
_NACK_META = 0xFFFFFFFF  # in a NACK: send the meta again
_NACK_ALL = 0xFFFFFFFE  # in a NACK: send every chunk again (nothing of the mean arrived)


class DatagramMeans:
    """Owner push and member assembly of bucket means (see the module docstring).

    The transport provides what these methods use: ``config``, ``_handler``, ``_grpc``,
    ``_opener``, ``_counts``, ``_body_max`` and the methods ``_count``, ``_round``,
    ``_send``, ``_send_sock``, ``_send_ctl``, ``_seal_chunks``.
    """

    config: Any
    _handler: Any
    _grpc: Any
    _opener: Any
    _counts: dict[str, int]
    _body_max: int

    # ------------------------------------------------------------------ means: owner side
    def _push_means(self, rs: RoundState, mine: list[int]) -> None:
        threads = [threading.Thread(target=self._push_mean, args=(rs, b), daemon=True) for b in mine]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _push_mean(self, rs: RoundState, b: int) -> None:
        assert self._handler is not None
        try:
            m = self._handler.handle_pull_mean(rs.round, b, rs.site_id, max(0.0, rs.broadcast_until - time.monotonic()))
        except TransportError as e:
            log.warning("round %d: no mean of bucket %d to push: %s", rs.round, b, e)
            return
        with rs.lock:
            rs.published[b] = m
        dests = [i for i in range(len(rs.site_ids)) if i != rs.me]
        self._send_mean(rs, m, dests, list(range(len(m.chunks))), with_meta=True)

    def _mean_datagrams(self, rs: RoundState, m: BucketMean, c: int) -> list[bytes]:
        ch = m.chunks[c]
        return self._seal_chunks(
            rs,
            Kind.MEAN,
            senders_bitmap(ch.senders, rs.site_ids),
            ch.payload,
            bucket=m.bucket,
            chunk=c,
            offset=ch.offset,
            numel=ch.numel,
            codec=codec_id(ch.codec),
        )

    def _send_mean(
        self, rs: RoundState, m: BucketMean, dests: list[int], chunks: list[int], *, with_meta: bool
    ) -> None:
        """Meta, the chunks, final meta; to every dest, interleaved chunk by chunk, paced."""
        meta = encode_meta(m)
        socks = {d: self._send_sock(rs.plan.members[d].address) for d in dests}
        items: list[int | None] = ([None] if with_meta else []) + list(chunks) + [None]
        last = len(items) - 1
        for k, c in enumerate(items):
            for d in dests:
                if c is None:
                    datagrams = [rs.sealer.seal(Kind.MEAN_META, meta, bucket=m.bucket, chunk=int(k == last))]
                else:
                    datagrams = self._mean_datagrams(rs, m, c)
                    self._count(sent=len(m.chunks[c].payload))
                for data in datagrams:
                    try:
                        if not self._send(rs, d, socks[d], data, rs.broadcast_until, contribution=False):
                            log.warning("round %d: mean of bucket %d: past the broadcast deadline", rs.round, m.bucket)
                            return
                    except PeerUnavailable as e:
                        log.debug("round %d: mean to %s: %s", rs.round, rs.site_ids[d], e)

    def _answer_nack(self, rs: RoundState, h, body: bytes) -> None:
        with rs.lock:
            m = rs.published.get(h.bucket)
        if m is None or len(body) % 4:
            return
        asked = struct.unpack(f"<{len(body) // 4}I", body)
        wanted = list(range(len(m.chunks))) if _NACK_ALL in asked else [c for c in asked if c < len(m.chunks)]
        self._count(resent=len(wanted))
        self._send_mean(rs, m, [h.sender], wanted, with_meta=_NACK_META in asked)

    def _answer_ack(self, rs: RoundState, h) -> None:
        """A member holds our whole mean of ``h.bucket``: it counts as pulled (``close()``)."""
        if not (h.bucket < len(rs.owners) and rs.owners[h.bucket] == rs.site_id):
            self._opener.count("malformed")
            return
        delivered = getattr(self._handler, "handle_mean_delivered", None)
        if delivered is not None:
            delivered(rs.round, h.bucket, rs.site_ids[h.sender])

    # ------------------------------------------------------------------ means: member side
    def _on_mean(self, rs: RoundState, h, body: bytes) -> None:
        if not (h.bucket < len(rs.owners) and rs.owners[h.bucket] == rs.site_ids[h.sender] and h.sender != rs.me):
            self._opener.count("malformed")
            return
        nbits = (len(rs.site_ids) + 7) // 8
        with rs.cv:
            ma = rs.mean_for(h.bucket)
            ma.last_arrival = rs.owner_active[h.sender] = time.monotonic()
            if h.kind == Kind.MEAN_META:
                if ma.num_chunks is None:
                    ma.num_chunks, before, after = decode_meta(body)
                    ma.checksums = (before, after)
                ma.final_meta_seen = ma.final_meta_seen or h.chunk == _META_COPY_FINAL
            elif h.chunk not in ma.chunks and h.codec < len(CODEC_WIRE_NAMES) and len(body) >= nbits:
                whole = rs.add_fragment((Kind.MEAN, h.bucket, h.chunk), h.frag, h.nfrags, body[nbits:])
                if whole is False or (whole and not rs.charge(len(whole))):
                    self._opener.count("over_budget")
                elif whole is not None:
                    ma.chunks[h.chunk] = MeanChunk(
                        chunk=h.chunk,
                        offset=h.offset,
                        numel=h.numel,
                        codec=CODEC_WIRE_NAMES[h.codec],
                        payload=whole,
                        senders=senders_from_bitmap(body[:nbits], rs.site_ids),
                    )
                    self._counts["received"] += len(whole)
            # Acknowledge only a mean this member returns: after it fell back to gRPC, a copy
            # completed by late datagrams is not applied, and an ACK would let the owner exit
            # before the gRPC pull was served (owner_lost here, applied at the owner)
            ack = ma.complete() and not ma.acked and not ma.fallback
            ma.acked = ma.acked or ack
            rs.cv.notify_all()
        if ack:
            self._ack_mean(rs, h.sender, h.bucket)

    def pull_mean(
        self, address: str, round: int, bucket: int, *, requester: str, timeout_s: float, have_checksum: str = ""
    ) -> BucketMean:
        # have_checksum is not used on this path: its owner counts MEAN_ACKs, not pulls
        rs = self._round(round)
        pushed = (
            rs is not None
            and bucket < len(rs.owners)
            and rs.by_address.get(address) == rs.owners[bucket]
            and rs.owners[bucket] != rs.site_id
        )
        if not pushed:
            m = self._grpc.pull_mean(address, round, bucket, requester=requester, timeout_s=timeout_s)
            if (
                rs is not None
                and bucket < len(rs.owners)
                and rs.owners[bucket] != rs.site_id
                and rs.by_address.get(address) == rs.owners[bucket]
            ):
                self._ack_mean(rs, rs.index[rs.owners[bucket]], bucket)  # the owner counts acknowledgements
            return m
        assert rs is not None
        deadline = time.monotonic() + timeout_s
        fallback_at = max(time.monotonic(), deadline - self.config.fallback_reserve_s)
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
        self._ack_mean(rs, rs.index[rs.owners[bucket]], bucket)
        return m

    def _ack_mean(self, rs: RoundState, owner: int, bucket: int) -> None:
        """Two MEAN_ACKs of ``bucket`` to ``owner``: a lost pair only makes its ``close()`` wait to its bound."""
        for copy in range(2):
            self._send_ctl(rs, owner, rs.sealer.seal(Kind.MEAN_ACK, b"", bucket=bucket, chunk=copy))

    def _await_mean(self, rs: RoundState, address: str, bucket: int, fallback_at: float) -> BucketMean | None:
        """Wait for a pushed mean until ``fallback_at``, NACKing missing chunks; None: pull over gRPC
        (the steps are :func:`~.datagram_round.mean_wait_decision`'s)."""
        cfg = self.config
        owner = rs.index[rs.owners[bucket]]
        # by then the owner finalized (its reduce deadline) and its first datagrams crossed the path
        silent_after = rs.t0 + rs.plan.reduce_timeout_s + 2 * cfg.rtt_s + cfg.nack_idle_s
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
                part = missing[i : i + room]
                self._send_ctl(
                    rs, owner, rs.sealer.seal(Kind.NACK, struct.pack(f"<{len(part)}I", *part), bucket=bucket)
                )
