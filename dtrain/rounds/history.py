"""The last few rounds' applied means, kept so that a site behind can replay them.

A joiner (or a site cut from rounds) that holds each bucket's θ_b and outer state at some
earlier round catches up by running, bucket by bucket, the outer steps of the rounds it
missed with the means the group applied (:mod:`dtrain.rounds.catchup`). Every site keeps
what it applied: its :class:`MeanHistory` holds, per closed round and bucket, one of

* the :class:`~dtrain.protocol.BucketMean` that was applied (the owner's encoded bytes, as
  broadcast: already compressed by the broadcast codec), with the outer optimizer's learning
  rates of that step;
* "unchanged": nothing was applied to θ_b in that round (owner lost, a chunk without
  contributions, a bucket outside the round's fragment) — served as a mean without chunks;
* nothing: this site did not learn the group's mean (its copy was stale and it never got
  the mean): a request is refused, the joiner asks another donor.

Bounded by a number of rounds and by the payload bytes kept (``RoundConfig.history_rounds``,
``history_bytes``): the oldest rounds go first, but the newest round is kept even when it
alone is larger than the byte bound (a straggler cut from one round replays it). Means of the
newest round are the same objects the engine serves to late pullers until the next round
opens, so at most one round costs memory past the bound.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Sequence

from dtrain.errors import StateTransferError
from dtrain.protocol import BucketMean, BucketState

__all__ = ["AppliedMean", "MeanHistory", "NotRetained", "HistoryInfo", "history_info_state", "decode_history_info"]


class NotRetained(LookupError):
    """The asked round or bucket is not in the history (too old, not closed yet, or unknown here)."""


@dataclass(frozen=True)
class AppliedMean:
    """What happened to one bucket in one round at this site.

    Attributes:
        mean: the applied mean; ``None``: θ_b passed the round unchanged.
        lrs: the bucket's outer optimizer learning rate per param group at that step.
    """

    mean: BucketMean | None
    lrs: tuple[float, ...] = ()


def _size(m: AppliedMean | None) -> int:
    if m is None or m.mean is None:
        return 0
    return sum(len(ch.payload) for ch in m.mean.chunks)


class MeanHistory:
    """Per closed round, each bucket's :class:`AppliedMean` (or None: unknown here). Thread-safe.

    Args:
        max_rounds: rounds kept, >= 0 (0 keeps none: no site can replay from this one).
        max_bytes: payload bytes kept over all rounds, >= 0.
    """

    def __init__(self, max_rounds: int, max_bytes: int) -> None:
        if max_rounds < 0 or max_bytes < 0:
            raise ValueError(f"max_rounds and max_bytes must be >= 0, got {max_rounds!r}, {max_bytes!r}")
        self.max_rounds = max_rounds
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._rounds: OrderedDict[int, dict[int, AppliedMean | None]] = OrderedDict()
        self._bytes: dict[int, int] = {}

    def close_round(self, round: int, buckets: Mapping[int, AppliedMean | None]) -> None:
        """Keep round ``round``'s outcome per bucket (every bucket of the layout: ``None`` for
        one whose group mean this site does not know); drops the oldest rounds past the bounds
        (never the newest). A round older than one kept, or kept already, is ignored; a gap
        (rounds this site did not close) drops everything older."""
        size = sum(_size(m) for m in buckets.values())
        with self._lock:
            if self.max_rounds == 0:
                return
            if self._rounds and round <= next(reversed(self._rounds)):
                return
            if self._rounds and round != next(reversed(self._rounds)) + 1:
                self._rounds.clear()  # not contiguous (this site missed rounds): start again
                self._bytes.clear()
            self._rounds[round] = dict(buckets)
            self._bytes[round] = size
            # the newest round stays even past the byte bound (a straggler cut from one round
            # replays it; the engine held those means anyway until the next round opened)
            while len(self._rounds) > self.max_rounds or (
                len(self._rounds) > 1 and sum(self._bytes.values()) > self.max_bytes
            ):
                old, _ = self._rounds.popitem(last=False)
                del self._bytes[old]

    def get(self, round: int, bucket: int) -> AppliedMean:
        """Round ``round``'s outcome of ``bucket``.

        Raises:
            NotRetained: the round is not kept (why in the message), or the mean is unknown here.
        """
        with self._lock:
            rec = self._rounds.get(round)
            if rec is None:
                span = f"[{next(iter(self._rounds))}, {next(reversed(self._rounds))}]" if self._rounds else "none"
                raise NotRetained(f"round {round} not kept here (kept: {span})")
            if bucket not in rec:
                raise NotRetained(f"bucket {bucket} out of range")
            m = rec[bucket]
        if m is None:
            raise NotRetained(f"round {round} bucket {bucket}: the group's mean is not known here")
        return m

    def span(self) -> tuple[int, int] | None:
        """``(oldest, newest)`` round kept, or None."""
        with self._lock:
            if not self._rounds:
                return None
            return next(iter(self._rounds)), next(reversed(self._rounds))

    def bytes_kept(self) -> int:
        with self._lock:
            return sum(self._bytes.values())


@dataclass(frozen=True)
class HistoryInfo:
    """What a donor says about itself to a site catching up (a ``PullState`` of bucket index
    ``num_buckets + 1``; no proto change, as the training position at ``num_buckets``).

    Attributes:
        rounds_applied: the donor's next round (its θ reflects rounds ``[0, rounds_applied)``).
        span: ``(oldest, newest)`` round whose means it keeps, or None.
        lrs: per kept round, per bucket, the outer learning rates of that round's step.
        lrs_now: per bucket, the outer learning rates of the donor's next step (an outer LR
            scheduler steps them after each round).
        skipped: recent rounds the donor was a member of and did not run (its plan expired
            before it read it: ``RoundEngine.skip_round``), ascending; a site that skipped one
            too learns from these whether any member ran it (``dtrain.rounds.catchup.decide_void``).
    """

    rounds_applied: int
    span: tuple[int, int] | None
    lrs: dict[int, list[tuple[float, ...]]]
    lrs_now: list[tuple[float, ...]] = ()  # type: ignore[assignment]
    skipped: tuple[int, ...] = ()


def history_info_state(
    history: MeanHistory,
    rounds_applied: int,
    lrs_now: list[tuple[float, ...]],
    *,
    index: int,
    skipped: Sequence[int] = (),
) -> BucketState:
    """The answer to a ``PullState`` of bucket ``index`` (= number of buckets + 1): this site's
    :class:`HistoryInfo`, JSON in ``optimizer_state``, its blake2b-128 as the checksum."""
    with history._lock:
        lrs = {
            str(r): [list(m.lrs) if m is not None else None for _, m in sorted(rec.items())]
            for r, rec in history._rounds.items()
        }
        span = [next(iter(history._rounds)), next(reversed(history._rounds))] if history._rounds else None
    data = json.dumps(
        {
            "rounds_applied": rounds_applied,
            "span": span,
            "lrs": lrs,
            "lrs_now": [list(x) for x in lrs_now],
            "skipped": sorted(int(r) for r in skipped),
        }
    ).encode()
    return BucketState(
        bucket=index,
        rounds_applied=rounds_applied,
        theta=b"",
        optimizer_state=data,
        checksum=hashlib.blake2b(data, digest_size=16).hexdigest(),
        extra={"history": True},
    )


def decode_history_info(st: BucketState) -> HistoryInfo:
    """The :class:`HistoryInfo` of a :func:`history_info_state` answer.

    Raises:
        StateTransferError: not such an answer, corrupt or unreadable.
    """
    if not st.extra.get("history") or st.theta:
        raise StateTransferError(f"bucket {st.bucket}: not a history summary")
    if hashlib.blake2b(st.optimizer_state, digest_size=16).hexdigest() != st.checksum:
        raise StateTransferError("history summary: checksum mismatch (corrupt transfer)")
    try:
        d = json.loads(st.optimizer_state)
        lrs = {
            int(r): [tuple(float(x) for x in v) if v is not None else () for v in per] for r, per in d["lrs"].items()
        }
        span = (int(d["span"][0]), int(d["span"][1])) if d["span"] else None
        now = [tuple(float(x) for x in v) for v in d["lrs_now"]]
        skipped = tuple(int(r) for r in d.get("skipped", ()))  # absent from a donor of an older version
        return HistoryInfo(rounds_applied=int(d["rounds_applied"]), span=span, lrs=lrs, lrs_now=now, skipped=skipped)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise StateTransferError(f"history summary unreadable: {e}") from e
