"""The rendezvous over gRPC: a servicer for ``dtrain.rendezvous.RendezvousCore``
and the client sites use (``proto/dtrain/v1/rendezvous.proto``).

The core holds every decision (pure functions of the state and ``now``); this
module only moves requests and answers, and turns ``Ready`` into a long poll:
the server re-evaluates ``core.ready(now=time.monotonic())`` whenever the core
reports a change and at least every ``tick_s`` (so a ``quorum_timeout_s`` that
expires with no new call is still noticed), and answers as soon as the status is
not ``"wait"``, or ``"wait"`` once the request's ``wait_ms`` ran out.

Security, keepalive, message limits and retries are the peer transport's
(:class:`~dtrain.transports.grpc_common.GrpcTransportConfig`): a shared token
checked by a server interceptor, TLS or mutual TLS from PEM files, and only
UNAVAILABLE retried within the call's deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Protocol, Sequence, TypeVar

import grpc

from dtrain._proto.dtrain.v1 import rendezvous_pb2 as pb
from dtrain._proto.dtrain.v1 import rendezvous_pb2_grpc as pb_grpc
from dtrain.errors import DtrainError, RendezvousError
from dtrain.protocol import HeartbeatInfo, JoinInfo, Member, ReadyDecision, RoundPlan
from dtrain.transports.grpc_common import (
    ChannelPool,
    GrpcTransportConfig,
    ServerHandle,
    TlsConfig,
    abort_with,
    call_metadata,
    call_with_retry,
    check_timeout,
    start_server,
)

__all__ = [
    "RendezvousCoreLike",
    "RendezvousServer",
    "serve_rendezvous",
    "GrpcRendezvousClient",
    "plan_to_proto",
    "plan_from_proto",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Server threads by default: every long-polling Ready holds one for up to wait_ms.
DEFAULT_NUM_SERVER_THREADS = 64
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
    ) -> HeartbeatInfo: ...

    def ready(self, site_id: str, round: int, *, now: float) -> ReadyDecision: ...

    def leave(self, site_id: str, *, now: float) -> None: ...

    def wait_for_change(self, timeout_s: float) -> None: ...


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
    )


def plan_from_proto(m: pb.RoundPlan) -> RoundPlan:
    return RoundPlan(
        round=m.round,
        members=_members_from_proto(m.members),
        reduce_timeout_s=m.reduce_timeout_s,
        broadcast_timeout_s=m.broadcast_timeout_s,
    )


def _decision_to_proto(d: ReadyDecision) -> pb.ReadyReply:
    reply = pb.ReadyReply(status=d.status, reason=d.reason, next_round=d.next_round)
    if d.plan is not None:
        reply.plan.CopyFrom(plan_to_proto(d.plan))
    return reply


def _decision_from_proto(m: pb.ReadyReply) -> ReadyDecision:
    return ReadyDecision(
        status=m.status,
        reason=m.reason,
        next_round=m.next_round,
        plan=plan_from_proto(m.plan) if m.HasField("plan") else None,
    )


# --------------------------------------------------------------------------- server


class _RendezvousServicer(pb_grpc.RendezvousServicer):
    def __init__(self, core: RendezvousCoreLike, tick_s: float) -> None:
        self._core = core
        self._tick_s = tick_s

    def _guard(self, context, what: str, fn: Callable[[], T]) -> T:
        """Run a core call; a refusal becomes FAILED_PRECONDITION, bad input
        INVALID_ARGUMENT, anything else INTERNAL (logged)."""
        try:
            return fn()
        except DtrainError as e:
            log.info("rendezvous %s refused: %s", what, e)
            err = ("FAILED_PRECONDITION", str(e))
        except ValueError as e:
            err = ("INVALID_ARGUMENT", str(e))
        except Exception as e:
            log.exception("rendezvous %s failed", what)
            err = ("INTERNAL", f"{type(e).__name__}: {e}")
        abort_with(context, *err)
        raise AssertionError("unreachable")  # context.abort raises

    def Join(self, request, context):
        info = self._guard(
            context,
            "join",
            lambda: self._core.join(
                request.site_id, request.address, now=time.monotonic(), rank_addresses=tuple(request.rank_addresses)
            ),
        )
        return pb.JoinReply(
            next_round=info.next_round,
            members=_members_to_proto(info.members),
            heartbeat_interval_s=info.heartbeat_interval_s,
            needs_state=info.needs_state,
        )

    def Heartbeat(self, request, context):
        last_loss = request.last_loss if request.HasField("last_loss") else None
        info = self._guard(
            context,
            "heartbeat",
            lambda: self._core.heartbeat(
                request.site_id,
                now=time.monotonic(),
                inner_step=request.inner_step,
                last_loss=last_loss,
                round_reports=list(request.round_reports),
            ),
        )
        return pb.HeartbeatReply(
            known=info.known,
            resync_required=info.resync_required,
            next_round=info.next_round,
            reason=info.reason,
            dead=list(info.dead),
        )

    def Ready(self, request, context):
        start = time.monotonic()
        wait_s = request.wait_ms / 1000.0
        remaining = context.time_remaining()
        if remaining is not None:
            wait_s = min(wait_s, remaining - min(_ANSWER_MARGIN_S, 0.1 * remaining))
        deadline = start + max(0.0, wait_s)
        while True:
            decision = self._guard(
                context, "ready", lambda: self._core.ready(request.site_id, request.round, now=time.monotonic())
            )
            left = deadline - time.monotonic()
            if decision.status != "wait" or left <= 0 or not context.is_active():
                return _decision_to_proto(decision)
            self._core.wait_for_change(min(left, self._tick_s))

    def Leave(self, request, context):
        self._guard(context, "leave", lambda: self._core.leave(request.site_id, now=time.monotonic()))
        return pb.LeaveReply()


class RendezvousServer:
    """A running rendezvous gRPC server (from :func:`serve_rendezvous`).

    Attributes:
        address: ``host:port`` sites dial.
    """

    def __init__(self, server: ServerHandle, address: str) -> None:
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

    Args:
        core: the membership/quorum state (``dtrain.rendezvous.RendezvousCore``).
        config: bind address, token, TLS, keepalive, message limits. Its
            ``num_server_threads`` bounds how many calls run at once: every site
            long-polling ``Ready`` holds a thread, so use more threads than sites.
            Default: 127.0.0.1, port 0, 64 threads.
        tick_s: the longest a long poll sleeps before re-evaluating
            ``core.ready`` with a fresh ``now`` (seconds, in (0, 5]).

    Raises:
        OSError: the port cannot be bound.
        ValueError: ``tick_s`` out of range.
    """
    if not 0.0 < tick_s <= 5.0:
        raise ValueError(f"tick_s must be in (0, 5], got {tick_s!r}")
    cfg = config or GrpcTransportConfig(num_server_threads=DEFAULT_NUM_SERVER_THREADS)
    servicer = _RendezvousServicer(core, tick_s)
    server = start_server(cfg, lambda s: pb_grpc.add_RendezvousServicer_to_server(servicer, s), name="rendezvous")
    address = f"{cfg.advertised_host()}:{server.port}"
    log.info("rendezvous listening on %s (tls=%s)", address, cfg.tls is not None)
    return RendezvousServer(server, address)


# --------------------------------------------------------------------------- client


class GrpcRendezvousClient:
    """A site's client of the rendezvous service.

    Every call has a deadline (``rpc_timeout_s``; for ``ready``, its wait plus a
    slack) and retries UNAVAILABLE within it. Any failure to get an answer
    (unreachable, deadline passed, or a refusal) raises
    :class:`~dtrain.errors.RendezvousError`, whose message names the gRPC code;
    the worker keeps training and retries with backoff.

    Args:
        address: ``host:port`` of the rendezvous.
        config: token, TLS, keepalive, message limits and retry policy
            (the server-side fields are ignored). Default plaintext.
        token: overrides ``config.token`` when given.
        tls: overrides ``config.tls`` when given.
        rpc_timeout_s: deadline of join / heartbeat / leave, seconds.
    """

    def __init__(
        self,
        address: str,
        *,
        config: GrpcTransportConfig | None = None,
        token: str | None = None,
        tls: TlsConfig | None = None,
        rpc_timeout_s: float = 5.0,
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
        self._pool: ChannelPool[pb_grpc.RendezvousStub] = ChannelPool(
            dataclasses.replace(cfg, num_channels_per_peer=1), pb_grpc.RendezvousStub
        )

    def _call(self, what: str, timeout_s: float, fn: Callable[[pb_grpc.RendezvousStub, float], T]) -> T:
        try:
            return call_with_retry(
                lambda remaining: fn(self._pool.stub(self.address), remaining),
                timeout_s=timeout_s,
                cfg=self.config,
                what=f"rendezvous {what}",
            )
        except grpc.RpcError as e:
            raise RendezvousError(
                f"rendezvous {what} at {self.address} failed: {e.code().name}: {e.details()}"
            ) from None
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
        self, site_id: str, inner_step: int = 0, last_loss: float | None = None, round_reports: Sequence[str] = ()
    ) -> HeartbeatInfo:
        """Report liveness (and progress, and per-round JSON reports for the status
        page: ``dtrain.status``); the answer says whether to resync or re-join."""
        request = pb.HeartbeatRequest(site_id=site_id, inner_step=inner_step, round_reports=list(round_reports))
        if last_loss is not None:
            request.last_loss = last_loss
        reply = self._call(
            "heartbeat", self.rpc_timeout_s, lambda stub, t: stub.Heartbeat(request, timeout=t, metadata=self._metadata)
        )
        return HeartbeatInfo(
            known=reply.known,
            resync_required=reply.resync_required,
            next_round=reply.next_round,
            reason=reply.reason,
            dead=tuple(reply.dead),
        )

    def ready(self, site_id: str, round: int, timeout_s: float) -> ReadyDecision:
        """Ask to take part in ``round``, waiting up to ``timeout_s`` for a decision.

        Returns the decision: ``"plan"``, ``"missed"``, or ``"wait"`` when none was
        reached within ``timeout_s`` (ask again). Raises ``RendezvousError`` when the
        rendezvous cannot be reached or does not answer within ``timeout_s`` + 5 s.
        """
        wait_ms = int(check_timeout(timeout_s) * 1000)
        request = pb.ReadyRequest(site_id=site_id, round=round, wait_ms=wait_ms)
        reply = self._call(
            "ready",
            timeout_s + _READY_SLACK_S,
            lambda stub, t: stub.Ready(request, timeout=t, metadata=self._metadata),
        )
        return _decision_from_proto(reply)

    def leave(self, site_id: str) -> None:
        """Leave the group on purpose."""
        self._call(
            "leave",
            self.rpc_timeout_s,
            lambda stub, t: stub.Leave(pb.LeaveRequest(site_id=site_id), timeout=t, metadata=self._metadata),
        )

    def close(self) -> None:
        """Close the channel; later calls raise ``RendezvousError``."""
        self._pool.close()

    def __enter__(self) -> "GrpcRendezvousClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
