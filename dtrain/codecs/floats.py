"""Float codecs: fp32 (lossless), bf16, fp16 (with a per-tensor power-of-two scale)."""

from __future__ import annotations

import math

import numpy as np
import torch

from dtrain.codecs.base import (
    SLACK,
    TINY,
    Codec,
    absmax_checked,
    chunks,
    finite_or_raise,
    from_scaled_fp16,
    non_finite_error,
    np_view,
    pow2_exponent,
    t_view,
    to_scaled_fp16,
)

__all__ = ["Fp32Codec", "Bf16Codec", "Fp16Codec"]

_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def _chunk_absmax(c: torch.Tensor, x: torch.Tensor) -> float:
    lo, hi = (float(v) for v in torch.aminmax(c))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise non_finite_error(x)
    return max(-lo, hi)


class Fp32Codec(Codec):
    """numel little-endian float32. Lossless; the finiteness check is the only work."""

    lossless = True
    base = "fp32"

    def _body_bytes(self, numel: int) -> int:
        return 4 * numel

    def _encode_into(self, x, out, generator):
        dst = t_view(out, np.float32, x.numel())
        for s, t in chunks(x.numel()):
            dst[s:t].copy_(x[s:t])
            _chunk_absmax(dst[s:t], x)

    def _decode_body(self, body, numel):
        src = np_view(body, np.float32, numel)
        out = torch.empty(numel, dtype=torch.float32)
        out_np = out.numpy()
        for s, t in chunks(numel):
            out_np[s:t] = src[s:t]
            finite_or_raise(out[s:t])
        return out

    def _max_error(self, x, absmax):
        return 0.0


class Bf16Codec(Codec):
    """numel bfloat16, round to nearest even; |x| beyond bf16 max is clamped to it.

    Error bound: 2^-8 max|x| (RNE gives <= 2^-9 |x_i|; the clamp at the very top of the
    fp32 range, max|x| > 3.39e38, costs < 2^-7 max|x| and doubles the bound).
    """

    base = "bf16"

    def _body_bytes(self, numel: int) -> int:
        return 2 * numel

    def _encode_into(self, x, out, generator):
        dst = t_view(out, np.int16, x.numel()).view(torch.bfloat16)
        for s, t in chunks(x.numel()):
            c = x[s:t]
            if _chunk_absmax(c, x) > _BF16_MAX:  # would round to inf
                c = c.clamp(-_BF16_MAX, _BF16_MAX)
            dst[s:t].copy_(c)

    def _decode_body(self, body, numel):
        src = np_view(body, np.int16, numel)
        bits = torch.empty(numel, dtype=torch.int32)
        bits_np = bits.numpy()
        out = bits.view(torch.float32)
        for s, t in chunks(numel):
            bits_np[s:t] = src[s:t]  # sign-extends; the shift drops those bits
            bits[s:t].bitwise_left_shift_(16)  # bf16 bits are the top half of fp32's
            finite_or_raise(out[s:t])
        return out

    def _max_error(self, x, absmax):
        return absmax * 2.0**-8 * (2.0 if absmax > _BF16_MAX else SLACK) + TINY


class Fp16Codec(Codec):
    """int32 exponent e, then numel float16 of x * 2^-e.

    e is chosen per tensor so that max|x| * 2^-e lies in [2^14, 2^15): plain fp16 would
    overflow at 65504 and flush |x| < 6e-8 to zero, while pseudo-gradients live anywhere
    in fp32's range. Scaling by a power of two is exact. Error bound: 2^-11 max|x|.
    """

    base = "fp16"

    def _body_bytes(self, numel: int) -> int:
        return 4 + 2 * numel

    def _encode_into(self, x, out, generator):
        e = pow2_exponent(absmax_checked(x))
        t_view(out, np.int32, 1)[0] = e
        to_scaled_fp16(x, e, t_view(out, np.float16, x.numel(), 4))

    def _decode_body(self, body, numel):
        e = int(np_view(body, np.int32, 1)[0])
        return from_scaled_fp16(np_view(body, np.float16, numel, 4), e)

    def _max_error(self, x, absmax):
        return absmax * 2.0**-11 * SLACK + TINY
