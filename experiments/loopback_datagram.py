"""The datagram data path on 127.0.0.1 for in-process runs with ``RunSpec.datagram_drop``.

:func:`loopback_datagram` is the ``transport_factory`` of :class:`dtrain.sim.InprocCluster`
that :func:`experiments.common.run_inproc` passes (bound to the spec) when a run drops
datagrams instead of using the in-process network.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.transports.datagram import DatagramTransport, DatagramTransportConfig
from dtrain.transports.grpc import GrpcTransportConfig

if TYPE_CHECKING:
    from experiments.runspec import RunSpec

__all__ = ["loopback_datagram"]


def loopback_datagram(spec: RunSpec, i: int) -> DatagramTransport:
    """Site i's datagram data path on 127.0.0.1 with ``spec.datagram_drop`` injected at its receiver."""
    cfg = DatagramTransportConfig(
        grpc=GrpcTransportConfig(bind_host="127.0.0.1", bind_port=0),
        max_rate_mbit=200.0,
        rtt_s=0.01,
        nack_idle_s=0.02,
        fallback_reserve_s=min(1.0, spec.broadcast_timeout_s / 4),
        test_drop=spec.datagram_drop or 0.0,
        test_drop_seed=spec.seed * 100 + i,
    )
    return DatagramTransport(cfg)
