"""Quantized matvecs over raw GGUF blocks (``mul_mv.metal``): wrappers and exact-order oracles.

``mul_mv_q4_K(y, w)`` and ``mul_mv_q6_K(y, w)`` compute ``y @ W.T`` for activations
``y [..., K]`` and raw rows ``w [R, K/256*bytes]``, with llama.cpp's lane assignment. The
oracles rebuild every lane's partial sums with the kernel's operations in the kernel's
order (all lanes and rows at once, as arrays), then the SIMD butterfly.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import mlx.core as mx

from . import fp
from ..quants import _k_scale_min, _tile_shape, join_q6_K, untile_q4_K_rows
from .backend import Kernel, backend, constant
from .fp import CPU

F32 = mx.float32


def _flat(y: mx.array, k: int) -> mx.array:
    if y.shape[-1] != k:
        raise ValueError(f"activations have {y.shape[-1]} columns, the weight {k}")
    return y.astype(F32).reshape(-1, k)


def _tokens(y: mx.array, k: int) -> tuple[mx.array, int]:
    """``y`` as a kernel reads it (rows of ``k``, any leading shape: no reshape, which would be
    one more op per call) and its number of rows."""
    if y.shape[-1] != k:
        raise ValueError(f"activations have {y.shape[-1]} columns, the weight {k}")
    return y.astype(F32), y.size // k


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


class Q4KPrepared(NamedTuple):
    """Activations prepared for the exact Q4_K lanes of nibble form ``form`` (:func:`q4_K_prepared`)."""

    ys: mx.array
    sy: mx.array
    form: int


# Per nibble form (q4K_block's HALVES): the factors of the even and odd values, and of the run sums.
PREPARED_SCALES = {1: (2.0 ** 24, 2.0 ** 32, 1.0), 2: (2.0 ** 48, 2.0 ** 56, 2.0 ** 24)}
# The largest |y| each form takes exactly (past it the odd values overflow; form 0 has no limit).
HALVES_RANGE = {1: 2.0 ** 96, 2: 2.0 ** 72}


def q4_K_prepared(y: mx.array, form: int) -> Q4KPrepared:
    """Activations ``y [..., K]`` in the form the exact Q4_K lanes of nibble form ``form`` (1 or
    2, :func:`q4K_halves` of their kind) read with ``prep=``, as the tail before them writes it
    (``tail_dual_eps_q4``): ``ys`` = y with even values times 2^24 and odd ones times 2^32 (form
    1; form 2: 2^48, 2^56), and ``sy [..., K/8]``, each lane's four run sums per block (ggml's
    ``sumy``, summed in order from 0.0f; form 2: then times 2^24) at ``32*block + 4*(4*iq + ir) + k``.
    Exact (powers of two) below |y| = :data:`HALVES_RANGE`."""
    K = y.shape[-1]
    if K % 256:
        raise ValueError(f"Q4_K activations come in blocks of 256 values, not {K}")
    if form not in PREPARED_SCALES:
        raise ValueError(f"prepared Q4_K activations exist for nibble forms 1 and 2, not {form!r}")
    even, odd, sums = PREPARED_SCALES[form]
    y2 = _flat(y, K)
    with mx.stream(CPU):
        _, sumy = q4_K_lane_inputs(y2, K // 256)  # [T, nb, iq, ir, k]
        scale = mx.array([even, odd] * (K // 2), F32)
        sy = sumy.reshape(*y.shape[:-1], K // 8) * mx.array(sums, F32)
        return Q4KPrepared((y2 * scale).reshape(y.shape), sy, form)


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


# Matvec geometries: rows per SIMD group (NR0), SIMD groups per threadgroup (NSG), blocks of
# loads per row in a round (U), and how many rounds early each round's loads are issued (P).
# They decide occupancy, load sharing and latency hiding, never bits
# (each row is one SIMD group's butterfly over lanes whose sums do not depend on them). "ggml"
# is llama.cpp's; "tuned" is the one the engine launches, per backend (docs/performance-history.md).
MV_GEOMETRIES = {
    "ggml": (2, 2, 1, 0),
    # H200, 2026-12-01, timed inside a real decode (scripts/gpu_timeline.py --geometries, per
    # kernel; docs/performance-history.md): two blocks of loads in flight (U = 2) take the Q6_K ffn_down
    # from 88.7 to 64.3 us and the GLU from 74.0 to 70.0 us; the Q4_K ffn_down alone prefers U = 1
    # (42.6 vs 46.4 us), a smaller loss. Whole token 12.34 -> 11.47 ms. (bench.py's isolated
    # timings, which replay one matrix, had shown no geometry clearly ahead: part of a replayed
    # matrix stays in L2.) So a lone Q4_K matrix (ffn_down, attn_output: "q4_K single") keeps
    # U = 1, and the GLU and the fused projections (two or more matrices: "q4_K") take U = 2.
    # Ninth session (same tool, 30e2bee): issuing each round's loads a round early (P = 1) beats
    # both, at U = 1 on every Q4_K matrix (GLU 70.0 -> 65.7 us, ffn_down 42.4 -> 38.6, attn_out
    # 10.65 -> 9.97, q|k|v|gate 20.97 -> 19.10) and on the Q6_K ffn_down at 2x4 (63.6 -> 60.8;
    # the head 409 -> 431, a smaller loss); with U = 2 the Q6_K kernels were slower (88-103 us).
    # The vocabulary head (202,048 Q6_K rows, "q6_K head") kept the old 4x4x2x0 in the same lease-1
    # traces: 409 us against 431 at 2x4x1x1. Thirteenth session: since the Q6_K lanes keep one
    # pointer per row (62 registers at P = 2, one wave), P = 2 takes the Q6_K ffn_down from 62.1 to
    # 57.2 us (0.13 ms per token); in the ninth session, at 72 registers, it had saved 2 us.
    # Metal: unmeasured, so ggml's.
    # Twentieth session: the multi kernel (q|k|v|gate, "q4_K multi") has a kind of its own, so that
    # the lone and multi calls, whose grids run 1.26 and 1.65 waves at 2x2x1x1, were timed apart
    # from the GLU (MUSE_MLX_MV_GEOMETRY_SINGLE, _MULTI). Geometries that fit one wave lost: the Q4_K
    # ffn_down took 39.0 us at 2x2x1x1, 42.3 at 3x2x1x0, 43.6 at 2x2x1x0, 48.8 at 4x2x1x0; the multi
    # kernel 18.0 at 2x2x1x1, 17.8-18.0 at 3x2x1x0 (within the spread), 20.2-21.0 at 2x2x1x0 and
    # 4x2x1x0; the GLU 62.5 at 2x2x1x1 and at 2x2x1x0 alike, 86.6 at 4x2x1x0. So 2x2x1x1 stays.
    # Twenty-second session: with its weights staged in threadgroup memory (Q4K_STAGES, S = 2), the lone
    # kind takes four rows a SIMD group, which shares each round's copies and activations among four
    # rows (126 registers, one wave): the Q4_K ffn_down 35.8-35.9 us against 38.3-38.6 staged at 2x2x1x1
    # and 39.3-39.7 with register loads, attn_output 9.3 against 10.3 and 9.8. (With register loads
    # 4x2x1x0 is the slow one, 48.8 us: MUSE_MLX_Q4K_STAGES_SINGLE=0 wants MUSE_MLX_MV_GEOMETRY_SINGLE=2x2x1x1.)
    "tuned": {"cuda": {"q4_K": (2, 2, 1, 1), "q4_K single": (4, 2, 1, 0), "q4_K multi": (2, 2, 1, 1),
                       "q6_K": (2, 4, 1, 2), "q6_K head": (4, 4, 2, 0)},
              "metal": {"q4_K": (2, 2, 1, 0), "q4_K single": (2, 2, 1, 0), "q4_K multi": (2, 2, 1, 0),
                        "q6_K": (2, 2, 1, 0), "q6_K head": (2, 2, 1, 0)}},
}
# the variables that override "tuned", per kind, the first one set winning (a head follows the
# Q6_K setting unless it has its own, so a Q6_K sweep moves it as before; likewise the lone and
# multi Q4_K calls follow the GLU's MUSE_MLX_MV_GEOMETRY unless they have their own)
_GEOMETRY_ENV = {"q4_K": ("MUSE_MLX_MV_GEOMETRY",),
                 "q4_K single": ("MUSE_MLX_MV_GEOMETRY_SINGLE", "MUSE_MLX_MV_GEOMETRY"),
                 "q4_K multi": ("MUSE_MLX_MV_GEOMETRY_MULTI", "MUSE_MLX_MV_GEOMETRY"),
                 "q6_K": ("MUSE_MLX_MV_GEOMETRY_Q6K",),
                 "q6_K head": ("MUSE_MLX_MV_GEOMETRY_HEAD", "MUSE_MLX_MV_GEOMETRY_Q6K")}


# The Q4_K lanes' nibble form per backend (q4K_block's HALVES; the bits are the same either way).
# 0: each nibble through the 2^23 float pattern (two instructions per value on NVIDIA). 1: two
# nibbles at a time as subnormal halves against activations scaled by 2^24/2^32, one conversion
# per value, and with it the tails' prepared activations (q4K_prep): 13-16 % fewer instructions in
# the GLU's and the projections' loops (kernel_sass.py, NVRTC 13.5; docs/kernels.md). On CUDA since
# the eleventh session: bit for bit on the H200 (`gpu_check.py --only q4_forms`) and 113.0 against
# 111.0 tok/s at context 128 on the same machine (docs/performance-history.md). 2: form 1, and the block's
# scales and mins as subnormal halves too, picked by byte permutes (against activations scaled by
# 2^48/2^56, run sums by 2^24: exact below |y| = 2^72, HALVES_RANGE): 8 % fewer instructions in
# the GLU's loop and the multi kernel's, 5 % in the lone kernel's. Per geometry kind, since the
# kinds took it differently on the H200 (twenty-first session, docs/performance-history.md): the GLU 3.5 %
# faster with 2, the lone ffn_down 18 % slower (NVRTC issues two of its activation loads after the
# arithmetic that needs the first six: a second wait on memory each round), the multi kernel no
# faster. Metal: 0, since whether half subnormals survive there is unchecked (no Mac).
Q4K_HALVES = {"cuda": {"q4_K": 2, "q4_K single": 1, "q4_K multi": 1}, "metal": 0}
Q4K_KINDS = ("q4_K", "q4_K single", "q4_K multi")  # the GLU, the lone matvec, the multi kernel
# The switches per kind: a kind's own, else the one for all of them.
_HALVES_ENV = {"q4_K": ("MUSE_MLX_Q4K_HALVES_GLU", "MUSE_MLX_Q4K_HALVES"),
               "q4_K single": ("MUSE_MLX_Q4K_HALVES_SINGLE", "MUSE_MLX_Q4K_HALVES"),
               "q4_K multi": ("MUSE_MLX_Q4K_HALVES_MULTI", "MUSE_MLX_Q4K_HALVES")}


# How many rounds of weights the exact Q4_K lanes of each geometry kind stage in threadgroup
# memory (q4K_stage_round; S, 0 = none: each round's loads go to registers, P rounds early). With
# S > 0 a SIMD group copies the next S - 1 rounds' blocks (576 bytes a row each) into threadgroup
# memory, on NVIDIA with asynchronous copies that hold no registers, and each lane reads its words
# from there: the same words, so the same bits. It needs U = 1 and leaves P unused. Timed inside
# the decode on the H200 (twenty-second session, docs/performance-history.md): the GLU 54.3-54.6 us at S = 2
# against 57.6-57.9 with register loads (and 59.2 at S = 4), 125.0 against 122.3 tok/s at ctx 128.
# At their 2x2x1x1 the lone kernel's ffn_down ran 1.5 % faster at S = 2 but its attn_output 5 % slower
# and the multi kernel 1 % slower (two rows a round carry the copies); at four rows a SIMD group
# (MV_GEOMETRIES, 4x2x1x0) the lone kernel staged beats both (ffn_down 35.8 against 39.3-39.7 us,
# attn_output 9.3 against 9.8), and the multi kernel at 4x2x1x0 staged only ties its register loads.
# So the GLU and the lone kernel are staged, the multi kernel is not. Metal: none (unmeasured).
Q4K_STAGES = {"cuda": {"q4_K": 2, "q4_K single": 2, "q4_K multi": 0}}
_STAGES_ENV = {"q4_K": ("MUSE_MLX_Q4K_STAGES_GLU", "MUSE_MLX_Q4K_STAGES"),
               "q4_K single": ("MUSE_MLX_Q4K_STAGES_SINGLE", "MUSE_MLX_Q4K_STAGES"),
               "q4_K multi": ("MUSE_MLX_Q4K_STAGES_MULTI", "MUSE_MLX_Q4K_STAGES")}


def q4K_stages(which: str, kind: str, geometry: tuple[int, int, int, int]) -> int:
    """The rounds of weights the Q4_K lanes of geometry kind ``kind``, launched at ``geometry`` (NR0,
    NSG, U, P), stage in threadgroup memory on this backend (:data:`Q4K_STAGES`; 0 for none, and for a
    recorded call, as on Metal: the emulator's default is the register loads; when staged, their P is
    unused: a Q6_K matrix of the same multi call keeps it). ``MUSE_MLX_Q4K_STAGES=S`` (0, or 2 to 4) overrides it for every kind,
    ``MUSE_MLX_Q4K_STAGES_GLU``, ``_SINGLE``, ``_MULTI`` for one. Staging takes one block of loads a
    round: at U > 1 the default and ``MUSE_MLX_Q4K_STAGES`` give none, and a kind's own variable is an
    error."""
    return _stages(Q4K_STAGES, _STAGES_ENV[kind], which, kind, geometry, geometry[2] == 1,
                   f"staged Q4_K loads take one block of loads a round, not U={geometry[2]}")


# The same for the exact Q6_K matvecs (q6K_stage_round): two 208-byte blocks a row a round, in the
# split form only (raw 210-byte blocks do not sit at 16-byte boundaries: they keep their register
# loads) and at U = 1; the d's are
# still loaded into registers P = S - 1 rounds ahead. "q6_K" is the lone Q6_K matrix (a ffn_down),
# "q6_K head" the vocabulary head, whose tuned geometry has U = 2 (so no staging by default, and
# MUSE_MLX_Q6K_STAGES_HEAD needs MUSE_MLX_MV_GEOMETRY_HEAD with U = 1). Timed inside the decode on
# the H200 (twenty-second session, docs/performance-history.md): the ffn_down 42.1 us at S = 2 against
# 42.6-42.7 with register loads in both alternations (46.5 at S = 3), so S = 2 there; Metal: none.
Q6K_STAGES = {"cuda": {"q6_K": 2, "q6_K head": 0}}
_Q6K_STAGES_ENV = {"q6_K": ("MUSE_MLX_Q6K_STAGES",), "q6_K head": ("MUSE_MLX_Q6K_STAGES_HEAD",)}


def _stages(table: dict, names: tuple[str, ...], which: str, kind: str, geometry, fits: bool, why: str) -> int:
    """Rounds staged in threadgroup memory for a kind: its variables (the first set wins; 0, or 2 to 4),
    else ``table``. Where staging does not fit (``fits`` False:
    ``why``) the default and a variable shared by several kinds (``names[1:]``) fall back to 0, and
    the kind's own variable (``names[0]``) is an error."""
    for k, name in enumerate(names):
        env = os.environ.get(name)
        if env is not None:
            if env not in ("0", "2", "3", "4"):
                raise ValueError(f"{name}={env!r}: expected 0 (no staging) or 2, 3 or 4 rounds")
            if env != "0" and not fits:
                if k:
                    return 0
                raise ValueError(f"{name}={env}: {why} (geometry {'x'.join(map(str, geometry))})")
            return int(env)
    stages = table.get(which, {}).get(kind, 0)
    return stages if fits else 0


def q6K_stages(which: str, kind: str, geometry: tuple[int, int, int, int], split: bool) -> int:
    """The rounds of quant words the exact Q6_K lanes of kind ``kind`` ("q6_K", "q6_K head"), launched
    at ``geometry`` on a matrix in the split form or not, stage in threadgroup memory
    (:data:`Q6K_STAGES`; ``MUSE_MLX_Q6K_STAGES`` overrides it for the lone matrices,
    ``MUSE_MLX_Q6K_STAGES_HEAD`` for the head). Only the split form is staged (raw 210-byte blocks
    always load into registers: the same bits), and only at one block of loads a round (U = 1; asked
    for at another U, it is an error)."""
    if not split:
        return 0
    return _stages(Q6K_STAGES, _Q6K_STAGES_ENV[kind], which, kind, geometry, geometry[2] == 1,
                   f"staged Q6_K loads take one block of loads a round, not U={geometry[2]}")


def _switch(name: str, default: bool | None) -> bool | None:
    """An on/off environment switch: ``name=1`` or ``0``; unset, ``default``; anything else an error."""
    env = os.environ.get(name)
    if env is None:
        return default
    if env not in ("0", "1"):
        raise ValueError(f"{name}={env!r}: expected 0 or 1")
    return env == "1"


def q4K_halves(which: str, kind: str) -> int:
    """The nibble form of the Q4_K lanes of geometry kind ``kind`` (:data:`Q4K_KINDS`) on this
    backend (:data:`Q4K_HALVES`; 0 where it has none). ``MUSE_MLX_Q4K_HALVES=0|1|2`` overrides it
    for every kind, ``MUSE_MLX_Q4K_HALVES_GLU``, ``_SINGLE`` and ``_MULTI`` for one."""
    if kind not in _HALVES_ENV:
        raise ValueError(f"no Q4_K nibble form for kind {kind!r} (kinds: {', '.join(Q4K_KINDS)})")
    for name in _HALVES_ENV[kind]:
        env = os.environ.get(name)
        if env is not None:
            if env not in ("0", "1", "2"):
                raise ValueError(f"{name}={env!r}: expected 0, 1 or 2")
            return int(env)
    table = Q4K_HALVES.get(which, 0)
    return table.get(kind, 0) if isinstance(table, dict) else table


# Whether the pinned route holds its Q6_K matrices in the split form (quants.split_q6_K) for the
# exact kernels, per backend. A raw Q6_K block is 210 bytes, so the exact lanes read it 2 bytes at
# a time: eleven loads per block and row where the split form takes four (q6K_load_round). The
# words, so the bits, are the same; the switch is MUSE_MLX_Q6K_SPLIT=0|1. On by default on CUDA
# (nineteenth session, docs/performance-history.md); Metal keeps the reference's layout (no Mac here to
# time it on).
Q6K_SPLIT = {"cuda": 1}


def q6K_split(which: str) -> bool:
    """Whether the exact Q6_K matvecs read the split form on this backend (:data:`Q6K_SPLIT`)."""
    on = _switch("MUSE_MLX_Q6K_SPLIT", None)
    return bool(Q6K_SPLIT.get(which, 0)) if on is None else on


# Resident warps per SM that the exact Q4_K GLU is compiled for on CUDA (``__launch_bounds__``;
# 0 leaves ptxas its own choice), per nibble form of the GLU. It holds 153-165 registers, so 12
# warps per SM fit; bounded for 16 it fits 128. The arithmetic is the same instructions either way,
# so the bits are too. Form 1 spills 28 bytes prepared (kernel_sass.py, NVRTC 13.5), and on the
# H200 16 warps lost there (thirteenth session: 63.4-63.5 against 61.5-62.1 us; twenty-first:
# 64.2-64.5 against 61.1-61.9). Form 2 fits 128 with no spill, and 16 warps win (twenty-first
# session, docs/performance-history.md: 57.6-58.0 against 58.8-59.1 us, 0.06 ms a token).
GLU_WARPS = {"cuda": {2: 16}}


def _bounded_warps(which: str, nsg: int, default: int, var: str, what: str) -> int:
    """Resident warps per SM a kernel of ``nsg`` SIMD groups per threadgroup is bounded for: on
    CUDA (and in a recorded call, which is what CUDA would compile) ``default``, unless the
    environment variable ``var`` says otherwise (a multiple of ``nsg``, at most 64; 0 for none)."""
    if which not in ("cuda", "record"):
        return 0
    env = os.environ.get(var)
    if env is None:
        return default
    if not env.isdigit() or int(env) > 64 or int(env) % nsg:
        raise ValueError(f"{var}={env!r}: expected 0 or a multiple of {what}'s {nsg} SIMD groups "
                         "per threadgroup, at most 64")
    return int(env)


def glu_min_blocks(which: str, nsg: int, form: int) -> int:
    """Threadgroups of ``nsg`` SIMD groups per SM the Q4_K GLU of nibble form ``form`` is bounded for
    (:data:`GLU_WARPS`): ``MUSE_MLX_GLU_WARPS=N`` overrides it (N a multiple of ``nsg``, at most 64;
    0 for none)."""
    default = GLU_WARPS.get("cuda", {}).get(form, 0)
    return _bounded_warps(which, nsg, default, "MUSE_MLX_GLU_WARPS", "the GLU") // nsg


# Resident warps per SM the vocabulary head is compiled for on CUDA at its tuned geometry
# (``__launch_bounds__``). That geometry won its traces at 72 registers, 28 warps per SM. The
# Q6_K lanes' present load form (q6K_load_round, twelfth session) would take it to 80 registers,
# 24 warps, for 5 % fewer instructions; bounded for 28 warps it compiles to 72 registers, no
# spill and the old form's instruction count (kernel_sass.py, NVRTC 13.5): the head as it was
# timed, while the other Q6_K matrices keep the new form's savings. Traced on the H200 (thirteenth
# session): 395.5-400.3 us bounded against 418.5 unbounded (MUSE_MLX_HEAD_WARPS=0), and 409 in the
# old form. Other head geometries are not bounded.
HEAD_WARPS = {"cuda": 28}


def head_min_blocks(which: str, geometry: tuple[int, int, int, int]) -> int:
    """Threadgroups per SM the head of ``geometry`` (NR0, NSG, U, P) is bounded for: :data:`HEAD_WARPS`
    at the tuned head geometry, none at any other; ``MUSE_MLX_HEAD_WARPS=N`` sets it for any."""
    tuned = tuple(geometry) == tuple(MV_GEOMETRIES["tuned"]["cuda"]["q6_K head"])
    default = HEAD_WARPS.get("cuda", 0) if tuned else 0
    return _bounded_warps(which, geometry[1], default, "MUSE_MLX_HEAD_WARPS", "the head") // geometry[1]


# Resident warps per SM that the lone exact Q4_K matvec (attn_output, a Q4_K ffn_down) and the
# multi kernel (q|k|v|gate) are compiled for on CUDA (0: ptxas's own choice). Unbounded they hold
# 95-96 registers, 20 warps per SM, so the release's 1,664 and 2,176 threadgroups of two warps
# run in 1.26 and 1.65 waves, and issue on 45-60 % of the cycles (ncu on the H200, nineteenth
# session, docs/performance-history.md). A bound buys a fuller last wave with registers; the bits cannot
# change (the same instructions, allocated differently). Timed in the twentieth session, 24 warps
# lost: the Q4_K ffn_down 50.7 against 39.5 us, attn_output 12.0 against 9.7, the multi kernel
# 20.6 against 18.0 (spills and 9-11 % more instructions cost more than the fuller wave). So none.
Q4K_WARPS = {"cuda": 0}
MULTI_WARPS = {"cuda": 0}


def q4K_min_blocks(which: str, nsg: int) -> int:
    """Threadgroups per SM the lone Q4_K matvec is bounded for (:data:`Q4K_WARPS`;
    ``MUSE_MLX_Q4K_WARPS=N`` overrides it: N a multiple of ``nsg``, at most 64; 0 for none)."""
    return _bounded_warps(which, nsg, Q4K_WARPS.get("cuda", 0), "MUSE_MLX_Q4K_WARPS", "the Q4_K matvec") // nsg


def multi_min_blocks(which: str, nsg: int) -> int:
    """Threadgroups per SM the multi kernel is bounded for (:data:`MULTI_WARPS`;
    ``MUSE_MLX_MULTI_WARPS=N`` overrides it, as for :func:`q4K_min_blocks`)."""
    return _bounded_warps(which, nsg, MULTI_WARPS.get("cuda", 0), "MUSE_MLX_MULTI_WARPS", "the multi kernel") // nsg


def q4K_prep(which: str, kind: str) -> bool:
    """Whether the exact tails write their output prepared for the Q4_K matvecs of kind ``kind``
    after them (``tail_dual_eps_q4``; the matvecs' ``prep=``): on a GPU whose lanes of that kind
    take a halves form (:func:`q4K_halves`), unless ``MUSE_MLX_Q4K_PREP=0``. On the CPU the oracles
    read ``y`` anyway."""
    return (_switch("MUSE_MLX_Q4K_PREP", True) and which not in ("cpu", "record")
            and bool(q4K_halves(which, kind)))


def _prep_inputs(prep, y: mx.array, which: str, kind: str) -> tuple[list[mx.array], int]:
    """The ``ys``, ``sy`` inputs and PREP of a multi or GLU launch (geometry kind ``kind``) on
    activations ``y``: the prepared activations (:func:`q4_K_prepared`'s for ``y``), or two placeholders."""
    if prep is None:
        # eight floats: MLX's Metal kernels take an input of fewer than 8 elements in constant
        # space, which the lanes' device pointers cannot point at
        return [constant(0, F32, at_least=8)] * 2, 0
    form = q4K_halves(which, kind)
    if not form:
        raise ValueError(f"prepared Q4_K activations need a halves form ({_HALVES_ENV[kind][0]}=1 or 2)")
    ys, sy, made_for = prep
    if made_for != form:  # else every product would be off by a power of two
        raise ValueError(f"activations prepared for nibble form {made_for} given to lanes of form {form} "
                         f"({kind!r}; a tail prepares for the kind after it, see tail_dual_eps_q4)")
    want = (tuple(y.shape), (*y.shape[:-1], y.shape[-1] // 8))
    if (tuple(ys.shape), tuple(sy.shape)) != want:  # else the lanes would read past them
        raise ValueError(f"prepared activations of shapes {tuple(ys.shape)} and {tuple(sy.shape)} do not "
                         f"belong to activations {tuple(y.shape)} (expected {want[0]} and {want[1]})")
    return [ys.astype(F32), sy.astype(F32)], 1


def mv_geometry(geometry: str, which: str, kind: str = "q4_K") -> tuple[int, int, int, int]:
    """``(NR0, NSG, U, P)`` of a named geometry or of ``"NR0xNSG[xU[xP]]"`` (U defaults to 1, P
    to 0). "tuned" is per backend and kind ("q4_K": the GLU, "q4_K single", "q4_K multi", "q6_K",
    "q6_K head"); ``MUSE_MLX_MV_GEOMETRY`` (every Q4_K kind), ``MUSE_MLX_MV_GEOMETRY_SINGLE`` and
    ``_MULTI`` (those kinds alone), ``MUSE_MLX_MV_GEOMETRY_Q6K`` (Q6_K, the head too) and
    ``MUSE_MLX_MV_GEOMETRY_HEAD`` (the head alone) override it."""
    if "x" in geometry:
        try:
            parts = [int(v) for v in geometry.split("x")]
        except ValueError:
            parts = []
        if not 2 <= len(parts) <= 4:
            parts = [0, 0]  # fails the check below
        nr0, nsg, u, p = parts + [1, 0][len(parts) - 2:]  # U defaults to 1, P to 0
        if not (1 <= nr0 <= 8 and 1 <= nsg <= 32 and u in (1, 2, 3, 4) and 0 <= p <= 3):
            raise ValueError(f"matvec geometry {geometry!r}: expected NR0xNSG[xU[xP]] with NR0 1..8, "
                             "NSG 1..32, U 1..4, P 0..3")
        return nr0, nsg, u, p
    if geometry not in MV_GEOMETRIES:
        raise ValueError(f"unknown matvec geometry {geometry!r} (choose from {', '.join(MV_GEOMETRIES)})")
    g = MV_GEOMETRIES[geometry]
    if geometry == "tuned":
        env = next((os.environ[v] for v in _GEOMETRY_ENV[kind] if os.environ.get(v)), None)
        if env:
            return mv_geometry(env.lower(), which)
        return g.get(which, {}).get(kind, MV_GEOMETRIES["ggml"])
    return g


_Q4_K = Kernel("mul_mv", "mul_mv_q4_K_f32", ["w", "y"], ["dst"])
_Q6_K = Kernel("mul_mv", "mul_mv_q6_K_f32", ["w", "y"], ["dst"])
_MULTI = Kernel("mul_mv", "mul_mv_multi_f32", ["w0", "w1", "w2", "w3", "y", "ys", "sy"], ["dst"],
                parts=("multi_rows", "multi_any", "multi_out"))
# the same for Q4_K slots only: no Q6_K lanes in its source
_MULTI_Q4K = Kernel("mul_mv", "mul_mv_multi_q4K_f32", _MULTI.inputs, ["dst"], parts=("multi_rows", "multi_q4K", "multi_out"))
_GLU = Kernel("mul_mv", "mul_mv_glu_f32", ["wg", "wu", "y", "ys", "sy"], ["dst"], uses=("ffn",),
              parts=("glu_rows", "glu_q4K", "glu_out"))
_GLU_Q6K = Kernel("mul_mv", "mul_mv_glu_q6K_f32", _GLU.inputs, ["dst"], uses=("ffn",),
                  parts=("glu_rows", "glu_q6K", "glu_out"))
_DEQ = {dt: Kernel("mul_mv", f"dequant_{name}", ["w", "count"], ["out"])
        for dt, name in ((mx.float32, "f32"), (mx.float16, "f16"))}
_DEQ_AT = Kernel("mul_mv", "dequant_at_f32", ["w", "tokens", "count"], ["out"])
KERNELS = (_Q4_K, _Q6_K, _MULTI, _MULTI_Q4K, _GLU, _GLU_Q6K, *_DEQ.values(), _DEQ_AT)
BLOCK_BYTES = {"q4_K": 144, "q6_K": 210, "q6_K_split": 210}
TYPE_CODE = {"q4_K": 0, "q6_K": 1, "q6_K_split": 2}


def _k_of(w: mx.array, kind: str) -> int:
    return w.shape[1] // BLOCK_BYTES[kind] * 256


def _launch(kernel, y, w, which, geometry, kind, split=False):
    """One matvec of geometry ``kind`` ("q4_K single", "q6_K" or "q6_K head"); the head bounded
    as :func:`head_min_blocks` says. ``split``: a Q6_K ``w`` in the split form."""
    R = w.shape[0]
    qtype = kind.split()[0]
    K = _k_of(w, qtype)
    y, T = _tokens(y, K)
    nr0, nsg, u, p = mv_geometry(geometry, which, kind)
    template = [("K", K), ("ROWS", R), ("NR0", nr0), ("NSG", nsg), ("U", u), ("P", p)]
    if qtype == "q4_K":
        template += [("HALVES", q4K_halves(which, kind)), ("S", q4K_stages(which, kind, (nr0, nsg, u, p)))]
    else:
        template += [("SPLIT", int(split)), ("S", q6K_stages(which, kind, (nr0, nsg, u, p), split))]
    (dst,) = kernel(
        [w, y], [(*y.shape[:-1], R)], [F32], grid=(-(-R // (nr0 * nsg)) * 32, nsg, T), threadgroup=(32, nsg, 1),
        template=template, which=which,
        min_blocks=(head_min_blocks(which, (nr0, nsg, u, p)) if kind == "q6_K head"
                    else q4K_min_blocks(which, nsg) if qtype == "q4_K" else 0),
    )
    return dst


def mul_mv_q4_K(y, w, which=None, geometry: str = "tuned") -> mx.array:
    """``y @ W.T`` for raw Q4_K rows ``w`` -- llama.cpp's kernel_mul_mv_q4_K_f32 arithmetic."""
    which = which or backend()
    if which == "cpu":
        return mul_mv_q4_K_oracle(y, w)
    return _launch(_Q4_K, y, w, which, geometry, "q4_K single")


def mul_mv_q6_K(y, w, which=None, geometry: str = "tuned", head: bool = False, split: bool = False) -> mx.array:
    """``y @ W.T`` for raw Q6_K rows ``w`` -- llama.cpp's kernel_mul_mv_q6_K_f32 arithmetic.
    ``head``: the vocabulary head, which has a tuned geometry of its own (the same bits).
    ``split``: ``w`` is in the split form (:func:`~muse_mlx.quants.split_q6_K`): the same bits,
    with aligned loads (:func:`q6K_split`)."""
    which = which or backend()
    if which == "cpu":
        return ORACLES["q6_K_split" if split else "q6_K"](y, w)
    return _launch(_Q6_K, y, w, which, geometry, "q6_K head" if head else "q6_K", split)


def mul_mv_q6_K_split_oracle(y, w) -> mx.array:
    """The exact Q6_K matvec of a matrix in the split form: the raw rows' bits."""
    return mul_mv_q6_K_oracle(y, join_q6_K(w))


ORACLES = {"q4_K": mul_mv_q4_K_oracle, "q6_K": mul_mv_q6_K_oracle, "q6_K_split": mul_mv_q6_K_split_oracle}


def _four_slots(weights) -> tuple[list[mx.array], list[int], list[str]]:
    """A multi kernel's four slots: matrix inputs, row counts and kinds, the given matrices' first,
    then per absent slot 0 rows (no threadgroups, so never read) and a 16-byte placeholder. Not a
    copy of a matrix: MLX's CUDA backend counts every input's size towards its per-graph limit
    (``MLX_MAX_MB_PER_BUFFER``), so three copies of ffn_down made the ``mv_q8`` route commit 30
    graphs per token, not 16."""
    absent = 4 - len(weights)
    return ([w for w, _ in weights] + [constant(0, mx.uint8)] * absent,
            [w.shape[0] for w, _ in weights] + [0] * absent,
            [k for _, k in weights] + ["q4_K"] * absent)


def _common_k(weights, what: str) -> int:
    """The input width every matrix of a one-dispatch call reads (an error if they differ)."""
    K = _k_of(*weights[0])
    for w, kind in weights:
        if _k_of(w, kind) != K:
            raise ValueError(f"{what}: matrices read {K} and {_k_of(w, kind)} columns")
    return K


def mul_mv_multi(y, weights, which=None, geometry: str = "tuned", prep=None) -> mx.array:
    """``concat([y @ W.T for W in weights], -1)`` in one dispatch; ``weights`` = [(raw rows, "q4_K"|"q6_K")].

    Up to four matrices with the same input width; every row gets exactly the single kernels' bits.
    ``prep``: ``y`` prepared for the Q4_K lanes (:func:`q4_K_prepared`'s, from the tail that
    made ``y``), which then read it instead of scaling and summing ``y`` (the same bits)."""
    if not 1 <= len(weights) <= 4:
        raise ValueError(f"mul_mv_multi takes 1 to 4 matrices, got {len(weights)}")
    K = _common_k(weights, "mul_mv_multi")
    which = which or backend()
    if which == "cpu":
        return mx.concatenate([ORACLES[kind](y, w) for w, kind in weights], axis=-1)
    y, T = _tokens(y, K)
    nr0, nsg, u, p = mv_geometry(geometry, which, "q4_K multi")
    per_tg = nr0 * nsg
    mats, rows, kinds = _four_slots(weights)
    prepared, pre = _prep_inputs(prep, y, which, "q4_K multi")
    template = [("K", K), ("NR0", nr0), ("NSG", nsg), ("U", u), ("P", p), ("HALVES", q4K_halves(which, "q4_K multi")),
                ("PREP", pre), ("S", q4K_stages(which, "q4_K multi", (nr0, nsg, u, p)))]
    template += [(f"R{i}", rows[i]) for i in range(4)] + [(f"Y{i}", TYPE_CODE[kinds[i]]) for i in range(4)]
    groups = sum(-(-r // per_tg) for r in rows)
    (dst,) = (_MULTI_Q4K if all(k == "q4_K" for k in kinds) else _MULTI)(
        mats + [y] + prepared, [(*y.shape[:-1], sum(rows))], [F32], grid=(groups * 32, nsg, T),
        threadgroup=(32, nsg, 1), template=template, which=which, min_blocks=multi_min_blocks(which, nsg),
    )
    return dst


def mul_mv_glu(y, w_gate, w_up, kind: str, activation: str = "silu", which=None, geometry: str = "tuned",
               prep=None) -> mx.array:
    """``act(y @ Wg.T) * (y @ Wu.T)`` in one dispatch, with the unfused kernels' bits. ``prep``:
    as for :func:`mul_mv_multi` (Q4_K only)."""
    from .ffn import ACTIVATIONS, gelu_oracle, silu_oracle

    if w_gate.shape != w_up.shape:
        raise ValueError(f"gate {w_gate.shape} and up {w_up.shape} rows differ")
    which = which or backend()
    K, R = _k_of(w_gate, kind), w_gate.shape[0]
    if which == "cpu":
        g, u = ORACLES[kind](y, w_gate), ORACLES[kind](y, w_up)
        return silu_oracle(g, u) if activation == "silu" else gelu_oracle(g, u)
    if prep is not None and kind != "q4_K":
        raise ValueError(f"prepared activations are for Q4_K matrices, not {kind}")
    y, T = _tokens(y, K)
    nr0, nsg, u, p = mv_geometry(geometry, which, "q6_K" if kind == "q6_K_split" else kind)
    prepared, pre = _prep_inputs(prep, y, which, "q4_K")
    form = q4K_halves(which, "q4_K")
    stages = q4K_stages(which, "q4_K", (nr0, nsg, u, p)) if kind == "q4_K" else 0
    (dst,) = (_GLU if kind == "q4_K" else _GLU_Q6K)(
        [w_gate, w_up, y] + prepared, [(*y.shape[:-1], R)], [F32], grid=(-(-R // (nr0 * nsg)) * 32, nsg, T),
        threadgroup=(32, nsg, 1),
        template=[("K", K), ("ROWS", R), ("TYPE", TYPE_CODE[kind]), ("ACT", ACTIVATIONS[activation]),
                  ("NR0", nr0), ("NSG", nsg), ("U", u), ("P", p), ("HALVES", form),
                  ("PREP", pre), ("S", stages)], which=which, min_blocks=glu_min_blocks(which, nsg, form) if kind == "q4_K" else 0,
    )
    return dst


# -- the opt-in int8-activation matvec (flag mv_q8): NOT exact ---------------------------------


def quantize_q8(y2: mx.array):
    """Activations ``[T, K]`` -> ``(q [T, K/32, 32], d [T, K/32], s [T, K/32])`` as the kernel
    quantizes them: d = max|y|/127, q = round(y * (1/d)) (half away from zero), s = sum q."""
    with mx.stream(CPU):
        T, K = y2.shape
        g = y2.reshape(T, K // 32, 32)
        amax = mx.max(mx.abs(g), axis=-1)
        d = amax / mx.array(127.0, F32)
        inv = mx.where(d != 0, mx.array(1.0, F32) / mx.where(d != 0, d, 1.0), 0.0)
        x = (g * inv[..., None]).astype(mx.float64)  # the float32 product, rounded exactly in float64
        q = mx.sign(x) * mx.floor(mx.abs(x) + 0.5)
        return q, d, q.sum(axis=-1)


def _q8_oracle_inputs(y, w, kind: str):
    """What both q8 oracles start from: rows R, blocks per row nb, tokens T and the activations as
    the kernels quantize them, ``quantize_q8``'s (q, dy, sy)."""
    R, nb = w.shape[0], w.shape[1] // BLOCK_BYTES[kind]
    y2 = _flat(y, nb * 256)
    return (R, nb, y2.shape[0]) + quantize_q8(y2)


def mul_mv_q4_K_q8_oracle(y, w, lanes: int = 32) -> mx.array:
    """The q8 kernels' operations in their order: per 32-value sub-block an exact integer dot, then
    ``fma(d*sc, dy*sumi, -((dmin*m) * (dy*s)))``; lane l of a row's ``lanes`` adds its runs
    l, l+lanes, ... (two sub-blocks each) in order; then the butterfly over those lanes."""
    R, nb, T, q, dy, sy = _q8_oracle_inputs(y, w, "q4_K")  # q [T, nb*8, 32], dy, sy [T, nb*8]
    with mx.stream(CPU):
        b = w.reshape(R, nb, 144)
        d = fp.f16(b[..., 0:2])[None, :, :, None]  # [1, R, nb, 1]
        dmin = fp.f16(b[..., 2:4])[None, :, :, None]
        sc, m = (v.astype(F32)[None] for v in _k_scale_min(b[..., 4:16]))  # [1, R, nb, 8]
        qs = b[..., 16:144].reshape(R, nb, 4, 32)
        nib = mx.stack([qs & 0x0F, qs >> 4], axis=3).reshape(R, nb * 8, 32).astype(mx.float64)
        sumi = (nib[None] * q.reshape(T, 1, nb * 8, 32)).sum(axis=-1)  # exact integers
        sumi = sumi.astype(F32).reshape(T, R, nb, 8)
        dyb, syb = dy.reshape(T, 1, nb, 8), sy.astype(F32).reshape(T, 1, nb, 8)
        part = fp.fma(d * sc, dyb * sumi, -((dmin * m) * (dyb * syb)))  # [T, R, nb, 8]
        runs = part.reshape(T, R, nb * 4, 2)
        runs = fp.pad_axis(runs, 2, lanes).reshape(T, R, -1, lanes, 2)  # [T, R, k, lane, 2]
        seq = runs.transpose(0, 1, 3, 2, 4).reshape(T, R, lanes, -1)  # each lane's additions in order
        return fp.simd_sum(fp.running_sum(seq, axis=-1), lanes).reshape(*y.shape[:-1], R)


def mul_mv_q6_K_q8_oracle(y, w, lanes: int = 32) -> mx.array:
    """The split Q6_K rows ``w`` (:func:`~muse_mlx.quants.split_q6_K`) against int8 activations, in
    ``q6K_q8_run``'s order: per run (four per block: values 128h + 32k + 16s + 0..15, k = 0..3) and
    group k an exact integer ``t = sc * sum((code - 32) * q)``, then ``acc = dy_0 * t_0``,
    ``acc = fma(dy_k, t_k, acc)``, ``sumf = fma(d, acc, sumf)``; lane l of a row's ``lanes`` takes
    the runs l, l+lanes, ... in order; then the butterfly over those lanes."""
    from ..quants import _q6_k_codes, join_q6_K

    R, nb, T, q, dy, _ = _q8_oracle_inputs(y, w, "q6_K_split")  # q [T, nb*8, 32], dy [T, nb*8]
    with mx.stream(CPU):
        d, sc, codes = _q6_k_codes(join_q6_K(w).reshape(R, nb, 210))  # [R, nb], [R, nb, 16], [R, nb, 16, 16]
        # per 16 values (g = 8h + 2k + s, the scale's index): the exact integer sc_g * sum(code * q)
        qy = q.reshape(T, 1, nb, 16, 16)
        dots = (codes.astype(mx.float64)[None] * qy).sum(axis=-1)  # [T, R, nb, 16], exact
        t = (dots * sc.astype(mx.float64)[None]).astype(F32).reshape(T, R, nb, 2, 4, 2)  # [.., h, k, s]
        dyk = dy.reshape(T, 1, nb, 2, 4, 1)  # group 8b + 4h + k
        acc = dyk[..., 0, :] * t[..., 0, :]
        for k in range(1, 4):
            acc = fp.fma(dyk[..., k, :], t[..., k, :], acc)  # [T, R, nb, h, s]: run p = 4b + 2h + s
        runs = acc.reshape(T, R, nb * 4)
        dr = mx.broadcast_to(mx.repeat(d, 4, axis=-1)[None], runs.shape)
        runs, dr = (fp.pad_axis(v, 2, lanes).reshape(T, R, -1, lanes) for v in (runs, dr))
        sumf = mx.zeros((T, R, lanes), F32)
        for j in range(runs.shape[2]):
            sumf = fp.fma(dr[:, :, j], runs[:, :, j], sumf)
        return fp.simd_sum(sumf, lanes).reshape(*y.shape[:-1], R)


_Q8 = Kernel("mul_mv", "mul_mv_q4_K_q8_multi", ["w0", "w1", "w2", "w3", "y"], ["dst"], uses=("ffn",))
_QUANTIZE_Q8 = Kernel("mul_mv", "quantize_q8", ["y"], ["qy", "ds"])
_Q8_PRE = Kernel("mul_mv", "mul_mv_q8_pre", ["w0", "w1", "w2", "w3", "qy", "ds"], ["dst"], uses=("ffn",),
                 parts=("q8_pre_rows", "q8_pre_live", "q8_pre_lanes", "q8_pre_q6K", "q8_pre_q4K", "q8_pre_out"))
# the same for calls of Q4_K matrices only (the GLU among them): no split Q6_K lanes in its source
_Q8_PRE_Q4K = Kernel("mul_mv", "mul_mv_q8_pre_q4K", _Q8_PRE.inputs, ["dst"], uses=("ffn",),
                     parts=("q8_pre_rows", "q8_pre_live", "q8_pre_lanes", "q8_pre_q4K", "q8_pre_out"))
# the q8 GLU that also writes its output quantized (flag mv_q8_q6k; MUSE_MLX_Q8_GLU_OUT=0 turns it off)
_Q8_PRE_OUT = Kernel("mul_mv", "mul_mv_q8_pre_q8out", ["w0", "w1", "w2", "w3", "qy", "ds"], ["dst", "oqy", "ods"],
                     uses=("ffn",),
                     parts=("q8_pre_rows", "q8_pre_live", "q8_pre_lanes", "q8_pre_q4K", "q8_pre_out", "q8_out"))
KERNELS += (_Q8, _QUANTIZE_Q8, _Q8_PRE, _Q8_PRE_Q4K, _Q8_PRE_OUT)
# rows per SIMD group, SIMD groups per threadgroup: H200 best of eight (bench.py --tune); Metal unmeasured
Q8_GEOMETRY = {"cuda": (8, 4), "metal": (2, 4)}
# mul_mv_q8_pre's (NR0 rows per lane group, NSG, LPR lanes per row, U runs in flight). LPR
# fixes the bits, so the CPU's oracle takes CUDA's. CUDA: the GLU's best of 14 on the H200 (bench.py
# --parts q8: 52.1 us alone, 44.9 inside the decode, against 54.9 and 60.0 for the per-threadgroup
# kernel); Metal unmeasured (LPR 32: mul_mv_q4_K_q8_multi's order)
Q8_PRE_GEOMETRY = {"cuda": (2, 4, 4, 1), "metal": (2, 4, 32, 1)}
Q8_PRE_GEOMETRY["cpu"] = Q8_PRE_GEOMETRY["cuda"]


def _q8_geometry(which: str) -> tuple[int, int]:
    """``(NR0, NSG)`` of the q8 kernel; ``MUSE_MLX_Q8_GEOMETRY=NR0xNSG`` overrides it."""
    env = os.environ.get("MUSE_MLX_Q8_GEOMETRY")
    if env:
        return mv_geometry(env.lower(), which)[:2]
    return Q8_GEOMETRY.get(which, (2, 4))


# The calls of at most this many rows but the GLU (ffn_down, the projections, attn_output) may take
# a geometry of their own (Q8_PRE_FEW_GEOMETRY): with 32/LPR row groups a SIMD group, a
# 6,656-row call at the GLU's geometry fills 104 threadgroups of 4 SIMD groups, under one per SM.
FEW_ROWS = 65536
# CUDA: the fastest of 14 over the split Q6_K ffn_down and projections (bench.py --parts q8, H200,
# 2026-12-02); inside the decode the ffn_down then ran 29.4 us, against 55.5 exact (docs/performance-history.md)
Q8_PRE_FEW_GEOMETRY = {"cuda": (4, 4, 32, 1)}
Q8_PRE_FEW_GEOMETRY["cpu"] = Q8_PRE_FEW_GEOMETRY["cuda"]  # LPR fixes the bits: the CPU's oracle takes CUDA's
# The calls of more rows (the vocabulary head) likewise. CUDA: inside the H200's decode the split
# Q6_K head ran 277 us at 4x8x32x1 against 320 at the GLU's 2x4x4x1, which it took before (280 at
# 2x4x8x1, 285-288 at 2x8x16x1, 324-325 at 1x8x8x1; docs/performance-history.md, twenty-eighth session).
Q8_PRE_MANY_GEOMETRY = {"cuda": (4, 8, 32, 1)}
Q8_PRE_MANY_GEOMETRY["cpu"] = Q8_PRE_MANY_GEOMETRY["cuda"]


def q8_call(rows: int, glu: bool) -> str:
    """The geometry class of a mul_mv_q8_pre call: "glu", or "few" (at most FEW_ROWS rows), or "many"."""
    return "glu" if glu else "few" if rows <= FEW_ROWS else "many"


_Q8_PRE_CLASS_GEOMETRY = {"few": Q8_PRE_FEW_GEOMETRY, "many": Q8_PRE_MANY_GEOMETRY}


def q8_pre_geometry(which: str, call: str = "glu") -> tuple[int, int, int, int]:
    """``(NR0, NSG, LPR, U)`` of mul_mv_q8_pre for a call of class ``call`` (:func:`q8_call`):
    ``MUSE_MLX_Q8_PRE_GEOMETRY=NR0xNSGxLPR[xU]`` overrides it for every call, and
    ``MUSE_MLX_Q8_PRE_GEOMETRY_FEW`` / ``_MANY`` for the "few" / "many" calls alone (which otherwise
    take Q8_PRE_FEW_GEOMETRY / Q8_PRE_MANY_GEOMETRY where it has the backend, else the GLU's)."""
    own = f"MUSE_MLX_Q8_PRE_GEOMETRY_{call.upper()}"
    name = own if call in _Q8_PRE_CLASS_GEOMETRY and os.environ.get(own) else "MUSE_MLX_Q8_PRE_GEOMETRY"
    env = os.environ.get(name)
    if not env:
        if which in _Q8_PRE_CLASS_GEOMETRY.get(call, {}):
            return _Q8_PRE_CLASS_GEOMETRY[call][which]
        return Q8_PRE_GEOMETRY.get(which, (2, 4, 32, 1))
    try:
        parts = [int(v) for v in env.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) not in (3, 4):
        raise ValueError(f"{name}={env!r}: expected NR0xNSGxLPR[xU], e.g. 1x4x8x2")
    nr0, nsg, lpr, u = (parts + [1])[:4]
    if not (1 <= nr0 <= 8 and 1 <= nsg <= 32 and lpr in (4, 8, 16, 32) and 1 <= u <= 4):
        raise ValueError(f"{name}={env!r}: NR0 must be 1..8, NSG 1..32, LPR 4, 8, 16 or 32, U 1..4")
    return nr0, nsg, lpr, u


def _q8_pre(kinds, glu: bool, quantized: bool = False) -> bool:
    """Whether a call on matrices of these kinds takes quantize_q8 + mul_mv_q8_pre: by
    default the GLU, where it is the faster on the H200 (the per-threadgroup kernel was faster on
    the other calls, measured inside the decode: docs/performance-history.md), and any all-Q4_K call whose
    activations come ``quantized`` already (by the kernel before it: no quantize_q8 dispatch, and
    mul_mv_q8_pre was the faster kernel on every such call, ``MUSE_MLX_Q8_PRE=all``'s trace);
    ``MUSE_MLX_Q8_PRE=all``: every all-Q4_K call, ``0``: none. A call with a split Q6_K matrix
    (flag mv_q8_q6k) always takes it, the only kernel that reads that form."""
    mode = os.environ.get("MUSE_MLX_Q8_PRE", "glu").lower()
    if mode not in ("glu", "all", "0"):
        raise ValueError(f"MUSE_MLX_Q8_PRE={mode!r}: expected glu, all or 0")
    if "q6_K_split" in kinds:
        if "q6_K" in kinds:
            raise ValueError("a q8 call takes Q6_K matrices all split or none (mul_mv_q8_pre reads only split ones)")
        return True
    if mode == "0" or any(k != "q4_K" for k in kinds):
        return False
    return mode == "all" or glu or quantized


def q8_pre_glu() -> bool:
    """Whether the q8 GLU takes quantize_q8 + mul_mv_q8_pre's lanes (``MUSE_MLX_Q8_PRE``), the only
    ones that read Q4_K rows in tiles."""
    return _q8_pre(("q4_K", "q4_K"), glu=True)


def q8_from_tail() -> bool:
    """Whether the tail before a q8 GLU also writes its output quantized (``tail_dual_eps_q8``),
    sparing the GLU's ``quantize_q8`` dispatch: ``MUSE_MLX_Q8_TAIL=1`` (default) or ``0``, and
    only where the GLU reads activations quantized beforehand (``q8=`` of :func:`mul_mv_q8`)."""
    return _switch("MUSE_MLX_Q8_TAIL", True) and _q8_pre(("q4_K", "q4_K"), glu=True)  # a Q4_K GLU reads it


def q8_from_glu() -> bool:
    """Whether the q8 GLU (flag mv_q8_q6k) also writes its output quantized
    (``mul_mv_q8_pre_q8out``) for the ffn_down after it, sparing a split Q6_K ffn_down's
    ``quantize_q8`` dispatch and letting a Q4_K one take ``mul_mv_q8_pre``:
    ``MUSE_MLX_Q8_GLU_OUT=1`` (default: on the H200 its bits are the plain GLU's and quantize_q8's,
    and it saves 0.23 ms of GPU time a token) or ``0``."""
    return _switch("MUSE_MLX_Q8_GLU_OUT", True) and q8_pre_glu()


# Rows a tile of the q8 GLU's gate and up matrices, per backend (1: raw rows). On the H200 the GLU
# takes 41.9-42.4 us a call in tiles against 46.2-46.5 on raw rows, the q8 route's token 0.2 ms
# less (thirty-first session, docs/performance-history.md); not yet timed on a Mac.
Q8_TILE = {"cuda": 16}


def q8_tile(which: str | None = None) -> int:
    """Rows a tile of the q8 GLU's gate and up matrices (``quants.tile_q4_K_rows``: each SIMD
    group's rows of a block one run of bytes; the same bits) on this backend (:data:`Q8_TILE`):
    ``MUSE_MLX_Q8_TILE=<rows>`` overrides it, 1 for raw rows. Read where a weight's form is made
    (at load, Model.set_flags). ``bench.py --parts tiles`` times the kernels, ``--env-ab
    MUSE_MLX_Q8_TILE=1,16`` the route's decode (re-forming the weights)."""
    text = os.environ.get("MUSE_MLX_Q8_TILE")
    if text is None:
        return Q8_TILE.get(which or backend(), 1)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"MUSE_MLX_Q8_TILE={text!r}: expected a number of rows, 1 (raw rows) or more")
    return int(text)


def q8_from_attention() -> bool:
    """Whether the one-dispatch attention with its norms also writes its output quantized
    (``attn_decode_fused_q8``) for the q8 attn_output after it (flag ``mv_q8``), which then reads
    it through ``mul_mv_q8_pre`` at 32 lanes a row: the per-threadgroup kernel's bits, with no
    quantization in each of its threadgroups. ``MUSE_MLX_Q8_ATTN=1`` (the default: on the H200
    attn_output 6.35 us a call against 8.4-9.4, the attention 0.3-0.4 us more, about 0.09 ms a token
    less in kernels; twenty-seventh session, docs/performance-history.md) or ``0``."""
    return bool(_switch("MUSE_MLX_Q8_ATTN", True))


def quantize_q8_rows(y: mx.array, which=None) -> tuple[mx.array, mx.array]:
    """Activations ``[..., K]`` as ``quantize_q8`` writes them for mul_mv_q8_pre: ``qy``
    (uint32, four int8 to a word, little-endian) and ``ds`` (float32 pairs: d, sum of q per group
    of 32), flat. On the CPU, :func:`quantize_q8`'s values in that layout."""
    which = which or backend()
    K = y.shape[-1]
    if K % 32:
        raise ValueError(f"q8 activations come in groups of 32 values, not {K}")
    if which == "cpu":
        q, d, s = quantize_q8(y.astype(F32).reshape(-1, K))
        with mx.stream(CPU):
            b = q.astype(mx.int8).reshape(-1, 4).view(mx.uint8).astype(mx.uint32)
            qy = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
            return qy, mx.stack([d, s.astype(F32)], axis=-1).reshape(-1)
    groups = y.size // 32
    return _QUANTIZE_Q8([y.astype(F32)], [(y.size // 4,), (y.size // 16,)], [mx.uint32, F32],
                        grid=(groups, 1, 1), threadgroup=(min(256, groups), 1, 1),
                        template=[("GROUPS", groups)], which=which)


Q8_PRE_TYPE = {"q4_K": 0, "q6_K_split": 2}  # mul_mv_q8_pre's Y codes (1, raw Q6_K, it does not read)


def mul_mv_q8(y, weights, which=None, glu: str | None = None, q8=None, q8_out: bool = False, tile: int = 1):
    """The opt-in int8-activation matvec: ``weights`` as in :func:`mul_mv_multi` (Q4_K through q8;
    Q6_K through the exact lanes, or, split by :func:`~muse_mlx.quants.split_q6_K` and given as
    "q6_K_split", through q8 as well), concatenated; or, with ``glu`` an activation, two Q4_K
    matrices (gate, up) and ``act(gate) * up``. The GLU and every call with a split matrix take the
    activations quantized once (``quantize_q8`` + ``mul_mv_q8_pre``, whose lanes per row fix the
    bits; see :func:`_q8_pre`); the rest, ``mul_mv_q4_K_q8_multi`` (32 lanes per row). ``q8``: ``y``
    already quantized, as :func:`quantize_q8_rows` returns it (from
    :func:`~muse_mlx.kernels.tail_dual_eps_q8`), for a call that takes the activations quantized
    once, which an all-Q4_K call then takes too (see :func:`_q8_pre`); otherwise ignored. ``q8_out`` (a GLU only): return ``(output, q8)``, the output also
    quantized as :func:`quantize_q8_rows` quantizes it, by the GLU itself where it can
    (``mul_mv_q8_pre_q8out``; else ``q8`` is None and the next call quantizes). ``tile``: the Q4_K
    matrices are in the tiled form of that many rows (:func:`~muse_mlx.quants.tile_q4_K_rows`; 1,
    raw rows), for a call of Q4_K matrices only that takes the activations quantized once: the same
    bits as the raw rows give."""
    from .ffn import ACTIVATIONS, gelu_oracle, silu_oracle

    K = _common_k(weights, "mul_mv_q8")
    which = which or backend()
    if glu is not None and (len(weights) != 2 or any(k != "q4_K" for _, k in weights)):
        raise ValueError("the q8 GLU takes two Q4_K matrices")
    if q8_out and glu is None:
        raise ValueError("q8_out is for the q8 GLU (glu=...) only")
    kinds = [k for _, k in weights]
    pre = _q8_pre(kinds, glu is not None, quantized=q8 is not None)
    if tile != 1:
        if not pre or any(k != "q4_K" for k in kinds):
            raise ValueError(f"Q4_K rows in tiles of {tile}: only for a q8 call of Q4_K matrices that takes its "
                             f"activations quantized once, not {kinds}" + ("" if pre else " on float activations")
                             + " (a model's tiles are made at load for MUSE_MLX_Q8_TILE and MUSE_MLX_Q8_PRE as they "
                             "were then: after changing either, load it again or call Model.set_flags)")
        for w, _ in weights:
            _tile_shape(w, tile)  # whole tiles of whole blocks, or a ValueError that says so
    call = q8_call(sum(w.shape[0] for w, _ in weights), glu is not None)
    if pre:
        nr0, nsg, lpr, u = q8_pre_geometry(which, call)
        per_tg = nr0 * nsg * (32 // lpr)
    # the GLU writes its output quantized where its threadgroups hold whole groups of 32 rows and
    # no SIMD group leaves before the part's barrier (the CPU gives the q8 on the same condition)
    own_q8 = q8_out and pre and weights[0][0].shape[0] % per_tg == 0 and per_tg % 32 == 0
    if which == "cpu":
        if tile != 1:  # the oracles read raw rows: the bytes put back where they were
            weights = [(untile_q4_K_rows(w, tile), k) for w, k in weights]
        lanes = lpr if pre else 32
        q8_oracles = {"q4_K": mul_mv_q4_K_q8_oracle, "q6_K_split": mul_mv_q6_K_q8_oracle}
        outs = [q8_oracles[k](y, w, lanes) if k in q8_oracles else ORACLES[k](y, w) for w, k in weights]
        if glu is not None:
            out = silu_oracle(*outs) if glu == "silu" else gelu_oracle(*outs)
            return (out, quantize_q8_rows(out, which) if own_q8 else None) if q8_out else out
        return mx.concatenate(outs, axis=-1)
    y, T = _tokens(y, K)
    if not pre:
        nr0, nsg = _q8_geometry(which)
        per_tg = nr0 * nsg
    mats, rows, kinds = _four_slots(weights)
    if glu is not None:
        rows = [rows[0], 0, 0, 0]
    template = [("K", K), ("NR0", nr0), ("NSG", nsg), ("GLU", int(glu is not None)),
                ("ACT", ACTIVATIONS[glu or "silu"])] + [(f"R{i}", rows[i]) for i in range(4)]
    groups = sum(-(-r // per_tg) for r in rows)
    launch = dict(grid=(groups * 32, nsg, T), threadgroup=(32, nsg, 1), which=which)
    out_shape = [(*y.shape[:-1], sum(rows))]
    if pre:
        qy, ds = q8 if q8 is not None else quantize_q8_rows(y, which)
        template += [("LPR", lpr), ("U", u), ("TILE", tile)] + [(f"Y{i}", Q8_PRE_TYPE[kinds[i]]) for i in range(4)]
        if own_q8:
            dst, oqy, ods = _Q8_PRE_OUT(mats + [qy, ds], out_shape + [(y.size // K * rows[0] // 4,),
                                                                (y.size // K * rows[0] // 16,)],
                                   [F32, mx.uint32, F32], template=template, **launch)
            return dst, (oqy, ods)
        kernel = _Q8_PRE_Q4K if all(Q8_PRE_TYPE[k] == 0 for k in kinds) else _Q8_PRE
        (dst,) = kernel(mats + [qy, ds], out_shape, [F32], template=template, **launch)
    else:
        template += [(f"Y{i}", TYPE_CODE[kinds[i]]) for i in range(4)]
        (dst,) = _Q8(mats + [y], out_shape, [F32], template=template, **launch)
    return (dst, None) if q8_out else dst


def dequantize_rows(w: mx.array, kind: str, dtype=mx.float32, which=None, tile: int = 1) -> mx.array:
    """Raw Q4_K/Q6_K rows ``[..., row_bytes]``, or a whole Q6_K matrix in the split form (kind
    "q6_K_split", :func:`~muse_mlx.quants.split_q6_K`), -> ``[..., K]`` in one dispatch: float32
    bit-equal to gguf-py, or (``dtype=mx.float16``) those values rounded to nearest half. ``tile``:
    a whole Q4_K matrix in tiles of that many rows (:func:`~muse_mlx.quants.tile_q4_K_rows`), whose
    rows come out in their own order."""
    from ..quants import dequantize
    from gguf import GGMLQuantizationType as T

    if dtype not in (mx.float32, mx.float16):
        raise ValueError(f"dequantize_rows gives float32 or float16, not {dtype}")
    if kind == "q6_K_split" and w.ndim != 2:
        raise ValueError(f"a split Q6_K matrix is [R, whole 210-byte blocks], got {w.shape}")
    if tile != 1:
        if kind != "q4_K":
            raise ValueError(f"rows in tiles are Q4_K rows, not {kind!r}")
        _tile_shape(w, tile)
    which = which or backend()
    if which == "cpu":
        raw = join_q6_K(w) if kind == "q6_K_split" else untile_q4_K_rows(w, tile) if tile != 1 else w
        return dequantize(raw, T.Q4_K if kind == "q4_K" else T.Q6_K).astype(dtype)
    K = w.shape[-1] // BLOCK_BYTES[kind] * 256
    quads = w.size // BLOCK_BYTES[kind] * 64  # four values each
    threads = -(-quads // 128) * 32  # four quads each (whole SIMD groups: 128 quads per 32 threads)
    (out,) = _DEQ[dtype](
        [w, constant(quads, mx.uint32)], [(*w.shape[:-1], K)], [dtype], grid=(threads, 1, 1),
        threadgroup=(min(256, threads), 1, 1), which=which,
        template=[("TYPE", TYPE_CODE[kind]), ("TILE", tile), ("NB", K // 256 if tile != 1 else 0)],
    )
    return out


def embed_rows(w: mx.array, tokens: mx.array, kind: str, which=None) -> mx.array:
    """Rows ``tokens`` of raw Q4_K/Q6_K rows ``w [R, row_bytes]`` as float32 ``[*tokens.shape, K]``,
    bit-equal to gguf-py: ``dequantize_rows(w[tokens], kind)`` in one dispatch (MLX 0.32's CUDA
    gather of one 3.7 KB row from the release vocabulary took ~200 us, measured with CUPTI). An id
    outside ``0..R-1`` gives a row of NaN (the table is never read outside its rows)."""
    if kind not in ("q4_K", "q6_K"):  # a split matrix has no rows to gather (its d's lie apart)
        raise ValueError(f"embed_rows reads raw Q4_K/Q6_K rows, not {kind!r}")
    which = which or backend()
    if which == "cpu":
        ok = (tokens >= 0) & (tokens < w.shape[0])
        rows = dequantize_rows(w[mx.where(ok, tokens, 0)], kind, which=which)
        return mx.where(ok[..., None], rows, float("nan"))
    kq = w.shape[1] // BLOCK_BYTES[kind] * 64
    count = tokens.size * kq
    if tokens.dtype in (mx.int64, mx.uint64):  # an id past 32 bits would wrap into the table
        tokens = mx.where((tokens < 0) | (tokens >= w.shape[0]), -1, tokens)
    (out,) = _DEQ_AT(
        [w, tokens.astype(mx.int32).reshape(-1), constant(count, mx.uint32)], [(*tokens.shape, 4 * kq)],
        [F32], grid=(count, 1, 1), threadgroup=(min(256, count), 1, 1),
        template=[("TYPE", TYPE_CODE[kind]), ("R", w.shape[0]), ("ROWB", w.shape[1]), ("KQ", kq)], which=which,
    )
    return out
