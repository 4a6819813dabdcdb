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
  τ = 0 blocks, as plain DiLoCo; τ = H/F merges just before the next fragment round
  measures its Δ (with F = 1: the one-step-delayed mode of DiLoCoX, arXiv 2506.21263).
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
from typing import Callable, Protocol, Sequence

import torch

from dtrain.buckets import BucketLayout
from dtrain.state import GlobalState

__all__ = ["fragment_buckets", "fragment_of_round", "step_actions", "StreamingSync"]

log = logging.getLogger(__name__)

START, APPLY = "start", "apply"


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


def step_actions(step: int, *, period: int, overlap_steps: int, apply_at: int | None) -> tuple[str, ...]:
    """What to do after inner step ``step`` (1-based), in order.

    Args:
        step: inner steps taken so far.
        period: H/F, inner steps between two fragment rounds.
        overlap_steps: τ.
        apply_at: the step the round in flight is due to be merged at (None: none in flight).
    Returns:
        ``("apply",)``, ``("start",)``, ``("apply", "start")`` (τ = H/F: merge, then
        measure the next fragment), ``("start", "apply")`` (τ = 0: a blocking round) or ``()``.
    """
    actions: list[str] = []
    if apply_at is not None and step >= apply_at:
        actions.append(APPLY)
    if step % period == 0:
        actions.append(START)
        if overlap_steps == 0:
            actions.append(APPLY)
    return tuple(actions)


class Outcome(Protocol):
    """What a round's sync returns (``dtrain.membership.SyncOutcome``)."""

    status: str  # "applied", "resynced" or "deferred"
    reason: str


SyncFn = Callable[..., Outcome]  # sync(tensors, *, buckets, fragment): Group.sync


@dataclass(eq=False)
class _InFlight:
    """A fragment round started at ``started_at`` and merged at ``apply_at``."""

    fragment: int
    buckets: tuple[int, ...]
    started_at: int
    apply_at: int
    future: "cf.Future[Outcome]"
    checksums: list[str]  # θ_b of every bucket when the round started
    residuals: list[torch.Tensor | None]  # every bucket's residual when it started (kept by a resync)


class StreamingSync:
    """Fragment rounds of one site, each started at its step and merged τ steps later.

    Args:
        sync: runs one round over the buckets given (``Group.sync`` of
            :mod:`dtrain.membership`; passed in, this module sits beside it).
        site_id: this site (for logs and the thread's name).
        layout: the bucket layout.
        state: θ, outer optimizers, residuals.
        tensors: returns the model's tensors as the layout expects (live, written in place).
        sync_every: H; num_fragments: F; overlap_steps: τ; merge_alpha: α
            (see :class:`~dtrain.configs.DiLoCoConfig`).

    Attributes:
        num_waited_steps: merges that had to wait for their round (its result was not
            there at step t + τ): inner steps that waited on the network.
        waited_s: seconds those merges waited.
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
    ) -> None:
        self._sync, self.site_id = sync, site_id
        self.layout, self.state, self._tensors = layout, state, tensors
        self.fragments = fragment_buckets(len(layout), num_fragments)
        self.period = sync_every // num_fragments
        self.overlap_steps = overlap_steps
        self.merge_alpha = float(merge_alpha)
        self.num_waited_steps = 0
        self.waited_s = 0.0
        self._pending: _InFlight | None = None
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fragment-{site_id}")

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def on_step(self, step: int) -> Outcome | None:
        """After inner step ``step``: merge a round that is due, start one on schedule.

        Returns the outcome of the round merged at this step, or None.
        """
        merged = None
        actions = step_actions(
            step,
            period=self.period,
            overlap_steps=self.overlap_steps,
            apply_at=self._pending.apply_at if self._pending else None,
        )
        for action in actions:
            if action == APPLY:
                merged = self.flush()
            else:
                self._start(step)
        return merged

    def _start(self, step: int) -> None:
        """Measure the next fragment's Δ from a snapshot; run its round in the background."""
        assert self._pending is None, "one fragment round at a time"
        f = fragment_of_round(self.state.rounds_applied, len(self.fragments))
        buckets = self.fragments[f]
        live = self._tensors()
        touched = {sg.tensor_index for b in buckets for sg in self.layout.buckets[b].segments}
        snapshot = [t.detach().clone() if i in touched else t for i, t in enumerate(live)]
        self._pending = _InFlight(
            fragment=f,
            buckets=buckets,
            started_at=step,
            apply_at=step + self.overlap_steps,
            future=self._executor.submit(self._sync, snapshot, buckets=buckets, fragment=f),
            checksums=self.state.checksums(),
            residuals=list(self.state.residuals),
        )

    def flush(self) -> Outcome | None:
        """Merge the round in flight now (waiting for it if it is not done); None if none."""
        p, self._pending = self._pending, None
        if p is None:
            return None
        if not p.future.done():
            self.num_waited_steps += 1
            t = time.monotonic()
            cf.wait([p.future])
            self.waited_s += time.monotonic() - t
        outcome = p.future.result()  # QuorumTimeout propagates
        self._merge(p, outcome)
        return outcome

    def _merge(self, p: _InFlight, outcome: Outcome) -> None:
        """Write the round's θ into the model's tensors, per its outcome."""
        tensors = self._tensors()
        if outcome.status == "applied":
            for b in p.buckets:
                self._merge_bucket(b, tensors, self.merge_alpha)
        elif outcome.status == "resynced":
            changed = [b for b in range(len(self.state)) if self.state.checksum(b) != p.checksums[b]]
            reset = sorted(set(p.buckets) | set(changed))
            for b in range(len(self.state)):
                if b not in reset:  # θ_b did not change: its residual and local progress still hold
                    self.state.residuals[b] = p.residuals[b]
            for b in reset:
                self._merge_bucket(b, tensors, 0.0)
        else:
            log.warning(
                "%s: fragment %d round deferred (%s); training on locally", self.site_id, p.fragment, outcome.reason
            )

    def _merge_bucket(self, b: int, tensors: Sequence[torch.Tensor], alpha: float) -> None:
        with self.state.lock(b):
            theta = self.state.theta[b].detach()
            if alpha == 0.0:
                self.layout.scatter(b, theta, tensors)
            else:
                local = self.layout.gather(b, tensors)
                self.layout.scatter(b, torch.lerp(theta, local, alpha), tensors)

    def close(self) -> Outcome | None:
        """Merge the round in flight (if any) and stop the background thread."""
        try:
            return self.flush()
        finally:
            self._executor.shutdown(wait=True)
