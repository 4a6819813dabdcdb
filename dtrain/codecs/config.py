"""CodecConfig: which codec to use and its parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "CODEC_NAMES",
    "ZSTD_SUFFIX",
    "MAX_BLOCK_SIZE",
    "NEEDS_ERROR_FEEDBACK",
    "SPARSE_CHUNKS",
    "CodecConfig",
    "CodecName",
]

#: Every accepted ``CodecConfig.name``: a base codec, optionally with ``+zstd``. This
#: module imports no torch, so the command line checks names without loading it.
CodecName = Literal[
    "fp32",
    "bf16",
    "fp16",
    "int8",
    "int4",
    "topk",
    "sparseloco",
    "fp32+zstd",
    "bf16+zstd",
    "fp16+zstd",
    "int8+zstd",
    "int4+zstd",
    "topk+zstd",
    "sparseloco+zstd",
]
ZSTD_SUFFIX = "+zstd"
CODEC_NAMES: tuple[str, ...] = tuple(n for n in get_args(CodecName) if not n.endswith(ZSTD_SUFFIX))
#: Base codecs that drop information by design and need error feedback (the codec
#: classes' ``needs_error_feedback``; tests/unit/test_config.py checks they agree).
NEEDS_ERROR_FEEDBACK: tuple[str, ...] = ("topk", "sparseloco")
MAX_BLOCK_SIZE = 1 << 24
#: Chunk sizes ``sparseloco`` accepts: powers of two, so a chunk-local index uses all of its
#: log2(chunk) bits.
SPARSE_CHUNKS: tuple[int, ...] = tuple(1 << e for e in range(4, 17))


def _bad_int(v: object) -> bool:
    return isinstance(v, bool) or not isinstance(v, int)


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """Which codec to use and its parameters.

    Attributes:
        name: the codec: fp32, bf16, fp16, int8, int4, topk or sparseloco, optionally with the
            ``"+zstd"`` suffix (``"int8+zstd"``); the datagram data path takes fixed-size codecs
            only (no ``+zstd``, no topk; sparseloco is fixed-size and allowed).
        zstd_level: zstd compression level, 1..22 (1-3 for the hot path).
        block_size: elements per absmax scale block for int8/int4; even, in
            8..2**24. Smaller blocks: tighter error, more scale overhead
            (4 / block_size bytes per element).
        topk_fraction: fraction of elements kept by topk, in (0, 1]; k =
            ceil(topk_fraction * numel), at least 1.
        sparse_chunk: sparseloco: elements per top-k chunk (SparseLoCo's chunk, 4096 in
            arXiv 2508.15706), a power of two in 16..65536; chunk-local indices take
            log2(sparse_chunk) bits.
        sparse_k: sparseloco: entries kept per chunk (the paper's k; density k / chunk:
            64 / 4096 = 1.56 %), an int in 1..sparse_chunk - 1.
        sparse_bits: sparseloco: bits per kept value (the paper's Q: 2 bits, 4 levels),
            an int in 2..8: a sign bit and sparse_bits - 1 magnitude bits.
        stochastic_rounding: int8/int4 only. Round up with probability equal to the
            fractional part, so that E[decode(encode(x))] = x (unbiased; error < one
            quantization step instead of half a step). Pass a seeded
            ``torch.Generator`` to ``Codec.encode`` to make it reproducible.
        max_decoded_bytes: hard bound, in bytes, on any decoded (decompressed) body;
            decode refuses a larger one before allocating it.

    Raises:
        ValueError: a field is out of range; the message names the field and the
            allowed values.
    """

    name: CodecName = "fp32"
    zstd_level: int = 3
    block_size: int = 256
    topk_fraction: float = 0.01
    sparse_chunk: int = 4096
    sparse_k: int = 64
    sparse_bits: int = 2
    stochastic_rounding: bool = False
    max_decoded_bytes: int = 1 << 31

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.base_name not in CODEC_NAMES:
            raise ValueError(
                f"codec name {self.name!r} is not valid: allowed codec names are "
                f"{', '.join(CODEC_NAMES)}, each optionally with the suffix {ZSTD_SUFFIX!r}"
            )
        if _bad_int(self.zstd_level) or not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be an int in 1..22, got {self.zstd_level!r}")
        if _bad_int(self.block_size) or not 8 <= self.block_size <= MAX_BLOCK_SIZE or self.block_size % 2:
            raise ValueError(f"block_size must be an even int in 8..{MAX_BLOCK_SIZE}, got {self.block_size!r}")
        f = self.topk_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not 0.0 < f <= 1.0:
            raise ValueError(f"topk_fraction must be a number in (0, 1], got {f!r}")
        if _bad_int(self.sparse_chunk) or self.sparse_chunk not in SPARSE_CHUNKS:
            raise ValueError(f"sparse_chunk must be a power of two in 16..65536, got {self.sparse_chunk!r}")
        if _bad_int(self.sparse_k) or not 1 <= self.sparse_k < self.sparse_chunk:
            raise ValueError(
                f"sparse_k must be an int in 1..sparse_chunk - 1 = {self.sparse_chunk - 1}, got {self.sparse_k!r}"
            )
        if _bad_int(self.sparse_bits) or not 2 <= self.sparse_bits <= 8:
            raise ValueError(f"sparse_bits must be an int in 2..8, got {self.sparse_bits!r}")
        defaults = {"sparse_chunk": 4096, "sparse_k": 64, "sparse_bits": 2}
        set_here = [k for k, v in defaults.items() if getattr(self, k) != v]
        if set_here and self.base_name != "sparseloco":
            verb = "applies" if len(set_here) == 1 else "apply"
            raise ValueError(
                f"{', '.join(set_here)} {verb} to codec sparseloco only, not codec {self.base_name!r} (the codec "
                "these settings belong to: the contributions' --codec or the means' --broadcast-codec): set that "
                "codec's name to sparseloco (or sparseloco+zstd) or leave them at their defaults"
            )
        if self.topk_fraction != 0.01 and self.base_name != "topk":
            raise ValueError(
                f"topk_fraction applies to codec topk only, not codec {self.base_name!r}: "
                "set the codec name to topk or leave topk_fraction at its default (0.01)"
            )
        if self.block_size != 256 and self.base_name not in ("int8", "int4"):
            raise ValueError(
                f"block_size applies to codecs int8 and int4 only, not codec {self.base_name!r} (the codec it "
                "belongs to: the contributions' --codec or the means' --broadcast-codec): set that codec's name "
                "to int8 or int4 or leave block_size at its default (256)"
            )
        if not isinstance(self.stochastic_rounding, bool):
            raise ValueError(f"stochastic_rounding must be a bool, got {self.stochastic_rounding!r}")
        if self.stochastic_rounding and self.base_name not in ("int8", "int4"):
            raise ValueError(f"stochastic_rounding applies to int8/int4 only, not codec {self.base_name!r}")
        if _bad_int(self.max_decoded_bytes) or self.max_decoded_bytes < 1:
            raise ValueError(f"max_decoded_bytes must be a positive int, got {self.max_decoded_bytes!r}")

    @property
    def base_name(self) -> str:
        """The codec name without the ``"+zstd"`` suffix."""
        if isinstance(self.name, str) and self.name.endswith(ZSTD_SUFFIX):
            return self.name[: -len(ZSTD_SUFFIX)]
        return self.name

    @property
    def needs_error_feedback(self) -> bool:
        """Whether this codec requires error feedback (``topk``, ``sparseloco``)."""
        return self.base_name in NEEDS_ERROR_FEEDBACK

    @property
    def zstd(self) -> bool:
        """Whether the zstd stage is on."""
        return self.name.endswith(ZSTD_SUFFIX)
