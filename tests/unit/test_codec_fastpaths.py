"""The vectorized int8/int4 paths (``encode_chunks``' payload rows, ``decode_chunks``' run decode)
against the implementation they replaced, kept here as a reference: byte-identical payloads and
bit-identical decoded values on random and edge-case inputs, and decode's errors on bad runs;
each on the compiled kernels (``kernels.c``) and on the torch path."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

from dtrain.codecs import CodecConfig, get_codec, native
from dtrain.codecs.base import HEADER_BYTES, chunks, np_view, t_view
from dtrain.errors import CodecError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _on_both_paths(kernel_path: str) -> None:
    """Each test runs on the compiled kernels and on the torch path (``tests/conftest.py``)."""


# ------------------------------------------------------------------ the reference (before the fast paths)
class _Reference:
    """The int8/int4 encode_chunks and decode_chunks as they were (quantizer, per-range slicing with
    a header and crc per payload, per-payload header checks), over a codec of the same config."""

    def __init__(self, codec) -> None:
        self.c = codec
        self.bs = codec.config.block_size
        self.qmax = codec.qmax

    def encode_chunks(self, x: torch.Tensor, ranges, generator=None) -> list[bytes]:
        c, bs = self.c, self.bs
        aligned = all(o % bs == 0 and o % 2 == 0 for o, _ in ranges)
        if c._zstd or not aligned or x.dim() != 1 or x.dtype != torch.float32 or len(ranges) < 2:
            return [c.encode(x[o : o + n], generator=generator) for o, n in ranges]
        whole = memoryview(self.encode(x, generator))[HEADER_BYTES:]
        nb = c._num_blocks(x.numel())
        out = []
        for o, n in ranges:
            k0, k1 = o // bs, o // bs + c._num_blocks(n)
            c0, c1 = c._code_range(o, n)
            body = b"".join((whole[4 * k0 : 4 * k1], whole[4 * nb + c0 : 4 * nb + c1]))
            out.append(c._header(n, body) + body)
        return out

    def encode(self, x: torch.Tensor, generator=None) -> bytes:
        c = self.c
        n = x.numel()
        body = np.empty(c._body_bytes(n), dtype=np.uint8)
        if body.size:
            nb = c._num_blocks(n)
            scales = t_view(body, np.float32, nb)
            if c.base == "int8":
                codes = t_view(body, np.int8, n, 4 * nb)
                for s, t, q in self._quantize(x, scales, generator):
                    codes[s:t].copy_(q)
            else:
                packed = t_view(body, np.uint8, (n + 1) // 2, 4 * nb)
                for s, t, q in self._quantize(x, scales, generator):
                    q.add_(8.0)
                    if (t - s) % 2:
                        q = torch.cat([q, q.new_full((1,), 8.0)])
                    pairs = q.view(-1, 2)
                    packed[s // 2 : s // 2 + pairs.shape[0]].copy_(pairs[:, 0] + 16 * pairs[:, 1])
        return c._header(n, body) + body.tobytes()

    def _quantize(self, x, scales, generator):
        n, bs, qmax = x.numel(), self.bs, float(self.qmax)
        step = self.c._step
        scratch = torch.empty(min(step, n))
        noise = torch.empty_like(scratch) if self.c.config.stochastic_rounding else None
        for s, t in chunks(n, step):
            m = t - s
            full = m // bs
            xv = x[s : s + full * bs].view(full, bs)
            tail = x[s + full * bs : t]
            sc = scales[s // bs : s // bs + -(-m // bs)]
            if full:
                torch.maximum(xv.amax(dim=1), xv.amin(dim=1).neg_(), out=sc[:full])
            if tail.numel():
                sc[full] = torch.maximum(tail.max(), tail.min().neg())
            sc.abs_()  # a block of -0.0 only: scale +0 (was -0 before the compiled kernels)
            top = float(sc.max())
            if not top <= 3.5e38:
                raise CodecError("non-finite input")
            absmax = sc.clone() if top > 1e37 else None
            sc.div_(qmax)
            if absmax is not None:
                over = sc * qmax > absmax
                sc.copy_(torch.where(over, torch.nextafter(sc, torch.zeros_like(sc)), sc))
            div = torch.where(sc == 0, 1.0, sc)
            q = scratch[:m]
            if full:
                torch.div(xv, div[:full, None], out=q[: full * bs].view(full, bs))
            if tail.numel():
                torch.div(tail, div[full], out=q[full * bs :])
            if noise is not None:
                q.add_(torch.rand(m, generator=generator, out=noise[:m])).floor_()
            else:
                q.round_()
            yield s, t, q.clamp_(-qmax, qmax)

    def decode(self, payload, numel: int) -> torch.Tensor:
        """Per payload: the header checks, then codes times scales."""
        body, raw = self.c._checked_body(payload, numel)
        if raw == 0:
            return torch.zeros(numel)
        nb = self.c._num_blocks(numel)
        scale = torch.from_numpy(np_view(body, np.float32, nb).copy())
        if not bool(torch.isfinite(scale * self.qmax).all() and (scale >= 0).all()):
            raise CodecError("corrupted payload: block scales must be finite and >= 0")
        out = torch.empty(numel)
        if self.c.base == "int8":
            codes = np_view(body, np.int8, numel, 4 * nb)
            if numel and codes.min() == -128:
                raise CodecError("corrupted payload: int8 code -128 is never produced")
            out.numpy()[:] = codes
        else:
            table = np.stack([(np.arange(256) & 15) - 8, (np.arange(256) >> 4) - 8], axis=1).astype(np.float32)
            table[(np.arange(256) & 15) == 0, 0] = np.nan
            table[(np.arange(256) >> 4) == 0, 1] = np.nan
            packed = np_view(body, np.uint8, (numel + 1) // 2, 4 * nb)
            out.copy_(torch.from_numpy(table[packed].reshape(-1)[:numel].copy()))
            if numel % 2 and int(packed[-1]) >> 4 != 8:
                raise CodecError("corrupted payload: int4 padding nibble is not zero")
        full = numel // self.bs
        if full:
            out[: full * self.bs].view(full, self.bs).mul_(scale[:full, None])
        if numel % self.bs:
            out[full * self.bs :].mul_(scale[full])
        if numel and not bool(torch.isfinite(out).all()):
            raise CodecError("corrupted payload: int4 nibble 0 (code -8) is never produced")
        return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # -0.0 and 0.0 differ here, unlike torch.equal


def _inputs(numel: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    cases = {"random": x * 3, "zeros": torch.zeros(numel), "negative zeros": -torch.zeros(numel)}
    huge = x.clone()
    huge[::97] = 3.3e38  # the scale nudge near the top of fp32's range
    huge[1::193] = -3.4028234e38
    cases["huge"] = huge
    tiny = x * 1e-40  # subnormal scales: codes are clamped
    tiny[::5] = 1.4e-45
    cases["subnormal"] = tiny
    mixed = x.clone()
    mixed[: numel // 3] = 0.0  # zero blocks beside others
    mixed[numel // 2 :: 7] *= 1e30
    cases["mixed"] = mixed
    ties = torch.randint(-50, 50, (numel,), generator=g).float() / 2  # halves: round-half-even ties
    cases["ties"] = ties
    return cases


def _ranges(numel: int, step: int) -> list[tuple[int, int]]:
    return [(o, min(step, numel - o)) for o in range(0, numel, step)]


CONFIGS = [
    CodecConfig(name="int8"),
    CodecConfig(name="int4"),
    CodecConfig(name="int8", block_size=8),
    CodecConfig(name="int4", block_size=64),
    CodecConfig(name="int8", block_size=1 << 18),  # one block per quantizer chunk
    CodecConfig(name="int8", stochastic_rounding=True),
    CodecConfig(name="int4", stochastic_rounding=True, block_size=32),
]
SHAPES = [  # (numel, chunk step): odd lengths, a short last chunk, chunks at and across block boundaries
    (5 * 1280, 1280),
    (7 * 1280 + 333, 1280),
    (3 * 1280 + 1, 1280),
    (1000, 1280),
    (10 * 256, 256),
    (2 * 256 + 255, 256),
    (9 * 512, 300),  # not block-aligned: the per-range path
    ((1 << 18) + 3 * 1280, 1280),  # over one quantizer chunk
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.name}-bs{c.block_size}-sr{int(c.stochastic_rounding)}")
@pytest.mark.parametrize("numel,step", SHAPES)
def test_payloads_and_decoded_values_equal_the_reference(cfg: CodecConfig, numel: int, step: int) -> None:
    codec, ref = get_codec(cfg), _Reference(get_codec(cfg))
    ranges = _ranges(numel, step)
    numels = [n for _, n in ranges]
    for what, x in _inputs(numel, seed=numel + step).items():
        got = codec.encode_chunks(x, ranges, generator=torch.Generator().manual_seed(7))
        want = ref.encode_chunks(x, ranges, generator=torch.Generator().manual_seed(7))
        assert got == want, f"{cfg.name} {what}: payloads differ from the reference"
        assert all(type(p) is bytes for p in got)
        dec = codec.decode_chunks(got, numels)
        ref_dec = torch.cat([ref.decode(p, n) for p, n in zip(want, numels)])
        assert torch.equal(_bits(dec), _bits(ref_dec)), f"{cfg.name} {what}: decoded bits differ"
        assert torch.equal(_bits(dec), _bits(torch.cat([codec.decode(p, numel=n) for p, n in zip(got, numels)])))
        assert torch.equal(_bits(codec.decode_chunks(got, numels, verify=False)), _bits(dec))  # own payloads


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_non_finite_input_is_refused_as_before(name: str) -> None:
    codec = get_codec(name)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(4 * 1280)
        x[2 * 1280 + 17] = bad
        with pytest.raises(CodecError, match="non-finite input: 1 of 5120 elements are NaN or inf"):
            codec.encode_chunks(x, _ranges(x.numel(), 1280))


def _forged(p: bytes, at: int, value: bytes) -> bytes:
    """``p`` with body bytes at ``at`` replaced and the crc32 fixed (passes the header checks)."""
    body = bytearray(p[HEADER_BYTES:])
    body[at : at + len(value)] = value
    return p[: HEADER_BYTES - 4] + zlib.crc32(body).to_bytes(4, "little") + bytes(body)


def _first_error(codec, payloads, numel) -> str:
    for p in payloads:
        try:
            codec.decode(p, numel=numel)
        except CodecError as e:
            return str(e)
    raise AssertionError("no payload is bad")


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_bad_run_raises_decodes_error_for_its_first_bad_payload(name: str) -> None:
    codec = get_codec(name)
    x = torch.randn(6 * 1280)
    ps = codec.encode_chunks(x, _ranges(x.numel(), 1280))
    flipped = bytearray(ps[4])
    flipped[-1] ^= 1
    code_off = 5 * 4 + 3
    forbidden = b"\x80" if name == "int8" else b"\x00"  # int8 -128; int4 nibble 0
    nan_scale = struct.pack("<f", float("nan"))
    header = bytearray(ps[1])
    header[7] = 9  # an unknown dtype id
    runs = {
        "crc": ps[:4] + [bytes(flipped)] + ps[5:],
        "code": ps[:2] + [_forged(ps[2], code_off, forbidden)] + ps[3:],
        "scale": ps[:1] + [_forged(ps[1], 4, nan_scale)] + ps[2:],
        "negative scale": ps[:3] + [_forged(ps[3], 0, struct.pack("<f", -1.0))] + ps[4:],
        "dtype id": ps[:1] + [bytes(header)] + ps[2:],
        "truncated": ps[:5] + [ps[5][:-1]],
        "code then crc": ps[:1] + [_forged(ps[1], code_off, forbidden)] + ps[2:4] + [bytes(flipped)] + ps[5:],
    }
    for what, run in runs.items():
        with pytest.raises(CodecError) as e:
            codec.decode_chunks(run, [1280] * 6)
        assert str(e.value) == _first_error(codec, run, 1280), what
    for what in ("code", "scale", "negative scale", "truncated"):  # checked without verify too
        with pytest.raises(CodecError) as e:
            codec.decode_chunks(runs[what], [1280] * 6, verify=False)
        assert str(e.value) == _first_error(codec, runs[what], 1280), what


def test_a_run_of_memoryviews_and_bytearrays_decodes_alike() -> None:
    codec = get_codec("int8")
    x = torch.randn(4 * 1280)
    ps = codec.encode_chunks(x, _ranges(x.numel(), 1280))
    mixed = [memoryview(ps[0]), bytearray(ps[1]), ps[2], memoryview(bytearray(ps[3]))]
    assert torch.equal(_bits(codec.decode_chunks(mixed, [1280] * 4)), _bits(codec.decode_chunks(ps, [1280] * 4)))
    wide = memoryview(bytearray(ps[1] + b"\0" * (3 * len(ps[1])))).cast("I")  # len() counts items, not bytes
    with pytest.raises(CodecError):
        codec.decode_chunks([ps[0], wide, ps[2], ps[3]], [1280] * 4)


def test_without_a_compiler_the_kernels_are_unavailable_and_say_why(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("DTRAIN_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    native.kernels.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="dtrain.codecs.native"):
            assert native.kernels() is None
        assert "compiled codec kernels unavailable (`/bin/false` failed" in caplog.text
        monkeypatch.setenv("CC", "gcc")
        monkeypatch.setenv("DTRAIN_CODEC_NATIVE", "off")
        native.kernels.cache_clear()
        assert native.kernels() is None  # off: the torch path, no build
        assert not list(tmp_path.iterdir())
    finally:
        native.kernels.cache_clear()


@pytest.mark.parametrize("name", ["int8", "int4", "fp16", "int8+zstd"])
@pytest.mark.parametrize("numel,step", [(7 * 1280 + 333, 1280), (3 * 1280 + 1, 1280), (9 * 512, 300)])
def test_decoding_into_out_and_subtracting_from_it_equal_decode_then_copy_or_subtract(
    name: str, numel: int, step: int
) -> None:
    codec = get_codec(name)
    ranges = _ranges(numel, step)
    numels = [n for _, n in ranges]
    ps = codec.encode_chunks(torch.randn(numel) * 5, ranges)
    dec = codec.decode_chunks(ps, numels)
    base = torch.randn(numel + 10)
    out = base.clone()
    assert codec.decode_chunks(ps, numels, out=out[5 : 5 + numel]).data_ptr() == out[5:].data_ptr()
    assert torch.equal(_bits(out[5 : 5 + numel]), _bits(dec)) and torch.equal(out[:5], base[:5])
    out = base.clone()
    codec.decode_chunks(ps, numels, out=out[5 : 5 + numel], subtract=True)
    assert torch.equal(_bits(out[5 : 5 + numel]), _bits(base[5 : 5 + numel] - dec))
    assert torch.equal(out[:5], base[:5]) and torch.equal(out[5 + numel :], base[5 + numel :])
    # a bad payload anywhere (here the last): CodecError, and what was to be subtracted from is untouched
    bad = list(ps)
    flipped = bytearray(bad[-1])
    flipped[-1] ^= 1
    bad[-1] = bytes(flipped)
    out = base.clone()
    with pytest.raises(CodecError, match="checksum mismatch|corrupted"):
        codec.decode_chunks(bad, numels, out=out[5 : 5 + numel], subtract=True)
    assert torch.equal(_bits(out), _bits(base))
    with pytest.raises(ValueError, match=f"out must be a contiguous 1-D float32 CPU tensor of {numel} elements"):
        codec.decode_chunks(ps, numels, out=torch.empty(numel + 1))
    with pytest.raises(ValueError, match="subtract=True needs out"):
        codec.decode_chunks(ps, numels, subtract=True)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_forged_code_in_a_later_run_leaves_out_untouched_when_subtracting(name: str) -> None:
    """The kernel checks every run's scales and codes before it subtracts the first."""
    codec = get_codec(name)
    numel = 4 * 1280 + 512  # a run of four chunks, then one of 512
    ranges = _ranges(numel, 1280)
    ps = codec.encode_chunks(torch.randn(numel), ranges)
    ps[-1] = _forged(ps[-1], 2 * 4 + 1, b"\x80" if name == "int8" else b"\x00")
    base = torch.randn(numel)
    out = base.clone()
    with pytest.raises(CodecError, match="never produced"):
        codec.decode_chunks(ps, [n for _, n in ranges], out=out, subtract=True)
    assert torch.equal(_bits(out), _bits(base))


def test_the_baseline_build_of_the_kernels_gives_the_same_bits_as_the_one_this_cpu_picks(tmp_path, monkeypatch) -> None:
    """A CPU without AVX2 runs the kernels' baseline copy (GCC target_clones picks at load): built
    here on its own (``-DBW_BASELINE_ONLY``), it gives the same bytes and values as the copy this
    machine picks, so sites on different CPUs agree."""
    from dtrain.native import build_and_load

    if native.kernels() is None:
        pytest.skip("no compiler")
    monkeypatch.setenv("DTRAIN_NATIVE_CACHE", str(tmp_path))
    lib, why = build_and_load(
        native.SOURCE,
        stem="kernels-baseline",
        cflags=[*native.CFLAGS, "-DBW_BASELINE_ONLY"],
        libs=[],
        version_fn="bw_version",
        version=native.VERSION,
    )
    assert lib is not None, why
    base, here = native.Kernels(lib), native.kernels()
    numel, bs = 7 * 1280 + 333, 256
    nb = -(-numel // bs)
    for int4 in (False, True):
        size = 4 * nb + ((numel + 1) // 2 if int4 else numel)
        for what, x in _inputs(numel, seed=11).items():
            bodies = [np.zeros(size, dtype=np.uint8) for _ in range(4)]
            settled = [x.clone(), x.clone()]
            for k, b, st in zip((base, here, base, here), bodies, [None, None, *settled]):
                sc, codes = b[: 4 * nb].view(np.float32), b[4 * nb :]
                assert k.encode(x if st is None else st, bs, 1 << 18, int4, sc, codes, settle=st is not None)
            assert all(np.array_equal(bodies[0], b) for b in bodies[1:]), (int4, what)
            assert torch.equal(_bits(settled[0]), _bits(settled[1])), (int4, what)
            for k, st in zip((base, here), settled):
                assert k.decode(bodies[0][None, :], numel, bs, int4, st, unsettle=True)
                assert torch.equal(_bits(st), _bits(x)), (int4, what)
            r = torch.randn(numel)
            outs = [torch.empty(numel), torch.empty(numel), r.clone(), r.clone(), r.clone(), r.clone()]
            for k, o in zip((base, here), outs[:2]):
                assert k.decode(bodies[0][None, :], numel, bs, int4, o)
            for k, o in zip((base, here), outs[2:4]):
                assert k.decode(bodies[0][None, :], numel, bs, int4, o, sub=True)
            th, loc = torch.randn(numel), torch.randn(numel)
            for k, o in zip((base, here), outs[4:]):
                assert k.accumulate(o, th, loc, 0.95)
            for a, b in zip(outs[::2], outs[1::2]):
                assert torch.equal(_bits(a), _bits(b)), (int4, what)


def _boundaries(numel: int, seed: int) -> torch.Tensor:
    """Values a few ulps either side of the rounding boundaries (q + 1/2) * scale of blocks with
    scales that are not powers of 2, and each block's absmax at 127 * scale."""
    g = torch.Generator().manual_seed(seed)
    scale = (
        torch.rand(numel // 64 + 1, generator=g).repeat_interleave(64)[:numel]
        * 10.0 ** torch.randint(-30, 30, (numel // 64 + 1,), generator=g).repeat_interleave(64)[:numel].float()
    )
    q = torch.randint(-127, 127, (numel,), generator=g).float() + 0.5
    x = q * scale
    for _ in range(3):  # nudged by up to 3 ulps each way
        step = torch.randint(-1, 2, (numel,), generator=g)
        x = torch.where(step > 0, torch.nextafter(x, torch.full_like(x, float("inf"))), x)
        x = torch.where(step < 0, torch.nextafter(x, torch.full_like(x, float("-inf"))), x)
    x[::64] = 127 * scale[::64]
    return x


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if not c.stochastic_rounding], ids=str)
def test_an_encode_that_settles_in_place_is_undone_bit_for_bit(cfg: CodecConfig, kernel_path: str) -> None:
    """``encode_chunks(..., settle=True)`` sends the same payloads and leaves x − decoded (what
    error feedback's settle of a sent chunk leaves, bit for bit); ``decode_chunks(unsettle=True)``
    gives the original x back, bit for bit, -0.0 included: the residual of a chunk that was
    sent and then not included in its mean is kept whole (kernels.c, the Sterbenz argument)."""
    codec = get_codec(cfg)
    numel = 6 * 4096 + 1024
    ranges = _ranges(numel, 4096)
    cases = {**_inputs(numel, seed=21), "boundaries": _boundaries(numel, seed=22)}
    if 4096 % cfg.block_size or kernel_path == "torch":  # ranges of parts of blocks, or no compiled pass
        assert not codec.settles_in_place(cases["random"], ranges)
        return
    for what, x in cases.items():
        assert codec.settles_in_place(x, ranges), what
        sent = codec.encode_chunks(x, ranges)
        y = x.clone()
        assert codec.encode_chunks(y, ranges, settle=True) == sent, what
        want = x.clone()
        codec.decode_chunks(sent, [n for _, n in ranges], out=want, subtract=True)
        assert torch.equal(_bits(y), _bits(want)), what
        codec.decode_chunks(sent, [n for _, n in ranges], out=y, unsettle=True)
        assert torch.equal(_bits(y), _bits(x)), what


def test_codecs_that_cannot_settle_in_place_say_so_and_refuse_it(kernel_path: str) -> None:
    x = torch.randn(4 * 1280)
    ranges = _ranges(x.numel(), 1280)
    for name in ("fp32", "bf16", "topk", "int8+zstd"):
        codec = get_codec(name)
        assert not codec.settles_in_place(x, ranges), name
        with pytest.raises(ValueError, match="does not settle in place"):
            codec.encode_chunks(x.clone(), ranges, settle=True)
    int8 = get_codec("int8")
    assert int8.settles_in_place(x, ranges) == (kernel_path == "compiled")
    assert not int8.settles_in_place(x, ranges[1:])  # ranges that do not cover x from 0
    assert not int8.settles_in_place(x.view(-1, 2).t()[0], ranges[:2])  # not contiguous
    assert not get_codec(CodecConfig(name="int8", stochastic_rounding=True)).settles_in_place(x, ranges)
    sent, out = int8.encode_chunks(x, ranges), x.clone()
    with pytest.raises(ValueError, match="'fp32' did not settle"):  # a codec with no settle to undo
        get_codec("fp32").decode_chunks(get_codec("fp32").encode_chunks(x, ranges), [1280] * 4, out=out, unsettle=True)
    with pytest.raises(CodecError, match="codec"):  # another codec's payloads: decode's own error
        get_codec("int4").decode_chunks(sent, [1280] * 4, out=out, unsettle=True)
    bad = list(sent)
    bad[2] = bad[2][:-1] + bytes([bad[2][-1] ^ 1])
    with pytest.raises(CodecError, match="checksum mismatch|corrupted"):  # checked before anything is added
        int8.decode_chunks(bad, [1280] * 4, out=out, unsettle=True)
    assert torch.equal(_bits(out), _bits(x))
