"""The receive half of the datagram data path (:class:`~.datagram.DatagramTransport`).

The receive thread (:meth:`DatagramReceive._recv_loop`) waits for the UDP socket, reads
what is queued (one ``recvmmsg`` and one batch authentication with the compiled loop,
``recvmsg`` and :meth:`~.datagram_wire.Opener.open` per datagram without it), and hands
each authenticated, new datagram on by kind: contributions and control datagrams to the
dispatch thread's queue (bounded: ``_MAX_QUEUED`` items), mean chunks to the round's
assemblies (:mod:`.datagram_means`), REPORTs to the waiting sender. Datagrams of a round
whose plan has not arrived are held (``max_pending_datagrams``) and opened at
``begin_round``.

:class:`DatagramReceive` is a mixin of :class:`~.datagram.DatagramTransport`: it uses the
transport's socket, opener, rounds, counters and config.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import socket
import struct
import sys
import time
from typing import Any, Sequence

import numpy as np

from dtrain.protocol import Contribution, ContributionRun, made
from dtrain.transports.datagram_native import PlainColumns
from dtrain.transports.datagram_reorder import SeqArrivals
from dtrain.transports.datagram_round import RoundState, SenderStats
from dtrain.transports.datagram_wire import (
    CLAIM_BYTES,
    CODEC_WIRE_NAMES,
    HEADER,
    HEADER_BYTES,
    TAG_BYTES,
    BatchOpened,
    Dropped,
    Header,
    Kind,
    split_contribution_body,
)

__all__ = ["HELD_COPY", "DatagramReceive", "dispatch_groups", "queued_datagrams"]

log = logging.getLogger(__name__)

_REPORT = struct.Struct("<QQdQQQQ")  # received datagrams, bytes, recv_s, accepted, rejected, echo, socket drops
_TIMESPEC = struct.Struct("@qq")
_U32 = struct.Struct("@I")
_U32LE = struct.Struct("<I")
_PLAIN_OVERHEAD = HEADER_BYTES + CLAIM_BYTES + TAG_BYTES  # a whole contribution's datagram less its codec payload
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # == SCM_TIMESTAMPNS (Linux)
_SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
_MAX_QUEUED = 65536  # datagrams waiting for the dispatch thread at most (a flood's bound)
_RECV_BATCH = 256  # datagrams the receive thread reads per wake-up at most
_UDP_GRO = 104  # linux/udp.h (Linux >= 5.0); the socket module does not name it
_DATA_KINDS = (Kind.CONTRIB, Kind.MEAN, Kind.MEAN_META)  # what test_drop may discard
#: a batch this long at least is taken in columns (_hand_on_plain): its compiled pass and per-sender
#: Python cost ~15 µs a batch, so below it row by row is cheaper (the hand-on alone, µs a datagram,
#: columns against rows: 2 rows 9.7 / 7.1, 4 rows 4.8 / 5.0, 8 rows 2.5 / 3.6, 16 rows 1.4 / 3.0)
_COLUMNS_MIN_ROWS = 4


def _contribution(rs: RoundState, h: Header, payload: bytes, tokens: int) -> Contribution:
    """The Contribution a CONTRIB datagram (or its reassembled fragments) carries, its claim
    ``tokens`` read from the sealed body (:func:`~.datagram_wire.split_contribution_body`):
    equal to ``Contribution(round=h.round, ...)``, made without the frozen dataclass's
    per-field ``object.__setattr__`` (half of the constructor's ~2.6 µs, once per datagram)."""
    return made(
        Contribution,
        round=h.round,
        bucket=h.bucket,
        chunk=h.chunk,
        offset=h.offset,
        numel=h.numel,
        codec=CODEC_WIRE_NAMES[h.codec],
        sender=rs.site_ids[h.sender],
        payload=payload,
        tokens=tokens,  # bounded by the owner (OpenRound.check -> claim_decision), as over gRPC
    )


def queued_datagrams(items: list[tuple]) -> int:
    """The datagrams that queued ``(kind, round state, header, object)`` items stand for: a
    :class:`~dtrain.protocol.ContributionRun` its length, any other item one."""
    return sum(len(obj) if type(obj) is ContributionRun else 1 for _, _, _, obj in items)


def dispatch_groups(items: Sequence[tuple]) -> list[list[int]]:
    """The order in which the dispatch thread handles queued ``(kind, round state, header,
    object)`` items, as lists of indices: each stretch of consecutive contributions is split
    by round and sender (one batch each, in order of first arrival; senders' datagrams
    interleave on the wire), every other item alone and in place, so each sender's items
    keep their order (a SEND_END after that sender's contributions)."""
    out: list[list[int]] = []
    stretch: dict[tuple, list[int]] = {}
    for i, (kind, rs, h, _) in enumerate(items):
        if kind == Kind.CONTRIB:
            stretch.setdefault((id(rs), h.sender), []).append(i)
            continue
        out += stretch.values()
        stretch = {}
        out.append([i])
    out += stretch.values()
    return out


def _enable_rx_meta(sock: socket.socket) -> int:
    """Ask for arrival timestamps and drop counts on ``sock``; the ancillary buffer size, 0 if refused."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        sock.setsockopt(socket.SOL_SOCKET, _SO_RXQ_OVFL, 1)
    except OSError:
        return 0
    return socket.CMSG_SPACE(_TIMESPEC.size) + socket.CMSG_SPACE(_U32.size)


#: the copy number a REPORT names when it answers a SEND_END that was held for its round's
#: key (:meth:`DatagramReceive._open_held`): no copy is sent with it, so no round-trip sample
HELD_COPY = (1 << 32) - 1


class DatagramReceive:
    """The receive thread and what it hands on (see the module docstring).

    The transport provides what these methods use: ``config``, ``_sock``, ``_native``,
    ``_opener``, ``_stopped``, ``_lock``, ``_recv_lock``, ``_pending``, ``_dispatch``, ``_queued``, ``_rx``,
    ``_drop_rng``, ``_counts``, ``_sock_drops``, ``_reorder`` (the :class:`~.datagram_reorder.ReorderWindow`
    each overtaken contribution's lateness goes to) and the methods ``_round``, ``_on_mean``,
    ``_on_mean_run``, ``_on_mean_cols``, ``_unpin_means``, ``_answer_nack``.
    """

    config: Any
    _sock: Any
    _native: Any
    _gro: int | None
    _plain: PlainColumns | None
    _opener: Any
    _stopped: Any
    _lock: Any
    _pending: list[bytes]
    _recv_lock: Any
    _dispatch: queue.Queue
    _queued: int
    _rx: tuple | None
    _drop_rng: Any
    _counts: dict[str, int]
    _sock_drops: int
    _reorder: Any
    _rtt: Any
    _drained_at: float
    _ends_waiting: bool
    _round: Any
    _on_mean: Any
    _on_mean_run: Any
    _on_mean_cols: Any
    _unpin_means: Any
    _answer_nack: Any

    def _recv_loop(self) -> None:
        """Receive thread: waits for the socket to be readable (``poll``, 0.1 s at most, so
        ``stop`` is seen), then reads every queued datagram (at most ``_RECV_BATCH``)
        without blocking until ``EAGAIN``: one wake-up and no ``poll`` per datagram when
        they arrive faster than they are handled. With the compiled loop one ``recvmmsg``
        reads the batch and one call authenticates it (:meth:`~.datagram_wire.Opener.open_batch`);
        else ``recvmsg`` and :meth:`~.datagram_wire.Opener.open` per datagram.

        Where the kernel offers them (Linux), every datagram comes with its
        arrival time at the socket (``SO_TIMESTAMPNS``) and the socket's running count of
        datagrams dropped at a full receive buffer (``SO_RXQ_OVFL``): the REPORT's receive
        window is then the network's, not this thread's (a CPU-starved receiver used to look
        like a queue on the path), and the drops say when this receiver is the bottleneck."""
        sock = self._sock
        assert sock is not None
        anc = _enable_rx_meta(sock)
        read = self._read_native if self._native is not None else self._read_python
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        more = False  # the last read stopped at its bound with datagrams left (in the socket or coalesced)
        try:
            while not self._stopped.is_set():
                t = time.monotonic()
                try:
                    if not more and not poller.poll(2 if self._ends_waiting else 100):
                        self._drained_at = t  # nothing readable since t: all that came before was read
                        continue
                except OSError:
                    break
                if self.config.recv_coalesce_s and not more:
                    time.sleep(self.config.recv_coalesce_s)
                more = False
                try:
                    more = bool(read(sock, anc))
                except OSError:  # the socket closed by stop()
                    if self._stopped.is_set():
                        return
                except Exception:  # a bug must not stop the receive loop
                    log.exception("datagram handling failed")
        finally:
            if self._gro is not None and self._native is not None:
                self._native.gro_free(self._gro)
            self._gro = None

    def _enable_gro(self, sock: socket.socket) -> int | None:
        """With the compiled loop and ``config.gro``: ask the kernel for coalesced reads
        (``UDP_GRO``) and return the holding area of :meth:`~.datagram_native.NativeLib.recv_gro`;
        None (logged when the kernel refused) to read with ``recvmmsg``."""
        if self._native is None or not self.config.gro or not sys.platform.startswith("linux"):
            return None
        try:
            sock.setsockopt(socket.SOL_UDP, _UDP_GRO, 1)
        except OSError as e:
            log.warning("UDP receive coalescing (UDP_GRO) refused by the kernel (%s): reading with recvmmsg", e)
            return None
        return self._native.gro_state()

    def _read_python(self, sock: socket.socket, anc: int) -> bool:
        """Read and handle up to ``_RECV_BATCH`` queued datagrams one by one, then queue what
        goes to the dispatch thread, all under ``_recv_lock`` (see :meth:`_read_native`).
        True: it stopped at its bound, the socket not yet found empty."""
        out: list[tuple] = []
        with self._recv_lock:
            drained = None
            try:
                drained = self._read_python_into(sock, anc, out)
            finally:
                self._enqueue(out)
            if drained is not None:  # after the queueing (see DatagramTransport._check_all_ends)
                self._drained_at = drained
        return drained is None

    def _read_python_into(self, sock: socket.socket, anc: int, out: list[tuple]) -> float | None:
        """Up to ``_RECV_BATCH`` datagrams; the time of the read that found the socket empty (None: not emptied)."""
        size = self.config.max_datagram_bytes + 1  # a larger datagram arrives cut to this: "oversized"
        for _ in range(_RECV_BATCH):
            t_arrival = None
            t = time.monotonic()
            try:
                if anc:
                    data, cmsgs, _, _ = sock.recvmsg(size, anc)
                    t_arrival = self._rx_meta(cmsgs)
                else:
                    data = sock.recv(size)
            except BlockingIOError:
                return t
            except OSError:  # e.g. an ICMP error of an earlier send, or the socket closed by stop()
                if self._stopped.is_set():
                    raise
                continue
            self._counts["wire_received"] += len(data)  # only this thread writes it
            try:
                self._on_datagram(data, t_arrival, out)
            except Exception:  # a bug must not stop the receive loop
                log.exception("datagram handling failed")
        return None

    def _read_native(self, sock: socket.socket, anc: int) -> bool:
        """Read up to 4 batches of ``_RECV_BATCH`` queued datagrams: each with one ``recvmmsg``
        (or coalesced reads, ``config.gro``), opened in one call, handed on (:meth:`_hand_on`)
        and queued for the dispatch thread. True: it stopped at its bound with datagrams left.

        Each batch, from its read to its queueing, holds ``_recv_lock``: ``begin_round`` queues
        what was held for its round between two batches, never inside one, so nothing read
        after a round's key opened is queued before what was held for it (a BUCKET_END read
        just after could close a bucket before that sender's held chunks of it counted). One
        batch, not all 4, so ``begin_round`` waits for one batch at most (it waited 0.12 s for
        4 on a loaded machine)."""
        assert self._native is not None
        rx = self._rx_buffers()
        buf, lens, ts, drops = rx
        for _ in range(4):  # bounded: a flood cannot keep this thread from queueing what it read
            out: list[tuple] = []
            t = time.monotonic()
            with self._recv_lock:
                try:
                    n = self._read_batch(sock, anc, rx, out)
                finally:
                    self._enqueue(out)
            if n is not None and n < len(lens):  # the socket is empty (0 included): all before t is queued
                self._drained_at = t
                return False
        return True

    def _read_batch(self, sock: socket.socket, anc: int, rx: tuple, out: list[tuple]) -> int | None:
        """One ``recvmmsg`` batch of :meth:`_read_native`: the rows read (None: an error to read past)."""
        buf, lens, ts, drops = rx
        if self._gro is not None:
            n = self._native.recv_gro(self._gro, sock.fileno(), buf, lens, ts, drops)
        else:
            n = self._native.recv(sock.fileno(), buf, lens, ts, drops)
        if n < 0:  # an ICMP error of an earlier send: the next call reads on
            if self._stopped.is_set():
                raise OSError(-n, os.strerror(-n))
            return None
        if n == 0:
            return 0
        nbytes = int(lens[:n].sum())
        self._counts["wire_received"] += nbytes  # only this thread writes it
        if anc:
            self._sock_drops = int(drops[0])
        self._open_rows(buf, lens, ts, n, self._test_drops(buf, lens, n), out, nbytes=nbytes)
        return n

    def _open_rows(
        self,
        buf: np.ndarray,
        lens: np.ndarray,
        ts: np.ndarray,
        n: int,
        skip: np.ndarray | None,
        out: list[tuple],
        again: bool = False,
        nbytes: int | None = None,
    ) -> None:
        """Authenticate rows ``0..n-1`` of a batch in one call, hold those of a round still to
        come (or open them again if it began meanwhile) and hand the rest on (:meth:`_hand_on`).
        ``again``: the rows were held before (:meth:`_hold` does not count them twice).
        ``nbytes``: the rows' bytes together, where the caller has summed them already."""
        opened = self._opener.open_batch(buf, lens, n, skip)
        for i in opened.pending:
            data = buf[i, : int(lens[i])].tobytes()
            if not self._hold(data, again):  # its round began meanwhile
                self._open_one(data, None, out)
        self._hand_on(buf, lens, ts, opened, out, nbytes)

    def _hand_on(
        self,
        buf: np.ndarray,
        lens: np.ndarray,
        ts: np.ndarray,
        opened: BatchOpened,
        out: list[tuple],
        nbytes: int | None = None,
    ) -> None:
        """Hand each opened datagram of a batch on, in arrival order. A whole contribution
        (one datagram) takes the short way: its Contribution goes straight to ``out`` and its
        sender's receive statistics are noted once per batch (before ``out`` is queued, so a
        SEND_END behind them in the queue sees them); consecutive whole mean chunks of one
        bucket go in one call (:meth:`_on_mean_run`); the rest goes through :meth:`_on_opened`.
        A batch of nothing but whole contributions of one round (a receiving owner's usual
        batch) is taken in columns instead (:meth:`_hand_on_plain`), and so is one of nothing
        but whole mean chunks of one round (a member's, :meth:`_hand_on_means`), with the same
        effects (tests/unit/test_datagram_recv.py). ``nbytes``: as :meth:`_open_rows`."""
        n = len(opened.ok)
        all_ok = opened.all_ok or bool(opened.ok.all())
        if n >= _COLUMNS_MIN_ROWS and all_ok:
            kind = buf[0, 3]  # row 0's: a batch of one kind is taken in columns
            if kind == Kind.CONTRIB and self._hand_on_plain(buf, lens, ts, opened.headers, n, out, nbytes):
                return
            if kind == Kind.MEAN and self._hand_on_means(buf, lens, ts, n, nbytes):
                return
        # each row's first 8 body bytes as a u64: a CONTRIB's claim (one numpy pass per batch)
        claims = np.ascontiguousarray(buf[:n, HEADER_BYTES : HEADER_BYTES + CLAIM_BYTES]).view("<u8")[:, 0]
        if all_ok:  # the usual batch: no fancy indexing
            idx, rows, lens_, ts_ = range(n), opened.headers.tolist(), lens[:n].tolist(), ts[:n].tolist()
            claims_ = claims.tolist()
        else:
            ok = np.flatnonzero(opened.ok)
            idx, rows, lens_, ts_ = ok.tolist(), opened.headers[ok].tolist(), lens[ok].tolist(), ts[ok].tolist()
            claims_ = claims[ok].tolist()
        to_mono = time.monotonic() - time.time()
        now = time.monotonic()
        rounds: dict[int, RoundState | None] = {}
        seen: dict[tuple[int, int], list] = {}  # (round, sender) -> [datagrams, bytes, first_t, last_t]
        received = 0
        means: list[tuple[Header, bytes]] = []  # a run of whole mean chunks of one bucket
        raw = buf.reshape(-1).data  # bodies are sliced from the rows as bytes (one copy each)
        stride = buf.shape[1]
        num_codecs = len(CODEC_WIRE_NAMES)
        for i, row, n_i, t, claim in zip(idx, rows, lens_, ts_, claims_):
            h = Header._make(row)
            rs = rounds[h.round] if h.round in rounds else rounds.setdefault(h.round, self._round(h.round))
            at = i * stride
            lo, hi = at + HEADER_BYTES, at + n_i - TAG_BYTES  # the plaintext body
            t_arrival = t * 1e-9 + to_mono if t else now
            if h.kind == Kind.CONTRIB and h.nfrags == 1 and hi - lo >= CLAIM_BYTES:  # the usual datagram
                tokens, body = claim, raw[lo + CLAIM_BYTES : hi].tobytes()
            else:
                tokens, body = -1, raw[lo:hi].tobytes()
            if h.kind == Kind.MEAN and h.nfrags == 1 and rs is not None:
                if means and (means[0][0].round, means[0][0].bucket, means[0][0].sender) != (
                    h.round,
                    h.bucket,
                    h.sender,
                ):
                    self._on_mean_run(rounds[means[0][0].round], means)
                    means = []
                means.append((h, body))
                continue
            if means:  # what came before this datagram is handled before it
                self._on_mean_run(rounds[means[0][0].round], means)
                means = []
            if tokens < 0 or rs is None or h.codec >= num_codecs:
                self._on_opened(rs, h, body if tokens < 0 else raw[lo:hi].tobytes(), t_arrival, out)
                continue
            st = seen.get((h.round, h.sender))
            if st is None:
                arrivals = rs.arrivals.get(h.sender) or rs.arrivals.setdefault(h.sender, SeqArrivals())
                st = seen[(h.round, h.sender)] = [0, 0, t_arrival, t_arrival, rs, arrivals]
            st[0] += 1
            st[1] += hi - lo
            if t_arrival < st[2]:
                st[2] = t_arrival
            elif t_arrival > st[3]:
                st[3] = t_arrival
            arrivals, seq = st[5], h.seq
            if seq > arrivals.hi:  # in order (SeqArrivals.note's first case, inline; trimmed per batch)
                arrivals.hi = seq
                arrivals.seqs.append(seq)
                arrivals.times.append(t_arrival)
            else:
                late = arrivals.note(seq, t_arrival)
                if late:
                    self._reorder.observe(rs.site_ids[h.sender], late)
            received += len(body)
            out.append((Kind.CONTRIB, rs, h, _contribution(rs, h, body, tokens)))
        if means:
            self._on_mean_run(rounds[means[0][0].round], means)
        for (_, sender), (num, size, first, last, rs, arrivals) in seen.items():
            arrivals.trim()
            with rs.lock:
                rs.stats.setdefault(sender, SenderStats()).note_many(num, size, first, last, self._sock_drops)
                # a site sending contributions is alive and its pacer busy: its means' quiet is not loss
                rs.owner_active[sender] = max(rs.owner_active.get(sender, 0.0), now)
        self._counts["received"] += received

    def _hand_on_plain(
        self,
        buf: np.ndarray,
        lens: np.ndarray,
        ts: np.ndarray,
        hv: np.ndarray,
        n: int,
        out: list[tuple],
        nbytes: int | None = None,
    ) -> bool:
        """:meth:`_hand_on` for a batch whose rows are all whole contributions of one round with
        a plan (a receiving owner's usual batch), with the same effects, or False (nothing done)
        for any other batch. One compiled pass (:meth:`~.datagram_native.NativeLib.plain_batch`)
        checks the rows and gives their columns, payloads and per-sender figures; then per
        sender: its arrivals (in-order sequence numbers appended as one run, else row by row as
        :meth:`_hand_on`), statistics and activity, and its rows as one
        :class:`~dtrain.protocol.ContributionRun` to ``out`` (no object per datagram), senders in
        the order of their first rows. A sender whose rows differ in codec or claim gets one
        Contribution per row instead (the owner refuses what does not match, chunk by chunk).
        The queued item's header is the sender's first of the batch (for a contribution the
        dispatch thread reads only the round and sender)."""
        (rnd,) = _U32LE.unpack_from(buf, 8)  # row 0's round
        rs = self._round(rnd)
        if rs is None:
            return False
        pc = self._plain if self._plain is not None else PlainColumns()
        self._plain = pc
        now = time.monotonic()
        total = (int(lens[:n].sum()) if nbytes is None else nbytes) - n * _PLAIN_OVERHEAD  # payload bytes, if all plain
        if total < 0:
            return False
        # the batch's payloads, copied once, straight from the rows: every byte is written (no
        # zeroing first, as a bytearray's: 2-3 µs a batch)
        blob = np.empty(total or 1, np.uint8)
        k = self._native.plain_batch(
            buf, lens, ts, n, pc, blob, offset_s=now - time.time(), now_s=now, kind=Kind.CONTRIB, round=rnd,
            num_codecs=len(CODEC_WIRE_NAMES), num_members=len(rs.site_ids),
        )  # fmt: skip
        if not k:
            return False
        view = memoryview(blob).toreadonly()
        senders, buckets, chunks, offsets, numels, codecs, seqs, claims = pc.cols[:n].T.tolist()
        times, at, width = pc.t[:n].tolist(), pc.at[:n].tolist(), pc.width[:n].tolist()
        payloads = [view[a : a + w] for a, w in zip(at, width)]
        order = pc.order[:k].tolist()
        for s in order:
            first, num = int(pc.first[s]), int(pc.rows[s])
            if k == 1:  # one sender: its rows are the batch's
                rows, s_seqs, s_times = range(n), seqs, times
            else:
                rows = [i for i in range(first, n) if senders[i] == s]
                s_seqs, s_times = [seqs[i] for i in rows], [times[i] for i in rows]
            self._note_sender(rs, s, s_seqs, s_times, bool(pc.ascending[s]))
            with rs.lock:
                rs.stats.setdefault(s, SenderStats()).note_many(
                    num, int(pc.bytes[s]), float(pc.tmin[s]), float(pc.tmax[s]), self._sock_drops
                )
                rs.owner_active[s] = max(rs.owner_active.get(s, 0.0), now)
            head = Header._make(hv[first].tolist())
            if pc.uniform[s]:
                pick = (lambda col: col) if k == 1 else (lambda col: [col[i] for i in rows])
                run = ContributionRun(
                    round=rnd,
                    sender=rs.site_ids[s],
                    codec=CODEC_WIRE_NAMES[codecs[first]],
                    tokens=claims[first],
                    buckets=pick(buckets),
                    chunks=pick(chunks),
                    offsets=pick(offsets),
                    numels=pick(numels),
                    payloads=pick(payloads),
                )
                out.append((Kind.CONTRIB, rs, head, run))
                continue
            for i in rows:
                h = Header._make(hv[i].tolist())
                out.append((Kind.CONTRIB, rs, head, _contribution(rs, h, bytes(payloads[i]), claims[i])))
        self._counts["received"] += total  # codec payload bytes
        return True

    def _hand_on_means(
        self, buf: np.ndarray, lens: np.ndarray, ts: np.ndarray, n: int, nbytes: int | None = None
    ) -> bool:
        """:meth:`_hand_on` for a batch whose rows are all whole mean chunks of one round with a
        plan (a member's usual batch), with the same effects, or False (nothing done) for any
        other batch or where the senders bitmap is wider than 8 bytes (over 64 members: row by
        row). One compiled pass (:meth:`~.datagram_native.NativeLib.plain_batch`, the bitmap as
        each row's lead) checks the rows and gives their columns and payloads (one copy, each
        chunk's payload a read-only view of it); each run of consecutive rows of one (owner,
        bucket) then goes to :meth:`_on_mean_cols` in one call, as the row path's runs go to
        :meth:`_on_mean_run`. No object per datagram but its MeanChunk."""
        (rnd,) = _U32LE.unpack_from(buf, 8)  # row 0's round
        rs = self._round(rnd)
        if rs is None:
            return False
        nbits = (len(rs.site_ids) + 7) // 8
        total = (int(lens[:n].sum()) if nbytes is None else nbytes) - n * (HEADER_BYTES + nbits + TAG_BYTES)
        if nbits > 8 or total < 0:
            return False
        pc = self._plain if self._plain is not None else PlainColumns()
        self._plain = pc
        now = time.monotonic()
        blob = np.empty(total or 1, np.uint8)  # every byte is written
        k = self._native.plain_batch(
            buf, lens, ts, n, pc, blob, offset_s=now - time.time(), now_s=now, kind=Kind.MEAN, round=rnd,
            num_codecs=len(CODEC_WIRE_NAMES), num_members=len(rs.site_ids), lead=nbits,
        )  # fmt: skip
        if not k:
            return False
        view = memoryview(blob).toreadonly()
        cols = pc.cols[:n]
        senders, buckets, chunks, offsets, numels, codecs, _, bitmaps = cols.T.tolist()
        payloads = [view[a : a + w] for a, w in zip(pc.at[:n].tolist(), pc.width[:n].tolist())]
        named = {v: rs.mean_senders(v.to_bytes(nbits, "little")) for v in set(bitmaps)}
        who = [named[bitmaps[0]]] * n if len(named) == 1 else [named[v] for v in bitmaps]
        # where each run of one (owner, bucket) ends: the row path's runs (_hand_on's `means`)
        if k == 1 and buckets.count(buckets[0]) == n:  # the usual batch: one owner's one bucket
            ends = [n]
        else:
            ends = (np.flatnonzero((cols[1:, 0] != cols[:-1, 0]) | (cols[1:, 1] != cols[:-1, 1])) + 1).tolist() + [n]
        start, kept, runs = 0, 0, []
        for end in ends:
            runs.append((buckets[start], chunks[start:end]))
            kept += self._on_mean_cols(
                rs,
                senders[start],
                buckets[start],
                chunks[start:end],
                offsets[start:end],
                numels[start:end],
                codecs[start:end],
                payloads[start:end],
                who[start:end],
            )
            start = end
        if kept * 2 < total:
            self._unpin_means(rs, blob, runs)
        return True

    def _note_sender(self, rs: RoundState, s: int, seqs: list[int], times: list[float], ascending: bool) -> None:
        """Sender ``s``'s arrivals of a plain batch (:meth:`_hand_on_plain`): its sequence numbers
        (rising row by row: ``ascending``) and arrival times, as :meth:`_hand_on` notes them."""
        arrivals = rs.arrivals.get(s) or rs.arrivals.setdefault(s, SeqArrivals())
        if ascending and seqs[0] > arrivals.hi:  # every one a new high, in order
            arrivals.seqs += seqs
            arrivals.times += times
            arrivals.hi = seqs[-1]
        else:
            for seq, t in zip(seqs, times):
                if seq > arrivals.hi:
                    arrivals.hi = seq
                    arrivals.seqs.append(seq)
                    arrivals.times.append(t)
                elif late := arrivals.note(seq, t):
                    self._reorder.observe(rs.site_ids[s], late)
        arrivals.trim()

    def _rx_buffers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The receive thread's batch buffers (rows of ``max_datagram_bytes + 1``: a larger
        datagram shows as that, i.e. oversized)."""
        if self._rx is None:
            stride = self.config.max_datagram_bytes + 1
            self._rx = (
                np.zeros((_RECV_BATCH, stride), np.uint8),
                np.zeros(_RECV_BATCH, np.uint32),
                np.zeros(_RECV_BATCH, np.int64),
                np.zeros(1, np.uint32),
            )
        return self._rx

    def _test_drops(self, buf: np.ndarray, lens: np.ndarray, n: int) -> np.ndarray | None:
        """Rows ``test_drop`` discards before they are opened (data kinds only), counted."""
        if not self.config.test_drop:
            return None
        skip = np.zeros(n, bool)
        for i in range(n):
            if lens[i] > 3 and buf[i, 3] in _DATA_KINDS and self._drop_rng.random() < self.config.test_drop:
                skip[i] = True
        self._counts["test_dropped"] += int(skip.sum())
        return skip

    def _rx_meta(self, cmsgs: list) -> float | None:
        """Arrival time (``time.monotonic()`` seconds) from the ancillary data; notes socket drops."""
        t = None
        for _, kind, data in cmsgs:
            if kind == _SO_TIMESTAMPNS and len(data) >= 16:
                sec, nsec = _TIMESPEC.unpack_from(data)
                t = sec + nsec * 1e-9 - time.time() + time.monotonic()
            elif kind == _SO_RXQ_OVFL and len(data) >= 4:
                self._sock_drops = _U32.unpack_from(data)[0]
        return t

    def _hold(self, data: bytes, again: bool = False) -> bool:
        """Keep a datagram of a round whose plan has not arrived (bounded); opened at ``begin_round``.
        Counted ``held_before_key`` the first time (``again``: it was held before).

        False: its round's key arrived since it failed to open (the caller opens it again).
        ``begin_round`` opens the key, then takes what is held, under ``_lock``; the check here is
        under the same lock, so a datagram caught between the two is either held and taken, or
        opened again, never left held for a round that has begun (it was: 0.7% of the contributions
        of a run lost on loopback at 0% loss, under CI load)."""
        with self._lock:
            if len(data) >= HEADER.size and self._opener.is_open(HEADER.unpack_from(data)[4]):
                return False
            if len(self._pending) < self.config.max_pending_datagrams:
                self._pending.append(data)
                self._counts["held_before_key"] += not again
                return True
        self._opener.count("over_budget")
        return True

    def _open_held(self, held: list[bytes], out: list[tuple]) -> None:
        """Open and hand on what was held for a round whose key just arrived (``begin_round``,
        which holds ``_recv_lock``: the receive thread and its buffers wait). With the compiled
        loop in batches of ``_RECV_BATCH`` through the receive thread's own buffers, one
        :meth:`~.datagram_wire.Opener.open_batch` and :meth:`_hand_on` each; else one by one.

        A site whose plan came late holds most of the others' contributions to it: one by one,
        opening them took 0.1-0.6 s of its round's start on the datagram experiment. Held
        datagrams already passed ``test_drop`` when they were read; they are not dropped again.

        A held SEND_END is answered with a REPORT that names no copy (:data:`HELD_COPY`): its
        wait here was for the plan, not the path, so the sender takes no round-trip sample from
        it (it did: seven such at once raised a flaky run's estimate from 70 to 527 ms)."""
        start = len(out)
        self._open_held_rows(held, out)
        for i in range(start, len(out)):
            item = out[i]
            if item[0] == Kind.SEND_END:
                out[i] = (item[0], item[1], item[2]._replace(chunk=HELD_COPY), *item[3:])

    def _open_held_rows(self, held: list[bytes], out: list[tuple]) -> None:
        """:meth:`_open_held`'s opening: one by one, or in batches with the compiled loop."""
        if self._native is None:
            for data in held:
                self._open_one(data, None, out, again=True)
            return
        buf, lens, ts, _ = self._rx_buffers()
        stride = buf.shape[1]
        for at in range(0, len(held), _RECV_BATCH):
            part = held[at : at + _RECV_BATCH]
            for i, data in enumerate(part):
                k = min(len(data), stride)  # a held datagram was read into a row: never longer
                buf[i, :k] = np.frombuffer(data, np.uint8, k)
                lens[i] = k
            ts[: len(part)] = 0  # arrival: now
            self._open_rows(buf, lens, ts, len(part), None, out, again=True)  # a round still to come: held again

    def _on_datagram(self, data: bytes, t_arrival: float | None, out: list[tuple]) -> None:
        """A datagram just read by the Python loop: ``test_drop``, then :meth:`_open_one`."""
        if self.config.test_drop and len(data) > 3 and data[3] in _DATA_KINDS:
            if self._drop_rng.random() < self.config.test_drop:
                self._counts["test_dropped"] += 1
                return
        self._open_one(data, t_arrival, out)

    def _open_one(self, data: bytes, t_arrival: float | None, out: list[tuple], again: bool = False) -> None:
        """Open one datagram and hand it on; what goes to the dispatch thread is appended to ``out``.
        Also for datagrams held or read earlier (``again``), which passed ``test_drop`` then: not
        dropped again."""
        try:
            h, body = self._opener.open(data)
        except Dropped as e:
            if e.reason == "unknown_round" and not self._hold(data, again):  # its round began meanwhile: once more
                try:
                    h, body = self._opener.open(data)
                except Dropped:
                    return
            else:
                return
        self._on_opened(self._round(h.round), h, body, time.monotonic() if t_arrival is None else t_arrival, out)

    def _on_opened(self, rs: RoundState | None, h: Header, body: bytes, t_arrival: float, out: list[tuple]) -> None:
        """One authenticated, new datagram: by kind, to its handler here or queued in ``out``."""
        if rs is None:
            self._opener.count("stale_round")
            return
        if h.kind == Kind.CONTRIB:
            self._on_contribution(rs, h, body, t_arrival, out)
        elif h.kind in (Kind.MEAN, Kind.MEAN_META):
            self._on_mean(rs, h, body)
        elif h.kind == Kind.NACK:
            self._answer_nack_here(rs, h, body)
        elif h.kind in (Kind.SEND_END, Kind.MEAN_ACK, Kind.BUCKET_END):
            out.append((h.kind, rs, h, body))
        elif h.kind == Kind.REPORT:
            self._on_report(rs, h, body)
        else:
            self._opener.count("malformed")

    def _answer_nack_here(self, rs: RoundState, h: Header, body: bytes) -> None:
        """A NACK is answered in this thread, not queued for the dispatch thread: it asks for
        mean chunks that already left, so nothing queued before it (contributions, ends) changes
        the answer, and behind a backlog of contributions it waited as long as that backlog took
        to handle (through netem on 2 cores, the SEND_END -> REPORT round trip that shares the
        queue measured 250-880 ms on an 80 ms path). The answer itself is the repair thread's."""
        try:
            self._answer_nack(rs, h, body)
        except Exception:  # a bug must not drop the rest of the batch
            log.exception("round %d: NACK from %s failed", rs.round, rs.site_ids[h.sender])

    def _enqueue(self, items: list[tuple]) -> None:
        """Queue a batch of items for the dispatch thread; at most ``_MAX_QUEUED`` datagrams
        wait (:func:`queued_datagrams`; the rest: over budget)."""
        if not items:
            return
        num = queued_datagrams(items)
        with self._lock:
            room = self._queued + num <= _MAX_QUEUED
            self._queued += num if room else 0
        if room:
            self._dispatch.put(items)
        else:
            self._opener.count("over_budget", num)

    def _on_contribution(self, rs: RoundState, h: Header, body: bytes, t_arrival: float, out: list[tuple]) -> None:
        if h.codec >= len(CODEC_WIRE_NAMES):
            self._opener.count("malformed")
            return
        late = rs.arrivals.setdefault(h.sender, SeqArrivals()).note(h.seq, t_arrival)
        if late:
            self._reorder.observe(rs.site_ids[h.sender], late)
        with rs.lock:
            rs.stats.setdefault(h.sender, SenderStats()).note(len(body), t_arrival, self._sock_drops)
            rs.owner_active[h.sender] = max(rs.owner_active.get(h.sender, 0.0), t_arrival)
            whole = rs.add_fragment((Kind.CONTRIB, h.sender, h.bucket, h.chunk), h.frag, h.nfrags, body)
        if whole is False:
            self._opener.count("over_budget")
        if not whole:
            return
        try:
            tokens, payload = split_contribution_body(whole)
        except Dropped as e:
            self._opener.count(e.reason)
            return
        self._counts["received"] += len(payload)
        out.append((Kind.CONTRIB, rs, h, _contribution(rs, h, payload, tokens)))

    def _on_report(self, rs: RoundState, h, body: bytes) -> None:
        if len(body) < _REPORT.size:
            self._opener.count("malformed")
            return
        rep = _REPORT.unpack_from(body, 0)
        code, _, reason = body[_REPORT.size :].decode("utf-8", "replace").partition("\0")
        now = time.monotonic()
        with rs.cv:
            # the REPORT names the SEND_END copy it answers (its chunk field): a round-trip sample
            # with no retransmission ambiguity (what Karn's rule guards against, RFC 6298 section 3)
            sent_at = rs.send_end_at.pop((h.sender, h.chunk), None)
            old = rs.reports.get(h.sender)
            if old is None or rep[5] >= old[5]:
                rs.reports[h.sender] = rep
                if code:
                    rs.rejections[h.sender] = (code, reason)
            rs.cv.notify_all()
        if sent_at is not None and now >= sent_at:
            self._rtt.observe(rs.site_ids[h.sender], now - sent_at)
