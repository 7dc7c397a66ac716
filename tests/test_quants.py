"""Dequantization and the MLX affine repack, bit for bit against gguf-py's dequantizer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from muse_mlx.quantizers import quantize
from muse_mlx.quants import FORMATS, HI_LO_GROUP, dequantize, to_affine, to_affine_hi_lo

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def _random_blocks(qtype: T, rows: int, n: int, rng) -> np.ndarray:
    """Arbitrary bytes, except that the f16 scale fields are finite (as any real file has)."""
    f = FORMATS[qtype]
    raw = rng.integers(0, 256, size=(rows, n // f.block_size, f.type_size), dtype=np.uint8)
    scale_fields = {T.Q8_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}[qtype]
    for off in scale_fields:  # clear the top exponent bit: |x| < 2, never inf/NaN
        raw[..., off + 1] &= 0xBF
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_bit_exactly_on_quantizer_blocks(qtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 1024)) * rng.uniform(0.01, 10, (6, 1))).astype(np.float32)
    data = quantize(x, qtype)
    ref = gguf_dequantize(data, qtype).reshape(6, 1024)
    ours = np.array(dequantize(mx.array(data), qtype))
    assert ours.shape == ref.shape
    np.testing.assert_array_equal(_bits(ours), _bits(ref))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_dequantize_matches_gguf_bit_exactly_on_arbitrary_blocks(qtype):
    rng = np.random.default_rng(2)
    data = _random_blocks(qtype, 5, 768, rng)
    ref = gguf_dequantize(data, qtype).reshape(5, 768)
    ours = np.array(dequantize(mx.array(data), qtype))
    np.testing.assert_array_equal(_bits(ours), _bits(ref))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_affine_repack_is_bit_exact(qtype):
    """Q4_K/Q5_K/Q8_0 -> MLX affine (group 32, float32 scales) loses nothing."""
    rng = np.random.default_rng(3)
    data = quantize(rng.standard_normal((4, 512)).astype(np.float32), qtype)
    w, scales, biases, bits = to_affine(mx.array(data), qtype)
    assert scales.dtype == mx.float32 and biases.dtype == mx.float32
    back = np.array(mx.dequantize(w, scales, biases, group_size=32, bits=bits))
    np.testing.assert_array_equal(_bits(back), _bits(gguf_dequantize(data, qtype).reshape(4, 512)))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_affine_repack_is_exact_on_arbitrary_blocks(qtype):
    """Equal values on any block; the bits too, except Q8_0's zeros when d < 0.

    gguf-py computes ``0 * d`` (-0.0 for d < 0); the affine form ``d*128 + (-128*d)`` gives +0.0.
    Quantizers never write d < 0 (d = max|x|/127), so real files are bit-exact.
    """
    rng = np.random.default_rng(3)
    data = _random_blocks(qtype, 4, 512, rng)
    w, scales, biases, bits = to_affine(mx.array(data), qtype)
    back = np.array(mx.dequantize(w, scales, biases, group_size=32, bits=bits))
    ref = gguf_dequantize(data, qtype).reshape(4, 512)
    if qtype == T.Q8_0:
        back, ref = back + np.float32(0), ref + np.float32(0)  # -0.0 -> +0.0
    np.testing.assert_array_equal(_bits(back), _bits(ref))


def test_affine_repack_with_float16_scales_is_not_exact():
    """Why the repack keeps float32 scales: d*sc needs up to 17 significant bits."""
    rng = np.random.default_rng(4)
    data = _random_blocks(T.Q4_K, 4, 512, rng)
    w, scales, biases, bits = to_affine(mx.array(data), T.Q4_K)
    half = np.array(mx.dequantize(w, scales.astype(mx.float16), biases.astype(mx.float16), group_size=32, bits=4))
    assert not np.array_equal(half.astype(np.float32), gguf_dequantize(data, T.Q4_K).reshape(4, 512))


def test_affine_repack_memory_cost():
    """Q4_K is 4.5 bits/weight raw; the exact affine form costs 6.0 (4 + 2 x 32-bit per 32)."""
    rows, n = 8, 1024
    data = quantize(np.ones((rows, n), np.float32), T.Q4_K)
    w, s, b, _ = to_affine(mx.array(data), T.Q4_K)
    assert data.nbytes * 8 / (rows * n) == 4.5
    assert (w.nbytes + s.nbytes + b.nbytes) * 8 / (rows * n) == 6.0


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_quantized_matmul_on_repack_matches_float64(qtype):
    rng = np.random.default_rng(5)
    data = quantize(rng.standard_normal((64, 512)).astype(np.float32), qtype)
    w, s, b, bits = to_affine(mx.array(data), qtype)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    ours = np.array(mx.quantized_matmul(mx.array(x), w, s, b, transpose=True, group_size=32, bits=bits))
    ref = x.astype(np.float64) @ gguf_dequantize(data, qtype).astype(np.float64).reshape(64, 512).T
    # float32 sums of 512 products of size ~1: a few ulp of the sum's magnitude (~30).
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def _hi_lo_matrix(data: np.ndarray) -> np.ndarray:
    hi, lo = to_affine_hi_lo(mx.array(data), T.Q6_K)
    parts = [mx.dequantize(w, s, b, group_size=HI_LO_GROUP, bits=bits) for w, s, b, bits in (hi, lo)]
    return np.array(parts[0] + parts[1])


@pytest.mark.parametrize("source", ["quantizer", "arbitrary"])
def test_q6_k_hi_lo_repack_is_bit_exact(source):
    """Q6_K -> an 8-bit and a 6-bit MLX affine form (group 64) whose sum is gguf-py's matrix.

    Arbitrary blocks reach every scale (-128..127), every code and d < 0; the one difference
    allowed is a zero's sign (gguf-py's ``(d*sc)*0`` is -0.0 when d*sc < 0; hi + lo gives +0.0).
    """
    rng = np.random.default_rng(7)
    if source == "quantizer":
        data = quantize((rng.standard_normal((6, 1024)) * rng.uniform(0.01, 10, (6, 1))).astype(np.float32), T.Q6_K)
    else:
        data = _random_blocks(T.Q6_K, 6, 1024, rng)
    ours, ref = _hi_lo_matrix(data), gguf_dequantize(data, T.Q6_K).reshape(6, 1024)
    np.testing.assert_array_equal(_bits(ours + np.float32(0)), _bits(ref + np.float32(0)))


def test_q6_k_hi_lo_repack_reaches_the_code_range_ends():
    """n = sc*(q-32) spans [-4064, 4096]; both ends (hi codes 0 and 128) come back exactly."""
    block = np.zeros(210, np.uint8)
    block[192:208] = np.array([-128, 127] * 8, np.int8).view(np.uint8)  # scales
    block[0:128] = 0x00  # ql: low nibbles 0 ...
    block[128:192] = 0x00  # ... and high bits 0: q = 0, q - 32 = -32
    block[64:128] = 0xFF  # the second half: q = 15 | (0 << 4) ...
    block[160:192] = 0xFF  # ... with high bits 3: q = 63, q - 32 = 31
    block[208:210] = np.array([0.5], np.float16).view(np.uint8)
    data = block.reshape(1, 210)
    ref = gguf_dequantize(data, T.Q6_K).reshape(1, 256)
    assert ref.max() == 0.5 * 4096 and ref.min() == 0.5 * -4064  # (-128)(-32) and (127)(-32)
    np.testing.assert_array_equal(_bits(_hi_lo_matrix(data)), _bits(ref))


def test_q6_k_hi_lo_repack_memory_cost():
    """Q6_K is 6.5625 bits/weight raw; the hi/lo pair costs 8 + 6 + 4 x 32-bit per 64 = 16."""
    data = quantize(np.ones((8, 1024), np.float32), T.Q6_K)
    forms = to_affine_hi_lo(mx.array(data), T.Q6_K)
    assert sum(a.nbytes for f in forms for a in f[:3]) * 8 / data.size / 256 * 210 == 16.0


def test_quantized_matmul_on_hi_lo_matches_float64():
    rng = np.random.default_rng(8)
    data = quantize(rng.standard_normal((64, 512)).astype(np.float32), T.Q6_K)
    (wh, sh, bh, bits_h), (wl, sl, bl, bits_l) = to_affine_hi_lo(mx.array(data), T.Q6_K)
    x = mx.array(rng.standard_normal((3, 512)).astype(np.float32))
    ours = np.array(mx.quantized_matmul(x, wh, sh, bh, transpose=True, group_size=HI_LO_GROUP, bits=bits_h)
                    + mx.quantized_matmul(x, wl, sl, bl, transpose=True, group_size=HI_LO_GROUP, bits=bits_l))
    ref = np.array(x).astype(np.float64) @ gguf_dequantize(data, T.Q6_K).astype(np.float64).reshape(64, 512).T
    # two float32 sums of 512 products whose terms are each about |W| in size: a few ulp of ~30
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def test_hi_lo_refuses_other_types():
    with pytest.raises(ValueError, match="Q4_K has an MLX affine form of its own"):
        to_affine_hi_lo(mx.array(quantize(np.ones((1, 256), np.float32), T.Q4_K)), T.Q4_K)


@pytest.mark.parametrize("qtype,bound", [(T.Q8_0, 0.005), (T.Q6_K, 0.02), (T.Q5_K, 0.04), (T.Q4_K, 0.08)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_quantizers_round_trip_within_their_resolution(qtype, bound):
    """Our writer's quantizers: max error relative to each row's max |x| stays within the format's step."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    back = gguf_dequantize(quantize(x, qtype), qtype).reshape(16, 512)
    rel = np.abs(back - x).max(axis=1) / np.abs(x).max(axis=1)
    assert rel.max() < bound


def test_q6_k_split_form_holds_the_same_bytes():
    """The split form (mv_q8_q6k; the exact lanes' on CUDA): the same bytes, every 208-byte body first (16-byte aligned),
    then the d's; joining it gives the raw rows back."""
    from muse_mlx.quants import join_q6_K, split_q6_K

    raw = np.random.default_rng(5).integers(0, 256, (3, 2 * 210), dtype=np.uint8)
    raw.reshape(6, 210)[:, 208:] = np.frombuffer(np.float16([0.5] * 6).tobytes(), np.uint8).reshape(6, 2)
    sp = np.array(split_q6_K(mx.array(raw)))
    assert sp.shape == raw.shape
    flat = sp.reshape(-1)
    for r in range(3):
        for j in range(2):
            blk = raw[r, 210 * j : 210 * (j + 1)]
            n = 2 * r + j
            assert np.array_equal(flat[208 * n : 208 * (n + 1)], blk[:208])
            assert np.array_equal(flat[208 * 6 + 2 * n : 208 * 6 + 2 * n + 2], blk[208:])
    assert np.array_equal(np.array(join_q6_K(mx.array(sp))), raw)
    host = split_q6_K(raw)  # numpy in, numpy out: the loader splits on the host
    assert isinstance(host, np.ndarray) and np.array_equal(host, sp)
    with pytest.raises(ValueError, match="whole 210-byte blocks"):
        split_q6_K(mx.array(raw[:, :300]))
    with pytest.raises(ValueError, match="whole 210-byte blocks"):
        split_q6_K(raw[:, :300])
