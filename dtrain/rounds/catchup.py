"""Catching up: a site behind brings θ and the outer state to the group's round, however slow
its link, from every live member at once (issue 33).

Per bucket, not per snapshot: each bucket's θ_b and outer-optimizer state carry the round
they reflect (``BucketState.rounds_applied``, read under the bucket's lock at the donor), so
a bucket pulled at round t needs only the outer steps of rounds ``[t, T)`` to be current at
round T. Those steps are replayed here from the means the members keep
(:class:`~dtrain.rounds.history.MeanHistory`): decode the mean, run the bucket's outer
optimizer with the learning rate of that round, and check θ_b's checksum before and after
against the owner's (``BucketMean.checksum_before/after``). No donor keeps a copy of its
state, blocks its training, or has to finish the transfer within a round; a transfer that
spans rounds replays them afterwards. Buckets start from the site's own θ_b when the
members still keep every round since (a straggler cut from a round pulls only that round's
means); a bucket older than what the members keep, or whose replay does not reach the
owner's checksum, is pulled whole again ("says so, takes a newer copy").

Several donors: one work queue of buckets; each live member serves it through
``streams_per_donor`` concurrent transfers, so a faster donor takes more buckets (chosen
by measured throughput, as work stealing does); a donor that fails mid-transfer is dropped
and only the bucket it was serving goes back on the queue (a partial re-pull). Buckets the
site cannot start from its own θ_b go out as a first wave beside the donors' summaries
(:func:`first_wave`), and the summary that ends a pass is asked while its last buckets are
in flight, so neither costs a round trip with nothing to send. What was
pulled survives a failed :meth:`CatchUp.run` (every donor gone): the next call, with the
members the rendezvous names then, goes on from there.

A round no site ran: when every member of a round read its plan past the reduce deadline
(every site stalled at once), each skips it and resyncs towards a round that no θ will ever
reflect. The run of a site that skipped it as a member counts it void instead
(:func:`decide_void`: every other member says it skipped it too), brings θ to the round
before and the site passes the void round with θ unchanged (``RoundEngine.void_round``).
"""

from __future__ import annotations

import copy
import logging
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import torch

from dtrain.buckets import checksum
from dtrain.codecs.base import Codec
from dtrain.errors import (
    CodecError,
    PeerTimeout,
    PeerUnavailable,
    RejectCode,
    Rejected,
    StateTransferError,
    TransportError,
)
from dtrain.protocol import BucketMean, Member, RoundPlan
from dtrain.rounds.history import HistoryInfo, decode_history_info
from dtrain.rounds.means import decode_mean
from dtrain.state import GlobalState
from dtrain.transports.base import Transport

__all__ = ["CatchUp", "CatchUpStats", "decide_void", "first_wave", "takes_from_queue"]

log = logging.getLogger(__name__)

#: how long a worker waits before asking a donor again for a mean of the donor's own open round
#: that it has not received yet (a donor answers NOT_FOUND then, ``PeerSide.pull_mean``)
_NOT_YET_S = 0.02


@dataclass
class CatchUpStats:
    """What a :class:`CatchUp` did (tests, logs, the benchmark).

    Attributes:
        buckets_from: per donor site id, the buckets pulled whole from it.
        bytes_from: per donor site id, bytes of bucket state pulled from it.
        means_replayed: outer steps replayed (one bucket, one round each).
        own_buckets: buckets that started from this site's own θ_b and were only replayed.
        repulled: bucket pulls beyond the first of each bucket (a bucket older than what the
            members keep, a replay that missed the owner's checksum, or a donor lost mid-pull).
        donors_lost: donors dropped after a failed transfer.
        first_wave_dropped: buckets of the first wave (asked for beside the donors' summaries)
            that came back from a donor behind ``min_round`` (another joiner) and were dropped.
        rounds: the round installed.
        void: why the run counted the round it was given as ``missed`` void (installed that
            round, for the site to pass it: :func:`decide_void`); None when it did not.
    """

    buckets_from: dict[str, int] = field(default_factory=dict)
    bytes_from: dict[str, int] = field(default_factory=dict)
    means_replayed: int = 0
    own_buckets: int = 0
    repulled: int = 0
    donors_lost: list[str] = field(default_factory=list)
    first_wave_dropped: int = 0
    rounds: int = -1
    void: str | None = None


class _Staged:
    """One bucket being brought up to date: its own outer optimizer over a private θ_b."""

    def __init__(self, opt: torch.optim.Optimizer, tag: int) -> None:
        self.opt = opt
        self.theta: torch.Tensor = opt.param_groups[0]["params"][0]
        self.tag = tag
        self.sum = checksum(self.theta)


class _Stop(Exception):
    pass


def first_wave(
    bucket_rounds: Sequence[int],
    staged: set[int],
    *,
    min_round: int,
    use_own: bool,
    kept_rounds: int | None,
    limit: int,
) -> list[int]:
    """The buckets a run pulls whole before the donors' summaries are in, at most ``limit``
    (one per stream), in order: those not already ``staged`` that this site cannot start from
    its own θ_b whatever the summaries say. That is every bucket when not ``use_own``, else a
    bucket whose own round (``bucket_rounds[b]``) is more than ``kept_rounds`` behind
    ``min_round`` (members at ``min_round`` or later keep no round that old); none when
    ``kept_rounds`` is None. The others wait for the summaries (what is kept, from which
    round): a straggler one round behind must not pull its state whole."""
    out: list[int] = []
    for b, own in enumerate(bucket_rounds):
        if len(out) >= limit:
            break
        if b in staged:
            continue
        if not use_own or (kept_rounds is not None and min_round - own > kept_rounds):
            out.append(b)
    return out


def decide_void(missed: RoundPlan, me: str, infos: dict[str, HistoryInfo]) -> tuple[bool, str]:
    """Whether round ``missed.round`` (R), whose plan site ``me`` read too late and skipped as
    a member, is void: no site ran it, so no θ will ever reflect it. ``infos``: the summaries
    of the donors that answered (:class:`HistoryInfo`, by site id). Void when every other
    member of the plan answered that it is at R and skipped R too: a member that ran R (or
    runs it now) says neither, and a site that was not a member cannot have run it. A
    member that did not answer (dead, unreachable, or asked too early) keeps the round
    undecided: it may hold R's θ, and a site that went on without it would differ from it.
    With no other member the round is void at once. Pure; ``(void, why)``."""
    r = missed.round
    others = [sid for sid in missed.site_ids if sid != me]
    for sid in others:
        info = infos.get(sid)
        if info is None:
            return False, f"no summary from {sid}, a member of round {r}: it may have run it"
        if info.rounds_applied != r or r not in info.skipped:
            return False, f"{sid}, a member of round {r}, is at round {info.rounds_applied} and did not skip it"
    for sid, info in sorted(infos.items()):
        if info.rounds_applied > r:
            return False, f"{sid} is at round {info.rounds_applied}: round {r} ran"
    who = f"every other member ({', '.join(others)}) skipped it too" if others else "this site was its only member"
    return True, f"no site ran round {r}: {who}, each reading its plan past the reduce deadline"


def takes_from_queue(queued: int, live: int, tail_in_flight: bool) -> bool:
    """Whether a donor's free stream takes the next queued bucket: always while the queue holds
    at least one bucket per live donor (``queued``, ``live``); in the queue's tail (fewer left)
    only when that donor has no tail bucket in flight (``tail_in_flight``): the last buckets go
    one per donor, each asked for as soon as a stream of its donor frees (docs/DECISIONS.md,
    "What a joiner takes from whom": not two on the donor freed first, nor after its connection drained)."""
    return queued >= live or not tail_in_flight


class _Confirmation:
    """The donors' summaries asked while a pass's last buckets were in flight
    (:meth:`CatchUp._confirm_during_tail`): each donor's round right after every bucket of the
    pass was asked for."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.rounds: dict[str, int] = {}  # the round each donor's summary said
        self.thread: threading.Thread | None = None

    def still_holds(self, cu: "CatchUp") -> bool:
        """Whether these answers stand for the pass's end (the donors need not be asked again): all
        in (each probe bounded by the request timeout), from every live donor, and no pull saw a
        newer round since (``CatchUp._rounds``), so their learning rates are the target round's. A
        round closing after the last read goes unnoticed: the site replays it as a straggler."""
        if self.thread is not None:
            self.thread.join(cu.request_timeout_s)
        with cu._cv:
            return self.done.is_set() and self.rounds == cu._rounds and set(self.rounds) == set(cu._live)


class CatchUp:
    """Bring ``state`` to the members' round; :meth:`run` once per set of donors.

    Args:
        state: this rank's θ, outer optimizers and residuals; written only when :meth:`run`
            succeeds (every bucket at one round), else untouched.
        transport: to reach the donors.
        bcodec: the broadcast codec the means are encoded with.
        requester: this site's id (in the donors' logs).
        streams_per_donor: concurrent transfers per donor, >= 1.
        progress_timeout_s: :meth:`run` fails when nothing was pulled or replayed this long.
        request_timeout_s: the first timeout of each request to a donor, seconds (None: 30 s;
            at most ``progress_timeout_s``): the site passes its last plan's broadcast
            deadline, how long the run's own exchange of a round may take. Each request that
            times out doubles it (up to ``progress_timeout_s``) and drops that donor for the
            run, so a stalled stream (one TCP flow in retransmission back-off at 30% loss)
            costs a short wait before the other donors take its buckets, and a slow but
            moving link gets longer requests.
        use_own: start each bucket from this site's own θ_b when the members keep every
            round since its ``bucket_round`` (False: pull every bucket).
        kept_rounds: how many closed rounds the members keep, in rounds, >= 0, as this site's
            own ``RoundConfig.history_rounds`` says (None: unknown). With it (or with
            ``use_own`` False), the buckets this site cannot start from its own θ_b (more than
            ``kept_rounds`` behind ``min_round``) go out as a first wave, one per stream, beside
            the donors' summaries instead of one round trip after them (:func:`first_wave`).
            If the members keep more than it says, those buckets are pulled whole where a
            replay would have done; a first-wave bucket that comes back older than
            ``min_round`` (its donor is a joiner itself) is dropped and pulled from another
            donor (``CatchUpStats.first_wave_dropped``); one whose donor fails or times out
            goes back on the queue, as any bucket's.
    """

    def __init__(
        self,
        state: GlobalState,
        transport: Transport,
        bcodec: Codec,
        *,
        requester: str,
        streams_per_donor: int = 2,
        progress_timeout_s: float = 120.0,
        use_own: bool = True,
        request_timeout_s: float | None = None,
        kept_rounds: int | None = None,
    ) -> None:
        if streams_per_donor < 1:
            raise ValueError(f"streams_per_donor must be >= 1, got {streams_per_donor!r}")
        if kept_rounds is not None and (
            isinstance(kept_rounds, bool) or not isinstance(kept_rounds, int) or kept_rounds < 0
        ):
            raise ValueError(f"kept_rounds must be None or an int >= 0 (rounds), got {kept_rounds!r}")
        self.kept_rounds = kept_rounds
        self.state = state
        self.transport = transport
        self.bcodec = bcodec
        self.requester = requester
        self.streams_per_donor = streams_per_donor
        self.progress_timeout_s = progress_timeout_s
        first = 30.0 if request_timeout_s is None else max(1.0, float(request_timeout_s))
        self.request_timeout_s = min(first, progress_timeout_s)  # doubled by each request that times out
        self.use_own = use_own
        self.stats = CatchUpStats()
        self._staged: dict[int, _Staged] = {}
        self._pulled: set[int] = set()
        self._pulled_again: set[int] = set()
        self._cv = threading.Condition()
        # per run
        self._queue: deque[int] = deque()
        self._avoid: dict[int, set[str]] = {}
        self._inflight: set[int] = set()
        self._tail: dict[int, str] = {}  # bucket -> donor: taken from the queue's tail, in flight
        self._early: deque[int] = deque()  # the first wave, pulled beside the donors' summaries
        self._early_taken: set[int] = set()  # first-wave buckets in flight
        self._min_round = 0
        self._missed: RoundPlan | None = None
        self._summarized = False  # the donors' summaries of this run are in
        self._live: dict[str, Member] = {}
        self._rounds: dict[str, int] = {}  # each donor's last known rounds_applied
        self._info: dict[str, HistoryInfo] = {}
        self._target = 0
        self.progress_at = 0.0
        self._stop = False
        self._cancelled = False  # run_within gave up: nothing is installed any more
        self._started_at: float | None = None  # the current run's start (eta_s)

    def eta_s(self, now: float | None = None) -> float | None:
        """Seconds until the current :meth:`run` should end, from its progress: the buckets not
        yet at the target round over the rate at which buckets got there so far; None when no
        estimate can be made yet (no run, nothing at the target, or under half a second in).
        What a site pulling state tells the rendezvous (``catch_up_eta_s``)."""
        now = time.monotonic() if now is None else now
        with self._cv:
            if self._started_at is None:
                return None
            n, target = len(self.state), self._target
            done = sum(1 for s in self._staged.values() if s.tag >= target)
            elapsed = now - self._started_at
        if n == 0 or done == 0 or elapsed < 0.5:
            return None
        return max(0.0, (n - done) * elapsed / done)

    # ------------------------------------------------------------------ driver
    def run(self, donors: Sequence[Member], *, min_round: int = 0, missed: RoundPlan | None = None) -> int:
        """Pull and replay until every bucket is at the donors' round (>= ``min_round``),
        then install it in ``state`` and return that round.

        ``missed``: the plan of round ``min_round - 1``, which this site skipped as a member
        (None: none). While every donor is behind ``min_round``, the run asks whether that
        round is void (:func:`decide_void`, on each new set of summaries); once it is, the run
        brings θ to that round instead, says why in ``stats.void``, and returns it: the caller
        passes it (``RoundEngine.void_round``).

        Raises:
            StateTransferError: every donor failed (what was pulled is kept for the next
                call), or nothing progressed for ``progress_timeout_s``.
        """
        n = len(self.state)
        with self._cv:
            self._live = {d.site_id: d for d in donors}
            self._rounds, self._info = {}, {}
            self.progress_at = time.monotonic()
            self._started_at = self.progress_at
            self._stop = False
            self._queue, self._avoid, self._tail = deque(), {}, {}
            self._summarized = False
            self._early_taken = set()
            self._min_round = min_round
            self._missed = missed
            self.stats.void = None  # decided afresh each run, from this run's summaries
            self._early = deque(
                first_wave(
                    [self.state.bucket_round[b] for b in range(n)],
                    set(self._staged),
                    min_round=min_round,
                    use_own=self.use_own,
                    kept_rounds=self.kept_rounds,
                    limit=self.streams_per_donor * len(self._live),
                )
            )
        workers = [
            threading.Thread(target=self._worker, args=(sid,), name=f"catchup-{self.requester}-{sid}-{i}", daemon=True)
            for sid in self._live
            for i in range(self.streams_per_donor)
        ]
        for w in workers:
            w.start()
        try:
            self._probe_all()  # the first wave's transfers start beside it
            with self._cv:
                if not self._live:
                    raise StateTransferError(f"every donor failed ({len(donors)} tried): no history summary")
                self._target = self._aim(min_round, max(self._rounds.values()))
                self._stage_own()
                # a first-wave bucket already pulled is advanced from there (a no-op at the target)
                self._queue = deque(b for b in range(n) if b not in self._inflight)
                self._early.clear()
                self._summarized = True
                self._cv.notify_all()
            return self._drive(min_round)
        finally:
            with self._cv:
                self._stop = True
                self._started_at = None
                self._cv.notify_all()
            for w in workers:
                w.join(timeout=5.0)

    def run_within(self, donors: Sequence[Member], *, min_round: int, limit_s: float) -> str | None:
        """:meth:`run` on a thread of its own, given up after ``limit_s`` seconds whatever it
        waits on: then it is cancelled (it installs nothing after that) and its stack goes to
        the log, so a catch-up that hangs says where. Returns None once installed, else why
        not, in words (a :class:`StateTransferError`'s message, or the time limit)."""
        why: list[str] = []

        def go() -> None:
            try:
                self.run(donors, min_round=min_round)
            except Exception as e:  # noqa: BLE001 - reported to the caller in words
                why.append(str(e) if isinstance(e, StateTransferError) else f"{type(e).__name__}: {e}")

        t = threading.Thread(target=go, name=f"catchup-{self.requester}", daemon=True)
        t.start()
        t.join(limit_s)
        if not t.is_alive():
            return why[0] if why else None
        with self._cv:
            self._cancelled = self._stop = True
            self._cv.notify_all()
        frames, mine = sys._current_frames(), f"catchup-{self.requester}"
        stacks = [
            f"thread {th.name}:\n" + "".join(traceback.format_stack(frames[th.ident]))
            for th in threading.enumerate()
            if th.name.startswith(mine) and th.ident in frames
        ]
        msg = "%s: catch-up still running after %g s; cancelled. Its threads:\n%s"
        log.warning(msg, self.requester, limit_s, "".join(stacks))
        t.join(1.0)
        return f"the catch-up did not finish within {limit_s:g} s"

    def _drive(self, min_round: int) -> int:
        while True:
            confirm: _Confirmation | None = None
            with self._cv:
                idle_since: float | None = None
                while (self._queue or self._inflight) and self._live:
                    if self._cancelled:
                        raise StateTransferError("cancelled")
                    now = time.monotonic()
                    left = self.progress_at + self.progress_timeout_s - now
                    if left <= 0:
                        raise StateTransferError(self._stuck())
                    if self._queue and not self._inflight:  # no donor takes them: ask the donors again
                        idle_since = idle_since if idle_since is not None else now
                        if now - idle_since > 0.5:
                            break
                    else:
                        idle_since = None
                    if confirm is None and not self._queue and self._inflight:
                        confirm = self._confirm_during_tail()
                    self._cv.wait(min(left, 0.1))
                if not self._live:
                    raise StateTransferError(
                        f"every donor failed ({', '.join(self.stats.donors_lost)}); {len(self._staged)} of "
                        f"{len(self.state)} buckets kept for the next try"
                    )
                self._queue.clear()
            # every bucket is at some round (or nobody took it): where are the donors now? Asked
            # while the last buckets were in flight; asked again when a pull said otherwise since
            if confirm is None or not confirm.still_holds(self):
                self._probe_all()
            with self._cv:
                if not self._live:
                    continue
                target = self._aim(min_round, max(self._rounds.get(sid, 0) for sid in self._live))
                self._target = target
                if self.stats.void is not None:  # this site's own θ is the void round's: start from it
                    self._stage_own()
                for b in [b for b, s in self._staged.items() if s.tag > target]:
                    self._drop_staged(b)  # ahead of every donor (its own θ_b): take theirs
                behind = [b for b in range(len(self.state)) if b not in self._staged or self._staged[b].tag < target]
                if not behind:
                    break
                if time.monotonic() - self.progress_at > self.progress_timeout_s:
                    raise StateTransferError(self._stuck())
                self._queue.extend(b for b in behind if b not in self._inflight)  # one stream per bucket
                self._avoid = {}
                self._cv.notify_all()
        self._install(target)
        return target

    def _aim(self, min_round: int, top: int) -> int:
        """The round this run brings θ to, the newest donor's being ``top``: at least
        ``min_round``, but the skipped round R = ``min_round - 1`` itself once it is void
        (:func:`decide_void`, asked while every donor is at R; never lower, whatever donors
        remain: this site's own θ is R's). Under ``_cv``."""
        m = self._missed
        if m is None or top >= min_round or m.round != min_round - 1:
            return max(min_round, top)
        if self.stats.void is None and top == m.round:
            void, why = decide_void(m, self.requester, self._info)
            if void:
                self.stats.void = why
                self._min_round = m.round
                log.warning("%s: round %d is void: %s", self.requester, m.round, why)
        return m.round if self.stats.void is not None else min_round

    def _stage_own(self) -> None:
        """Stage own θ_b for each unstaged bucket not past the target that :meth:`_kept_since`. Under ``_cv``."""
        for b in range(len(self.state)):
            own = self.state.bucket_round[b]
            if b not in self._staged and self.use_own and own <= self._target and self._kept_since(own):
                with self.state.lock(b):
                    self._staged[b] = _Staged(copy.deepcopy(self.state.optimizers[b]), self.state.bucket_round[b])
                self.stats.own_buckets += 1

    def _stuck(self) -> str:
        why = f"no progress for {self.progress_timeout_s:g} s at round {self._target}"
        why += f" ({len(self._queue)} bucket(s) queued, {len(self._inflight)} in flight"
        if self.stats.repulled:
            why += (
                f"; {self.stats.repulled} bucket pull(s) repeated: a bucket's transfer outlasts the rounds the "
                "members keep (RoundConfig.history_rounds / history_bytes)"
            )
        return why + ")"

    def _install(self, target: int) -> None:
        lrs_now = next((i.lrs_now for i in self._info.values() if i.rounds_applied == target), None)
        with self._cv:  # all or nothing against run_within's cancel (no worker holds a bucket lock here)
            if self._cancelled:  # run_within gave up on this run: the caller reports it behind
                raise StateTransferError("cancelled")
            for b, s in sorted(self._staged.items()):
                if lrs_now is not None and b < len(lrs_now) and lrs_now[b]:
                    for g, lr in zip(s.opt.param_groups, lrs_now[b]):
                        g["lr"] = lr
                self.state.load_bucket(b, s.theta.detach(), s.opt.state_dict(), target)
            self.state.rounds_applied = target
            self.stats.rounds = target
            self._staged = {}
        log.info(
            "%s caught up to round %d: %s bucket(s) pulled (%s), %d from its own θ, %d outer step(s) replayed, "
            "%d pulled again",
            self.requester,
            target,
            sum(self.stats.buckets_from.values()),
            ", ".join(f"{k}: {v}" for k, v in sorted(self.stats.buckets_from.items())) or "none",
            self.stats.own_buckets,
            self.stats.means_replayed,
            self.stats.repulled,
        )

    def _floor(self) -> int:
        """The oldest round a whole bucket may be of and still be replayed to the target:
        the oldest round a donor at the target keeps (the target when none keeps any)."""
        spans = [i.span[0] for sid, i in self._info.items() if self._rounds.get(sid) == self._target and i.span]
        return min(spans, default=self._target)

    def _kept_since(self, tag: int) -> bool:
        """A donor at the target round keeps every round from ``tag`` on (or none is needed)."""
        if tag >= self._target:
            return True
        return any(
            self._rounds.get(sid) == self._target and i.span is not None and i.span[0] <= tag
            for sid, i in self._info.items()
        )

    def _probe_all(self) -> None:
        """:meth:`_probe` every live donor at once: one stalled donor costs one request's
        timeout, not one per donor (a catch-up at 30% loss spent its whole window asking two
        stalled donors in turn). Each probe is bounded by its request's timeout."""
        with self._cv:
            donors = list(self._live.values())
        if donors:
            with ThreadPoolExecutor(len(donors), thread_name_prefix=f"catchup-{self.requester}-probe") as pool:
                list(pool.map(self._probe, donors))

    def _confirm_during_tail(self) -> "_Confirmation":
        """Start :meth:`_probe_all` on a thread of its own once the last bucket was asked for (the
        queue is empty, buckets are in flight): its answers come back while the last bytes do,
        instead of one round trip after them. Called under ``_cv``."""
        c = _Confirmation()

        def ask() -> None:
            try:
                self._probe_all()
            finally:
                with self._cv:
                    c.rounds = {sid: i.rounds_applied for sid, i in self._info.items()}
                    c.done.set()
                    self._cv.notify_all()

        c.thread = threading.Thread(target=ask, name=f"catchup-{self.requester}-confirm", daemon=True)
        c.thread.start()
        return c

    def _probe(self, d: Member) -> None:
        """Ask ``d`` for its round and what it keeps; a donor that fails is dropped."""
        timeout_s = self.request_timeout_s
        try:
            st = self.transport.pull_state(
                d.address, len(self.state) + 1, requester=self.requester, timeout_s=timeout_s
            )
            info = decode_history_info(st)
        except (TransportError, StateTransferError) as e:
            if isinstance(e, PeerTimeout):
                self._timed_out(timeout_s)
            self._lose(d.site_id, f"history summary: {e}")
            return
        with self._cv:
            self._info[d.site_id] = info
            # never lowered: a bucket stepped in the donor's open round came back a round ahead
            self._rounds[d.site_id] = max(self._rounds.get(d.site_id, 0), info.rounds_applied)

    def _timed_out(self, used_s: float) -> None:
        """A request ran out of its timeout ``used_s``: the next ones get twice that (up to
        ``progress_timeout_s``); requests that timed out together (a stalled donor's summary
        and first-wave transfers) double it once, not once each."""
        with self._cv:
            self.request_timeout_s = min(max(self.request_timeout_s, 2.0 * used_s), self.progress_timeout_s)

    def _lose(self, sid: str, why: str) -> None:
        with self._cv:
            self._rounds.pop(sid, None)
            self._info.pop(sid, None)
            if self._live.pop(sid, None) is not None:
                self.stats.donors_lost.append(sid)
                log.warning("%s: donor %s dropped: %s", self.requester, sid, why)
            self._cv.notify_all()

    # ------------------------------------------------------------------ workers
    def _next(self, sid: str) -> int:
        """The next bucket for this donor (blocks): first a pulled bucket that fell behind
        the newest round seen while others were being pulled (its replay keeps it within
        the rounds the members keep, however long the whole pull takes), then the next
        queued one it has not been ruled out for."""
        with self._cv:
            while True:
                if self._stop or sid not in self._live:
                    raise _Stop
                if not self._summarized:  # before the donors' summaries: only the first wave
                    if self._early:
                        b = self._early.popleft()
                        self._inflight.add(b)
                        self._early_taken.add(b)
                        return b
                    self._cv.wait(0.5)
                    continue
                mine = self._rounds.get(sid, -1)
                for b, s in self._staged.items():
                    if (
                        s.tag < min(self._target, mine)
                        and b not in self._inflight
                        and b not in self._queue
                        and sid not in self._avoid.get(b, ())
                    ):
                        self._inflight.add(b)
                        return b
                tail = len(self._queue) < len(self._live)
                takes = takes_from_queue(len(self._queue), len(self._live), sid in self._tail.values())
                for i, b in enumerate(self._queue if takes else ()):
                    s = self._staged.get(b)
                    # a donor older than what the donors at the target keep (a joiner itself)
                    # serves only the means it has; whole buckets come from the others
                    useful = mine >= self._floor() or (s is not None and s.tag < mine)
                    if useful and b not in self._inflight and sid not in self._avoid.get(b, ()):
                        del self._queue[i]
                        self._inflight.add(b)
                        if tail:
                            self._tail[b] = sid
                        if not self._queue:  # the last one: _drive asks the donors where they are now
                            self._cv.notify_all()
                        return b
                self._cv.wait(0.5)

    def _done(self, sid: str, b: int, *, requeue: bool, avoid: str | None = None) -> None:
        with self._cv:
            self._inflight.discard(b)
            self._tail.pop(b, None)
            self._early_taken.discard(b)
            if requeue:
                if avoid is not None:
                    self._avoid.setdefault(b, set()).add(avoid)
                    if set(self._live) <= self._avoid[b]:  # no donor can advance it: pull it whole
                        self._avoid[b] = set()
                        self._drop_staged(b)
                self._queue.append(b)
            self._cv.notify_all()

    def _drop_staged(self, b: int) -> None:
        if self._staged.pop(b, None) is not None:
            log.info("%s: bucket %d cannot be replayed from the kept means; pulling it again", self.requester, b)

    def _worker(self, sid: str) -> None:
        while True:
            try:
                b = self._next(sid)
            except _Stop:
                return
            d = self._live.get(sid)
            if d is None:
                self._done(sid, b, requeue=True)
                return
            timeout_s = self.request_timeout_s
            try:
                requeue, avoid = self._advance(d, b, timeout_s)
            except (PeerUnavailable, PeerTimeout) as e:
                if isinstance(e, PeerTimeout):
                    self._timed_out(timeout_s)
                self._lose(sid, str(e))
                self._done(sid, b, requeue=True)
                return
            except Exception as e:  # noqa: BLE001 - any other failure of this donor: drop it, keep the bucket
                self._lose(sid, f"{type(e).__name__}: {e}")
                self._done(sid, b, requeue=True)
                return
            self._done(sid, b, requeue=requeue, avoid=avoid)

    def _advance(self, d: Member, b: int, timeout_s: float) -> tuple[bool, str | None]:
        """Bring bucket ``b`` as far as ``d`` can: pull it whole when not staged, then replay ``d``'s
        kept means up to the target, each request within ``timeout_s``, its open round's too; ``d``
        asked where it is first where it looked behind (rounds go on while buckets are pulled:
        stopped at a stale round, a bucket went to a donor past what it kept). Returns ``(requeue, avoid)``."""
        with self._cv:
            s = self._staged.get(b)
            target = self._target
        if s is None:
            s = self._pull_bucket(d, b, timeout_s)
            if s is None:
                return True, d.site_id
        # up to d's round + 1: the mean of d's open round is waited for ("not yet"), not ruled out
        stopped = self._replay_from(d, b, s, min(target, self._rounds.get(d.site_id, 0) + 1), timeout_s)
        if stopped is None and s.tag < target:  # d looked behind the target: ask it where it is
            self._probe(d)
            with self._cv:
                if d.site_id not in self._live:
                    return True, None
                upto = min(target, self._rounds.get(d.site_id, 0) + 1)
            stopped = self._replay_from(d, b, s, upto, timeout_s)
        return stopped or (s.tag < target, (d.site_id if s.tag < target else None))

    def _replay_from(
        self, d: Member, b: int, s: _Staged, upto: int, timeout_s: float
    ) -> tuple[bool, str | None] | None:
        """Replay ``d``'s kept means on ``s`` up to round ``upto``: None once there, else what
        :meth:`_advance` returns (a mean not kept, not reproducing the owner's, or not there in time)."""
        not_yet_since: float | None = None
        while s.tag < upto:
            try:
                # a replay: "unchanged" is answered too (PeerSide._past_mean)
                m = self.transport.pull_mean(d.address, s.tag, b, requester=self.requester, timeout_s=timeout_s,
                                             have_checksum=s.sum)  # fmt: skip
            except Rejected as e:
                log.debug("%s: mean of round %d bucket %d from %s: %s", self.requester, s.tag, b, d.site_id, e)
                if e.code == RejectCode.NOT_FOUND:  # its round is open, the mean not there yet: this
                    now = time.monotonic()  # stream asks again (DECISIONS "Answering an old round's mean")
                    not_yet_since = now if not_yet_since is None else not_yet_since
                    if now - not_yet_since < timeout_s and not self._stop:
                        time.sleep(_NOT_YET_S)
                        continue
                    return True, None
                return True, d.site_id  # not kept there (or unknown): another donor, else a new copy
            if not self._replay(b, s, m, d.site_id):
                with self._cv:
                    self._drop_staged(b)
                return True, None
        return None

    def _pull_bucket(self, d: Member, b: int, timeout_s: float) -> _Staged | None:
        st = self.transport.pull_state(d.address, b, requester=self.requester, timeout_s=timeout_s)
        try:
            theta, opt_sd = self.state.decode_bucket_state(st)
        except StateTransferError as e:
            log.warning("%s: bucket %d from %s: %s", self.requester, b, d.site_id, e)
            return None
        with self._cv:
            early = b in self._early_taken
            self._early_taken.discard(b)
            if early and st.rounds_applied < self._min_round:  # asked before its summary: a joiner
                self.stats.first_wave_dropped += 1
                msg = "%s: first-wave bucket %d from %s is of round %d, before %d: dropped (that donor is behind)"
                log.info(msg, self.requester, b, d.site_id, st.rounds_applied, self._min_round)
                return None
        with self.state.lock(b):
            opt = copy.deepcopy(self.state.optimizers[b])
        with torch.no_grad():
            opt.param_groups[0]["params"][0].copy_(theta)
        opt.load_state_dict(opt_sd)
        s = _Staged(opt, st.rounds_applied)
        with self._cv:
            if b in self._pulled:
                self.stats.repulled += 1
                self._pulled_again.add(b)
            self._pulled.add(b)
            self.stats.buckets_from[d.site_id] = self.stats.buckets_from.get(d.site_id, 0) + 1
            self.stats.bytes_from[d.site_id] = (
                self.stats.bytes_from.get(d.site_id, 0) + len(st.theta) + len(st.optimizer_state)
            )
            self._staged[b] = s
            self._rounds[d.site_id] = max(self._rounds.get(d.site_id, 0), st.rounds_applied)
            self._target = max(self._target, st.rounds_applied)
            if b not in self._pulled_again:
                # a bucket's first pull is progress; pulling it again is not (with nothing kept
                # to replay, a pull that spans rounds would pull forever: it times out instead)
                self.progress_at = time.monotonic()
        return s

    def _replay(self, b: int, s: _Staged, m: BucketMean, sid: str) -> bool:
        """One outer step of round ``s.tag`` on the staged bucket; False when it does not
        reproduce the owner's checksums (the bucket is then pulled whole)."""
        if m.chunks:
            if s.sum != m.checksum_before:
                if s.sum == m.checksum_after:  # a copy read between the step and its round tag
                    s.tag += 1
                    return True
                log.info(
                    "%s: bucket %d at round %d differs from the owner's before its mean; pulling it again",
                    self.requester,
                    b,
                    s.tag,
                )
                return False
            try:
                full = decode_mean(self.bcodec, self.state.layout.buckets[b], m)
            except (CodecError, ValueError) as e:
                log.warning("%s: mean of round %d bucket %d from %s undecodable: %s", self.requester, s.tag, b, sid, e)
                return False
            info = self._info.get(sid)
            lrs = info.lrs.get(s.tag, [])[b] if info is not None and len(info.lrs.get(s.tag, [])) > b else ()
            for g, lr in zip(s.opt.param_groups, lrs):
                g["lr"] = lr
            s.theta.grad = full.to(s.theta.device)
            s.opt.step()
            s.theta.grad = None
            s.sum = checksum(s.theta)
            if s.sum != m.checksum_after:
                log.info("%s: replaying round %d of bucket %d missed the owner's checksum", self.requester, s.tag, b)
                return False
        s.tag += 1
        with self._cv:
            self.stats.means_replayed += 1
            self.progress_at = time.monotonic()
        return True
