"""The gRPC bulk path's copies (docs/DECISIONS.md, "gRPC"): a received payload is a view of
the message grpcio handed over, not a copy of it, and the process keeps freed heap memory
for the next message (dtrain/transports/heap.py)."""

from __future__ import annotations

import platform

import pytest

from dtrain.protocol import BucketMean, Contribution, MeanChunk
from dtrain.transports import grpc_wire as wire
from dtrain.transports import heap
from dtrain.transports.grpc_config import GrpcTransportConfig


def test_a_pushed_payload_is_a_view_of_its_message() -> None:
    c = Contribution(
        round=1, bucket=2, chunk=3, offset=0, numel=64, codec="fp32", sender="a", payload=bytes(range(256))
    )
    data = wire.encode_contribution(c)
    got = wire.decode_contribution(data)
    assert got == c and bytes(got.payload) == c.payload
    assert isinstance(got.payload, memoryview) and got.payload.obj is data and got.payload.readonly


def test_a_mean_chunk_in_one_part_is_a_view_and_one_in_several_is_joined() -> None:
    chunks = (
        MeanChunk(chunk=0, offset=0, numel=4, codec="fp32", payload=bytes(range(16)), senders=("a",)),
        MeanChunk(chunk=1, offset=4, numel=16, codec="fp32", payload=bytes(range(64)), senders=("a", "b")),
    )
    mean = BucketMean(round=1, bucket=0, owner="o", chunks=chunks, checksum_before="x", checksum_after="y")
    parts = list(wire.mean_to_wire(mean, part_bytes=32))
    got = wire.mean_from_wire(parts)
    assert got == mean
    assert isinstance(got.chunks[0].payload, memoryview) and got.chunks[0].payload.obj is parts[0]
    assert isinstance(got.chunks[1].payload, bytes)  # two parts: joined once


def test_keep_freed_memory() -> None:
    assert heap.keep_freed_memory(0) is False
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert heap.keep_freed_memory(64 << 20) is True
        assert heap.keep_freed_memory(1 << 20) is True  # already kept: nothing to do


def test_heap_keep_bytes_is_checked() -> None:
    assert GrpcTransportConfig(heap_keep_bytes=0).heap_keep_bytes == 0
    with pytest.raises(ValueError, match="heap_keep_bytes"):
        GrpcTransportConfig(heap_keep_bytes=-1)


def test_part_size_defaults_to_one_chunk_within_the_message_limit() -> None:
    assert GrpcTransportConfig().part_size == 4 << 20  # a 1 MiB chunk + its codec header: one part
    assert GrpcTransportConfig(max_message_bytes=4 << 20).part_size == (4 << 20) - (16 << 10)
    assert GrpcTransportConfig(part_bytes=1 << 20).part_size == 1 << 20
    with pytest.raises(ValueError, match="part_bytes"):
        GrpcTransportConfig(max_message_bytes=4 << 20, part_bytes=4 << 20)
