"""``Site``: one site's side of the round protocol, for a site of K >= 1 ranks.

A site is one process (K = 1) or a torch.distributed group of K ranks; rank j holds
slice j of θ (:mod:`dtrain.sitegroup.slices`) and runs its own
:class:`~dtrain.rounds.RoundEngine`, which exchanges slice j with rank j of the other
sites. One membership per site: rank 0 holds the :class:`~dtrain.membership.Group`
(rendezvous client, heartbeats) and registers every rank's Peer address. What differs
between K = 1 and K > 1 is only the :class:`~dtrain.sitegroup.comm.SiteComm` the
steps below talk through (the identity for K = 1):

* :meth:`Site.join`: rank 0 registers; every rank pulls its slice when rounds already
  ran; the slices are aligned to one round.
* :meth:`Site.sync` (one round; the callable :class:`~dtrain.streaming.StreamingSync`
  runs fragment rounds with): rank 0 asks the rendezvous; its decision is broadcast;
  the ranks apply the half-round rule (:func:`~dtrain.sitegroup.agree.decide_agreement`)
  before any of them pushes; each rank runs its slice's round with rank j of the
  members (:func:`~dtrain.sitegroup.agree.rank_plan`).
* :meth:`Site.resync`: a site cut from a round or declared dead: every rank pulls its
  slice from rank j of the members.

It never raises for peer faults; ``QuorumTimeout`` (every rank) when no round forms
within ``GroupConfig.quorum_wait_s``; ``LeftBehind`` (every rank) when its θ is behind the
group's round and no member is left to pull from (the end of a run that left it behind).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Sequence

import torch

from dtrain.configs import GroupConfig
from dtrain.errors import (
    LeftBehind,
    PeerTimeout,
    QuorumTimeout,
    RendezvousError,
    SiteGroupError,
    StateTransferError,
    TransportError,
)
from dtrain.membership import Decision, Group, RendezvousClient
from dtrain.protocol import JoinInfo, Member, RoundPlan
from dtrain.rounds import RoundEngine
from dtrain.rounds.catchup import CatchUp, CatchUpStats, decide_void
from dtrain.rounds.outcome import RoundStatus, SyncOutcome
from dtrain.sitegroup.agree import RankView, decide_agreement, rank_donors, rank_plan
from dtrain.sitegroup.comm import SiteComm
from dtrain.state import decode_position, position_passes
from dtrain.transports.base import LinkProbe

__all__ = ["Site", "probe_report"]

log = logging.getLogger(__name__)


def plan_expired(plan: RoundPlan) -> tuple[bool, str]:
    """Whether a plan read ``plan.age_s`` seconds after the rendezvous formed it is too old
    to act on: its reduce deadline (``reduce_timeout_s`` after formation) has passed, so
    the owners have finalized without this site and it could only finalize its own
    buckets alone. Such a site takes the round as missed and resynchronises after it."""
    if plan.age_s > plan.reduce_timeout_s:
        return True, (
            f"the plan of round {plan.round} is {plan.age_s:.1f}s old, past its reduce deadline "
            f"({plan.reduce_timeout_s:.1f}s after it formed): this site was stalled"
        )
    return False, f"the plan of round {plan.round} is {plan.age_s:.2f}s old"


def probe_report(contribution_bytes: int, probes: Sequence[LinkProbe], *, num_sites: int) -> dict | None:
    """What a round's exchange would take at the rates a join probe measured: the report a
    joining site sends the rendezvous (``{"probe": true, "reduce_s", "means_s", "why", ...}``;
    ``dtrain.rendezvous.deadlines``, the join probe). None: nothing was measured.

    Each member owns 1 / ``num_sites`` of the buckets, and a site pushes its contribution's
    share to each owner at once, so the reduce takes the slowest of
    ``contribution_bytes / num_sites / rate + 2 rtt`` over the probed members (they were
    probed at once, so a shared bottleneck shows in each rate). The means are as large and
    cross the same links after it: ``means_s`` (from formation) is twice that. A stream that
    did not complete in time gives its average as an upper bound on the rate (so the figure
    is a lower bound); one with no rate gives nothing.
    """
    figures = []
    for p in probes:
        rate = p.rate_bytes_per_s
        if not p.complete and p.seconds > 0 and p.bytes > 0:
            rate = min(rate or math.inf, p.bytes / p.seconds)
        if rate is None or not rate > 0:
            continue
        figures.append((contribution_bytes / max(1, num_sites) / rate + 2 * p.rtt_s, rate, p.rtt_s))
    if not figures:
        return None
    reduce_s, rate, rtt_s = max(figures)
    return {
        "probe": True,
        "reduce_s": reduce_s,
        "means_s": 2 * reduce_s,
        "rate_bytes_per_s": rate,
        "rtt_s": rtt_s,
        "why": (
            f"{contribution_bytes / 2**20:.1f} MiB a round over {num_sites} sites at {rate / 1e3:.0f} kB/s "
            f"and {rtt_s * 1e3:.0f} ms to the slowest of {len(figures)} members: reduce {reduce_s:.2f}s"
        ),
    }


class Site:
    """One site's (one rank's) membership and rounds.

    Args:
        engine: this rank's round engine, started (it has an address).
        comm: the site's ranks (:class:`~dtrain.sitegroup.comm.LocalSiteComm` for K = 1).
        rendezvous: the rendezvous client; rank 0 only (None on the other ranks).
        config: membership timing (:class:`~dtrain.configs.GroupConfig`).

    Every rank must construct it and call :meth:`join`, :meth:`sync` and
    :meth:`leave` in the same order (they run collectives).

    Attributes:
        group: rank 0's :class:`~dtrain.membership.Group`; None on ranks j > 0.
        donors: the members (their rank j) this rank's θ was last pulled from (join or
            resync), for the training-position heal; empty when the last one pulled nothing.
        last_catch_up: what the last join or resync pulled and replayed, from whom
            (:class:`~dtrain.rounds.catchup.CatchUpStats`); None before the first.
        view_hook: test-only fault injection, ``view -> view`` applied to this rank's
            :class:`~dtrain.sitegroup.agree.RankView` before the ranks compare them.
    Raises:
        ValueError: (every rank) rank 0 has no rendezvous client.
    """

    def __init__(
        self, engine: RoundEngine, comm: SiteComm, rendezvous: RendezvousClient | None, config: GroupConfig
    ) -> None:
        self.engine = engine
        self.comm = comm
        self.config = config
        self.site_id = engine.site_id
        self.rank, self.num_ranks = comm.rank, comm.num_ranks
        if not all(comm.all_gather(self.rank != 0 or rendezvous is not None, round=True)):
            raise ValueError("rendezvous must be given on rank 0 (it speaks for the site)")
        self.rank_addresses: list[str] = comm.all_gather(engine.address, round=True)
        self.group: Group | None = None
        if self.rank == 0:
            assert rendezvous is not None  # checked above, on every rank
            ranks = self.rank_addresses if self.num_ranks > 1 else ()
            self.group = Group(engine, rendezvous, config, rank_addresses=ranks)
        self.notices = None
        if self.num_ranks > 1:
            self.notices = comm.lost_notices(lambda ids: engine.members_lost(ids, why="lost notice from rank 0"))
            if self.group is not None and self.notices is not None:
                self.group.on_members_lost = self.notices.post
        self.donors: list[Member] = []
        self.last_catch_up: CatchUpStats | None = None  # what the last join or resync pulled and replayed
        # the plan this site skipped as a member (read past its reduce deadline): every resync
        # while θ is at its round may count it void (_pull), not only the first
        self._skipped_plan: RoundPlan | None = None
        self._voided = False  # this rank's last pull passed a void round (resync: site-wide)
        self.last_plan: RoundPlan | None = None  # of the last round this site ran
        self.view_hook: Callable[[RankView], RankView] | None = None
        self._probing: threading.Thread | None = None  # rank 0's join probe, until its first decision
        # process CPU seconds of the last round's steps: gather (Δ + residual) and round (the
        # engine: encode, push, reduce, outer step, decode); empty when no round ran
        self.last_cpu_s: dict[str, float] = {}

    # ------------------------------------------------------------------ membership
    def join(self) -> JoinInfo:
        """Join as one site: rank 0 registers (every rank's address) and starts
        heartbeating; when rounds already ran every rank pulls its slice from rank j of
        the members (:meth:`_pull`).

        Raises:
            RendezvousError: (every rank) the rendezvous unreachable for 60 s.
            StateTransferError: (every rank) no member could provide a consistent state.
            LeftBehind: (every rank) rounds already ran, this site's θ is older (a
                checkpoint of an earlier round, or none) and no member is live to pull from.
        """
        info: JoinInfo | Exception | None = None
        if self.group is not None:
            try:
                info = self.group.join()
            except (RendezvousError, StateTransferError) as e:
                info = e
        info = self.comm.broadcast(info, round=True)
        if isinstance(info, Exception):
            raise info
        assert isinstance(info, JoinInfo)
        self.donors = []
        err = None
        if self.engine.state.rounds_applied < info.next_round:  # needs_state, or no member to pull from
            log.info(
                "%s joins at round %d: pulling state from %s",
                self.site_id,
                info.next_round,
                [m.site_id for m in info.members],
            )
            err = self._try_pull(info, min_round=info.next_round)
        errs = self._gather_errors(err)
        if errs:  # on every rank, so none waits for the others in a collective
            raise StateTransferError(f"{self.site_id}: joining failed: {errs[0]}")
        self._align_rounds(info)
        if self.group is not None and info.members and self.config.join_probe_s > 0:
            self._probing = threading.Thread(
                target=self._probe_links, args=(info.members,), name=f"probe-{self.site_id}", daemon=True
            )
            self._probing.start()  # beside the first inner phase; the first decision waits for it
        return info

    def _probe_done(self) -> None:
        """(rank 0) Wait for the join probe, if one still runs, before this site's first
        ready or its leave: at most ``join_probe_s`` for the probe and as long again for its
        report's delivery (:meth:`_probe_links`), less the inner steps it ran beside."""
        if self._probing is not None:
            self._probing.join(timeout=2 * self.config.join_probe_s + 1.0)
            self._probing = None

    def _probe_links(self, members: Sequence[Member]) -> None:
        """Rank 0 after join, on its own thread beside the first inner phase: probe every
        member's link at once (``Transport.probe_link``, within ``join_probe_s``) and report
        what a round's exchange would take at those rates (:func:`probe_report`) before this
        site's first ready (:meth:`_probe_done`), so that the rendezvous sizes the round it
        forms with it (``dtrain.rendezvous.deadlines``, the join probe). Run beside the inner
        steps, a member's outage during the probe delays the first ready only by what the
        probe outlasts them. A member that fails the probe is left out; a transport that
        cannot probe reports nothing."""
        assert self.group is not None
        cfg, transport = self.config, self.engine.transport
        size = sum(self.engine.codec.max_encoded_bytes(b.numel) for b in self.engine.state.layout.buckets)

        def one(m: Member):
            try:
                return transport.probe_link(
                    m.address, max_bytes=cfg.join_probe_bytes, timeout_s=cfg.join_probe_s, requester=self.site_id
                )
            except TransportError as e:
                log.info("%s: join probe of %s failed: %s", self.site_id, m.site_id, e)
                return None

        with ThreadPoolExecutor(len(members), thread_name_prefix=f"probe-{self.site_id}") as pool:
            probes = [p for p in pool.map(one, members) if p is not None]
        report = probe_report(size, probes, num_sites=len(members) + 1)
        if report is None:
            return
        log.info("%s: join probe: %s", self.site_id, report["why"])
        self.group.report_probe(report)
        self.group.beat_and_wait(cfg.join_probe_s)  # delivered before this site's first ready

    def resync(self, min_round: int = 0, missed: RoundPlan | None = None) -> str | None:
        """Discard this site's progress and pull θ and the outer state from the members
        (rank 0 registers again first). Returns None, or the first rank's error (then
        rank 0 tries again at its next sync). A rendezvous unreachable for
        ``config.rendezvous_retry_s`` (the tolerance of :meth:`Group.next_decision`) is
        such an error: the round is deferred and the site trains on locally, as in any
        round the rendezvous cannot be reached for. ``missed``: the plan this site skipped
        as a member (it read it past its reduce deadline), or None: when no site ran that
        round either, the pull counts it void instead of waiting for a θ that never comes
        (:meth:`_pull`).

        Raises:
            LeftBehind: (every rank) no member is left to pull from (:meth:`_pull`).
        """
        info: JoinInfo | str = ""
        if self.group is not None:
            try:  # as long as a round waits for an unreachable rendezvous: then the site trains on
                info = self.group.register_with_backoff(self.config.rendezvous_retry_s)
                self.group.resync_done()
            except RendezvousError as e:
                info = f"rendezvous unreachable: {e}"  # the words of every round deferred for it
        info = self.comm.broadcast(info, round=True)
        err: str | None = info if isinstance(info, str) else None
        self.donors = []
        self._voided = False
        st = self.engine.state
        if missed is not None:
            self._skipped_plan = missed
        skipped = self._skipped_plan
        if skipped is not None and st.rounds_applied != skipped.round:
            skipped = self._skipped_plan = None  # θ is past it (or it was not this round's)
        if err is None:
            assert isinstance(info, JoinInfo)
            st.residuals = [None] * len(st)
            err = self._try_pull(info, min_round=max(min_round, info.next_round), missed=skipped)
        errs = self._gather_errors(err)
        if errs:
            if self.group is not None:
                self.group.resync_needed()  # try again next time (with the skipped plan again)
            return errs[0]
        if any(self.comm.all_gather(self._voided, round=True)):
            self.donors = []  # a rank passed a void round: no rank heals, so the ranks' collectives match
        self._align_rounds(info)  # type: ignore[arg-type]
        return None

    def _try_pull(self, info: JoinInfo, *, min_round: int, missed: RoundPlan | None = None) -> str | LeftBehind | None:
        """:meth:`_pull`; its error as text (prefixed with the rank for K > 1), or None;
        a :class:`LeftBehind` as it is (:meth:`_gather_errors` raises it on every rank)."""
        try:
            self._pull(info, min_round=min_round, missed=missed)
        except LeftBehind as e:
            return e
        except (StateTransferError, RendezvousError) as e:
            return f"rank {self.rank}: {e}" if self.num_ranks > 1 else str(e)
        return None

    def _gather_errors(self, err: str | LeftBehind | None) -> list[str]:
        """Every rank's pull error (a collective); a rank left behind raises
        :class:`LeftBehind` on every rank."""
        errs = [e for e in self.comm.all_gather(err, round=True) if e]
        behind = [e for e in errs if isinstance(e, LeftBehind)]
        if behind:
            raise behind[0]
        return errs

    def _pull(self, info: JoinInfo, *, min_round: int, missed: RoundPlan | None = None) -> None:
        """Bring this rank's slice to the group's round from rank j of ``info.members``
        (:class:`~dtrain.rounds.catchup.CatchUp`: buckets spread over every member, each
        pulled whole or replayed from the means the members keep, starting from this
        site's own θ_b where they keep every round since). A pull may take any number of
        rounds; it fails after ``state_pull_timeout_s`` without progress. A one-process
        site whose donors all failed, or that finds no member while its θ is behind the
        group's round (the others may be re-joining), asks the rendezvous for the current
        members every 0.5 s and goes on with them, keeping what it pulled (ranks of a
        K > 1 site fail together and try again at the next sync instead: one rank cannot
        re-register alone). With no member and a θ that is not behind there is nothing to
        pull. ``last_catch_up`` holds what the pull did.

        A round no site ran: when ``missed`` (the plan this site skipped as a member) is the
        round before the target and every other member skipped it too
        (:func:`~dtrain.rounds.catchup.decide_void`), no donor will ever reach the target;
        the pull brings θ to the skipped round and the engine passes it with θ unchanged
        (``RoundEngine.void_round``); a member that asks later pulls the target from one that did.

        Raises:
            StateTransferError: no progress within ``state_pull_timeout_s``.
            RendezvousError: the rendezvous unreachable when asked again.
            LeftBehind: no member to pull from (K = 1: for ``state_pull_timeout_s``, at once
                when the group's round is past ``run_rounds``: the run is over) while θ is
                behind the round the group is at: the site never adopts the round number
                with its old θ (issue 33, "no site left behind").
        """
        st = self.engine.state
        timeout_s = self.config.state_pull_timeout_s
        deadline = time.monotonic() + timeout_s
        catch = CatchUp(
            st,
            self.engine.transport,
            self.engine.bcodec,
            requester=self.site_id,
            streams_per_donor=self.config.state_pull_streams,
            progress_timeout_s=timeout_s,
            # a request's first timeout: the run's own exchange of a round (none yet: 30 s)
            request_timeout_s=None if self.last_plan is None else self.last_plan.broadcast_timeout_s,
            # what the members keep, as this site keeps it: buckets older than that go out at once
            kept_rounds=self.engine.config.history_rounds,
        )
        self.last_catch_up = catch.stats
        while True:
            donors = rank_donors(info.members, self.rank, self.num_ranks)
            target = max(min_round, info.next_round)
            void = missed if missed is not None and missed.round == target - 1 == st.rounds_applied else None
            if not donors and st.rounds_applied >= target:
                self.donors = []
                return
            if not donors and void is not None:
                alone, why = decide_void(void, self.site_id, {})  # void when it was this site's alone
                if alone:
                    self.donors = []
                    self.engine.void_round(void.round, why)
                    self._voided = True
                    return
            if not donors:
                self.donors = []
                over = self.config.run_rounds is not None and target >= self.config.run_rounds
                if over or self.group is None or self.num_ranks > 1 or time.monotonic() + 0.5 >= deadline:
                    raise LeftBehind(
                        self.site_id,
                        st.rounds_applied,
                        target,
                        f"the run ended (its {self.config.run_rounds} rounds ran) and no member is left"
                        if over
                        else f"no live member for {timeout_s:g} s"
                        if self.num_ranks == 1
                        else "no live member",
                    )
                time.sleep(0.5)
                info = self.group.register_with_backoff(max(0.0, deadline - time.monotonic()))
                continue
            self.donors = donors
            if self.group is not None:  # the rendezvous then does not hold rounds for a long pull
                self.group.catch_up_eta = catch.eta_s
            try:
                catch.run(donors, min_round=target, missed=void)
                if void is not None and catch.stats.void is not None and st.rounds_applied == void.round:
                    self.engine.void_round(void.round, catch.stats.void)
                    self.donors = []  # no site ran the round: each keeps its own training position
                    self._voided = True
                return
            except StateTransferError as e:
                deadline = max(deadline, catch.progress_at + timeout_s)  # it made progress: go on
                if self.group is None or self.num_ranks > 1 or time.monotonic() + 0.2 >= deadline:
                    raise
                log.warning(
                    "%s: state pull failed (%s); asking the rendezvous for the current members", self.site_id, e
                )
            time.sleep(0.2)
            info = self.group.register_with_backoff(max(0.0, deadline - time.monotonic()))

    def _align_rounds(self, info: JoinInfo, max_tries: int = 5) -> None:
        """Make every slice reflect the same number of rounds: ranks behind the newest
        pull again (a donor site may have finished a round between two ranks' pulls).
        Nothing to do for K = 1."""
        for _ in range(max_tries):
            rounds = self.comm.all_gather(self.engine.state.rounds_applied, round=True)
            if len(set(rounds)) == 1:
                return
            target = max(rounds)
            err = None
            if self.engine.state.rounds_applied < target:
                err = self._try_pull(info, min_round=target)
            errs = self._gather_errors(err)
            if errs:
                raise StateTransferError(f"{self.site_id}: slices could not be aligned: {errs[0]}")
        raise SiteGroupError(f"{self.site_id}: slices still at different rounds after {max_tries} pulls")

    def pull_position(self, donors: Sequence[Member], r: int) -> tuple[dict | None, str | None]:
        """The training position of round ``r`` (θ was pulled at it) from a donor, its rank j
        for rank j: ``(position, donor id)``, the same donor's on every rank (a collective), or
        ``(None, None)`` (logged) when no donor has it for every rank.

        Every donor is asked at once, in the passes of :func:`~dtrain.state.position_passes`
        (the last plan's broadcast deadline, doubled per pass up to ``state_pull_timeout_s``);
        a later pass asks again only the donors whose call timed out. A one-rank site takes
        the first usable answer without waiting for the pass to end, so a donor whose stream
        stalled (30% loss) costs nothing while another answers; K > 1 ranks wait for the pass
        and take the first donor, in the members' order, usable on every rank. A donor already
        past round ``r`` ends the pull at once: the group moved on, so this site's next round
        resyncs θ and takes that round's position (a resync at 30% loss asked on for 64 s
        more while the members finished the run and left)."""
        plan = self.last_plan
        asking = list(range(len(donors)))
        for timeout_s in position_passes(
            None if plan is None else plan.broadcast_timeout_s, self.config.state_pull_timeout_s
        ):
            if not asking:
                break
            mine = self._ask_positions(donors, asking, r, timeout_s)
            told = {i: (None if p is None else int(p["inner_steps"]), why) for i, (p, why) in mine.items()}
            got = self.comm.all_gather(told)  # the main group, as DiLoCo calls it (not the round thread)
            if any(why == "past" for g in got for _, why in g.values()):
                log.warning("%s: a donor is past round %d; keeping this site's own position", self.site_id, r)
                return None, None
            for i in asking:
                steps = [g.get(i, (None, ""))[0] for g in got]
                if None not in steps and len(set(steps)) == 1:
                    return mine[i][0], donors[i].site_id
            asking = [i for i in asking if any(g.get(i, (None, "timeout"))[1] == "timeout" for g in got)]
        log.warning("%s: no donor had a training position of round %d; keeping this site's own", self.site_id, r)
        return None, None

    def _ask_positions(
        self, donors: Sequence[Member], asking: list[int], r: int, timeout_s: float
    ) -> dict[int, tuple[dict | None, str]]:
        """Ask the donors ``asking`` (indices) at once; ``{index: _fetch_position's answer}`` of
        those that answered within ``timeout_s`` (K = 1: until the first usable or "past")."""
        out: dict[int, tuple[dict | None, str]] = {}
        pool = ThreadPoolExecutor(max_workers=len(asking), thread_name_prefix=f"position-{self.site_id}")
        calls = {pool.submit(self._fetch_position, donors[i], r, timeout_s): i for i in asking}
        try:
            for call in as_completed(calls, timeout=timeout_s + 5.0):
                out[calls[call]] = answer = call.result()
                if self.num_ranks == 1 and (answer[0] is not None or answer[1] == "past"):
                    break
        except TimeoutError:  # a call past its own timeout: counted as timed out
            pass
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return out

    def _fetch_position(self, donor: Member, r: int, timeout_s: float) -> tuple[dict | None, str]:
        """``donor``'s training position of round ``r``, or None (logged); and why not:
        ``"timeout"`` (the call ran out of its ``timeout_s``: a later pass with more time
        may succeed), ``"past"`` (the donor is past round ``r``: the group moved on) or ``""``."""
        try:
            st = self.engine.transport.pull_state(
                donor.address, len(self.engine.state), requester=self.site_id, timeout_s=timeout_s
            )
            pos = decode_position(st)
        except (TransportError, StateTransferError, KeyError, ValueError, RuntimeError) as e:
            timed_out = isinstance(e, PeerTimeout)
            why = f" (a pass of {timeout_s:.1f} s)" if timed_out else ""
            log.warning("%s: no training position from %s%s: %s", self.site_id, donor.site_id, why, e)
            return None, "timeout" if timed_out else ""
        if pos["round"] != r:
            log.info("%s: %s's training position is of round %d, not %d", self.site_id, donor.site_id, pos["round"], r)
            return None, "past" if pos["round"] > r else ""
        return pos, ""

    def note_rounds_done(self, n: int) -> None:
        """(rank 0) This site finished ``n`` rounds: its heartbeats say so (no-op elsewhere)."""
        if self.group is not None:
            self.group.note_rounds_done(n)

    def unrepaired(self, outcome: SyncOutcome | None) -> list[int]:
        """The buckets of this rank's slice that ``outcome`` (the round just run) left STALE
        and unrepaired: θ_b unlike the owner's (its mean never arrived and the round's
        repairs failed); [] when the round was not applied here or repair is off."""
        applied = outcome is not None and outcome.status is RoundStatus.APPLIED and outcome.result is not None
        return list(self.engine.unrepaired) if applied and self.engine.config.repair else []

    def catch_up_last_round(self, outcome: SyncOutcome | None) -> LeftBehind | None:
        """Right after a round that left buckets STALE and unrepaired (``DiLoCo`` calls it
        before the next inner phase), and at the end of a run, before the worker exports θ and
        writes its summary (every rank: a collective): bring the buckets ``outcome``'s round
        left STALE and unrepaired to the round from its other members (mid-run they serve
        state and kept means as to a joiner). At the end they keep serving while this site's
        heartbeats say it has not finished that round (rank 0's ``rounds_done`` stays one
        short while its slice is unrepaired; :meth:`_wait_members_finished`, at most the
        round's broadcast deadline). Each such bucket goes back to the round before and takes
        the round's mean again from a member's kept history (:class:`CatchUp`: replayed when
        it reproduces the owner's checksums, else pulled whole), within the round's
        ``broadcast_timeout_s`` in all (:meth:`CatchUp.run_within`: given up, with its stack
        logged, whatever it waits on); donors all dropped (their requests timed out) are asked
        again while time is left. Returns None (nothing unrepaired, or all brought to the
        round: the heartbeats then say the round is done) or, when some rank's buckets stay
        behind, the :class:`LeftBehind` that the caller raises at close (issue 33: never
        "done" on another θ)."""
        mine, plan = self.unrepaired(outcome), self.last_plan
        try:
            total = sum(self.comm.all_gather(len(mine), round=True))
        except RuntimeError:  # a rank died (its collectives fail): no catch-up; what this rank knows
            return self._left_behind(len(mine), "a rank of the site died") if mine else None
        if not total or plan is None:
            return None
        err = None
        if mine:
            gone = self.group.dead if self.group is not None else frozenset()
            others = [m for m in plan.members if m.site_id != self.site_id and m.site_id not in gone]
            donors = rank_donors(others, self.rank, self.num_ranks)
            log.info("%s: catching up buckets %s of round %d from %s", self.site_id, mine, plan.round, donors)
            st = self.engine.state
            tags = {b: st.bucket_round[b] for b in mine}
            for b in mine:  # θ_b does not reflect the round: it takes the round's mean again
                with st.lock(b):
                    st.bucket_round[b] = plan.round
            catch = CatchUp(
                st,
                self.engine.transport,
                self.engine.bcodec,
                requester=self.site_id,
                streams_per_donor=self.config.state_pull_streams,
                progress_timeout_s=plan.broadcast_timeout_s,
                # a quarter of the window first (doubled after each timeout): one stalled
                # request (30% loss) no longer takes the whole window
                request_timeout_s=plan.broadcast_timeout_s / 4,
            )
            self.last_catch_up = catch.stats
            err = "no live member to pull from"
            deadline = time.monotonic() + plan.broadcast_timeout_s
            while donors and time.monotonic() < deadline - 0.5:  # every donor dropped: ask them again
                err = catch.run_within(donors, min_round=plan.round + 1, limit_s=deadline - time.monotonic())
                if err is None or time.monotonic() >= deadline - 0.7:
                    break
                log.info("%s: catching up: %s; asking again", self.site_id, err)
                time.sleep(0.2)
            if err is not None:  # nothing was installed: the buckets keep the tags the round gave them
                for b, tag in tags.items():
                    with st.lock(b):
                        st.bucket_round[b] = tag
        try:
            errs = [e for e in self.comm.all_gather(err, round=True) if e]
        except RuntimeError:
            errs = [err or "a rank of the site died"]
        if errs:
            return self._left_behind(total, f"catching them up failed: {errs[0]}")
        self.engine.unrepaired = []  # θ_b is the round's now: nothing left to catch up
        self.note_rounds_done(plan.round + 1)  # the heartbeat thread tells the rendezvous at once
        log.info("%s: round %d's %d unrepaired bucket(s) caught up", self.site_id, plan.round, total)
        return None

    def _left_behind(self, n: int, why: str) -> LeftBehind:
        r = self.engine.state.rounds_applied  # θ does not wholly reflect round r - 1
        return LeftBehind(
            self.site_id,
            r - 1,
            r,
            f"its last round left {n} bucket(s) stale and unrepaired (a mean that never arrived and whose repair "
            f"failed), and {why}: its θ differs from its peers', so the run does not end 'done' here",
        )

    def note_progress(self, *, inner_step: int, last_loss: float | None = None) -> None:
        """What rank 0's heartbeats tell the rendezvous (no-op on ranks j > 0)."""
        if self.group is not None:
            self.group.inner_step = inner_step
            if last_loss is not None:
                self.group.last_loss = last_loss

    def wait_left_out(self, timeout_s: float, poll_s: float = 0.1) -> list[str]:
        """Before leaving at the end of a run: wait until every site the last round this
        site ran left out (cut as a straggler, ``RoundPlan.left_out``) is gone: it caught
        up (pulled θ from this site or another member, finished and left) or the
        rendezvous holds it dead; at most ``timeout_s``. Meanwhile this site heartbeats
        and serves its state as a member, so the straggler's resync finds a donor
        instead of ending behind (issue 33). Nothing to wait for when this site's θ moved
        past that round since (it resynced). Rank 0 waits; the other ranks wait for its
        answer (every rank keeps serving its slice). Returns the sites still not gone.
        """
        waiting: list[str] = []
        plan = self.last_plan
        if self.group is not None and plan is not None and self.engine.state.rounds_applied == plan.round + 1:
            self._wait_members_finished(plan, poll_s)
        if self.group is not None and plan is not None and plan.left_out:
            if self.engine.state.rounds_applied == plan.round + 1:
                deadline = time.monotonic() + timeout_s
                t0 = time.monotonic()
                waiting = [s for s in plan.left_out if s not in self.group.dead]
                if waiting:
                    log.info(
                        "%s: waiting up to %.1f s for %s to catch up before leaving", self.site_id, timeout_s, waiting
                    )
                while waiting and time.monotonic() < deadline:
                    time.sleep(poll_s)
                    waiting = [s for s in waiting if s not in self.group.dead]
                if plan.left_out:
                    log.info(
                        "%s: %s after %.1f s",
                        self.site_id,
                        f"still waiting for {waiting}; leaving" if waiting else f"{list(plan.left_out)} gone",
                        time.monotonic() - t0,
                    )
        return self.comm.broadcast(waiting, round=True)

    def _wait_members_finished(self, plan: RoundPlan, poll_s: float) -> None:
        """(rank 0) Keep serving until every other live member of ``plan`` (this site's last
        round) has finished it, as the rendezvous sees from their heartbeats
        (``HeartbeatInfo.behind``), at most ``plan.broadcast_timeout_s``: a member still in
        the round (behind a lossy or partitioned link) late-pulls and repairs from the
        others, which must not have left (a flaky-link run ended with one site "done" on
        another θ because the member holding its missed mean had already left)."""
        assert self.group is not None
        g, others = self.group, set(plan.site_ids) - {self.site_id}
        t0 = time.monotonic()
        deadline, waiting, answered = t0 + plan.broadcast_timeout_s, None, False
        while time.monotonic() < deadline:
            # only an answer to a heartbeat sent from here on counts
            if g.beat_and_wait(min(2.0, max(0.0, deadline - time.monotonic()))):
                answered = True
                waiting = sorted(((g.behind or frozenset()) & others) - g.dead)
                if not waiting:
                    break
            elif not answered:
                break  # no answer within 2 s (the rendezvous is gone): do not wait on it
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))  # a later answer may still come
        if waiting:
            log.info(
                "%s: leaving after %.1f s with %s still in round %d",
                self.site_id,
                time.monotonic() - t0,
                waiting,
                plan.round,
            )
        elif time.monotonic() - t0 > 1.0:
            log.info(
                "%s: every member finished round %d (waited %.1f s)", self.site_id, plan.round, time.monotonic() - t0
            )

    def leave(self) -> None:
        """Rank 0 leaves the group (heartbeats stop); every rank stops its notices."""
        if self.group is not None:
            self._probe_done()
            self.group.leave()
        if self.notices is not None:
            self.notices.close()

    # ------------------------------------------------------------------ rounds
    def _decision(self) -> tuple[Decision | None, RoundPlan | None, str, float]:
        """(rank 0) ``(decision, plan, reason, quorum_s)``: the rendezvous's decision, or
        ``(None, None, why, 0)`` for a QuorumTimeout (re-raised on every rank)."""
        assert self.group is not None
        self._probe_done()
        t0 = time.monotonic()
        try:
            kind, d, reason = self.group.next_decision()
        except QuorumTimeout as e:
            return None, None, str(e), 0.0
        quorum_s = time.monotonic() - t0 if kind in (Decision.PLAN, Decision.MISSED) else 0.0
        plan = d.plan if d is not None else None
        if kind == Decision.PLAN and plan is not None:
            expired, why = plan_expired(plan)
            if expired:  # the others are past its reduce: acting on it could only apply a mean alone
                return Decision.MISSED, plan, why, quorum_s
        return kind, plan, reason, quorum_s

    def sync(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        buckets: Sequence[int] | None = None,
        fragment: int | None = None,
        pace_window_s: float | None = None,
        tokens: int = 0,
    ) -> SyncOutcome:
        """Take part in the next round with this rank's slice of the model.

        Args:
            tensors: this rank's slice (Δ = θ − tensors), as the bucket layout expects.
            buckets: a fragment round (Streaming DiLoCo): only these buckets are
                measured, sent and applied (:meth:`RoundEngine.run_round`); None: all.
            fragment: the fragment's index, recorded in the outcome and the result.
            pace_window_s: spread this rank's sends over this many seconds from the
                round's start; None: unpaced.
            tokens: the site's tokens trained since its last round of these buckets (its
                claim on every contribution, ``RoundEngine.run_round``); 0: none.
        Returns:
            the outcome (the same on every rank but ``result``); the caller writes θ
            into the model per its status. θ is never half a round's: a rank that
            disagrees makes every rank skip (SKIPPED, slices pulled again).
        Raises:
            QuorumTimeout: (every rank) no round formed within ``quorum_wait_s``.
        """
        self.last_cpu_s = {}
        decided = self._decision() if self.group is not None else None
        kind, plan, reason, quorum_s = self.comm.broadcast(decided, round=True)
        if plan is not None:  # the round's deadlines count from its formation, on this rank's clock
            plan = dataclasses.replace(plan, formed_local_s=time.monotonic() - plan.age_s)
        if kind is None:
            raise QuorumTimeout(reason)
        if kind == Decision.DEFERRED:
            return SyncOutcome(status=RoundStatus.DEFERRED, reason=reason, fragment=fragment)
        if kind == Decision.PLAN:
            assert plan is not None
            return self._run_planned(plan, reason, quorum_s, tensors, buckets, fragment, pace_window_s, tokens)
        r = self.engine.state.rounds_applied
        if kind == Decision.MISSED and plan is not None:  # a member that will not run it: peers hear at once
            self.engine.skip_round(plan.round, reason)
        if kind == Decision.MISSED:
            log.warning("%s missed round %d: %s; resynchronising", self.site_id, r, reason)
        err = self.resync(missed=plan if kind == Decision.MISSED else None)
        if err is not None:
            prefix = f"missed round {r} ({reason}); " if kind == Decision.MISSED else ""
            why = f"{prefix}resync failed: {err}"
            return SyncOutcome(status=RoundStatus.DEFERRED, reason=why, quorum_s=quorum_s, fragment=fragment)
        return SyncOutcome(status=RoundStatus.RESYNCED, reason=reason, quorum_s=quorum_s, fragment=fragment)

    def _run_planned(
        self,
        plan: RoundPlan,
        reason: str,
        quorum_s: float,
        tensors: Sequence[torch.Tensor],
        buckets: Sequence[int] | None,
        fragment: int | None,
        pace_window_s: float | None,
        tokens: int = 0,
    ) -> SyncOutcome:
        """The half-round rule, then this rank's slice's round."""
        view = RankView(
            rank=self.rank,
            kind=Decision.PLAN.value,
            plan_round=plan.round,
            members=plan.site_ids,
            rounds_applied=self.engine.state.rounds_applied,
        )
        if self.view_hook is not None:
            view = self.view_hook(view)
        agree, why = decide_agreement(self.comm.all_gather(view, round=True))
        if not agree:
            log.warning("%s rank %d: skipping round %d (half-round rule): %s", self.site_id, self.rank, plan.round, why)
            err = self.resync(min_round=plan.round + 1)
            status = RoundStatus.DEFERRED if err else RoundStatus.SKIPPED
            return SyncOutcome(status=status, reason=err or why, quorum_s=quorum_s, fragment=fragment)
        self.last_plan = plan
        my_plan = rank_plan(plan, self.rank, self.num_ranks)
        t0 = time.process_time()
        ok = self.engine.add_pseudo_gradient(list(tensors), buckets)
        t1 = time.process_time()
        res = self.engine.run_round(my_plan, contribute=ok, buckets=buckets, pace_window_s=pace_window_s, tokens=tokens)
        res.fragment = fragment
        self.last_cpu_s = {"gather": t1 - t0, "round": time.process_time() - t1}
        return SyncOutcome(status=RoundStatus.APPLIED, reason=reason, result=res, quorum_s=quorum_s, fragment=fragment)
