"""Encoding of the Peer service's bulk messages with few copies.

The messages are exactly those of ``proto/dtrain/v1/peer.proto`` (any protobuf
implementation reads and writes them), but the large ``bytes`` fields skip the
protobuf runtime: building and serializing a protobuf message copies a payload
twice, and parsing it and reading the field copies it twice more. Here

* encoding serializes the small fields with protobuf and appends the payload
  field by hand (tag, length, bytes): one copy, in ``b"".join``;
* decoding walks the top-level fields of the received bytes, takes the payload
  field as a ``memoryview`` (no copy) and parses only the rest with protobuf. The
  decoded payload *is* that read-only view of the message grpcio handed over
  (a contribution, a mean chunk that came in one part): grpcio has already copied
  the message three times on its way to Python, and a fourth copy into fresh memory
  cost a receiver more than the view's keeping the message's few header bytes alive.
  A payload that came in several parts (a state, a chunk larger than ``part_bytes``)
  is joined once.

Protobuf allows a message's fields in any order and parses a concatenation of
field encodings as one message, which is what makes this equivalent.

Reassembly rules for the streamed answers (``PullMean`` / ``PullState``) are in
:func:`mean_from_wire` and :func:`state_from_wire`: a malformed stream raises
``Rejected(INVALID_ARGUMENT)`` and nothing partial is returned.
"""

from __future__ import annotations

import json
from typing import Callable, Iterable, Iterator

from google.protobuf.message import DecodeError

from dtrain._proto.dtrain.v1 import peer_pb2 as pb
from dtrain.errors import RejectCode, Rejected
from dtrain.protocol import BucketMean, BucketState, Contribution, MeanChunk

__all__ = [
    "WireError",
    "contribution_wire_bytes",
    "encode_contribution",
    "decode_contribution",
    "mean_to_wire",
    "mean_from_wire",
    "state_to_wire",
    "state_from_wire",
]

# Field numbers of the bulk fields (peer.proto).
_CONTRIBUTION_PAYLOAD = 8
_MEAN_HEADER, _MEAN_CHUNK, _MEAN_DATA = 1, 2, 3
_STATE_HEADER, _STATE_THETA, _STATE_OPT = 1, 2, 3
_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5


class WireError(ValueError):
    """Bytes that are not a well-formed message of the expected type."""


def _varint(n: int) -> bytes:
    if n < 0:
        raise ValueError(f"cannot encode negative value {n} as an unsigned varint")
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len_prefix(field: int, length: int) -> bytes:
    """Key and length of a length-delimited field (the bytes themselves follow)."""
    return _varint(field << 3 | _WIRE_LEN) + _varint(length)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise WireError("varint longer than 10 bytes")


def split_fields(data: bytes, bulk: frozenset[int]) -> tuple[bytes, dict[int, memoryview]]:
    """Split an encoded message into (its other fields re-encoded, {bulk field: view}).

    Bulk fields must be length-delimited; a repeated one keeps the last value,
    as protobuf does. Raises ``WireError`` on truncation or unknown wire types.
    """
    view = memoryview(data)
    n = len(view)
    pos = 0
    rest: list[memoryview] = []
    found: dict[int, memoryview] = {}
    while pos < n:
        start = pos
        key, pos = _read_varint(view, pos)
        field, wire = key >> 3, key & 7
        if wire == _WIRE_VARINT:
            _, pos = _read_varint(view, pos)
        elif wire == _WIRE_I64:
            pos += 8
        elif wire == _WIRE_I32:
            pos += 4
        elif wire == _WIRE_LEN:
            length, pos = _read_varint(view, pos)
            if pos + length > n:
                raise WireError(f"field {field} claims {length} bytes, {n - pos} left")
            if field in bulk:
                found[field] = view[pos : pos + length]
                pos += length
                continue
            pos += length
        else:
            raise WireError(f"unsupported wire type {wire} (field {field})")
        if pos > n:
            raise WireError(f"field {field} is truncated")
        if field in bulk:
            raise WireError(f"field {field} must be length-delimited")
        rest.append(view[start:pos])
    return b"".join(rest), found


def _parse(cls, data: bytes):
    try:
        return cls.FromString(data)
    except DecodeError as e:
        raise WireError(f"not a {cls.__name__}: {e}") from e


# --------------------------------------------------------------------------- Push


def contribution_wire_bytes(c: Contribution) -> int:
    """Upper bound of the encoded size of ``c`` in bytes."""
    return len(c.payload) + len(c.codec.encode()) + len(c.sender.encode()) + 8 * 12


def encode_contribution(c: Contribution) -> bytes:
    """A ``ContributionChunk`` message for ``c``."""
    head = pb.ContributionChunk(
        round=c.round,
        bucket=c.bucket,
        chunk=c.chunk,
        offset=c.offset,
        numel=c.numel,
        codec=c.codec,
        sender=c.sender,
        tokens=c.tokens,
    ).SerializeToString()
    if not c.payload:
        return head
    return b"".join((head, _len_prefix(_CONTRIBUTION_PAYLOAD, len(c.payload)), c.payload))


def decode_contribution(data: bytes) -> Contribution:
    """The Contribution a ``ContributionChunk`` message carries; ``WireError`` if malformed."""
    rest, bulk = split_fields(data, frozenset((_CONTRIBUTION_PAYLOAD,)))
    m = _parse(pb.ContributionChunk, rest)
    payload = bulk.get(_CONTRIBUTION_PAYLOAD)
    return Contribution(
        round=m.round,
        bucket=m.bucket,
        chunk=m.chunk,
        offset=m.offset,
        numel=m.numel,
        codec=m.codec,
        sender=m.sender,
        payload=payload if payload is not None else b"",
        tokens=m.tokens,
    )


# --------------------------------------------------------------------------- PullMean / PullState


def _slices(data: bytes, part_bytes: int) -> Iterator[bytes | memoryview]:
    if len(data) <= part_bytes:
        yield data
        return
    view = memoryview(data)
    for off in range(0, len(data), part_bytes):
        yield view[off : off + part_bytes]


def _malformed(what: str, why: str) -> Rejected:
    return Rejected(RejectCode.INVALID_ARGUMENT, f"malformed {what} stream: {why}")


def mean_to_wire(
    mean: BucketMean, part_bytes: int, on_piece: Callable[[int], None] = lambda n: None
) -> Iterator[bytes]:
    """Encode ``mean`` as ``MeanPart`` messages of at most ``part_bytes`` payload each.

    The first part carries the header; the part that begins each chunk carries
    that chunk's header (with its total ``payload_bytes``); ``data`` holds the
    next slice of the chunk's payload. ``on_piece(n)`` gets each slice's length.
    """
    header = pb.MeanHeader(
        round=mean.round,
        bucket=mean.bucket,
        owner=mean.owner,
        checksum_before=mean.checksum_before,
        checksum_after=mean.checksum_after,
        num_chunks=len(mean.chunks),
    ).SerializeToString()
    pending = _len_prefix(_MEAN_HEADER, len(header)) + header
    for ch in mean.chunks:
        chunk_header = pb.MeanChunkHeader(
            chunk=ch.chunk,
            offset=ch.offset,
            numel=ch.numel,
            codec=ch.codec,
            senders=list(ch.senders),
            payload_bytes=len(ch.payload),
        ).SerializeToString()
        pending += _len_prefix(_MEAN_CHUNK, len(chunk_header)) + chunk_header
        for piece in _slices(ch.payload, part_bytes) if ch.payload else ():
            on_piece(len(piece))
            yield b"".join((pending, _len_prefix(_MEAN_DATA, len(piece)), piece))
            pending = b""
        if pending:  # a chunk with an empty payload
            yield pending
            pending = b""
    if pending:  # a mean without chunks
        yield pending


def _header_of(parsed, header, what: str):
    """The stream's header once a part is read: the one the part carries, or
    the one seen before; a missing or repeated header is malformed."""
    if parsed.HasField("header"):
        if header is not None:
            raise _malformed(what, "a second header")
        return parsed.header
    if header is None:
        raise _malformed(what, "the first part has no header")
    return header


def mean_from_wire(messages: Iterable[bytes], on_data: Callable[[int], None] = lambda n: None) -> BucketMean:
    """Reassemble a BucketMean from ``MeanPart`` messages.

    Raises ``Rejected(INVALID_ARGUMENT)`` when the stream is malformed (missing
    or repeated header, a chunk longer or shorter than announced, a wrong number
    of chunks, bytes that do not parse). ``on_data(n)`` gets each slice's length.
    """
    header: pb.MeanHeader | None = None
    chunks: list[MeanChunk] = []
    cur: pb.MeanChunkHeader | None = None
    pieces: list[memoryview] = []
    got = 0

    def finish() -> None:
        if cur is None:
            return
        if got != cur.payload_bytes:
            raise _malformed("mean", f"chunk {cur.chunk} has {got} bytes, announced {cur.payload_bytes}")
        chunks.append(
            MeanChunk(
                chunk=cur.chunk,
                offset=cur.offset,
                numel=cur.numel,
                codec=cur.codec,
                payload=pieces[0] if len(pieces) == 1 else b"".join(pieces),
                senders=tuple(cur.senders),
            )
        )

    for raw in messages:
        try:
            rest, bulk = split_fields(raw, frozenset((_MEAN_DATA,)))
            part = _parse(pb.MeanPart, rest)
        except WireError as e:
            raise _malformed("mean", str(e)) from None
        header = _header_of(part, header, "mean")
        if part.HasField("chunk"):
            finish()
            cur, pieces, got = part.chunk, [], 0
        data = bulk.get(_MEAN_DATA)
        if data is not None and len(data):
            if cur is None:
                raise _malformed("mean", "data before any chunk header")
            got += len(data)
            if got > cur.payload_bytes:
                raise _malformed("mean", f"chunk {cur.chunk} longer than announced {cur.payload_bytes} bytes")
            pieces.append(data)
            on_data(len(data))
    if header is None:
        raise _malformed("mean", "empty stream")
    finish()
    if len(chunks) != header.num_chunks:
        raise _malformed("mean", f"{len(chunks)} chunks, announced {header.num_chunks}")
    return BucketMean(
        round=header.round,
        bucket=header.bucket,
        owner=header.owner,
        chunks=tuple(chunks),
        checksum_before=header.checksum_before,
        checksum_after=header.checksum_after,
    )


def state_to_wire(
    state: BucketState, part_bytes: int, on_piece: Callable[[int], None] = lambda n: None
) -> Iterator[bytes]:
    """Encode ``state`` as ``StatePart`` messages: the header, then theta, then the
    optimizer state, in slices of at most ``part_bytes``. ``state.extra`` travels
    as JSON (``TypeError`` when it is not JSON-serialisable). ``on_piece(n)`` gets
    each slice's length."""
    header = pb.StateHeader(
        bucket=state.bucket,
        rounds_applied=state.rounds_applied,
        checksum=state.checksum,
        theta_bytes=len(state.theta),
        optimizer_state_bytes=len(state.optimizer_state),
        extra_json=json.dumps(state.extra, sort_keys=True) if state.extra else "",
    ).SerializeToString()
    pending = _len_prefix(_STATE_HEADER, len(header)) + header
    for field, data in ((_STATE_THETA, state.theta), (_STATE_OPT, state.optimizer_state)):
        for piece in _slices(data, part_bytes) if data else ():
            on_piece(len(piece))
            yield b"".join((pending, _len_prefix(field, len(piece)), piece))
            pending = b""
    if pending:  # empty theta and optimizer state
        yield pending


def state_from_wire(messages: Iterable[bytes], on_data: Callable[[int], None] = lambda n: None) -> BucketState:
    """Reassemble a BucketState from ``StatePart`` messages.

    Raises ``Rejected(INVALID_ARGUMENT)`` when the stream is malformed (no header,
    lengths other than announced, theta after optimizer state, bad extra JSON).
    """
    header: pb.StateHeader | None = None
    pieces: dict[int, list[memoryview]] = {_STATE_THETA: [], _STATE_OPT: []}
    got = {_STATE_THETA: 0, _STATE_OPT: 0}
    for raw in messages:
        try:
            rest, bulk = split_fields(raw, frozenset((_STATE_THETA, _STATE_OPT)))
            part = _parse(pb.StatePart, rest)
        except WireError as e:
            raise _malformed("state", str(e)) from None
        header = _header_of(part, header, "state")
        if len(bulk) > 1:
            raise _malformed("state", "a part with both theta and optimizer_state")
        for field, data in bulk.items():
            if field == _STATE_THETA and got[_STATE_OPT]:
                raise _malformed("state", "theta after optimizer_state")
            got[field] += len(data)
            limit = header.theta_bytes if field == _STATE_THETA else header.optimizer_state_bytes
            if got[field] > limit:
                raise _malformed("state", f"field {field} longer than announced {limit} bytes")
            pieces[field].append(data)
            on_data(len(data))
    if header is None:
        raise _malformed("state", "empty stream")
    if got[_STATE_THETA] != header.theta_bytes or got[_STATE_OPT] != header.optimizer_state_bytes:
        raise _malformed(
            "state",
            f"got theta {got[_STATE_THETA]} / optimizer_state {got[_STATE_OPT]} bytes, announced "
            f"{header.theta_bytes} / {header.optimizer_state_bytes}",
        )
    try:
        extra = json.loads(header.extra_json) if header.extra_json else {}
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the interpreter's limit
        raise _malformed("state", f"extra_json is not JSON: {e}") from None
    if not isinstance(extra, dict):
        raise _malformed("state", "extra_json is not a JSON object")
    return BucketState(
        bucket=header.bucket,
        rounds_applied=header.rounds_applied,
        theta=b"".join(pieces[_STATE_THETA]),
        optimizer_state=b"".join(pieces[_STATE_OPT]),
        checksum=header.checksum,
        extra=extra,
    )
