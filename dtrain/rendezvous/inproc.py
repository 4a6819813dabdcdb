"""The in-process client of a :class:`~dtrain.rendezvous.core.RendezvousCore`: tests,
simulations, and a site on etcd directly."""

from __future__ import annotations

import time
from typing import Sequence

from dtrain.errors import RendezvousError
from dtrain.protocol import HeartbeatInfo, JoinInfo, ReadyDecision
from dtrain.rendezvous.core import RendezvousCore

__all__ = ["InprocRendezvousClient"]


class InprocRendezvousClient:
    """Client of a :class:`RendezvousCore` in the same process (tests, simulations, and
    a site on etcd directly: :class:`~dtrain.rendezvous.etcd_store.EtcdRendezvousClient`).

    Same methods as ``dtrain.rendezvous.grpc.GrpcRendezvousClient``.
    """

    def __init__(self, core: RendezvousCore) -> None:
        self.core = core
        self.down = False  # tests flip this to emulate an unreachable rendezvous

    def _check(self) -> None:
        if self.down:
            raise RendezvousError("rendezvous unreachable (inproc down)")

    def join(self, site_id: str, address: str, rank_addresses: Sequence[str] = ()) -> JoinInfo:
        self._check()
        return self.core.join(site_id, address, now=time.monotonic(), rank_addresses=rank_addresses)

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
        self._check()
        return self.core.heartbeat(
            site_id,
            now=time.monotonic(),
            inner_step=inner_step,
            last_loss=last_loss,
            round_reports=round_reports,
            unreachable=unreachable,
            rounds_done=rounds_done,
            catch_up_eta_s=catch_up_eta_s,
        )

    def ready(self, site_id: str, round: int, timeout_s: float) -> ReadyDecision:
        """Ready for ``round``; waits up to ``timeout_s`` for the plan, waking on the
        store's changes (the watch on etcd) and to decide the quorum when it is due."""
        self._check()
        deadline = time.monotonic() + timeout_s
        d = self.core.ready(site_id, round, now=time.monotonic())
        while d.status == "wait":
            left = deadline - time.monotonic()
            if left <= 0:
                return d
            self.core.wait(round, left)
            d = self.core.ready(site_id, round, now=time.monotonic())
        return d

    def leave(self, site_id: str) -> None:
        self._check()
        self.core.leave(site_id, now=time.monotonic())

    def close(self) -> None:
        pass
