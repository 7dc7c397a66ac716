"""The decode step: one token through the model on preallocated caches, optionally compiled.

:class:`DecodeStep` owns what changes from token to token -- the position, each cache's write
slot, the planes -- and passes them as arrays, so the graph of a step has the same shapes
every time. That is what lets ``mx.compile`` trace it once and replay it: Python then does
no per-op work for a token at all (the route's kernels are already built into the tape).
"""

from __future__ import annotations

import mlx.core as mx

from .cache import RingKVCache
from .kernels import backend
from .kernels.backend import in_device_memory


def position_array(offset: int) -> mx.array:
    """A token's position as the decode path passes it: four equal int32s in device memory (a
    one-element array would live in MLX's managed scalar pool, which kernels may read across
    PCIe on CUDA: kernels.backend.SCALAR_POOL_BYTES); the model reads element 0 through a view."""
    return in_device_memory(mx.array([offset] * 4, dtype=mx.int32))


class DecodeStep:
    """``step(token) -> logits [vocab]`` for batch 1, advancing ``cache`` by one position.

    ``compiled=True`` replays one traced graph (``mx.compile``); the route must have the
    one-token decode path (:meth:`muse_mlx.model.Model.uses_decode_path`). ``capacity``
    positions are reserved up front so the planes never reallocate (a new size would mean
    a new trace).
    """

    def __init__(self, model, cache: list, capacity: int, compiled: bool | None = None):
        self.model, self.cache = model, cache
        if not model.uses_decode_path(mx.zeros((1, 1), dtype=mx.int32), cache):
            raise ValueError(f"the {model.route.describe()} route has no one-token decode path for this model")
        model.prepare_decode(cache, capacity)
        self.capacity = capacity
        # The CPU oracles read the position back to the host (.item()), which a trace cannot do.
        self.compiled = backend() != "cpu" if compiled is None else compiled
        self._fn = mx.compile(self._step) if self.compiled else self._step
        self._pos, self._offset = None, None

    def _slots(self, pos4):
        # The position is four equal int32s (position_array), and so is each ring's slot; the model
        # reads element 0 of each through a view. A global layer's slot is the position itself, a sliding layer's the position in its
        # ring (one op per window size, not per layer).
        pos = pos4[:1]
        rings = {c.window: (pos4 % c.window)[:1] for c in self.cache if isinstance(c, RingKVCache)}
        return pos, [rings[c.window] if isinstance(c, RingKVCache) else pos for c in self.cache]

    def _step(self, token, pos4, *planes):
        """The forward: logits, the next position, and each cache's planes, the token's K/V in them
        (handed out whole by the attention, or written after it: cache.kv_write_mode)."""
        for c, p in zip(self.cache, planes):
            c.kv = p
        pos, slots = self._slots(pos4)
        logits = self.model(token, self.cache, last_only=True, positions=(pos, slots))
        return (logits[0, -1], pos4 + 1) + tuple(c.kv for c in self.cache)

    def __call__(self, token: mx.array) -> mx.array:
        offset = self.cache[0].offset
        if offset >= self.capacity:
            raise ValueError(f"the decode step was prepared for {self.capacity} positions")
        # The position lives on the device and each step returns the next one, so a token costs
        # no upload; it is rebuilt only when the caches moved without this step (a new prompt).
        if self._pos is None or self._offset != offset:
            self._pos = position_array(offset)
        pos, planes = self._pos, [c.kv for c in self.cache]  # (a trace leaves its placeholders in the caches)
        logits, self._pos, *outs = self._fn(token.reshape(1, 1).astype(mx.int32), pos, *planes)
        # Dropping the old planes' last references lets a write into them (MUSE_MLX_KV_WRITE=layer)
        # reuse their buffers where the GPU is done with them (else MLX copies a plane first).
        del planes
        for c, p in zip(self.cache, outs):
            c.kv = p
            c.offset += 1
        self._offset = offset + 1
        return logits
