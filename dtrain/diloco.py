"""``DiLoCo``: wrap a model and any inner optimizer; every H inner steps a round runs.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models", arXiv 2311.08105, Algorithm 1): each site runs H inner steps
of its own optimizer, then the sites average the pseudo-gradients
Δ = θ − θ_local and apply an outer optimizer (SGD, lr 0.7, momentum 0.9,
Nesterov) to the global parameters θ.

Usage keeps a training loop's shape (as torchft's ``DiLoCo`` does)::

    model = MyModel(); opt = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
    diloco = DiLoCo(model, opt, config=DiLoCoConfig(sync_every=50))   # hooks opt.step()
    for x, y in data:
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    diloco.close()   # waits (bounded) until the peers pulled this site's last means

Without a transport and rendezvous it runs as a single local site (useful for
tests); pass ``transport=GrpcTransport(...)`` and ``rendezvous=GrpcRendezvousClient(...)``
for a real multi-site run.

A site that is a torch.distributed group of K ranks (DDP, FSDP2 or plain replicas)
runs the same wrapper on every rank, with ``site_comm=TorchSiteComm()`` and its own
transport per rank (rendezvous on rank 0 only): rank j holds θ, the outer state and the
residuals of slice j (:class:`~dtrain.sitegroup.slices.SliceMap`: its FSDP2 shards, or
1/K of the replicated tensors) and syncs it with rank j of the other sites, so a rank's
DiLoCo memory is ~12/K bytes per parameter (as torchft's DiLoCo serves plain tensors
and DTensor shards alike).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
import time
from typing import Callable

import torch

from dtrain.buckets import BucketLayout
from dtrain.configs import DiLoCoConfig
from dtrain.errors import LeftBehind
from dtrain.membership import Group, RendezvousClient
from dtrain.protocol import BucketState, Member
from dtrain.rendezvous import InprocRendezvousClient, RendezvousConfig, RendezvousCore
from dtrain.rounds import RoundEngine
from dtrain.rounds.outcome import RoundStatus, SyncOutcome
from dtrain.rounds.pulls import PullWait
from dtrain.site import Site
from dtrain.sitegroup.agree import combine_checksums
from dtrain.sitegroup.comm import LocalSiteComm, SiteComm
from dtrain.sitegroup.slices import SliceMap
from dtrain.state import (
    GlobalState,
    OuterOptimizerFactory,
    copy_reusing,
    default_outer_optimizer,
    delayed_outer_optimizer,
    position_state,
    theta_device_of,
)
from dtrain.streaming import StreamingSync, fragment_buckets, fragment_period
from dtrain.transports.base import Transport
from dtrain.transports.inproc import InprocNetwork, InprocTransport

__all__ = ["DiLoCoConfig", "DiLoCo", "sync_tensors", "theta_checksum", "diloco_numel"]

log = logging.getLogger(__name__)

# state_dict() keys that load_state_dict() needs, and their names in the older layout
_STATE_KEYS = ("theta", "outer_optimizer", "residuals", "round", "bucket_round", "fingerprint")
_OLD_NAMES = {"outer_optimizer": "optimizers", "round": "rounds_applied"}


def sync_tensors(model: torch.nn.Module, buffers: str) -> tuple[list[torch.Tensor], list[str]]:
    """The tensors DiLoCo synchronises: every parameter (``.data``: DTensors stay
    DTensors), then the floating-point buffers when ``buffers == "average"``; with
    their kinds (``"param"``/``"buffer"``) as ``BucketLayout`` takes them."""
    tensors = [p.data for p in model.parameters()]
    kinds = ["param"] * len(tensors)
    if buffers == "average":
        bufs = [b for b in model.buffers() if b.is_floating_point()]
        tensors += bufs
        kinds += ["buffer"] * len(bufs)
    return tensors, kinds


def theta_checksum(state: GlobalState, bucket_checksums: list[str] | None = None) -> str:
    """One hex digest (blake2b-64) over every bucket's θ checksum of ``state`` (one rank's
    slice; equal on consistent sites), or over ``bucket_checksums`` taken earlier."""
    h = hashlib.blake2b(digest_size=8)
    for c in bucket_checksums if bucket_checksums is not None else state.checksums():
        h.update(c.encode())
    return h.hexdigest()


def diloco_numel(state: GlobalState) -> dict[str, int]:
    """Elements a process holds for DiLoCo: θ, outer-optimizer state tensors and
    residuals (fp32 each, so bytes = 4 x ``total``).

    Returns:
        ``{"theta", "outer", "residual", "total"}`` element counts.
    """
    theta = sum(t.numel() for t in state.theta)
    outer = 0
    for opt in state.optimizers:
        for st in opt.state.values():
            outer += sum(v.numel() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    resid = sum(r.numel() for r in state.residuals if r is not None)
    return {"theta": theta, "outer": outer, "residual": resid, "total": theta + outer + resid}


class DiLoCo:
    """DiLoCo around ``model`` and its inner optimizer, for a site of K >= 1 ranks.

    Args:
        model: any ``torch.nn.Module`` (fp32, bf16 or fp16 parameters); for K > 1 this
            rank's module (DDP-wrapped, FSDP2-sharded or plain): DTensor parameters are
            synced as their local shards, replicated ones as a 1/K partition that is
            all-gathered inside the site after a round.
        inner_optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        config: see :class:`DiLoCoConfig`; ``site_id`` is the site's (the same on every rank).
        outer_optimizer: factory ``list[Tensor] -> Optimizer`` applied to each
            bucket of θ (default SGD lr 0.7, momentum 0.9, Nesterov; in the
            one-step-delayed mode momentum 0.7: :func:`dtrain.state.delayed_outer_optimizer`).
        transport: how this rank reaches the other sites (default: a private in-process
            network, i.e. a single local site); each rank of a site has its own.
        rendezvous: rendezvous client (default for K = 1: a private in-process one with
            ``min_sites=1``); rank 0 only for K > 1 (None on the other ranks).
        inner_scheduler: the inner optimizer's LR scheduler, if any (the caller
            steps it); its state travels with the training position.
        outer_scheduler: factory ``Optimizer -> LRScheduler`` applied to each
            bucket's outer optimizer; stepped here after every applied round.
        site_comm: the site's ranks (:class:`~dtrain.sitegroup.comm.TorchSiteComm` for
            K > 1; default :class:`~dtrain.sitegroup.comm.LocalSiteComm`, one process).

    On construction the site joins the group; if rounds already ran it pulls θ
    and the outer-optimizer state from the members (rank j from their rank j) and
    loads θ into ``model``, then heals its training position from the first donor that
    has one for that round, on every rank (as torchft heals a replica): the inner step
    count, the inner optimizer's state, the inner and outer LR schedulers' states. A
    site whose own state is current (nothing pulled) keeps its own. The data position
    is not taken from a donor (the donor's is its own shard's); the inner step count it
    takes is the cursor ``dtrain worker`` moves its own stream on to: docs/DECISIONS.md.
    Peer faults during rounds never raise here; ``QuorumTimeout`` does (on every
    rank), when no round can form within ``config.group.quorum_wait_s``.
    For K > 1 every rank must construct it and call :meth:`step`/:meth:`sync` and
    :meth:`close` in the same order (they run collectives); a rank that dies breaks
    the site's collectives after the process group's timeout.

    Raises:
        ValueError: a non-floating-point tensor, rank 0 without a rendezvous, or a
            rank with fewer buckets than ``num_fragments`` (on every rank).
        SiteGroupError: sites with different numbers of ranks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        config: DiLoCoConfig | None = None,
        outer_optimizer: OuterOptimizerFactory = default_outer_optimizer,
        transport: Transport | None = None,
        rendezvous: RendezvousClient | None = None,
        inner_scheduler: "torch.optim.lr_scheduler.LRScheduler | None" = None,
        outer_scheduler: "Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None" = None,
        site_comm: SiteComm | None = None,
        _defer_join: bool = False,
    ) -> None:
        self.config = config or DiLoCoConfig()
        if self.config.round_window_s is not None and not self.config.rounds.aggregation.token_weighted:
            log.warning(
                "%s: time-based rounds (round_window_s %.3g s) without aggregation.token_weighted: a fast "
                "site trains more steps per round than a slow one, yet each contribution counts equally "
                "(--token-weighted weighs each by the tokens it trained)",
                self.config.site_id,
                self.config.round_window_s,
            )
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.comm: SiteComm = site_comm or LocalSiteComm()
        self.rank, self.num_ranks = self.comm.rank, self.comm.num_ranks
        tensors, kinds = sync_tensors(model, self.config.buffers)
        for t in tensors:
            if not t.is_floating_point():
                raise ValueError(f"DiLoCo synchronises floating-point tensors only, got {t.dtype}")
        # K > 1: this rank's slice, views of the model's tensors; K = 1: the tensors themselves
        self.slices = SliceMap(tensors, kinds, self.rank, self.num_ranks) if self.num_ranks > 1 else None
        if self.slices is not None:
            self._slice, kinds = self.slices.local()
            tensors = self._slice
        self.layout = BucketLayout([t.numel() for t in tensors], kinds, self.config.buckets)
        if outer_optimizer is default_outer_optimizer and self.config.one_step_delayed:
            outer_optimizer = delayed_outer_optimizer  # a one-round-stale Δ: lower outer momentum
        device = theta_device_of(tensors, self.config.theta_device)
        self.state = GlobalState(self.layout, tensors, outer_optimizer, device=device)
        self.engine = RoundEngine(
            self.config.site_id, self.state, transport or InprocTransport(InprocNetwork()), self.config.rounds
        )
        # token claims are bounded by max_weight_ratio x a full round's tokens (claim_decision)
        self.engine.full_round_tokens = self.config.sync_every * self.config.tokens_per_step
        # a site group's ranks take turns holding the extra bucket of their slice (assign_owners)
        self.engine.owner_rotation = self.rank if self.num_ranks > 1 else None
        self.engine.start()
        if rendezvous is None and self.num_ranks == 1:
            rendezvous = InprocRendezvousClient(RendezvousCore(RendezvousConfig(min_sites=1)))
        self.site = Site(self.engine, self.comm, rendezvous, self.config.group)
        self.inner_scheduler = inner_scheduler
        self.outer_schedulers = [outer_scheduler(o) for o in self.state.optimizers] if outer_scheduler else []
        self.inner_steps = 0
        self.round_steps = 0  # inner steps since the last blocking round reset the model (its claim)
        # time-based rounds: this phase's step count (decided once, rank 0's), the measured step time
        self.step_s: float | None = None
        self._first_step_s: float | None = None  # the process's first inner step (slow: warm-up), seconds
        self.phase_reason = ""
        self._phase_target: int | None = None
        self._phase_steps = 0
        self._phase_t0 = time.monotonic()
        self._phase_waited0 = 0.0  # the streaming merges' wait at the phase's start
        self.last_outcome: SyncOutcome | None = None
        self.on_round: list[Callable[[SyncOutcome], None]] = []
        self.healed_from: str | None = None  # the donor of the last position heal
        self._closed = False
        self._settled: tuple[SyncOutcome | None, LeftBehind | None] | None = None  # catch_up_last_round's
        self._hook_paused = False  # checkpoint code steps the optimizer without it counting
        # process CPU seconds of the last blocking sync's steps: gather, round (Site.sync),
        # scatter (θ into the model), allgather (replicated parts, K > 1), checksum
        self.last_cpu_s: dict[str, float] = {}
        # Streaming DiLoCo (fragments, overlap, merge): dtrain/streaming.py runs the rounds.
        self.streaming = self._streaming_sync(self.config) if self.config.streaming else None
        self._position: dict | None = None  # the snapshot joiners heal from (_snapshot_position)
        self._position_lock = threading.Lock()  # its in-place refresh against a PullState serializing it
        self._in_step_hook = False  # a round runs inside inner_optimizer.step() (the post-step hook)
        self._heal_due: dict | None = None  # a position healed there, installed at the next step's start
        self.engine.position_source = self._serve_position
        if not _defer_join:
            self.join()
        self._hooks = []
        if self.config.hook_optimizer:
            self._hooks = [
                inner_optimizer.register_step_post_hook(self._post_step),
                inner_optimizer.register_step_pre_hook(self._pre_step),
            ]

    @property
    def group(self) -> Group | None:
        """Rank 0's membership (rendezvous client, heartbeats); None on ranks j > 0."""
        return self.site.group

    def _streaming_sync(self, c: DiLoCoConfig) -> StreamingSync:
        """The fragment-round scheduler with ``c``'s F, τ and α; every rank must hold at
        least F buckets (checked on every rank, so none waits alone in a collective)."""
        try:
            fragment_buckets(len(self.layout), c.num_fragments)
            err = None
        except ValueError as e:
            err = f"rank {self.rank}: {e}" if self.num_ranks > 1 else str(e)
        errs = [e for e in self.comm.all_gather(err) if e]
        if errs:
            raise ValueError(f"{c.site_id}: {errs[0]}")
        return StreamingSync(
            self.site.sync,
            c.site_id,
            self.layout,
            self.state,
            self.local_tensors,
            sync_every=c.sync_every,
            num_fragments=c.num_fragments,
            overlap_steps=c.overlap_steps,
            merge_alpha=c.merge_alpha,
            pace_fraction=c.pace_fraction,
            delayed_update=c.delayed_update,
            on_merge=self._sync_replicas,
            tokens_per_step=c.tokens_per_step,
        )

    def join(self) -> None:
        """Join the group (done by the constructor); pulls θ when rounds already ran,
        then writes θ into the model on every rank and heals the training position."""
        info = self.site.join()
        if info.needs_state or self.num_ranks > 1:
            self.state.copy_to(self.local_tensors())
            self._sync_replicas()
        if self.site.donors:
            self._heal(self.site.donors)
        self._snapshot_position()

    def local_tensors(self) -> list[torch.Tensor]:
        """This rank's slice of the model (K = 1: every synced tensor, read afresh)."""
        if self.slices is not None:
            return self._slice
        return sync_tensors(self.model, self.config.buffers)[0]

    def _sync_replicas(self) -> None:
        """K > 1: all-gather the replicated parts of the model inside the site."""
        if self.slices is not None:
            self.comm.sync_replicas(self.slices)

    # ------------------------------------------------------------------ training position
    def training_position(self) -> dict:
        """This rank's training position now: ``round``, ``inner_steps``,
        ``inner_optimizer`` (its ``state_dict``, deep-copied), ``inner_scheduler`` and
        ``outer_schedulers`` (``state_dict``s, None / [] without schedulers),
        ``scheduler_behind`` (see :meth:`_live_position`)."""
        return copy.deepcopy(self._live_position())

    def _live_position(self) -> dict:
        """The position now, referencing the live state. ``scheduler_behind``: taken inside
        ``inner_optimizer.step()`` (a round run by the post-step hook), before the caller
        stepped its LR scheduler for that inner step; whoever installs it steps the
        scheduler once (:meth:`_install_position`), so its scheduler and AdamW step counts
        are the donor's at the start of the next inner step (issue 33: a joiner one LR
        step behind its donor for the rest of the run)."""
        return {
            "round": self.state.rounds_applied,
            "inner_steps": self.inner_steps,
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "inner_scheduler": self.inner_scheduler.state_dict() if self.inner_scheduler is not None else None,
            "scheduler_behind": self._in_step_hook and self.inner_scheduler is not None,
            "outer_schedulers": [sch.state_dict() for sch in self.outer_schedulers],
        }

    def _snapshot_position(self) -> None:
        """Keep the position at the start of the next round: what joiners heal from (a
        position healed inside the post-step hook and not yet installed is kept as it
        came). The inner optimizer's state (2 x the parameters for AdamW) is copied into
        the previous snapshot's tensors (:func:`~dtrain.state.copy_reusing`), so a round
        allocates nothing and never holds two snapshots at once."""
        live = self._heal_due if self._heal_due is not None else self._live_position()
        with self._position_lock:
            self._position = copy_reusing(self._position, live)

    def _serve_position(self, index: int) -> BucketState | None:
        """The snapshot as a PullState answer (serialized under the lock: never torn)."""
        with self._position_lock:
            return None if self._position is None else position_state(self._position, index=index)

    def load_training_position(self, position: dict) -> None:
        """Install a position (:meth:`training_position`) without changing θ or the round.
        Called inside ``inner_optimizer.step()`` (a round run by the post-step hook), the
        install waits for the start of the next inner step (the pre-step hook), so the
        caller's LR scheduler step after this one does not move it on."""
        if self._in_step_hook:
            self._heal_due = position
            return
        self._install_position(position)

    def _install_position(self, position: dict) -> None:
        """Install ``position`` now: at the start of an inner step, as the donor's next one."""
        self.inner_steps = int(position["inner_steps"])
        self.site.note_progress(inner_step=self.inner_steps)
        self.inner_optimizer.load_state_dict(position["inner_optimizer"])
        if self.inner_scheduler is not None and position.get("inner_scheduler") is not None:
            self.inner_scheduler.load_state_dict(position["inner_scheduler"])
            if position.get("scheduler_behind"):
                self.inner_scheduler.step()  # the step the donor's caller made after the snapshot
        for sch, sd in zip(self.outer_schedulers, position.get("outer_schedulers") or []):
            sch.load_state_dict(sd)

    def _heal(self, donors: list[Member]) -> bool:
        """Take the training position of round ``rounds_applied`` (θ was pulled at it) from a
        donor, the same donor's on every rank (:meth:`Site.pull_position
        <dtrain.site.Site.pull_position>`: every donor asked at once, a donor past the round
        ends it); False (own position kept, logged) when no donor has it for every rank."""
        r = self.state.rounds_applied
        pos, donor = self.site.pull_position(donors, r)
        if pos is None:
            return False
        self.load_training_position(pos)
        self.healed_from = donor
        log.info(
            "%s: took the training position of round %d from %s (inner step %d)",
            self.config.site_id,
            r,
            donor,
            int(pos["inner_steps"]),
        )
        return True

    @property
    def round(self) -> int:
        """Number of rounds applied to θ (= the next round's number)."""
        return self.state.rounds_applied

    @property
    def model_round(self) -> int:
        """Rounds whose θ the model reflects, for decisions of the training loop (when to stop,
        evaluate, checkpoint). Without streaming, :attr:`round`; with streaming, the count at
        the last merge (:attr:`StreamingSync.merged_round`): a fragment round running in the
        background does not move it, so every rank of a site takes the same decision at the
        same step (reading :attr:`round` there raced with the round's thread and put the
        ranks' collectives out of step)."""
        if self.streaming is not None and self.streaming.merged_round is not None:
            return self.streaming.merged_round
        return self.state.rounds_applied

    @property
    def period_steps(self) -> int:
        """Inner steps between two rounds: ``sync_every`` / ``num_fragments`` (with time-based
        rounds the bound of a period, whose steps the window decides: :meth:`phase_target`)."""
        return self.config.sync_every // self.config.num_fragments

    def _post_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if not self._hook_paused:
            self._in_step_hook = True
            try:
                self.step()
            finally:
                self._in_step_hook = False

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if self._heal_due is not None and not self._hook_paused:
            pos, self._heal_due = self._heal_due, None
            self._install_position(pos)

    def note_progress(self, *, last_loss: float | None = None) -> None:
        """Tell the rendezvous (rank 0's heartbeats) the inner step and the last loss."""
        self.site.note_progress(inner_step=self.inner_steps, last_loss=last_loss)

    def step(self) -> SyncOutcome | None:
        """Count one inner step; every ``sync_every`` steps run a round.

        Called automatically after ``inner_optimizer.step()`` when
        ``hook_optimizer`` is True. Returns the round's outcome, or None.
        With streaming (``num_fragments`` > 1, ``overlap_steps`` or ``merge_alpha``
        set) a fragment round starts every H/F steps (time-based rounds: every fragment
        period, :meth:`phase_target`) and the outcome returned is that of the round
        merged at this step (:mod:`dtrain.streaming`).
        """
        self.inner_steps += 1
        self.round_steps += 1
        self._phase_steps += 1
        self.note_progress()
        if self.streaming is not None:
            period, elapsed_s = None, self._phase_elapsed_s()
            if self.config.round_window_s is not None:  # time-based: this period's steps (rank 0's)
                period = self.phase_target(self._phase_steps, elapsed_s)
            # a SyncOutcome (Site.sync)
            outcome = self.streaming.on_step(self.inner_steps, period=period, since_start=self._phase_steps)
            if period is not None and self._phase_steps >= period:  # a round started: the next period decides anew
                self.note_phase(self._phase_steps, elapsed_s)
                self.start_inner_phase()
            if outcome is not None:
                self._merged(outcome)
            return outcome
        if self.config.round_window_s is None:
            return self.sync() if self.inner_steps % self.config.sync_every == 0 else None
        target = self.phase_target(self._phase_steps, time.monotonic() - self._phase_t0)
        return self.sync() if self._phase_steps >= target else None

    def phase_target(self, done: int, elapsed_s: float) -> int:
        """Inner steps of the current inner phase (blocking rounds: up to the round; streaming:
        one fragment period, up to the next fragment round's start): ``sync_every`` (H/F), or
        with time-based rounds (``round_window_s``) as many as fit in the window (W/F with F
        fragments) at the measured step time (:func:`~dtrain.streaming.fragment_period`),
        decided once per phase, after its first step, on rank 0 and broadcast over the site
        group (every rank must call it at the same step). The step time is that of the earlier
        phases (:meth:`note_phase`); in the first phase, with none measured, the decision is
        asked after every step until the window is spent
        (:func:`~dtrain.streaming.first_window_steps`; the answer is then ``done + 1``).

        Args:
            done: steps taken in this phase so far (>= 1 for a time-based decision).
            elapsed_s: the seconds they took.
        """
        c = self.config
        window = c.round_window_s
        if window is None:
            return c.sync_every // c.num_fragments
        if self._phase_target is None:
            if self.step_s is None and done == 1:
                self._first_step_s = elapsed_s  # left out of the first step time (note_phase)
            decided = None
            if self.rank == 0:
                decided = fragment_period(
                    window_s=window,
                    num_fragments=c.num_fragments,
                    step_s=self.step_s,
                    done=done,
                    elapsed_s=elapsed_s,
                    max_steps=c.sync_every // c.num_fragments,
                    overlap_steps=c.overlap_steps,
                )
            # streaming: on the training loop's group (a fragment round's thread uses the side group)
            n, why = self.comm.broadcast(decided, round=not c.streaming)
            if n is None:
                return done + 1  # the first phase: decided again after the next step
            self._phase_target, self.phase_reason = n, why
            log.info("%s: this period trains %d inner steps (%s)", c.site_id, *self.decided_phase)
        return self._phase_target

    def start_inner_phase(self) -> None:
        """The current inner phase starts now: its step count is decided anew and its clock
        (the step time of time-based rounds) starts here. Called after every round; a training
        loop calls it before its first step, so that setup (joining, a first evaluation) does
        not count as inner steps."""
        self._phase_target, self._phase_steps = None, 0
        self._phase_t0 = time.monotonic()
        self._phase_waited0 = self.streaming.waited_s if self.streaming is not None else 0.0

    def _phase_elapsed_s(self) -> float:
        """Seconds of inner steps in the current phase: since its start, less what merges
        waited for their rounds (network time, not compute)."""
        waited = self.streaming.waited_s - self._phase_waited0 if self.streaming is not None else 0.0
        return time.monotonic() - self._phase_t0 - waited

    def note_phase(self, steps: int, seconds: float) -> None:
        """An inner phase of ``steps`` steps took ``seconds``: the step time time-based rounds
        plan with (a running mean over phases, 0.7 weight on the newest). The first phase's
        first step is left out when there are others: it carries the process's warm-up
        (allocations, cold caches; 37.5 ms against 16 ms a step after it in a fresh user's
        run, which under-filled the next window by 42%)."""
        if steps > 0 and seconds > 0:
            measured = seconds / steps
            first = self._first_step_s if self.step_s is None else None
            if first is not None and steps > 1 and seconds > first:
                measured = (seconds - first) / (steps - 1)
            self.step_s = measured if self.step_s is None else 0.3 * self.step_s + 0.7 * measured

    @property
    def decided_phase(self) -> tuple[int, str]:
        """The current phase's step count and why (time-based rounds; (0, "") before the decision)."""
        return self._phase_target or 0, self.phase_reason

    def flush(self) -> SyncOutcome | None:
        """With streaming: merge the fragment round in flight now (waiting for it, bounded by
        its deadlines) and return its outcome; None when none is in flight or without streaming."""
        if self.streaming is None:
            return None
        outcome = self.streaming.flush()
        if outcome is not None:
            self._merged(outcome)
        return outcome

    def sync(self) -> SyncOutcome:
        """Run one round of the whole model now (normally called by :meth:`step`).

        With streaming (fragments / overlap) configured, a hand-called ``sync()`` first
        merges the fragment round in flight (:meth:`flush`), then runs a blocking round
        over every bucket (not the next fragment): after it the model and θ are the
        group's, as after a blocking round. Every member must call it at the same point
        (it is a round of the rendezvous); the fragment schedule then goes on from the
        next round number, alike on every site.
        """
        self.flush()
        tensors = self.local_tensors()
        if self._phase_steps:  # the hooked path's phase (the worker notes its own)
            self.note_phase(self._phase_steps, self._phase_elapsed_s())
        # at least one step's claim: a round right after another (a hand-called sync) still sends its
        # residuals, and an owner refuses a token-weighted contribution that claims nothing
        outcome = self.site.sync(tensors, tokens=self.config.tokens_per_step * max(1, self.round_steps))
        self._phase_target, self._phase_steps = None, 0  # the next inner phase decides anew
        cpu = dict(self.site.last_cpu_s)
        if outcome.status.resets_model:
            self.round_steps = 0
            t0 = time.process_time()
            self.state.copy_to(tensors)
            t1 = time.process_time()
            self._sync_replicas()
            cpu.update(scatter=t1 - t0, allgather=time.process_time() - t1)
            if outcome.status == RoundStatus.APPLIED:
                for sch in self.outer_schedulers:
                    sch.step()
            elif self.site.donors:
                self._heal(self.site.donors)
            self._snapshot_position()
        else:
            log.warning("%s: round deferred (%s); training on locally", self.config.site_id, outcome.reason)
        if self.streaming is not None:  # a hand-called blocking round: the model is the group's now
            self.streaming.merged_round = self.state.rounds_applied
            self.streaming.merged_checksums = None
        t0 = time.process_time()
        self._record(outcome)
        self.last_cpu_s = {**cpu, "checksum": time.process_time() - t0}
        self.start_inner_phase()  # the next inner phase's steps are timed from here
        return outcome

    def _merged(self, outcome: SyncOutcome) -> None:
        """A streaming fragment round was merged into the model: step the outer schedulers
        after an applied one, then record it."""
        if outcome.status == RoundStatus.APPLIED:
            for sch in self.outer_schedulers:
                sch.step()
        self._record(outcome)

    def slice_checksums(self, bucket_checksums: list[str] | None = None) -> list[str]:
        """Every rank's θ checksum (:func:`theta_checksum` of its slice, or of its
        ``bucket_checksums`` taken earlier), in rank order (a collective for K > 1)."""
        return self.comm.all_gather(theta_checksum(self.state, bucket_checksums))

    def site_checksum(self, slice_checksums: list[str] | None = None) -> str:
        """One θ checksum for the site: the slice's for K = 1, else
        :func:`~dtrain.sitegroup.agree.combine_checksums` of the ranks' (a collective
        unless ``slice_checksums`` is given)."""
        sums = slice_checksums if slice_checksums is not None else self.slice_checksums()
        return sums[0] if self.num_ranks == 1 else combine_checksums(sums)

    def _record(self, outcome: SyncOutcome) -> None:
        # a merged fragment round: θ as the merge left it (the next round may already run and
        # change θ before this line), so every site and rank reports the same round's θ
        merged = self.streaming.merged_checksums if self.streaming is not None else None
        # one collective: every rank's θ checksum, and whether the round left its slice unrepaired
        mine = (theta_checksum(self.state, merged), bool(self.site.unrepaired(outcome)))
        ranks = self.comm.all_gather(mine)
        if self.streaming is None and any(u for _, u in ranks) and self._catch_up_now(outcome):
            ranks = self.comm.all_gather((theta_checksum(self.state), False))
        outcome.slice_checksums = [c for c, _ in ranks]
        outcome.site_checksum = self.site_checksum(outcome.slice_checksums)
        notices = self.site.notices
        outcome.num_lost_notices_used = notices.num_used if notices is not None else 0
        self.last_outcome = outcome
        # a round that left any rank's buckets unrepaired is not finished: the members wait at close
        # (catch_up_last_round)
        self.site.note_rounds_done(self.engine.state.rounds_applied - any(u for _, u in ranks))
        for cb in self.on_round:
            cb(outcome)

    def _catch_up_now(self, outcome: SyncOutcome) -> bool:
        """Right after a round that left buckets of some rank's slice stale and unrepaired
        (every rank, a collective): bring them to the round from its other members before the
        next inner phase (:meth:`Site.catch_up_last_round
        <dtrain.site.Site.catch_up_last_round>`, within the round's broadcast deadline), and
        the model to θ. Left stale, such a bucket stayed unlike its owner's in every later
        round (each round's mean then misses its checksum before) until a repair pulled it
        whole: at gRPC over reno at 10% loss no repair fitted a round, and every round of the
        run ended with unequal θ. Returns whether they were caught up; if not, the buckets stay
        stale (the next rounds' repairs, and the end of the run, try again)."""
        behind = self.site.catch_up_last_round(outcome)
        if behind is not None:
            log.warning("%s: %s; training on", self.config.site_id, behind)
            return False
        self.state.copy_to(self.local_tensors())
        self._sync_replicas()
        return True

    def diloco_numel(self) -> dict[str, int]:
        """This rank's DiLoCo elements (see :func:`diloco_numel`): ~1/K of a one-rank site's."""
        return diloco_numel(self.state)

    def state_dict(self) -> dict:
        """Everything this wrapper adds to a training position, as plain tensors.

        Keys: ``theta`` (per bucket, fp32 ``[numel_b]``: the global parameters θ),
        ``outer_optimizer`` (per bucket, the outer optimizer's ``state_dict()``),
        ``residuals`` (per bucket, fp32 ``[numel_b]`` error-feedback residuals or
        None), ``round`` (rounds applied to θ = the next round's number),
        ``bucket_round`` (per bucket), ``fingerprint`` (the bucket layout; a
        load into another model or bucket size is refused), ``inner_steps``
        and ``sync_every`` (H). The model's own parameters and the inner
        optimizer are not in it: save ``model.state_dict()`` and the inner
        optimizer's ``state_dict()`` beside it (as ``dtrain worker`` does).
        ``outer_schedulers``: the outer LR schedulers' ``state_dict``s (empty without).

        With streaming, a fragment round in flight is waited for first (bounded by its
        deadlines; not merged into the model, which happens at its step as always): θ and
        the round number are then the group's after that round, never half of it.
        """
        if self.streaming is not None:
            self.streaming.wait_in_flight()
        return {
            **self.state.state_dict(),
            "inner_steps": self.inner_steps,
            "sync_every": self.config.sync_every,
            "outer_schedulers": [sch.state_dict() for sch in self.outer_schedulers],
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` (also the older layout that nested θ, outer
        state, residuals and round under ``"global"``). The model's own (local)
        parameters are not touched.

        Raises:
            ValueError: not a DiLoCo state_dict (names the missing keys), or one
                of another model or bucket layout.
        """
        state = sd.get("global", sd) if isinstance(sd, dict) else None  # the older layout nested it
        if not isinstance(state, dict):
            raise ValueError(f"not a DiLoCo state_dict (a {type(sd).__name__}, expected a dict)")
        missing = [k for k in _STATE_KEYS if k not in state and _OLD_NAMES.get(k) not in state]
        if missing:
            raise ValueError(f"not a DiLoCo state_dict (missing {', '.join(map(repr, missing))})")
        self.state.load_state_dict(state)
        self.inner_steps = int(sd.get("inner_steps", 0))
        for sch, ssd in zip(self.outer_schedulers, sd.get("outer_schedulers") or []):
            sch.load_state_dict(ssd)

    def catch_up_last_round(self) -> LeftBehind | None:
        """End of a run, before θ is exported or reported (every rank; :meth:`close` calls it
        when the caller did not): buckets the last round left stale and unrepaired take that
        round's means again from the members, which wait for it
        (:meth:`Site.catch_up_last_round <dtrain.site.Site.catch_up_last_round>`, within the
        round's broadcast deadline); the model then gets θ again (not with streaming: export
        and checksums read θ). Returns None, or the :class:`LeftBehind` that :meth:`close`
        raises because θ still differs from the peers'. Once per round (a collective)."""
        if self._settled is None or self._settled[0] is not self.last_outcome:
            had = bool(self.site.unrepaired(self.last_outcome))
            behind = self.site.catch_up_last_round(self.last_outcome)
            if had and behind is None and self.streaming is None:
                self.state.copy_to(self.local_tensors())
                self._sync_replicas()
            self._settled = (self.last_outcome, behind)
        return self._settled[1]

    def close(self, *, wait: bool = True) -> PullWait | None:
        """Wait for the peers to pull this site's last means, leave the group, stop serving
        (every rank of a site calls it).

        With ``wait``, first :meth:`catch_up_last_round`, then blocks until every member of the
        last round this site ran has pulled the means of the buckets it owned, at most
        ``config.close_timeout_s`` (default: until that round's late pulls and repairs end: its
        broadcast deadline + its repair window; members declared dead meanwhile are not waited
        for): closing at once would leave a slower member with a different θ.

        Args:
            wait: False closes at once (e.g. on SIGINT); a fragment round in flight is not merged.
        Returns:
            what the wait found (who did not pull what), or None when this call did not wait
            (``wait=False`` or already closed).
        Raises:
            LeftBehind: after leaving, when the last round left this site's θ unlike its peers'.
        """
        if self._closed:
            return None
        self._closed = True
        for h in self._hooks:
            h.remove()
        if self.streaming is not None:  # merge the fragment round in flight (bounded by its deadlines)
            outcome = self.streaming.close(wait=wait)
            if outcome is not None:
                self._merged(outcome)
        waited = None
        behind = self.catch_up_last_round() if wait else None
        if wait:
            waited = self.engine.mean_pulls.wait_pulled(timeout_s=self.config.close_timeout_s)
            if waited.round >= 0 or waited.missing:
                said = f"closing without every peer's pull (missing: {waited.missing})" if waited.missing else "pulled"
                level = logging.WARNING if waited.missing else logging.INFO
                sid = self.config.site_id
                log.log(level, "%s: round %d's means %s after %.2f s", sid, waited.round, said, waited.waited_s)
        try:
            if wait:  # a straggler cut from this site's last round pulls θ from it, not from nobody
                self.site.wait_left_out(self.config.group.state_pull_timeout_s)
            if wait and self.num_ranks > 1:  # rank 0 leaves the group only once every rank's peers pulled
                self.comm.all_gather(None, round=True)
        except RuntimeError as e:  # a rank died (its collectives fail): leave at once, so a restarted group can rejoin
            log.warning("%s rank %d: closing without the other ranks: %s", self.config.site_id, self.rank, e)
        finally:
            self.site.leave()
        # A pull counts when it was served, before its reply crossed the link: give replies in
        # flight until the round's late pulls and repairs end (a stop returns as soon as none is left).
        # With 0.5 s, a member at 20% loss lost the last round's mean as it streamed in
        # (datagram_vs_grpc: owner_lost there, applied elsewhere, θ differed).
        grace_s = 0.5
        if wait:
            grace_s = max(grace_s, self.engine.mean_pulls.time_left_s(time.monotonic()))
            if self.config.close_timeout_s is not None:
                grace_s = min(grace_s, max(0.5, self.config.close_timeout_s))
        self.engine.stop(grace_s)
        if behind is not None:
            raise behind
        return waited

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        # An interrupted loop closes at once; otherwise the peers get the last means.
        self.close(wait=not (exc_type is not None and issubclass(exc_type, KeyboardInterrupt)))
