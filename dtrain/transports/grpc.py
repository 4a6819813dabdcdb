"""The gRPC peer transport: ``dtrain.transports.base.Transport`` over grpcio.

Server side, a ``Peer`` service (``proto/dtrain/v1/peer.proto``) hands each
request to the site's :class:`~dtrain.transports.base.PeerHandler`; client side,
``push`` / ``pull_mean`` / ``pull_state`` call the peers' services.

Wire rules (docs/ARCHITECTURE.md, "Transport rules"):

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
* The server is asynchronous (:mod:`dtrain.transports.grpc_server`): the
  blocking handler runs in a thread pool per method, a stream between messages
  holds no thread, a Push stream idle for ``stream_idle_timeout_s`` is ended,
  ``max_streams_per_sender`` and ``max_concurrent_rpcs`` bound the calls (past
  them: RESOURCE_EXHAUSTED at once) and ``max_wait_ms`` caps a pull's wait. It
  serves the standard ``grpc.health.v1.Health`` service too.
* ``Probe`` streams filler bytes back (at most ``PROBE_MAX_BYTES``, parts of at most
  ``PROBE_MAX_PART_BYTES``) for a joining site's link probe (:meth:`GrpcTransport.probe_link`);
  ``max_streams_per_sender`` probes per sender at a time; its bytes are not counted in ``bytes_sent``.
* Authentication (shared token, TLS/mTLS) and keepalive come from
  :class:`~dtrain.transports.grpc_common.GrpcTransportConfig`.
* The bulk messages are peer.proto's, encoded and decoded by
  :mod:`dtrain.transports.grpc_wire` so that payloads skip the protobuf runtime's
  copies; any other implementation of peer.proto interoperates.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from typing import Callable, Iterator, Sequence, TypeVar

import grpc

from dtrain._proto.dtrain.v1 import peer_pb2 as pb
from dtrain.errors import PeerUnavailable, RejectCode, Rejected, TransportError
from dtrain.protocol import BucketMean, BucketState, Contribution
from dtrain.transports.base import LinkProbe, PeerHandler, Transport
from dtrain.transports.grpc_common import (
    ChannelPool,
    GrpcTransportConfig,
    TlsConfig,
    call_metadata,
    call_with_retry,
    check_timeout,
    to_transport_error,
)
from dtrain.transports.grpc_server import AioServer, abort
from dtrain.transports.grpc_wire import (
    WireError,
    contribution_wire_bytes,
    decode_contribution,
    encode_contribution,
    mean_from_wire,
    mean_to_wire,
    state_from_wire,
    state_to_wire,
)
from dtrain.transports.heap import keep_freed_memory

__all__ = [
    "GrpcTransport",
    "GrpcTransportConfig",
    "TlsConfig",
    "NUM_ACCEPTED_METADATA_KEY",
    "PEER_SERVICE",
    "PUSH_PART_METADATA_KEY",
    "push_parts",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

NUM_ACCEPTED_METADATA_KEY = "dtrain-num-accepted"
#: Metadata of a push sent as several streams (``num_channels_per_peer`` > 1): ``"i/k"``, this
#: stream is part i of k (0 <= i < k <= 64); absent: the whole push in one stream.
PUSH_PART_METADATA_KEY = "dtrain-push-part"
PEER_SERVICE = pb.DESCRIPTOR.services_by_name["Peer"].full_name  # "dtrain.v1.Peer"
# Seconds the owner answers before the caller's deadline, so that a handler's
# own PeerTimeout (with its reason) reaches the caller instead of a bare deadline.
_HANDLER_MARGIN_S = 0.2
# A PullMean waiting for its bucket looks again at least this often (seconds), besides
# whenever the handler's means change: a round that never opens is refused after plan_wait_s.
_REPOLL_S = 0.5
#: The most filler bytes one Probe call streams back, and the largest part: a token
#: holder cannot make a peer send more than this per call (one call per sender at a time).
PROBE_MAX_BYTES = 4 << 20
PROBE_MAX_PART_BYTES = 64 << 10
_PROBE_FILLER = bytes(PROBE_MAX_PART_BYTES)


# --------------------------------------------------------------------------- server


#: A push stream that ends within this many seconds of its call's own deadline ended by the
#: sender's deadline (the grpc-timeout it sent), not by a broken connection.
CALL_DEADLINE_SLACK_S = 1.0


def _push_part(metadata) -> tuple[int, int] | Rejected:
    """The ``(i, k)`` a Push stream's :data:`PUSH_PART_METADATA_KEY` says (``(0, 1)`` without
    it); a malformed one (the metadata comes from a token holder) as the refusal to send."""
    raw = next((v for k, v in metadata if k == PUSH_PART_METADATA_KEY), None)
    if raw is None:
        return (0, 1)
    try:
        i, k = (int(x) for x in str(raw).split("/"))
    except ValueError:
        i = k = -1
    if not 0 <= i < k <= 64:
        return Rejected(
            RejectCode.INVALID_ARGUMENT, f"{PUSH_PART_METADATA_KEY} must be 'i/k' with 0 <= i < k <= 64, got {raw!r}"
        )
    return (i, k)


def push_parts(contributions: Sequence[Contribution], k: int) -> list[Sequence[Contribution]]:
    """``contributions`` cut into at most ``k`` consecutive, non-empty slices of about equal
    payload bytes (whole chunks; order kept): the streams of a push over ``k`` connections."""
    k = max(1, min(k, len(contributions)))
    if k == 1:
        return [contributions]
    total = sum(len(c.payload) for c in contributions) or 1
    parts, start, acc = [], 0, 0
    for j, c in enumerate(contributions):
        acc += len(c.payload)
        cut = len(parts) + 1  # the slice being filled ends once it holds its share of the bytes
        if cut < k and acc * k >= total * cut and len(contributions) - (j + 1) >= k - cut:
            parts.append(contributions[start : j + 1])
            start = j + 1
    parts.append(contributions[start:])
    return parts


def _at_call_deadline(context) -> bool:
    """Whether the call's own deadline (the client's, carried as grpc-timeout) has passed or is
    within :data:`CALL_DEADLINE_SLACK_S`: a stream cancelled then ran out of the sender's time.
    A sender whose plan reckoning put its reduce deadline a second before the owner's was
    taken for dead at 30% loss (a false death and a round of unequal θ, the reliability run)."""
    try:
        left = context.time_remaining()
    except Exception:  # noqa: BLE001 - a context without a deadline API: no evidence either way
        return False
    return left is not None and left <= CALL_DEADLINE_SLACK_S


def _run_handler(what: str, fn: Callable[[], T]) -> tuple[T | None, TransportError | None]:
    """Call a handler; return (result, None) or (None, the error to abort with)."""
    try:
        return fn(), None
    except TransportError as e:
        return None, e
    except Exception as e:  # a handler bug must not kill the server silently
        log.exception("%s: handler raised", what)
        return None, TransportError(RejectCode.INTERNAL, f"handler error in {what}: {type(e).__name__}: {e}")


class _PeerServicer:
    """Serves the Peer service on the transport's asyncio server. Push requests
    arrive as raw bytes and pull answers leave as raw bytes (``grpc_wire``), so
    payloads are copied as little as possible.

    The site's handler is blocking: it runs in the server's thread pool of its
    method. A Push stream between two messages holds no thread; one idle for
    ``stream_idle_timeout_s`` is ended. Each method allows
    ``max_streams_per_sender`` calls per sender at once (RESOURCE_EXHAUSTED past it).
    """

    def __init__(self, transport: "GrpcTransport", handler: PeerHandler, server: AioServer) -> None:
        self._t = transport
        self._handler = handler
        self.server = server
        self._wake = asyncio.Event()  # replaced and set (on the loop) when the handler's means change
        self._num_pulls = 0  # PullMean calls running (max_waiting_pulls)
        self._poll = getattr(handler, "poll_pull_mean", None)
        listeners = getattr(handler, "mean_listeners", None)
        if self._poll is not None and listeners is not None:
            listeners.append(self._means_changed)
        else:
            self._poll = None  # a handler without listeners: the blocking form in the pool

    def _means_changed(self) -> None:
        """From any thread: wake every PullMean waiting here (they look again)."""
        try:
            self.server.call_soon(self._fire)
        except RuntimeError:  # the server's loop is closed (stopped)
            pass

    def _fire(self) -> None:
        old, self._wake = self._wake, asyncio.Event()
        old.set()

    def register(self, server: grpc.aio.Server) -> list[str]:
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    PEER_SERVICE,
                    {
                        "Push": grpc.stream_unary_rpc_method_handler(
                            self.Push, request_deserializer=None, response_serializer=pb.PushReply.SerializeToString
                        ),
                        "PullMean": grpc.unary_stream_rpc_method_handler(
                            self.PullMean, request_deserializer=pb.PullMeanRequest.FromString, response_serializer=None
                        ),
                        "PullState": grpc.unary_stream_rpc_method_handler(
                            self.PullState,
                            request_deserializer=pb.PullStateRequest.FromString,
                            response_serializer=None,
                        ),
                        "Probe": grpc.unary_stream_rpc_method_handler(
                            self.Probe,
                            request_deserializer=pb.ProbeRequest.FromString,
                            response_serializer=pb.ProbePart.SerializeToString,
                        ),
                    },
                ),
            )
        )
        return [PEER_SERVICE]

    async def _next_message(self, context, it) -> bytes | None:
        """The stream's next message, None at its end; aborts an idle stream."""
        idle_s = self._t.config.stream_idle_timeout_s
        try:
            return await asyncio.wait_for(it.__anext__(), idle_s)
        except StopAsyncIteration:
            return None
        except asyncio.TimeoutError:
            log.info("ended a Push stream from %s: no message for %.1f s", context.peer(), idle_s)
            await abort(context, "DEADLINE_EXCEEDED", f"Push stream idle for {idle_s:g} s (stream_idle_timeout_s)")
        raise AssertionError("unreachable")

    async def _refuse(self, context, accepted: int, err: TransportError) -> None:
        log.info("refused chunk %d of a push from %s: %s", accepted, context.peer(), err)
        context.set_trailing_metadata(((NUM_ACCEPTED_METADATA_KEY, str(accepted)),))
        await abort(context, err.code, err.reason)

    async def Push(self, request_iterator, context) -> pb.PushReply:
        accepted = received = 0
        sender: str | None = None
        rnd = 0
        it = request_iterator.__aiter__()
        part = _push_part(context.invocation_metadata() or ())
        try:
            while (raw := await self._next_message(context, it)) is not None:
                try:
                    c = decode_contribution(raw)
                except WireError as e:
                    err = Rejected(RejectCode.INVALID_ARGUMENT, f"malformed ContributionChunk: {e}")
                    await self._refuse(context, accepted, err)
                if sender is None:
                    if isinstance(part, Rejected):  # refused at the first message: the stream is read from
                        await self._refuse(context, 0, part)
                    full = self.server.limiter.acquire("Push", c.sender)
                    if full is not None:
                        await self._refuse(context, accepted, Rejected(RejectCode.RESOURCE_EXHAUSTED, full))
                    sender, rnd = c.sender, c.round
                elif c.sender != sender:
                    reason = f"a Push stream carries one sender's chunks: {sender!r}, then {c.sender!r}"
                    await self._refuse(context, accepted, Rejected(RejectCode.INVALID_ARGUMENT, reason))
                self._t._count(received=len(c.payload))
                _, err = await self.server.run_blocking(
                    "Push", lambda c=c: _run_handler("Push", lambda: self._handler.handle_contribution(c))
                )
                if err is not None:
                    await self._refuse(context, accepted, err)
                accepted += 1
                received += len(c.payload)
            if accepted and (ended := getattr(self._handler, "handle_push_ended", None)) is not None:
                # grpc.aio ends the request stream alike whether the client closed it or
                # its connection broke (the sender died): the handler tells them apart
                due = _at_call_deadline(context)
                await self.server.run_blocking(
                    "Push",
                    lambda: _run_handler("Push", lambda: ended(sender, rnd, accepted, at_deadline=due, part=part)),
                )
        except asyncio.CancelledError:
            # The sender's connection broke while this coroutine awaited a chunk's handling
            # (grpc.aio cancels the RPC then instead of ending the stream): the stream
            # ended short all the same, so the handler hears of it (not awaited: the task
            # is being cancelled); without this the owner waited for the dead sender's
            # chunks until the reduce deadline.
            if sender is not None and (ended := getattr(self._handler, "handle_push_ended", None)) is not None:
                n, who, due = accepted, sender, _at_call_deadline(context)
                self.server.pool("Push").submit(
                    _run_handler, "Push", lambda: ended(who, rnd, n, at_deadline=due, part=part)
                )
            raise
        finally:
            if sender is not None:
                self.server.limiter.release("Push", sender)
        context.set_trailing_metadata(((NUM_ACCEPTED_METADATA_KEY, str(accepted)),))
        return pb.PushReply(num_accepted=accepted, payload_bytes=received)

    def _handler_timeout_s(self, requested_ms: int, context) -> float:
        wait_s = min(requested_ms, self._t.config.max_wait_ms) / 1000.0
        remaining = context.time_remaining()
        if remaining is not None:
            wait_s = min(wait_s, remaining - min(_HANDLER_MARGIN_S, 0.1 * remaining))
        return max(0.0, wait_s)

    async def _limited(self, method: str, requester: str, context, fn: Callable[[], T]) -> T:
        """Run ``fn`` in ``method``'s pool within ``requester``'s limit; abort on its error."""
        full = self.server.limiter.acquire(method, requester)
        if full is not None:
            await abort(context, RejectCode.RESOURCE_EXHAUSTED, full)
        try:
            result, err = await self.server.run_blocking(method, lambda: _run_handler(method, fn))
        finally:
            self.server.limiter.release(method, requester)
        if err is not None:
            await abort(context, err.code, err.reason)
        return result  # type: ignore[return-value]

    async def PullMean(self, request, context):
        wait_s = self._handler_timeout_s(request.timeout_ms, context)
        if self._num_pulls >= self._t.config.max_waiting_pulls:
            reason = f"{self._num_pulls} PullMean calls already wait here (max_waiting_pulls)"
            await abort(context, RejectCode.RESOURCE_EXHAUSTED, reason)
        self._num_pulls += 1
        try:
            if self._poll is None:
                mean = await self._limited(
                    "PullMean",
                    request.requester,
                    context,
                    lambda: self._handler.handle_pull_mean(
                        request.round, request.bucket, request.requester, wait_s, have_checksum=request.have_checksum
                    ),
                )
            else:
                mean = await self._wait_mean(request, context, wait_s)
        finally:
            self._num_pulls -= 1
        for part in mean_to_wire(mean, self._t.config.part_size, lambda n: self._t._count(sent=n)):
            yield part

    async def _wait_mean(self, request, context, wait_s: float):
        """The mean of ``request``'s bucket, waiting up to ``wait_s`` as a coroutine: each
        look (``poll_pull_mean``) is a short job in the pool; between looks the call waits
        for the handler's means to change (or ``_REPOLL_S``, for its plan_wait_s rule)."""
        full = self.server.limiter.acquire("PullMean", request.requester)
        if full is not None:
            await abort(context, RejectCode.RESOURCE_EXHAUSTED, full)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            while True:
                wake, waited = self._wake, loop.time() - t0  # taken before looking: no change is missed
                look = functools.partial(
                    self._poll,
                    request.round,
                    request.bucket,
                    request.requester,
                    waited_s=waited,
                    last=waited >= wait_s,
                    have_checksum=request.have_checksum,
                )
                mean, err = await self.server.run_blocking("PullMean", lambda: _run_handler("PullMean", look))
                if err is not None:
                    await abort(context, err.code, err.reason)
                if mean is not None:
                    return mean
                left = wait_s - (loop.time() - t0)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), max(0.0, min(left, _REPOLL_S)))
        finally:
            self.server.limiter.release("PullMean", request.requester)

    async def PullState(self, request, context):
        state = await self._limited(
            "PullState",
            request.requester,
            context,
            lambda: self._handler.handle_pull_state(request.bucket, request.requester),
        )
        parts = state_to_wire(state, self._t.config.part_size, lambda n: self._t._count(sent=n))
        try:
            first = next(parts)  # the header: BucketState.extra is encoded here
        except TypeError as e:
            log.error("PullState bucket %d: BucketState.extra is not JSON-serialisable: %s", request.bucket, e)
            await abort(context, RejectCode.INTERNAL, f"BucketState.extra is not JSON-serialisable: {e}")
        yield first
        for part in parts:  # lazily: a bucket's state is not copied whole
            yield part

    async def Probe(self, request, context):
        """Stream ``request.bytes`` filler bytes (capped) in parts; 0 bytes: one empty part."""
        full = self.server.limiter.acquire("Probe", request.requester)
        if full is not None:
            await abort(context, RejectCode.RESOURCE_EXHAUSTED, full)
        try:
            left = min(request.bytes, PROBE_MAX_BYTES)
            part = min(request.part_bytes or 16 << 10, PROBE_MAX_PART_BYTES)
            if left == 0:
                yield pb.ProbePart()
            while left > 0:
                n = min(part, left)
                left -= n
                yield pb.ProbePart(data=_PROBE_FILLER[:n])
        finally:
            self.server.limiter.release("Probe", request.requester)


# --------------------------------------------------------------------------- transport


class _PeerStub:
    """Client side of the Peer service; bulk messages travel as raw bytes (``grpc_wire``)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.Push = channel.stream_unary(
            f"/{PEER_SERVICE}/Push", request_serializer=None, response_deserializer=pb.PushReply.FromString
        )
        self.PullMean = channel.unary_stream(
            f"/{PEER_SERVICE}/PullMean",
            request_serializer=pb.PullMeanRequest.SerializeToString,
            response_deserializer=None,
        )
        self.PullState = channel.unary_stream(
            f"/{PEER_SERVICE}/PullState",
            request_serializer=pb.PullStateRequest.SerializeToString,
            response_deserializer=None,
        )
        self.Probe = channel.unary_stream(
            f"/{PEER_SERVICE}/Probe",
            request_serializer=pb.ProbeRequest.SerializeToString,
            response_deserializer=pb.ProbePart.FromString,
        )


class GrpcTransport(Transport):
    """The peer transport over gRPC (one instance per site).

    Args:
        config: see :class:`GrpcTransportConfig`; default plaintext on 127.0.0.1, port 0.

    Attributes:
        address: ``host:port`` peers dial, set by :meth:`start`.
    """

    def __init__(self, config: GrpcTransportConfig | None = None) -> None:
        self.config = config or GrpcTransportConfig()
        keep_freed_memory(self.config.heap_keep_bytes)  # received messages reuse memory (heap.py)
        self.address: str | None = None
        self._server: AioServer | None = None
        self._pool: ChannelPool[_PeerStub] = ChannelPool(self.config, _PeerStub)
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

        Raises ``BindError`` (an ``OSError``) when the port cannot be bound, ``RuntimeError`` when
        already started or stopped.
        """
        if self._server is not None or self._stopped:
            raise RuntimeError("GrpcTransport.start: already started (or stopped); use a new instance")
        server = AioServer(self.config, "peer")
        server.start(_PeerServicer(self, handler, server).register)
        self._server = server
        self.address = f"{self.config.advertised_host()}:{self._server.port}"
        log.info("peer service listening on %s (tls=%s)", self.address, self.config.tls is not None)
        return self.address

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (in-flight calls get ``grace_s`` s) and close all channels.

        Afterwards every client call of this transport raises ``PeerUnavailable``.
        """
        self._stopped = True
        if self._server is not None:
            self._server.stop(grace_s)
        self._pool.close()

    # -- client
    def _check_running(self) -> None:
        if self._stopped:
            raise PeerUnavailable("transport stopped")

    def _call(
        self,
        address: str,
        what: str,
        timeout_s: float,
        fn: Callable[[_PeerStub, float], object],
        channel: int | None = None,
    ):
        """``fn(stub, remaining_s)`` with retries; ``channel``: that one of the peer's channels
        (its index), else the next one round-robin."""
        self._check_running()
        used: list[_PeerStub] = []

        def attempt(remaining: float) -> object:
            used.append(self._pool.stub(address, channel))
            return fn(used[-1], remaining)

        try:
            return call_with_retry(attempt, timeout_s=timeout_s, cfg=self.config, what=f"{what} {address}")
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and used:  # a stalled connection: a new one
                self._pool.renew(address, used[-1])
            err = to_transport_error(e, f"{what} {address}")
            if isinstance(err, Rejected):
                err.num_accepted = _num_accepted(e)
            raise err from None

    def push(
        self,
        address: str,
        contributions: Sequence[Contribution],
        *,
        timeout_s: float,
        pace: Callable[[int], None] | None = None,
    ) -> int:
        """Stream ``contributions`` to ``address`` in order; return how many the peer accepted.

        With ``num_channels_per_peer`` = k > 1 the push goes as up to k streams at once, one
        per connection, each a consecutive slice of about equal bytes (:func:`push_parts`),
        marked ``i/k`` (:data:`PUSH_PART_METADATA_KEY`) so that the owner judges a short
        stream only once every part ended: on a lossy long-RTT path each TCP connection
        grows its own window (loss-based congestion control, e.g. reno/cubic, fills such
        a path only with several flows).

        Raises ``Rejected`` (the peer's first refusal, with its code and reason; the
        exception's ``num_accepted`` attribute says how many earlier chunks of that stream
        were accepted, when the peer said), ``PeerUnavailable`` (after the retries),
        ``PeerTimeout`` (deadline ``timeout_s`` passed), ``Rejected(RESOURCE_EXHAUSTED)``
        before sending when a contribution would exceed ``max_message_bytes``. With several
        streams every stream runs to its end and the first error (by part) is raised.
        A retried push (UNAVAILABLE mid-stream) re-sends every chunk of that stream; owners
        treat a repeated chunk as idempotent.
        """
        check_timeout(timeout_s)
        contributions = list(contributions)
        limit = self.config.max_message_bytes
        for c in contributions:
            if contribution_wire_bytes(c) > limit:
                raise Rejected(
                    RejectCode.RESOURCE_EXHAUSTED,
                    f"contribution r{c.round} b{c.bucket} c{c.chunk} is {len(c.payload)} payload bytes; "
                    f"max_message_bytes is {limit} (split buckets into smaller chunks)",
                )

        parts = push_parts(contributions, self.config.num_channels_per_peer)
        if len(parts) == 1:
            return self._push_part(address, parts[0], timeout_s, pace, None)
        deadline = time.monotonic() + timeout_s
        results: list[int | Exception] = [0] * len(parts)

        def run(i: int) -> None:
            try:
                results[i] = self._push_part(
                    address, parts[i], max(0.01, deadline - time.monotonic()), pace, (i, len(parts))
                )
            except Exception as e:  # raised in the caller's thread below, whatever it is
                results[i] = e

        threads = [
            threading.Thread(target=run, args=(i,), name=f"push-part-{i}", daemon=True) for i in range(1, len(parts))
        ]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise errors[0]
        return sum(results)  # type: ignore[arg-type]

    def _push_part(
        self,
        address: str,
        contributions: Sequence[Contribution],
        timeout_s: float,
        pace: Callable[[int], None] | None,
        part: tuple[int, int] | None,
    ) -> int:
        """One push stream (part ``(i, k)`` on channel i, or the whole push on the next channel)."""
        metadata = (
            self._metadata if part is None else (*self._metadata, (PUSH_PART_METADATA_KEY, f"{part[0]}/{part[1]}"))
        )

        def requests() -> Iterator[bytes]:
            for c in contributions:
                if pace is not None:  # here, not while listing: gRPC sends each message as it is yielded
                    pace(len(c.payload))
                msg = encode_contribution(c)
                self._count(sent=len(c.payload))
                yield msg

        def attempt(stub: _PeerStub, remaining: float) -> int:
            return stub.Push(requests(), timeout=remaining, metadata=metadata).num_accepted

        return self._call(address, "push to", timeout_s, attempt, None if part is None else part[0])

    def pull_mean(
        self, address: str, round: int, bucket: int, *, requester: str, timeout_s: float, have_checksum: str = ""
    ) -> BucketMean:
        """Fetch the finalized mean of ``bucket`` for ``round`` from its owner.

        The owner waits for finalization until shortly before ``timeout_s``.
        Raises ``PeerTimeout`` (not final in time, or the deadline passed),
        ``Rejected`` (e.g. NOT_FOUND / FAILED_PRECONDITION from the owner, or
        INVALID_ARGUMENT for a malformed stream), ``PeerUnavailable``.
        """
        check_timeout(timeout_s)
        request = pb.PullMeanRequest(
            round=round,
            bucket=bucket,
            requester=requester,
            timeout_ms=int(timeout_s * 1000),
            have_checksum=have_checksum,
        )

        def attempt(stub: _PeerStub, remaining: float) -> BucketMean:
            stream = stub.PullMean(request, timeout=remaining, metadata=self._metadata)
            return mean_from_wire(stream, lambda n: self._count(received=n))

        return self._call(address, "pull_mean from", timeout_s, attempt)

    def pull_state(self, address: str, bucket: int, *, requester: str, timeout_s: float) -> BucketState:
        """Fetch the whole state of ``bucket`` (θ_b, outer-optimizer state) from ``address``.

        Raises ``PeerTimeout``, ``Rejected`` (the peer's refusal, or
        INVALID_ARGUMENT for a malformed stream), ``PeerUnavailable``. Nothing
        partial is returned.
        """
        check_timeout(timeout_s)
        request = pb.PullStateRequest(bucket=bucket, requester=requester)

        def attempt(stub: _PeerStub, remaining: float) -> BucketState:
            stream = stub.PullState(request, timeout=remaining, metadata=self._metadata)
            return state_from_wire(stream, lambda n: self._count(received=n))

        return self._call(address, "pull_state from", timeout_s, attempt)

    def probe_link(self, address: str, *, max_bytes: int, timeout_s: float, requester: str) -> LinkProbe:
        """Time ``address``'s link (:class:`~dtrain.transports.base.LinkProbe`): an empty call
        that opens the connection, a second one for the round trip, then a stream of up to
        ``max_bytes`` (capped at ``PROBE_MAX_BYTES``) filler bytes in 16 KiB parts, timed
        from the first part's arrival to the last one's; all within ``timeout_s``. A stream
        cut by the time gives what arrived (``complete=False``).

        Raises ``PeerUnavailable``, ``PeerTimeout`` (the round trips did not fit
        ``timeout_s``), ``Rejected`` (the peer refused, e.g. an older peer without Probe:
        UNIMPLEMENTED)."""
        check_timeout(timeout_s)
        until = time.monotonic() + timeout_s

        def round_trip(stub: _PeerStub, remaining: float) -> float:
            t0 = time.monotonic()
            for _ in stub.Probe(pb.ProbeRequest(requester=requester), timeout=remaining, metadata=self._metadata):
                pass
            return time.monotonic() - t0

        self._call(address, "probe", timeout_s, round_trip)  # opens the connection (a handshake's RTTs)
        rtt_s = self._call(address, "probe", max(1e-3, until - time.monotonic()), round_trip)
        want = min(max(0, max_bytes), PROBE_MAX_BYTES)
        got, first, last = 0, None, None
        t0 = time.monotonic()
        remaining = until - t0
        if want and remaining > 0:
            stub = self._pool.stub(address)
            request = pb.ProbeRequest(bytes=want, part_bytes=16 << 10, requester=requester)
            try:
                for part in stub.Probe(request, timeout=remaining, metadata=self._metadata):
                    last = time.monotonic()
                    if first is None:
                        first = (last, len(part.data))
                    got += len(part.data)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise to_transport_error(e, f"probe {address}") from None
        rate = None
        if first is not None and last is not None and last > first[0] and got > first[1]:
            rate = (got - first[1]) / (last - first[0])
        seconds = (last if got >= want and last is not None else time.monotonic()) - t0
        return LinkProbe(
            address=address, rtt_s=rtt_s, rate_bytes_per_s=rate, bytes=got, seconds=seconds, complete=got >= want
        )

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
