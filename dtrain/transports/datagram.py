"""The datagram data path: contributions and means as paced, sealed UDP datagrams.

Chosen per run (``data_path = "datagram"``; gRPC stays the default). Control, plans,
state pulls (repair, joins) and the last-resort mean pull stay on gRPC: this
transport wraps a :class:`~dtrain.transports.grpc.GrpcTransport` and binds a UDP
socket on the same port number as its gRPC server (UDP and TCP ports are separate),
so a plan's ``host:port`` addresses both.

Per round (:meth:`DatagramTransport.begin_round`, the round engine's one seam):

* **Contributions** (``push``) leave as datagrams of at most ``max_datagram_bytes``
  (``dtrain.transports.datagram_wire``), paced (:class:`~.datagram_pacing.Pacer`),
  never retransmitted. With ``chunk_bytes`` from :func:`datagram_chunk_bytes`, one
  chunk is one datagram, so a lost datagram costs exactly its element range and the
  owner's per-chunk mean (divided by the senders whose datagram arrived) is unbiased
  at packet granularity; what no mean included stays in the sender's residual (the
  round engine's rules). Larger payloads are split in fragments (all needed).
* **Means** (:mod:`.datagram_means`) are pushed by the owner to every member as soon as a bucket is final
  (the transport waits on the handler's ``handle_pull_mean``): a meta datagram
  (chunk count, checksums) before and after the chunks. A member's ``pull_mean``
  waits for them; missing chunks are re-requested (NACK datagram listing them) at
  most ``max_nack_rounds`` times; whatever is still missing ``fallback_reserve_s``
  before the deadline is pulled over gRPC, so every replica applies the same bytes
  or, past the deadline, none (docs/DECISIONS.md, "Datagram data path").
* After its contributions a sender sends a SEND_END; the owner answers with a
  REPORT (what arrived, over how long, what its handler accepted or refused), which
  ``push`` waits for briefly: it returns the accepted count, raises ``Rejected``
  with the owner's first refusal, and feeds the :class:`~.datagram_pacing.RateController`
  that sets the next round's rate.

Contract differences (``tests/unit/test_transport_contract.py``): a rejection reaches
the sender only through the REPORT, after the later chunks were sent and handled
(``reports_rejections_in_order = False``); a push to a closed port fails through the
kernel's ICMP error (loopback, LAN), a push to a silent host only through the gRPC
pulls.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import random
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from dtrain.codecs import CodecConfig, get_codec
from dtrain.codecs.base import HEADER_BYTES as CODEC_HEADER_BYTES
from dtrain.errors import BindError, PeerTimeout, PeerUnavailable, Rejected, TransportError
from dtrain.protocol import BucketState, Contribution, ContributionRun, RoundPlan
from dtrain.transports.base import LinkProbe, PeerHandler, Transport
from dtrain.transports.datagram_config import DatagramTransportConfig, max_datagram_bytes_for_mtu
from dtrain.transports.datagram_ends import DatagramEnds
from dtrain.transports.datagram_means import _MAX_REPAIRS_QUEUED, DatagramMeans
from dtrain.transports.datagram_native import native
from dtrain.transports.datagram_pacing import (
    Pacer,
    RateController,
    ReceiverReport,
    describe_reports,
    socket_buffer_bytes,
)
from dtrain.transports.datagram_recv import _REPORT, DatagramReceive, dispatch_groups, queued_datagrams
from dtrain.transports.datagram_reorder import ReorderWindow
from dtrain.transports.datagram_round import RoundState, SenderStats
from dtrain.transports.datagram_rtt import RttEstimator
from dtrain.transports.datagram_wire import (
    AEAD_NAME,
    CLAIM_BYTES,
    VERSION,
    Kind,
    Opener,
    SealedBatch,
    codec_id,
    contribution_body,
    max_body_bytes,
)
from dtrain.transports.grpc import GrpcTransport

__all__ = [
    "DatagramTransport",
    "DatagramTransportConfig",
    "datagram_chunk_bytes",
    "dispatch_groups",
    "max_datagram_bytes_for_mtu",
]

log = logging.getLogger(__name__)

_SEND_END = struct.Struct("<QQdQ")  # contribution datagrams, their bytes, send window s, contributions sent
_COUNT = struct.Struct("<Q")  # a BUCKET_END's body: the sender's contributions to that bucket and owner so far
_DISPATCH_BATCH = 512  # queued datagrams the dispatch thread takes per wake-up (at least)
_BUCKET_END_COPIES = 2  # BUCKET_END datagrams per bucket and owner
# at most this many datagrams sealed and sent per call, and what fits the pacer's burst (46 x 1,400 B in 64 KiB)
_SEND_BATCH = 64
_SEND_END_COPIES = 5  # all lost: 1e-5 at 10% loss, 3e-4 at 20% (3 copies: 1e-3, 8e-3)
_LATE_SEND_END_EVERY_S = 0.25  # then, until the REPORT comes: one more copy this often (_resend_end_later)
_LATE_SEND_END_MAX = 40  # at most this many more (10 s of them)


def datagram_chunk_bytes(codec: CodecConfig | str, max_datagram_bytes: int = 1400, max_members: int = 64) -> int:
    """Largest ``BucketConfig.chunk_bytes`` (fp32 input) whose encoded chunk fits one
    datagram: its codec payload plus the mean's senders bitmap (``max_members`` bits) or
    a contribution's token claim (8 bytes), whichever is larger; for
    the blockwise codecs a whole number of blocks (int4: 2,304 elements, not 2,522), so
    neighbouring chunks encode and decode as one run (``Codec.decode_chunks``); for
    ``sparseloco`` a whole number of its top-k chunks (C=4096, k=64: 10 chunks, 40,960
    elements, in 1,400 bytes), each datagram decodable on its own.

    Raises:
        ValueError: a codec whose size depends on the data (``+zstd``, ``topk``) or
            a datagram too small for one element.
    """
    c = get_codec(codec)
    if c.name.endswith("+zstd") or c.base == "topk":
        raise ValueError(
            f"codec {c.name!r} has no fixed size per element: use fp32, bf16, fp16, int8, int4 or sparseloco"
        )
    # codec payload bytes that fit beside the mean's senders bitmap, and beside a contribution's claim
    room = max_body_bytes(max_datagram_bytes) - max((max_members + 7) // 8, CLAIM_BYTES)
    lo, hi = 0, max(1, 2 * room)
    while CODEC_HEADER_BYTES + c._body_bytes(hi) <= room:  # sparse codecs: many elements per byte
        lo, hi = hi, 2 * hi
    while lo < hi:  # the largest numel whose payload fits
        mid = (lo + hi + 1) // 2
        if CODEC_HEADER_BYTES + c._body_bytes(mid) <= room:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        raise ValueError(f"max_datagram_bytes={max_datagram_bytes} leaves no room for one {c.name} element")
    block = getattr(c, "_bs", 0)  # blockwise: whole blocks (runs decode in one pass); sparseloco: whole chunks
    if block and lo >= block:
        lo -= lo % block
    return 4 * lo


class DatagramTransport(DatagramMeans, DatagramReceive, DatagramEnds, Transport):
    """One site's datagram data path (see the module docstring; the means half is
    :class:`~.datagram_means.DatagramMeans`, the receive thread :class:`~.datagram_recv.DatagramReceive`)."""

    reports_rejections_in_order = False
    acknowledges_means = True  # a member MEAN_ACKs each mean of its owner, pushed or pulled over gRPC

    def __init__(self, config: DatagramTransportConfig | None = None) -> None:
        self.config = cfg = config or DatagramTransportConfig()
        self._grpc = GrpcTransport(cfg.grpc)
        self._handler: PeerHandler | None = None
        self._sock: socket.socket | None = None
        self._native = native(cfg.native)
        # UDP segmentation offload for the compiled loop's sends, until a kernel refuses it (_no_gso)
        self._gso = cfg.gso and self._native is not None and sys.platform.startswith("linux")
        self._opener = Opener(run=cfg.run_id, max_datagram_bytes=cfg.max_datagram_bytes, native=self._native)
        self._body_max = max_body_bytes(cfg.max_datagram_bytes)
        self.rate = RateController(
            max_rate_mbit=cfg.max_rate_mbit, min_rate_mbit=cfg.min_rate_mbit, initial_rate_mbit=cfg.initial_rate_mbit
        )
        self._pacer = Pacer(self.rate.rate_mbit, burst_bytes=cfg.burst_bytes)
        # datagrams per paced send: a batch stays within the pacer's burst (7 of 8,900 B at 64 KiB)
        self._batch_datagrams = max(1, min(_SEND_BATCH, cfg.burst_bytes // cfg.max_datagram_bytes))
        self._rounds: dict[int, RoundState] = {}
        self._pending: list[bytes] = []
        # held by the receive thread from reading a batch to queueing it, and by begin_round from
        # opening a round's key to queueing what was held for it: what was held is queued before
        # anything read after (a sender's BUCKET_END after its held chunks, not before them)
        self._recv_lock = threading.Lock()
        self._lock = threading.Lock()
        self._send_socks: dict[tuple[str, int], socket.socket] = {}
        self._dispatch: queue.Queue = queue.Queue()  # batches (lists) of items; _queued bounds their total
        self._repairs: queue.Queue = queue.Queue(maxsize=_MAX_REPAIRS_QUEUED)  # NACK answers (_repair_loop)
        self._queued = 0
        self._rx: tuple | None = None
        self._gro: int | None = None  # the receive thread's coalesced-read state (config.gro), its own
        self._plain = None  # the receive thread's PlainColumns (its own), made at its first plain batch
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()
        self._drop_rng = random.Random(cfg.test_drop_seed)
        self._sock_drops = 0  # the receive socket's drops at a full buffer so far (SO_RXQ_OVFL)
        self._counts = {"sent": 0, "received": 0, "wire_sent": 0, "wire_received": 0, "datagrams_sent": 0}
        self._counts.update(nacks_sent=0, resent=0, fallback_pulls=0, test_dropped=0, rejected=0)
        # sender ends that found announced contributions missing (and waited), that ended with some
        # still missing (lost), how many; contributions handled after their end had ended
        self._counts.update(ends_waited=0, ends_short=0, end_missing=0, late_after_end=0, mean_duplicates=0)
        self._counts.update(held_before_key=0)
        self._reorder = ReorderWindow()  # per sending site: how late overtaken contributions came
        self._rtt = RttEstimator(cfg.rtt_s)  # per peer site: the measured round trip (SEND_END -> REPORT)
        self._ends_due = float("inf")  # the dispatch thread's next look at ends still waiting
        # the receive thread: every datagram that reached the socket before this time.monotonic()
        # was read and queued (it found the socket empty then); it looks every 2 ms while ends wait
        self._drained_at = 0.0
        self._ends_waiting = False

    # ------------------------------------------------------------------ lifecycle
    def start(self, handler: PeerHandler) -> str:
        self._handler = handler
        if self.config.switch_interval_s is not None and sys.getswitchinterval() > self.config.switch_interval_s:
            sys.setswitchinterval(self.config.switch_interval_s)
        address = self._grpc.start(handler)
        host, port = address.rsplit(":", 1)
        sock = socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET, socket.SOCK_DGRAM)
        self._size_buffers(sock)
        try:
            sock.bind((self.config.grpc.bind_host, int(port)))
        except OSError as e:
            sock.close()
            self._grpc.stop(0)
            raise BindError(
                "bind_host and bind_port", f"cannot bind udp {self.config.grpc.bind_host}:{port}: {e}"
            ) from e
        sock.setblocking(False)  # the receive thread polls, then drains until EAGAIN
        self._sock = sock
        self._gro = self._enable_gro(sock)  # the receive thread's from now on (it frees it)
        threads = (
            (self._recv_loop, "dgram-recv"),
            (self._dispatch_loop, "dgram-dispatch"),
            (self._repair_loop, "dgram-repair"),
        )
        for target, name in threads:
            t = threading.Thread(target=target, name=f"{name}-{port}", daemon=True)
            t.start()
            self._threads.append(t)
        how = f"compiled loop {self._native.path.name}" if self._native is not None else "Python loop"
        how += ", UDP GSO" if self._gso else ""
        how += ", UDP GRO" if self._gro is not None else ""
        how += f"; sealed with {AEAD_NAME}, wire version {VERSION}"
        log.info("datagram data path on udp %s:%s (rate %.0f Mbit/s, %s)", host, port, self.rate.rate_mbit, how)
        return address

    def _size_buffers(self, sock: socket.socket) -> None:
        cfg = self.config
        want = socket_buffer_bytes(cfg.max_rate_mbit, cfg.rtt_s)
        rcv = socket_buffer_bytes(cfg.max_rate_mbit, cfg.rtt_s, stall_s=cfg.recv_stall_s)
        for force, plain, size in ((33, socket.SO_RCVBUF, rcv), (32, socket.SO_SNDBUF, want)):  # SO_*BUFFORCE
            try:
                sock.setsockopt(socket.SOL_SOCKET, force, size)
            except OSError:  # not root: capped by net.core.[rw]mem_max
                sock.setsockopt(socket.SOL_SOCKET, plain, size)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop the gRPC side (``grace_s`` for its calls in flight), then the datagram side: from
        then on no datagram leaves (a site killed mid-round sends nothing more, as a crashed one
        would not, while the threads are joined and before the sockets close)."""
        self._grpc.stop(grace_s)
        self._stopped.set()
        for t in self._threads:
            t.join(timeout=2.0)
        with self._lock:
            socks, self._send_socks = list(self._send_socks.values()), {}
        for s in socks + ([self._sock] if self._sock else []):
            s.close()

    def counters(self) -> dict[str, Any]:
        """Datagram counters: payload and wire bytes, NACKs, resends, fallbacks, drops by reason,
        refusals by code (``rejected_<code>``, e.g. ``rejected_failed_precondition`` for a late
        contribution; ``rejected`` is their sum), and the sender ends of :mod:`.datagram_reorder`:
        ``ends_waited`` (an end that found announced contributions missing waited for them),
        ``ends_short`` / ``end_missing`` (ends that passed their grace with contributions missing,
        and how many: lost), ``late_after_end`` (contributions handled after their end had ended:
        reordered past the grace; refused once their bucket closed); ``mean_duplicates``: mean
        chunks that came when the member held them already (a NACK's answer and its copies, an
        original overtaken by its resend), not applied twice.

        ``held_before_key`` counts datagrams that came before their round's key, each once (not a
        drop): they are held (at most ``max_pending_datagrams``, beyond that
        ``dropped_over_budget``, not counted here) and opened when the plan arrives, so they are
        not lost; one opened at a ``begin_round`` that is still not its round's is held again,
        not counted again. (The opener's ``unknown_round`` counts attempts to open, so re-holds
        too: it is not reported.)

        ``rtt_ms``: per peer site with a sample, the measured round trip its timers follow
        (``{"srtt": ms, "rto": ms, "samples": n}``, :mod:`.datagram_rtt`)."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
        drops = self._opener.counts()
        drops.pop("unknown_round")  # open attempts, re-holds included: held_before_key counts datagrams
        out.update({f"dropped_{k}": v for k, v in drops.items()})
        out["rtt_ms"] = self._rtt.summary_ms()
        return out

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._counts[k] += v

    def bytes_sent(self) -> int:
        with self._lock:
            return self._counts["sent"] + self._grpc.bytes_sent()

    def bytes_received(self) -> int:
        with self._lock:
            return self._counts["received"] + self._grpc.bytes_received()

    def wire_bytes(self) -> tuple[int, int]:
        """(sent, received) UDP payload bytes, headers, tags and resends included."""
        with self._lock:
            return self._counts["wire_sent"], self._counts["wire_received"]

    # ------------------------------------------------------------------ rounds
    def begin_round(self, plan: RoundPlan, owners: Sequence[str], site_id: str) -> None:
        """Open round ``plan.round``: its key, its receive buffers, this site's mean pushes.

        Args:
            plan: the round's plan; ``plan.datagram_key`` must be 32 bytes.
            owners: owner site_id per bucket (``assign_owners``); empty: no means
                are pushed or awaited as datagrams (all pulled over gRPC).
            site_id: this site (a member of the plan).
        """
        rs = RoundState(
            plan,
            list(owners),
            site_id,
            run=self.config.run_id,
            max_buffer_bytes=self.config.max_round_buffer_bytes,
            native=self._native,
        )
        self._next_rate()
        self._reorder.new_round()
        with self._lock:
            self._rounds[plan.round] = rs
            for r in [r for r in self._rounds if r < plan.round - 1]:
                del self._rounds[r]
        with self._recv_lock:
            self._opener.open_round(plan.round, plan.datagram_key, len(plan.members))
            with self._lock:  # after the key: what fails to open from now is opened again (_hold)
                pending, self._pending = self._pending, []
            out: list[tuple] = []
            self._open_held(pending, out)
            self._enqueue(out)
        mine = [b for b, o in enumerate(owners) if o == site_id]
        if mine and len(plan.members) > 1:
            t = threading.Thread(
                target=self._push_means, args=(rs, mine), name=f"dgram-means-{plan.round}", daemon=True
            )
            t.start()

    def _next_rate(self) -> None:
        with self._lock:
            last = max(self._rounds.values(), key=lambda rs: rs.round, default=None)
        if last is None:
            return
        reports = []
        with last.lock:
            for dest, rep in last.reports.items():
                sent = last.sent.get(dest)
                if sent is not None:
                    reports.append(
                        ReceiverReport(
                            sent_datagrams=sent[0],
                            sent_bytes=sent[1],
                            send_s=sent[3] - sent[2],
                            received_datagrams=rep[0],
                            received_bytes=rep[1],
                            recv_s=rep[2],
                            receiver_drops=rep[6],
                        )
                    )
        rate, why = self.rate.decide(reports)
        self._pacer.set_rate(rate)
        log.info("round %d: datagram rate %.1f Mbit/s: %s (%s)", last.round + 1, rate, why, describe_reports(reports))

    def _round(self, round: int) -> RoundState | None:
        with self._lock:
            return self._rounds.get(round)

    # ------------------------------------------------------------------ sending
    def _send_sock(self, address: str) -> socket.socket:
        host, port = address.rsplit(":", 1)
        key = (host.strip("[]"), int(port))
        with self._lock:
            s = self._send_socks.get(key)
            if s is None:
                s = socket.socket(socket.AF_INET6 if ":" in key[0] else socket.AF_INET, socket.SOCK_DGRAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, socket_buffer_bytes(self.config.max_rate_mbit, 0.05))
                s.connect(key)
                self._send_socks[key] = s
            return s

    def _send_batch(
        self,
        rs: RoundState,
        dest: int,
        sock: socket.socket,
        batch: SealedBatch,
        deadline: float,
        *,
        contribution: bool,
        first_class: bool = False,
    ) -> bool:
        """Paced send of a batch of datagrams (one pacer wait, one ``sendmmsg`` with the compiled
        loop); ``contribution`` ones count in what the REPORT is compared with. Contributions
        (and ``first_class`` ones: NACK answers) are paced first, other sends (fresh means) in
        the gaps they leave (:meth:`Pacer.wait` ``second``). False: the paced send would end
        past ``deadline`` (nothing sent). A datagram the local queue refuses (ENOBUFS) counts
        as sent: it is lost like one on the wire."""
        lens = batch.lens
        n = len(lens)
        nbytes = int(lens.sum())
        if not n or not self._pacer.wait(nbytes, deadline, second=not (contribution or first_class)):
            return not n
        if self._stopped.is_set():  # stop() sends nothing more, as a crashed site would not (its sockets close last)
            raise PeerUnavailable(f"datagram to {rs.site_ids[dest]}: this site's transport stopped")
        if self._native is not None:
            if self._gso:
                r, refused = self._native.send_gso(sock.fileno(), batch.buf, lens, n)
                if refused:
                    self._no_gso(refused)
            else:
                r = self._native.send(sock.fileno(), batch.buf, lens, n)
            if r < 0 and -r not in (errno.ENOBUFS, errno.EAGAIN):
                err = OSError(-r, os.strerror(-r))
                if -r == errno.ECONNREFUSED:
                    raise PeerUnavailable(f"{rs.site_ids[dest]} refused datagrams (port closed): {err}")
                raise PeerUnavailable(f"datagram to {rs.site_ids[dest]} failed: {err}")
        else:
            for i in range(n):
                try:
                    sock.send(batch.datagram(i))
                except ConnectionRefusedError as e:
                    raise PeerUnavailable(f"{rs.site_ids[dest]} refused datagrams (port closed): {e}") from e
                except OSError as e:
                    if e.errno not in (errno.ENOBUFS, errno.EAGAIN):
                        raise PeerUnavailable(f"datagram to {rs.site_ids[dest]} failed: {e}") from e
        if contribution:  # the REPORT counts contribution datagrams only
            now = time.monotonic()
            with rs.lock:
                st = rs.sent.setdefault(dest, [0, 0, now, now])
                st[0] += n
                st[1] += nbytes
                st[3] = now
        self._count(wire_sent=nbytes, datagrams_sent=n)
        return True

    def _no_gso(self, err: int) -> None:
        """The kernel refused UDP_SEGMENT (the batch went with ``sendmmsg``): say so once, then
        send every batch with ``sendmmsg``."""
        with self._lock:
            was, self._gso = self._gso, False
        if was:
            log.warning(
                "UDP segmentation offload refused by the kernel (%s): sending datagrams with sendmmsg from now on",
                os.strerror(err),
            )

    def _parts(self, head: bytes, payload: bytes, fields: tuple[int, int, int, int, int]) -> list[tuple[tuple, bytes]]:
        """``(fields + (frag, nfrags), body)`` of the datagrams that carry ``head + payload`` fragment by
        fragment; ``fields``: ``(bucket, chunk, offset, numel, codec)``."""
        room = self._body_max - len(head)
        n = max(1, -(-len(payload) // room))
        if n > 0xFFFF:
            raise Rejected("RESOURCE_EXHAUSTED", f"payload of {len(payload)} bytes needs {n} > 65535 datagrams")
        if n == 1:
            return [(fields + (0, 1), head + payload if head else payload)]
        return [(fields + (i, n), head + payload[i * room : (i + 1) * room]) for i in range(n)]

    def push(
        self,
        address: str,
        contributions: Iterable[Contribution],
        *,
        timeout_s: float,
        pace: Callable[[int], None] | None = None,
    ) -> int:
        if self._stopped.is_set():
            raise PeerUnavailable("transport stopped")
        deadline = time.monotonic() + timeout_s
        sock = self._send_sock(address)
        rs: RoundState | None = None
        dest = -1
        num = 0
        before: tuple[int, int] = (0, 0)
        fields: list[tuple] = []  # of the datagrams to seal next, and their bodies
        bodies: list[bytes] = []
        room = self._body_max  # a payload up to this leaves whole in one datagram (the usual case)
        batch_max = self._batch_datagrams
        codecs: dict[str, int] = {}
        claims: dict[int, bytes] = {}  # token claim -> its wire bytes
        bucket = -1  # of the contribution before
        in_bucket = 0  # contributions to it in this push (the end announces the running count)
        unsent = 0  # payload bytes in parts, counted as sent once they leave (one lock per batch)

        def flush() -> None:
            nonlocal unsent
            assert rs is not None
            batch = rs.sealer.seal_many(Kind.CONTRIB, fields, bodies)
            fields.clear()
            bodies.clear()
            if not self._send_batch(rs, dest, sock, batch, deadline, contribution=True):
                raise PeerTimeout(f"push to {address}: the paced send would end past the deadline")
            self._count(sent=unsent)
            unsent = 0

        for c in contributions:
            if pace is not None:  # a paced fragment round's budget, on top of the path's own rate
                pace(len(c.payload))
            if rs is None:
                rs, dest = self._round_and_dest(c.round, address)
                with rs.lock:
                    rep = rs.reports.get(dest)
                before = (rep[3], rep[4]) if rep else (0, 0)
            if c.bucket != bucket:
                if bucket >= 0:  # the previous bucket is all sent: say so
                    if bodies:
                        flush()
                    self._end_bucket(rs, dest, bucket, in_bucket)
                    in_bucket = 0
                bucket = c.bucket
            in_bucket += 1
            claim = claims.get(c.tokens)  # the claim, sealed with the payload (a sender's one per round)
            if claim is None:
                claim = claims[c.tokens] = contribution_body(c.tokens, b"")
            p = claim + c.payload
            cid = codecs.get(c.codec)
            if cid is None:
                cid = codecs[c.codec] = codec_id(c.codec)
            if len(p) <= room:  # one datagram (no per-datagram list of parts on the hot path)
                fields.append((bucket, c.chunk, c.offset, c.numel, cid, 0, 1))
                bodies.append(p)
            else:
                for f, b in self._parts(b"", p, (bucket, c.chunk, c.offset, c.numel, cid)):
                    fields.append(f)
                    bodies.append(b)
            unsent += len(c.payload)
            if len(bodies) >= batch_max:
                flush()
            num += 1
        if rs is None:
            return 0
        if bodies:
            flush()
        self._announce(rs, dest, bucket, in_bucket)  # the last bucket ends with the SEND_END
        return self._end_push(rs, dest, sock, address, num, before, deadline)

    @staticmethod
    def _announce(rs: RoundState, dest: int, bucket: int, num: int) -> int:
        """Add ``num`` contributions to ``bucket`` sent to ``dest`` to the round's running counts
        (that bucket's and the round's total, which the ends announce); returns the bucket's."""
        with rs.lock:
            rs.announced[(dest, -1)] = rs.announced.get((dest, -1), 0) + num
            n = rs.announced[(dest, bucket)] = rs.announced.get((dest, bucket), 0) + num
        return n

    def _end_bucket(self, rs: RoundState, dest: int, bucket: int, num: int) -> None:
        """BUCKET_END of ``bucket`` to ``dest``, twice (not paced; after its last chunk left), with
        the count of contributions to it sent to ``dest`` this round (``num`` more now): under loss
        an owner finalizes each bucket as its senders finish it, not all at the SEND_END, and
        under reordering it waits for what the end overtook (:mod:`.datagram_reorder`). Both
        copies lost: that bucket waits for the SEND_END, as without it."""
        body = _COUNT.pack(self._announce(rs, dest, bucket, num))
        for copy in range(_BUCKET_END_COPIES):
            self._send_ctl(rs, dest, rs.sealer.seal(Kind.BUCKET_END, body, bucket=bucket, chunk=copy))

    def _round_and_dest(self, round: int, address: str) -> tuple[RoundState, int]:
        rs = self._round(round)
        if rs is None:
            raise Rejected("FAILED_PRECONDITION", f"no datagram plan for round {round} here")
        sid = rs.by_address.get(address)
        if sid is None:
            raise PeerUnavailable(f"{address} is not a member of round {round}")
        return rs, rs.index[sid]

    def _end_push(
        self, rs: RoundState, dest: int, sock: socket.socket, address: str, num: int, before: tuple, deadline: float
    ) -> int:
        """Send SEND_END (up to ``_SEND_END_COPIES`` copies, until the owner's REPORT comes) and
        wait for the REPORT. If none came, more copies follow from a daemon thread until it does
        (:meth:`_resend_end_later`): an owner that got no copy would finalize this sender's chunks
        only at its reduce deadline (30 s in datagram_vs_grpc)."""
        with rs.lock:
            st = list(rs.sent.get(dest, [0, 0, 0.0, 0.0]))
            total = rs.announced.get((dest, -1), 0)
        body = _SEND_END.pack(st[0], st[1], st[3] - st[2], total)
        peer = rs.site_ids[dest]
        rto_s = self._rtt.rto_s(peer)

        def answered() -> bool:
            return dest in rs.reports and rs.reports[dest][5] >= st[0]

        # the first copy waits the path's RTO; all copies together at least report_wait_s
        until = min(deadline, time.monotonic() + max(self.config.report_wait_s, 3 * rto_s))
        for copy in range(_SEND_END_COPIES):
            with rs.lock:  # the REPORT that answers this copy is a round-trip sample (_on_report)
                rs.send_end_at[(dest, copy)] = time.monotonic()
            self._send_ctl(rs, dest, rs.sealer.seal(Kind.SEND_END, body, chunk=copy), refused_raises=True)
            share = max(0.0, until - time.monotonic()) / (_SEND_END_COPIES - copy)
            with rs.cv:
                got = rs.cv.wait_for(answered, timeout=max(share, rto_s) if copy == 0 else share)
            if got:
                break
        else:
            self._resend_end_later(rs, dest, body, st[0], deadline)
        with rs.lock:
            rep = rs.reports.get(dest)
            rejection = rs.rejections.get(dest)
        if rep is None:
            return num  # no report: as with a lost datagram, the sender cannot tell
        accepted, rejected = rep[3] - before[0], rep[4] - before[1]
        if rejected > 0 and rejection is not None:
            raise Rejected(*rejection)
        return max(0, min(num, accepted))

    def _resend_end_later(self, rs: RoundState, dest: int, body: bytes, echo: int, deadline: float) -> None:
        """After :meth:`_end_push`'s copies went unanswered: a daemon thread sends one more SEND_END
        every ``_LATE_SEND_END_EVERY_S`` until the owner's REPORT for it comes, ``deadline`` (the
        push's) passes, the transport stops or ``_LATE_SEND_END_MAX`` more copies went. The push
        itself returns as before (no report: it cannot tell what arrived).

        Without it an owner that got no copy finalized this sender's chunks only at its reduce
        deadline: every copy lost (0.2^5 per sender and owner at 20% loss), or dropped over the
        owner's pending budget while its plan was late. One round in ~40 at 20% loss took the
        experiment's whole 30 s reduce timeout."""

        def answered() -> bool:
            return dest in rs.reports and rs.reports[dest][5] >= echo

        def run() -> None:
            for k in range(_LATE_SEND_END_MAX):
                with rs.cv:
                    if rs.cv.wait_for(answered, timeout=_LATE_SEND_END_EVERY_S):
                        return
                if self._stopped.is_set() or time.monotonic() >= deadline:
                    return
                with rs.lock:
                    rs.send_end_at[(dest, _SEND_END_COPIES + k)] = time.monotonic()
                self._send_ctl(rs, dest, rs.sealer.seal(Kind.SEND_END, body, chunk=_SEND_END_COPIES + k))
            log.debug("round %d: no REPORT from %s for SEND_END", rs.round, rs.site_ids[dest])

        threading.Thread(target=run, name=f"dgram-end-{rs.round}-{dest}", daemon=True).start()

    def _send_ctl(self, rs: RoundState, dest: int, data: bytes, *, refused_raises: bool = False) -> None:
        """One small control datagram (SEND_END, REPORT, NACK): not paced, never a burst.

        Raises:
            PeerUnavailable: ``refused_raises`` and the kernel reported the port closed (an
                ICMP error of this or an earlier datagram; a batch of contributions leaves
                before the first error can come back, so the SEND_END is where a push sees it).
        """
        if self._stopped.is_set():  # as _send_batch: nothing leaves a stopped transport
            return
        try:
            self._send_sock(rs.plan.members[dest].address).send(data)
            self._count(wire_sent=len(data))
        except ConnectionRefusedError as e:
            if refused_raises:
                raise PeerUnavailable(f"{rs.site_ids[dest]} refused datagrams (port closed): {e}") from e
            log.debug("control datagram to %s failed: %s", rs.site_ids[dest], e)
        except OSError as e:
            log.debug("control datagram to %s failed: %s", rs.site_ids[dest], e)

    def _dispatch_loop(self) -> None:
        """Dispatch thread: takes what the receive thread queued (batches, up to
        ``_DISPATCH_BATCH`` items per wake-up) and hands each sender's consecutive
        contributions to the handler as one batch (``handle_contributions``: one decode per
        run of chunks)."""
        while not self._stopped.is_set():
            try:
                items = list(self._dispatch.get(timeout=min(0.1, max(0.0, self._ends_due - time.monotonic()))))
            except queue.Empty:
                self._check_all_ends()
                continue
            num = queued_datagrams(items)
            while num < _DISPATCH_BATCH:
                try:
                    more = self._dispatch.get_nowait()
                except queue.Empty:
                    break
                items += more
                num += queued_datagrams(more)
            with self._lock:
                self._queued -= num
            for group in dispatch_groups(items):
                if len(group) > 1 or type(items[group[0]][3]) is ContributionRun:
                    self._dispatch_contributions([items[i] for i in group])
                else:
                    self._dispatch_one(*items[group[0]])
            if self._ends_due <= time.monotonic():
                self._check_all_ends()

    def _dispatch_one(self, kind: int, rs: RoundState, h, obj) -> None:
        try:
            if kind == Kind.CONTRIB:
                self._handle_contribution(rs, h.sender, obj)
            elif kind == Kind.SEND_END:
                self._answer_send_end(rs, h.sender, obj, copy=h.chunk)
            elif kind == Kind.MEAN_ACK:
                self._answer_ack(rs, h, obj)
            elif kind == Kind.BUCKET_END:
                self._answer_bucket_end(rs, h, obj)
        except TransportError as e:
            log.warning("round %d: datagram %s from %s: %s", rs.round, kind, rs.site_ids[h.sender], e)
        except Exception:
            log.exception("datagram dispatch failed")

    def _dispatch_contributions(self, items: list[tuple]) -> None:
        """Contributions of one sender and round, in arrival order (:func:`dispatch_groups`):
        Contributions and :class:`~dtrain.protocol.ContributionRun` s, handed to the handler as
        one run where they share codec and claim (else as a list of Contributions)."""
        _, rs, h, _ = items[0]
        objs = [obj for _, _, _, obj in items]
        cs: Sequence[Contribution] | None = ContributionRun.concat(objs)
        if cs is None:
            cs = [c for o in objs for c in (o if type(o) is ContributionRun else (o,))]
        batch = getattr(self._handler, "handle_contributions", None)
        if batch is None:
            for c in cs:
                self._dispatch_one(Kind.CONTRIB, rs, h, c)
            return
        try:
            results = batch(cs)
        except Exception:
            log.exception("datagram dispatch failed")
            return
        finally:
            self._note_handled(rs, h.sender, cs.buckets if isinstance(cs, ContributionRun) else [c.bucket for c in cs])
        refused = [e for e in results if e is not None]
        with rs.lock:
            st = rs.stats[h.sender]
            st.accepted += len(results) - len(refused)
            st.rejected += len(refused)
            if refused:
                st.last_rejection = (refused[-1].code.value, refused[-1].reason)
        if refused:
            self._count_refused(refused)

    def _count_refused(self, refused: Sequence[Rejected]) -> None:
        with self._lock:
            self._counts["rejected"] += len(refused)
            for e in refused:
                k = f"rejected_{e.code.name.lower()}"
                self._counts[k] = self._counts.get(k, 0) + 1

    def _handle_contribution(self, rs: RoundState, sender: int, c: Contribution) -> None:
        assert self._handler is not None
        try:
            self._handle_one_contribution(rs, sender, c)
        finally:
            self._note_handled(rs, sender, [c.bucket])

    def _handle_one_contribution(self, rs: RoundState, sender: int, c: Contribution) -> None:
        assert self._handler is not None
        try:
            self._handler.handle_contribution(c)
        except Rejected as e:
            self._count_refused([e])
            with rs.lock:
                st = rs.stats[sender]
                st.rejected += 1
                st.last_rejection = (e.code.value, e.reason)  # RejectCode name on the wire
            return
        with rs.lock:
            rs.stats[sender].accepted += 1

    def _answer_bucket_end(self, rs: RoundState, h, body: bytes = b"") -> None:
        """The sender sent all of bucket ``h.bucket``'s chunks, ``body`` says how many (its running
        count to this site this round): once that many were handled here, or the reordering grace
        passed, what is missing was lost and the bucket need not wait for it (:meth:`_end_sender`)."""
        if not 0 <= h.bucket < len(rs.owners) or rs.owners[h.bucket] != rs.site_id or len(body) not in (0, _COUNT.size):
            self._opener.count("malformed")
            return
        self._end_sender(rs, h.sender, h.bucket, _COUNT.unpack(body)[0] if body else None)

    def _answer_send_end(self, rs: RoundState, sender: int, body: bytes, *, copy: int = 0) -> None:
        """The REPORT for a SEND_END: it carries the SEND_END's copy number in its chunk field,
        so the sender knows which copy it answers (its round-trip sample, :mod:`.datagram_rtt`)."""
        if len(body) != _SEND_END.size:
            self._opener.count("malformed")
            return
        echo, _, _, announced = _SEND_END.unpack(body)
        self._end_sender(rs, sender, -1, announced)  # the REPORT goes now; the end may wait
        with rs.lock:
            st = rs.stats.setdefault(sender, SenderStats())
            head = _REPORT.pack(
                st.datagrams, st.bytes, st.last_t - st.first_t, st.accepted, st.rejected, echo, st.socket_drops
            )
            code, reason = st.last_rejection
        tail = (code + "\0" + reason).encode()[: self._body_max - _REPORT.size] if code else b""
        self._send_ctl(rs, sender, rs.sealer.seal(Kind.REPORT, head + tail, chunk=copy))

    def pull_state(self, address: str, bucket: int, *, requester: str, timeout_s: float) -> BucketState:
        return self._grpc.pull_state(address, bucket, requester=requester, timeout_s=timeout_s)

    def probe_link(self, address: str, *, max_bytes: int, timeout_s: float, requester: str) -> LinkProbe:
        """Over the gRPC half (a TCP flow: conservative for the paced datagrams, which keep
        their rate under loss that slows TCP)."""
        return self._grpc.probe_link(address, max_bytes=max_bytes, timeout_s=timeout_s, requester=requester)
