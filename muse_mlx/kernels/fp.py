"""Exact float32 building blocks for the oracles, in MLX ops on the CPU stream.

Each function performs one float32 operation of a kernel with the kernel's rounding:
``fma`` is a single rounding of ``a*b + c`` (emulated exactly through float64, see below),
``simd_sum`` is the CUDA prelude's xor butterfly, ``dot4`` the prelude's FMA chain. Plain
float32 ``+ - * /`` and ``sqrt`` are IEEE in MLX's CPU ops, so they need no helper.

Every mul that feeds an add in an oracle goes through :func:`fma`: the kernels spell those
as ``fma()`` or let the CUDA compiler contract them, and a compiled oracle (``mx.compile``)
could contract a plain ``a*b + c`` too -- with ``fma`` there is nothing left to contract.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..quants import _f16

CPU = mx.cpu
LANES = 32


def fma(a, b, c) -> mx.array:
    """Correctly rounded float32 ``a*b + c``.

    The float64 product of two float32 values is exact; the float64 sum is rounded once, and
    its error is recovered exactly (TwoSum). Nudging an inexact sum to the neighbour whose
    last bit is odd ("round to odd") makes the final float64 -> float32 rounding correct,
    so there are no double-rounding ties.
    """
    with mx.stream(CPU):
        a64, b64, c64 = (mx.array(t).astype(mx.float64) for t in (a, b, c))
        p = a64 * b64
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)
        bits = mx.view(s, mx.int64)
        nudge = (err != 0) & ((bits & 1) == 0)
        away_from_zero = (err > 0) == (s > 0)
        bits = mx.where(nudge, bits + mx.where(away_from_zero, 1, -1), bits)
        return mx.view(bits, mx.float64).astype(mx.float32)


def dot4(a: mx.array, b: mx.array) -> mx.array:
    """The prelude's ``dot(float4, float4)`` over the last axis (size 4): a left-to-right FMA chain."""
    with mx.stream(CPU):
        acc = a[..., 0] * b[..., 0]
        for k in (1, 2, 3):
            acc = fma(a[..., k], b[..., k], acc)
        return acc


def simd_sum(v: mx.array, width: int = LANES) -> mx.array:
    """The prelude's ``simd_sum`` of the last axis (32 lanes), returned as one value per group;
    ``width`` lanes: the same butterfly over a group of that many (offsets width/2, ..., 1)."""
    with mx.stream(CPU):
        lanes = mx.arange(width, dtype=mx.uint32)
        off = width // 2
        while off:
            v = v + v[..., lanes ^ off]
            off //= 2
        return v[..., 0]


def running_sum(parts: mx.array, axis: int, start=None) -> mx.array:
    """``acc = start (0.0); for p in parts: acc += p`` along ``axis``, one float32 add at a time."""
    with mx.stream(CPU):
        parts = mx.moveaxis(parts, axis, 0)
        acc = mx.zeros(parts.shape[1:], dtype=mx.float32) if start is None else start
        for i in range(parts.shape[0]):
            acc = acc + parts[i]
        return acc


def pad_axis(x: mx.array, axis: int, multiple: int) -> mx.array:
    """Zero-pad ``axis`` up to a multiple (threads past the end contribute +0.0)."""
    n = x.shape[axis]
    extra = -n % multiple
    if extra == 0:
        return x
    with mx.stream(CPU):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return mx.pad(x, widths)


def f16(lo_hi: mx.array) -> mx.array:
    """Two uint8 lanes (last axis) -> the little-endian float16 they spell, as float32 (one axis fewer)."""
    with mx.stream(CPU):
        return _f16(lo_hi)[..., 0]


# MLX's float64 exp on the CPU is only float32-accurate (relative error ~2e-6, measured), so
# the reference transcendentals are built here from float64 + - * / alone.
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10  # ln2 = hi + lo, hi*k exact


def _exp64(x: mx.array) -> mx.array:
    """exp in float64 to ~1e-15: x = k*ln2 + r, |r| <= ln2/2, Taylor to r^13, times 2^k."""
    x = mx.clip(x, -744.0, 709.0)
    k = mx.round(x * (1.0 / 0.6931471805599453))
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = mx.ones_like(r)
    for n in range(13, 0, -1):
        p = 1.0 + p * r / n
    # 2^k split in two factors so that k below -1022 stays representable (subnormal results)
    k1 = mx.floor(k / 2)
    two = lambda e: mx.view(((e.astype(mx.int64) + 1023) << 52), mx.float64)  # noqa: E731
    return (p * two(k1)) * two(k - k1)


def _tanh64(x: mx.array) -> mx.array:
    """tanh in float64: em1/(em1 + 2) with em1 = expm1(2|x|) (Taylor below 0.5, so no cancellation)."""
    a = mx.minimum(mx.abs(x), 20.0)  # tanh(20) rounds to 1 in float32
    y = 2.0 * a
    term, series = y, y
    for n in range(2, 19):
        term = term * y / n
        series = series + term
    em1 = mx.where(y < 0.5, series, _exp64(y) - 1.0)
    return mx.where(x < 0, -1.0, 1.0) * (em1 / (em1 + 2.0))


def correctly_rounded(fn64):
    """A float32 function from a float64 one accurate to ~1e-15 (what the kernel's function approximates)."""

    def f(x):
        with mx.stream(CPU):
            return fn64(x.astype(mx.float64)).astype(mx.float32)

    return f


def _numpy64(fn):
    """A float32 function through numpy's float64 one (sin, cos: correctly rounded to float32
    but for rare double roundings; MLX's own float64 transcendentals are float32-accurate)."""

    def f(x):
        with mx.stream(CPU):
            return mx.array(fn(np.array(x.astype(mx.float32), np.float64)).astype(np.float32))

    return f


exp = correctly_rounded(_exp64)
sin = _numpy64(np.sin)
cos = _numpy64(np.cos)
tanh = correctly_rounded(_tanh64)
rsqrt = correctly_rounded(lambda x: 1.0 / mx.sqrt(x))
