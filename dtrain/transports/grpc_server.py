"""The asyncio gRPC server both dtrain services run on (the Peer service and the rendezvous).

Why asyncio (docs/DECISIONS.md, "Control plane and data plane: asyncio servers"):
with a thread per call, every waiting call held a thread of one bounded pool, so
80 Ready long polls starved the rendezvous's heartbeats and 24 idle Push streams
stalled a site's round. Here each server runs a ``grpc.aio`` server on its own
event loop, in a daemon thread ``dtrain-<name>-loop``. Handlers are coroutines: a
call that waits (a long poll, a Push stream between two messages, a pull waiting
for its bucket's mean) holds no thread. Blocking work of the site's handler
(decoding a chunk, waiting for a round to open or a bucket to finalize) runs in a
thread pool per method (:meth:`AioServer.pool`), so that one kind of call cannot
take the threads of another.

Limits, all from :class:`~dtrain.transports.grpc_common.GrpcTransportConfig`:

* ``max_concurrent_rpcs``: grpc's ``maximum_concurrent_rpcs``; the call past it
  is answered RESOURCE_EXHAUSTED at once.
* ``max_streams_per_sender``: :class:`SenderLimiter`; a sender's call past it is
  answered RESOURCE_EXHAUSTED at once.
* ``stream_idle_timeout_s`` and ``max_wait_ms``: applied by the services.

Every server also serves the standard health service (``grpc.health.v1.Health``,
package ``grpcio-health-checking``): the overall status ``""`` and each dtrain
service name are SERVING while it runs and NOT_SERVING once it stops. ``Check``
needs no token, so that orchestrators' probes (which send no metadata) work; it
reveals nothing but the serving status. ``Watch`` (a stream) needs the token.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, Sequence, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dtrain.errors import BindError
from dtrain.transports.grpc_common import TOKEN_METADATA_KEY, GrpcTransportConfig, server_options

__all__ = [
    "HEALTH_CHECK_METHOD",
    "TokenInterceptor",
    "SenderLimiter",
    "AioServer",
    "start_server",
    "abort",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

HEALTH_CHECK_METHOD = f"/{health.SERVICE_NAME}/Check"
# Seconds stop() waits for the loop thread on top of the grace period.
_STOP_SLACK_S = 10.0
_BIND_FIELDS = "bind_host and bind_port"  # the GrpcTransportConfig fields of a server's address


async def abort(context: grpc.aio.ServicerContext, code: object, reason: str) -> None:
    """``context.abort`` with a status-code name, or an Enum member named like one
    (``RejectCode``); unknown names become INTERNAL. Never returns."""
    name = code.name if isinstance(code, enum.Enum) else str(code)
    status = grpc.StatusCode.__members__.get(name, grpc.StatusCode.INTERNAL)
    await context.abort(status, reason)


def _deny_handler(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts UNAUTHENTICATED
    without reading the request stream."""

    async def deny(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls whose ``dtrain-token`` metadata is missing or wrong with
    UNAUTHENTICATED, before the servicer runs or reads any request message.

    The comparison is constant-time (``hmac.compare_digest``). The health
    service's ``Check`` is exempt (see the module docstring).
    """

    def __init__(self, token: str) -> None:
        self._token = token.encode("ascii")

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method == HEALTH_CHECK_METHOD:
            return await continuation(handler_call_details)
        got: str | bytes | None = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                got = value
        if got is not None:
            got_bytes = got if isinstance(got, bytes) else got.encode("utf-8", "replace")
            if hmac.compare_digest(got_bytes, self._token):
                return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        reason = "missing dtrain-token metadata" if got is None else "wrong token"
        log.warning("rejected %s: %s", handler_call_details.method, reason)
        return _deny_handler(handler, reason)


class SenderLimiter:
    """Counts the open calls of each (method, sender) and refuses one past
    ``max_per_sender``. Used on the server's event loop only (no lock).

    The sender is what the request says (a Push's ``sender``, a pull's
    ``requester``, a Ready's ``site_id``): with a shared token anyone holding it
    can claim any name, so the limit bounds what one name can hold, not what one
    client can; ``max_concurrent_rpcs`` bounds the total.
    """

    def __init__(self, max_per_sender: int) -> None:
        self.max_per_sender = max_per_sender
        self._open: dict[tuple[str, str], int] = {}

    def acquire(self, method: str, sender: str) -> str | None:
        """Count one more call; return None, or the refusal's reason when full."""
        key = (method, sender)
        n = self._open.get(key, 0)
        if n >= self.max_per_sender:
            return f"{sender!r} already has {n} {method} calls open here (max_streams_per_sender)"
        self._open[key] = n + 1
        return None

    def release(self, method: str, sender: str) -> None:
        key = (method, sender)
        n = self._open.get(key, 0) - 1
        if n > 0:
            self._open[key] = n
        else:
            self._open.pop(key, None)

    def num_open(self, method: str, sender: str) -> int:
        return self._open.get((method, sender), 0)


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class AioServer:
    """A started ``grpc.aio`` server on its own event loop thread (from :func:`start_server`).

    Attributes:
        name: what it serves (thread names, logs).
        loop: the event loop the handlers run on.
        server: the ``grpc.aio.Server``.
        port: the bound TCP port.
        health: the ``grpc.health.v1`` servicer (aio).
        limiter: the per-sender call limits (:class:`SenderLimiter`).
    """

    def __init__(self, cfg: GrpcTransportConfig, name: str) -> None:
        self.name = name
        self.config = cfg
        self.loop = asyncio.new_event_loop()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.health = health.aio.HealthServicer()
        self.limiter = SenderLimiter(cfg.max_streams_per_sender)
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._on_stop: list[Callable[[], Awaitable[None]]] = []
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"dtrain-{name}-loop", daemon=True)

    def pool(self, method: str) -> ThreadPoolExecutor:
        """The thread pool (``num_server_threads`` threads) for blocking work of ``method``."""
        with self._lock:
            p = self._pools.get(method)
            if p is None:
                p = ThreadPoolExecutor(
                    max_workers=self.config.num_server_threads, thread_name_prefix=f"dtrain-{self.name}-{method}"
                )
                self._pools[method] = p
            return p

    async def run_blocking(self, method: str, fn: Callable[[], T]) -> T:
        """Run ``fn()`` in ``method``'s thread pool; await its result."""
        return await self.loop.run_in_executor(self.pool(method), fn)

    def on_stop(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run coroutine function ``fn`` on the loop when the server stops (before the loop ends)."""
        self._on_stop.append(fn)

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the loop (thread-safe)."""
        self.loop.call_soon_threadsafe(fn)

    async def _start(self, register: Callable[[grpc.aio.Server], Sequence[str]]) -> None:
        cfg = self.config
        interceptors = [TokenInterceptor(cfg.token)] if cfg.token else []
        server = grpc.aio.server(
            interceptors=interceptors, options=server_options(cfg), maximum_concurrent_rpcs=cfg.max_concurrent_rpcs
        )
        services = list(register(server))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        target = f"{_format_host(cfg.bind_host)}:{cfg.bind_port}"
        try:
            if cfg.tls is not None:
                port = server.add_secure_port(target, cfg.tls.server_credentials())
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as e:  # grpcio raises RuntimeError when it cannot bind
            raise BindError(_BIND_FIELDS, f"cannot bind {self.name} server to {target}: {e}") from None
        if not port:
            raise BindError(_BIND_FIELDS, f"cannot bind {self.name} server to {target}")
        for service in services:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        self.server, self.port = server, port

    def start(self, register: Callable[[grpc.aio.Server], Sequence[str]]) -> None:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(register), self.loop).result(timeout=60)
        except BaseException:
            self._end_loop()
            raise

    async def _shutdown(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(grace_s)
        for fn in self._on_stop:
            try:
                await fn()
            except Exception:
                log.exception("%s: stop hook failed", self.name)
        me = asyncio.current_task()
        rest = [t for t in asyncio.all_tasks() if t is not me]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def _end_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=_STOP_SLACK_S)
        if not self._thread.is_alive():
            self.loop.close()
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for p in pools:
            p.shutdown(wait=False, cancel_futures=True)

    def stop(self, grace_s: float) -> None:
        """Refuse new calls, give in-flight ones ``grace_s`` seconds, cancel the
        rest, end the loop and release idle pool threads (a handler still blocked
        in a pool thread keeps it until it returns). Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(grace_s), self.loop).result(grace_s + _STOP_SLACK_S)
            except Exception as e:
                log.warning("%s server: shutdown did not finish cleanly: %s", self.name, e)
        self._end_loop()


def start_server(
    cfg: GrpcTransportConfig, register: Callable[[grpc.aio.Server], Sequence[str]], *, name: str
) -> AioServer:
    """Build, bind and start an asyncio server with ``cfg``'s options, limits,
    token interceptor, TLS and the health service; ``register`` adds the
    servicers and returns the service names to report SERVING.

    Raises ``BindError`` (an ``OSError``) when the port cannot be bound.
    """
    srv = AioServer(cfg, name)
    srv.start(register)
    return srv
