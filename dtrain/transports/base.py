"""The Transport interface that the round engine is written against.

A transport moves the messages of ``dtrain.protocol`` between sites. Server side,
it hands every incoming request to a :class:`PeerHandler` (the site's round
engine); client side, it offers ``push`` / ``pull_mean`` / ``pull_state``.

Contract every transport honours (``tests/unit/test_transport_contract.py`` runs
the same suite against each one):

* Every client call takes ``timeout_s`` and never blocks longer than that
  (plus a small scheduling slack); past it, it raises :class:`PeerTimeout`.
* An unreachable peer raises :class:`PeerUnavailable` (the only error a caller
  may retry).
* A handler that raises :class:`Rejected` makes the client call raise
  :class:`Rejected` with the same ``code`` and ``reason``.
* ``push`` delivers contributions in order; the handler sees each one at most
  once per call; the first rejection ends the call (earlier chunks of the same
  call stay accepted).
* ``stop(grace_s)`` finishes in-flight calls for up to ``grace_s`` seconds and
  then refuses new ones.

A transport whose refusals reach the sender only after the whole push (the datagram
path, ``dtrain.transports.datagram``) sets ``reports_rejections_in_order = False``:
its ``push`` still raises the first refusal, but later chunks were already handled.

A transport whose members acknowledge every mean they got from its owner, pulled or
pushed (the datagram path's MEAN_ACK, through ``handle_mean_delivered``), sets
``acknowledges_means = True``: the owner then counts a mean as delivered on the
acknowledgement, not when it served the pull (a served reply can still be lost as the
owner exits).

A transport that can time a stream from a peer (gRPC, and the datagram path through its
gRPC half) answers :meth:`Transport.probe_link` with a :class:`LinkProbe`: a site's join
probe (``dtrain.site.Site.join``), from which the rendezvous sizes its first rounds'
deadlines (``dtrain.rendezvous.deadlines``). Others return None.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from dtrain.protocol import BucketMean, BucketState, Contribution, RoundPlan

__all__ = ["LinkProbe", "PeerHandler", "Transport"]


class PeerHandler(Protocol):
    """What a site serves to its peers (implemented by ``dtrain.rounds.RoundEngine``)."""

    def handle_contribution(self, contribution: Contribution) -> None:
        """Validate and accept one chunk; raise ``Rejected(code, reason)`` to refuse."""

    def handle_pull_mean(
        self, round: int, bucket: int, requester: str, timeout_s: float, *, have_checksum: str = ""
    ) -> BucketMean:
        """Return the finalized mean, waiting up to ``timeout_s`` for finalization.

        ``have_checksum``: the requester's θ_b checksum before applying, as it sent it
        ("" = none); an owner uses it to tell whether the requester will repair the bucket.

        Raises ``Rejected(NOT_FOUND | FAILED_PRECONDITION, reason)`` when this site has
        no mean for that round/bucket, ``PeerTimeout`` when it is not final in time.
        """

    def handle_pull_state(self, bucket: int, requester: str) -> BucketState:
        """Return the bucket's current θ_b and outer-optimizer state."""

    # Optional: ``handle_sender_done(round, sender)``: a transport that learns that a
    # sender sent everything it will send for a round (the datagram path's SEND_END)
    # calls it, so the handler stops waiting for chunks that were lost.

    # Optional: ``handle_mean_delivered(round, bucket, member, have_checksum)``: a transport
    # that delivers this site's means without a pull (the datagram path's pushed means,
    # confirmed by the member's MEAN_ACK, which carries the member's θ_b checksum) calls
    # it, so that the member counts as having pulled the mean (``close()`` waits for
    # exactly those pulls, and for a stale member's state pull too).

    # Optional (transports call it when the handler has it):
    # ``handle_push_ended(sender: str, round: int, num_accepted: int, *, at_deadline: bool,
    # part: tuple[int, int]) -> None`` — a push stream from ``sender`` for ``round`` ended
    # (closed by the sender, or broken because it died or its connection dropped: a gRPC
    # server cannot tell these apart) after ``num_accepted`` accepted chunks; ``at_deadline``:
    # it ended at its call's own deadline (the sender's time ran out); ``part``: (i, k), the
    # stream is part i of a push sent as k streams ((0, 1): the whole push). Must not block.


@dataclass(frozen=True, kw_only=True)
class LinkProbe:
    """What one probe of a peer's link measured (:meth:`Transport.probe_link`).

    Attributes:
        address: the peer probed.
        rtt_s: seconds of an empty call's round trip (the connection already open).
        rate_bytes_per_s: bytes per second of the filler stream from the first part's
            arrival to the last one's; None when fewer than two parts arrived in time.
        bytes: filler bytes that arrived within the probe's time.
        seconds: from the filler call's start until its last part arrived (or its time ran out).
        complete: every requested byte arrived in time (else the link is slower than
            ``bytes / seconds``: the rate is an upper bound).
    """

    address: str
    rtt_s: float
    rate_bytes_per_s: float | None
    bytes: int
    seconds: float
    complete: bool


class Transport(abc.ABC):
    """Moves round messages between sites. One instance per site."""

    @abc.abstractmethod
    def start(self, handler: PeerHandler) -> str:
        """Start serving ``handler``; return the address peers should use."""

    @abc.abstractmethod
    def push(
        self,
        address: str,
        contributions: Sequence[Contribution],
        *,
        timeout_s: float,
        pace: Callable[[int], None] | None = None,
    ) -> int:
        """Send contributions (usually every chunk this site owes one owner).

        ``pace`` (a paced fragment round): called with a contribution's payload bytes right
        before it goes on the wire (it may block: the round's send budget); None: unpaced.
        Returns the number of contributions the peer accepted (all of them on
        success). Raises ``Rejected`` (first refusal), ``PeerUnavailable``, ``PeerTimeout``.
        """

    @abc.abstractmethod
    def pull_mean(
        self, address: str, round: int, bucket: int, *, requester: str, timeout_s: float, have_checksum: str = ""
    ) -> BucketMean:
        """Fetch a bucket's finalized mean for ``round`` (the peer waits for it to be final).

        ``have_checksum``: the requester's θ_b checksum before applying ("" = none); the
        transport hands it to the owner's handler (``handle_pull_mean(..., have_checksum=)``),
        which then knows whether this member will need a repair."""

    @abc.abstractmethod
    def pull_state(self, address: str, bucket: int, *, requester: str, timeout_s: float) -> BucketState:
        """Fetch a bucket's whole state (θ_b, outer-optimizer state) for repair or joining."""

    def probe_link(self, address: str, *, max_bytes: int, timeout_s: float, requester: str) -> LinkProbe | None:
        """Time a round trip and a stream of up to ``max_bytes`` filler bytes from the peer at
        ``address``, within ``timeout_s`` seconds in all (a link slower than that gives what
        arrived). None: this transport cannot probe (the default). Raises ``PeerUnavailable``,
        ``PeerTimeout`` (not even the round trip in time), ``Rejected`` (the peer refused)."""
        return None

    def begin_round(self, plan: RoundPlan, owners: Sequence[str], site_id: str) -> None:
        """Called by the round engine once it accepts contributions for ``plan.round``.

        A transport that needs the plan (the datagram path: the round's key, the
        members' addresses, which buckets' means to push or await) takes it here;
        ``owners`` is the owner site_id per bucket. Default: nothing.
        """
        return None

    @abc.abstractmethod
    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving; in-flight calls get ``grace_s`` seconds to finish."""

    def bytes_sent(self) -> int:  # pragma: no cover - overridden where counted
        """Total payload bytes this transport sent (for round metrics)."""
        return 0

    def bytes_received(self) -> int:  # pragma: no cover
        """Total payload bytes this transport received."""
        return 0
