"""The decode kernels (one-dispatch projections, the fused GLU, the decode attention, the
prefill dequantizer) against their oracles and independent references.

Two kinds of test: the oracles (which the pinned route runs on a CPU) against float64 or
against the single kernels they claim to equal; and the kernels' source text, run by the CPU
emulator (tests/kernel_emulator.py), against the oracles bit for bit. On a GPU the same
comparisons are made by scripts/gpu_check.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from kernel_emulator import available, emulate_recorded
from muse_mlx import kernels as K
from muse_mlx.kernels import attention, ffn, mul_mv, rms_norm
from muse_mlx.kernels.backend import Kernel
from muse_mlx.quantizers import quantize
from test_kernel_emulator import assert_bits_equal, libm

RNG = np.random.default_rng(23)
F32 = np.float32
emulator = pytest.mark.skipif(not available(), reason="needs g++ with C++20 (<barrier>) and _Float16")
QTYPE = {"q4_K": T.Q4_K, "q6_K": T.Q6_K}


def arr(*shape, scale=1.0):
    v = RNG.standard_normal(shape) * RNG.uniform(0.1, 10.0, shape) * scale
    return mx.array(v.astype(F32))


def qrows(rows, k, kind):
    return mx.array(quantize(RNG.standard_normal((rows, k)).astype(F32), QTYPE[kind]))


# -- oracles ---------------------------------------------------------------------------------


def test_multi_and_glu_oracles_are_the_single_kernels():
    """What the one-dispatch kernels promise: the single kernels' bits, concatenated or activated."""
    y = arr(2, 512)
    a, b, c = qrows(37, 512, "q4_K"), qrows(8, 512, "q6_K"), qrows(16, 512, "q4_K")
    multi = K.mul_mv_multi(y, [(a, "q4_K"), (b, "q6_K"), (c, "q4_K")])
    single = np.concatenate([np.array(K.mul_mv_q4_K(y, a)), np.array(K.mul_mv_q6_K(y, b)),
                             np.array(K.mul_mv_q4_K(y, c))], axis=-1)
    assert_bits_equal(multi, single)
    for kind, act, fn in (("q4_K", "silu", K.silu_mul), ("q6_K", "gelu_tanh", K.gelu_mul)):
        g, u = qrows(21, 512, kind), qrows(21, 512, kind)
        mv = K.mul_mv_q4_K if kind == "q4_K" else K.mul_mv_q6_K
        assert_bits_equal(K.mul_mv_glu(y, g, u, kind, act), fn(mv(y, g), mv(y, u)))


def test_per_row_norm_weights_equal_separate_norms():
    """The Q- and K-norms of a token in one dispatch: each row's bits as if normalized alone."""
    x = arr(6, 128)
    wq, wk = arr(128), arr(128)
    w = mx.concatenate([mx.broadcast_to(wq, (4, 128)), mx.broadcast_to(wk, (2, 128))])
    both = K.rms_norm_mul(x, w, 1e-6)
    assert_bits_equal(both[:4], K.rms_norm_mul(x[:4], wq, 1e-6))
    assert_bits_equal(both[4:], K.rms_norm_mul(x[4:], wk, 1e-6))


def test_dequantize_rows_is_gguf_py():
    for kind in ("q4_K", "q6_K"):
        w = qrows(5, 768, kind)
        want = gguf_dequantize(np.array(w), QTYPE[kind]).reshape(5, 768)
        assert_bits_equal(K.dequantize_rows(w, kind), want)


def attention64(q, kv, pos, window, scale, gate):
    """float64 reference: softmax over positions lo..pos (slot p % cap), GQA, then o * sigmoid(g)."""
    q, kv = np.array(q, np.float64), np.array(kv).astype(np.float64)
    _, hkv, cap, d = kv.shape
    h = q.shape[0]
    lo = max(0, pos - window + 1) if window else 0
    slots = [p % cap for p in range(lo, pos + 1)]
    out = np.zeros((h, d))
    for i in range(h):
        k, v = kv[0, i // (h // hkv), slots], kv[1, i // (h // hkv), slots]
        s = (k @ q[i]) * scale
        p = np.exp(s - s.max())
        out[i] = p @ v / p.sum()
    out = out.reshape(-1)
    return out if gate is None else out / (1 + np.exp(-np.array(gate, np.float64)))


# (heads, kv heads, head dim, cache capacity, window, position): a flat buffer, a ring that has
# wrapped, a window inside a flat buffer, one KV head per query head, one position
ATTN_CASES = [(8, 2, 64, 512, 0, 300), (4, 2, 128, 256, 256, 700), (6, 3, 32, 1024, 100, 600),
              (2, 2, 64, 128, 0, 0), (16, 1, 128, 384, 0, 383), (4, 2, 32, 2048, 0, 1500),
              (4, 2, 32, 2048, 0, 40),  # 2 of 64 splits hold keys
              (2, 1, 32, 16384, 0, 9000)]  # 282 splits: the combine takes them in two rounds of 256


def _attn_inputs(h, hkv, d, cap, gate=True):
    q = arr(h, d, scale=0.3)
    kv = mx.array((RNG.standard_normal((2, hkv, cap, d))).astype(np.float16))
    g = arr(h * d) if gate else None
    return q, kv, g


@pytest.mark.parametrize("h,hkv,d,cap,window,pos", ATTN_CASES)
def test_decode_attention_oracle_matches_float64(h, hkv, d, cap, window, pos):
    """float32 scores over <= 128 dims and sums over <= 32 keys per split: relative error ~1e-6."""
    q, kv, g = _attn_inputs(h, hkv, d, cap)
    scale = d ** -0.5
    got = np.array(attention.attn_decode_oracle(q, kv, pos, window, scale, g), np.float64)
    np.testing.assert_allclose(got, attention64(q, kv, pos, window, scale, g), rtol=1e-5, atol=1e-6)


# -- kernel source text on the CPU emulator -------------------------------------------------


@emulator
@pytest.mark.parametrize("geometry", ["ggml", "1x1", "4x2", "2x4", "4x4", "8x1", "2x2x2", "1x4x3", "4x2x2", "4x4x2", "3x2"])
@pytest.mark.parametrize("kind", ["q4_K", "q6_K"])
def test_every_matvec_geometry_gives_ggml_bits(kind, geometry):
    """NR0 rows per SIMD group and NSG groups per threadgroup change the launch, not the bits."""
    w, y = qrows(37, 768, kind), arr(3, 768)
    fn = K.mul_mv_q4_K if kind == "q4_K" else K.mul_mv_q6_K
    assert_bits_equal(emulate_recorded(fn, y, w, geometry=geometry), mul_mv.ORACLES[kind](y, w))


@emulator
@pytest.mark.parametrize("geometry", ["2x2x1x1", "1x4x3x1", "4x2x2x1", "2x2x1x2", "1x2x2x3", "3x2x1x1"])
@pytest.mark.parametrize("k", [768, 3328, 4864])
@pytest.mark.parametrize("kind", ["q4_K", "q6_K"])
def test_loads_issued_a_round_early_give_ggml_bits(kind, k, geometry):
    """P > 0 (each round's loads issued P rounds before it is computed): rows of 3, 13
    and 19 blocks, so lanes end on either set of registers, after one round or several, and
    Q4_K's fourth lane column has no block at K = 768."""
    w, y = qrows(13, k, kind), arr(2, k)
    fn = K.mul_mv_q4_K if kind == "q4_K" else K.mul_mv_q6_K
    assert_bits_equal(emulate_recorded(fn, y, w, geometry=geometry), mul_mv.ORACLES[kind](y, w))


@emulator
@pytest.mark.parametrize("geometry", ["ggml", "4x2", "2x2x2", "2x2x1x1", "3x2", "3x2x1x1"])
def test_multi_kernel(geometry):
    y = arr(2, 512)
    ws = [(qrows(36, 512, "q4_K"), "q4_K"), (qrows(8, 512, "q4_K"), "q4_K"), (qrows(5, 512, "q6_K"), "q6_K"),
          (qrows(36, 512, "q4_K"), "q4_K")]
    want = mx.concatenate([mul_mv.ORACLES[k](y, w) for w, k in ws], axis=-1)
    assert_bits_equal(emulate_recorded(K.mul_mv_multi, y, ws, geometry=geometry), want)
    assert_bits_equal(emulate_recorded(K.mul_mv_multi, y, ws[:2], geometry=geometry), want[:, :44])


def test_absent_matrix_slots_do_not_repeat_a_matrix():
    """A multi kernel's unused slots hold a 16-byte placeholder, not copies of a matrix: MLX's
    CUDA backend adds every input's size to its graph's, and commits a graph per 1,000 MB."""
    y, a, b = arr(1, 512), qrows(64, 512, "q4_K"), qrows(64, 512, "q4_K")
    calls = [lambda: K.mul_mv_multi(y, [(a, "q4_K")], which="record"),
             lambda: K.mul_mv_q8(y, [(a, "q4_K")], which="record"),
             lambda: K.mul_mv_q8(y, [(a, "q4_K"), (b, "q4_K")], glu="silu", which="record")]
    for given, call in zip([[a], [a], [a, b]], calls):
        call()
        inputs = Kernel.recorded.pop()["inputs"]
        Kernel.recorded.clear()
        mats = inputs[:4]
        assert sum(m is w for m in mats for w in given) == len(given), "a given matrix is missing or repeated"
        assert all(m.nbytes <= 16 for m in mats if not any(m is w for w in given))
        assert sum(m.nbytes for m in inputs) <= sum(w.nbytes for w in given) + 64 + 4 * y.size + 4 * y.size


@emulator
@pytest.mark.parametrize("geometry", ["2x2", "4x2x2", "2x2x1x1", "4x2"])
@pytest.mark.parametrize("kind,act", [("q4_K", "silu"), ("q6_K", "silu"), ("q4_K", "gelu_tanh")])
def test_glu_kernel(kind, act, geometry):
    g, u, y = qrows(37, 768, kind), qrows(37, 768, kind), arr(2, 768, scale=0.2)
    gs, us = mul_mv.ORACLES[kind](y, g), mul_mv.ORACLES[kind](y, u)
    want = ffn.silu_oracle(gs, us, exp=libm("expf")) if act == "silu" else ffn.gelu_oracle(gs, us, tanh=libm("tanhf"))
    assert_bits_equal(emulate_recorded(K.mul_mv_glu, y, g, u, kind, act, geometry=geometry), want)


@emulator
@pytest.mark.parametrize("geometry", ["ggml", "2x4x1x2", "4x4x2", "1x4x3x1", "2x2x1x3"])
@pytest.mark.parametrize("rows,k", [(13, 768), (37, 3328), (5, 256)])
def test_split_Q6_K_kernel_gives_the_raw_rows_bits(rows, k, geometry):
    """The split form (aligned loads: quants.split_q6_K) changes what a lane loads, not the
    words: the raw rows' oracle bits, at ggml's geometry, CUDA's tuned ffn_down (P = 2) and head
    geometries, and rows of 3, 13 and 1 blocks; random blocks reach every int8 scale."""
    from muse_mlx.quants import split_q6_K
    from muse_mlx.synthetic import random_blocks

    for w in (qrows(rows, k, "q6_K"), mx.array(random_blocks(rows, k, T.Q6_K, np.random.default_rng(rows)))):
        y = arr(2, k)
        want = mul_mv.mul_mv_q6_K_oracle(y, w)
        assert_bits_equal(emulate_recorded(K.mul_mv_q6_K, y, split_q6_K(w), geometry=geometry, split=True), want)
        assert_bits_equal(emulate_recorded(K.mul_mv_q6_K, y, split_q6_K(w), geometry=geometry, split=True,
                                           head=True), want)


@emulator
@pytest.mark.parametrize("geometry", ["ggml", "2x2x1x1", "4x2x2"])
def test_multi_and_glu_kernels_on_split_Q6_K(geometry):
    """A split Q6_K slot beside Q4_K and raw Q6_K ones, and a split Q6_K GLU: the raw rows' bits."""
    from muse_mlx.quants import split_q6_K

    y = arr(2, 512)
    a, b, c = qrows(36, 512, "q4_K"), qrows(5, 512, "q6_K"), qrows(11, 512, "q6_K")
    want = mx.concatenate([mul_mv.ORACLES["q4_K"](y, a), mul_mv.ORACLES["q6_K"](y, b),
                           mul_mv.ORACLES["q6_K"](y, c)], axis=-1)
    ws = [(a, "q4_K"), (split_q6_K(b), "q6_K_split"), (c, "q6_K")]
    assert_bits_equal(emulate_recorded(K.mul_mv_multi, y, ws, geometry=geometry), want)
    g, u = qrows(37, 512, "q6_K"), qrows(37, 512, "q6_K")
    want = ffn.silu_oracle(mul_mv.ORACLES["q6_K"](y, g), mul_mv.ORACLES["q6_K"](y, u), exp=libm("expf"))
    got = emulate_recorded(K.mul_mv_glu, y, split_q6_K(g), split_q6_K(u), "q6_K_split", "silu", geometry=geometry)
    assert_bits_equal(got, want)


@emulator
def test_dequantize_kernels():
    """f32: gguf-py's bits; f16: those values rounded to nearest (numpy's float32 -> float16)."""
    for kind, shape in (("q4_K", (3, 512)), ("q6_K", (3, 512)), ("q4_K", (5, 256)), ("q6_K", (3, 256))):
        w = qrows(*shape, kind)  # 5 x 256: a SIMD group whose last quads lie past the end
        want = gguf_dequantize(np.array(w), QTYPE[kind]).reshape(shape)
        assert_bits_equal(emulate_recorded(K.dequantize_rows, w, kind), want)
        half = emulate_recorded(K.dequantize_rows, w, kind, mx.float16)
        assert np.array(half).dtype == np.float16
        assert_bits_equal(half, want.astype(np.float16))
        if kind == "q6_K":  # the split form: the same values (the half d read from after the bodies)
            from muse_mlx.quants import split_q6_K

            assert_bits_equal(emulate_recorded(K.dequantize_rows, split_q6_K(w), "q6_K_split"), want)
            assert_bits_equal(emulate_recorded(K.dequantize_rows, split_q6_K(w), "q6_K_split", mx.float16),
                              want.astype(np.float16))
            with pytest.raises(ValueError, match="raw Q4_K/Q6_K rows, not 'q6_K_split'"):
                K.embed_rows(split_q6_K(w), mx.array([0]), "q6_K_split")
    # Q4_K rows in tiles (the q8 GLU's opt-in form): the raw rows' values, in the raw rows' order;
    # 24 rows of 3 blocks in tiles of 8 and 4, and of 1 block (where the tiles are the raw rows)
    from muse_mlx.quants import tile_q4_K_rows

    for shape, tile in (((24, 768), 8), ((24, 768), 4), ((16, 256), 8)):
        w = qrows(*shape, "q4_K")
        want = gguf_dequantize(np.array(w), T.Q4_K).reshape(shape)
        tiled = tile_q4_K_rows(w, tile)
        assert_bits_equal(emulate_recorded(K.dequantize_rows, tiled, "q4_K", tile=tile), want)
        assert_bits_equal(emulate_recorded(K.dequantize_rows, tiled, "q4_K", mx.float16, tile=tile),
                          want.astype(np.float16))
    with pytest.raises(ValueError, match="rows in tiles are Q4_K rows, not 'q6_K'"):
        K.dequantize_rows(qrows(8, 256, "q6_K"), "q6_K", tile=4)


@emulator
@pytest.mark.parametrize("kind", ["q4_K", "q6_K"])
def test_embedding_kernel_is_gguf_py_of_the_rows(kind):
    """Gather and dequantization in one dispatch: rows in token order, repeats included; an id
    outside the table (past it, or negative) gives a row of NaN, on the kernel and the CPU path
    alike, and leaves the other tokens' rows as they are."""
    w = qrows(37, 512, kind)
    table = gguf_dequantize(np.array(w), QTYPE[kind]).reshape(37, 512)
    tokens = mx.array([[3, 0, 36], [3, 17, 5]], dtype=mx.int32)
    got = emulate_recorded(K.embed_rows, w, tokens, kind)
    assert got.shape == (2, 3, 512)
    assert_bits_equal(got, table[np.array(tokens)])
    for bad in (mx.array([5, 37, -1, 40], dtype=mx.int32), mx.array([5, 37, -1, 2**32 + 3], dtype=mx.int64)):
        for out in (emulate_recorded(K.embed_rows, w, bad, kind), K.embed_rows(w, bad, kind, which="cpu")):
            out = np.array(out)
            assert_bits_equal(out[0], table[5])
            assert np.isnan(out[1:]).all()  # (2**32 + 3 as int32 would be row 3)


@emulator
@pytest.mark.parametrize("h,hkv,d,cap,window,pos", ATTN_CASES)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("fused", [None, False])
def test_decode_attention_kernels(h, hkv, d, cap, window, pos, gated, fused):
    """Both forms, one dispatch (the default where the cache fits it) and two, give the oracle's bits."""
    if fused is False and not attention.fused_fits(cap, d):
        pytest.skip("the default is already the two-dispatch form")
    q, kv, g = _attn_inputs(h, hkv, d, cap, gated)
    scale = d ** -0.5
    pos_arr, geom = mx.array([pos], dtype=mx.int32), attention.decode_geometry(cap, window)
    Kernel.recorded.clear()
    K.attn_decode(q, kv, pos_arr, geom, scale, g, fused=fused, which="record")
    launched = [c["kernel"].name for c in Kernel.recorded]
    one = fused is None and attention.one_dispatch(cap, d)
    assert launched == (["attn_decode_fused"] if one else ["attn_decode_partial", "attn_decode_combine"])
    got = emulate_recorded(K.attn_decode, q, kv, pos_arr, geom, scale, g, fused=fused)
    assert_bits_equal(got, attention.attn_decode_oracle(q, kv, pos, window, scale, g, exp=libm("expf")))


def test_the_one_dispatch_attention_refuses_what_it_cannot_hold():
    q, kv, _ = _attn_inputs(4, 2, 32, 2048, False)
    with pytest.raises(ValueError, match="at most 1024 cache positions"):
        K.attn_decode(q, kv, mx.array([5], dtype=mx.int32), attention.decode_geometry(2048, 0), 0.1, fused=True,
                      which="record")
    assert attention.fused_fits(1024, 128) and not attention.fused_fits(1025, 128)
    assert not attention.fused_fits(256, 256) and not attention.fused_fits(256, 96)


def test_the_attention_form_switch(monkeypatch):
    """MUSE_MLX_ATTN=two puts the partial pass and the combine back (for timing them against the
    one-dispatch form); anything else is an error that names the variable."""
    q, kv, _ = _attn_inputs(4, 2, 32, 256, False)
    args = (q, kv, mx.array([5], dtype=mx.int32), attention.decode_geometry(256, 0), 0.1)
    for mode, want in (("auto", ["attn_decode_fused"]), ("apart", ["attn_decode_fused"]),
                       ("two", ["attn_decode_partial", "attn_decode_combine"])):
        monkeypatch.setenv("MUSE_MLX_ATTN", mode)
        Kernel.recorded.clear()
        K.attn_decode(*args, which="record")
        assert [c["kernel"].name for c in Kernel.recorded] == want
    monkeypatch.setenv("MUSE_MLX_ATTN", "one")
    with pytest.raises(ValueError, match="MUSE_MLX_ATTN='one'"):
        K.attn_decode(*args, which="record")


@emulator
@pytest.mark.parametrize("threads", [64, 128, 256, 512])
@pytest.mark.parametrize("h,hkv,d,cap,window,pos", [(16, 1, 128, 384, 0, 383), (8, 2, 64, 512, 0, 300)])
def test_partial_pass_threads_change_no_bits(threads, h, hkv, d, cap, window, pos, monkeypatch):
    """The partial pass at other thread counts (MUSE_MLX_ATTN_PARTIAL_THREADS): fewer threads than
    dimensions (each takes several, every head), or more (the heads cut into slices): the oracle's bits."""
    monkeypatch.setenv("MUSE_MLX_ATTN_PARTIAL_THREADS", str(threads))
    q, kv, g = _attn_inputs(h, hkv, d, cap, True)
    pos_arr, geom = mx.array([pos], dtype=mx.int32), attention.decode_geometry(cap, window)
    Kernel.recorded.clear()
    K.attn_decode(q, kv, pos_arr, geom, d ** -0.5, g, fused=False, which="record")
    call = Kernel.recorded[0]
    assert call["threadgroup"] == (threads, 1, 1)
    assert dict(call["template"])["HS"] == attention.head_slices(h // hkv, d, threads)
    got = emulate_recorded(K.attn_decode, q, kv, pos_arr, geom, d ** -0.5, g, fused=False)
    assert_bits_equal(got, attention.attn_decode_oracle(q, kv, pos, window, d ** -0.5, g, exp=libm("expf")))


@emulator
@pytest.mark.parametrize("splits", [1, 7, 64, 256])
@pytest.mark.parametrize("h,hkv,d,cap,window,pos", [(2, 1, 32, 16384, 0, 9000), (4, 2, 32, 2048, 0, 1500)])
def test_combine_load_rounds_change_no_bits(splits, h, hkv, d, cap, window, pos, monkeypatch):
    """The combine loading its splits' outputs in rounds of other sizes (MUSE_MLX_ATTN_COMBINE_SPLITS;
    282 and 47 splits hold keys here): the oracle's bits."""
    monkeypatch.setenv("MUSE_MLX_ATTN_COMBINE_SPLITS", str(splits))
    q, kv, g = _attn_inputs(h, hkv, d, cap, True)
    pos_arr, geom = mx.array([pos], dtype=mx.int32), attention.decode_geometry(cap, window)
    Kernel.recorded.clear()
    K.attn_decode(q, kv, pos_arr, geom, d ** -0.5, g, fused=False, which="record")
    assert dict(Kernel.recorded[1]["template"])["CB"] == splits
    got = emulate_recorded(K.attn_decode, q, kv, pos_arr, geom, d ** -0.5, g, fused=False)
    assert_bits_equal(got, attention.attn_decode_oracle(q, kv, pos, window, d ** -0.5, g, exp=libm("expf")))


def test_partial_pass_thread_count_is_checked(monkeypatch):
    assert attention.head_slices(16, 128, 256) == 2 and attention.head_slices(16, 128, 64) == 1
    assert attention.head_slices(6, 64, 256) == 3 and attention.head_slices(5, 32, 256) == 5
    monkeypatch.setenv("MUSE_MLX_ATTN_PARTIAL_THREADS", "100")
    with pytest.raises(ValueError, match="MUSE_MLX_ATTN_PARTIAL_THREADS='100'"):
        attention.partial_threads("cuda")
    monkeypatch.delenv("MUSE_MLX_ATTN_PARTIAL_THREADS")
    assert attention.partial_threads("cuda") == 256 and attention.partial_threads("metal") == 128
    monkeypatch.setenv("MUSE_MLX_ATTN_COMBINE_SPLITS", "0")
    with pytest.raises(ValueError, match="MUSE_MLX_ATTN_COMBINE_SPLITS='0'"):
        attention.combine_splits()


@emulator
def test_per_row_norm_kernel():
    x, w = arr(6, 128), arr(6, 128)
    assert_bits_equal(emulate_recorded(K.rms_norm_mul, x, w, 1e-6), rms_norm.rms_norm_mul_oracle(x, w, 1e-6, None, 32))


# -- the opt-in int8-activation matvec (flag mv_q8) -----------------------------------------


def test_q8_matvec_oracle_error_is_the_activation_quantization():
    """Not exact by design: each activation moves by at most half its group's step d = max|y|/127,
    so row r is off by at most sum_k |W[r, k]| * d(k) / 2, plus float32 rounding (bounded here
    generously by 1e-5 * sum_k |y_k W[r, k]|)."""
    w, y = qrows(37, 768, "q4_K"), arr(2, 768)
    W = gguf_dequantize(np.array(w), T.Q4_K).reshape(37, 768).astype(np.float64)
    y64 = np.array(y, np.float64)
    ref = y64 @ W.T
    got = np.array(mul_mv.mul_mv_q4_K_q8_oracle(y, w), np.float64)
    half_step = np.repeat(np.abs(y64).reshape(2, -1, 32).max(axis=-1) / 127.0 / 2, 32, axis=-1)
    rounding = 1e-5 * (np.abs(y64) @ np.abs(W).T)
    assert np.all(np.abs(got - ref) <= half_step @ np.abs(W).T + rounding)
    # and clearly not the exact kernel, whose float32 error here is ~1e-7 of the largest output
    assert np.abs(got - ref).max() > 1e-3 * np.abs(ref).max()


def test_q6_K_q8_oracle_is_the_quantized_activations_product():
    """The split Q6_K q8 oracle (flag mv_q8_q6k) computes the float64 product of the int8-rounded
    activations (q * d) with gguf-py's dequantized rows, to float32 rounding (its integer dots are
    exact; 1e-6 of sum |terms| bounds its ~100 roundings generously); and, like the Q4_K one, it is
    off the exact product by no more than the activation rounding allows."""
    from muse_mlx.quants import split_q6_K

    raw, y = qrows(29, 768, "q6_K"), arr(3, 768)
    W = gguf_dequantize(np.array(raw), T.Q6_K).reshape(29, 768).astype(np.float64)
    q, d, _ = mul_mv.quantize_q8(y)
    yq = (np.array(q) * np.array(d, np.float64)[..., None]).reshape(3, 768)
    got = np.array(mul_mv.mul_mv_q6_K_q8_oracle(y, split_q6_K(raw), 4), np.float64)
    assert np.all(np.abs(got - yq @ W.T) <= 1e-6 * (np.abs(yq) @ np.abs(W).T))
    y64 = np.array(y, np.float64)
    half_step = np.repeat(np.abs(y64).reshape(3, -1, 32).max(axis=-1) / 127.0 / 2, 32, axis=-1)
    assert np.all(np.abs(got - y64 @ W.T) <= half_step @ np.abs(W).T + 1e-5 * (np.abs(y64) @ np.abs(W).T))


def test_q8_quantization_rounds_half_away_from_zero():
    y = mx.array(np.array([[127.0, 63.5, -63.5, 0.5 * 127 / 127, -1.0] + [0.0] * 27], F32))
    q, d, s = mul_mv.quantize_q8(y)
    assert float(d[0, 0]) == 1.0
    assert np.array(q)[0, 0, :5].tolist() == [127, 64, -64, 1, -1] and int(s[0, 0]) == 127


def test_q8_oracle_lanes_change_only_the_order():
    """Fewer lanes per row add the same sub-block terms in another order: within float32 rounding
    of the 32-lane oracle, and (a different order) not always the same bits."""
    w, y = qrows(64, 2048, "q4_K"), arr(1, 2048)
    ref = np.array(mul_mv.mul_mv_q4_K_q8_oracle(y, w), np.float64)
    for lanes in (4, 8, 16):
        got = np.array(mul_mv.mul_mv_q4_K_q8_oracle(y, w, lanes), np.float64)
        assert np.allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        assert (got != ref).any()


def test_q8_rows_layout_is_the_quantization():
    """quantize_q8_rows's words and pairs hold quantize_q8's q, d and sum q."""
    y = arr(3, 256)
    qy, ds = mul_mv.quantize_q8_rows(y, which="cpu")
    q, d, s = mul_mv.quantize_q8(y)
    assert np.array_equal(np.array(qy).view(np.int8).reshape(3, 8, 32), np.array(q).astype(np.int8))
    pairs = np.array(ds).reshape(3, 8, 2)
    assert_bits_equal(pairs[..., 0], np.array(d))
    assert_bits_equal(pairs[..., 1], np.array(s, F32))


@emulator
@pytest.mark.parametrize("rows,k,t", [(37, 768, 2), (16, 256, 1)])
def test_q8_kernel(rows, k, t, monkeypatch):
    """A mix with Q6_K: the kernel that quantizes per threadgroup (32 lanes per row)."""
    y = arr(t, k)
    a, b, c = qrows(rows, k, "q4_K"), qrows(8, k, "q6_K"), qrows(rows, k, "q4_K")
    got = emulate_recorded(K.mul_mv_q8, y, [(a, "q4_K"), (b, "q6_K"), (c, "q4_K")])
    want = mx.concatenate([mul_mv.mul_mv_q4_K_q8_oracle(y, a), mul_mv.ORACLES["q6_K"](y, b),
                           mul_mv.mul_mv_q4_K_q8_oracle(y, c)], axis=-1)
    assert_bits_equal(got, want)
    assert_bits_equal(emulate_recorded(K.mul_mv_q8, y, [(a, "q4_K"), (c, "q4_K")]),  # all Q4_K, not a GLU
                      mx.concatenate([mul_mv.mul_mv_q4_K_q8_oracle(y, a), mul_mv.mul_mv_q4_K_q8_oracle(y, c)], -1))
    monkeypatch.setenv("MUSE_MLX_Q8_PRE", "0")  # the GLU through the same kernel
    glu = emulate_recorded(K.mul_mv_q8, y, [(a, "q4_K"), (c, "q4_K")], glu="silu")
    assert_bits_equal(glu, ffn.silu_oracle(mul_mv.mul_mv_q4_K_q8_oracle(y, a), mul_mv.mul_mv_q4_K_q8_oracle(y, c),
                                           exp=libm("expf")))


@emulator
@pytest.mark.parametrize("geometry", ["2x4x4x1", "1x4x8x2", "4x2x32x3"])
def test_q8_pre_kernel_on_split_Q6_K(geometry, monkeypatch):
    """mul_mv_q8_pre's split Q6_K lanes (flag mv_q8_q6k), bit for bit against their oracle at the
    geometry's lanes per row: a Q6_K matrix alone (3 blocks a row, rows not a whole number of
    SIMD groups, two tokens), and beside Q4_K ones in one call (the q|k|v|gate shape)."""
    from muse_mlx.quants import split_q6_K

    monkeypatch.setenv("MUSE_MLX_Q8_PRE_GEOMETRY", geometry)
    lanes = int(geometry.split("x")[2])
    y = arr(2, 768)
    v, a, c = split_q6_K(qrows(21, 768, "q6_K")), qrows(37, 768, "q4_K"), qrows(8, 768, "q4_K")
    assert_bits_equal(emulate_recorded(K.mul_mv_q8, y, [(v, "q6_K_split")]), mul_mv.mul_mv_q6_K_q8_oracle(y, v, lanes))
    got = emulate_recorded(K.mul_mv_q8, y, [(a, "q4_K"), (c, "q4_K"), (v, "q6_K_split"), (a, "q4_K")])
    want = [mul_mv.mul_mv_q4_K_q8_oracle(y, a, lanes), mul_mv.mul_mv_q4_K_q8_oracle(y, c, lanes),
            mul_mv.mul_mv_q6_K_q8_oracle(y, v, lanes), mul_mv.mul_mv_q4_K_q8_oracle(y, a, lanes)]
    assert_bits_equal(got, mx.concatenate(want, axis=-1))


@emulator
@pytest.mark.parametrize("geometry", ["2x4x4x1", "2x8x8x2", "1x4x4x1"])
def test_q8_glu_writes_its_output_quantized(geometry, monkeypatch):
    """mul_mv_q8_pre_q8out (flag mv_q8_q6k, MUSE_MLX_Q8_GLU_OUT=1): the GLU's output, bit for bit
    the plain kernel's, and that output quantized as quantize_q8 quantizes it (two tokens; 128 rows,
    two whole threadgroups of 64 rows at two geometries, four of 32 at the third). With rows that
    are not whole threadgroups, or threadgroups not of whole groups of 32 (1x4x8: 16 rows), it gives
    no q8 (the next call quantizes)."""
    monkeypatch.setenv("MUSE_MLX_Q8_PRE_GEOMETRY", geometry)
    y = arr(2, 512)
    y[1] = y[1] * 1e15  # the second token's outputs near 1e30
    a, c = qrows(128, 512, "q4_K"), qrows(128, 512, "q4_K")  # two threadgroups a token
    c[32:64] = 0  # zero blocks: a group of 32 outputs all zero (d = 0, every q 0)
    mats = [(a, "q4_K"), (c, "q4_K")]
    out, (qy, ds) = emulate_recorded(K.mul_mv_q8, y, mats, glu="silu", q8_out=True)
    assert_bits_equal(out, emulate_recorded(K.mul_mv_q8, y, mats, glu="silu"))
    want_qy, want_ds = mul_mv.quantize_q8_rows(out, which="cpu")
    assert np.array_equal(np.array(qy), np.array(want_qy))
    assert_bits_equal(ds, want_ds)
    odd = [(qrows(40, 512, "q4_K"), "q4_K"), (qrows(40, 512, "q4_K"), "q4_K")]
    assert emulate_recorded(K.mul_mv_q8, y, odd, glu="silu", q8_out=True)[1] is None
    monkeypatch.setenv("MUSE_MLX_Q8_PRE_GEOMETRY", "1x4x8")
    assert emulate_recorded(K.mul_mv_q8, y, mats, glu="silu", q8_out=True)[1] is None
    with pytest.raises(ValueError, match="q8_out is for the q8 GLU"):
        K.mul_mv_q8(y, mats[:1], q8_out=True, which="cpu")


@emulator
@pytest.mark.parametrize("geometry,tile", [("2x4x4x1", 16), ("2x4x4x1", 64), ("2x4x4x1", 128), ("2x2x4x1", 8),
                                           ("4x4x32x1", 4)])
def test_q8_rows_in_tiles_are_the_q8_rows(geometry, tile, monkeypatch):
    """The q8 Q4_K lanes over rows in tiles (quants.tile_q4_K_rows, TILE): the GLU with its q8
    output and an all-Q4_K call of two matrices, bit for bit what the same
    kernels give on the raw rows (the same blocks, read where they lie), two tokens; a tile that
    is not a SIMD group's rows (16 rows at 2x2x4 take two SIMD groups' 8) too."""
    from muse_mlx.quants import tile_q4_K_rows

    monkeypatch.setenv("MUSE_MLX_Q8_PRE_GEOMETRY", geometry)
    monkeypatch.setenv("MUSE_MLX_Q8_PRE_GEOMETRY_FEW", geometry)
    k = 768  # 3 blocks: an odd number of rounds at 4 lanes a row
    y = arr(2, k)
    gate, up = qrows(128, k, "q4_K"), qrows(128, k, "q4_K")
    q8 = mul_mv.quantize_q8_rows(y, which="cpu")
    plain, plain_q8 = emulate_recorded(K.mul_mv_q8, y, [(gate, "q4_K"), (up, "q4_K")], glu="silu", q8_out=True,
                                       q8=q8)
    plain_two = emulate_recorded(K.mul_mv_q8, y, [(gate, "q4_K"), (up[:64], "q4_K")], q8=q8)
    tiled = [(tile_q4_K_rows(w, tile), "q4_K") for w in (gate, up)]
    out, out_q8 = emulate_recorded(K.mul_mv_q8, y, tiled, glu="silu", q8_out=True, q8=q8, tile=tile)
    assert_bits_equal(out, plain)
    # (a threadgroup of 16 rows, 4x4x32, holds no whole group of 32: then neither writes its q8)
    assert (out_q8 is None) == (plain_q8 is None) == (geometry == "4x4x32x1")
    if plain_q8 is not None:
        assert np.array_equal(np.array(out_q8[0]), np.array(plain_q8[0]))
        assert_bits_equal(out_q8[1], plain_q8[1])
    t2 = tile if 64 % tile == 0 else 64  # (a tile of all 128 rows: the call's 64-row matrix takes 64)
    two = emulate_recorded(K.mul_mv_q8, y, [(tile_q4_K_rows(gate, t2), "q4_K"), (tile_q4_K_rows(up[:64], t2), "q4_K")],
                           q8=q8, tile=t2)
    assert_bits_equal(two, plain_two)


def test_q8_rows_in_tiles_on_the_cpu_and_their_errors():
    """On the CPU the tiled rows are put back for the oracles (the same bits as the raw rows); a
    tile is refused where the lanes cannot read it, with the reason."""
    from muse_mlx.quants import split_q6_K, tile_q4_K_rows, untile_q4_K_rows

    y = arr(1, 512)
    a, b = qrows(32, 512, "q4_K"), qrows(48, 512, "q4_K")
    q8 = mul_mv.quantize_q8_rows(y, which="cpu")
    got = K.mul_mv_q8(y, [(tile_q4_K_rows(a, 16), "q4_K"), (tile_q4_K_rows(b, 16), "q4_K")], q8=q8, tile=16,
                      which="cpu")
    assert_bits_equal(got, K.mul_mv_q8(y, [(a, "q4_K"), (b, "q4_K")], q8=q8, which="cpu"))
    assert np.array_equal(np.array(untile_q4_K_rows(tile_q4_K_rows(b, 16), 16)), np.array(b))
    assert not np.array_equal(np.array(tile_q4_K_rows(b, 16)), np.array(b))  # (the bytes did move)
    with pytest.raises(ValueError, match="48 Q4_K rows are not whole tiles of 32"):
        K.mul_mv_q8(y, [(a, "q4_K"), (b, "q4_K")], q8=q8, tile=32, which="cpu")
    with pytest.raises(ValueError, match="only for a q8 call of Q4_K matrices"):
        K.mul_mv_q8(y, [(a, "q4_K"), (split_q6_K(qrows(32, 512, "q6_K")), "q6_K_split")], q8=q8, tile=16,
                    which="cpu")
    with pytest.raises(ValueError, match="at least one row"):
        tile_q4_K_rows(a, 0)


def test_q8_pre_geometry_per_call_class(monkeypatch):
    """mul_mv_q8_pre's geometry classes: the GLU, the calls of at most FEW_ROWS rows and those of
    more (the vocabulary head) take defaults of their own; MUSE_MLX_Q8_PRE_GEOMETRY overrides all
    three, MUSE_MLX_Q8_PRE_GEOMETRY_FEW / _MANY their class alone, before it. On the CPU a "many"
    call computes its oracle at that class's lanes per row, which give other bits than the GLU's."""
    from muse_mlx.quants import split_q6_K

    for name in ("MUSE_MLX_Q8_PRE_GEOMETRY", "MUSE_MLX_Q8_PRE_GEOMETRY_FEW", "MUSE_MLX_Q8_PRE_GEOMETRY_MANY"):
        monkeypatch.delenv(name, raising=False)
    assert [mul_mv.q8_call(r, g) for r, g in ((19968, True), (6656, False), (202048, False))] == ["glu", "few", "many"]
    geo = lambda call: mul_mv.q8_pre_geometry("cuda", call)  # noqa: E731
    assert geo("many") == mul_mv.Q8_PRE_MANY_GEOMETRY["cuda"] and geo("many")[2] != geo("glu")[2]
    monkeypatch.setenv("MUSE_MLX_Q8_PRE_GEOMETRY", "1x4x8")
    assert geo("glu") == geo("few") == geo("many") == (1, 4, 8, 1)
    monkeypatch.setenv("MUSE_MLX_Q8_PRE_GEOMETRY_MANY", "2x4x16x2")
    assert (geo("glu"), geo("few"), geo("many")) == ((1, 4, 8, 1), (1, 4, 8, 1), (2, 4, 16, 2))
    monkeypatch.delenv("MUSE_MLX_Q8_PRE_GEOMETRY")
    monkeypatch.delenv("MUSE_MLX_Q8_PRE_GEOMETRY_MANY")
    monkeypatch.setattr(mul_mv, "FEW_ROWS", 16)  # 40 rows: a "many" call
    y, w = arr(1, 512), split_q6_K(qrows(40, 512, "q6_K"))
    many_lanes, glu_lanes = mul_mv.q8_pre_geometry("cpu", "many")[2], mul_mv.q8_pre_geometry("cpu", "glu")[2]
    want, other = mul_mv.mul_mv_q6_K_q8_oracle(y, w, many_lanes), mul_mv.mul_mv_q6_K_q8_oracle(y, w, glu_lanes)
    assert not np.array_equal(np.array(want), np.array(other))  # the class's lanes are what is checked
    assert_bits_equal(K.mul_mv_q8(y, [(w, "q6_K_split")], which="cpu"), want)


def test_q8_calls_take_Q6_K_all_split_or_none():
    from muse_mlx.quants import split_q6_K

    raw = qrows(4, 256, "q6_K")
    with pytest.raises(ValueError, match="all split or none"):
        K.mul_mv_q8(arr(1, 256), [(raw, "q6_K"), (split_q6_K(raw), "q6_K_split")], which="cpu")


def test_q8_pre_switch_is_checked(monkeypatch):
    monkeypatch.setenv("MUSE_MLX_Q8_PRE", "sometimes")
    with pytest.raises(ValueError, match="MUSE_MLX_Q8_PRE='sometimes'"):
        K.mul_mv_q8(arr(1, 256), [(qrows(4, 256, "q4_K"), "q4_K")], which="cpu")
    monkeypatch.setenv("MUSE_MLX_Q8_PRE", "all")
    monkeypatch.setenv("MUSE_MLX_Q8_PRE_GEOMETRY", "1x4x12")
    with pytest.raises(ValueError, match="LPR 4, 8, 16 or 32"):
        K.mul_mv_q8(arr(1, 256), [(qrows(4, 256, "q4_K"), "q4_K")], which="cpu")


@emulator
def test_q8_quantize_kernel():
    y = arr(3, 768)
    y = mx.concatenate([y[:, :736], mx.zeros((3, 32))], axis=-1)  # a group of zeros: d = 0
    qy, ds = emulate_recorded(mul_mv.quantize_q8_rows, y)
    want_qy, want_ds = mul_mv.quantize_q8_rows(y, which="cpu")
    assert np.array_equal(np.array(qy), np.array(want_qy))
    assert_bits_equal(ds, want_ds)


def emulated_tail_with_form(fn, n, geometry, zeros):
    """An emulated tail that also writes a matvec's input form (its first ``zeros`` outputs zero):
    its two rows checked against the exact tail's oracle; returns (the form, output, the oracle's)."""
    from muse_mlx.kernels import norm_tail

    h, s, w1 = arr(2, n), arr(2, n, scale=7), arr(n)
    w2 = mx.concatenate([mx.zeros((zeros,)), arr(n - zeros)])
    hid, out, form = emulate_recorded(fn, h, s, w1, w2, 1e-8, 1e-5, geometry)
    want_hid, want_out = norm_tail.tail_dual_eps_oracle(h, s, w1, w2, 1e-8, 1e-5, K.norm_threads(n, geometry))
    assert_bits_equal(hid, want_hid)
    assert_bits_equal(out, want_out)
    return form, out, want_out


@emulator
@pytest.mark.parametrize("n,geometry", [(6656, "seeds"), (1152, "llama"), (1152, "seeds")])
def test_tail_with_q8_output(n, geometry):
    """The tail before the q8 GLU: the exact tail's two outputs bit for bit, and its output
    quantized as quantize_q8 quantizes it (a group of zeros among them: d = 0). 6,656 at 1,024
    threads leaves part of the second pass idle, 1,152 at 512 threads part of the only one."""
    (qy, ds), out, want_out = emulated_tail_with_form(K.tail_dual_eps_q8, n, geometry, zeros=32)
    want_qy, want_ds = mul_mv.quantize_q8_rows(want_out, which="cpu")
    assert np.array_equal(np.array(qy), np.array(want_qy))
    assert_bits_equal(ds, want_ds)
    assert float(ds[0]) == 0.0 and float(ds[2]) > 0.0
    emulated_qy, emulated_ds = emulate_recorded(mul_mv.quantize_q8_rows, out)  # the kernel it replaces
    assert np.array_equal(np.array(qy), np.array(emulated_qy))
    assert_bits_equal(ds, emulated_ds)


@emulator
@pytest.mark.parametrize("geometry", ["1x4x8", "2x2x4x2", "1x2x16x3", "2x4x32", "3x1x8x4"])
def test_q8_pre_kernel(geometry, monkeypatch):
    """The activations quantized once, then mul_mv_q4_K_q8_pre (the GLU's default; every all-Q4_K
    call with MUSE_MLX_Q8_PRE=all); its lanes per row (LPR, the third number) fix the bits, the
    other numbers only the speed. Rows not a multiple of a SIMD group's, and row lengths of 1, 3
    and 8 blocks (runs not a multiple of the lanes)."""
    monkeypatch.setenv("MUSE_MLX_Q8_PRE_GEOMETRY", geometry)
    monkeypatch.setenv("MUSE_MLX_Q8_PRE", "all")
    lanes = int(geometry.split("x")[2])
    oracle = lambda y, w: mul_mv.mul_mv_q4_K_q8_oracle(y, w, lanes)  # noqa: E731
    for rows, k, t in [(37, 768, 2), (16, 256, 1), (5, 2048, 1)]:
        y = arr(t, k)
        a, c, d = qrows(rows, k, "q4_K"), qrows(rows + 3, k, "q4_K"), qrows(rows, k, "q4_K")
        got = emulate_recorded(K.mul_mv_q8, y, [(a, "q4_K"), (c, "q4_K")])
        assert_bits_equal(got, mx.concatenate([oracle(y, a), oracle(y, c)], axis=-1))
        for mode in ("all", "glu"):  # the GLU takes it by default too
            monkeypatch.setenv("MUSE_MLX_Q8_PRE", mode)
            glu = emulate_recorded(K.mul_mv_q8, y, [(a, "q4_K"), (d, "q4_K")], glu="gelu_tanh")
            assert_bits_equal(glu, ffn.gelu_oracle(oracle(y, a), oracle(y, d), tanh=libm("tanhf")))
        monkeypatch.setenv("MUSE_MLX_Q8_PRE", "all")
        # and on the CPU the route computes that same oracle
        assert_bits_equal(K.mul_mv_q8(y, [(a, "q4_K"), (c, "q4_K")], which="cpu"), got)


@emulator
@pytest.mark.parametrize("geometry", ["2x4x4x1", "4x4x32x1"])
def test_q8_calls_handed_their_activations_quantized_take_the_pre_kernel(geometry, monkeypatch):
    """With MUSE_MLX_Q8_PRE at its default (the GLU), an all-Q4_K call that is handed its
    activations quantized (by the tail or the GLU before it, flag mv_q8_q6k) reads them through
    mul_mv_q8_pre: its lanes per row give the bits, on the emulator and on the CPU, and with
    MUSE_MLX_Q8_PRE=0 it quantizes per threadgroup as before."""
    monkeypatch.setenv("MUSE_MLX_Q8_PRE_GEOMETRY", geometry)
    lanes = int(geometry.split("x")[2])
    y = arr(1, 2048)
    a, c = qrows(40, 2048, "q4_K"), qrows(8, 2048, "q4_K")
    q8 = mul_mv.quantize_q8_rows(y, which="cpu")
    want = mx.concatenate([mul_mv.mul_mv_q4_K_q8_oracle(y, a, lanes), mul_mv.mul_mv_q4_K_q8_oracle(y, c, lanes)], -1)
    assert_bits_equal(emulate_recorded(K.mul_mv_q8, y, [(a, "q4_K"), (c, "q4_K")], q8=q8), want)
    assert_bits_equal(K.mul_mv_q8(y, [(a, "q4_K"), (c, "q4_K")], q8=q8, which="cpu"), want)
    monkeypatch.setenv("MUSE_MLX_Q8_PRE", "0")
    assert_bits_equal(K.mul_mv_q8(y, [(a, "q4_K")], q8=q8, which="cpu"), mul_mv.mul_mv_q4_K_q8_oracle(y, a))


@emulator
def test_q8_pre_kernel_at_32_lanes_is_the_per_threadgroup_kernel(monkeypatch):
    y, a, b = arr(1, 1024), qrows(40, 1024, "q4_K"), qrows(40, 1024, "q4_K")
    monkeypatch.setenv("MUSE_MLX_Q8_PRE_GEOMETRY", "2x4x32")
    monkeypatch.setenv("MUSE_MLX_Q8_PRE", "glu")
    pre = emulate_recorded(K.mul_mv_q8, y, [(a, "q4_K"), (b, "q4_K")], glu="silu")
    monkeypatch.setenv("MUSE_MLX_Q8_PRE", "0")
    assert_bits_equal(pre, emulate_recorded(K.mul_mv_q8, y, [(a, "q4_K"), (b, "q4_K")], glu="silu"))


# -- the Q4_K lanes' nibble forms and their prepared activations -------------------------------


def edge_activations(t, k, form=1):
    """Activations a lane must take exactly, ``t`` >= 2 tokens of ordinary values: every token
    holds signed zeros, subnormals and tiny normals; the last also holds huge ones (up to half the
    range of nibble form ``form``: 2^95 for forms 0 and 1, 2^71 for form 2). They get a token of
    their own because they swamp every other product of a row: a wrong order among ordinary values
    shows only in the other tokens."""
    v = np.array(arr(t, k))
    small = np.array([0.0, -0.0, 1e-45, -3e-42, 1.2e-38, -1e-30], F32)
    for row in v:
        row[RNG.choice(k, size=4 * small.size, replace=False)] = np.tile(small, 4)
    top = mul_mv.HALVES_RANGE.get(form, 2.0 ** 96) / 2
    huge = np.array([top, -top / 2, top / 1e4], F32)
    v[-1, RNG.choice(k, size=4 * huge.size, replace=False)] = np.tile(huge, 4)
    return mx.array(v)


@pytest.mark.parametrize("form", [1, 2])
def test_prepared_activations_are_scaled_values_and_run_sums(form):
    """q4_K_prepared against numpy: even values times 2^24, odd times 2^32 (form 2: 2^48, 2^56);
    each run of 8 summed from 0.0 one float32 add at a time (form 2: then times 2^24), at the
    slot its lane (iq, ir) reads as sumy[k]."""
    y = np.array(edge_activations(2, 512, form))
    prep = mul_mv.q4_K_prepared(mx.array(y), form)
    assert prep.form == form
    ys, sy = np.array(prep.ys), np.array(prep.sy)
    even, odd, sums = {1: (2.0 ** 24, 2.0 ** 32, 1.0), 2: (2.0 ** 48, 2.0 ** 56, 2.0 ** 24)}[form]
    want_ys = y * np.tile(np.array([even, odd], F32), 256)
    assert np.isfinite(want_ys).all()  # the edge values are inside the form's range
    assert_bits_equal(ys, want_ys.astype(F32))
    for t in range(2):
        for block in range(2):
            for iq in range(2):
                for ir in range(4):
                    for k in range(4):
                        start = 256 * block + 64 * iq + 8 * ir + 32 * (k % 2) + 128 * (k // 2)
                        run = F32(0.0)
                        for v in y[t, start:start + 8]:
                            run = F32(run + v)
                        run = F32(run * F32(sums))
                        got = sy[t, 32 * block + 4 * (4 * iq + ir) + k]
                        assert got.view(np.uint32) == run.view(np.uint32), (t, block, iq, ir, k)
    with pytest.raises(ValueError, match="blocks of 256"):
        mul_mv.q4_K_prepared(mx.zeros((1, 320)), form)
    with pytest.raises(ValueError, match="nibble forms 1 and 2, not 0"):
        mul_mv.q4_K_prepared(mx.zeros((1, 256)), 0)


@emulator
@pytest.mark.parametrize("halves", ["0", "1", "2"])
@pytest.mark.parametrize("geometry", ["ggml", "2x2x1x1", "1x4x3x1"])
def test_every_nibble_form_gives_ggml_bits(halves, geometry, monkeypatch):
    """q4K_block's three forms (the 2^23 pattern, the CPU's; two nibbles as subnormal halves
    against activations scaled by 2^24/2^32; and those with the scales and mins as subnormal halves
    too, against 2^48/2^56) on activations with zeros, subnormals and values up to half the form's
    range: the oracle's bits, single, multi and GLU."""
    monkeypatch.setenv("MUSE_MLX_Q4K_HALVES", halves)
    y, w = edge_activations(2, 1280, int(halves)), qrows(19, 1280, "q4_K")
    assert_bits_equal(emulate_recorded(K.mul_mv_q4_K, y, w, geometry=geometry), mul_mv.mul_mv_q4_K_oracle(y, w))
    ws = [(w, "q4_K"), (qrows(5, 1280, "q6_K"), "q6_K")]
    want = mx.concatenate([mul_mv.ORACLES[k](y, m) for m, k in ws], axis=-1)
    assert_bits_equal(emulate_recorded(K.mul_mv_multi, y, ws, geometry=geometry), want)
    u = qrows(19, 1280, "q4_K")
    want = ffn.silu_oracle(mul_mv.mul_mv_q4_K_oracle(y, w), mul_mv.mul_mv_q4_K_oracle(y, u), exp=libm("expf"))
    assert_bits_equal(emulate_recorded(K.mul_mv_glu, y, w, u, "q4_K", "silu", geometry=geometry), want)


@emulator
@pytest.mark.parametrize("form", [1, 2])
def test_halves_forms_overflow_past_their_range(form, monkeypatch):
    """The halves forms' documented limits: past |y| = 2^96 (form 1; 2^72, form 2) an odd value
    times 2^32 (2^56) is inf, so a row that ggml computes finite comes out non-finite (the 2^23
    form has no such limit); just inside it, the oracle's bits."""
    limit = mul_mv.HALVES_RANGE[form]
    w = qrows(4, 256, "q4_K")
    monkeypatch.setenv("MUSE_MLX_Q4K_HALVES", str(form))
    y = np.array(arr(1, 256))
    y[0, 1] = limit * (1 - 2.0 ** -24)  # the largest float below the limit
    assert_bits_equal(emulate_recorded(K.mul_mv_q4_K, mx.array(y), w), mul_mv.mul_mv_q4_K_oracle(mx.array(y), w))
    y[0, 1] = limit * 2
    y = mx.array(y)
    want = np.array(mul_mv.mul_mv_q4_K_oracle(y, w))
    assert np.isfinite(want).all()
    assert not np.isfinite(np.array(emulate_recorded(K.mul_mv_q4_K, y, w))).all()
    monkeypatch.setenv("MUSE_MLX_Q4K_HALVES", "0")
    assert_bits_equal(emulate_recorded(K.mul_mv_q4_K, y, w), want)


@emulator
@pytest.mark.parametrize("form", [1, 2])
@pytest.mark.parametrize("geometry", ["2x2x1x1", "4x2x2", "1x2x2x3"])
def test_prepared_activations_give_ggml_bits(form, geometry, monkeypatch):
    """prep= (the activations scaled and their run sums given, not computed by the lanes): the
    multi kernel's Q4_K rows (its Q6_K rows read y) and the GLU, at rows of 3 and 5 blocks, for
    both halves forms."""
    monkeypatch.setenv("MUSE_MLX_Q4K_HALVES", str(form))
    for k in (768, 1280):
        y = edge_activations(2, k, form)
        prep = mul_mv.q4_K_prepared(y, form)
        ws = [(qrows(13, k, "q4_K"), "q4_K"), (qrows(4, k, "q6_K"), "q6_K"), (qrows(6, k, "q4_K"), "q4_K")]
        want = mx.concatenate([mul_mv.ORACLES[kd](y, m) for m, kd in ws], axis=-1)
        assert_bits_equal(emulate_recorded(K.mul_mv_multi, y, ws, geometry=geometry, prep=prep), want)
        g, u = qrows(13, k, "q4_K"), qrows(13, k, "q4_K")
        want = ffn.gelu_oracle(mul_mv.mul_mv_q4_K_oracle(y, g), mul_mv.mul_mv_q4_K_oracle(y, u), tanh=libm("tanhf"))
        assert_bits_equal(emulate_recorded(K.mul_mv_glu, y, g, u, "q4_K", "gelu_tanh", geometry=geometry, prep=prep),
                          want)


@emulator
@pytest.mark.parametrize("stages", ["2", "3", "4"])
@pytest.mark.parametrize("form", [0, 2])
def test_staged_q4_K_loads_give_ggml_bits(stages, form, monkeypatch):
    """S > 0 (each round's weights copied into threadgroup memory S - 1 rounds ahead, the copies
    spread over the SIMD group's lanes, each lane then reading its words from there): rows of 3,
    13 and 19 blocks, so the last round holds one to four blocks and the slots wrap at every
    point; the lone kernel, the multi kernel (whose Q6_K rows keep their P = 1 register loads) and
    the GLU, plain and prepared, with edge activations."""
    monkeypatch.setenv("MUSE_MLX_Q4K_HALVES", str(form))
    monkeypatch.setenv("MUSE_MLX_Q4K_STAGES", stages)
    for k, geometry in ((768, "2x2x1x1"), (3328, "3x2"), (4864, "1x4x1x2"), (1280, "4x2")):
        y, w = edge_activations(2, k, form), qrows(7, k, "q4_K")
        assert_bits_equal(emulate_recorded(K.mul_mv_q4_K, y, w, geometry=geometry), mul_mv.mul_mv_q4_K_oracle(y, w))
        ws = [(w, "q4_K"), (qrows(3, k, "q6_K"), "q6_K"), (qrows(5, k, "q4_K"), "q4_K")]
        want = mx.concatenate([mul_mv.ORACLES[kd](y, m) for m, kd in ws], axis=-1)
        prep = mul_mv.q4_K_prepared(y, form) if form else None
        assert_bits_equal(emulate_recorded(K.mul_mv_multi, y, ws, geometry=geometry, prep=prep), want)
        u = qrows(7, k, "q4_K")
        want = ffn.silu_oracle(mul_mv.mul_mv_q4_K_oracle(y, w), mul_mv.mul_mv_q4_K_oracle(y, u), exp=libm("expf"))
        assert_bits_equal(emulate_recorded(K.mul_mv_glu, y, w, u, "q4_K", "silu", geometry=geometry, prep=prep), want)


@emulator
@pytest.mark.parametrize("stages", ["2", "3", "4"])
def test_staged_q6_K_loads_give_ggml_bits(stages, monkeypatch):
    """The split Q6_K lanes with their quant words staged in threadgroup memory (two blocks a row a
    round) and their d's loaded P = S - 1 rounds ahead: rows of 3, 13 and 19 blocks, so the last
    round holds one block or two and the slots wrap at every point; the raw rows' oracle bits, for
    the ffn_down and the head's kind, at CUDA's tuned ffn_down geometry and two others."""
    from muse_mlx.quants import split_q6_K
    from muse_mlx.synthetic import random_blocks

    monkeypatch.setenv("MUSE_MLX_Q6K_STAGES", stages)
    for k, geometry in ((768, "2x4x1x2"), (3328, "3x2"), (4864, "1x4x1x1")):
        w = mx.array(random_blocks(7, k, T.Q6_K, np.random.default_rng(k)))
        y = arr(2, k)
        want = mul_mv.mul_mv_q6_K_oracle(y, w)
        for head in (False, True):
            got = emulate_recorded(K.mul_mv_q6_K, y, split_q6_K(w), geometry=geometry, split=True, head=head)
            assert_bits_equal(got, want)
    K.mul_mv_q6_K(y, split_q6_K(w), which="record", geometry=geometry, split=True)
    assert dict(Kernel.recorded.pop()["template"])["S"] == int(stages)
    Kernel.recorded.clear()


def test_staged_q6_K_loads_are_checked(monkeypatch):
    """Q6_K staging takes the split form (raw blocks keep their register loads) and U = 1 (elsewhere
    the default is none and an explicit request an error); the lone matrices and the head have a
    variable each."""
    tuned, head = (2, 4, 1, 2), (4, 4, 2, 0)
    assert mul_mv.q6K_stages("cuda", "q6_K", tuned, False) == 0
    assert mul_mv.q6K_stages("cuda", "q6_K head", head, True) == 0
    assert mul_mv.q6K_stages("record", "q6_K", tuned, True) == 0
    assert mul_mv.q6K_stages("cuda", "q6_K", tuned, True) == mul_mv.Q6K_STAGES["cuda"]["q6_K"]
    monkeypatch.setenv("MUSE_MLX_Q6K_STAGES", "2")
    assert mul_mv.q6K_stages("cuda", "q6_K", tuned, True) == 2
    assert mul_mv.q6K_stages("cuda", "q6_K head", head, True) == 0
    monkeypatch.setenv("MUSE_MLX_Q6K_STAGES_HEAD", "3")
    assert mul_mv.q6K_stages("cuda", "q6_K head", (4, 4, 1, 0), True) == 3
    with pytest.raises(ValueError, match="_HEAD=3: staged Q6_K loads take one block of loads a round, not U=2"):
        mul_mv.q6K_stages("cuda", "q6_K head", head, True)
    y, w = arr(1, 256), qrows(4, 256, "q6_K")
    K.mul_mv_q6_K(y, w, which="record")  # raw blocks: register loads
    assert dict(Kernel.recorded.pop()["template"])["S"] == 0
    Kernel.recorded.clear()


def test_staged_q4_K_loads_are_checked(monkeypatch):
    """Staging is per kind (a kind's own variable wins over the one for all; a recorded call, the
    emulator's, takes none unless asked, as Metal), takes 2 to 4 rounds, and only one block of loads
    a round: at U > 1 the default falls back to none and an explicit request is an error. The
    recorded launch carries S."""
    geometry, wide = (2, 2, 1, 1), (2, 2, 2, 0)
    assert [mul_mv.q4K_stages("cuda", kind, geometry) for kind in mul_mv.Q4K_KINDS] == \
        [mul_mv.Q4K_STAGES["cuda"][kind] for kind in mul_mv.Q4K_KINDS]
    assert mul_mv.q4K_stages("metal", "q4_K", geometry) == mul_mv.q4K_stages("record", "q4_K", geometry) == 0
    assert mul_mv.q4K_stages("cuda", "q4_K", wide) == 0
    monkeypatch.setenv("MUSE_MLX_Q4K_STAGES", "3")
    monkeypatch.setenv("MUSE_MLX_Q4K_STAGES_GLU", "0")
    assert [mul_mv.q4K_stages("cuda", kind, geometry) for kind in mul_mv.Q4K_KINDS] == [0, 3, 3]
    assert mul_mv.q4K_stages("cuda", "q4_K", wide) == 0
    y, w = arr(1, 256), qrows(4, 256, "q4_K")
    K.mul_mv_q4_K(y, w, which="record")
    assert dict(Kernel.recorded.pop()["template"])["S"] == 3
    K.mul_mv_q4_K(y, w, which="record", geometry="2x2x2")  # the variable for all kinds: none where it cannot
    assert dict(Kernel.recorded.pop()["template"])["S"] == 0
    monkeypatch.setenv("MUSE_MLX_Q4K_STAGES_SINGLE", "3")
    with pytest.raises(ValueError, match=r"_SINGLE=3: staged Q4_K loads take one block of loads a round, not U=2 "
                                         r"\(geometry 2x2x2x0\)"):
        K.mul_mv_q4_K(y, w, which="record", geometry="2x2x2")
    monkeypatch.delenv("MUSE_MLX_Q4K_STAGES_SINGLE")
    monkeypatch.setenv("MUSE_MLX_Q4K_STAGES", "1")
    with pytest.raises(ValueError, match="MUSE_MLX_Q4K_STAGES='1': expected 0 .* or 2, 3 or 4"):
        K.mul_mv_q4_K(y, w, which="record")
    Kernel.recorded.clear()


def test_prepared_activations_are_checked(monkeypatch):
    y, w = arr(1, 256), qrows(4, 256, "q6_K")
    with pytest.raises(ValueError, match="for Q4_K matrices"):
        K.mul_mv_glu(y, w, w, "q6_K", prep=mul_mv.q4_K_prepared(y, 1), which="record")
    monkeypatch.setenv("MUSE_MLX_Q4K_HALVES", "0")
    q = qrows(4, 256, "q4_K")
    with pytest.raises(ValueError, match="halves form"):
        K.mul_mv_multi(y, [(q, "q4_K")], prep=mul_mv.q4_K_prepared(y, 1), which="record")
    assert not mul_mv.q4K_prep("cuda", "q4_K") and not mul_mv.q4K_prep("cuda", "q4_K multi")
    for lanes, made in (("2", 1), ("1", 2)):  # every product would be off by 2^24
        monkeypatch.setenv("MUSE_MLX_Q4K_HALVES", lanes)
        with pytest.raises(ValueError, match=f"prepared for nibble form {made} given to lanes of form {lanes}"):
            K.mul_mv_glu(y, q, q, "q4_K", prep=mul_mv.q4_K_prepared(y, made), which="record")
    monkeypatch.setenv("MUSE_MLX_Q4K_HALVES", "3")
    with pytest.raises(ValueError, match="MUSE_MLX_Q4K_HALVES"):
        mul_mv.q4K_halves("cuda", "q4_K")
    with pytest.raises(ValueError, match="no Q4_K nibble form for kind 'q6_K'"):
        mul_mv.q4K_halves("cuda", "q6_K")
    monkeypatch.delenv("MUSE_MLX_Q4K_HALVES")
    # the defaults: the per-backend table (per kind where it has one), else 0
    assert [mul_mv.q4K_halves("cuda", k) for k in mul_mv.Q4K_KINDS] == [mul_mv.Q4K_HALVES["cuda"][k]
                                                                       for k in mul_mv.Q4K_KINDS]
    for which in ("metal", "cpu"):
        assert all(mul_mv.q4K_halves(which, k) == mul_mv.Q4K_HALVES.get(which, 0) for k in mul_mv.Q4K_KINDS)
    for kind in mul_mv.Q4K_KINDS:
        assert mul_mv.q4K_prep("cuda", kind) == (mul_mv.Q4K_HALVES["cuda"][kind] > 0)
        assert not mul_mv.q4K_prep("cpu", kind)
    # a kind's own switch wins over the one for all kinds; the others keep that one
    monkeypatch.setenv("MUSE_MLX_Q4K_HALVES", "1")
    monkeypatch.setenv("MUSE_MLX_Q4K_HALVES_MULTI", "2")
    assert [mul_mv.q4K_halves("metal", k) for k in mul_mv.Q4K_KINDS] == [1, 1, 2]
    monkeypatch.setenv("MUSE_MLX_Q4K_HALVES_GLU", "0")
    monkeypatch.setenv("MUSE_MLX_Q4K_HALVES_SINGLE", "2")
    assert [mul_mv.q4K_halves("cuda", k) for k in mul_mv.Q4K_KINDS] == [0, 2, 2]
    assert not mul_mv.q4K_prep("cuda", "q4_K") and mul_mv.q4K_prep("cuda", "q4_K multi")
    for name in ("MUSE_MLX_Q4K_HALVES_GLU", "MUSE_MLX_Q4K_HALVES_SINGLE", "MUSE_MLX_Q4K_HALVES_MULTI"):
        monkeypatch.delenv(name)
    assert mul_mv.q4K_prep("cuda", "q4_K") and mul_mv.q4K_prep("metal", "q4_K") and not mul_mv.q4K_prep("cpu", "q4_K")
    monkeypatch.setenv("MUSE_MLX_Q4K_PREP", "0")
    assert not mul_mv.q4K_prep("cuda", "q4_K")
    monkeypatch.setenv("MUSE_MLX_Q4K_PREP", "yes")
    with pytest.raises(ValueError, match="MUSE_MLX_Q4K_PREP"):
        mul_mv.q4K_prep("cuda", "q4_K")
    monkeypatch.setenv("MUSE_MLX_Q4K_HALVES", "1")
    with pytest.raises(ValueError, match=r"do not belong to activations \(1, 256\)"):  # another token's
        K.mul_mv_multi(y, [(q, "q4_K")], prep=mul_mv.q4_K_prepared(arr(2, 256), 1), which="record")
    Kernel.recorded.clear()


def record_one(fn, *a, **kw) -> dict:
    """The one kernel call ``fn(*a, which="record", **kw)`` makes, as Kernel.recorded holds it."""
    Kernel.recorded.clear()
    fn(*a, which="record", **kw)
    (c,) = Kernel.recorded
    Kernel.recorded.clear()
    return c


def test_glu_warps_switch_sets_launch_bounds(monkeypatch):
    """MUSE_MLX_GLU_WARPS bounds the Q4_K GLU only, as threadgroups per SM of its geometry, under a
    name of its own (MLX caches a kernel by name), with the bound in front of MLX's signature.
    Unset, the bound is the table's for the GLU's nibble form (CUDA: 16 warps in form 2 only)."""
    y, q4, q6 = arr(1, 256), qrows(8, 256, "q4_K"), qrows(8, 256, "q6_K")
    recorded = lambda *a, **kw: record_one(K.mul_mv_glu, *a, **kw)  # noqa: E731

    monkeypatch.delenv("MUSE_MLX_GLU_WARPS", raising=False)
    assert [mul_mv.glu_min_blocks("cuda", 2, form) for form in (0, 1, 2)] == [0, 0, 8]
    for table, blocks in (({"cuda": {}}, 0), ({"cuda": {1: 16}}, 8)):  # unset: the per-backend table
        monkeypatch.setattr(mul_mv, "GLU_WARPS", table)
        assert mul_mv.glu_min_blocks("cuda", 2, 1) == mul_mv.glu_min_blocks("record", 2, 1) == blocks
    monkeypatch.undo()
    for form, bounds in (("2", (64, 8)), ("1", None)):  # the GLU's form picks the default bound
        monkeypatch.setenv("MUSE_MLX_Q4K_HALVES_GLU", form)
        assert recorded(y, q4, q4, "q4_K", geometry="2x2x1x1")["bounds"] == bounds
    monkeypatch.delenv("MUSE_MLX_Q4K_HALVES_GLU")
    monkeypatch.setenv("MUSE_MLX_GLU_WARPS", "16")
    c = recorded(y, q4, q4, "q4_K", geometry="2x2x1x1")
    assert c["bounds"] == (64, 8)
    src = Kernel.recorded_source(c)
    bound = src.index("#define __global__ __location__(global) __launch_bounds__(64, 8)")
    assert bound < src.index("__global__ void custom_kernel_mul_mv_glu_f32_lb64x8(")
    assert recorded(y, q4, q4, "q4_K", geometry="2x4x1x1")["bounds"] == (128, 4)
    assert recorded(y, q6, q6, "q6_K")["bounds"] is None  # the Q6_K GLU already fits 20 warps
    assert mul_mv.glu_min_blocks("metal", 2, 2) == mul_mv.glu_min_blocks("cpu", 2, 2) == 0
    for bad in ("3", "80", "sixteen", "-2"):
        monkeypatch.setenv("MUSE_MLX_GLU_WARPS", bad)
        with pytest.raises(ValueError, match="MUSE_MLX_GLU_WARPS"):
            mul_mv.glu_min_blocks("cuda", 2, 2)
    monkeypatch.setenv("MUSE_MLX_GLU_WARPS", "0")
    c = recorded(y, q4, q4, "q4_K")
    src = Kernel.recorded_source(c)
    assert c["bounds"] is None and "#undef __global__" not in src and "custom_kernel_mul_mv_glu_f32(" in src


def test_q4K_and_multi_warps_switches_bound_their_own_kernels(monkeypatch):
    """MUSE_MLX_Q4K_WARPS bounds the lone Q4_K matvec and MUSE_MLX_MULTI_WARPS the multi kernel, each
    as threadgroups per SM of its geometry under a name of its own; neither touches the other, the
    lone Q6_K matvec or the GLU; none by default (the tables are 0 until a lease times them)."""
    y, q4, q6 = arr(1, 256), qrows(8, 256, "q4_K"), qrows(8, 256, "q6_K")
    for var in ("MUSE_MLX_Q4K_WARPS", "MUSE_MLX_MULTI_WARPS", "MUSE_MLX_GLU_WARPS", "MUSE_MLX_HEAD_WARPS"):
        monkeypatch.delenv(var, raising=False)
    lone = lambda: record_one(K.mul_mv_q4_K, y, q4, geometry="2x2x1x1")  # noqa: E731
    multi = lambda: record_one(K.mul_mv_multi, y, [(q4, "q4_K"), (q6, "q6_K")], geometry="2x2x1x1")  # noqa: E731
    assert lone()["bounds"] is None and multi()["bounds"] is None
    monkeypatch.setenv("MUSE_MLX_Q4K_WARPS", "24")
    c = lone()
    assert c["bounds"] == (64, 12) and "custom_kernel_mul_mv_q4_K_f32_lb64x12(" in Kernel.recorded_source(c)
    assert multi()["bounds"] is None and record_one(K.mul_mv_q6_K, y, q6)["bounds"] is None
    assert record_one(K.mul_mv_glu, y, q4, q4, "q4_K")["bounds"] is None
    monkeypatch.delenv("MUSE_MLX_Q4K_WARPS")
    monkeypatch.setenv("MUSE_MLX_MULTI_WARPS", "28")
    c = multi()
    assert c["bounds"] == (64, 14) and "custom_kernel_mul_mv_multi_f32_lb64x14(" in Kernel.recorded_source(c)
    assert lone()["bounds"] is None
    assert mul_mv.q4K_min_blocks("metal", 2) == mul_mv.multi_min_blocks("cpu", 2) == 0
    for var, fn in (("MUSE_MLX_Q4K_WARPS", mul_mv.q4K_min_blocks), ("MUSE_MLX_MULTI_WARPS", mul_mv.multi_min_blocks)):
        monkeypatch.setenv(var, "25")
        with pytest.raises(ValueError, match=var):
            fn("cuda", 2)


def test_head_is_bounded_at_its_tuned_geometry_only(monkeypatch):
    """The vocabulary head keeps the occupancy its tuned geometry was timed at (HEAD_WARPS, as
    launch bounds under a name of its own); any other head geometry, and the other Q6_K matrices,
    are not bounded unless MUSE_MLX_HEAD_WARPS asks; Metal and the CPU never are."""
    y, q6 = arr(1, 256), qrows(8, 256, "q6_K")

    def bounds(head, geometry="tuned"):
        c = record_one(K.mul_mv_q6_K, y, q6, head=head, geometry=geometry)
        return c["bounds"], c

    for var in ("MUSE_MLX_HEAD_WARPS", "MUSE_MLX_MV_GEOMETRY_HEAD", "MUSE_MLX_MV_GEOMETRY_Q6K"):
        monkeypatch.delenv(var, raising=False)
    tuned = mul_mv.MV_GEOMETRIES["tuned"]["cuda"]["q6_K head"]
    g = "x".join(map(str, tuned))
    nsg = tuned[1]
    threads, warps = 32 * nsg, mul_mv.HEAD_WARPS["cuda"]
    b, c = bounds(True, g)
    assert b == (threads, warps // nsg)
    assert f"custom_kernel_mul_mv_q6_K_f32_lb{threads}x{warps // nsg}(" in Kernel.recorded_source(c)
    assert mul_mv.head_min_blocks("cuda", tuned) == warps // nsg
    assert bounds(False, g)[0] is None  # the ffn_down at the same geometry: no bound
    assert bounds(True, "2x4x1x1")[0] is None  # another head geometry: none
    assert warps % nsg == 0  # the table's bound is whole threadgroups of the tuned geometry
    monkeypatch.setenv("MUSE_MLX_HEAD_WARPS", "0")  # the opt-out a trace compares against
    assert bounds(True, g)[0] is None
    monkeypatch.delenv("MUSE_MLX_HEAD_WARPS")
    monkeypatch.setattr(mul_mv, "HEAD_WARPS", {"cuda": 0})
    assert bounds(True, g)[0] is None
    monkeypatch.setenv("MUSE_MLX_HEAD_WARPS", "16")  # the variable bounds any head geometry
    assert bounds(True, "2x4x1x1")[0] == (128, 4) and bounds(False, "2x4x1x1")[0] is None
    assert mul_mv.head_min_blocks("metal", tuned) == mul_mv.head_min_blocks("cpu", tuned) == 0
    for bad in ("6", "80", "many"):
        monkeypatch.setenv("MUSE_MLX_HEAD_WARPS", bad)
        with pytest.raises(ValueError, match="MUSE_MLX_HEAD_WARPS"):
            mul_mv.head_min_blocks("cuda", tuned)


def test_a_bounded_kernel_is_built_apart(monkeypatch, tmp_path):
    """Kernel.build hands MLX a bounded CUDA variant under its own name, with the bound in its
    header, beside the unbounded kernel; Metal has no bound, so it gets the one kernel."""
    from muse_mlx.kernels.backend import expand_includes

    monkeypatch.setenv("MUSE_MLX_CUDA_SOURCE_DIR", str(tmp_path))
    made = []

    def recorder(**kw):
        made.append(kw)
        return object()

    monkeypatch.setattr(mx.fast, "cuda_kernel", recorder)
    monkeypatch.setattr(mx.fast, "metal_kernel", recorder)
    k = Kernel("mul_mv", "mul_mv_glu_f32", mul_mv._GLU.inputs, mul_mv._GLU.outputs, parts=mul_mv._GLU.parts)
    plain, bounded = k.build("cuda"), k.build("cuda", (64, 8))
    assert plain is not bounded and k.build("cuda", (64, 8)) is bounded and k.build("cuda") is plain
    assert [m["name"] for m in made] == ["mul_mv_glu_f32", "mul_mv_glu_f32_lb64x8"]
    headers = [expand_includes(m["header"]) for m in made]  # (each an #include line of its text)
    assert "__launch_bounds__(64, 8)" in headers[1] and "#undef __global__" not in headers[0]
    assert k.build("metal", (64, 8)) is k.build("metal") and len(made) == 3
    monkeypatch.setenv("MUSE_MLX_CUDA_SOURCE", "inline")  # each source form its own build (an in-process A/B)
    inline = k.build("cuda")
    assert inline is not plain and k.build("cuda") is inline and made[-1]["header"] == headers[0]


@emulator
@pytest.mark.parametrize("form", ["1", "2"])
@pytest.mark.parametrize("n,geometry", [(6656, "seeds"), (1280, "llama"), (1280, "seeds")])
def test_tail_with_q4_output(n, geometry, form, monkeypatch):
    """The tail before the exact Q4_K matvecs: its two outputs bit for bit, and its output
    prepared as q4_K_prepared prepares it for the lanes' nibble form (a run of zeros among them).
    6,656 at 1,024 threads takes two float4s per thread and leaves part of the second pass idle;
    1,280 takes one, at 320 (llama) or 512 (seeds) threads, of which 192 idle."""
    monkeypatch.setenv("MUSE_MLX_Q4K_HALVES", form)
    prep, _, want_out = emulated_tail_with_form(K.tail_dual_eps_q4, n, geometry, zeros=8)
    want = mul_mv.q4_K_prepared(want_out, int(form))
    assert prep.form == int(form)
    assert_bits_equal(prep.ys, want.ys)
    assert_bits_equal(prep.sy, want.sy)
    assert float(prep.sy[0, 0]) == 0.0 and float(prep.sy[0, 1]) != 0.0
    with pytest.raises(ValueError, match="blocks of 256"):
        K.tail_dual_eps_q4(arr(1, 320), arr(1, 320), arr(320), arr(320), 1e-8, 1e-5, which="record")


# -- Q/K-norms, RoPE and the f16 K/V in one dispatch -------------------------------------------

QK_CASES = [  # heads, kv heads, head dim, rope dims, traditional, norm, rope
    (4, 2, 128, 128, True, True, True), (4, 2, 64, 64, False, True, True), (6, 3, 64, 32, False, True, True),
    (2, 1, 128, 128, True, False, True), (4, 2, 64, 64, True, True, False),
]


@emulator
@pytest.mark.parametrize("h,hkv,d,rd,trad,norm,rope", QK_CASES)
def test_qk_rope_pack_kernel(h, hkv, d, rd, trad, norm, rope):
    """The kernel against its oracle, given the C library's sinf/cosf (what the emulated kernel calls)."""
    rows, v_off = h + hkv, (h + hkv) * d + 16  # V further along, as in the projection output
    y = arr(v_off + hkv * d + 8)
    w = arr(rows, d) if norm else None
    table = attention.rope_table(rd, 10000.0, 0.5) if rope else None
    pos = mx.array([1234], dtype=mx.int32)
    nth = rms_norm.norm_threads(d, "llama")
    kw = dict(rows=rows, hkv=hkv, d=d, rd=rd, traditional=trad, v_offset=v_off, nth=nth)
    got_qk, got_kv = emulate_recorded(K.qk_rope_pack, y, w, 1e-6, pos, table, **kw)
    want_qk, want_kv = attention.qk_rope_pack_oracle(y, w, 1e-6, 1234, table, **kw, sin=libm("sinf"), cos=libm("cosf"))
    assert np.array(got_kv).dtype == np.float16
    assert_bits_equal(got_qk, want_qk)
    assert_bits_equal(got_kv, want_kv)


# heads, kv heads, head dim, cache capacity, window, position, traditional, norm, rope, gated: the
# token in the first, a middle and the last split, a wrapped ring, a window, no norm, no RoPE
TOKEN_CASES = [(4, 2, 128, 256, 0, 70, True, True, True, True), (4, 2, 64, 128, 128, 300, False, True, True, False),
               (6, 3, 32, 1024, 100, 600, False, False, True, True), (2, 2, 64, 64, 0, 0, True, True, False, False),
               (8, 2, 128, 1024, 0, 1023, False, True, True, True), (16, 1, 64, 512, 0, 31, True, True, True, True)]


def token_case_inputs(h, hkv, d, cap, window, pos, norm, rope):
    """A TOKEN_CASES case's inputs for attn_decode_token: ``(rows, v_off, y, gate, w, table, kv, p,
    geom)`` -- the projection output with V 16 values past the heads and 8 after it, a gate read
    from offset 40, the norm weights and RoPE table where the case has them, random f16 planes."""
    rows, v_off = h + hkv, (h + hkv) * d + 16
    y, gate = arr(v_off + hkv * d + 8), arr(h * d + 40)
    w = arr(rows, d) if norm else None
    table = attention.rope_table(d, 10000.0, 0.5) if rope else None
    kv = mx.array(RNG.standard_normal((2, hkv, cap, d)).astype(np.float16))
    p, geom = mx.array([pos], dtype=mx.int32), attention.decode_geometry(cap, window)
    return rows, v_off, y, gate, w, table, kv, p, geom


@emulator
@pytest.mark.parametrize("h,hkv,d,cap,window,pos,trad,norm,rope,gated", TOKEN_CASES)
def test_attention_with_its_norms_is_the_two_kernels(h, hkv, d, cap, window, pos, trad, norm, rope, gated):
    """attn_decode_token (qk_rope_pack's norms and RoPE inside the one-dispatch attention, the token's
    K/V from the kernel's own registers) against qk_rope_pack's oracle, its K/V written into the
    planes, then the attention's oracle: the same bits, and the same K/V out for the cache. The
    planes' slot of the token holds other values, so reading it there would show."""
    rows, v_off, y, gate, w, table, kv, p, geom = token_case_inputs(h, hkv, d, cap, window, pos, norm, rope)
    kw = dict(n_head=h, rd=d, traditional=trad, v_offset=v_off)
    g = gate if gated else None
    got, got_kv = emulate_recorded(attention.attn_decode_token, y, w, 1e-6, p, table, kv, geom, d ** -0.5, g, nth=32,
                                   gate_offset=40 if gated else 0, **kw)
    want, want_kv = attention.attn_decode_token_oracle(
        y, w, 1e-6, pos, table, kv, window, d ** -0.5, None if g is None else g[40:], d=d, exp=libm("expf"),
        sin=libm("sinf"), cos=libm("cosf"), **kw)
    assert_bits_equal(got, want)
    assert_bits_equal(got_kv, want_kv)
    # the oracle is the two kernels' oracles as the decode path ran them before: the norms and RoPE,
    # the K/V written at the token's slot, then the attention over the planes
    qk, kvn = attention.qk_rope_pack_oracle(y, w, 1e-6, pos, table, rows=rows, hkv=hkv, d=d, rd=d, traditional=trad,
                                            v_offset=v_off, nth=32, sin=libm("sinf"), cos=libm("cosf"))
    planes = np.array(kv)
    planes[:, :, pos % cap] = np.array(kvn)
    assert_bits_equal(want_kv, kvn)
    assert_bits_equal(want, attention.attn_decode_oracle(qk, mx.array(planes), pos, window, d ** -0.5,
                                                         None if g is None else g[40:], exp=libm("expf"), n_head=h))


@emulator
@pytest.mark.parametrize("case", TOKEN_CASES)
def test_attention_hands_out_its_planes_whole(case):
    """attn_decode_token with ``through`` (THRU): the planes come out whole, every slot the input's
    but the token's, which holds its K/V -- the oracle's copy of the planes, bit for bit (the
    emulator's outputs start as NaN bytes, so a row no thread copies fails) -- and the output is the
    plain kernel's. The cases cover a wrapped ring, a window, the token in the last slot and caches
    of 64 to 1,024 positions, so 2 to 64 copy threadgroups."""
    h, hkv, d, cap, window, pos, trad, norm, rope, gated = case
    rows, v_off, y, gate, w, table, kv, p, geom = token_case_inputs(h, hkv, d, cap, window, pos, norm, rope)
    kw = dict(n_head=h, rd=d, traditional=trad, v_offset=v_off, nth=32, gate_offset=40 if gated else 0)
    args = (y, w, 1e-6, p, table, kv, geom, d ** -0.5, gate if gated else None)
    got, got_planes = emulate_recorded(attention.attn_decode_token, *args, through=True, **kw)
    plain, plain_kv = emulate_recorded(attention.attn_decode_token, *args, **kw)
    assert got_planes.shape == kv.shape and got_planes.dtype == mx.float16
    assert_bits_equal(got, plain)
    want = np.array(kv)
    want[:, :, pos % cap] = np.array(plain_kv)
    assert_bits_equal(got_planes, mx.array(want))
    _, oracle_planes = attention.attn_decode_token_oracle(
        y, w, 1e-6, pos, table, kv, window, d ** -0.5, None if not gated else gate[40:], d=d, exp=libm("expf"),
        sin=libm("sinf"), cos=libm("cosf"), through=True, **{k: kw[k] for k in ("n_head", "rd", "traditional", "v_offset")})
    assert_bits_equal(oracle_planes, mx.array(want))


@emulator
@pytest.mark.parametrize("case", [TOKEN_CASES[0], TOKEN_CASES[2], TOKEN_CASES[5]])
def test_attention_writes_its_output_quantized(case):
    """attn_decode_fused_q8 (opt-in q8 route, MUSE_MLX_Q8_ATTN=1): the attention with its norms that
    also writes its output quantized for attn_output: the float output and K/V are the plain
    kernel's, bit for bit, and the words and (d, sum q) are quantize_q8's of that output (heads of
    128, 32 and 64 dimensions: four, one and two groups of 32 a head)."""
    h, hkv, d, cap, window, pos, trad, norm, rope, gated = case
    rows, v_off, y, gate, w, table, kv, p, geom = token_case_inputs(h, hkv, d, cap, window, pos, norm, rope)
    kw = dict(n_head=h, rd=d, traditional=trad, v_offset=v_off, nth=32, gate_offset=40 if gated else 0)
    args = (y, w, 1e-6, p, table, kv, geom, d ** -0.5, gate if gated else None)
    got, got_kv, (qy, ds) = emulate_recorded(attention.attn_decode_token, *args, q8_out=True, **kw)
    plain, plain_kv = emulate_recorded(attention.attn_decode_token, *args, **kw)
    assert_bits_equal(got, plain)
    assert_bits_equal(got_kv, plain_kv)
    want_qy, want_ds = mul_mv.quantize_q8_rows(got, which="cpu")
    assert np.array_equal(np.array(qy), np.array(want_qy))
    assert_bits_equal(ds, want_ds)


def test_attention_with_its_norms_refuses_what_it_cannot_hold():
    y, kv = arr(1024), mx.zeros((2, 2, 2048, 64), dtype=mx.float16)
    args = (y, None, 1e-6, mx.array([5], dtype=mx.int32), None)
    kw = dict(n_head=4, rd=64, traditional=False, v_offset=384, which="record")
    with pytest.raises(ValueError, match="at most 1024 cache positions"):
        attention.attn_decode_token(*args, kv, attention.decode_geometry(2048, 0), 0.1, nth=32, **kw)
    kv = mx.zeros((2, 2, 256, 64), dtype=mx.float16)
    with pytest.raises(ValueError, match="one SIMD group"):
        attention.attn_decode_token(*args, kv, attention.decode_geometry(256, 0), 0.1, nth=64, **kw)


def test_qk_rope_pack_oracle_is_norm_then_mlx_rope():
    """The oracle's parts against independent references: the norm agrees with a float64 RMS norm
    to float32 rounding, V is rounded to f16 as astype does, and the rotation agrees with
    mx.fast.rope (MLX's own RoPE, other rounding) to float32 rounding."""
    h, hkv, d = 4, 2, 64
    rows = h + hkv
    y = arr(rows * d + hkv * d)
    w = arr(rows, d)
    nth = rms_norm.norm_threads(d, "llama")
    for trad in (True, False):
        kw = dict(rows=rows, hkv=hkv, d=d, rd=d, traditional=trad, v_offset=rows * d, nth=nth)
        plain, kv = attention.qk_rope_pack_oracle(y, w, 1e-6, 0, None, **kw)
        x64 = np.array(y[: rows * d], np.float64).reshape(rows, d)
        norm64 = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-6) * np.array(w, np.float64)
        np.testing.assert_allclose(np.array(plain), norm64, rtol=2e-6, atol=1e-6)
        assert_bits_equal(kv[1], y[rows * d :].reshape(hkv, d).astype(mx.float16))
        roped, _ = attention.qk_rope_pack_oracle(y, w, 1e-6, 77, attention.rope_table(d, 10000.0, 1.0), **kw)
        ref = mx.fast.rope(plain.reshape(1, rows, 1, d), d, traditional=trad, base=10000.0, scale=1.0, offset=77,
                           stream=mx.cpu)
        np.testing.assert_allclose(np.array(roped), np.array(ref).reshape(rows, d), rtol=0, atol=2e-4)
        assert not np.allclose(np.array(roped), np.array(plain), atol=1e-2)


def test_decode_path_needs_the_partial_pass_to_fit_metal_threadgroup_memory():
    """18,752 bytes at G = 16, D = 128 is what ptxas -v reports for the sm_90a build
    (scripts/kernel_sass.py); Metal allows 32 KB per threadgroup, so G = 16 with D = 256 takes
    the general path, and so does a head width that is not whole 16-byte words."""
    from types import SimpleNamespace

    from muse_mlx.routes import make_route

    assert attention.partial_threadgroup_bytes(16, 128) == 18752
    # the one-dispatch form: 18,176 bytes at D = 128 (ptxas -v), the most it takes
    assert attention.fused_threadgroup_bytes(128) == 18176
    assert all(attention.fused_threadgroup_bytes(d) <= 32 * 1024 for d in (32, 64, 128))
    route = make_route("pinned", ())
    cfg = lambda h, hkv, d: SimpleNamespace(n_head=h, n_head_kv=hkv, head_dim=d, attn_softcap=None,  # noqa: E731
                                            q_scale=None, kq_scale=1.0)
    assert route.fast_decode(cfg(32, 2, 128))
    assert route.fast_decode(cfg(8, 4, 256))
    assert not route.fast_decode(cfg(32, 2, 256))
    assert not route.fast_decode(cfg(8, 2, 68))
