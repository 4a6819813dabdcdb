"""Per-round receive state of the datagram data path: fragment reassembly, the
means arriving for this site, receive statistics per sender, all bounded.

Every buffer of a round charges a byte budget (``max_round_buffer_bytes``, from the
transport config and the plan); a datagram that would exceed it is dropped and
counted (``over_budget``), so a flood, even an authenticated one, cannot grow memory.
"""

from __future__ import annotations

import struct
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

from dtrain.protocol import BucketMean, MeanChunk, RoundPlan
from dtrain.transports.datagram_reorder import SeqArrivals
from dtrain.transports.datagram_wire import Sealer

if TYPE_CHECKING:
    from dtrain.transports.datagram_native import NativeLib

__all__ = [
    "MeanAssembly",
    "MeanWait",
    "RoundState",
    "SenderStats",
    "decode_meta",
    "encode_meta",
    "mean_wait_decision",
    "senders_bitmap",
]

_META = struct.Struct("<I16s16s")


def senders_bitmap(senders: tuple[str, ...], site_ids: tuple[str, ...]) -> bytes:
    """Bitmap (bit i = member i of the plan) of the sites a mean chunk includes."""
    bits = bytearray((len(site_ids) + 7) // 8)
    index = {s: i for i, s in enumerate(site_ids)}
    for s in senders:
        i = index[s]
        bits[i // 8] |= 1 << (i % 8)
    return bytes(bits)


_MAX_BITMAPS_KEPT = 1024  # distinct sender bitmaps a round decodes once (RoundState.mean_senders)


@lru_cache(maxsize=1024)  # a round's mean chunks share a handful of bitmaps
def senders_from_bitmap(bits: bytes, site_ids: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(s for i, s in enumerate(site_ids) if bits[i // 8] >> (i % 8) & 1)


def encode_meta(m: BucketMean) -> bytes:
    """Chunk count and both checksums of a bucket mean (BLAKE3 hex digests, 16 bytes)."""
    return _META.pack(len(m.chunks), bytes.fromhex(m.checksum_before), bytes.fromhex(m.checksum_after))


def decode_meta(body: bytes) -> tuple[int, str, str]:
    n, before, after = _META.unpack(body)
    return n, before.hex(), after.hex()


@dataclass
class SenderStats:
    """Contribution datagrams received from one sender in one round."""

    datagrams: int = 0
    bytes: int = 0
    first_t: float = 0.0
    last_t: float = 0.0
    accepted: int = 0
    rejected: int = 0
    last_rejection: tuple[str, str] = ("", "")
    drops_first: int = 0  # the receive socket's drop counter at the first arrival
    drops_last: int = 0  # ... and at the latest

    def note(self, nbytes: int, now: float, socket_drops: int = 0) -> None:
        """One datagram of ``nbytes`` arrived at ``now``; ``socket_drops``: the socket's
        running count of datagrams dropped at a full buffer (``SO_RXQ_OVFL``)."""
        if not self.datagrams:
            self.first_t = now
            self.drops_first = socket_drops
        self.datagrams += 1
        self.bytes += nbytes
        self.first_t = min(self.first_t, now)
        self.last_t = max(self.last_t, now)
        self.drops_last = socket_drops

    def note_many(self, num: int, nbytes: int, first_t: float, last_t: float, socket_drops: int = 0) -> None:
        """``num`` datagrams of ``nbytes`` in all arrived between ``first_t`` and ``last_t``
        (:meth:`note` for a batch)."""
        if not self.datagrams:
            self.first_t = first_t
            self.drops_first = socket_drops
        self.datagrams += num
        self.bytes += nbytes
        self.first_t = min(self.first_t, first_t)
        self.last_t = max(self.last_t, last_t)
        self.drops_last = socket_drops

    @property
    def socket_drops(self) -> int:
        """Datagrams (from any sender) the receive socket dropped while this sender's arrived."""
        return max(0, self.drops_last - self.drops_first)


@dataclass
class MeanAssembly:
    """The chunks of one bucket's mean as they arrive from its owner."""

    num_chunks: int | None = None
    checksums: tuple[str, str] = ("", "")
    chunks: dict[int, MeanChunk] = field(default_factory=dict)
    final_meta_seen: bool = False
    last_arrival: float = 0.0  # time.monotonic() of the latest datagram of this mean (0: none yet)
    acked: bool = False  # a MEAN_ACK went to the owner
    have: str | None = None  # this member's θ_b checksum, said by its pull_mean (None: not pulled yet)
    nacks: int = 0  # NACKs this site sent for this mean
    nack_at: float = 0.0  # when the latest went
    fallback: bool = False  # the member gave up on the datagrams and pulls over gRPC: no MEAN_ACK

    def missing(self) -> list[int]:
        if self.num_chunks is None:
            return []
        return [c for c in range(self.num_chunks) if c not in self.chunks]

    def complete(self) -> bool:
        return self.num_chunks is not None and len(self.chunks) == self.num_chunks

    def to_mean(self, round: int, bucket: int, owner: str) -> BucketMean:
        assert self.num_chunks is not None
        return BucketMean(
            round=round,
            bucket=bucket,
            owner=owner,
            chunks=tuple(self.chunks[c] for c in range(self.num_chunks)),
            checksum_before=self.checksums[0],
            checksum_after=self.checksums[1],
        )


@dataclass(frozen=True)
class MeanWait:
    """What a member does next about one pushed mean (:func:`mean_wait_decision`).

    Attributes:
        action: ``"done"`` (complete), ``"wait"`` (until ``wake_at``), ``"nack"``
            (re-request the missing chunks now) or ``"pull"`` (over gRPC now).
        wake_at: ``time.monotonic()`` seconds to wait until (``"wait"`` only).
        reason: why, for the log.
    """

    action: str
    wake_at: float = 0.0
    reason: str = ""


def mean_wait_decision(
    m: MeanAssembly,
    now: float,
    *,
    fallback_at: float,
    silent_after: float,
    nack_idle_s: float,
    max_nacks: int,
    owner_active_at: float = 0.0,
    rtt_s: float = 0.0,
    reorder_s: float = 0.005,
) -> MeanWait:
    """Next step of a member waiting for a pushed mean, from what has arrived and ``now``.

    Args:
        m: the mean's assembly so far (chunks, metas, arrivals, NACKs sent).
        now: ``time.monotonic()``.
        fallback_at: past this, whatever is missing is pulled over gRPC (the pull's
            deadline less ``fallback_reserve_s``).
        silent_after: by this time some datagram of the mean should have arrived (the
            owner's reduce deadline plus the path's slack); a mean of which nothing came
            by then was wholly lost or its owner is gone: one NACK asks for all of it, and
            if nothing answers within ``rtt_s + 2 x nack_idle_s`` it is pulled over gRPC
            then, not at ``fallback_at``.
        nack_idle_s: a mean that made no progress for ``2 x`` this gets a NACK (``reorder_s``
            after the final meta: the owner sent everything); the k-th NACK's answer is
            waited for ``rtt_s + nack_idle_s x 2^(k-1)`` (capped at 64x) first, unless the
            answer's final meta arrived (the answer is whole: ``reorder_s`` later the next NACK
            goes); when nothing arrived since the NACK, the next goes ``reorder_s`` after that wait.
        max_nacks: NACKs per mean; once spent, the rest is pulled over gRPC.
        rtt_s: how long an answer from the owner may take, seconds: the path's measured
            RTO (:class:`~.datagram_rtt.RttEstimator`); no answer to a NACK can come sooner,
            so none is sent again before, and a NACK that brought nothing is given up only
            after it.
        reorder_s: how long chunks the final meta overtook may still come: the reordering
            grace of the owner's path (:func:`~.datagram_reorder.reorder_grace_s`; 5 ms on an
            in-order path).
        owner_active_at: the latest arrival of any mean or contribution datagram from this bucket's owner
            (0: none). While the owner is still sending (other buckets interleave with
            this one through its pacer), quiet on this bucket is not loss: before its
            final meta, the bucket waits for quiet from the owner as a whole (through
            netem on a loaded machine, the per-bucket quiet re-sent ~2x the mean at 1% loss).
    """
    if m.complete():
        return MeanWait("done", reason="complete")
    if now >= fallback_at:
        return MeanWait("pull", reason="fallback reserve reached")
    if not m.last_arrival:  # nothing of this mean yet
        if m.nacks:
            silent_until = m.nack_at + rtt_s + 2 * nack_idle_s  # its answer cannot come sooner than a round trip
            if now >= silent_until:
                return MeanWait("pull", reason="nothing arrived, a NACK unanswered: owner silent or gone")
            return MeanWait("wait", min(fallback_at, silent_until), "waiting for the answer to a NACK")
        owner_quiet_at = owner_active_at + 2 * nack_idle_s
        if now >= max(silent_after, owner_quiet_at):
            return MeanWait("nack", reason="nothing arrived by the owner's reduce deadline: asking for all of it")
        return MeanWait("wait", min(fallback_at, max(silent_after, owner_quiet_at)), "the owner may still be reducing")
    # quiet after the final meta (the owner sent everything), or with nothing at all since the
    # last NACK (no answer is on its way: its wait below already covers an RTT), is not a pause
    unanswered = m.nacks and m.last_arrival < m.nack_at
    idle = reorder_s if m.final_meta_seen or unanswered else 2 * nack_idle_s
    busy = 0.0 if m.final_meta_seen else owner_active_at  # the owner still sending: not loss yet
    # the k-th NACK's answer gets nack_idle_s x 2^(k-1) (at most 64x) before the next one: an
    # owner slowed down (a busy CPU) is not asked again and again (each NACK re-sends what is
    # missing), and the NACKs span ~10 s before the gRPC pull (a TCP pull at 20% loss is slow)
    answer_s = rtt_s + nack_idle_s * 2 ** min(m.nacks - 1, 6) if m.nacks else 0.0
    # the answer's final meta came: it is all here, what still misses can be asked for at once
    answering = m.nacks and not m.final_meta_seen
    wake = max(m.last_arrival, busy, m.nack_at + answer_s if answering else 0.0) + idle
    if now < wake:
        return MeanWait("wait", min(fallback_at, wake), "chunks still arriving")
    if m.nacks >= max_nacks:
        return MeanWait("pull", reason=f"{m.nacks} NACKs spent")
    return MeanWait("nack", reason=f"{len(m.missing()) if m.num_chunks is not None else 'all'} chunks missing")


class RoundState:
    """What one site's datagram transport holds for one round.

    Args:
        plan: the round's plan (members, deadlines, ``datagram_key``).
        owners: owner site_id per bucket (empty: no bucket means are pushed).
        site_id: this site.
        run: run id.
        max_buffer_bytes: the round's receive budget (bytes).
        native: the compiled loop for the round's :class:`~.datagram_wire.Sealer` (None: Python).
    """

    def __init__(
        self,
        plan: RoundPlan,
        owners: list[str],
        site_id: str,
        *,
        run: int,
        max_buffer_bytes: int,
        native: NativeLib | None = None,
    ) -> None:
        self.plan = plan
        self.round = plan.round
        self.owners = owners
        self.site_ids = plan.site_ids
        self.index = {s: i for i, s in enumerate(self.site_ids)}
        self._senders_of: dict[bytes, tuple[str, ...]] = {}  # mean chunks' sender bitmaps, decoded
        self.by_address = {m.address: m.site_id for m in plan.members}
        self.me = self.index[site_id]
        self.site_id = site_id
        self.t0 = time.monotonic()
        self.broadcast_until = self.t0 + plan.broadcast_timeout_s
        self.sealer = Sealer(plan.datagram_key, run=run, round=plan.round, sender=self.me, native=native)
        self.max_buffer_bytes = max_buffer_bytes
        self.buffered_bytes = 0
        self.fragments: dict[tuple, dict[int, bytes]] = {}
        self.means: dict[int, MeanAssembly] = {}
        # site index -> latest arrival of any of its mean or contribution datagrams
        self.owner_active: dict[int, float] = {}
        # bucket -> chunks of this site's mean that have left to every member (its first pass):
        # a NACK is answered only for those (the rest are on their way; a member NACKs a mean
        # still trickling out behind contributions)
        self.mean_left: dict[int, int] = {}
        self.published: dict[int, BucketMean] = {}  # means this site owns, kept for NACKs
        # the owner sends its means one bucket at a time, in the order they were finalized:
        # ticket i goes when send_turn == i (under cv)
        self.send_tickets = 0
        self.send_turn = 0
        # (sender, bucket, NACK number) -> {body hash: chunks (+1 for the meta) answered}: the NACKs
        # answered here, bounded by the plan (numbers <= max_nack_rounds, a whole mean per number)
        self.nacks_answered: dict[tuple, dict[int, int]] = {}
        self.stats: dict[int, SenderStats] = {}
        self.sent: dict[int, list] = {}  # dest index -> [datagrams, bytes, first_t, last_t]
        self.reports: dict[int, tuple] = {}  # dest index -> report tuple from that receiver
        self.send_end_at: dict[tuple[int, int], float] = {}  # (dest index, SEND_END copy) -> when it left
        self.rejections: dict[int, tuple[str, str]] = {}  # dest index -> its handler's last refusal
        # what the ends count (datagram_reorder); bucket -1: the whole round (SEND_END)
        self.announced: dict[tuple[int, int], int] = {}  # (dest, bucket) -> contributions sent there (rs.lock)
        # the dispatch thread's alone: (sender, bucket) -> contributions handled; ends still waiting
        # for contributions they announced -> (announced, handled at); ended ones, the same
        self.handled: dict[tuple[int, int], int] = {}
        self.ends: dict[tuple[int, int], tuple[int | None, float]] = {}
        self.ended: dict[tuple[int, int], tuple[int | None, float]] = {}
        self.arrivals: dict[int, SeqArrivals] = {}  # sender -> its contributions' arrival order (receive thread)
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)

    def mean_senders(self, bitmap: bytes) -> tuple[str, ...]:
        """The site_ids a mean chunk's senders ``bitmap`` names (bit i: member i of the plan),
        decoded once per distinct bitmap in the round (nearly every chunk of a round carries the
        same one; at most ``_MAX_BITMAPS_KEPT`` are kept, so a forger cannot grow the cache)."""
        senders = self._senders_of.get(bitmap)
        if senders is None:
            senders = senders_from_bitmap(bitmap, self.site_ids)
            if len(self._senders_of) < _MAX_BITMAPS_KEPT:
                self._senders_of[bitmap] = senders
        return senders

    def charge(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` of the round's budget; False when it would be exceeded."""
        if self.buffered_bytes + nbytes > self.max_buffer_bytes:
            return False
        self.buffered_bytes += nbytes
        return True

    def add_fragment(self, key: tuple, frag: int, nfrags: int, data: bytes) -> bytes | None | bool:
        """Store one fragment; return the whole body once every fragment is in, None
        while some are missing, False when over budget. Called under :attr:`lock`."""
        if nfrags == 1:
            return data
        parts = self.fragments.get(key)
        if parts is None:
            parts = self.fragments[key] = {}
        if frag in parts:
            return None
        if not self.charge(len(data)):
            return False
        parts[frag] = data
        if len(parts) < nfrags:
            return None
        del self.fragments[key]
        body = b"".join(parts[i] for i in range(nfrags))
        self.buffered_bytes -= len(body)
        return body

    def mean_for(self, bucket: int) -> MeanAssembly:
        m = self.means.get(bucket)
        if m is None:
            m = self.means[bucket] = MeanAssembly()
        return m
