"""Unit tests for dtrain.codecs: round trips, error bounds, malformed payloads, zstd bombs."""

from __future__ import annotations

import io
import math
import struct
import tracemalloc
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtrain.codecs import CODEC_NAMES, HEADER_BYTES, CodecConfig, get_codec, peek_header
from dtrain.errors import CodecError, DecodeBoundExceeded

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
    assert CODEC_NAMES == ("fp32", "bf16", "fp16", "int8", "int4", "topk", "sparseloco")
    for name in ALL_NAMES:
        c = get_codec(name)
        assert c.name == name
        assert c.lossless == name.startswith("fp32")
        assert c.needs_error_feedback == name.startswith(("topk", "sparseloco"))
    assert get_codec(CodecConfig(name="int8+zstd", zstd_level=1)).name == "int8+zstd"


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(name: str, bad: float) -> None:
    x = torch.randn(600)
    x[417] = bad
    with pytest.raises(CodecError, match="non-finite input: 1 of 600 elements .* first at index 417"):
        get_codec(name).encode(x)
    with pytest.raises(CodecError, match="non-finite"):
        get_codec(name).encode(x.to(torch.bfloat16))


def test_bad_numel_argument() -> None:
    payload = get_codec("int8").encode(torch.randn(10))
    with pytest.raises(CodecError, match="numel"):
        get_codec("int8").decode(payload, numel=-1)


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
    with pytest.raises(DecodeBoundExceeded, match="decoded body of .* exceeds bound max_decoded_bytes=1000"):
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
    """zstandard's decompress() allocates the declared content size up front as a Python
    bytes object, which tracemalloc sees (a naive call on this frame peaks at 10 GiB)."""
    claimed = 10 * 1024**3
    frame = _frame_claiming(claimed, b"\0" * 64)
    assert zstandard.frame_content_size(frame) == claimed
    codec = get_codec("fp32+zstd")
    payload = _zstd_payload("fp32+zstd", 2048, frame)
    tracemalloc.start()
    try:
        with pytest.raises(DecodeBoundExceeded, match=f"zstd frame claims {claimed} bytes, bound is 8192"):
            codec.decode(payload, numel=2048)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak traced allocation {peak} bytes"


def _streaming_frames(raw: bytes) -> dict[str, bytes]:
    """``raw`` compressed as other zstd implementations write it: no content size in
    the frame header (a streaming compressor does not know it up front)."""
    obj = zstandard.ZstdCompressor(level=3).compressobj()
    by_obj = obj.compress(raw[: len(raw) // 2]) + obj.compress(raw[len(raw) // 2 :]) + obj.flush()
    sink = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(sink, closefd=False) as w:
        for i in range(0, len(raw), 1000):
            w.write(raw[i : i + 1000])
    frames = {
        "compressobj": by_obj,
        "stream_writer": sink.getvalue(),
        "no_size": zstandard.ZstdCompressor(write_content_size=False).compress(raw),
    }
    for name, frame in frames.items():
        assert zstandard.frame_content_size(frame) == -1, name
    return frames


@pytest.mark.parametrize("name", ["int8+zstd", "fp32+zstd", "topk+zstd"])
def test_streaming_zstd_frame_of_another_implementation_decodes(name: str) -> None:
    """A valid frame without its content size is decoded (within the bound), not refused."""
    codec = get_codec(name)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(7))
    own = codec.encode(x)
    raw = zstandard.ZstdDecompressor().decompress(own[HEADER_BYTES:])
    want = codec.decode(own, numel=5000)
    for how, frame in _streaming_frames(raw).items():
        got = codec.decode(_with_header(own[:HEADER_BYTES] + frame, body=len(frame), crc=zlib.crc32(frame)), numel=5000)
        assert torch.equal(got, want), how


def test_streaming_zstd_frame_past_its_bound_is_refused_as_such() -> None:
    """A frame without a content size that yields more than the expected body raises
    DecodeBoundExceeded (a decompression bomb: RESOURCE_EXHAUSTED at an owner) after
    allocating no more than the expected size; short or corrupted ones a plain CodecError."""
    codec = get_codec("fp32+zstd")
    numel = 2048  # body 8192 bytes
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64 << 20))
    assert len(bomb) < 8192 and zstandard.frame_content_size(bomb) == -1
    tracemalloc.start()
    try:
        with pytest.raises(DecodeBoundExceeded, match="decompresses past its bound of 8192 bytes"):
            codec.decode(_zstd_payload("fp32+zstd", numel, bomb), numel=numel)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak traced allocation {peak} bytes"
    one_more = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(8193))
    with pytest.raises(DecodeBoundExceeded):
        codec.decode(_zstd_payload("fp32+zstd", numel, one_more), numel=numel)
    short = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(8191))
    with pytest.raises(CodecError, match="decompressed to 8191 bytes, expected 8192") as info:
        codec.decode(_zstd_payload("fp32+zstd", numel, short), numel=numel)
    assert not isinstance(info.value, DecodeBoundExceeded)
    truncated = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(range(256)) * 32)[:-4]
    with pytest.raises(CodecError, match="corrupted zstd frame") as info:
        codec.decode(_zstd_payload("fp32+zstd", numel, truncated), numel=numel)
    assert not isinstance(info.value, DecodeBoundExceeded)


def test_zstd_frame_short_or_garbage_is_refused() -> None:
    codec = get_codec("int8+zstd")
    raw = bytes(4 + 100)  # one block scale + 100 codes
    short = zstandard.ZstdCompressor().compress(raw[:-1])
    with pytest.raises(CodecError, match="zstd frame claims 103 bytes, expected 104"):
        codec.decode(_zstd_payload("int8+zstd", 100, short), numel=100)
    long = zstandard.ZstdCompressor().compress(raw + b"\0")
    with pytest.raises(DecodeBoundExceeded, match="zstd frame claims 105 bytes, bound is 104"):
        codec.decode(_zstd_payload("int8+zstd", 100, long), numel=100)
    garbage = b"\x28\xb5\x2f\xfd" + b"\xff" * 20
    with pytest.raises(CodecError, match="zstd") as info:
        codec.decode(_zstd_payload("int8+zstd", 100, garbage), numel=100)
    assert not isinstance(info.value, DecodeBoundExceeded)


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
    assert math.isclose(
        get_codec("int8").max_encoded_bytes(256 * 100) / (256 * 100 * 4), (256 + 4) / 1024, rel_tol=1e-2
    )


# -------------------------------------------------------- stochastic rounding
@pytest.mark.parametrize("base, qmax", [("int8", 127), ("int4", 7)])
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(base: str, qmax: int) -> None:
    """x sits at 0.3 of a quantization step in every block (the first element of each
    block fixes the scale). Round-to-nearest maps it to 0 every time: bias -0.3 step.
    Stochastic rounding: one encode of the block pattern repeated R times gives R
    independent draws per element; each draw's error e has |e| < step and variance
    <= step^2 / 4, so the mean over R draws has std <= step / (2 sqrt(R)); we allow 6
    std per element (n elements: P(any fails) < n * 2e-9) and 6 std / sqrt(n) overall."""
    bs, reps = 64, 4000
    step = 1.0 / qmax
    g = torch.Generator().manual_seed(7)
    block = torch.full((bs,), 0.3 * step) * torch.where(torch.rand(bs, generator=g) < 0.5, -1.0, 1.0)
    block[0] = 1.0  # scale = 1 / qmax exactly (up to fp32 rounding)
    pattern = torch.cat([block, block * 0.5])  # two blocks with different scales
    x = pattern.repeat(reps)
    n = pattern.numel()
    steps = torch.cat([torch.full((bs,), step), torch.full((bs,), 0.5 * step)])

    sr = get_codec(CodecConfig(name=base, block_size=bs, stochastic_rounding=True))
    y = sr.decode(sr.encode(x, generator=torch.Generator().manual_seed(123)), numel=x.numel())
    mean_err = (y.double() - x.double()).view(reps, n).mean(0)
    per_elem_tol = 6 * steps.double() / (2 * math.sqrt(reps))
    assert (mean_err.abs() <= per_elem_tol).all(), float((mean_err.abs() / per_elem_tol).max())
    assert abs(float(mean_err[1:bs].mean())) <= 6 * step / (2 * math.sqrt(reps * (bs - 1)))
    assert (y - x).abs().max() <= sr.max_error(x)

    rtn = get_codec(CodecConfig(name=base, block_size=bs))
    y_rtn = rtn.decode(rtn.encode(x), numel=x.numel())
    bias = (y_rtn.double() - x.double()).view(reps, n).mean(0)
    # every non-scale element is biased by 0.3 step towards zero, 5x beyond the SR bound
    assert torch.allclose(bias[1:bs].abs(), torch.full((bs - 1,), 0.3 * step, dtype=torch.float64), rtol=1e-3)
    assert (bias[1:bs].abs() > 5 * per_elem_tol[1:bs]).all()


def test_stochastic_rounding_is_reproducible_with_a_generator() -> None:
    codec = get_codec(CodecConfig(name="int8+zstd", stochastic_rounding=True))
    x = torch.randn(10_000)
    a = codec.encode(x, generator=torch.Generator().manual_seed(5))
    b = codec.encode(x, generator=torch.Generator().manual_seed(5))
    c = codec.encode(x, generator=torch.Generator().manual_seed(6))
    assert a == b
    assert a != c
    # deterministic rounding ignores the generator
    plain = get_codec("int8")
    assert plain.encode(x, generator=torch.Generator().manual_seed(1)) == plain.encode(x)


# ---------------------------------------------------------- property tests
@given(
    values=st.lists(
        st.floats(allow_nan=False, allow_infinity=False, width=32),
        min_size=0,
        max_size=300,
    ),
    exponent=st.integers(min_value=-30, max_value=30),
    base=st.sampled_from(["int8", "int4"]),
    block_size=st.sampled_from([8, 10, 64, 256]),
    stochastic=st.booleans(),
    zstd=st.booleans(),
)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_blockwise_error_bound_property(
    values: list[float], exponent: int, base: str, block_size: int, stochastic: bool, zstd: bool
) -> None:
    x = torch.tensor(values, dtype=torch.float32) * (10.0**exponent)
    x = torch.nan_to_num(x, posinf=3e38, neginf=-3e38)  # scaling may overflow fp32
    name = base + ("+zstd" if zstd else "")
    codec = get_codec(CodecConfig(name=name, block_size=block_size, stochastic_rounding=stochastic))
    y = codec.decode(codec.encode(x, generator=torch.Generator().manual_seed(0)), numel=x.numel())
    assert y.dtype == torch.float32 and y.shape == (x.numel(),)
    assert torch.isfinite(y).all()
    err = (y.double() - x.double()).abs()
    assert (err <= codec.max_error(x)).all()
    # the per-block bound too: half a step (a full step with stochastic rounding)
    qmax = 127 if base == "int8" else 7
    for s in range(0, x.numel(), block_size):
        blk = x[s : s + block_size].double()
        step = float(blk.abs().max()) / qmax
        tol = step * (1.0 if stochastic else 0.5) * (1 + 2**-12) + 2.0**-126
        assert float(err[s : s + block_size].max()) <= tol


# ------------------------------------------------------------------- topk
@pytest.mark.parametrize("n, fraction", [(300_000, 0.01), (1 << 20, 0.001), (5000, 0.05), (100, 1.0)])
def test_topk_keeps_exactly_the_largest(n: int, fraction: float) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g)
    codec = get_codec(CodecConfig(name="topk+zstd", topk_fraction=fraction))
    y = codec.decode(codec.encode(x), numel=n)
    k = math.ceil(fraction * n)
    kept = y.nonzero().squeeze(1)
    ref = torch.topk(x.abs(), k).indices.sort().values
    assert torch.equal(kept, ref)
    assert ((y[kept] - x[kept]).abs() <= x[kept].abs() * 2.0**-11 + 1e-30).all()
    assert (y.double() - x.double()).abs().max() <= codec.max_error(x)


def test_topk_with_ties_keeps_exactly_k() -> None:
    x = torch.ones(1 << 19)
    x[::3] = -2.0
    codec = get_codec(CodecConfig(name="topk", topk_fraction=0.01))
    y = codec.decode(codec.encode(x), numel=x.numel())
    k = math.ceil(0.01 * x.numel())
    assert int((y != 0).sum()) == k
    assert (y[y != 0] == -2.0).all()


def test_topk_error_feedback_delivers_everything() -> None:
    """With a residual, every element is eventually sent: after R rounds of the same Δ,
    sum(decoded) + residual == R * Δ (up to fp rounding), and the residual stays bounded."""
    codec = get_codec(CodecConfig(name="topk", topk_fraction=0.05))
    delta = torch.randn(2000, generator=torch.Generator().manual_seed(3))
    residual = torch.zeros_like(delta)
    sent = torch.zeros_like(delta, dtype=torch.float64)
    rounds = 60
    for _ in range(rounds):
        target = delta + residual
        out = codec.decode(codec.encode(target), numel=delta.numel())
        residual = target - out
        sent += out.double()
    assert torch.allclose(sent + residual.double(), rounds * delta.double(), atol=1e-3)
    assert float(residual.abs().max()) < 25 * float(delta.abs().max())
    assert codec.needs_error_feedback


# ------------------------------------------------------------ misc contract
def test_decode_accepts_bytearray_and_memoryview() -> None:
    codec = get_codec("int4+zstd")
    x = torch.randn(999)
    payload = codec.encode(x)
    ref = codec.decode(payload, numel=999)
    assert torch.equal(codec.decode(bytearray(payload), numel=999), ref)
    assert torch.equal(codec.decode(memoryview(payload), numel=999), ref)


def test_codec_is_thread_safe() -> None:
    codec = get_codec("int8+zstd")
    inputs = [torch.randn(50_000, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    serial = [codec.encode(x) for x in inputs]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(codec.encode, inputs))
        decoded = list(pool.map(lambda p: codec.decode(p, numel=50_000), parallel))
    assert parallel == serial
    for x, y in zip(inputs, decoded):
        assert (y - x).abs().max() <= codec.max_error(x)


def test_compression_ratios_are_as_documented() -> None:
    x = torch.randn(256 * 64)
    n = x.numel()
    assert len(get_codec("fp32").encode(x)) == HEADER_BYTES + 4 * n
    assert len(get_codec("bf16").encode(x)) == HEADER_BYTES + 2 * n
    assert len(get_codec("fp16").encode(x)) == HEADER_BYTES + 4 + 2 * n
    assert len(get_codec("int8").encode(x)) == HEADER_BYTES + 4 * 64 + n
    assert len(get_codec("int4").encode(x)) == HEADER_BYTES + 4 * 64 + n // 2
    k = math.ceil(0.01 * n)
    assert len(get_codec("topk").encode(x)) == HEADER_BYTES + 4 + 6 * k
