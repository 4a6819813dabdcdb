"""Re-assigning the data shard of a site that stays dead (``--non-iid``; issue 13).

With non-IID data each site trains its own files; a site that dies takes its shard
out of training. :class:`ShardWatch` is a state machine fed with each applied round's
members (:meth:`ShardWatch.observe`): once a site that was a member has been absent
from ``after_rounds`` consecutive rounds, the survivors split its shard among them
(survivor k of the round's sorted members takes part k of len(members)); when it is
back, they give it up. :class:`DataMix` interleaves a site's own stream with the parts
it adopted (one batch from each in turn) and reports each one's ledger.

Shard indices come from site ids of the form ``site-<index>`` (what ``dtrain launch``
gives); a site named otherwise is never adopted (logged once).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Adoption", "ShardWatch", "DataMix", "shard_index"]

log = logging.getLogger(__name__)

_SITE_RE = re.compile(r"^site-(\d+)$")


def shard_index(site_id: str) -> int | None:
    """The shard index of ``site-<index>``; None for other ids."""
    m = _SITE_RE.match(site_id)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Adoption:
    """Part ``part`` of ``num_parts`` of the shard of ``site_id`` (index ``index``), adopted
    after round ``since_round`` (the applied round whose members made it; the same at every
    survivor). Each adoption is a stream of its own (``Task.shard_part``'s ``since_round``):
    a shard adopted again after its site came back and died again draws new windows, never
    the ones an earlier adoption drew (issue 33: exactly-once data)."""

    site_id: str
    index: int
    part: int
    num_parts: int
    since_round: int = 0

    def as_list(self) -> list[int]:
        return [self.index, self.part, self.num_parts, self.since_round]

    @classmethod
    def of_list(cls, site_id: str, v: list) -> "Adoption":
        """From :meth:`as_list` (or a checkpoint's older ``[index, part, num_parts]``)."""
        if not isinstance(v, (list, tuple)) or len(v) not in (3, 4):
            raise ValueError(f"an adoption is [index, part, num_parts, since_round], got {v!r}")
        return cls(str(site_id), *map(int, v))


@dataclass
class ShardWatch:
    """Which dead sites' shards this site trains (see the module docstring).

    Args:
        site_id: this site.
        after_rounds: consecutive absent rounds before a shard is adopted (>= 1).
    """

    site_id: str
    after_rounds: int
    absent: dict[str, int] = field(default_factory=dict)  # member ever seen -> consecutive rounds absent
    adopted: dict[str, Adoption] = field(default_factory=dict)

    def observe(self, members: list[str], round: int = 0) -> tuple[list[Adoption], list[str]]:
        """Feed applied round ``round``'s members; returns ``(new adoptions, released site ids)``."""
        new, released = [], []
        for s in members:
            self.absent[s] = 0
            if s in self.adopted:
                del self.adopted[s]
                released.append(s)
        survivors = sorted(members)
        for s in sorted(self.absent):
            if s in members:
                continue
            self.absent[s] += 1
            if self.absent[s] < self.after_rounds or s in self.adopted or self.site_id not in survivors:
                continue
            idx = shard_index(s)
            if idx is None:
                log.warning("cannot re-assign the shard of %s: not a site-<index> id", s)
                self.absent[s] = -(10**9)  # never again
                continue
            a = Adoption(s, idx, part=survivors.index(self.site_id), num_parts=len(survivors), since_round=round)
            self.adopted[s] = a
            new.append(a)
        return new, released

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: the absence counts and the adoptions (checkpointed with the worker)."""
        return {
            "absent": dict(self.absent),
            "adopted": {s: a.as_list() for s, a in self.adopted.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`. Raises ValueError naming what is malformed."""
        try:
            absent = {str(s): int(n) for s, n in state["absent"].items()}
            adopted = {str(s): Adoption.of_list(s, v) for s, v in state["adopted"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"shards: not a ShardWatch state ({e!r})") from e
        self.absent, self.adopted = absent, adopted


class DataMix:
    """The site's own batch stream, interleaved with adopted parts (one batch each in turn).

    Args:
        own: the task's stream.
        make_part: ``(index, part, num_parts, since_round) -> stream`` (``Task.shard_part``).
    """

    def __init__(self, own, make_part: Callable[[int, int, int], Any]) -> None:
        self.own = own
        self._make_part = make_part
        self.parts: dict[str, Any] = {}
        self.adoptions: dict[str, Adoption] = {}
        self._turn = 0

    def apply(self, new: list[Adoption], released: list[str]) -> None:
        for a in new:
            self.parts[a.site_id] = self._make_part(a.index, a.part, a.num_parts, a.since_round)
            self.adoptions[a.site_id] = a
            log.info(
                "adopting part %d/%d of the shard of %s (dead for a while; after round %d)",
                a.part + 1,
                a.num_parts,
                a.site_id,
                a.since_round,
            )
        for s in released:
            self.parts.pop(s, None)
            self.adoptions.pop(s, None)
            log.info("%s is back: its shard is its own again", s)

    def state_dict(self) -> dict[str, Any]:
        """The turn and each adopted part's adoption and stream position (the own stream
        is checkpointed apart, as ``batches``)."""
        return {
            "turn": self._turn,
            "parts": {
                s: {"adoption": a.as_list(), "stream": self.parts[s].state_dict()} for s, a in self.adoptions.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Re-make the adopted parts of :meth:`state_dict` at their saved positions.

        Raises:
            ValueError: malformed, or a part's stream refuses its saved position
                (another shard, batch size or context length); nothing is changed then.
        """
        try:
            turn = int(state["turn"])
            saved = {str(s): (Adoption.of_list(s, p["adoption"]), p["stream"]) for s, p in state["parts"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"shards: not a DataMix state ({e!r})") from e
        parts = {}
        for s, (a, pos) in saved.items():
            parts[s] = self._make_part(a.index, a.part, a.num_parts, a.since_round)
            parts[s].load_state_dict(pos)
        self.parts, self.adoptions, self._turn = parts, {s: a for s, (a, _) in saved.items()}, turn

    def __iter__(self) -> "DataMix":
        return self

    def __next__(self):
        streams = [self.own, *self.parts.values()]
        stream = streams[self._turn % len(streams)]
        self._turn += 1
        return next(stream)

    def take_ledger(self, fallback: Callable[[], dict]) -> dict:
        """The own stream's ledger (``fallback()`` when it has none), with the adopted
        parts' ledgers under ``adopted`` (site id -> ledger) when there are any."""
        take = getattr(self.own, "take_ledger", None)
        entry = take() if callable(take) else fallback()
        if self.parts:
            entry["adopted"] = {s: p.take_ledger() for s, p in self.parts.items() if hasattr(p, "take_ledger")}
        return entry
