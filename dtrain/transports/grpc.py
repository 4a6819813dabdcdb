"""The gRPC peer transport: ``dtrain.transports.base.Transport`` over grpcio.

Server side, a ``Peer`` service (``proto/dtrain/v1/peer.proto``) hands each
request to the site's :class:`~dtrain.transports.base.PeerHandler`; client side,
``push`` / ``pull_mean`` / ``pull_state`` call the peers' services.

Wire rules (DESIGN.md, "Transport rules (gRPC)"):

* ``Push`` is client-streamed, one :class:`~dtrain.protocol.Contribution` per
  message; a contribution larger than ``max_message_bytes`` is refused before
  sending (``Rejected(RESOURCE_EXHAUSTED)``), and a server receiving one refuses it
  the same way.
* ``PullMean`` / ``PullState`` answers are server-streamed in parts of at most
  ``part_bytes`` of payload and reassembled here, so no single message nears the
  limit and a tensor past the protobuf 2 GiB cap still travels.
* Every call has a deadline (``timeout_s``); only UNAVAILABLE is retried
  (``grpc_common.call_with_retry``). Errors map to
  :class:`~dtrain.errors.PeerUnavailable` (UNAVAILABLE),
  :class:`~dtrain.errors.PeerTimeout` (DEADLINE_EXCEEDED) and
  :class:`~dtrain.errors.Rejected` (every other code, with the peer's reason).
* A handler's ``Rejected(code, reason)`` becomes ``context.abort(code, reason)``;
  any other handler exception is logged and becomes INTERNAL.
* Authentication (shared token, TLS/mTLS) and keepalive come from
  :class:`~dtrain.transports.grpc_common.GrpcTransportConfig`.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Callable, Iterable, Iterator, Sequence

import grpc

from dtrain._proto.dtrain.v1 import peer_pb2 as pb
from dtrain._proto.dtrain.v1 import peer_pb2_grpc as pb_grpc
from dtrain.errors import PeerUnavailable, RejectCode, Rejected, TransportError
from dtrain.protocol import BucketMean, BucketState, Contribution, MeanChunk
from dtrain.transports.base import PeerHandler, Transport
from dtrain.transports.grpc_common import (
    MESSAGE_OVERHEAD_BYTES,
    ChannelPool,
    GrpcTransportConfig,
    TlsConfig,
    abort_with,
    call_metadata,
    call_with_retry,
    check_timeout,
    start_server,
    to_transport_error,
)

__all__ = [
    "GrpcTransport",
    "GrpcTransportConfig",
    "TlsConfig",
    "NUM_ACCEPTED_METADATA_KEY",
    "contribution_to_proto",
    "contribution_from_proto",
    "mean_to_parts",
    "mean_from_parts",
    "state_to_parts",
    "state_from_parts",
]

log = logging.getLogger(__name__)

NUM_ACCEPTED_METADATA_KEY = "dtrain-num-accepted"
# Seconds the owner answers before the caller's deadline, so that a handler's
# own PeerTimeout (with its reason) reaches the caller instead of a bare deadline.
_HANDLER_MARGIN_S = 0.2


# --------------------------------------------------------------------------- conversions


_CONTRIBUTION_FIELDS = ("round", "bucket", "chunk", "offset", "numel", "codec", "sender", "payload")


def contribution_to_proto(c: Contribution) -> pb.ContributionChunk:
    """The wire message of ``c`` (same field names)."""
    return pb.ContributionChunk(**{f: getattr(c, f) for f in _CONTRIBUTION_FIELDS})


def contribution_from_proto(m: pb.ContributionChunk) -> Contribution:
    """The Contribution a wire message carries."""
    return Contribution(**{f: getattr(m, f) for f in _CONTRIBUTION_FIELDS})


def _contribution_wire_bytes(c: Contribution) -> int:
    """Upper bound of the serialized size of ``c`` (6 varints <= 10 bytes, 3 tags+lengths)."""
    return len(c.payload) + len(c.codec.encode()) + len(c.sender.encode()) + 6 * 11 + 3 * 11


def _slices(data: bytes, part_bytes: int) -> Iterator[bytes]:
    view = memoryview(data)
    for off in range(0, len(data), part_bytes):
        yield bytes(view[off : off + part_bytes])


def mean_to_parts(mean: BucketMean, part_bytes: int) -> Iterator[pb.MeanPart]:
    """Split ``mean`` into MeanParts of at most ``part_bytes`` payload each.

    The first part carries the header; the part that begins each chunk carries
    that chunk's header (with its total ``payload_bytes``).
    """
    header = pb.MeanHeader(
        round=mean.round,
        bucket=mean.bucket,
        owner=mean.owner,
        checksum_before=mean.checksum_before,
        checksum_after=mean.checksum_after,
        num_chunks=len(mean.chunks),
    )
    pending_header: pb.MeanHeader | None = header
    for ch in mean.chunks:
        chunk_header = pb.MeanChunkHeader(
            chunk=ch.chunk,
            offset=ch.offset,
            numel=ch.numel,
            codec=ch.codec,
            senders=list(ch.senders),
            payload_bytes=len(ch.payload),
        )
        pieces: Iterable[bytes] = _slices(ch.payload, part_bytes) if ch.payload else (b"",)
        for i, piece in enumerate(pieces):
            part = pb.MeanPart(data=piece)
            if i == 0:
                part.chunk.CopyFrom(chunk_header)
            if pending_header is not None:
                part.header.CopyFrom(pending_header)
                pending_header = None
            yield part
    if pending_header is not None:  # a mean without chunks
        yield pb.MeanPart(header=pending_header)


def _malformed(what: str, why: str) -> Rejected:
    return Rejected(RejectCode.INVALID_ARGUMENT, f"malformed {what} stream: {why}")


def _header_after(part, header, what: str):
    """The stream's header once ``part`` is read: the one ``part`` carries (a
    copy), or the one seen before; a missing or repeated header is malformed."""
    if part.HasField("header"):
        if header is not None:
            raise _malformed(what, "a second header")
        header = type(part.header)()
        header.CopyFrom(part.header)
    elif header is None:
        raise _malformed(what, "the first part has no header")
    return header


def mean_from_parts(parts: Iterable[pb.MeanPart], on_data: Callable[[int], None] = lambda n: None) -> BucketMean:
    """Reassemble a BucketMean from its parts; raises ``Rejected(INVALID_ARGUMENT)``
    when the stream is malformed (missing header, a chunk longer or shorter than
    announced, a wrong number of chunks). ``on_data(n)`` is called per part with
    its payload length."""
    header: pb.MeanHeader | None = None
    chunks: list[MeanChunk] = []
    cur: pb.MeanChunkHeader | None = None
    pieces: list[bytes] = []
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
                payload=b"".join(pieces),
                senders=tuple(cur.senders),
            )
        )

    for part in parts:
        header = _header_after(part, header, "mean")
        if part.HasField("chunk"):
            finish()
            cur = pb.MeanChunkHeader()
            cur.CopyFrom(part.chunk)
            pieces, got = [], 0
        if part.data:
            if cur is None:
                raise _malformed("mean", "data before any chunk header")
            got += len(part.data)
            if got > cur.payload_bytes:
                raise _malformed("mean", f"chunk {cur.chunk} longer than announced {cur.payload_bytes} bytes")
            pieces.append(part.data)
            on_data(len(part.data))
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


def state_to_parts(state: BucketState, part_bytes: int) -> Iterator[pb.StatePart]:
    """Split ``state`` into StateParts: the header, then theta, then the optimizer
    state, each in slices of at most ``part_bytes``. ``state.extra`` travels as JSON
    (``TypeError`` when it is not JSON-serialisable)."""
    header = pb.StateHeader(
        bucket=state.bucket,
        rounds_applied=state.rounds_applied,
        checksum=state.checksum,
        theta_bytes=len(state.theta),
        optimizer_state_bytes=len(state.optimizer_state),
        extra_json=json.dumps(state.extra, sort_keys=True) if state.extra else "",
    )
    pending_header: pb.StateHeader | None = header
    for name, data in (("theta", state.theta), ("optimizer_state", state.optimizer_state)):
        for piece in _slices(data, part_bytes):
            part = pb.StatePart(**{name: piece})
            if pending_header is not None:
                part.header.CopyFrom(pending_header)
                pending_header = None
            yield part
    if pending_header is not None:  # empty theta and optimizer state
        yield pb.StatePart(header=pending_header)


def state_from_parts(parts: Iterable[pb.StatePart], on_data: Callable[[int], None] = lambda n: None) -> BucketState:
    """Reassemble a BucketState; raises ``Rejected(INVALID_ARGUMENT)`` when the
    stream is malformed (no header, lengths other than announced, bad extra JSON)."""
    header: pb.StateHeader | None = None
    pieces: dict[str, list[bytes]] = {"theta": [], "optimizer_state": []}
    got = {"theta": 0, "optimizer_state": 0}
    for part in parts:
        header = _header_after(part, header, "state")
        which = part.WhichOneof("data")
        if which is None:
            continue
        data = getattr(part, which)
        if which == "theta" and got["optimizer_state"]:
            raise _malformed("state", "theta after optimizer_state")
        got[which] += len(data)
        limit = header.theta_bytes if which == "theta" else header.optimizer_state_bytes
        if got[which] > limit:
            raise _malformed("state", f"{which} longer than announced {limit} bytes")
        pieces[which].append(data)
        on_data(len(data))
    if header is None:
        raise _malformed("state", "empty stream")
    if got["theta"] != header.theta_bytes or got["optimizer_state"] != header.optimizer_state_bytes:
        raise _malformed(
            "state",
            f"got theta {got['theta']} / optimizer_state {got['optimizer_state']} bytes, announced "
            f"{header.theta_bytes} / {header.optimizer_state_bytes}",
        )
    try:
        extra = json.loads(header.extra_json) if header.extra_json else {}
    except ValueError as e:
        raise _malformed("state", f"extra_json is not JSON: {e}") from e
    if not isinstance(extra, dict):
        raise _malformed("state", "extra_json is not a JSON object")
    return BucketState(
        bucket=header.bucket,
        rounds_applied=header.rounds_applied,
        theta=b"".join(pieces["theta"]),
        optimizer_state=b"".join(pieces["optimizer_state"]),
        checksum=header.checksum,
        extra=extra,
    )


# --------------------------------------------------------------------------- server


def _run_handler(what: str, fn: Callable[[], object]) -> tuple[object, TransportError | None]:
    """Call a handler; return (result, None) or (None, the error to abort with)."""
    try:
        return fn(), None
    except TransportError as e:
        return None, e
    except Exception as e:  # a handler bug must not kill the server thread silently
        log.exception("%s: handler raised", what)
        return None, TransportError("INTERNAL", f"handler error in {what}: {type(e).__name__}: {e}")


class _PeerServicer(pb_grpc.PeerServicer):
    def __init__(self, transport: "GrpcTransport", handler: PeerHandler) -> None:
        self._t = transport
        self._handler = handler

    def Push(self, request_iterator, context):
        accepted = 0
        received = 0
        for msg in request_iterator:
            c = contribution_from_proto(msg)
            self._t._count(received=len(c.payload))
            _, err = _run_handler("Push", lambda: self._handler.handle_contribution(c))
            if err is not None:
                log.info("refused chunk r%d b%d c%d from %s: %s", c.round, c.bucket, c.chunk, c.sender, err)
                context.set_trailing_metadata(((NUM_ACCEPTED_METADATA_KEY, str(accepted)),))
                abort_with(context, err.code, err.reason)
            accepted += 1
            received += len(c.payload)
        context.set_trailing_metadata(((NUM_ACCEPTED_METADATA_KEY, str(accepted)),))
        return pb.PushReply(num_accepted=accepted, payload_bytes=received)

    def _handler_timeout_s(self, requested_ms: int, context) -> float:
        wait_s = requested_ms / 1000.0
        remaining = context.time_remaining()
        if remaining is not None:
            wait_s = min(wait_s, remaining - min(_HANDLER_MARGIN_S, 0.1 * remaining))
        return max(0.0, wait_s)

    def PullMean(self, request, context):
        wait_s = self._handler_timeout_s(request.timeout_ms, context)
        mean, err = _run_handler(
            "PullMean", lambda: self._handler.handle_pull_mean(request.round, request.bucket, request.requester, wait_s)
        )
        if err is not None:
            abort_with(context, err.code, err.reason)
        for part in mean_to_parts(mean, self._t.config.part_bytes):
            self._t._count(sent=len(part.data))
            yield part

    def PullState(self, request, context):
        state, err = _run_handler("PullState", lambda: self._handler.handle_pull_state(request.bucket, request.requester))
        if err is not None:
            abort_with(context, err.code, err.reason)
        try:
            for part in state_to_parts(state, self._t.config.part_bytes):
                which = part.WhichOneof("data")
                self._t._count(sent=len(getattr(part, which)) if which else 0)
                yield part
        except TypeError as e:
            log.error("PullState bucket %d: BucketState.extra is not JSON-serialisable: %s", request.bucket, e)
            abort_with(context, "INTERNAL", f"BucketState.extra is not JSON-serialisable: {e}")


# --------------------------------------------------------------------------- transport


class GrpcTransport(Transport):
    """The peer transport over gRPC (one instance per site).

    Args:
        config: see :class:`GrpcTransportConfig`; default plaintext on 127.0.0.1, port 0.

    Attributes:
        address: ``host:port`` peers dial, set by :meth:`start`.
    """

    def __init__(self, config: GrpcTransportConfig | None = None) -> None:
        self.config = config or GrpcTransportConfig()
        self.address: str | None = None
        self._server: grpc.Server | None = None
        self._pool: ChannelPool[pb_grpc.PeerStub] = ChannelPool(self.config, pb_grpc.PeerStub)
        self._metadata = call_metadata(self.config)
        self._count_lock = threading.Lock()
        self._sent = 0
        self._received = 0
        self._stopped = False

    # -- counters
    def _count(self, *, sent: int = 0, received: int = 0) -> None:
        with self._count_lock:
            self._sent += sent
            self._received += received

    def bytes_sent(self) -> int:
        """Payload bytes sent, as a client (pushed chunks) and as a server (means, states)."""
        with self._count_lock:
            return self._sent

    def bytes_received(self) -> int:
        """Payload bytes received, as a server (pushed chunks) and as a client (means, states)."""
        with self._count_lock:
            return self._received

    # -- server
    def start(self, handler: PeerHandler) -> str:
        """Serve ``handler``; return ``"host:port"`` (the advertised host, the bound port).

        Raises ``OSError`` when the port cannot be bound, ``RuntimeError`` when
        already started or stopped.
        """
        if self._server is not None or self._stopped:
            raise RuntimeError("GrpcTransport.start: already started (or stopped); use a new instance")
        servicer = _PeerServicer(self, handler)
        self._server, port = start_server(
            self.config, lambda s: pb_grpc.add_PeerServicer_to_server(servicer, s), name="peer"
        )
        self.address = f"{self.config.advertised_host()}:{port}"
        log.info("peer service listening on %s (tls=%s)", self.address, self.config.tls is not None)
        return self.address

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (in-flight calls get ``grace_s`` s) and close all channels.

        Afterwards every client call of this transport raises ``PeerUnavailable``.
        """
        self._stopped = True
        if self._server is not None:
            self._server.stop(grace_s).wait()
        self._pool.close()

    # -- client
    def _check_running(self) -> None:
        if self._stopped:
            raise PeerUnavailable("transport stopped")

    def _call(self, address: str, what: str, timeout_s: float, fn: Callable[[pb_grpc.PeerStub, float], object]):
        self._check_running()
        try:
            return call_with_retry(
                lambda remaining: fn(self._pool.stub(address), remaining),
                timeout_s=timeout_s,
                cfg=self.config,
                what=f"{what} {address}",
            )
        except grpc.RpcError as e:
            err = to_transport_error(e, f"{what} {address}")
            if isinstance(err, Rejected):
                err.num_accepted = _num_accepted(e)
            raise err from None

    def push(self, address: str, contributions: Sequence[Contribution], *, timeout_s: float) -> int:
        """Stream ``contributions`` to ``address`` in order; return how many the peer accepted.

        Raises ``Rejected`` (the peer's first refusal, with its code and reason; the
        exception's ``num_accepted`` attribute says how many earlier chunks were
        accepted, when the peer said), ``PeerUnavailable`` (after the retries),
        ``PeerTimeout`` (deadline ``timeout_s`` passed), ``Rejected(RESOURCE_EXHAUSTED)``
        before sending when a contribution would exceed ``max_message_bytes``.
        A retried push (UNAVAILABLE mid-stream) re-sends every chunk; owners treat
        a repeated chunk as idempotent.
        """
        check_timeout(timeout_s)
        contributions = list(contributions)
        limit = self.config.max_message_bytes
        for c in contributions:
            if _contribution_wire_bytes(c) > limit:
                raise Rejected(
                    RejectCode.RESOURCE_EXHAUSTED,
                    f"contribution r{c.round} b{c.bucket} c{c.chunk} is {len(c.payload)} payload bytes; "
                    f"max_message_bytes is {limit} (split buckets into smaller chunks)",
                )

        def requests() -> Iterator[pb.ContributionChunk]:
            for c in contributions:
                msg = contribution_to_proto(c)
                self._count(sent=len(c.payload))
                yield msg

        def attempt(stub: pb_grpc.PeerStub, remaining: float) -> int:
            return stub.Push(requests(), timeout=remaining, metadata=self._metadata).num_accepted

        return self._call(address, "push to", timeout_s, attempt)

    def pull_mean(self, address: str, round: int, bucket: int, *, requester: str, timeout_s: float) -> BucketMean:
        """Fetch the finalized mean of ``bucket`` for ``round`` from its owner.

        The owner waits for finalization until shortly before ``timeout_s``.
        Raises ``PeerTimeout`` (not final in time, or the deadline passed),
        ``Rejected`` (e.g. NOT_FOUND / FAILED_PRECONDITION from the owner, or
        INVALID_ARGUMENT for a malformed stream), ``PeerUnavailable``.
        """
        check_timeout(timeout_s)
        request = pb.PullMeanRequest(round=round, bucket=bucket, requester=requester, timeout_ms=int(timeout_s * 1000))

        def attempt(stub: pb_grpc.PeerStub, remaining: float) -> BucketMean:
            stream = stub.PullMean(request, timeout=remaining, metadata=self._metadata)
            return mean_from_parts(stream, lambda n: self._count(received=n))

        return self._call(address, "pull_mean from", timeout_s, attempt)

    def pull_state(self, address: str, bucket: int, *, requester: str, timeout_s: float) -> BucketState:
        """Fetch the whole state of ``bucket`` (θ_b, outer-optimizer state) from ``address``.

        Raises ``PeerTimeout``, ``Rejected`` (the peer's refusal, or
        INVALID_ARGUMENT for a malformed stream), ``PeerUnavailable``. Nothing
        partial is returned.
        """
        check_timeout(timeout_s)
        request = pb.PullStateRequest(bucket=bucket, requester=requester)

        def attempt(stub: pb_grpc.PeerStub, remaining: float) -> BucketState:
            stream = stub.PullState(request, timeout=remaining, metadata=self._metadata)
            return state_from_parts(stream, lambda n: self._count(received=n))

        return self._call(address, "pull_state from", timeout_s, attempt)

    def channels(self, address: str) -> Sequence[grpc.Channel]:
        """The open channels to ``address`` (for tests and diagnostics)."""
        return self._pool.channels(address)


def _num_accepted(err: BaseException | None) -> int | None:
    """The ``dtrain-num-accepted`` trailing metadata of a failed Push, if any."""
    trailing = getattr(err, "trailing_metadata", None)
    if not callable(trailing):
        return None
    for key, value in trailing() or ():
        if key == NUM_ACCEPTED_METADATA_KEY:
            try:
                return int(value)
            except ValueError:
                return None
    return None

