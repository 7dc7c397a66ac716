"""FFN activation kernels (``ffn.metal``): wrappers and oracles.

* :func:`silu_mul` -- the seeds' ``muser_silu_mul_inplace``: ``(g / (1 + exp(-g))) * u``;
* :func:`gelu_mul` -- its GELU-tanh twin (ggml's ``kernel_geglu`` formula) for gemma;
* :func:`ffn_q4k_gate_up_4r2s` -- the opt-in fused Q4_K gate+up+activation kernel.

The oracles take the transcendental (``exp``, ``tanh``) as an argument: by default the
correctly rounded float32 value, so CPU results are as exact as the formula allows; the
GPU check passes the device's own ``exp``/``tanh`` of the same inputs, so that kernel and
oracle can be compared bit for bit, and measures the function's ULP error separately.
"""

from __future__ import annotations

import mlx.core as mx

from . import fp
from .backend import Kernel, backend, constant
from .fp import CPU
from .mul_mv import F32, Q4KRows, _flat, q4_K_lane_inputs

GELU_COEF_A = 0.044715
SQRT_2_OVER_PI = 0.79788456080286535587989211986876
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def silu_oracle(g, u, exp=fp.exp) -> mx.array:
    with mx.stream(CPU):
        g, u = g.astype(F32), u.astype(F32)
        one = mx.array(1.0, F32)
        return (g / (one + exp(-g))) * u


def gelu_oracle(g, u, tanh=fp.tanh) -> mx.array:
    with mx.stream(CPU):
        g, u = g.astype(F32), u.astype(F32)
        inner = fp.fma(mx.array(GELU_COEF_A, F32) * g, g, mx.array(1.0, F32))
        t = tanh((mx.array(SQRT_2_OVER_PI, F32) * g) * inner)
        return ((mx.array(0.5, F32) * g) * (mx.array(1.0, F32) + t)) * u


def ffn_4r2s_oracle(x, w_gate, w_up, activation="silu", exp=fp.exp, tanh=fp.tanh) -> mx.array:
    """The fused kernel's gate and up sums (one running sum per sub-block), then the activation."""
    R = w_gate.shape[0]
    nb = w_gate.shape[1] // 144
    x2 = _flat(x, nb * 256)
    T = x2.shape[0]
    with mx.stream(CPU):
        Y, sumy = q4_K_lane_inputs(x2, nb)
        Y = Y[:, None]  # [T, 1, nb, h, iq, c, ir, i]

        def rows_sum(w):
            rows = Q4KRows(w)
            nib = [rows.lo, rows.hi]
            acc = []
            for h in (0, 1):  # q1 (yl) then q2 (yh)
                for c in (0, 1):  # low nibbles with y[+0], high nibbles with y[+32]
                    a = mx.zeros((1,), F32)
                    for k in range(8):
                        a = fp.fma(Y[:, :, :, h, :, c, :, k], nib[c][:, :, h, :, :, k][None], a)
                    acc.append(a)  # [T, R, nb, iq, ir]
            scaled = acc[1] * rows.lane(rows.sc, 1)
            scaled = fp.fma(acc[0], rows.lane(rows.sc, 0), scaled)
            scaled = fp.fma(acc[2], rows.lane(rows.sc, 4), scaled)
            scaled = fp.fma(acc[3], rows.lane(rows.sc, 5), scaled)
            return rows.lane_totals(scaled, sumy, T)

        g, u = rows_sum(w_gate), rows_sum(w_up)
        out = silu_oracle(g, u, exp) if activation == "silu" else gelu_oracle(g, u, tanh)
        return out.reshape(*x.shape[:-1], R)


_SILU = Kernel("ffn", "silu_mul_inplace", ["gate", "up", "count"], ["out"])
_GELU = Kernel("ffn", "gelu_mul_inplace", ["gate", "up", "count"], ["out"])
_4R2S = Kernel("ffn", "ffn_q4k_gate_up_silu_4r2s", ["W_gate", "W_up", "x"], ["out"])
KERNELS = (_SILU, _GELU, _4R2S)


def _elementwise(kernel, g, u, which):
    n = g.size
    (out,) = kernel(
        [g.astype(F32).reshape(-1), u.astype(F32).reshape(-1), constant(n, mx.uint32)],
        [(n,)], [F32], grid=(n, 1, 1), threadgroup=(min(256, n), 1, 1), template=None, which=which,
    )
    return out.reshape(g.shape)


def silu_mul(gate, up, which=None) -> mx.array:
    """``silu(gate) * up`` as the seeds' ``muser_silu_mul_inplace`` computes it."""
    which = which or backend()
    if which == "cpu":
        return silu_oracle(gate, up)
    return _elementwise(_SILU, gate, up, which)


def gelu_mul(gate, up, which=None) -> mx.array:
    """``gelu_tanh(gate) * up`` with ggml's formula and constants."""
    which = which or backend()
    if which == "cpu":
        return gelu_oracle(gate, up)
    return _elementwise(_GELU, gate, up, which)


def ffn_q4k_gate_up_4r2s(x, w_gate, w_up, activation: str = "silu", which=None) -> mx.array:
    """Fused ``act(x @ Wg.T) * (x @ Wu.T)`` over raw Q4_K rows (the seeds' opt-in 4r2s kernel)."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gate {w_gate.shape} and up {w_up.shape} rows differ")
    which = which or backend()
    if which == "cpu":
        return ffn_4r2s_oracle(x, w_gate, w_up, activation)
    R, K = w_gate.shape[0], w_gate.shape[1] // 144 * 256
    x2 = _flat(x, K)
    T = x2.shape[0]
    (out,) = _4R2S(
        [w_gate, w_up, x2], [(T, R)], [F32], grid=(-(-R // 4) * 64, 1, T), threadgroup=(64, 1, 1),
        template=[("ROWS", R), ("COLS", K), ("ACT", ACTIVATIONS[activation])], which=which,
    )
    return out.reshape(*x.shape[:-1], R)
