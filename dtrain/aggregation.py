"""Unbiased partial aggregation of pseudo-gradient chunks at their owner.

The owner of a bucket averages, per chunk, only the contributions that arrived
and validated before the deadline, dividing by their *count* rather than by the
number of members. This is the unbiased reduce of Weintraub, Banner & Orda,
"Distributed Training under Packet Loss" (arXiv 2507.07114, §4, "unbiased
reduce-scatter"): with independent losses, E[mean] equals the full mean.

Robust options (off by default):
  * ``max_norm``: absolute L2 bound per contribution, checked on arrival.
  * ``norm_bound_ratio``: at finalize, contributions whose L2 norm exceeds
    ``ratio x median norm`` are dropped (needs >= 3 contributions to act).
  * ``trim_fraction``: coordinate-wise trimmed mean dropping that fraction of
    the largest and the smallest values per element (Yin et al., "Byzantine-
    robust distributed learning", ICML 2018, trimmed mean with beta); token-weighted,
    that share of the *weight* (:func:`weighted_trimmed_mean`).

:class:`ChunkAccumulator` holds one chunk; :class:`BucketAccumulator` holds every chunk
of a bucket and takes a run of neighbouring chunks from one sender at once (the datagram
path's ~1,300-element chunks), with the same checks, refusals and bit for bit the same
means: the owner's books (dtrain/rounds/owner.py) use it for one chunk and for runs.

Token-weighted means (``AggregationConfig.token_weighted``; Decoupled DiLoCo, arXiv
2604.21428, merges by tokens): each sender's contribution counts with its weight, passed
as a factor fᵢ = wᵢ / w_ref (a float32 number; w_ref is one claim of the round, so equal
claims give fᵢ = 1.0 exactly and every operation is the unweighted one, bit for bit). The
mean of a chunk that k of the senders reached is Σ fᵢΔᵢ / (k · f̄), f̄ the mean factor of
every sender the owner heard from this round (``weights``). With every contribution there
this is Σ wᵢΔᵢ / Σ wᵢ. Under loss it stays unbiased: if each sender's chunk is lost
independently with one probability, the k that arrived are a uniform k-subset of the
senders, so E[Σ_S fᵢΔᵢ | k] = (k/n) Σ fᵢΔᵢ and the divisor k · f̄ = (k/n) Σ fᵢ undoes it
exactly (a Horvitz-Thompson estimate with the observed arrival rate). The ratio
Σ_S fᵢΔᵢ / Σ_S fᵢ over the arrived is *not* unbiased (weights 1 and 100, Δ 0 and 1, each
arriving with p = 0.5: it averages 0.66 against 0.99); tests/unit/test_token_weights.py
measures both.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch

from dtrain.codecs.base import CheckedRun, equal_runs
from dtrain.configs import AggregationConfig
from dtrain.errors import RejectCode, Rejected

__all__ = [
    "AggregationConfig",
    "BucketAccumulator",
    "BucketReduction",
    "ChunkAccumulator",
    "ChunkReduction",
    "claim_decision",
    "mean_factor",
    "partial_mean",
    "weighted_trimmed_mean",
    "trimmed_counts",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkReduction:
    """The partial mean of one chunk of a closed bucket.

    Attributes:
        chunk: chunk index in the bucket.
        mean: 1-D fp32 mean over ``senders`` (None: nothing arrived or all dropped).
        senders: the senders the mean includes, sorted.
        dropped: sender -> reason for contributions the robust options dropped here.
    """

    chunk: int
    mean: torch.Tensor | None
    senders: tuple[str, ...]
    dropped: dict[str, str] = field(default_factory=dict)


class BucketReduction(Sequence[ChunkReduction]):
    """The partial means of every chunk of a closed bucket (:meth:`BucketAccumulator.finalize`) as
    columns, not an object and a view per chunk (~480 on the datagram path; the mean encode
    takes the bucket whole). Item ``c``, made on demand, is chunk ``c``'s :class:`ChunkReduction`.

    Attributes:
        mean: 1-D fp32, the bucket's elements: chunk ``c``'s partial mean at its range where
            ``senders[c]`` is not empty (elsewhere unspecified); None when no chunk has one.
        numels: elements of each chunk, in chunk order.
        senders: per chunk, the senders its mean includes, sorted (empty: no mean).
        dropped: chunk -> (sender -> reason) where the robust options dropped contributions.
    """

    __slots__ = ("mean", "numels", "senders", "dropped", "_pos")

    def __init__(self, mean: torch.Tensor | None, numels: Sequence[int], senders: Sequence, dropped=None) -> None:
        if len(senders) != len(numels):
            raise ValueError(f"{len(numels)} chunks but {len(senders)} sender sets")
        self.mean, self.numels, self.senders = mean, tuple(numels), list(senders)
        self.dropped = {c: d for c, d in (dropped or {}).items() if d}
        self._pos = list(itertools.accumulate(self.numels, initial=0))
        if mean is not None and mean.numel() != self._pos[-1]:
            raise ValueError(f"mean has {mean.numel()} elements, the chunks {self._pos[-1]}")

    @classmethod
    def of_chunks(cls, numels: Sequence[int], items: Sequence[tuple]) -> BucketReduction:
        """Per-chunk ``(mean, senders, dropped)`` (:func:`partial_mean`'s) copied into columns."""
        means = [torch.zeros(n) if m is None else m for (m, _, _), n in zip(items, numels)]
        mean = None if all(m is None for m, _, _ in items) else torch.cat(means)
        senders = [s if m is not None else () for m, s, _ in items]
        return cls(mean, numels, senders, {c: d for c, (_, _, d) in enumerate(items)})  # empty drops left out

    @property
    def complete(self) -> bool:
        """Every chunk has a mean."""
        return self.mean is not None and all(self.senders)

    def __len__(self) -> int:
        return len(self.numels)

    def __getitem__(self, c):  # type: ignore[override] - an int gives a ChunkReduction, a slice a list of them
        if isinstance(c, slice):
            return [self[i] for i in range(len(self))[c]]
        c = range(len(self))[c]  # IndexError past the end; negative indices count from it
        ss = self.senders[c]
        mean = self.mean[self._pos[c] : self._pos[c + 1]] if ss and self.mean is not None else None
        return ChunkReduction(c, mean, ss if mean is not None else (), dict(self.dropped.get(c, {})))


def mean_factor(weights: Mapping[str, float] | None) -> float:
    """f̄, the mean of the weight factors of the senders heard from (1.0 without weights).
    A chunk reached by k senders is divided by k · f̄ (see the module docstring)."""
    if not weights:
        return 1.0
    factors = tuple(weights.values())  # one C-level copy: the owner may add a claim meanwhile
    return math.fsum(factors) / len(factors)


#: Claims an owner must have accepted in a round before it bounds the next one by their median.
MIN_CLAIMS_COMPARED = 2


def claim_decision(
    claim: int, accepted: Sequence[int], max_weight_ratio: float, full_round_tokens: int = 0
) -> tuple[bool, str]:
    """Whether an owner accepts a sender's token claim (a pure decision).

    The rule: a claim must be a positive integer, and
    - with ``full_round_tokens`` known (the runtime's: ``sync_every`` x ``tokens_per_step``,
      what a site trains in a round at its most; time-based rounds never take more than
      ``sync_every`` steps), not above ``max_weight_ratio`` x it: no sender weighs more than
      ``max_weight_ratio`` sites training a full round, and a fast honest site is never
      refused, however slow the others (a bound relative to the median refused the fastest
      site of a run where two of three ran at a fifth of its speed, and excluded it);
    - without it, not above ``max_weight_ratio`` x the median of the claims the owner
      accepted this round before it (its own first), once there are at least
      :data:`MIN_CLAIMS_COMPARED` of them.
    A refused claim's contribution stays in its sender's residual.

    Args:
        claim: the tokens claimed.
        accepted: the claims accepted so far this round.
        max_weight_ratio: the bound's factor, >= 1.
        full_round_tokens: tokens a site trains in a full round (0: not known).
    Returns:
        ``(accepted, reason)``: the reason names the claim and the bound.
    """
    if isinstance(claim, bool) or not isinstance(claim, int) or claim <= 0:
        return False, f"claims {claim!r} tokens: a token-weighted round needs a claim > 0"
    if full_round_tokens > 0:
        cap = max_weight_ratio * full_round_tokens
        if claim > cap:
            return False, (
                f"claims {claim} tokens, above max_weight_ratio {max_weight_ratio:g} x a full round's "
                f"{full_round_tokens} tokens ({cap:g})"
            )
        return True, f"claims {claim} tokens, within {max_weight_ratio:g} x a full round's {full_round_tokens}"
    if len(accepted) < MIN_CLAIMS_COMPARED:
        return True, f"claims {claim} tokens, with {len(accepted)} claim(s) of the round to compare with"
    med = statistics.median(accepted)
    bound = max_weight_ratio * med
    if claim > bound:
        return False, (
            f"claims {claim} tokens, above max_weight_ratio {max_weight_ratio:g} x the median claim {med:g} "
            f"of the round ({bound:g})"
        )
    return True, f"claims {claim} tokens, within {max_weight_ratio:g} x the median claim {med:g}"


def partial_mean(
    contributions: dict[str, torch.Tensor],
    config: AggregationConfig,
    weights: Mapping[str, float] | None = None,
    trimmed: "collections.Counter[str] | None" = None,
) -> tuple[torch.Tensor | None, tuple[str, ...], dict[str, str]]:
    """Mean over the contributions that are present and pass the robust checks.

    Args:
        contributions: sender -> fp32 1-D tensor, all of the same length.
        config: robust options.
        weights: token weighting: sender -> weight factor fᵢ (a sender not in it counts
            1.0); the mean is Σ fᵢvᵢ / (k · f̄) (module docstring). None: unweighted.
        trimmed: with ``trim_fraction`` cutting something, each sender's count of elements
            the trim cut is added here (:func:`trimmed_counts`); None: not counted.
    Returns:
        ``(mean, included_senders, rejected)``: ``mean`` is None when nothing is
        left; ``rejected`` maps sender -> reason for contributions dropped here.
    """
    rejected: dict[str, str] = {}
    items = sorted(contributions.items())
    if config.norm_bound_ratio is not None and len(items) >= 3:
        norms = {s: float(torch.linalg.vector_norm(v)) for s, v in items}
        med = (
            sorted(norms.values())[len(norms) // 2]
            if len(norms) % 2
            else sum(sorted(norms.values())[len(norms) // 2 - 1 : len(norms) // 2 + 1]) / 2
        )
        bound = config.norm_bound_ratio * med
        kept = []
        for s, v in items:
            if norms[s] > bound:
                rejected[s] = f"norm {norms[s]:.4g} above bound {bound:.4g} ({config.norm_bound_ratio} x median)"
            else:
                kept.append((s, v))
        items = kept
    if not items:
        return None, (), rejected
    senders = tuple(s for s, _ in items)
    stack = torch.stack([v for _, v in items])
    weighted = bool(weights) and (
        any(weights.get(s, 1.0) != 1.0 for s in senders) or mean_factor(weights) != 1.0  # type: ignore[union-attr]
    )
    if int(config.trim_fraction * len(items)) > 0:
        if trimmed is not None:
            counts = trimmed_counts(stack, int(config.trim_fraction * len(items)))
            trimmed.update({s: n for s, n in zip(senders, counts.tolist()) if n})
        if weighted:
            assert weights is not None
            f = torch.tensor([weights.get(s, 1.0) for s in senders], dtype=torch.float64)
            mean = weighted_trimmed_mean(stack, f, config.trim_fraction, total=len(items) * mean_factor(weights))
        else:
            mean = weighted_trimmed_mean(stack, torch.ones(len(items), dtype=torch.float64), config.trim_fraction)
    elif weighted:
        assert weights is not None
        f = torch.tensor([weights.get(s, 1.0) for s in senders], dtype=torch.float32)
        mean = (stack * f.unsqueeze(1)).sum(dim=0) / float(len(items) * mean_factor(weights))
    else:
        mean = stack.sum(dim=0) / len(items)
    return mean, senders, rejected


def trimmed_counts(values: torch.Tensor, k: int) -> torch.Tensor:
    """Per contribution (row of ``values``, [n, m]), how many of its m elements lie among
    the ``k`` lowest or ``k`` highest of their coordinate (ties by row order): what a
    trimmed mean with ``k = int(trim_fraction * n)`` cuts (Yin et al. 2018's trimmed mean;
    with token weights the cut is a weight share, so this counts the elements at the
    extremes it is taken from). int64 [n]; 0 everywhere for ``k`` 0. A contribution cut
    at nearly every element is an outlier the trim kept out of the mean."""
    n = values.shape[0]
    if k <= 0:
        return torch.zeros(n, dtype=torch.int64)
    idx = torch.argsort(values, dim=0, stable=True)
    return torch.bincount(torch.cat([idx[:k], idx[n - k :]]).flatten(), minlength=n)


def weighted_trimmed_mean(
    values: torch.Tensor, weights: torch.Tensor, trim_fraction: float, *, total: float | None = None
) -> torch.Tensor:
    """Coordinate-wise weighted trimmed mean of ``n`` contributions (a pure function).

    The rule, per coordinate: with ``k = int(trim_fraction * n)`` (the count of values
    today's trimmed mean drops from each end; 0 for a non-integer ``trim_fraction * n``
    below 1) and ``W = Σ wᵢ``, sort the values ascending with their weights, drop the
    weight mass ``k/n · W`` from each end, a value straddling a cut keeping the part of
    its weight inside, and take the weighted mean of the mass left,
    ``(1 - 2k/n) · W``. This is the α-trimmed mean as an L-estimator,
    T(F) = (1 - 2α)⁻¹ ∫_α^{1-α} F⁻¹(u) du (Huber & Ronchetti, *Robust Statistics*, 2nd ed.
    2009, §3.3), evaluated at the weighted empirical distribution Σ (wᵢ/W) δ(xᵢ), with
    α = k/n; the same algorithm as R's ``smoothemplik::trimmed.weighted.mean`` (sort,
    accumulate the weights, drop what lies wholly outside the cut points, weigh the two
    outermost kept values down in proportion). Equal weights with ``total`` None or
    their sum give exactly today's trimmed mean (``sort(values)[k:n-k].mean(0)``, the
    same arithmetic, bit for bit); a heavy value of small weight is trimmed as soon as
    the weight below (or above) it reaches ``k/n · W``.

    The cuts are compared as ``n x cumulative weight`` against ``k x W`` and
    ``(n - k) x W`` in float64, so that for weights within ~2^29 of each other every
    comparison is exact and a value wholly outside the kept mass gets weight 0, not a
    rounding error's worth (which would leak a huge outlier into the mean).

    Args:
        values: ``(n, m)`` float32, one contribution per row (finite).
        weights: ``(n,)`` weights > 0, any float dtype (computed in float64).
        trim_fraction: in [0, 0.5), as ``AggregationConfig.trim_fraction``.
        total: the weight the kept mass is a ``(1 - 2k/n)`` share of, in the divisor:
            None: ``W`` (the L-estimator above); :func:`partial_mean` passes
            ``n · f̄``, the Horvitz-Thompson divisor of the module docstring, so that
            with every sender's chunk there it is ``W`` and under loss it stays the
            weighted mean's estimate of the full round.
    Returns:
        ``(m,)`` float32.
    Raises:
        ValueError: shapes that do not match, a weight <= 0, or ``trim_fraction``
            outside [0, 0.5).
    """
    if values.dim() != 2 or weights.shape != (values.shape[0],) or values.shape[0] == 0:
        raise ValueError(
            f"values must be (n, m) and weights (n,), n >= 1; got {tuple(values.shape)}, {tuple(weights.shape)}"
        )
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction!r}")
    n = values.shape[0]
    w = weights.to(torch.float64)
    if not bool((w > 0).all()):
        raise ValueError(f"weights must be > 0, got {w.tolist()}")
    k = int(trim_fraction * n)
    if bool((w == w[0]).all()) and (total is None or total == float(w.sum())):
        srt, _ = torch.sort(values, dim=0)  # equal weights: today's trimmed mean, the same operations
        return srt[k : n - k].mean(dim=0) if k > 0 else values.sum(dim=0) / n
    srt, idx = torch.sort(values, dim=0, stable=True)
    ws = w[idx]  # (n, m): each sorted value's weight
    upto = torch.cumsum(ws, dim=0)  # weight at or below each sorted value
    below = torch.cat([torch.zeros_like(upto[:1]), upto[:-1]])  # weight strictly below it
    whole = upto[-1:]  # (1, m): W, per coordinate (its own sums: the cuts use the same numbers)
    kept = (torch.minimum(n * upto, (n - k) * whole) - torch.maximum(n * below, k * whole)).clamp_(min=0.0)
    denom = (n - 2 * k) * (whole if total is None else torch.full_like(whole, float(total)))
    return ((kept * srt.to(torch.float64)).sum(dim=0) / denom.squeeze(0)).to(torch.float32)


class ChunkAccumulator:
    """Collects the contributions to one chunk of one bucket for one round.

    The sum is taken in a canonical order, whatever order contributions arrive in:
    sender ids sorted. Without robust options it keeps a running fp32 sum over the
    contiguous prefix of ``order`` that has arrived, and holds a contribution that
    arrives ahead of its turn until the senders before it arrive or :meth:`finalize`
    (memory: one chunk, plus the contributions that arrived out of turn); with them it
    keeps every contribution until :meth:`finalize`. Either way two owners given the
    same contributions compute a bit-identical mean.
    Thread-safety: callers hold the owning round's lock.

    Args:
        numel: elements of the chunk.
        config: robust options.
        order: the senders expected (the round's members); None folds nothing before
            :meth:`finalize` (every contribution is kept until then).
    """

    def __init__(self, numel: int, config: AggregationConfig, order: Iterable[str] | None = None) -> None:
        self.numel = numel
        self.config = config
        self._order = sorted(order) if order is not None else []
        self._next = 0  # senders self._order[:self._next] are in self._sum
        self._sum: torch.Tensor | None = None
        self._nnz: torch.Tensor | None = None  # sparse_mean: per element, contributions nonzero there
        self._kept: dict[str, torch.Tensor] = {}  # robust: every contribution; else: arrived out of turn
        self._digests: dict[str, bytes] = {}
        self.trimmed: collections.Counter[str] = collections.Counter()  # sender -> elements the trim cut

    @property
    def senders(self) -> tuple[str, ...]:
        return tuple(sorted(self._digests))

    @property
    def num_held(self) -> int:
        """Contributions held as tensors: every one with robust options, else those that
        arrived ahead of their turn in the sum."""
        return len(self._kept)

    @property
    def digests(self) -> dict[str, bytes]:
        """Sender -> the key (the payload, or a digest of it) counted from it (a copy)."""
        return dict(self._digests)

    def add(self, sender: str, values: torch.Tensor, digest: bytes) -> bool:
        """Add one contribution. Returns False for an identical retry (idempotent).

        Raises:
            Rejected: wrong length or dtype, non-finite values, norm over
                ``max_norm`` (INVALID_ARGUMENT); a *different* payload from a
                sender already counted (ALREADY_EXISTS).
        """
        if sender in self._digests:
            if self._digests[sender] == digest:
                return False
            raise Rejected(
                RejectCode.ALREADY_EXISTS, f"a different contribution from {sender} for this chunk was already accepted"
            )
        if values.dtype != torch.float32 or values.dim() != 1 or values.numel() != self.numel:
            raise Rejected(
                RejectCode.INVALID_ARGUMENT,
                f"contribution has {values.numel()} {values.dtype} values, expected {self.numel} float32",
            )
        if not bool(torch.isfinite(values).all()):
            raise Rejected(RejectCode.INVALID_ARGUMENT, "contribution contains NaN or Inf values")
        if self.config.max_norm is not None:
            norm = float(torch.linalg.vector_norm(values))
            if norm > self.config.max_norm:
                raise Rejected(
                    RejectCode.INVALID_ARGUMENT,
                    f"contribution norm {norm:.4g} exceeds max_norm {self.config.max_norm:.4g}",
                )
        self._kept[sender] = values
        self._digests[sender] = digest
        if not self.config.robust:
            while self._next < len(self._order) and self._order[self._next] in self._kept:
                self._fold(self._kept.pop(self._order[self._next]))
                self._next += 1
        return True

    def _fold(self, values: torch.Tensor) -> None:
        if self._sum is None:
            self._sum = values.clone()
        else:
            self._sum.add_(values)
        if self.config.sparse_mean:
            nz = (values != 0).to(torch.float32)
            self._nnz = nz if self._nnz is None else self._nnz.add_(nz)

    def finalize(self) -> tuple[torch.Tensor | None, tuple[str, ...], dict[str, str]]:
        """The unbiased partial mean; see :func:`partial_mean` for the result."""
        if self.config.robust:
            return partial_mean(self._kept, self.config, trimmed=self.trimmed)
        for sender in sorted(self._kept):
            self._fold(self._kept.pop(sender))
        if self._sum is None:
            return None, (), {}
        senders = self.senders
        if self._nnz is not None:
            return self._sum / self._nnz.clamp_(min=1.0), senders, {}
        return self._sum / len(senders), senders, {}


#: Relative margin under ``max_norm`` within which a norm computed over a run's rows is
#: trusted; nearer the bound the chunk's own norm decides (row and 1-D reductions may
#: round differently, by far less than this: ~n·eps for n = a few thousand elements).
_NORM_MARGIN = 1e-3


class BucketAccumulator:
    """Collects the contributions to every chunk of one bucket for one round.

    Per chunk it is a :class:`ChunkAccumulator` (same checks, same refusals with the
    same codes and reasons, idempotent retries, bit for bit the same mean: fp32 sums in
    sender-id order, the first sender copied, each next one added, then divided by the
    count), but it takes a *run* of neighbouring chunks from one sender at once
    (:meth:`add_run`; ascending chunks, gaps allowed) and does its work per run: one finiteness check (and one norm per
    row for ``max_norm``) over the run's values, and the running sums of the whole
    bucket in one fp32 tensor, folded with one ``copy_`` / ``add_`` per stretch of
    neighbouring chunks whose turn it is (the per-chunk work left is a few dict
    operations). A contribution that arrives ahead of its turn is held as a view of its
    run's values (as :class:`ChunkAccumulator` holds it) until the senders before it
    arrive or :meth:`finalize`; with robust options every contribution is held until
    then and each chunk's mean is :func:`partial_mean` of its contributions.
    Thread-safety: callers hold the owning round's lock.

    Args:
        numels: elements of each chunk, in chunk order (a run's values are its chunks'
            concatenated in that order).
        config: robust options.
        order: the senders expected (the round's members); None folds nothing before
            :meth:`finalize`.
        weights: token weighting (module docstring): sender -> weight factor fᵢ, a mapping
            the caller fills as senders' claims arrive (a sender's factor must be in it
            before its first contribution is added, and never change); a sender not in it
            counts 1.0. None: unweighted.
    """

    def __init__(
        self,
        numels: Sequence[int],
        config: AggregationConfig,
        order: Iterable[str] | None = None,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        self.numels = tuple(int(n) for n in numels)
        self.config = config
        self.weights = weights
        self._pos = list(itertools.accumulate(self.numels, initial=0))  # chunk c is [pos[c], pos[c+1])
        self._order = sorted(order) if order is not None else []
        self._next = [0] * len(self.numels)  # senders order[:next[c]] are folded into chunk c's sum
        self._sum: torch.Tensor | None = None  # the bucket's running sums (allocated at the first fold)
        self._nnz: torch.Tensor | None = None  # sparse_mean: per element, the contributions nonzero there
        self._digests: list[dict[str, bytes]] = [{} for _ in self.numels]
        # sender -> (its run's values, element offset of the chunk in them): held until folded
        self._held: list[dict[str, tuple[torch.Tensor, int]]] = [{} for _ in self.numels]
        self.trimmed: collections.Counter[str] = collections.Counter()  # sender -> elements the trim cut
        self._final: BucketReduction | None = None

    # ------------------------------------------------------------------ queries
    @property
    def num_chunks(self) -> int:
        return len(self.numels)

    @property
    def num_held(self) -> int:
        """Contributions held as (views of) tensors: every one with robust options, else
        those that arrived ahead of their turn in the sum."""
        return sum(len(h) for h in self._held)

    def digest(self, chunk: int, sender: str) -> bytes | None:
        """The key (the payload, or a digest of it) counted from ``sender`` for ``chunk`` (None: none yet)."""
        return self._digests[chunk].get(sender)

    def digests(self, chunk: int) -> dict[str, bytes]:
        """Sender -> the key counted from it for ``chunk`` (a copy)."""
        return dict(self._digests[chunk])

    # ------------------------------------------------------------------ transitions
    def add(self, sender: str, chunk: int, values: torch.Tensor, digest: bytes) -> bool:
        """:meth:`ChunkAccumulator.add` for chunk ``chunk``: False for an identical retry.

        Raises:
            Rejected: as :meth:`ChunkAccumulator.add`.
        """
        n = self.numels[chunk]
        if values.dtype != torch.float32 or values.dim() != 1 or values.numel() != n:
            raise Rejected(
                RejectCode.INVALID_ARGUMENT,
                f"contribution has {values.numel()} {values.dtype} values, expected {n} float32",
            )
        (result,) = self.add_run(sender, [chunk], values, [digest])
        if isinstance(result, Rejected):
            raise result
        return bool(result)

    def add_run(
        self, sender: str, chunks: Sequence[int], values: torch.Tensor | CheckedRun, digests: Sequence[bytes | None]
    ) -> list[bool | Rejected | None]:
        """Add ``sender``'s contributions to ``chunks`` (a run: ascending chunk indices, gaps
        allowed, e.g. a sender's datagrams that arrived), as :meth:`add` of each in turn.

        Args:
            sender: the sender of every chunk of the run.
            chunks: the run's chunk indices, strictly ascending.
            values: 1-D fp32, the run's chunks' values concatenated in that order, or a
                :class:`~dtrain.codecs.base.CheckedRun` of them: decoded straight into the sums
                when the run folds in its turn unweighted (finite by construction: no check),
                else decoded first.
            digests: per chunk of the run, its payload's key (the payload itself, or a
                digest of it: a retry counts as identical when its key is equal); None skips the
                chunk (refused before: its values are ignored).
        Returns:
            Per chunk: True (counted), False (an identical retry: a no-op), the
            :class:`Rejected` that :meth:`ChunkAccumulator.add` would raise for it
            (ALREADY_EXISTS, or INVALID_ARGUMENT for NaN/Inf or a norm over
            ``max_norm``; the others of the run are counted), or None (skipped).
        Raises:
            ValueError: ``chunks`` not ascending or out of range, ``digests`` of another
                length, or ``values`` not 1-D fp32 of the run's element count (caller bugs).
        """
        fast = self._add_in_turn(sender, chunks, values, digests)
        if fast is not None:
            return fast
        if isinstance(values, CheckedRun):
            values = values.tensor()
        starts = self._starts(chunks, digests, values)
        out: list[bool | Rejected | None] = [None] * len(chunks)
        todo = []  # indices in the run of the chunks still to check and count
        for j, (c, d) in enumerate(zip(chunks, digests)):
            if d is None:
                continue
            had = self._digests[c].get(sender)
            if had is None:
                todo.append(j)
            elif had == d:
                out[j] = False
            else:
                out[j] = Rejected(
                    RejectCode.ALREADY_EXISTS,
                    f"a different contribution from {sender} for this chunk was already accepted",
                )
        if todo:
            todo = self._check_values(chunks, starts, values, todo, out)
        for j in todo:
            c = chunks[j]
            self._digests[c][sender] = digests[j]
            self._held[c][sender] = (values, starts[j])
            out[j] = True
        if todo and not self.config.robust:
            self._fold_in_turn([chunks[j] for j in todo])
        return out

    def _add_in_turn(
        self, sender: str, chunks: Sequence[int], values: torch.Tensor | CheckedRun, digests: Sequence[bytes | None]
    ) -> list[bool | Rejected | None] | None:
        """:meth:`add_run`'s usual case without per-chunk Python: consecutive chunks, a digest
        for each, none counted from ``sender`` yet, none held, and ``sender``'s turn in every
        chunk's sum (each has folded the same senders before it), values that pass the checks:
        counted and folded with one ``copy_`` / ``add_``, the same values as the general path.
        None (nothing changed) for any other case, which the general path takes."""
        m, order = len(chunks), self._order
        if self.config.robust or m < 2 or len(digests) != m or None in digests:
            return None
        c0 = chunks[0]
        c1, pos = c0 + m, self._pos
        if c0 < 0 or c1 > len(self.numels) or tuple(chunks) != tuple(range(c0, c1)):
            return None
        k = self._next[c0]
        if k >= len(order) or order[k] != sender or self._next[c0:c1].count(k) != m:
            return None
        if any(self._held[c0:c1]) or any(sender in d for d in self._digests[c0:c1]):
            return None
        w = self._factor(sender)
        if isinstance(values, CheckedRun):  # finite by construction: checked only for max_norm
            if values.numel() != pos[c1] - pos[c0]:
                return None
            if self.config.max_norm is not None or w != 1.0 or self.config.sparse_mean:
                values = values.tensor()
        elif values.dtype != torch.float32 or values.dim() != 1 or values.numel() != pos[c1] - pos[c0]:
            return None  # the general path names the problem
        if isinstance(values, torch.Tensor):
            out: list[bool | Rejected | None] = [None] * m
            if len(self._check_values(chunks, [p - pos[c0] for p in pos[c0:c1]], values, list(range(m)), out)) != m:
                return None  # a refused chunk: the general path refuses it and counts the others
        list(map(dict.__setitem__, self._digests[c0:c1], itertools.repeat(sender), digests))
        sums = self._sums(pos[c0], pos[c1])
        if isinstance(values, CheckedRun):
            values.decode_into(sums[0], add=k != 0)  # copy_ / add_ of the decoded values, bit for bit
        else:
            self._fold(sums, values, k == 0, w)
        self._next[c0:c1] = [k + 1] * m
        return [True] * m

    def _starts(self, chunks: Sequence[int], digests: Sequence, values: torch.Tensor) -> list[int]:
        """Where each chunk of a run starts in its ``values`` (checking the run's shape)."""
        starts, total, prev = [], 0, -1
        for c in chunks:
            if not prev < c < len(self.numels):
                raise ValueError(f"run chunks {list(chunks)} not ascending in [0, {len(self.numels)})")
            starts.append(total)
            total += self.numels[c]
            prev = c
        if len(digests) != len(chunks):
            raise ValueError(f"{len(digests)} digests for {len(chunks)} chunks")
        if values.dtype != torch.float32 or values.dim() != 1 or values.numel() != total:
            raise ValueError(f"run needs {total} float32 values, got {values.numel()} {values.dtype}")
        return starts

    def _check_values(
        self, chunks: Sequence[int], starts: list[int], values: torch.Tensor, todo: list[int], out: list
    ) -> list[int]:
        """The chunks of ``todo`` (indices in the run) whose values are finite and within
        ``max_norm``; the others get their refusal in ``out`` (ChunkAccumulator.add's
        codes and reasons). One check over the whole run; chunk by chunk only where it fails."""

        def row(j: int) -> torch.Tensor:
            return values[starts[j] : starts[j] + self.numels[chunks[j]]]

        # A sum is finite only if every value is (NaN propagates, inf - inf is NaN); a finite
        # run whose sum overflows is checked chunk by chunk too. ~40x cheaper than isfinite().all().
        if not math.isfinite(float(values.sum())):
            kept = []
            for j in todo:
                if bool(torch.isfinite(row(j)).all()):
                    kept.append(j)
                else:
                    out[j] = Rejected(RejectCode.INVALID_ARGUMENT, "contribution contains NaN or Inf values")
            todo = kept
        bound = self.config.max_norm
        if bound is None or not todo:
            return todo
        n = self.numels[chunks[0]]
        if n and all(self.numels[c] == n for c in chunks):
            fast = torch.linalg.vector_norm(values.view(len(chunks), n), dim=1).tolist()  # one reduction per row
        else:
            fast = [float("inf")] * len(chunks)
        kept = []
        for j in todo:
            if fast[j] < bound * (1.0 - _NORM_MARGIN):
                kept.append(j)
                continue
            norm = float(torch.linalg.vector_norm(row(j)))  # near the bound: the chunk's own norm decides
            if norm > bound:
                out[j] = Rejected(
                    RejectCode.INVALID_ARGUMENT, f"contribution norm {norm:.4g} exceeds max_norm {bound:.4g}"
                )
            else:
                kept.append(j)
        return kept

    def _fold_in_turn(self, chunks: Iterable[int]) -> None:
        """Fold into the sums the held contributions of ``chunks`` whose turn came: for each
        chunk, the senders of ``order`` from its next one on while they are held."""
        order, ops = self._order, []
        for c in chunks:
            held, k = self._held[c], self._next[c]
            while k < len(order) and order[k] in held:
                base, start = held.pop(order[k])
                ops.append((k, c, base, start, k == 0, self._factor(order[k])))
                k += 1
            self._next[c] = k
        self._apply(ops)

    def _factor(self, sender: str) -> float:
        return 1.0 if self.weights is None else self.weights.get(sender, 1.0)

    def _apply(self, ops: list[tuple[int, int, torch.Tensor, int, bool, float]]) -> None:
        """Run folds ``(step, chunk, values, offset in values, first, weight factor)``: each
        chunk's in the order of its steps (the sum's order), one ``copy_`` (a chunk's first
        sender) or ``add_`` per stretch of neighbouring chunks at one step whose values lie
        one after another in one run's tensor; a factor other than 1.0 scales the values
        (``mul`` / ``add_`` with ``alpha``), 1.0 runs exactly the unweighted operations."""
        if not ops:
            return
        ops.sort(key=lambda op: (op[0], op[1]))
        pos, numels, i = self._pos, self.numels, 0
        while i < len(ops):
            step, c0, base, start, first, w = ops[i]
            c, stop, i = c0, start + numels[c0], i + 1
            while i < len(ops):
                s2, c2, b2, st2, f2, w2 = ops[i]
                if s2 != step or c2 != c + 1 or b2 is not base or st2 != stop or f2 != first or w2 != w:
                    break
                c, stop, i = c2, stop + numels[c2], i + 1
            self._fold(self._sums(pos[c0], pos[c + 1]), base[start:stop], first, w)

    def _sums(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The running sums of elements ``[a, b)`` (and their nonzero counts under
        ``sparse_mean``), allocated at the first fold."""
        if self._sum is None:
            self._sum = torch.empty(self._pos[-1], dtype=torch.float32)
            if self.config.sparse_mean:
                self._nnz = torch.zeros(self._pos[-1], dtype=torch.float32)
        return self._sum[a:b], None if self._nnz is None else self._nnz[a:b]

    @staticmethod
    def _fold(sums: tuple[torch.Tensor, torch.Tensor | None], src: torch.Tensor, first: bool, w: float) -> None:
        """One fold of ``src`` into ``sums``: copied (the chunks' first sender) or added, scaled
        by ``w`` unless it is 1.0 (then exactly the unweighted operations)."""
        dst, nnz = sums
        if w != 1.0:
            if first:
                torch.mul(src, w, out=dst)
            else:
                dst.add_(src, alpha=w)
        elif first:
            dst.copy_(src)
        else:
            dst.add_(src)
        if nnz is not None:
            nnz.add_((src != 0).to(torch.float32))

    def finalize(self) -> BucketReduction:
        """Per chunk, the unbiased partial mean (:func:`partial_mean`), as columns: the sums divided
        in place (a second call returns the same), or with robust options each chunk's copied in."""
        if self.config.robust:
            cfg, w, cut = self.config, self.weights, self.trimmed
            held = zip(self._held, self.numels)
            means = [partial_mean({s: v[o : o + n] for s, (v, o) in h.items()}, cfg, w, cut) for h, n in held]
            return BucketReduction.of_chunks(self.numels, means)
        if self._final is not None:
            return self._final
        ops = []
        for c in [c for c, held in enumerate(self._held) if held]:  # the rest, in sender order after the prefix
            held = self._held[c]
            k, first = self._next[c], self._next[c] == 0
            for s in sorted(held):
                base, start = held[s]
                ops.append((k, c, base, start, first, self._factor(s)))
                k, first = k + 1, False
            held.clear()
        self._apply(ops)
        self._final = self._means()
        return self._final

    def _means(self) -> BucketReduction:
        """sum / count per chunk, divided in place in the sums: one division when every chunk
        has the same count, else one per stretch of chunks of one size, the sums as rows over
        a column of counts (float32 division is exactly rounded: the same values as dividing
        each chunk by its count). Weighted: the count times f̄ (1.0 for equal claims, so the
        same divisors)."""
        sorted_keys: dict[tuple[str, ...], tuple[str, ...]] = {}  # the chunks mostly share one sender set
        senders = []
        for d in self._digests:
            key = tuple(d)
            got = sorted_keys.get(key)
            if got is None:
                got = sorted_keys[key] = tuple(sorted(key))
            senders.append(got)
        if self._sum is None:
            return BucketReduction(None, self.numels, senders)
        pos = self._pos
        if self._nnz is not None:  # sparse_mean: per element over the contributions nonzero there
            return BucketReduction(self._sum / self._nnz.clamp(min=1.0), self.numels, senders)
        fbar = mean_factor(self.weights)
        mean = self._sum  # divided in place: the sums are not read again (finalize keeps its result)
        if len(set(map(len, senders))) == 1:  # every chunk the same count: one division by it
            mean.div_(len(senders[0]) * fbar)
        else:
            counts = torch.tensor([len(s) * fbar for s in senders], dtype=torch.float32)
            for a, b in equal_runs(self.numels):
                mean[pos[a] : pos[b]].view(b - a, self.numels[a]).div_(counts[a:b].unsqueeze(1))
        return BucketReduction(mean, self.numels, senders)
