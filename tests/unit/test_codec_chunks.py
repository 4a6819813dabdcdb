"""Codec.encode_chunks: one pass per bucket gives the bytes of one encode per range."""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np
import pytest
import torch

from dtrain.codecs import CodecConfig, get_codec, native
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


def test_compiled_payload_rows_are_sealed_and_checked_like_the_python_rows(monkeypatch) -> None:
    """``Kernels.seal_rows`` writes the header and crc32 the Python rows write (zlib's crc32, via
    zlib-ng's C symbol), and ``Kernels.check_headers`` names the first row whose magic, codec,
    dtype byte, numel field or crc32 is wrong; without the C symbol the Python rows run."""
    kern = native.kernels()
    if kern is None:
        if os.environ.get("DTRAIN_NATIVE_REQUIRED"):
            pytest.fail("the compiled kernels did not build")
        pytest.skip("no compiler: the compiled kernels are unavailable")
    assert kern.rows, "zlib-ng's zng_crc32 is exported by the zlib_ng extension"
    codec = get_codec("int8")
    x = torch.randn(8 * 1280)
    ranges = [(o, 1280) for o in range(0, x.numel(), 1280)]
    sealed = codec.encode_chunks(x, ranges)
    assert all(zlib.crc32(p[HEADER_BYTES:]).to_bytes(4, "little") == p[28:32] for p in sealed)
    monkeypatch.setattr(kern, "_crc32", None)  # as where the symbol is not exported
    assert not kern.rows
    python_rows = codec.encode_chunks(x, ranges)
    assert python_rows == sealed
    monkeypatch.undo()

    prefix = codec._header_prefix(1280)
    rows = np.frombuffer(bytearray().join(sealed), dtype=np.uint8).reshape(len(sealed), -1).copy()
    ok = np.zeros(256, dtype=np.uint8)
    ok[[1, 2, 3]] = 1  # float32, bfloat16, float16
    assert kern.check_headers(rows, prefix, ok) == -1
    for byte, row in ((0, 5), (6, 2), (7, 3), (16, 6), (40, 1), (31, 7)):  # magic, zstd flag, dtype, numel, body, crc
        bad = rows.copy()
        bad[row, byte] ^= 0x40
        assert kern.check_headers(bad, prefix, ok) == row, byte
        bad[row - 1, byte] ^= 0x40
        assert kern.check_headers(bad, prefix, ok) == row - 1, byte
    bf16 = rows.copy()
    bf16[:, 7] = 2  # another known dtype of the original tensor: informational, accepted
    assert kern.check_headers(bf16, prefix, ok) == -1
    bad = rows.copy()
    bad[4, 7] = 9
    assert kern.check_headers(bad, prefix, ok) == 4


def test_per_chunk_list_answers_a_tuple_asked_before_by_identity_and_anything_else_afresh() -> None:
    """A bucket's ``chunks`` tuple is asked the same questions every round: answered by
    identity (no rehash of its pairs); an equal tuple gets the same answer, and a list (which
    may change) or an unhashable element is answered afresh each time."""
    from dtrain.codecs.base import per_chunk_list

    calls = []

    @per_chunk_list
    def total(chunks, scale):
        calls.append(chunks)
        return sum(n for _, n in chunks) * scale

    ch = tuple((o * 4, 4) for o in range(100))
    assert total(ch, 2) == 800 and total(ch, 2) == 800 and total(ch, 3) == 1200
    assert len(calls) == 2  # once per distinct (chunks, args)
    assert total(tuple(list(ch)), 2) == 800 and len(calls) == 2  # an equal tuple: remembered by value
    lst = [list(p) for p in ch[:3]]
    assert total(lst, 1) == 12
    lst[0][1] = 10
    assert total(lst, 1) == 18  # unhashable: not remembered
    grown = list(ch[:2])
    assert total(grown, 1) == 8
    grown.append((8, 4))
    assert total(grown, 1) == 12  # a list asked again after it changed: its new value

    @per_chunk_list
    def first_plus(chunks, opts):
        return chunks[0][1] + len(opts)

    opts = [1, 2]
    assert first_plus(ch, opts) == 6  # an unhashable argument: answered, not remembered
    opts.append(3)
    assert first_plus(ch, opts) == 7
