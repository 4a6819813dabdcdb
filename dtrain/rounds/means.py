"""An owner's mean of one bucket as broadcast bytes, and back (docs/ARCHITECTURE.md, "One round",
step 3: finalize, apply and verify): the owner encodes each chunk's partial mean with the broadcast codec; every
site, the owner included, applies the same decoded bytes, so θ_b stays equal everywhere.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch

from dtrain.aggregation import BucketReduction, ChunkReduction
from dtrain.buckets import Bucket
from dtrain.codecs import Codec
from dtrain.codecs.base import CheckedRun, per_chunk_list
from dtrain.protocol import BucketMean, MeanChunk, made

__all__ = ["ascending_runs", "checked_mean", "contiguous_runs", "decode_mean", "encode_mean"]


def encode_mean(
    codec: Codec,
    bucket: Bucket,
    reductions: Sequence[ChunkReduction],
    *,
    residual: torch.Tensor | None,
    generator: torch.Generator,
) -> tuple[tuple[MeanChunk, ...], torch.Tensor | CheckedRun]:
    """The broadcast chunks of a bucket's mean and the decoded full mean (what every site applies).

    Args:
        codec: the broadcast codec.
        bucket: the bucket (its chunks' offsets and sizes).
        reductions: every chunk's partial mean (none may be None): the owner's
            :class:`~dtrain.aggregation.BucketReduction` (its mean tensor encoded whole, in
            place unless ``residual``), or any sequence of chunk reductions, in any order.
        residual: the owner's broadcast error feedback for this bucket (1-D fp32,
            ``bucket.numel``), or None when off: what the lossy codec lost from the
            previous mean is added before encoding, and what it loses now is stored
            back (in place).
        generator: random source of stochastic rounding.
    Returns:
        ``(chunks, full)``: the encoded chunks (with the senders each mean includes)
        and the decoded mean, 1-D fp32 of ``bucket.numel`` elements; without ``residual``,
        where the codec checks a run without decoding it (:meth:`Codec.checked_run`), the
        mean's payloads undecoded instead (a :class:`~dtrain.codecs.base.CheckedRun`: the owner's
        outer step decodes them in its own pass, as a member's does, ``GlobalState.apply_mean``).
    """
    whole = isinstance(reductions, BucketReduction) and reductions.complete
    if whole and len(reductions) == len(bucket.chunks) and reductions.mean.numel() == bucket.numel:
        ranges, senders = list(bucket.chunks), reductions.senders
        src = reductions.mean if residual is None else reductions.mean + residual  # no copy without a residual
    else:
        ranges = [bucket.chunks[red.chunk] for red in reductions]
        senders = [red.senders for red in reductions]
        src = torch.empty(bucket.numel, dtype=torch.float32)
        if ranges == list(bucket.chunks):  # every chunk in order: one copy, one add
            torch.cat([red.mean for red in reductions], out=src)
            if residual is not None:
                src.add_(residual)
        else:
            for red, (off, n) in zip(reductions, ranges):
                src[off : off + n] = red.mean if residual is None else red.mean + residual[off : off + n]
    # one encoding pass per bucket (the datagram path cuts a bucket into many small chunks)
    payloads = codec.encode_chunks(src, ranges, generator=generator)
    name = codec.name
    chunks = tuple(  # one per chunk (~480 in a datagram run's bucket): without the frozen constructor's cost
        made(MeanChunk, chunk=c, offset=off, numel=n, codec=name, payload=payload, senders=ss)
        for c, (off, n), payload, ss in zip(_chunk_indices(reductions), ranges, payloads, senders)
    )
    if residual is None and ranges == list(bucket.chunks) and _consecutive(bucket.chunks):
        # payloads just made here: not re-verified
        run = codec.checked_run(payloads, list(map(_NUMEL, ranges)), verify=False)
        if run is not None:
            return chunks, run
    full = torch.empty(bucket.numel, dtype=torch.float32)
    # one pass per run of equal chunks, not one call per chunk; payloads just made here: not re-verified
    _decode_into(codec, full, ranges, payloads, verify=False)
    if residual is not None:
        for i, j in contiguous_runs(ranges):
            a, b = ranges[i][0], ranges[j - 1][0] + ranges[j - 1][1]
            residual[a:b] = src[a:b] - full[a:b]
    return chunks, full


def _chunk_indices(reductions: Sequence[ChunkReduction]) -> Sequence[int]:
    """Each reduction's chunk index (a :class:`BucketReduction`'s are its positions)."""
    return range(len(reductions)) if isinstance(reductions, BucketReduction) else [red.chunk for red in reductions]


def _decode_into(
    codec: Codec, full: torch.Tensor, ranges: Sequence[tuple[int, int]], payloads: Sequence, *, verify: bool = True
) -> None:
    """Decode ``payloads`` into their element ``ranges`` of ``full``: each run of ranges that
    follow one another (:func:`contiguous_runs`) with one :meth:`Codec.decode_chunks` call
    (``verify``: as there; False only for payloads made in this process)."""
    for i, j in contiguous_runs(ranges):
        numels = list(map(_NUMEL, ranges[i:j]))
        off = ranges[i][0]
        codec.decode_chunks(payloads[i:j], numels, verify=verify, out=full[off : off + sum(numels)])


def contiguous_runs(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, end)`` index ranges of the maximal runs of ``(offset, numel)`` element ranges
    where each starts where the one before ended (``[(0, 4), (4, 4), (10, 2)]`` ->
    ``[(0, 2), (2, 3)]``); a new list each call (the runs are remembered per distinct ranges)."""
    return list(_contiguous_runs(ranges))


@per_chunk_list
def _contiguous_runs(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(ranges) + 1):
        if i == len(ranges) or ranges[i][0] != ranges[i - 1][0] + ranges[i - 1][1]:
            runs.append((start, i))
            start = i
    return tuple(runs)


def ascending_runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` index ranges of the maximal runs of strictly ascending values in
    ``indices`` (``[0, 1, 5, 2, 2]`` -> ``[(0, 3), (3, 4), (4, 5)]``)."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(indices) + 1):
        if i == len(indices) or indices[i] <= indices[i - 1]:
            runs.append((start, i))
            start = i
    return runs


def decode_mean(codec: Codec, bucket: Bucket, m: BucketMean) -> torch.Tensor:
    """The full decoded mean of ``m`` (1-D fp32, ``bucket.numel`` elements).

    Raises:
        ValueError: the mean's chunks do not match the bucket's (count, offsets, sizes)
            or use another codec.
        CodecError: a chunk's payload does not decode.
    """
    mean = checked_mean(codec, bucket, m)
    return mean.tensor() if isinstance(mean, CheckedRun) else mean


def checked_mean(codec: Codec, bucket: Bucket, m: BucketMean) -> torch.Tensor | CheckedRun:
    """:func:`decode_mean`, or, where the codec checks a run without decoding it
    (:meth:`Codec.checked_run`), the mean's payloads checked and not yet decoded: the outer step
    then decodes them in its own pass (``GlobalState.apply_mean``). The same checks and errors."""
    if len(m.chunks) != len(bucket.chunks):
        raise ValueError(f"mean has {len(m.chunks)} chunks, bucket {bucket.index} has {len(bucket.chunks)}")
    # the checks as one C-level pass each (~480 chunks a bucket on the datagram path); the loop
    # below only names the first mismatch
    if list(map(_OFFSET_NUMEL, m.chunks)) != list(bucket.chunks) or set(map(_CODEC, m.chunks)) - {codec.name}:
        for ch, (off, n) in zip(m.chunks, bucket.chunks):
            if (ch.offset, ch.numel) != (off, n):
                raise ValueError(f"mean chunk {ch.chunk} covers {ch.offset}+{ch.numel}, expected {off}+{n}")
            if ch.codec != codec.name:
                raise ValueError(f"mean codec {ch.codec!r}, expected {codec.name!r}")
    payloads = list(map(_PAYLOAD, m.chunks))
    if _consecutive(bucket.chunks) and (run := codec.checked_run(payloads, list(map(_NUMEL, bucket.chunks)))):
        return run
    full = torch.empty(bucket.numel, dtype=torch.float32)
    _decode_into(codec, full, bucket.chunks, payloads)
    return full


@per_chunk_list
def _consecutive(chunks: tuple[tuple[int, int], ...]) -> bool:
    """Whether the chunks' ranges follow one another from element 0 (a bucket's do)."""
    return _contiguous_runs(chunks) == ((0, len(chunks)),) and (not chunks or chunks[0][0] == 0)


_NUMEL = operator.itemgetter(1)
_OFFSET_NUMEL = operator.attrgetter("offset", "numel")
_CODEC = operator.attrgetter("codec")
_PAYLOAD = operator.attrgetter("payload")
