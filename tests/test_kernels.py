"""The pinned kernels on a CPU-only machine: oracles against float64, fusion claims, sources.

What runs here: every oracle (the pinned route on CPU) against an independent float64
computation; the bit-level claims of the seeds about fused vs unfused kernels; the exact
float32 building blocks; the generated Metal source of every kernel (MLX prints it on a
CPU-only build when the kernel is traced by ``mx.export_function``); the CUDA translation
unit of every kernel through nvcc when it is installed. Kernel == oracle on a GPU is
``scripts/gpu_check.py`` (recorded in docs/gpu-exactness.md) and the ``gpu`` tests below.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from muse_mlx import kernels as K
from muse_mlx.kernels import attention, ffn, fp, mul_mv, norm_tail, rms_norm
from muse_mlx.kernels.backend import metal_compact
from muse_mlx.kernels.backend import Kernel, backend
from muse_mlx.quantizers import quantize
from muse_mlx.quants import split_q6_K

RNG = np.random.default_rng(7)


def arr(*shape, scale=1.0):
    return mx.array((scale * RNG.standard_normal(shape)).astype(np.float32))


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.array(x), dtype=np.float32).view(np.uint32)


def f64(x) -> np.ndarray:
    return np.array(x).astype(np.float64)


def rms64(x, w=None, eps=1e-5):
    x = f64(x)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * f64(w)


# -- exact float32 building blocks ---------------------------------------------------------


def test_fma_is_correctly_rounded_including_ties():
    a, b, c = (np.array(RNG.standard_normal(3000) * RNG.choice([1, 1e-4, 1e4], 3000), np.float32) for _ in range(3))
    # and constructed ties: a*b + c exactly halfway between two floats, off by a tiny c2
    a[:100], b[:100] = np.float32(1 + 2**-12), np.float32(1 + 2**-12)  # a*b = 1 + 2^-11 + 2^-24
    c[:100] = np.float32(2**-40) * np.sign(RNG.standard_normal(100)).astype(np.float32)
    got = np.array(fp.fma(mx.array(a), mx.array(b), mx.array(c)))
    for i in range(len(a)):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        best = min((np.float32(got[i]), np.nextafter(got[i], np.float32(-np.inf)), np.nextafter(got[i], np.float32(np.inf))),
                   key=lambda v: abs(Fraction(float(v)) - exact))
        assert best == got[i], i


def test_simd_sum_is_the_xor_butterfly():
    v = RNG.standard_normal(32).astype(np.float32)
    lanes = v.copy()
    for off in (16, 8, 4, 2, 1):
        lanes = (lanes + lanes[np.arange(32) ^ off]).astype(np.float32)
    assert bits(fp.simd_sum(mx.array(v)[None]))[0] == lanes.view(np.uint32)[0]
    assert len(set(lanes.view(np.uint32).tolist())) == 1  # every lane holds the same total


def test_dot4_is_a_left_to_right_fma_chain():
    a, b = RNG.standard_normal((2, 500, 4)).astype(np.float32)
    want = np.array(fp.fma(a[:, 3], b[:, 3], fp.fma(a[:, 2], b[:, 2], fp.fma(a[:, 1], b[:, 1], mx.array(a[:, 0] * b[:, 0])))))
    np.testing.assert_array_equal(bits(fp.dot4(mx.array(a), mx.array(b))), bits(want))


def test_reference_transcendentals_are_float64_accurate():
    x = np.linspace(-30, 30, 20001, dtype=np.float32)
    np.testing.assert_array_equal(np.array(fp.exp(mx.array(x))), np.exp(x.astype(np.float64)).astype(np.float32))
    np.testing.assert_array_equal(np.array(fp.tanh(mx.array(x))), np.tanh(x.astype(np.float64)).astype(np.float32))


# -- geometry ------------------------------------------------------------------------------


@pytest.mark.parametrize("n,seeds,llama", [(6656, 1024, 1024), (128, 32, 32), (1152, 512, 288), (256, 64, 64), (4100, 1024, 1024)])
def test_norm_thread_rules(n, seeds, llama):
    assert K.norm_threads(n, "seeds") == seeds and K.norm_threads(n, "llama") == llama


def test_matvec_geometry_strings(monkeypatch):
    """NR0xNSG[xU[xP]]: U defaults to 1 and P to 0; the environment overrides "tuned" for its kind
    only; a bad string names itself and the form expected."""
    from muse_mlx.kernels import mul_mv

    assert mul_mv.mv_geometry("4x2", "cuda") == (4, 2, 1, 0)
    assert mul_mv.mv_geometry("2x4x3", "cuda") == (2, 4, 3, 0)
    assert mul_mv.mv_geometry("2x2x1x2", "cuda") == (2, 2, 1, 2)
    assert mul_mv.mv_geometry("ggml", "cuda") == (2, 2, 1, 0)
    tuned = mul_mv.MV_GEOMETRIES["tuned"]["cuda"]
    assert mul_mv.mv_geometry("tuned", "cuda", "q6_K head") == tuned["q6_K head"] != tuned["q6_K"]
    monkeypatch.setenv("MUSE_MLX_MV_GEOMETRY_Q6K", "1x8x1x3")
    assert mul_mv.mv_geometry("tuned", "cuda", "q6_K") == (1, 8, 1, 3)
    assert mul_mv.mv_geometry("tuned", "cuda", "q6_K head") == (1, 8, 1, 3)  # a Q6_K sweep moves the head too
    assert mul_mv.mv_geometry("tuned", "cuda", "q4_K") == tuned["q4_K"]
    monkeypatch.setenv("MUSE_MLX_MV_GEOMETRY_HEAD", "8x2")  # unless the head has its own setting
    assert mul_mv.mv_geometry("tuned", "cuda", "q6_K head") == (8, 2, 1, 0)
    assert mul_mv.mv_geometry("tuned", "cuda", "q6_K") == (1, 8, 1, 3)
    # the lone and multi Q4_K calls follow the GLU's variable unless they have their own
    monkeypatch.setenv("MUSE_MLX_MV_GEOMETRY", "4x2")
    monkeypatch.setenv("MUSE_MLX_MV_GEOMETRY_MULTI", "3x2")
    assert mul_mv.mv_geometry("tuned", "cuda", "q4_K") == (4, 2, 1, 0)
    assert mul_mv.mv_geometry("tuned", "cuda", "q4_K single") == (4, 2, 1, 0)
    assert mul_mv.mv_geometry("tuned", "cuda", "q4_K multi") == (3, 2, 1, 0)
    monkeypatch.setenv("MUSE_MLX_MV_GEOMETRY_SINGLE", "2x2x1x0")
    assert mul_mv.mv_geometry("tuned", "cuda", "q4_K single") == (2, 2, 1, 0)
    assert mul_mv.mv_geometry("tuned", "cuda", "q4_K") == (4, 2, 1, 0)
    for bad in ("2x2x1x4", "2x2x0", "0x2", "2x2x1x1x1", "2xa", "9x2"):
        with pytest.raises(ValueError, match=rf"{bad}.*NR0xNSG\[xU\[xP\]\]"):
            mul_mv.mv_geometry(bad, "cuda")


# -- oracles against float64 ---------------------------------------------------------------

# A float32 norm of n terms: relative error a few 2^-24 plus the sum's ~log2(n) roundings.
NORM_RTOL = 2e-6


@pytest.mark.parametrize("rows,n", [(1, 6656), (3, 1152), (8, 128), (2, 4100)])
def test_rms_norm_oracles_match_float64(rows, n):
    x, w, a = arr(rows, n, scale=3), arr(n), arr(rows, n)
    for geometry in ("seeds", "llama"):
        np.testing.assert_allclose(f64(K.rms_norm_mul(x, None, 1e-5, geometry=geometry)), rms64(x), rtol=NORM_RTOL, atol=1e-6)
        np.testing.assert_allclose(f64(K.rms_norm_mul(x, w, 1e-5, geometry=geometry)), rms64(x, w), rtol=NORM_RTOL, atol=1e-6)
        np.testing.assert_allclose(f64(K.rms_norm_mul(x, w, 1e-8, add=a, geometry=geometry)),
                                   rms64(x, w, 1e-8) + f64(a), rtol=NORM_RTOL, atol=1e-6)
    np.testing.assert_allclose(f64(K.rms_norm_batch(x, w)), rms64(x, w), rtol=NORM_RTOL, atol=1e-6)
    # F16: three roundings to f16 -- the normed value, the weight, the product -- of 2^-11 each
    np.testing.assert_allclose(f64(K.rms_norm_f16(x, w)), rms64(x, w), rtol=3 * 2**-11, atol=1e-4)


@pytest.mark.parametrize("rows,n", [(1, 6656), (2, 256), (3, 1152)])
def test_tail_oracles_match_float64(rows, n):
    h, s, w1, w2 = arr(rows, n), arr(rows, n, scale=5), arr(n), arr(n)
    h_ref = f64(h) + rms64(s, w1, 1e-8)
    out_ref = rms64(h_ref, w2, 1e-5)
    for hid, out in (K.tail_dual_eps(h, s, w1, w2, 1e-8, 1e-5, "seeds"), K.tail_32sg(h, s, w1, w2, 1e-8, 1e-5)):
        np.testing.assert_allclose(f64(hid), h_ref, rtol=NORM_RTOL, atol=1e-5)
        np.testing.assert_allclose(f64(out), out_ref, rtol=NORM_RTOL, atol=1e-5)


@pytest.mark.parametrize("qtype,fn", [(T.Q4_K, K.mul_mv_q4_K), (T.Q6_K, K.mul_mv_q6_K)], ids=["q4_K", "q6_K"])
@pytest.mark.parametrize("rows,k,t", [(37, 768, 1), (8, 1536, 3), (5, 256, 2)])
def test_matvec_oracles_match_float64(qtype, fn, rows, k, t):
    w = quantize(RNG.standard_normal((rows, k)).astype(np.float32), qtype)
    y = arr(t, k)
    ref = f64(y) @ dequantize(w, qtype).reshape(rows, k).astype(np.float64).T
    # |sum| <= ~ sqrt(k) * 3; float32 accumulation over k terms: k * 2^-24 * max|term| bound
    np.testing.assert_allclose(f64(fn(y, mx.array(w))), ref, rtol=0, atol=k * 2**-24 * 8)


def test_activation_oracles_match_float64():
    g, u = arr(4096, scale=4), arr(4096)
    G, U = f64(g), f64(u)
    np.testing.assert_allclose(f64(K.silu_mul(g, u)), G / (1 + np.exp(-G)) * U, rtol=4e-7, atol=1e-7)
    gelu = 0.5 * G * (1 + np.tanh(np.sqrt(2 / np.pi) * G * (1 + 0.044715 * G * G))) * U
    np.testing.assert_allclose(f64(K.gelu_mul(g, u)), gelu, rtol=1e-5, atol=1e-6)


def test_fused_ffn_oracle_matches_float64():
    rows, k = 37, 768
    wg = quantize(RNG.standard_normal((rows, k)).astype(np.float32), T.Q4_K)
    wu = quantize(RNG.standard_normal((rows, k)).astype(np.float32), T.Q4_K)
    x = arr(2, k)
    g = f64(x) @ dequantize(wg, T.Q4_K).reshape(rows, k).astype(np.float64).T
    u = f64(x) @ dequantize(wu, T.Q4_K).reshape(rows, k).astype(np.float64).T
    got = f64(K.ffn_q4k_gate_up_4r2s(x, mx.array(wg), mx.array(wu)))
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-3)


# -- the seeds' claims about fusions -------------------------------------------------------


@pytest.mark.parametrize("n,geometry", [(6656, "seeds"), (1152, "llama"), (1152, "seeds"), (256, "llama")])
def test_exact_tail_is_bit_equal_to_norm_add_norm(n, geometry):
    """Ch 12 §12.4.4: the dual-eps tail gives the same bits as ggml's two kernels run separately."""
    h, s, w1, w2 = arr(4, n), arr(4, n, scale=7), arr(n), arr(n)
    hid, out = K.tail_dual_eps(h, s, w1, w2, 1e-8, 1e-5, geometry)
    h_sep = K.rms_norm_mul(s, w1, 1e-8, add=h, geometry=geometry)
    out_sep = K.rms_norm_mul(h_sep, w2, 1e-5, geometry=geometry)
    np.testing.assert_array_equal(bits(hid), bits(h_sep))
    np.testing.assert_array_equal(bits(out), bits(out_sep))


def test_legacy_32sg_tail_is_not_bit_equal_to_the_exact_tail():
    """Ch 12 §12.7: rsqrt and a serial 32-partial combine: the same math, other bits."""
    n = 6656
    h, s, w1, w2 = arr(8, n), arr(8, n, scale=7), arr(n), arr(n)
    exact = K.tail_dual_eps(h, s, w1, w2, 1e-8, 1e-5, "seeds")[1]
    legacy = K.tail_32sg(h, s, w1, w2, 1e-8, 1e-5)[1]
    assert (bits(exact) != bits(legacy)).any()
    # ... by a few ulp: of the output, and of `hidden` (|h| ~ 7) where outputs are small
    np.testing.assert_allclose(f64(legacy), f64(exact), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [128, 1152, 1280, 4100, 6656, 19968])
def test_both_thread_rules_give_the_same_bits(n):
    """A finding: next_pow2 and roundup32 differ in thread count (1,152: 512 vs 288) but not in bits.

    Under both rules every thread owns at most one float4 when n/4 <= 1,024 (and both are 1,024
    above that), and the extra threads hold exact zeros, so the reduction tree is the same.
    """
    x, w = arr(4, n, scale=3), arr(n)
    np.testing.assert_array_equal(bits(K.rms_norm_mul(x, w, geometry="seeds")), bits(K.rms_norm_mul(x, w, geometry="llama")))


def test_thread_count_changes_bits_when_threads_take_several_elements():
    """The control for the test above: 128 threads (rms_norm_batch's geometry) over 1,664 float4s."""
    rng = np.random.default_rng(1)
    x = mx.array((rng.standard_normal((64, 6656)) * rng.uniform(0.1, 10, (64, 6656))).astype(np.float32))
    assert (bits(rms_norm.ggml_sum_of_squares(x, 1024)) != bits(rms_norm.ggml_sum_of_squares(x, 128))).sum() > 5
    ggml = rms_norm.rms_norm_mul_oracle(x, mx.ones((6656,)), 1e-5, None, 1024)
    narrow = rms_norm.rms_norm_mul_oracle(x, mx.ones((6656,)), 1e-5, None, 128)
    assert (bits(ggml) != bits(narrow)).any()


def test_fused_ffn_is_not_bit_equal_to_the_unfused_control():
    """Ch 18 §18.6: the 4r2s kernel's sums run in another order than ggml's matvec."""
    rows, k = 64, 1536
    wg = mx.array(quantize(RNG.standard_normal((rows, k)).astype(np.float32), T.Q4_K))
    wu = mx.array(quantize(RNG.standard_normal((rows, k)).astype(np.float32), T.Q4_K))
    x = arr(1, k)
    fused = K.ffn_q4k_gate_up_4r2s(x, wg, wu)
    unfused = K.silu_mul(K.mul_mv_q4_K(x, wg), K.mul_mv_q4_K(x, wu))
    assert (bits(fused) != bits(unfused)).mean() > 0.5
    np.testing.assert_allclose(f64(fused), f64(unfused), rtol=1e-4, atol=1e-4)


# -- composability -------------------------------------------------------------------------


def test_kernels_compose_inside_mx_compile():
    """The oracles are MLX ops: they run inside mx.compile and give the same bits uncompiled."""
    x, w, h = arr(3, 256, scale=2), arr(256), arr(3, 256)
    q = mx.array(quantize(RNG.standard_normal((8, 256)).astype(np.float32), T.Q4_K))

    def step(x, w, h):
        hid, out = K.tail_dual_eps(h, x, w, w, 1e-8, 1e-5)
        return K.silu_mul(K.mul_mv_q4_K(out, q), K.mul_mv_q4_K(hid, q))

    np.testing.assert_array_equal(bits(mx.compile(step)(x, w, h)), bits(step(x, w, h)))


# -- sources -------------------------------------------------------------------------------


def record_all_kernels():
    """Run every public kernel function in record mode: the exact launches MLX would make."""
    Kernel.recorded.clear()
    x, w = arr(3, 512), arr(512)
    q4 = mx.array(quantize(RNG.standard_normal((8, 512)).astype(np.float32), T.Q4_K))
    q6 = mx.array(quantize(RNG.standard_normal((8, 512)).astype(np.float32), T.Q6_K))
    K.rms_norm_mul(x, None, which="record")
    K.rms_norm_mul(x, w, which="record")
    K.rms_norm_mul(x, w, add=x, which="record")
    K.rms_norm_batch(x, w, which="record")
    K.rms_norm_f16(x, w, which="record")
    K.tail_dual_eps(x, x, w, w, 1e-8, 1e-5, which="record")
    K.tail_dual_eps_q8(x, x, w, w, 1e-8, 1e-5, which="record")
    K.tail_dual_eps_q4(x, x, w, w, 1e-8, 1e-5, which="record")
    K.tail_32sg(x, x, w, w, 1e-8, 1e-5, which="record")
    K.mul_mv_q4_K(x, q4, which="record")
    K.mul_mv_q6_K(x, q6, which="record")
    K.silu_mul(x, x, which="record")
    K.gelu_mul(x, x, which="record")
    K.ffn_q4k_gate_up_4r2s(x, q4, q4, "silu", which="record")
    K.ffn_q4k_gate_up_4r2s(x, q4, q4, "gelu_tanh", which="record")
    K.mul_mv_multi(x, [(q4, "q4_K"), (q6, "q6_K"), (q4, "q4_K")], which="record", geometry="4x2")
    K.mul_mv_multi(x, [(q4, "q4_K"), (q4, "q4_K")], which="record")  # Q4_K slots only: mul_mv_multi_q4K_f32
    K.mul_mv_glu(x, q4, q4, "q4_K", "silu", which="record")
    for form in ("1", "2"):  # the prepared activations' form of both (halves forms only)
        prep = mul_mv.q4_K_prepared(x, int(form))
        with mock.patch.dict(os.environ, {"MUSE_MLX_Q4K_HALVES": form}):
            K.tail_dual_eps_q4(x, x, w, w, 1e-8, 1e-5, which="record")
            K.mul_mv_glu(x, q4, q4, "q4_K", "silu", which="record", prep=prep)
            K.mul_mv_multi(x, [(q4, "q4_K"), (q6, "q6_K")], which="record", prep=prep)
            K.mul_mv_q4_K(x, q4, which="record")
    with mock.patch.dict(os.environ, {"MUSE_MLX_GLU_WARPS": "16"}):  # launch bounds in the unit's header
        K.mul_mv_glu(x, q4, q4, "q4_K", "silu", which="record")
    K.mul_mv_glu(x, q6, q6, "q6_K", "gelu_tanh", which="record")
    head = "x".join(map(str, mul_mv.MV_GEOMETRIES["tuned"]["cuda"]["q6_K head"]))
    K.mul_mv_q6_K(x, q6, which="record", head=True, geometry=head)  # bounded at its tuned geometry
    K.mul_mv_q8(x, [(q4, "q4_K"), (q6, "q6_K")], which="record")
    K.mul_mv_q8(x, [(q4, "q4_K"), (q4, "q4_K")], which="record", glu="gelu_tanh")
    K.mul_mv_q8(x, [(q4, "q4_K"), (split_q6_K(q6), "q6_K_split")], which="record")  # mul_mv_q8_pre's Q6_K lanes
    q4_64 = mx.concatenate([q4] * (-(-64 // q4.shape[0])))[:64]  # whole threadgroups of 2x4x4 (64 rows)
    with mock.patch.dict(os.environ, {"MUSE_MLX_Q8_PRE_GEOMETRY": "2x4x4"}):  # the GLU writing its output's q8
        K.mul_mv_q8(x, [(q4_64, "q4_K"), (q4_64, "q4_K")], which="record", glu="silu", q8_out=True)
        K.mul_mv_q8(x, [(q4, "q4_K"), (q4, "q4_K")], which="record", q8=mul_mv.quantize_q8_rows(x, which="cpu"))
        # the Q4_K rows in tiles (MUSE_MLX_Q8_TILE)
        K.mul_mv_q8(x, [(q4_64, "q4_K"), (q4_64, "q4_K")], which="record", glu="silu", q8_out=True, tile=16)
    K.dequantize_rows(q4_64, "q4_K", which="record", tile=16)
    K.dequantize_rows(q4_64, "q4_K", mx.float16, which="record", tile=16)
    K.dequantize_rows(q4, "q4_K", which="record")
    K.dequantize_rows(q6, "q6_K", which="record")
    K.dequantize_rows(q4, "q4_K", mx.float16, which="record")
    K.dequantize_rows(q6, "q6_K", mx.float16, which="record")
    K.embed_rows(q4, mx.array([1, 0], dtype=mx.int32), "q4_K", which="record")
    K.embed_rows(q6, mx.array([[2]], dtype=mx.int32), "q6_K", which="record")
    K.rms_norm_mul(x, mx.ones((3, 512)), which="record")
    kv = mx.zeros((2, 2, 256, 128), dtype=mx.float16)
    q = arr(8, 128)
    K.qk_rope_pack(q, q, 1e-6, mx.array([5], dtype=mx.int32), attention.rope_table(128, 10000.0, 1.0), rows=6, hkv=2,
                   d=128, rd=128, traditional=True, v_offset=6 * 128, nth=32, which="record")
    for fused in (True, False):
        K.attn_decode(q, kv, mx.array([5], dtype=mx.int32), attention.decode_geometry(256, 0), 0.1, q, which="record",
                      fused=fused)
    y = arr(10 * 128)  # 6 query heads, 2 KV heads, V at 8 * 128: the attention with its norms, writing its q8,
    for through in (False, True):  # then handing its planes out whole too (THRU)
        attention.attn_decode_token(y, arr(8, 128), 1e-6, mx.array([5], dtype=mx.int32),
                                    attention.rope_table(128, 10000.0, 1.0), kv, attention.decode_geometry(256, 0), 0.1,
                                    n_head=6, rd=128, traditional=False, v_offset=8 * 128, nth=32, q8_out=True,
                                    through=through, which="record")
    K.logit_stats(arr(2, 1000), which="record")
    calls = list(Kernel.recorded)
    assert {c["kernel"] for c in calls} == set(K.ALL_KERNELS)
    return calls


_C_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|[A-Za-z_]\w*|\.?\d[\w.]*|//|/\*|\*/|<<=|>>=|->|'
                      r"\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^]=|::|\.\.\.|\S")


def _tokens(cuda_text: str) -> tuple[list[str], list[str]]:
    """(preprocessor lines, the C++ tokens of the rest) of a CUDA source: what the compiler sees.
    The token split is maximal munch over C's multi-character operators and comment marks, so two
    tokens that whitespace had kept apart and a squeeze fused would show."""
    lines = cuda_text.split("\n")
    pre, code, in_macro = [], [], False
    for line in lines:
        if in_macro or line.lstrip().startswith("#"):
            pre.append(line.strip())
            in_macro = line.endswith("\\")
        else:
            code.append(line)
    return pre, _C_TOKEN.findall("\n".join(code))


def _without_comments(text: str) -> str:
    """``text`` with each ``//`` comment removed, string and character literals read as such: an
    independent reading of what backend._compact drops (the kernels hold no ``/*`` comments, which it
    refuses)."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text[i] in "\"'":
            j = i + 1
            while j < n and text[j] not in (text[i], "\n"):
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _sequence(text: str) -> list:
    """The C++ tokens of ``text`` with each preprocessor line (and its continuations) in its place
    among them, as one item of its own tokens: a directive that moved past code shows."""
    out, directive = [], None
    for line in text.split("\n"):
        if directive is not None or line.lstrip().startswith("#"):
            directive = (directive or []) + _C_TOKEN.findall(line)
            if not line.rstrip().endswith("\\"):
                out.append(("#",) + tuple(directive))
                directive = None
        else:
            out.extend(_C_TOKEN.findall(line))
    return out


def test_squeezed_sources_keep_every_token():
    """backend._squeeze drops the whitespace that separates no two tokens from the CUDA text and the
    Metal text (MLX reads a kernel's whole source at every launch): for every kernel of the release
    geometry and the prelude, the preprocessor lines and the token sequence are those of the
    unsqueezed text."""
    import importlib

    B = importlib.import_module("muse_mlx.kernels.backend")  # (the package's `backend` is the function)

    def unsqueezed(text):
        return B._ADDRESS_SPACE.sub(lambda m: B._CUDA_SPELLING[m.group(1)], B._compact(text))

    texts = [(B._compact((B.HERE / "prelude.cuh").read_text()), B.cuda_prelude())]
    seen = set()
    for c in record_all_kernels():
        k = c["kernel"]
        if k.name not in seen:
            seen.add(k.name)
            texts += [(unsqueezed(k.body), B.to_cuda(k.body)), (unsqueezed(k.header), B.to_cuda(k.header))]
            # Metal's: the same compaction without the address-space rewrite
            texts += [(B._compact(k.body), B.metal_compact(k.body)), (B._compact(k.header), B.metal_compact(k.header))]
    before = after = 0
    for plain, squeezed in texts:
        assert _tokens(squeezed) == _tokens(plain)
        before, after = before + len(plain), after + len(squeezed)
    assert after < 0.9 * before  # (and it is worth doing)
    # the whole compaction (comments dropped too) against an independent reading of the raw texts,
    # the directives' places among the code kept: what Metal and NVRTC get is what the files say
    for k in {c["kernel"].name: c["kernel"] for c in record_all_kernels()}.values():
        for raw in (k.body, k.header):
            plain = _without_comments(raw)
            assert _sequence(B.metal_compact(raw)) == _sequence(plain), k.name
            cuda_plain = B._ADDRESS_SPACE.sub(lambda m: B._CUDA_SPELLING[m.group(1)], plain)
            assert _sequence(B.to_cuda(raw)) == _sequence(cuda_plain), k.name
    for bad in ("a = 1; /* b */\n", 'x = "a // b";\n', "// a \\\nint b;\n"):  # what the rule cannot read
        with pytest.raises(ValueError, match="cannot drop safely"):
            B.metal_compact(bad)
    # the cases the rules are for: fusing operators, a comment opener, a string's spaces, a macro
    sample = 'x = y / *p - -q;\nasm volatile("cp.async.commit_group;\\n" ::: "memory");\n#define A (b)\nreturn -x;\n'
    assert B._squeeze(sample) == 'x=y/ *p- -q;asm volatile("cp.async.commit_group;\\n" ::: "memory");\n#define A (b)\nreturn-x;\n'


def test_each_kernel_gets_the_prelude_blocks_it_names():
    """prelude.cuh's optional blocks (``// -- only where the source names A B``) go into a kernel's CUDA
    source only where its header or body names one of their names. The markers list what each block
    defines (a helper added to a block without its name in the marker fails here), and every kernel
    that names something an optional block defines gets that block (the built-in ``fma`` and ``tanh``
    aside, which the float4 block only overloads for float4 and the precise block only wraps in its
    namespace)."""
    import importlib

    B = importlib.import_module("muse_mlx.kernels.backend")  # (the package's `backend` is the function)
    text = (B.HERE / "prelude.cuh").read_text()
    marks = list(B._PRELUDE_BLOCK.finditer(text))
    defines = {}
    for m, nxt in zip(marks, marks[1:] + [None]):
        if m.group(1):
            block = B._compact(text[m.end(): nxt.start() if nxt else len(text)])
            names = set(re.findall(r"#define\s+(\w+)|namespace\s+(\w+)", block))
            names = {a or b for a, b in names} | set(re.findall(r"(\w+)\s*(?:<[^<>;]*>)?\s*\([^;{}]*\)\s*(?:const\s*)?\{", block))
            names -= {"__align__", "operator", "op", "if", "for", "fma", "tanh", "F4_OP", "muse_float4"}  # (op: F4_OP's)
            assert names and names <= set(m.group(1).split()), (m.group(1), names)
            defines[frozenset(m.group(1).split())] = names
    assert len(defines) >= 10
    assert "simd_sum" not in B.cuda_prelude("") and "muse_float4" not in B.cuda_prelude("")
    assert "simd_sum" in B.cuda_prelude("x = simd_sum(y)") and "simd_max" not in B.cuda_prelude("simd_sum")
    for c in record_all_kernels():
        k = c["kernel"]
        used = set(B._IDENTIFIER.findall(k.header + k.body))
        prelude = B.cuda_prelude(k.header + k.body)
        for marker, names in defines.items():
            block = next(t for n, t in B._prelude_blocks() if n == marker)
            assert (block in prelude) == bool(marker & used), (k.name, sorted(marker))
            assert not (names & used) or block in prelude, (k.name, sorted(names & used))


METAL_ATTRIBUTES = {
    "thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
    "threads_per_threadgroup", "threads_per_grid", "threadgroups_per_grid", "thread_index_in_threadgroup",
    "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup", "threads_per_simdgroup",
    "simdgroups_per_threadgroup", "thread_execution_width",
}


def test_generated_metal_source_of_every_kernel(capfd, tmp_path):
    """MLX writes the kernel signature around our body; check it for every kernel and template."""
    for i, c in enumerate(record_all_kernels()):
        kernel = c["kernel"]
        builder = kernel.metal_source_preview()

        def call(*inputs):
            return builder(inputs=list(inputs), output_shapes=c["output_shapes"], output_dtypes=c["output_dtypes"],
                           grid=c["grid"], threadgroup=c["threadgroup"], template=c["template"], verbose=True)

        mx.export_function(str(tmp_path / f"k{i}.mlxfn"), call, *c["inputs"])
        src = capfd.readouterr().out
        assert f"custom_kernel_{kernel.name}" in src, kernel.name
        assert "#define MUSE_FN inline" in src
        for name, a in zip(kernel.inputs, c["inputs"]):
            space = "constant" if a.size < 8 else "device"
            assert f"const {space} " in src and f"* {name} [[buffer(" in src, (kernel.name, name)
        for name in kernel.outputs:
            assert "device " in src and f"* {name} [[buffer(" in src, (kernel.name, name)
        for tname, value in c["template"] or []:
            assert f"int {tname}" in src, (kernel.name, tname)
        # the body arrives compacted (the same tokens: test_squeezed_sources_keep_every_token)
        assert metal_compact(kernel.body).strip() in src
        # the Metal thread-position names the body uses became kernel attributes
        for attr in ("threadgroup_position_in_grid", "thread_index_in_simdgroup", "thread_position_in_grid"):
            if attr in kernel.body:
                assert f"[[{attr}]]" in src, (kernel.name, attr)
        # ... and a header helper names none: Metal has them only as the kernel's parameters (MLX
        # declares those the body names), where CUDA's prelude and the emulator make them global
        helpers = re.sub(r"//[^\n]*|/\*.*?\*/", "", kernel.header, flags=re.S)
        assert not set(re.findall(r"\w+", helpers)) & METAL_ATTRIBUTES, kernel.name


def test_a_kernel_source_holds_only_the_header_helpers_its_body_calls():
    """MLX hashes a kernel's whole source per launch, so each kernel carries only the helpers it
    reaches (the compile tests above and below show nothing it needs is dropped)."""
    from muse_mlx.kernels.backend import header_items, sections, to_cuda

    for family in ("attention", "ffn", "mul_mv", "norm_tail", "rms_norm"):
        header = sections(family).get("header", "")
        assert "".join(text for _, text in header_items(header)) == header, family  # a split, nothing lost
    names = lambda kernel: {name for name, _ in header_items(kernel.header)}  # noqa: E731
    q4, q6 = names(mul_mv._Q4_K), names(mul_mv._Q6_K)
    # the lone kernels call the row sums of their own type: neither carries the other's lane loop
    assert {"row_sums_q4K", "q4K_lane_sums", "q4K_block", "u2f_m"} <= q4
    assert not q4 & {"row_sums", "q6K_lane_sums", "q6K_load_round", "byte_magic", "q8_group", "q4K_q8_run",
                     "dot4_i8", "q4K_dequant4", "dequant4", "lane_group_sum"}
    assert {"row_sums_q6K", "q6K_lane_sums"} <= q6 and not q6 & {"row_sums", "q4K_lane_sums", "q4K_block"}
    # the multi kernel's slots take either type (its TYPE branch is not resolved in the text); its
    # Q4_K-only form holds no Q6_K lanes
    assert {"row_sums", "q4K_lane_sums", "q6K_lane_sums"} <= names(mul_mv._MULTI)
    assert "q4K_lane_sums" in names(mul_mv._MULTI_Q4K) and "q6K_lane_sums" not in names(mul_mv._MULTI_Q4K)
    assert "q6K_q8_run" in names(mul_mv._Q8_PRE) and "q6K_q8_run" not in names(mul_mv._Q8_PRE_Q4K)
    assert names(mul_mv._QUANTIZE_Q8) == {"q8_group"}
    glu, glu6 = names(mul_mv._GLU), names(mul_mv._GLU_Q6K)  # one text per type
    assert {"apply_activation", "gelu_tanh", "GELU_COEF_A", "q4K_lane_sums"} <= glu and "q6K_lane_sums" not in glu
    assert "q6K_lane_sums" in glu6 and "q4K_lane_sums" not in glu6
    assert "q4k_v4_dual_row_mac" not in glu
    assert names(attention._COMBINE) == {"first_visible", "splits_used", "attn_gate"}
    unreached = sum(len(to_cuda(text)) for name, text in header_items(sections("mul_mv")["header"])
                    if name in {"q8_group", "q4K_q8_run", "dot4_i8", "q4K_dequant4", "q6K_dequant4", "dequant4"})
    assert len(to_cuda(mul_mv._Q4_K.header)) <= len(to_cuda(sections("mul_mv")["header"])) - unreached


def test_a_header_the_split_cannot_place_is_an_error():
    from muse_mlx.kernels.backend import header_items

    with pytest.raises(ValueError, match="preprocessor line inside"):
        header_items("MUSE_FN int f()\n#if X\n{ return 1; }\n#endif\n")
    with pytest.raises(ValueError, match="ends inside an item"):
        header_items("MUSE_FN int f() { return 1;\n")
    # a block comment above an item, parentheses and braces in it, is not part of its name
    assert [name for name, _ in header_items("/* g(x) { */\nMUSE_FN int f() { return 1; }\n")] == ["f"]


def test_cuda_launches_name_their_texts_by_include(tmp_path, monkeypatch):
    """On CUDA, MLX gets each kernel's header and body as one #include line of a file holding the
    text (MLX hashes the source it gets at every launch): for every kernel of every recorded call,
    the translation unit with the files' texts put back is the inline one, character for character,
    and what MLX gets is a small fraction of it. The files are named by their content."""
    from muse_mlx.kernels.backend import expand_includes

    monkeypatch.setenv("MUSE_MLX_CUDA_SOURCE_DIR", str(tmp_path / "src"))
    inline = launched = 0
    for c in record_all_kernels():
        whole, short = Kernel.recorded_source(c), Kernel.recorded_source(c, as_launched=True)
        assert expand_includes(short) == whole, c["kernel"].name
        header, body = c["kernel"].launch_texts(c["bounds"])
        for text in (header, body):
            assert text.startswith(f'#include "{tmp_path / "src"}/') and text.count("\n") == 1, text
        # (measured with the default folder's path, not pytest's, whose length varies from run to run)
        default = str(Path(os.path.expanduser("~")) / ".cache" / "muse_mlx" / "cuda-sources")
        inline, launched = inline + len(whole), launched + len(short.replace(str(tmp_path / "src"), default))
    assert launched < inline / 10, (launched, inline)
    files = sorted((tmp_path / "src").iterdir())
    assert files and all(f.suffix == ".cuh" for f in files)  # (no temporary file left behind)
    # the same text is the same file; another text another; a file that lost its text is rewritten
    from muse_mlx.kernels.backend import included

    line = included("int a;\n", "probe")
    assert included("int a;\n", "probe") == line != included("int b;\n", "probe")
    path = Path(line.split('"')[1])
    path.write_text("int a")
    assert included("int a;\n", "probe") == line and path.read_text() == "int a;\n"


def test_cuda_sources_inline_on_request_or_when_the_folder_fails(tmp_path, monkeypatch):
    """``MUSE_MLX_CUDA_SOURCE=inline`` hands MLX the texts themselves; a folder that cannot be made
    does too, after a warning that names it; an unknown mode is an error naming the variable; a body
    that names an input's _shape (which MLX passes only where its source text names it) stays inline."""
    import importlib

    B = importlib.import_module("muse_mlx.kernels.backend")
    k = Kernel("mul_mv", "mul_mv_glu_f32", mul_mv._GLU.inputs, mul_mv._GLU.outputs, parts=mul_mv._GLU.parts)
    texts = (k.cuda_header(), B.to_cuda(k.body))
    monkeypatch.setenv("MUSE_MLX_CUDA_SOURCE", "inline")
    assert k.launch_texts() == texts
    monkeypatch.setenv("MUSE_MLX_CUDA_SOURCE", "files")
    with pytest.raises(ValueError, match="MUSE_MLX_CUDA_SOURCE='files'"):
        k.launch_texts()
    monkeypatch.delenv("MUSE_MLX_CUDA_SOURCE")
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("MUSE_MLX_CUDA_SOURCE_DIR", str(tmp_path / "a_file" / "src"))
    monkeypatch.setattr(B, "_INCLUDE_FAILED", set())
    with pytest.warns(UserWarning, match="a_file/src.*MUSE_MLX_CUDA_SOURCE_DIR"):
        assert k.launch_texts() == texts
    monkeypatch.setenv("MUSE_MLX_CUDA_SOURCE_DIR", str(tmp_path / "src"))
    probe = Kernel(None, "probe", ["x"], ["y"], body="y[0] = x_shape[0];\n")
    header, body = probe.launch_texts()
    assert header.startswith("#include") and body == "y[0]=x_shape[0];\n"


def test_variants_launched_counts_what_mlx_builds_apart(monkeypatch):
    """``variants_launched`` counts a kernel once per launch bounds, template values, input and
    output dtypes and (on CUDA) source form, what MLX builds, and on CUDA compiles, apart; per GPU
    backend; a repeat or a recorded call adds nothing."""
    from muse_mlx.kernels.backend import variants_launched

    monkeypatch.setattr(Kernel, "launched", set())
    monkeypatch.setenv("MUSE_MLX_CUDA_PREBUILD", "0")  # the fake build below makes no texts to build ahead
    k = Kernel(None, "probe", ["x"], ["y"], body="y[0] = x[0];\n")
    monkeypatch.setattr(k, "build", lambda which, bounds=None: (lambda **kw: [mx.zeros((1,))]))
    x32, x16 = mx.zeros((4,)), mx.zeros((4,), dtype=mx.float16)

    def launch(x, n, which="cuda", min_blocks=0, out=mx.float32):
        k([x], [(1,)], [out], (32, 1, 1), (32, 1, 1), [("N", n)], which=which, min_blocks=min_blocks)

    launch(x32, 4)
    launch(x32, 4)
    assert variants_launched("cuda") == 1
    launch(x32, 8)
    launch(x16, 8)
    launch(x32, 8, min_blocks=2)
    launch(x32, 8, out=mx.float16)
    assert variants_launched("cuda") == 5
    monkeypatch.setenv("MUSE_MLX_CUDA_SOURCE", "inline")  # another text for MLX, another module
    launch(x32, 4)
    assert variants_launched("cuda") == 6
    launch(x32, 4, which="metal")
    assert variants_launched("metal") == 1 and variants_launched() == 7
    launch(x32, 16, which="record")
    assert variants_launched() == 7


def test_every_kernel_can_be_built_ahead_of_mlx(tmp_path, monkeypatch):
    """MUSE_MLX_CUDA_PREBUILD takes every recorded launch (none asks for shapes or has a type MLX
    passes by a type of its own, which it would leave to MLX), and gives different texts different
    module files: one compile per distinct translation unit, in MLX's naming."""
    from muse_mlx.kernels import cuda_prebuild as cp
    from muse_mlx.kernels.backend import bounded_name

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setenv("MUSE_MLX_CUDA_SOURCE_DIR", str(tmp_path / "src"))
    units = {}

    def fake(source, kernel):
        units.setdefault(source, kernel)
        return b"cubin", "_Z1k"

    calls = record_all_kernels()
    paths = set()
    for c in calls:
        k = c["kernel"]
        header, body = k.launch_texts(c["bounds"])
        path = cp.ensure(bounded_name(k.name, c["bounds"]), header, body, k.inputs, c["inputs"], k.outputs,
                         c["output_dtypes"], c["template"], compiler=fake)
        assert path is not None, k.name
        paths.add(path)
    assert len(paths) == len(units) > 40, len(units)
    assert all(p.is_file() and p.with_suffix(".txt").is_file() for p in paths)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_translation_of_every_kernel_compiles(tmp_path):
    """The same bodies behind prelude.cuh, as mx.fast.cuda_kernel assembles them, through nvcc."""
    header = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n#include <cooperative_groups.h>\n"
    for i, c in enumerate(record_all_kernels()):
        k = c["kernel"]
        src = tmp_path / f"k{i}.cu"
        src.write_text(header + Kernel.recorded_source(c))
        r = subprocess.run(["nvcc", "-arch=sm_90", "-ptx", "-o", str(src) + ".ptx", str(src)], capture_output=True, text=True)
        assert r.returncode == 0, f"{k.name}:\n{r.stderr[-3000:]}"
        if c["bounds"]:  # the redefined __global__ reached the kernel: its PTX carries the bound
            ptx = Path(str(src) + ".ptx").read_text()
            assert f".maxntid {c['bounds'][0]}, 1, 1" in ptx and f".minnctapersm {c['bounds'][1]}" in ptx, k.name


# -- on a GPU: kernel == oracle ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(backend() == "cpu", reason="needs a Metal or CUDA device")
def test_kernels_equal_oracles_on_the_gpu():
    which = backend()
    x, w, a = arr(5, 6656), arr(6656), arr(5, 6656)
    np.testing.assert_array_equal(bits(K.rms_norm_mul(x, w, 1e-5, add=a, geometry="seeds", which=which)),
                                  bits(rms_norm.rms_norm_mul_oracle(x, w, 1e-5, a, 1024)))
    hid, out = K.tail_dual_eps(a, x, w, w, 1e-8, 1e-5, "seeds", which=which)
    want = norm_tail.tail_dual_eps_oracle(a, x, w, w, 1e-8, 1e-5, 1024)
    np.testing.assert_array_equal(bits(out), bits(want[1]))
    for qtype, fn, oracle in ((T.Q4_K, K.mul_mv_q4_K, mul_mv.mul_mv_q4_K_oracle),
                              (T.Q6_K, K.mul_mv_q6_K, mul_mv.mul_mv_q6_K_oracle)):
        q = mx.array(quantize(RNG.standard_normal((37, 768)).astype(np.float32), qtype))
        y = arr(3, 768)
        np.testing.assert_array_equal(bits(fn(y, q, which=which)), bits(oracle(y, q)))
    # silu with the device's own exp (the probe kernel scripts/gpu_check.py compiles behind the prelude)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from gpu_check import probe

    g, u = arr(1000, scale=4), arr(1000)
    np.testing.assert_array_equal(bits(K.silu_mul(g, u, which=which)), bits(ffn.silu_oracle(g, u, probe("exp"))))


def test_kernel_constants_are_four_wide_and_exact():
    """A kernel's scalar argument is element 0 of four (16 bytes: past MLX's 8-byte scalar pool)."""
    from muse_mlx.kernels.backend import SCALAR_POOL_BYTES, bit_copy, constant, in_device_memory

    for value, dtype in ((1e-6, mx.float32), (123456, mx.uint32)):
        c = constant(value, dtype)
        assert c.dtype == dtype and c.shape == (4,) and c.nbytes > SCALAR_POOL_BYTES
        assert np.array(c)[0] == np.array([value], dtype=np.dtype(str(dtype).split(".")[-1]))[0]
    x = mx.array(np.array([-0.0, np.inf, 1e-45, np.nan], np.float32))
    for dtype in (mx.float32, mx.float16, mx.int64, mx.uint8):
        v = x.astype(dtype) if dtype != mx.float32 else x
        c = bit_copy(v)  # the copy in_device_memory makes on CUDA, run here on the CPU
        assert c.dtype == dtype and np.array(c).tobytes() == np.array(v).tobytes()
    with pytest.raises(ValueError, match="8 bytes would stay in MLX's managed scalar pool"):
        in_device_memory(mx.array([1, 2], dtype=mx.int32))
