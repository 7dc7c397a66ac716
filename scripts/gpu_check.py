"""Every pinned kernel against its oracle, bit for bit, on this machine's GPU (CUDA or Metal).

    python scripts/gpu_check.py [--quick] [--only SECTION,...] [--jobs N] [--json report.json]

For each kernel and size (the Muse Glimmer sizes 6,656 / 19,968 / head_dim 128, and awkward
ones: one row, many rows, rows not a multiple of 4, row lengths whose float4 count is not a
multiple of the thread count), the kernel runs on the GPU and its oracle on the CPU, from
the same inputs, and the outputs are compared as bit patterns.

Kernels that call a transcendental (rsqrt, exp, tanh) are compared twice: against the
oracle with the correctly rounded function (the distance is that function's error on this
GPU, in ULP) and against the oracle given the GPU's own function of the same arguments
(computed by a one-line probe kernel), which must match bit for bit. The script exits 1 if
any bit-for-bit comparison fails.

On a Mac this is the one command that tells whether Apple's simd_sum, dot and compiler do
what the oracles (which model the CUDA prelude) assume; see docs/gpu-exactness.md.

The oracles run on the CPU and take most of the time, so ``--jobs N`` runs the sections in
processes of their own, N at a time (on the H200's 16-core host, ten sections at once took as long
as the longest of them, 224 s). Each section then draws its own random inputs, as with
``--only`` alone (in one process, a section's inputs depend on the sections before it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as T  # noqa: E402

from muse_mlx import kernels as K  # noqa: E402
from muse_mlx import synthetic  # noqa: E402
from muse_mlx.compare import ulp_distance  # noqa: E402
from muse_mlx.kernels import attention, ffn, fp, mul_mv, norm_tail, rms_norm  # noqa: E402
from muse_mlx.kernels.backend import Kernel, backend, bounds_of  # noqa: E402
from muse_mlx.quantizers import quantize  # noqa: E402

from environment import env, settings_in_effect  # noqa: E402

RESULTS: list[dict] = []
WHICH = backend()  # read once: inside an oracle the default stream is the CPU's

# One-line probes: the GPU's own transcendental, compiled behind the same prelude.
PROBES = {
    "rsqrt": "const uint i = thread_position_in_grid.x; if (i < count[0]) out[i] = rsqrt(x[i]);",
    "exp": "const uint i = thread_position_in_grid.x; if (i < count[0]) out[i] = exp(x[i]);",
    "log": "const uint i = thread_position_in_grid.x; if (i < count[0]) out[i] = log(x[i]);",
    "tanh": "const uint i = thread_position_in_grid.x; if (i < count[0]) out[i] = precise::tanh(x[i]);",
    "sin": "const uint i = thread_position_in_grid.x; if (i < count[0]) out[i] = sin(x[i]);",
    "cos": "const uint i = thread_position_in_grid.x; if (i < count[0]) out[i] = cos(x[i]);",
}


def probe(fn: str):
    kernel = Kernel(None, f"probe_{fn}", ["x", "count"], ["out"], body=PROBES[fn])

    def device_fn(v: mx.array) -> mx.array:
        mx.eval(v)
        flat = v.reshape(-1)
        n = flat.size
        (out,) = kernel([flat, mx.array([n], dtype=mx.uint32)], [(n,)], [mx.float32], grid=(n, 1, 1),
                        threadgroup=(min(256, n), 1, 1), template=None, which=WHICH, stream=mx.gpu)
        return out.reshape(v.shape)

    return device_fn


def compare(kernel: str, case: str, got, want, exact: bool = True, note: str = "") -> None:
    mx.eval(got, want)
    g = np.array(got.astype(mx.float32) if got.dtype != mx.float16 else got).reshape(-1)
    w = np.array(want.astype(mx.float32) if want.dtype != mx.float16 else want).reshape(-1)
    if g.dtype == np.float16:
        g, w = g.astype(np.float32), w.astype(np.float32)
    d = ulp_distance(g, w)
    row = dict(kernel=kernel, case=case, n=int(g.size), mismatches=int((d > 0).sum()),
               max_ulp=int(d.max()) if d.size else 0, exact=exact, note=note)
    row["ok"] = (row["mismatches"] == 0) if exact else True
    RESULTS.append(row)
    flag = "PASS" if row["ok"] and exact else ("info" if not exact else "FAIL")
    print(f"{flag:4}  {kernel:46} {case:34} n={row['n']:>9}  differing={row['mismatches']:>8}  "
          f"max_ulp={row['max_ulp']:>6}  {note}", flush=True)


def gpu(fn, *args, **kw):
    out = fn(*args, which=WHICH, **kw)
    mx.eval(out)
    return out


def gpu_as(kernel: Kernel, key, fn, *args, **kw):
    """:func:`gpu`, with ``kernel``'s builds cleared first so that the one built is the one that ran;
    on CUDA it must be the variant ``key`` (``(backend, bounds)``, the start of Kernel.build's key,
    which on CUDA also holds the source mode), else the comparison proves nothing."""
    kernel._built.clear()
    out = gpu(fn, *args, **kw)
    if WHICH == "cuda" and [k[:2] for k in kernel._built] != [key]:
        raise RuntimeError(f"{kernel.name} ran as {list(kernel._built)}, not {key}")
    return out


def randn(rng, *shape, scale=1.0):
    return mx.array((scale * rng.standard_normal(shape)).astype(np.float32))


def check_norms(rng, quick):
    sizes = [(1, 6656), (8, 6656), (64, 128), (3, 1152), (2, 4100), (5, 256), (1, 19968)]
    for rows, n in sizes[:4] if quick else sizes:
        x, w, a = randn(rng, rows, n), randn(rng, n, scale=0.5), randn(rng, rows, n)
        for geometry in ("seeds", "llama"):
            nth = K.norm_threads(n, geometry)
            case = f"{rows}x{n} {geometry} ({nth} thr)"
            compare("rms_norm_mul F=1", case, gpu(K.rms_norm_mul, x, None, 1e-5, geometry=geometry),
                    rms_norm.rms_norm_mul_oracle(x, None, 1e-5, None, nth))
            compare("rms_norm_mul F=2", case, gpu(K.rms_norm_mul, x, w, 1e-5, geometry=geometry),
                    rms_norm.rms_norm_mul_oracle(x, w, 1e-5, None, nth))
            compare("rms_norm_mul F=3", case, gpu(K.rms_norm_mul, x, w, 1e-8, add=a, geometry=geometry),
                    rms_norm.rms_norm_mul_oracle(x, w, 1e-8, a, nth))
        got = gpu(K.rms_norm_batch, x, w, 1e-5)
        compare("rms_norm_batch", f"{rows}x{n} vs 1/sqrt", got, rms_norm.rms_norm_batch_oracle(x, w, 1e-5),
                exact=False, note="rsqrt vs correctly rounded 1/sqrt")
        compare("rms_norm_batch", f"{rows}x{n} vs device rsqrt", got,
                rms_norm.rms_norm_batch_oracle(x, w, 1e-5, rsqrt=probe("rsqrt")))
        nth = K.norm_threads(n, "llama")
        compare("rms_norm_f16 + mul_f16", f"{rows}x{n}", gpu(K.rms_norm_f16, x, w, 1e-5),
                rms_norm.rms_norm_f16_oracle(x, w.astype(mx.float16), 1e-5, nth))


def check_tails(rng, quick):
    sizes = [(1, 6656), (4, 6656), (3, 1152), (2, 256), (1, 4100)]
    for rows, n in sizes[:3] if quick else sizes:
        h, s = randn(rng, rows, n), randn(rng, rows, n, scale=3.0)
        w1, w2 = randn(rng, n, scale=0.5), randn(rng, n, scale=0.5)
        for geometry in ("seeds", "llama"):
            nth = K.norm_threads(n, geometry)
            case = f"{rows}x{n} {geometry} ({nth} thr)"
            got = gpu(K.tail_dual_eps, h, s, w1, w2, 1e-8, 1e-5, geometry=geometry)
            want = norm_tail.tail_dual_eps_oracle(h, s, w1, w2, 1e-8, 1e-5, nth)
            compare("tail_dual_eps hidden", case, got[0], want[0])
            compare("tail_dual_eps output", case, got[1], want[1])
            # the contract: the fused tail equals ggml's two kernels run separately, on the GPU
            h_sep = gpu(K.rms_norm_mul, s, w1, 1e-8, add=h, geometry=geometry)
            o_sep = gpu(K.rms_norm_mul, h_sep, w2, 1e-5, geometry=geometry)
            compare("tail_dual_eps == norm_mul_add; norm_mul", case, mx.concatenate([got[0], got[1]]),
                    mx.concatenate([h_sep, o_sep]))
        got = gpu(K.tail_32sg, h, s, w1, w2, 1e-8, 1e-5)
        compare("tail_32sg output", f"{rows}x{n} vs device rsqrt", got[1],
                norm_tail.tail_32sg_oracle(h, s, w1, w2, 1e-8, 1e-5, rsqrt=probe("rsqrt"))[1])
        exact = gpu(K.tail_dual_eps, h, s, w1, w2, 1e-8, 1e-5, geometry="seeds")
        compare("tail_32sg vs exact tail", f"{rows}x{n}", got[1], exact[1], exact=False,
                note="expected to differ (seeds §12.7)")


def check_matvecs(rng, quick):
    shapes = [(19968, 6656, "ffn_gate/up"), (6656, 19968, "ffn_down"), (4096, 6656, "attn_q"),
              (256, 6656, "attn_k/v"), (37, 768, "37 rows (not /4)"), (5, 256, "one block")]
    if quick:
        shapes = shapes[4:]
    for rows, k, label in shapes:
        x = randn(rng, 3, k)
        for qtype, fn, oracle in ((T.Q4_K, K.mul_mv_q4_K, mul_mv.mul_mv_q4_K_oracle),
                                  (T.Q6_K, K.mul_mv_q6_K, mul_mv.mul_mv_q6_K_oracle)):
            w = mx.array(quantize((rng.standard_normal((rows, k)) / np.sqrt(k)).astype(np.float32), qtype))
            for t in (1, 3):
                got = gpu(fn, x[:t], w)
                # the oracle of a row needs only that row: check a spread of rows on big matrices
                sel = np.unique(np.r_[0:min(rows, 96), rows - min(rows, 64):rows, np.linspace(0, rows - 1, 64).astype(int)])
                want = oracle(x[:t], w[mx.array(sel)])
                compare(f"mul_mv_{qtype.name}_f32", f"{rows}x{k} {label} T={t}",
                        got[:, mx.array(sel)], want, note=f"{len(sel)} rows checked")


def check_ffn(rng, quick):
    for n in (19968, 37) if not quick else (37,):
        g, u = randn(rng, n, scale=4.0), randn(rng, n)
        got = gpu(K.silu_mul, g, u)
        compare("silu_mul_inplace", f"{n} vs correctly rounded exp", got, ffn.silu_oracle(g, u),
                exact=False, note="device exp error")
        compare("silu_mul_inplace", f"{n} vs device exp", got, ffn.silu_oracle(g, u, exp=probe("exp")))
        got = gpu(K.gelu_mul, g, u)
        compare("gelu_mul_inplace", f"{n} vs correctly rounded tanh", got, ffn.gelu_oracle(g, u),
                exact=False, note="device tanh error")
        compare("gelu_mul_inplace", f"{n} vs device tanh", got, ffn.gelu_oracle(g, u, tanh=probe("tanh")))
    shapes = [(19968, 6656), (37, 768)] if not quick else [(37, 768)]
    for rows, k in shapes:
        x = randn(rng, 2, k)
        wg = mx.array(quantize((rng.standard_normal((rows, k)) / np.sqrt(k)).astype(np.float32), T.Q4_K))
        wu = mx.array(quantize((rng.standard_normal((rows, k)) / np.sqrt(k)).astype(np.float32), T.Q4_K))
        sel = mx.array(np.unique(np.r_[0:min(rows, 64), np.linspace(0, rows - 1, 64).astype(int)]))
        for act in ("silu", "gelu_tanh"):
            got = gpu(K.ffn_q4k_gate_up_4r2s, x, wg, wu, act)[:, sel]
            want = ffn.ffn_4r2s_oracle(x, wg[sel], wu[sel], act, exp=probe("exp"), tanh=probe("tanh"))
            compare("ffn_q4k_gate_up_4r2s", f"{rows}x{k} {act} T=2", got, want, note="device exp/tanh")
            unfused = gpu(K.silu_mul if act == "silu" else K.gelu_mul,
                          gpu(K.mul_mv_q4_K, x, wg), gpu(K.mul_mv_q4_K, x, wu))[:, sel]
            compare("ffn_q4k_gate_up_4r2s vs unfused", f"{rows}x{k} {act}", got, unfused, exact=False,
                    note="expected to differ (seeds §18.6)")


def some_rows(n: int) -> mx.array:
    """The rows a full-size check compares of ``n``: the first 64 and 64 spread to the last (the
    oracle of every row is slow on the CPU)."""
    return mx.array(np.unique(np.r_[0:64, np.linspace(0, n - 1, 64).astype(int)]))


def random_blocks(rows: int, k: int, qtype: T, rng) -> mx.array:
    """Valid raw blocks without a quantizer (fast at 202,048 rows)."""
    return mx.array(synthetic.random_blocks(rows, k, qtype, rng))


def check_geometries(rng, quick):
    """Every launch geometry against ggml's (NR0 = NSG = 2) on the GPU, all rows: the same bits."""
    shapes = [(19968, 6656), (6656, 19968), (202048, 6656)] if not quick else [(37, 768), (37, 4864)]
    for rows, k in shapes:
        x = randn(rng, 2, k)
        for qtype, fn in ((T.Q4_K, K.mul_mv_q4_K), (T.Q6_K, K.mul_mv_q6_K)):
            if rows == 202048 and qtype == T.Q4_K:
                continue
            w = random_blocks(rows, k, qtype, rng)
            ref = gpu(fn, x, w, geometry="ggml")
            for geometry in ("tuned", "1x4", "2x4", "4x2", "4x4", "2x8", "8x2", "1x8", "2x2x2", "2x4x2", "4x2x2", "4x4x2",
                             "1x8x2", "2x2x1x1", "2x2x2x1", "4x4x1x1", "4x4x2x1", "1x2x1x1", "2x2x1x2", "2x4x1x2",
                             "2x2x1x3", "3x2", "3x2x1x1"):
                compare(f"mul_mv_{qtype.name}_f32 {geometry} == ggml 2x2", f"{rows}x{k} T=2",
                        gpu(fn, x, w, geometry=geometry), ref, note="all rows")


def check_decode_kernels(rng, quick):
    """The decode path's one-dispatch kernels against the single kernels / oracles, at release sizes."""
    D = 6656 if not quick else 512
    qw, kvw = (4096, 256) if not quick else (256, 64)
    x = randn(rng, 1, D)
    q4 = lambda r, c: mx.array(quantize((rng.standard_normal((r, c)) / np.sqrt(c)).astype(np.float32), T.Q4_K))  # noqa: E731
    q6 = lambda r, c: mx.array(quantize((rng.standard_normal((r, c)) / np.sqrt(c)).astype(np.float32), T.Q6_K))  # noqa: E731
    ws = [(q4(qw, D), "q4_K"), (q4(kvw, D), "q4_K"), (q6(kvw, D), "q6_K"), (q4(qw, D), "q4_K")]
    single = mx.concatenate([gpu(K.mul_mv_q4_K if k == "q4_K" else K.mul_mv_q6_K, x, w) for w, k in ws], axis=-1)
    compare("mul_mv_multi_f32 == 4 single matvecs", f"q,k,v(Q6_K),gate x {D}", gpu(K.mul_mv_multi, x, ws), single)
    ff = 19968 if not quick else 320
    for kind, mk, act in (("q4_K", q4, "silu"), ("q6_K", q6, "silu"), ("q4_K", q4, "gelu_tanh")):
        wg, wu = mk(ff, D), mk(ff, D)
        mv = K.mul_mv_q4_K if kind == "q4_K" else K.mul_mv_q6_K
        unfused = gpu(K.silu_mul if act == "silu" else K.gelu_mul, gpu(mv, x, wg), gpu(mv, x, wu))
        compare("mul_mv_glu_f32 == matvec, matvec, activation", f"{ff}x{D} {kind} {act}",
                gpu(K.mul_mv_glu, x, wg, wu, kind, act), unfused)
        wd = mk(512, D)
        from gguf.quants import dequantize as gguf_dequantize
        want = gguf_dequantize(np.array(wd), T.Q4_K if kind == "q4_K" else T.Q6_K).reshape(512, D)
        compare("dequant (prefill) == gguf-py", f"512x{D} {kind}", gpu(K.dequantize_rows, wd, kind), mx.array(want))
        compare("dequant f16 (prefill) == gguf-py rounded to half", f"512x{D} {kind}",
                gpu(K.dequantize_rows, wd, kind, mx.float16).astype(mx.float32),
                mx.array(want.astype(np.float16).astype(np.float32)))
        toks = mx.array([7, 0, 511, 7], dtype=mx.int32)
        compare("embed_rows (gather + dequant) == gguf-py", f"4 of 512x{D} {kind}", gpu(K.embed_rows, wd, toks, kind),
                mx.array(want[np.array(toks)]))
        bad = mx.array([7, 512, -1, 0], dtype=mx.int32)  # ids outside the table: rows of NaN (0x7FC00000)
        want_bad = np.full((4, D), np.nan, np.float32)
        want_bad[0], want_bad[3] = want[7], want[0]
        compare("embed_rows, ids outside the table == NaN rows", f"4 of 512x{D} {kind}", gpu(K.embed_rows, wd, bad, kind),
                mx.array(want_bad))
    # decode attention: a flat buffer, a ring that has wrapped, a window in a flat buffer
    cases = [(32, 2, 128, 8192, 0, 4000), (32, 2, 128, 4096, 4096, 6000), (32, 2, 128, 8192, 4096, 8191),
             (8, 2, 64, 256, 0, 0), (16, 1, 256, 512, 0, 300), (4, 2, 32, 2048, 0, 1500),
             (4, 2, 32, 2048, 0, 40), (32, 2, 128, 8192, 0, 128),
             (32, 2, 128, 256, 0, 128), (32, 2, 128, 1024, 0, 1023), (32, 2, 128, 1024, 1024, 3000),
             (4, 2, 32, 1024, 100, 600), (4, 2, 32, 16384, 0, 9000)]
    # (2048 at pos 1500: 47 splits hold keys, so the combine loads them in two rounds of 32; then
    # a short context in a large cache: 2 of 64 and 5 of 256 splits hold keys; then caches of at
    # most 1,024 positions, which take the one-dispatch form: the benchmark's ctx 128, all 32
    # splits, a wrapped ring, a window. The first of those is checked in the two-dispatch form too.
    # Last, 282 splits of heads of 32: the combine takes them in two rounds of 256.)
    for i, (h, hkv, d, cap, window, pos) in enumerate(cases[3:] if quick else cases):
        q = randn(rng, h, d, scale=0.3)
        kv = mx.array(rng.standard_normal((2, hkv, cap, d)).astype(np.float16))
        g = randn(rng, h * d)
        want = attention.attn_decode_oracle(q, kv, pos, window, d ** -0.5, g, exp=probe("exp"))
        forms = [attention.fused_fits(cap, d)] + ([False] if (cap, pos) == (256, 128) else [])
        for fused in forms:
            got = gpu(K.attn_decode, q, kv, mx.array([pos], dtype=mx.int32), attention.decode_geometry(cap, window),
                      d ** -0.5, g, fused=fused)
            compare("attn_decode (one dispatch)" if fused else "attn_decode (partial + combine)",
                    f"{h}x{hkv}x{d} cap {cap} win {window} pos {pos}", got, want, note="device exp")
    # Q/K-norms + RoPE + f16 K/V (one dispatch) against its oracle given the device's sin and cos
    for h, hkv, d, trad in ((32, 2, 128, True), (16, 8, 128, False)):
        rows = h + hkv
        y, w = randn(rng, rows * d + hkv * d), randn(rng, rows, d)
        table, pos = attention.rope_table(d, 10000.0, 1.0), mx.array([4321], dtype=mx.int32)
        kw = dict(rows=rows, hkv=hkv, d=d, rd=d, traditional=trad, v_offset=rows * d, nth=32)
        qk, kv = gpu(K.qk_rope_pack, y, w, 1e-6, pos, table, **kw)
        want_qk, want_kv = attention.qk_rope_pack_oracle(y, w, 1e-6, 4321, table, **kw, sin=probe("sin"), cos=probe("cos"))
        compare("qk_rope_pack (norm, rope, f16 K/V)", f"{h}+{hkv} heads x {d}{' trad' if trad else ' neox'}", qk, want_qk,
                note="device sin/cos")
        compare("qk_rope_pack f16 K/V", f"{hkv}x{d}", kv.astype(mx.float32), want_kv.astype(mx.float32))
    # the same norms and RoPE inside the one-dispatch attention (the token's K/V from the kernel's
    # registers, the planes' slot holding other values) against the two oracles, device exp/sin/cos:
    # the release geometry at ctx 128 (neox, then traditional), a wrapped ring, no RoPE, the last slot
    for h, hkv, d, cap, window, pos, trad, rope in ((32, 2, 128, 256, 0, 128, False, True),
                                                    (32, 2, 128, 256, 0, 128, True, True),
                                                    (32, 2, 128, 1024, 1024, 3000, False, True),
                                                    (32, 2, 128, 512, 0, 300, False, False),
                                                    (8, 2, 64, 1024, 0, 1023, False, True)):
        rows, v_off = h + hkv, (h + hkv) * d
        y, w, gate = randn(rng, rows * d + hkv * d + h * d), randn(rng, rows, d), randn(rng, h * d)
        table = attention.rope_table(d, 10000.0, 1.0) if rope else None
        kv = mx.array(rng.standard_normal((2, hkv, cap, d)).astype(np.float16))
        kw = dict(n_head=h, rd=d, traditional=trad, v_offset=v_off)
        got, got_kv = gpu(attention.attn_decode_token, y, w, 1e-6, mx.array([pos], dtype=mx.int32), table, kv,
                          attention.decode_geometry(cap, window), d ** -0.5, gate, nth=32, **kw)
        want, want_kv = attention.attn_decode_token_oracle(y, w, 1e-6, pos, table, kv, window, d ** -0.5, gate, d=d,
                                                           exp=probe("exp"), sin=probe("sin"), cos=probe("cos"), **kw)
        case = f"{h}x{hkv}x{d} cap {cap} win {window} pos {pos}{' trad' if trad else ''}{'' if rope else ' no rope'}"
        compare("attn_decode_token (norms, rope, attention)", case, got, want, note="device exp/sin/cos")
        compare("attn_decode_token f16 K/V", case, got_kv.astype(mx.float32), want_kv.astype(mx.float32))
    qk, w = randn(rng, 34, 128), randn(rng, 34, 128)
    compare("rms_norm_mul per-row weights", "34x128", gpu(K.rms_norm_mul, qk, w, 1e-5),
            rms_norm.rms_norm_mul_oracle(qk, w, 1e-5, None, 32))


def check_q8(rng, quick):
    """The opt-in int8-activation kernels (flag mv_q8) against their oracle (exact integer dots, then
    their float order; Q6_K rows through the exact lanes), on every Q4_K matrix shape of the release
    geometry: random valid blocks (written in seconds, where quantizing takes minutes). The GLU (and,
    with MUSE_MLX_Q8_PRE=all, every all-Q4_K call) takes quantize_q8 + mul_mv_q8_pre, whose lanes
    per row (LPR) fix the bits: checked at the default geometry and at others (LPR 32 must give the
    per-threadgroup kernel's bits); the rest takes mul_mv_q4_K_q8_multi."""
    D, ff = (6656, 19968) if not quick else (512, 768)  # (768: an odd number of blocks per row)
    qw, kvw = (4096, 256) if not quick else (256, 64)
    x, h = randn(rng, 1, D), randn(rng, 1, ff)
    lanes = mul_mv.q8_pre_geometry(WHICH)[2]
    oracle = lambda y, w, n=lanes: mul_mv.mul_mv_q4_K_q8_oracle(y, w, n)  # noqa: E731
    geo = "x".join(map(str, mul_mv.q8_pre_geometry(WHICH)))

    def compare_q8(kernel, case, got, y):  # (qy, ds) against the CPU quantization of y
        want_qy, want_ds = mul_mv.quantize_q8_rows(y, which="cpu")
        compare(f"{kernel} (opt-in mv_q8) d, sum q", case, got[1], want_ds)
        compare(f"{kernel} (opt-in mv_q8) int8 words", case, mx.view(got[0], mx.float32),
                mx.view(want_qy, mx.float32))

    compare_q8("quantize_q8", f"{ff}", gpu(mul_mv.quantize_q8_rows, h), h)
    # the tail before the q8 GLU writes its output quantized too: the exact tail's bits, quantize_q8's words
    hid, s, w1, w2 = randn(rng, 1, D), randn(rng, 1, D), randn(rng, D), randn(rng, D)
    got_h, got_o, got_q8 = gpu(K.tail_dual_eps_q8, hid, s, w1, w2, 1e-6, 1e-5, geometry="seeds")
    want_h, want_o = norm_tail.tail_dual_eps_oracle(hid, s, w1, w2, 1e-6, 1e-5, K.norm_threads(D, "seeds"))
    compare("tail_dual_eps_q8 (opt-in mv_q8) hidden, output", f"{D}", mx.concatenate([got_h, got_o]),
            mx.concatenate([want_h, want_o]))
    compare_q8("tail_dual_eps_q8", f"{D}", got_q8, want_o)
    wq, wq2 = random_blocks(ff, D, T.Q4_K, rng), random_blocks(ff, D, T.Q4_K, rng)
    # ffn_gate alone, ffn_down, attn_output: on both kernels (by default the per-threadgroup one,
    # since none is the GLU)
    singles = ((wq, x), (random_blocks(D, ff, T.Q4_K, rng), h), (random_blocks(D, qw, T.Q4_K, rng), randn(rng, 1, qw)))
    for w, y in singles:
        rows, k, sel = w.shape[0], y.shape[-1], some_rows(w.shape[0])
        with env("MUSE_MLX_Q8_PRE", "all"):
            got = gpu(K.mul_mv_q8, y, [(w, "q4_K")])
        g = mul_mv.q8_pre_geometry(WHICH, mul_mv.q8_call(rows, False))  # not the GLU: its own class
        compare("mul_mv_q8_pre (opt-in mv_q8)", f"{rows}x{k} at {'x'.join(map(str, g))}", got[..., sel],
                oracle(y, w[sel], g[2]), note=f"{sel.size} rows")
        got = gpu(K.mul_mv_q8, y, [(w, "q4_K")])
        compare("mul_mv_q4_K_q8_multi (opt-in mv_q8)", f"{rows}x{k}", got[..., sel], oracle(y, w[sel], 32),
                note=f"{sel.size} rows")
    sel = some_rows(ff)
    got = gpu(K.mul_mv_q8, x, [(wq, "q4_K"), (wq2, "q4_K")], glu="silu")
    want = ffn.silu_oracle(oracle(x, wq[sel]), oracle(x, wq2[sel]), exp=probe("exp"))
    compare("mul_mv_q8_pre glu (opt-in mv_q8)", f"{ff}x{D} silu at {geo}", got[..., sel], want, note="device exp")
    for other in ("2x4x8x2", "1x4x16", "4x4x32", "1x4x4x3"):  # other geometries: their LPR's bits
        with env("MUSE_MLX_Q8_PRE_GEOMETRY", other), env("MUSE_MLX_Q8_PRE_GEOMETRY_FEW", other):
            got = gpu(K.mul_mv_q8, x, [(wq, "q4_K"), (wq2, "q4_K")], glu="silu")
        n = int(other.split("x")[2])
        want = ffn.silu_oracle(oracle(x, wq[sel], n), oracle(x, wq2[sel], n), exp=probe("exp"))
        compare("mul_mv_q8_pre glu (opt-in mv_q8)", f"{ff}x{D} silu at {other}", got[..., sel], want,
                note="device exp")
    with env("MUSE_MLX_Q8_PRE", "0"):  # the per-threadgroup kernel: 32 lanes per row
        got = gpu(K.mul_mv_q8, x, [(wq, "q4_K"), (wq2, "q4_K")], glu="silu")
    want = ffn.silu_oracle(oracle(x, wq[sel], 32), oracle(x, wq2[sel], 32), exp=probe("exp"))
    compare("mul_mv_q4_K_q8_multi glu (opt-in mv_q8)", f"{ff}x{D} silu", got[..., sel], want, note="device exp")
    q4 = [random_blocks(r, D, T.Q4_K, rng) for r in (qw, kvw, kvw, qw)]
    with env("MUSE_MLX_Q8_PRE", "all"):
        got = gpu(K.mul_mv_q8, x, [(w, "q4_K") for w in q4])
    g = mul_mv.q8_pre_geometry(WHICH, mul_mv.q8_call(sum(w.shape[0] for w in q4), False))
    compare("mul_mv_q8_pre multi (opt-in mv_q8)", f"q,k,v,gate x {D} at {'x'.join(map(str, g))}", got,
            mx.concatenate([oracle(x, w, g[2]) for w in q4], -1))
    ws = [(q4[0], "q4_K"), (q4[1], "q4_K"), (random_blocks(kvw, D, T.Q6_K, rng), "q6_K"), (q4[3], "q4_K")]
    got = gpu(K.mul_mv_q8, x, ws)
    want = mx.concatenate([oracle(x, w, 32) if k == "q4_K" else mul_mv.ORACLES[k](x, w) for w, k in ws], -1)
    compare("mul_mv_q4_K_q8_multi multi (opt-in mv_q8)", f"q,k,v(Q6_K),gate x {D}", got, want)


def check_q8_q6k(rng, quick):
    """The opt-in flag mv_q8_q6k: mul_mv_q8_pre's split Q6_K lanes against their oracle (exact
    integer dots, then their float order), on the release geometry's Q6_K shapes: ffn_down, the
    vocabulary head, and attn_v inside the q|k|v|gate call beside Q4_K matrices; at the default
    geometry and at others (the lanes per row, LPR, fix the bits). Random valid blocks, split on
    the device as the loader splits them; each oracle takes the same rows split alone."""
    from muse_mlx.quants import split_q6_K

    D, ff, vocab = (6656, 19968, 202048) if not quick else (512, 768, 1000)
    qw, kvw = (4096, 256) if not quick else (256, 64)
    x, h = randn(rng, 1, D), randn(rng, 1, ff)
    geo = lambda call: mul_mv.q8_pre_geometry(WHICH, call)  # noqa: E731
    oracle = lambda y, raw, n: mul_mv.mul_mv_q6_K_q8_oracle(y, split_q6_K(raw), n)  # noqa: E731
    for name, raw, y in (("ffn_down", random_blocks(D, ff, T.Q6_K, rng), h),
                         ("head", random_blocks(vocab, D, T.Q6_K, rng), x)):
        sp, sel = split_q6_K(raw), some_rows(raw.shape[0])
        call = mul_mv.q8_call(raw.shape[0], False)  # "few" and "many" at full size
        got = gpu(K.mul_mv_q8, y, [(sp, "q6_K_split")])
        compare("mul_mv_q8_pre Q6_K split (opt-in mv_q8_q6k)",
                f"{name} {raw.shape[0]}x{y.shape[-1]} at {'x'.join(map(str, geo(call)))}",
                got[..., sel], oracle(y, raw[sel], geo(call)[2]), note=f"{sel.size} rows")
        for other in ("2x4x8x2", "1x4x16", "4x4x32", "1x4x4x3"):
            with env("MUSE_MLX_Q8_PRE_GEOMETRY", other), env("MUSE_MLX_Q8_PRE_GEOMETRY_FEW", other):
                got = gpu(K.mul_mv_q8, y, [(sp, "q6_K_split")])
            compare("mul_mv_q8_pre Q6_K split (opt-in mv_q8_q6k)", f"{name} at {other}", got[..., sel],
                    oracle(y, raw[sel], int(other.split("x")[2])), note=f"{sel.size} rows")
        del sp, raw
    q4 = [random_blocks(r, D, T.Q4_K, rng) for r in (qw, kvw, qw)]
    v = random_blocks(kvw, D, T.Q6_K, rng)
    got = gpu(K.mul_mv_q8, x, [(q4[0], "q4_K"), (q4[1], "q4_K"), (split_q6_K(v), "q6_K_split"), (q4[2], "q4_K")])
    g = geo(mul_mv.q8_call(2 * qw + 2 * kvw, False))
    want = [mul_mv.mul_mv_q4_K_q8_oracle(x, w, g[2]) for w in q4]
    compare("mul_mv_q8_pre multi (opt-in mv_q8_q6k)", f"q,k,v(Q6_K split),gate x {D} at {'x'.join(map(str, g))}",
            got, mx.concatenate(want[:2] + [oracle(x, v, g[2])] + want[2:], -1))
    # the GLU that writes its output quantized too (MUSE_MLX_Q8_GLU_OUT=1): the plain GLU's output,
    # and that output quantized as quantize_q8 does
    wg, wu = random_blocks(ff, D, T.Q4_K, rng), random_blocks(ff, D, T.Q4_K, rng)
    out, q8 = gpu(K.mul_mv_q8, x, [(wg, "q4_K"), (wu, "q4_K")], glu="silu", q8_out=True)
    case = f"{ff}x{D} silu at {'x'.join(map(str, geo('glu')))}"
    if q8 is None:
        compare("mul_mv_q8_pre_q8out (opt-in mv_q8_q6k)", case, mx.array([1.0]), mx.array([0.0]),
                note="no q8 output at this geometry")
    else:
        compare("mul_mv_q8_pre_q8out glu output (opt-in mv_q8_q6k)", case, out,
                gpu(K.mul_mv_q8, x, [(wg, "q4_K"), (wu, "q4_K")], glu="silu"))
        want_qy, want_ds = mul_mv.quantize_q8_rows(out, which="cpu")
        compare("mul_mv_q8_pre_q8out d, sum q (opt-in mv_q8_q6k)", case, q8[1], want_ds)
        compare("mul_mv_q8_pre_q8out int8 words (opt-in mv_q8_q6k)", case, mx.view(q8[0], mx.float32),
                mx.view(want_qy, mx.float32))


def check_q6k_split(rng, quick):
    """The exact Q6_K lanes on the split form (MUSE_MLX_Q6K_SPLIT, CUDA's default) against the same
    kernels on the raw rows, all rows, bit for bit: ffn_down and the vocabulary head at their tuned
    geometries and at others, the prefill's dequantization of ffn_down (float32 and half), the Q6_K
    GLU, attn_v inside the q|k|v|gate call; then a tiny model's
    decode loaded with the split form against one loaded without it."""
    from muse_mlx.quants import split_q6_K

    D, ff, vocab = (6656, 19968, 202048) if not quick else (512, 768, 1000)
    x, h = randn(rng, 2, D), randn(rng, 2, ff)
    for name, raw, y, head in (("ffn_down", random_blocks(D, ff, T.Q6_K, rng), h, False),
                               ("head", random_blocks(vocab, D, T.Q6_K, rng), x, True)):
        sp = split_q6_K(raw)
        for geometry in ("tuned", "ggml", "2x4x1x2", "4x4x2", "1x4x3x1", "2x2x1x3"):
            compare("mul_mv_q6_K_f32 split == raw", f"{name} {raw.shape[0]}x{y.shape[-1]} {geometry}",
                    gpu(K.mul_mv_q6_K, y, sp, geometry=geometry, head=head, split=True),
                    gpu(K.mul_mv_q6_K, y, raw, geometry=geometry, head=head), note="all rows, T=2")
        if not head:  # the batched prefill's dequantization reads the split form as it is held
            for dt in (mx.float32, mx.float16):
                compare("dequant split == raw (prefill)", f"{name} {raw.shape[0]}x{y.shape[-1]} {dt}",
                        gpu(K.dequantize_rows, sp, "q6_K_split", dt), gpu(K.dequantize_rows, raw, "q6_K", dt),
                        note="all rows")
        del sp, raw
    wg, wu = random_blocks(ff, D, T.Q6_K, rng), random_blocks(ff, D, T.Q6_K, rng)
    compare("mul_mv_glu_f32 Q6_K split == raw", f"{ff}x{D} silu", gpu(K.mul_mv_glu, x, split_q6_K(wg), split_q6_K(wu),
            "q6_K_split", "silu"), gpu(K.mul_mv_glu, x, wg, wu, "q6_K", "silu"))
    qw, kvw = (4096, 256) if not quick else (256, 64)
    q4 = [random_blocks(r, D, T.Q4_K, rng) for r in (qw, kvw, qw)]
    v = random_blocks(kvw, D, T.Q6_K, rng)
    mats = lambda vv, kind: [(q4[0], "q4_K"), (q4[1], "q4_K"), (vv, kind), (q4[2], "q4_K")]  # noqa: E731
    compare("mul_mv_multi_f32 v split == raw", f"q,k,v(Q6_K),gate x {D}",
            gpu(K.mul_mv_multi, x[:1], mats(split_q6_K(v), "q6_K_split")), gpu(K.mul_mv_multi, x[:1], mats(v, "q6_K")))
    outs = []
    for on in ("0", "1"):
        with env("MUSE_MLX_Q6K_SPLIT", on):
            model, tokens = tiny_model(np.random.default_rng(7), 40)
            outs.append(tiny_decode(model, tokens, compiled=True))
    compare("decode, Q6_K split form == raw blocks", "tiny muse-glimmer, 32 tokens, compiled", outs[1], outs[0])


def edge_activations(rng, k, form: int | None = None):
    """Two tokens of ordinary activations, both with signed zeros, subnormals and tiny normals, the
    second also with values up to half the range of the Q4_K lanes' nibble form ``form``
    (mul_mv.HALVES_RANGE: 2^95 for forms 0 and 1, which scale by up to 2^32 and are exact below
    |y| = 2^96; 2^71 for form 2). The huge ones get a token of their own: they swamp every other
    product of a row, so a wrong order among ordinary values shows only in the first token.
    ``form`` None: the narrowest of the forms the engine runs here."""
    if form is None:
        forms = {mul_mv.q4K_halves(WHICH, kind) for kind in mul_mv.Q4K_KINDS}
        form = 2 if 2 in forms else max(forms)
    v = rng.standard_normal((2, k)).astype(np.float32)
    small = np.array([0.0, -0.0, 1e-45, -3e-42, 1.2e-38, -1e-30], np.float32)
    for row in v:
        row[rng.choice(k, 4 * small.size, replace=False)] = np.tile(small, 4)
    top = mul_mv.HALVES_RANGE.get(form, 2.0 ** 96) / 2
    huge = np.array([top, -top / 2, top / 1e4], np.float32)
    v[1, rng.choice(k, 4 * huge.size, replace=False)] = np.tile(huge, 4)
    return mx.array(v)


def prepared(y, kind: str):
    """``y`` prepared for the Q4_K lanes of geometry kind ``kind`` in the nibble form the engine runs here."""
    return mul_mv.q4_K_prepared(y, mul_mv.q4K_halves(WHICH, kind))


def check_q4_forms(rng, quick):
    """The exact Q4_K lanes' three nibble forms (MUSE_MLX_Q4K_HALVES: 2, nibbles, scales and mins as
    subnormal halves against activations scaled by 2^48/2^56; 1, the nibbles only, against 2^24/2^32,
    CUDA's default; 0, the 2^23 float pattern) and the activations a tail prepares for forms 1 and 2
    (tail_dual_eps_q4, then prep=): the oracle's bits on every Q4_K shape of the release geometry,
    with edge activations inside each form's range, then a tiny model's decoded logits, form
    against form."""
    D, ff = (6656, 19968) if not quick else (512, 768)
    qw, kvw = (4096, 256) if not quick else (256, 64)
    oracle = mul_mv.mul_mv_q4_K_oracle
    lone = ((random_blocks(ff, D, T.Q4_K, rng), D, "ffn_gate"), (random_blocks(D, ff, T.Q4_K, rng), ff, "ffn_down"),
            (random_blocks(D, qw, T.Q4_K, rng), qw, "attn_output"))
    ws = [(random_blocks(qw, D, T.Q4_K, rng), "q4_K"), (random_blocks(kvw, D, T.Q4_K, rng), "q4_K"),
          (random_blocks(kvw, D, T.Q6_K, rng), "q6_K"), (random_blocks(qw, D, T.Q4_K, rng), "q4_K")]
    wg, wu = random_blocks(ff, D, T.Q4_K, rng), random_blocks(ff, D, T.Q4_K, rng)
    hid, s, w1, w2 = randn(rng, 1, D), randn(rng, 1, D, scale=3.0), randn(rng, D), randn(rng, D)
    want_h, want_o = norm_tail.tail_dual_eps_oracle(hid, s, w1, w2, 1e-8, 1e-5, K.norm_threads(D, "seeds"))
    for halves in ("2", "1", "0"):
        form = int(halves)
        for w, k, name in lone:
            y = edge_activations(rng, k, form)
            sel = some_rows(w.shape[0])
            with env("MUSE_MLX_Q4K_HALVES", halves):
                got = gpu(K.mul_mv_q4_K, y, w)
            compare(f"mul_mv_q4_K_f32 HALVES={halves}", f"{name} {w.shape[0]}x{k} edge y", got[..., sel],
                    oracle(y, w[sel]), note=f"{sel.size} rows")
        x = edge_activations(rng, D, form)
        want = mx.concatenate([mul_mv.ORACLES[k](x, w) for w, k in ws], -1)
        sel = some_rows(ff)
        want_glu = ffn.silu_oracle(oracle(x, wg[sel]), oracle(x, wu[sel]), exp=probe("exp"))
        with env("MUSE_MLX_Q4K_HALVES", halves):
            multi, glu = gpu(K.mul_mv_multi, x, ws), gpu(K.mul_mv_glu, x, wg, wu, "q4_K", "silu")
        compare(f"mul_mv_multi_f32 HALVES={halves}", f"q,k,v(Q6_K),gate x {D} edge y", multi, want)
        compare(f"mul_mv_glu_f32 HALVES={halves}", f"{ff}x{D} q4_K silu edge y", glu[..., sel], want_glu,
                note="device exp")
        if not form:  # prepared activations are for the halves forms
            continue
        # the tail writes the prepared form: its own two outputs and q4_K_prepared's of its output
        with env("MUSE_MLX_Q4K_HALVES", halves):
            got_h, got_o, made = gpu(K.tail_dual_eps_q4, hid, s, w1, w2, 1e-8, 1e-5, geometry="seeds")
        compare(f"tail_dual_eps_q4 HALVES={halves} hidden, output", f"{D}", mx.concatenate([got_h, got_o]),
                mx.concatenate([want_h, want_o]))
        want_made = mul_mv.q4_K_prepared(want_o, form)
        compare(f"tail_dual_eps_q4 HALVES={halves} scaled activations", f"{D}", made.ys, want_made.ys)
        compare(f"tail_dual_eps_q4 HALVES={halves} run sums", f"{D // 8}", made.sy, want_made.sy)
        # the projections and the GLU reading it (edge activations, prepared on the CPU)
        prep = mul_mv.q4_K_prepared(x, form)
        with env("MUSE_MLX_Q4K_HALVES", halves):
            multi = gpu(K.mul_mv_multi, x, ws, prep=prep)
            glu = gpu(K.mul_mv_glu, x, wg, wu, "q4_K", "silu", prep=prep)
        compare(f"mul_mv_multi_f32 HALVES={halves} prepared", f"q,k,v(Q6_K),gate x {D} edge y", multi, want)
        compare(f"mul_mv_glu_f32 HALVES={halves} prepared", f"{ff}x{D} q4_K silu edge y", glu[..., sel], want_glu,
                note="device exp")
    # end to end: a tiny model's decode, each combination of the switches against the default
    model, tokens = tiny_model(rng, 24)
    base = tiny_decode(model, tokens)
    for halves, prep in (("2", "1"), ("2", "0"), ("1", "1"), ("1", "0"), ("0", "1")):  # every kind at once
        model.route.dispatches.clear()
        with env("MUSE_MLX_Q4K_HALVES", halves), env("MUSE_MLX_Q4K_PREP", prep):
            got = tiny_decode(model, tokens)
        tails = model.route.dispatches["fused_norm_residual_rms_norm_batch_dual_eps_q4"]
        compare(f"decode HALVES={halves} PREP={prep} == default", f"tiny muse-glimmer, 16 tokens, {tails} prepared tails",
                got, base)


def check_glu_warps(rng, quick):
    """The exact Q4_K GLU compiled for 16 resident warps per SM (MUSE_MLX_GLU_WARPS=16: launch bounds,
    128 registers; CUDA's default in form 2) against the oracle, in each nibble form and prepared,
    then a tiny model's decoded logits with the bound against without (MUSE_MLX_GLU_WARPS=0):
    register allocation must not move a bit."""
    D, ff = (6656, 19968) if not quick else (512, 768)
    x = edge_activations(rng, D, 2)  # inside every form's range
    wg, wu = random_blocks(ff, D, T.Q4_K, rng), random_blocks(ff, D, T.Q4_K, rng)
    sel = some_rows(ff)
    oracle = mul_mv.mul_mv_q4_K_oracle
    want = ffn.silu_oracle(oracle(x, wg[sel]), oracle(x, wu[sel]), exp=probe("exp"))
    nsg = mul_mv.mv_geometry("tuned", WHICH, "q4_K")[1]
    bounded = ("cuda", bounds_of((32, nsg, 1), 16 // nsg))  # the key Kernel.build files it under
    with env("MUSE_MLX_GLU_WARPS", "16"):
        for halves, pr in (("2", mul_mv.q4_K_prepared(x, 2)), ("2", None), ("1", mul_mv.q4_K_prepared(x, 1)),
                           ("1", None), ("0", None)):
            with env("MUSE_MLX_Q4K_HALVES", halves):
                got = gpu_as(mul_mv._GLU, bounded, K.mul_mv_glu, x, wg, wu, "q4_K", "silu", prep=pr)
            compare(f"mul_mv_glu_f32 16 warps HALVES={halves}{' prepared' if pr else ''}", f"{ff}x{D} q4_K silu edge y",
                    got[..., sel], want, note="device exp")
    model, tokens = tiny_model(rng, 24)
    with env("MUSE_MLX_GLU_WARPS", "0"):
        base = tiny_decode(model, tokens)
    with env("MUSE_MLX_GLU_WARPS", "16"):
        got = tiny_decode(model, tokens)
    compare("decode GLU 16 warps == unbounded", "tiny muse-glimmer, 16 tokens", got, base)


def release_q4_matrices(rng, D: int, ff: int, qw: int, kvw: int):
    """Random blocks of the calls the lone and multi Q4_K kernels make: q|k|v|gate (v Q6_K, as in
    llama.cpp's mix on half the layers), ffn_down and attn_output."""
    mats = [(random_blocks(qw, D, T.Q4_K, rng), "q4_K"), (random_blocks(kvw, D, T.Q4_K, rng), "q4_K"),
            (random_blocks(kvw, D, T.Q6_K, rng), "q6_K"), (random_blocks(qw, D, T.Q4_K, rng), "q4_K")]
    return mats, random_blocks(D, ff, T.Q4_K, rng), random_blocks(D, qw, T.Q4_K, rng)


def check_mv_warps(rng, quick):
    """The lone exact Q4_K matvec and the multi kernel compiled for 24 and 28 resident warps per SM
    (MUSE_MLX_Q4K_WARPS, MUSE_MLX_MULTI_WARPS: launch bounds, 80 and 72 registers with spills)
    against the same kernels unbounded, all rows, edge activations, plain and prepared; then a tiny
    model's decode with both bounds against without: register allocation must not move a bit."""
    D, ff = (6656, 19968) if not quick else (512, 768)
    qw, kvw = (4096, 256) if not quick else (256, 64)
    nsg = {kind: mul_mv.mv_geometry("tuned", WHICH, kind)[1] for kind in ("q4_K single", "q4_K multi")}
    x, h = edge_activations(rng, D), edge_activations(rng, ff)
    mats, down, attn_out = release_q4_matrices(rng, D, ff, qw, kvw)
    a = edge_activations(rng, qw)
    for warps in (24, 28):
        key = ("cuda", bounds_of((32, nsg["q4_K single"], 1), warps // nsg["q4_K single"]))
        for name, y, w in (("ffn_down", h, down), ("attn_output", a, attn_out)):
            want = gpu_as(mul_mv._Q4_K, ("cuda", None), K.mul_mv_q4_K, y, w)
            with env("MUSE_MLX_Q4K_WARPS", str(warps)):
                got = gpu_as(mul_mv._Q4_K, key, K.mul_mv_q4_K, y, w)
            compare(f"mul_mv_q4_K_f32 {warps} warps == unbounded", f"{name} {w.shape[0]}x{y.shape[-1]} edge y", got, want,
                    note="all rows")
        key = ("cuda", bounds_of((32, nsg["q4_K multi"], 1), warps // nsg["q4_K multi"]))
        for prep in (None, prepared(x, "q4_K multi")):
            want = gpu_as(mul_mv._MULTI, ("cuda", None), K.mul_mv_multi, x, mats, prep=prep)
            with env("MUSE_MLX_MULTI_WARPS", str(warps)):
                got = gpu_as(mul_mv._MULTI, key, K.mul_mv_multi, x, mats, prep=prep)
            compare(f"mul_mv_multi_f32 {warps} warps == unbounded", f"q,k,v(Q6_K),gate x {D}{' prepared' if prep else ''}",
                    got, want, note="edge y")
    model, tokens = tiny_model(rng, 24)
    base = tiny_decode(model, tokens)
    with env("MUSE_MLX_Q4K_WARPS", "24"), env("MUSE_MLX_MULTI_WARPS", "24"):
        got = tiny_decode(model, tokens)
    compare("decode Q4_K and multi 24 warps == default", "tiny muse-glimmer, 16 tokens", got, base)


def q4_kind_calls(rng, quick, var: dict) -> dict:
    """Per Q4_K kind, calls of the release shapes with edge activations, each launching one kernel of
    that kind, keyed by the variable ``var`` names for it ("single", "multi", "glu"): the lone kernel
    (ffn_down, attn_output), the multi kernel (q, k, Q6_K v, gate) and the GLU, the last two plain and
    prepared. Each call takes ``which``; its name says what it runs."""
    D, ff = (6656, 19968) if not quick else (512, 768)
    qw, kvw = (4096, 256) if not quick else (256, 64)
    x, h, a = edge_activations(rng, D), edge_activations(rng, ff), edge_activations(rng, qw)
    prep = {kind: prepared(x, kind) for kind in ("q4_K", "q4_K multi")}
    mats, down, attn_out = release_q4_matrices(rng, D, ff, qw, kvw)
    wg, wu = random_blocks(ff, D, T.Q4_K, rng), random_blocks(ff, D, T.Q4_K, rng)
    return {var["single"]: [
                (f"mul_mv_q4_K_f32 ffn_down {D}x{ff}", lambda which: K.mul_mv_q4_K(h, down, which=which)),
                (f"mul_mv_q4_K_f32 attn_output {D}x{qw}", lambda which: K.mul_mv_q4_K(a, attn_out, which=which))],
            var["multi"]: [
                (f"mul_mv_multi_f32 q,k,v(Q6_K),gate x {D}", lambda which: K.mul_mv_multi(x, mats, which=which)),
                (f"mul_mv_multi_f32 q,k,v(Q6_K),gate x {D} prepared",
                 lambda which: K.mul_mv_multi(x, mats, which=which, prep=prep["q4_K multi"]))],
            var["glu"]: [
                (f"mul_mv_glu_f32 {ff}x{D} q4_K silu", lambda which: K.mul_mv_glu(x, wg, wu, "q4_K", which=which)),
                (f"mul_mv_glu_f32 {ff}x{D} q4_K silu prepared",
                 lambda which: K.mul_mv_glu(x, wg, wu, "q4_K", which=which, prep=prep["q4_K"]))]}


# The geometries timed per Q4_K kind: the twentieth session's (the lone calls' and the multi kernel's
# grids run 1.26 and 1.65 waves at 2x2x1x1; P = 0 and NR0 3 or 4 fit in one), and the GLU at 3x2x1x0,
# which staging makes room for (twenty-third session).
KIND_GEOMETRIES = {"MUSE_MLX_MV_GEOMETRY_SINGLE": ("2x2x1x0", "3x2x1x0", "4x2x1x0", "3x2x1x1"),
                   "MUSE_MLX_MV_GEOMETRY_MULTI": ("2x2x1x0", "3x2x1x0", "4x2x1x0", "3x2x1x1"),
                   "MUSE_MLX_MV_GEOMETRY": ("2x2x1x0", "3x2x1x0", "4x2x1x0")}
# The split Q6_K ffn_down's geometries checked staged against its tuned one (q6_stages): four and
# three rows a SIMD group, which staging makes room for (fewer registers than P rounds of loads)
Q6K_STAGED_GEOMETRIES = ("4x2x1x0", "3x2x1x0", "4x4x1x0")


def check_kind_geometries(rng, quick):
    """The lone Q4_K matvec, the multi kernel and the GLU at the geometries of KIND_GEOMETRIES, each
    set through its kind's variable, against the same call at the tuned geometry: all rows, edge
    activations, plain and prepared; then a tiny model's decode with each kind at such a geometry
    against the tuned decode. A geometry must not move a bit."""
    calls = q4_kind_calls(rng, quick, {"single": "MUSE_MLX_MV_GEOMETRY_SINGLE", "multi": "MUSE_MLX_MV_GEOMETRY_MULTI",
                                       "glu": "MUSE_MLX_MV_GEOMETRY"})
    for var, geometries in KIND_GEOMETRIES.items():
        for name, call in calls[var]:  # each call launches one kernel, of the kind ``var`` sets
            want = gpu(call)
            for geometry in geometries:
                with env(var, geometry):
                    got = gpu(call)
                compare(f"{name} {geometry} == tuned", "edge y", got, want, note=f"{var}, all rows")
    model, tokens = tiny_model(rng, 24)
    base = tiny_decode(model, tokens)
    for var, geometries in KIND_GEOMETRIES.items():
        for geometry in geometries:
            with env(var, geometry):
                got = tiny_decode(model, tokens)
            compare(f"decode {var}={geometry} == tuned", "tiny muse-glimmer, 16 tokens", got, base)


def check_q4_stages(rng, quick):
    """The exact Q4_K lanes with their weights staged in threadgroup memory (MUSE_MLX_Q4K_STAGES_*=2,
    3, 4: asynchronous copies on NVIDIA) against the same calls with the register loads (S = 0): the
    lone kernel, the multi kernel and the GLU, all rows, edge activations, plain and prepared; then a
    tiny model's decode with every kind staged against the default decode. Where the bytes come from
    must not move a bit."""
    calls = q4_kind_calls(rng, quick, {"single": "MUSE_MLX_Q4K_STAGES_SINGLE", "multi": "MUSE_MLX_Q4K_STAGES_MULTI",
                                       "glu": "MUSE_MLX_Q4K_STAGES_GLU"})
    for var, named in calls.items():
        for name, call in named:
            with env(var, "0"):
                want = gpu(call)
            for stages in ("2", "3", "4"):
                with env(var, stages):
                    got = gpu(call)
                compare(f"{name} S={stages} == registers", "edge y", got, want, note=f"{var}, all rows")
    model, tokens = tiny_model(rng, 24)
    with env("MUSE_MLX_Q4K_STAGES", "0"):
        base = tiny_decode(model, tokens)
    for stages in ("2", "3", "4"):
        with env("MUSE_MLX_Q4K_STAGES", stages):
            got = tiny_decode(model, tokens)
        compare(f"decode MUSE_MLX_Q4K_STAGES={stages} == registers", "tiny muse-glimmer, 16 tokens", got, base)


def check_q6_stages(rng, quick):
    """The exact Q6_K lanes on the split form with their quant words staged in threadgroup memory
    (MUSE_MLX_Q6K_STAGES=2, 3, 4; MUSE_MLX_Q6K_STAGES_HEAD at a head geometry of U = 1) against the
    same calls with register loads, all rows, edge activations; then a tiny model's decode staged
    against the default."""
    from muse_mlx.quants import split_q6_K

    D, ff, vocab = (6656, 19968, 202048) if not quick else (512, 768, 1000)
    x, h = edge_activations(rng, D), edge_activations(rng, ff)
    down = split_q6_K(random_blocks(D, ff, T.Q6_K, rng))
    with env("MUSE_MLX_Q6K_STAGES", "0"):
        want = gpu(K.mul_mv_q6_K, h, down, split=True)
    for stages in ("2", "3", "4"):
        with env("MUSE_MLX_Q6K_STAGES", stages):
            got = gpu(K.mul_mv_q6_K, h, down, split=True)
        compare(f"mul_mv_q6_K_f32 split S={stages} == registers", f"ffn_down {D}x{ff} edge y", got, want,
                note="all rows, tuned geometry")
    for geometry in Q6K_STAGED_GEOMETRIES:  # staged (the default S) at other geometries
        with env("MUSE_MLX_MV_GEOMETRY_Q6K", geometry):
            got = gpu(K.mul_mv_q6_K, h, down, split=True)
        compare(f"mul_mv_q6_K_f32 split staged {geometry} == registers", f"ffn_down {D}x{ff} edge y", got, want,
                note="all rows")
    del down
    head = split_q6_K(random_blocks(vocab, D, T.Q6_K, rng))
    with env("MUSE_MLX_MV_GEOMETRY_HEAD", "4x4x1x1"):
        with env("MUSE_MLX_Q6K_STAGES_HEAD", "0"):
            want = gpu(K.mul_mv_q6_K, x, head, head=True, split=True)
        with env("MUSE_MLX_Q6K_STAGES_HEAD", "2"):
            got = gpu(K.mul_mv_q6_K, x, head, head=True, split=True)
    compare("mul_mv_q6_K_f32 head split S=2 == registers", f"head {vocab}x{D} 4x4x1x1 edge y", got, want,
            note="all rows")
    del head
    model, tokens = tiny_model(rng, 24)
    with env("MUSE_MLX_Q6K_STAGES", "0"):
        base = tiny_decode(model, tokens)
    for stages in ("2", "3"):
        with env("MUSE_MLX_Q6K_STAGES", stages):
            got = tiny_decode(model, tokens)
        compare(f"decode MUSE_MLX_Q6K_STAGES={stages} == registers", "tiny muse-glimmer, 16 tokens", got, base)
    for geometry in Q6K_STAGED_GEOMETRIES:
        with env("MUSE_MLX_MV_GEOMETRY_Q6K", geometry), env("MUSE_MLX_MV_GEOMETRY_HEAD", "4x4x2x0"):
            got = tiny_decode(model, tokens)
        compare(f"decode MUSE_MLX_MV_GEOMETRY_Q6K={geometry} staged == registers", "tiny muse-glimmer, 16 tokens",
                got, base)


def check_head_warps(rng, quick):
    """The vocabulary head at its tuned geometry, compiled with its launch bounds (HEAD_WARPS: the
    occupancy it was tuned at) and without (MUSE_MLX_HEAD_WARPS=0), each against the oracle: the
    register allocation must not move a bit. Also the lone Q6_K matrix beside it (never bounded)."""
    for var in ("MUSE_MLX_HEAD_WARPS", "MUSE_MLX_MV_GEOMETRY_HEAD", "MUSE_MLX_MV_GEOMETRY_Q6K"):
        if var in os.environ:  # each would move the head off what this section checks
            raise RuntimeError(f"head_warps checks the default head: unset {var} first")
    rows, D = (202048, 6656) if not quick else (1000, 768)
    x = randn(rng, 1, D)
    w = random_blocks(rows, D, T.Q6_K, rng)
    sel = some_rows(rows)
    want = mul_mv.mul_mv_q6_K_oracle(x, w[sel])
    tuned = mul_mv.mv_geometry("tuned", WHICH, "q6_K head")
    blocks = mul_mv.head_min_blocks(WHICH, tuned)
    for setting, key in ((None, ("cuda", bounds_of((32, tuned[1], 1), blocks))), ("0", ("cuda", None))):
        with env("MUSE_MLX_HEAD_WARPS", setting):
            got = gpu_as(mul_mv._Q6_K, key, K.mul_mv_q6_K, x, w, head=True)
        compare(f"mul_mv_q6_K_f32 head, {blocks * tuned[1] if setting is None else 0} warps bound", f"{rows}x{D} T=1",
                got[..., sel], want, note=f"geometry {'x'.join(map(str, tuned))}")
    compare("mul_mv_q6_K_f32 (lone, unbounded)", f"{rows}x{D} T=1", gpu(K.mul_mv_q6_K, x, w)[..., sel], want)


def check_stock_q6k(rng, quick):
    """The stock route's Q6_K form (two MLX affine forms, hi + lo) on the device: MLX's own
    dequantization of the pair against gguf-py, bit for bit (zeros compared without their sign,
    as the form promises), and its two quantized_matmuls against a float64 product (info: MLX's
    rounding, not a pinned order)."""
    from gguf.quants import dequantize as gguf_dequantize

    from muse_mlx.layers import QLinear
    from muse_mlx.routes import StockRoute

    D, ff = (6656, 19968) if not quick else (512, 768)
    stock = StockRoute()
    for rows, k in ((D, ff), (256, D)):  # ffn_down, attn_v
        w = random_blocks(rows, k, T.Q6_K, rng)
        lin = QLinear(w, T.Q6_K, k, rows, stock.form_for(T.Q6_K))  # the route's own form and op
        want = mx.array(gguf_dequantize(np.array(w), T.Q6_K).reshape(rows, k))
        compare("stock Q6_K hi + lo == gguf-py", f"{rows}x{k}", lin.dequantized() + 0.0, want + 0.0,
                note="zero signs dropped")
        for m in (1, 64):  # qmv, and the quantized GEMM a prefill takes
            x = randn(rng, m, k)
            qmm = stock.linear(x, lin)
            ref64 = np.array(x, np.float64) @ np.array(want, np.float64).T
            # ULP distances blow up at outputs near zero; the error against the row's scale does not
            scale = np.abs(np.array(x, np.float64)) @ np.abs(np.array(want, np.float64)).T
            rel = float((np.abs(np.array(qmm, np.float64) - ref64) / np.maximum(scale, 1e-30)).max())
            compare("stock Q6_K qmm(hi) + qmm(lo) vs float64", f"{m}x{k} @ {rows}x{k}", qmm,
                    mx.array(ref64.astype(np.float32)), exact=False, note=f"max |err| / sum|x*w| = {rel:.1e}")


def tiny_model(rng, n_tokens: int):
    """The pinned route on a tiny muse-glimmer file written for the check, and ``n_tokens`` random ids."""
    import tempfile

    from muse_mlx import load_model
    from muse_mlx.writer import write_tiny

    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(write_tiny(Path(tmp) / "tiny.gguf", "muse-glimmer"), "pinned")
    return model, [int(t) for t in rng.integers(0, model.cfg.vocab_size, n_tokens)]


def tiny_decode(model, tokens, compiled: bool | None = None) -> mx.array:
    """``tokens[:8]`` prefilled, then the rest decoded one at a time: their logits, stacked. By the
    model's own call (``compiled=None``) or through a DecodeStep, compiled or not."""
    from muse_mlx.decode import DecodeStep

    cache = model.make_cache()
    model(mx.array([tokens[:8]]), cache)
    step = DecodeStep(model, cache, 64, compiled=compiled) if compiled is not None else None
    out = mx.stack([(model(mx.array([[t]]), cache)[0, -1] if step is None else step(mx.array([t]))) for t in tokens[8:]])
    mx.eval(out)
    return out


def check_decode_step(rng, quick):
    """A tiny model's decode path: compiled (one replayed trace) == uncompiled == the model's own."""
    model, tokens = tiny_model(rng, 40)
    outs = [tiny_decode(model, tokens, compiled) for compiled in (None, False, True)]
    compare("decode step uncompiled == model", "tiny muse-glimmer, 32 tokens", outs[1], outs[0])
    compare("decode step mx.compile == uncompiled", "tiny muse-glimmer, 32 tokens", outs[2], outs[1])


def token_attention_args(rng, h, hkv, d, cap, window, pos):
    """attn_decode_token's arguments for a random case, no gate: ``(args, kw)``."""
    rows, v_off = h + hkv, (h + hkv) * d
    y, w, table = randn(rng, v_off + hkv * d), randn(rng, rows, d), attention.rope_table(d, 10000.0, 1.0)
    kv = mx.array(rng.standard_normal((2, hkv, cap, d)).astype(np.float16))
    args = (y, w, 1e-6, mx.array([pos], dtype=mx.int32), table, kv, attention.decode_geometry(cap, window),
            d ** -0.5, None)
    return args, dict(n_head=h, rd=d, traditional=False, v_offset=v_off, nth=32)


def decode_ab(rng, name: str, base: str, other: str, flags=()) -> tuple[mx.array, mx.array]:
    """A tiny model's compiled decode of 16 tokens with the switch ``name`` at ``other``, then at
    ``base``: their logits."""
    model, tokens = tiny_model(rng, 24)
    if flags:
        model.set_flags(list(flags))
    outs = []
    for value in (other, base):
        with env(name, value):
            outs.append(tiny_decode(model, tokens, True))
    return outs[0], outs[1]


def check_q8_outputs(rng, quick):
    """The opt-in q8 route's attention writing its output quantized (attn_decode_fused_q8,
    MUSE_MLX_Q8_ATTN=1, the default) -- its float output and K/V the plain kernel's, its words and
    scales quantize_q8's of that output -- then a tiny model's compiled decode with mv_q8 +
    mv_q8_q6k, with it on and off. (Until the twenty-seventh session this also compared the q8
    GLU's output quantized by SIMD groups, a form not kept.)"""
    h, hkv, d, cap = (32, 2, 128, 1024) if not quick else (8, 2, 64, 256)
    args, kw = token_attention_args(rng, h, hkv, d, cap, 0, cap // 2 + 5)
    case = f"{h} heads of {d}, ctx {cap // 2 + 6} of {cap}"
    plain, plain_kv = gpu(attention.attn_decode_token, *args, **kw)
    out, out_kv, (qy, ds) = gpu(attention.attn_decode_token, *args, q8_out=True, **kw)
    compare("attn_decode_fused_q8 output, K/V (opt-in mv_q8)", case, mx.concatenate([out, out_kv.astype(mx.float32)
                                                                                      .reshape(-1)]),
            mx.concatenate([plain, plain_kv.astype(mx.float32).reshape(-1)]))
    want_qy, want_ds = mul_mv.quantize_q8_rows(out, which="cpu")
    compare("attn_decode_fused_q8 d, sum q (opt-in mv_q8)", case, ds, want_ds)
    compare("attn_decode_fused_q8 int8 words (opt-in mv_q8)", case, mx.view(qy, mx.float32), mx.view(want_qy, mx.float32))
    on, off = decode_ab(rng, "MUSE_MLX_Q8_ATTN", "0", "1", ["mv_q8", "mv_q8_q6k"])
    compare("decode step, q8 attention on == off (opt-in mv_q8 + mv_q8_q6k)", "tiny muse-glimmer, 16 tokens", on, off)


def q8_release_calls(rng, quick):
    """The q8 route's all-Q4_K calls at the release shapes (``quick``: small ones), on random
    blocks: ``(glu_shape, x, [gate, up], [(name, activations, [matrices]), ...])``, the GLU ("rows x K")
    and then the q|k|v|gate, attn_output and ffn_down calls."""
    D, ff = (6656, 19968) if not quick else (512, 768)
    qw, kvw = (4096, 256) if not quick else (256, 64)
    x, h, o = randn(rng, 1, D), randn(rng, 1, ff), randn(rng, 1, qw)
    q4 = lambda r, k: random_blocks(r, k, T.Q4_K, rng)  # noqa: E731
    pair = [q4(ff, D), q4(ff, D)]
    calls = [("q|k|v|gate", x, [q4(qw, D), q4(kvw, D), q4(kvw, D), q4(qw, D)]), ("attn_output", o, [q4(D, qw)]),
             ("ffn_down", h, [q4(D, ff)])]
    return f"{ff}x{D}", x, pair, calls


def compare_q8_glu(kernel: str, note: str, case: str, got, want):
    """A q8 GLU writing its output quantized, ``(output, (int8 words, (d, sum q) pairs))``, against another."""
    (out, (qy, ds)), (w_out, (w_qy, w_ds)) = got, want
    compare(f"{kernel} output ({note})", case, out, w_out)
    compare(f"{kernel} d, sum q ({note})", case, ds, w_ds)
    compare(f"{kernel} int8 words ({note})", case, mx.view(qy, mx.float32), mx.view(w_qy, mx.float32))


def check_q8_tiles(rng, quick):
    """The q8 GLU's weights in tiles of rows (MUSE_MLX_Q8_TILE, 16 by default on CUDA; quants.tile_q4_K_rows): the
    q8 GLU with its q8 output and the all-Q4_K q8 calls on tiled rows bit
    for bit what they give on the raw rows; the batched prefill's dequantization of tiled rows (f32,
    f16) the raw rows'; then a tiny model (rows of two blocks) with mv_q8 + mv_q8_q6k loaded with
    tiles of 16 and without: a batched prefill's and a compiled decode's logits."""
    import tempfile

    from muse_mlx import load_model
    from muse_mlx.decode import DecodeStep
    from muse_mlx.generate import batched_prefill
    from muse_mlx.quants import tile_q4_K_rows
    from muse_mlx.writer import Geometry, write_tiny

    glu_shape, x, (gate, up), calls = q8_release_calls(rng, quick)
    plain = gpu(K.mul_mv_q8, x, [(gate, "q4_K"), (up, "q4_K")], glu="silu", q8_out=True)
    for tile in (16, 64, 256):
        tiled = [(tile_q4_K_rows(w, tile), "q4_K") for w in (gate, up)]
        out = gpu(K.mul_mv_q8, x, tiled, glu="silu", q8_out=True, tile=tile)
        compare_q8_glu("q8 GLU on tiled rows:", "MUSE_MLX_Q8_TILE", f"{glu_shape} silu, tiles of {tile}", out, plain)
    for name, y, mats in calls:
        q8 = gpu(mul_mv.quantize_q8_rows, y)
        plain = gpu(K.mul_mv_q8, y, [(w, "q4_K") for w in mats], q8=q8)
        for tile in (4, 16):
            out = gpu(K.mul_mv_q8, y, [(tile_q4_K_rows(w, tile), "q4_K") for w in mats], q8=q8, tile=tile)
            compare("q8 call on tiled rows (MUSE_MLX_Q8_TILE)", f"{name}, tiles of {tile}", out, plain)
    for dtype in (mx.float32, mx.float16):
        want = gpu(K.dequantize_rows, gate, "q4_K", dtype)
        got = gpu(K.dequantize_rows, tile_q4_K_rows(gate, 16), "q4_K", dtype, tile=16)
        compare(f"dequant_{'f32' if dtype == mx.float32 else 'f16'} of tiled rows (MUSE_MLX_Q8_TILE)",
                f"{glu_shape}, tiles of 16", got.astype(mx.float32), want.astype(mx.float32))
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny(Path(tmp) / "tiny.gguf", "muse-glimmer",
                          geometry=Geometry(n_embd=512, n_ff=512, head_dim=64, n_head=4, n_head_kv=2))
        tokens = [int(t) for t in rng.integers(0, 300, 24)]
        outs = []
        for tile in ("16", "1"):
            with env("MUSE_MLX_Q8_TILE", tile):
                model = load_model(path, "pinned", ["mv_q8", "mv_q8_q6k"])
            cache = model.make_cache()
            with batched_prefill(model.route):
                first = model(mx.array([tokens[:8]]), cache)[0, -1]
            step = DecodeStep(model, cache, 64, compiled=WHICH != "cpu")  # (the oracles do not compile)
            outs.append(mx.concatenate([first[None], mx.stack([step(mx.array([t])) for t in tokens[8:]])]))
            mx.eval(outs[-1])
    compare("batched prefill + decode step, GLU weights in tiles of 16 == raw rows (MUSE_MLX_Q8_TILE)",
            "tiny muse-glimmer 512 wide, 8 + 16 tokens", outs[0], outs[1])


def check_kv_through(rng, quick):
    """The attention with its norms handing its planes out whole (MUSE_MLX_KV_WRITE=through, THRU):
    its output the plain kernel's, its planes the input's with the token's K/V at its slot (the
    plain kernel's K/V), at the release heads with caches of 256 and 1,024 positions (16 and 64 copy
    threadgroups) and a wrapped ring of 512; then a tiny model's compiled decode,
    through against a scatter after each attention (MUSE_MLX_KV_WRITE=layer)."""
    h, hkv, d = (32, 2, 128) if not quick else (8, 2, 64)
    for cap, window, pos in ((256, 0, 133), (1024, 0, 1000), (512, 512, 1300)):
        args, kw = token_attention_args(rng, h, hkv, d, cap, window, pos)
        case = f"{h} heads of {d}, pos {pos}, cap {cap}" + (", ring" if window else "")
        plain, plain_kv = gpu(attention.attn_decode_token, *args, **kw)
        out, planes = gpu(attention.attn_decode_token, *args, through=True, **kw)
        want = np.array(args[5])
        want[:, :, pos % cap] = np.array(plain_kv)
        compare("attn_decode_fused THRU output", case, out, plain)
        compare("attn_decode_fused THRU planes", case, planes, mx.array(want))
    thru, layer = decode_ab(rng, "MUSE_MLX_KV_WRITE", "layer", "through")
    compare("decode step, planes through == scatters after", "tiny muse-glimmer, 16 tokens", thru, layer)


def check_logits(rng, quick):
    """The logits' statistics (``logit_stats``: argmax, log-sum-exp, finite flag) against their order
    on the CPU with this GPU's own exp and log (the probes), bit for bit, and the log-sum-exp against
    float64; rows of the vocabulary's length with a maximum tied at each level of the merges (the
    incoming state holding the lower index), an -inf, a NaN, a row of one value."""
    from muse_mlx.kernels import logits

    n, span = (70_001 if quick else 202_048), logits.GROUPS * logits.THREADS
    ties = [(7, 7 + span), (7, 8 + span), (32, 3 + span), (256, 5 + span)]  # as tests/test_logits.py's TIES
    x = 4.0 * rng.standard_normal((4 + len(ties), n)).astype(np.float32)
    x[1, 11] = -np.inf
    x[2, n // 2] = np.nan
    x[3, :] = x[3, 0]  # every value the maximum
    for r, (first, other) in enumerate(ties, start=4):
        x[r, [other, first]] = 40.0
    cases = [(f"{len(x)} rows of {n} (ties, -inf, NaN)", mx.array(x))]
    if not quick:
        cases += [("3 rows of 5", randn(rng, 3, 5, scale=4.0)), ("1 row of 300", randn(rng, 1, 300, scale=4.0))]
    for case, v in cases:
        got = gpu(logits.logit_stats, v)
        want = logits.logit_stats_oracle(v, exp=probe("exp"), log=probe("log"))
        compare("logit_stats token", case, got.token, want.token)
        compare("logit_stats finite", case, got.finite, want.finite)
        xs = np.array(v)
        live = np.flatnonzero(~np.isnan(xs).any(axis=1))  # a NaN row's log-sum-exp means nothing
        compare("logit_stats lse, device exp/log order", case, got.lse[mx.array(live)], want.lse[mx.array(live)])
        x64 = xs.astype(np.float64)[live]
        top = x64.max(axis=1, keepdims=True)
        lse64 = (top + np.log(np.exp(x64 - top).sum(axis=1, keepdims=True)))[:, 0]
        compare("logit_stats lse vs float64", case, got.lse[mx.array(live)], mx.array(lse64.astype(np.float32)),
                exact=False, note="its own order against the float64 sum")
        compare("logit_stats token vs numpy argmax", case, got.token[mx.array(live)],
                mx.array(np.argmax(xs[live], axis=1).astype(np.uint32)))


def transcendental_ulps(rng, quick=False):
    """The GPU's rsqrt/exp/tanh against correctly rounded values, on 1M arguments each (64K quick:
    the float64 references run on the CPU and took most of a quick run's four minutes)."""
    n = 1 << 16 if quick else 1 << 20
    args = {
        "rsqrt": mx.array(np.exp(rng.uniform(-20, 20, n)).astype(np.float32)),
        "exp": mx.array(rng.uniform(-20, 20, n).astype(np.float32)),
        "tanh": mx.array(rng.uniform(-10, 10, n).astype(np.float32)),
    }
    exact = {"rsqrt": fp.rsqrt, "exp": fp.exp, "tanh": fp.tanh}
    for fn, x in args.items():
        compare(f"device {fn}", f"{x.size} arguments vs correctly rounded", probe(fn)(x), exact[fn](x), exact=False,
                note="the ULP bound of this GPU's function")


def _mlx_printed_source(run) -> str:
    """The source MLX prints for a kernel call made by ``run()`` with ``verbose=True`` (C++'s
    standard output, read from file descriptor 1)."""
    with tempfile.TemporaryFile() as f:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            mx.eval(run())
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        text = f.read().decode()
    return text.split("```\n", 1)[1].rsplit("\n```", 1)[0]


def check_prebuild(rng, quick=False):
    """``MUSE_MLX_CUDA_PREBUILD``'s reading of MLX (CUDA only): (1) the source MLX prints for a
    probe kernel is ``cuda_prebuild``'s, character for character, so the module names agree; (2) MLX
    runs a module written ahead under that name: the probe's cubin, written first, adds 2 where the
    text MLX gets adds 1; (3) a real kernel built ahead (``rms_norm_mul`` at a width no other section
    uses) gives its oracle's bits."""
    from muse_mlx.kernels import cuda_prebuild as cp

    if WHICH != "cuda":
        print("prebuild: CUDA only; skipped")
        return
    tag = f"{os.getpid()}_{time.time_ns() % 10**9}"  # a kernel no process has built before
    # The probe adds PROBE_ADD, 1 in its text; the cubin written ahead is built with a -D of 2 in
    # front: a define, not an edit of the text, which MUSE_MLX_CUDA_SOURCE_DIR moves behind an #include
    probe_k = Kernel(None, f"prebuild_probe_{tag}", ["x"], ["y"],
                     body="#ifndef PROBE_ADD\n#define PROBE_ADD 1.0f\n#endif\ny[0] = x[0] + PROBE_ADD;\n")
    x = mx.array([5.0], dtype=mx.float32)
    launch = dict(output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                  which=WHICH)
    header, body = probe_k.launch_texts(None)
    name = cp.mlx_kernel_name(probe_k.name, [("N", 3)])
    want = cp.MLX_DEFAULT_HEADER + cp.mlx_source(name, header, body, ["x"], [mx.float32], ["y"], [mx.float32],
                                                 [("N", 3)])
    printed = _mlx_printed_source(lambda: probe_k([x], template=[("N", 3)], verbose=True, **launch))
    same = printed == want
    print(f"{'PASS' if same else 'FAIL'}  MLX's printed source == cuda_prebuild.mlx_source  ({len(printed)} chars)")
    if not same:
        import difflib
        print("".join(difflib.unified_diff(want.splitlines(True), printed.splitlines(True), "ours", "MLX's")))
    RESULTS.append(dict(kernel="cuda_prebuild.mlx_source == MLX's printed source", case="probe, template N=3",
                        n=1, mismatches=int(not same), max_ulp=0, exact=True, ok=same, note=""))
    nvrtc = cp.Nvrtc()
    plus_two = lambda src, k: nvrtc.compile("#define PROBE_ADD 2.0f\n" + src, k, cp._arch())  # noqa: E731
    path = cp.ensure(probe_k.name, header, body, ["x"], [x], ["y"], [mx.float32], [("N", 4)], compiler=plus_two)
    print(f"      wrote {path}")
    (y,) = probe_k([x], template=[("N", 4)], **launch)
    (y3,) = probe_k([x], template=[("N", 3)], **launch)  # built by MLX from the text (N=3 above)
    compare("MLX builds the probe's own text", "probe, N=3: 5 + 1", y3, mx.array([6.0]))
    compare("MLX runs the module cuda_prebuild wrote", "probe: 5 + 2 (its text: 5 + 1)", y, mx.array([7.0]))
    with env("MUSE_MLX_CUDA_PREBUILD", "1"):
        n = 1184
        xs, w = randn(rng, 3, n), randn(rng, n, scale=0.5)
        nth = K.norm_threads(n, "seeds")
        compare("rms_norm_mul built ahead", f"3x{n} seeds", gpu(K.rms_norm_mul, xs, w, 1e-5, geometry="seeds"),
                rms_norm.rms_norm_mul_oracle(xs, w, 1e-5, None, nth))


SECTIONS = dict(norms=check_norms, tails=check_tails, matvecs=check_matvecs, ffn=check_ffn,
                geometries=check_geometries, decode_kernels=check_decode_kernels, q4_forms=check_q4_forms,
                glu_warps=check_glu_warps, head_warps=check_head_warps, mv_warps=check_mv_warps,
                kind_geometries=check_kind_geometries, q4_stages=check_q4_stages, q6_stages=check_q6_stages, q8=check_q8, q8_q6k=check_q8_q6k, q6k_split=check_q6k_split,
                stock_q6k=check_stock_q6k,
                decode_step=check_decode_step, q8_outputs=check_q8_outputs, kv_through=check_kv_through,
                q8_tiles=check_q8_tiles, logits=check_logits, prebuild=check_prebuild,
                transcendentals=transcendental_ulps)


def section_command(name: str, quick: bool, report: Path) -> list[str]:
    """The command that runs one section alone and writes its results to ``report``."""
    return [sys.executable, str(Path(__file__).resolve()), "--only", name, "--json", str(report)] + \
        (["--quick"] if quick else [])


def run_sections_apart(only: list[str], quick: bool, jobs: int) -> tuple[list[dict], list[str]]:
    """Each section in a process of its own, ``jobs`` at a time. Prints each section's output, in
    section order, once it and those before it are done; returns every comparison's row and the
    sections that crashed: no report, a torn one, or an exit status that does not match it (0 when
    every row passed, 1 when one failed; a crash at exit, say). Their output above says why."""
    def one(name: str, tmp: str):
        report = Path(tmp) / f"{name}.json"
        t0 = time.time()
        proc = subprocess.run(section_command(name, quick, report), check=False, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace")
        try:
            rows = json.loads(report.read_text())["results"]
        except (OSError, ValueError, KeyError):  # no report, or a torn one: the section crashed
            rows = None
        return proc.returncode, proc.stdout, rows, time.time() - t0

    results, crashed = [], []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp, ThreadPoolExecutor(jobs) as pool:
        futures = [(name, pool.submit(one, name, tmp)) for name in only]
        for name, future in futures:
            rc, out, rows, dt = future.result()
            lines = out.splitlines()
            if lines and lines[0].startswith("{"):
                lines = lines[1:]  # the machine's description, printed once above
            print(f"\n## {name} ({dt:.0f} s, exit status {rc})")
            print("\n".join(lines).strip("\n"), flush=True)
            results += rows or []
            if rows is None or rc != int(not all(r["ok"] for r in rows)):
                crashed.append(name)
    return results, crashed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes only (seconds, not minutes)")
    ap.add_argument("--json", help="write the results as JSON to this path")
    ap.add_argument("--only", default=None,
                    help="comma-separated sections to run, of: " + ", ".join(SECTIONS) + " (default: all)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="run the sections in processes of their own, this many at a time (default 1: "
                         "all in this process, one after another)")
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: expected 1 or more")
    only = list(SECTIONS) if args.only is None else list(dict.fromkeys(args.only.split(",")))  # once each
    unknown = set(only) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s) {', '.join(sorted(unknown))} in --only")
    which = WHICH
    if which not in ("metal", "cuda"):
        print("no Metal or CUDA device: nothing to check (the CPU runs the oracles themselves)")
        return 2
    info = dict(date=time.strftime("%Y-%m-%d"), backend=which, mlx=mx.__version__,
                device=str(mx.device_info() if hasattr(mx, "device_info") else mx.default_device()),
                python=platform.python_version(), environment=settings_in_effect())
    print(json.dumps(info))
    t0 = time.time()
    crashed = []
    if args.jobs > 1 and len(only) > 1:
        rows, crashed = run_sections_apart(only, args.quick, args.jobs)
        RESULTS.extend(rows)
    else:
        rng = np.random.default_rng(20261129)
        for name in only:
            SECTIONS[name](rng, args.quick)
    failed = [r for r in RESULTS if not r["ok"]]
    print(f"\n{len(RESULTS)} comparisons, {sum(r['exact'] for r in RESULTS)} bit-for-bit, "
          f"{len(failed)} failed, {time.time() - t0:.0f} s")
    if crashed:
        print(f"sections that crashed (no report, a torn one, or an exit status it does not explain): "
              f"{', '.join(crashed)} (their output is above)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(info=info, results=RESULTS, crashed=crashed), indent=1))
    return 1 if failed or crashed else 0


if __name__ == "__main__":
    sys.exit(main())
