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
    diloco.close()

Without a transport and rendezvous it runs as a single local site (useful for
tests); pass ``transport=GrpcTransport(...)`` and ``rendezvous=GrpcRendezvousClient(...)``
for a real multi-site run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from dtrain.buckets import BucketConfig, BucketLayout
from dtrain.membership import Group, GroupConfig, RendezvousClient, SyncOutcome
from dtrain.rendezvous import InprocRendezvousClient, RendezvousConfig, RendezvousCore
from dtrain.rounds import RoundConfig, RoundEngine
from dtrain.state import GlobalState, OuterOptimizerFactory, default_outer_optimizer
from dtrain.transports.base import Transport
from dtrain.transports.inproc import InprocNetwork, InprocTransport

__all__ = ["DiLoCoConfig", "DiLoCo", "sync_tensors"]

log = logging.getLogger(__name__)

_BUFFER_MODES = ("average", "local")


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    """Configuration of the DiLoCo wrapper.

    Attributes:
        site_id: this site's unique name.
        sync_every: H, inner steps per round (DiLoCo arXiv 2311.08105 uses 500).
        buckets: bucket and chunk sizes.
        rounds: codec, aggregation, error feedback, repair.
        group: rendezvous-client behaviour (quorum wait, retries).
        buffers: ``"average"`` floating-point buffers (e.g. batch-norm running
            statistics) across sites each round, or keep them ``"local"``.
        hook_optimizer: count inner steps through a post-step hook on the inner
            optimizer (True) or only when the caller calls :meth:`DiLoCo.step`.
    """

    site_id: str = "site-0"
    sync_every: int = 500
    buckets: BucketConfig = field(default_factory=BucketConfig)
    rounds: RoundConfig = field(default_factory=RoundConfig)
    group: GroupConfig = field(default_factory=GroupConfig)
    buffers: str = "average"
    hook_optimizer: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.sync_every, int) or self.sync_every <= 0:
            raise ValueError(f"sync_every (H) must be an int >= 1, got {self.sync_every!r}")
        if self.buffers not in _BUFFER_MODES:
            raise ValueError(f"buffers must be one of {_BUFFER_MODES}, got {self.buffers!r}")
        if not self.site_id or not isinstance(self.site_id, str):
            raise ValueError(f"site_id must be a non-empty string, got {self.site_id!r}")


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
            bucket of θ (default SGD lr 0.7, momentum 0.9, Nesterov).
        transport: how to reach the other sites (default: a private in-process
            network, i.e. a single local site).
        rendezvous: rendezvous client (default: a private in-process one with
            ``min_sites=1``).

    On construction the site joins the group; if rounds already ran it pulls θ
    and the outer-optimizer state from the members and loads θ into ``model``.
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
        self.state = GlobalState(self.layout, tensors, outer_optimizer)
        self.engine = RoundEngine(
            self.config.site_id, self.state, transport or InprocTransport(InprocNetwork()), self.config.rounds
        )
        self.engine.start()
        self.group = Group(
            self.engine,
            rendezvous or InprocRendezvousClient(RendezvousCore(RendezvousConfig(min_sites=1))),
            self.config.group,
        )
        self.inner_steps = 0
        self.last_outcome: SyncOutcome | None = None
        self.on_round: list[Callable[[SyncOutcome], None]] = []
        self._closed = False
        if not _defer_join:
            self.join()
        self._hook = inner_optimizer.register_step_post_hook(self._post_step) if self.config.hook_optimizer else None

    def join(self) -> None:
        """Join the group (done by the constructor); pulls θ when rounds already ran."""
        info = self.group.join()
        if info.needs_state:
            self.state.copy_to(self._tensors_and_kinds()[0])

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
        """
        self.inner_steps += 1
        self.group.inner_step = self.inner_steps
        if self.inner_steps % self.config.sync_every == 0:
            return self.sync()
        return None

    def sync(self) -> SyncOutcome:
        """Run one round now (normally called by :meth:`step`)."""
        tensors = self._tensors_and_kinds()[0]
        outcome = self.group.sync(tensors)
        if outcome.status in ("applied", "resynced"):
            self.state.copy_to(tensors)
        else:
            log.warning("%s: round deferred (%s); training on locally", self.config.site_id, outcome.reason)
        self.last_outcome = outcome
        for cb in self.on_round:
            cb(outcome)
        return outcome

    def state_dict(self) -> dict:
        """θ, outer-optimizer state, residuals, round number and inner-step count."""
        return {
            "global": self.state.state_dict(),
            "inner_steps": self.inner_steps,
            "sync_every": self.config.sync_every,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict`; raises ``ValueError`` for another model/layout.
        The model's own (local) parameters are not touched."""
        if not isinstance(sd, dict) or "global" not in sd:
            raise ValueError("not a DiLoCo state_dict (missing 'global')")
        self.state.load_state_dict(sd["global"])
        self.inner_steps = int(sd.get("inner_steps", 0))

    def close(self) -> None:
        """Leave the group and stop serving peers."""
        if self._closed:
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        self.group.leave()
        self.engine.stop(0.5)

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
