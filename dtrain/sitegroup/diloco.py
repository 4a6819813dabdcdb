"""``SiteGroupDiLoCo``: DiLoCo for a site that is a torch.distributed group of K ranks.

Each rank of the site calls it with its own model replica or shard (DDP, FSDP2's
``fully_shard`` or a plain module) and its own inner optimizer. Rank j holds θ,
the outer-optimizer state and the residuals of slice j only
(:class:`~dtrain.sitegroup.slices.SliceMap`) and runs its own
:class:`~dtrain.rounds.RoundEngine` with its own transport, which exchanges slice
j with rank j of the other sites. So a rank's DiLoCo memory is ~12/K bytes per
parameter and the site's cross-site traffic is spread over K connections.

One membership per site: local rank 0 holds the :class:`~dtrain.membership.Group`
(rendezvous client, heartbeats) and registers every rank's Peer address; it
broadcasts the rendezvous's decision to the other ranks over the site's process
group, then the ranks apply the half-round rule (:mod:`dtrain.sitegroup.agree`)
before any of them pushes. After a round each rank resets its slice of the model
to θ and replicated tensors are all-gathered inside the site.

Faults: a rank that dies breaks the site's collectives (the process group's
timeout bounds the wait), the site stops heartbeating and the other sites finish
their rounds by their deadlines as for a dead single-process site. When torchrun
(``--max-restarts``) or the operator restarts the group, each rank pulls its slice
from the same rank of another site on join.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from dtrain.buckets import BucketLayout
from dtrain.diloco import DiLoCoConfig, sync_tensors
from dtrain.errors import QuorumTimeout, RendezvousError, SiteGroupError, StateTransferError
from dtrain.membership import Group, RendezvousClient
from dtrain.protocol import JoinInfo, RoundPlan
from dtrain.rounds import RoundEngine, RoundResult
from dtrain.sitegroup.agree import RankView, combine_checksums, decide_agreement, rank_donors, rank_plan
from dtrain.sitegroup.notices import LostNotices, site_store
from dtrain.sitegroup.slices import SliceMap
from dtrain.state import GlobalState, OuterOptimizerFactory, default_outer_optimizer, pull_full_state, theta_device_of
from dtrain.streaming import fragment_buckets, fragment_of_round
from dtrain.transports.base import Transport

__all__ = ["SiteSyncOutcome", "SiteGroupDiLoCo", "check_site_streaming", "slice_checksum", "diloco_numel"]

log = logging.getLogger(__name__)


def slice_checksum(state: GlobalState) -> str:
    """One digest over a rank's bucket checksums (its slice's θ)."""
    return combine_checksums(state.checksums())


def check_site_streaming(config: DiLoCoConfig) -> None:
    """Refuse the streaming settings a site group does not run (yet).

    A site group runs blocking fragment rounds (``num_fragments`` >= 1 with
    ``overlap_steps`` = 0 and ``merge_alpha`` = 0); overlap (τ > 0), merging
    (α > 0) and the one-step-delayed mode are one-process-site only.

    Raises:
        ValueError: naming ``overlap_steps``/``merge_alpha`` and the allowed value.
    """
    if config.overlap_steps != 0:
        raise ValueError(
            f"overlap_steps must be 0 for a site group (blocking fragment rounds only), got {config.overlap_steps!r}"
        )
    if config.merge_alpha != 0:
        raise ValueError(
            f"merge_alpha must be 0 for a site group (blocking fragment rounds), got {config.merge_alpha!r}"
        )


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


@dataclass(kw_only=True)
class SiteSyncOutcome:
    """What one ``SiteGroupDiLoCo.sync`` did, identical on every rank of the site
    except ``result`` (this rank's slice).

    Attributes:
        status: ``"applied"``, ``"resynced"``, ``"skipped"`` (the half-round rule
            kept every rank out of the round; slices resynchronised) or ``"deferred"``.
        reason: why.
        fragment: the fragment this round synced on every rank (``num_fragments`` > 1,
            :func:`~dtrain.streaming.fragment_of_round` of the plan's round); None for a
            whole-slice round or when no plan was run.
        result: this rank's round result (None unless applied).
        slice_checksums: every rank's slice checksum after the call, rank order.
        site_checksum: :func:`combine_checksums` of them: one θ checksum per site.
        quorum_s: seconds rank 0 waited for the rendezvous's decision (0 when it
            asked for none).
        num_lost_notices_used: (ranks j > 0) dead-site notices from rank 0 that
            ended this rank's wait for a member so far (:mod:`dtrain.sitegroup.notices`).
    """

    status: str
    reason: str
    fragment: int | None = None
    result: RoundResult | None = None
    slice_checksums: list[str] = field(default_factory=list)
    site_checksum: str = ""
    quorum_s: float = 0.0
    num_lost_notices_used: int = 0


class SiteGroupDiLoCo:
    """DiLoCo around one rank's part of a site's model.

    Args:
        model: this rank's module (DDP-wrapped, FSDP2-sharded or plain); its
            parameters are DTensors (synced as their local shards) or replicated
            tensors (synced as a 1/K partition and all-gathered after a round).
        inner_optimizer: this rank's inner optimizer.
        config: ``DiLoCoConfig``; ``site_id`` is the site's (same on every rank).
        transport: this rank's own transport (its own Peer server and address).
        rendezvous: the rendezvous client; used on rank 0 only (None elsewhere).
        process_group: the site's process group (default: the default group),
            gloo on CPU. Give it a timeout: a dead rank blocks collectives until then.
        outer_optimizer: factory of the outer optimizer per bucket.
        store: a ``torch.distributed`` store every rank of the site reaches, for
            rank 0's dead-site notices (default: a client of the site's TCPStore
            from ``MASTER_ADDR``/``MASTER_PORT``; none without them, and then ranks
            j > 0 wait for a dead site until the reduce deadline).
        defer_join: do not join in the constructor: load a checkpoint first
            (:func:`dtrain.sitegroup.checkpoint.load_site_checkpoint`), then call
            :meth:`join` on every rank, so the site presents its saved round.

    Fragment rounds (``num_fragments`` = F > 1, Streaming DiLoCo §2.2, blocking):
    rank j's buckets are cut into F contiguous groups as a one-process site cuts its
    own (:func:`~dtrain.streaming.fragment_buckets`); a round runs every H/F inner
    steps and round r syncs fragment ``(r + 1) mod F`` on every rank of every site, so
    rank j of each site exchanges the same fragment of slice j. The half-round rule
    holds per fragment round. Only the fragment's buckets of the model are reset to
    θ after it; a resync (missed or skipped round) resets the whole slice.

    Every rank must construct it, call :meth:`step`/:meth:`sync` and
    :meth:`close` in the same order: they run collectives.
    Raises (at construction or in ``sync``):
        SiteGroupError: sites with different numbers of ranks, or a collective failed.
        QuorumTimeout: (every rank) no round formed within ``quorum_wait_s``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        config: DiLoCoConfig,
        transport: Transport,
        rendezvous: RendezvousClient | None,
        process_group: dist.ProcessGroup | None = None,
        outer_optimizer: OuterOptimizerFactory = default_outer_optimizer,
        store: dist.Store | None = None,
        defer_join: bool = False,
    ) -> None:
        self.config = config
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.pg = process_group
        self.rank = dist.get_rank(process_group)
        self.num_ranks = dist.get_world_size(process_group)
        if not all(self._all_gather(self.rank != 0 or rendezvous is not None)):
            raise ValueError("rendezvous must be given on rank 0 (it speaks for the site)")
        tensors, kinds = sync_tensors(model, config.buffers)
        self.slices = SliceMap(tensors, kinds, self.rank, self.num_ranks)
        self.local, local_kinds = self.slices.local()
        self.layout = BucketLayout([t.numel() for t in self.local], local_kinds, config.buckets)
        device = theta_device_of(self.local, config.theta_device)
        self.state = GlobalState(self.layout, self.local, outer_optimizer, device=device)
        self.fragments = self._fragments(config.num_fragments)
        self.engine = RoundEngine(config.site_id, self.state, transport, config.rounds)
        self.engine.start()
        addresses = self._all_gather(self.engine.address)
        self.rank_addresses: list[str] = addresses
        self.group: Group | None = None
        if self.rank == 0:
            assert rendezvous is not None  # checked above, on every rank
            ranks = addresses if self.num_ranks > 1 else ()
            self.group = Group(self.engine, rendezvous, config.group, rank_addresses=ranks)
        self.notices = self._lost_notices(store)
        self.inner_steps = 0
        self.last_outcome: SiteSyncOutcome | None = None
        self.on_round: list[Callable[[SiteSyncOutcome], None]] = []
        # Test-only fault injection: view_hook(view) -> view, applied to this rank's
        # RankView before the ranks compare them (e.g. to make a rank miss the plan).
        self.view_hook: Callable[[RankView], RankView] | None = None
        # Process CPU seconds (all threads) of the last sync's steps: gather (Δ + residual),
        # round (engine: encode, push, reduce, outer step, decode), scatter (θ into the
        # model), allgather (replicated parts inside the site), checksum.
        self.last_cpu_s: dict[str, float] = {}
        self._closed = False
        self._hook_paused = False  # checkpoint code steps the optimizer without it counting
        if not defer_join:
            self.join()
        self._hook = inner_optimizer.register_step_post_hook(self._post_step) if config.hook_optimizer else None

    def _fragments(self, num_fragments: int) -> list[tuple[int, ...]]:
        """This rank's buckets per fragment; a rank with too few buckets fails every rank."""
        try:
            frags, err = fragment_buckets(len(self.layout), num_fragments), None
        except ValueError as e:
            frags, err = [], f"rank {self.rank}: {e}"
        errs = [e for e in self._all_gather(err) if e]
        if errs:
            raise ValueError(f"{self.config.site_id}: {errs[0]}")
        return frags

    def _lost_notices(self, store: dist.Store | None) -> LostNotices | None:
        """Rank 0 posts the members its heartbeats report dead; the others poll them."""
        if self.num_ranks == 1:
            return None
        store = store if store is not None else site_store()
        if store is None:
            log.warning(
                "%s: no site store (MASTER_ADDR/MASTER_PORT): ranks > 0 wait out dead sites", self.config.site_id
            )
            return None
        notices = LostNotices(
            store, rank=self.rank, on_lost=lambda ids: self.engine.members_lost(ids, why="lost notice from rank 0")
        )
        if self.group is not None:
            self.group.on_members_lost = notices.post
        return notices

    # ------------------------------------------------------------------ collectives
    def _broadcast(self, obj: object) -> object:
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0) if self.pg else 0, group=self.pg)
        return box[0]

    def _all_gather(self, obj: object) -> list:
        out: list = [None] * self.num_ranks
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    # ------------------------------------------------------------------ membership
    def join(self) -> None:
        """Join as one site (done by the constructor): rank 0 registers every rank's
        address; when rounds already ran, every rank pulls its slice from the same
        rank of the members; then the model is reset to θ on every rank."""
        info: JoinInfo | Exception | None = None
        if self.group is not None:
            try:
                info = self.group.join()
            except (RendezvousError, StateTransferError) as e:
                info = e
        info = self._broadcast(info)
        if isinstance(info, Exception):
            raise info
        assert isinstance(info, JoinInfo)
        err = None
        if self.rank != 0 and info.needs_state and self.state.rounds_applied < info.next_round:
            try:
                self._pull_slice(info, min_round=info.next_round)
            except StateTransferError as e:
                err = f"rank {self.rank}: {e}"
        errs = [e for e in self._all_gather(err) if e]
        if errs:  # on every rank, so none waits for the others in a collective
            raise StateTransferError(f"{self.config.site_id}: joining failed: {errs[0]}")
        self._align_rounds(info)
        self._publish()

    def _pull_slice(self, info: JoinInfo, *, min_round: int) -> None:
        donors = rank_donors(info.members, self.rank, self.num_ranks)
        if not donors:
            self.state.rounds_applied = max(self.state.rounds_applied, info.next_round)
            return
        pull_full_state(
            self.state,
            self.engine.transport,
            donors,
            requester=self.config.site_id,
            timeout_s=self.config.group.state_pull_timeout_s,
            min_round=min_round,
        )

    def _align_rounds(self, info: JoinInfo, max_tries: int = 5) -> None:
        """Make every slice reflect the same number of rounds: ranks behind the
        newest pull again from their donors (a donor site may have finished a round
        between two ranks' pulls)."""
        for _ in range(max_tries):
            rounds = self._all_gather(self.state.rounds_applied)
            if len(set(rounds)) == 1:
                return
            target = max(rounds)
            err = None
            if self.state.rounds_applied < target:
                try:
                    self._pull_slice(info, min_round=target)
                except StateTransferError as e:
                    err = str(e)
            errs = [e for e in self._all_gather(err) if e]
            if errs:
                raise StateTransferError(f"{self.config.site_id}: slices could not be aligned: {errs[0]}")
        raise SiteGroupError(f"{self.config.site_id}: slices still at different rounds after {max_tries} pulls")

    def _publish(self, buckets: tuple[int, ...] | None = None) -> None:
        """Reset this rank's slice of the model to θ (only ``buckets``' part when given:
        a fragment round), all-gather the replicated parts."""
        t0 = time.process_time()
        if buckets is None:
            self.state.copy_to(self.local)
        else:
            for b in buckets:
                with self.state.lock(b):
                    self.layout.scatter(b, self.state.theta[b].detach(), self.local)
        t1 = time.process_time()
        self.slices.sync_replicas(self.pg)
        self.last_cpu_s.update(scatter=t1 - t0, allgather=time.process_time() - t1)

    def _resync(self, min_round: int) -> str | None:
        """Every rank pulls its slice from the same rank of the members (rank 0
        re-registers first). Returns None, or the first rank's error."""
        info: JoinInfo | str
        if self.group is not None:
            try:
                info = self.group._call_with_backoff(self.group.register, 60.0)
                self.group._resync_needed.clear()
            except RendezvousError as e:
                info = f"rendezvous: {e}"
        else:
            info = ""
        info = self._broadcast(info)
        err: str | None = info if isinstance(info, str) else None
        if err is None:
            assert isinstance(info, JoinInfo)
            self.state.residuals = [None] * len(self.state)
            try:
                self._pull_slice(info, min_round=max(min_round, info.next_round))
            except StateTransferError as e:
                err = f"rank {self.rank}: {e}"
        errs = [e for e in self._all_gather(err) if e]
        if errs:
            if self.group is not None:
                self.group._resync_needed.set()  # try again next time
            return errs[0]
        self._align_rounds(info)  # type: ignore[arg-type]
        return None

    # ------------------------------------------------------------------ rounds
    def _decision(self) -> tuple[str, RoundPlan | None, str, float]:
        if self.group is None:
            return "", None, "", 0.0
        t0 = time.monotonic()
        try:
            kind, d, reason = self.group.next_decision()
        except QuorumTimeout as e:
            return "error", None, str(e), 0.0
        quorum_s = time.monotonic() - t0 if kind in ("plan", "missed") else 0.0
        return kind, (d.plan if d is not None else None), reason, quorum_s

    def sync(self) -> SiteSyncOutcome:
        """Run one round on every rank of the site (normally called by :meth:`step`).

        Rank 0 asks the rendezvous; the decision is broadcast; the ranks apply the
        half-round rule; then each rank runs its slice's round with rank j of the
        other members. Returns the same outcome on every rank (except ``result``).
        Raises:
            QuorumTimeout: on every rank, when no round formed in time.
        """
        self.last_cpu_s = {}
        kind, plan, reason, quorum_s = self._broadcast(self._decision())
        if kind == "error":
            raise QuorumTimeout(reason)
        if kind == "deferred":
            out = SiteSyncOutcome(status="deferred", reason=reason)
            log.warning("%s: round deferred (%s); training on locally", self.config.site_id, reason)
        elif kind == "plan":
            assert plan is not None
            out = self._run_planned(plan, reason)
        else:
            err = self._resync(min_round=0)
            out = SiteSyncOutcome(status="deferred" if err else "resynced", reason=err or reason)
        if out.status != "deferred":
            self._publish(
                self.fragments[out.fragment] if out.status == "applied" and out.fragment is not None else None
            )
        out.quorum_s = quorum_s
        t0 = time.process_time()
        out.slice_checksums = self._all_gather(slice_checksum(self.state))
        self.last_cpu_s["checksum"] = time.process_time() - t0
        out.site_checksum = combine_checksums(out.slice_checksums)
        out.num_lost_notices_used = self.notices.num_used if self.notices is not None else 0
        self.last_outcome = out
        for cb in self.on_round:
            cb(out)
        return out

    def _run_planned(self, plan: RoundPlan, reason: str) -> SiteSyncOutcome:
        view = RankView(
            rank=self.rank,
            kind="plan",
            plan_round=plan.round,
            members=plan.site_ids,
            rounds_applied=self.state.rounds_applied,
        )
        if self.view_hook is not None:
            view = self.view_hook(view)
        agree, why = decide_agreement(self._all_gather(view))
        if not agree:
            log.warning(
                "%s rank %d: skipping round %d (half-round rule): %s", self.config.site_id, self.rank, plan.round, why
            )
            err = self._resync(min_round=plan.round + 1)
            return SiteSyncOutcome(status="deferred" if err else "skipped", reason=err or why)
        my_plan = rank_plan(plan, self.rank, self.num_ranks)
        frag = fragment_of_round(plan.round, len(self.fragments)) if len(self.fragments) > 1 else None
        buckets = self.fragments[frag] if frag is not None else None
        t0 = time.process_time()
        ok = self.engine.add_pseudo_gradient(self.local, buckets)
        t1 = time.process_time()
        res = self.engine.run_round(my_plan, contribute=ok, buckets=buckets)
        res.fragment = frag
        self.last_cpu_s.update(gather=t1 - t0, round=time.process_time() - t1)
        return SiteSyncOutcome(status="applied", reason=reason, fragment=frag, result=res)

    @property
    def period_steps(self) -> int:
        """Inner steps between two rounds: ``sync_every`` / ``num_fragments``."""
        return self.config.sync_every // len(self.fragments)

    @property
    def round(self) -> int:
        """Rounds applied to θ (= the next round's number)."""
        return self.state.rounds_applied

    def _post_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if not self._hook_paused:
            self.step()

    def step(self) -> SiteSyncOutcome | None:
        """Count one inner step; every ``sync_every`` / ``num_fragments`` steps run a
        round (on every rank; a fragment round when ``num_fragments`` > 1)."""
        self.inner_steps += 1
        if self.group is not None:
            self.group.inner_step = self.inner_steps
        if self.inner_steps % self.period_steps == 0:
            return self.sync()
        return None

    # ------------------------------------------------------------------ state
    def diloco_numel(self) -> dict[str, int]:
        """This rank's DiLoCo elements (see :func:`diloco_numel`): ~1/K of a 1-rank site's."""
        return diloco_numel(self.state)

    def close(self) -> None:
        """Leave the group (rank 0) and stop serving peers (every rank)."""
        if self._closed:
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        if self.group is not None:
            self.group.leave()
        if self.notices is not None:
            self.notices.close()
        self.engine.stop(0.5)

    def __enter__(self) -> "SiteGroupDiLoCo":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
