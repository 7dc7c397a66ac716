"""GGML block formats: the type table, dequantization in MLX ops, and the MLX affine repack.

Every dequantizer here performs gguf-py's float operations in gguf-py's order
(``(d*sc)*q - dmin*m`` for Q4_K/Q5_K, ``(d*sc)*q`` for Q6_K, ``q*d`` for Q8_0), each as
its own uncompiled MLX op, so the results are bit-identical to ``gguf.quants.dequantize``
(tests/test_quants.py checks it on every type).

The raw GGUF blocks stay on the device as uint8 arrays ``[rows, row_bytes]``; nothing
in this module expands a whole model to float.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

QK_K = 256


@dataclass(frozen=True)
class BlockFormat:
    name: str
    block_size: int  # values per block
    type_size: int  # bytes per block
    affine_bits: int | None  # bits of the exact MLX affine (group 32) form, if any


# The types this engine keeps on the device. Anything else is refused by name at load.
FORMATS: dict[T, BlockFormat] = {
    T.F32: BlockFormat("F32", 1, 4, None),
    T.F16: BlockFormat("F16", 1, 2, None),
    T.BF16: BlockFormat("BF16", 1, 2, None),
    T.Q8_0: BlockFormat("Q8_0", 32, 34, 8),
    T.Q4_K: BlockFormat("Q4_K", 256, 144, 4),
    T.Q5_K: BlockFormat("Q5_K", 256, 176, 5),
    T.Q6_K: BlockFormat("Q6_K", 256, 210, None),
}

QUANTIZED = (T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)


def row_bytes(qtype: T, n: int) -> int:
    f = FORMATS[qtype]
    return n // f.block_size * f.type_size


def _f16(b: mx.array) -> mx.array:
    """Two uint8 lanes (last axis) read as one little-endian float16, widened to float32."""
    return mx.view(b, mx.float16).astype(mx.float32)


def _k_scale_min(scales: mx.array) -> tuple[mx.array, mx.array]:
    """The 12-byte Q4_K/Q5_K scale strip -> (sc, m), each [..., 8] uint8 (ggml get_scale_min_k4)."""
    lo = scales[..., 0:4]
    mid = scales[..., 4:8]
    hi = scales[..., 8:12]
    sc = mx.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = mx.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return sc, m


def _blocks(data: mx.array, qtype: T) -> mx.array:
    """[..., row_bytes] -> [..., n_blocks, type_size]."""
    f = FORMATS[qtype]
    return data.reshape(*data.shape[:-1], data.shape[-1] // f.type_size, f.type_size)


def _q4_k_parts(b: mx.array):
    """Q4_K blocks [..., nb, 144] -> (scale [..., nb, 8], min [..., nb, 8], codes [..., nb, 8, 32])."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scale_min(b[..., 4:16])
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 1, 32)
    codes = mx.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
    return d * sc.astype(mx.float32), dmin * m.astype(mx.float32), codes


def _q5_k_parts(b: mx.array):
    """Q5_K blocks [..., nb, 176] -> (scale, min, codes [..., nb, 8, 32])."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scale_min(b[..., 4:16])
    qh = b[..., 16:48].reshape(*b.shape[:-1], 1, 32)
    qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 1, 32)
    low = mx.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
    shifts = mx.arange(8, dtype=mx.uint8).reshape(8, 1)
    high = (qh >> shifts) & 0x01
    return d * sc.astype(mx.float32), dmin * m.astype(mx.float32), low | (high << 4)


def _q6_k_codes(b: mx.array):
    """Q6_K blocks [..., nb, 210] -> (d [..., nb], sc int8 [..., nb, 16], codes - 32 int8 [..., nb, 16, 16])."""
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 64)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
    sc = mx.view(b[..., 192:208], mx.int8)
    d = _f16(b[..., 208:210])
    low = mx.concatenate([ql & 0x0F, ql >> 4], axis=-2).reshape(*lead, 8, 32)
    shifts = mx.array([0, 2, 4, 6], dtype=mx.uint8).reshape(4, 1)
    high = ((qh >> shifts) & 0x03).reshape(*lead, 8, 32)
    q = (low | (high << 4)).astype(mx.int8) - 32
    return d[..., 0], sc, q.reshape(*lead, 16, 16)


def _q6_k_parts(b: mx.array):
    """Q6_K blocks [..., nb, 210] -> (scale [..., nb, 16], codes - 32 as float [..., nb, 16, 16])."""
    d, sc, q = _q6_k_codes(b)
    return d[..., None] * sc.astype(mx.float32), q.astype(mx.float32)


def dequantize(data: mx.array, qtype: T) -> mx.array:
    """Raw GGUF rows ``[..., row_bytes]`` (or float rows) -> float32 ``[..., n]``, bit-exact vs gguf-py."""
    if qtype == T.F32:
        return data
    if qtype == T.F16:
        return data.astype(mx.float32)
    if qtype == T.BF16:
        return mx.view(data, mx.bfloat16).astype(mx.float32)
    b = _blocks(data, qtype)
    lead = data.shape[:-1]
    if qtype == T.Q8_0:
        d = _f16(b[..., 0:2])
        q = mx.view(b[..., 2:34], mx.int8).astype(mx.float32)
        return (q * d).reshape(*lead, -1)
    if qtype in (T.Q4_K, T.Q5_K):
        scale, mn, codes = (_q4_k_parts if qtype == T.Q4_K else _q5_k_parts)(b)
        out = scale[..., None] * codes.astype(mx.float32) - mn[..., None]
        return out.reshape(*lead, -1)
    if qtype == T.Q6_K:
        scale, q = _q6_k_parts(b)
        return (scale[..., None] * q).reshape(*lead, -1)
    raise ValueError(f"no dequantizer for {qtype.name}")


def _pack_lsb(codes: mx.array, bits: int) -> mx.array:
    """Codes [..., n] (uint) -> MLX's packing: an LSB-first bit stream in uint32 words."""
    lead, n = codes.shape[:-1], codes.shape[-1]
    per = 32 // bits if 32 % bits == 0 else None
    c = codes.astype(mx.uint32)
    if per is not None:
        shifts = (mx.arange(per, dtype=mx.uint32) * bits).reshape(1, per)
        words = (c.reshape(*lead, n // per, per) << shifts).sum(axis=-1)
        return words.astype(mx.uint32)
    # 5 or 6 bits: 32 codes fill exactly `bits` words. Each word is an OR of the codes that start
    # in it and the spill of one that started in the word before; built from per-code slices
    # (a few bytes of temporaries per weight; masks over whole groups took ~50).
    groups = c.reshape(*lead, n // 32, 32)
    words = [None] * bits
    for i in range(32):
        p = i * bits
        w, s = divmod(p, 32)
        code = groups[..., i]
        words[w] = code << s if words[w] is None else words[w] | (code << s)
        if s + bits > 32:
            words[w + 1] = code >> (32 - s)
    return mx.stack(words, axis=-1).reshape(*lead, -1).astype(mx.uint32)


def to_affine(data: mx.array, qtype: T) -> tuple[mx.array, mx.array, mx.array, int]:
    """Raw rows -> MLX affine (group 32) ``(w, scales, biases, bits)`` with float32 scales.

    Exact: scale = d*sc and bias = -(dmin*m) are exact float32 products, and scale*q is
    exact too, so ``scale*q + bias`` rounds once, as gguf-py's ``d*q - dm`` does.
    """
    b = _blocks(data, qtype)
    lead = data.shape[:-1]
    if qtype == T.Q8_0:
        d = _f16(b[..., 0:2])
        codes = (mx.view(b[..., 2:34], mx.int8).astype(mx.int32) + 128).reshape(*lead, -1)
        scales, biases = d.reshape(*lead, -1), (d * -128.0).reshape(*lead, -1)
        return _pack_lsb(codes, 8), scales, biases, 8
    if qtype in (T.Q4_K, T.Q5_K):
        bits = FORMATS[qtype].affine_bits
        scale, mn, codes = (_q4_k_parts if qtype == T.Q4_K else _q5_k_parts)(b)
        w = _pack_lsb(codes.reshape(*lead, -1), bits)
        return w, scale.reshape(*lead, -1), (-mn).reshape(*lead, -1), bits
    raise ValueError(f"{qtype.name} has no exact MLX affine form")


# Q6_K has 16-value sub-blocks, and MLX's affine groups are 32, 64 or 128 values: no one MLX form
# holds it. Its weights are d * n with n = sc*(q-32) an integer in [-4064, 4096], which splits
# exactly into two MLX forms over groups that share one d: n + 4096 = 64*h + l with h in [0, 128]
# (8 bits) and l in [0, 63] (6 bits). Groups of 64, not 128 (one d covers 256): MLX 0.32.4's
# CUDA quantized_matmul fails to launch at group 128 from 64 rows of x up ("cuGraphAddKernelNode
# ... invalid argument" on the H200, 2026-12-01, bits 6 and 8; groups of 32 and 64 run).
HI_LO_GROUP = 64


def to_affine_hi_lo(data: mx.array, qtype: T):
    """Raw Q6_K rows -> two MLX affine forms (group 64, float32 scales) whose sum is the matrix:
    ``((w_hi, scales_hi, biases_hi, 8), (w_lo, scales_lo, biases_lo, 6))``.

    Exact: hi = (64d)*h + (-4096d) and lo = d*l are exact float32 values (d has 11 significant
    bits, h and l at most 8), and so is their sum d*n (n has at most 12), which is gguf-py's
    ``(d*sc)*(q-32)``; only a zero may differ in sign (+0.0 here where gguf-py rounds to -0.0).
    16 bits per weight (Q6_K: 6.56).
    """
    if qtype != T.Q6_K:
        raise ValueError(f"{qtype.name} has an MLX affine form of its own (to_affine)")
    b = _blocks(data, qtype)
    lead = data.shape[:-1]
    d, sc, q = _q6_k_codes(b)
    m = (sc.astype(mx.int32)[..., None] * q.astype(mx.int32) + 4096).reshape(*lead, -1)
    per_group = QK_K // HI_LO_GROUP
    d = mx.repeat(d, per_group, axis=-1)  # [..., nb * per_group]
    hi = (_pack_lsb(m >> 6, 8), d * 64.0, d * -4096.0, 8)
    lo = (_pack_lsb(m & 63, 6), d, mx.zeros_like(d), 6)
    return hi, lo


# -- Q6_K blocks split for 16-byte loads (the opt-in flag mv_q8_q6k) ---------------------------
#
# A Q6_K block is 210 bytes (ql 128, qh 64, int8 scales 16, then the f16 d), so in a row of blocks
# only every other block starts on a 4-byte boundary and none on a 16-byte one: a GPU lane can read
# its quants only a few bytes at a time. The split form holds the same bytes of a matrix
# [R, nb*210] in the same total size, rearranged: first every block's 208-byte body (ql | qh |
# scales) in row-major block order, so each body starts on a 16-byte boundary, then every
# block's d (2 bytes) in the same order. Block (r, j)'s body is at 208*(r*nb + j), its d at
# 208*R*nb + 2*(r*nb + j).
Q6_K_BLOCK = FORMATS[T.Q6_K].type_size  # 210
Q6_K_BODY = Q6_K_BLOCK - 2  # 208: all but d


def split_q6_K(rows):
    """Raw Q6_K rows ``[R, nb*210]`` -> the split form (uint8, the same shape; see above). An MLX
    array gives an MLX array; a numpy one (the loader's, so that the device never holds a matrix
    in both forms) gives numpy."""
    if rows.ndim != 2 or rows.shape[1] % Q6_K_BLOCK:
        raise ValueError(f"Q6_K rows must be [R, whole 210-byte blocks], got {rows.shape}")
    xp = np if isinstance(rows, np.ndarray) else mx
    R, nb = rows.shape[0], rows.shape[1] // Q6_K_BLOCK
    b = rows.reshape(R * nb, Q6_K_BLOCK)
    return xp.concatenate([b[:, :Q6_K_BODY].reshape(-1), b[:, Q6_K_BODY:].reshape(-1)]).reshape(R, nb * Q6_K_BLOCK)


def join_q6_K(split: mx.array) -> mx.array:
    """The split form -> raw Q6_K rows ``[R, nb*210]`` (the inverse of :func:`split_q6_K`). Only a
    whole split matrix: its rows are not rows of the raw one (a slice of it is no matrix at all)."""
    if split.ndim != 2 or split.shape[1] % Q6_K_BLOCK:
        raise ValueError(f"a split Q6_K matrix is [R, whole 210-byte blocks], got {split.shape}")
    R, nb = split.shape[0], split.shape[1] // Q6_K_BLOCK
    flat = split.reshape(-1)
    bodies = flat[: R * nb * Q6_K_BODY].reshape(R * nb, Q6_K_BODY)
    ds = flat[R * nb * Q6_K_BODY :].reshape(R * nb, Q6_K_BLOCK - Q6_K_BODY)
    return mx.concatenate([bodies, ds], axis=1).reshape(R, nb * Q6_K_BLOCK)


# -- Q4_K rows in tiles (the q8 route's tiled form, opt-in) -------------------------------------
#
# A q8 matvec at few lanes a row (the GLU: 4) has each SIMD group read block j of 16 rows at once,
# 144 bytes from each of 16 rows 3,744 bytes apart. The tiled form holds the same blocks of a
# matrix [R, nb*144] rearranged in tiles of `tile` rows: within a tile, block j of its rows lie one
# after another, so those 16 reads are one run of 2,304 bytes. Block (r, j) is at
# (r // tile)*tile*nb*144 + j*tile*144 + (r % tile)*144. Tile 1 is the plain layout.
Q4_K_BLOCK = FORMATS[T.Q4_K].type_size  # 144


def _tile_shape(rows, tile: int) -> tuple[int, int]:
    if tile < 1:
        raise ValueError(f"a Q4_K tile holds at least one row, not {tile}")
    if rows.ndim != 2 or rows.shape[1] % Q4_K_BLOCK:
        raise ValueError(f"Q4_K rows must be [R, whole 144-byte blocks], got {rows.shape}")
    if rows.shape[0] % tile:
        raise ValueError(f"{rows.shape[0]} Q4_K rows are not whole tiles of {tile}")
    return rows.shape[0], rows.shape[1] // Q4_K_BLOCK


def tile_q4_K_rows(rows, tile: int):
    """Raw Q4_K rows ``[R, nb*144]`` -> the tiled form (the same shape and bytes; see above). MLX in,
    MLX out; numpy in, numpy out."""
    R, nb = _tile_shape(rows, tile)
    t = rows.reshape(R // tile, tile, nb, Q4_K_BLOCK).swapaxes(1, 2)
    return (np.ascontiguousarray(t) if isinstance(rows, np.ndarray) else t).reshape(R, nb * Q4_K_BLOCK)


def untile_q4_K_rows(tiled, tile: int):
    """The tiled form -> raw Q4_K rows (the inverse of :func:`tile_q4_K_rows`)."""
    R, nb = _tile_shape(tiled, tile)
    t = tiled.reshape(R // tile, nb, tile, Q4_K_BLOCK).swapaxes(1, 2)
    return (np.ascontiguousarray(t) if isinstance(tiled, np.ndarray) else t).reshape(R, nb * Q4_K_BLOCK)
