"""Bucket layout (gather/scatter, chunking) and rendezvous-hash ownership."""

from __future__ import annotations

import pytest
import torch

from dtrain.buckets import BucketConfig, BucketLayout, assign_owners, checksum

pytestmark = pytest.mark.timeout(30)


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, generator=g),
        torch.randn(2, 5, generator=g),  # 10 elements: spans buckets 0 and 1 (bucket = 8 elements)
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.randn(4, generator=g),  # a buffer
    ]


def _layout() -> BucketLayout:
    return BucketLayout(
        [3, 10, 5, 4], ["param", "param", "param", "buffer"], BucketConfig(bucket_bytes=32, chunk_bytes=12)
    )


def test_layout_cuts_buckets_and_chunks() -> None:
    lay = _layout()
    # params: 3 + 10 + 5 = 18 elements -> buckets of 8, 8, 2; buffers: 4 -> one bucket
    assert [b.numel for b in lay.buckets] == [8, 8, 2, 4]
    assert [b.kind for b in lay.buckets] == ["param", "param", "param", "buffer"]
    assert lay.total_numel == 22
    # chunk_bytes=12 -> 3 elements per chunk, the last chunk shorter
    assert lay.buckets[0].chunks == ((0, 3), (3, 3), (6, 2))
    assert lay.buckets[2].chunks == ((0, 2),)
    # tensor 1 (10 elements) spans bucket 0 (elements 0..4) and bucket 1 (elements 5..9)
    seg0 = [s for s in lay.buckets[0].segments if s.tensor_index == 1]
    seg1 = [s for s in lay.buckets[1].segments if s.tensor_index == 1]
    assert [(s.tensor_offset, s.bucket_offset, s.numel) for s in seg0] == [(0, 3, 5)]
    assert [(s.tensor_offset, s.bucket_offset, s.numel) for s in seg1] == [(5, 0, 5)]


def test_gather_scatter_round_trip_with_a_parameter_spanning_two_buckets() -> None:
    lay = _layout()
    src = _tensors()
    flat = [lay.gather(b, src) for b in range(len(lay))]
    assert all(f.dtype == torch.float32 for f in flat)
    # gather is a plain concatenation in parameter order, buffers in their own bucket
    params_cat = torch.cat([src[0].reshape(-1), src[1].reshape(-1), src[2].float().reshape(-1)])
    assert torch.equal(torch.cat(flat[:3]), params_cat)
    assert torch.equal(flat[3], src[3])
    dst = [torch.zeros_like(t) for t in src]
    for b in range(len(lay)):
        lay.scatter(b, flat[b], dst)
    for s, d in zip(src, dst):
        assert d.dtype == s.dtype and d.shape == s.shape
        assert torch.equal(s, d)
    # a preallocated out buffer is used and returned
    out = torch.empty(8)
    assert lay.gather(1, src, out=out) is out


def test_fingerprint_depends_on_sizes_and_config() -> None:
    a = _layout().fingerprint()
    assert a == _layout().fingerprint()
    assert (
        a
        != BucketLayout(
            [3, 10, 5, 4], ["param"] * 3 + ["buffer"], BucketConfig(bucket_bytes=64, chunk_bytes=12)
        ).fingerprint()
    )
    assert (
        a
        != BucketLayout(
            [3, 11, 5, 4], ["param"] * 3 + ["buffer"], BucketConfig(bucket_bytes=32, chunk_bytes=12)
        ).fingerprint()
    )


def test_assign_owners_agrees_regardless_of_member_order() -> None:
    members = [f"site-{i}" for i in range(5)]
    a = assign_owners(200, members)
    b = assign_owners(200, list(reversed(members)))
    c = assign_owners(200, members[2:] + members[:2])
    assert a == b == c
    assert set(a) == set(members)  # 200 buckets over 5 members: everyone owns some
    counts = {m: a.count(m) for m in members}
    assert min(counts.values()) >= 20, counts  # roughly balanced (expected 40 each)


def test_assign_owners_moves_only_the_leaving_members_buckets() -> None:
    members = [f"site-{i}" for i in range(5)]
    before = assign_owners(200, members)
    after = assign_owners(200, [m for m in members if m != "site-3"])
    moved = [b for b in range(200) if before[b] != after[b]]
    assert moved, "site-3 owned buckets, they must move"
    assert all(before[b] == "site-3" for b in moved)
    assert all(after[b] != "site-3" for b in range(200))
    assert len(moved) == before.count("site-3")


def test_assign_owners_needs_members() -> None:
    with pytest.raises(ValueError, match="members"):
        assign_owners(3, [])
    assert assign_owners(0, ["a"]) == []


def test_checksum_is_of_the_bits() -> None:
    t = torch.tensor([1.0, 2.0, 3.0])
    assert checksum(t) == checksum(t.clone())
    assert checksum(t) != checksum(torch.tensor([1.0, 2.0, 3.0000002]))
    assert checksum(torch.tensor([0.0])) != checksum(torch.tensor([-0.0]))
    assert checksum(torch.empty(0)) == checksum(torch.empty(0))
