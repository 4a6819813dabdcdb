"""The compiled batch loop of the datagram data path (``dgram_native.c``): build, load, call.

Why compiled: through netem on the 2-core machine, a worker's datagram threads spent
~50 µs of CPU per datagram end to end (seal, ``send``, ``recvmsg``, open, one Python call
each, and the GIL hand-overs between six sending threads), ~1.1 of the 1.4 CPU-s a 9.8 MB
round cost per site, and the round took 2-3.6x its physical limit. The C library does the
per-datagram work for a whole batch in one call that releases the GIL: AES-256-GCM
from OpenSSL's libcrypto (the cipher the ``cryptography`` package wraps, so both produce
the same bytes), ``sendmmsg`` (or UDP segmentation offload) on a connected socket and ``recvmmsg`` (or
UDP receive coalescing, ``UDP_GRO``) with the arrival timestamps and drop counter the
receive loop reads.

Build: :func:`native` compiles ``dgram_native.c`` once (:func:`dtrain.native.build_and_load`:
``$CC -O2 -shared -fPIC``, cached in ``$DTRAIN_NATIVE_CACHE``) against ``-lcrypto`` (Debian:
``libssl-dev``), so later processes load it at once. Any failure (no compiler,
no headers, the library does not load) returns None with one logged warning, and the
transport runs its Python loop (same wire format, same checks): ``DatagramTransportConfig``
``native = "auto"`` (default), ``"off"`` (always Python) or ``"on"`` (fail without it).

Buffers: a batch is a ``(n, stride)`` uint8 numpy array, one datagram per row, with a
uint32 length per row; :data:`HEADER_DTYPE` reads the 43-byte headers of a batch in one
numpy view (the layout of :data:`~.datagram_wire.HEADER`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from pathlib import Path

import numpy as np

from dtrain.native import build_and_load
from dtrain.transports.datagram_config import NATIVE_MODES

__all__ = ["HEADER_DTYPE", "NATIVE_MODES", "OPEN_STATUS", "NativeLib", "PlainColumns", "header_view", "native"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "dgram_native.c"
CFLAGS = ["-O2", "-shared", "-fPIC", "-Wall", "-Wextra"]
LIBS = ["-lcrypto"]
#: :meth:`NativeLib.open_round`'s row outcomes, by code (``dgram_native.c`` ``DG_*``).
OPEN_STATUS = (
    "ok",
    "skip",
    "oversized",
    "truncated",
    "bad_magic",
    "bad_version",
    "wrong_run",
    "other_round",
    "bad_sender",
    "forged",
    "replayed",
)

_FIELDS = (
    ("magic", "S2", 0),
    ("version", "u1", 2),
    ("kind", "u1", 3),
    ("run", "<u4", 4),
    ("round", "<u4", 8),
    ("bucket", "<u4", 12),
    ("chunk", "<u4", 16),
    ("offset", "<u4", 20),
    ("numel", "<u4", 24),
    ("codec", "u1", 28),
    ("sender", "<u2", 29),
    ("seq", "<u8", 31),
    ("frag", "<u2", 39),
    ("nfrags", "<u2", 41),
)


@functools.lru_cache(maxsize=16)  # one per batch stride
def _header_dtype(itemsize: int) -> np.dtype:
    names, formats, offsets = zip(*_FIELDS)
    return np.dtype({"names": list(names), "formats": list(formats), "offsets": list(offsets), "itemsize": itemsize})


HEADER_DTYPE = _header_dtype(43)


def header_view(buf: np.ndarray, n: int) -> np.ndarray:
    """The headers of rows ``0..n-1`` of a ``(rows, stride)`` uint8 batch as a structured array (a view)."""
    return np.frombuffer(buf, dtype=_header_dtype(buf.shape[1]), count=n)


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class _Addresses:
    """The addresses of arrays handed to the library call after call (a receive thread's
    batch buffers): ``ndarray.ctypes.data`` costs ~1-2 µs a call, four to six a batch. Kept
    per tuple of arrays, which are held (no other array can take their ids while kept); at
    most ``size`` tuples (then forgotten at once)."""

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._kept: dict[tuple[int, ...], tuple[tuple[np.ndarray, ...], tuple[int, ...]]] = {}

    def __call__(self, *arrays: np.ndarray) -> tuple[int, ...]:
        key = tuple(map(id, arrays))
        hit = self._kept.get(key)
        if hit is not None:
            return hit[1]
        ptrs = tuple(_ptr(a) for a in arrays)
        if len(self._kept) >= self._size:
            self._kept.clear()
        self._kept[key] = (arrays, ptrs)
        return ptrs


class PlainColumns:
    """:meth:`NativeLib.plain_batch`'s output, reused batch after batch by one receive thread.

    Per row ``i`` (of up to the batch's rows): ``cols[i]`` its sender, bucket, chunk, offset,
    numel, codec, sequence number and lead (int64: a contribution's claim, a mean chunk's
    senders bitmap); ``t[i]`` its arrival (float64, monotonic
    seconds); ``at[i]``, ``width[i]`` where its codec payload lies in the call's blob and its bytes.
    Per sender id ``s`` (the first ``n`` ids of ``order`` are the batch's senders, in the order
    of their first rows; the other entries are stale): ``rows``, ``first`` (row), ``bytes``
    (plaintext, lead included), ``tmin`` / ``tmax``, ``ascending`` (sequence numbers rise row
    by row), ``uniform`` (one codec and one lead).
    """

    def __init__(self) -> None:
        self._shape: tuple[int, int] = (0, 0)
        self._members = 0
        self._own: tuple[int, ...] | None = None  # this object's arrays' addresses (None: reallocated)
        self._theirs = _Addresses(size=2)  # the caller's batch buffers

    def fit(self, buf: np.ndarray, lens: np.ndarray, ts_ns: np.ndarray, num_members: int) -> tuple[int, ...]:
        """Arrays for batches read into ``buf`` (rows, stride) and ``num_members`` sender ids; the
        pointers :meth:`NativeLib.plain_batch` passes (kept while the arrays stay the same:
        ``ndarray.ctypes.data`` costs ~2 µs a call, 16 a batch)."""
        if buf.shape != self._shape:
            rows = buf.shape[0]
            self.cols = np.zeros((rows, 8), np.int64)
            self.t = np.zeros(rows, np.float64)
            self.at = np.zeros(rows, np.int64)
            self.width = np.zeros(rows, np.int64)
            self.order = np.zeros(rows, np.int32)
            self._shape, self._own = buf.shape, None
        if num_members > self._members:
            m = max(num_members, 64)
            self.rows, self.first = np.zeros(m, np.int32), np.zeros(m, np.int32)
            self.bytes = np.zeros(m, np.int64)
            self.tmin, self.tmax = np.zeros(m, np.float64), np.zeros(m, np.float64)
            self.ascending, self.uniform = np.zeros(m, np.uint8), np.zeros(m, np.uint8)
            self._members, self._own = m, None
        if self._own is None:
            mine = (self.cols, self.t, self.at, self.width, self.order, self.rows, self.first)
            mine += (self.bytes, self.tmin, self.tmax, self.ascending, self.uniform)
            self._own = tuple(_ptr(a) for a in mine)
        return self._theirs(buf, lens, ts_ns) + self._own


class NativeLib:
    """The loaded library with typed entry points (see ``dgram_native.c`` for each contract)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, i, u32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32
        for name, res, args in (
            ("dg_version", i, []),
            ("dg_aead_new", vp, [ctypes.c_char_p]),
            ("dg_aead_free", None, [vp]),
            ("dg_seal", i, [vp, i, ctypes.c_char_p, u32, u32, u32, u32, u32, ctypes.c_uint64, vp, vp, vp, vp, u32, vp]),
            ("dg_open", i, [i, vp, vp, u32, vp, vp]),
            ("dg_open_round", i, [i, vp, vp, u32, vp, vp, u32, ctypes.c_char_p, u32, u32, u32, u32, vp, vp, u32, vp]),
            ("dg_send", i, [i, i, vp, u32, vp]),
            ("dg_send_gso", i, [i, i, vp, u32, vp, vp]),
            ("dg_recv", i, [i, i, vp, u32, vp, vp, vp]),
            (
                "dg_plain_batch",
                i,
                [i, vp, u32, vp, vp, ctypes.c_double, ctypes.c_double, u32, u32, u32, u32, u32] + [vp] * 13,
            ),
            ("dg_gro_new", vp, []),
            ("dg_gro_free", None, [vp]),
            ("dg_gro_pending", i, [vp]),
            ("dg_gro_stats", None, [vp, vp]),
            ("dg_recv_gro", i, [vp, i, i, vp, u32, vp, vp, vp]),
        ):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self._lib = lib
        self.path = Path(lib._name)
        self._rx = _Addresses()  # the receive batches' buffers

    def aead(self, key: bytes) -> int:
        """An AES-256-GCM handle for a 32-byte key (free it with :meth:`free`)."""
        if len(key) != 32:
            raise ValueError(f"datagram key must be 32 bytes, got {len(key)}")
        h = self._lib.dg_aead_new(key)
        if not h:
            raise MemoryError("dg_aead_new could not allocate a key handle")
        return h

    def free(self, handle: int) -> None:
        self._lib.dg_aead_free(handle)

    def seal(
        self,
        handle: int,
        cols: np.ndarray,
        body: bytes,
        offsets: np.ndarray,
        out: np.ndarray,
        *,
        magic: bytes,
        version: int,
        kind: int,
        run: int,
        round: int,
        sender: int,
        seq0: int,
    ) -> np.ndarray:
        """Seal ``len(cols)`` datagrams into the rows of ``out``; their lengths (uint32).

        Args:
            cols: ``(n, 7)`` int64, per datagram ``(bucket, chunk, offset, numel, codec, frag,
                nfrags)``; the header's other fields are the keywords, datagram i's sequence
                number ``seq0 + i``.
            body: the plaintexts back to back; datagram i's is ``body[offsets[i]:offsets[i+1]]``.
            offsets: uint64, ``n + 1`` entries.
            out: ``(>= n, stride)`` uint8.

        Raises:
            ValueError: a field does not fit its wire width, or a datagram its slot.
        """
        n = len(cols)
        lens = np.empty(n, np.uint32)
        cols = np.ascontiguousarray(cols, dtype=np.int64)
        src = np.frombuffer(body, np.uint8) if len(body) else np.zeros(1, np.uint8)
        rc = self._lib.dg_seal(
            handle, n, magic, version, kind, run, round, sender, seq0,
            _ptr(cols), _ptr(src), _ptr(offsets), _ptr(out), out.shape[1], _ptr(lens),
        )  # fmt: skip
        if rc == -2:
            raise ValueError(f"a header field does not fit its wire width: {cols.min(0)}..{cols.max(0)}")
        if rc != n:
            raise ValueError(f"dg_seal failed: a datagram of {n} does not fit a {out.shape[1]}-byte slot")
        return lens

    def open(self, keys: np.ndarray, buf: np.ndarray, lens: np.ndarray, n: int) -> np.ndarray:
        """Authenticate rows ``0..n-1`` in place (``keys``: one handle per row, 0: skip); ok flags (bool)."""
        ok = np.zeros(n, np.uint8)
        self._lib.dg_open(n, _ptr(keys), _ptr(buf), buf.shape[1], _ptr(lens), _ptr(ok))
        return ok.view(bool)

    def open_round(
        self,
        handle: int,
        buf: np.ndarray,
        lens: np.ndarray,
        n: int,
        skip: np.ndarray | None,
        *,
        max_len: int,
        magic: bytes,
        version: int,
        run: int,
        round: int,
        num_members: int,
        windows: tuple[ctypes.Array, ctypes.Array, int],
    ) -> tuple[np.ndarray, int]:
        """Check and authenticate rows ``0..n-1`` of one round in place: per row its outcome, a
        uint8 index into :data:`OPEN_STATUS` (``"ok"``; ``"skip"``: in ``skip``; ``"other_round"``:
        left sealed; else the drop reason), and how many rows are ``"ok"`` (``n``: every row, with
        no pass over the outcomes). The checks and their order are ``Opener.open``'s, the
        replay check included: ``windows`` are the round's replay windows (``ReplayWindow.pointers``
        of each sender, and their size), which rows that open update."""
        status = np.empty(n, np.uint8)
        p_buf, p_lens = self._rx(buf, lens)
        sk = None if skip is None else np.ascontiguousarray(skip[:n], dtype=np.uint8)
        opened = self._lib.dg_open_round(
            n,
            handle,
            p_buf,
            buf.shape[1],
            p_lens,
            None if sk is None else _ptr(sk),
            max_len,
            magic,
            version,
            run,
            round,
            num_members,
            windows[0],
            windows[1],
            windows[2],
            _ptr(status),
        )
        return status, opened

    def send(self, fd: int, buf: np.ndarray, lens: np.ndarray, n: int) -> int:
        """``sendmmsg`` rows ``0..n-1`` on connected ``fd``: the number sent, or ``-errno``."""
        return self._lib.dg_send(fd, n, _ptr(buf), buf.shape[1], _ptr(lens))

    def send_gso(self, fd: int, buf: np.ndarray, lens: np.ndarray, n: int) -> tuple[int, int]:
        """:meth:`send` with UDP segmentation offload (``UDP_SEGMENT``: one ``sendmsg`` per run of
        equal-length rows, cut by the kernel into the same datagrams, in order): ``(number sent or
        -errno, errno of a refused UDP_SEGMENT or 0)``; a refused one sent the rest with ``sendmmsg``."""
        err = ctypes.c_int(0)
        r = self._lib.dg_send_gso(fd, n, _ptr(buf), buf.shape[1], _ptr(lens), ctypes.byref(err))
        return r, err.value

    def recv(self, fd: int, buf: np.ndarray, lens: np.ndarray, ts_ns: np.ndarray, drops: np.ndarray) -> int:
        """``recvmmsg`` into the rows of ``buf`` without blocking: the number received (0: none), or ``-errno``."""
        p_buf, p_lens, p_ts, p_drops = self._rx(buf, lens, ts_ns, drops)
        return self._lib.dg_recv(fd, buf.shape[0], p_buf, buf.shape[1], p_lens, p_ts, p_drops)

    def plain_batch(
        self,
        buf: np.ndarray,
        lens: np.ndarray,
        ts_ns: np.ndarray,
        n: int,
        out: PlainColumns,
        blob: bytearray | np.ndarray,
        *,
        offset_s: float,
        now_s: float,
        kind: int,
        round: int,
        num_codecs: int,
        num_members: int,
        lead: int = 8,
    ) -> int:
        """The columns of opened rows ``0..n-1`` when every one is a whole datagram of kind
        ``kind`` (one fragment) of round ``round`` with a known codec and sender, written into
        ``out`` (see :class:`PlainColumns`), their codec payloads back to back into ``blob``
        (at least the rows' lengths less header, lead and tag: nothing is written past them);
        arrival times are ``ts_ns * 1e-9 + offset_s`` (``now_s`` where 0). ``lead``: the body's
        bytes before the codec payload, 1 to 8 (a contribution's claim: 8; a mean chunk's
        senders bitmap: ``(members + 7) // 8``), read per row as a little-endian integer.
        Returns the number of senders, 0 when a row is not plain (``blob`` untouched).

        Raises:
            ValueError: ``blob`` is empty, or ``lead`` is outside 1..8.
        """
        if not 1 <= lead <= 8:
            raise ValueError(f"plain_batch: lead must be 1..8 bytes, got {lead}")
        ptrs = out.fit(buf, lens, ts_ns, num_members)
        if len(blob) == 0:
            raise ValueError("plain_batch needs a blob of at least 1 byte")
        room = ctypes.addressof((ctypes.c_char * len(blob)).from_buffer(blob))
        return self._lib.dg_plain_batch(
            n, ptrs[0], buf.shape[1], ptrs[1], ptrs[2], offset_s, now_s, kind, round, num_codecs, num_members, lead,
            *ptrs[3:7], room, *ptrs[7:],
        )  # fmt: skip

    def gro_state(self) -> int:
        """The holding area of :meth:`recv_gro` for one socket (4 MiB; free it with :meth:`gro_free`)."""
        h = self._lib.dg_gro_new()
        if not h:
            raise MemoryError("dg_gro_new could not allocate the coalesced-read buffers")
        return h

    def gro_free(self, state: int) -> None:
        self._lib.dg_gro_free(state)

    def gro_pending(self, state: int) -> bool:
        """Whether ``state`` holds datagrams read but not yet returned (the next :meth:`recv_gro` needs no wait)."""
        return bool(self._lib.dg_gro_pending(state))

    def gro_stats(self, state: int) -> tuple[int, int]:
        """``(reads taken from the socket, datagrams cut from them)`` by ``state`` so far."""
        out = np.zeros(2, np.uint64)
        self._lib.dg_gro_stats(state, _ptr(out))
        return int(out[0]), int(out[1])

    def recv_gro(
        self, state: int, fd: int, buf: np.ndarray, lens: np.ndarray, ts_ns: np.ndarray, drops: np.ndarray
    ) -> int:
        """:meth:`recv` on a socket with ``UDP_GRO`` set: the kernel's coalesced reads (runs of
        equal-sized datagrams of one flow, ~45 per ``recvmmsg`` slot) cut back into one datagram
        per row, the same rows :meth:`recv` gives; what does not fit stays in ``state``. Fewer
        rows than ``buf`` has: the socket was found empty and ``state`` holds nothing."""
        p_buf, p_lens, p_ts, p_drops = self._rx(buf, lens, ts_ns, drops)
        return self._lib.dg_recv_gro(state, fd, buf.shape[0], p_buf, buf.shape[1], p_lens, p_ts, p_drops)


_lock = threading.Lock()
_loaded: dict[str, NativeLib | None] = {}


def native(mode: str = "auto") -> NativeLib | None:
    """The compiled library (built on first use, then cached), or None.

    Args:
        mode: ``"auto"``: None (after one warning naming the reason) when it cannot be
            built or loaded; ``"on"``: raise instead; ``"off"``: None.

    Raises:
        ValueError: ``mode`` not one of :data:`NATIVE_MODES`.
        RuntimeError: ``mode="on"`` and the library is unavailable (the reason named).
    """
    if mode not in NATIVE_MODES:
        raise ValueError(f"native must be one of {', '.join(NATIVE_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"], _loaded["why"] = _build_and_load()  # type: ignore[assignment]
            if _loaded["lib"] is None:
                log.warning("compiled datagram loop unavailable (%s): using the Python loop", _loaded["why"])
        lib, why = _loaded["lib"], _loaded["why"]
    if lib is None and mode == "on":
        raise RuntimeError(f"native='on' but the compiled datagram loop is unavailable: {why}")
    return lib  # type: ignore[return-value]


def _build_and_load() -> tuple[NativeLib | None, str]:
    lib, why = build_and_load(SOURCE, stem="dgram", cflags=CFLAGS, libs=LIBS, version_fn="dg_version", version=8)
    return (NativeLib(lib) if lib is not None else None), why
