"""Top-k sparsification: keep the k largest |x|, send their indices and values.

Every element not kept decodes to 0, so top-k is only sound with error feedback: the
residual (what was dropped) is added to the next round's Δ (docs/ARCHITECTURE.md, "The
residual rule"). Hence ``needs_error_feedback = True``.

Why this is not SparseLoCo's compressor (that is :mod:`dtrain.codecs.sparse`, ``sparseloco``):
the top-k here is over the whole payload, not per chunk, so a few large tensors' entries
can take every slot and the rest of the model gets none for rounds; k scales with numel
(``topk_fraction``), not per chunk; the index gaps are 32-bit and the values fp16 (6 bytes
per kept entry against ~1.75 for sparseloco's 12-bit indices and 2-bit values); and its size
does not decompose per chunk, so the datagram path refuses it. It stays as the plain,
exact global top-k reference; its poor convergence in experiments/RESULTS.md (+69.6 % at 20
rounds) comes mostly from the run's setting, not the codec: see docs/DECISIONS.md, "Codecs
and error feedback".
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dtrain.codecs.base import (
    SLACK,
    TINY,
    Codec,
    absmax_checked,
    from_scaled_fp16,
    np_view,
    pow2_exponent,
    t_view,
    to_scaled_fp16,
)
from dtrain.errors import CodecError

__all__ = ["TopKCodec", "topk_indices"]

_SAMPLE = 1 << 14


class TopKCodec(Codec):
    """int32 exponent e, k uint32 index gaps, k float16 values scaled by 2^-e.

    k = ceil(topk_fraction * numel), at least 1 for a non-empty tensor. Indices are
    sorted ascending and stored as gaps (the first gap is the first index): gaps are
    small and zstd compresses their zero high bytes. Values are float16 with the
    per-tensor power-of-two scale of the fp16 codec (not int8 with one scale): the kept
    values span from the threshold to max|x|, and fp16 keeps 2^-11 relative precision
    on all of them. 6 bytes per kept element before zstd.

    Error bound: max(largest dropped |x|, 2^-11 max|x|).
    """

    base = "topk"
    needs_error_feedback = True
    _param_name = "k"

    def _param(self, numel):
        return self.k_for(numel)

    def k_for(self, numel: int) -> int:
        """The number of kept elements for a tensor of ``numel`` elements."""
        if numel == 0:
            return 0
        return min(numel, max(1, math.ceil(self.config.topk_fraction * numel)))

    def _body_bytes(self, numel):
        k = self.k_for(numel)
        return 4 + 6 * k if k else 0

    def _encode_into(self, x, out, generator):
        absmax_checked(x)
        k = self.k_for(x.numel())
        idx = topk_indices(x, k)
        vals = x[idx]
        e = pow2_exponent(float(vals.abs().max()))
        t_view(out, np.int32, 1)[0] = e
        gaps = t_view(out, np.int32, k, 4)
        gaps[0] = idx[0]
        if k > 1:
            torch.sub(idx[1:], idx[:-1], out=gaps[1:])
        to_scaled_fp16(vals, e, t_view(out, np.float16, k, 4 + 4 * k))

    def _decode_body(self, body, numel):
        k = self.k_for(numel)
        e = int(np_view(body, np.int32, 1)[0])
        vals = from_scaled_fp16(np_view(body, np.float16, k, 4 + 4 * k), e)
        gaps = torch.from_numpy(np_view(body, np.uint32, k, 4).astype(np.int64))
        if k > 1 and bool((gaps[1:] == 0).any()):
            raise CodecError("corrupted payload: topk indices are not strictly increasing")
        idx = torch.cumsum(gaps, 0)
        if int(idx[-1]) >= numel:
            raise CodecError(f"corrupted payload: topk index {int(idx[-1])} out of range for {numel} elements")
        out = torch.zeros(numel, dtype=torch.float32)
        out[idx] = vals
        return out

    def _max_error(self, x, absmax):
        n = x.numel()
        k = self.k_for(n)
        dropped = float(torch.kthvalue(x.abs(), n - k).values) if k < n else 0.0
        return max(dropped, absmax * 2.0**-11) * SLACK + TINY


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 indices of the k largest |x| (ties broken by position).

    ``torch.topk`` over millions of elements runs at ~40 MB/s on one CPU core, so a
    threshold is estimated from a fixed-seed random sample of 16384 |x| (aiming at
    about 2k candidates), the candidates at or above it are collected in index order
    with one numpy compare + flatnonzero, and exactly k are kept from those with a
    k-th-value cut. If the sample over-estimates the threshold (fewer than k
    candidates), it is lowered once (8k); the last resort is a full topk. Exact
    either way.
    """
    n = x.numel()
    if k * 8 >= n or n < 4 * _SAMPLE:
        return torch.topk(x.abs(), k, sorted=False).indices.sort().values
    x_np = x.numpy()
    g = torch.Generator().manual_seed(0x5EED)
    sample = x[torch.randint(n, (_SAMPLE,), generator=g)].abs_()
    for mult in (2.0, 8.0):
        rank = min(_SAMPLE - 1, int(_SAMPLE * k / n * mult) + 1)
        thr = float(torch.kthvalue(sample, _SAMPLE - rank).values)
        cand = np.flatnonzero(np.abs(x_np) >= thr)
        if cand.size >= k:
            cand_t = torch.from_numpy(cand)
            return cand_t[_keep_k_largest(x[cand_t].abs_(), k)]
    return torch.topk(x.abs(), k, sorted=False).indices.sort().values


def _keep_k_largest(vals: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask selecting exactly k of the largest ``vals`` (the first of equal
    values at the cut), so that masking keeps the original order."""
    c = vals.numel()
    if c == k:
        return torch.ones(c, dtype=torch.bool)
    cut = torch.kthvalue(vals, c - k + 1).values  # the k-th largest value
    keep = vals > cut
    need = k - int(keep.sum())
    if need:
        keep[(vals == cut).nonzero().squeeze(1)[:need]] = True
    return keep
