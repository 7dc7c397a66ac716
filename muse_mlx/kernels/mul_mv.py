"""Quantized matvecs over raw GGUF blocks (``mul_mv.metal``): wrappers and exact-order oracles.

``mul_mv_q4_K(y, w)`` and ``mul_mv_q6_K(y, w)`` compute ``y @ W.T`` for activations
``y [..., K]`` and raw rows ``w [R, K/256*bytes]``, with llama.cpp's lane assignment. The
oracles rebuild every lane's partial sums with the kernel's operations in the kernel's
order (all lanes and rows at once, as arrays), then the SIMD butterfly.
"""

from __future__ import annotations

import mlx.core as mx

from . import fp
from ..quants import _k_scale_min
from .backend import Kernel, backend
from .fp import CPU

F32 = mx.float32


def _flat(y: mx.array, k: int) -> mx.array:
    if y.shape[-1] != k:
        raise ValueError(f"activations have {y.shape[-1]} columns, the weight {k}")
    return y.astype(F32).reshape(-1, k)


class Q4KRows:
    """A Q4_K matrix's fields as every lane reads them (shared by the matvec and fused-FFN oracles).

    ``d``/``dmin`` are ``[1, R, nb, 1, 1]``; :meth:`lane` gives the 6-bit scale or min of the
    lane's sub-block ``o + 2*iq`` as ``[1, R, nb, iq, 1]``; ``lo``/``hi`` are the nibbles of
    byte ``64h + 32iq + 8ir + j`` as ``[R, nb, h, iq, ir, j]``.
    """

    def __init__(self, w: mx.array):
        R, nb = w.shape[0], w.shape[1] // 144
        b = w.reshape(R, nb, 144)
        self.R, self.nb = R, nb
        self.d = fp.f16(b[..., 0:2])[None, :, :, None, None]
        self.dmin = fp.f16(b[..., 2:4])[None, :, :, None, None]
        self.sc, self.m = (v.astype(F32) for v in _k_scale_min(b[..., 4:16]))
        qs = b[..., 16:144].reshape(R, nb, 2, 2, 4, 8)
        self.lo, self.hi = (qs & 0x0F).astype(F32), (qs >> 4).astype(F32)

    @staticmethod
    def lane(v: mx.array, o: int) -> mx.array:
        return mx.stack([v[..., o], v[..., o + 2]], axis=-1)[..., :, None][None]

    def lane_totals(self, scaled: mx.array, sumy: mx.array, T: int) -> mx.array:
        """``sumf += d*scaled - dmin*(Y0*m0 + ...)`` over each lane's blocks (ix, ix+4, ...), then simd_sum.

        ``scaled`` is ``[T, R, nb, iq, ir]``; returns ``[T, R]``."""
        lane, m = self.lane, self.m
        Ys = sumy[:, None]  # [T, 1, nb, iq, ir, 4]
        mins = Ys[..., 1] * lane(m, 1)
        mins = fp.fma(Ys[..., 0], lane(m, 0), mins)
        mins = fp.fma(Ys[..., 2], lane(m, 4), mins)
        mins = fp.fma(Ys[..., 3], lane(m, 5), mins)
        part = fp.fma(self.d, scaled, -(self.dmin * mins))
        part = fp.pad_axis(part, 2, 4).reshape(T, self.R, -1, 4, 2, 4)
        return fp.simd_sum(fp.running_sum(part, axis=2).reshape(T, self.R, 32))


def q4_K_lane_inputs(y2: mx.array, nb: int):
    """Each lane's activations: ``Y [T, nb, h, iq, c, ir, i]`` and ``sumy [T, nb, iq, ir, 4]``.

    Lane (iq, ir) of a block reads values 64*iq + 8*ir + i + {0, 32} (yl) and + {128, 160} (yh):
    h = 0/1 selects yl/yh, c = 0/1 the +0/+32 half. sumy[k] is a running sum over i.
    """
    T = y2.shape[0]
    Y = y2.reshape(T, nb, 2, 2, 2, 4, 8)  # index = 128h + 64iq + 32c + 8ir + i
    parts = [Y[:, :, h, :, c] for h in (0, 1) for c in (0, 1)]  # [T, nb, iq, ir, i]
    sumy = mx.stack([fp.running_sum(p, axis=-1) for p in parts], axis=-1)
    return Y, sumy


def mul_mv_q4_K_oracle(y, w) -> mx.array:
    nb = w.shape[1] // 144
    y2 = _flat(y, nb * 256)
    T = y2.shape[0]
    with mx.stream(CPU):
        rows = Q4KRows(w)
        lane = rows.lane
        Y, sumy = q4_K_lane_inputs(y2, nb)
        Y = Y[:, None]  # [T, 1, nb, h, iq, c, ir, i]
        acc = {}
        for h in (0, 1):
            a = [mx.zeros((1,), F32)] * 4
            for i in range(4):
                yv = lambda c, k: Y[:, :, :, h, :, c, :, k]  # noqa: E731  [T, 1, nb, iq, ir]
                qv = lambda v, j, f: (v[:, :, h, :, :, j] * f)[None]  # noqa: E731  [1, R, nb, iq, ir]
                a[0] = fp.fma(yv(0, 2 * i), qv(rows.lo, 2 * i, 1.0), a[0])
                a[1] = fp.fma(yv(0, 2 * i + 1), qv(rows.lo, 2 * i + 1, 256.0), a[1])
                a[2] = fp.fma(yv(1, 2 * i), qv(rows.hi, 2 * i, 16.0), a[2])
                a[3] = fp.fma(yv(1, 2 * i + 1), qv(rows.hi, 2 * i + 1, 4096.0), a[3])
            acc[h] = a
        c256, c16 = mx.array(1.0 / 256.0, F32), mx.array(1.0 / 16.0, F32)
        a0 = fp.fma(c256, acc[0][1], acc[0][0])
        a1 = fp.fma(c256, acc[0][3], acc[0][2])
        b0 = fp.fma(c256, acc[1][1], acc[1][0])
        b1 = fp.fma(c256, acc[1][3], acc[1][2])
        scaled = (a1 * lane(rows.sc, 1)) * c16
        scaled = fp.fma(a0, lane(rows.sc, 0), scaled)
        scaled = fp.fma(b0, lane(rows.sc, 4), scaled)
        scaled = fp.fma(b1 * lane(rows.sc, 5), c16, scaled)
        return rows.lane_totals(scaled, sumy, T).reshape(*y.shape[:-1], rows.R)


def mul_mv_q6_K_oracle(y, w) -> mx.array:
    R = w.shape[0]
    nb = w.shape[1] // 210
    K = nb * 256
    y2 = _flat(y, K)
    T = y2.shape[0]
    with mx.stream(CPU):
        b = w.reshape(R, nb, 210)
        d = fp.f16(b[..., 208:210])[None, :, :, None, None]
        sc = mx.view(b[..., 192:208], mx.int8).astype(F32).reshape(R, nb, 2, 8)  # [.., ip, 8]
        ql = b[..., 0:128].reshape(R, nb, 2, 2, 8, 4)  # byte = 64ip + 32s + 4il + l
        qh = b[..., 128:192].reshape(R, nb, 2, 8, 4)  # byte = 32ip + 4il + l
        q1, q2 = ql[:, :, :, 0], ql[:, :, :, 1]
        vals = [
            (q1 & 0xF) | ((qh & 0x03) << 4),
            (q2 & 0xF) | ((qh & 0x0C) << 2),
            (q1 >> 4) | (qh & 0x30),
            (q2 >> 4) | ((qh & 0xC0) >> 2),
        ]
        vals = [(v.astype(mx.int32) - 32).astype(F32)[None] for v in vals]  # [1, R, nb, ip, il, l]
        Y = y2.reshape(T, nb, 2, 4, 8, 4)[:, None]  # value = 128ip + 32k + 4il + l
        sums = []
        for k in range(4):
            s = mx.zeros((1,), F32)
            for l in range(4):
                s = fp.fma(Y[:, :, :, :, k, :, l], vals[k][..., l], s)
            sums.append(s)  # [T, R, nb, ip, il]
        # the lane's scales: is = 8*ip + il//4, then is+2, is+4, is+6
        il_group = mx.array([i // 4 for i in range(8)])
        scale = lambda o: mx.take(sc, il_group + o, axis=-1)[None]  # noqa: E731  [1, R, nb, ip, il]
        scaled = sums[1] * scale(2)
        scaled = fp.fma(sums[0], scale(0), scaled)
        scaled = fp.fma(sums[2], scale(4), scaled)
        scaled = fp.fma(sums[3], scale(6), scaled)  # [T, R, nb, ip, il]
        # lane (ip, il, ix) walks blocks ix, ix+2, ...: sumf = fma(d, scaled, sumf)
        d_b = mx.broadcast_to(d, scaled.shape)
        scaled = fp.pad_axis(scaled, 2, 2).reshape(T, R, -1, 2, 2, 8)
        d_b = fp.pad_axis(d_b, 2, 2).reshape(T, R, -1, 2, 2, 8)
        acc = mx.zeros((T, R, 2, 2, 8), F32)
        for j in range(scaled.shape[2]):
            acc = fp.fma(d_b[:, :, j], scaled[:, :, j], acc)
        lanes = acc.transpose(0, 1, 3, 4, 2).reshape(T, R, 32)  # lane = 16ip + 2il + ix
        return fp.simd_sum(lanes).reshape(*y.shape[:-1], R)


_Q4_K = Kernel("mul_mv", "mul_mv_q4_K_f32", ["w", "y"], ["dst"])
_Q6_K = Kernel("mul_mv", "mul_mv_q6_K_f32", ["w", "y"], ["dst"])
KERNELS = (_Q4_K, _Q6_K)


def _launch(kernel, y, w, block_bytes, which):
    R = w.shape[0]
    K = w.shape[1] // block_bytes * 256
    y2 = _flat(y, K)
    T = y2.shape[0]
    (dst,) = kernel(
        [w, y2], [(T, R)], [F32], grid=(-(-R // 4) * 32, 2, T), threadgroup=(32, 2, 1),
        template=[("K", K), ("ROWS", R)], which=which,
    )
    return dst.reshape(*y.shape[:-1], R)


def mul_mv_q4_K(y, w, which=None) -> mx.array:
    """``y @ W.T`` for raw Q4_K rows ``w`` -- llama.cpp's kernel_mul_mv_q4_K_f32 geometry."""
    which = which or backend()
    if which == "cpu":
        return mul_mv_q4_K_oracle(y, w)
    return _launch(_Q4_K, y, w, 144, which)


def mul_mv_q6_K(y, w, which=None) -> mx.array:
    """``y @ W.T`` for raw Q6_K rows ``w`` -- llama.cpp's kernel_mul_mv_q6_K_f32 geometry."""
    which = which or backend()
    if which == "cpu":
        return mul_mv_q6_K_oracle(y, w)
    return _launch(_Q6_K, y, w, 210, which)
