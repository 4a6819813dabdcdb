"""Fuzzing the hand-written Peer wire codec (dtrain/transports/grpc_wire.py) with hypothesis.

The bytes come from peers, so every input must end in a value or in the module's own
error: ``WireError`` for one ``ContributionChunk``, ``Rejected(INVALID_ARGUMENT)`` for a
``MeanPart`` / ``StatePart`` stream. Never another exception, never a hang (each example
has a deadline), never an allocation driven by a length the sender claims (tracemalloc
peak bounded by a multiple of the input size).
"""

from __future__ import annotations

import json
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtrain._proto.dtrain.v1 import peer_pb2 as pb
from dtrain.errors import RejectCode, Rejected
from dtrain.protocol import BucketMean, BucketState, Contribution, MeanChunk
from dtrain.transports import grpc_wire as wire

FUZZ = settings(
    max_examples=150,
    deadline=500,  # ms per example: a hang or a quadratic blow-up fails here
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,  # the same examples every run: a failure reproduces
)
MAX_EXTRA_BYTES = 1 << 20  # what decoding may allocate beyond a few times its input


def _contribution(payload: bytes, sender: str = "site-1") -> Contribution:
    return Contribution(
        round=3, bucket=1, chunk=2, offset=1024, numel=len(payload) // 4, codec="int8", sender=sender, payload=payload
    )


def _mean(payloads: list[bytes]) -> BucketMean:
    chunks = tuple(
        MeanChunk(chunk=i, offset=i * 64, numel=len(p) // 4, codec="fp32", payload=p, senders=("a", "b"))
        for i, p in enumerate(payloads)
    )
    return BucketMean(round=5, bucket=2, owner="a", chunks=chunks, checksum_before="x" * 8, checksum_after="y" * 8)


def _state(theta: bytes, opt: bytes) -> BucketState:
    return BucketState(
        bucket=4, rounds_applied=9, theta=theta, optimizer_state=opt, checksum="c" * 8, extra={"mean_round": 8}
    )


def _bounded(fn, size: int):
    """Run ``fn()``; assert it allocated at most a few times ``size`` bytes (plus slack)."""
    tracemalloc.start()
    try:
        return fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak <= 4 * size + MAX_EXTRA_BYTES, f"decoding {size} bytes allocated {peak} bytes"


def _decode_one(data: bytes) -> None:
    try:
        c = _bounded(lambda: wire.decode_contribution(data), len(data))
    except wire.WireError:
        return
    assert isinstance(c, Contribution) and len(c.payload) <= len(data)


def _decode_stream(fn, parts: list[bytes]) -> None:
    size = sum(len(p) for p in parts)
    try:
        out = _bounded(lambda: fn(parts), size)
    except Rejected as e:
        assert e.code == RejectCode.INVALID_ARGUMENT and e.reason.startswith("malformed "), e
        return
    assert isinstance(out, (BucketMean, BucketState))


# ----------------------------------------------------------------------------- mutations
@st.composite
def _mutated(draw, valid: bytes) -> bytes:
    """``valid`` with a few edits: flipped bytes, a cut, an insertion or a duplicated slice."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "cut", "insert", "dup"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and data:
            data[pos] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x0A, 0x12, 0x1A, 0x42]))
        elif kind == "cut":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=12))
        elif kind == "dup":
            end = draw(st.integers(pos, len(data)))
            data[pos:pos] = data[pos:end]
    return bytes(data)


_payloads = st.binary(min_size=0, max_size=300)


# ----------------------------------------------------------------------------- ContributionChunk
@FUZZ
@given(st.binary(max_size=400))
def test_arbitrary_bytes_as_a_contribution(data):
    _decode_one(data)


@FUZZ
@given(st.data(), _payloads, st.text(max_size=12))
def test_mutated_contributions(data, payload, sender):
    valid = wire.encode_contribution(_contribution(payload, sender))
    assert wire.decode_contribution(valid) == _contribution(payload, sender)
    _decode_one(data.draw(_mutated(valid)))


# ----------------------------------------------------------------------------- streams
@FUZZ
@given(st.lists(st.binary(max_size=200), max_size=5))
def test_arbitrary_parts_as_a_mean_and_a_state(parts):
    _decode_stream(wire.mean_from_wire, parts)
    _decode_stream(wire.state_from_wire, parts)


@FUZZ
@given(st.data(), st.lists(_payloads, max_size=3), st.integers(1, 64))
def test_mutated_mean_streams(data, payloads, part_bytes):
    mean = _mean(payloads)
    parts = list(wire.mean_to_wire(mean, part_bytes))
    assert wire.mean_from_wire(parts) == mean
    i = data.draw(st.integers(0, len(parts) - 1))
    parts[i] = data.draw(_mutated(parts[i]))
    if data.draw(st.booleans()) and len(parts) > 1:  # reorder, drop or repeat a part
        j = data.draw(st.integers(0, len(parts) - 1))
        op = data.draw(st.sampled_from(["swap", "drop", "repeat"]))
        if op == "swap":
            parts[i], parts[j] = parts[j], parts[i]
        elif op == "drop":
            del parts[j]
        else:
            parts.insert(j, parts[i])
    _decode_stream(wire.mean_from_wire, parts)


@FUZZ
@given(st.data(), _payloads, _payloads, st.integers(1, 64))
def test_mutated_state_streams(data, theta, opt, part_bytes):
    state = _state(theta, opt)
    parts = list(wire.state_to_wire(state, part_bytes))
    assert wire.state_from_wire(parts) == state
    i = data.draw(st.integers(0, len(parts) - 1))
    parts[i] = data.draw(_mutated(parts[i]))
    _decode_stream(wire.state_from_wire, parts)


@FUZZ
@given(
    st.recursive(
        st.none() | st.integers() | st.text(max_size=5),
        lambda x: st.lists(x) | st.dictionaries(st.text(max_size=3), x),
        max_leaves=20,
    )
)
def test_state_extra_json_of_any_shape(extra):
    header = pb.StateHeader(bucket=0, extra_json=json.dumps(extra)).SerializeToString()
    part = wire._len_prefix(wire._STATE_HEADER, len(header)) + header
    _decode_stream(wire.state_from_wire, [part])


# ----------------------------------------------------------------------------- hostile lengths
@pytest.mark.timeout(10)
def test_a_length_field_claiming_2_to_the_62_bytes_allocates_nothing():
    claim = 1 << 62
    data = wire._len_prefix(wire._CONTRIBUTION_PAYLOAD, claim) + b"\0" * 16
    with pytest.raises(wire.WireError, match=f"field 8 claims {claim} bytes, 16 left"):
        _bounded(lambda: wire.decode_contribution(data), len(data))


@pytest.mark.timeout(10)
def test_an_announced_chunk_of_2_to_the_62_bytes_is_refused_without_allocating():
    header = pb.MeanHeader(round=1, bucket=0, owner="a", num_chunks=1).SerializeToString()
    chunk = pb.MeanChunkHeader(chunk=0, numel=1, codec="fp32", payload_bytes=1 << 62).SerializeToString()
    first = wire._len_prefix(wire._MEAN_HEADER, len(header)) + header + wire._len_prefix(wire._MEAN_CHUNK, len(chunk))
    parts = [first + chunk + wire._len_prefix(wire._MEAN_DATA, 8) + b"\1" * 8]
    with pytest.raises(Rejected, match=f"chunk 0 has 8 bytes, announced {1 << 62}"):
        _bounded(lambda: wire.mean_from_wire(parts), 100)
    state_header = pb.StateHeader(bucket=0, theta_bytes=1 << 62, optimizer_state_bytes=1 << 62).SerializeToString()
    part = wire._len_prefix(wire._STATE_HEADER, len(state_header)) + state_header
    with pytest.raises(Rejected, match="got theta 0 / optimizer_state 0 bytes"):
        _bounded(lambda: wire.state_from_wire([part]), 100)


@pytest.mark.timeout(10)
def test_an_overlong_varint_is_refused():
    with pytest.raises(wire.WireError, match="varint longer than 10 bytes"):
        wire.decode_contribution(b"\x42" + b"\xff" * 11 + b"\x01")


@pytest.mark.timeout(10)
def test_deeply_nested_extra_json_is_a_malformed_stream():
    header = pb.StateHeader(bucket=0, extra_json="[" * 100_000).SerializeToString()
    part = wire._len_prefix(wire._STATE_HEADER, len(header)) + header
    with pytest.raises(Rejected, match="extra_json is not JSON"):
        wire.state_from_wire([part])
