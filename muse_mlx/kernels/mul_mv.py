"""Quantized matvecs over raw GGUF blocks (``mul_mv.metal``): wrappers and exact-order oracles.

``mul_mv_q4_K(y, w)`` and ``mul_mv_q6_K(y, w)`` compute ``y @ W.T`` for activations
``y [..., K]`` and raw rows ``w [R, K/256*bytes]``, with llama.cpp's lane assignment. The
oracles rebuild every lane's partial sums with the kernel's operations in the kernel's
order (all lanes and rows at once, as arrays), then the SIMD butterfly.
"""

from __future__ import annotations

import mlx.core as mx

from . import fp
from .backend import Kernel, backend
from .fp import CPU

F32 = mx.float32


def _flat(y: mx.array, k: int) -> mx.array:
    if y.shape[-1] != k:
        raise ValueError(f"activations have {y.shape[-1]} columns, the weight {k}")
    return y.astype(F32).reshape(-1, k)


def _k_scales(b: mx.array) -> tuple[mx.array, mx.array]:
    """The 6-bit (scale, min) of the 8 sub-blocks, as float32 [..., 8] (get_scale_min_k4)."""
    s = b[..., 4:16]
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = mx.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = mx.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return sc.astype(F32), m.astype(F32)


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
    R = w.shape[0]
    nb = w.shape[1] // 144
    K = nb * 256
    y2 = _flat(y, K)
    T = y2.shape[0]
    with mx.stream(CPU):
        b = w.reshape(R, nb, 144)
        d, dmin = fp.f16(b[..., 0:2]), fp.f16(b[..., 2:4])
        sc, m = _k_scales(b)
        # the lane's four sub-blocks: 2iq, 2iq+1 (low/high nibbles of q1), 2iq+4, 2iq+5 (q2)
        sub = lambda v, o: mx.stack([v[..., o], v[..., o + 2]], axis=-1)[..., :, None]  # noqa: E731
        s0, s1, s4, s5 = sub(sc, 0), sub(sc, 1), sub(sc, 4), sub(sc, 5)  # [R, nb, iq, 1]
        m0, m1, m4, m5 = sub(m, 0), sub(m, 1), sub(m, 4), sub(m, 5)
        qs = b[..., 16:144].reshape(R, nb, 2, 2, 4, 8)  # byte = 64h + 32iq + 8ir + j
        lo = (qs & 0x0F).astype(F32)
        hi = (qs >> 4).astype(F32)
        Y, sumy = q4_K_lane_inputs(y2, nb)
        Y = Y[:, None]  # [T, 1, nb, h, iq, c, ir, i]
        acc = {}
        for h in (0, 1):
            a = [mx.zeros((1,), F32)] * 4
            for i in range(4):
                yv = lambda c, k: Y[:, :, :, h, :, c, :, k]  # noqa: E731  [T, 1, nb, iq, ir]
                qv = lambda v, j, f: (v[:, :, h, :, :, j] * f)[None]  # noqa: E731  [1, R, nb, iq, ir]
                a[0] = fp.fma(yv(0, 2 * i), qv(lo, 2 * i, 1.0), a[0])
                a[1] = fp.fma(yv(0, 2 * i + 1), qv(lo, 2 * i + 1, 256.0), a[1])
                a[2] = fp.fma(yv(1, 2 * i), qv(hi, 2 * i, 16.0), a[2])
                a[3] = fp.fma(yv(1, 2 * i + 1), qv(hi, 2 * i + 1, 4096.0), a[3])
            acc[h] = a
        c256, c16 = mx.array(1.0 / 256.0, F32), mx.array(1.0 / 16.0, F32)
        a0 = fp.fma(c256, acc[0][1], acc[0][0])
        a1 = fp.fma(c256, acc[0][3], acc[0][2])
        b0 = fp.fma(c256, acc[1][1], acc[1][0])
        b1 = fp.fma(c256, acc[1][3], acc[1][2])
        scaled = (a1 * s1[None]) * c16
        scaled = fp.fma(a0, s0[None], scaled)
        scaled = fp.fma(b0, s4[None], scaled)
        scaled = fp.fma(b1 * s5[None], c16, scaled)
        Ys = sumy[:, None]  # [T, 1, nb, iq, ir, 4]
        mins = Ys[..., 1] * m1[None]
        mins = fp.fma(Ys[..., 0], m0[None], mins)
        mins = fp.fma(Ys[..., 2], m4[None], mins)
        mins = fp.fma(Ys[..., 3], m5[None], mins)
        dd, dm = d[None, :, :, None, None], dmin[None, :, :, None, None]
        part = fp.fma(dd, scaled, -(dm * mins))  # [T, R, nb, iq, ir]
        # lane (ix, iq, ir) walks blocks ix, ix+4, ...: a running sum per lane, then the butterfly
        part = fp.pad_axis(part, 2, 4).reshape(T, R, -1, 4, 2, 4)
        lanes = fp.running_sum(part, axis=2).reshape(T, R, 32)
        return fp.simd_sum(lanes).reshape(*y.shape[:-1], R)


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
