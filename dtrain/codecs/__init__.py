"""Codecs: how a float tensor (a bucket of a pseudo-gradient Δ, or an owner's mean)
becomes bytes, and back.

``get_codec("int8+zstd").encode(x)`` turns a CPU tensor (float32, bfloat16 or float16;
any shape, flattened) into self-describing bytes; ``decode(payload, numel=n)`` returns
a *new* 1-D float32 tensor of exactly n elements or raises
:class:`dtrain.errors.CodecError` naming the problem. The optional ``+zstd`` stage
compresses the codec's body losslessly.

Payload layout (little-endian; :data:`HEADER_BYTES` = 32, then the body)::

    offset size field
    0      4    magic b"DTRC"
    4      1    format version (1)
    5      1    codec id: fp32=1, bf16=2, fp16=3, int8=4, int4=5, topk=6, sparseloco=7
    6      1    zstd flag: 0/1
    7      1    original dtype id: float32=1, bfloat16=2, float16=3 (informational)
    8      4    codec parameter: int8/int4 block size, topk k, sparseloco
                log2(chunk) | bits << 8 | k << 16, else 0
    12     8    numel (u64)
    20     8    body length in bytes as stored (after zstd when the flag is set)
    28     4    crc32 of the stored body

Decoding checks magic, version, codec id, zstd flag, parameter and numel against what
the decoding codec expects; the decoded body size (which follows from codec, numel and
parameter alone) against ``CodecConfig.max_decoded_bytes``; the stored length against
the payload length; the crc32; for zstd, the frame's *declared* content size against the
exact expected body size before anything is decompressed (so a frame claiming 10 GB is
refused without allocating it, :class:`~dtrain.errors.DecodeBoundExceeded`; a streaming
frame that declares no size is decoded into a buffer of the expected size and refused
the same way if it yields more); and finally
that the decoded values are finite and the codes possible.

Bodies (details in each class):

* ``fp32`` (:class:`~dtrain.codecs.floats.Fp32Codec`): numel float32; lossless.
* ``bf16`` (:class:`~dtrain.codecs.floats.Bf16Codec`): numel bfloat16 (RNE);
  error <= 2^-8 max|x|.
* ``fp16`` (:class:`~dtrain.codecs.floats.Fp16Codec`): int32 exponent e, numel float16
  of x * 2^-e with max|x| * 2^-e in [2^14, 2^15); error <= 2^-11 max|x|.
* ``int8`` / ``int4`` (:mod:`dtrain.codecs.blockwise`): float32 absmax scale per
  ``block_size`` elements, then int8 codes in [-127, 127] / packed 4-bit codes in
  [-7, 7]; error <= scale / 2 (scale = block max|x| / 127 or / 7), < scale with
  stochastic rounding (unbiased).
* ``topk`` (:class:`~dtrain.codecs.topk.TopKCodec`): k = ceil(fraction * numel) sorted
  index gaps (uint32) and fp16 values; needs error feedback.
* ``sparseloco`` (:class:`~dtrain.codecs.sparse.SparseLoCoCodec`, SparseLoCo arXiv
  2508.15706): per chunk of ``sparse_chunk`` elements (C) the ``sparse_k`` largest |x|
  (k); body = per chunk (lo, hi) float32, then all kept chunk-local indices in log2(C) bits
  each, then all kept values in ``sparse_bits`` bits each (sign | magnitude level between
  lo and hi), both bit streams LSB-first; error <= max(lo, (hi − lo) / 2^sparse_bits) per
  chunk; fixed size per element count (C=4096, k=64, 2 bits: 120 B per 4096 elements,
  1/136.5 of fp32); needs error feedback.

Measured speeds and ratios: ``experiments/bench_codecs.py``.

The codec classes import torch; this package loads them on first use (``get_codec`` or
an attribute such as ``dtrain.codecs.Codec``), so ``dtrain.codecs.config`` (names and
:class:`CodecConfig`) stays importable without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dtrain.codecs.config import CODEC_NAMES, ZSTD_SUFFIX, CodecConfig

if TYPE_CHECKING:
    from dtrain.codecs.base import HEADER_BYTES, Codec, PayloadHeader, peek_header

__all__ = [
    "CODEC_NAMES",
    "HEADER_BYTES",
    "ZSTD_SUFFIX",
    "Codec",
    "CodecConfig",
    "codec_class",
    "PayloadHeader",
    "get_codec",
    "peek_header",
]

#: base codec name -> "module:class" (imported on first use).
_CLASSES: dict[str, str] = {
    "fp32": "floats:Fp32Codec",
    "bf16": "floats:Bf16Codec",
    "fp16": "floats:Fp16Codec",
    "int8": "blockwise:Int8Codec",
    "int4": "blockwise:Int4Codec",
    "topk": "topk:TopKCodec",
    "sparseloco": "sparse:SparseLoCoCodec",
}
_BASE_NAMES = ("HEADER_BYTES", "Codec", "PayloadHeader", "peek_header")


def __getattr__(name: str) -> Any:
    if name in _BASE_NAMES:
        return getattr(importlib.import_module("dtrain.codecs.base"), name)
    raise AttributeError(f"module 'dtrain.codecs' has no attribute {name!r}")


def codec_class(base_name: str) -> type[Codec]:
    """The codec class for a base name in :data:`CODEC_NAMES` (imports it)."""
    module, cls = _CLASSES[base_name].split(":")
    return getattr(importlib.import_module(f"dtrain.codecs.{module}"), cls)


def get_codec(config: CodecConfig | str) -> Codec:
    """Build the codec for ``config``.

    Args:
        config: a :class:`CodecConfig`, or a codec name as shorthand for
            ``CodecConfig(name=name)`` (e.g. ``"int8+zstd"``).

    Returns:
        A :class:`Codec`; cheap to build, immutable, thread-safe.

    Raises:
        ValueError: unknown codec name (the message names "codec" and lists the allowed
            names) or an invalid config field.
    """
    if isinstance(config, str):
        config = CodecConfig(name=config)
    if not isinstance(config, CodecConfig):
        raise ValueError(
            f"codec config must be a CodecConfig or a codec name, got {type(config).__name__}; "
            f"allowed codec names: {', '.join(CODEC_NAMES)} (each optionally {ZSTD_SUFFIX})"
        )
    return codec_class(config.base_name)(config)
