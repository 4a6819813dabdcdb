"""The round engine's public types: :class:`RoundConfig` (per-site round behaviour)
and :class:`RoundResult` (what one round did at one site; its metrics line).

Re-exported by :mod:`dtrain.rounds`, where the engine that uses them lives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.aggregation import AggregationConfig
from dtrain.codecs import CodecConfig, get_codec

__all__ = ["RoundConfig", "RoundResult"]


@dataclass(frozen=True, kw_only=True)
class RoundConfig:
    """Per-site round behaviour (the deadlines come with each ``RoundPlan``).

    Attributes:
        codec: codec of the pseudo-gradient contributions (reduce phase).
        broadcast_codec: codec of the owners' means; None = same as ``codec``.
        aggregation: robust-aggregation options of the owner.
        error_feedback: keep what the codec or a lost exchange failed to deliver
            and add it to the next round's Δ (Seide et al. 2014 "1-bit SGD";
            Karimireddy et al. 2019 "EF-SGD"); required by ``topk``.
        broadcast_error_feedback: the owner also keeps what the lossy broadcast
            codec lost from each mean and adds it to the next mean of that bucket
            (costs 4 bytes per owned parameter; off by default).
        repair: pull stale buckets whole from the owner; False keeps stale
            values as the packet-loss paper does (arXiv 2507.07114 §4.2).
        plan_wait_s: how long a request for a round this site has not opened yet
            waits for the plan to arrive (peers receive plans a few ms apart).
        repair_timeout_s: time budget for late mean pulls and state repair after
            the broadcast deadline, seconds.
        max_consecutive_rejections: a sender whose contributions were rejected in
            this many consecutive rounds is refused from then on (PERMISSION_DENIED).
        num_pull_threads: concurrent mean pulls.
    """

    codec: CodecConfig = field(default_factory=lambda: CodecConfig(name="fp32"))
    broadcast_codec: CodecConfig | None = None
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    error_feedback: bool = True
    broadcast_error_feedback: bool = False
    repair: bool = True
    plan_wait_s: float = 5.0
    repair_timeout_s: float = 5.0
    max_consecutive_rejections: int = 3
    num_pull_threads: int = 8

    def __post_init__(self) -> None:
        get_codec(self.codec)  # raises ValueError naming the codec
        if self.broadcast_codec is not None:
            get_codec(self.broadcast_codec)
        if get_codec(self.codec).needs_error_feedback and not self.error_feedback:
            raise ValueError(f"codec {self.codec.name!r} requires error_feedback=True")
        for name in ("plan_wait_s", "repair_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.max_consecutive_rejections < 1:
            raise ValueError(f"max_consecutive_rejections must be >= 1, got {self.max_consecutive_rejections!r}")
        if self.num_pull_threads < 1:
            raise ValueError(f"num_pull_threads must be >= 1, got {self.num_pull_threads!r}")


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
