"""Codec.encode_chunks: one pass per bucket gives the bytes of one encode per range."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from dtrain.codecs import CodecConfig, get_codec
from dtrain.codecs.base import HEADER_BYTES, equal_runs
from dtrain.errors import CodecError


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


# ---------------------------------------------------------------- decode_chunks (the batch decode)
def _bucket(numel: int, step: int = 1280) -> list[tuple[int, int]]:
    return [(o, min(step, numel - o)) for o in range(0, numel, step)]


@pytest.mark.parametrize("name", ["int8", "int4", "fp32", "fp16", "bf16", "int8+zstd"])
@pytest.mark.parametrize("numel", [5 * 1280, 7 * 1280 + 333, 1000, 0])
def test_decode_chunks_equals_decode_per_payload_bit_for_bit(name: str, numel: int) -> None:
    codec = get_codec(name)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel + 1)) * 5
    x[: min(numel, 300)] = 0.0  # a zero block (scale 0) among the others
    chunks = _bucket(numel)
    payloads = codec.encode_chunks(x, chunks)
    want = [codec.decode(p, numel=n) for p, (_, n) in zip(payloads, chunks)]
    got = codec.decode_chunks(payloads, [n for _, n in chunks])
    assert got.dtype == torch.float32 and got.numel() == numel
    assert torch.equal(got, torch.cat(want) if want else torch.empty(0))


def test_decode_chunks_refuses_what_decode_refuses_naming_the_problem() -> None:
    codec = get_codec("int8")
    x = torch.randn(6 * 1280)
    chunks = _bucket(x.numel())
    payloads = codec.encode_chunks(x, chunks)
    numels = [n for _, n in chunks]
    bad = bytearray(payloads[3])
    bad[-1] ^= 0xFF  # a body byte: the crc no longer matches
    with pytest.raises(CodecError, match="checksum mismatch"):
        codec.decode_chunks(payloads[:3] + [bytes(bad)] + payloads[4:], numels)
    with pytest.raises(CodecError, match="element count mismatch"):
        codec.decode_chunks(payloads, numels[:-1] + [numels[-1] - 1])
    with pytest.raises(ValueError, match="6 payloads but 5 element counts"):
        codec.decode_chunks(payloads, numels[:-1])


def test_decode_chunks_refuses_forbidden_codes_and_bad_scales_in_a_run() -> None:
    """Payloads that pass the crc but hold a code or a scale the encoder never makes (forged
    with a matching crc): the vectorized pass refuses them as decode does."""
    codec = get_codec("int8")
    x = torch.randn(3 * 1280)
    chunks = _bucket(x.numel())
    payloads = codec.encode_chunks(x, chunks)

    def forged(p: bytes, at: int, value: bytes) -> bytes:
        body = bytearray(p[HEADER_BYTES:])
        body[at : at + len(value)] = value
        h = bytearray(p[:HEADER_BYTES])
        h[-4:] = zlib.crc32(body).to_bytes(4, "little")
        return bytes(h) + bytes(body)

    code_128 = forged(payloads[1], 5 * 4 + 7, b"\x80")  # after the 5 scales: code -128
    nan_scale = forged(payloads[1], 0, struct.pack("<f", float("nan")))
    for bad, what in ((code_128, "-128"), (nan_scale, "scales must be finite")):
        with pytest.raises(CodecError, match=what):
            codec.decode(bad, numel=1280)
        with pytest.raises(CodecError, match=what):
            codec.decode_chunks([payloads[0], bad, payloads[2]], [1280] * 3)


def test_equal_runs() -> None:
    assert equal_runs([]) == []
    assert equal_runs([5]) == [(0, 1)]
    assert equal_runs([5, 5, 5, 2]) == [(0, 3), (3, 4)]
    assert equal_runs(["a", "b", "b", "a"]) == [(0, 1), (1, 3), (3, 4)]
