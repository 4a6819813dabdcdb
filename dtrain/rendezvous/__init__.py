"""Membership and quorum: the pure core (``core``) and its gRPC service and client (``grpc``).

Importing this package loads only the core; ``dtrain.rendezvous.grpc`` brings in grpc.
"""

from dtrain.rendezvous.core import (
    InprocRendezvousClient,
    NullReportSink,
    RendezvousConfig,
    RendezvousCore,
    ReportSink,
    SiteIdTaken,
    SiteRecord,
    decide_quorum,
)

__all__ = [
    "RendezvousConfig",
    "SiteRecord",
    "decide_quorum",
    "ReportSink",
    "NullReportSink",
    "RendezvousCore",
    "InprocRendezvousClient",
    "SiteIdTaken",
]
