"""Error feedback: the residual arithmetic of a site (docs/ARCHITECTURE.md, "The residual rule").

A site keeps one fp32 residual per bucket: what its contributions have not yet
delivered to θ. Before a round the pseudo-gradient Δ = θ − θ_local is added to it
(:func:`add_pseudo_gradient`); the residual ``u`` is what the site encodes and sends.
After the round each chunk of ``u`` is settled (:func:`settle_chunk`):

* included — a finalized mean counted this site's chunk: it is consumed, less what the
  codec lost: ``u − decode(encode(u))`` (0 for a lossless codec). It is never sent
  again, even if this site missed the broadcast (the bucket is repaired instead).
* not included (lost, late, rejected), and a mean was applied to that chunk: keep
  ``u − A``, where ``A`` is the applied mean. The owner divided by the senders that
  arrived, so ``A`` already stood in for this contribution once; keeping all of ``u``
  would count it twice (a systematic overshoot of ~p·(N−1)/N under chunk loss p).
  Summed over sites this makes N·A = Σ_i u_i − Σ_i residual_i, so over rounds the
  applied means add up to the true mean of every Δ, less what is still in the
  residuals.
* not included and no mean applied (owner gone, empty chunk; or this site missed the
  mean and was repaired, so it knows which chunks were included but not ``A``): ``u``
  stays whole.

Error feedback for lossy compression: Seide et al. 2014 ("1-bit SGD"), Karimireddy et
al. 2019 ("EF-SGD"); for lost exchanges, the unbiased partial mean of Weintraub et al.
(arXiv 2507.07114).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Sequence

import torch

from dtrain.buckets import Bucket, BucketLayout
from dtrain.codecs import Codec
from dtrain.codecs.base import equal_runs, per_chunk_list
from dtrain.codecs.native import kernels
from dtrain.errors import CodecError

__all__ = ["add_pseudo_gradient", "included_chunks", "settle_bucket", "settle_chunk"]


def _pseudo_gradient_into(
    out: torch.Tensor, theta_b: torch.Tensor, bucket: Bucket, tensors: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``out`` ← Δ_b = θ_b − local_b, with θ rounded to the model's dtype where a tensor is not
    fp32 (a bf16/fp16 model was reset to θ rounded to its dtype: measure Δ from there, so
    rounding alone is not mistaken for progress).

    Each segment is one subtraction straight from the model's tensor (no gathered copy of
    the bucket first); a tensor on another device than θ is copied over first."""
    for sg in bucket.segments:
        src = tensors[sg.tensor_index].detach().reshape(-1)[sg.tensor_offset : sg.tensor_offset + sg.numel]
        dst = out[sg.bucket_offset : sg.bucket_offset + sg.numel]
        ref = theta_b[sg.bucket_offset : sg.bucket_offset + sg.numel]
        dtype = src.dtype
        if dtype != torch.float32:
            ref = ref.to(dtype).float()
        if src.device != out.device or dtype != torch.float32:
            src = dst.copy_(src)  # in fp32 on θ's device: exact for every float dtype
        torch.sub(ref, src, out=dst)
    return out


def _accumulates_in_place(
    r: torch.Tensor, theta_b: torch.Tensor, bucket: Bucket, tensors: Sequence[torch.Tensor]
) -> bool:
    """Whether the compiled accumulation serves this bucket: ``r``, ``θ_b`` and every source
    tensor float32, contiguous and on the CPU (else the torch path: other dtypes round θ)."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in (r, theta_b)):
        return False
    for sg in bucket.segments:
        t = tensors[sg.tensor_index]
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            return False
    return True


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite: one min/max pass (NaN propagates), no mask."""
    if t.numel() == 0:
        return True
    lo, hi = (float(v) for v in torch.aminmax(t))
    return math.isfinite(lo) and math.isfinite(hi)


def add_pseudo_gradient(
    layout: BucketLayout,
    theta: list[torch.Tensor],
    residuals: list[torch.Tensor | None],
    tensors: list[torch.Tensor],
    *,
    error_feedback: bool,
    buckets: Sequence[int] | None = None,
    decay: float = 1.0,
    codec: Codec | None = None,
    encoded: dict[int, Any] | None = None,
) -> bool:
    """Set ``residuals[b] ← decay·residuals[b] + (θ_b − local_b)`` for every bucket, in place.

    Args:
        layout: how the model's tensors map to buckets.
        theta: θ per bucket (1-D fp32).
        residuals: per bucket, the residual (1-D fp32) or None (nothing kept); updated.
        tensors: the model's current (local) tensors, as ``layout`` expects.
        error_feedback: False replaces each residual with Δ_b (nothing carried over).
        buckets: only these buckets (a fragment round); None: all.
        decay: β of SparseLoCo's error feedback e ← β·e + Δ (arXiv 2508.15706, Algorithm 1;
            0.95 there), in (0, 1]; 1 keeps everything not yet delivered (EF-SGD).
        codec, encoded: with both, a bucket whose residual ``codec`` can accumulate and encode
            in one pass (:meth:`Codec.accumulate_encode`) is also encoded now, its residual
            left settled as ``codec.encode_chunks(r, chunks, settle=True)`` leaves it, and
            ``encoded[b]`` holds what to cut its payloads from (``encode_chunks(encoded=)``).
            Cleared when the result is False.
    Returns:
        False, with every residual of ``buckets`` set to None, when any value is non-finite (the site
        then contributes nothing this round; docs/ARCHITECTURE.md, "The residual rule").
    """
    tmp: torch.Tensor | None = None
    ok = True
    chosen = range(len(layout)) if buckets is None else buckets
    for b in chosen:
        bucket = layout.buckets[b]
        n = bucket.numel
        th = theta[b].detach()
        r = residuals[b]
        if r is None or not error_feedback:  # Δ_b becomes the residual: computed in its own tensor
            residuals[b] = _pseudo_gradient_into(
                torch.empty(n, dtype=torch.float32, device=th.device), th, bucket, tensors
            )
        elif (kern := kernels()) is not None and _accumulates_in_place(r, th, bucket, tensors):
            pieces = [  # the bucket's local values, segment by segment (views, no copy)
                tensors[sg.tensor_index].detach().reshape(-1)[sg.tensor_offset : sg.tensor_offset + sg.numel]
                for sg in bucket.segments
            ]
            if codec is not None and encoded is not None:
                try:
                    e = codec.accumulate_encode(r, th, pieces, bucket.chunks, decay=decay)
                except CodecError:  # non-finite: the round's residuals are dropped below
                    ok = False
                    continue
                if e is not None:
                    encoded[b] = e
                    continue
            for sg, src in zip(bucket.segments, pieces):  # r ← β·r + (θ_b − local_b), in one pass
                at = slice(sg.bucket_offset, sg.bucket_offset + sg.numel)
                ok &= kern.accumulate(r[at], th[at], src, decay)
            continue
        else:
            if tmp is None or tmp.numel() < n:
                tmp = torch.empty(n, dtype=torch.float32, device=th.device)
            if decay != 1.0:
                r.mul_(decay)
            r.add_(_pseudo_gradient_into(tmp[:n], th, bucket, tensors))
        if not _all_finite(residuals[b]):
            ok = False
    if not ok:
        for b in chosen:
            residuals[b] = None
        if encoded is not None:
            encoded.clear()
    return ok


def included_chunks(site_id: str, senders: list, num_chunks: int) -> list[bool]:
    """Per chunk, whether a finalized mean included ``site_id``'s contribution.

    Args:
        site_id: this site.
        senders: per chunk, the senders the mean included (from the mean, or from a
            repair's ``mean_senders``); shorter than ``num_chunks`` (empty: no mean)
            means the missing chunks included nobody.
        num_chunks: chunks of the bucket.
    """
    return [c < len(senders) and site_id in senders[c] for c in range(num_chunks)]


def settle_chunk(
    residual: torch.Tensor, *, included: bool, sent: torch.Tensor | None, applied_mean: torch.Tensor | None
) -> None:
    """Settle one chunk of a residual after its round, in place (see the module docstring).

    Args:
        residual: the chunk ``u`` of the residual this site sent (a view; updated).
        included: whether the chunk's finalized mean included this site.
        sent: what the owner decoded from this site's payload, ``decode(encode(u))``;
            None when the codec is lossless (it decoded ``u`` exactly).
        applied_mean: the mean applied to this chunk (decoded broadcast), or None when
            no mean was applied or it is not known here.
    ``sent`` and ``applied_mean`` are decoded on the host; they are moved to the
    residual's device (``DiLoCoConfig.theta_device``).
    """
    if included:
        if sent is None:
            residual.zero_()
        else:
            residual.sub_(sent.to(residual.device))
    elif applied_mean is not None:
        residual.sub_(applied_mean.to(residual.device))


def settle_bucket(
    residual: torch.Tensor,
    chunks: Sequence[tuple[int, int]],
    included: Sequence[bool],
    *,
    codec: Codec,
    sent: Callable[[int], bytes],
    bcodec: Codec,
    mean_payloads: Sequence[bytes] | None,
    settled_in_place: bool = False,
) -> list[tuple[int, CodecError]]:
    """Settle every chunk of one bucket's residual (:func:`settle_chunk` for each) in a few
    vectorized passes: the same values, bit for bit, as one :func:`settle_chunk` per chunk.

    Chunks that settle alike are decoded together with one ``decode_chunks`` call: every
    included chunk (this site's own payloads) in one, every chunk settled by the mean in
    another, and subtracted with one gather / subtract / scatter when the chunks are the
    layout's usual equal steps (``_uniform_step``); else one call per run of neighbouring
    chunks that settle alike. (Per run, a round with 10% datagram loss took ~1,500 decode
    calls per site and 0.13-0.36 s of a 3-4 s round on the datagram path.)

    Args:
        residual: the bucket's residual (1-D fp32; updated in place).
        chunks: the bucket's ``(offset, numel)`` chunks (contiguous, in order, from 0).
        included: per chunk, whether the finalized mean included this site.
        codec: the contribution codec (``sent`` payloads).
        sent: this site's payload of chunk ``c`` (called for included chunks of a lossy codec,
            and with ``settled_in_place`` for the others); made by this process, so decoded
            without re-checking headers and crc32s.
        bcodec: the broadcast codec (``mean_payloads``).
        mean_payloads: the applied mean's payload per chunk, or None when no whole mean
            is known here.
        settled_in_place: the residual was left settled as if every chunk were included by
            ``codec.encode_chunks(residual, chunks, settle=True)`` when it made the ``sent``
            payloads, and not written since: the included chunks are done, the others are
            restored first (exactly: ``decode_chunks(..., unsettle=True)``). The usual round
            (every chunk included) then costs nothing here.

    Returns:
        ``(chunk, error)`` for each mean chunk that did not decode (its residual is kept whole;
        a bad mean was not applied either).
    """
    own_case = "sent" if not codec.lossless else "zero"
    if settled_in_place:  # the included chunks are settled already; restore the others
        _unsettle(residual, chunks, included, codec, sent)
        own_case = "done"
    if all(included):  # the usual round: one case for every chunk
        if own_case == "done":
            return []
        cases = [own_case] * len(included)
    else:
        cases = [own_case if inc else ("mean" if mean_payloads is not None else "keep") for inc in included]
    runs = equal_runs(cases)
    step = _uniform_step(chunks) if residual.is_contiguous() else None
    if step is None or len(runs) <= 2 * len(set(cases)):  # few runs: each in place, no gather
        return _settle_runs(residual, chunks, cases, runs, codec=codec, sent=sent, bcodec=bcodec, means=mean_payloads)
    bad: list[tuple[int, CodecError]] = []
    for i, j in runs:
        if cases[i] == "zero":
            settle_chunk(
                residual[chunks[i][0] : chunks[j - 1][0] + chunks[j - 1][1]],
                included=True,
                sent=None,
                applied_mean=None,
            )
    own = [c for c, k in enumerate(cases) if k == "sent"]
    if own:
        dec = codec.decode_chunks(list(map(sent, own)), [chunks[c][1] for c in own], verify=False)
        _sub_chunks(residual, chunks, own, dec, step)
    by_mean = [c for c, k in enumerate(cases) if k == "mean"]
    if by_mean:
        assert mean_payloads is not None
        try:
            dec = bcodec.decode_chunks([mean_payloads[c] for c in by_mean], [chunks[c][1] for c in by_mean])
        except CodecError:  # find which chunks are bad; settle the others
            bad += _settle_means_one_by_one(residual, chunks, by_mean, bcodec, mean_payloads)
        else:
            _sub_chunks(residual, chunks, by_mean, dec, step)
    return bad


def _unsettle(
    residual: torch.Tensor,
    chunks: Sequence[tuple[int, int]],
    included: Sequence[bool],
    codec: Codec,
    sent: Callable[[int], bytes],
) -> None:
    """Undo the encode's in-place settle of the chunks not included (each run of them in one
    pass): the residual they had before it, bit for bit."""
    for i, j in equal_runs(list(included)):
        if not included[i]:
            a, b = chunks[i][0], chunks[j - 1][0] + chunks[j - 1][1]
            numels = list(map(_NUMEL, chunks[i:j]))
            codec.decode_chunks(list(map(sent, range(i, j))), numels, verify=False, out=residual[a:b], unsettle=True)


def _settle_runs(
    residual: torch.Tensor,
    chunks: Sequence[tuple[int, int]],
    cases: Sequence[str],
    runs: Sequence[tuple[int, int]],
    *,
    codec: Codec,
    sent: Callable[[int], bytes],
    bcodec: Codec,
    means: Sequence[bytes] | None,
) -> list[tuple[int, CodecError]]:
    """:func:`settle_bucket` one run of neighbouring chunks that settle alike at a time (in place)."""
    bad: list[tuple[int, CodecError]] = []
    in_place = residual.device.type == "cpu" and residual.dtype == torch.float32 and residual.is_contiguous()
    for i, j in runs:
        a, b = chunks[i][0], chunks[j - 1][0] + chunks[j - 1][1]
        numels = list(map(_NUMEL, chunks[i:j]))
        if cases[i] == "zero":
            settle_chunk(residual[a:b], included=True, sent=None, applied_mean=None)
        elif cases[i] == "sent" and in_place:  # residual -= what was sent, in one pass
            codec.decode_chunks(list(map(sent, range(i, j))), numels, verify=False, out=residual[a:b], subtract=True)
        elif cases[i] == "sent":
            dec = codec.decode_chunks(list(map(sent, range(i, j))), numels, verify=False)  # this site's own
            settle_chunk(residual[a:b], included=True, sent=dec, applied_mean=None)
        elif cases[i] == "mean":
            assert means is not None
            try:  # a CodecError leaves residual[a:b] as it was
                if in_place:
                    bcodec.decode_chunks(means[i:j], numels, out=residual[a:b], subtract=True)
                else:
                    dec = bcodec.decode_chunks(means[i:j], numels)
                    settle_chunk(residual[a:b], included=False, sent=None, applied_mean=dec)
            except CodecError:  # find which chunks are bad; settle the others
                bad += _settle_means_one_by_one(residual, chunks, range(i, j), bcodec, means)
    return bad


def _settle_means_one_by_one(
    residual: torch.Tensor,
    chunks: Sequence[tuple[int, int]],
    which: Sequence[int],
    bcodec: Codec,
    means: Sequence[bytes],
) -> list[tuple[int, CodecError]]:
    """Settle chunks ``which`` by their mean, decoding each alone; the ones that fail are kept whole and returned."""
    bad: list[tuple[int, CodecError]] = []
    for c in which:
        off, n = chunks[c]
        try:
            mean = bcodec.decode(means[c], numel=n)
        except CodecError as e:
            bad.append((c, e))
            continue
        settle_chunk(residual[off : off + n], included=False, sent=None, applied_mean=mean)
    return bad


_NUMEL = operator.itemgetter(1)


@per_chunk_list
def _uniform_step(chunks: tuple[tuple[int, int], ...]) -> int | None:
    """``n`` when chunk ``c`` is ``(c * n, n)`` for every chunk but the last, which starts at
    ``c * n`` and has at most ``n`` elements (the layout's chunks); else None."""
    if not chunks:
        return None
    n = chunks[0][1]
    last = len(chunks) - 1
    if n <= 0 or any(chunks[c] != (c * n, n) for c in range(last)):
        return None
    return n if chunks[last][0] == last * n and 0 < chunks[last][1] <= n else None


def _sub_chunks(
    residual: torch.Tensor, chunks: Sequence[tuple[int, int]], idx: list[int], dec: torch.Tensor, step: int
) -> None:
    """``residual``'s chunks ``idx`` (ascending) minus ``dec``, their decoded values concatenated
    in that order (chunks as :func:`_uniform_step` accepts, of ``step`` elements but the last):
    one gather, subtraction and scatter, element for element what :func:`settle_chunk` does."""
    dec = dec.to(residual.device)
    last = len(chunks) - 1
    if idx[-1] == last and chunks[last][1] != step:  # the short last chunk, on its own
        off, n = chunks[last]
        residual[off : off + n].sub_(dec[dec.numel() - n :])
        idx, dec = idx[:-1], dec[: dec.numel() - n]
        if not idx:
            return
    if idx[-1] - idx[0] + 1 == len(idx):  # one contiguous range
        residual[idx[0] * step : (idx[-1] + 1) * step].sub_(dec)
        return
    full = len(chunks) if chunks[last][1] == step else last
    rows = residual[: full * step].view(full, step)
    at = torch.tensor(idx, dtype=torch.long, device=residual.device)
    part = rows.index_select(0, at)
    part.sub_(dec.view(len(idx), step))
    rows.index_copy_(0, at, part)
