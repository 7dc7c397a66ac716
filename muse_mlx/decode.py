"""The decode step: one token through the model on preallocated caches, optionally compiled.

:class:`DecodeStep` owns what changes from token to token -- the position, each cache's write
slot, the planes -- and passes them as arrays, so the graph of a step has the same shapes
every time. That is what lets ``mx.compile`` trace it once and replay it: Python then does
no per-op work for a token at all (the route's kernels are already built into the tape).
"""

from __future__ import annotations

import os

import mlx.core as mx

from .cache import RingKVCache
from .kernels import backend
from .kernels.backend import in_device_memory


def position_array(offset: int) -> mx.array:
    """A token's position as the decode path passes it: four equal int32s in device memory (a
    one-element array would live in MLX's managed scalar pool, which kernels may read across
    PCIe on CUDA: kernels.backend.SCALAR_POOL_BYTES); the model reads element 0 through a view."""
    return in_device_memory(mx.array([offset] * 4, dtype=mx.int32))


def kv_write_mode() -> str:
    """Where a :class:`DecodeStep` writes the K/V that the attention hands out (the attention with
    its norms reads the token's own from registers, so nothing in the forward waits for the
    write): after the forward, in a graph of their own (``MUSE_MLX_KV_WRITE=end``, the default), the
    same with every plane copied first (``end-copy``), or right after each attention (``layer``, as
    the model's own call does).

    Why ``end-copy``: MLX keeps a kernel's inputs alive until its graph has run, so after the
    forward a plane can be donated to its write only if the GPU has finished that layer, and MLX
    copies the others first; how many depends on the GPU's progress, so the writes' CUDA graph
    changes shape from token to token and MLX instantiates a new one now and then (1-1.6 ms of host
    time on the H200, docs/performance.md, twenty-sixth session). Copying every plane gives the
    graph one shape. The values written are the same in every mode."""
    mode = os.environ.get("MUSE_MLX_KV_WRITE", "end")
    if mode not in ("end", "end-copy", "layer"):
        raise ValueError(f"MUSE_MLX_KV_WRITE={mode!r}: expected end, end-copy or layer")
    return mode


def writes_after_forward() -> bool:
    """Whether the K/V writes come after the forward (:func:`kv_write_mode` ``end`` or ``end-copy``)."""
    return kv_write_mode() != "layer"


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
        self._write_fn = mx.compile(self._write) if self.compiled else self._write
        self._pos, self._offset = None, None
        self._deferred = None  # per cache, whether the step hands out its K/V for _write (set when traced)

    def _slots(self, pos4):
        # The position is four equal int32s (position_array), and so is each ring's slot; the model
        # reads element 0 of each through a view. A global layer's slot is the position itself, a sliding layer's the position in its
        # ring (one op per window size, not per layer).
        pos = pos4[:1]
        rings = {c.window: (pos4 % c.window)[:1] for c in self.cache if isinstance(c, RingKVCache)}
        return pos, [rings[c.window] if isinstance(c, RingKVCache) else pos for c in self.cache]

    def _step(self, token, pos4, *planes):
        """The forward: logits, the next position, and per cache its planes (written) or the token's
        K/V that the attention handed out (:func:`writes_after_forward`), for :meth:`_write`."""
        defer = writes_after_forward()
        for c, p in zip(self.cache, planes):
            c.kv, c.deferred, c.defer_writes = p, None, defer
        pos, slots = self._slots(pos4)
        try:
            logits = self.model(token, self.cache, last_only=True, positions=(pos, slots))
        finally:
            for c in self.cache:
                c.defer_writes = False
        self._deferred = [c.deferred is not None for c in self.cache]
        outs = tuple(c.kv if c.deferred is None else c.deferred[0] for c in self.cache)
        for c in self.cache:
            c.deferred = None
        return (logits[0, -1], pos4 + 1) + outs

    def _write(self, pos4, *args):
        """The K/V that :meth:`_step` handed out, written into the planes at the token's slots."""
        n = len(self.cache)
        _, slots = self._slots(pos4)
        for c, plane, out, slot, deferred in zip(self.cache, args[:n], args[n:], slots, self._deferred):
            if deferred:
                c.kv = plane
                c.write_token(out, slot)
            else:
                c.kv = out
        return tuple(c.kv for c in self.cache)

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
        deferred = any(self._deferred)
        if deferred:
            # The forward first, on its own: then its CUDA graphs are one chain of kernels. With the
            # writes among them, each write would branch off the chain, and a graph runs a branch on
            # another stream: the chain's next launches then wait across streams (1.2-1.6 us more
            # before several kernels a layer on the H200, which ate what the fusion saved).
            mx.async_eval(logits, self._pos)
            outs = self._write_fn(pos, *planes, *outs)
        # Dropping the old planes' last references but the writes' own lets each write reuse its
        # buffer where the GPU is done with it (else MLX copies the plane first); end-copy holds them
        # until the writes are queued, so that every plane is copied (kv_write_mode).
        keep = planes if deferred and kv_write_mode() == "end-copy" else None
        del planes
        for c, p in zip(self.cache, outs):
            c.kv = p
            c.offset += 1
        if deferred:
            mx.async_eval(outs)
        del keep
        self._offset = offset + 1
        return logits
