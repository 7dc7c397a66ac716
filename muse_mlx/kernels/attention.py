"""Decode attention over f16 KV planes (``attention.metal``): wrappers and the exact-order oracle.

``attn_decode(q, kv, pos, window, scale, gate)`` is one new token's attention, GQA, with the
attention output gate folded in: two dispatches (a split-K partial pass, then the combine), or
one (``attn_decode_fused``, the same operations) for caches of at most 1,024 positions.
``qk_rope_pack(y, ...)`` is the step before it: the Q/K-norms, RoPE and the f16 K/V of the token.
The order of every float operation is the oracle's (scores as an fma chain over the head
dimension, each split's max / exp / sum / fma chain over its keys, then the splits in order);
``exp`` is the device's on a GPU and a parameter of the oracle.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

from . import fp
from .backend import Kernel, backend, constant, in_device_memory
from .fp import CPU

F32 = mx.float32
# Keys per split: keys are cut in order into splits of CMAX, so a context of n keys uses
# ceil(n / CMAX) splits and the combine's serial chain is that long, whatever the capacity; the
# grid has ceil(cap / CMAX) splits (a static shape) and the empty ones return at once.
CMAX = 32
# Threads of a partial-pass threadgroup, per backend. 256 on CUDA (twenty-fifth session,
# docs/performance-history.md: 10.9 against 12.1 us a layer on the H200 at 4,096 keys): the partial pass is
# bound by latency (two threadgroups an SM there), so more threads each carry fewer of the same
# chains, and the output chains are cut into head slices (head_slices). Metal keeps 128 (no Mac here
# to time it). MUSE_MLX_ATTN_PARTIAL_THREADS overrides it (partial_threads); the bits are the same
# at any count.
NT = 128
PARTIAL_THREADS = {"cuda": 256, "record": 256}  # (a recorded call follows CUDA's, as kernel_sass.py expects)
# Splits whose outputs the combine loads at once (the first CB of them before anything else).
# MUSE_MLX_ATTN_COMBINE_SPLITS overrides it (combine_splits); the chain is the same either way, so
# the bits are. On the H200 at ctx 4,096 (twenty-fifth session, docs/performance-history.md): 5.2 us a layer
# at 64, against 5.4-5.8 before the first round was loaded first; 8.4 at 128 (174 registers).
CB = 64
# attn_decode_fused: caches of at most FUSED_SPLITS splits (1,024 positions) take one dispatch
# instead of two (fused_threadgroup_bytes: under Metal's 32 KB).
FUSED_SPLITS = 32
NTF = 256  # threads of a fused threadgroup: eight SIMD groups, each one split at a time
# With the planes handed out whole (THRU), the 16-byte words of the planes each thread of a copy
# threadgroup copies: all loaded before any is stored.
COPY_WORDS = 4

_QK_ROPE_PACK = Kernel("attention", "qk_rope_pack", ["y", "w", "eps", "pos", "rope"], ["qk", "kv"])
_PARTIAL = Kernel("attention", "attn_decode_partial", ["q", "kv", "pos", "geom", "scale"],
                  ["part_m", "part_l", "part_o"])
_COMBINE = Kernel("attention", "attn_decode_combine", ["part_m", "part_l", "part_o", "gate", "geom", "pos"], ["out"])
_FUSED = Kernel("attention", "attn_decode_fused", ["q", "kv", "pos", "geom", "scale", "gate", "nw", "eps", "rope"],
                ["out", "kvnew"])
# the same, also writing its output quantized for a q8 attn_output (opt-in route mv_q8, q8_attention)
_FUSED_Q8 = Kernel("attention", "attn_decode_fused_q8", _FUSED.inputs, ["out", "kvnew", "oqy", "ods"],
                   uses=("mul_mv",), parts=("attn_decode_fused", "q8_out_attn"))
KERNELS = (_QK_ROPE_PACK, _PARTIAL, _COMBINE, _FUSED, _FUSED_Q8)


def partial_threadgroup_bytes(g: int, d: int) -> int:
    """Threadgroup memory of the partial pass: the G scaled q rows (padded to D + 4 floats), one
    split's f16 key rows (then its value rows), its scores and the G maxima."""
    return 16 * g * (d // 4 + 1) + 2 * CMAX * d + 4 * g * CMAX + 4 * g


def _count_switch(name: str, default: int, fits, expected: str) -> int:
    """A whole-number environment switch: ``name``'s value if set (``fits`` it, else an error that
    says what was ``expected``), else ``default``."""
    env = os.environ.get(name)
    if not env:
        return default
    if not env.isdigit() or not fits(int(env)):
        raise ValueError(f"{name}={env!r}: expected {expected}")
    return int(env)


def partial_threads(which: str) -> int:
    """Threads of a partial-pass threadgroup on backend ``which``: :data:`PARTIAL_THREADS`, else
    :data:`NT`, or ``MUSE_MLX_ATTN_PARTIAL_THREADS`` (a multiple of 32 from 32 to 1,024)."""
    return _count_switch("MUSE_MLX_ATTN_PARTIAL_THREADS", PARTIAL_THREADS.get(which, NT),
                         lambda n: n % 32 == 0 and 32 <= n <= 1024, "a multiple of 32 from 32 to 1024")


def combine_splits() -> int:
    """Splits whose outputs the combine loads at once: :data:`CB`, or ``MUSE_MLX_ATTN_COMBINE_SPLITS``
    (1 to 256)."""
    return _count_switch("MUSE_MLX_ATTN_COMBINE_SPLITS", CB, lambda n: 1 <= n <= 256, "1 to 256")


def head_slices(g: int, d: int, threads: int) -> int:
    """How many slices of a KV head's ``g`` query heads the partial pass's output chains are cut into:
    the most, up to ``threads // d`` (one thread per dimension and slice), that divide ``g``. Each
    head's chain is the same either way, so the bits are too."""
    return max(k for k in range(1, max(1, threads // d) + 1) if g % k == 0)


def splits_for(cap: int) -> int:
    return -(-cap // CMAX)


def fused_threadgroup_bytes(d: int) -> int:
    """Threadgroup memory of attn_decode_fused: the scaled q row, each SIMD group's exp values,
    and per split its max, sum and D outputs."""
    return 4 * d + 4 * (NTF // 32) * CMAX + 8 * FUSED_SPLITS + 4 * FUSED_SPLITS * d


def fused_fits(cap: int, d_head: int) -> bool:
    """Whether a cache of ``cap`` positions and heads of ``d_head`` can take ``attn_decode_fused``."""
    return splits_for(cap) <= FUSED_SPLITS and d_head in (32, 64, 128)


def _attn_mode() -> str:
    mode = os.environ.get("MUSE_MLX_ATTN", "auto")
    if mode not in ("auto", "apart", "two"):
        raise ValueError(f"MUSE_MLX_ATTN={mode!r}: expected auto, apart or two")
    return mode


def _require_fused_fit(name: str, cap: int, d_head: int) -> None:
    if not fused_fits(cap, d_head):
        raise ValueError(f"{name} takes at most {FUSED_SPLITS * CMAX} cache positions and heads "
                         f"of 32, 64 or 128; got {cap} positions of {d_head}")


def one_dispatch(cap: int, d_head: int) -> bool:
    """The default form of :func:`attn_decode`: one dispatch wherever it fits, unless
    ``MUSE_MLX_ATTN=two`` asks for the partial pass and the combine everywhere (to compare them)."""
    return _attn_mode() != "two" and fused_fits(cap, d_head)


def with_its_norms(cap: int, d_head: int) -> bool:
    """Whether the decode path takes a token's Q/K-norms and RoPE into its one-dispatch attention
    (:func:`attn_decode_token`): wherever that fits, unless ``MUSE_MLX_ATTN`` is ``apart``
    (:func:`qk_rope_pack` launched on its own, to compare them) or ``two``."""
    return _attn_mode() == "auto" and fused_fits(cap, d_head)


def decode_geometry(cap: int, window: int) -> mx.array:
    """The constant kernel arguments of one cache: ``[cap, window, splits, 0]`` (int32, device memory)."""
    return in_device_memory(mx.array([cap, window, splits_for(cap), 0], dtype=mx.int32))


def rope_table(dims: int, base: float | None, scale: float, freqs=None) -> mx.array:
    """``[scale, inv_freq_0, ..., 0]`` (float32, device memory) for :func:`qk_rope_pack`:
    inv_freq_j = base^(-2j/dims), or 1/freqs_j with explicit frequencies (MLX's ``freqs``
    argument), rounded from float64. The trailing zero keeps even a 2-dim table out of MLX's
    scalar pool (:data:`~muse_mlx.kernels.backend.SCALAR_POOL_BYTES`)."""
    if freqs is not None:
        inv = 1.0 / np.array(freqs, np.float64)
    else:
        inv = float(base) ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    return in_device_memory(mx.array(np.concatenate([[scale], inv, [0.0]]).astype(np.float32)))


def qk_rope_pack_oracle(y, w, eps, pos: int, rope, *, rows, hkv, d, rd, traditional, v_offset, nth,
                        sin=fp.sin, cos=fp.cos):
    """The kernel's float operations in order, on the CPU: ``(qk [rows, d], kv [2, hkv, d] f16)``."""
    from .rms_norm import rms_norm_mul_oracle

    with mx.stream(CPU):
        flat = y.astype(F32).reshape(-1)
        x = flat[: rows * d].reshape(rows, d)
        x = rms_norm_mul_oracle(x, w, eps, None, nth) if w is not None else x
        if rope is not None:
            L = rope[0] * mx.array(float(pos), F32)
            theta = L * rope[1 : 1 + rd // 2]  # [rd/2] (a zero pads the table)
            c, s = cos(theta), sin(theta)
            if traditional:
                x1, x2 = x[:, 0:rd:2], x[:, 1:rd:2]
            else:
                x1, x2 = x[:, : rd // 2], x[:, rd // 2 : rd]
            r1 = fp.fma(x1, c, -(x2 * s))
            r2 = fp.fma(x1, s, x2 * c)
            if traditional:
                rot = mx.stack([r1, r2], axis=-1).reshape(rows, rd)
            else:
                rot = mx.concatenate([r1, r2], axis=-1)
            x = mx.concatenate([rot, x[:, rd:]], axis=-1)
        v = flat[v_offset : v_offset + hkv * d].reshape(hkv, d)
        kv = mx.stack([x[rows - hkv :], v]).astype(mx.float16)
        return x, kv


def qk_rope_pack(y, w, eps: float, pos: mx.array, rope, *, rows: int, hkv: int, d: int, rd: int,
                 traditional: bool, v_offset: int, nth: int, qk_shape=None, kv_shape=None, which=None):
    """One token's Q/K heads normed (``w``: ``[rows, d]`` per-row weights, or None) and roped
    (``rope``: :func:`rope_table`, or None), and its K/V rounded to f16 for the cache, in one
    dispatch. ``y`` holds the ``rows`` head rows from its start and V's ``hkv`` rows from
    ``v_offset`` (flat). Returns ``(qk [rows, d] float32, kv [2, hkv, d] float16)`` (or the shapes given)."""
    which = which or backend()
    qk_shape = (rows, d) if qk_shape is None else tuple(qk_shape)
    kv_shape = (2, hkv, d) if kv_shape is None else tuple(kv_shape)
    if which == "cpu":
        qk, kv = qk_rope_pack_oracle(y, w, eps, int(pos.reshape(-1)[0].item()), rope, rows=rows, hkv=hkv, d=d,
                                     rd=rd, traditional=traditional, v_offset=v_offset, nth=nth)
        return qk.reshape(qk_shape), kv.reshape(kv_shape)
    template = [("D", d), ("NTH", nth), ("ROWS", rows), ("HKV", hkv), ("NORM", int(w is not None)),
                ("ROPE", int(rope is not None)), ("TRAD", int(traditional)), ("RD", rd), ("VOFF", v_offset)]
    y32 = y.astype(F32)
    qk, kv = _QK_ROPE_PACK(
        [y32, y32 if w is None else w.astype(F32), constant(float(eps), F32), pos, y32 if rope is None else rope],
        [qk_shape, kv_shape], [F32, mx.float16], grid=(nth * rows, 1, 1), threadgroup=(nth, 1, 1),
        template=template, which=which,
    )
    return qk, kv


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
        chunk = CMAX  # keys in order, CMAX per split; the splits past ceil(n / CMAX) are empty
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
                gate_offset: int = 0, out_shape=None, fused: bool | None = None) -> mx.array:
    """One token's attention (and gate): ``q [H, D]``, ``kv [2, (1,) HKV, cap, D]`` f16, ``pos`` int32 [1].

    ``geom`` is :func:`decode_geometry` of the cache (cap, window, splits). Returns ``[H*D]`` float32
    (or ``out_shape``). The decode path passes arrays as they are, to spare a slice per input:
    ``n_head`` heads are read from the start of ``q``, the gate from ``gate_offset`` of ``gate``.
    ``fused`` picks one dispatch (``attn_decode_fused``) or two (partial, combine); by default
    :func:`one_dispatch`. Both give the oracle's bits.
    """
    which = which or backend()
    hkv, cap, d_head = kv.shape[-3:]
    h = q.shape[0] if n_head is None else n_head
    shape = (h * d_head,) if out_shape is None else tuple(out_shape)
    if fused is None:
        fused = one_dispatch(cap, d_head)
    elif fused:
        _require_fused_fit("attn_decode_fused", cap, d_head)
    if which == "cpu":
        window = int(geom[1].item())
        g = None if gate is None else gate.reshape(-1)[gate_offset:]
        out = attn_decode_oracle(q, kv, int(pos.reshape(-1)[0].item()), window, scale, g, n_head=h)
        return out.reshape(shape)
    g_per = h // hkv
    if fused:
        q32 = q.astype(F32)
        out, _ = _FUSED(
            [q32, kv, pos, geom, constant(float(scale), F32), q32 if gate is None else gate.astype(F32), q32, q32, q32],
            [shape, (1,)], [F32, mx.float16], grid=(NTF, h, 1), threadgroup=(NTF, 1, 1),
            template=_fused_template(g_per, d_head, hkv, gate is not None, gate_offset), which=which,
        )
        return out
    splits = splits_for(cap)
    nt = partial_threads(which)
    template = [("G", g_per), ("D", d_head), ("NT", nt), ("CMAX", CMAX), ("HKV", hkv), ("HS", head_slices(g_per, d_head, nt))]
    part_m, part_l, part_o = _PARTIAL(
        [q.astype(F32), kv, pos, geom, constant(float(scale), F32)],
        [(hkv, splits, g_per), (hkv, splits, g_per), (hkv, splits, g_per, d_head)], [F32, F32, F32],
        grid=(nt * splits, hkv, 1), threadgroup=(nt, 1, 1), template=template, which=which,
    )
    (out,) = _COMBINE(
        [part_m, part_l, part_o, q if gate is None else gate.astype(F32), geom, pos], [shape], [F32],
        grid=(d_head, h, 1), threadgroup=(d_head, 1, 1),
        template=[("G", g_per), ("D", d_head), ("GATE", int(gate is not None)), ("GOFF", gate_offset),
                  ("CMAX", CMAX), ("CB", combine_splits())],
        which=which,
    )
    return out


def _fused_template(g_per: int, d_head: int, hkv: int, gated: bool, gate_offset: int, new=None,
                    through: bool = False) -> list:
    """attn_decode_fused's template; ``new``: qk_rope_pack's (NORM, ROPE, TRAD, RD, VOFF) for NEW = 1;
    ``through``: THRU = 1, the planes handed out whole (with NEW only)."""
    norm, rope, trad, rd, voff = new or (0, 0, 0, 0, 0)
    return [("G", g_per), ("D", d_head), ("NTF", NTF), ("CMAX", CMAX), ("SMAX", FUSED_SPLITS), ("HKV", hkv),
            ("GATE", int(gated)), ("GOFF", gate_offset), ("NEW", int(new is not None)),
            ("THRU", int(through and new is not None)), ("CPW", COPY_WORDS), ("NORM", norm), ("ROPE", rope),
            ("TRAD", trad), ("RD", rd), ("VOFF", voff)]


def copy_threadgroups(hkv: int, cap: int, d_head: int) -> int:
    """The threadgroups that copy the planes when :func:`attn_decode_token` hands them out whole
    (THRU): :data:`COPY_WORDS` 16-byte words a thread, :data:`NTF` threads each."""
    return -(-2 * hkv * cap * d_head // 8 // (NTF * COPY_WORDS))


def attn_decode_token_oracle(y, w, eps, pos: int, rope, kv, window: int, scale: float, gate=None, *, n_head, d, rd,
                             traditional, v_offset, exp=fp.exp, sin=fp.sin, cos=fp.cos, through: bool = False):
    """:func:`qk_rope_pack_oracle`, its K/V written into (a copy of) the planes at the token's slot,
    then :func:`attn_decode_oracle`: ``(out [H*D], kv [2, HKV, D] f16)``, or with ``through`` that
    copy of the planes ``[2, HKV, cap, D]`` in place of the token's K/V."""
    hkv, cap = kv.shape[-3], kv.shape[-2]
    qk, kvn = qk_rope_pack_oracle(y, w, eps, pos, rope, rows=n_head + hkv, hkv=hkv, d=d, rd=rd,
                                  traditional=traditional, v_offset=v_offset, nth=32, sin=sin, cos=cos)
    with mx.stream(CPU):
        planes = kv.reshape(2, hkv, cap, d)
        slot = pos % cap
        planes = mx.concatenate([planes[:, :, :slot], kvn[:, :, None], planes[:, :, slot + 1 :]], axis=2)
    return attn_decode_oracle(qk, planes, pos, window, scale, gate, exp=exp, n_head=n_head), planes if through else kvn


def attn_decode_token(y, w, eps: float, pos: mx.array, rope, kv, geom: mx.array, scale: float, gate=None, *,
                      n_head: int, rd: int, traditional: bool, v_offset: int, nth: int, gate_offset: int = 0,
                      out_shape=None, kv_shape=None, q8_out: bool = False, through: bool = False, which=None):
    """:func:`qk_rope_pack` and the one-dispatch :func:`attn_decode` in one dispatch: a token's
    attention straight from its projection output ``y`` (query heads, key heads, and V at
    ``v_offset``), with the same bits as the two. The token's K/V are read from the kernel's own
    registers, not from ``kv``, which the caller writes afterwards: returns ``(out [n_head*D],
    kv [2, HKV, D] f16)`` (or the shapes given), the second for the cache's slot of ``pos``; with
    ``through``, the planes themselves with that slot written (``kv``'s shape; ``kv_shape`` is then
    not used), for the cache to take as its planes (THRU in ``attention.metal``: no write after it).
    Takes what the one-dispatch attention takes (:func:`fused_fits`), with the norm's reduction at
    ``nth`` = 32 threads (every head of at most 128 has it under either norm geometry).
    ``q8_out`` (the opt-in q8 route): also return the output quantized as
    :func:`~muse_mlx.kernels.mul_mv.quantize_q8_rows` quantizes it, ``(out, kv, (qy, ds))``, written
    by the same dispatch (``attn_decode_fused_q8``)."""
    which = which or backend()
    hkv, cap, d_head = kv.shape[-3:]
    _require_fused_fit("attn_decode_token", cap, d_head)
    if nth != 32:
        raise ValueError(f"attn_decode_token reduces a head's norm with one SIMD group (32 threads), not {nth}")
    shape = (n_head * d_head,) if out_shape is None else tuple(out_shape)
    kv_shape = kv.shape if through else (2, hkv, d_head) if kv_shape is None else tuple(kv_shape)
    if which == "cpu":
        g = None if gate is None else gate.reshape(-1)[gate_offset:]
        out, kvn = attn_decode_token_oracle(y, w, eps, int(pos.reshape(-1)[0].item()), rope, kv, int(geom[1].item()),
                                            scale, g, n_head=n_head, d=d_head, rd=rd, traditional=traditional,
                                            v_offset=v_offset, through=through)
        if q8_out:
            from .mul_mv import quantize_q8_rows

            return out.reshape(shape), kvn.reshape(kv_shape), quantize_q8_rows(out, which)
        return out.reshape(shape), kvn.reshape(kv_shape)
    y32 = y.astype(F32)
    new = (int(w is not None), int(rope is not None), int(traditional), rd, v_offset)
    n_out = n_head * d_head
    out, kvn, *q8 = (_FUSED_Q8 if q8_out else _FUSED)(
        [y32, kv, pos, geom, constant(float(scale), F32), y32 if gate is None else gate.astype(F32),
         y32 if w is None else w.astype(F32), constant(float(eps), F32), y32 if rope is None else rope],
        [shape, kv_shape] + ([(n_out // 4,), (n_out // 16,)] if q8_out else []),
        [F32, mx.float16] + ([mx.uint32, F32] if q8_out else []),
        grid=(NTF, n_head + (copy_threadgroups(hkv, cap, d_head) if through else 0), 1), threadgroup=(NTF, 1, 1),
        template=_fused_template(n_head // hkv, d_head, hkv, gate is not None, gate_offset, new, through), which=which,
    )
    return (out, kvn, tuple(q8)) if q8_out else (out, kvn)
