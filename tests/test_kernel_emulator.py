"""The CPU kernel emulator (tests/kernel_emulator.py): its vocabulary, its checks, and the kernels.

The vocabulary tests pin what the emulator means by each Metal name (the prelude.cuh meaning);
the kernel tests then run the kernels' source text through it and require their oracles'
float32 bits, at small but awkward sizes (partial row groups, one block per token, threads
holding zero elements); a negative control shows that a reordered body is caught.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from kernel_emulator import CompileError, EmulatorError, available, emulate, emulate_recorded
from muse_mlx import kernels as K
from muse_mlx.kernels import ffn, fp, mul_mv, norm_tail, rms_norm
from muse_mlx.kernels.backend import Kernel
from muse_mlx.quantizers import quantize

pytestmark = pytest.mark.skipif(not available(), reason="needs g++ with C++20 (<barrier>) and _Float16")

RNG = np.random.default_rng(11)
F32 = np.float32


def arr(*shape, scale=1.0):
    # magnitudes spread over two decades, so that the order of additions shows in the bits
    v = RNG.standard_normal(shape) * RNG.uniform(0.1, 10.0, shape) * scale
    return mx.array(v.astype(F32))


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.array(x), dtype=F32).view(np.uint32)


def assert_bits_equal(got, want):
    g, w = bits(got), bits(want)
    assert g.shape == w.shape
    bad = np.flatnonzero(g != w)
    first = bad[:5]
    assert bad.size == 0, (f"{bad.size} of {g.size} differ, first at {first}: "
                           f"{np.array(got).ravel()[first]} vs {np.array(want).ravel()[first]}")


def ulps(a, b) -> np.ndarray:
    """Distance in float32 steps (same-sign finite values)."""
    return np.abs(bits(a).astype(np.int64) - bits(b).astype(np.int64))


class Inline(Kernel):
    """A kernel given as text: a body and, unlike ``Kernel(None, ...)``, optionally header helpers."""

    def __init__(self, name, inputs, outputs, body, header=""):
        super().__init__(None, name, inputs, outputs, body=body)
        self._header = header

    @property
    def header(self) -> str:
        return self._header


def probe(body, inputs, outputs):
    return Inline("probe", inputs, outputs, body)


def run_probe(body, threads, tg=None, out_size=None):
    """A probe body with one dummy input and one float32 output ``out``, on a 1-D grid."""
    tg = tg or threads
    return emulate(probe(body, ["x"], ["out"]), [np.zeros(1, F32)], [(out_size or threads,)], [mx.float32],
                   (threads, 1, 1), (tg, 1, 1), None)


# -- the C library's float functions, for the kernels that call exp, tanh, sin, cos ----------

_LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
for _name in ("expf", "logf", "tanhf", "sinf", "cosf"):
    getattr(_LIBM, _name).restype = ctypes.c_float
    getattr(_LIBM, _name).argtypes = [ctypes.c_float]


def libm(name):
    """x -> the C library's float function of each element (what the emulated kernel calls)."""
    fn = getattr(_LIBM, name)
    return lambda x: mx.array(np.array([fn(float(v)) for v in np.array(x, F32).ravel()], F32).reshape(x.shape))


# -- the vocabulary -------------------------------------------------------------------------


def test_thread_positions_and_block_count():
    """grid in threads, ceil(grid / threadgroup) blocks per axis, linear index x + bx*(y + by*z)."""
    grid, tg = (70, 3, 2), (32, 2, 2)
    blocks = [-(-g // t) for g, t in zip(grid, tg)]  # 3, 2, 1
    n_threads = int(np.prod(blocks) * np.prod(tg))
    body = """
    const uint3 b = threadgroup_position_in_grid;
    const uint3 t = thread_position_in_threadgroup;
    const uint block = b.x + BX * (b.y + BY * b.z);
    device uint* o = out + 12 * (block * 128 + thread_index_in_threadgroup);
    o[0] = thread_position_in_grid.x; o[1] = thread_position_in_grid.y; o[2] = thread_position_in_grid.z;
    o[3] = t.x; o[4] = t.y; o[5] = t.z;
    o[6] = thread_index_in_threadgroup; o[7] = thread_index_in_simdgroup; o[8] = simdgroup_index_in_threadgroup;
    o[9] = threads_per_threadgroup.x * 10000 + threads_per_threadgroup.y * 100 + threads_per_threadgroup.z;
    o[10] = b.x * 100 + b.y * 10 + b.z; o[11] = 7;
"""
    (out,) = emulate(probe(body, ["x"], ["out"]), [np.zeros(1, F32)], [(n_threads * 12,)], [mx.uint32], grid, tg,
                     [("BX", blocks[0]), ("BY", blocks[1])])
    rows = {tuple(r[:3]): r for r in out.reshape(-1, 12)}
    assert len(rows) == n_threads and (out.reshape(-1, 12)[:, 11] == 7).all()  # every thread ran once
    for bz in range(blocks[2]):
        for by in range(blocks[1]):
            for bx in range(blocks[0]):
                for tz in range(tg[2]):
                    for ty in range(tg[1]):
                        for tx in range(tg[0]):
                            lin = tx + tg[0] * (ty + tg[1] * tz)
                            r = rows[(bx * tg[0] + tx, by * tg[1] + ty, bz * tg[2] + tz)]
                            assert list(r[3:11]) == [tx, ty, tz, lin, lin & 31, lin >> 5, 320202,
                                                     bx * 100 + by * 10 + bz]


def test_simd_sum_is_the_prelude_butterfly():
    """Every lane ends with the xor-butterfly total (order matters at these magnitudes)."""
    x = (RNG.standard_normal(64) * 10.0 ** RNG.integers(-6, 7, 64)).astype(F32)
    body = """
    const uint i = thread_position_in_grid.x;
    s[i] = simd_sum(x[i]);
    m[i] = simd_max(x[i]);
    sh[i] = simd_shuffle_xor(x[i], 5u);
"""
    s, m, sh = emulate(probe(body, ["x"], ["s", "m", "sh"]), [x], [(64,)] * 3, [mx.float32] * 3,
                       (64, 1, 1), (64, 1, 1), None)
    for g in range(2):
        lanes = x[32 * g : 32 * g + 32].copy()
        for off in (16, 8, 4, 2, 1):
            lanes = (lanes + lanes[np.arange(32) ^ off]).astype(F32)
        np.testing.assert_array_equal(s[32 * g : 32 * g + 32].view(np.uint32), lanes.view(np.uint32))
        assert bits(s[32 * g]) == bits(fp.simd_sum(mx.array(x[32 * g : 32 * g + 32])[None]))[0]
        assert (m[32 * g : 32 * g + 32] == x[32 * g : 32 * g + 32].max()).all()
        np.testing.assert_array_equal(sh[32 * g : 32 * g + 32], x[32 * g : 32 * g + 32][np.arange(32) ^ 5])
    # the control: a plain left-to-right sum gives other bits for these values
    assert any(bits(s[32 * g]) != bits(np.cumsum(x[32 * g : 32 * g + 32], dtype=F32)[-1]) for g in range(2))


def test_float_semantics_fma_no_contraction_half_rounding():
    """fma is one rounding; a*b + c in a body is two (never contracted); half rounds to nearest even."""
    n = 4096
    a, b, c = (RNG.standard_normal(n).astype(F32) for _ in range(3))
    a[:64] = b[:64] = np.float32(1 + 2**-12)  # a*b = 1 + 2^-11 + 2^-24: only a single rounding keeps 2^-24
    c[:64] = np.float32(-1.0)
    # random magnitudes down to f16 subnormals, plus overflow and ties (each rounds to the even side)
    ties = [65504.0, 65520.0, 2.0**-25, 3 * 2.0**-25, 1 + 2**-11, 1 + 3 * 2**-11, -0.0, np.inf]
    h = np.concatenate([RNG.standard_normal(n - 8) * 10.0 ** RNG.integers(-9, 6, n - 8), ties]).astype(F32)
    body = """
    const uint i = thread_position_in_grid.x;
    fused[i] = fma(a[i], b[i], c[i]);
    plain[i] = a[i] * b[i] + c[i];
    const float4 v = {a[i], b[i], c[i], h[i]};
    d4[i] = dot(v, v);
    hh[i] = half(h[i]);
    back[i] = float(hh[i]);
"""
    fused, plain, d4, hh, back = emulate(
        probe(body, ["a", "b", "c", "h"], ["fused", "plain", "d4", "hh", "back"]), [a, b, c, h], [(n,)] * 5,
        [mx.float32, mx.float32, mx.float32, mx.float16, mx.float32], (n, 1, 1), (256, 1, 1), None)
    np.testing.assert_array_equal(fused.view(np.uint32), bits(fp.fma(mx.array(a), mx.array(b), mx.array(c))))
    np.testing.assert_array_equal(plain.view(np.uint32), ((a * b).astype(F32) + c).view(np.uint32))
    assert (fused[:64] != plain[:64]).all()
    v4 = mx.array(np.stack([a, b, c, h], -1))
    np.testing.assert_array_equal(d4.view(np.uint32), bits(fp.dot4(v4, v4)))
    with np.errstate(over="ignore"):  # 65520 rounds to inf, as it should
        h16 = h.astype(np.float16)
    np.testing.assert_array_equal(hh.view(np.uint16), h16.view(np.uint16))
    np.testing.assert_array_equal(back, h16.astype(F32))


def test_threadgroup_memory_is_shared_and_barriers_order_it():
    body = """
    threadgroup float shm[256];
    const uint tid = thread_index_in_threadgroup;
    shm[tid] = x[threadgroup_position_in_grid.x * 256 + tid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[threadgroup_position_in_grid.x * 256 + tid] = shm[255 - tid];
"""
    x = RNG.standard_normal(768).astype(F32)
    (out,) = emulate(probe(body, ["x"], ["out"]), [x], [(768,)], [mx.float32], (768, 1, 1), (256, 1, 1), None)
    np.testing.assert_array_equal(out, x.reshape(3, 256)[:, ::-1].ravel())


def test_unwritten_outputs_are_poisoned_or_init_value():
    body = "    if (thread_position_in_grid.x % 2 == 0) out[thread_position_in_grid.x] = 1.0f;\n"
    k = probe(body, ["x"], ["out"])
    (out,) = emulate(k, [np.zeros(1, F32)], [(64,)], [mx.float32], (64, 1, 1), (32, 1, 1), None)
    assert (out[::2] == 1).all() and np.isnan(out[1::2]).all()
    (out,) = emulate(k, [np.zeros(1, F32)], [(64,)], [mx.float32], (64, 1, 1), (32, 1, 1), None, init_value=0)
    assert (out[1::2] == 0).all()


# -- the emulator's checks ------------------------------------------------------------------


def test_simd_op_after_some_lanes_returned_is_an_error():
    body = """
    if (thread_index_in_simdgroup == 3) return;
    out[thread_position_in_grid.x] = simd_sum(1.0f);
"""
    with pytest.raises(EmulatorError, match="lane 3, which did not take part"):
        run_probe(body, 64)


def test_simd_op_in_a_partial_simd_group_is_an_error_but_plain_code_is_not():
    body = "    out[thread_position_in_grid.x] = simd_sum(1.0f);\n"
    with pytest.raises(EmulatorError, match="only 8 lanes"):
        run_probe(body, 40)
    (out,) = run_probe("    out[thread_position_in_grid.x] = 2.0f;\n", 40)
    assert (out == 2).all()


def test_divergent_barrier_is_an_error():
    body = """
    if (thread_index_in_threadgroup < 32) threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = 0.0f;
"""
    with pytest.raises(EmulatorError, match="divergent"):
        run_probe(body, 64)


def test_write_past_an_output_is_an_error():
    body = "    out[thread_position_in_grid.x + 1] = 0.0f;\n"
    with pytest.raises(EmulatorError, match="outside buffer 'out'"):
        run_probe(body, 32)


def test_compile_error_names_the_source_and_shows_gcc():
    with pytest.raises(CompileError) as e:
        run_probe("    out[0] = undefined_name;\n", 32, out_size=1)
    msg = str(e.value)
    assert "undefined_name" in msg and "was not declared" in msg
    assert re.search(r"kernel-\w+\.cpp", msg)


def test_threadgroup_variable_with_an_initializer_is_refused():
    """As a function-static it would be initialised once, by whichever thread came first."""
    body = """
    threadgroup float shm[64];
    threadgroup float* mine = shm + thread_index_in_threadgroup;  // the threadgroup word: a comment is fine
    *mine = 1.0f;
"""
    with pytest.raises(EmulatorError, match="initializer"):
        run_probe(body, 64, out_size=1)


def test_emulate_recorded_restores_kernel_call():
    original = Kernel.__call__
    emulate_recorded(K.silu_mul, arr(64), arr(64))
    assert Kernel.__call__ is original
    with pytest.raises(ValueError, match="emulate"):  # outside emulate_recorded the mode does not exist
        K.silu_mul(arr(64), arr(64), which="emulate")


# -- the kernels against their oracles ------------------------------------------------------


@pytest.mark.parametrize("n", [128, 1152, 6656])
@pytest.mark.parametrize("geometry", ["seeds", "llama"])
def test_rms_norm_mul(n, geometry):
    rows = 3
    x, w, a = arr(rows, n, scale=3), arr(n), arr(rows, n)
    nth = K.norm_threads(n, geometry)
    for mode, (ww, aa, eps) in enumerate([(None, None, 1e-5), (w, None, 1e-6), (w, a, 1e-8)], start=1):
        got = emulate_recorded(K.rms_norm_mul, x, ww, eps, add=aa, geometry=geometry)
        assert_bits_equal(got, rms_norm.rms_norm_mul_oracle(x, ww, eps, aa, nth))


@pytest.mark.parametrize("n,geometry", [(6656, "seeds"), (1152, "llama"), (1152, "seeds")])
def test_tail_dual_eps(n, geometry):
    h, s, w1, w2 = arr(2, n), arr(2, n, scale=7), arr(n), arr(n)
    hid, out = emulate_recorded(K.tail_dual_eps, h, s, w1, w2, 1e-8, 1e-5, geometry)
    want_hid, want_out = norm_tail.tail_dual_eps_oracle(h, s, w1, w2, 1e-8, 1e-5, K.norm_threads(n, geometry))
    assert_bits_equal(hid, want_hid)
    assert_bits_equal(out, want_out)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=["q4_K", "q6_K"])
@pytest.mark.parametrize("rows,k", [(37, 768), (8, 1536), (5, 256)])
def test_mul_mv(qtype, rows, k):
    fn, oracle = {T.Q4_K: (K.mul_mv_q4_K, mul_mv.mul_mv_q4_K_oracle),
                  T.Q6_K: (K.mul_mv_q6_K, mul_mv.mul_mv_q6_K_oracle)}[qtype]
    w = mx.array(quantize(RNG.standard_normal((rows, k)).astype(F32), qtype))
    for t in (1, 3):
        y = arr(t, k)
        assert_bits_equal(emulate_recorded(fn, y, w), oracle(y, w))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=["q4_K", "q6_K"])
def test_mul_mv_on_random_blocks(qtype):
    """Blocks of random bytes (valid d): every code, every 6-bit scale pattern and, for Q6_K,
    every int8 scale reach the kernels' integer-to-float conversions, not only a quantizer's."""
    from muse_mlx.synthetic import random_blocks

    fn, oracle = {T.Q4_K: (K.mul_mv_q4_K, mul_mv.mul_mv_q4_K_oracle),
                  T.Q6_K: (K.mul_mv_q6_K, mul_mv.mul_mv_q6_K_oracle)}[qtype]
    w = mx.array(random_blocks(24, 1024, qtype, np.random.default_rng(5)))
    y = arr(2, 1024)
    assert_bits_equal(emulate_recorded(fn, y, w), oracle(y, w))


@pytest.mark.parametrize("n,geometry", [(128, "llama"), (1152, "seeds"), (1152, "llama")])
def test_rms_norm_f16(n, geometry):
    """Two launches (F16 norm, then mul_f16 on its output): the emulated chain equals the oracle."""
    x, w = arr(3, n, scale=2), arr(n)
    got = np.array(emulate_recorded(K.rms_norm_f16, x, w, 1e-5, geometry))
    want = np.array(rms_norm.rms_norm_f16_oracle(x, w.astype(mx.float16), 1e-5, K.norm_threads(n, geometry)))
    assert got.dtype == want.dtype == np.float16
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("n", [5000, 100])  # a partial last block; a threadgroup of 100 (no SIMD op)
def test_silu_mul(n):
    """The emulated kernel calls the C library's expf (on a GPU: the device's exp).

    Exact against the oracle given that same function. Against the oracle's default, a
    correctly rounded exp: glibc's expf is not correctly rounded (measured: it differs in about
    0.06 % of inputs, by one ulp), and one ulp of exp(-g) moves the output by at most one ulp,
    so at most 0.1 % of elements may differ, by one ulp. (numpy's float32 exp is no model of
    expf: its SIMD version differs from the correctly rounded value in ~40 % of inputs, by up
    to 2 ulp, on an AVX-512 machine.)
    """
    g, u = arr(n, scale=2), arr(n)
    got = emulate_recorded(K.silu_mul, g, u)
    assert_bits_equal(got, ffn.silu_oracle(g, u, exp=libm("expf")))
    d = ulps(got, ffn.silu_oracle(g, u))
    assert d.max() <= 1 and (d > 0).mean() <= 1e-3


def test_gelu_mul():
    g, u = arr(3000), arr(3000)
    assert_bits_equal(emulate_recorded(K.gelu_mul, g, u), ffn.gelu_oracle(g, u, tanh=libm("tanhf")))


def test_fused_ffn_4r2s():
    """Whole SIMD groups return early on the last threadgroup (37 rows): allowed, no SIMD op is cut."""
    rows, k = 37, 768
    wg, wu = (mx.array(quantize(RNG.standard_normal((rows, k)).astype(F32), T.Q4_K)) for _ in range(2))
    x = arr(2, k)
    for act, kw in (("silu", {"exp": libm("expf")}), ("gelu_tanh", {"tanh": libm("tanhf")})):
        got = emulate_recorded(K.ffn_q4k_gate_up_4r2s, x, wg, wu, act)
        assert_bits_equal(got, ffn.ffn_4r2s_oracle(x, wg, wu, act, **kw))


# rsqrt: the GPU's is approximate, the emulator's 1.0f / sqrt(x); the oracles take it as an argument
RSQRT = lambda v: mx.array(1.0, mx.float32) / mx.sqrt(v)  # noqa: E731  two float32 roundings


def test_rms_norm_batch_with_the_emulators_rsqrt():
    x, w = arr(3, 1152), arr(1152)
    assert_bits_equal(emulate_recorded(K.rms_norm_batch, x, w), rms_norm.rms_norm_batch_oracle(x, w, 1e-5, RSQRT))


def test_tail_32sg_leaves_a_contraction_to_the_compiler():
    """A finding: the legacy tail's ``hidden + src * inv * w`` is not written as an fma().

    Its oracle models the GPU compilers, which contract it (fma(src*inv, w, hidden)); the text
    itself does not fix it. Emulated as written (no contraction) it gives the bits of an
    unfused model, not the oracle's; with contraction allowed it gives the oracle's.
    """
    n = 6656
    h, s, w1, w2 = arr(2, n), arr(2, n, scale=7), arr(n), arr(n)
    want_hid, want_out = norm_tail.tail_32sg_oracle(h, s, w1, w2, 1e-8, 1e-5, RSQRT)
    with mx.stream(mx.cpu):  # the oracle with the one add unfused
        inv_src = norm_tail._serial_32(s.reshape(2, -1, 4), n, 1e-8, RSQRT)
        unfused_hid = h + (s * inv_src) * w1
        unfused_out = (unfused_hid * norm_tail._serial_32(unfused_hid.reshape(2, -1, 4), n, 1e-5, RSQRT)) * w2
    hid, out = emulate_recorded(K.tail_32sg, h, s, w1, w2, 1e-8, 1e-5)
    assert_bits_equal(hid, unfused_hid)
    assert_bits_equal(out, unfused_out)
    assert (bits(hid) != bits(want_hid)).mean() > 0.05
    hid, out = emulate_recorded(K.tail_32sg, h, s, w1, w2, 1e-8, 1e-5, contract=True)
    assert_bits_equal(hid, want_hid)
    assert_bits_equal(out, want_out)


def test_contraction_does_not_change_the_explicit_fma_kernels():
    """The pinned kernels spell every contraction: allowing the compiler more changes no bit."""
    x, w, a = arr(2, 1152), arr(1152), arr(2, 1152)
    assert_bits_equal(emulate_recorded(K.rms_norm_mul, x, w, 1e-5, add=a, contract=True),
                      rms_norm.rms_norm_mul_oracle(x, w, 1e-5, a, K.norm_threads(1152, "llama")))
    q = mx.array(quantize(RNG.standard_normal((9, 512)).astype(F32), T.Q4_K))
    y = arr(2, 512)
    assert_bits_equal(emulate_recorded(K.mul_mv_q4_K, y, q, contract=True), mul_mv.mul_mv_q4_K_oracle(y, q))


# -- the negative control -------------------------------------------------------------------


def test_a_reordered_q4_K_accumulation_is_caught():
    """Swap two fma steps of the Q4_K scale accumulation (same math, another rounding order):
    the emulator gives other bits, close in value. Proves the comparisons above can fail."""
    w = mx.array(quantize(RNG.standard_normal((37, 768)).astype(F32), T.Q4_K))
    y = arr(3, 768)
    K.mul_mv_q4_K(y, w, which="record")
    launch = Kernel.recorded.pop()
    kernel = launch.pop("kernel")
    # the two lines live in the body or in a header helper, depending on the kernel's revision
    swapped = {}
    for part in ("header", "body"):
        text = getattr(kernel, part)
        lines = text.split("\n")
        ia = [i for i, ln in enumerate(lines) if re.match(r"\s*scaled = fma\(a0, ", ln)]
        ib = [i for i, ln in enumerate(lines) if re.match(r"\s*scaled = fma\(b0, ", ln)]
        if ia and ib:
            lines[ia[0]], lines[ib[0]] = lines[ib[0]], lines[ia[0]]
            text = "\n".join(lines)
        swapped[part] = text
    assert swapped["header"] + swapped["body"] != kernel.header + kernel.body, "the lines to swap were not found"
    altered = Inline(kernel.name, kernel.inputs, kernel.outputs, swapped["body"], swapped["header"])

    want = bits(mul_mv.mul_mv_q4_K_oracle(y, w)).reshape(-1)
    (same,) = emulate(kernel, **launch)
    (other,) = emulate(altered, **launch)
    np.testing.assert_array_equal(same.view(np.uint32).reshape(-1), want)
    assert (other.view(np.uint32).reshape(-1) != want).sum() >= 5
    np.testing.assert_allclose(other.reshape(-1), same.reshape(-1), rtol=1e-5, atol=1e-4)
