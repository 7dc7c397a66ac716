"""Deterministic numpy quantizers that write valid GGML blocks (Q8_0, Q4_K, Q5_K, Q6_K).

They exist so the project can write its own checkpoints. They are simpler than
llama.cpp's searches (plain min/max and max-abs scales, round-to-nearest), so the error
is somewhat larger than llama-quantize's, but every block is a valid block that any
GGUF reader decodes identically. Input rows must be multiples of the block size.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

QK_K = 256


def _round(x: np.ndarray) -> np.ndarray:
    # Round half away from zero, as ggml's nearest_int / roundf do.
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit (sc, m) [nb, 8] -> the 12-byte strip that ggml's get_scale_min_k4 unpacks."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return out


def _k_affine(x: np.ndarray, levels: int):
    """Shared Q4_K/Q5_K scale search: per 32-value sub-block, min/max -> 6-bit sc and m."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    hi = sub.max(axis=-1)
    scale = (hi - lo) / levels
    d = _f16(scale.max(axis=-1) / 63.0)
    dmin = _f16(-lo.min(axis=-1) / 63.0)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.where(d32 > 0, _round(scale / d32), 0), 0, 63)
        m = np.clip(np.where(dmin32 > 0, _round(-lo / dmin32), 0), 0, 63)
    eff_scale = (d32 * sc)[..., None]
    eff_min = (dmin32 * m)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff_scale > 0, _round((sub + eff_min) / eff_scale), 0)
    return d, dmin, sc, m, np.clip(q, 0, levels).astype(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, n] -> uint8 [rows, n/256*144]."""
    rows = x.shape[0]
    d, dmin, sc, m, q = _k_affine(x.astype(np.float32), 15)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_k_scales(sc, m), qs],
        axis=1,
    )
    return blocks.reshape(rows, -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, n] -> uint8 [rows, n/256*176]."""
    rows = x.shape[0]
    d, dmin, sc, m, q = _k_affine(x.astype(np.float32), 31)
    low = (q & 0x0F).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(-1, 128)
    high = (q >> 4).astype(np.uint8)  # [nb, 8, 32]: sub-block j's bit goes to bit j of qh[l]
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j, :] << j
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_k_scales(sc, m), qh, qs],
        axis=1,
    )
    return blocks.reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, n] -> uint8 [rows, n/256*210]."""
    rows = x.shape[0]
    sub = x.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31.0
    d = _f16(scale.max(axis=-1) / 127.0)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.where(d32 > 0, _round(scale / d32), 0), -128, 127).astype(np.int8)
    eff = (d32 * sc.astype(np.float32))[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff != 0, _round(sub / eff), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [nb, half, k, l]
    # Each half: ql[l] holds values l (low nibble) and l+64 (high); ql[l+32] holds l+32 and l+96.
    ql_low = np.concatenate([q[:, :, 0, :] & 0x0F, q[:, :, 1, :] & 0x0F], axis=-1)
    ql_high = np.concatenate([q[:, :, 2, :] & 0x0F, q[:, :, 3, :] & 0x0F], axis=-1)
    ql = (ql_low | (ql_high << 4)).reshape(-1, 128)
    qh = ((q[:, :, 0, :] >> 4) | ((q[:, :, 1, :] >> 4) << 2) | ((q[:, :, 2, :] >> 4) << 4) | ((q[:, :, 3, :] >> 4) << 6))
    blocks = np.concatenate(
        [ql, qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1
    )
    return blocks.reshape(rows, -1)


def quantize(x: np.ndarray, qtype: T) -> np.ndarray:
    """float32 [rows, n] -> the GGUF payload for ``qtype`` (float types are just cast)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == T.F32:
        return x
    if qtype == T.F16:
        return x.astype(np.float16)
    if qtype == T.BF16:
        return gguf_quants.quantize(x, T.BF16)
    if qtype == T.Q8_0:
        return gguf_quants.quantize(x, T.Q8_0)
    if qtype == T.Q4_K:
        return quantize_q4_k(x)
    if qtype == T.Q5_K:
        return quantize_q5_k(x)
    if qtype == T.Q6_K:
        return quantize_q6_k(x)
    raise ValueError(f"no quantizer for {qtype.name}")
