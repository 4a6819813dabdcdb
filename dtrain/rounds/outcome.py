"""What one sync did at one site: :class:`RoundStatus` and :class:`SyncOutcome`, the one
outcome type of a round for every kind of site (one process or K ranks) and every
schedule (blocking rounds or streaming fragment rounds).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dtrain.rounds.types import RoundResult

__all__ = ["RoundStatus", "SyncOutcome"]


class RoundStatus(enum.StrEnum):
    """What a sync did with the site's model (the value is the word in logs and in the
    ``status`` metric).

    | status | value | the model afterwards |
    |---|---|---|
    | APPLIED | ``applied`` | the round ran; the synced buckets are reset to the new θ |
    | RESYNCED | ``resynced`` | the site was cut from the round (a straggler) or declared dead: its Δ is discarded, θ pulled from the members, the model reset to θ |
    | SKIPPED | ``skipped`` | (K > 1) the site's ranks disagreed about the round (the half-round rule, :mod:`dtrain.sitegroup.agree`): no rank pushed, every slice was pulled again, the model reset to θ |
    | DEFERRED | ``deferred`` | the rendezvous was unreachable, or a resync failed: the model is NOT reset; the site trains on locally and tries again |
    """

    APPLIED = "applied"
    RESYNCED = "resynced"
    SKIPPED = "skipped"
    DEFERRED = "deferred"

    @property
    def resets_model(self) -> bool:
        """True when θ was written into the model (every status but DEFERRED)."""
        return self is not RoundStatus.DEFERRED


@dataclass(kw_only=True)
class SyncOutcome:
    """What one sync did at one site; the same on every rank of a site except ``result``.

    Attributes:
        status: see :class:`RoundStatus`.
        reason: why (the rendezvous's reason, the half-round rule's, an error).
        result: this rank's round result (its slice's buckets); None unless APPLIED.
        quorum_s: seconds this sync waited for the rendezvous's decision (the round's
            plan, or "missed"): the quorum forming, i.e. the slowest member finishing its
            inner phase; 0 when no decision was asked for.
        fragment: the fragment this round synced (``num_fragments`` > 1,
            :func:`~dtrain.streaming.fragment_of_round`); None for a whole-model round.
        slice_checksums: every rank's θ checksum after the sync, in rank order (one for
            K = 1); filled in by :class:`~dtrain.diloco.DiLoCo`.
        site_checksum: one θ checksum for the site (equal at consistent sites with the
            same K); filled in by :class:`~dtrain.diloco.DiLoCo`.
        num_lost_notices_used: (ranks j > 0) dead-site notices from rank 0 that ended
            this rank's wait for a member so far (:mod:`dtrain.sitegroup.notices`).
    """

    status: RoundStatus
    reason: str
    result: RoundResult | None = None
    quorum_s: float = 0.0
    fragment: int | None = None
    slice_checksums: list[str] = field(default_factory=list)
    site_checksum: str = ""
    num_lost_notices_used: int = 0

    def __post_init__(self) -> None:
        self.status = RoundStatus(self.status)  # a bad word raises ValueError naming it
