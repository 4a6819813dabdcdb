"""Membership and quorum: the one core (``core``) over a store (``store``: ``memory_store``
by default, ``etcd_store``), and its gRPC service and client (``grpc``).

Importing this package loads only the core and the in-memory store; ``dtrain.rendezvous.grpc``
brings in grpc and ``dtrain.rendezvous.etcd_store`` the etcd client.
"""

from dtrain.rendezvous.core import (
    NullReportSink,
    RendezvousConfig,
    RendezvousCore,
    ReportSink,
    SiteIdTaken,
    SiteRecord,
    decide_quorum,
)
from dtrain.rendezvous.inproc import InprocRendezvousClient
from dtrain.rendezvous.memory_store import MemoryStore
from dtrain.rendezvous.store import RendezvousStore

__all__ = [
    "RendezvousConfig",
    "SiteRecord",
    "decide_quorum",
    "ReportSink",
    "NullReportSink",
    "RendezvousCore",
    "RendezvousStore",
    "MemoryStore",
    "InprocRendezvousClient",
    "SiteIdTaken",
]
