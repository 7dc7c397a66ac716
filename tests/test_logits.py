"""The logits' statistics (muse_mlx/kernels/logits.py): the kernels' text in the CPU emulator against
their order's oracle, bit for bit; that order and the CPU path against float64 and numpy's argmax;
and generation taking its token, log-probabilities and finite check from them."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from kernel_emulator import available, emulate_recorded
from test_kernel_emulator import assert_bits_equal, libm

from muse_mlx.generate import next_token
from muse_mlx.kernels import logits as L
from muse_mlx.sampling import greedy, make_sampler

emulator = pytest.mark.skipif(not available(), reason="needs g++ with C++20 (<barrier>) and _Float16")
SPAN = L.GROUPS * L.THREADS  # values one pass of the first kernel's threads covers


# A tied maximum where the merge's incoming state holds the lower index (the first must win), at each
# level of the merges: two values of one thread; lanes of one SIMD group (lane 0 holds index
# 8 + SPAN and takes lane 7's state last); SIMD groups of one threadgroup; two threadgroups.
TIES = [(7, 7 + SPAN), (7, 8 + SPAN), (32, 3 + SPAN), (256, 5 + SPAN)]


def rows_with_edges(n: int, rng) -> np.ndarray:
    """Ordinary rows, a maximum tied (where n reaches past one pass: each of TIES, else two values),
    an -inf, a NaN, an Inf, a row of one value, and a row of -inf only."""
    ties = [t for t in TIES if t[1] < n] or [(7, n - 1)]
    x = (4.0 * rng.standard_normal((6 + len(ties), n))).astype(np.float32)
    x[1, 3] = -np.inf
    x[2, n // 2] = np.nan
    x[3, n // 3] = np.inf
    x[4, :] = 1.5
    x[5, :] = -np.inf
    for r, (first, other) in enumerate(ties, start=6):
        x[r, [other, first]] = 40.0
    return x


def sums(x: np.ndarray) -> np.ndarray:
    """The rows whose log-sum-exp means something: no NaN or +inf, and not -inf only."""
    return ~np.isnan(x).any(axis=1) & ~np.isposinf(x).any(axis=1) & (x > -np.inf).any(axis=1)


def lse64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    return (top + np.log(np.exp(x - top).sum(axis=1, keepdims=True)))[:, 0]


def first_argmax(x: np.ndarray) -> np.ndarray:
    return np.argmax(x, axis=1)  # numpy: the first index of the maximum


@emulator
@pytest.mark.parametrize("n", [40, SPAN + 4 * 997])  # most threads idle; past one pass (a second round of four loads)
def test_kernels_are_their_order_bit_for_bit(n):
    """The two kernels' text against logit_stats_oracle given the emulator's expf and logf (every row
    launches 65,536 threads here, which is what these tests spend their time on)."""
    x = mx.array(rows_with_edges(n, np.random.default_rng(n)))
    got = emulate_recorded(L.logit_stats, x)
    want = L.logit_stats_oracle(x, exp=libm("expf"), log=libm("logf"))
    assert_bits_equal(got.token, want.token)
    assert_bits_equal(got.finite, want.finite)
    live = np.flatnonzero(sums(np.array(x)))  # the -inf row included
    assert live.size == x.shape[0] - 3  # all but the NaN, +inf and -inf-only rows
    assert_bits_equal(np.array(got.lse)[live], np.array(want.lse)[live])
    assert np.array(got.token)[5] == 0 and np.array(got.lse)[5] == -np.inf  # -inf only


@pytest.mark.parametrize("n", [5, 300, 70_001, 202_048])
def test_the_order_and_the_cpu_path_against_float64(n):
    """Both give numpy's first argmax and the finite flag exactly. The log-sum-exp: the kernels'
    order merges at most 4 + 16 times (16 tree levels, steps of four values a thread), each within a
    few float32 roundings and exp's error, so its relative error in the sum stays below 1e-5 and the
    log's absolute error with it; the CPU path sums in float64 (one rounding of the result and
    of each exp). MLX's own CPU logsumexp is 3.5e-4 off at 202,048 values: what the float64 sum is for."""
    x = rows_with_edges(n, np.random.default_rng(1)) if n >= 16 else \
        (4.0 * np.random.default_rng(1).standard_normal((3, n))).astype(np.float32)
    finite = np.isfinite(x).all(axis=1)
    for name, stats in (("oracle", L.logit_stats_oracle(mx.array(x))), ("cpu", L.logit_stats(mx.array(x), which="cpu"))):
        np.testing.assert_array_equal(np.array(stats.finite), finite.astype(np.uint32), err_msg=name)
        live = np.flatnonzero(~np.isnan(x).any(axis=1))  # (a NaN's place is where the two differ)
        np.testing.assert_array_equal(np.array(stats.token)[live], first_argmax(x[live]), err_msg=name)
        live = np.flatnonzero(sums(x))  # -inf values included: left out of the sum
        err = np.abs(np.array(stats.lse, np.float64)[live] - lse64(x[live]))
        assert err.max() <= 1e-5, (name, err.max())
    if n >= 16:
        ties = [t for t in TIES if t[1] < n] or [(7, n - 1)]
        assert np.array(L.logit_stats_oracle(mx.array(x[6:])).token).tolist() == [first for first, _ in ties]
        assert np.array(L.logit_stats(mx.array(x[5:6]), which="cpu").lse).tolist() == [-np.inf]  # -inf only


def test_a_row_without_any_value_is_an_error():
    for shape in ((2, 0), (0, 5)):
        with pytest.raises(ValueError, match="at least one row of at least one value"):
            L.logit_stats(mx.zeros(shape))
    with pytest.raises(ValueError, match="at most 65535 rows"):
        L.logit_stats(mx.zeros((65_536, 1)))


def test_the_mode_switch_is_checked(monkeypatch):
    """The kernels by default, except on Metal until a Mac has run them (every route's generation
    reads its logits through them); the switch overrides, and a bad value names itself."""
    monkeypatch.delenv("MUSE_MLX_LOGITS", raising=False)
    assert [L.logits_mode(w) for w in ("cuda", "metal", "emulate")] == ["kernel", "mlx", "kernel"]
    monkeypatch.setenv("MUSE_MLX_LOGITS", "kernel")
    assert L.logits_mode("metal") == "kernel"
    monkeypatch.setenv("MUSE_MLX_LOGITS", "fast")
    with pytest.raises(ValueError, match="MUSE_MLX_LOGITS='fast'"):
        L.logits_mode()


def test_next_token_greedy_and_sampled():
    """Greedy: the logits' own first argmax (not of the log-probabilities, where two values one ulp
    apart can round to one); the log-probabilities are logits - lse; a sampler reads those."""
    rng = np.random.default_rng(3)
    x = (3.0 * rng.standard_normal((2, 1000))).astype(np.float32)
    x[0, 10], x[0, 20] = 30.0, np.nextafter(np.float32(30.0), np.float32(31.0))  # 20 is the larger by one ulp
    token, logprobs, finite = next_token(mx.array(x))
    assert np.array(token).tolist() == [20, int(np.argmax(x[1]))]
    np.testing.assert_allclose(np.array(logprobs, np.float64), x - lse64(x)[:, None], atol=2e-5)
    assert np.array(finite).tolist() == [1, 1]
    seen = []
    token, lp, _ = next_token(mx.array(x), lambda logprobs: seen.append(logprobs) or mx.array([1, 2], dtype=mx.uint32))
    assert seen and seen[0] is lp and np.array(token).tolist() == [1, 2]
    assert make_sampler(0.0) is greedy
