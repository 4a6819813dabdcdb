"""Plain data types exchanged between sites and with the rendezvous.

They are transport-neutral: the in-process transport passes them as Python
objects, the gRPC transport maps them to ``dtrain/v1`` protobuf messages field for
field. Units are in field names (``_s`` seconds, ``_bytes`` bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar, overload

__all__ = [
    "Member",
    "RoundPlan",
    "Contribution",
    "ContributionRun",
    "MeanChunk",
    "BucketMean",
    "BucketState",
    "JoinInfo",
    "HeartbeatInfo",
    "ReadyDecision",
    "made",
]

_T = TypeVar("_T")


def made(cls: type[_T], /, **fields: object) -> _T:
    """An instance of the frozen dataclass ``cls`` with ``fields`` (every field, by name), equal
    to ``cls(**fields)``, made without the frozen constructor's per-field ``object.__setattr__``
    (~1.1 against ~0.4 µs for a :class:`MeanChunk`): for the many chunk objects a round makes
    from values this process built or already checked (a datagram's header, an encoded bucket).
    No field is checked or defaulted here."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


#: Heartbeats a site may have out at once (``dtrain.membership.Group`` sends the next one
#: while earlier ones are still out), and the gRPC rendezvous client's heartbeat connections.
#: Three: in a model of heartbeats through a link losing 30% of segments (Linux's RTO
#: backoff), one connection stalls the arrivals past the accrual detector's bound ~11 times
#: per 3,000 heartbeats, three about once per 20,000 (tests/unit/test_accrual.py).
HEARTBEATS_IN_FLIGHT = 3


@dataclass(frozen=True, kw_only=True)
class Member:
    """One site admitted to a round.

    Attributes:
        site_id: unique, stable name of the site (e.g. ``"site-0"``).
        address: ``host:port`` where its Peer service listens (for the in-process
            transport, any unique string).
        rank_addresses: for a site group of K > 1 ranks, rank j's Peer address
            at index j (``rank_addresses[0] == address``); empty for a
            single-process site. Rank j syncs its slice with rank j of the others.
    """

    site_id: str
    address: str
    rank_addresses: tuple[str, ...] = ()

    @property
    def num_ranks(self) -> int:
        """K, the number of ranks whose Peer services this member has (1 for a single process)."""
        return max(1, len(self.rank_addresses))

    def rank_address(self, rank: int) -> str:
        """The Peer address of rank ``rank`` (``address`` for a single-process site's rank 0).

        Raises:
            KeyError: the member has no such rank.
        """
        if not self.rank_addresses and rank == 0:
            return self.address
        if 0 <= rank < len(self.rank_addresses):
            return self.rank_addresses[rank]
        raise KeyError(f"{self.site_id} has {self.num_ranks} ranks, no rank {rank}")


@dataclass(frozen=True, kw_only=True)
class RoundPlan:
    """What the rendezvous answers when a quorum for round ``round`` forms.

    Attributes:
        round: the round number r (0-based; equals the number of rounds the
            global parameters have already had applied).
        members: the quorum, sorted by ``site_id``; ownership of buckets follows
            from it by rendezvous hashing (``dtrain.buckets.assign_owners``).
        reduce_timeout_s: seconds after receiving the plan by which owners
            finalize their buckets' means over whatever arrived.
        broadcast_timeout_s: seconds after receiving the plan by which every site
            stops waiting for means; a bucket whose mean did not arrive is stale.
        datagram_key: 32 random bytes the rendezvous draws for this round: the
            AEAD key of the datagram data path (``dtrain.transports.datagram``), so it
            only ever travels over the authenticated control plane. Empty when the
            plan was made without one. Kept out of ``repr`` (plans are logged).
        left_out: live sites the rendezvous did not admit (stragglers it cut), sorted:
            they resync after the round, from its members. A member that ends the run
            with this round waits (bounded) for them to catch up or leave before it
            leaves (``Site.wait_left_out``; issue 33, "no site left behind").
        deadline_reason: why the deadlines are what they are: the rendezvous's derivation
            from the rounds it observed and the stall budget, or "set" for an explicit
            timeout (``dtrain.rendezvous.deadlines``); logged and in the metrics line.
        formed_at: when the rendezvous formed the plan, on its store's clock
            (``RendezvousStore.clock``: monotonic seconds in memory, wall-clock on etcd);
            0 when unknown. The rendezvous's own; not sent to sites.
        age_s: how old the plan was when this site read it, seconds: the rendezvous's
            measure at its answer plus the answer's time in flight (an upper bound).
            The plan's deadlines count from its formation, not from when a site reads
            it (``Site`` opens the round ``age_s`` in the past, and treats a plan older
            than ``reduce_timeout_s`` as a round it missed). Not part of equality.
        formed_local_s: when the plan formed on this process's ``time.monotonic()``
            clock (read time − ``age_s``, set by ``Site``): the round engine counts the
            deadlines from it. None: from when the engine opens the round. Not sent.
    """

    round: int
    members: tuple[Member, ...]
    reduce_timeout_s: float
    broadcast_timeout_s: float
    datagram_key: bytes = field(default=b"", repr=False)
    left_out: tuple[str, ...] = ()
    deadline_reason: str = ""
    formed_at: float = field(default=0.0, compare=False, repr=False)
    age_s: float = field(default=0.0, compare=False)
    formed_local_s: float | None = field(default=None, compare=False, repr=False)

    @property
    def site_ids(self) -> tuple[str, ...]:
        return tuple(m.site_id for m in self.members)

    def address_of(self, site_id: str) -> str:
        for m in self.members:
            if m.site_id == site_id:
                return m.address
        raise KeyError(site_id)


@dataclass(frozen=True, kw_only=True)
class Contribution:
    """One chunk of one site's encoded pseudo-gradient for one bucket.

    A chunk covers elements ``[offset, offset + numel)`` of bucket ``bucket``
    and is encoded on its own, so a lost chunk only affects that slice.

    Attributes:
        round: round number r the contribution belongs to.
        bucket: bucket index.
        chunk: chunk index within the bucket.
        offset: first element of the chunk within the bucket (elements, not bytes).
        numel: number of fp32 elements the payload decodes to.
        codec: codec name (``dtrain.codecs``), e.g. ``"int8+zstd"``.
        sender: site_id of the contributing site.
        payload: the codec's self-describing bytes; as received over gRPC, a read-only
            ``memoryview`` of the message (``dtrain.transports.grpc_wire``: no copy).
        tokens: tokens (samples) the sender trained since its last round, the same on
            every chunk it sends in a round: its weight in a token-weighted mean
            (``AggregationConfig.token_weighted``); 0 (default): no claim. A field of the
            message, so it is authenticated with the rest of the contribution.
    """

    round: int
    bucket: int
    chunk: int
    offset: int
    numel: int
    codec: str
    sender: str
    payload: bytes | memoryview
    tokens: int = 0


class ContributionRun(Sequence[Contribution]):
    """Contributions of one sender, round and codec, in arrival order, held as columns: what a
    datagram receiver hands on for a batch of whole contributions, with no object per
    datagram, and what an owner checks, decodes and counts a run at a time
    (``PeerSide.handle_contributions``). A ``Sequence[Contribution]``: item ``i``, made on
    demand, equals the :class:`Contribution` it stands for; a slice is a run (no copy).

    Attributes:
        round, sender, codec, tokens: shared by every item (a :class:`Contribution`'s fields).
        buckets, chunks, offsets, numels: per item, ints (elements, not bytes).

    Payloads are one per item (``bytes``, or read-only ``memoryview`` slices of one buffer,
    as the datagram receive thread hands them on).
    """

    __slots__ = ("round", "sender", "codec", "tokens", "buckets", "chunks", "offsets", "numels", "_payloads")

    def __init__(
        self,
        *,
        round: int,
        sender: str,
        codec: str,
        tokens: int,
        buckets: list[int],
        chunks: list[int],
        offsets: list[int],
        numels: list[int],
        payloads: list[bytes | memoryview],
    ) -> None:
        n = len(chunks)
        if not len(buckets) == len(offsets) == len(numels) == n:
            raise ValueError(f"columns of unequal length: {len(buckets)}, {n}, {len(offsets)}, {len(numels)}")
        if len(payloads) != n:
            raise ValueError(f"{len(payloads)} payloads for {n} contributions")
        self.round, self.sender, self.codec, self.tokens = round, sender, codec, tokens
        self.buckets, self.chunks, self.offsets, self.numels = buckets, chunks, offsets, numels
        self._payloads = payloads

    @classmethod
    def concat(cls, parts: Sequence[ContributionRun | Contribution]) -> ContributionRun | None:
        """Runs and single contributions one after the other as one run, or None when they do
        not share round, sender, codec and tokens (or are none)."""
        if not parts:
            return None
        if len(parts) == 1 and isinstance(parts[0], ContributionRun):
            return parts[0]
        p0 = parts[0]
        key = (p0.round, p0.sender, p0.codec, p0.tokens)
        cols: dict[str, list] = {k: [] for k in ("buckets", "chunks", "offsets", "numels", "payloads")}
        for p in parts:
            if (p.round, p.sender, p.codec, p.tokens) != key:
                return None
            if isinstance(p, ContributionRun):
                cols["buckets"] += p.buckets
                cols["chunks"] += p.chunks
                cols["offsets"] += p.offsets
                cols["numels"] += p.numels
                cols["payloads"] += p._payloads
            else:
                cols["buckets"].append(p.bucket)
                cols["chunks"].append(p.chunk)
                cols["offsets"].append(p.offset)
                cols["numels"].append(p.numel)
                cols["payloads"].append(p.payload)
        return cls(round=p0.round, sender=p0.sender, codec=p0.codec, tokens=p0.tokens, **cols)

    @classmethod
    def stretches(cls, cs: Sequence[Contribution]) -> list[ContributionRun]:
        """``cs`` cut into runs: each maximal stretch of consecutive items that share round,
        sender, codec and tokens (a run is one stretch: itself)."""
        if isinstance(cs, ContributionRun):
            return [cs]
        out: list[ContributionRun] = []
        start = 0
        for i in range(1, len(cs) + 1):
            if i == len(cs) or (cs[i].round, cs[i].sender, cs[i].codec, cs[i].tokens) != (
                cs[start].round,
                cs[start].sender,
                cs[start].codec,
                cs[start].tokens,
            ):
                out.append(cls.concat(cs[start:i]))  # type: ignore[arg-type]
                start = i
        return out

    def payloads(self) -> list[bytes | memoryview]:
        """Every item's payload, in order (the run's own list: do not modify it)."""
        return self._payloads

    def __len__(self) -> int:
        return len(self.chunks)

    @overload
    def __getitem__(self, i: int) -> Contribution: ...

    @overload
    def __getitem__(self, i: slice) -> ContributionRun: ...

    def __getitem__(self, i: int | slice) -> Contribution | ContributionRun:
        if isinstance(i, slice):
            return ContributionRun(
                round=self.round,
                sender=self.sender,
                codec=self.codec,
                tokens=self.tokens,
                buckets=self.buckets[i],
                chunks=self.chunks[i],
                offsets=self.offsets[i],
                numels=self.numels[i],
                payloads=self._payloads[i],
            )
        return Contribution(
            round=self.round,
            bucket=self.buckets[i],
            chunk=self.chunks[i],
            offset=self.offsets[i],
            numel=self.numels[i],
            codec=self.codec,
            sender=self.sender,
            payload=self._payloads[i],
            tokens=self.tokens,
        )

    def __repr__(self) -> str:
        return f"ContributionRun(round={self.round}, sender={self.sender!r}, codec={self.codec!r}, len={len(self)})"


@dataclass(frozen=True, kw_only=True)
class MeanChunk:
    """The owner's finalized mean for one chunk, encoded with the broadcast codec.

    ``senders`` lists the site_ids whose contributions the mean includes (sorted);
    a site not listed keeps its contribution in its error-feedback residual.
    ``payload``: bytes, or (pulled over gRPC in one part) a read-only ``memoryview``
    of the message that carried it.
    """

    chunk: int
    offset: int
    numel: int
    codec: str
    payload: bytes | memoryview
    senders: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class BucketMean:
    """Everything a site needs to apply round ``round`` to bucket ``bucket``.

    Attributes:
        checksum_before: hex digest of the owner's θ_b before applying the mean;
            a site whose own θ_b differs is stale and repairs the bucket.
        checksum_after: hex digest of θ_b after the owner applied the decoded mean
            with its outer optimizer; every site must reach the same value.
    """

    round: int
    bucket: int
    owner: str
    chunks: tuple[MeanChunk, ...]
    checksum_before: str
    checksum_after: str


@dataclass(frozen=True, kw_only=True)
class BucketState:
    """Whole state of one bucket, for repair and for joining sites.

    Attributes:
        bucket: bucket index.
        rounds_applied: number of rounds applied to this θ_b (= next round number).
        theta: θ_b as little-endian fp32 bytes (4 * numel bytes).
        optimizer_state: the bucket's outer-optimizer ``state_dict`` serialized
            with ``torch.save`` (tensors only, loaded with ``weights_only=True``).
        checksum: hex digest of ``theta``.
    """

    bucket: int
    rounds_applied: int
    theta: bytes
    optimizer_state: bytes
    checksum: str
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class JoinInfo:
    """Rendezvous answer to ``join``.

    Attributes:
        next_round: the round the group will run next (= rounds completed so far).
        members: live sites other than the caller (donors for a state pull).
        heartbeat_interval_s: how often the site must heartbeat.
        needs_state: True when rounds already ran (``next_round > 0``) and other
            live members exist: the caller must pull θ and outer-optimizer state
            before it trains, instead of starting from its own initial weights.
    """

    next_round: int
    members: tuple[Member, ...]
    heartbeat_interval_s: float
    needs_state: bool


@dataclass(frozen=True, kw_only=True)
class HeartbeatInfo:
    """Rendezvous answer to ``heartbeat``.

    ``resync_required`` is True when the rendezvous declared this site dead (or
    cut it from a round it then took part in); the site must pull state again.
    ``known`` is False when the rendezvous does not know the site (it restarted):
    the site re-joins. ``dead`` lists the sites the rendezvous holds dead now
    (silent for longer than its heartbeat timeout, or left): the site's round
    engine stops waiting for their contributions (``RoundEngine.members_lost``).
    ``behind`` lists the live members of the newest round the rendezvous formed that
    have not finished it (their heartbeats' ``rounds_done``): a site ending its run
    keeps serving until they have (``dtrain.site.Site.wait_left_out``).
    """

    known: bool
    resync_required: bool
    next_round: int
    reason: str
    dead: tuple[str, ...] = ()
    behind: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ReadyDecision:
    """Rendezvous answer to ``ready(site, round)``.

    ``status`` is one of:
      * ``"plan"``: ``plan`` holds the admitted quorum for ``round``;
      * ``"wait"``: no decision yet; ask again (the gRPC servicer long-polls);
      * ``"missed"``: the site was not admitted (cut as a straggler, declared
        dead, or asked for a round that already ran); it must resynchronise and
        then ask for ``next_round``.
    ``reason`` always says why, in words, and is logged by both sides.
    """

    status: str
    reason: str
    next_round: int
    plan: RoundPlan | None = None
