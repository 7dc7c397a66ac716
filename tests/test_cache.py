"""KV-cache decoding against the full causal forward, and the sliding cache's bound."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from muse_mlx import load_model
from muse_mlx.cache import KVCache, SlidingKVCache

TOKENS = [3, 17, 250, 99, 42, 7, 300, 12, 5, 64, 128, 1, 255, 77, 31, 8, 200, 150, 9, 10, 11, 13, 15, 17]


def _full(model, tokens):
    return np.array(model(mx.array([tokens]))[0])


def _decode(model, tokens, chunks):
    """Feed ``tokens`` in chunks of the given sizes through one cache; stack the logits."""
    cache = model.make_cache()
    out, i = [], 0
    for n in chunks:
        out.append(np.array(model(mx.array([tokens[i : i + n]]), cache)[0]))
        i += n
    assert i == len(tokens)
    return np.concatenate(out), cache


@pytest.mark.parametrize("chunks", [[1] * 24, [5, 1, 1, 9, 8], [24], [16, 1, 1, 1, 1, 1, 1, 1, 1]])
def test_cached_decode_equals_full_forward(tiny, arch, chunks):
    """Token-by-token and chunked prefill give the full forward's logits, past the window (8) too.

    K/V are float32 here so the comparison is about the cache and the masks: the two paths only
    differ in matmul blocking (M = chunk vs M = 24), a few float32 ulps of the logits.
    """
    model = load_model(tiny(arch, "f32"))
    model.kv_dtype = mx.float32
    full = _full(model, TOKENS)
    stepped, _ = _decode(model, TOKENS, chunks)
    np.testing.assert_allclose(stepped, full, rtol=0, atol=2e-5)


def test_cached_decode_with_f16_planes_equals_full_forward(tiny):
    """The default f16 cache: the same planes are read either way, so only float32 rounding moves."""
    model = load_model(tiny("muse-glimmer"))
    full = _full(model, TOKENS)
    stepped, _ = _decode(model, TOKENS, [1] * len(TOKENS))
    np.testing.assert_allclose(stepped, full, rtol=0, atol=2e-3)


def test_sliding_cache_keeps_only_the_window(tiny):
    model = load_model(tiny("muse-glimmer"))
    _, cache = _decode(model, TOKENS, [1] * len(TOKENS))
    window = model.cfg.sliding_window
    for c, swa in zip(cache, model.cfg.swa_layers):
        if swa:
            assert isinstance(c, SlidingKVCache) and c.keys.shape[2] == window - 1
            assert c.keys.dtype == mx.float16
        else:
            assert isinstance(c, KVCache) and c.offset == len(TOKENS)
        assert c.offset == len(TOKENS)


def test_sliding_cache_memory_is_bounded_over_long_decode(tiny):
    """Past the window, the sliding layers' cache bytes stop growing."""
    model = load_model(tiny("muse-glimmer"))
    cache = model.make_cache()
    sizes = []
    for i in range(40):
        model(mx.array([[i % 300]]), cache)
        mx.eval([c.state for c in cache])
        sizes.append(sum(c.nbytes for c, s in zip(cache, model.cfg.swa_layers) if s))
    assert len(set(sizes[10:])) == 1 and sizes[10] < sizes[-1] + 1
