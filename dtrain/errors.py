"""All exception types raised by dtrain.

Network and peer failures during a round are *recorded* by the round engine and
handled by the round rules (DESIGN.md, "One round"); these exceptions are how the
layers below the engine report them. Bad configuration raises ``ValueError`` at
construction (see ``dtrain.config``), not one of these.
"""

from __future__ import annotations

__all__ = [
    "DtrainError",
    "CodecError",
    "TransportError",
    "PeerUnavailable",
    "PeerTimeout",
    "Rejected",
    "RejectCode",
    "RendezvousError",
    "QuorumTimeout",
    "MissedRound",
    "StateTransferError",
    "CheckpointError",
    "SiteGroupError",
]


class DtrainError(Exception):
    """Base class of every dtrain exception."""


class CodecError(DtrainError):
    """A payload could not be encoded or decoded.

    Raised for truncated, corrupted or mislabeled payloads, element-count or dtype
    mismatches, and zstd frames that claim or produce more bytes than the bound.
    The message names the problem (field and expected vs. found value).
    """


class RejectCode:
    """Status codes used to reject a request. They are the names of
    ``grpc.StatusCode`` members so the gRPC transport maps them one to one,
    while the core does not import grpc."""

    UNAUTHENTICATED = "UNAUTHENTICATED"  # missing or wrong token
    PERMISSION_DENIED = "PERMISSION_DENIED"  # sender not a member of the round
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # wrong/stale round, bucket not owned here, finalized
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # offsets, lengths, codec, non-finite, norm bound
    ALREADY_EXISTS = "ALREADY_EXISTS"  # a different payload for a chunk already received
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # oversized message, decompression bomb
    NOT_FOUND = "NOT_FOUND"  # no mean / state for that round or bucket here
    UNAVAILABLE = "UNAVAILABLE"  # peer not reachable (the only retried code)
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    ALL = (
        UNAUTHENTICATED,
        PERMISSION_DENIED,
        FAILED_PRECONDITION,
        INVALID_ARGUMENT,
        ALREADY_EXISTS,
        RESOURCE_EXHAUSTED,
        NOT_FOUND,
        UNAVAILABLE,
        DEADLINE_EXCEEDED,
    )


class TransportError(DtrainError):
    """A request to a peer failed. ``code`` is one of :class:`RejectCode`."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
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


class QuorumTimeout(RendezvousError):
    """No quorum of at least ``min_sites`` formed within the configured time."""


class MissedRound(RendezvousError):
    """This site was not admitted to the round it asked for (it was cut as a
    straggler, or was declared dead); it must resynchronise before rejoining."""

    def __init__(self, reason: str, next_round: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.next_round = next_round


class StateTransferError(DtrainError):
    """Pulling θ and outer-optimizer state from members failed; nothing was applied."""


class CheckpointError(DtrainError):
    """A checkpoint is corrupt or does not match the model/config; nothing was loaded."""


class SiteGroupError(DtrainError):
    """A site group cannot take part: its sites disagree on the number of ranks per
    site, or a collective inside the site failed (a rank died)."""
