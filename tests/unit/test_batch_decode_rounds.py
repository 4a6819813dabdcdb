"""The round's batch decodes (``Codec.decode_chunks``) give what one decode per chunk gave:
``encode_mean`` / ``decode_mean`` (means.py), ``settle_bucket`` (error_feedback.py) and an
owner's ``handle_contributions`` (serving.py) fed by the datagram dispatch thread's batches."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dtrain.buckets import Bucket
from dtrain.codecs import get_codec
from dtrain.codecs.base import CheckedRun
from dtrain.errors import RejectCode, Rejected
from dtrain.protocol import BucketMean, Contribution
from dtrain.rounds.error_feedback import settle_bucket, settle_chunk
from dtrain.rounds.means import ascending_runs, contiguous_runs, decode_mean, encode_mean
from dtrain.rounds.owner import ChunkReduction
from dtrain.rounds.serving import PeerSide
from dtrain.transports.datagram import dispatch_groups
from dtrain.transports.datagram_wire import Kind


def _bucket(numel: int, step: int = 1280) -> Bucket:
    chunks = tuple((o, min(step, numel - o)) for o in range(0, numel, step))
    return Bucket(0, numel, "param", (), chunks)


def test_ascending_runs() -> None:
    assert ascending_runs([]) == []
    assert ascending_runs([0, 1, 5, 2, 2]) == [(0, 3), (3, 4), (4, 5)]
    assert ascending_runs([3]) == [(0, 1)]


def test_contiguous_runs() -> None:
    assert contiguous_runs([]) == []
    assert contiguous_runs([(0, 4), (4, 4), (10, 2)]) == [(0, 2), (2, 3)]
    assert contiguous_runs([(0, 4), (4, 4), (8, 1)]) == [(0, 3)]
    assert contiguous_runs([(8, 2), (0, 8)]) == [(0, 1), (1, 2)]
    layout = ((0, 4), (4, 4), (10, 2))  # remembered per distinct ranges: the same answer again, a list each time
    first = contiguous_runs(layout)
    first.append((9, 9))
    assert contiguous_runs(layout) == [(0, 2), (2, 3)] == contiguous_runs(list(layout))
    assert contiguous_runs([[0, 4], [4, 4]]) == [(0, 2)]  # unhashable ranges: answered, not remembered


@pytest.mark.parametrize("name", ["int8", "int4", "bf16"])
def test_encode_mean_then_decode_mean_match_one_decode_per_chunk(name: str) -> None:
    codec = get_codec(name)
    bucket = _bucket(9 * 1280 + 77)
    g = torch.Generator().manual_seed(3)
    reds = [ChunkReduction(c, torch.randn(n, generator=g), ("a", "b")) for c, (_, n) in enumerate(bucket.chunks)]
    residual = torch.randn(bucket.numel, generator=g) * 0.01
    before = residual.clone()
    chunks, full = encode_mean(codec, bucket, reds, residual=residual, generator=torch.Generator().manual_seed(0))
    want = torch.cat([codec.decode(ch.payload, numel=ch.numel) for ch in chunks])
    assert torch.equal(full, want)
    src = torch.cat([r.mean for r in reds]) + before
    assert torch.equal(residual, src - want)  # what the codec lost now, kept for the next mean
    m = BucketMean(round=1, bucket=0, owner="a", chunks=chunks, checksum_before="", checksum_after="")
    assert torch.equal(decode_mean(codec, bucket, m), want)


def test_settle_bucket_matches_settle_chunk_per_chunk_and_keeps_a_bad_mean_chunk_whole() -> None:
    codec = get_codec("int8")
    bucket = _bucket(8 * 1280 + 300)
    g = torch.Generator().manual_seed(5)
    u = torch.randn(bucket.numel, generator=g)
    sent = codec.encode_chunks(u, list(bucket.chunks))
    mean = torch.randn(bucket.numel, generator=g)
    mean_payloads = codec.encode_chunks(mean, list(bucket.chunks))
    mean_payloads[6] = mean_payloads[6][:-1] + bytes([mean_payloads[6][-1] ^ 1])  # corrupted: kept whole
    included = [True, True, False, False, True, False, False, False, True]
    for payloads in (mean_payloads, None):
        want = u.clone()
        for c, (off, n) in enumerate(bucket.chunks):
            s = codec.decode(sent[c], numel=n) if included[c] else None
            a = None
            if not included[c] and payloads is not None and c != 6:
                a = codec.decode(payloads[c], numel=n)
            settle_chunk(want[off : off + n], included=included[c], sent=s, applied_mean=a)
        got = u.clone()
        bad = settle_bucket(
            got, bucket.chunks, included, codec=codec, sent=sent.__getitem__, bcodec=codec, mean_payloads=payloads
        )
        assert torch.equal(got, want)
        assert [c for c, _ in bad] == ([6] if payloads is not None else [])
        assert all("checksum mismatch" in str(e) for _, e in bad)


@pytest.mark.parametrize("name", ["int8", "int4", "fp32"])
@pytest.mark.parametrize("last", [1280, 300])
def test_settle_bucket_scattered_inclusion_matches_settle_chunk_bit_for_bit(name: str, last: int) -> None:
    """Many alternating runs (a lossy round): the grouped decode + gather / scatter path, with
    the short last chunk both included and not, gives settle_chunk's values exactly."""
    codec = get_codec(name)
    bucket = _bucket(40 * 1280 + last)
    g = torch.Generator().manual_seed(11)
    u = torch.randn(bucket.numel, generator=g)
    sent = codec.encode_chunks(u, list(bucket.chunks))
    mean_payloads = codec.encode_chunks(torch.randn(bucket.numel, generator=g), list(bucket.chunks))
    for seed, last_included in ((0, True), (1, False)):
        r = torch.Generator().manual_seed(seed)
        included = [bool(x) for x in (torch.rand(len(bucket.chunks), generator=r) < 0.7).tolist()]
        included[-1] = last_included
        assert sum(1 for a, b in zip(included, included[1:]) if a != b) > 8  # scattered, not a few runs
        for payloads in (mean_payloads, None):
            want = u.clone()
            for c, (off, n) in enumerate(bucket.chunks):
                s = codec.decode(sent[c], numel=n) if included[c] and not codec.lossless else None
                a = codec.decode(payloads[c], numel=n) if not included[c] and payloads is not None else None
                settle_chunk(want[off : off + n], included=included[c], sent=s, applied_mean=a)
            got = u.clone()
            bad = settle_bucket(
                got, bucket.chunks, included, codec=codec, sent=sent.__getitem__, bcodec=codec, mean_payloads=payloads
            )
            assert bad == []
            assert torch.equal(got, want), (name, last, seed, payloads is None)


def test_settle_bucket_lossless_codec_zeroes_the_included_chunks() -> None:
    fp32 = get_codec("fp32")
    bucket = _bucket(3 * 1280)
    u = torch.ones(bucket.numel)
    bad = settle_bucket(
        u,
        bucket.chunks,
        [True, False, True],
        codec=fp32,
        sent=lambda c: pytest.fail("a lossless codec's payload is never decoded"),
        bcodec=fp32,
        mean_payloads=None,
    )
    assert bad == []
    assert u[:1280].eq(0).all() and u[1280:2560].eq(1).all() and u[2560:].eq(0).all()


class _Side(PeerSide):
    """Only what ``handle_contributions`` uses: the codec; ``_handle_one`` (a chunk) and
    ``_handle_run`` (a decoded run, its chunks' values as views) recorded."""

    def __init__(self, codec) -> None:
        self.codec = codec
        self.seen: list[tuple[Contribution, torch.Tensor | None]] = []
        self.runs: list[list[int]] = []

    def _handle_one(self, c, values) -> None:
        if c.sender == "refused":
            raise Rejected(RejectCode.INVALID_ARGUMENT, f"chunk {c.chunk} refused")
        self.seen.append((c, values))

    def _handle_run(self, cs, values) -> list:
        self.runs.append([c.chunk for c in cs])
        values = values.tensor() if isinstance(values, CheckedRun) else values  # checked, decoded where summed
        pos = 0
        for c in cs:
            self.seen.append((c, values[pos : pos + c.numel]))
            pos += c.numel
        return [None] * len(cs)


def _contribs(codec, bucket: int, chunks: list[int], *, sender: str = "s", x: torch.Tensor) -> list[Contribution]:
    return [
        Contribution(
            round=1,
            bucket=bucket,
            chunk=c,
            offset=1280 * c,
            numel=1280,
            codec=codec.name,
            sender=sender,
            payload=codec.encode(x[1280 * c : 1280 * (c + 1)]),
        )
        for c in chunks
    ]


def test_handle_contributions_decodes_runs_of_ascending_chunks_and_answers_each() -> None:
    codec = get_codec("int8")
    x = torch.randn(10 * 1280, generator=torch.Generator().manual_seed(2))
    cs = _contribs(codec, 0, [0, 1, 2, 4], x=x)  # one run: ascending chunks, chunk 3 lost
    cs += _contribs(codec, 3, [5, 6], x=x) + _contribs(codec, 1, [7], x=x)
    bad = bytearray(cs[4].payload)
    bad[-1] ^= 1
    cs[4] = replace(cs[4], payload=bytes(bad))  # its run (bucket 3, chunks 5, 6) is decoded chunk by chunk
    cs += _contribs(codec, 2, [8], sender="refused", x=x)
    side = _Side(codec)
    results = side.handle_contributions(cs)
    assert [r is None for r in results] == [True] * 7 + [False]
    assert str(results[7]) and "chunk 8 refused" in results[7].reason
    assert [c.chunk for c, _ in side.seen] == [0, 1, 2, 4, 5, 6, 7]
    assert side.runs == [[0, 1, 2, 4]]  # checked and counted in one pass
    for c, values in side.seen[:4]:  # decoded in one pass, bit for bit the chunk's own decode
        assert values is not None and torch.equal(values, codec.decode(c.payload, numel=c.numel))
    assert all(values is None for _, values in side.seen[4:])  # bad run, and a run of one


def test_dispatch_groups_batch_each_senders_contributions_and_keep_each_senders_order() -> None:
    rs_a, rs_b = object(), object()

    def h(sender: int) -> SimpleNamespace:
        return SimpleNamespace(sender=sender)

    items = [
        (Kind.CONTRIB, rs_a, h(1), None),  # 0
        (Kind.CONTRIB, rs_a, h(2), None),  # 1: senders interleave on the wire
        (Kind.CONTRIB, rs_a, h(1), None),  # 2
        (Kind.CONTRIB, rs_b, h(1), None),  # 3: another round
        (Kind.SEND_END, rs_a, h(1), None),  # 4: after everything before it
        (Kind.CONTRIB, rs_a, h(1), None),  # 5
        (Kind.NACK, rs_b, h(2), None),  # 6
        (Kind.NACK, rs_b, h(2), None),  # 7
        (Kind.CONTRIB, rs_a, h(2), None),  # 8
    ]
    assert dispatch_groups(items) == [[0, 2], [1], [3], [4], [5], [6], [7], [8]]
    assert dispatch_groups([]) == []


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("last", [1280, 300])
def test_a_residual_settled_in_place_by_its_encode_ends_as_the_per_chunk_settle(
    name: str, last: int, kernel_path: str
) -> None:
    """``encode_chunks(..., settle=True)`` makes the same payloads, and ``settle_bucket`` told
    the residual was settled in place leaves what settle_chunk leaves, bit for bit, for every
    inclusion pattern: all chunks (nothing decoded), scattered ones with and without a mean,
    none (the whole residual restored)."""
    codec = get_codec(name)
    bucket = _bucket(40 * 1280 + last)
    g = torch.Generator().manual_seed(12)
    u = torch.randn(bucket.numel, generator=g) * torch.logspace(-3, 2, bucket.numel)  # blocks of unlike scale
    u[5 * 1280 : 6 * 1280] = 0.0  # a zero block: scale 0
    u[7 * 1280 : 8 * 1280] *= -0.0  # and one of -0.0
    if not codec.settles_in_place(u, bucket.chunks):
        assert kernel_path == "torch" or (last % 256 and name == "int4")
        return
    sent = codec.encode_chunks(u, list(bucket.chunks))
    mean_payloads = codec.encode_chunks(torch.randn(bucket.numel, generator=g), list(bucket.chunks))
    r = torch.Generator().manual_seed(3)
    scattered = [bool(x) for x in (torch.rand(len(bucket.chunks), generator=r) < 0.7).tolist()]
    for included in ([True] * len(bucket.chunks), scattered, [False] * len(bucket.chunks)):
        for payloads in (mean_payloads, None):
            want = u.clone()
            for c, (off, n) in enumerate(bucket.chunks):
                s = codec.decode(sent[c], numel=n) if included[c] else None
                a = codec.decode(payloads[c], numel=n) if not included[c] and payloads is not None else None
                settle_chunk(want[off : off + n], included=included[c], sent=s, applied_mean=a)
            got = u.clone()
            assert codec.encode_chunks(got, list(bucket.chunks), settle=True) == sent
            decoded: list[int] = []
            bad = settle_bucket(
                got,
                bucket.chunks,
                included,
                codec=codec,
                sent=lambda c: decoded.append(c) or sent[c],
                bcodec=codec,
                mean_payloads=payloads,
                settled_in_place=True,
            )
            assert bad == []
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (name, last, sum(included))
            assert decoded == [c for c, inc in enumerate(included) if not inc]  # only the ones restored
