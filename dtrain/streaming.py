"""Streaming rounds: fragments synchronised in turn, communication overlapped with inner steps.

Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping communication",
arXiv 2501.18512; torchft's ``local_sgd.py`` is the reference for the semantics):

* **Fragments** (§2.2). The buckets are cut into F contiguous groups
  (:func:`fragment_buckets`, ``DiLoCoConfig.num_fragments``). A round runs every H/F
  inner steps and synchronises one fragment: round r syncs fragment
  :func:`fragment_of_round` ``= (r + 1) mod F``, so while every round succeeds fragment
  f starts at inner steps f·H/F + k·H. Only one fragment's pseudo-gradient is on the
  wire at a time. A fragment round is a normal round of the rendezvous (its number
  advances per fragment round); the fragment is chosen from the round number, so every
  member picks the same one, also after a resync or a deferred round.
* **Overlap** (§2.3, ``overlap_steps`` τ). At step t the fragment's pseudo-gradient
  Δ = θ − θ_local(t) is measured from a snapshot of the fragment's tensors, and its
  round (``Group.sync`` over the fragment's buckets) runs in a background thread
  while training goes on. At step t + τ its result is merged in: the fragment's
  parameters become ``lerp(θ_new, θ_local(t+τ), α)`` (``merge_alpha``; 0 = θ_new, the
  τ local steps are dropped; α > 0 keeps that share of them). The next pseudo-gradient
  of the fragment is measured from θ_new (θ in :class:`GlobalState`), as in the paper.
  τ = 0 blocks, as plain DiLoCo; τ = H/F with F > 1 merges a fragment right before the
  next fragment starts.
* **One-step-delayed mode** (DiLoCoX, arXiv 2506.21263; PCCL's async DiLoCo) is F = 1,
  τ = H: round r's whole exchange runs during round r+1's inner phase. At each start
  step the model's Δ is measured first (against the θ its steps began from: the snapshot
  is shifted by what the merged round moved θ, :meth:`StreamingSync._shift`), then round
  r's θ is merged in (the first time: θ as it is), then round r+1 is sent; its outer step
  lands on θ after round r. Without the shift Δ would count round r's outer update again.
* **Pacing** (``pace_fraction``). Through a rate-capped link TCP sends a round's bytes at
  the cap, so without pacing a fragment's exchange is a burst as high as a blocking
  round's, only shorter. With τ > 0 a fragment round is given a send-rate budget: its
  estimated bytes spread over ``pace_fraction`` of the expected time of its τ inner
  steps (:func:`pace_window_s`, from the measured step time;
  ``RoundEngine.run_round(pace_window_s=...)``, the shared
  :class:`~dtrain.transports.pacing.Pacer`). Blocking rounds (τ = 0) are never paced.
* **Time-based rounds** (``DiLoCoConfig.round_window_s`` W, issue 34): a fragment period is
  the steps that fit W/F seconds of compute at the site's measured step time, at least 1
  and at most H/F (:func:`fragment_period`, the caller's decision: rank 0's, broadcast over
  the site group, passed to :meth:`StreamingSync.on_step`); :func:`step_actions` then counts
  the period from the last start instead of ``step % (H/F)``. A round in flight is merged
  τ steps into the next period or at its end, whichever comes first (τ clamped to the
  period). The fragment stays :func:`fragment_of_round` of the round number, the claim the
  steps since that fragment's last start.
* **Faults**: the engine's rules hold per fragment (the round is an ordinary round over
  the fragment's buckets). A resynchronised site (cut from the round or declared dead)
  resets only the buckets whose θ changed in the pull, plus the fragment (whose Δ was
  discarded); the other fragments keep their local progress and their residuals.

:func:`step_actions` is the pure schedule; :class:`StreamingSync` carries it out.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dtrain.buckets import BucketLayout
from dtrain.rounds.outcome import RoundStatus, SyncOutcome
from dtrain.state import GlobalState

__all__ = [
    "fragment_buckets",
    "fragment_of_round",
    "fragment_period",
    "first_window_steps",
    "pace_window_s",
    "step_actions",
    "window_steps",
    "StreamingSync",
]

log = logging.getLogger(__name__)

START, APPLY, MEASURE, SUBMIT = "start", "apply", "measure", "submit"


def fragment_buckets(num_buckets: int, num_fragments: int) -> list[tuple[int, ...]]:
    """The buckets of each fragment: ``num_fragments`` contiguous groups, sizes differing by at most 1.

    Raises:
        ValueError: fewer buckets than fragments (names ``num_fragments``).
    """
    if num_fragments < 1 or num_buckets < num_fragments:
        raise ValueError(
            f"num_fragments must be in [1, number of buckets = {num_buckets}], got {num_fragments} "
            "(lower bucket_bytes for more buckets)"
        )
    base, extra = divmod(num_buckets, num_fragments)
    out, start = [], 0
    for f in range(num_fragments):
        n = base + (f < extra)
        out.append(tuple(range(start, start + n)))
        start += n
    return out


def fragment_of_round(round: int, num_fragments: int) -> int:
    """The fragment round ``round`` synchronises: ``(round + 1) mod num_fragments``
    (the first round, at inner step H/F, is fragment 1: fragment f at f·H/F + k·H)."""
    return (round + 1) % num_fragments


def step_actions(
    step: int,
    *,
    period: int,
    overlap_steps: int,
    apply_at: int | None,
    num_fragments: int = 2,
    since_start: int | None = None,
    delayed: bool | None = None,
) -> tuple[str, ...]:
    """What to do after inner step ``step`` (1-based), in order.

    Args:
        step: inner steps taken so far.
        period: inner steps between two fragment rounds: H/F, or with time-based rounds the
            count decided for the current period (:func:`fragment_period`).
        overlap_steps: τ.
        apply_at: the step the round in flight is due to be merged at (None: none in flight).
        num_fragments: F.
        since_start: time-based rounds: inner steps since the current period began (the last
            round's start step), so the period ends when it reaches ``period``; None: fixed
            periods, a round starts when ``step % period == 0``.
        delayed: the one-step-delayed mode (F = 1, τ = H); None: ``num_fragments == 1 and
            overlap_steps == period`` (fixed periods).
    Returns:
        ``("apply",)``, ``("start",)`` (measure Δ and run the round), ``("start", "apply")``
        (τ = 0: a blocking round), ``()``; at τ = H/F, when a merge and a start fall on the
        same step: ``("apply", "start")`` (F > 1: the merged fragment is another one), or
        ``("measure", "apply", "submit")`` (F = 1, τ = H: the one-step-delayed mode, at every
        start step: Δ of the model's steps is measured, then the previous round's θ (at the
        first round: θ as it is) is merged in, then the round is sent).
    """
    due = apply_at is not None and step >= apply_at
    if (step if since_start is None else since_start) % period:
        return (APPLY,) if due else ()
    if delayed if delayed is not None else (num_fragments == 1 and overlap_steps == period):
        return (MEASURE, APPLY, SUBMIT)
    if not due:
        return (START, APPLY) if overlap_steps == 0 else (START,)
    return (APPLY, START)


def window_steps(*, window_s: float, step_s: float, done: int, max_steps: int) -> tuple[int, str]:
    """Time-based rounds (``DiLoCoConfig.round_window_s``): how many inner steps this site's
    round trains (a pure decision).

    Args:
        window_s: the round's compute window, seconds.
        step_s: the expected inner-step time, seconds (> 0; measured).
        done: steps already taken in this round's inner phase (the decision is made after
            the first); the answer is never below it.
        max_steps: the bound (``sync_every``).
    Returns:
        ``(steps, reason)``: ``floor(window_s / step_s)`` clamped to ``[max(1, done), max_steps]``.
    """
    fit = int(window_s / step_s) if step_s > 0 else max_steps
    n = min(max_steps, max(1, done, fit))
    why = f"{fit} steps of {step_s * 1e3:.1f} ms fit in {window_s:g} s"
    if n != fit:
        why += f", clamped to [{max(1, done)}, {max_steps}]"
    return n, why


def first_window_steps(*, window_s: float, elapsed_s: float, done: int, max_steps: int) -> tuple[int | None, str]:
    """Time-based rounds before any step time was measured (a process's first inner
    phase, whose first steps are slow: allocations, cold caches; the first one alone
    once made round 0 train 3 steps of a window that fits 20): whether this phase ends
    now (a pure decision, asked after each step).

    Args:
        window_s: the round's compute window, seconds.
        elapsed_s: seconds the ``done`` steps of this phase took.
        done: steps taken in this phase (>= 1).
        max_steps: the bound (``sync_every``).
    Returns:
        ``(done, reason)`` to end the phase now: the bound is reached, or one more step at
        the mean step time so far (``elapsed_s / done``, an over-estimate while the first
        step is in it) would pass the window; ``(None, "")`` to take another step.
    """
    step_s = elapsed_s / max(1, done)
    if done >= max_steps:
        return done, f"the bound of {max_steps} steps, {elapsed_s:.2f} s of the {window_s:g} s window"
    if elapsed_s + step_s > window_s:
        return done, f"{done} steps took {elapsed_s:.2f} s of the {window_s:g} s window (no step time measured yet)"
    return None, ""


def fragment_period(
    *,
    window_s: float,
    num_fragments: int,
    step_s: float | None,
    done: int,
    elapsed_s: float,
    max_steps: int,
    overlap_steps: int = 0,
) -> tuple[int | None, str]:
    """Time-based rounds (``DiLoCoConfig.round_window_s``), blocking or streaming: the inner
    steps of the current period, from one round's start to the next (a pure decision). With
    F fragments a fragment round starts every ``window_s / F`` seconds of compute, so every
    site starts fragment k's round at about the same wall time whatever its speed; F = 1 is
    the blocking round's window.

    Args:
        window_s: the round window W, seconds (a whole model's worth: F fragment periods).
        num_fragments: F (1: blocking rounds).
        step_s: the expected inner-step time, seconds (measured over earlier periods); None:
            none measured yet (the process's first period: :func:`first_window_steps`, asked
            after every step).
        done: steps taken in this period (>= 1); the answer is never below it.
        elapsed_s: the seconds they took (used only while ``step_s`` is None).
        max_steps: the bound, H/F (``sync_every / num_fragments``).
        overlap_steps: τ. A round started at a period's end is merged τ steps into the next
            period, at the latest at that period's end (the next start): τ is clamped to the
            period decided (the reason says so), so one fragment round at a time holds.
    Returns:
        ``(steps, reason)``: ``floor(W / F / step_s)`` clamped to ``[max(1, done), max_steps]``;
        ``(None, "")`` in the first period while another step fits.
    """
    w = window_s / num_fragments
    if step_s is None:
        n, why = first_window_steps(window_s=w, elapsed_s=elapsed_s, done=done, max_steps=max_steps)
    else:
        n, why = window_steps(window_s=w, step_s=step_s, done=done, max_steps=max_steps)
    if n is not None and num_fragments > 1:
        why = f"fragment period of {window_s:g} s / {num_fragments}: {why}"
    if n is not None and overlap_steps > n:
        why += f"; overlap_steps {overlap_steps} clamped to {n} (the round in flight merges at this period's end)"
    return n, why


def pace_window_s(*, overlap_steps: int, step_s: float | None, pace_fraction: float) -> float | None:
    """Seconds a fragment round's sends are spread over: ``pace_fraction`` x τ x the
    expected inner-step time. None (unpaced): τ = 0 (a blocking round), pacing off
    (``pace_fraction`` 0), or no step time measured yet."""
    if overlap_steps == 0 or pace_fraction <= 0 or step_s is None or not step_s > 0:
        return None
    return pace_fraction * overlap_steps * step_s


SyncFn = Callable[..., SyncOutcome]  # sync(tensors, *, buckets, fragment, pace_window_s): Site.sync


@dataclass(eq=False)
class _InFlight:
    """A fragment round started at ``started_at`` and merged at ``apply_at``."""

    fragment: int
    buckets: tuple[int, ...]
    started_at: int
    apply_at: int
    future: "cf.Future[SyncOutcome]"
    checksums: list[str]  # θ_b of every bucket when the round started
    residuals: list[torch.Tensor | None]  # every bucket's residual when it started (kept by a resync)
    theta_before: list[torch.Tensor] | None = None  # θ_b of its buckets at the start (one-step-delayed mode only)


@dataclass(eq=False)
class _Measured:
    """A fragment's Δ basis: its tensors at the start step (clones; others live, unread)."""

    fragment: int
    buckets: tuple[int, ...]
    snapshot: list[torch.Tensor]


class StreamingSync:
    """Fragment rounds of one site, each started at its step and merged τ steps later.

    Args:
        sync: runs one round over the buckets given (:meth:`dtrain.site.Site.sync`;
            passed in, this module sits below it).
        site_id: this site (for logs and the thread's name).
        layout: the bucket layout.
        state: θ, outer optimizers, residuals.
        tensors: returns the model's tensors as the layout expects (live, written in place).
        sync_every: H; num_fragments: F; overlap_steps: τ; merge_alpha: α;
            pace_fraction: the share of τ steps' time a round's sends spread over
            (see :class:`~dtrain.configs.DiLoCoConfig`).
        on_merge: called (the caller's thread) after θ was written into the model's
            tensors: a site group all-gathers its replicated parts there
            (:meth:`~dtrain.sitegroup.comm.SiteComm.sync_replicas`); None: nothing.

    Attributes:
        num_waited_steps: merges that had to wait for their round (its result was not
            there at step t + τ): inner steps that waited on the network.
        waited_s: seconds those merges waited.
        step_s: the expected inner-step time (an average of the time between
            :meth:`on_step` calls, not counting the time spent in them); None at first.
        num_paced_rounds: rounds started with a send-rate budget.
        merged_round: rounds applied to θ as of the last merge (or, before the first one, as
            of the first round's start): read on the caller's thread, it never moves while a
            round runs in the background, so every rank of a site reads the same number at
            the same inner step (``GlobalState.rounds_applied`` is advanced by the round's
            thread). None until the first round starts.
        merged_checksums: every bucket's θ checksum at the last merge, for the same reason.
        started_round: the number of the last round started (read on the caller's thread at
            its start, when none is in flight: the same on every rank); None before the
            first. A run of R rounds ends once round R − 1 has started and is merged.
    Raises (from :meth:`on_step`): ``QuorumTimeout`` of a round, at its merge.
    """

    def __init__(
        self,
        sync: SyncFn,
        site_id: str,
        layout: BucketLayout,
        state: GlobalState,
        tensors: Callable[[], list[torch.Tensor]],
        *,
        sync_every: int,
        num_fragments: int,
        overlap_steps: int,
        merge_alpha: float,
        pace_fraction: float = 0.0,
        delayed_update: str = "stale",
        on_merge: Callable[[], None] | None = None,
        tokens_per_step: int = 1,
    ) -> None:
        self._sync, self.site_id = sync, site_id
        self.tokens_per_step = tokens_per_step
        self._last_start: dict[int, int] = {}  # fragment -> the inner step its last round started at
        self._on_merge = on_merge
        self.layout, self.state, self._tensors = layout, state, tensors
        self.fragments = fragment_buckets(len(layout), num_fragments)
        self.period = sync_every // num_fragments
        self.overlap_steps = overlap_steps
        self.merge_alpha = float(merge_alpha)
        self.num_waited_steps = 0
        self.waited_s = 0.0
        self.pace_fraction = float(pace_fraction)
        self.step_s: float | None = None
        self.num_paced_rounds = 0
        self.merged_round: int | None = None
        self.started_round: int | None = None
        self.merged_checksums: list[str] | None = None  # every bucket's θ checksum at the last merge
        self._step_end: float | None = None
        self._tau_now = overlap_steps
        self._pending: _InFlight | None = None
        self._delayed = num_fragments == 1 and overlap_steps == self.period  # DiLoCoX's one-step delay
        if delayed_update not in ("stale", "eager"):
            raise ValueError(f"delayed_update must be 'stale' or 'eager', got {delayed_update!r}")
        self.delayed_update = delayed_update
        self._base: dict[int, torch.Tensor] = {}  # eager: per bucket, where the model's current steps began
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fragment-{site_id}")

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def on_step(self, step: int, *, period: int | None = None, since_start: int | None = None) -> SyncOutcome | None:
        """After inner step ``step``: merge a round that is due, start one on schedule.

        Args:
            step: inner steps taken so far.
            period: time-based rounds: the current period's step count (decided by the caller,
                :func:`fragment_period`, alike on every rank of the site); a round in flight
                is merged at this period's end at the latest (τ clamped to it). None: H/F,
                a round every ``step % (H/F) == 0``.
            since_start: with ``period``: steps taken in the current period (this one included).
        Returns the outcome of the round merged at this step, or None.
        """
        self._time_step()
        try:
            return self._on_step(step, period, since_start)
        finally:
            self._step_end = time.monotonic()

    def _time_step(self) -> None:
        """Fold the inner step that just ended into :attr:`step_s` (a running mean, 0.2 weight)."""
        if self._step_end is not None:
            dt = time.monotonic() - self._step_end
            self.step_s = dt if self.step_s is None else 0.8 * self.step_s + 0.2 * dt

    def _on_step(self, step: int, period: int | None, since_start: int | None) -> SyncOutcome | None:
        merged = None
        # the τ steps a round started now is expected to overlap (its pacing): with time-based
        # periods at most this period's steps (the next one's, unknown yet, is about as long)
        self._tau_now = self.overlap_steps if period is None else min(self.overlap_steps, period)
        if period is not None and since_start is not None and self._pending is not None:
            # τ fits the period: merged at the latest at this period's end (the next start)
            self._pending.apply_at = min(self._pending.apply_at, step - since_start + period)
        actions = step_actions(
            step,
            period=self.period if period is None else period,
            overlap_steps=self.overlap_steps,
            apply_at=self._pending.apply_at if self._pending else None,
            num_fragments=len(self.fragments),
            since_start=since_start if period is not None else None,
            delayed=self._delayed,
        )
        measured: _Measured | None = None
        for action in actions:
            if action == APPLY:
                merged, moved = self._flush()
                if measured is not None and self.delayed_update == "eager":
                    self._rebase(measured)
                    self._merged()
                elif measured is not None:  # one-step-delayed: Δ stays relative to the θ the steps began from
                    self._shift(measured, moved)
                    if merged is None:  # no round in flight (the first): the model restarts from θ as it is
                        tensors = self._tensors()
                        for b in measured.buckets:
                            self._merge_bucket(b, tensors, self.merge_alpha)
                        self._merged()
            elif action == MEASURE:
                measured = self._measure()
            elif action == SUBMIT:
                assert measured is not None
                self._submit(step, measured)
            else:
                self._submit(step, self._measure())
        return merged

    def _measure(self) -> _Measured:
        """Snapshot the next fragment's tensors (its Δ = θ − snapshot is formed once its plan arrives)."""
        f = fragment_of_round(self.state.rounds_applied, len(self.fragments))
        buckets = self.fragments[f]
        touched = {sg.tensor_index for b in buckets for sg in self.layout.buckets[b].segments}
        snapshot = [t.detach().clone() if i in touched else t for i, t in enumerate(self._tensors())]
        return _Measured(fragment=f, buckets=buckets, snapshot=snapshot)

    def _submit(self, step: int, m: _Measured) -> None:
        """Run the measured fragment's round in the background; it is merged at ``step + τ``."""
        assert self._pending is None, "one fragment round at a time"
        if self.merged_round is None:  # nothing in flight now: the count is this thread's to read
            self.merged_round = self.state.rounds_applied
        self.started_round = self.state.rounds_applied  # the number of the round started now
        # taken before the round starts: its thread may resync (replacing residuals and θ) at once
        checksums, residuals = self.state.checksums(), list(self.state.residuals)
        theta_before = [self.state.theta[b].detach().clone() for b in m.buckets] if self._delayed else None
        window = pace_window_s(overlap_steps=self._tau_now, step_s=self.step_s, pace_fraction=self.pace_fraction)
        self.num_paced_rounds += window is not None
        # the fragment's claim: the tokens of the inner steps since its last round started
        tokens = self.tokens_per_step * (step - self._last_start.get(m.fragment, 0))
        self._last_start[m.fragment] = step
        self._pending = _InFlight(
            fragment=m.fragment,
            buckets=m.buckets,
            started_at=step,
            apply_at=step + self.overlap_steps,
            future=self._executor.submit(
                self._sync, m.snapshot, buckets=m.buckets, fragment=m.fragment, pace_window_s=window, tokens=tokens
            ),
            checksums=checksums,
            residuals=residuals,
            theta_before=theta_before,
        )

    def _rebase(self, m: _Measured) -> None:
        """One-step-delayed mode, eager update (Kale et al., "Eager updates for overlapped
        communication and computation in DiLoCo", arXiv 2502.12996): the model's own last H
        steps (``own = local − base``, base: where they began) stay in the model on top of the
        θ just merged, as a local stand-in for the round now sent, which replaces it with the
        group's mean one round later. θ itself is the group's on every site, as always.

        Per bucket: ``local ← θ + own``; the snapshot becomes ``θ + own`` so that the round's
        Δ = θ − snapshot = −own (the steps alone, as a pseudo-gradient); ``base ← local``.
        """
        tensors = self._tensors()
        for b in m.buckets:
            with self.state.lock(b):
                theta = self.state.theta[b].detach().clone()
            end = self.layout.gather(b, m.snapshot)  # the model at this start step
            own = end - self._base.get(b, theta)  # the first time: the steps began at θ
            self.layout.scatter(b, theta + own, tensors)
            self.layout.scatter(b, theta + own, m.snapshot)  # Δ = θ − snapshot = base − end
            self._base[b] = theta + own

    def _shift(self, m: _Measured, moved: dict[int, torch.Tensor]) -> None:
        """Add to the snapshot what the merged round moved θ by (θ_after − θ_before), so that
        Δ = θ_after − snapshot' = θ_before − snapshot: the model's own steps, not the outer update."""
        for b, d in moved.items():
            if b in m.buckets:
                self.layout.scatter(b, self.layout.gather(b, m.snapshot).to(d.device) + d, m.snapshot)

    def wait_in_flight(self, timeout_s: float | None = None) -> bool:
        """Wait until the round in flight (if any) has finished, without merging it: θ, the
        outer state, residuals and the round number are then one round's (a consistent
        ``state_dict``). The merge into the model still happens at its step. False on timeout."""
        p = self._pending
        if p is None:
            return True
        done, _ = cf.wait([p.future], timeout=timeout_s)
        return bool(done)

    def flush(self) -> SyncOutcome | None:
        """Merge the round in flight now (waiting for it if it is not done); None if none."""
        return self._flush()[0]

    def _flush(self) -> tuple[SyncOutcome | None, dict[int, torch.Tensor]]:
        """:meth:`flush`, and per bucket how far the round moved θ (one-step-delayed mode only)."""
        p, self._pending = self._pending, None
        if p is None:
            return None, {}
        if not p.future.done():
            self.num_waited_steps += 1
            t = time.monotonic()
            cf.wait([p.future])
            self.waited_s += time.monotonic() - t
        outcome = p.future.result()  # QuorumTimeout propagates
        self.merged_round = self.state.rounds_applied  # nothing else in flight until the next start
        self.merged_checksums = self.state.checksums()  # θ as this round left it (cached per bucket)
        self._merge(p, outcome)
        moved = {}
        if p.theta_before is not None:
            moved = {b: self.state.theta[b].detach() - t0 for b, t0 in zip(p.buckets, p.theta_before)}
        return outcome, moved

    def _merge(self, p: _InFlight, outcome: SyncOutcome) -> None:
        """Write the round's θ into the model's tensors, per its outcome."""
        tensors = self._tensors()
        if outcome.status == RoundStatus.APPLIED:
            for b in p.buckets:
                self._merge_bucket(b, tensors, self.merge_alpha)
        elif outcome.status in (RoundStatus.RESYNCED, RoundStatus.SKIPPED):
            changed = [b for b in range(len(self.state)) if self.state.checksum(b) != p.checksums[b]]
            reset = sorted(set(p.buckets) | set(changed))
            for b in range(len(self.state)):
                if b not in reset:  # θ_b did not change: its residual and local progress still hold
                    self.state.residuals[b] = p.residuals[b]
            for b in reset:
                self._merge_bucket(b, tensors, 0.0)
        if outcome.status.resets_model:
            self._merged()
        else:
            log.warning(
                "%s: fragment %d round deferred (%s); training on locally", self.site_id, p.fragment, outcome.reason
            )

    def _merged(self) -> None:
        """θ was written into the model's tensors: tell the caller (``on_merge``)."""
        if self._on_merge is not None:
            self._on_merge()

    def _merge_bucket(self, b: int, tensors: Sequence[torch.Tensor], alpha: float) -> None:
        with self.state.lock(b):
            theta = self.state.theta[b].detach()
            if alpha == 0.0:
                self.layout.scatter(b, theta, tensors)
            else:
                local = self.layout.gather(b, tensors).to(theta.device)
                self.layout.scatter(b, torch.lerp(theta, local, alpha), tensors)

    def close(self, *, wait: bool = True) -> SyncOutcome | None:
        """Merge the round in flight (if any) and stop the background thread.

        Args:
            wait: False leaves a round in flight to run out on its own (bounded by its
                deadlines) and merges nothing (e.g. on SIGINT).
        """
        if not wait:
            self._pending = None
            self._executor.shutdown(wait=False, cancel_futures=True)
            return None
        try:
            return self.flush()
        finally:
            self._executor.shutdown(wait=True)
