"""Dequantization and the MLX affine repack, bit for bit against gguf-py's dequantizer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from muse_mlx.quantizers import quantize
from muse_mlx.quants import FORMATS, dequantize, to_affine

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


@pytest.mark.parametrize("qtype,bound", [(T.Q8_0, 0.005), (T.Q6_K, 0.02), (T.Q5_K, 0.04), (T.Q4_K, 0.08)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_quantizers_round_trip_within_their_resolution(qtype, bound):
    """Our writer's quantizers: max error relative to each row's max |x| stays within the format's step."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    back = gguf_dequantize(quantize(x, qtype), qtype).reshape(16, 512)
    rel = np.abs(back - x).max(axis=1) / np.abs(x).max(axis=1)
    assert rel.max() < bound
