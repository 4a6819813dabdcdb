"""The rendezvous over gRPC: a servicer for ``dtrain.rendezvous.RendezvousCore``
and the client sites use (``proto/dtrain/v1/rendezvous.proto``).

The core holds every decision (pure functions of the state and ``now``); this
module only moves requests and answers, and turns ``Ready`` into a long poll on
an asynchronous server (:mod:`dtrain.transports.grpc_server`): a waiting poll is
a future on the server's event loop, not a thread, so heartbeats never queue
behind polls. The server re-runs the quorum decision (``core.decide``) once per
change (a Ready, Join or Leave) and at least every ``tick_s`` (so a
``quorum_timeout_s`` that expires with no new call is still noticed), answers
every poll as soon as its status is not ``"wait"``, and ``"wait"`` once the
request's ``wait_ms`` ran out, capped by ``max_wait_ms`` on the server.

Security, keepalive, message limits and retries are the peer transport's
(:class:`~dtrain.transports.grpc_common.GrpcTransportConfig`): a shared token
checked by a server interceptor, TLS or mutual TLS from PEM files, and only
UNAVAILABLE retried within the call's deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import inspect
import logging
import threading
import time
from typing import Callable, Protocol, Sequence, TypeVar

import grpc

from dtrain._proto.dtrain.v1 import rendezvous_pb2 as pb
from dtrain._proto.dtrain.v1 import rendezvous_pb2_grpc as pb_grpc
from dtrain.errors import AuthenticationError, DtrainError, RendezvousError, RendezvousRefused
from dtrain.protocol import HEARTBEATS_IN_FLIGHT, HeartbeatInfo, JoinInfo, Member, ReadyDecision, RoundPlan
from dtrain.rendezvous.core import SiteIdTaken
from dtrain.transports.grpc_common import (
    ChannelPool,
    GrpcTransportConfig,
    TlsConfig,
    call_metadata,
    call_with_retry,
    check_timeout,
)
from dtrain.transports.grpc_server import AioServer, abort

__all__ = [
    "RendezvousCoreLike",
    "RendezvousServer",
    "serve_rendezvous",
    "GrpcRendezvousClient",
    "rendezvous_error",
    "plan_to_proto",
    "plan_from_proto",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Kept for compatibility: the server is asynchronous, a long poll holds no thread.
DEFAULT_NUM_SERVER_THREADS = 64
_SERVICE = pb.DESCRIPTOR.services_by_name["Rendezvous"].full_name  # "dtrain.v1.Rendezvous"
# Seconds a Ready answer leaves before the caller's deadline.
_ANSWER_MARGIN_S = 0.1
# Extra seconds a client allows on top of a long poll's wait for the answer to travel.
_READY_SLACK_S = 5.0


class RendezvousCoreLike(Protocol):
    """What the servicer needs from ``dtrain.rendezvous.RendezvousCore``."""

    def join(self, site_id: str, address: str, *, now: float, rank_addresses: Sequence[str] = ()) -> JoinInfo: ...

    def heartbeat(
        self,
        site_id: str,
        *,
        now: float,
        inner_step: int = 0,
        last_loss: float | None = None,
        round_reports: Sequence[str] = (),
        unreachable: Sequence[str] = (),
        rounds_done: int | None = None,
        catch_up_eta_s: float | None = None,
    ) -> HeartbeatInfo: ...

    def ready(self, site_id: str, round: int, *, now: float) -> ReadyDecision: ...

    def leave(self, site_id: str, *, now: float) -> None: ...

    # Optional: ``decide(*, now) -> int`` re-runs the quorum decision for the round
    # being formed and returns the next round (``RendezvousCore.decide``). Without
    # it, every waiting poll calls ``ready`` on each change and tick.


HEARTBEAT_CONNECTIONS = HEARTBEATS_IN_FLIGHT  # one per heartbeat that may be out (dtrain.protocol)


# --------------------------------------------------------------------------- conversions


def _members_to_proto(members) -> list[pb.Member]:
    return [pb.Member(site_id=m.site_id, address=m.address, rank_addresses=m.rank_addresses) for m in members]


def _members_from_proto(members) -> tuple[Member, ...]:
    return tuple(Member(site_id=m.site_id, address=m.address, rank_addresses=tuple(m.rank_addresses)) for m in members)


def plan_to_proto(plan: RoundPlan) -> pb.RoundPlan:
    return pb.RoundPlan(
        round=plan.round,
        members=_members_to_proto(plan.members),
        reduce_timeout_s=plan.reduce_timeout_s,
        broadcast_timeout_s=plan.broadcast_timeout_s,
        datagram_key=plan.datagram_key,
        left_out=list(plan.left_out),
        deadline_reason=plan.deadline_reason,
    )


def plan_from_proto(m: pb.RoundPlan) -> RoundPlan:
    return RoundPlan(
        round=m.round,
        members=_members_from_proto(m.members),
        reduce_timeout_s=m.reduce_timeout_s,
        broadcast_timeout_s=m.broadcast_timeout_s,
        datagram_key=m.datagram_key,
        left_out=tuple(m.left_out),
        deadline_reason=m.deadline_reason,
    )


def _decision_from_proto(m: pb.ReadyReply, call_s: float = 0.0) -> ReadyDecision:
    """The answer of a Ready call that took ``call_s`` seconds here: its plan's age is the
    rendezvous's figure plus the call's time not spent held there (an upper bound of the
    answer's time in flight, whatever stalled this process meanwhile)."""
    plan = None
    if m.HasField("plan"):
        plan = dataclasses.replace(plan_from_proto(m.plan), age_s=m.plan_age_s + max(0.0, call_s - m.held_s))
    return ReadyDecision(status=m.status, reason=m.reason, next_round=m.next_round, plan=plan)


# --------------------------------------------------------------------------- server


class _Poll:
    """One Ready long poll waiting on the server's loop."""

    __slots__ = ("site_id", "round", "future", "asked_at")

    def __init__(self, site_id: str, round: int, future: "asyncio.Future[ReadyDecision | None]") -> None:
        self.site_id = site_id
        self.round = round
        self.future = future
        self.asked_at = time.monotonic()  # when the core last heard this site's ready

    def answer(self, decision: ReadyDecision | None) -> None:
        if not self.future.done():
            self.future.set_result(decision)


class _RendezvousServicer:
    """The Rendezvous service on an asyncio server. Core calls are short (under
    the core's lock) and run on the loop; a waiting Ready long poll is a future,
    no thread. One evaluator task re-runs the quorum decision once per change or
    tick (not once per waiting poll) and answers the polls it settles."""

    def __init__(self, core: RendezvousCoreLike, tick_s: float, server: AioServer) -> None:
        self._core = core
        self._tick_s = tick_s
        self._server = server
        self._cfg = server.config
        self._polls: dict[str, list[_Poll]] = {}
        self._dirty: set[str] = set()  # sites whose polls must be re-evaluated on their own
        self._kick: asyncio.Event | None = None
        self._seen_round = -1  # the highest next_round any answer carried
        self._answered_round = -1  # polls of rounds below it were answered
        self._need_decide = True
        self._decided_at = 0.0
        self._plan_bytes: dict[int, tuple[RoundPlan, bytes]] = {}  # round -> (plan, its serialized field)
        self._evaluator: asyncio.Task | None = None
        # A core (or store) whose heartbeat takes no ``unreachable`` reports (an older one)
        # still gets every heartbeat: the reports are left out for it.
        self._takes_unreachable = "unreachable" in inspect.signature(core.heartbeat).parameters
        self._takes_rounds_done = "rounds_done" in inspect.signature(core.heartbeat).parameters
        self._takes_catch_up = "catch_up_eta_s" in inspect.signature(core.heartbeat).parameters
        self._decide = getattr(core, "decide", None)  # RendezvousCore.decide; absent: evaluate every poll
        # A core whose calls wait on the network (``blocking = True``: the etcd store) runs them
        # on threads; the in-memory core's calls are short and run on the loop.
        self._blocking = bool(getattr(core, "blocking", False))
        # A remote store counts a ready only while its site keeps asking (it renews it):
        # the polls waiting here ask the core again this often on the site's behalf.
        rv_config = getattr(core, "config", None)
        self._renew_s = getattr(rv_config, "heartbeat_interval_s", 1.0)

    def register(self, server: grpc.aio.Server) -> list[str]:
        def unary(fn, request_type, reply_type):
            serialize = reply_type.SerializeToString if reply_type is not None else None
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=request_type.FromString, response_serializer=serialize
            )

        handlers = {
            "Join": unary(self.Join, pb.JoinRequest, pb.JoinReply),
            "Heartbeat": unary(self.Heartbeat, pb.HeartbeatRequest, pb.HeartbeatReply),
            "Ready": unary(self.Ready, pb.ReadyRequest, None),  # answers pre-serialized bytes
            "Leave": unary(self.Leave, pb.LeaveRequest, pb.LeaveReply),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
        return [_SERVICE]

    def _reply(self, d: ReadyDecision, held_s: float = 0.0) -> bytes:
        """``d`` as ReadyReply bytes. A plan is serialized once per round, not once
        per site: with 1,000 members that is most of the cost of an answer. ``held_s``:
        how long this call was held (the client subtracts it from the call's time to
        bound the answer's time in flight, which ages the plan)."""
        head = pb.ReadyReply(
            status=d.status,
            reason=d.reason,
            next_round=d.next_round,
            plan_age_s=d.plan.age_s if d.plan is not None else 0.0,
            held_s=held_s,
        ).SerializeToString()
        if d.plan is None:
            return head
        cached = self._plan_bytes.get(d.plan.round)
        if cached is None or not (cached[0] is d.plan or cached[0] == d.plan):
            cached = (d.plan, pb.ReadyReply(plan=plan_to_proto(d.plan)).SerializeToString())
            self._plan_bytes[d.plan.round] = cached
            for r in [r for r in self._plan_bytes if r < d.plan.round - 4]:
                del self._plan_bytes[r]
        return head + cached[1]  # concatenated messages merge: the plan field is appended

    def _call(self, what: str, fn: Callable[[], T]) -> tuple[T | None, tuple[str, str] | None]:
        """Run a core call; a taken site id becomes ALREADY_EXISTS, another refusal
        FAILED_PRECONDITION, bad input INVALID_ARGUMENT, anything else INTERNAL (logged)."""
        try:
            return fn(), None
        except SiteIdTaken as e:  # its own code, so that the client knows it by type, not by text
            log.info("rendezvous %s refused: %s", what, e)
            return None, ("ALREADY_EXISTS", str(e))
        except DtrainError as e:
            log.info("rendezvous %s refused: %s", what, e)
            return None, ("FAILED_PRECONDITION", str(e))
        except ValueError as e:
            return None, ("INVALID_ARGUMENT", str(e))
        except Exception as e:
            log.exception("rendezvous %s failed", what)
            return None, ("INTERNAL", f"{type(e).__name__}: {e}")

    async def _guard(self, context, what: str, fn: Callable[[], T]) -> T:
        if self._blocking:  # a store over the network (etcd): its calls must not stall the loop
            result, err = await asyncio.to_thread(self._call, what, fn)
        else:
            result, err = self._call(what, fn)
        if err is not None:
            await abort(context, *err)
        return result  # type: ignore[return-value]

    def _touch(self, site_id: str) -> None:
        """Re-evaluate ``site_id``'s waiting polls (its standing changed) and the quorum."""
        if site_id in self._polls:
            self._dirty.add(site_id)
        self._need_decide = True
        self._wake()

    def _wake(self) -> None:
        if self._kick is not None:
            self._kick.set()

    async def Join(self, request, context):
        info = await self._guard(
            context,
            "join",
            lambda: self._core.join(
                request.site_id, request.address, now=time.monotonic(), rank_addresses=tuple(request.rank_addresses)
            ),
        )
        self._touch(request.site_id)
        return pb.JoinReply(
            next_round=info.next_round,
            members=_members_to_proto(info.members),
            heartbeat_interval_s=info.heartbeat_interval_s,
            needs_state=info.needs_state,
        )

    async def Heartbeat(self, request, context):
        last_loss = request.last_loss if request.HasField("last_loss") else None
        info = await self._guard(
            context,
            "heartbeat",
            lambda: self._core.heartbeat(
                request.site_id,
                now=time.monotonic(),
                inner_step=request.inner_step,
                last_loss=last_loss,
                round_reports=list(request.round_reports),
                **(
                    {"unreachable": list(request.unreachable)}
                    if request.unreachable and self._takes_unreachable
                    else {}
                ),
                **(
                    {"rounds_done": request.rounds_done}
                    if request.HasField("rounds_done") and self._takes_rounds_done
                    else {}
                ),
                **(
                    {"catch_up_eta_s": request.catch_up_eta_s}
                    if request.HasField("catch_up_eta_s") and self._takes_catch_up
                    else {}
                ),
            ),
        )
        # A heartbeat never makes a site live (a late one marks it for resync), so it
        # cannot complete a quorum; it only changes the answer of the site's own polls.
        if info.resync_required or not info.known:
            self._touch(request.site_id)
        return pb.HeartbeatReply(
            known=info.known,
            resync_required=info.resync_required,
            next_round=info.next_round,
            reason=info.reason,
            dead=list(info.dead),
            behind=list(info.behind),
        )

    async def Leave(self, request, context):
        await self._guard(context, "leave", lambda: self._core.leave(request.site_id, now=time.monotonic()))
        self._touch(request.site_id)
        return pb.LeaveReply()

    def _wait_s(self, wait_ms: int, context) -> float:
        """The request's wait, capped by ``max_wait_ms`` and the call's deadline."""
        wait_s = min(wait_ms, self._cfg.max_wait_ms) / 1000.0
        remaining = context.time_remaining()
        if remaining is not None:
            wait_s = min(wait_s, remaining - min(_ANSWER_MARGIN_S, 0.1 * remaining))
        return max(0.0, wait_s)

    async def Ready(self, request, context):
        site_id, rnd = request.site_id, request.round
        t0 = time.monotonic()
        wait_s = self._wait_s(request.wait_ms, context)
        decision = await self._guard(context, "ready", lambda: self._core.ready(site_id, rnd, now=time.monotonic()))
        if decision.next_round > self._seen_round:  # this call formed a plan that other polls wait for
            self._seen_round = decision.next_round
            self._wake()
        if decision.status != "wait" or wait_s <= 0:
            return self._reply(decision, time.monotonic() - t0)
        poll = self._add_poll(site_id, rnd)
        try:
            got = await asyncio.wait_for(asyncio.shield(poll.future), wait_s)
        except asyncio.TimeoutError:
            got = None
        finally:
            self._remove_poll(poll)
        if got is None:  # the wait ran out, or a newer poll of this site superseded this one
            got = await self._guard(context, "ready", lambda: self._core.ready(site_id, rnd, now=time.monotonic()))
        return self._reply(got, time.monotonic() - t0)

    def _add_poll(self, site_id: str, rnd: int) -> _Poll:
        self._start_evaluator()
        polls = self._polls.setdefault(site_id, [])
        while len(polls) >= self._cfg.max_streams_per_sender:
            old = polls.pop(0)
            log.info("rendezvous: a newer Ready of %s supersedes an older one (max_streams_per_sender)", site_id)
            old.answer(None)
        poll = _Poll(site_id, rnd, asyncio.get_running_loop().create_future())
        polls.append(poll)
        return poll

    def _remove_poll(self, poll: _Poll) -> None:
        polls = self._polls.get(poll.site_id)
        if polls is not None and poll in polls:
            polls.remove(poll)
            if not polls:
                del self._polls[poll.site_id]

    def _start_evaluator(self) -> None:
        if self._evaluator is None:
            self._kick = asyncio.Event()
            self._evaluator = asyncio.get_running_loop().create_task(self._evaluate_forever())

    async def _evaluate_forever(self) -> None:
        assert self._kick is not None
        while True:
            try:
                await asyncio.wait_for(self._kick.wait(), self._tick_s)
            except asyncio.TimeoutError:
                pass
            self._kick.clear()
            try:
                now = time.monotonic()
                if self._blocking:
                    if self._decide is not None and self._polls and self._decide_due(now):
                        self._decided(now, await asyncio.to_thread(self._decide, now=now))
                    targets = self._targets()
                    for poll, d in await asyncio.to_thread(self._settle, targets, now):
                        poll.answer(d)
                else:
                    self._evaluate(now)
            except Exception:
                log.exception("rendezvous: evaluating the waiting Ready polls failed")

    def _decide_due(self, now: float) -> bool:
        return self._need_decide or now - self._decided_at >= self._tick_s

    def _decided(self, now: float, next_round: int) -> None:
        self._seen_round = max(self._seen_round, next_round)
        self._need_decide, self._decided_at = False, now

    def _targets(self) -> list[_Poll]:
        """The waiting polls whose answer may have changed (all of them without ``decide``)."""
        if not self._polls:
            targets = []
        elif self._decide is None:
            targets = [p for ps in self._polls.values() for p in ps]
        else:
            targets = [p for s in self._dirty for p in self._polls.get(s, ())]
            if self._seen_round > self._answered_round:
                self._answered_round = self._seen_round
                targets += [p for ps in self._polls.values() for p in ps if p.round < self._seen_round]
        if self._blocking:  # renew the readies of polls the core has not heard for a while
            now = time.monotonic()
            chosen = {id(p) for p in targets}
            targets += [
                p
                for ps in self._polls.values()
                for p in ps
                if id(p) not in chosen and now - p.asked_at >= self._renew_s
            ]
        self._dirty.clear()
        return targets

    def _settle(self, targets: list[_Poll], now: float) -> list[tuple[_Poll, ReadyDecision | None]]:
        """The answers of ``targets`` that are no longer "wait" (None: an error, which makes
        the handler ask once more and report it)."""
        out = []
        for poll in targets:
            if poll.future.done():
                continue
            poll.asked_at = time.monotonic()
            d, err = self._call("ready", lambda: self._core.ready(poll.site_id, poll.round, now=now))
            if err is not None or d.status != "wait":
                out.append((poll, d))
        return out

    def _evaluate(self, now: float) -> None:
        """Re-run the quorum decision (at most once; none when only a Ready that
        decided itself woke us) and answer the polls it settled."""
        if not self._polls:
            self._dirty.clear()
            return
        if self._decide is not None and self._decide_due(now):
            self._decided(now, self._decide(now=now))
        for poll, d in self._settle(self._targets(), now):
            poll.answer(d)

    async def close(self) -> None:
        if self._evaluator is not None:
            self._evaluator.cancel()
        for ps in list(self._polls.values()):
            for p in ps:
                p.answer(None)


class RendezvousServer:
    """A running rendezvous gRPC server (from :func:`serve_rendezvous`).

    Attributes:
        address: ``host:port`` sites dial.
    """

    def __init__(self, server: AioServer, address: str) -> None:
        self._server = server
        self.address = address
        self._lock = threading.Lock()
        self._stopped = False

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving; in-flight calls (long polls included) get ``grace_s`` seconds."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._server.stop(grace_s)

    def __enter__(self) -> "RendezvousServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop(0)


def serve_rendezvous(
    core: RendezvousCoreLike, config: GrpcTransportConfig | None = None, *, tick_s: float = 0.1
) -> RendezvousServer:
    """Serve ``core`` over gRPC, standalone or embedded in a worker process.

    The server is asynchronous (:mod:`dtrain.transports.grpc_server`): a Ready
    long poll holds no thread, so heartbeats are answered whatever the number of
    polls. It serves ``grpc.health.v1.Health`` too.

    Args:
        core: the membership/quorum state (``dtrain.rendezvous.RendezvousCore``).
        config: bind address, token, TLS, keepalive, message limits, and the
            server's limits: ``max_wait_ms`` caps a Ready's wait (the site asks
            again), ``max_streams_per_sender`` the long polls per site id (a newer
            one supersedes the oldest), ``max_concurrent_rpcs`` all calls
            (RESOURCE_EXHAUSTED past it; keep it above twice the number of sites).
            ``num_server_threads`` is unused. Default: 127.0.0.1, port 0.
        tick_s: the longest the server goes without re-evaluating the quorum
            with a fresh ``now`` while polls wait (seconds, in (0, 5]), so that a
            ``quorum_timeout_s`` that expires with no new call is still noticed.

    Raises:
        BindError: the port cannot be bound (an ``OSError``).
        ValueError: ``tick_s`` out of range.
    """
    if not 0.0 < tick_s <= 5.0:
        raise ValueError(f"tick_s must be in (0, 5], got {tick_s!r}")
    cfg = config or GrpcTransportConfig()
    server = AioServer(cfg, "rendezvous")
    servicer = _RendezvousServicer(core, tick_s, server)
    server.on_stop(servicer.close)
    server.start(servicer.register)
    address = f"{cfg.advertised_host()}:{server.port}"
    log.info("rendezvous listening on %s (tls=%s)", address, cfg.tls is not None)
    return RendezvousServer(server, address)


# --------------------------------------------------------------------------- client


def rendezvous_error(code: grpc.StatusCode, details: str, what: str) -> RendezvousError:
    """The dtrain error of a rendezvous call that failed with gRPC status ``code``,
    classified by the code alone (the details only go into the message):

    | code | error | retried by the site |
    |---|---|---|
    | UNAUTHENTICATED | :class:`~dtrain.errors.AuthenticationError` (wrong or missing token) | never: fatal |
    | ALREADY_EXISTS | :class:`~dtrain.rendezvous.store.SiteIdTaken` (a live site holds the id) | never: fatal |
    | FAILED_PRECONDITION, INVALID_ARGUMENT, PERMISSION_DENIED | :class:`~dtrain.errors.RendezvousRefused` (an answer) | with backoff, not on another front-end |
    | any other (UNAVAILABLE, DEADLINE_EXCEEDED, ...) | :class:`~dtrain.errors.RendezvousError` (no answer) | with backoff, and on the next front-end |
    """
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"{what} refused this site's token ({code.name}: {details})")
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return SiteIdTaken(f"{what} refused: {details}")
    if code in (
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
    ):
        return RendezvousRefused(code.name, f"{what} refused: {code.name}: {details}")
    return RendezvousError(f"{what} failed: {code.name}: {details}")


class GrpcRendezvousClient:
    """A site's client of the rendezvous service.

    Every call has a deadline (``rpc_timeout_s``; for ``ready``, its wait plus a
    slack) and retries UNAVAILABLE within it. Any failure to get an answer
    (unreachable, deadline passed, or a refusal) raises a
    :class:`~dtrain.errors.RendezvousError` of the type its gRPC code gives
    (:func:`rendezvous_error`): the worker keeps training and retries with backoff,
    except after a :class:`~dtrain.errors.PermanentError` (a wrong token, a taken
    site id), which it raises at once.

    Args:
        address: ``host:port`` of the rendezvous.
        config: token, TLS, keepalive, message limits and retry policy
            (the server-side fields are ignored). Default plaintext.
        token: overrides ``config.token`` when given.
        tls: overrides ``config.tls`` when given.
        rpc_timeout_s: deadline of join / heartbeat / leave, seconds.
        hedge_ready: send each ``ready`` long poll twice at once, over two TCP
            connections, and take the first answer (the rendezvous treats a site's
            repeated Ready of one round as one). On a lossy link a lost segment of the
            plan's reply (or of the request) stalls its connection for a TCP
            retransmission timeout, 0.2-0.6 s at 80 ms RTT, and that site starts the
            round late, which every other site then waits for; two connections stall
            together with the square of the probability (docs/DECISIONS.md, "Datagram
            data path: scheduling a round"). A connection whose last call has not returned
            (stalled) gets no new one until it does. False: one connection.
    """

    def __init__(
        self,
        address: str,
        *,
        config: GrpcTransportConfig | None = None,
        token: str | None = None,
        tls: TlsConfig | None = None,
        rpc_timeout_s: float = 5.0,
        hedge_ready: bool = True,
    ) -> None:
        cfg = config or GrpcTransportConfig()
        if token is not None:
            cfg = dataclasses.replace(cfg, token=token)
        if tls is not None:
            cfg = dataclasses.replace(cfg, tls=tls)
        self.address = address
        self.config = cfg
        self.rpc_timeout_s = check_timeout(rpc_timeout_s)
        self._metadata = call_metadata(cfg)
        one = dataclasses.replace(cfg, num_channels_per_peer=1)
        self._pool: ChannelPool[pb_grpc.RendezvousStub] = ChannelPool(one, pb_grpc.RendezvousStub)
        # Heartbeats get TCP connections of their own (HEARTBEAT_CONNECTIONS), each call on
        # the one with the fewest calls out: a connection stalled in TCP retransmission or
        # reconnect back-off on a lossy link (a Ready long poll's, or a heartbeat's) must not
        # silence the site's liveness; connections stall independently (the Group sends the
        # next heartbeat while one is still out).
        self._heartbeat_pools: list[ChannelPool[pb_grpc.RendezvousStub]] = [
            ChannelPool(one, pb_grpc.RendezvousStub) for _ in range(HEARTBEAT_CONNECTIONS)
        ]
        self._heartbeat_out = [0] * HEARTBEAT_CONNECTIONS
        self._heartbeat_lock = threading.Lock()
        # the second Ready of each poll: a third connection, and threads for the two blocking calls
        # (a call whose twin answered first runs on until its own answer, at most its wait)
        self._hedge_pool: ChannelPool[pb_grpc.RendezvousStub] | None = None
        self._hedge_exec: cf.ThreadPoolExecutor | None = None
        if hedge_ready:
            self._hedge_pool = ChannelPool(one, pb_grpc.RendezvousStub)
            self._hedge_exec = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="rendezvous-ready")
        # each connection's latest Ready call: a connection whose call is still out (stalled, or
        # the loser of the last pair) gets no new one, so stalled calls never pile up
        self._ready_calls: list[cf.Future | None] = [None, None]

    def _call(
        self,
        what: str,
        timeout_s: float,
        fn: Callable[[pb_grpc.RendezvousStub, float], T],
        pool: "ChannelPool[pb_grpc.RendezvousStub] | None" = None,
    ) -> T:
        pool = pool or self._pool
        try:
            return call_with_retry(
                lambda remaining: fn(pool.stub(self.address), remaining),
                timeout_s=timeout_s,
                cfg=self.config,
                what=f"rendezvous {what}",
            )
        except grpc.RpcError as e:
            raise rendezvous_error(e.code(), e.details() or "", f"rendezvous {what} at {self.address}") from None
        except DtrainError as e:  # the pool is closed
            raise RendezvousError(f"rendezvous {what}: {e}") from None

    def join(self, site_id: str, address: str, rank_addresses: Sequence[str] = ()) -> JoinInfo:
        """Register ``site_id`` serving its Peer service at ``address`` (and, for a
        site group, every rank's Peer address in ``rank_addresses``)."""
        reply = self._call(
            "join",
            self.rpc_timeout_s,
            lambda stub, t: stub.Join(
                pb.JoinRequest(site_id=site_id, address=address, rank_addresses=list(rank_addresses)),
                timeout=t,
                metadata=self._metadata,
            ),
        )
        return JoinInfo(
            next_round=reply.next_round,
            members=_members_from_proto(reply.members),
            heartbeat_interval_s=reply.heartbeat_interval_s,
            needs_state=reply.needs_state,
        )

    def heartbeat(
        self,
        site_id: str,
        inner_step: int = 0,
        last_loss: float | None = None,
        round_reports: Sequence[str] = (),
        unreachable: Sequence[str] = (),
        rounds_done: int | None = None,
        catch_up_eta_s: float | None = None,
    ) -> HeartbeatInfo:
        """Report liveness (and progress, per-round JSON reports for the status
        page: ``dtrain.status``, the sites this site's data path found
        unreachable, how many rounds it finished, and when a state pull it is in
        should end); the answer says whether to resync or re-join."""
        request = pb.HeartbeatRequest(
            site_id=site_id,
            inner_step=inner_step,
            round_reports=list(round_reports),
            unreachable=list(unreachable),
        )
        if rounds_done is not None:
            request.rounds_done = max(0, int(rounds_done))
        if catch_up_eta_s is not None:
            request.catch_up_eta_s = float(catch_up_eta_s)
        if last_loss is not None:
            request.last_loss = last_loss
        with self._heartbeat_lock:
            i = min(range(HEARTBEAT_CONNECTIONS), key=lambda k: self._heartbeat_out[k])
            self._heartbeat_out[i] += 1
        try:
            reply = self._call(
                "heartbeat",
                self.rpc_timeout_s,
                lambda stub, t: stub.Heartbeat(request, timeout=t, metadata=self._metadata),
                self._heartbeat_pools[i],
            )
        finally:
            with self._heartbeat_lock:
                self._heartbeat_out[i] -= 1
        return HeartbeatInfo(
            known=reply.known,
            resync_required=reply.resync_required,
            next_round=reply.next_round,
            reason=reply.reason,
            dead=tuple(reply.dead),
            behind=tuple(reply.behind),
        )

    def ready(self, site_id: str, round: int, timeout_s: float) -> ReadyDecision:
        """Ask to take part in ``round``, waiting up to ``timeout_s`` for a decision.

        Returns the decision: ``"plan"``, ``"missed"``, or ``"wait"`` when none was
        reached within ``timeout_s`` (ask again). Raises ``RendezvousError`` when the
        rendezvous cannot be reached or does not answer within ``timeout_s`` + 5 s.
        """
        wait_ms = int(check_timeout(timeout_s) * 1000)
        request = pb.ReadyRequest(site_id=site_id, round=round, wait_ms=wait_ms)

        def poll(pool: "ChannelPool[pb_grpc.RendezvousStub]") -> ReadyDecision:
            t0 = time.monotonic()
            reply = self._call(
                "ready",
                timeout_s + _READY_SLACK_S,
                lambda stub, t: stub.Ready(request, timeout=t, metadata=self._metadata),
                pool,
            )
            return _decision_from_proto(reply, time.monotonic() - t0)

        if self._hedge_pool is None or self._hedge_exec is None:
            return poll(self._pool)
        out = [f for f in self._ready_calls if f is not None and not f.done()]
        if len(out) == 2:  # both connections still busy with earlier calls: wait for one (at most its deadline)
            cf.wait(out, timeout=timeout_s + _READY_SLACK_S, return_when=cf.FIRST_COMPLETED)
        calls = []
        try:
            for i, p in enumerate((self._pool, self._hedge_pool)):
                last = self._ready_calls[i]
                if last is None or last.done():
                    self._ready_calls[i] = self._hedge_exec.submit(poll, p)
                    calls.append(self._ready_calls[i])
        except RuntimeError:  # the executor is shut down: the client is closed
            raise RendezvousError("rendezvous ready: the client is closed") from None
        if not calls:
            raise RendezvousError(f"rendezvous ready at {self.address}: both connections stalled past the deadline")
        failure: RendezvousError | None = None
        for done in cf.as_completed(calls):
            try:
                return done.result()
            except RendezvousError as e:  # the other call may still answer
                failure = failure or e
        assert failure is not None
        raise failure

    def leave(self, site_id: str) -> None:
        """Leave the group on purpose."""
        self._call(
            "leave",
            self.rpc_timeout_s,
            lambda stub, t: stub.Leave(pb.LeaveRequest(site_id=site_id), timeout=t, metadata=self._metadata),
        )

    def close(self) -> None:
        """Close the channels; later calls raise ``RendezvousError``."""
        self._pool.close()
        for pool in self._heartbeat_pools:
            pool.close()
        if self._hedge_pool is not None and self._hedge_exec is not None:
            self._hedge_pool.close()
            self._hedge_exec.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "GrpcRendezvousClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
