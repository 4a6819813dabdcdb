"""Codecs: how a float tensor (a bucket of a pseudo-gradient Δ or of a mean) becomes bytes.

Every codec turns a CPU tensor (float32, bfloat16 or float16; any shape, flattened) into
self-describing bytes and back into a *new* 1-D float32 tensor. An optional zstd stage
(``"<codec>+zstd"``) compresses the codec's body losslessly.

Payload layout (little-endian, :data:`HEADER_BYTES` = 32 bytes, then the body)::

    offset size field
    0      4    magic  b"DTRC"
    4      1    format version (1)
    5      1    codec id (fp32=1, bf16=2, fp16=3, int8=4, int4=5, topk=6)
    6      1    zstd flag (0/1)
    7      1    original dtype id (float32=1, bfloat16=2, float16=3; informational)
    8      4    codec parameter (int8/int4: block size; topk: k; else 0)
    12     8    numel (u64)
    20     8    body length in bytes as stored (after zstd when the flag is set)
    28     4    crc32 of the stored body

Decoding checks every field against what the decoding codec expects (codec id, zstd
flag, parameter, ``numel``), the stored length against the payload length, the crc32,
and for zstd the frame's *declared* content size against the exact expected body size
before anything is decompressed (a frame claiming 10 GB is refused without allocating).
Decoded values are checked to be finite. Any failure raises
:class:`dtrain.errors.CodecError` whose message names the problem.

Bodies (the raw body size follows from codec, numel and parameter alone):

* ``fp32``: numel float32. Lossless.
* ``bf16``: numel bfloat16, round-to-nearest-even; values beyond the bfloat16 range are
  clamped to ±max finite bfloat16. Error <= 2^-8 |x| (+ a subnormal floor).
* ``fp16``: int32 exponent e, then numel float16 of x * 2^-e, where the power of two 2^e
  is chosen per tensor so that max|x| lands in [2^14, 2^15) (no overflow at 1e30, no
  underflow at 1e-30; multiplying by a power of two is exact). Error <= 2^-11 max|x|.
* ``int8``: ceil(numel / block_size) float32 scales, then numel int8 codes in [-127, 127].
  Blockwise absmax: scale_b = max|x_b| / 127, code = round(x / scale_b). Scales are fp32
  (not fp16) so that magnitudes from 1e-30 to 1e30 keep their range; the overhead is
  4 / block_size bytes per element (1.6 % at block_size 256). Error <= scale_b / 2
  (round to nearest) or < scale_b (stochastic rounding, unbiased). This is the int8
  pseudo-gradient scheme of OpenDiLoCo (arXiv 2407.07852) and INTELLECT-1
  (arXiv 2412.01152), with blockwise rather than per-tensor scales.
* ``int4``: float32 scales as int8, then ceil(numel / 2) bytes, two codes per byte
  (element 2i in the low nibble, 2i+1 in the high nibble), nibble = code + 8 with code in
  [-7, 7]; an odd tail is padded with the nibble 8 (zero). scale_b = max|x_b| / 7.
  Streaming DiLoCo (arXiv 2501.18512) uses 4-bit E3M0 floats; this is the integer
  absmax variant.
* ``topk``: int32 exponent e, then k uint32 index gaps, then k float16 values scaled by
  2^-e as in fp16. k = ceil(topk_fraction * numel) (at least 1 for a non-empty tensor);
  the kept elements are the k largest |x|; indices are sorted ascending and stored as
  gaps (the first gap is the first index), which zstd compresses well. fp16 values rather
  than int8 keep relative precision 2^-11 on the kept elements. Every element not kept
  decodes to 0, so topk only makes sense with error feedback (the residual carries what
  was dropped into the next round; SparseLoCo, DESIGN.md), hence
  ``needs_error_feedback = True``.

Threading: a :class:`Codec` may be used from several threads at once (zstd contexts are
per thread).
"""

from __future__ import annotations

import math
import struct
import sys
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from dtrain.errors import CodecError

__all__ = [
    "CODEC_NAMES",
    "HEADER_BYTES",
    "Codec",
    "CodecConfig",
    "PayloadHeader",
    "get_codec",
    "peek_header",
]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("dtrain.codecs assumes a little-endian host")

CODEC_NAMES: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8", "int4", "topk")
ZSTD_SUFFIX = "+zstd"

_CODEC_IDS = {"fp32": 1, "bf16": 2, "fp16": 3, "int8": 4, "int4": 5, "topk": 6}
_CODEC_BY_ID = {v: k for k, v in _CODEC_IDS.items()}
_DTYPE_IDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_DTYPE_BY_ID = {v: k for k, v in _DTYPE_IDS.items()}

_MAGIC = b"DTRC"
_VERSION = 1
_HEADER = struct.Struct("<4sBBBBIQQI")
HEADER_BYTES: int = _HEADER.size  # 32
_MAX_BLOCK_SIZE = 1 << 24
_FP32_MAX = float(torch.finfo(torch.float32).max)
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)
_TINY = 2.0**-126  # absolute floor added to lossy bounds (fp32 subnormal range)
_SLACK = 1.0 + 2.0**-12  # relative slack for fp32 arithmetic inside the bounds
_FP16_EXP_RANGE = (-170, 120)  # exponents an encoder can produce (max|x| in fp32 range)


def _zstd_bound(raw: int) -> int:
    """ZSTD_COMPRESSBOUND(raw) from zstd.h: the largest frame zstd makes for ``raw`` bytes."""
    extra = ((128 << 10) - raw) >> 11 if raw < (128 << 10) else 0
    return raw + (raw >> 8) + extra + 32  # + frame header/checksum margin


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """Which codec to use and its parameters.

    Attributes:
        name: one of :data:`CODEC_NAMES`, optionally with the ``"+zstd"`` suffix
            (``"int8+zstd"``).
        zstd_level: zstd compression level, 1..22 (1-3 for the hot path).
        block_size: elements per absmax scale block for int8/int4; >= 8, even,
            <= 2**24.
        topk_fraction: fraction of elements kept by topk, in (0, 1].
        stochastic_rounding: int8/int4 only. Round up with probability equal to the
            fractional part, so that E[decode(encode(x))] = x; pass a seeded
            ``torch.Generator`` to :meth:`Codec.encode` to make it reproducible.
        max_decoded_bytes: hard bound on any decoded (decompressed) body size in bytes;
            decode refuses larger payloads before allocating.

    Raises:
        ValueError: a field is out of range; the message names the field.
    """

    name: str = "fp32"
    zstd_level: int = 3
    block_size: int = 256
    topk_fraction: float = 0.01
    stochastic_rounding: bool = False
    max_decoded_bytes: int = 1 << 31

    def __post_init__(self) -> None:
        allowed = ", ".join(CODEC_NAMES)
        if not isinstance(self.name, str) or self.base_name not in CODEC_NAMES:
            raise ValueError(
                f"codec name {self.name!r} is not valid: allowed codec names are {allowed}, "
                f"each optionally with the suffix {ZSTD_SUFFIX!r}"
            )
        if _bad_int(self.zstd_level) or not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be an int in 1..22, got {self.zstd_level!r}")
        if (
            _bad_int(self.block_size)
            or not 8 <= self.block_size <= _MAX_BLOCK_SIZE
            or self.block_size % 2
        ):
            raise ValueError(
                f"block_size must be an even int in 8..{_MAX_BLOCK_SIZE}, got {self.block_size!r}"
            )
        if (
            isinstance(self.topk_fraction, bool)
            or not isinstance(self.topk_fraction, (int, float))
            or not 0.0 < self.topk_fraction <= 1.0
        ):
            raise ValueError(f"topk_fraction must be in (0, 1], got {self.topk_fraction!r}")
        if not isinstance(self.stochastic_rounding, bool):
            raise ValueError(
                f"stochastic_rounding must be a bool, got {self.stochastic_rounding!r}"
            )
        if self.stochastic_rounding and self.base_name not in ("int8", "int4"):
            raise ValueError(
                f"stochastic_rounding applies to int8/int4 only, not codec {self.base_name!r}"
            )
        if _bad_int(self.max_decoded_bytes) or self.max_decoded_bytes < 1:
            raise ValueError(
                f"max_decoded_bytes must be a positive int, got {self.max_decoded_bytes!r}"
            )

    @property
    def base_name(self) -> str:
        """The codec name without the ``"+zstd"`` suffix."""
        return self.name[: -len(ZSTD_SUFFIX)] if self.name.endswith(ZSTD_SUFFIX) else self.name

    @property
    def zstd(self) -> bool:
        """Whether the zstd stage is on."""
        return self.name.endswith(ZSTD_SUFFIX)


def _bad_int(v: object) -> bool:
    return isinstance(v, bool) or not isinstance(v, int)


@dataclass(frozen=True)
class PayloadHeader:
    """The fixed header of a payload, as parsed by :func:`peek_header` (not validated
    against any expectation beyond magic and version)."""

    codec: str
    zstd: bool
    dtype: torch.dtype
    param: int
    numel: int
    body_bytes: int
    crc32: int


def peek_header(payload: bytes) -> PayloadHeader:
    """Parse a payload's header, e.g. to log or route it.

    Raises:
        CodecError: too short, bad magic, unknown version, codec or dtype id.
    """
    if len(payload) < HEADER_BYTES:
        raise CodecError(
            f"truncated payload: need {HEADER_BYTES} bytes for the header, have {len(payload)}"
        )
    magic, version, codec_id, zflag, dtype_id, param, numel, body_len, crc = _HEADER.unpack_from(
        payload, 0
    )
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
    """Encodes float tensors to self-describing bytes and back (see the module docstring).

    Attributes:
        name: full name including ``"+zstd"``.
        config: the :class:`CodecConfig` it was built from.
        lossless: True only for fp32 (with or without zstd).
        needs_error_feedback: True for topk: what it drops must be carried in a residual.
    """

    lossless: bool = False
    needs_error_feedback: bool = False
    _base: str = ""

    def __init__(self, config: CodecConfig) -> None:
        self.config = config
        self.name = config.name
        self._zstd = config.zstd
        self._codec_id = _CODEC_IDS[self._base]
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    # ----------------------------------------------------------------- public API
    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> bytes:
        """Encode ``x`` to bytes.

        Args:
            x: CPU tensor of dtype float32, bfloat16 or float16, any shape (flattened in
                row-major order). Not modified.
            generator: CPU generator for stochastic rounding (int8/int4 with
                ``stochastic_rounding=True``); ignored by other codecs. ``None`` uses
                torch's default generator.

        Returns:
            The payload: header + body, see the module docstring.

        Raises:
            CodecError: ``x`` is not a CPU float32/bfloat16/float16 tensor, or contains
                NaN or ±inf (the message says how many and the first index).
        """
        x32, dtype_id = _prepare(x)
        numel = x32.numel()
        raw = self._body_bytes(numel)
        param = self._param(numel)
        if self._zstd:
            body = bytearray(raw)
            if raw:
                self._encode_into(x32, memoryview(body), generator)
            stored = self._compressor().compress(body)
        else:
            buf = bytearray(HEADER_BYTES + raw)
            if raw:
                self._encode_into(x32, memoryview(buf)[HEADER_BYTES:], generator)
            crc = zlib.crc32(memoryview(buf)[HEADER_BYTES:])
            _HEADER.pack_into(
                buf, 0, _MAGIC, _VERSION, self._codec_id, 0, dtype_id, param, numel, raw, crc
            )
            return bytes(buf)
        header = _HEADER.pack(
            _MAGIC,
            _VERSION,
            self._codec_id,
            1,
            dtype_id,
            param,
            numel,
            len(stored),
            zlib.crc32(stored),
        )
        return header + stored

    def decode(self, payload: bytes, *, numel: int) -> torch.Tensor:
        """Decode a payload made by :meth:`encode` of a codec with the same config.

        Args:
            payload: the bytes (``bytes``, ``bytearray`` or ``memoryview``).
            numel: the number of elements the caller expects.

        Returns:
            A new 1-D float32 tensor with exactly ``numel`` elements.

        Raises:
            CodecError: truncated, corrupted (crc32 or value checks), mislabeled (codec,
                zstd flag, parameter), wrong element count, a body larger than
                ``config.max_decoded_bytes``, or a zstd frame whose declared content size
                is not the expected body size (refused before decompressing).
        """
        if _bad_int(numel) or numel < 0:
            raise CodecError(f"numel must be a non-negative int, got {numel!r}")
        mv = memoryview(payload).cast("B") if not isinstance(payload, bytes) else payload
        h = peek_header(mv)
        if h.codec != self._base:
            raise CodecError(f"codec mismatch: payload says {h.codec}, expected {self._base}")
        if h.zstd != self._zstd:
            raise CodecError(
                f"zstd flag mismatch: payload says zstd={int(h.zstd)}, "
                f"expected zstd={int(self._zstd)} for codec {self.name}"
            )
        if h.numel != numel:
            raise CodecError(f"element count mismatch: header {h.numel}, expected {numel}")
        expected_param = self._param(numel)
        if h.param != expected_param:
            raise CodecError(
                f"{self._param_name} mismatch: header {h.param}, expected {expected_param}"
            )
        raw = self._body_bytes(numel)
        bound = self.config.max_decoded_bytes
        if raw > bound:
            raise CodecError(
                f"decoded body of {raw} bytes for {numel} elements exceeds bound "
                f"max_decoded_bytes={bound}"
            )
        max_stored = _zstd_bound(raw) if self._zstd else raw
        if (self._zstd and h.body_bytes > max_stored) or (
            not self._zstd and h.body_bytes != raw
        ):
            raise CodecError(
                f"body length mismatch: header says {h.body_bytes} bytes, expected "
                f"{'at most ' if self._zstd else ''}{max_stored}"
            )
        total = HEADER_BYTES + h.body_bytes
        if len(mv) < total:
            raise CodecError(f"truncated payload: need {total} bytes, have {len(mv)}")
        if len(mv) > total:
            raise CodecError(
                f"trailing bytes: payload has {len(mv)} bytes, header says {total}"
            )
        stored = memoryview(mv)[HEADER_BYTES:]
        crc = zlib.crc32(stored)
        if crc != h.crc32:
            raise CodecError(
                f"checksum mismatch (corrupted body): header crc32 {h.crc32:#010x}, "
                f"computed {crc:#010x}"
            )
        body = self._decompress(stored, raw) if self._zstd else stored
        if raw == 0:
            return torch.zeros(numel, dtype=torch.float32)
        return self._decode_body(body, numel)

    def max_error(self, x: torch.Tensor) -> float:
        """The stated bound on ``|decode(encode(x))[i] - x[i]|`` over all elements ``i``.

        Args:
            x: a tensor :meth:`encode` accepts.

        Returns:
            0.0 for fp32; otherwise a bound that holds for every element (it includes a
            small relative slack for fp32 arithmetic and an absolute floor of 2^-126).
        """
        x32, _ = _prepare(x)
        if x32.numel() == 0:
            return 0.0
        return self._max_error(x32, _absmax(x32))

    def max_encoded_bytes(self, numel: int) -> int:
        """An upper bound on ``len(encode(x))`` for ``x`` with ``numel`` elements."""
        raw = self._body_bytes(numel)
        return HEADER_BYTES + (_zstd_bound(raw) if self._zstd else raw)

    # --------------------------------------------------------- per-codec pieces
    _param_name = "codec parameter"

    def _param(self, numel: int) -> int:
        return 0

    def _body_bytes(self, numel: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _encode_into(
        self, x: torch.Tensor, out: memoryview, generator: torch.Generator | None
    ) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _decode_body(self, body, numel: int) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _max_error(self, x: torch.Tensor, absmax: float) -> float:  # pragma: no cover
        raise NotImplementedError

    # ----------------------------------------------------------------- zstd stage
    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "cctx", None)
        if c is None:
            c = zstandard.ZstdCompressor(
                level=self.config.zstd_level, write_content_size=True, write_checksum=False
            )
            self._local.cctx = c
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "dctx", None)
        if d is None:
            # max_window_size bounds the decoder's window memory (128 MiB).
            d = zstandard.ZstdDecompressor(max_window_size=1 << 27)
            self._local.dctx = d
        return d

    def _decompress(self, stored: memoryview, expected: int) -> bytes:
        """Decompress one zstd frame whose content size must be exactly ``expected``.

        The frame header's declared content size is checked *before* decompressing (the
        zstandard library would otherwise allocate whatever the frame claims), and the
        output is capped at ``expected`` bytes.
        """
        try:
            declared = zstandard.frame_content_size(stored)
        except zstandard.ZstdError as e:
            raise CodecError(f"corrupted zstd frame header: {e}") from None
        if declared == -1:
            raise CodecError(
                f"zstd frame does not declare its content size (expected {expected} bytes)"
            )
        if declared != expected:
            raise CodecError(
                f"zstd frame claims {declared} bytes, bound is {expected}"
                if declared > expected
                else f"zstd frame claims {declared} bytes, expected {expected}"
            )
        if expected == 0:
            return b""
        try:
            out = self._decompressor().decompress(
                stored, max_output_size=expected, allow_extra_data=False
            )
        except zstandard.ZstdError as e:
            raise CodecError(f"corrupted zstd frame: {e}") from None
        if len(out) != expected:  # zstd enforces the declared size; belt and braces
            raise CodecError(f"zstd frame decompressed to {len(out)} bytes, expected {expected}")
        return out


# ------------------------------------------------------------------- helpers
def _prepare(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Validate and flatten to a contiguous 1-D float32 view (a copy only if needed)."""
    if not isinstance(x, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise CodecError(f"expected a CPU tensor, got device {x.device}")
    dtype_id = _DTYPE_IDS.get(x.dtype)
    if dtype_id is None:
        raise CodecError(
            f"unsupported dtype {x.dtype}: expected float32, bfloat16 or float16"
        )
    x32 = x.detach().reshape(-1)
    if x32.dtype != torch.float32:
        x32 = x32.float()
    return x32.contiguous(), dtype_id


def _non_finite_error(x: torch.Tensor) -> CodecError:
    bad = ~torch.isfinite(x)
    count = int(bad.sum())
    first = int(bad.nonzero()[0, 0]) if count else -1
    n_nan = int(torch.isnan(x).sum())
    return CodecError(
        f"non-finite input: {count} of {x.numel()} elements are NaN or inf "
        f"({n_nan} NaN; first at index {first}); drop non-finite Δ before encoding"
    )


def _absmax(x: torch.Tensor) -> float:
    """max|x| as a Python float; raises CodecError on NaN/inf. One read pass."""
    if x.numel() == 0:
        return 0.0
    mn, mx = torch.aminmax(x)
    lo, hi = float(mn), float(mx)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise _non_finite_error(x)
    return max(-lo, hi)


def _np_view(buf, dtype, count: int, offset: int = 0) -> np.ndarray:
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def _t_view(buf: memoryview, dtype, count: int, offset: int = 0) -> torch.Tensor:
    """A torch tensor aliasing a *writable* buffer."""
    return torch.from_numpy(np.frombuffer(buf, dtype=dtype, count=count, offset=offset))


def _pow2_exponent(absmax: float) -> int:
    """e such that absmax * 2^-e is in [2^14, 2^15) (0 for absmax == 0)."""
    if absmax == 0.0:
        return 0
    _, exp = math.frexp(absmax)  # absmax = m * 2^exp, m in [0.5, 1)
    return exp - 15


def _to_scaled_fp16(x: torch.Tensor, e: int, dst: torch.Tensor) -> None:
    """dst (float16) <- x * 2^-e. When 2^(e+15) would overflow float32 (max|x| within
    half an fp16 step of 2^128), the scaled values are clamped to the largest float16
    below 2^15 so that decoding cannot produce inf (error still <= 2^-11 max|x|)."""
    if e == 0:
        dst.copy_(x)
        return
    scaled = _mul_pow2_(x.clone(), -e)
    if e + 15 > 127:
        scaled.clamp_(-32752.0, 32752.0)
    dst.copy_(scaled)


def _mul_pow2_(t: torch.Tensor, p: int) -> torch.Tensor:
    """t *= 2^p in place, exactly (in steps whose factor is a normal float32)."""
    while p:
        step = max(-126, min(127, p))
        t.mul_(2.0**step)
        p -= step
    return t


def _check_finite_out(out: torch.Tensor) -> torch.Tensor:
    if out.numel():
        mn, mx = torch.aminmax(out)
        if not (math.isfinite(float(mn)) and math.isfinite(float(mx))):
            raise CodecError("corrupted payload: decoded values contain NaN or inf")
    return out


# -------------------------------------------------------------- float codecs
class _Fp32(Codec):
    lossless = True
    _base = "fp32"

    def _body_bytes(self, numel: int) -> int:
        return 4 * numel

    def _encode_into(self, x, out, generator):
        _absmax(x)  # finiteness check
        _t_view(out, np.float32, x.numel()).copy_(x)

    def _decode_body(self, body, numel):
        out = torch.empty(numel, dtype=torch.float32)
        out.numpy()[:] = _np_view(body, np.float32, numel)
        return _check_finite_out(out)

    def _max_error(self, x, absmax):
        return 0.0


class _Bf16(Codec):
    _base = "bf16"

    def _body_bytes(self, numel: int) -> int:
        return 2 * numel

    def _encode_into(self, x, out, generator):
        absmax = _absmax(x)
        dst = _t_view(out, np.int16, x.numel()).view(torch.bfloat16)
        if absmax > _BF16_MAX:  # fp32 values past bf16 max would round to inf
            dst.copy_(x.clamp(-_BF16_MAX, _BF16_MAX))
        else:
            dst.copy_(x)

    def _decode_body(self, body, numel):
        src = _np_view(body, np.int16, numel)
        # bf16 -> fp32 is a 16-bit left shift of the bit pattern.
        out = torch.empty(numel, dtype=torch.int32)
        out.numpy()[:] = src
        out.bitwise_left_shift_(16)
        return _check_finite_out(out.view(torch.float32))

    def _max_error(self, x, absmax):
        # RNE: <= 2^-9 relative to the element; 2^-8 absmax covers it, and the clamp at
        # the top of the range (< 2^-7 absmax) is covered by the factor 2.
        return absmax * 2.0**-8 * (2.0 if absmax > _BF16_MAX else _SLACK) + _TINY


class _Fp16(Codec):
    _base = "fp16"

    def _body_bytes(self, numel: int) -> int:
        return 4 + 2 * numel

    def _encode_into(self, x, out, generator):
        e = _pow2_exponent(_absmax(x))
        _t_view(out, np.int32, 1)[0] = e
        _to_scaled_fp16(x, e, _t_view(out, np.float16, x.numel(), 4))

    def _decode_body(self, body, numel):
        e = int(_np_view(body, np.int32, 1)[0])
        _check_exponent(e)
        out = torch.empty(numel, dtype=torch.float32)
        out.numpy()[:] = _np_view(body, np.float16, numel, 4)
        return _check_finite_out(_mul_pow2_(out, e))

    def _max_error(self, x, absmax):
        return absmax * 2.0**-11 * _SLACK + _TINY


def _check_exponent(e: int) -> None:
    lo, hi = _FP16_EXP_RANGE
    if not lo <= e <= hi:
        raise CodecError(f"corrupted payload: scale exponent {e} outside [{lo}, {hi}]")


# -------------------------------------------------------- blockwise integer
class _Blockwise(Codec):
    """Blockwise absmax quantization to signed integers in [-qmax, qmax]."""

    _qmax = 127
    _param_name = "block size"

    def __init__(self, config: CodecConfig) -> None:
        super().__init__(config)
        self._bs = config.block_size
        self._sr = config.stochastic_rounding

    def _param(self, numel):
        return self._bs

    def _num_blocks(self, numel: int) -> int:
        return -(-numel // self._bs)

    def _codes_bytes(self, numel: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _body_bytes(self, numel):
        return 4 * self._num_blocks(numel) + self._codes_bytes(numel)

    def _scales(self, x: torch.Tensor) -> torch.Tensor:
        """Per-block absmax / qmax (fp32), nudged down so qmax * scale never overflows."""
        n, bs = x.numel(), self._bs
        nfull = n // bs
        parts = []
        if nfull:
            xv = x[: nfull * bs].view(nfull, bs)
            parts.append(torch.maximum(xv.amax(dim=1), xv.amin(dim=1).neg_()))
        if n % bs:
            tail = x[nfull * bs :]
            parts.append(torch.maximum(tail.max(), tail.min().neg()).reshape(1))
        absmax = torch.cat(parts) if len(parts) > 1 else parts[0]
        if not bool(torch.isfinite(absmax).all()):
            raise _non_finite_error(x)
        scale = absmax / self._qmax
        over = scale * self._qmax > absmax
        if bool(over.any()):
            scale = torch.where(over, torch.nextafter(scale, torch.zeros_like(scale)), scale)
        return scale

    def _quantize(self, x, scale, generator) -> torch.Tensor:
        """float32 tensor of codes in [-qmax, qmax] (same length as x)."""
        n, bs = x.numel(), self._bs
        nfull = n // bs
        div = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.empty(n, dtype=torch.float32)
        if nfull:
            torch.div(x[: nfull * bs].view(nfull, bs), div[:nfull, None], out=q[: nfull * bs].view(nfull, bs))
        if n % bs:
            torch.div(x[nfull * bs :], div[nfull], out=q[nfull * bs :])
        if self._sr:
            q.add_(torch.rand(n, generator=generator, dtype=torch.float32)).floor_()
        else:
            q.round_()
        return q.clamp_(-self._qmax, self._qmax)

    def _dequantize_(self, out: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        n, bs = out.numel(), self._bs
        nfull = n // bs
        if nfull:
            out[: nfull * bs].view(nfull, bs).mul_(scale[:nfull, None])
        if n % bs:
            out[nfull * bs :].mul_(scale[nfull])
        return out

    def _read_scales(self, body, numel) -> torch.Tensor:
        nb = self._num_blocks(numel)
        scale = torch.from_numpy(_np_view(body, np.float32, nb).copy())
        ok = torch.isfinite(scale * self._qmax).all() and (scale >= 0).all()
        if not bool(ok):
            raise CodecError("corrupted payload: block scales must be finite and >= 0")
        return scale

    def _max_error(self, x, absmax):
        step = absmax / self._qmax
        return step * (1.0 if self._sr else 0.5) * _SLACK + _TINY


class _Int8(_Blockwise):
    _base = "int8"
    _qmax = 127

    def _codes_bytes(self, numel):
        return numel

    def _encode_into(self, x, out, generator):
        n = x.numel()
        scale = self._scales(x)
        _t_view(out, np.float32, scale.numel()).copy_(scale)
        q = self._quantize(x, scale, generator)
        _t_view(out, np.int8, n, 4 * scale.numel()).copy_(q)

    def _decode_body(self, body, numel):
        scale = self._read_scales(body, numel)
        codes = _np_view(body, np.int8, numel, 4 * scale.numel())
        if numel and (codes == -128).any():
            raise CodecError("corrupted payload: int8 code -128 is never produced")
        out = torch.empty(numel, dtype=torch.float32)
        out.numpy()[:] = codes
        return self._dequantize_(out, scale)


# (lo, hi) values for every packed byte: nibble - 8.
_INT4_TABLE = np.stack(
    [(np.arange(256) & 15) - 8, (np.arange(256) >> 4) - 8], axis=1
).astype(np.float32)


class _Int4(_Blockwise):
    _base = "int4"
    _qmax = 7

    def _codes_bytes(self, numel):
        return (numel + 1) // 2

    def _encode_into(self, x, out, generator):
        n = x.numel()
        scale = self._scales(x)
        nb = scale.numel()
        _t_view(out, np.float32, nb).copy_(scale)
        q = self._quantize(x, scale, generator).add_(8)  # nibbles 1..15
        if n % 2:
            q = torch.cat([q, torch.full((1,), 8.0)])
        pairs = q.view(-1, 2)
        packed = torch.add(pairs[:, 0], pairs[:, 1], alpha=16)
        _t_view(out, np.uint8, (n + 1) // 2, 4 * nb).copy_(packed)

    def _decode_body(self, body, numel):
        scale = self._read_scales(body, numel)
        nbytes = (numel + 1) // 2
        packed = _np_view(body, np.uint8, nbytes, 4 * scale.numel())
        lo = packed & 15
        if (lo == 0).any() or ((packed >> 4) == 0).any():
            raise CodecError("corrupted payload: int4 nibble 0 (code -8) is never produced")
        if numel % 2 and packed[-1] >> 4 != 8:
            raise CodecError("corrupted payload: int4 padding nibble is not zero")
        pairs = np.empty((nbytes, 2), dtype=np.float32)
        np.take(_INT4_TABLE, packed, axis=0, out=pairs)
        out = torch.from_numpy(pairs.reshape(-1)[:numel])
        return self._dequantize_(out, scale)


# ----------------------------------------------------------------------- topk
class _TopK(Codec):
    _base = "topk"
    needs_error_feedback = True
    _param_name = "k"

    def _param(self, numel):
        return self.k_for(numel)

    def k_for(self, numel: int) -> int:
        """Number of kept elements: ceil(topk_fraction * numel), at least 1 if numel > 0."""
        if numel == 0:
            return 0
        return min(numel, max(1, math.ceil(self.config.topk_fraction * numel)))

    def _body_bytes(self, numel):
        k = self.k_for(numel)
        return 4 + 6 * k if k else 0

    def _encode_into(self, x, out, generator):
        n = x.numel()
        absmax = _absmax(x)
        k = self.k_for(n)
        idx = _topk_indices(x, k)
        vals = x[idx]
        e = _pow2_exponent(float(vals.abs().max()))
        _t_view(out, np.int32, 1)[0] = e
        gaps = _t_view(out, np.int32, k, 4)
        gaps[0] = idx[0]
        torch.sub(idx[1:], idx[:-1], out=gaps[1:]) if k > 1 else None
        _to_scaled_fp16(vals, e, _t_view(out, np.float16, k, 4 + 4 * k))
        del absmax

    def _decode_body(self, body, numel):
        k = self.k_for(numel)
        e = int(_np_view(body, np.int32, 1)[0])
        _check_exponent(e)
        gaps = torch.from_numpy(_np_view(body, np.uint32, k, 4).astype(np.int64))
        if k > 1 and bool((gaps[1:] == 0).any()):
            raise CodecError("corrupted payload: topk indices are not strictly increasing")
        idx = torch.cumsum(gaps, 0)
        if int(idx[-1]) >= numel:
            raise CodecError(
                f"corrupted payload: topk index {int(idx[-1])} out of range for {numel} elements"
            )
        vals = torch.empty(k, dtype=torch.float32)
        vals.numpy()[:] = _np_view(body, np.float16, k, 4 + 4 * k)
        _check_finite_out(_mul_pow2_(vals, e))
        out = torch.zeros(numel, dtype=torch.float32)
        out[idx] = vals
        return out

    def _max_error(self, x, absmax):
        n = x.numel()
        k = self.k_for(n)
        dropped = float(torch.kthvalue(x.abs(), n - k).values) if k < n else 0.0
        return max(dropped * _SLACK, absmax * 2.0**-11 * _SLACK) + _TINY


def _topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted (ascending) int64 indices of the k largest |x|.

    torch.topk over millions of elements is slow on CPU (~40 MB/s), so a threshold is
    estimated from a fixed-seed random sample, the candidates above it are collected
    with one compare and one nonzero, and topk runs on the candidates only. If the
    sample under-estimates, the threshold is lowered; the last resort is a full topk.
    """
    n = x.numel()
    a = x.abs()
    if k * 8 >= n or n < 1 << 16:
        idx = torch.topk(a, k, sorted=False).indices
        return idx.sort().values
    g = torch.Generator().manual_seed(0x5EED)
    sample = a[torch.randint(n, (1 << 16,), generator=g)]
    frac = k / n
    for mult in (2.0, 8.0):
        rank = min(sample.numel() - 1, int(sample.numel() * frac * mult))
        thr = torch.kthvalue(sample, sample.numel() - rank).values
        cand = (a >= thr).nonzero().squeeze(1)
        if cand.numel() >= k:
            sel = torch.topk(a[cand], k, sorted=False).indices
            return cand[sel].sort().values
    idx = torch.topk(a, k, sorted=False).indices
    return idx.sort().values


_CLASSES: dict[str, type[Codec]] = {
    "fp32": _Fp32,
    "bf16": _Bf16,
    "fp16": _Fp16,
    "int8": _Int8,
    "int4": _Int4,
    "topk": _TopK,
}


def get_codec(config: CodecConfig | str) -> Codec:
    """Build the codec for ``config``.

    Args:
        config: a :class:`CodecConfig`, or a name as shorthand for
            ``CodecConfig(name=name)``.

    Raises:
        ValueError: unknown codec name (the message names "codec" and the allowed
            names) or an invalid config field.
    """
    if isinstance(config, str):
        config = CodecConfig(name=config)
    if not isinstance(config, CodecConfig):
        raise ValueError(
            f"codec config must be a CodecConfig or a codec name, got {type(config).__name__}; "
            f"allowed codec names: {', '.join(CODEC_NAMES)} (each optionally +zstd)"
        )
    return _CLASSES[config.base_name](config)
