"""The fused sandwich tails (``norm_tail.metal``): wrappers and oracles.

Both compute ``hidden += rms_norm(src, eps1) * w1; output = rms_norm(hidden, eps2) * w2``:

* :func:`tail_dual_eps` -- exact: bit-equal to ``rms_norm_mul(src, w1, eps1, add=hidden)``
  followed by ``rms_norm_mul(hidden, w2, eps2)`` with the same geometry (tested);
* :func:`tail_32sg` -- the legacy one-token tail: 1,024 threads, rsqrt, a serial combine
  of 32 partials. Same math, a different reduction: not bit-equal (tested).
"""

from __future__ import annotations

import mlx.core as mx

from . import fp
from .backend import Kernel, backend
from .fp import CPU
from .rms_norm import F32, _eps, _rows, ggml_scale, ggml_sum_of_squares, norm_threads


def tail_dual_eps_oracle(hidden, src, w1, w2, eps1, eps2, nth):
    s2, n = _rows(src)
    h2 = hidden.astype(F32).reshape(-1, n)
    with mx.stream(CPU):
        scale1 = ggml_scale(ggml_sum_of_squares(s2, nth), n, eps1)[:, None]
        h_new = fp.fma(s2 * scale1, w1.astype(F32), h2)
        scale2 = ggml_scale(ggml_sum_of_squares(h_new, nth), n, eps2)[:, None]
        out = (h_new * scale2) * w2.astype(F32)
        return h_new.reshape(src.shape), out.reshape(src.shape)


def _serial_32(x4: mx.array, n: int, eps: float, rsqrt) -> mx.array:
    """The 32sg reduction of ``x4 [rows, n4, 4]``: 1,024 threads, thread 0 adds 32 partials in order."""
    rows = x4.shape[0]
    parts = fp.pad_axis(x4, 1, 1024).reshape(rows, -1, 1024, 4)
    per_group = fp.simd_sum(fp.running_sum(fp.dot4(parts, parts), axis=1).reshape(rows, 32, 32))
    total = fp.running_sum(per_group, axis=1)
    return rsqrt(total / mx.array(n, dtype=F32) + mx.array(eps, dtype=F32))[:, None]


def tail_32sg_oracle(hidden, src, w1, w2, eps1, eps2, rsqrt=fp.rsqrt):
    s2, n = _rows(src)
    h2 = hidden.astype(F32).reshape(-1, n)
    with mx.stream(CPU):
        rows = s2.shape[0]
        inv_src = _serial_32(s2.reshape(rows, -1, 4), n, eps1, rsqrt)
        # hidden4[i] + src4[i] * inv_src * weight14[i]: the add takes the product chain as an fma
        h_new = fp.fma(s2 * inv_src, w1.astype(F32), h2)
        inv_hidden = _serial_32(h_new.reshape(rows, -1, 4), n, eps2, rsqrt)
        out = (h_new * inv_hidden) * w2.astype(F32)
        return h_new.reshape(src.shape), out.reshape(src.shape)


_DUAL_EPS = Kernel(
    "norm_tail", "fused_norm_residual_rms_norm_batch_dual_eps",
    ["hidden", "src", "weight1", "weight2", "eps1", "eps2"], ["hidden_out", "output"],
)
_DUAL_EPS_Q8 = Kernel(
    "norm_tail", "fused_norm_residual_rms_norm_batch_dual_eps_q8",
    ["hidden", "src", "weight1", "weight2", "eps1", "eps2"], ["hidden_out", "output", "qy", "ds"],
    parts=("fused_norm_residual_rms_norm_batch_dual_eps", "tail_q8"),
)
_DUAL_EPS_Q4 = Kernel(
    "norm_tail", "fused_norm_residual_rms_norm_batch_dual_eps_q4",
    ["hidden", "src", "weight1", "weight2", "eps1", "eps2"], ["hidden_out", "output", "ys", "sy"],
    parts=("fused_norm_residual_rms_norm_batch_dual_eps", "tail_q4"), uses=("mul_mv",),  # the lanes' factors
)
_32SG = Kernel(
    "norm_tail", "fused_norm_residual_rms_norm_32sg",
    ["hidden", "src", "weight1", "weight2", "eps1", "eps2"], ["hidden_out", "output"],
)
KERNELS = (_DUAL_EPS, _DUAL_EPS_Q8, _DUAL_EPS_Q4, _32SG)


def _launch(kernel, hidden, src, w1, w2, eps1, eps2, nth, template, which, extra=()):
    """One launch; ``extra``: the (shape, dtype) of outputs after the two rows."""
    n = src.shape[-1]
    if hidden.shape != src.shape:
        raise ValueError(f"hidden {hidden.shape} and src {src.shape} differ")
    rows = src.size // n
    src, hidden = src.astype(F32), hidden.astype(F32)  # rows read in place: no reshape per call
    shapes = [src.shape, src.shape] + [shape for shape, _ in extra]
    dtypes = [F32, F32] + [dtype for _, dtype in extra]
    return kernel(
        [hidden, src, w1.astype(F32), w2.astype(F32), _eps(eps1), _eps(eps2)], shapes, dtypes,
        grid=(rows * nth, 1, 1), threadgroup=(nth, 1, 1), template=template, which=which,
    )


def _tail_and_form(kernel, group: str, size: int, cpu_form, extra, hidden, src, w1, w2, eps1, eps2, geometry, which,
                   template=()):
    """The exact tail and its output in a matvec's input form: ``(hidden, output, form)``, where
    rows must be a multiple of ``size`` values (``group`` names what they come in) and ``extra``
    gives the form's outputs; on the CPU, ``cpu_form(output)``. ``template``: the form's own
    template arguments."""
    n = src.shape[-1]
    if n % size:
        raise ValueError(f"{group} of {size} values, not {n}")
    nth = norm_threads(n, geometry)
    which = which or backend()
    if which == "cpu":
        hid, out = tail_dual_eps_oracle(hidden, src, w1, w2, eps1, eps2, nth)
        return hid, out, cpu_form(out)
    hid, out, *form = _launch(kernel, hidden, src, w1, w2, eps1, eps2, nth, [("N", n), ("NTH", nth), *template],
                              which, extra)
    return hid, out, tuple(form)


def tail_dual_eps(hidden, src, w1, w2, eps1: float, eps2: float, geometry: str = "llama", which=None):
    """Exact tail: ``(hidden + rms_norm(src, eps1)*w1, rms_norm(that, eps2)*w2)`` in ggml's order."""
    nth = norm_threads(src.shape[-1], geometry)
    which = which or backend()
    if which == "cpu":
        return tail_dual_eps_oracle(hidden, src, w1, w2, eps1, eps2, nth)
    return tuple(_launch(_DUAL_EPS, hidden, src, w1, w2, eps1, eps2, nth,
                         [("N", src.shape[-1]), ("NTH", nth)], which))


def tail_dual_eps_q8(hidden, src, w1, w2, eps1: float, eps2: float, geometry: str = "llama", which=None):
    """:func:`tail_dual_eps` (the same bits) that also returns its output as
    :func:`~muse_mlx.kernels.mul_mv.quantize_q8_rows` writes it, ``(qy, ds)``, for the opt-in
    q8 GLU: one dispatch where the two take two. Rows of a multiple of 32 values."""
    from .mul_mv import quantize_q8_rows

    # quantize_q8's layout of the output: flat words, flat (d, sum) pairs
    extra = [((src.size // 4,), mx.uint32), ((src.size // 16,), F32)]
    return _tail_and_form(_DUAL_EPS_Q8, "q8 activations come in groups", 32, lambda out: quantize_q8_rows(out, "cpu"),
                          extra, hidden, src, w1, w2, eps1, eps2, geometry, which)


def tail_dual_eps_q4(hidden, src, w1, w2, eps1: float, eps2: float, geometry: str = "llama", which=None,
                     kind: str = "q4_K"):
    """:func:`tail_dual_eps` (the same bits) that also returns its output prepared for the exact
    Q4_K matvecs of geometry kind ``kind`` after it ("q4_K", the GLU, or "q4_K multi"), as
    :func:`~muse_mlx.kernels.mul_mv.q4_K_prepared` gives it for their nibble form (their
    ``prep=``): the lanes then neither scale nor sum the activations. Rows of a multiple of 256
    values."""
    from .mul_mv import Q4KPrepared, q4_K_prepared, q4K_halves

    which = which or backend()
    # a backend without a halves form (the CPU: its oracles read y) gets form 1's; lanes of form 0
    # refuse prepared activations, and lanes of the other form these (mul_mv._prep_inputs)
    form = q4K_halves(which, kind) or 1
    extra = [(src.shape, F32), ((*src.shape[:-1], src.shape[-1] // 8), F32)]  # scaled values, run sums
    hid, out, made = _tail_and_form(_DUAL_EPS_Q4, "Q4_K activations come in blocks", 256,
                                    lambda o: q4_K_prepared(o, form), extra, hidden, src, w1, w2, eps1, eps2,
                                    geometry, which, [("HALVES", form)])
    return hid, out, Q4KPrepared(made[0], made[1], form)


def tail_32sg(hidden, src, w1, w2, eps1: float, eps2: float, which=None):
    """The seeds' legacy tail (opt-in flag ``tail_32sg``): 1,024 threads, rsqrt, serial combine."""
    which = which or backend()
    if which == "cpu":
        return tail_32sg_oracle(hidden, src, w1, w2, eps1, eps2)
    return _launch(_32SG, hidden, src, w1, w2, eps1, eps2, 1024, [("N", src.shape[-1])], which)
