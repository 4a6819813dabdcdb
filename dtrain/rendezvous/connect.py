"""A site's rendezvous client from one address string: one or several ``dtrain
rendezvous`` front-ends (``h1:p1,h2:p2``, failing over between them) or etcd
directly (``etcd://h1:2379,h2:2379[/run]``, no rendezvous process at all)."""

from __future__ import annotations

import logging
import threading
from typing import Sequence

from dtrain.errors import PermanentError, RendezvousError, RendezvousRefused
from dtrain.protocol import HeartbeatInfo, JoinInfo, ReadyDecision

__all__ = ["FailoverRendezvousClient", "rendezvous_client"]

log = logging.getLogger(__name__)


class FailoverRendezvousClient:
    """Several rendezvous front-ends of one run (stateless, on one etcd store): each
    call goes to the current one and, when it cannot be reached, to the next ones in
    turn; the first that answers becomes current. A refusal that is an answer
    (:class:`~dtrain.errors.RendezvousRefused`, or a :class:`~dtrain.errors.PermanentError`
    such as a wrong token or a taken site id) is raised at once, not tried elsewhere.

    Args:
        clients: one client per front-end (``GrpcRendezvousClient``), in preference order.

    Raises:
        RendezvousError: from a call, when no front-end answered (every one named).
    """

    def __init__(self, clients: Sequence) -> None:
        if not clients:
            raise ValueError("clients must hold at least one rendezvous client")
        self.clients = list(clients)
        self._current = 0
        self._lock = threading.Lock()

    def _call(self, what: str, fn):
        with self._lock:
            start = self._current
        errors = []
        for k in range(len(self.clients)):
            i = (start + k) % len(self.clients)
            try:
                result = fn(self.clients[i])
            except (PermanentError, RendezvousRefused):
                raise  # an answer, not an outage: every front-end of the run would give the same
            except RendezvousError as e:
                errors.append(str(e))
                continue
            if i != start:
                with self._lock:
                    self._current = i
                log.warning(
                    "rendezvous %s: failed over to %s (%s)",
                    what,
                    getattr(self.clients[i], "address", i),
                    "; ".join(errors),
                )
            return result
        raise RendezvousError(f"rendezvous {what}: no front-end answered: " + "; ".join(errors))

    def join(self, site_id: str, address: str, rank_addresses: Sequence[str] = ()) -> JoinInfo:
        kw = {"rank_addresses": rank_addresses} if rank_addresses else {}
        return self._call("join", lambda c: c.join(site_id, address, **kw))

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
        kw = dict(round_reports=round_reports, unreachable=unreachable, rounds_done=rounds_done)
        if catch_up_eta_s is not None:
            kw["catch_up_eta_s"] = catch_up_eta_s
        return self._call("heartbeat", lambda c: c.heartbeat(site_id, inner_step, last_loss, **kw))

    def ready(self, site_id: str, round: int, timeout_s: float) -> ReadyDecision:
        return self._call("ready", lambda c: c.ready(site_id, round, timeout_s))

    def leave(self, site_id: str) -> None:
        self._call("leave", lambda c: c.leave(site_id))

    def close(self) -> None:
        for c in self.clients:
            c.close()


def rendezvous_client(spec: str, *, grpc_config=None, rendezvous_config=None):
    """The client for ``spec``.

    Args:
        spec: ``host:port``, ``host:port,host:port,...`` (front-ends, failing over) or
            ``etcd://host:port,...[/run]`` (etcd directly).
        grpc_config: ``GrpcTransportConfig`` for front-ends (token, TLS, retries).
        rendezvous_config: the run's ``RendezvousConfig`` (timing) for etcd directly;
            it must be the same on every site of the run (default: from the url's query,
            ``etcd://h:2379/run?quorum_timeout_s=5&initial_sites=3``).

    Raises:
        ValueError: ``spec`` is malformed.
    """
    if spec.startswith(("etcd://", "etcds://")):
        from dtrain.rendezvous.etcd_store import EtcdRendezvousClient, EtcdStoreConfig, timing_from_url

        return EtcdRendezvousClient(EtcdStoreConfig.parse(spec), rendezvous_config or timing_from_url(spec))
    from dtrain.rendezvous.grpc import GrpcRendezvousClient

    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    if not addresses or not all(a.rpartition(":")[2].isdigit() for a in addresses):
        raise ValueError(f"rendezvous must be host:port[,host:port...] or etcd://..., got {spec!r}")
    clients = [GrpcRendezvousClient(a, config=grpc_config) for a in addresses]
    return clients[0] if len(clients) == 1 else FailoverRendezvousClient(clients)
