"""The site's component configs, importable without torch.

:class:`DiLoCoConfig` (the library's config of one site) and its parts: :class:`BucketConfig`,
:class:`GroupConfig`, :class:`RoundConfig` with :class:`AggregationConfig` and
:class:`~dtrain.codecs.config.CodecConfig`. Their owners (``dtrain.diloco``,
``dtrain.buckets``, ``dtrain.membership``, ``dtrain.rounds``, ``dtrain.aggregation``)
import torch at module level and re-export their config from here, so
``from dtrain.buckets import BucketConfig`` keeps working while ``dtrain --help`` and
every usage error (``dtrain.options`` walks these classes to build the flags) answer
without loading torch.

Each field is documented in its class's ``Attributes:`` section; that text is the
field's ``--help`` line (``dtrain.options.field_docs``), so every field needs one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from dtrain.codecs.config import CodecConfig

__all__ = [
    "AggregationConfig",
    "BucketConfig",
    "BufferMode",
    "ThetaDevice",
    "DiLoCoConfig",
    "GroupConfig",
    "MiB",
    "RoundConfig",
]

KiB = 1 << 10
MiB = 1 << 20

BufferMode = Literal["average", "local"]
ThetaDevice = Literal["cpu", "model"]
DelayedUpdate = Literal["stale", "eager"]


@dataclass(frozen=True, kw_only=True)
class AggregationConfig:
    """How an owner combines the contributions to one chunk.

    Attributes:
        max_norm: reject a contribution whose L2 norm exceeds this, a finite number > 0
            (None: off).
        norm_bound_ratio: at finalize, drop contributions with norm above
            ``norm_bound_ratio * median(norms)``, a number >= 1 (None: off).
        trim_fraction: fraction in [0, 0.5) of values trimmed at each end per
            element (coordinate-wise trimmed mean: ``int(trim_fraction * n)`` of the n
            values; of their weight with ``token_weighted``; 0: plain mean).
        sparse_mean: per element, divide the sum by the number of contributions that sent
            a nonzero value there instead of by the number of contributions (SparseLoCo's
            aggregation, arXiv 2508.15706: a scatter-mean over the workers whose top-k
            picked the element; an element picked by one of R sites is not shrunk R-fold).
            For sparse codecs (``sparseloco``, ``topk``); not with the robust options.
        token_weighted: weight each contribution by the tokens (samples) its site trained
            since its last round, carried in the contribution itself (``Contribution.tokens``,
            inside what the data path authenticates): the owner's mean is
            Σ wᵢΔᵢ / (k · w̄) over the k contributions that arrived, w̄ the mean claim of the
            senders the owner heard from this round (= Σ wᵢΔᵢ / Σ wᵢ when every one
            arrived; unbiased under random loss, see :mod:`dtrain.aggregation`). Equal
            claims give bit for bit the unweighted mean. With ``trim_fraction`` the trimmed
            mean trims weight, not a count of values (``dtrain.aggregation.weighted_trimmed_mean``:
            the same share of the weight as today's of the count, fractional at the cuts).
            Not with ``sparse_mean`` (its per-element divisor counts contributions).
        max_weight_ratio: with ``token_weighted``, an owner refuses (INVALID_ARGUMENT, logged
            and counted) every chunk of a sender whose claim is above ``max_weight_ratio`` x
            the tokens a site trains in a full round (``sync_every`` x ``tokens_per_step``;
            an engine used without DiLoCo: x the median of the claims it accepted this round,
            once it holds two), so one site cannot weigh more than that many full-speed
            sites in a mean; a number >= 1 (``dtrain.aggregation.claim_decision``).
    """

    max_norm: float | None = None
    norm_bound_ratio: float | None = None
    trim_fraction: float = 0.0
    sparse_mean: bool = False
    token_weighted: bool = False
    max_weight_ratio: float = 4.0

    def __post_init__(self) -> None:
        if self.max_norm is not None and not (self.max_norm > 0 and math.isfinite(self.max_norm)):
            raise ValueError(f"max_norm must be a finite number > 0 or None, got {self.max_norm!r}")
        if self.norm_bound_ratio is not None and not self.norm_bound_ratio >= 1.0:
            raise ValueError(f"norm_bound_ratio must be >= 1 or None, got {self.norm_bound_ratio!r}")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction!r}")
        if not isinstance(self.sparse_mean, bool):
            raise ValueError(f"sparse_mean must be a bool, got {self.sparse_mean!r}")
        if self.sparse_mean and self.robust:
            raise ValueError("sparse_mean cannot be combined with norm_bound_ratio or trim_fraction (robust options)")
        if not isinstance(self.token_weighted, bool):
            raise ValueError(f"token_weighted must be a bool, got {self.token_weighted!r}")
        r = self.max_weight_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (r >= 1.0 and math.isfinite(r)):
            raise ValueError(f"max_weight_ratio must be a finite number >= 1, got {r!r}")
        if self.token_weighted and self.sparse_mean:
            raise ValueError(
                "token_weighted cannot be combined with sparse_mean: its per-element divisor counts the "
                "contributions nonzero there, not their tokens"
            )

    @property
    def robust(self) -> bool:
        return self.norm_bound_ratio is not None or self.trim_fraction > 0.0


@dataclass(frozen=True, kw_only=True)
class BucketConfig:
    """How parameters are cut into buckets and chunks.

    Attributes:
        bucket_bytes: bucket size in bytes of fp32 (4 bytes/element); the unit of
            ownership, repair and outer-optimizer state. None (default): chosen by
            :meth:`resolve_bucket_bytes` from the model's size and ``num_sites``.
        chunk_bytes: chunk size in bytes of fp32 input; the unit of encoding,
            transfer and partial aggregation. Default 1 MiB; a bucket smaller
            than this is one chunk. Must be <= ``bucket_bytes`` when that is set.
        num_sites: the configured number of sites of the run (not the live
            membership); only the automatic bucket size uses it. Every site of a
            run must use the same value, or their layouts differ.
        min_buckets_per_site: the automatic size gives at least this many
            buckets per configured site (so that ownership stays balanced when
            membership changes), unless that would go below ``min_bucket_bytes``.
        min_bucket_bytes: the smallest automatic bucket (per-chunk costs: an
            encode, a header, a mean pull per bucket). Default 64 KiB.
        max_bucket_bytes: the largest automatic bucket. Default 4 MiB.
    """

    bucket_bytes: int | None = None
    chunk_bytes: int = 1 * MiB
    num_sites: int = 1
    min_buckets_per_site: int = 4
    min_bucket_bytes: int = 64 * KiB
    max_bucket_bytes: int = 4 * MiB

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        b = self.bucket_bytes
        need(b is None or (is_int(b) and b >= 4), "bucket_bytes", "None (automatic) or an int >= 4 (one fp32 element)")
        top = b if b is not None else f"auto <= max_bucket_bytes={self.max_bucket_bytes}"
        need(
            is_int(self.chunk_bytes) and 4 <= self.chunk_bytes <= (b or 1 << 62),
            "chunk_bytes",
            f"an int in [4, bucket_bytes={top}]",
        )
        need(is_int(self.num_sites) and self.num_sites >= 1, "num_sites", "an int >= 1")
        need(
            is_int(self.min_buckets_per_site) and self.min_buckets_per_site >= 1, "min_buckets_per_site", "an int >= 1"
        )
        need(is_int(self.min_bucket_bytes) and self.min_bucket_bytes >= 4, "min_bucket_bytes", "an int >= 4")
        need(
            is_int(self.max_bucket_bytes) and self.max_bucket_bytes >= self.min_bucket_bytes,
            "max_bucket_bytes",
            f"an int >= min_bucket_bytes={self.min_bucket_bytes}",
        )

    def resolve_bucket_bytes(self, total_bytes: int) -> int:
        """The bucket size for ``total_bytes`` of fp32 tensors (a multiple of 4).

        ``bucket_bytes`` when set. Otherwise the model is cut into
        ``max(ceil(total / max_bucket_bytes), min_buckets_per_site * num_sites)``
        equal buckets, fewer (each ``>= min_bucket_bytes``) when those would be
        smaller than ``min_bucket_bytes``; a model under ``min_bucket_bytes`` is
        one bucket. E.g. the built-in ``small`` GPT (1.75 MB) at 3 sites: 12
        buckets of 146 KB; a 400 MB model: 100 buckets of 4 MiB (as before).
        The result depends on the configuration and the model only, never on
        the live membership.
        """
        if self.bucket_bytes is not None:
            return self.bucket_bytes
        total_elems = max(1, math.ceil(total_bytes / 4))
        n = max(math.ceil(total_bytes / self.max_bucket_bytes), self.min_buckets_per_site * self.num_sites)
        if total_bytes < n * self.min_bucket_bytes:
            n = max(1, total_bytes // self.min_bucket_bytes)
        return 4 * math.ceil(total_elems / n)


@dataclass(frozen=True, kw_only=True)
class GroupConfig:
    """Client-side membership behaviour.

    Attributes:
        quorum_wait_s: longest a site waits for a round to form before
            ``QuorumTimeout`` (the rendezvous's reason is in the message); > 0.
        ready_poll_s: length of one long poll of ``ready``; > 0.
        rendezvous_retry_s: how long ``sync`` retries an unreachable rendezvous
            before giving up for now and letting the site train on locally; > 0.
        backoff_max_s: cap of the exponential backoff between retries; > 0.
        state_pull_timeout_s: how long a state pull (join/resync) goes on without progress
            (no bucket pulled or replayed) before it fails, and how long a site behind looks
            for a member to pull from; > 0. A pull that makes progress may take any number
            of rounds (it replays the rounds it missed, :mod:`dtrain.rounds.catchup`). Also
            the longest pass of a training-position pull, whose passes start at the last
            plan's broadcast deadline and double (``dtrain.state.position_passes``).
        state_pull_streams: concurrent transfers per donor of a state pull, >= 1; the buckets
            are spread over every live member, a faster one taking more (:mod:`dtrain.rounds.catchup`).
        takeover_s: how long a join that the rendezvous refuses because a live site holds
            this site id is tried again, >= 0: a restarted incarnation of the same site (a
            torchrun restart of a site group, a process supervisor) waits there for its
            predecessor to be declared dead. 0 refuses at once (two sites given one id by
            mistake); ``dtrain worker`` restarted by torchrun uses ``quorum_wait_s`` when 0.
        join_probe_s: how long a joining site's link probe may take, seconds >= 0 (0: no
            probe). At join, before its first round, the site times a round trip and a
            stream of up to ``join_probe_bytes`` from every member at once
            (``Transport.probe_link``) and reports what a round's exchange would take at
            those rates; the rendezvous raises its start bound to that before it has
            measured rounds (``dtrain.rendezvous.deadlines``, "the join probe"). A link that
            needs longer than this gives what arrived by then.
        join_probe_bytes: filler bytes the join probe asks of each member, >= 0 (the peer
            caps it at 4 MiB). On a fast link it arrives in milliseconds.
        run_rounds: the run's number of rounds where the caller knows it (``dtrain worker``
            sets it from ``--rounds``), an int >= 1, or None. A site that joins or resyncs
            behind a group whose next round is already past it, and finds no member to pull
            from, is left behind at once (``LeftBehind``, "the run ended ..."): every member
            finished the run and none comes back with its θ, so waiting
            ``state_pull_timeout_s`` for one only delays the exit. None: it waits.
    """

    quorum_wait_s: float = 300.0
    ready_poll_s: float = 2.0
    rendezvous_retry_s: float = 2.0
    backoff_max_s: float = 5.0
    state_pull_timeout_s: float = 120.0
    state_pull_streams: int = 2
    takeover_s: float = 0.0
    join_probe_s: float = 3.0
    join_probe_bytes: int = 1 << 20
    run_rounds: int | None = None

    def __post_init__(self) -> None:
        for name in ("quorum_wait_s", "ready_poll_s", "rendezvous_retry_s", "backoff_max_s", "state_pull_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
        n = self.state_pull_streams
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"state_pull_streams must be an int >= 1, got {n!r}")
        t = self.takeover_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
            raise ValueError(f"takeover_s must be a number of seconds >= 0, got {t!r}")
        t = self.join_probe_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
            raise ValueError(f"join_probe_s must be a number of seconds >= 0, got {t!r}")
        n = self.join_probe_bytes
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"join_probe_bytes must be an int >= 0, got {n!r}")
        n = self.run_rounds
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"run_rounds must be None or an int >= 1, got {n!r}")


@dataclass(frozen=True, kw_only=True)
class RoundConfig:
    """Per-site round behaviour (the deadlines come with each ``RoundPlan``).

    Attributes:
        codec: codec of the pseudo-gradient contributions (reduce phase).
        broadcast_codec: codec of the owners' means; None = same as ``codec``.
        aggregation: robust-aggregation options of the owner.
        error_feedback: keep what the codec or a lost exchange failed to deliver
            and add it to the next round's Δ (Seide et al. 2014 "1-bit SGD";
            Karimireddy et al. 2019 "EF-SGD"); required by ``topk`` and ``sparseloco``.
        error_feedback_decay: β, the residual's decay before each round's Δ is added:
            residual ← β·residual + Δ (SparseLoCo, arXiv 2508.15706, Algorithm 1: β = 0.95
            with outer lr α = 1 and no outer momentum, the decayed residual standing in for
            the outer momentum). In (0, 1]; 1 (default): nothing undelivered is forgotten.
        broadcast_error_feedback: the owner also keeps what the lossy broadcast
            codec lost from each mean and adds it to the next mean of that bucket
            (costs 4 bytes per owned parameter; off by default).
        repair: pull stale buckets whole from the owner; False keeps stale
            values as the packet-loss paper does (arXiv 2507.07114 §4.2).
        plan_wait_s: how long a request for a round this site has not opened yet
            waits for the plan to arrive (peers receive plans a few ms apart); > 0. None
            (default): derived, the reduce timeout of the last plan this site opened (5 s
            before the first), so it follows the link as the plans' deadlines do.
        repair_timeout_s: time budget for late mean pulls and state repair after
            the broadcast deadline; > 0. None (default): derived per round, the plan's
            broadcast timeout minus its reduce timeout (the round's broadcast window,
            itself derived from the observed exchange), at least 0.5 s.
        max_consecutive_rejections: a sender whose contributions were rejected in
            this many consecutive rounds, with none of its contributions counted in
            those rounds, is refused from then on (PERMISSION_DENIED); >= 1. (A
            token holder spoofing a member's name must not get it excluded while the
            member's own chunks are counted.)
        num_pull_threads: concurrent mean pulls; >= 1.
        short_push_is_loss: a push stream that ends while its sender still owes
            chunks of open buckets here marks the sender lost for the round (a member
            sends all it owes an owner in one stream; a stream broken by the sender's
            death looks the same to a gRPC server). Off: such a sender is awaited
            until the reduce deadline or the rendezvous declares it dead.
        history_rounds: how many closed rounds' applied means this site keeps for a site
            behind to replay (:mod:`dtrain.rounds.history`), >= 0. A pull may span any number
            of rounds; one bucket's transfer must take fewer than this many (else that
            bucket is pulled again, and again). 0: none kept (a site behind then needs its
            state pull to finish within the round it started in).
        history_bytes: the most bytes of means kept (encoded, as broadcast), >= 0; the
            oldest rounds are dropped first.
    """

    codec: CodecConfig = field(default_factory=lambda: CodecConfig(name="fp32"))
    broadcast_codec: CodecConfig | None = None
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    error_feedback: bool = True
    error_feedback_decay: float = 1.0
    broadcast_error_feedback: bool = False
    repair: bool = True
    plan_wait_s: float | None = None
    repair_timeout_s: float | None = None
    max_consecutive_rejections: int = 3
    num_pull_threads: int = 8
    short_push_is_loss: bool = True
    history_rounds: int = 16
    history_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        # Codec names are checked by CodecConfig against its torch-free name list.
        for name in ("codec", "broadcast_codec"):
            v = getattr(self, name)
            if not isinstance(v, CodecConfig) and not (v is None and name == "broadcast_codec"):
                raise ValueError(f"{name} must be a CodecConfig, got {type(v).__name__}")
        if self.codec.needs_error_feedback and not self.error_feedback:
            raise ValueError(f"codec {self.codec.name!r} requires error_feedback=True")
        if self.aggregation.sparse_mean and self.codec.base_name not in ("topk", "sparseloco"):
            raise ValueError(
                f"aggregation.sparse_mean needs a sparse codec (topk or sparseloco), not codec {self.codec.name!r}: "
                "a dense codec sends a value for every element, so the per-element count it divides by is every "
                "contribution (the plain mean) or, for an exact zero, a smaller one that inflates the mean"
            )
        d = self.error_feedback_decay
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 < d <= 1.0:
            raise ValueError(f"error_feedback_decay must be a number in (0, 1], got {d!r}")
        for name in ("plan_wait_s", "repair_timeout_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.max_consecutive_rejections < 1:
            raise ValueError(f"max_consecutive_rejections must be >= 1, got {self.max_consecutive_rejections!r}")
        if self.num_pull_threads < 1:
            raise ValueError(f"num_pull_threads must be >= 1, got {self.num_pull_threads!r}")
        for name in ("history_rounds", "history_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    """Configuration of the DiLoCo wrapper.

    Attributes:
        site_id: this site's unique name.
        sync_every: H, inner steps per round, >= 1 (DiLoCo arXiv 2311.08105 uses 500).
        buckets: bucket and chunk sizes.
        rounds: codec, aggregation, error feedback, repair.
        group: rendezvous-client behaviour (quorum wait, retries).
        buffers: ``"average"`` floating-point buffers (e.g. batch-norm running
            statistics) across sites each round, or keep them ``"local"``.
        hook_optimizer: count inner steps through a post-step hook on the inner
            optimizer (True) or only when the caller calls :meth:`DiLoCo.step`.
        close_timeout_s: longest :meth:`DiLoCo.close` waits for the members of the
            last round to pull this site's means, seconds (0: not at all). None
            (default): until that round's late pulls and repairs end (its broadcast
            deadline + its repair window), after which no member pulls any more.
        num_fragments: F, Streaming DiLoCo's fragments (arXiv 2501.18512 §2.2): the
            buckets are cut into F contiguous groups, synchronised in turn; a round
            runs every H/F inner steps, for one fragment (its round number r syncs
            fragment (r + 1) mod F, so fragment f at inner steps f·H/F + k·H), and
            the peak bytes on the wire fall by about F. An int >= 1 that divides
            ``sync_every``, at most the number of buckets. 1: every round syncs the
            whole model.
        overlap_steps: τ, inner steps a round's communication overlaps with
            training (arXiv 2501.18512 §2.3): the round starts in the background at
            step t, Δ measured there, and its result is merged in at step t + τ.
            0 <= τ <= H/F; 0 = the round blocks. τ = H with F = 1 is the
            one-step-delayed mode (DiLoCoX, arXiv 2506.21263; PCCL's async
            DiLoCo): round r's exchange runs during round r+1's inner phase; at
            each start step round r+1's Δ (the model's own H steps) is measured,
            then round r's θ merged in, then round r+1 sent. τ = H/F with F > 1
            merges a fragment right before the next fragment starts.
        merge_alpha: α, how the fragment's local parameters are merged with the
            new global ones when its round is applied: ``lerp(θ_new, θ_local, α)``
            = (1 − α)·θ_new + α·θ_local (torchft ``fragment_update_alpha``; the
            paper's α); 0 = take θ_new, as blocking DiLoCo. In [0, 1]. The next
            pseudo-gradient is measured from θ_new.
        theta_device: where θ, the outer-optimizer state and the residuals live:
            ``"cpu"`` (default: host memory, 12 bytes per synchronised parameter,
            for small hosts) or ``"model"`` (the device of the model's first
            parameter, e.g. its GPU: gather, Δ, residuals, outer step and scatter
            run there, and only codec payloads, checksums and state transfers
            cross to the host). With a CPU model both are the same.
        pace_fraction: with overlap (τ > 0), a fragment round's sends (its chunk
            pushes and the means it serves) are spread over this share of the
            expected time of its τ inner steps (the measured inner-step time), a
            send-rate budget, instead of leaving at the link's rate; this is what
            lowers the peak bytes per second by about F (Streaming DiLoCo,
            arXiv 2501.18512 §2.2). In [0, 1); 0 = unpaced. Blocking rounds
            (τ = 0) are never paced.
        delayed_update: the one-step-delayed mode's merge (F = 1, τ = H).
            ``"eager"`` (default): the model keeps its own last H steps on top of
            the θ merged in, a local stand-in for the round in flight until its
            mean lands one round later (Kale et al., "Eager updates for
            overlapped communication and computation in DiLoCo", arXiv
            2502.12996; θ stays the group's on every site); ``"stale"``: the
            model restarts from the merged θ (``lerp`` with ``merge_alpha``) and
            its steps reach θ only through the one-round-late outer step, which
            DiLoCo's outer Nesterov momentum 0.9 turns unstable (see
            experiments/RESULTS.md, "One-step-delayed rounds"). Other modes
            ignore it.
        tokens_per_step: tokens (samples) one inner step of this site trains, over all its
            ranks (batch x sequence length x ranks), an int >= 1: a round's claim is this
            times the inner steps since the site's last round of those buckets
            (``Contribution.tokens``, the weight of a token-weighted mean,
            ``rounds.aggregation.token_weighted``). 1 (default): the claim counts steps;
            ``dtrain worker`` then uses the task's tokens per batch x the site's ranks.
        round_window_s: time-based rounds: instead of H inner steps, each site trains as many
            as fit in this many seconds from its measured inner-step time, at least 1 and at
            most ``sync_every`` (which becomes the bound), so sites of different speed reach
            the exchange together (``dtrain.streaming.fragment_period``; the ranks of a site
            group take rank 0's count). With streaming rounds a fragment round starts every
            ``round_window_s / num_fragments`` seconds of compute (at least 1, at most H/F
            steps a fragment period; the fragment stays ``(r + 1) mod F`` of the round number
            r, alike on every site), and a round in flight is merged ``overlap_steps`` steps
            into the next period or at its end, whichever comes first (τ clamped to the
            period decided). Pair with ``rounds.aggregation.token_weighted``, so a site's
            contribution weighs what it trained. None (default): ``sync_every`` steps a round
            (H/F a fragment round).
    """

    site_id: str = "site-0"
    sync_every: int = 500
    buckets: BucketConfig = field(default_factory=BucketConfig)
    rounds: RoundConfig = field(default_factory=RoundConfig)
    group: GroupConfig = field(default_factory=GroupConfig)
    buffers: BufferMode = "average"
    hook_optimizer: bool = True
    close_timeout_s: float | None = None
    num_fragments: int = 1
    overlap_steps: int = 0
    merge_alpha: float = 0.0
    theta_device: ThetaDevice = "cpu"
    pace_fraction: float = 0.5
    delayed_update: DelayedUpdate = "eager"
    tokens_per_step: int = 1
    round_window_s: float | None = None

    @property
    def one_step_delayed(self) -> bool:
        """The one-step-delayed mode: F = 1, τ = H (DiLoCoX, arXiv 2506.21263)."""
        return self.num_fragments == 1 and self.overlap_steps == self.sync_every > 0

    @property
    def streaming(self) -> bool:
        """Whether rounds go through :mod:`dtrain.streaming` (fragments, overlap or merging)."""
        return self.num_fragments > 1 or self.overlap_steps > 0 or self.merge_alpha > 0

    def __post_init__(self) -> None:
        if not isinstance(self.sync_every, int) or self.sync_every <= 0:
            raise ValueError(f"sync_every (H) must be an int >= 1, got {self.sync_every!r}")
        self._check_streaming()
        if self.buffers not in get_args(BufferMode):
            raise ValueError(f"buffers must be one of {get_args(BufferMode)}, got {self.buffers!r}")
        if self.theta_device not in get_args(ThetaDevice):
            raise ValueError(f"theta_device must be one of {get_args(ThetaDevice)}, got {self.theta_device!r}")
        w = self.round_window_s
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < float("inf")):
            raise ValueError(f"round_window_s must be None (rounds of sync_every steps) or seconds > 0, got {w!r}")
        n = self.tokens_per_step
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"tokens_per_step must be an int >= 1, got {n!r}")
        if not self.site_id or not isinstance(self.site_id, str):
            raise ValueError(f"site_id must be a non-empty string, got {self.site_id!r}")
        t = self.close_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf")):
            raise ValueError(f"close_timeout_s must be None (the broadcast deadline) or seconds >= 0, got {t!r}")

    def _check_streaming(self) -> None:
        f, tau, a = self.num_fragments, self.overlap_steps, self.merge_alpha
        if isinstance(f, bool) or not isinstance(f, int) or f < 1 or self.sync_every % f:
            raise ValueError(f"num_fragments must be an int >= 1 dividing sync_every ({self.sync_every}), got {f!r}")
        if isinstance(tau, bool) or not isinstance(tau, int) or not 0 <= tau <= self.sync_every // f:
            raise ValueError(
                f"overlap_steps (tau) must be an int in [0, sync_every/num_fragments = {self.sync_every // f}], "
                f"got {tau!r}"
            )
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ValueError(f"merge_alpha must be a number in [0, 1], got {a!r}")
        if a > 0 and self.one_step_delayed and self.delayed_update == "eager":
            raise ValueError(
                f"merge_alpha {a!r} has nothing to apply to in the one-step-delayed mode's eager merge "
                "(num_fragments 1, overlap_steps = sync_every, delayed_update eager: the model keeps its own "
                "steps on the merged θ); use delayed_update stale, num_fragments > 1, or merge_alpha 0"
            )
        p = self.pace_fraction
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ValueError(f"pace_fraction must be a number in [0, 1) (0 = unpaced), got {p!r}")
        if self.delayed_update not in get_args(DelayedUpdate):
            raise ValueError(f"delayed_update must be one of {get_args(DelayedUpdate)}, got {self.delayed_update!r}")
