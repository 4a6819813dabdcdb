"""The ``sparseloco`` codec (chunked top-k, low-bit values, packed indices) and the error
feedback decay β that SparseLoCo pairs with it (arXiv 2508.15706)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from dtrain.buckets import BucketConfig, BucketLayout
from dtrain.codecs import HEADER_BYTES, CodecConfig, get_codec
from dtrain.codecs.sparse import chunk_topk, pack_bits, unpack_bits
from dtrain.errors import CodecError
from dtrain.rounds import RoundConfig
from dtrain.rounds.error_feedback import add_pseudo_gradient, settle_bucket
from dtrain.transports.datagram import datagram_chunk_bytes


def _codec(**kw):
    return get_codec(CodecConfig(name="sparseloco", **kw))


@pytest.mark.parametrize(
    "n, chunk, k, bits",
    [(4096 * 3, 4096, 64, 2), (4096 * 3 + 700, 4096, 64, 2), (1000, 256, 8, 4), (5, 16, 3, 8), (4096, 4096, 128, 3)],
)
def test_round_trip_keeps_the_top_k_of_each_chunk_within_the_bound(n, chunk, k, bits) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3
    c = _codec(sparse_chunk=chunk, sparse_k=k, sparse_bits=bits)
    p = c.encode(x)
    y = c.decode(p, numel=n)
    assert len(p) == HEADER_BYTES + c._body_bytes(n) == c.max_encoded_bytes(n)
    assert float((y - x).abs().max()) <= c.max_error(x)
    full, m = divmod(n, chunk)
    for r in range(full + (1 if m else 0)):
        xs, ys = x[r * chunk : (r + 1) * chunk], y[r * chunk : (r + 1) * chunk]
        kk = k if r < full else min(m, max(1, -(-k * m // chunk)))
        want = torch.topk(xs.abs(), kk).indices.sort().values
        assert torch.equal(ys.nonzero().squeeze(1), want)  # no kept value decodes to 0 here
        assert bool((torch.sign(ys[want]) == torch.sign(xs[want])).all())
        lo, hi = float(xs[want].abs().min()), float(xs[want].abs().max())
        levels = 1 << (bits - 1)
        assert float((ys[want].abs() - xs[want].abs()).abs().max()) <= (hi - lo) / (2 * levels) * 1.001 + 1e-30


def test_two_bit_layout_is_120_bytes_per_4096_elements() -> None:
    c = _codec()
    assert c._body_bytes(4096 * 10) == 10 * (8 + 64 * 12 // 8 + 64 * 2 // 8)  # 1/136.5 of fp32
    assert c._body_bytes(0) == 0
    assert _codec(sparse_k=32)._body_bytes(4096) == 8 + 48 + 8


def test_packed_indices_decode_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(1)
    for w in (1, 2, 3, 7, 12, 16):
        v = torch.randint(0, 1 << w, (37,), generator=g)
        buf = pack_bits(v, w)
        assert buf.size == -(-37 * w // 8)
        assert torch.equal(unpack_bits(buf, 37, w), v)
    # LSB first: 3 (0b11) then 1 (0b01) in 2 bits each -> 0b0111
    assert pack_bits(torch.tensor([3, 1]), 2).tolist() == [0b0111]
    # 12-bit indices 0xABC, 0x123 -> bytes BC, 3A, 12
    assert pack_bits(torch.tensor([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]
    with pytest.raises(CodecError, match="padding bits"):
        unpack_bits(np.array([0xFF], dtype=np.uint8), 3, 2, "codes")


def test_chunk_topk_is_exact_with_groups() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 4096, generator=g)
    x[3, :] = 0.0  # all ties
    x[5, 100:300] = 7.0  # a run of equal maxima
    for k in (1, 16, 64, 128, 1000):
        got = chunk_topk(x, k)
        assert got.shape == (8, k)
        assert bool((got[:, 1:] > got[:, :-1]).all())
        kth = torch.topk(x.abs(), k, dim=1).values[:, -1:]
        assert bool((x.abs().gather(1, got) >= kth).all())  # the k largest, ties arbitrary
    x[6, 9] = float("nan")
    assert chunk_topk(x, 64) is None


def test_error_feedback_conserves_what_was_not_sent() -> None:
    """Over rounds, what the means applied plus what is still in the residual is every Δ."""
    c = _codec(sparse_chunk=256, sparse_k=8)
    layout = BucketLayout([1024], ["param"], BucketConfig(bucket_bytes=4096, chunk_bytes=1024))
    chunks = list(layout.buckets[0].chunks)
    assert len(chunks) == 4
    theta = [torch.zeros(1024)]
    residuals: list = [None]
    g = torch.Generator().manual_seed(3)
    total_delta = torch.zeros(1024)
    delivered = torch.zeros(1024)
    for _ in range(6):
        local = torch.randn(1024, generator=g)
        total_delta += theta[0] - local
        assert add_pseudo_gradient(layout, theta, residuals, [local], error_feedback=True)
        payloads = c.encode_chunks(residuals[0], chunks)
        for (o, n), p in zip(chunks, payloads):
            delivered[o : o + n] += c.decode(p, numel=n)
        settle_bucket(
            residuals[0],
            chunks,
            [True] * len(chunks),
            codec=c,
            sent=lambda i: payloads[i],
            bcodec=c,
            mean_payloads=None,
        )
    assert torch.allclose(delivered + residuals[0], total_delta, atol=1e-4)
    assert 0 < int((delivered != 0).sum()) < 1024  # it did drop something every round


def test_error_feedback_decay_is_beta_times_the_residual_plus_delta() -> None:
    layout = BucketLayout([8], ["param"], BucketConfig(bucket_bytes=4096, chunk_bytes=1024))
    residuals: list = [torch.full((8,), 2.0)]
    add_pseudo_gradient(layout, [torch.ones(8)], residuals, [torch.zeros(8)], error_feedback=True, decay=0.95)
    assert torch.allclose(residuals[0], torch.full((8,), 0.95 * 2.0 + 1.0))
    with pytest.raises(ValueError, match=r"error_feedback_decay must be a number in \(0, 1\]"):
        RoundConfig(error_feedback_decay=0.0)
    with pytest.raises(ValueError, match="requires error_feedback=True"):
        RoundConfig(codec=CodecConfig(name="sparseloco"), error_feedback=False)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"sparse_chunk": 1000}, "sparse_chunk must be a power of two in 16..65536"),
        ({"sparse_chunk": 8}, "sparse_chunk"),
        ({"sparse_k": 0}, "sparse_k must be an int in 1..sparse_chunk - 1"),
        ({"sparse_k": 4096}, "sparse_k"),
        ({"sparse_bits": 1}, "sparse_bits must be an int in 2..8"),
        ({"sparse_bits": 9}, "sparse_bits"),
    ],
)
def test_bad_options_name_the_field(kw, field) -> None:
    with pytest.raises(ValueError, match=field):
        CodecConfig(name="sparseloco", **kw)


def _body(p: bytes) -> bytearray:
    return bytearray(p[HEADER_BYTES:])


def _repack(c, body: bytearray) -> bytes:
    """A payload around ``body`` with a valid header and crc (so the body's own checks run)."""
    return c._header(4096, bytes(body)) + bytes(body)


def test_truncated_or_malformed_payloads_are_refused() -> None:
    c = _codec()
    x = torch.randn(4096)
    p = c.encode(x)
    with pytest.raises(CodecError, match="truncated payload"):
        c.decode(p[:-1], numel=4096)
    with pytest.raises(CodecError, match="truncated payload"):
        c.decode(p[:10], numel=4096)
    with pytest.raises(CodecError, match="element count mismatch"):
        c.decode(p, numel=4095)
    with pytest.raises(CodecError, match="sparseloco parameter"):
        _codec(sparse_k=32).decode(p, numel=4096)
    with pytest.raises(CodecError, match="checksum mismatch"):
        bad = bytearray(p)
        bad[-1] ^= 1
        c.decode(bytes(bad), numel=4096)
    # bodies with a valid crc but impossible contents
    body = _body(p)
    body[0:8] = struct.pack("<ff", 2.0, 1.0)  # lo > hi
    with pytest.raises(CodecError, match="0 <= lo <= hi"):
        c.decode(_repack(c, body), numel=4096)
    body = _body(p)
    body[0:8] = struct.pack("<ff", 0.0, float("inf"))
    with pytest.raises(CodecError, match="finite"):
        c.decode(_repack(c, body), numel=4096)
    body = _body(p)
    body[8:11] = bytes([0, 0, 0])  # the first two 12-bit indices both 0
    with pytest.raises(CodecError, match="not strictly increasing"):
        c.decode(_repack(c, body), numel=4096)
    with pytest.raises(CodecError, match="codec mismatch"):
        get_codec("int8").decode(p, numel=4096)


def test_last_chunk_index_out_of_range_is_refused() -> None:
    c = _codec(sparse_chunk=16, sparse_k=2)
    p = c.encode(torch.arange(1.0, 21.0))  # 16 + 4: the last chunk keeps 1 of 4
    body = bytearray(p[HEADER_BYTES:])
    # indices stream at 8·2 = 16: three 4-bit indices; the last (tail) one set to 15 >= 4
    body[16 + 1] = (body[16 + 1] & 0xF0) | 0x0F  # the third index: bits 8..11
    payload = c._header(20, bytes(body)) + bytes(body)
    with pytest.raises(CodecError, match="last chunk"):
        c.decode(payload, numel=20)


def test_datagram_path_takes_whole_chunks_per_datagram() -> None:
    cfg = CodecConfig(name="sparseloco")
    chunk_bytes = datagram_chunk_bytes(cfg, 1400)
    numel = chunk_bytes // 4
    assert numel % 4096 == 0 and numel >= 4096
    c = get_codec(cfg)
    assert len(c.encode(torch.randn(numel))) <= 1400
    with pytest.raises(ValueError, match="no fixed size"):
        datagram_chunk_bytes(CodecConfig(name="sparseloco+zstd"), 1400)


def test_sparse_mean_divides_each_element_by_the_contributions_nonzero_there() -> None:
    from dtrain.aggregation import BucketAccumulator, ChunkAccumulator
    from dtrain.configs import AggregationConfig

    a = torch.tensor([4.0, 0.0, 2.0, 0.0, 1.0, 0.0])
    b = torch.tensor([2.0, 0.0, 0.0, 6.0, 0.0, 0.0])
    want = torch.tensor([3.0, 0.0, 2.0, 6.0, 1.0, 0.0])
    cfg = AggregationConfig(sparse_mean=True)
    acc = BucketAccumulator([4, 2], cfg, order=["a", "b"])
    acc.add_run("b", [0, 1], b, [b"b0", b"b1"])
    acc.add_run("a", [0, 1], a, [b"a0", b"a1"])
    means = acc.finalize()
    assert torch.equal(torch.cat([r.mean for r in means]), want) and torch.equal(means.mean, want)
    assert means[0].senders == ("a", "b")
    one = ChunkAccumulator(6, cfg, order=["a", "b"])
    one.add("a", a, b"a")
    one.add("b", b, b"b")
    assert torch.equal(one.finalize()[0], want)
    plain = BucketAccumulator([6], AggregationConfig(), order=["a", "b"])
    plain.add_run("a", [0], a, [b"a"])
    plain.add_run("b", [0], b, [b"b"])
    assert torch.equal(plain.finalize()[0].mean, (a + b) / 2)
    with pytest.raises(ValueError, match="sparse_mean cannot be combined"):
        AggregationConfig(sparse_mean=True, trim_fraction=0.1)
    sparse = AggregationConfig(sparse_mean=True)
    with pytest.raises(ValueError, match="sparse_mean needs a sparse codec \\(topk or sparseloco\\), not codec 'int8'"):
        RoundConfig(codec=CodecConfig(name="int8"), aggregation=sparse)
    for name in ("topk", "sparseloco+zstd"):  # its own codecs: fine
        assert RoundConfig(
            codec=CodecConfig(name=name), aggregation=sparse, error_feedback=True
        ).aggregation.sparse_mean


def test_datagram_chunk_fits_both_the_contribution_and_the_denser_mean() -> None:
    from dataclasses import replace

    from dtrain.app.config import NetConfig, WorkerConfig
    from dtrain.configs import DiLoCoConfig

    rounds = RoundConfig(
        codec=CodecConfig(name="sparseloco", sparse_k=128), broadcast_codec=CodecConfig(name="sparseloco", sparse_k=512)
    )
    cfg = WorkerConfig(diloco=replace(DiLoCoConfig(site_id="s"), rounds=rounds), net=NetConfig(data_path="datagram"))
    chunk = cfg.diloco_config().buckets.chunk_bytes
    assert chunk == datagram_chunk_bytes(rounds.broadcast_codec) < datagram_chunk_bytes(rounds.codec)
    assert len(get_codec(rounds.broadcast_codec).encode(torch.randn(chunk // 4))) <= 1400


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"name": "int8", "sparse_k": 32}, "sparse_k applies to codec sparseloco only, not codec 'int8'"),
        ({"name": "fp32+zstd", "sparse_chunk": 1024, "sparse_bits": 4}, "sparse_chunk, sparse_bits apply to codec"),
        ({"name": "sparseloco", "topk_fraction": 0.05}, "topk_fraction applies to codec topk only"),
        ({"name": "topk", "block_size": 64}, "block_size applies to codecs int8 and int4 only, not codec 'topk'"),
    ],
)
def test_a_codec_parameter_set_for_another_codec_is_refused_naming_it(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CodecConfig(**kw)
    CodecConfig(name="sparseloco+zstd", sparse_k=32)  # its own codec: fine
