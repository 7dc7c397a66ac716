"""Standalone RMSNorm kernels (``rms_norm.metal``): wrappers, geometry rules and oracles.

* :func:`rms_norm_mul` -- llama.cpp's ``kernel_rms_norm_mul_f32_4`` (and its F=1/F=3 twins);
  the serving norm of the pinned route (entry norm, layer 0's pre-norm, QK-norms).
* :func:`rms_norm_batch` -- the seeds' Ferrite ``rms_norm_batch`` (128 threads, rsqrt).
* :func:`rms_norm_f16` -- the split no-fast-math norm of the cross-vendor seam (F16 out).
"""

from __future__ import annotations

import mlx.core as mx

from . import fp
from .backend import Kernel, backend, constant
from .fp import CPU

F32 = mx.float32


def threads_seeds(n4: int) -> int:
    """The seeds' pin (Ch 12 §12.4.2): next_pow2(n/4) clamped to [32, 1024]."""
    return min(1024, max(32, 1 << max(n4 - 1, 0).bit_length()))


def threads_llama(n4: int) -> int:
    """Today's llama.cpp (ggml-metal-ops.cpp:4228-4235): min(1024, roundup32(n/4))."""
    return min(1024, max(32, -(-n4 // 32) * 32))


# Named norm geometries: equal at 6,656 (1,024 threads) and 128 (32), different elsewhere
# (1,152 -> 512 vs 288 threads), so the choice changes the reduction tree and the bits.
GEOMETRIES = {"seeds": threads_seeds, "llama": threads_llama}


def norm_threads(n: int, geometry: str) -> int:
    if geometry not in GEOMETRIES:
        raise ValueError(f"unknown norm geometry {geometry!r} (choose from {', '.join(GEOMETRIES)})")
    return GEOMETRIES[geometry](n // 4)


def _rows(x: mx.array) -> tuple[mx.array, int]:
    n = x.shape[-1]
    if n % 4 or n < 8:
        raise ValueError(f"pinned norms need a row length that is a multiple of 4 and >= 8, got {n}")
    return x.astype(F32).reshape(-1, n), n


def _eps(eps: float) -> mx.array:
    return constant(float(eps), F32)


# -- oracles -------------------------------------------------------------------------------


def ggml_sum_of_squares(x2: mx.array, nth: int) -> mx.array:
    """The ggml norm reduction of rows ``x2 [rows, N]`` with ``nth`` threads -> ``[rows]``.

    Thread t sums dot(x4[i], x4[i]) for i = t, t+nth, ...; each SIMD group simd_sums its 32
    threads; the group totals fill 32 zero-padded slots, which are simd_summed again.
    """
    with mx.stream(CPU):
        rows, n = x2.shape
        x4 = fp.pad_axis(x2.reshape(rows, n // 4, 4), 1, nth).reshape(rows, -1, nth, 4)
        per_thread = fp.running_sum(fp.dot4(x4, x4), axis=1)
        per_group = fp.simd_sum(per_thread.reshape(rows, nth // 32, 32))
        return fp.simd_sum(fp.pad_axis(per_group, 1, 32))


def ggml_scale(total: mx.array, n: int, eps: float) -> mx.array:
    """``1.0f / sqrt(sum / N + eps)`` in float32."""
    with mx.stream(CPU):
        mean = total / mx.array(n, dtype=F32)
        return mx.array(1.0, dtype=F32) / mx.sqrt(mean + mx.array(eps, dtype=F32))


def rms_norm_mul_oracle(x, w=None, eps=1e-5, add=None, nth=32) -> mx.array:
    x2, n = _rows(x)
    with mx.stream(CPU):
        scale = ggml_scale(ggml_sum_of_squares(x2, nth), n, eps)[:, None]
        y = x2 * scale
        w = None if w is None else w.astype(F32).reshape(-1, n)  # [1, N] or one row per row
        if w is not None and add is not None:
            y = fp.fma(y, w, add.astype(F32).reshape(-1, n))
        elif w is not None:
            y = y * w
        return y.reshape(x.shape)


def rms_norm_batch_oracle(x, w, eps=1e-5, rsqrt=fp.rsqrt) -> mx.array:
    """128 threads, float4 loads; thread 0 adds the four SIMD-group partials left to right."""
    x2, n = _rows(x)
    with mx.stream(CPU):
        rows = x2.shape[0]
        x4 = fp.pad_axis(x2.reshape(rows, n // 4, 4), 1, 128).reshape(rows, -1, 128, 4)
        per_thread = fp.running_sum(fp.dot4(x4, x4), axis=1)
        parts = fp.simd_sum(per_thread.reshape(rows, 4, 32))
        total = ((parts[:, 0] + parts[:, 1]) + parts[:, 2]) + parts[:, 3]
        inv = rsqrt(total / mx.array(n, dtype=F32) + mx.array(eps, dtype=F32))
        return ((x2 * inv[:, None]) * w.astype(F32)).reshape(x.shape)


def rms_norm_f16_oracle(x, w16, eps=1e-5, nth=32) -> mx.array:
    x2, n = _rows(x)
    with mx.stream(CPU):
        scale = ggml_scale(ggml_sum_of_squares(x2, nth), n, eps)[:, None]
        normed = (x2 * scale).astype(mx.float16)
        return (normed.astype(F32) * w16.astype(F32)).astype(mx.float16).reshape(x.shape)


# -- kernels -------------------------------------------------------------------------------

_RMS_NORM_MUL = Kernel("rms_norm", "rms_norm_mul", ["x", "w", "a", "eps"], ["out"])
_RMS_NORM_BATCH = Kernel("rms_norm", "rms_norm_batch", ["x", "weight", "eps"], ["out"])
_RMS_NORM_F16 = Kernel("rms_norm", "rms_norm_f16", ["x", "eps"], ["out"])
_MUL_F16 = Kernel("rms_norm", "mul_f16", ["x", "w", "count"], ["out"])
KERNELS = (_RMS_NORM_MUL, _RMS_NORM_BATCH, _RMS_NORM_F16, _MUL_F16)


def rms_norm_mul(x, w=None, eps: float = 1e-5, add=None, geometry: str = "llama", which=None, n=None,
                 rows=None, out_shape=None) -> mx.array:
    """llama.cpp's RMSNorm: ``x*scale`` (no ``w``), ``(x*scale)*w``, or ``(x*scale)*w + add``.

    Rows are the last axis of ``x``; ``w`` is ``[N]``, or ``[rows, N]`` for one weight per row
    (every row's bits are the same as normalizing it alone); ``add`` has ``x``'s shape.
    The decode path normalizes the first ``rows`` rows of ``n`` values of ``x`` as they lie
    (``x`` flat, no slice), into ``out_shape``.
    """
    n = x.shape[-1] if n is None else n
    if n % 4 or n < 8:
        raise ValueError(f"pinned norms need a row length that is a multiple of 4 and >= 8, got {n}")
    nth = norm_threads(n, geometry)
    which = which or backend()
    if rows is not None:
        if rows * n > x.size or add is not None:
            raise ValueError(f"{rows} rows of {n} do not fit in {x.size} values (or an add was given)")
        shape = (rows, n) if out_shape is None else tuple(out_shape)
        if which == "cpu":
            x = x.reshape(-1)[: rows * n].reshape(rows, n)
            return rms_norm_mul_oracle(x, w, eps, None, nth).reshape(shape)
    else:
        rows, shape = x.size // n, x.shape
    per_row = w is not None and w.ndim == 2
    if per_row and w.shape != (rows, n):
        raise ValueError(f"per-row weights {w.shape} do not match {rows} rows of {n}")
    if which == "cpu":
        return rms_norm_mul_oracle(x, w, eps, add, nth)
    mode = 1 if w is None else (3 if add is not None else 2)
    # rows are read in place whatever the leading shape (a reshape would be one more op per call)
    x = x.astype(F32)
    inputs = [x, x if w is None else w.astype(F32), x if add is None else add.astype(F32), _eps(eps)]
    (out,) = _RMS_NORM_MUL(
        inputs, [shape], [F32], grid=(rows * nth, 1, 1), threadgroup=(nth, 1, 1),
        template=[("N", n), ("NTH", nth), ("MODE", mode), ("WROW", int(per_row))], which=which,
    )
    return out


def rms_norm_batch(x, w, eps: float = 1e-5, which=None) -> mx.array:
    """The seeds' Ferrite ``rms_norm_batch``: 128 threads per row, rsqrt."""
    x2, n = _rows(x)
    which = which or backend()
    if which == "cpu":
        return rms_norm_batch_oracle(x, w, eps)
    (out,) = _RMS_NORM_BATCH(
        [x2, w.astype(F32), _eps(eps)], [x2.shape], [F32], grid=(x2.shape[0] * 128, 1, 1),
        threadgroup=(128, 1, 1), template=[("N", n)], which=which,
    )
    return out.reshape(x.shape)


def rms_norm_f16(x, w, eps: float = 1e-5, geometry: str = "llama", which=None) -> mx.array:
    """The cross-vendor seam: unweighted RMS rounded to F16, then the F16 weight multiply (F16 out)."""
    x2, n = _rows(x)
    nth = norm_threads(n, geometry)
    w16 = w.astype(mx.float16)
    which = which or backend()
    if which == "cpu":
        return rms_norm_f16_oracle(x, w16, eps, nth)
    rows = x2.shape[0]
    (normed,) = _RMS_NORM_F16(
        [x2, _eps(eps)], [x2.shape], [mx.float16], grid=(rows * nth, 1, 1), threadgroup=(nth, 1, 1),
        template=[("N", n), ("NTH", nth)], which=which,
    )
    total = rows * n
    (out,) = _MUL_F16(
        [normed, w16, constant(total, mx.uint32)], [x2.shape], [mx.float16], grid=(total, 1, 1),
        threadgroup=(min(256, total), 1, 1), template=[("N", n)], which=which,
    )
    return out.reshape(x.shape)


