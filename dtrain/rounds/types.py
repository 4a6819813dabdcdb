"""The round engine's public types: :class:`RoundConfig` (per-site round behaviour)
and :class:`RoundResult` (what one round did at one site; its metrics line).

Re-exported by :mod:`dtrain.rounds`, where the engine that uses them lives.
:class:`RoundConfig` is defined in :mod:`dtrain.configs` (importable without torch, for
the command line) and re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.configs import RoundConfig

__all__ = ["RoundConfig", "RoundResult"]


@dataclass(kw_only=True)
class RoundResult:
    """What one round did at one site (also the source of its metrics line)."""

    round: int
    members: tuple[str, ...]
    owned_buckets: int = 0
    applied_buckets: int = 0
    stale_buckets: int = 0
    repaired_buckets: int = 0
    skipped_buckets: int = 0
    contributed: bool = True
    reduce_arrived_fraction: float = 0.0  # of expected contribution chunks at my buckets
    broadcast_arrived_fraction: float = 0.0  # of buckets whose mean this site got
    included_fraction: float = 0.0  # of my chunks that a finalized mean included
    bytes_sent: int = 0
    bytes_received: int = 0
    encode_s: float = 0.0
    encoded_bytes: int = 0  # this site's encoded contribution payloads (all owners, itself included)
    encoded_fp32_bytes: int = 0  # the fp32 size of what it encoded (compression = this / encoded_bytes)
    decode_s: float = 0.0
    network_s: float = 0.0
    wait_s: float = 0.0
    total_s: float = 0.0
    rejected: dict[str, int] = field(default_factory=dict)
    lost_members: list[str] = field(default_factory=list)  # declared dead by the rendezvous during the round
    errors: list[str] = field(default_factory=list)

    def metrics(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}
