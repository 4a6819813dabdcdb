"""Unit tests for dtrain.codecs: round trips, error bounds, malformed payloads, zstd bombs."""

from __future__ import annotations

import math
import struct
import tracemalloc
import zlib

import pytest
import torch
import zstandard

from dtrain.codecs import CODEC_NAMES, HEADER_BYTES, CodecConfig, get_codec, peek_header
from dtrain.errors import CodecError

pytestmark = pytest.mark.timeout(30)

ALL_NAMES = [n + z for n in CODEC_NAMES for z in ("", "+zstd")]


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "randn": torch.randn(1000, generator=g),
        "odd_len_not_block_multiple": torch.randn(1001, generator=g),
        "empty": torch.empty(0),
        "zeros": torch.zeros(300),
        "constant": torch.full((257,), -2.5),
        "one": torch.tensor([0.75]),
        "huge": torch.randn(513, generator=g) * 1e30,
        "tiny": torch.randn(513, generator=g) * 1e-30,
        "mixed_scales": torch.cat([torch.randn(256, generator=g) * 1e-20, torch.randn(256, generator=g) * 1e20]),
        "fp32_max": torch.tensor([3.4028234e38, -3.4028234e38, 1.0, 0.0]),
        "bf16": torch.randn(600, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(600, generator=g).to(torch.float16),
        "2d": torch.randn(20, 30, generator=g),
    }


CASES = _cases()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", ALL_NAMES)
def test_round_trip_within_stated_bound(name: str, case: str) -> None:
    codec = get_codec(name)
    x = CASES[case]
    payload = codec.encode(x)
    assert isinstance(payload, bytes)
    y = codec.decode(payload, numel=x.numel())
    assert y.dtype == torch.float32
    assert y.shape == (x.numel(),)
    assert torch.isfinite(y).all()
    bound = codec.max_error(x)
    ref = x.reshape(-1).double()
    err = (y.double() - ref).abs().max().item() if x.numel() else 0.0
    assert err <= bound, f"{name} on {case}: error {err} > bound {bound}"
    if codec.lossless:
        assert bound == 0.0
        assert torch.equal(y, x.reshape(-1).float())
    if case in ("zeros", "empty"):
        assert torch.equal(y, torch.zeros(x.numel()))


@pytest.mark.parametrize("name", ALL_NAMES)
def test_decode_returns_new_tensor_and_does_not_touch_input(name: str) -> None:
    codec = get_codec(name)
    x = torch.randn(512)
    before = x.clone()
    y = codec.decode(codec.encode(x), numel=512)
    assert torch.equal(x, before)
    y.add_(1.0)  # writable and not aliasing x
    assert torch.equal(x, before)


def test_flags_and_names() -> None:
    assert CODEC_NAMES == ("fp32", "bf16", "fp16", "int8", "int4", "topk")
    for name in ALL_NAMES:
        c = get_codec(name)
        assert c.name == name
        assert c.lossless == name.startswith("fp32")
        assert c.needs_error_feedback == name.startswith("topk")
    assert get_codec(CodecConfig(name="int8+zstd", zstd_level=1)).name == "int8+zstd"


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4", "topk"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(name: str, bad: float) -> None:
    x = torch.randn(600)
    x[417] = bad
    with pytest.raises(CodecError, match="non-finite"):
        get_codec(name).encode(x)


def test_bad_input_types() -> None:
    with pytest.raises(CodecError, match="dtype"):
        get_codec("int8").encode(torch.arange(10))
    with pytest.raises(CodecError, match="dtype"):
        get_codec("fp32").encode(torch.randn(10, dtype=torch.float64))
    with pytest.raises(CodecError, match="Tensor"):
        get_codec("fp32").encode([1.0, 2.0])  # type: ignore[arg-type]


# ------------------------------------------------------------- bad payloads
@pytest.mark.parametrize("name", ALL_NAMES)
def test_truncated_payload(name: str) -> None:
    codec = get_codec(name)
    payload = codec.encode(torch.randn(1000))
    with pytest.raises(CodecError, match="truncated payload: need 32 bytes"):
        codec.decode(payload[:20], numel=1000)
    with pytest.raises(CodecError, match=rf"truncated payload: need {len(payload)} bytes, have {len(payload) - 24}"):
        codec.decode(payload[:-24], numel=1000)
    with pytest.raises(CodecError, match="trailing bytes"):
        codec.decode(payload + b"\0", numel=1000)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_corrupted_body_is_detected(name: str) -> None:
    codec = get_codec(name)
    payload = bytearray(codec.encode(torch.randn(1000)))
    payload[HEADER_BYTES + 7] ^= 0x10
    with pytest.raises(CodecError, match="checksum mismatch"):
        codec.decode(bytes(payload), numel=1000)


def test_bad_magic_and_version() -> None:
    codec = get_codec("int8")
    payload = bytearray(codec.encode(torch.randn(100)))
    bad = bytearray(payload)
    bad[0:4] = b"XXXX"
    with pytest.raises(CodecError, match="bad magic"):
        codec.decode(bytes(bad), numel=100)
    bad = bytearray(payload)
    bad[4] = 9
    with pytest.raises(CodecError, match="format version: payload says 9, expected 1"):
        codec.decode(bytes(bad), numel=100)


def test_mislabeled_payloads() -> None:
    x = torch.randn(100)
    with pytest.raises(CodecError, match="codec mismatch: payload says int4, expected int8"):
        get_codec("int8").decode(get_codec("int4").encode(x), numel=100)
    with pytest.raises(CodecError, match="zstd flag mismatch"):
        get_codec("int8").decode(get_codec("int8+zstd").encode(x), numel=100)
    with pytest.raises(CodecError, match="block size mismatch: header 128, expected 256"):
        get_codec("int8").decode(get_codec(CodecConfig(name="int8", block_size=128)).encode(x), numel=100)
    with pytest.raises(CodecError, match="k mismatch: header 10, expected 1"):
        get_codec("topk").decode(get_codec(CodecConfig(name="topk", topk_fraction=0.1)).encode(x), numel=100)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_wrong_numel(name: str) -> None:
    codec = get_codec(name)
    with pytest.raises(CodecError, match="element count mismatch: header 100, expected 64"):
        codec.decode(codec.encode(torch.randn(100)), numel=64)


def _with_header(payload: bytes, **fields: int) -> bytes:
    """Rewrite header fields and fix the crc so only the named field is wrong."""
    names = ["magic", "version", "codec", "zstd", "dtype", "param", "numel", "body", "crc"]
    fmt = struct.Struct("<4sBBBBIQQI")
    vals = dict(zip(names, fmt.unpack_from(payload, 0)))
    vals.update(fields)
    return fmt.pack(*[vals[n] for n in names]) + payload[HEADER_BYTES:]


def test_consistent_lies_in_header_are_caught() -> None:
    codec = get_codec("int8")
    payload = codec.encode(torch.randn(100))
    # numel claims match the caller but not the body length
    with pytest.raises(CodecError, match="body length mismatch"):
        codec.decode(_with_header(payload, numel=64), numel=64)
    with pytest.raises(CodecError, match="unknown codec id 99"):
        codec.decode(_with_header(payload, codec=99), numel=100)
    with pytest.raises(CodecError, match="decoded body of .* exceeds bound max_decoded_bytes=1000"):
        get_codec(CodecConfig(name="fp32", max_decoded_bytes=1000)).decode(
            get_codec("fp32").encode(torch.randn(300)), numel=300
        )


def test_corrupted_values_with_valid_crc_are_refused() -> None:
    """A peer can send a well-formed payload with garbage values; decode must not emit NaN."""
    codec = get_codec("fp32")
    payload = bytearray(codec.encode(torch.randn(10)))
    payload[HEADER_BYTES : HEADER_BYTES + 4] = struct.pack("<f", float("nan"))
    body = bytes(payload[HEADER_BYTES:])
    fixed = _with_header(bytes(payload), crc=zlib.crc32(body))
    with pytest.raises(CodecError, match="NaN or inf"):
        codec.decode(fixed, numel=10)
    codec8 = get_codec("int8")
    payload = bytearray(codec8.encode(torch.randn(10)))
    payload[HEADER_BYTES : HEADER_BYTES + 4] = struct.pack("<f", float("inf"))
    fixed = _with_header(bytes(payload), crc=zlib.crc32(bytes(payload[HEADER_BYTES:])))
    with pytest.raises(CodecError, match="block scales"):
        codec8.decode(fixed, numel=10)


# ------------------------------------------------------------------ zstd bomb
def _frame_claiming(size: int, content: bytes) -> bytes:
    """A zstd frame whose header declares ``size`` bytes of content (8-byte FCS field,
    single segment) followed by one raw last block holding ``content``."""
    descriptor = 0b1110_0000  # FCS field 8 bytes, single-segment, no checksum, no dict
    block_header = (1 | (0 << 1) | (len(content) << 3)).to_bytes(3, "little")
    return b"\x28\xb5\x2f\xfd" + bytes([descriptor]) + size.to_bytes(8, "little") + block_header + content


def _zstd_payload(codec_name: str, numel: int, frame: bytes) -> bytes:
    ok = get_codec(codec_name).encode(torch.zeros(numel))
    return _with_header(ok[:HEADER_BYTES] + frame, body=len(frame), crc=zlib.crc32(frame))


def test_zstd_bomb_is_refused_without_allocating() -> None:
    claimed = 10 * 1024**3
    frame = _frame_claiming(claimed, b"\0" * 64)
    assert zstandard.frame_content_size(frame) == claimed
    codec = get_codec("fp32+zstd")
    payload = _zstd_payload("fp32+zstd", 2048, frame)
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match=f"zstd frame claims {claimed} bytes, bound is 8192"):
            codec.decode(payload, numel=2048)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak traced allocation {peak} bytes"


def test_zstd_frame_without_content_size_or_short_is_refused() -> None:
    codec = get_codec("int8+zstd")
    cctx = zstandard.ZstdCompressor(write_content_size=False)
    raw = bytes(4 + 100)  # one block scale + 100 codes
    frame = cctx.compress(raw)
    assert zstandard.frame_content_size(frame) == -1
    with pytest.raises(CodecError, match="does not declare its content size"):
        codec.decode(_zstd_payload("int8+zstd", 100, frame), numel=100)
    short = zstandard.ZstdCompressor().compress(raw[:-1])
    with pytest.raises(CodecError, match="zstd frame claims 103 bytes, expected 104"):
        codec.decode(_zstd_payload("int8+zstd", 100, short), numel=100)
    garbage = b"\x28\xb5\x2f\xfd" + b"\xff" * 20
    with pytest.raises(CodecError, match="zstd"):
        codec.decode(_zstd_payload("int8+zstd", 100, garbage), numel=100)


def test_zstd_frame_lying_about_size_with_small_body_is_refused() -> None:
    """Declared size equals the expected size, but the content is shorter: zstd must fail."""
    codec = get_codec("fp32+zstd")
    frame = _frame_claiming(400, b"\0" * 10)
    with pytest.raises(CodecError, match="corrupted zstd frame"):
        codec.decode(_zstd_payload("fp32+zstd", 100, frame), numel=100)


def test_peek_header() -> None:
    h = peek_header(get_codec("int4+zstd").encode(torch.randn(50).half()))
    assert (h.codec, h.zstd, h.dtype, h.param, h.numel) == ("int4", True, torch.float16, 256, 50)


# ----------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"name": "int7"}, "codec"),
        ({"name": "int8+lz4"}, "codec"),
        ({"name": "zstd"}, "codec"),
        ({"zstd_level": 0}, "zstd_level"),
        ({"zstd_level": 23}, "zstd_level"),
        ({"zstd_level": 2.0}, "zstd_level"),
        ({"block_size": 4}, "block_size"),
        ({"block_size": 255}, "block_size"),
        ({"topk_fraction": 0.0}, "topk_fraction"),
        ({"topk_fraction": 1.5}, "topk_fraction"),
        ({"topk_fraction": float("nan")}, "topk_fraction"),
        ({"stochastic_rounding": 1}, "stochastic_rounding"),
        ({"name": "fp16", "stochastic_rounding": True}, "stochastic_rounding"),
        ({"max_decoded_bytes": 0}, "max_decoded_bytes"),
    ],
)
def test_bad_config_raises_value_error_naming_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CodecConfig(**kwargs)


def test_get_codec_unknown_name_lists_allowed() -> None:
    with pytest.raises(ValueError, match=r"codec.*fp32, bf16, fp16, int8, int4, topk"):
        get_codec("gzip")


def test_max_encoded_bytes_is_an_upper_bound() -> None:
    x = torch.randn(5000)
    for name in ALL_NAMES:
        c = get_codec(name)
        assert len(c.encode(x)) <= c.max_encoded_bytes(5000)
    assert get_codec("fp32").max_encoded_bytes(10) == HEADER_BYTES + 40
    assert math.isclose(get_codec("int8").max_encoded_bytes(256 * 100) / (256 * 100 * 4), (256 + 4) / 1024, rel_tol=1e-2)
