"""Flattening parameters into buckets, chunking buckets, and bucket ownership.

All tensors a site synchronises (the model's parameters, and optionally its
floating-point buffers) are viewed as one virtual fp32 vector in
``model.parameters()`` order. That vector is cut into *buckets* of about
``bucket_bytes`` (a parameter may span two buckets); each bucket is cut into
*chunks* of ``chunk_bytes`` of fp32 input, each encoded and aggregated on its own.

Ownership uses rendezvous (highest-random-weight) hashing (Thaler & Ravishankar,
"Using name-based mappings to increase hit rates", 1998): the owner of bucket b is
the member m with the largest ``H(m, b)``. Every site computes the same answer
from the member list alone, and when one member leaves only its buckets move.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

from dtrain.configs import BucketConfig

__all__ = [
    "BucketConfig",
    "Segment",
    "Bucket",
    "BucketLayout",
    "assign_owners",
    "checksum",
]


@dataclass(frozen=True)
class Segment:
    """Elements ``[tensor_offset, tensor_offset+numel)`` of flattened tensor
    ``tensor_index`` live at ``[bucket_offset, bucket_offset+numel)`` of a bucket."""

    tensor_index: int
    tensor_offset: int
    bucket_offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """One bucket: ``numel`` fp32 elements, where they come from, how they are chunked.

    ``kind`` is ``"param"`` for model parameters (outer optimizer applies) or
    ``"buffer"`` for averaged buffers (plain mean, outer SGD lr=1, no momentum).
    ``chunks`` holds ``(offset, numel)`` element ranges covering the bucket.
    """

    index: int
    numel: int
    kind: str
    segments: tuple[Segment, ...]
    chunks: tuple[tuple[int, int], ...]


class BucketLayout:
    """Buckets over a list of tensors (shapes fixed at construction).

    Args:
        numels: element count of each tensor, in order.
        kinds: ``"param"`` or ``"buffer"`` per tensor; tensors of different kinds
            never share a bucket.
        config: bucket and chunk sizes.
    """

    def __init__(self, numels: Sequence[int], kinds: Sequence[str], config: BucketConfig) -> None:
        if len(numels) != len(kinds):
            raise ValueError("numels and kinds must have the same length")
        self.config = config
        self.numels = tuple(int(n) for n in numels)
        self.kinds = tuple(kinds)
        bucket_elems = max(1, config.bucket_bytes // 4)
        chunk_elems = max(1, config.chunk_bytes // 4)
        buckets: list[Bucket] = []
        for kind in ("param", "buffer"):
            segs: list[Segment] = []
            fill = 0

            def close() -> None:
                nonlocal segs, fill
                if fill:
                    chunks = tuple((o, min(chunk_elems, fill - o)) for o in range(0, fill, chunk_elems))
                    buckets.append(Bucket(len(buckets), fill, kind, tuple(segs), chunks))
                segs, fill = [], 0

            for ti, (n, k) in enumerate(zip(self.numels, self.kinds)):
                if k != kind or n == 0:
                    continue
                off = 0
                while off < n:
                    take = min(n - off, bucket_elems - fill)
                    segs.append(Segment(ti, off, fill, take))
                    off += take
                    fill += take
                    if fill == bucket_elems:
                        close()
            close()
        self.buckets: tuple[Bucket, ...] = tuple(buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def total_numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    def fingerprint(self) -> str:
        """Hex digest of the tensor sizes and bucket config; equal on compatible sites."""
        h = hashlib.blake2b(digest_size=8)
        h.update(repr((self.numels, self.kinds, self.config.bucket_bytes, self.config.chunk_bytes)).encode())
        return h.hexdigest()

    def gather(self, index: int, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy bucket ``index``'s elements out of ``tensors`` into a 1-D fp32 tensor.

        Args:
            tensors: the tensors the layout was built for (any float dtype, CPU).
            out: optional preallocated fp32 tensor of ``bucket.numel`` elements.
        Returns:
            fp32 tensor of shape ``[bucket.numel]``.
        """
        b = self.buckets[index]
        if out is None:
            out = torch.empty(b.numel, dtype=torch.float32)
        for s in b.segments:
            src = tensors[s.tensor_index].detach().reshape(-1)[s.tensor_offset : s.tensor_offset + s.numel]
            out[s.bucket_offset : s.bucket_offset + s.numel].copy_(src)
        return out

    def scatter(self, index: int, src: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy a 1-D fp32 bucket back into ``tensors`` (cast to each tensor's dtype)."""
        b = self.buckets[index]
        with torch.no_grad():
            for s in b.segments:
                t = tensors[s.tensor_index]
                flat = t.view(-1) if t.is_contiguous() else None
                piece = src[s.bucket_offset : s.bucket_offset + s.numel]
                if flat is not None:
                    flat[s.tensor_offset : s.tensor_offset + s.numel].copy_(piece)
                else:  # pragma: no cover - non-contiguous parameters are rare
                    tmp = t.detach().reshape(-1).clone()
                    tmp[s.tensor_offset : s.tensor_offset + s.numel].copy_(piece)
                    t.copy_(tmp.view_as(t))


def _weight(member: str, bucket: int) -> int:
    h = hashlib.blake2b(f"{member}\x00{bucket}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def assign_owners(num_buckets: int, members: Sequence[str]) -> list[str]:
    """Owner site_id of each bucket by rendezvous (highest-random-weight) hashing.

    Args:
        num_buckets: number of buckets (>= 0).
        members: site_ids of the round's quorum (order does not matter).
    Returns:
        ``owners[b]`` for ``b in range(num_buckets)``.
    Raises:
        ValueError: ``members`` is empty.
    """
    if not members:
        raise ValueError("members must name at least one site")
    ms = sorted(set(members))
    return [max(ms, key=lambda m: (_weight(m, b), m)) for b in range(num_buckets)]


def checksum(t: torch.Tensor) -> str:
    """Hex blake2b-128 digest of a tensor's raw bytes (fp32 θ_b in practice)."""
    data = t.detach().contiguous().view(torch.uint8).numpy() if t.numel() else b""
    return hashlib.blake2b(memoryview(data) if len(data) else b"", digest_size=16).hexdigest()
