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


def rows_with_edges(n: int, rng) -> np.ndarray:
    """Ordinary rows, a maximum tied across threadgroups (the first index must win), an -inf, a NaN,
    an Inf, a row of one value, and a row of -inf only."""
    x = (4.0 * rng.standard_normal((7, n))).astype(np.float32)
    x[1, [n - 1, 7, min(7 + SPAN, n - 2)]] = 40.0
    x[2, 3] = -np.inf
    x[3, n // 2] = np.nan
    x[4, n // 3] = np.inf
    x[5, :] = 1.5
    x[6, :] = -np.inf
    return x


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
    live = np.flatnonzero(np.array(want.finite))
    assert live.size >= 2
    assert_bits_equal(np.array(got.lse)[live], np.array(want.lse)[live])


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
        live = np.flatnonzero(finite)
        np.testing.assert_array_equal(np.array(stats.token)[live], first_argmax(x[live]), err_msg=name)
        err = np.abs(np.array(stats.lse, np.float64)[live] - lse64(x[live]))
        assert err.max() <= 1e-5, (name, err.max())
    tie = x[1] if n >= 16 else None
    if tie is not None:  # the tied maximum: the first of its indices, also where the row has other values
        assert int(L.logit_stats_oracle(mx.array(tie[None])).token[0]) == 7


def test_a_row_without_any_value_is_an_error():
    with pytest.raises(ValueError, match="at least one value"):
        L.logit_stats(mx.zeros((2, 0)))


def test_the_mode_switch_is_checked(monkeypatch):
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
