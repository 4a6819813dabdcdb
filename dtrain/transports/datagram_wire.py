"""Wire format and sealing of the datagram data path (``dtrain.transports.datagram``).

Every datagram is decodable on its own: a fixed 43-byte header, then the body sealed
with AES-256-GCM (NIST SP 800-38D, from the ``cryptography`` package) under the round's
key (``RoundPlan.datagram_key``, which only travels over the authenticated gRPC control
plane). The header is the AEAD's associated data, so a changed header field fails
authentication exactly like a changed body byte. Layout (little-endian)::

    offset size field
    0      2    magic b"DG"
    2      1    version (3)
    3      1    kind: CONTRIB=1, MEAN=2, MEAN_META=3, NACK=4, SEND_END=5, REPORT=6, MEAN_ACK=7,
                BUCKET_END=8
    4      4    run id (u32; a run's sites share it; 0 by default)
    8      4    round
    12     4    bucket
    16     4    chunk
    20     4    element offset of the chunk within the bucket
    24     4    element count of the chunk
    28     1    codec id (index into CODEC_WIRE_NAMES; 255: none)
    29     2    sender: index of the sending site in the round's sorted member list
    31     8    sequence number (per sender and round, never reused)
    39     2    fragment index
    41     2    fragment count (1: the datagram carries the whole chunk)
    43     ..   sealed body (plaintext length + 16-byte Poly1305 tag)

A CONTRIB datagram's plaintext is the contribution's token claim (u64, little-endian;
``Contribution.tokens``, 0: none) then its codec payload; a contribution sent in
fragments has the claim once, at the start of the reassembled plaintext
(:func:`contribution_body`, :func:`split_contribution_body`). Being in the sealed body,
the claim is authenticated (and hidden) like the payload: a changed claim fails as
``forged``. Version 1 had no claim, version 2 sealed with ChaCha20-Poly1305; a datagram of
another version is dropped as ``bad_version``.
The claim costs no datagram: a chunk's size leaves room for the mean's senders bitmap
(``datagram_chunk_bytes``: 64 members, 8 bytes), which a contribution does not carry.

The 96-bit nonce is ``sender (u16) | 0 (u16) | sequence (u64)``: unique under a round's
key because each sender numbers its datagrams once per round. The receiver keeps, per
round and sender, a window of the sequence numbers it accepted
(:class:`ReplayWindow`), so a replayed datagram is dropped even though it authenticates.

:class:`Opener` checks, in this order, and drops (counting the reason) what fails:
size (truncated / oversized), magic, version, run, round (unknown, or no longer open),
sender index, authentication (forged or wrong key), replay. Nothing is ever handed on
before it authenticated.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
import weakref
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from dtrain.codecs.config import CODEC_NAMES, ZSTD_SUFFIX
from dtrain.transports.datagram_native import OPEN_STATUS, header_view

if TYPE_CHECKING:
    from dtrain.transports.datagram_native import NativeLib

__all__ = [
    "AEAD_NAME",
    "BatchOpened",
    "CLAIM",
    "CLAIM_BYTES",
    "CODEC_WIRE_NAMES",
    "DROP_REASONS",
    "HEADER",
    "HEADER_BYTES",
    "KEY_BYTES",
    "Kind",
    "Header",
    "Dropped",
    "Opener",
    "ReplayWindow",
    "SealedBatch",
    "Sealer",
    "TAG_BYTES",
    "codec_id",
    "contribution_body",
    "max_body_bytes",
    "split_contribution_body",
]

MAGIC = b"DG"
VERSION = 3  # 2: a CONTRIB body starts with the token claim; 3: AES-256-GCM
AEAD_NAME = "AES-256-GCM"  # the cipher of VERSION (the Sealer's and the compiled loop's)
HEADER = struct.Struct("<2sBBIIIIIIBHQHH")
HEADER_BYTES: int = HEADER.size  # 43
TAG_BYTES = 16
KEY_BYTES = 32
_NONCE = struct.Struct("<HHQ")
_U32_MAX = (1 << 32) - 1

CODEC_WIRE_NAMES: tuple[str, ...] = CODEC_NAMES + tuple(n + ZSTD_SUFFIX for n in CODEC_NAMES)
_CODEC_IDS = {n: i for i, n in enumerate(CODEC_WIRE_NAMES)}
NO_CODEC = 255

DROP_REASONS: tuple[str, ...] = (
    "truncated",
    "oversized",
    "bad_magic",
    "bad_version",
    "wrong_run",
    "unknown_round",
    "stale_round",
    "bad_sender",
    "forged",
    "replayed",
    "over_budget",
    "malformed",
)
_OTHER_ROUND = OPEN_STATUS.index("other_round")  # rows NativeLib.open_round leaves for the general path
# NativeLib.open_round's outcomes that are drops, by code ("ok", "skip", "other_round": not counted there)
_STATUS_DROPS = tuple((code, r) for code, r in enumerate(OPEN_STATUS) if r in DROP_REASONS)


class Kind:
    """Datagram kinds (header byte 3)."""

    CONTRIB = 1  # one chunk (or fragment) of a contribution, member -> owner
    MEAN = 2  # one chunk (or fragment) of a bucket's mean, owner -> members
    MEAN_META = 3  # a bucket mean's chunk count and checksums, owner -> members
    NACK = 4  # chunks of a mean a member is missing, member -> owner
    SEND_END = 5  # what a member sent to an owner this round (rate control)
    REPORT = 6  # what an owner received from a member this round (rate control)
    MEAN_ACK = 7  # a member holds a bucket's whole mean, member -> owner (close() waits for it)
    BUCKET_END = 8  # a member sent all of one bucket's chunks, member -> owner (finalize it without waiting)

    ALL = (CONTRIB, MEAN, MEAN_META, NACK, SEND_END, REPORT, MEAN_ACK, BUCKET_END)


class Header(NamedTuple):
    """A parsed datagram header (see the module docstring for the fields)."""

    magic: bytes
    version: int
    kind: int
    run: int
    round: int
    bucket: int
    chunk: int
    offset: int
    numel: int
    codec: int
    sender: int
    seq: int
    frag: int
    nfrags: int


class Dropped(Exception):
    """A datagram was refused; ``reason`` is one of :data:`DROP_REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def codec_id(name: str) -> int:
    """Wire id of a codec name (ValueError naming the codec for an unknown one)."""
    try:
        return _CODEC_IDS[name]
    except KeyError:
        raise ValueError(f"codec {name!r} has no datagram wire id; allowed: {', '.join(CODEC_WIRE_NAMES)}") from None


def max_body_bytes(max_datagram_bytes: int) -> int:
    """Plaintext body bytes that fit a datagram of ``max_datagram_bytes`` (UDP payload)."""
    return max_datagram_bytes - HEADER_BYTES - TAG_BYTES


#: The token claim at the start of a CONTRIB datagram's plaintext.
CLAIM = struct.Struct("<Q")
CLAIM_BYTES: int = CLAIM.size  # 8


def contribution_body(tokens: int, payload: bytes | memoryview) -> bytes:
    """A CONTRIB plaintext: ``tokens`` (the contribution's claim, u64) then ``payload``.

    Raises:
        ValueError: ``tokens`` not an int in [0, 2^64), naming the field.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens < 1 << 64:
        raise ValueError(f"Contribution.tokens must be an int in [0, 2^64) on the datagram wire, got {tokens!r}")
    return CLAIM.pack(tokens) + payload


def split_contribution_body(body: bytes) -> tuple[int, bytes]:
    """``(tokens, payload)`` of a CONTRIB plaintext (:func:`contribution_body`).

    Raises:
        Dropped: ``malformed``, a plaintext shorter than the claim (not counted here).
    """
    if len(body) < CLAIM_BYTES:
        raise Dropped("malformed", f"contribution body of {len(body)} bytes < the {CLAIM_BYTES}-byte claim")
    return CLAIM.unpack_from(body)[0], body[CLAIM_BYTES:]


def _check_u32(name: str, v: int) -> None:
    if not 0 <= v <= _U32_MAX:
        raise ValueError(f"{name} must fit in 32 bits on the datagram wire, got {v!r}")


class SealedBatch(NamedTuple):
    """Sealed datagrams, one per row: ``buf[i, :lens[i]]`` is datagram ``i``.

    Attributes:
        buf: ``(n, stride)`` uint8.
        lens: ``(n,)`` uint32 byte lengths.
    """

    buf: np.ndarray
    lens: np.ndarray

    def datagram(self, i: int) -> bytes:
        return self.buf[i, : int(self.lens[i])].tobytes()


class Sealer:
    """Seals datagrams of one sender for one round (thread-safe).

    Args:
        key: the round's 32-byte key (``RoundPlan.datagram_key``).
        run: run id (u32).
        round: round number.
        sender: this site's index in the round's sorted member list.
        native: the compiled loop (:func:`~.datagram_native.native`) that seals
            :meth:`seal_many`'s batches in one call; None: the ``cryptography`` package
            seals each datagram (the same bytes).
    """

    def __init__(self, key: bytes, *, run: int, round: int, sender: int, native: NativeLib | None = None) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"datagram key must be {KEY_BYTES} bytes, got {len(key)}")
        _check_u32("round", round)
        self._aead = AESGCM(key)
        self.run, self.round, self.sender = run, round, sender
        self._next_seq = 0
        self._lock = threading.Lock()
        self._native = native
        self._handle = native.aead(key) if native is not None else None
        if native is not None:
            weakref.finalize(self, native.free, self._handle)

    def _reserve(self, n: int) -> int:
        """The first of ``n`` fresh sequence numbers (never handed out again this round)."""
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + n
        return seq

    def _header(self, kind: int, seq: int, *fields: int) -> bytes:
        """The 43-byte header; ``fields``: ``(bucket, chunk, offset, numel, codec, frag, nfrags)``."""
        bucket, chunk, offset, numel, codec, frag, nfrags = fields
        return HEADER.pack(
            MAGIC,
            VERSION,
            kind,
            self.run,
            self.round,
            bucket,
            chunk,
            offset,
            numel,
            codec,
            self.sender,
            seq,
            frag,
            nfrags,
        )

    def seal(
        self,
        kind: int,
        body: bytes | memoryview,
        *,
        bucket: int = 0,
        chunk: int = 0,
        offset: int = 0,
        numel: int = 0,
        codec: int = NO_CODEC,
        frag: int = 0,
        nfrags: int = 1,
    ) -> bytes:
        """Return header + sealed body; every call uses a fresh sequence number."""
        seq = self._reserve(1)
        header = self._header(kind, seq, bucket, chunk, offset, numel, codec, frag, nfrags)
        return header + self._aead.encrypt(_NONCE.pack(self.sender, 0, seq), bytes(body), header)

    def seal_many(self, kind: int, fields: Sequence[tuple[int, ...]], bodies: Sequence[bytes]) -> SealedBatch:
        """Seal one datagram per body, each with a fresh sequence number, in one batch.

        Args:
            kind: one of :class:`Kind`.
            fields: per datagram ``(bucket, chunk, offset, numel, codec, frag, nfrags)``.
            bodies: per datagram its plaintext body (at most :func:`max_body_bytes`).
        """
        n = len(bodies)
        seq = self._reserve(n)
        blens = list(map(len, bodies))
        stride = HEADER_BYTES + max(blens, default=0) + TAG_BYTES
        out = np.empty((n, stride), np.uint8)
        if self._native is None:
            lens = np.empty(n, np.uint32)
            for i, (f, b) in enumerate(zip(fields, bodies)):
                header = self._header(kind, seq + i, *f)
                d = header + self._aead.encrypt(_NONCE.pack(self.sender, 0, seq + i), bytes(b), header)
                out[i, : len(d)] = np.frombuffer(d, np.uint8)
                lens[i] = len(d)
            return SealedBatch(out, lens)
        cols = np.array(fields, dtype=np.int64).reshape(n, 7)
        offsets = np.zeros(n + 1, np.uint64)
        np.cumsum(blens, out=offsets[1:])
        try:
            lens = self._native.seal(
                self._handle, cols, b"".join(bodies), offsets, out,
                magic=MAGIC, version=VERSION, kind=kind, run=self.run, round=self.round, sender=self.sender, seq0=seq,
            )  # fmt: skip
        except ValueError as e:
            raise ValueError(f"{getattr(kind, 'name', kind)} datagram: {e}") from None
        return SealedBatch(out, lens)


_SEQ_TOP = (1 << 64) - 1  # a header's sequence number (u64) that no window accepts


class ReplayWindow:
    """Sequence numbers accepted from one sender in one round.

    A ring of ``size`` slots holds ``seq + 1`` at ``seq % size``; a sequence number is
    new when it is above ``highest - size`` and its slot does not hold it. Memory:
    8 bytes per slot, fixed. Datagrams reordered by more than ``size`` are dropped.
    The ring and the highest number (kept as ``highest + 1``, 0 for none) live in two
    ``array("Q")`` buffers that the compiled open checks and updates in place
    (``dgram_native.c`` ``replay_new``, :meth:`pointers`), so both loops share one window.
    """

    def __init__(self, size: int = 8192) -> None:
        self._ring = array("Q", bytes(8 * size))
        self._next = array("Q", [0])  # the highest sequence number seen + 1 (0: none)
        self._size = size

    def check_and_add(self, seq: int) -> bool:
        """True (and remembered) when ``seq`` was not seen and is inside the window. The wire's
        top value (2^64 - 1) is refused: ``seq + 1`` does not fit a slot (a key holder may seal it)."""
        nxt = self._next[0]
        if seq >= _SEQ_TOP or (nxt > self._size and seq < nxt - self._size):
            return False
        slot = seq % self._size
        if self._ring[slot] == seq + 1:
            return False
        self._ring[slot] = seq + 1
        if seq >= nxt:
            self._next[0] = seq + 1
        return True

    def pointers(self) -> tuple[int, int]:
        """The addresses of the ring and of the highest number + 1 (for the compiled open;
        valid while this window lives: the arrays never grow)."""
        return self._ring.buffer_info()[0], self._next.buffer_info()[0]


def native_windows(windows: Sequence[ReplayWindow]) -> tuple[ctypes.Array, ctypes.Array, int]:
    """``windows`` (one per sender, one size) as :meth:`NativeLib.open_round` takes them: the
    rings' and the highest numbers' addresses as two pointer arrays, and the window size."""
    rings, nexts = zip(*(w.pointers() for w in windows))
    return (ctypes.c_void_p * len(rings))(*rings), (ctypes.c_void_p * len(nexts))(*nexts), windows[0]._size


@dataclass
class _RoundKey:
    aead: AESGCM
    num_members: int
    windows: list[ReplayWindow]
    handle: int = 0  # the compiled loop's key handle (0: none)
    native_windows: tuple | None = None  # the windows as the compiled open takes them (native_windows)


class Opener:
    """Receive-side checks of one site: keys of the open rounds, replay windows, counters.

    Used from the transport's single receive thread (not thread-safe except
    :meth:`counts`). At most ``max_rounds`` rounds are open; opening a newer one
    retires the oldest (its datagrams then count as ``stale_round``).

    Args:
        run: run id every datagram must carry.
        max_datagram_bytes: larger datagrams are ``oversized``.
        window: replay window size per sender.
    """

    def __init__(
        self,
        *,
        run: int,
        max_datagram_bytes: int,
        window: int = 8192,
        max_rounds: int = 2,
        native: NativeLib | None = None,
    ) -> None:
        self.run = run
        self._native = native
        self.max_datagram_bytes = max_datagram_bytes
        self._window = window
        self._max_rounds = max_rounds
        self._keys: dict[int, _RoundKey] = {}
        self._retired_below = -1
        self._counts = {r: 0 for r in DROP_REASONS}
        self._lock = threading.Lock()
        self._views: tuple[np.ndarray, ...] | None = None  # (buffer, its header view, its round field)

    def open_round(self, round: int, key: bytes, num_members: int) -> None:
        """Accept datagrams of ``round`` sealed with ``key`` from ``num_members`` senders."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"datagram key of round {round} must be {KEY_BYTES} bytes, got {len(key)}")
        rk = _RoundKey(AESGCM(key), num_members, [ReplayWindow(self._window) for _ in range(num_members)])
        if self._native is not None:
            rk.handle = self._native.aead(key)
            rk.native_windows = native_windows(rk.windows)
            weakref.finalize(rk, self._native.free, rk.handle)  # freed once no batch uses it
        with self._lock:
            self._keys[round] = rk
            while len(self._keys) > self._max_rounds:
                old = min(self._keys)
                del self._keys[old]
                self._retired_below = max(self._retired_below, old)

    def close_round(self, round: int) -> None:
        with self._lock:
            if self._keys.pop(round, None) is not None:
                self._retired_below = max(self._retired_below, round)

    def is_open(self, round: int) -> bool:
        with self._lock:
            return round in self._keys

    def count(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._counts[reason] += n

    def counts(self) -> dict[str, int]:
        """Datagrams dropped so far, by reason (a copy)."""
        with self._lock:
            return dict(self._counts)

    def peek(self, data: bytes | memoryview) -> Header:
        """Parse and sanity-check the header without authenticating (raises :class:`Dropped`)."""
        n = len(data)
        if n > self.max_datagram_bytes:
            raise Dropped("oversized", f"{n} bytes > {self.max_datagram_bytes}")
        if n < HEADER_BYTES + TAG_BYTES:
            raise Dropped("truncated", f"{n} bytes < {HEADER_BYTES + TAG_BYTES}")
        h = Header._make(HEADER.unpack_from(data, 0))
        if h.magic != MAGIC:
            raise Dropped("bad_magic")
        if h.version != VERSION:
            raise Dropped("bad_version", str(h.version))
        if h.run != self.run:
            raise Dropped("wrong_run", f"run {h.run}, expected {self.run}")
        return h

    def open(self, data: bytes | memoryview) -> tuple[Header, bytes]:
        """Authenticate one datagram; return its header and plaintext body.

        Raises:
            Dropped: with the reason, which is counted (:meth:`counts`);
                ``unknown_round`` when the round's key is not known yet (the caller
                may hold the datagram until the plan arrives).
        """
        try:
            return self._open(data)
        except Dropped as e:
            self.count(e.reason)
            raise

    def _open(self, data: bytes | memoryview) -> tuple[Header, bytes]:
        h = self.peek(data)
        with self._lock:
            rk = self._keys.get(h.round)
            retired = h.round <= self._retired_below
        if rk is None:
            raise Dropped("stale_round" if retired else "unknown_round", f"round {h.round}")
        if h.sender >= rk.num_members:
            raise Dropped("bad_sender", f"sender index {h.sender} of {rk.num_members} members")
        mv = memoryview(data)
        try:
            body = rk.aead.decrypt(_NONCE.pack(h.sender, 0, h.seq), mv[HEADER_BYTES:], mv[:HEADER_BYTES])
        except InvalidTag:
            raise Dropped("forged", f"round {h.round} sender {h.sender} seq {h.seq}") from None
        if not rk.windows[h.sender].check_and_add(h.seq):
            raise Dropped("replayed", f"round {h.round} sender {h.sender} seq {h.seq}")
        return h, body

    def open_batch(self, buf: np.ndarray, lens: np.ndarray, n: int, skip: np.ndarray | None = None) -> BatchOpened:
        """Authenticate rows ``0..n-1`` of a received batch in place (the compiled loop).

        The checks and their order are :meth:`open`'s, vectorised over the batch; what
        fails is counted by reason and not opened. Rows of a round whose key is not
        known yet are returned in ``pending`` (counted ``unknown_round``, still sealed:
        the caller may hold them until the plan arrives).

        Args:
            buf: ``(rows, stride)`` uint8, one datagram per row (``dgram_native.c`` ``dg_recv``).
            lens: uint32 byte length per row.
            n: rows received.
            skip: rows to leave alone (not opened, not counted), e.g. a test's injected drops.
        """
        assert self._native is not None
        views = self._views
        if views is None or views[0] is not buf:  # the receive thread reads into one buffer: made once
            full = header_view(buf, buf.shape[0])
            views = self._views = (buf, full, full["round"])
        hv = views[1][:n]
        if n:
            r = int(views[2][0])
            with self._lock:
                rk = self._keys.get(r)
            if rk is not None:
                return self._open_one_round(buf, lens, n, skip, hv, r, rk)
        return self._open_general(buf, lens, n, skip, hv)

    def _open_one_round(
        self,
        buf: np.ndarray,
        lens: np.ndarray,
        n: int,
        skip: np.ndarray | None,
        hv: np.ndarray,
        r: int,
        rk: "_RoundKey",
    ) -> BatchOpened:
        """:meth:`open_batch` when the first row's round has a key (nearly every batch): one call
        checks and opens the rows of that round (:meth:`NativeLib.open_round`, a dozen numpy
        calls fewer per batch: they cost more than the datagrams of a small batch), and the rows
        of other rounds, left sealed, go through :meth:`_open_general`."""
        assert self._native is not None
        status, opened = self._native.open_round(
            rk.handle,
            buf,
            lens,
            n,
            skip,
            max_len=self.max_datagram_bytes,
            magic=MAGIC,
            version=VERSION,
            run=self.run,
            round=r,
            num_members=rk.num_members,
            windows=rk.native_windows,
        )
        if opened == n:  # every row opened: a receiving site's usual batch, no numpy call on its outcomes
            return BatchOpened(hv, _all_true(n), [], all_ok=True)
        counts = np.bincount(status, minlength=len(OPEN_STATUS)).tolist()
        for code, reason in _STATUS_DROPS:
            if counts[code]:
                self.count(reason, counts[code])
        good = status == 0
        if not counts[_OTHER_ROUND]:
            return BatchOpened(hv, good, [])
        rest = self._open_general(buf, lens, n, status != _OTHER_ROUND, hv)
        return BatchOpened(hv, good | rest.ok, rest.pending)

    def _open_general(
        self, buf: np.ndarray, lens: np.ndarray, n: int, skip: np.ndarray | None, hv: np.ndarray
    ) -> BatchOpened:
        """:meth:`open_batch` for rows of any rounds: numpy checks by reason, a key per row."""
        assert self._native is not None
        ln = lens[:n]
        good = np.ones(n, bool) if skip is None else ~skip[:n]
        for reason, bad in (
            ("oversized", ln > self.max_datagram_bytes),
            ("truncated", ln < HEADER_BYTES + TAG_BYTES),
            ("bad_magic", hv["magic"] != MAGIC),
            ("bad_version", hv["version"] != VERSION),
            ("wrong_run", hv["run"] != self.run),
        ):
            self._drop(good, bad, reason)
        keys = np.zeros(n, np.uintp)
        pending: list[int] = []
        windows: dict[int, list[ReplayWindow]] = {}
        held: list[_RoundKey] = []  # keeps each key handle alive through the call, even if its round retires
        rounds, senders = hv["round"], hv["sender"]
        for r in np.unique(rounds[good]).tolist():
            in_r = good & (rounds == r)
            with self._lock:
                rk = self._keys.get(r)
                retired = r <= self._retired_below
            if rk is None:
                if not retired:
                    pending += np.flatnonzero(in_r).tolist()
                self._drop(good, in_r, "stale_round" if retired else "unknown_round")
                continue
            self._drop(good, in_r & (senders >= rk.num_members), "bad_sender")
            keys[good & (rounds == r)] = rk.handle
            windows[r] = rk.windows
            held.append(rk)
        ok = self._native.open(keys, buf, lens, n)
        self._drop(good, ~ok, "forged")
        replayed = 0
        idx = np.flatnonzero(good)
        for i, r, sender, seq in zip(
            idx.tolist(), rounds[idx].tolist(), senders[idx].tolist(), hv["seq"][idx].tolist()
        ):
            if not windows[r][sender].check_and_add(seq):
                good[i] = False
                replayed += 1
        if replayed:
            self.count("replayed", replayed)
        return BatchOpened(hv, good, pending)

    def _drop(self, good: np.ndarray, bad: np.ndarray, reason: str) -> None:
        """Count and clear the rows of ``good`` that fail a check (``bad``)."""
        hit = good & bad
        k = int(hit.sum())
        if k:
            good &= ~hit
            self.count(reason, k)


class BatchOpened(NamedTuple):
    """What :meth:`Opener.open_batch` found.

    Attributes:
        headers: the batch's headers (:data:`~.datagram_native.HEADER_DTYPE` fields; a view).
        ok: rows that authenticated and were new: their plaintext body is
            ``buf[i, HEADER_BYTES : lens[i] - TAG_BYTES]``.
        pending: rows of rounds whose key is not known yet (still sealed).
        all_ok: True when every row is known to be in ``ok`` (False: see ``ok``).
    """

    headers: np.ndarray
    ok: np.ndarray
    pending: list[int]
    all_ok: bool = False


@functools.lru_cache(maxsize=256)  # one per batch size (a receive batch has at most 256 rows)
def _all_true(n: int) -> np.ndarray:
    """``n`` True flags, read-only (shared by every batch of ``n`` rows)."""
    ok = np.ones(n, bool)
    ok.flags.writeable = False
    return ok
