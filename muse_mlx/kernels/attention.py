"""Decode attention over f16 KV planes (``attention.metal``): wrappers and the exact-order oracle.

``attn_decode(q, kv, pos, window, scale, gate)`` is one new token's attention, GQA, with the
attention output gate folded in: two dispatches (a split-K partial pass, then the combine).
``kv_pack_f16(k, v)`` rounds the token's K and V to f16 side by side, for the cache write.
The order of every float operation is the oracle's (scores as an fma chain over the head
dimension, each split's max / exp / sum / fma chain over its keys, then the splits in order);
``exp`` is the device's on a GPU and a parameter of the oracle.
"""

from __future__ import annotations

import mlx.core as mx

from . import fp
from .backend import Kernel, backend, constant
from .fp import CPU

F32 = mx.float32
CMAX = 32  # keys per split at most: splits = ceil(cap / CMAX), so short caches still fill the GPU
NT = 128  # threads of a partial-pass threadgroup
CB = 32  # splits whose partial results the combine loads at once

_PACK = Kernel("attention", "kv_pack_f16", ["k", "v"], ["kv"])
_PARTIAL = Kernel("attention", "attn_decode_partial", ["q", "kv", "pos", "geom", "scale"],
                  ["part_m", "part_l", "part_o"])
_COMBINE = Kernel("attention", "attn_decode_combine", ["part_m", "part_l", "part_o", "gate", "geom", "pos"], ["out"])
KERNELS = (_PACK, _PARTIAL, _COMBINE)


def splits_for(cap: int) -> int:
    return -(-cap // CMAX)


def decode_geometry(cap: int, window: int) -> mx.array:
    """The constant kernel arguments of one cache: ``[cap, window, splits]`` (int32)."""
    return mx.array([cap, window, splits_for(cap)], dtype=mx.int32)


def kv_pack_f16(k: mx.array, v: mx.array, n: int | None = None, k_offset: int = 0, v_offset: int = 0,
                out_shape=None, which=None) -> mx.array:
    """``[2, n]`` float16 (or ``out_shape``): ``n`` values of ``k`` from ``k_offset`` (flat), then of
    ``v`` from ``v_offset``, rounded to nearest even. Defaults: all of ``k`` and ``v``."""
    which = which or backend()
    n = k.size if n is None else n
    shape = (2, n) if out_shape is None else tuple(out_shape)
    if which == "cpu":
        kk = k.astype(F32).reshape(-1)[k_offset : k_offset + n]
        vv = v.astype(F32).reshape(-1)[v_offset : v_offset + n]
        return mx.stack([kk, vv]).astype(mx.float16).reshape(shape)
    (kv,) = _PACK([k.astype(F32), v.astype(F32)], [shape], [mx.float16], grid=(n, 1, 1),
                  threadgroup=(min(256, n), 1, 1), template=[("N", n), ("KOFF", k_offset), ("VOFF", v_offset)],
                  which=which)
    return kv


def attn_decode_oracle(q, kv, pos: int, window: int, scale: float, gate=None, exp=fp.exp, n_head=None) -> mx.array:
    """The kernels' float operations in their order, as array ops on the CPU. ``q [H, D]`` -> ``[H*D]``."""
    with mx.stream(CPU):
        hkv, cap, d_head = kv.shape[-3:]
        kv = kv.reshape(2, hkv, cap, d_head)
        h = q.shape[0] if n_head is None else n_head
        q = q.reshape(-1)[: h * d_head].reshape(h, d_head)
        g_per = h // hkv
        splits = splits_for(cap)
        lo = max(0, pos - window + 1) if window > 0 else 0
        n = pos - lo + 1
        slots = (lo + mx.arange(n)) % cap
        k = kv[0][:, slots].astype(F32)  # [HKV, n, D]
        v = kv[1][:, slots].astype(F32)
        qs = q.astype(F32).reshape(hkv, g_per, d_head) * mx.array(scale, F32)
        s = mx.zeros((hkv, g_per, n), F32)
        for d in range(d_head):
            s = fp.fma(qs[:, :, d : d + 1], k[:, None, :, d], s)
        chunk = -(-n // splits)
        pad = splits * chunk - n
        valid = mx.arange(splits * chunk) < n
        s = mx.pad(s, [(0, 0), (0, 0), (0, pad)]).reshape(hkv, g_per, splits, chunk)
        valid = valid.reshape(splits, chunk)
        vpad = mx.pad(v, [(0, 0), (0, pad), (0, 0)]).reshape(hkv, splits, chunk, d_head)
        m = mx.max(mx.where(valid, s, -mx.inf), axis=-1)  # [HKV, G, splits]; -inf where a split is empty
        p = mx.where(valid, exp(mx.where(valid, s - m[..., None], 0.0)), 0.0)
        l = fp.running_sum(p, axis=-1)
        o = mx.zeros((hkv, g_per, splits, d_head), F32)
        for j in range(chunk):
            o = fp.fma(p[..., j : j + 1], vpad[:, None, :, j, :], o)
        m_all = mx.max(m, axis=-1, keepdims=True)
        w = exp(m - m_all)  # empty splits: exp(-inf) = 0
        num = mx.zeros((hkv, g_per, d_head), F32)
        den = mx.zeros((hkv, g_per), F32)
        for i in range(splits):
            num = fp.fma(w[..., i : i + 1], o[:, :, i], num)
            den = fp.fma(w[..., i], l[..., i], den)
        out = (num / den[..., None]).reshape(-1)
        if gate is not None:
            one = mx.array(1.0, F32)
            out = out * (one / (one + exp(-gate.astype(F32).reshape(-1)[: h * d_head])))
        return out


def attn_decode(q, kv, pos: mx.array, geom: mx.array, scale: float, gate=None, which=None, n_head=None,
                gate_offset: int = 0, out_shape=None) -> mx.array:
    """One token's attention (and gate): ``q [H, D]``, ``kv [2, (1,) HKV, cap, D]`` f16, ``pos`` int32 [1].

    ``geom`` is :func:`decode_geometry` of the cache (cap, window, splits). Returns ``[H*D]`` float32
    (or ``out_shape``). The decode path passes arrays as they are, to spare a slice per input:
    ``n_head`` heads are read from the start of ``q``, the gate from ``gate_offset`` of ``gate``.
    """
    which = which or backend()
    hkv, cap, d_head = kv.shape[-3:]
    h = q.shape[0] if n_head is None else n_head
    shape = (h * d_head,) if out_shape is None else tuple(out_shape)
    if which == "cpu":
        window = int(geom[1].item())
        g = None if gate is None else gate.reshape(-1)[gate_offset:]
        out = attn_decode_oracle(q, kv, int(pos.reshape(-1)[0].item()), window, scale, g, n_head=h)
        return out.reshape(shape)
    g_per = h // hkv
    splits = splits_for(cap)
    template = [("G", g_per), ("D", d_head), ("NT", NT), ("CMAX", CMAX), ("HKV", hkv)]
    part_m, part_l, part_o = _PARTIAL(
        [q.astype(F32), kv, pos, geom, constant(float(scale), F32)],
        [(hkv, splits, g_per), (hkv, splits, g_per), (hkv, splits, g_per, d_head)], [F32, F32, F32],
        grid=(NT * splits, hkv, 1), threadgroup=(NT, 1, 1), template=template, which=which,
    )
    (out,) = _COMBINE(
        [part_m, part_l, part_o, q if gate is None else gate.astype(F32), geom, pos], [shape], [F32],
        grid=(d_head, h, 1), threadgroup=(d_head, 1, 1),
        template=[("G", g_per), ("D", d_head), ("GATE", int(gate is not None)), ("GOFF", gate_offset), ("CB", CB)],
        which=which,
    )
    return out
