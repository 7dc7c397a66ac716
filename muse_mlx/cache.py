"""KV caches with float16 planes: a growing buffer for global layers, a ring for sliding layers.

llama.cpp stores K and V as f16 (K after QK-norm and RoPE, V straight from its projection)
and attention always reads the cache, the current token included; the model rounds to
f16 before writing, so the caches only store what they are given.

Both caches keep K and V in ONE array ``kv [2, B, Hkv, capacity, D]`` (K then V), written in
place by a slice update (prefill) or a scatter, or on the decode path handed out whole by the
attention with the token's slot written (:func:`kv_write_mode`), so the decode attention kernel
reads both planes from one buffer. Position ``p`` lives in slot ``p`` of a global layer's
buffer and in slot ``p % window`` of a sliding layer's ring.
"""

from __future__ import annotations

import os

import mlx.core as mx


def kv_write_mode() -> str:
    """How a decoded token's K/V reach its cache where the attention takes the token's Q/K-norms
    and RoPE in (``MUSE_MLX_KV_WRITE``; the attention reads the token's own K/V from registers, so
    nothing in the forward waits for the write):

    * ``through`` (the default): the attention hands the planes out whole, with the token's slot
      written, and the cache takes them as its planes: no write follows (THRU in
      ``attention.metal``; copy threadgroups of its own copy the other rows). On the H200 a token
      launches 52 kernels fewer and the GPU waits far less for the host (twenty-seventh session,
      docs/performance-history.md: the q8 route 167.7 tok/s, the exact one 129.7-129.8 against 128.0-128.2);
    * ``layer``: the attention hands the token's K/V out and a scatter writes them into the
      planes right after it.

    The values in the planes are the same either way. (Until then the K/V were written after the
    forward, in a CUDA graph of their own: the scatters a token cost 0.11 ms of GPU time and 52
    launches of host time, and the graph's shape moved with the GPU's progress, so MLX instantiated
    new ones now and then; twenty-sixth and twenty-seventh sessions.)"""
    mode = os.environ.get("MUSE_MLX_KV_WRITE", "through")
    if mode not in ("through", "layer"):
        raise ValueError(f"MUSE_MLX_KV_WRITE={mode!r}: expected through or layer")
    return mode


class _Planes:
    """What both caches share: the planes, the position count, the in-place write."""

    kv = None
    offset = 0
    window = 0  # 0: every past position stays visible
    step = 256  # planes grow this many slots at a time

    def _slots_for(self, total: int) -> int:
        """``total`` positions' slots, rounded up to ``step``."""
        return -(-total // self.step) * self.step

    @property
    def keys(self) -> mx.array | None:
        return None if self.kv is None else self.kv[0]

    @property
    def values(self) -> mx.array | None:
        return None if self.kv is None else self.kv[1]

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else self.kv.shape[3]

    @property
    def state(self):
        return [] if self.kv is None else [self.kv]

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.nbytes

    def reserve_for(self, cfg, total: int, dtype=mx.float16) -> None:
        """Batch-1 planes with room for ``total`` positions (the decode path's allocation)."""
        self.reserve((1, cfg.n_head_kv, cfg.head_dim), dtype, total)

    def _allocate(self, shape: tuple[int, int, int], dtype, capacity: int) -> None:
        """Planes of ``capacity`` slots for ``shape = (B, H, D)`` (old contents kept)."""
        B, H, D = shape
        grown = mx.zeros((2, B, H, capacity, D), dtype=dtype)
        if self.kv is not None:
            grown[:, :, :, : self.capacity, :] = self.kv
        self.kv = grown
        self._geometry = None

    def _write(self, k: mx.array, v: mx.array, slot: int) -> None:
        """K/V ``[B, H, T, D]`` into slots ``slot .. slot+T-1`` (no wrap)."""
        T = k.shape[2]
        self.kv[:, :, :, slot : slot + T, :] = mx.stack([k, v])

    def write_token(self, kv16: mx.array, slot) -> None:
        """The decode path's write: ``kv16 [2, B, H, 1, D]`` into one slot (an int or an int32 [1] array).

        An array slot is not bounds-checked by MLX (an out-of-range one writes past the planes):
        callers pass ``self.slot(position)`` for a position below the reserved capacity.

        The array form is a scatter (``put_along_axis``), not ``mx.slice_update``: MLX 0.32's
        CUDA dynamic slice update launches one thread per element of the whole destination, each
        rewriting the update (22 us per layer and token at 4 MB planes on the H200, measured with
        ``scripts/gpu_timeline.py``), where the scatter's threads are the update's 2*H*D values."""
        if isinstance(slot, int):
            self.kv[:, :, :, slot : slot + 1, :] = kv16
        else:
            self.kv = mx.put_along_axis(self.kv, slot.reshape((1,) * self.kv.ndim), kv16, axis=3)

    def decode_geometry(self) -> mx.array:
        """The decode attention kernel's constant arguments for these planes (made once per size)."""
        from .kernels.attention import decode_geometry

        if getattr(self, "_geometry", None) is None:
            self._geometry = decode_geometry(self.capacity, self.window)
        return self._geometry


def _plane_shape(k: mx.array) -> tuple[int, int, int]:
    """``(B, H, D)`` of K/V ``[B, H, T, D]``."""
    B, H, _, D = k.shape
    return B, H, D


class KVCache(_Planes):
    """Global layers: all positions, in a buffer grown ``step`` slots at a time (or reserved once)."""

    def __init__(self):
        self.kv = None
        self.offset = 0

    @property
    def n_kept(self) -> int:
        """Past positions the next update will attend to."""
        return self.offset

    def reserve(self, shape: tuple[int, int, int], dtype, total: int) -> None:
        """Make room for ``total`` positions of ``shape = (B, H, D)`` now, so decoding never reallocates."""
        if total > self.capacity:
            self._allocate(shape, dtype, self._slots_for(total))

    def slot(self, position: int) -> int:
        return position

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        start, T = self.offset, k.shape[2]
        self.reserve(_plane_shape(k), k.dtype, start + T)
        self._write(k, v, start)
        self.offset = start + T
        return self.kv[0, :, :, : self.offset, :], self.kv[1, :, :, : self.offset, :]


class RingKVCache(_Planes):
    """Sliding layers: the last ``window`` positions in a ring of ``window`` slots.

    A query sees the ``window - 1`` positions before it and itself, so that is all a ring of
    ``window`` slots must hold. Prefill chunks get their keys in temporal order (the kept
    positions gathered from the ring, then the new ones), so masks stay simple.

    Until the positions reach the window, the planes hold only as many slots as they need
    (``step`` at a time): no position has wrapped yet, so growing keeps every slot where it is.
    A short generation's sliding layers then take the one-dispatch decode attention
    (:func:`muse_mlx.kernels.attention.fused_fits`) and less memory.
    """

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"a sliding window must be at least 1, got {window}")
        self.window = window
        self.kv = None
        self.offset = 0

    @property
    def n_kept(self) -> int:
        return min(self.offset, self.window - 1)

    def reserve(self, shape: tuple[int, int, int], dtype, total: int) -> None:
        """Room for positions ``0 .. total - 1``: ``total`` slots rounded up to ``step``, at most the window."""
        need = min(self.window, self._slots_for(max(total, 1)))
        if need > self.capacity:
            self._allocate(shape, dtype, need)

    def slot(self, position: int) -> int:
        return position % self.window

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        T, start, kept = k.shape[2], self.offset, self.n_kept
        self.reserve(_plane_shape(k), k.dtype, start + T)
        if T == 1:
            # one new token: every slot written so far is visible to it, in whatever order
            self._write(k, v, self.slot(start))
            self.offset = start + 1
            n = min(self.offset, self.window)
            return self.kv[0, :, :, :n, :], self.kv[1, :, :, :n, :]
        if kept:
            slots = mx.array([self.slot(p) for p in range(start - kept, start)])
            old = mx.take(self.kv, slots, axis=3)
            keys, values = mx.concatenate([old[0], k], axis=2), mx.concatenate([old[1], v], axis=2)
        else:
            keys, values = k, v
        # keep the last `window` new positions; a run that wraps is written in two pieces
        m = min(T, self.window)
        first = start + T - m
        s0 = self.slot(first)
        head = min(m, self.window - s0)
        self._write(k[:, :, T - m : T - m + head], v[:, :, T - m : T - m + head], s0)
        if head < m:
            self._write(k[:, :, T - m + head :], v[:, :, T - m + head :], 0)
        self.offset = start + T
        return keys, values


def make_cache(config) -> list:
    """One cache per layer: sliding layers get a ring of ``window`` slots, global layers a growing buffer."""
    return [RingKVCache(config.sliding_window) if swa else KVCache() for swa in config.swa_layers]
