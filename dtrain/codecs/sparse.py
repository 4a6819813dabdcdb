"""SparseLoCo's compressor: chunk-wise top-k, low-bit values, packed chunk-local indices.

SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training
with SparseLoCo", arXiv 2508.15706, Algorithm 1), for worker r in outer step t::

    Δ_r^(t) = θ^(t-1) − θ_r^(t)            pseudo-gradient after H inner AdamW steps
    e_r     ← β·e_r + Δ_r^(t)              error feedback with decay β (paper: 0.95)
    Δ̂_r^(t) = Q(TopK(e_r))                 chunk-wise top-k, then a 2-bit quantizer Q
    e_r     ← e_r − Δ̂_r^(t)                what was not sent stays
    Δ^(t)   = (1/R)·Σ_r Δ̂_r^(t)            the mean over the R workers
    θ^(t)   = θ^(t-1) − α·Δ^(t)            outer SGD, learning rate α, no outer momentum

This codec is Q∘TopK. The rest maps onto dtrain as follows: e_r is the site's residual
(:mod:`dtrain.rounds.error_feedback`: :func:`~dtrain.rounds.error_feedback.add_pseudo_gradient`
applies β = ``RoundConfig.error_feedback_decay``; the settle step is e_r − Δ̂_r for chunks a
mean included); the mean is the owners' (unbiased per chunk: divided by the senders that
arrived); the outer step is ``OuterConfig`` with ``lr`` α and ``momentum`` 0 (the paper's
point: the decayed accumulator e_r stands in for DiLoCo's outer Nesterov momentum, so
momentum on top counts it twice).

Body of a payload of n elements (C = ``sparse_chunk``, k = ``sparse_k``, b =
``sparse_bits``, w = log2 C, L = 2^(b−1) magnitude levels). The input is cut into
R = ceil(n / C) chunks; a full chunk keeps k entries, the last chunk of m < C elements keeps
k_m = min(m, max(1, ceil(k·m / C))); K is the total kept::

    offset          size            field
    0               8·R             per chunk: lo, hi (float32): smallest and largest kept |x|
    8R              ceil(K·w / 8)   indices: per chunk, its kept chunk-local indices ascending,
                                    w bits each, one LSB-first bit stream over all chunks
    8R + I          ceil(K·b / 8)   codes: per kept entry in index order, b bits LSB-first:
                                    magnitude level (b−1 low bits) | sign << (b−1)

Unused bits of the last byte of each stream are zero. Decoding: |x̂| = lo + (hi − lo)·(level
+ ½) / L (at most hi), negated when the sign bit is set; every other element is 0. The size
depends on n and the config only, so a payload (one datagram on the datagram path, whole
chunks per datagram) decodes on its own.

Error bound per element: a kept one is off by at most (hi − lo) / (2L) of its chunk; a
dropped one by |x| <= lo. Hence max over chunks of max(lo, (hi − lo) / (2L)). With C = 4096,
k = 64, b = 2: 8 + 96 + 16 = 120 bytes per 16 KiB of fp32 (1/136.5).

Selection is exact (ties broken arbitrarily) without a full top-k per chunk: the k largest
of a chunk lie in the k groups of g ~ sqrt(C / k) neighbours whose max |x| is largest (an
element outside them is beaten by k group maxima), so one max-reduction per group, a top-k
over the C / g group maxima and a top-k over the k·g candidates replace a top-k over C
(torch.topk over rows of 4096 runs at ~200 MB/s on one core).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from dtrain.codecs.base import SLACK, TINY, Codec, non_finite_error, np_view, t_view
from dtrain.codecs.config import CodecConfig
from dtrain.errors import CodecError

__all__ = ["SparseLoCoCodec", "chunk_topk", "pack_bits", "unpack_bits"]


class SparseLoCoCodec(Codec):
    """Chunk-wise top-k of ``sparse_k`` per ``sparse_chunk`` elements, ``sparse_bits``-bit
    values with a (lo, hi) float32 range per chunk, indices in log2(chunk) bits (layout in
    the module docstring). Needs error feedback: what it drops stays in the residual.

    The header's codec parameter is log2(chunk) | bits << 8 | k << 16.
    """

    base = "sparseloco"
    needs_error_feedback = True
    _param_name = "sparseloco parameter (log2 chunk | bits << 8 | k << 16)"

    def __init__(self, config: CodecConfig) -> None:
        super().__init__(config)
        self._C = config.sparse_chunk
        self._k = config.sparse_k
        self._b = config.sparse_bits
        self._w = self._C.bit_length() - 1
        self._L = 1 << (self._b - 1)
        self._bs = self._C  # elements per self-contained unit: the datagram path cuts whole chunks

    def _param(self, numel):
        return self._w | self._b << 8 | self._k << 16

    def _tail_k(self, m: int) -> int:
        """Entries kept from a last chunk of ``m`` (< chunk) elements."""
        return min(m, max(1, -(-self._k * m // self._C))) if m else 0

    def _counts(self, numel: int) -> tuple[int, int, int, int]:
        """(full chunks, tail elements, tail kept, total kept K) for ``numel`` elements."""
        full, m = divmod(numel, self._C)
        km = self._tail_k(m)
        return full, m, km, full * self._k + km

    def _layout(self, numel: int) -> tuple[int, int, int]:
        """(chunks R, index bytes, code bytes)."""
        full, m, _, kk = self._counts(numel)
        return full + (1 if m else 0), -(-kk * self._w // 8), -(-kk * self._b // 8)

    def _body_bytes(self, numel):
        if numel == 0:
            return 0
        r, ib, cb = self._layout(numel)
        return 8 * r + ib + cb

    # ------------------------------------------------------------------ encode
    def _select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indices (K,) chunk-local, kept values (K,), lo (R,), hi (R,)); CodecError on NaN/inf."""
        n = x.numel()
        full, m, km, _ = self._counts(n)
        parts = []
        if full:
            xv = x[: full * self._C].view(full, self._C)
            idx = chunk_topk(xv, self._k)
            if idx is None:
                raise non_finite_error(x)
            parts.append((idx, xv.gather(1, idx)))
        if m:
            tail = x[full * self._C :].view(1, m)
            idx = torch.topk(tail.abs(), km, dim=1, sorted=False).indices.sort(dim=1).values
            vals = tail.gather(1, idx)
            parts.append((idx, vals))
        mags = [v.abs() for _, v in parts]
        lo = torch.cat([a.amin(1) for a in mags])
        hi = torch.cat([a.amax(1) for a in mags])
        if not math.isfinite(float(hi.max())):
            raise non_finite_error(x)
        return (
            torch.cat([i.reshape(-1) for i, _ in parts]),
            torch.cat([v.reshape(-1) for _, v in parts]),
            lo,
            hi,
        )

    def _chunk_of(self, numel: int) -> torch.Tensor:
        """Per kept entry (K,), the index of its chunk."""
        full, m, km, _ = self._counts(numel)
        rows = torch.arange(full).repeat_interleave(self._k)
        return torch.cat([rows, torch.full((km,), full, dtype=torch.long)]) if m else rows

    def _encode_into(self, x, out, generator):
        n = x.numel()
        r, ib, cb = self._layout(n)
        idx, vals, lo, hi = self._select(x)
        scales = t_view(out, np.float32, 2 * r).view(r, 2)
        scales[:, 0] = lo
        scales[:, 1] = hi
        step = (hi - lo) / self._L  # per chunk
        inv = torch.where(step > 0, 1.0 / step, 0.0)
        ch = self._chunk_of(n)
        level = (vals.abs() - lo[ch]).mul_(inv[ch]).floor_().clamp_(0, self._L - 1).to(torch.int64)
        code = level | (vals < 0).to(torch.int64) << (self._b - 1)
        out[8 * r : 8 * r + ib] = pack_bits(idx, self._w)
        out[8 * r + ib : 8 * r + ib + cb] = pack_bits(code, self._b)

    # ------------------------------------------------------------------ decode
    def _decode_body(self, body, numel):
        full, m, km, kk = self._counts(numel)
        r, ib, cb = self._layout(numel)
        scales = torch.from_numpy(np_view(body, np.float32, 2 * r).copy()).view(r, 2)
        lo, hi = scales[:, 0], scales[:, 1]
        if not (bool(torch.isfinite(scales).all()) and bool((lo >= 0).all()) and bool((hi >= lo).all())):
            raise CodecError("corrupted payload: sparseloco chunk ranges must be finite with 0 <= lo <= hi")
        idx = unpack_bits(np_view(body, np.uint8, ib, 8 * r), kk, self._w, "indices")
        code = unpack_bits(np_view(body, np.uint8, cb, 8 * r + ib), kk, self._b, "codes")
        ch = self._chunk_of(numel)
        level = (code & (self._L - 1)).to(torch.float32)
        mag = torch.minimum(lo[ch] + (hi - lo)[ch] / self._L * (level + 0.5), hi[ch])  # finite: <= hi
        vals = torch.where(code >> (self._b - 1) == 1, -mag, mag)
        out = torch.zeros(numel, dtype=torch.float32)
        if full:
            fi = idx[: full * self._k].view(full, self._k)
            if self._k > 1 and not bool((fi[:, 1:] > fi[:, :-1]).all()):
                raise CodecError("corrupted payload: sparseloco indices of a chunk are not strictly increasing")
            out[: full * self._C].view(full, self._C).scatter_(1, fi, vals[: full * self._k].view(full, self._k))
        if m:
            ti = idx[full * self._k :]
            if (km > 1 and not bool((ti[1:] > ti[:-1]).all())) or int(ti[-1]) >= m:
                raise CodecError(
                    f"corrupted payload: sparseloco indices of the last chunk ({m} elements) are not "
                    "strictly increasing and in range"
                )
            out[full * self._C :][ti] = vals[full * self._k :]
        return out

    def _max_error(self, x, absmax):
        _, _, lo, hi = self._select(x)
        return max(float(lo.max()), float((hi - lo).max()) / (2 * self._L)) * SLACK + TINY


def chunk_topk(xv: torch.Tensor, k: int) -> torch.Tensor | None:
    """Per row of ``xv`` (R, C), the column indices of its k largest |x|, ascending (R, k)
    int64; None when ``xv`` holds NaN or inf.

    Exact up to ties: groups of g ~ sqrt(C / k) neighbours (a power of two, >= 4, with at
    least 2k groups; else a plain top-k) are reduced to their max |x|, the k largest groups
    kept, and the k largest of their k·g elements taken (see the module docstring for why
    nothing is missed): two top-k over ~2·sqrt(C·k) values instead of one over C."""
    rows, c = xv.shape
    g = 1 << max(0, int(math.sqrt(c / k)).bit_length() - 1)
    while g > 1 and c // g < 2 * k:
        g >>= 1
    a = xv.abs()
    if g < 4:
        if not math.isfinite(float(a.max())):
            return None
        return torch.topk(a, k, dim=1, sorted=False).indices.sort(dim=1).values
    gm = F.max_pool1d(a.unsqueeze(1), g).squeeze(1)  # (R, C / g); NaN propagates
    if not math.isfinite(float(gm.max())):
        return None
    gi = torch.topk(gm, k, dim=1, sorted=False).indices
    cand = a.view(rows, c // g, g).gather(1, gi.unsqueeze(-1).expand(rows, k, g)).reshape(rows, k * g)
    ci = torch.topk(cand, k, dim=1, sorted=False).indices
    shift = g.bit_length() - 1
    idx = (gi.gather(1, ci >> shift) << shift) | (ci & (g - 1))
    return idx.sort(dim=1).values


_SHIFTS = {w: torch.arange(w, dtype=torch.int64) for w in range(1, 17)}
_WEIGHTS = {w: (1 << np.arange(w, dtype=np.int64)) for w in range(1, 17)}


def pack_bits(v: torch.Tensor, width: int) -> np.ndarray:
    """The non-negative ints ``v`` (N,) as one LSB-first stream of ``width`` bits each:
    ceil(N·width / 8) uint8 (the unused high bits of the last byte are 0)."""
    bits = ((v.reshape(-1, 1) >> _SHIFTS[width]) & 1).to(torch.uint8)
    return np.packbits(bits.numpy().reshape(-1), bitorder="little")


def unpack_bits(buf: np.ndarray, count: int, width: int, what: str = "bits") -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` ints (int64) of ``width`` bits from ``buf``.

    Raises:
        CodecError: ``buf`` is not exactly ceil(count·width / 8) bytes, or the unused bits
            of its last byte are not 0 (``what`` names the stream).
    """
    nbits = count * width
    if buf.size != -(-nbits // 8):
        raise CodecError(f"corrupted payload: sparseloco {what} take {buf.size} bytes, expected {-(-nbits // 8)}")
    if nbits % 8 and int(buf[-1]) >> (nbits % 8):
        raise CodecError(f"corrupted payload: sparseloco {what} padding bits are not zero")
    bits = np.unpackbits(buf, count=nbits, bitorder="little").reshape(count, width)
    return torch.from_numpy(bits.astype(np.int64) @ _WEIGHTS[width])
