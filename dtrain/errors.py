"""All exception types raised by dtrain.

Network and peer failures during a round are *recorded* by the round engine and
handled by the round rules (docs/ARCHITECTURE.md, "One round"); these exceptions are how the
layers below the engine report them. Bad configuration raises ``ValueError`` at
construction (see ``dtrain.app.config``), not one of these.

Errors are told apart by type, never by message text. A :class:`PermanentError` is a
refusal that retrying cannot change (a wrong token, a taken site id, an address this
host cannot bind): callers that retry (``Group._call_with_backoff``, the rendezvous
fail-over) re-raise it at once, and the command line exits with its ``fix``.
"""

from __future__ import annotations

import enum

__all__ = [
    "DtrainError",
    "CodecError",
    "DecodeBoundExceeded",
    "TransportError",
    "PeerUnavailable",
    "PeerTimeout",
    "Rejected",
    "RejectCode",
    "RendezvousError",
    "RendezvousRefused",
    "PermanentError",
    "AuthenticationError",
    "ConfigError",
    "BindError",
    "QuorumTimeout",
    "StateTransferError",
    "CheckpointError",
    "SiteGroupError",
    "LeftBehind",
]


class DtrainError(Exception):
    """Base class of every dtrain exception."""


class CodecError(DtrainError):
    """A payload could not be encoded or decoded.

    Raised for truncated, corrupted or mislabeled payloads, element-count or dtype
    mismatches, and zstd frames that claim or produce more bytes than the bound.
    The message names the problem (field and expected vs. found value).
    """


class DecodeBoundExceeded(CodecError):
    """Decoding a payload would produce more bytes than its bound.

    Raised before anything is allocated when a header's element count needs a body
    larger than ``CodecConfig.max_decoded_bytes``, or a zstd frame declares more
    content than the exact expected body size; and while decompressing when a zstd
    frame that does not declare its size (a streaming frame) produces more than that
    size. A sender whose payload raises this is refused with
    :attr:`RejectCode.RESOURCE_EXHAUSTED` (a decompression bomb); any other
    :class:`CodecError` is :attr:`RejectCode.INVALID_ARGUMENT`.
    """


class RejectCode(enum.Enum):
    """Why a request was refused or failed; the names (and values) are those of
    ``grpc.StatusCode`` members, so the gRPC transport maps them one to one, while
    the core does not import grpc.

    | code | raised by dtrain when |
    |---|---|
    | UNAUTHENTICATED | missing or wrong token (gRPC server; from the rendezvous: :class:`AuthenticationError`) |
    | PERMISSION_DENIED | sender not a member of the round, or excluded after repeated rejections |
    | FAILED_PRECONDITION | wrong or stale round, bucket not owned here, bucket already finalized; a rendezvous refusal |
    | INVALID_ARGUMENT | offsets, lengths, codec, undecodable payload, non-finite values, norm bound, malformed message |
    | ALREADY_EXISTS | a different payload for a chunk already received from that sender; the rendezvous: a live site holds this site id |
    | RESOURCE_EXHAUSTED | oversized message, decoding past its bound (:class:`DecodeBoundExceeded`) |
    | NOT_FOUND | no mean or state for that round or bucket here |
    | UNAVAILABLE | peer not reachable (the only retried code; :class:`PeerUnavailable`) |
    | DEADLINE_EXCEEDED | no answer before the call's deadline (:class:`PeerTimeout`) |
    | INTERNAL | a handler raised an unexpected exception; state not serialisable |

    The other members (CANCELLED, UNKNOWN, ...) are never raised by dtrain; they stand
    for whatever gRPC status a peer or the library answers with.
    """

    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"
    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    ABORTED = "ABORTED"
    DATA_LOSS = "DATA_LOSS"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: "str | RejectCode") -> "RejectCode":
        """The member named ``name`` (a member is returned as is); unknown names give
        :attr:`UNKNOWN`, so a peer's odd status never raises here."""
        if isinstance(name, cls):
            return name
        return cls.__members__.get(str(name), cls.UNKNOWN)


class TransportError(DtrainError):
    """A request to a peer failed. ``code`` is one of :class:`RejectCode`."""

    def __init__(self, code: "RejectCode | str", reason: str) -> None:
        code = RejectCode.parse(code)
        super().__init__(f"{code.value}: {reason}")
        self.code: RejectCode = code
        self.reason = reason


class PeerUnavailable(TransportError):
    """The peer could not be reached (connection refused, dead, partitioned)."""

    def __init__(self, reason: str) -> None:
        super().__init__(RejectCode.UNAVAILABLE, reason)


class PeerTimeout(TransportError):
    """The peer did not answer before the call's deadline."""

    def __init__(self, reason: str) -> None:
        super().__init__(RejectCode.DEADLINE_EXCEEDED, reason)


class Rejected(TransportError):
    """The peer (or this site, as a server) refused the request on purpose.

    Raised by request handlers with a :class:`RejectCode` and a human-readable
    reason; transports carry both to the caller unchanged.
    """


class RendezvousError(DtrainError):
    """The rendezvous refused a request or could not be reached."""


class RendezvousRefused(RendezvousError):
    """The rendezvous answered with a refusal (it was reached: another front-end of the
    run would answer the same, so a fail-over client does not try the next).

    Attributes:
        code: the gRPC status it answered with, as a :class:`RejectCode`
            (FAILED_PRECONDITION for a refusal of the core, INVALID_ARGUMENT for bad input).
    """

    def __init__(self, code: "RejectCode | str", reason: str) -> None:
        super().__init__(reason)
        self.code: RejectCode = RejectCode.parse(code)


class PermanentError(DtrainError):
    """A refusal that retrying cannot change: something in this site's settings must be
    fixed first. Never retried; ``dtrain worker`` exits with exit code 2 and ``fix``.

    Attributes:
        fix: one sentence saying what to change (the setting, in library terms).
    """

    fix: str = "fix this site's settings"

    def __init__(self, reason: str, fix: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        if fix is not None:
            self.fix = fix


class AuthenticationError(PermanentError, RendezvousError):
    """The rendezvous refused this site's token (gRPC UNAUTHENTICATED): the site's
    token (``GrpcTransportConfig.token``, from ``--net.token-file``) is missing or is
    not the rendezvous's."""

    fix = "give this site the rendezvous's token (GrpcTransportConfig.token; the CLI's --net.token-file)"


class ConfigError(PermanentError, ValueError):
    """A setting that passed its checks but is found wrong only when used (e.g. a
    listen address this host does not have).

    Attributes:
        field: the dotted config field to change (``net.listen``).
    """

    def __init__(self, field: str, reason: str, fix: str | None = None) -> None:
        super().__init__(reason, fix or f"change {field}")
        self.field = field


class BindError(ConfigError, OSError):
    """A server could not bind its address: the port is taken or the host is not one of
    this machine's addresses (also an ``OSError``, as binding is one)."""


class QuorumTimeout(RendezvousError):
    """No quorum of at least ``min_sites`` formed within the configured time."""


class StateTransferError(DtrainError):
    """Pulling θ and outer-optimizer state from members failed; nothing was applied."""


class CheckpointError(DtrainError):
    """A checkpoint is corrupt or does not match the model/config; nothing was loaded."""


class SiteGroupError(DtrainError):
    """A site group cannot take part: its sites disagree on the number of ranks per
    site, or a collective inside the site failed (a rank died)."""


class LeftBehind(DtrainError):
    """This site's θ is behind the group's round and it cannot catch up: no live member
    holds a state to pull (the others finished, left or died) within
    ``state_pull_timeout_s``, or the run's last round left buckets stale and unrepaired,
    which no later round can repair (``detail`` says which). It never adopts the group's
    round with its old θ (that would end a run "done" on another θ); the worker exits with
    its own code (``dtrain worker``).

    Attributes:
        site_id: this site.
        round: rounds applied to its θ (the round it is stuck at).
        group_round: the group's next round (what it would have to catch up to).
    """

    def __init__(self, site_id: str, round: int, group_round: int, detail: str = "") -> None:
        self.site_id, self.round, self.group_round, self.detail = site_id, round, group_round, detail
        super().__init__(
            f"{site_id} is left behind at round {round} (the group is at round {group_round}): "
            f"{detail or 'no member to pull θ from'}"
        )

    def __reduce__(self):  # a SiteComm sends it between ranks
        return (LeftBehind, (self.site_id, self.round, self.group_round, self.detail))
