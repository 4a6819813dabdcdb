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
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Callable

import torch

from dtrain.buckets import BucketLayout
from dtrain.configs import DiLoCoConfig
from dtrain.errors import StateTransferError, TransportError
from dtrain.membership import Group, RendezvousClient, SyncOutcome
from dtrain.protocol import BucketState
from dtrain.rendezvous import InprocRendezvousClient, RendezvousConfig, RendezvousCore
from dtrain.rounds import RoundEngine
from dtrain.rounds.pulls import PullWait
from dtrain.state import (
    GlobalState,
    OuterOptimizerFactory,
    copy_reusing,
    decode_position,
    default_outer_optimizer,
    delayed_outer_optimizer,
    position_state,
    theta_device_of,
)
from dtrain.streaming import StreamingSync
from dtrain.transports.base import Transport
from dtrain.transports.inproc import InprocNetwork, InprocTransport

__all__ = ["DiLoCoConfig", "DiLoCo", "sync_tensors"]

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


class DiLoCo:
    """DiLoCo around ``model`` and its inner optimizer.

    Args:
        model: any ``torch.nn.Module`` (fp32, bf16 or fp16 parameters, CPU).
        inner_optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        config: see :class:`DiLoCoConfig`.
        outer_optimizer: factory ``list[Tensor] -> Optimizer`` applied to each
            bucket of θ (default SGD lr 0.7, momentum 0.9, Nesterov; in the
            one-step-delayed mode momentum 0.7: :func:`dtrain.state.delayed_outer_optimizer`).
        transport: how to reach the other sites (default: a private in-process
            network, i.e. a single local site).
        rendezvous: rendezvous client (default: a private in-process one with
            ``min_sites=1``).
        inner_scheduler: the inner optimizer's LR scheduler, if any (the caller
            steps it); its state travels with the training position.
        outer_scheduler: factory ``Optimizer -> LRScheduler`` applied to each
            bucket's outer optimizer; stepped here after every applied round.

    On construction the site joins the group; if rounds already ran it pulls θ
    and the outer-optimizer state from the members and loads θ into ``model``,
    then heals its training position from the first donor that has one for that
    round (as torchft heals a replica): the inner step count, the inner
    optimizer's state, the inner and outer LR schedulers' states. A site whose own
    state is current (nothing pulled) keeps its own. The data position is never
    taken from a donor (the donor's is its own shard's): docs/DECISIONS.md.
    Peer faults during rounds never raise here; ``QuorumTimeout`` does, when no
    round can form within ``config.group.quorum_wait_s``.
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
        _defer_join: bool = False,
    ) -> None:
        self.config = config or DiLoCoConfig()
        self.model = model
        self.inner_optimizer = inner_optimizer
        tensors, kinds = self._tensors_and_kinds()
        for t in tensors:
            if not t.is_floating_point():
                raise ValueError(f"DiLoCo synchronises floating-point tensors only, got {t.dtype}")
        self.layout = BucketLayout([t.numel() for t in tensors], kinds, self.config.buckets)
        if outer_optimizer is default_outer_optimizer and self.config.one_step_delayed:
            outer_optimizer = delayed_outer_optimizer  # a one-round-stale Δ: lower outer momentum
        device = theta_device_of(tensors, self.config.theta_device)
        self.state = GlobalState(self.layout, tensors, outer_optimizer, device=device)
        self.engine = RoundEngine(
            self.config.site_id, self.state, transport or InprocTransport(InprocNetwork()), self.config.rounds
        )
        self.engine.start()
        self.group = Group(
            self.engine,
            rendezvous or InprocRendezvousClient(RendezvousCore(RendezvousConfig(min_sites=1))),
            self.config.group,
        )
        self.inner_scheduler = inner_scheduler
        self.outer_schedulers = [outer_scheduler(o) for o in self.state.optimizers] if outer_scheduler else []
        self.inner_steps = 0
        self.last_outcome: SyncOutcome | None = None
        self.on_round: list[Callable[[SyncOutcome], None]] = []
        self.healed_from: str | None = None  # the donor of the last position heal
        self._closed = False
        # Streaming DiLoCo (fragments, overlap, merge): dtrain/streaming.py runs the rounds.
        self.streaming = self._streaming_sync(self.config) if self.config.streaming else None
        self._position: dict | None = None  # the snapshot joiners heal from (_snapshot_position)
        self._position_lock = threading.Lock()  # its in-place refresh against a PullState serializing it
        self.engine.position_source = self._serve_position
        if not _defer_join:
            self.join()
        self._hook = inner_optimizer.register_step_post_hook(self._post_step) if self.config.hook_optimizer else None

    def _streaming_sync(self, c: DiLoCoConfig) -> StreamingSync:
        """The fragment-round scheduler with ``c``'s F, τ and α (built whatever they are)."""
        return StreamingSync(
            self.group.sync,
            c.site_id,
            self.layout,
            self.state,
            lambda: self._tensors_and_kinds()[0],
            sync_every=c.sync_every,
            num_fragments=c.num_fragments,
            overlap_steps=c.overlap_steps,
            merge_alpha=c.merge_alpha,
            pace_fraction=c.pace_fraction,
            delayed_update=c.delayed_update,
        )

    def join(self) -> None:
        """Join the group (done by the constructor); pulls θ when rounds already ran."""
        info = self.group.join()
        if info.needs_state:
            self.state.copy_to(self._tensors_and_kinds()[0])
        if self.group.donors:
            self._heal(self.group.donors)
        self._snapshot_position()

    # ------------------------------------------------------------------ training position
    def training_position(self) -> dict:
        """This site's training position now: ``round``, ``inner_steps``,
        ``inner_optimizer`` (its ``state_dict``, deep-copied), ``inner_scheduler`` and
        ``outer_schedulers`` (``state_dict``s, None / [] without schedulers)."""
        return {
            "round": self.state.rounds_applied,
            "inner_steps": self.inner_steps,
            "inner_optimizer": copy.deepcopy(self.inner_optimizer.state_dict()),
            "inner_scheduler": self.inner_scheduler.state_dict() if self.inner_scheduler is not None else None,
            "outer_schedulers": [sch.state_dict() for sch in self.outer_schedulers],
        }

    def _snapshot_position(self) -> None:
        """Keep the position at the start of the next round: what joiners heal from. The
        inner optimizer's state (2 x the parameters for AdamW) is copied into the previous
        snapshot's tensors (:func:`~dtrain.state.copy_reusing`), so a round allocates
        nothing and never holds two snapshots at once."""
        live = {
            "round": self.state.rounds_applied,
            "inner_steps": self.inner_steps,
            "inner_optimizer": self.inner_optimizer.state_dict(),  # references to the live state
            "inner_scheduler": self.inner_scheduler.state_dict() if self.inner_scheduler is not None else None,
            "outer_schedulers": [sch.state_dict() for sch in self.outer_schedulers],
        }
        with self._position_lock:
            self._position = copy_reusing(self._position, live)

    def _serve_position(self, index: int) -> BucketState | None:
        """The snapshot as a PullState answer (serialized under the lock: never torn)."""
        with self._position_lock:
            return None if self._position is None else position_state(self._position, index=index)

    def load_training_position(self, position: dict) -> None:
        """Install a position (:meth:`training_position`) without changing θ or the round."""
        self.inner_steps = int(position["inner_steps"])
        self.group.inner_step = self.inner_steps
        self.inner_optimizer.load_state_dict(position["inner_optimizer"])
        if self.inner_scheduler is not None and position.get("inner_scheduler") is not None:
            self.inner_scheduler.load_state_dict(position["inner_scheduler"])
        for sch, sd in zip(self.outer_schedulers, position.get("outer_schedulers") or []):
            sch.load_state_dict(sd)

    def _heal(self, donors) -> bool:
        """Take the training position of the first donor whose position is of the round
        θ was pulled at; False (own position kept, logged) when none has it."""
        r = self.state.rounds_applied
        idx = len(self.state)
        timeout_s = self.config.group.state_pull_timeout_s
        for m in donors:
            try:
                st = self.engine.transport.pull_state(
                    m.address, idx, requester=self.config.site_id, timeout_s=timeout_s
                )
                pos = decode_position(st)
                if pos["round"] != r:
                    log.info(
                        "%s: %s's training position is of round %d, not %d",
                        self.config.site_id,
                        m.site_id,
                        pos["round"],
                        r,
                    )
                    continue
                self.load_training_position(pos)
            except (TransportError, StateTransferError, KeyError, ValueError, RuntimeError) as e:
                log.warning("%s: no training position from %s: %s", self.config.site_id, m.site_id, e)
                continue
            self.healed_from = m.site_id
            log.info(
                "%s: took the training position of round %d from %s (inner step %d)",
                self.config.site_id,
                r,
                m.site_id,
                self.inner_steps,
            )
            return True
        log.warning("%s: no donor had a training position of round %d; keeping this site's own", self.config.site_id, r)
        return False

    def _tensors_and_kinds(self) -> tuple[list[torch.Tensor], list[str]]:
        return sync_tensors(self.model, self.config.buffers)

    @property
    def round(self) -> int:
        """Number of rounds applied to θ (= the next round's number)."""
        return self.state.rounds_applied

    def _post_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        self.step()

    def step(self) -> SyncOutcome | None:
        """Count one inner step; every ``sync_every`` steps run a round.

        Called automatically after ``inner_optimizer.step()`` when
        ``hook_optimizer`` is True. Returns the round's outcome, or None.
        With streaming (``num_fragments`` > 1, ``overlap_steps`` or ``merge_alpha``
        set) a fragment round starts every H/F steps and the outcome returned is
        that of the round merged at this step (:mod:`dtrain.streaming`).
        """
        self.inner_steps += 1
        self.group.inner_step = self.inner_steps
        if self.streaming is not None:
            outcome = self.streaming.on_step(self.inner_steps)  # a SyncOutcome (Group.sync)
            if outcome is not None:
                self._record(outcome)
            return outcome
        if self.inner_steps % self.config.sync_every == 0:
            return self.sync()
        return None

    def flush(self) -> SyncOutcome | None:
        """With streaming: merge the fragment round in flight now (waiting for it, bounded by
        its deadlines) and return its outcome; None when none is in flight or without streaming."""
        if self.streaming is None:
            return None
        outcome = self.streaming.flush()
        if outcome is not None:
            self._record(outcome)
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
        tensors = self._tensors_and_kinds()[0]
        outcome = self.group.sync(tensors)
        if outcome.status in ("applied", "resynced"):
            self.state.copy_to(tensors)
            if outcome.status == "applied":
                for sch in self.outer_schedulers:
                    sch.step()
            elif self.group.donors:
                self._heal(self.group.donors)
            self._snapshot_position()
        else:
            log.warning("%s: round deferred (%s); training on locally", self.config.site_id, outcome.reason)
        self._record(outcome)
        return outcome

    def _record(self, outcome: SyncOutcome) -> None:
        self.last_outcome = outcome
        for cb in self.on_round:
            cb(outcome)

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

    def close(self, *, wait: bool = True) -> PullWait | None:
        """Wait for the peers to pull this site's last means, leave the group, stop serving.

        With ``wait``, blocks until every member of the last round this site ran
        has pulled the means of the buckets it owned, at most
        ``config.close_timeout_s`` (default: until that round's broadcast
        deadline); members the rendezvous declares dead meanwhile are not waited
        for. Closing at once would leave a slower member without those means
        (it would skip the buckets and end with a different θ).

        Args:
            wait: False closes at once (e.g. on SIGINT); a fragment round in flight is not merged.
        Returns:
            what the wait found (who did not pull what), or None when this call
            did not wait (``wait=False`` or already closed).
        """
        if self._closed:
            return None
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        if self.streaming is not None:  # merge the fragment round in flight (bounded by its deadlines)
            outcome = self.streaming.close(wait=wait)
            if outcome is not None:
                self._record(outcome)
        waited = None
        if wait:
            waited = self.engine.mean_pulls.wait_pulled(timeout_s=self.config.close_timeout_s)
            if waited.missing:
                log.warning(
                    "%s: closing after %.2f s without every peer's pull of round %d's means (missing: %s)",
                    self.config.site_id,
                    waited.waited_s,
                    waited.round,
                    waited.missing,
                )
            elif waited.round >= 0:
                log.info(
                    "%s: every peer pulled round %d's means (waited %.2f s)",
                    self.config.site_id,
                    waited.round,
                    waited.waited_s,
                )
        self.group.leave()
        # A pull counts when it was served, before its reply crossed the link: give replies in
        # flight until the round's broadcast deadline (a stop returns as soon as none is left).
        # With 0.5 s, a member at 20% loss lost the last round's mean as it streamed in
        # (datagram_vs_grpc: owner_lost there, applied elsewhere, θ differed).
        grace_s = 0.5
        if wait:
            grace_s = max(grace_s, self.engine.mean_pulls.time_left_s(time.monotonic()))
            if self.config.close_timeout_s is not None:
                grace_s = min(grace_s, max(0.5, self.config.close_timeout_s))
        self.engine.stop(grace_s)
        return waited

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        # An interrupted loop closes at once; otherwise the peers get the last means.
        self.close(wait=not (exc_type is not None and issubclass(exc_type, KeyboardInterrupt)))
