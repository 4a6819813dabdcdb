"""gRPC plumbing shared by the peer transport and the rendezvous service.

Holds the one configuration both use (:class:`GrpcTransportConfig`, with
:class:`TlsConfig`), the channel and server options it turns into, the
shared-token server interceptor, TLS credentials from PEM files, the
UNAVAILABLE-only retry loop, and the per-address channel pool.

Rules (DESIGN.md, "Transport rules (gRPC)"): every RPC has a deadline; only
``UNAVAILABLE`` is retried, with bounded exponential backoff that never runs past
the call's deadline; the max message size is set explicitly on both ends;
keepalive is set so that an idle inner phase (minutes without a call) neither
drops the channel nor earns a "too_many_pings" GOAWAY.
"""

from __future__ import annotations

import hmac
import logging
import os
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Generic, Sequence, TypeVar

import grpc

from dtrain.errors import PeerTimeout, PeerUnavailable, RejectCode, Rejected, TransportError

__all__ = [
    "TOKEN_METADATA_KEY",
    "TlsConfig",
    "GrpcTransportConfig",
    "channel_options",
    "server_options",
    "call_metadata",
    "TokenInterceptor",
    "ServerHandle",
    "start_server",
    "check_timeout",
    "call_with_retry",
    "to_transport_error",
    "abort_with",
    "ChannelPool",
]

log = logging.getLogger(__name__)

MiB = 1 << 20
TOKEN_METADATA_KEY = "dtrain-token"
# Bytes a part/chunk message may carry on top of its payload (field tags, the
# chunk header with its list of senders, checksums). part_bytes must leave this.
MESSAGE_OVERHEAD_BYTES = 16 * 1024
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")
# Largest deadline accepted by this module (one day); guards against inf/NaN.
_MAX_TIMEOUT_S = 86_400.0

T = TypeVar("T")


def _check_file(name: str, path: str | None) -> None:
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"{name} must name an existing PEM file, got {path!r}")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    """TLS or mutual TLS from PEM files.

    One site is both a server (peers pull from it) and a client, so one set of
    files serves both roles.

    Attributes:
        cert_path: this site's certificate chain (PEM). Required to serve; sent
            as the client certificate when ``mutual`` is True.
        key_path: the private key of ``cert_path`` (PEM).
        ca_path: CA bundle (PEM) that verifies peers' server certificates and,
            when ``mutual``, clients' certificates. ``None`` on a client means
            the system roots.
        mutual: require and present client certificates (mTLS).
        server_name_override: the name to verify in a peer's server certificate
            instead of the host of the address (for certificates issued to a
            name while peers are dialled by IP). Use in tests only.
    """

    cert_path: str | None = None
    key_path: str | None = None
    ca_path: str | None = None
    mutual: bool = False
    server_name_override: str | None = None

    def __post_init__(self) -> None:
        for name in ("cert_path", "key_path", "ca_path"):
            _check_file(name, getattr(self, name))
        if (self.cert_path is None) != (self.key_path is None):
            raise ValueError("cert_path and key_path must be given together (both or neither)")
        if self.mutual and (self.cert_path is None or self.ca_path is None):
            raise ValueError("mutual=True needs cert_path, key_path and ca_path")

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for a server; raises ValueError without cert_path/key_path."""
        if self.cert_path is None or self.key_path is None:
            raise ValueError("serving over TLS needs cert_path and key_path")
        return grpc.ssl_server_credentials(
            [(_read(self.key_path), _read(self.cert_path))],
            root_certificates=_read(self.ca_path) if self.ca_path else None,
            require_client_auth=self.mutual,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for a client channel (presents the certificate when mutual)."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_path) if self.ca_path else None,
            private_key=_read(self.key_path) if self.mutual and self.key_path else None,
            certificate_chain=_read(self.cert_path) if self.mutual and self.cert_path else None,
        )


def _positive_int(cfg: object, name: str, low: int = 1, high: int | None = None) -> None:
    v = getattr(cfg, name)
    if not isinstance(v, int) or isinstance(v, bool) or v < low or (high is not None and v > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {bound}, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class GrpcTransportConfig:
    """Configuration of the gRPC peer transport (also used by the rendezvous).

    Keepalive defaults and why (an inner phase can leave a channel idle for
    minutes, DESIGN.md "One round", step 1):

    * ``keepalive_time_ms=30_000``: each end pings an idle connection every 30 s,
      so NATs and firewalls (idle timeouts of 60 s and more) keep the flow, and a
      dead peer is noticed after at most 30 s + ``keepalive_timeout_ms``.
    * ``keepalive_timeout_ms=10_000``: a ping not acknowledged in 10 s closes
      the connection (the next call reconnects or fails UNAVAILABLE).
    * ``keepalive_permit_without_calls=True``: ping even with no call in flight
      (the idle inner phase is exactly when no call is in flight).
    * ``max_pings_without_data=0``: no cap on pings between data frames (the
      gRPC default of 2 would stop pinging after 1 minute of idleness).
    * ``server_min_ping_interval_ms=10_000``: the server accepts a data-less
      ping every 10 s (``grpc.http2.min_ping_interval_without_data_ms`` and
      ``grpc.http2.min_time_between_pings_ms``). The gRPC default is 5 minutes,
      under which a client pinging every 30 s collects ping strikes and is sent
      GOAWAY "too_many_pings". It must be <= ``keepalive_time_ms`` (checked).

    Attributes:
        bind_host: interface to listen on (``"0.0.0.0"`` for all).
        bind_port: TCP port; 0 picks a free one.
        advertise_host: host peers should dial; default ``bind_host``, or the
            machine's hostname when ``bind_host`` is a wildcard.
        max_message_bytes: the max send and receive message size, set on both the
            server and every channel. Default 16 MiB (chunks are <= 1 MiB).
        part_bytes: payload bytes per streamed part of a pulled mean or state.
            Must be <= ``max_message_bytes - 16 KiB`` (header room). Default 1 MiB.
        keepalive_time_ms, keepalive_timeout_ms, keepalive_permit_without_calls,
        max_pings_without_data, server_min_ping_interval_ms: see above.
        num_channels_per_peer: channels (TCP connections) per peer address,
            used round-robin per call; more than 1 helps fill lossy long-RTT links.
        num_server_threads: server worker threads; every in-flight RPC holds one
            (a PullMean waiting for finalization, a long-polling Ready), so size
            it above the number of concurrent streams expected. Default 16.
        num_attempts: attempts per call when the peer answers UNAVAILABLE
            (1 = no retry). Other codes are never retried.
        retry_initial_backoff_s, retry_max_backoff_s, retry_backoff_multiplier:
            exponential backoff between attempts (with jitter in [0.5, 1] x);
            a sleep never runs past the call's deadline. The initial and max
            backoff also set the channel's reconnect backoff.
        token: shared secret sent in call metadata (``dtrain-token``) and
            checked by a server interceptor (``hmac.compare_digest``) before any
            request message is read. ``None`` disables the check. Not in repr.
        tls: TLS / mutual TLS files; ``None`` for plaintext.
        extra_options: raw gRPC channel/server arguments ``(name, int | str)``
            appended after the ones above (a later one wins), for tuning, e.g.
            ``(("grpc.experimental.tcp_read_chunk_size", 4194304),)``.
    """

    bind_host: str = "127.0.0.1"
    bind_port: int = 0
    advertise_host: str | None = None
    max_message_bytes: int = 16 * MiB
    part_bytes: int = 1 * MiB
    keepalive_time_ms: int = 30_000
    keepalive_timeout_ms: int = 10_000
    keepalive_permit_without_calls: bool = True
    max_pings_without_data: int = 0
    server_min_ping_interval_ms: int = 10_000
    num_channels_per_peer: int = 1
    num_server_threads: int = 16
    num_attempts: int = 4
    retry_initial_backoff_s: float = 0.05
    retry_max_backoff_s: float = 1.0
    retry_backoff_multiplier: float = 2.0
    token: str | None = field(default=None, repr=False)
    tls: TlsConfig | None = None
    extra_options: tuple[tuple[str, int | str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.bind_host, str):
            raise ValueError(f"bind_host must be a str, got {self.bind_host!r}")
        _positive_int(self, "bind_port", 0, 65535)
        _positive_int(self, "max_message_bytes", 64 * 1024, 2**31 - 1)
        _positive_int(self, "part_bytes", 1, self.max_message_bytes - MESSAGE_OVERHEAD_BYTES)
        _positive_int(self, "keepalive_time_ms", 1000)
        _positive_int(self, "keepalive_timeout_ms", 100)
        _positive_int(self, "max_pings_without_data", 0)
        _positive_int(self, "server_min_ping_interval_ms", 0, self.keepalive_time_ms)
        _positive_int(self, "num_channels_per_peer", 1, 64)
        _positive_int(self, "num_server_threads", 2, 1024)
        _positive_int(self, "num_attempts", 1, 100)
        if not 0.0 < self.retry_initial_backoff_s <= self.retry_max_backoff_s <= 60.0:
            raise ValueError(
                "need 0 < retry_initial_backoff_s <= retry_max_backoff_s <= 60, got "
                f"{self.retry_initial_backoff_s!r} and {self.retry_max_backoff_s!r}"
            )
        if not 1.0 <= self.retry_backoff_multiplier <= 10.0:
            raise ValueError(f"retry_backoff_multiplier must be in [1, 10], got {self.retry_backoff_multiplier!r}")
        if self.token is not None and (not isinstance(self.token, str) or not self.token or not self.token.isascii()):
            raise ValueError("token must be a non-empty ASCII str or None")
        for opt in self.extra_options:
            if not (
                isinstance(opt, tuple) and len(opt) == 2 and isinstance(opt[0], str) and isinstance(opt[1], (int, str))
            ):
                raise ValueError(f"extra_options must be (name: str, value: int | str) pairs, got {opt!r}")
        if self.tls is not None and not isinstance(self.tls, TlsConfig):
            raise ValueError(f"tls must be a TlsConfig or None, got {type(self.tls).__name__}")

    def advertised_host(self) -> str:
        """The host part of the address peers dial."""
        if self.advertise_host:
            return self.advertise_host
        if self.bind_host in _WILDCARD_HOSTS:
            return socket.gethostname()
        return self.bind_host


def _common_options(cfg: GrpcTransportConfig) -> list[tuple[str, int | str]]:
    return [
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.keepalive_time_ms", cfg.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", cfg.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", int(cfg.keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", cfg.max_pings_without_data),
    ]


def channel_options(cfg: GrpcTransportConfig) -> list[tuple[str, int | str]]:
    """Options for a client channel built from ``cfg``."""
    opts = _common_options(cfg) + [
        # Reconnect soon after a refused connection, so an UNAVAILABLE retry can
        # reach a peer that came back (the default first backoff is 1 s).
        ("grpc.initial_reconnect_backoff_ms", max(1, int(cfg.retry_initial_backoff_s * 1000))),
        ("grpc.max_reconnect_backoff_ms", max(1, int(cfg.retry_max_backoff_s * 1000))),
        # Each channel gets its own TCP connection (otherwise channels with equal
        # arguments share one subchannel and num_channels_per_peer would be moot).
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if cfg.tls is not None and cfg.tls.server_name_override:
        opts.append(("grpc.ssl_target_name_override", cfg.tls.server_name_override))
    return opts + list(cfg.extra_options)


def server_options(cfg: GrpcTransportConfig) -> list[tuple[str, int | str]]:
    """Options for a server built from ``cfg`` (see GrpcTransportConfig for keepalive)."""
    return (
        _common_options(cfg)
        + [
            ("grpc.http2.min_ping_interval_without_data_ms", cfg.server_min_ping_interval_ms),
            ("grpc.http2.min_time_between_pings_ms", cfg.server_min_ping_interval_ms),
            # Two servers on one port would split the traffic silently.
            ("grpc.so_reuseport", 0),
        ]
        + list(cfg.extra_options)
    )


def call_metadata(cfg: GrpcTransportConfig) -> tuple[tuple[str, str], ...]:
    """Metadata every call carries (the shared token, when configured)."""
    return ((TOKEN_METADATA_KEY, cfg.token),) if cfg.token else ()


def _deny_handler(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts UNAUTHENTICATED
    without reading the request stream."""

    def deny(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class TokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose ``dtrain-token`` metadata is missing or wrong with
    UNAUTHENTICATED, before the servicer runs or reads any request message.

    The comparison is constant-time (``hmac.compare_digest``).
    """

    def __init__(self, token: str) -> None:
        self._token = token.encode("ascii")

    def intercept_service(self, continuation, handler_call_details):
        got: str | bytes | None = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                got = value
        if got is not None:
            got_bytes = got if isinstance(got, bytes) else got.encode("utf-8", "replace")
            if hmac.compare_digest(got_bytes, self._token):
                return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        reason = "missing dtrain-token metadata" if got is None else "wrong token"
        log.warning("rejected %s: %s", handler_call_details.method, reason)
        return _deny_handler(handler, reason)


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class ServerHandle:
    """A started gRPC server with its worker pool (from :func:`start_server`).

    Attributes:
        server: the ``grpc.Server``.
        port: the bound TCP port.
    """

    def __init__(self, server: grpc.Server, executor: ThreadPoolExecutor, port: int) -> None:
        self.server = server
        self.port = port
        self._executor = executor

    def stop(self, grace_s: float) -> None:
        """Refuse new calls, give in-flight ones ``grace_s`` seconds, cancel the
        rest and wait for that; then release idle worker threads (a handler still
        blocked past the grace period keeps its thread until it returns)."""
        self.server.stop(grace_s).wait()
        self._executor.shutdown(wait=False, cancel_futures=True)


def start_server(cfg: GrpcTransportConfig, register: Callable[[grpc.Server], None], *, name: str) -> ServerHandle:
    """Build, bind and start a server with ``cfg``'s options, token interceptor
    and TLS; ``register`` adds the servicers.

    Raises ``OSError`` when the port cannot be bound.
    """
    interceptors = [TokenInterceptor(cfg.token)] if cfg.token else []
    executor = ThreadPoolExecutor(max_workers=cfg.num_server_threads, thread_name_prefix=f"dtrain-{name}")
    server = grpc.server(executor, interceptors=interceptors, options=server_options(cfg))
    register(server)
    target = f"{_format_host(cfg.bind_host)}:{cfg.bind_port}"
    try:
        if cfg.tls is not None:
            port = server.add_secure_port(target, cfg.tls.server_credentials())
        else:
            port = server.add_insecure_port(target)
    except RuntimeError as e:  # grpcio raises RuntimeError when it cannot bind
        port, error = 0, e
    else:
        error = None
    if not port:
        executor.shutdown(wait=False)
        raise OSError(f"cannot bind {name} server to {target}" + (f": {error}" if error else ""))
    server.start()
    return ServerHandle(server, executor, port)


def check_timeout(timeout_s: float) -> float:
    """Validate a call's timeout (seconds, > 0 and finite); return it as float."""
    t = float(timeout_s)
    if not 0.0 < t <= _MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s must be in (0, {_MAX_TIMEOUT_S}], got {timeout_s!r}")
    return t


def call_with_retry(fn: Callable[[float], T], *, timeout_s: float, cfg: GrpcTransportConfig, what: str) -> T:
    """Run ``fn(remaining_s)`` until it returns, retrying only on UNAVAILABLE.

    ``fn`` gets the seconds left until the overall deadline and must use them as
    its RPC timeout. Backoff starts at ``retry_initial_backoff_s`` and grows by
    ``retry_backoff_multiplier`` up to ``retry_max_backoff_s``; no sleep runs past
    the deadline. Raises the last ``grpc.RpcError`` when attempts or time run out,
    and any other ``grpc.RpcError`` at once.
    """
    deadline = time.monotonic() + check_timeout(timeout_s)
    backoff = cfg.retry_initial_backoff_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn(max(0.001, deadline - time.monotonic()))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or attempt >= cfg.num_attempts:
                raise
            sleep_s = backoff * random.uniform(0.5, 1.0)
            if time.monotonic() + sleep_s >= deadline - 0.001:
                raise
            log.debug("%s: UNAVAILABLE (%s), retry %d in %.3f s", what, e.details(), attempt, sleep_s)
            time.sleep(sleep_s)
            backoff = min(backoff * cfg.retry_backoff_multiplier, cfg.retry_max_backoff_s)


def to_transport_error(e: grpc.RpcError, what: str) -> TransportError:
    """Map a gRPC error to dtrain's: UNAVAILABLE -> PeerUnavailable,
    DEADLINE_EXCEEDED -> PeerTimeout, any other code -> Rejected(code name, details)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    if code == grpc.StatusCode.UNAVAILABLE:
        return PeerUnavailable(f"{what}: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return PeerTimeout(f"{what}: {details}")
    return Rejected(RejectCode.parse(code.name), details)


def abort_with(context: grpc.ServicerContext, code: RejectCode | str, reason: str) -> None:
    """``context.abort`` with the gRPC status of the same name as ``code`` (a
    :class:`RejectCode`, or its name; unknown names become INTERNAL). Never returns."""
    name = code.value if isinstance(code, RejectCode) else code
    status = grpc.StatusCode.__members__.get(name, grpc.StatusCode.INTERNAL)
    context.abort(status, reason)


class ChannelPool(Generic[T]):
    """Channels and stubs cached per address, ``num_channels_per_peer`` each,
    handed out round-robin. Thread-safe; ``close()`` closes them all."""

    def __init__(self, cfg: GrpcTransportConfig, make_stub: Callable[[grpc.Channel], T]) -> None:
        self._cfg = cfg
        self._make_stub = make_stub
        self._lock = threading.Lock()
        self._entries: dict[str, list[tuple[grpc.Channel, T]]] = {}
        self._next: dict[str, int] = {}
        self._closed = False

    def _new_channel(self, address: str) -> grpc.Channel:
        opts = channel_options(self._cfg)
        if self._cfg.tls is not None:
            return grpc.secure_channel(address, self._cfg.tls.channel_credentials(), options=opts)
        return grpc.insecure_channel(address, options=opts)

    def stub(self, address: str) -> T:
        """The next stub for ``address`` (creating its channels on first use)."""
        with self._lock:
            if self._closed:
                raise PeerUnavailable("transport stopped")
            entries = self._entries.get(address)
            if entries is None:
                entries = []
                for _ in range(self._cfg.num_channels_per_peer):
                    ch = self._new_channel(address)
                    entries.append((ch, self._make_stub(ch)))
                self._entries[address] = entries
                self._next[address] = 0
            i = self._next[address]
            self._next[address] = (i + 1) % len(entries)
            return entries[i][1]

    def channels(self, address: str) -> Sequence[grpc.Channel]:
        """The channels open to ``address`` (empty if none yet); for tests and metrics."""
        with self._lock:
            return tuple(ch for ch, _ in self._entries.get(address, ()))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            entries, self._entries = self._entries, {}
        for chans in entries.values():
            for ch, _ in chans:
                ch.close()
