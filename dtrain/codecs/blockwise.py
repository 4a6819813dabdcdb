"""Blockwise absmax integer codecs: int8 and int4.

For each block b of ``block_size`` consecutive elements (the last one may be shorter),
scale_b = max|x_b| / qmax (float32) and code = round(x / scale_b) in [-qmax, qmax]
(qmax = 127 for int8, 7 for int4); decoding gives code * scale_b. Round to nearest:
error <= scale_b / 2. Stochastic rounding (``CodecConfig.stochastic_rounding``):
code = floor(x / scale_b + u), u ~ U[0, 1), so E[code * scale_b] = x (unbiased) and the
error is < scale_b. A zero block has scale 0 and decodes to exact zeros.

Scales are float32 rather than float16 so that blocks with max|x| anywhere from 1e-38
to 3e38 keep their range (cost: 4 / block_size bytes per element, 1.6 % at 256).
A scale is nudged down by one ulp where qmax * scale would round above max|x_b|, so
decoding can never overflow to inf near the top of the fp32 range.

The encoder works in chunks of whole blocks (~256 Ki elements) so that each input
element is read from memory once and temporaries stay in cache. Round-to-nearest encodes
and all decodes run in compiled kernels where they build (:mod:`dtrain.codecs.native`, the
same bytes and values as the torch path here, which runs otherwise).
"""

from __future__ import annotations

import functools
import itertools
import math
import struct

import numpy as np
import torch
from zlib_ng.zlib_ng import crc32

from dtrain.codecs.base import (
    CHUNK_ELEMS,
    HEADER_BYTES,
    SLACK,
    TINY,
    CheckedRun,
    Codec,
    _prepare,
    chunks,
    equal_runs,
    non_finite_error,
    np_view,
    per_chunk_list,
    t_view,
)
from dtrain.codecs.config import CodecConfig
from dtrain.codecs.native import SgdStep, kernels
from dtrain.errors import CodecError

__all__ = ["Int8Codec", "Int4Codec"]

_NUDGE_ABOVE = 1e37  # only blocks this large can overflow qmax * scale


class _Blockwise(Codec):
    qmax = 127
    _param_name = "block size"

    def __init__(self, config: CodecConfig) -> None:
        super().__init__(config)
        self._bs = config.block_size
        self._sr = config.stochastic_rounding
        self._step = max(self._bs, CHUNK_ELEMS // self._bs * self._bs)

    def _param(self, numel):
        return self._bs

    def _num_blocks(self, numel: int) -> int:
        return -(-numel // self._bs)

    def _codes_bytes(self, numel: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _body_bytes(self, numel):
        return 4 * self._num_blocks(numel) + self._codes_bytes(numel)

    def _max_error(self, x, absmax):
        return absmax / self.qmax * (1.0 if self._sr else 0.5) * SLACK + TINY

    # ------------------------------------------------------------------ encode
    def _quantize_chunks(self, x: torch.Tensor, scales: torch.Tensor, generator):
        """Yield (start, end, codes) per chunk; codes is a float32 scratch tensor of
        integers in [-qmax, qmax] valid until the next iteration. Fills ``scales``."""
        n, bs, qmax = x.numel(), self._bs, float(self.qmax)
        scratch = torch.empty(min(self._step, n))
        noise = torch.empty_like(scratch) if self._sr else None
        for s, t in chunks(n, self._step):
            m = t - s
            full = m // bs
            xv = x[s : s + full * bs].view(full, bs)
            tail = x[s + full * bs : t]
            sc = scales[s // bs : s // bs + -(-m // bs)]
            if full:
                torch.maximum(xv.amax(dim=1), xv.amin(dim=1).neg_(), out=sc[:full])
            if tail.numel():
                sc[full] = torch.maximum(tail.max(), tail.min().neg())
            sc.abs_()  # a block of -0.0 only: scale +0, as the compiled kernel's
            top = float(sc.max())
            if not top <= 3.5e38:  # NaN or inf somewhere in this chunk
                raise non_finite_error(x)
            absmax = sc.clone() if top > _NUDGE_ABOVE else None
            sc.div_(qmax)
            if absmax is not None:
                over = sc * qmax > absmax
                sc.copy_(torch.where(over, torch.nextafter(sc, torch.zeros_like(sc)), sc))
            div = torch.where(sc == 0, 1.0, sc)
            q = scratch[:m]
            if full:
                torch.div(xv, div[:full, None], out=q[: full * bs].view(full, bs))
            if tail.numel():
                torch.div(tail, div[full], out=q[full * bs :])
            if noise is not None:
                q.add_(torch.rand(m, generator=generator, out=noise[:m])).floor_()
            else:
                q.round_()
            yield s, t, q.clamp_(-qmax, qmax)

    def encode_chunks(self, x, chunks, *, generator=None, settle=False, encoded=None):
        """One pass over ``x`` into one body; then each run of equal, contiguous ranges of
        whole blocks is cut into its payloads at once (:meth:`_payload_rows`), any other
        range on its own (:meth:`_payload`): the bytes of ``encode(x[o:o+n])`` per range.
        ``settle``: the compiled pass also leaves ``x`` settled (:meth:`Codec.encode_chunks`);
        ``encoded``: that pass was :meth:`accumulate_encode`'s, the body is its."""
        bs = self._bs
        plan = _rows_plan(chunks, bs)
        if (settle or encoded is not None) and not self.settles_in_place(x, chunks):
            return super().encode_chunks(x, chunks, generator=generator, settle=settle, encoded=encoded)  # refused
        if self._zstd or plan is None or x.dim() != 1 or x.dtype != torch.float32 or len(chunks) < 2:
            return super().encode_chunks(x, chunks, generator=generator)
        x32, _ = _prepare(x)
        n = x32.numel()
        nb = self._num_blocks(n)
        if encoded is not None:  # accumulate_encode's body: x was encoded (and settled) then
            want = (self._body_bytes(n),)
            if not (isinstance(encoded, np.ndarray) and encoded.dtype == np.uint8 and encoded.shape == want):
                raise ValueError(
                    f"encoded must be accumulate_encode's body of x ({want[0]} uint8), got {encoded!r:.80}"
                )
            body = encoded
        else:
            body = self._body_buffer(self._body_bytes(n))  # per-thread scratch: every payload is a copy
            if settle:
                self._native_encode(x32, body, nb, settle=True)
            elif body.size:
                self._encode_into(x32, body, generator)
        out: list[bytes] = []
        for i, j in plan:
            o, m = chunks[i]
            if j - i > 1 and m > 0 and m % bs == 0 and o + (j - i) * m <= n:
                out.extend(self._payload_rows(body, nb, o, m, j - i))
            else:
                out.extend(self._payload(body, nb, o, m) for o, m in chunks[i:j])
        return out

    def settles_in_place(self, x, chunks):
        return (
            not self._zstd
            and not self._sr
            and kernels() is not None
            and isinstance(x, torch.Tensor)
            and x.dim() == 1
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.is_contiguous()
            and len(chunks) >= 2
            and _rows_plan(chunks, self._bs) is not None
            and _consecutive_end(chunks) == x.numel()
        )

    def accumulate_encode(self, r, theta, pieces, chunks, *, decay):
        """The compiled pass (``Kernels.accumulate_encode``) where :meth:`settles_in_place` holds
        for ``r`` and ``theta`` and every piece is contiguous float32 on the CPU; its body is
        a new array (kept until the payloads are cut, on another thread)."""
        k = None if self._sr else kernels()
        if k is None or not self.settles_in_place(r, chunks) or not pieces:
            return None
        if not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in (theta, *pieces)):
            return None
        n = r.numel()
        nb = self._num_blocks(n)
        body = np.empty(self._body_bytes(n), dtype=np.uint8)
        scales, codes = body[: 4 * nb].view(np.float32), body[4 * nb :]
        if not k.accumulate_encode(
            r, theta, pieces, decay, self._bs, self._step, self.qmax == 7, scales, codes, settle=True
        ):
            raise non_finite_error(r)
        return body

    def _native_encode(self, x: torch.Tensor, out: np.ndarray, nb: int, *, settle: bool = False) -> bool:
        """The body of ``x`` (flat contiguous float32) by the compiled kernel (``settle``: and
        ``x`` settled in place): True when it ran; False (nothing written) for stochastic
        rounding or without the kernel."""
        k = None if self._sr else kernels()
        if k is None:
            return False
        scales, codes = out[: 4 * nb].view(np.float32), out[4 * nb :]
        if not k.encode(x, self._bs, self._step, self.qmax == 7, scales, codes, settle=settle):
            raise non_finite_error(x)
        return True

    def _payload(self, body: np.ndarray, nb: int, o: int, n: int) -> bytes:
        """The payload of elements ``[o, o + n)`` cut from the body of the whole tensor
        (``nb`` blocks): its blocks' scales and its codes behind its own header."""
        whole = memoryview(body)
        k0, k1 = o // self._bs, o // self._bs + self._num_blocks(n)
        c0, c1 = self._code_range(o, n)
        part = b"".join((whole[4 * k0 : 4 * k1], whole[4 * nb + c0 : 4 * nb + c1]))
        return self._header(n, part) + part

    def _payload_rows(self, body: np.ndarray, nb: int, o: int, m: int, k: int) -> list[bytes]:
        """The payloads of ``k`` contiguous ranges of ``m`` elements (whole blocks) from
        element ``o``, built as the rows of one array: each row's scales, codes, header and
        crc32 in one compiled pass (``Kernels.seal_rows``; without it the scales and the codes
        each copied in one numpy assignment, the header in one and a crc32 call per row), and
        the rows cut into ``bytes`` by one ``struct`` unpack (a ``bytes`` per row from a
        memoryview slice costs ~2x its CPU)."""
        mb, cb = m // self._bs, self._codes_bytes(m)
        plen = HEADER_BYTES + 4 * mb + cb
        rows = self._rows_buffer(k * plen).reshape(k, plen)
        b0, c0 = o // self._bs, self._code_range(o, m)[0]
        scales, codes = body[4 * b0 : 4 * (b0 + k * mb)], body[4 * nb + c0 : 4 * nb + c0 + k * cb]
        if (kern := kernels()) is not None and kern.rows:  # bodies copied in and sealed in one pass
            kern.seal_rows(rows, self._header_prefix(m), scales, codes)
        else:
            rows[:, HEADER_BYTES : HEADER_BYTES + 4 * mb] = scales.reshape(k, 4 * mb)
            rows[:, HEADER_BYTES + 4 * mb :] = codes.reshape(k, cb)
            rows[:, :28] = np.frombuffer(self._header_prefix(m), dtype=np.uint8)
            flat = memoryview(rows.reshape(-1))
            crcs = [crc32(flat[a + HEADER_BYTES : a + plen]) for a in range(0, k * plen, plen)]
            rows[:, 28:32] = np.array(crcs, dtype="<u4").view(np.uint8).reshape(k, 4)
        return list(_rows_struct(k, plen).unpack(rows))

    def _rows_buffer(self, size: int) -> np.ndarray:
        """A uint8 scratch of ``size`` bytes for :meth:`_payload_rows`, reused per thread (each
        payload is a copy of its row): a round does not fault in fresh pages for it per bucket."""
        buf = getattr(self._local, "rows", None)
        if buf is None or buf.size < size:
            buf = self._local.rows = np.empty(max(size, 1), dtype=np.uint8)
        return buf[:size]

    def _code_range(self, o: int, n: int) -> tuple[int, int]:  # pragma: no cover - abstract
        raise NotImplementedError

    # ------------------------------------------------------------------ decode
    def _read_scales(self, body, numel: int) -> torch.Tensor:
        nb = self._num_blocks(numel)
        scale = torch.from_numpy(np_view(body, np.float32, nb).copy())
        if not bool(torch.isfinite(scale * self.qmax).all() and (scale >= 0).all()):
            raise CodecError("corrupted payload: block scales must be finite and >= 0")
        return scale

    def checked_run(self, payloads, numels, *, verify=True):
        """Every run of equal chunks checked (:meth:`_checked_bodies`, then the kernel's scale
        and code checks) before anything is decoded; decoded by the compiled kernel."""
        kern = kernels()
        if kern is None or len(payloads) != len(numels):
            return None
        runs = []
        for i, j in equal_runs(numels):
            n = numels[i]
            bodies = self._checked_bodies(payloads[i:j], n, verify)
            if bodies is None or not kern.check(bodies, n, self._bs, self.qmax == 7):
                return None
            runs.append((bodies, n))
        int4 = self.qmax == 7

        def decode(out: torch.Tensor, mode: str) -> None:
            pos = 0
            for bodies, n in runs:
                o = out[pos : pos + bodies.shape[0] * n]
                if not kern.decode(
                    bodies, n, self._bs, int4, o, sub=mode == "subtract", unsettle=mode == "unsettle",
                    add=mode == "add", checked=True,
                ):  # fmt: skip
                    raise AssertionError("a run that passed the kernel's checks did not decode")  # not reached
                pos += o.numel()

        def step(theta: torch.Tensor, buf: torch.Tensor, sgd: SgdStep) -> None:
            pos = 0
            for bodies, n in runs:
                m = bodies.shape[0] * n
                kern.decode_sgd(bodies, n, self._bs, int4, theta[pos : pos + m], buf[pos : pos + m], pos, sgd)
                pos += m

        return CheckedRun(sum(b.shape[0] * n for b, n in runs), decode, step)

    def _subtract_runs(self, out, payloads, numels, verify, unsettle=False):
        """The compiled kernel's in-place subtraction (or its inverse) of a :meth:`checked_run`:
        every run checked before the first is subtracted."""
        run = self.checked_run(payloads, numels, verify=verify) if out.device.type == "cpu" else None
        if run is None:
            return False
        run._decode(out, "unsettle" if unsettle else "subtract")  # noqa: SLF001 - out was checked by decode_chunks
        return True

    def _native_decode_body(self, body, numel: int) -> torch.Tensor | None:
        """One checked body decoded by the compiled kernel; None without the kernel or when
        the body holds a scale or code the encoder never makes (the torch path then raises
        :meth:`decode`'s error for it)."""
        kern = kernels()
        if kern is None:
            return None
        out = torch.empty(numel, dtype=torch.float32)
        rows = np.frombuffer(body, dtype=np.uint8).reshape(1, -1)
        return out if kern.decode(rows, numel, self._bs, self.qmax == 7, out) else None

    def _decode_run_into(self, out, payloads, numel, verify=True):
        """A run of chunks of whole blocks in one vectorized pass (:meth:`_checked_bodies`,
        then :meth:`_decode_rows`): the same products as :meth:`_decode_body` (code ->
        float32, times its block's scale). Anything the pass does not accept is decoded
        payload by payload, which raises :meth:`decode`'s error for the first bad one."""
        whole = numel % self._bs == 0 or kernels() is not None  # the torch pass takes whole blocks only
        bodies = self._checked_bodies(payloads, numel, verify) if whole and len(payloads) >= 2 else None
        if bodies is None or not self._decode_rows(out, bodies, numel):
            super()._decode_run_into(out, payloads, numel)

    def _decode_rows(self, out: torch.Tensor, bodies: np.ndarray, numel: int) -> bool:
        """Decode the rows of ``bodies`` (checked, ``numel`` elements each: whole blocks unless
        the compiled kernel runs) into ``out``; False when a scale or code is one the encoder
        never makes."""
        raise NotImplementedError  # pragma: no cover - abstract

    def _row_scales(self, bodies: np.ndarray, nb: int) -> torch.Tensor | None:
        """Each row's ``nb`` block scales as a ``(rows, nb)`` float32 tensor (a copy); None
        when any is negative or ``qmax * scale`` is not finite (:meth:`_read_scales`'s rule)."""
        scale = np.ascontiguousarray(bodies[:, : 4 * nb]).view(np.float32)
        if not (np.isfinite(scale * np.float32(self.qmax)).all() and (scale >= 0).all()):
            return None
        return torch.from_numpy(scale)

    def _dequantize_(self, out: torch.Tensor, scale: torch.Tensor, s: int, t: int) -> None:
        bs = self._bs
        full = (t - s) // bs
        b0 = s // bs
        if full:
            out[s : s + full * bs].view(full, bs).mul_(scale[b0 : b0 + full, None])
        if (t - s) % bs:
            out[s + full * bs : t].mul_(scale[b0 + full])


class Int8Codec(_Blockwise):
    """ceil(numel / block_size) float32 scales, then numel int8 codes in [-127, 127].

    The int8 pseudo-gradient scheme of OpenDiLoCo (arXiv 2407.07852) and INTELLECT-1
    (arXiv 2412.01152), with blockwise instead of per-tensor scales. Code -128 is never
    produced and is refused on decode.
    """

    base = "int8"
    qmax = 127

    def _codes_bytes(self, numel):
        return numel

    def _code_range(self, o, n):
        return o, o + n

    def _encode_into(self, x, out, generator):
        n = x.numel()
        nb = self._num_blocks(n)
        if self._native_encode(x, out, nb):
            return
        codes = t_view(out, np.int8, n, 4 * nb)
        for s, t, q in self._quantize_chunks(x, t_view(out, np.float32, nb), generator):
            codes[s:t].copy_(q)

    def _decode_rows(self, out, bodies, numel):
        if (kern := kernels()) is not None:
            return kern.decode(bodies, numel, self._bs, False, out)
        k, nb = bodies.shape[0], numel // self._bs
        scale = self._row_scales(bodies, nb)
        codes = bodies[:, 4 * nb :].view(np.int8)
        if scale is None or codes.min() == -128:
            return False
        rows = out.view(k, nb, self._bs)
        rows.copy_(torch.from_numpy(codes).view(k, nb, self._bs))  # int8 -> float32, exact
        rows.mul_(scale[:, :, None])
        return True

    def _decode_body(self, body, numel):
        if (out := self._native_decode_body(body, numel)) is not None:
            return out
        scale = self._read_scales(body, numel)
        codes = np_view(body, np.int8, numel, 4 * scale.numel())
        out = torch.empty(numel, dtype=torch.float32)
        out_np = out.numpy()
        for s, t in chunks(numel, self._step):
            c = codes[s:t]
            if c.min() == -128:
                raise CodecError("corrupted payload: int8 code -128 is never produced")
            out_np[s:t] = c
            self._dequantize_(out, scale, s, t)
        return out


# Decoded (low, high) code pair for every packed byte; nibble 0 (code -8) is never
# produced, maps to NaN and is reported as corruption.
_INT4_TABLE = np.stack([(np.arange(256) & 15) - 8, (np.arange(256) >> 4) - 8], axis=1).astype(np.float32)
_INT4_TABLE[(np.arange(256) & 15) == 0, 0] = np.nan
_INT4_TABLE[(np.arange(256) >> 4) == 0, 1] = np.nan


class Int4Codec(_Blockwise):
    """float32 scales as int8, then ceil(numel / 2) bytes of two 4-bit codes each.

    Element 2i is in the low nibble and 2i+1 in the high nibble of byte i; nibble =
    code + 8 with code in [-7, 7]; an odd tail is padded with nibble 8 (zero).
    scale_b = max|x_b| / 7. Streaming DiLoCo (arXiv 2501.18512) sends 4-bit (E3M0)
    outer gradients; this is the integer absmax variant.
    """

    base = "int4"
    qmax = 7

    def _codes_bytes(self, numel):
        return (numel + 1) // 2

    def _code_range(self, o, n):
        return o // 2, o // 2 + (n + 1) // 2

    def _encode_into(self, x, out, generator):
        n = x.numel()
        nb = self._num_blocks(n)
        if self._native_encode(x, out, nb):
            return
        packed = t_view(out, np.uint8, (n + 1) // 2, 4 * nb)
        pair_buf = torch.empty((min(self._step, n) + 1) // 2)
        for s, t, q in self._quantize_chunks(x, t_view(out, np.float32, nb), generator):
            q.add_(8.0)  # nibbles 1..15
            if (t - s) % 2:  # only the last chunk of an odd-length tensor
                q = torch.cat([q, q.new_full((1,), 8.0)])
            pairs = q.view(-1, 2)
            half = pair_buf[: pairs.shape[0]]
            torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=half)
            packed[s // 2 : s // 2 + half.numel()].copy_(half)

    def _decode_rows(self, out, bodies, numel):
        if (kern := kernels()) is not None:
            return kern.decode(bodies, numel, self._bs, True, out)
        k, nb = bodies.shape[0], numel // self._bs
        scale = self._row_scales(bodies, nb)
        if scale is None:
            return False
        pairs = out.numpy().reshape(k, numel // 2, 2)  # whole blocks: an even count, no padding nibble
        np.take(_INT4_TABLE, bodies[:, 4 * nb :], axis=0, out=pairs, mode="clip")
        out.view(k, nb, self._bs).mul_(scale[:, :, None])
        lo, hi = (float(v) for v in torch.aminmax(out))  # nibble 0 decodes to NaN
        return math.isfinite(lo) and math.isfinite(hi)

    def _decode_body(self, body, numel):
        if (out := self._native_decode_body(body, numel)) is not None:
            return out
        scale = self._read_scales(body, numel)
        packed = np_view(body, np.uint8, (numel + 1) // 2, 4 * scale.numel())
        out = torch.empty(numel, dtype=torch.float32)
        npairs = numel // 2
        pairs = out.numpy()[: 2 * npairs].reshape(npairs, 2)
        for s, t in chunks(numel, self._step):
            np.take(_INT4_TABLE, packed[s // 2 : t // 2], axis=0, out=pairs[s // 2 : t // 2], mode="clip")
            if t == numel and numel % 2:
                last = int(packed[-1])
                if last >> 4 != 8:
                    raise CodecError("corrupted payload: int4 padding nibble is not zero")
                out[numel - 1] = float(_INT4_TABLE[last, 0])
            self._dequantize_(out, scale, s, t)
            lo, hi = (float(v) for v in torch.aminmax(out[s:t]))  # NaN propagates
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise CodecError("corrupted payload: int4 nibble 0 (code -8) is never produced")
        return out


@functools.lru_cache(maxsize=64)
def _rows_struct(k: int, plen: int) -> struct.Struct:
    """A ``struct`` of ``k`` byte strings of ``plen`` bytes: its ``unpack`` makes the ``k``
    ``bytes`` of a rows array in one call (a layout has a few distinct ``(k, plen)``)."""
    return struct.Struct(f"{plen}s" * k)


@per_chunk_list
def _consecutive_end(chunks: tuple) -> int | None:
    """Where the ranges end when each starts where the one before ended, the first at 0; else None."""
    end = 0
    for o, n in chunks:
        if o != end or n < 0:
            return None
        end += n
    return end


@per_chunk_list
def _rows_plan(chunks: tuple, bs: int) -> "tuple[tuple[int, int], ...] | None":
    """:func:`_uniform_runs` of ``chunks`` when every chunk starts on a block boundary (and so
    on an even element: block sizes are even), else None."""
    if not all(o % bs == 0 for o, _ in chunks):
        return None
    return tuple(_uniform_runs(chunks))


def _uniform_runs(ranges) -> list[tuple[int, int]]:
    """``(start, end)`` index ranges of the maximal runs of ``(offset, numel)`` ranges of one
    size, each starting where the one before ended (``[(0, 4), (4, 4), (8, 2)]`` ->
    ``[(0, 2), (2, 3)]``)."""
    runs: list[tuple[int, int]] = []
    start = 0
    for m, group in itertools.groupby(ranges, key=lambda r: r[1]):
        offsets = [o for o, _ in group]
        o0, k = offsets[0], len(offsets)
        if m and offsets == list(range(o0, o0 + k * m, m)):
            runs.append((start, start + k))
        else:  # not contiguous (or empty ranges): split where a range does not follow the one before
            cut = start
            for i in range(1, k + 1):
                if i == k or offsets[i] != offsets[i - 1] + m:
                    runs.append((cut, start + i))
                    cut = start + i
        start += k
    return runs
