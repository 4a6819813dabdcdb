"""A round's deadlines, derived from what the run observed and one stall budget.

Instead of hand-set timeouts (the quorum wait, the owners' reduce deadline, the members'
broadcast deadline), the rendezvous derives each round's deadlines from the rounds it has
seen and one figure the user may state, ``stall_budget_s``: how long a round may stall
beyond its measured exchange (for a straggler, a lost chunk, a slow owner). The
derivation, :func:`derive_deadlines`, is a pure function of the observed history, the
configuration and ``now``; it returns the :class:`Deadlines` with the reason, which the
plan carries to every site (``RoundPlan.deadline_reason``) and the status page shows.

Rule (each figure from the latest ``history_rounds`` clean rounds; a round is clean when
every site's report says all contributions and all means arrived, so no observation is a
deadline in disguise, which would feed the deadlines back into themselves):

* quorum wait  = q(ready spread) · margin + budget  (ready spread: first to last ready)
* reduce       = q(reduce) · margin + budget        (reduce: formation to pushes done)
* broadcast    = max(q(means) · margin + budget, reduce + budget / 2)
                                                    (means: formation to all means in)

and when the reduce deadline backed off (below), the broadcast keeps the window it had
after the reduce before the back-off (its own figure minus the reduce's, before either backed
off): the late pulls and repairs get half of what remains after the reduce each
(``dtrain.rounds.recovery``). With ``reduce + budget / 2`` alone a reduce backed off from 10
to 20 s left the means 2.5 s after it, and a member whose owner's link stalled at 30% loss
had 1.2 s to fetch a mean from another member and 1.2 s to repair: its θ differed for a
round.

with q the ``quantile`` (0.9) over rounds of the slowest site's figure. A round that was not
clean but whose slowest figure reached ``cut_fraction`` (0.9) of the deadline it ran under was
cut by that deadline, not by a fault: its figure is at least the deadline (a right-censored
observation), so it enters the quantile as that deadline; and when the newest such round is
the newest round observed, the next deadline is at least ``backoff`` (2) times the one that
cut it, as TCP backs off its retransmission timer (RFC 6298, 5.5); and when the cut round's
slowest link that delivered anything had delivered only a share f of its contributions by the
reduce deadline D (``RoundTimes.reduce_live``, the owners' ``reduce_live_fraction``), the
figure is what the whole would take at that pace, D / f (at most ``max_pace_factor`` D), and
the next deadline at least that x margin + budget: reno at 10% loss moved a quarter of a
round's contributions by the 10 s start bound, and a doubling per round capped at 40 s cut
every round of that link. A member that sent nothing is left out of f: a dead or partitioned
site is a fault, whose rounds back off as above, not a pace. Without this a link that
slowed past its deadline would only produce rounds that are not clean, and the derivation,
which reads clean rounds only, would keep the deadline that cuts every round. A censored
round counts only until ``min_rounds`` clean rounds follow it: it bounds the link of its
time from below, and the clean rounds since measured the link as it is now. And when the
newest ``shift_rounds`` (5) figures all lie under 1 / ``backoff`` of the window's quantile,
the link got faster (a congestion episode ended): the window restarts after the newest
figure that did not (:func:`since_speedup`). Kept for the whole window, the rounds of a
slowdown held the deadline near its cap for up to ``history_rounds`` rounds after the link
recovered, so a fault in any of them stalled its round for the cap instead of the link's
figure; the price is that slow rounds which come back less often than every
``shift_rounds`` rounds, and need more than the budget covers, are cut each time (raise
``shift_rounds`` for such a link). Before
``min_rounds`` clean rounds, the start bound: quorum = budget, reduce = 2 · budget,
broadcast = 4 · budget (5 / 10 / 20 s at the default budget: the former fixed defaults,
conservative for a LAN and for most WAN links), or, for the reduce and the broadcast, the
slowest round seen that was measured (clean, or cut at a live pace) x margin + budget when
that is more: a reno run's clean 60 s round 1 was followed by the 10 s start bound again,
which cut round 2. The join probe: before
``min_rounds`` rounds of a figure are known, what the sites' join probes predicted a round's
reduce and means take (``probed``: each joining site timed a stream from every member,
``dtrain.site.probe_report``; the slowest site's, at most ``max_pace_factor`` times the start
bound, as it comes from the wire) x margin + budget raises the start bound too: reno at 10%
loss needs ~250 s a round, and its round 0 under the 10 / 20 s start bound ended with unequal
θ at every site. A figure the user set explicitly
(``RendezvousConfig.quorum_timeout_s`` ...) overrides its derivation. A deadline is capped at
``max_factor`` times its start bound, or at what the link was measured to need (clean rounds,
and cut rounds at their live pace) x margin + budget when that is more: faults and back-offs
cannot grow a deadline without bound, and a link that needs longer than the cap is given it
(the budget is a stall beyond the measured exchange, not a bound on the exchange). The idea follows Decoupled DiLoCo (arXiv 2604.21428), which closes
rounds at a minimum quorum plus an adaptive grace window, and hivemind #676 ("the deadline
should track the arrival times you already see").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from typing import Sequence

log = logging.getLogger(__name__)

__all__ = [
    "DeadlineBook",
    "DeadlineConfig",
    "Deadlines",
    "RoundTimes",
    "derive_deadlines",
    "quantile",
    "read_probe_report",
    "read_round_report",
    "since_speedup",
]


@dataclass(frozen=True, kw_only=True)
class DeadlineConfig:
    """How the rendezvous derives deadlines (:func:`derive_deadlines`).

    Attributes:
        stall_budget_s: the one figure a user may state: how long a round may stall beyond
            its measured exchange (waiting for a straggler, a lost chunk, a slow owner),
            seconds > 0. The start bound (before ``min_rounds`` clean rounds) is 1 / 2 / 4
            times it for the quorum wait / reduce / broadcast.
        history_rounds: how many recent clean rounds the derivation reads (>= 1).
        min_rounds: clean rounds needed before the derivation replaces the start bound (>= 1).
        quantile: the quantile of the observed figures used, in (0, 1].
        margin: factor on the observed quantile (>= 1).
        max_factor: a derived deadline is at most this many times its start bound unless the
            link was measured to need more (module docstring) (>= 1).
        max_pace_factor: the most a cut round's pace extrapolates the deadline that cut it,
            per round (>= 1): bounds what one chunk of a link that then stalled can make of
            it. Reno at 10% loss delivered 8% of a round by the 10 s start bound: 4 took two
            cut rounds (40 s, then 260 s) to reach the ~250 s it needed.
        cut_fraction: a round that was not clean and whose slowest figure reached this share
            of its deadline ran to that deadline (a censored observation), in (0, 1].
        backoff: factor on the deadline that cut the newest round observed (>= 1).
        shift_rounds: the newest this many observations, each under 1 / ``backoff`` of the
            window's quantile, mean the link got faster: the older ones leave the window
            (>= 1; a larger figure keeps a deadline that covers slow rounds that come back
            at a longer period).
    """

    stall_budget_s: float = 5.0
    history_rounds: int = 20
    min_rounds: int = 3
    quantile: float = 0.9
    margin: float = 1.5
    max_factor: float = 4.0
    max_pace_factor: float = 16.0
    cut_fraction: float = 0.9
    backoff: float = 2.0
    shift_rounds: int = 5

    def __post_init__(self) -> None:
        b = self.stall_budget_s
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (math.isfinite(b) and b > 0):
            raise ValueError(f"stall_budget_s must be a number of seconds > 0, got {b!r}")
        for name in ("history_rounds", "min_rounds", "shift_rounds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("quantile", "cut_fraction"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        for name in ("margin", "max_factor", "max_pace_factor", "backoff"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 1):
                raise ValueError(f"{name} must be a number >= 1, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class RoundTimes:
    """What one round showed, seconds: the slowest site's figures.

    Attributes:
        round: the round.
        ready_spread_s: from the first member's ready to the last one's (None: the round
            formed by cutting a straggler, so the spread is not known).
        reduce_s: from the plan's formation to the end of a site's pushes (None: unknown).
        means_s: from the plan's formation until a site held every mean (None: unknown).
        clean: every report of it said that all contributions and all means arrived.
        reduce_deadline_s, broadcast_deadline_s: the deadlines its plan carried (None: not
            known here, e.g. another front-end formed it): a round that was not clean and
            ran to one of them is a censored observation (module docstring).
        reduce_live: the lowest ``reduce_live_fraction`` its reports gave (0..1; None:
            unknown): the share of its contributions the slowest link that delivered any had
            delivered when the owner read them, the pace a cut round is extrapolated at.
    """

    round: int
    ready_spread_s: float | None = None
    reduce_s: float | None = None
    means_s: float | None = None
    clean: bool = True
    reduce_deadline_s: float | None = None
    broadcast_deadline_s: float | None = None
    reduce_live: float | None = None

    def paced(self, figure: str, cut_fraction: float, most: float) -> float | None:
        """What ``figure`` would have taken at the pace the round's slowest live link kept,
        when the round was cut (:meth:`cut`) while that link had delivered only part of it
        (``reduce_live`` < 1): the deadline that cut it / ``reduce_live``, at most ``most``
        times that deadline. The means cross the same links and are as large as the
        contributions, so they are extrapolated by the same factor. None otherwise: not cut,
        or no live link was behind (a silent member is a fault, not a pace)."""
        cut_by = self.cut(figure, cut_fraction)
        live = self.reduce_live
        if cut_by is None or live is None or not 0 < live < 1:
            return None
        return cut_by / max(live, 1 / most)

    def cut(self, figure: str, cut_fraction: float) -> float | None:
        """The deadline that cut this round's ``figure`` (``"reduce_s"`` or ``"means_s"``):
        the round was not clean and its figure reached ``cut_fraction`` of that deadline;
        None otherwise (clean, or ended well before its deadline, or the deadline unknown)."""
        value = getattr(self, figure)
        deadline = self.reduce_deadline_s if figure == "reduce_s" else self.broadcast_deadline_s
        if self.clean or value is None or deadline is None or value < cut_fraction * deadline:
            return None
        return deadline


@dataclass(frozen=True, kw_only=True)
class Deadlines:
    """One round's deadlines, seconds, and why they are what they are."""

    quorum_timeout_s: float
    reduce_timeout_s: float
    broadcast_timeout_s: float
    reason: str


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; ``values`` not empty)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def since_speedup(values: Sequence[float], q: float, *, factor: float, rounds: int) -> tuple[Sequence[float], bool]:
    """``values`` (in round order) from after the newest one at or above ``q / factor`` (``q``:
    the window's quantile), when at least ``rounds`` follow it: the link got faster (a level
    shift) and the window restarts there; else ``values`` as they are. Returns the values and
    whether the window restarted."""
    slow = [i for i, v in enumerate(values) if v >= q / factor]
    start = slow[-1] + 1 if slow else 0
    if slow and len(values) - start >= rounds:
        return values[start:], True
    return values, False


def derive_deadlines(
    history: Sequence[RoundTimes],
    *,
    config: DeadlineConfig,
    overrides: tuple[float | None, float | None, float | None] = (None, None, None),
    probed: tuple[float, float] | None = None,
    now: float = 0.0,
) -> Deadlines:
    """The next round's deadlines from the observed ``history`` (any order), the budget
    and the explicit ``overrides`` (quorum, reduce, broadcast; None: derived). ``probed``:
    the reduce and means seconds the sites' join probes predicted (the slowest; None: no
    probe), which raise the start bound. ``now`` is accepted for the pure-decision
    convention (the rule reads no clock; history is counted in rounds). See the module
    docstring for the rule."""
    del now
    b = config.stall_budget_s
    start = (b, 2 * b, 4 * b)
    ordered = sorted(history, key=lambda t: t.round)
    clean = [t for t in ordered if t.clean][-config.history_rounds :]

    def probe_of(i: int) -> float:
        """What the join probes predicted for figure ``i`` (1: reduce, 2: means), at most
        ``max_pace_factor`` times its start bound (a report from the wire); 0: none."""
        if probed is None or i == 0:
            return 0.0
        return min(probed[i - 1], start[i] * config.max_pace_factor)

    def observed(
        values: list[float], i: int, what: str, cap: float, measured: Sequence[float] = ()
    ) -> tuple[float, str]:
        if len(values) < config.min_rounds:
            # too few rounds for a quantile: the start bound, unless a round was measured (or the
            # join probe predicted it) to need longer
            need = max(measured, default=0.0)
            slow = max(need, probe_of(i)) * config.margin + b
            if slow > start[i]:
                d = min(slow, cap)
                if need >= probe_of(i):
                    return d, f"{what} {d:.2f}s (the slowest of {len(values)} rounds seen needed {need:.2f}s)"
                return d, f"{what} {d:.2f}s (the join probe predicts {probe_of(i):.2f}s)"
            return start[i], f"{what} {start[i]:.2f}s (start bound: {len(values)} of {config.min_rounds} rounds seen)"
        q = quantile(values, config.quantile)
        values, sped_up = since_speedup(values, q, factor=config.backoff, rounds=config.shift_rounds)
        q = quantile(values, config.quantile) if sped_up else q
        d = min(q * config.margin + b, cap)
        since = ", since the link sped up" if sped_up else ""
        return d, f"{what} {d:.2f}s (q{config.quantile:g} {q:.2f}s of {len(values)} rounds{since})"

    def exchange(figure: str, i: int, what: str) -> tuple[float, str, float]:
        """A figure's deadline from the clean rounds and the censored ones (module docstring),
        its reason, and the deadline before any back-off."""
        seen, clean_after = [], 0
        for t in reversed(ordered):  # a censored round counts until min_rounds clean ones follow it
            if t.clean:
                seen.append(t)
                clean_after += getattr(t, figure) is not None
            elif clean_after < config.min_rounds and t.cut(figure, config.cut_fraction) is not None:
                seen.append(t)
        seen = seen[::-1][-config.history_rounds :]
        paced = [t.paced(figure, config.cut_fraction, config.max_pace_factor) for t in seen]
        values = [p or t.cut(figure, config.cut_fraction) or getattr(t, figure) for t, p in zip(seen, paced)]
        # what the link was measured to need (clean rounds, and cut rounds at their live pace) is
        # never capped: the budget is a stall beyond it; faults and back-offs are
        measured = [v for t, p, v in zip(seen, paced, values) if v is not None and (t.clean or p is not None)]
        known = [v for v in values if v is not None]
        probe = probe_of(i) if len(known) < config.min_rounds else 0.0  # until rounds are measured
        cap = max(start[i] * config.max_factor, max(*measured, probe, 0.0) * config.margin + b)
        d, why = observed(known, i, what, cap, measured)
        seen_d = d
        d, why = _backed_off(ordered, figure, what, start[i], config, d, why)
        return d, why, seen_d

    spreads = [t.ready_spread_s for t in clean if t.ready_spread_s is not None]
    quorum, why_q = observed(spreads, 0, "quorum", start[0] * config.max_factor)
    reduce, why_r, reduce_seen = exchange("reduce_s", 1, "reduce")
    bcast, why_b, bcast_seen = exchange("means_s", 2, "broadcast")
    qo, ro, bo = overrides
    if qo is not None:
        quorum, why_q = qo, f"quorum {qo:.2f}s (set)"
    if ro is not None:
        reduce, why_r = ro, f"reduce {ro:.2f}s (set)"
    bcast, why_b = _broadcast(bcast, why_b, bo, reduce, reduce_seen, bcast_seen, start[2], config)
    reason = f"budget {b:g}s: {why_q}; {why_r}; {why_b}"
    return Deadlines(quorum_timeout_s=quorum, reduce_timeout_s=reduce, broadcast_timeout_s=bcast, reason=reason)


def _backed_off(
    ordered: Sequence[RoundTimes], figure: str, what: str, start: float, config: DeadlineConfig, d: float, why: str
) -> tuple[float, str]:
    """The deadline ``d`` of ``figure`` raised when the newest round that has the figure was
    cut by its deadline: x ``backoff`` (at most ``max_factor`` x its ``start`` bound), or what
    the whole takes at the slowest live link's pace x margin + budget when that is more
    (module docstring); ``(d, why)`` unchanged otherwise."""
    b = config.stall_budget_s
    newest = next((t for t in reversed(ordered) if getattr(t, figure) is not None), None)
    cut_by = newest.cut(figure, config.cut_fraction) if newest is not None else None
    if newest is None or cut_by is None:
        return d, why
    backed = min(cut_by * config.backoff, start * config.max_factor)
    why_back = f"round {newest.round} ran to its {cut_by:.2f}s deadline: x{config.backoff:g}"
    pace = newest.paced(figure, config.cut_fraction, config.max_pace_factor)
    if pace is not None and pace * config.margin + b > backed:
        backed = pace * config.margin + b
        why_back = (
            f"round {newest.round} ran to its {cut_by:.2f}s deadline with {newest.reduce_live:.0%} of "
            f"the slowest live link's contributions in: {pace:.2f}s at that pace"
        )
    if backed > d or (pace is not None and backed == d):  # the same figure: say why it is the link's
        return backed, f"{what} {backed:.2f}s ({why_back})"
    return d, why


def _broadcast(
    bcast: float,
    why: str,
    override: float | None,
    reduce: float,
    reduce_seen: float,
    bcast_seen: float,
    start: float,
    config: DeadlineConfig,
) -> tuple[float, str]:
    """The broadcast deadline after the reduce's is known: the user's ``override``; else, when
    the reduce backed off past what was seen, the means keep their own window after it (at
    most ``max_factor`` x the broadcast's ``start`` bound); and never under reduce + budget / 2."""
    b = config.stall_budget_s
    gap = bcast_seen - reduce_seen  # the means' own window, before any back-off
    if override is not None:
        return override, f"broadcast {override:.2f}s (set)"
    if reduce > reduce_seen and gap > b / 2 and bcast < min(reduce + gap, start * config.max_factor):
        bcast = min(reduce + gap, start * config.max_factor)
        return bcast, f"broadcast {bcast:.2f}s (reduce + the means' {gap:.2f}s window, kept when the reduce backed off)"
    if bcast < reduce + b / 2:
        return reduce + b / 2, f"broadcast {reduce + b / 2:.2f}s (reduce + budget/2)"
    return bcast, why


class DeadlineBook:
    """What the rounds showed (round -> the slowest site's :class:`RoundTimes`) and what the
    sites' join probes predicted, and the deadlines :func:`derive_deadlines` makes of them
    (``deadlines``, re-derived on every change). The rendezvous core calls it under its own
    lock (not thread-safe)."""

    def __init__(self, config: DeadlineConfig, overrides: tuple[float | None, float | None, float | None]) -> None:
        self.config, self.overrides = config, overrides
        self.times: dict[int, RoundTimes] = {}
        self.probed: dict[str, tuple[float, float]] = {}  # site -> predicted (reduce_s, means_s)
        self.deadlines = derive_deadlines((), config=config, overrides=overrides)

    def observe(self, round: int, **figures: float | bool | None) -> None:
        """Fold a round's figures into its :class:`RoundTimes`: the slowest site's (the longest
        time, the lowest share delivered; clean only while every report says so)."""
        t = self.times.get(round) or RoundTimes(round=round)
        new = {}
        for k, v in figures.items():
            if k == "clean":
                new[k] = t.clean and bool(v)
            elif v is not None:
                old = getattr(t, k)
                new[k] = v if old is None else (min if k == "reduce_live" else max)(old, v)
        self.times[round] = dataclasses.replace(t, **new)
        for r in sorted(self.times)[: -2 * self.config.history_rounds]:
            del self.times[r]
        self._derive()

    def probe(self, site_id: str, figures: tuple[float, float]) -> None:
        """A site's join-probe prediction (:func:`read_probe_report`); site ids come from the
        wire, so at most 65,536 are kept."""
        if site_id in self.probed or len(self.probed) < 1 << 16:
            self.probed[site_id] = figures
        self._derive()

    def _derive(self) -> None:
        p = self.probed.values()
        probed = (max(x[0] for x in p), max(x[1] for x in p)) if p else None
        d = derive_deadlines(list(self.times.values()), config=self.config, overrides=self.overrides, probed=probed)
        if d.reason != self.deadlines.reason:
            log.debug("rendezvous: deadlines %s", d.reason)
        self.deadlines = d


def _seconds(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def read_probe_report(raw: str) -> tuple[bool, tuple[float, float] | None, str]:
    """A site's join-probe report (``dtrain.site.probe_report`` JSON, from the wire): whether it
    is one, its predicted ``(reduce_s, means_s)`` (None: a bad figure, dropped) and what it says
    (or why it was dropped). The derivation caps the figures (``probed`` of
    :func:`derive_deadlines`)."""
    try:
        rep = json.loads(raw)
    except ValueError:
        return False, None, ""
    if not isinstance(rep, dict) or rep.get("probe") is not True:
        return False, None, ""
    figures = (rep.get("reduce_s"), rep.get("means_s"))
    if not all(_seconds(v) for v in figures):
        return True, None, f"bad reduce_s / means_s {figures!r}"[:200]
    return True, (float(figures[0]), float(figures[1])), str(rep.get("why", ""))[:200]  # type: ignore[arg-type]


def read_round_report(raw: str) -> tuple[int, dict] | None:
    """A site's round report (``dtrain.status.round_report`` JSON, from the wire) as the round
    and the :class:`RoundTimes` figures it gives (``clean``, ``reduce_live``, ``reduce_s``,
    ``means_s``); None when it is malformed, not applied, or lacks a finite phase time."""
    try:
        rep = json.loads(raw)
        rnd = int(rep["round"])
    except (ValueError, TypeError, KeyError):
        return None
    if rep.get("status") != "applied" or rnd < 0:
        return None
    times = {k: rep.get(k) for k in ("reduce_s", "means_s")}
    if not all(_seconds(v) for v in times.values()):
        return None
    fractions = (rep.get("reduce_arrived_fraction"), rep.get("broadcast_arrived_fraction"))
    live = rep.get("reduce_live_fraction")
    live = live if isinstance(live, (int, float)) and 0 <= live <= 1 else None
    return rnd, {"clean": fractions == (1.0, 1.0), "reduce_live": live, **times}
