"""Payload header, the Codec base class (encode/decode driver, zstd stage) and helpers.

See the package docstring (``dtrain.codecs``) for the payload layout.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard
from zlib_ng.zlib_ng import crc32  # zlib's crc32, several times faster (SIMD)

from dtrain.codecs.config import CodecConfig, _bad_int
from dtrain.codecs.native import kernels
from dtrain.errors import CodecError, DecodeBoundExceeded

__all__ = ["HEADER_BYTES", "CheckedRun", "Codec", "PayloadHeader", "equal_runs", "peek_header"]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("dtrain.codecs assumes a little-endian host")

CODEC_IDS = {"fp32": 1, "bf16": 2, "fp16": 3, "int8": 4, "int4": 5, "topk": 6, "sparseloco": 7}
_CODEC_BY_ID = {v: k for k, v in CODEC_IDS.items()}
_DTYPE_IDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_DTYPE_BY_ID = {v: k for k, v in _DTYPE_IDS.items()}
_DTYPE_ID_LIST = sorted(_DTYPE_BY_ID)
_DTYPE_OK = np.isin(np.arange(256), _DTYPE_ID_LIST).astype(np.uint8)  # by a header's byte 7

_MAGIC = b"DTRC"
_VERSION = 1
_HEADER = struct.Struct("<4sBBBBIQQI")
HEADER_BYTES: int = _HEADER.size  # 32

# Work is done in chunks of this many elements (1 MiB of fp32) so that temporaries
# stay in cache and each element is read from memory once, while the per-chunk Python
# overhead stays small (64 Ki was measurably slower, 1 Mi no faster). A multiple of
# every valid block size up to 2**18; larger block sizes use one block per chunk.
CHUNK_ELEMS = 1 << 18
TINY = 2.0**-126  # absolute floor added to lossy error bounds (fp32 subnormal range)
SLACK = 1.0 + 2.0**-12  # relative slack for fp32 arithmetic inside the bounds
FP16_EXP_RANGE = (-170, 120)  # exponents an encoder can produce (max|x| in fp32 range)
_ZSTD_MAX_WINDOW = 1 << 27  # bound on the zstd decoder's window memory (128 MiB)


def zstd_bound(raw: int) -> int:
    """ZSTD_COMPRESSBOUND(raw) from zstd.h plus frame-header margin: the largest frame
    zstd makes for ``raw`` input bytes."""
    extra = ((128 << 10) - raw) >> 11 if raw < (128 << 10) else 0
    return raw + (raw >> 8) + extra + 32


@dataclass(frozen=True)
class PayloadHeader:
    """A payload's fixed header as parsed by :func:`peek_header`.

    Only magic, version and the id fields are validated; nothing is compared with
    what a decoder expects.
    """

    codec: str
    zstd: bool
    dtype: torch.dtype
    param: int
    numel: int
    body_bytes: int
    crc32: int


def peek_header(payload: bytes | bytearray | memoryview) -> PayloadHeader:
    """Parse a payload's header, e.g. to log or route it before decoding.

    Raises:
        CodecError: too short, bad magic, unknown version, codec, zstd flag or dtype id.
    """
    if len(payload) < HEADER_BYTES:
        raise CodecError(f"truncated payload: need {HEADER_BYTES} bytes for the header, have {len(payload)}")
    magic, version, codec_id, zflag, dtype_id, param, numel, body_len, crc = _HEADER.unpack_from(payload, 0)
    if magic != _MAGIC:
        raise CodecError(f"bad magic: payload starts with {magic!r}, expected {_MAGIC!r}")
    if version != _VERSION:
        raise CodecError(f"unsupported format version: payload says {version}, expected {_VERSION}")
    if codec_id not in _CODEC_BY_ID:
        raise CodecError(f"unknown codec id {codec_id} in payload header")
    if zflag not in (0, 1):
        raise CodecError(f"bad zstd flag {zflag} in payload header (expected 0 or 1)")
    if dtype_id not in _DTYPE_BY_ID:
        raise CodecError(f"unknown original dtype id {dtype_id} in payload header")
    return PayloadHeader(
        codec=_CODEC_BY_ID[codec_id],
        zstd=bool(zflag),
        dtype=_DTYPE_BY_ID[dtype_id],
        param=param,
        numel=numel,
        body_bytes=body_len,
        crc32=crc,
    )


class Codec:
    """Encodes float tensors to self-describing bytes and back.

    Build one with :func:`dtrain.codecs.get_codec`. Instances are immutable and safe to
    use from several threads at once (zstd contexts are per thread).

    Attributes:
        name: full name including ``"+zstd"``.
        config: the :class:`CodecConfig` it was built from.
        lossless: True only for fp32 (with or without zstd).
        needs_error_feedback: True for topk: what it drops must be carried in a
            residual into the next round.
    """

    lossless: bool = False
    needs_error_feedback: bool = False
    base: str = ""
    _param_name = "codec parameter"

    def __init__(self, config: CodecConfig) -> None:
        self.config = config
        self.name = config.name
        self._zstd = config.zstd
        self._codec_id = CODEC_IDS[self.base]
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    # ----------------------------------------------------------------- public API
    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> bytes:
        """Encode ``x`` to a self-describing payload.

        Args:
            x: tensor of dtype float32, bfloat16 or float16, any shape (flattened in
                row-major order), on any device (a device tensor is copied to the
                host first; the payload is host bytes). Not modified.
            generator: CPU generator for stochastic rounding (int8/int4 with
                ``stochastic_rounding=True``); ignored by other codecs. ``None`` uses
                torch's default generator (not reproducible across processes).

        Returns:
            Header + body bytes (layout in the ``dtrain.codecs`` docstring).

        Raises:
            CodecError: ``x`` is not a float32/bfloat16/float16 tensor, or holds NaN
                or ±inf (the message says how many and the first index).
        """
        x32, dtype_id = _prepare(x)
        numel = x32.numel()
        raw = self._body_bytes(numel)
        body = self._body_buffer(raw)
        if raw:
            self._encode_into(x32, body, generator)
        stored = self._compressor().compress(body) if self._zstd else body
        return b"".join((self._header(numel, stored, dtype_id), stored))

    def _header(self, numel: int, stored, dtype_id: int = 1) -> bytes:
        return _HEADER.pack(
            _MAGIC,
            _VERSION,
            self._codec_id,
            int(self._zstd),
            dtype_id,
            self._param(numel),
            numel,
            len(stored),
            crc32(stored),
        )

    def encode_chunks(
        self,
        x: torch.Tensor,
        chunks: "list[tuple[int, int]] | tuple[tuple[int, int], ...]",
        *,
        generator=None,
        settle: bool = False,
        encoded: "np.ndarray | None" = None,
    ) -> list[bytes]:
        """Encode the element ranges ``chunks`` (``(offset, numel)`` pairs) of 1-D ``x``,
        each to its own payload: the same bytes as ``encode(x[o:o+n])`` per range (up to
        the random draws of stochastic rounding). Codecs that can do it in one pass over
        ``x`` (int8/int4 without zstd, block-aligned ranges) override this; many small
        ranges (the datagram path's one-chunk-per-datagram) then cost one encode.

        Args:
            settle: also leave ``x − decode(payload)`` in ``x`` over every range (in place),
                bit for bit what error feedback's settle of a sent chunk leaves, undone
                exactly by :meth:`decode_chunks` with ``unsettle``. Only where
                :meth:`settles_in_place` says so (else ValueError, ``x`` untouched); on a
                CodecError (non-finite ``x``) ``x`` is unspecified.
            encoded: what :meth:`accumulate_encode` returned for ``x`` and these ``chunks``:
                ``x`` was encoded and settled then; the payloads are cut from it (the same
                bytes as ``encode_chunks(x_before, chunks, settle=True)``), ``x`` is not read.
        """
        if settle or encoded is not None:
            raise ValueError(f"codec {self.name!r} does not settle in place here (see settles_in_place)")
        return [self.encode(x[o : o + n], generator=generator) for o, n in chunks]

    def accumulate_encode(
        self,
        r: torch.Tensor,
        theta: torch.Tensor,
        pieces: Sequence[torch.Tensor],
        chunks: Sequence[tuple[int, int]],
        *,
        decay: float,
    ) -> "np.ndarray | None":
        """Error feedback's accumulation ``r ← decay·r + (θ − x)`` and :meth:`encode_chunks` of
        ``r`` with ``settle``, in one pass over memory instead of two (the compiled int8 / int4
        pass; ``kernels.c`` ``ef_accumulate_encode``): bit for bit what
        ``dtrain.rounds.error_feedback.add_pseudo_gradient`` and then ``encode_chunks(r, chunks,
        settle=True)`` leave in ``r`` and send.

        Args:
            r: the bucket's residual, 1-D float32 (updated in place: accumulated, then settled).
            theta: θ_b, 1-D float32 like ``r``.
            pieces: the model's local values ``x`` of the bucket in order (views of its
                tensors), together ``r.numel()`` elements.
            chunks: the bucket's ``(offset, numel)`` ranges.
            decay: β of the accumulation (``add_pseudo_gradient``'s ``decay``).
        Returns:
            The encoded bucket, for :meth:`encode_chunks` ``encoded=`` (which cuts the
            payloads from it); None, with nothing done, where this codec has no such pass (or
            a tensor is not contiguous float32 on the CPU): the caller then accumulates and
            encodes in turn.
        Raises:
            CodecError: ``r`` holds NaN or inf after the accumulation (``r`` is then
                unspecified: ``add_pseudo_gradient`` drops every residual of the round).
        """
        return None

    def settles_in_place(self, x: torch.Tensor, chunks: Sequence[tuple[int, int]]) -> bool:
        """Whether :meth:`encode_chunks` of ``x`` with ``settle`` works: the ranges cover ``x``
        from 0 and in order, and this codec leaves ``x − decoded`` in ``x`` in its encoding
        pass with an exact inverse (the compiled int8 / int4 pass, round to nearest: see
        ``kernels.c``). Error feedback then settles a sent chunk without decoding it again."""
        return False

    def decode(self, payload: bytes | bytearray | memoryview, *, numel: int) -> torch.Tensor:
        """Decode a payload made by :meth:`encode` of a codec with the same config.

        Args:
            payload: the payload bytes.
            numel: the number of elements the caller expects.

        Returns:
            A new 1-D float32 tensor with exactly ``numel`` elements.

        Raises:
            DecodeBoundExceeded: (a ``CodecError``) the body would be larger than
                ``config.max_decoded_bytes``, or the zstd frame declares or yields more
                than the expected body size (refused before more than that is allocated).
            CodecError: truncated; corrupted (crc32, impossible codes, non-finite
                values, a bad zstd frame); mislabeled (codec, zstd flag, block size or k);
                wrong element count; a zstd frame that declares or yields fewer bytes than
                the expected body size.
        """
        body, raw = self._checked_body(payload, numel)
        if raw == 0:
            return torch.zeros(numel, dtype=torch.float32)
        return self._decode_body(body, numel)

    def decode_chunks(
        self,
        payloads: Sequence,
        numels: Sequence[int],
        *,
        verify: bool = True,
        out: torch.Tensor | None = None,
        subtract: bool = False,
        unsettle: bool = False,
    ) -> torch.Tensor:
        """Decode several payloads into one 1-D float32 tensor, their concatenation in order.

        The inverse of :meth:`encode_chunks` for a bucket's contiguous chunks: the same
        values (bit for bit) and the same errors as :meth:`decode` of each payload in
        turn. Codecs that can (int8 without zstd, chunks of whole blocks) decode each run
        of equal-size chunks (:func:`equal_runs`) in one vectorized pass: the datagram
        path's ~1,300-element chunks otherwise cost a dozen tensor operations each.

        Args:
            payloads: the payloads, in element order.
            numels: the element count each payload must decode to.
            verify: False only for payloads this process encoded itself (its own
                contributions and means, kept in memory): a vectorized run then skips the
                header and crc32 comparisons (the values are the same); lengths, scales and
                codes are still checked, and anything else decodes fully checked.
            out: where to decode (a contiguous 1-D float32 CPU tensor of ``sum(numels)``
                elements, e.g. a bucket's range: no new tensor and no copy); on a CodecError
                its contents are unspecified, unless ``subtract``.
            subtract: subtract the decoded values from ``out`` (required) instead of
                writing them: ``out -= decode(...)``, the same values as that, in one pass
                where the codec can (error feedback's settle). On a CodecError ``out`` is
                untouched.
            unsettle: add the decoded values back into ``out`` (required), the exact inverse
                of :meth:`encode_chunks` with ``settle`` for the same payloads; only for a codec
                that settles in place (else ValueError, ``out`` untouched). A payload that does
                not decode raises its CodecError, ``out`` untouched.

        Returns:
            ``out``, or a new float32 tensor of ``sum(numels)`` elements.

        Raises:
            ValueError: ``payloads`` and ``numels`` differ in length; ``out`` is not as above.
            CodecError: as :meth:`decode`, for the first payload that fails.
        """
        if len(payloads) != len(numels):
            raise ValueError(f"{len(payloads)} payloads but {len(numels)} element counts")
        if set(map(type, numels)) - {int} or (len(numels) and min(numels) < 0):  # else: checked one by one
            for n in numels:
                if _bad_int(n) or n < 0:
                    raise CodecError(f"numel must be a non-negative int, got {n!r}")
        if subtract and out is None:
            raise ValueError("subtract=True needs out: the tensor to subtract the decoded values from")
        if unsettle and out is None:
            raise ValueError("unsettle=True needs out: the tensor the encode settled in place")
        if out is None:
            out = torch.empty(sum(numels), dtype=torch.float32)
        elif not (
            out.dtype == torch.float32 and out.device.type == "cpu" and out.dim() == 1 and out.is_contiguous()
        ) or out.numel() != sum(numels):
            raise ValueError(
                f"out must be a contiguous 1-D float32 CPU tensor of {sum(numels)} elements, "
                f"got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
        if unsettle:
            if not self._subtract_runs(out, payloads, numels, verify, unsettle=True):
                self.decode_chunks(payloads, numels, verify=verify)  # a bad payload: its own CodecError
                raise ValueError(f"codec {self.name!r} did not settle these payloads in place: nothing to undo")
            return out
        if subtract:
            if not self._subtract_runs(out, payloads, numels, verify):
                out.sub_(self.decode_chunks(payloads, numels, verify=verify))
            return out
        pos = 0
        for i, j in equal_runs(numels):
            n = numels[i]
            self._decode_run_into(out[pos : pos + (j - i) * n], payloads[i:j], n, verify)
            pos += (j - i) * n
        return out

    def checked_run(self, payloads: Sequence, numels: Sequence[int], *, verify: bool = True) -> CheckedRun | None:
        """The payloads as a :class:`CheckedRun` when every one passes the checks of
        :meth:`decode_chunks` and this codec decodes them in one compiled pass (int8 / int4
        without zstd, chunks of whole blocks); None otherwise (also for a payload that would
        fail: :meth:`decode_chunks` then raises its error)."""
        return None

    def _subtract_runs(
        self, out: torch.Tensor, payloads: Sequence, numels: Sequence[int], verify: bool, unsettle: bool = False
    ) -> bool:
        """``out -= decode_chunks(payloads, numels)`` in one pass (``unsettle``: its exact
        inverse), every payload checked before ``out`` is written; False (``out`` untouched)
        where this codec has no such pass."""
        return False

    def _decode_run_into(self, out: torch.Tensor, payloads: Sequence, numel: int, verify: bool = True) -> None:
        """Decode payloads of ``numel`` elements each into consecutive ranges of ``out``
        (``verify`` is for codecs with a vectorized run: this path checks everything)."""
        for k, p in enumerate(payloads):
            out[k * numel : (k + 1) * numel] = self.decode(p, numel=numel)

    def _header_prefix(self, numel: int) -> bytes:
        """The first 28 header bytes of a float32 input's payload of ``numel`` elements
        (all but the crc32): equal for every payload of that size."""
        raw = self._body_bytes(numel)
        return _HEADER.pack(_MAGIC, _VERSION, self._codec_id, int(self._zstd), 1, self._param(numel), numel, raw, 0)[
            :28
        ]

    def _checked_bodies(self, payloads: Sequence, numel: int, verify: bool = True) -> np.ndarray | None:
        """The bodies of ``payloads`` (a run of ``numel`` elements each, no zstd stage) as a
        ``(len(payloads), body bytes)`` uint8 array when every payload passes the header,
        length and crc32 checks of :meth:`_checked_body`; None when any may not (the caller
        then decodes payload by payload, which raises :meth:`decode`'s error for the first
        bad one). One join and one compiled pass over the rows (``Kernels.check_headers``;
        numpy comparisons and a crc32 call per row without it) instead of a header parse per
        payload. ``verify=False`` (this process's own payloads): the lengths only."""
        raw = self._body_bytes(numel)
        plen = HEADER_BYTES + raw
        if self._zstd or raw == 0 or raw > self.config.max_decoded_bytes:
            return None
        if set(map(len, payloads)) - {plen}:  # also a memoryview of another format
            return None
        joined = bytearray().join(payloads)  # writable: torch can read the rows without a copy
        if len(joined) != plen * len(payloads):
            return None
        rows = np.frombuffer(joined, dtype=np.uint8).reshape(len(payloads), plen)
        if not verify:
            return rows[:, HEADER_BYTES:]
        prefix = self._header_prefix(numel)
        if (kern := kernels()) is not None and kern.rows:  # the same checks in one compiled pass
            return rows[:, HEADER_BYTES:] if kern.check_headers(rows, prefix, _DTYPE_OK) < 0 else None
        want = np.frombuffer(prefix, dtype=np.uint8)
        if not (
            (rows[:, :7] == want[:7]).all()  # magic, version, codec id, zstd flag
            and _DTYPE_OK[rows[:, 7]].all()  # the original dtype (informational)
            and (rows[:, 8:28] == want[8:28]).all()  # block size / k, numel, body length
        ):
            return None
        mv = memoryview(joined)
        crcs = [crc32(mv[a : a + raw]) for a in range(HEADER_BYTES, len(joined), plen)]
        if not np.array_equal(np.ascontiguousarray(rows[:, 28:32]).view("<u4")[:, 0], crcs):
            return None
        return rows[:, HEADER_BYTES:]

    def _checked_body(self, payload: bytes | bytearray | memoryview, numel: int) -> tuple[memoryview | bytes, int]:
        """The validated (decompressed) body of ``payload`` and its expected size (:meth:`decode`'s checks)."""
        if _bad_int(numel) or numel < 0:
            raise CodecError(f"numel must be a non-negative int, got {numel!r}")
        mv = memoryview(payload).cast("B")
        h = peek_header(mv)
        if h.codec != self.base:
            raise CodecError(f"codec mismatch: payload says {h.codec}, expected {self.base}")
        if h.zstd != self._zstd:
            raise CodecError(
                f"zstd flag mismatch: payload says zstd={int(h.zstd)}, "
                f"expected zstd={int(self._zstd)} for codec {self.name}"
            )
        if h.numel != numel:
            raise CodecError(f"element count mismatch: header {h.numel}, expected {numel}")
        expected_param = self._param(numel)
        if h.param != expected_param:
            raise CodecError(f"{self._param_name} mismatch: header {h.param}, expected {expected_param}")
        raw = self._body_bytes(numel)
        bound = self.config.max_decoded_bytes
        if raw > bound:
            raise DecodeBoundExceeded(
                f"decoded body of {raw} bytes for {numel} elements exceeds bound max_decoded_bytes={bound}"
            )
        if self._zstd and h.body_bytes > zstd_bound(raw):
            raise CodecError(
                f"body length mismatch: header says {h.body_bytes} bytes, expected at most {zstd_bound(raw)}"
            )
        if not self._zstd and h.body_bytes != raw:
            raise CodecError(f"body length mismatch: header says {h.body_bytes} bytes, expected {raw}")
        total = HEADER_BYTES + h.body_bytes
        if len(mv) < total:
            raise CodecError(f"truncated payload: need {total} bytes, have {len(mv)}")
        if len(mv) > total:
            raise CodecError(f"trailing bytes: payload has {len(mv)} bytes, header says {total}")
        stored = mv[HEADER_BYTES:]
        crc = crc32(stored)
        if crc != h.crc32:
            raise CodecError(f"checksum mismatch (corrupted body): header crc32 {h.crc32:#010x}, computed {crc:#010x}")
        return (self._decompress(stored, raw) if self._zstd else stored), raw

    def max_error(self, x: torch.Tensor) -> float:
        """The stated bound on ``|decode(encode(x))[i] - x[i]|``, valid for every ``i``.

        Args:
            x: a tensor :meth:`encode` accepts.

        Returns:
            0.0 for fp32. Otherwise the codec's bound (see the ``dtrain.codecs``
            docstring) with a relative slack of 2^-12 for fp32 arithmetic and an
            absolute floor of 2^-126. Costs a pass over ``x`` (topk: a selection);
            meant for tests and monitoring, not the hot path.
        """
        x32, _ = _prepare(x)
        if x32.numel() == 0:
            return 0.0
        return self._max_error(x32, absmax_checked(x32))

    def max_encoded_bytes(self, numel: int) -> int:
        """An upper bound on ``len(encode(x))`` for any ``x`` with ``numel`` elements."""
        raw = self._body_bytes(numel)
        return HEADER_BYTES + (zstd_bound(raw) if self._zstd else raw)

    # --------------------------------------------------------- per-codec pieces
    def _param(self, numel: int) -> int:
        """The header's codec parameter (block size, k; 0 when the codec has none)."""
        return 0

    def _body_bytes(self, numel: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _encode_into(
        self, x: torch.Tensor, out: np.ndarray, generator: torch.Generator | None
    ) -> None:  # pragma: no cover - abstract
        """Write the body for the flat float32 ``x`` into ``out`` (uint8, exact size)."""
        raise NotImplementedError

    def _decode_body(self, body, numel: int) -> torch.Tensor:  # pragma: no cover - abstract
        """Decode the (uncompressed, crc-checked, exact-size) body."""
        raise NotImplementedError

    def _max_error(self, x: torch.Tensor, absmax: float) -> float:  # pragma: no cover
        raise NotImplementedError

    def _body_buffer(self, raw: int) -> np.ndarray:
        """A uint8 scratch of ``raw`` bytes, reused per thread (the payload is a copy of
        it, so the next encode may overwrite it): no new body allocation per bucket."""
        buf = getattr(self._local, "body", None)
        if buf is None or buf.size < raw:
            buf = self._local.body = np.empty(max(raw, 1), dtype=np.uint8)
        return buf[:raw]

    # ----------------------------------------------------------------- zstd stage
    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "cctx", None)
        if c is None:
            c = zstandard.ZstdCompressor(level=self.config.zstd_level, write_content_size=True, write_checksum=False)
            self._local.cctx = c
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "dctx", None)
        if d is None:
            d = zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW)
            self._local.dctx = d
        return d

    def _decompress(self, stored: memoryview, expected: int) -> bytes:
        """Decompress one zstd frame whose content must be exactly ``expected`` bytes.

        A frame that declares its content size (what :meth:`encode` writes) is checked
        *before* decompressing (the zstandard library allocates whatever a frame
        declares): more than ``expected`` raises :class:`DecodeBoundExceeded`, less a
        :class:`CodecError`. A frame that does not declare it (a streaming frame, as
        ``ZstdCompressor().compressobj()`` or ``stream_writer`` write it) is decoded into
        a buffer of ``expected`` bytes; when its content is longer, a bounded streaming
        read of ``expected + 1`` bytes tells a frame past the bound
        (:class:`DecodeBoundExceeded`) from a corrupted one (:class:`CodecError`).
        """
        try:
            declared = zstandard.frame_content_size(stored)
        except zstandard.ZstdError as e:
            raise CodecError(f"corrupted zstd frame header: {e}") from None
        if declared > expected:
            raise DecodeBoundExceeded(f"zstd frame claims {declared} bytes, bound is {expected}")
        if declared != -1 and declared != expected:
            raise CodecError(f"zstd frame claims {declared} bytes, expected {expected}")
        if declared == 0 == expected:
            return b""
        try:
            # max_output_size bounds the buffer of a frame that declares no size (at least 1:
            # zstandard reads 0 as "no limit")
            out = self._decompressor().decompress(stored, max_output_size=max(1, expected), allow_extra_data=False)
        except zstandard.ZstdError as e:
            if declared == -1 and self._streamed_size_exceeds(stored, expected):
                raise DecodeBoundExceeded(f"zstd frame decompresses past its bound of {expected} bytes") from None
            raise CodecError(f"corrupted zstd frame: {e}") from None
        if len(out) != expected:  # zstd enforces a declared size; a streaming frame may be short
            raise CodecError(f"zstd frame decompressed to {len(out)} bytes, expected {expected}")
        return out

    def _streamed_size_exceeds(self, stored: memoryview, expected: int) -> bool:
        """Whether the first frame in ``stored`` yields more than ``expected`` bytes
        (reads at most ``expected + 1``; a corrupted frame reads as not exceeding)."""
        try:
            with self._decompressor().stream_reader(bytes(stored), read_across_frames=False) as r:
                return len(r.read(expected + 1)) > expected
        except zstandard.ZstdError:
            return False


# ------------------------------------------------------------------- helpers
def _prepare(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Validate ``x`` and return a contiguous flat float32 view (a copy only if needed)."""
    if not isinstance(x, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(x).__name__}")
    dtype_id = _DTYPE_IDS.get(x.dtype)
    if dtype_id is None:
        raise CodecError(f"unsupported dtype {x.dtype}: expected float32, bfloat16 or float16")
    x32 = x.detach().reshape(-1)
    if x32.device.type != "cpu":  # θ on the model's device: the body is built on the host
        x32 = x32.cpu()
    if x32.dtype != torch.float32:
        x32 = x32.float()
    return x32.contiguous(), dtype_id


def non_finite_error(x: torch.Tensor) -> CodecError:
    """The CodecError for an input holding NaN/inf (counts them; slow path only)."""
    bad = ~torch.isfinite(x)
    count = int(bad.sum())
    first = int(bad.nonzero()[0, 0]) if count else -1
    n_nan = int(torch.isnan(x).sum())
    return CodecError(
        f"non-finite input: {count} of {x.numel()} elements are NaN or inf "
        f"({n_nan} NaN; first at index {first}); drop non-finite Δ before encoding"
    )


def absmax_checked(x: torch.Tensor) -> float:
    """max|x| as a Python float (one read pass); CodecError if x holds NaN/inf."""
    if x.numel() == 0:
        return 0.0
    lo, hi = (float(v) for v in torch.aminmax(x))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise non_finite_error(x)
    return max(-lo, hi)


def finite_or_raise(chunk: torch.Tensor) -> None:
    """Raise if a *decoded* chunk holds NaN/inf (a corrupted or malicious payload)."""
    if chunk.numel():
        lo, hi = (float(v) for v in torch.aminmax(chunk))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise CodecError("corrupted payload: decoded values contain NaN or inf")


def per_chunk_list(fn):
    """``fn(chunks, *args)`` remembered per distinct chunk list (as a tuple; ``args`` hashable):
    a layout's buckets ask the same questions of the same chunks every round, ~180-300 µs of
    Python for a datagram run's 478-chunk bucket against ~20 µs to hash it. Unhashable chunks
    (lists of lists) are answered, not remembered. ``fn`` gets the tuple; its result is shared,
    so it must be immutable."""
    remembered = functools.lru_cache(maxsize=256)(fn)
    # Answers by identity for a tuple asked before (a bucket's ``chunks``): hashing 478 pairs
    # again cost ~25 µs a call, several calls per bucket and round. The entry holds the tuple,
    # so its id is not reused while the entry lives; only hashable (immutable) tuples get one.
    by_id: dict[tuple, tuple] = {}

    @functools.wraps(fn)
    def call(chunks, *args):
        key = tuple(chunks)
        try:
            if type(chunks) is tuple:
                hit = by_id.get((id(chunks), args))
                if hit is not None and hit[0] is chunks:
                    return hit[1]
            out = remembered(key, *args)
        except TypeError:  # unhashable
            return fn(key, *args)
        if type(chunks) is tuple:
            if len(by_id) >= 256:
                by_id.clear()
            by_id[(id(chunks), args)] = (chunks, out)
        return out

    return call


class CheckedRun:
    """A run of payloads that passed every check their decode makes, not decoded yet
    (:meth:`Codec.checked_run`): :meth:`decode_into` writes their values where they are
    used (an owner's running sum: added there, with no tensor of their own), :meth:`tensor`
    decodes them into a new one (once). Their values are finite (the checks guarantee it).

    Args:
        numel: elements of the run (its payloads' concatenation).
        decode: ``decode(out, mode)`` with ``mode`` ``"write"``, ``"add"``, ``"subtract"`` or
            ``"unsettle"`` (see :meth:`Codec.decode_chunks`), into a contiguous 1-D float32
            CPU ``out`` of ``numel`` elements; it cannot fail.
        step: ``step(theta, buf, sgd)``: torch's fused SGD step of ``theta`` (and its momentum
            ``buf``) with the values as the gradient, decoded in the same pass
            (``dtrain.codecs.native.Kernels.decode_sgd``); None where the codec has none.
    """

    def __init__(
        self,
        numel: int,
        decode: Callable[[torch.Tensor, str], None],
        step: Callable[[torch.Tensor, torch.Tensor, Any], None] | None = None,
    ) -> None:
        self._numel = numel
        self._decode = decode
        self._step = step
        self._tensor: torch.Tensor | None = None

    def numel(self) -> int:
        return self._numel

    def tensor(self) -> torch.Tensor:
        """The decoded values, a 1-D float32 tensor (decoded at the first call)."""
        if self._tensor is None:
            self._tensor = torch.empty(self._numel, dtype=torch.float32)
            self._decode(self._tensor, "write")
        return self._tensor

    def decode_into(self, out: torch.Tensor, *, add: bool = False) -> None:
        """Write (``add``: add) the values into ``out``, contiguous 1-D float32 on the CPU, of
        :meth:`numel` elements: the same values as ``out.copy_(tensor())`` /
        ``out.add_(tensor())``, bit for bit."""
        if not (out.dtype == torch.float32 and out.device.type == "cpu" and out.dim() == 1 and out.is_contiguous()):
            raise ValueError(f"out must be a contiguous 1-D float32 CPU tensor, got {out.dtype} on {out.device}")
        if out.numel() != self._numel:
            raise ValueError(f"out has {out.numel()} elements, the run {self._numel}")
        if self._tensor is not None:
            out.add_(self._tensor) if add else out.copy_(self._tensor)
        else:
            self._decode(out, "add" if add else "write")

    def step_sgd(self, theta: torch.Tensor, buf: torch.Tensor, sgd: Any) -> bool:
        """One outer step of ``theta`` with these values as its gradient, the decode and the step
        in one pass: the bits ``torch._fused_sgd_`` gives (``sgd``: a
        ``dtrain.codecs.native.SgdStep`` with the width ``sgd_width`` found). ``theta`` and ``buf``:
        contiguous 1-D float32 CPU tensors of :meth:`numel` elements. False (nothing done) where
        this codec has no such pass, or the values were decoded already."""
        if self._step is None or self._tensor is not None:
            return False
        if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in (theta, buf)):
            raise ValueError("theta and buf must be contiguous float32 CPU tensors")
        if theta.numel() != self._numel or buf.numel() != self._numel:
            raise ValueError(f"theta has {theta.numel()} and buf {buf.numel()} elements, the run {self._numel}")
        self._step(theta.reshape(-1), buf.reshape(-1), sgd)
        return True


def equal_runs(numels: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` index ranges of the maximal runs of equal values in ``numels``
    (``[5, 5, 5, 2]`` -> ``[(0, 3), (3, 4)]``; empty for an empty sequence)."""
    runs: list[tuple[int, int]] = []
    start = 0
    for _, group in itertools.groupby(numels):
        end = start + len(list(group))
        runs.append((start, end))
        start = end
    return runs


def chunks(n: int, step: int = CHUNK_ELEMS) -> Iterator[tuple[int, int]]:
    """(start, end) pairs covering range(n) in steps of ``step``."""
    for s in range(0, n, step):
        yield s, min(n, s + step)


def np_view(buf, dtype, count: int, offset: int = 0) -> np.ndarray:
    """A numpy array over ``count`` items of ``buf`` at byte ``offset`` (read-only ok)."""
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def t_view(buf: np.ndarray, dtype, count: int, offset: int = 0) -> torch.Tensor:
    """A torch tensor aliasing part of a *writable* uint8 numpy buffer."""
    itemsize = np.dtype(dtype).itemsize
    return torch.from_numpy(buf[offset : offset + count * itemsize].view(dtype))


def pow2_exponent(absmax: float) -> int:
    """e such that absmax * 2^-e lies in [2^14, 2^15) (0 for absmax == 0)."""
    if absmax == 0.0:
        return 0
    _, exp = math.frexp(absmax)  # absmax = m * 2^exp, m in [0.5, 1)
    return exp - 15


def check_exponent(e: int) -> None:
    lo, hi = FP16_EXP_RANGE
    if not lo <= e <= hi:
        raise CodecError(f"corrupted payload: scale exponent {e} outside [{lo}, {hi}]")


def mul_pow2_(t: torch.Tensor, p: int) -> torch.Tensor:
    """t *= 2^p in place, exactly (in steps whose factor is a normal float32)."""
    while p:
        step = max(-126, min(127, p))
        t.mul_(2.0**step)
        p -= step
    return t


def to_scaled_fp16(x: torch.Tensor, e: int, dst: torch.Tensor) -> None:
    """dst (float16) <- x * 2^-e, chunk by chunk.

    When 2^(e+15) would overflow float32 (max|x| within half an fp16 step of 2^128),
    the scaled values are clamped to the largest float16 below 2^15 so that decoding
    cannot produce inf (the error stays <= 2^-11 max|x|).
    """
    scratch = torch.empty(min(CHUNK_ELEMS, x.numel()))
    for s, t in chunks(x.numel()):
        buf = scratch[: t - s]
        buf.copy_(x[s:t])
        mul_pow2_(buf, -e)
        if e + 15 > 127:
            buf.clamp_(-32752.0, 32752.0)
        dst[s:t].copy_(buf)


def from_scaled_fp16(src: np.ndarray, e: int) -> torch.Tensor:
    """A new float32 tensor of src (float16 numpy) * 2^e; CodecError on NaN/inf."""
    check_exponent(e)
    out = torch.empty(src.size, dtype=torch.float32)
    out_np = out.numpy()
    for s, t in chunks(src.size):
        out_np[s:t] = src[s:t]
        finite_or_raise(mul_pow2_(out[s:t], e))
    return out
