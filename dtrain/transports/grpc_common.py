"""gRPC plumbing shared by the peer transport and the rendezvous service.

Re-exports the one configuration both use (:class:`GrpcTransportConfig`, with
:class:`TlsConfig`; defined in the grpc-free ``dtrain.transports.grpc_config``), and
holds the channel and server options it turns into, the shared-token server interceptor, TLS credentials from PEM files, the
UNAVAILABLE-only retry loop, and the per-address channel pool.

Rules (docs/ARCHITECTURE.md, "Transport rules"): every RPC has a deadline; only
``UNAVAILABLE`` is retried, with bounded exponential backoff that never runs past
the call's deadline; the max message size is set explicitly on both ends;
keepalive is set so that an idle inner phase (minutes without a call) neither
drops the channel nor earns a "too_many_pings" GOAWAY.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable, Generic, Sequence, TypeVar

import grpc

from dtrain.errors import PeerTimeout, PeerUnavailable, RejectCode, Rejected, TransportError
from dtrain.transports.grpc_config import MESSAGE_OVERHEAD_BYTES, GrpcTransportConfig, MiB, TlsConfig  # noqa: F401

__all__ = [
    "TOKEN_METADATA_KEY",
    "TlsConfig",
    "GrpcTransportConfig",
    "channel_options",
    "server_options",
    "call_metadata",
    "check_timeout",
    "call_with_retry",
    "to_transport_error",
    "abort_with",
    "ChannelPool",
]

log = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "dtrain-token"
# Largest deadline accepted by this module (one day); guards against inf/NaN.
from dtrain.transports.grpc_config import MAX_TIMEOUT_S as _MAX_TIMEOUT_S  # noqa: E402

T = TypeVar("T")


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
        self._retired: list[grpc.Channel] = []  # renewed, closed later (renew)
        self._closed = False

    def _new_channel(self, address: str) -> grpc.Channel:
        opts = channel_options(self._cfg)
        if self._cfg.tls is not None:
            return grpc.secure_channel(address, self._cfg.tls.channel_credentials(), options=opts)
        return grpc.insecure_channel(address, options=opts)

    def stub(self, address: str, index: int | None = None) -> T:
        """The next stub for ``address`` (creating its channels on first use); ``index``: that
        channel's (modulo their number) instead of the next one."""
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
            if index is not None:
                return entries[index % len(entries)][1]
            i = self._next[address]
            self._next[address] = (i + 1) % len(entries)
            return entries[i][1]

    def renew(self, address: str, stub: T) -> bool:
        """Replace the channel of ``stub`` (a call on it ran out of its deadline: its TCP
        connection may sit in retransmission back-off) with a new one for later calls; the
        old one closes ``renew_after_timeout_s`` later, so calls still on it may end. No-op
        (False) when renewal is off or ``stub`` is no longer in the pool (another call's
        timeout renewed it first)."""
        delay_s = self._cfg.renew_after_timeout_s
        with self._lock:
            entries = self._entries.get(address)
            i = next((i for i, (_, s) in enumerate(entries or ()) if s is stub), None)
            if not delay_s or self._closed or entries is None or i is None:
                return False
            old = entries[i][0]
            ch = self._new_channel(address)
            entries[i] = (ch, self._make_stub(ch))
            self._retired.append(old)
        timer = threading.Timer(delay_s, self._close_retired, args=(old,))
        timer.daemon = True
        timer.start()
        log.info("%s: a call ran out of its deadline; later calls use a new connection", address)
        return True

    def _close_retired(self, ch: grpc.Channel) -> None:
        with self._lock:
            if ch not in self._retired:
                return
            self._retired.remove(ch)
        ch.close()

    def channels(self, address: str) -> Sequence[grpc.Channel]:
        """The channels open to ``address`` (empty if none yet); for tests and metrics."""
        with self._lock:
            return tuple(ch for ch, _ in self._entries.get(address, ()))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            entries, self._entries = self._entries, {}
            retired, self._retired = self._retired, []
        for ch in [c for chans in entries.values() for c, _ in chans] + retired:
            ch.close()
