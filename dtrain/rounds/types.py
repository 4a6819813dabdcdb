"""The round engine's public types: :class:`RoundConfig` (per-site round behaviour),
:class:`BucketOutcome` (the one word for each state a bucket can be in after a round),
:class:`RejectionTally` (refused contributions: counts by code, a few example reasons)
and :class:`RoundResult` (what one round did at one site; its metrics line).

Re-exported by :mod:`dtrain.rounds`, where the engine that uses them lives.
:class:`RoundConfig` is defined in :mod:`dtrain.configs` (importable without torch, for
the command line) and re-exported here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from dtrain.configs import RoundConfig
from dtrain.errors import RejectCode

__all__ = [
    "RoundConfig",
    "RoundResult",
    "BucketOutcome",
    "RejectionTally",
    "MAX_REJECT_EXAMPLES_PER_CODE",
    "MAX_REFUSALS_NAMED",
]

#: Example reasons a round keeps per rejection code (the counts are exact).
MAX_REJECT_EXAMPLES_PER_CODE = 5


class BucketOutcome(enum.Enum):
    """The state a bucket is in at one site after a round (the value is the word used
    in logs and in the ``bucket_outcomes`` metric).

    | outcome | value | meaning |
    |---|---|---|
    | APPLIED | ``applied`` | the owner's mean arrived, was applied, and θ_b's checksum equals the owner's |
    | EMPTY | ``empty`` | the owner published a mean with no chunks (some chunk got no contribution at all): nobody applies it, every site keeps θ_b |
    | OWNER_LOST | ``owner_lost`` | the owner could not be reached (or did not answer by the broadcast deadline): nobody got its mean, every survivor keeps θ_b |
    | STALE | ``stale`` | θ_b is behind the owner's (its mean never arrived from a live owner, was undecodable, or the checksum before/after applying differs) and was not repaired (repair off, or it failed) |
    | REPAIRED | ``repaired`` | was stale and was pulled whole (θ_b and outer-optimizer state) from its owner or a member with the owner's checksum |

    In every outcome but APPLIED and REPAIRED this site's contribution to the bucket
    stays in its residual, except for chunks that a finalized mean included
    (:mod:`dtrain.rounds.error_feedback`). A site cut from a round by the quorum (a
    straggler) does not run the round at all: it resynchronises every bucket
    (``RoundStatus.RESYNCED``, :mod:`dtrain.rounds.outcome`), which is not a bucket outcome.
    """

    APPLIED = "applied"
    EMPTY = "empty"
    OWNER_LOST = "owner_lost"
    STALE = "stale"
    REPAIRED = "repaired"

    def __str__(self) -> str:
        return self.value


#: Refusals per round an owner names in ``RoundResult.rejected_senders`` (the rest are counted only).
MAX_REFUSALS_NAMED = 32


class RejectionTally:
    """Refused contributions of one round at their owner: an exact count per
    :class:`~dtrain.errors.RejectCode` and at most ``max_examples`` example reasons per
    code (memory bounded whatever a rogue sender does). Not thread-safe.

    Args:
        max_examples: example reasons kept per code.
    """

    def __init__(self, max_examples: int = MAX_REJECT_EXAMPLES_PER_CODE) -> None:
        if max_examples < 0:
            raise ValueError(f"max_examples must be >= 0, got {max_examples!r}")
        self.max_examples = max_examples
        self.counts: dict[RejectCode, int] = {}
        self.examples: dict[RejectCode, list[str]] = {}

    def add(self, code: RejectCode, reason: str) -> bool:
        """Count one rejection; returns whether ``reason`` was kept as an example
        (callers log those, and only a count of the rest)."""
        self.counts[code] = self.counts.get(code, 0) + 1
        kept = self.examples.setdefault(code, [])
        if len(kept) < self.max_examples:
            kept.append(reason)
            return True
        return False

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by_code(self) -> dict[str, int]:
        """``{code name: count}`` (JSON-safe; what ``RoundResult.rejected`` holds)."""
        return {c.value: n for c, n in sorted(self.counts.items(), key=lambda kv: kv[0].value)}

    def example_reasons(self) -> dict[str, list[str]]:
        """``{code name: [reason, ...]}``, at most ``max_examples`` each."""
        return {c.value: list(r) for c, r in sorted(self.examples.items(), key=lambda kv: kv[0].value)}


@dataclass(kw_only=True)
class RoundResult:
    """What one round did at one site (also the source of its metrics line).

    The bucket counts follow from ``bucket_outcome`` (one :class:`BucketOutcome` per
    bucket; :meth:`count_outcomes` fills them): ``applied_buckets`` = APPLIED,
    ``repaired_buckets`` = REPAIRED, ``stale_buckets`` = STALE + REPAIRED (found stale
    this round), ``skipped_buckets`` = EMPTY + OWNER_LOST; ``bucket_outcomes`` has the
    count of every outcome by its value. ``rejected`` counts the contributions this
    site refused as an owner by :class:`~dtrain.errors.RejectCode` name, with at most
    :data:`MAX_REJECT_EXAMPLES_PER_CODE` reasons per code in ``rejected_examples``.
    ``rejected_senders`` names, for the refusals of contributions to buckets this site
    owns (at most :data:`MAX_REFUSALS_NAMED` a round), the bucket, chunk, sender, the
    refused payload's digest and the digest the finalized mean counted from that sender
    (None: none); ``mean_senders`` has, per bucket applied here, the senders of each chunk
    of the mean applied, compactly (:func:`compact_senders`: the senders and, per sender,
    the chunks it is absent from; ~100 bytes a bucket when every chunk has everyone, where
    a list per chunk made a 4-site datagram round's line 320 KB). Together they let a reader check that nothing refused was applied
    (:func:`dtrain.metrics.rejected_applied`).
    """

    round: int
    members: tuple[str, ...]
    owned_buckets: int = 0
    applied_buckets: int = 0
    stale_buckets: int = 0
    repaired_buckets: int = 0
    skipped_buckets: int = 0
    contributed: bool = True
    reduce_arrived_fraction: float = 0.0  # of expected contribution chunks at my buckets
    reduce_live_fraction: float = 1.0  # the same, of the other members that sent at least one
    broadcast_arrived_fraction: float = 0.0  # of buckets whose mean this site got
    included_fraction: float = 0.0  # of my chunks that a finalized mean included
    bytes_sent: int = 0
    bytes_received: int = 0
    encode_s: float = 0.0
    encoded_bytes: int = 0  # this site's encoded contribution payloads (all owners, itself included)
    encoded_fp32_bytes: int = 0  # the fp32 size of what it encoded (compression = this / encoded_bytes)
    decode_s: float = 0.0  # means applied: the others' checked, decoded, applied; its own applied (the step decodes)
    network_s: float = 0.0
    wait_s: float = 0.0
    total_s: float = 0.0
    reduce_s: float = 0.0  # from the plan's formation (as this site reckons it) to the end of its pushes
    means_s: float = 0.0  # from the plan's formation to when this site held every mean it got
    reduce_timeout_s: float = 0.0  # the plan's deadlines (derived by the rendezvous, or set)
    broadcast_timeout_s: float = 0.0
    deadline_reason: str = ""  # why the deadlines are what they are (the rendezvous's derivation)
    bucket_outcomes: dict[str, int] = field(default_factory=dict)  # BucketOutcome value -> buckets
    rejected: dict[str, int] = field(default_factory=dict)  # RejectCode name -> contributions refused
    rejected_examples: dict[str, list[str]] = field(default_factory=dict)  # RejectCode name -> a few reasons
    # as owner, refused contributions to its buckets: bucket, chunk, sender, digest, counted (at most 32)
    rejected_senders: list[dict] = field(default_factory=list)
    # bucket -> compact_senders(the applied mean's senders per chunk)
    mean_senders: dict[str, dict] = field(default_factory=dict)
    lost_members: list[str] = field(default_factory=list)  # declared dead by the rendezvous during the round
    calls_given_up: int = 0  # pushes and mean pulls given up in flight: owner declared lost (or overran)
    late_means: int = 0  # means that arrived in the late pulls (step 4), from their owner or a member
    errors: list[str] = field(default_factory=list)
    fragment: int | None = None  # the Streaming DiLoCo fragment this round synchronised (None: the whole model)
    tokens: int = 0  # this site's token claim this round (its weight where token-weighted; 0: none)
    claims: dict[str, int] = field(default_factory=dict)  # as owner, token-weighted: sender -> accepted claim
    weight_refused: dict[str, str] = field(default_factory=dict)  # as owner: sender -> why its claim was refused
    trimmed: dict[str, int] = field(default_factory=dict)  # as owner, trim_fraction: sender -> elements cut
    buckets: list[int] = field(default_factory=list)  # the buckets it synchronised; not in the metrics line
    bucket_outcome: list[BucketOutcome] = field(default_factory=list)  # per bucket of `buckets`; not in the line

    def count_outcomes(self, outcomes: Iterable[BucketOutcome]) -> None:
        """Set ``bucket_outcome`` and the counts derived from it (see the class docstring)."""
        self.bucket_outcome = list(outcomes)
        n = {o: 0 for o in BucketOutcome}
        for o in self.bucket_outcome:
            n[o] += 1
        self.bucket_outcomes = {o.value: k for o, k in n.items()}
        self.applied_buckets = n[BucketOutcome.APPLIED]
        self.repaired_buckets = n[BucketOutcome.REPAIRED]
        self.stale_buckets = n[BucketOutcome.STALE] + n[BucketOutcome.REPAIRED]
        self.skipped_buckets = n[BucketOutcome.EMPTY] + n[BucketOutcome.OWNER_LOST]

    def metrics(self) -> dict:
        """The JSON-safe fields of the metrics line (docs/METRICS.md); the per-bucket
        ``bucket_outcome`` list is left out (its counts are in ``bucket_outcomes``)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("bucket_outcome", "buckets")}


def compact_senders(per_chunk: Sequence[Iterable[str]]) -> dict:
    """The senders of each chunk of a mean as ``{"senders": [...], "absent": {sender: [chunk, ...]}}``:
    every sender any chunk includes (sorted), and for each sender missing from some chunks, those
    chunks (ascending); chunk ``c`` includes ``[s for s in senders if c not in absent.get(s, [])]``
    (``dtrain.metrics.chunk_senders``). Chunks with the same senders tuple (the common case: one
    tuple object shared by a mean's chunks) cost one set operation."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for c, s in enumerate(per_chunk):
        groups.setdefault(tuple(s), []).append(c)
    senders = sorted({x for s in groups for x in s})
    absent: dict[str, list[int]] = {}
    for s, chunks in groups.items():
        for x in set(senders) - set(s):
            absent.setdefault(x, []).extend(chunks)
    return {"senders": senders, "absent": {x: sorted(cs) for x, cs in sorted(absent.items())}}
