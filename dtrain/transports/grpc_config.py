"""The gRPC transport's configuration (:class:`GrpcTransportConfig`, :class:`TlsConfig`).

Kept apart from ``dtrain.transports.grpc_common`` (which re-exports both) so that it
imports no grpc: the command line builds its flags from these classes before anything
heavy is loaded.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

__all__ = ["DEFAULT_PART_BYTES", "MESSAGE_OVERHEAD_BYTES", "MiB", "GrpcTransportConfig", "TlsConfig"]

MiB = 1 << 20
# Bytes a part/chunk message may carry on top of its payload (field tags, the
# chunk header with its list of senders, checksums). part_bytes must leave this.
MESSAGE_OVERHEAD_BYTES = 16 * 1024
#: Payload bytes per streamed part when ``part_bytes`` is None: one chunk's payload in one part.
DEFAULT_PART_BYTES = 4 * MiB
#: Longest deadline any call may have, seconds (a day).
MAX_TIMEOUT_S = 86_400.0
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


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
        import grpc  # here, not at module level: the command line reads this config without grpc

        if self.cert_path is None or self.key_path is None:
            raise ValueError("serving over TLS needs cert_path and key_path")
        return grpc.ssl_server_credentials(
            [(_read(self.key_path), _read(self.cert_path))],
            root_certificates=_read(self.ca_path) if self.ca_path else None,
            require_client_auth=self.mutual,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for a client channel (presents the certificate when mutual)."""
        import grpc

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
    minutes, docs/ARCHITECTURE.md "One round", the inner phase):

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
            Must be <= ``max_message_bytes - 16 KiB`` (header room). None (default):
            4 MiB, or ``max_message_bytes - 16 KiB`` when that is smaller
            (:attr:`part_size`), so that a chunk's payload (1 MiB of fp32 input is
            1 MiB + 32 header bytes) travels in one part and is received without a copy
            (``grpc_wire``); with 1 MiB parts every such chunk was two messages that the
            receiver joined.
        keepalive_time_ms: ping an idle connection this often, >= 1000.
        keepalive_timeout_ms: close a connection whose ping is not acknowledged in this
            time (>= 100).
        keepalive_permit_without_calls: ping even with no call in flight.
        max_pings_without_data: cap on pings between data frames (0: no cap).
        server_min_ping_interval_ms: shortest data-less ping interval the server
            accepts, in [0, keepalive_time_ms].
        num_channels_per_peer: channels (TCP connections) per peer address, 1..64, at most
            ``max_streams_per_sender``: calls take them round-robin, and a push goes as that
            many streams at once, one per connection (``GrpcTransport.push``); more than 1
            helps loss-based congestion control fill lossy long-RTT links.
        renew_after_timeout_s: a call that ran out of its deadline renews the channel it
            used: later calls to that peer open a new TCP connection, and the old channel
            is closed this many seconds later (calls still on it may finish), > 0; 0: never
            renew. At 30% loss a connection in retransmission back-off (RFC 6298 5.5: the
            timer doubles with each loss) stalled every call of a round to that peer, late
            pulls and repairs included; a new connection starts with a fresh timer.
        num_server_threads: threads per method (Push, PullMean, PullState) that
            run the site's blocking handler work: decoding and validating a chunk,
            a push waiting for its round to open, a mean pull's short look-ups. Calls
            that merely wait (a Push stream between messages, a Ready long poll, a
            PullMean waiting for its bucket) hold none (``dtrain.transports.grpc_server``).
            Default 32.
        max_concurrent_rpcs: calls a server runs at once, all methods together
            (grpc's ``maximum_concurrent_rpcs``); the call past it is answered
            RESOURCE_EXHAUSTED at once. Default 4096 (a rendezvous needs about
            two per site: a long poll and a heartbeat; a waiting call costs a
            coroutine, not a thread).
        max_streams_per_sender: calls of one method a server runs at once for
            one sender (a Push's ``sender``, a pull's ``requester``); the call past
            it is answered RESOURCE_EXHAUSTED at once. A site makes one push per
            owner per round, as ``num_channels_per_peer`` streams, and
            ``RoundConfig.num_pull_threads`` (8) pulls at a time. The rendezvous keeps at most this many Ready long
            polls per ``site_id``: a newer one answers the oldest "wait" at once
            (so a client spoofing a site's id cannot lock the site out).
            Default 8.
        max_waiting_pulls: PullMean calls a Peer server runs at once, all
            requesters together (each waits for its bucket as a coroutine, holding
            no thread); the call past it is answered RESOURCE_EXHAUSTED at once, so
            a token holder claiming many requester names cannot make calls pile
            up. A site's members pull at most ``RoundConfig.num_pull_threads`` (8)
            each. Default 512.
        stream_idle_timeout_s: a Push stream that sends no message for this long
            (seconds) is ended with DEADLINE_EXCEEDED, and its call slot freed.
            Default 10.
        max_wait_ms: the longest a server lets one call wait, whatever the
            request asks: a Ready long poll (answered "wait" at the cap; the site
            asks again) and a PullMean waiting for finalization (answered
            DEADLINE_EXCEEDED at the cap). Default 30 000.
        num_attempts: attempts per call when the peer answers UNAVAILABLE, 1..100
            (1 = no retry). Other codes are never retried.
        retry_initial_backoff_s: first backoff between attempts, in (0, retry_max_backoff_s];
            backoffs grow exponentially with jitter in [0.5, 1] x, and a sleep never runs
            past the call's deadline. Also the channel's initial reconnect backoff.
        retry_max_backoff_s: cap of the backoff between attempts, <= 60 (also the
            channel's max reconnect backoff).
        retry_backoff_multiplier: backoff growth per attempt, in [1, 10].
        token: shared secret sent in call metadata (``dtrain-token``) and
            checked by a server interceptor (``hmac.compare_digest``) before any
            request message is read. ``None`` disables the check. Not in repr.
        tls: TLS / mutual TLS files; ``None`` for plaintext.
        heap_keep_bytes: freed heap memory (bytes) this process's C allocator keeps for
            reuse instead of returning it to the kernel, and the block size up to which it
            serves from its heaps rather than ``mmap`` (capped at 32 MiB): set once per
            process when a ``GrpcTransport`` is created (``dtrain.transports.heap``, glibc
            ``mallopt``; a no-op elsewhere). Every message grpcio receives is new memory;
            with the allocator's own thresholds a receiver faulted in most of its pages
            again for each one, which cost more CPU than the copies. 0 leaves the allocator
            alone. Default 256 MiB (the memory is reused, the process's peak does not grow).
        extra_options: raw gRPC channel/server arguments ``(name, int | str)``
            appended after the ones above (a later one wins), for tuning, e.g.
            ``(("grpc.experimental.tcp_read_chunk_size", 4194304),)``.
    """

    bind_host: str = "127.0.0.1"
    bind_port: int = 0
    advertise_host: str | None = None
    max_message_bytes: int = 16 * MiB
    part_bytes: int | None = None
    keepalive_time_ms: int = 30_000
    keepalive_timeout_ms: int = 10_000
    keepalive_permit_without_calls: bool = True
    max_pings_without_data: int = 0
    server_min_ping_interval_ms: int = 10_000
    num_channels_per_peer: int = 1
    renew_after_timeout_s: float = 120.0
    num_server_threads: int = 32
    max_concurrent_rpcs: int = 4096
    max_streams_per_sender: int = 8
    max_waiting_pulls: int = 512
    stream_idle_timeout_s: float = 10.0
    max_wait_ms: int = 30_000
    num_attempts: int = 4
    retry_initial_backoff_s: float = 0.05
    retry_max_backoff_s: float = 1.0
    retry_backoff_multiplier: float = 2.0
    token: str | None = field(default=None, repr=False)
    tls: TlsConfig | None = None
    heap_keep_bytes: int = 256 * MiB
    extra_options: tuple[tuple[str, int | str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.bind_host, str):
            raise ValueError(f"bind_host must be a str, got {self.bind_host!r}")
        _positive_int(self, "bind_port", 0, 65535)
        _positive_int(self, "max_message_bytes", 64 * 1024, 2**31 - 1)
        if self.part_bytes is not None:
            _positive_int(self, "part_bytes", 1, self.max_message_bytes - MESSAGE_OVERHEAD_BYTES)
        _positive_int(self, "keepalive_time_ms", 1000)
        _positive_int(self, "keepalive_timeout_ms", 100)
        _positive_int(self, "max_pings_without_data", 0)
        _positive_int(self, "server_min_ping_interval_ms", 0, self.keepalive_time_ms)
        _positive_int(self, "num_channels_per_peer", 1, 64)
        r = self.renew_after_timeout_s
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 3600:
            raise ValueError(f"renew_after_timeout_s must be a number of seconds in [0, 3600] (0: never), got {r!r}")
        _positive_int(self, "num_server_threads", 2, 1024)
        _positive_int(self, "max_concurrent_rpcs", 4, 1_000_000)
        _positive_int(self, "max_streams_per_sender", 1, 1_000_000)
        if self.num_channels_per_peer > self.max_streams_per_sender:
            raise ValueError(
                f"num_channels_per_peer ({self.num_channels_per_peer}) must be <= max_streams_per_sender "
                f"({self.max_streams_per_sender}): a push goes as num_channels_per_peer streams at once, and an "
                "owner refuses a sender's streams beyond max_streams_per_sender; lower num_channels_per_peer or "
                "raise max_streams_per_sender (--net.grpc.max-streams-per-sender) on every site"
            )
        _positive_int(self, "max_waiting_pulls", 1, 1_000_000)
        _positive_int(self, "max_wait_ms", 10, int(MAX_TIMEOUT_S * 1000))
        if not isinstance(self.stream_idle_timeout_s, (int, float)) or not 0.01 <= self.stream_idle_timeout_s <= 3600:
            raise ValueError(
                f"stream_idle_timeout_s must be a number of seconds in [0.01, 3600], got {self.stream_idle_timeout_s!r}"
            )
        _positive_int(self, "num_attempts", 1, 100)
        _positive_int(self, "heap_keep_bytes", 0, 2**31 - 1)
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

    @property
    def part_size(self) -> int:
        """Payload bytes per streamed part: ``part_bytes``, or its default (4 MiB, at most
        ``max_message_bytes - 16 KiB``) when None."""
        if self.part_bytes is not None:
            return self.part_bytes
        return min(DEFAULT_PART_BYTES, self.max_message_bytes - MESSAGE_OVERHEAD_BYTES)

    def advertised_host(self) -> str:
        """The host part of the address peers dial."""
        if self.advertise_host:
            return self.advertise_host
        if self.bind_host in _WILDCARD_HOSTS:
            return socket.gethostname()
        return self.bind_host
