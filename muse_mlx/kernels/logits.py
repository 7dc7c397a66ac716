"""The logits' statistics (``logits.metal``): a row's argmax, log-sum-exp and whether it is finite.

What generation reads from a token's logits besides the logits themselves: the greedy pick, the
log-sum-exp that makes them log-probabilities, and the check that stops on NaN or Inf. With
MLX's ops that is ``logsumexp``, the subtraction, ``argmax``, ``isfinite`` and ``all``: five
launches, and MLX's
argmax over a 202,048-value row alone took 22-33 µs on the H200 (one threadgroup reads the row;
docs/performance-history.md). :func:`logit_stats` reads it once with 256 threadgroups and merges their
states in a second launch.

Not pinned: llama.cpp's samplers are not reproduced. The argmax is exact by definition (the first
index of the maximum, as ``mx.argmax``); the log-sum-exp is a fixed order of our own (each thread
an online sum of ``exp(v - m)`` over its values, then trees of merges; ``logits.metal``), the same
on every GPU, and :func:`logit_stats_oracle` performs that order on the CPU for the tests. Without
a GPU the function is MLX's argmax and isfinite and a float64 sum (:func:`_cpu_stats`): the same
token and flag, the log-sum-exp within rounding of the kernel's (a GPU's ``exp`` is not the CPU's
either way). ``MUSE_MLX_LOGITS=mlx`` gives MLX's own ops on a GPU too, to compare; on Metal they are
the default until the kernels have run on a Mac (:func:`logits_mode`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import mlx.core as mx

from . import fp
from .backend import Kernel, backend
from .fp import CPU

F32 = mx.float32
THREADS = 256  # LOGIT_THREADS in logits.metal: 8 SIMD groups, in both kernels
GROUPS = THREADS  # threadgroups a row in the first pass: the second merges their states, one a thread
NONE = 0xFFFFFFFF  # LOGIT_NONE: no index yet
MAX_VALUES = 1 << 31  # values a row: the first pass's 32-bit indices step 4 * 65,536 past the last
MAX_ROWS = 65_535  # rows are the grid's y axis (CUDA's limit)
MODES = ("kernel", "mlx")

_PARTIAL = Kernel("logits", "logit_stats_partial", ["logits"], ["part_m", "part_s", "part_idx", "part_bad"])
_COMBINE = Kernel("logits", "logit_stats_combine", ["part_m", "part_s", "part_idx", "part_bad"],
                  ["token", "lse", "finite"])
KERNELS = (_PARTIAL, _COMBINE)


class LogitStats(NamedTuple):
    """Per row of logits: ``token`` (uint32, the first index of the maximum), ``lse`` (float32,
    the log-sum-exp) and ``finite`` (uint32, 1 where every value is finite, else 0).

    Where a row is not finite the others are what the kernels' order makes of it, not MLX's: its
    argmax skips NaN (MLX's returns a NaN's index), a +inf gives a NaN log-sum-exp (MLX's: +inf);
    -inf values are left out of the sum, as they should be, and a row of -inf only gives token 0 and
    -inf. Generation stops on any row that is not finite."""

    token: mx.array
    lse: mx.array
    finite: mx.array


def logits_mode(which: str | None = None) -> str:
    """``MUSE_MLX_LOGITS``: ``kernel`` (:func:`logit_stats`'s two launches) or ``mlx`` (MLX's argmax,
    logsumexp and isfinite). Default: the kernels, except on Metal (backend ``which``), where they
    have not been compiled yet and every route's generation, the stock one too, would depend on
    them: Metal keeps MLX's ops until a Mac has run ``scripts/gpu_check.py --only logits``."""
    default = "mlx" if (which or backend()) == "metal" else "kernel"
    mode = (os.environ.get("MUSE_MLX_LOGITS") or default).lower()
    if mode not in MODES:
        raise ValueError(f"MUSE_MLX_LOGITS={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def logit_stats(logits: mx.array, which=None) -> LogitStats:
    """:class:`LogitStats` of each row (the last axis) of ``logits``; leading axes are kept."""
    if logits.ndim < 1 or logits.size == 0:
        raise ValueError(f"logits need at least one row of at least one value, got shape {logits.shape}")
    n, lead = logits.shape[-1], logits.shape[:-1]
    if n > MAX_VALUES or logits.size // n > MAX_ROWS:
        raise ValueError(f"logits of shape {logits.shape}: at most {MAX_ROWS} rows of {MAX_VALUES} values")
    which = which or backend()
    if which == "cpu":
        return _cpu_stats(logits)
    if logits_mode(which) == "mlx":
        x = logits.astype(F32)
        return LogitStats(mx.argmax(x, axis=-1), mx.logsumexp(x, axis=-1),
                          mx.isfinite(x).all(axis=-1).astype(mx.uint32))
    rows = logits.size // n
    x = logits.astype(F32)  # rows read in place
    parts = _PARTIAL([x], [(rows * GROUPS,)] * 4, [F32, F32, mx.uint32, mx.uint32],
                     grid=(GROUPS * THREADS, rows, 1), threadgroup=(THREADS, 1, 1),
                     template=[("N", n), ("G", GROUPS)], which=which)
    token, lse, finite = _COMBINE(parts, [(rows,)] * 3, [mx.uint32, F32, mx.uint32],
                                  grid=(THREADS, rows, 1), threadgroup=(THREADS, 1, 1),
                                  template=[("G", GROUPS)], which=which)
    return LogitStats(token.reshape(lead), lse.reshape(lead), finite.reshape(lead))


def _cpu_stats(logits: mx.array) -> LogitStats:
    """Without a GPU: MLX's argmax and isfinite, and the log-sum-exp with its sum of exp(v - max)
    taken in float64 (MLX's CPU ``logsumexp`` and ``sum`` add float32 values one after another: 3.5e-4
    off at 202,048 values, against 1e-7 so; the kernels' own order, :func:`logit_stats_oracle`, costs
    12 ms or more a row here)."""
    with mx.stream(CPU):
        x = logits.astype(F32)
        m = mx.max(x, axis=-1, keepdims=True)
        m = mx.where(m == -mx.inf, mx.array(0.0, F32), m)  # a row of -inf only: log(0) = -inf, not NaN
        total = mx.sum(mx.exp(x - m).astype(mx.float64), axis=-1)
        lse = (m[..., 0].astype(mx.float64) + mx.log(total)).astype(F32)
        return LogitStats(mx.argmax(x, axis=-1), lse, mx.isfinite(x).all(axis=-1).astype(mx.uint32))


# -- the kernels' order on the CPU -----------------------------------------------------------


def _weight(a: mx.array, m: mx.array, exp) -> mx.array:
    """``logit_weight``: exp(a - m), and 0 where a is -inf."""
    return mx.where(a == -mx.inf, mx.array(0.0, F32), exp(a - m))


def _merge(a: tuple, b: tuple, exp) -> tuple:
    """``logit_merge`` of state ``b`` into state ``a`` (each (m, s, idx, bad), elementwise)."""
    (m, s, idx, bad), (m2, s2, i2, b2) = a, b
    take = (m2 > m) | ((m2 == m) & (i2 < idx))
    mm = mx.where(take, m2, m)
    s = fp.fma(s, _weight(m, mm, exp), s2 * _weight(m2, mm, exp))
    return mm, s, mx.where(take, i2, idx), bad + b2


def _tree(state: tuple, exp) -> tuple:
    """A SIMD group's merges over the last axis (32 lanes): the lower half first at every step."""
    while state[0].shape[-1] > 1:
        half = state[0].shape[-1] // 2
        state = _merge(tuple(t[..., :half] for t in state), tuple(t[..., half:] for t in state), exp)
    return tuple(t[..., 0] for t in state)


def _empty(shape) -> tuple:
    return (mx.full(shape, -mx.inf, F32), mx.zeros(shape, F32), mx.full(shape, NONE, mx.uint32),
            mx.zeros(shape, mx.uint32))


def _group(state: tuple, exp) -> tuple:
    """``logit_group_merge`` over the last axis (THREADS threads): each SIMD group's tree, then
    the groups' roots padded to 32 with empty states and merged by one more tree."""
    lead = state[0].shape[:-1]
    roots = _tree(tuple(t.reshape(*lead, THREADS // 32, 32) for t in state), exp)
    pad = _empty((*lead, 32 - THREADS // 32))
    return _tree(tuple(mx.concatenate([r, p], axis=-1) for r, p in zip(roots, pad)), exp)


def logit_stats_oracle(logits: mx.array, exp=mx.exp, log=mx.log) -> LogitStats:
    """The two kernels' operations in their order, with ``exp`` and ``log`` as given (the GPU's
    are not the CPU's: the emulator's tests pass the C library's)."""
    n, lead = logits.shape[-1], logits.shape[:-1]
    with mx.stream(CPU):
        x = logits.astype(F32).reshape(-1, n)
        rows, span = x.shape[0], GROUPS * THREADS
        steps = -(-n // span)
        x = mx.pad(x, [(0, 0), (0, steps * span - n)])
        m, s, idx, bad = _empty((rows, span))
        j = mx.arange(span, dtype=mx.uint32)
        for k in range(steps):  # each thread's values in index order
            v = x[:, k * span:(k + 1) * span]
            i = j + k * span
            live = i < n
            bad = bad + (live & ~mx.isfinite(v)).astype(mx.uint32)
            up = live & (v > m)
            stay = live & ~up
            s = mx.where(up, fp.fma(s, _weight(m, v, exp), mx.array(1.0, F32)),
                         mx.where(stay, s + _weight(v, m, exp), s))
            m, idx = mx.where(up, v, m), mx.where(up, i, idx)
        block = _group(tuple(t.reshape(rows, GROUPS, THREADS) for t in (m, s, idx, bad)), exp)
        m, s, idx, bad = _group(block, exp)
        token = mx.where(idx == NONE, mx.array(0, mx.uint32), idx)
        return LogitStats(token.reshape(lead), (m + log(s)).reshape(lead),
                          (bad == 0).astype(mx.uint32).reshape(lead))
