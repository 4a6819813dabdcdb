"""An owner's mean of one bucket as broadcast bytes, and back (docs/ARCHITECTURE.md, "One round",
step 3: finalize, apply and verify): the owner encodes each chunk's partial mean with the broadcast codec; every
site, the owner included, applies the same decoded bytes, so θ_b stays equal everywhere.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dtrain.buckets import Bucket
from dtrain.codecs import Codec
from dtrain.protocol import BucketMean, MeanChunk
from dtrain.rounds.owner import ChunkReduction

__all__ = ["encode_mean", "decode_mean"]


def encode_mean(
    codec: Codec,
    bucket: Bucket,
    reductions: Sequence[ChunkReduction],
    *,
    residual: torch.Tensor | None,
    generator: torch.Generator,
) -> tuple[tuple[MeanChunk, ...], torch.Tensor]:
    """The broadcast chunks of a bucket's mean and the decoded full mean (what every site applies).

    Args:
        codec: the broadcast codec.
        bucket: the bucket (its chunks' offsets and sizes).
        reductions: every chunk's partial mean (none may be None).
        residual: the owner's broadcast error feedback for this bucket (1-D fp32,
            ``bucket.numel``), or None when off: what the lossy codec lost from the
            previous mean is added before encoding, and what it loses now is stored
            back (in place).
        generator: random source of stochastic rounding.
    Returns:
        ``(chunks, full)``: the encoded chunks (with the senders each mean includes)
        and the decoded mean, 1-D fp32 of ``bucket.numel`` elements.
    """
    full = torch.empty(bucket.numel, dtype=torch.float32)
    src = torch.empty(bucket.numel, dtype=torch.float32)
    ranges = [bucket.chunks[red.chunk] for red in reductions]
    for red, (off, n) in zip(reductions, ranges):
        src[off : off + n] = red.mean if residual is None else red.mean + residual[off : off + n]
    # one encoding pass per bucket (the datagram path cuts a bucket into many small chunks)
    payloads = codec.encode_chunks(src, ranges, generator=generator)
    chunks = []
    for red, (off, n), payload in zip(reductions, ranges, payloads):
        mean = src[off : off + n]
        dec = codec.decode(payload, numel=n)
        if residual is not None:
            residual[off : off + n] = mean - dec
        full[off : off + n] = dec
        chunks.append(
            MeanChunk(chunk=red.chunk, offset=off, numel=n, codec=codec.name, payload=payload, senders=red.senders)
        )
    return tuple(chunks), full


def decode_mean(codec: Codec, bucket: Bucket, m: BucketMean) -> torch.Tensor:
    """The full decoded mean of ``m`` (1-D fp32, ``bucket.numel`` elements).

    Raises:
        ValueError: the mean's chunks do not match the bucket's (count, offsets, sizes)
            or use another codec.
        CodecError: a chunk's payload does not decode.
    """
    if len(m.chunks) != len(bucket.chunks):
        raise ValueError(f"mean has {len(m.chunks)} chunks, bucket {bucket.index} has {len(bucket.chunks)}")
    full = torch.empty(bucket.numel, dtype=torch.float32)
    for ch, (off, n) in zip(m.chunks, bucket.chunks):
        if (ch.offset, ch.numel) != (off, n):
            raise ValueError(f"mean chunk {ch.chunk} covers {ch.offset}+{ch.numel}, expected {off}+{n}")
        if ch.codec != codec.name:
            raise ValueError(f"mean codec {ch.codec!r}, expected {codec.name!r}")
        full[off : off + n] = codec.decode(ch.payload, numel=n)
    return full
