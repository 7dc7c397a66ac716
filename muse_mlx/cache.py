"""KV caches with float16 planes: a growing cache for global layers, a bounded one for sliding layers.

llama.cpp stores K and V as f16 (K after QK-norm and RoPE, V straight from its projection)
and attention always reads the cache, the current token included; the model rounds to
f16 before calling :meth:`update_and_fetch`, so both caches only store what they are given.
"""

from __future__ import annotations

import mlx.core as mx


class _Planes:
    """What both caches share: the K and V planes and their size."""

    keys = None
    values = None

    @property
    def state(self):
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


class KVCache(_Planes):
    """All positions, in buffers grown in steps of ``step`` tokens and written by slice."""

    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    @property
    def n_kept(self) -> int:
        """Past positions the next update will attend to."""
        return self.offset

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        B, H, T, D = k.shape
        start = self.offset
        if self.keys is None or start + T > self.keys.shape[2]:
            cap = ((start + T + self.step - 1) // self.step) * self.step
            grow_k = mx.zeros((B, H, cap, D), dtype=k.dtype)
            grow_v = mx.zeros((B, H, cap, v.shape[-1]), dtype=v.dtype)
            if self.keys is not None:
                grow_k[..., :start, :] = self.keys[..., :start, :]
                grow_v[..., :start, :] = self.values[..., :start, :]
            self.keys, self.values = grow_k, grow_v
        self.keys[..., start : start + T, :] = k
        self.values[..., start : start + T, :] = v
        self.offset = start + T
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


class SlidingKVCache(_Planes):
    """Only the last ``window - 1`` positions survive an update: the next query can see no further back.

    Keys stay in temporal order (old, then new), so masks are simple and the sum order of
    attention matches the full forward.
    """

    def __init__(self, window: int):
        self.window = window
        self.keys = None
        self.values = None
        self.offset = 0

    @property
    def n_kept(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        self.offset += k.shape[2]
        if self.n_kept > 0:
            k = mx.concatenate([self.keys, k], axis=2)
            v = mx.concatenate([self.values, v], axis=2)
        total = k.shape[2]
        start = total - min(max(self.window - 1, 0), total)
        self.keys, self.values = k[..., start:, :], v[..., start:, :]
        return k, v


def make_cache(config) -> list:
    """One cache per layer: sliding layers get a bounded cache, global layers a growing one."""
    return [SlidingKVCache(config.sliding_window) if swa else KVCache() for swa in config.swa_layers]
