"""The compiled kernels of the blockwise codecs and error feedback (``kernels.c``): build, load, call.

Why compiled: the torch path of int8/int4 makes five to seven passes over each array
(absmax, divide, round, clamp, convert; on decode a strided int8 -> float32 copy that torch
does not vectorize, then the scale), ~11 ns per parameter of the 13 a round's arithmetic
cost one site (``experiments/bench_round_cpu.py``). The kernels do one read of the input
and one write of the output per array, with the same numbers bit for bit (the C file's
header says how; ``tests/unit/test_codec_native.py`` compares them).

Used for round-to-nearest encodes (stochastic rounding draws from a torch generator and
stays on the torch path), for every decode of a float32 CPU output, and for error
feedback's ``r ← β·r + (θ − local)`` where the model's tensors are float32 on the CPU (and
both in one pass where the engine encodes in the pseudo-gradient's pass: ``ef_accumulate_encode``). Built like the
datagram loop (:func:`dtrain.native.build_and_load`, ``-O3 -ffp-contract=off``); when it
cannot be built (no compiler) one warning says so and the torch path runs. ``DTRAIN_CODEC_
NATIVE=off`` in the environment keeps the torch path (to compare the two).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import torch
from zlib_ng import zlib_ng

from dtrain.native import build_and_load

__all__ = ["Kernels", "SgdStep", "kernels", "sgd_width"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "kernels.c"
VERSION = 8  # kernels.c BW_VERSION
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-strict-aliasing", "-shared", "-fPIC", "-Wall", "-Wextra"]


class Kernels:
    """Typed entry points of the loaded library (see ``kernels.c`` for each contract)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.bw_encode.restype, lib.bw_encode.argtypes = i, [vp, i64, i64, i64, i, vp, vp, vp, i]
        lib.bw_decode.restype, lib.bw_decode.argtypes = i, [vp, i64, i64, i64, i64, i, vp, i, i]
        lib.bw_check.restype, lib.bw_check.argtypes = i, [vp, i64, i64, i64, i64, i]
        lib.ef_accumulate.restype, lib.ef_accumulate.argtypes = i, [vp, vp, vp, i64, ctypes.c_float]
        lib.ef_accumulate_encode.restype = i
        lib.ef_accumulate_encode.argtypes = [vp, vp, vp, vp, i64, i64, ctypes.c_float, i64, i64, i, vp, vp, vp, i]
        f = ctypes.c_float
        lib.bw_decode_sgd.restype = i
        lib.bw_decode_sgd.argtypes = [vp, i64, i64, i64, i64, i, vp, vp, i64, i64, i64, f, f, f, f, i, i, vp]
        lib.bw_seal_rows.restype, lib.bw_seal_rows.argtypes = None, [vp, i64, i64, ctypes.c_char_p, vp, vp, i64, vp]
        lib.bw_check_headers.restype, lib.bw_check_headers.argtypes = i64, [vp, i64, i64, ctypes.c_char_p, vp, vp]
        self._lib = lib
        self._crc32 = _zlib_ng_crc32()

    @property
    def rows(self) -> bool:
        """Whether :meth:`seal_rows` and :meth:`check_headers` run (they need zlib-ng's
        ``zng_crc32`` as a C symbol; without it they are not called)."""
        return self._crc32 is not None

    def seal_rows(
        self, rows: np.ndarray, prefix: bytes, scales: np.ndarray | None = None, codes: np.ndarray | None = None
    ) -> None:
        """Write each row's header: ``prefix`` (28 bytes) and its body's crc32 (little-endian,
        bytes 28-31; the body is the row from byte 32). ``rows``: C-contiguous uint8
        ``(k, payload bytes)``. With ``scales`` and ``codes`` (contiguous uint8, ``k`` equal
        parts each: row r's scales, then its codes), the bodies are copied in first, in the
        same pass."""
        assert self._crc32 is not None and len(prefix) == 28
        assert rows.dtype == np.uint8 and rows.flags.c_contiguous and rows.ndim == 2 and rows.shape[1] >= 32
        k, plen = rows.shape
        sp = cp = None
        sbytes = 0
        if scales is not None:
            assert codes is not None and scales.flags.c_contiguous and codes.flags.c_contiguous
            sbytes = scales.nbytes // max(k, 1)
            assert scales.nbytes == k * sbytes and codes.nbytes == k * (plen - 32 - sbytes)
            sp, cp = scales.ctypes.data, codes.ctypes.data
        self._lib.bw_seal_rows(rows.ctypes.data, k, plen, prefix, self._crc32, sp, sbytes, cp)

    def check_headers(self, rows: np.ndarray, prefix: bytes, dtype_ok: np.ndarray) -> int:
        """-1 when every row of ``rows`` (C-contiguous uint8 ``(k, payload bytes)``) has the
        header ``prefix`` says (its bytes 0-6 and 8-27; byte 7 one with ``dtype_ok[byte]``
        nonzero, ``dtype_ok`` 256 uint8) and its body's crc32; else the index of the first
        row that does not."""
        assert self._crc32 is not None and len(prefix) == 28
        assert dtype_ok.dtype == np.uint8 and dtype_ok.shape == (256,) and dtype_ok.flags.c_contiguous
        assert rows.dtype == np.uint8 and rows.flags.c_contiguous and rows.ndim == 2 and rows.shape[1] >= 32
        bad = self._lib.bw_check_headers(
            rows.ctypes.data, rows.shape[0], rows.shape[1], prefix, dtype_ok.ctypes.data, self._crc32
        )
        return bad - 1

    def encode(
        self,
        x: torch.Tensor,
        bs: int,
        step: int,
        int4: bool,
        scales: np.ndarray,
        codes: np.ndarray,
        *,
        settle: bool = False,
    ) -> bool:
        """Fill ``scales`` (float32, one per block) and ``codes`` (uint8) from ``x`` (contiguous
        1-D float32 on the CPU; ``step`` a multiple of ``bs``); False when ``x`` holds inf or NaN.
        ``settle``: leave ``x − decoded`` in ``x`` (what :meth:`decode` with ``sub`` leaves; undone
        exactly by :meth:`decode` with ``unsettle``)."""
        quant, _q = _quantizer(bs, step, int4, scales, codes, settle)  # _q: alive until the call returns
        return self._lib.bw_encode(x.data_ptr(), x.numel(), *quant) == 0

    def accumulate(self, r: torch.Tensor, theta: torch.Tensor, x: torch.Tensor, decay: float) -> bool:
        """``r ← decay·r + (theta − x)`` in place (three contiguous float32 CPU tensors of one
        size; the torch path's roundings); whether every value of ``r`` is finite afterwards."""
        assert r.numel() == theta.numel() == x.numel()
        assert all(t.is_contiguous() and t.dtype == torch.float32 for t in (r, theta, x))
        return self._lib.ef_accumulate(r.data_ptr(), theta.data_ptr(), x.data_ptr(), r.numel(), decay) == 1

    def accumulate_encode(
        self,
        r: torch.Tensor,
        theta: torch.Tensor,
        pieces: Sequence[torch.Tensor],
        decay: float,
        bs: int,
        step: int,
        int4: bool,
        scales: np.ndarray,
        codes: np.ndarray,
        *,
        settle: bool,
    ) -> bool:
        """:meth:`accumulate` and :meth:`encode` of ``r`` in one pass, step by step while each
        step is in cache: the same numbers as the two calls in turn. ``pieces``: the local
        values ``x`` in order (contiguous float32 CPU tensors, e.g. views of the model's
        tensors), together ``r.numel()`` elements. False when ``r`` holds inf or NaN after the
        accumulation (``r``, ``scales`` and ``codes`` are then unspecified)."""
        assert r.numel() == theta.numel() == sum(p.numel() for p in pieces) and pieces
        assert all(t.is_contiguous() and t.dtype == torch.float32 for t in (r, theta, *pieces))
        ptrs = (ctypes.c_void_p * len(pieces))(*(p.data_ptr() for p in pieces))
        offs = (ctypes.c_int64 * (len(pieces) + 1))(*itertools.accumulate((p.numel() for p in pieces), initial=0))
        quant, _q = _quantizer(bs, step, int4, scales, codes, settle)  # _q: alive until the call returns
        lib = self._lib
        return (
            lib.ef_accumulate_encode(r.data_ptr(), theta.data_ptr(), ptrs, offs, len(pieces), r.numel(), decay, *quant)
            == 0
        )

    def check(self, bodies: np.ndarray, numel: int, bs: int, int4: bool) -> bool:
        """Whether every scale and code of the rows of ``bodies`` is one the encoder makes."""
        assert bodies.strides[1] == 1
        return self._lib.bw_check(bodies.ctypes.data, bodies.shape[0], bodies.strides[0], numel, bs, int(int4)) == 0

    def decode(
        self,
        bodies: np.ndarray,
        numel: int,
        bs: int,
        int4: bool,
        out: torch.Tensor,
        *,
        sub: bool = False,
        unsettle: bool = False,
        add: bool = False,
        checked: bool = False,
    ) -> bool:
        """Decode the rows of ``bodies`` (uint8, ``(k, >= body bytes)``, rows contiguous) into
        ``out`` (contiguous float32 CPU, ``k * numel``), or subtract them from it (``sub``), or
        add them back where the code is not 0 (``unsettle``: the exact inverse of
        :meth:`encode` with ``settle``), or add them to it (``add``: one rounding per element, as
        torch's ``add_`` of the decoded values); False (``out`` untouched: every row is checked first)
        when a scale or code is one the encoder never makes. ``checked``: these rows passed
        :meth:`check` already (not checked again; the caller's promise)."""
        k = bodies.shape[0]
        if k == 0:
            return True
        assert bodies.strides[1] == 1 and out.is_contiguous() and out.numel() == k * numel
        rc = self._lib.bw_decode(
            bodies.ctypes.data,
            k,
            bodies.strides[0],
            numel,
            bs,
            int(int4),
            out.data_ptr(),
            3 if add else 2 if unsettle else int(sub),
            int(checked),
        )
        return rc == 0

    def decode_sgd(
        self,
        bodies: np.ndarray,
        numel: int,
        bs: int,
        int4: bool,
        theta: torch.Tensor,
        buf: torch.Tensor,
        base: int,
        step: SgdStep,
    ) -> None:
        """One outer step of ``torch._fused_sgd_`` on the elements ``[base, base + k * numel)`` of
        a tensor of ``step.numel`` (``theta`` and its momentum ``buf``: contiguous float32 CPU
        views of those elements), the gradient being the rows of ``bodies`` decoded in the same
        pass (rows that passed :meth:`check`): the bits torch's step gives with the decoded
        values as the gradient, where :func:`sgd_width` found the ``step.width`` that gives them."""
        k = bodies.shape[0]
        assert bodies.strides[1] == 1 and theta.is_contiguous() and buf.is_contiguous()
        assert theta.numel() == buf.numel() == k * numel and theta.dtype == buf.dtype == torch.float32
        g = np.empty(bs, dtype=np.float32)  # one block's gradient
        self._lib.bw_decode_sgd(
            bodies.ctypes.data, k, bodies.strides[0], numel, bs, int(int4), theta.data_ptr(), buf.data_ptr(), base,
            step.numel, step.width, step.lr, step.momentum, 1.0 - step.dampening, step.weight_decay,
            int(step.nesterov), int(step.first), g.ctypes.data,
        )  # fmt: skip


class SgdStep(NamedTuple):
    """One ``torch._fused_sgd_`` step of a float32 tensor of ``numel`` elements (its
    hyperparameters as the optimizer's param group holds them; ``first``: the momentum buffer is
    new, torch's ``is_first_step``), and the width of torch's vectorized code (:func:`sgd_width`)."""

    numel: int
    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    first: bool
    width: int


#: Widths to try (``bw_decode_sgd``): torch's AVX-512 build, whose scalar tail its compiler
#: vectorized 8 at a time; then others a build might have
_SGD_WIDTHS = (8, 4, 16)


@functools.cache
def sgd_width() -> int | None:
    """The width with which :meth:`Kernels.decode_sgd` gives exactly the bits of this torch's
    ``torch._fused_sgd_`` on float32 CPU tensors here, found once by stepping both on random
    tensors of 1-40 and a few hundred elements, every combination of first step, Nesterov,
    weight decay and dampening; None (torch's step is used) when none does, or without the
    kernels or a CPU fused SGD. Logged once."""
    kern = kernels()
    if kern is None or not hasattr(torch, "_fused_sgd_"):
        return None
    try:
        cases = _sgd_cases(kern)
        for width in _SGD_WIDTHS:
            if all(_sgd_agrees(kern, c, width) for c in cases):
                log.info("outer step decoded in one pass: torch's fused SGD, vector width %d", width)
                return width
    except RuntimeError as e:  # a torch without the CPU kernel
        log.info("fused outer step unavailable (%s): torch's step is used", e)
        return None
    log.info("no width gives torch's fused SGD bits here: the outer step decodes first, then torch steps")
    return None


def _sgd_cases(kern: Kernels) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    cases = []
    flags = itertools.product((False, True), (True, False), (0.0, 0.01), (0.0, 0.1))
    for (first, nesterov, wd, damp), n in itertools.product(flags, [*range(1, 41), 257, 611]):
        x = torch.randn(n, generator=g) * 1e-2
        scales, codes = np.empty(-(-n // 8), np.float32), np.empty(n, np.uint8)
        assert kern.encode(x, 8, 8 * len(scales), False, scales, codes)
        body = np.concatenate([scales.view(np.uint8), codes]).reshape(1, -1)
        theta, buf = torch.randn(n, generator=g), torch.randn(n, generator=g)
        cases.append((body, n, theta, buf, SgdStep(n, 0.7, 0.9, damp, wd, nesterov, first, 0)))
    return cases


def _sgd_agrees(kern: Kernels, case: tuple, width: int) -> bool:
    body, n, theta, buf, step = case
    grad = torch.empty(n)
    kern.decode(body, n, 8, False, grad)
    want_t, want_b, got_t, got_b = theta.clone(), buf.clone(), theta.clone(), buf.clone()
    torch._fused_sgd_(
        [want_t], [grad], [want_b], weight_decay=step.weight_decay, momentum=step.momentum, lr=step.lr,
        dampening=step.dampening, nesterov=step.nesterov, maximize=False, is_first_step=step.first,
    )  # fmt: skip
    kern.decode_sgd(body, n, 8, False, got_t, got_b, 0, step._replace(width=width))
    bits = torch.int32
    return torch.equal(want_t.view(bits), got_t.view(bits)) and torch.equal(want_b.view(bits), got_b.view(bits))


def _quantizer(
    bs: int, step: int, int4: bool, scales: np.ndarray, codes: np.ndarray, settle: bool
) -> tuple[tuple, np.ndarray]:
    """The arguments ``bw_encode`` and ``ef_accumulate_encode`` end with, and the one-block
    float32 scratch ``q`` whose address they pass (the caller keeps it until the call returns)."""
    q = np.empty(bs, dtype=np.float32)
    return (bs, step, int(int4), scales.ctypes.data, codes.ctypes.data, q.ctypes.data, int(settle)), q


def _zlib_ng_crc32() -> int | None:
    """The address of zlib-ng's ``zng_crc32`` in the loaded ``zlib_ng`` extension (the crc32
    the codecs call from Python), or None when that build does not export it."""
    try:
        fn = ctypes.CDLL(zlib_ng.__file__).zng_crc32
    except (OSError, AttributeError) as e:
        log.info("zlib-ng's zng_crc32 is not a C symbol here (%s): payload rows are sealed in Python", e)
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.cache
def kernels() -> Kernels | None:
    """The compiled kernels (built on first use), or None (after one warning) when they
    cannot be built or loaded, or when ``$DTRAIN_CODEC_NATIVE`` is ``off``."""
    if os.environ.get("DTRAIN_CODEC_NATIVE", "auto") == "off":
        return None
    lib, why = build_and_load(
        SOURCE, stem="blockwise", cflags=CFLAGS, libs=[], version_fn="bw_version", version=VERSION
    )
    if lib is None:
        log.warning("compiled codec kernels unavailable (%s): using the torch path", why)
        return None
    return Kernels(lib)
