"""Pure decisions of a site group: do its ranks agree on a round, and each rank's plan.

The half-round rule: a site must never apply half a round (some ranks apply
round r while others do not), because its θ would then mix slices of two rounds.
So before any rank pushes, the K ranks all-gather a :class:`RankView` (the
decision each holds, the plan's round and members, and the rounds its own slice
has applied) and run :func:`decide_agreement` on the same list. Only when every
view agrees (same decision, same round, same members, and every slice at that
round) does any rank push; otherwise *every* rank of the site skips the round
(the other sites finish it by their deadlines as for a dead site) and pulls its
slice from the same rank of another site.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Sequence

from dtrain.errors import SiteGroupError
from dtrain.protocol import Member, RoundPlan

__all__ = ["RankView", "decide_agreement", "rank_plan", "rank_donors", "combine_checksums"]


@dataclass(frozen=True, kw_only=True)
class RankView:
    """What one rank believes about the site's next round.

    Attributes:
        rank: the rank's index in the site group.
        kind: the decision it holds (``"plan"``, ``"missed"``, ``"resync"``,
            ``"deferred"``, ``"error"``).
        plan_round: the plan's round number, or None without a plan.
        members: the plan's member site ids, sorted (empty without a plan).
        rounds_applied: rounds its own slice of θ has applied.
    """

    rank: int
    kind: str
    plan_round: int | None
    members: tuple[str, ...]
    rounds_applied: int


def decide_agreement(views: Sequence[RankView]) -> tuple[bool, str]:
    """Whether the site's ranks may run the round (the half-round rule).

    Args:
        views: one :class:`RankView` per rank, in rank order.
    Returns:
        ``(True, reason)`` when every rank holds the same plan (round and
        members) and every slice has applied exactly ``plan_round`` rounds;
        otherwise ``(False, reason)`` naming the first disagreement: then no rank
        pushes, and every rank resynchronises its slice.
    """
    if not views:
        return False, "no rank views"
    first = views[0]
    for v in views[1:]:
        if v.kind != first.kind:
            return False, f"rank {v.rank} holds decision {v.kind!r}, rank {first.rank} {first.kind!r}"
        if v.plan_round != first.plan_round:
            return False, f"rank {v.rank} holds round {v.plan_round}, rank {first.rank} round {first.plan_round}"
        if v.members != first.members:
            return False, f"rank {v.rank} holds members {list(v.members)}, rank {first.rank} {list(first.members)}"
    if first.kind != "plan" or first.plan_round is None:
        return False, f"no plan ({first.kind})"
    for v in views:
        if v.rounds_applied != first.plan_round:
            return (
                False,
                f"rank {v.rank}'s slice applied {v.rounds_applied} rounds, the plan is for round {first.plan_round}",
            )
    return True, f"{len(views)} ranks agree on round {first.plan_round} with {list(first.members)}"


def _check_ranks(m: Member, num_ranks: int) -> None:
    if m.num_ranks != num_ranks:
        raise SiteGroupError(
            f"site {m.site_id} runs {m.num_ranks} ranks per site, this site {num_ranks}: "
            "every site of a run needs the same --ranks-per-site (and model sharding)"
        )


def rank_plan(plan: RoundPlan, rank: int, num_ranks: int) -> RoundPlan:
    """The plan rank ``rank`` runs: the same plan (round, members, deadlines, keys), each
    member's address replaced by the Peer address of its rank ``rank`` (for a one-process
    site, rank 0: its own address).

    Raises:
        SiteGroupError: a member runs a different number of ranks.
    """
    for m in plan.members:
        _check_ranks(m, num_ranks)
    members = tuple(Member(site_id=m.site_id, address=m.rank_address(rank)) for m in plan.members)
    # every other field (deadlines, the datagram key, ...) is the site's plan's: a copy
    # field by field once dropped the datagram key and every site group crashed at round 0
    return dataclasses.replace(plan, members=members)


def rank_donors(members: Sequence[Member], rank: int, num_ranks: int) -> list[Member]:
    """The members rank ``rank`` pulls its slice of the state from (their rank ``rank``).

    Members with a different number of ranks cannot serve this slice and are left out.
    """
    return [Member(site_id=m.site_id, address=m.rank_address(rank)) for m in members if m.num_ranks == num_ranks]


def combine_checksums(slice_checksums: Sequence[str]) -> str:
    """One site checksum from the K slice checksums in rank order (hex blake2b-64)."""
    h = hashlib.blake2b(digest_size=8)
    for c in slice_checksums:
        h.update(c.encode())
        h.update(b"\x00")
    return h.hexdigest()
