"""Codec.encode_chunks: one pass per bucket gives the bytes of one encode per range."""

from __future__ import annotations

import pytest
import torch

from dtrain.codecs import CodecConfig, get_codec


@pytest.mark.parametrize("name", ["int8", "int4", "fp32", "bf16", "int8+zstd"])
@pytest.mark.parametrize("numel", [5 * 1280, 7 * 1280 + 333, 1000])
def test_encode_chunks_equals_encode_per_range(name: str, numel: int) -> None:
    codec = get_codec(name)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    chunks = [(o, min(1280, numel - o)) for o in range(0, numel, 1280)]
    assert codec.encode_chunks(x, chunks) == [codec.encode(x[o : o + n]) for o, n in chunks]


def test_unaligned_ranges_fall_back_to_one_encode_each() -> None:
    codec = get_codec(CodecConfig(name="int8", block_size=256))
    x = torch.randn(1000)
    chunks = [(0, 300), (300, 700)]  # 300 is not a multiple of the block size
    assert codec.encode_chunks(x, chunks) == [codec.encode(x[:300]), codec.encode(x[300:])]


def test_stochastic_rounding_chunks_decode_within_the_bound() -> None:
    codec = get_codec(CodecConfig(name="int8", stochastic_rounding=True))
    x = torch.randn(4 * 1280)
    chunks = [(o, 1280) for o in range(0, x.numel(), 1280)]
    for (o, n), p in zip(chunks, codec.encode_chunks(x, chunks, generator=torch.Generator().manual_seed(0))):
        err = (codec.decode(p, numel=n) - x[o : o + n]).abs().max()
        assert float(err) <= codec.max_error(x[o : o + n])
