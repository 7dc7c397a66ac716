"""KV-cache decoding against the full causal forward, and the sliding cache's bound."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from muse_mlx import load_model
from muse_mlx.cache import KVCache, RingKVCache

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
    """The default f16 cache: the same planes are read either way, so only float32 rounding moves
    (measured 1e-4; planes kept in float32 on one side move the logits by 2.5e-3)."""
    model = load_model(tiny("muse-glimmer"))
    full = _full(model, TOKENS)
    stepped, _ = _decode(model, TOKENS, [1] * len(TOKENS))
    np.testing.assert_allclose(stepped, full, rtol=0, atol=5e-4)


def test_sliding_cache_keeps_only_the_window(tiny):
    model = load_model(tiny("muse-glimmer"))
    _, cache = _decode(model, TOKENS, [5, 1, 1, 9, 8])
    window = model.cfg.sliding_window
    for c, swa in zip(cache, model.cfg.swa_layers):
        if swa:
            assert isinstance(c, RingKVCache) and c.keys.shape[2] == window
            assert c.keys.dtype == mx.float16
        else:
            assert isinstance(c, KVCache)
        assert c.offset == len(TOKENS)


def _positions(T, start, D=2):
    """K and V planes whose every element is its position (V negated), shape [1, 1, T, D]."""
    p = mx.arange(start, start + T, dtype=mx.float32)[None, None, :, None] * mx.ones((1, 1, 1, D))
    return p, -p


@pytest.mark.parametrize("window,chunks", [(8, [1] * 20), (8, [3, 9, 1, 7]), (8, [20]), (8, [8, 8, 4]),
                                           (8, [2, 11, 7]), (600, [200, 55, 1, 1, 300, 50, 1, 60, 1])])
def test_ring_cache_slots_and_fetched_keys(window, chunks):
    """Position p sits in slot p % window; a chunk gets the kept positions then its own, in order;
    a single token gets every filled slot (rotated order: attention does not depend on it).
    A window longer than ``step`` slots is reached in steps, each keeping the slots written so far."""
    ring, start = RingKVCache(window), 0
    for T in chunks:
        k, v = _positions(T, start)
        kept = ring.n_kept
        keys, values = ring.update_and_fetch(k, v)
        got = np.array(keys)[0, 0, :, 0]
        if T == 1:
            assert sorted(got.tolist()) == list(range(max(0, start - window + 1), start + 1))
        else:
            assert got.tolist() == list(range(start - kept, start + T)) and kept == min(start, window - 1)
        np.testing.assert_array_equal(np.array(values)[0, 0, :, 0], -got)
        start += T
        assert ring.offset == start
        slots = np.array(ring.keys)[0, 0, :, 0]
        for p in range(max(0, start - window), start):
            assert slots[p % window] == p
        assert ring.capacity == min(window, -(-start // RingKVCache.step) * RingKVCache.step)


def test_decode_path_with_rings_shorter_than_their_window(tiny):
    """A window of 600 reserved for a short run gives rings of 256 slots (cap < window): the decode
    path's slots and visible range still follow the positions, as the full forward's do."""
    import dataclasses

    from muse_mlx.decode import DecodeStep

    model = load_model(tiny("muse-glimmer"), "pinned")
    model.cfg = dataclasses.replace(model.cfg, sliding_window=600)
    full = _full(model, TOKENS)
    cache = model.make_cache()
    model(mx.array([TOKENS[:6]]), cache)
    step = DecodeStep(model, cache, capacity=64, compiled=False)
    rings = [c for c in cache if isinstance(c, RingKVCache)]
    assert rings and all(c.capacity == 256 < c.window == 600 for c in rings)
    stepped = np.stack([np.array(step(mx.array([t]))) for t in TOKENS[6:]])
    np.testing.assert_allclose(stepped, full[6:], rtol=0, atol=2e-3)


def _copy(cache):
    out = []
    for c in cache:
        d = copy.copy(c)
        d.kv = mx.array(c.kv)
        out.append(d)
    return out


def test_decode_path_equals_the_general_path(tiny, arch):
    """The one-token path (fused decode kernels on the pinned route, their oracles here) against the
    general path from the same cache contents, step by step: the same math in other summation
    orders. Each path writes the new token's K/V (rounded to f16) before attending to it, so a
    float32 difference upstream can flip one f16 rounding of the current token's K, which moves
    logits by up to ~5e-4 (the bound of the f16-plane tests above, 2e-3); in the typical step no
    rounding flips and the two agree to float32 rounding."""
    model = load_model(tiny(arch), "pinned")
    if not model.route.fast_decode(model.cfg):
        pytest.skip(f"{arch} has no fast decode path (attention soft-cap)")
    cache = model.make_cache()
    model(mx.array([TOKENS[:12]]), cache)
    worst = []
    for t in TOKENS[12:]:
        ref = _copy(cache)
        before = [np.array(c.kv) for c in cache]
        assert model.uses_decode_path(mx.array([[t]]), cache)
        fast = np.array(model(mx.array([[t]]), cache)[0, -1])
        general = np.array(_general_step(model, t, ref)[0, -1])
        worst.append(np.abs(fast - general).max())
        for c, r, b in zip(cache, ref, before):
            assert c.offset == r.offset
            # both paths wrote the token's K and V into one slot, the same one, and nothing else
            for planes in (c.kv, r.kv):
                changed = np.nonzero((np.array(planes) != b).any(axis=(0, 1, 2, 4)))[0].tolist()
                assert changed == [c.slot(c.offset - 1)]
    assert max(worst) < 2e-3 and np.median(worst) < 1e-5, worst


def _general_step(model, token, cache):
    route_fast = model.route.fast_decode
    model.route.fast_decode = lambda cfg: False
    try:
        return model(mx.array([[token]]), cache)
    finally:
        model.route.fast_decode = route_fast


def test_sliding_cache_memory_is_bounded_over_long_decode(tiny):
    """Past the window, each sliding layer holds exactly ``window`` f16 slots of K and V, however
    long the decode runs (past the global layers' first growth step too), and the global layers grow."""
    model = load_model(tiny("muse-glimmer"))
    cfg, cache = model.cfg, model.make_cache()
    n_swa = sum(cfg.swa_layers)
    assert 0 < n_swa < cfg.n_layer
    ring_bytes = n_swa * 2 * cfg.n_head_kv * cfg.head_dim * 2 * cfg.sliding_window
    steps = RingKVCache.step + cfg.sliding_window + 8
    for i in range(steps):
        model(mx.array([[i % 300]]), cache)
        mx.eval([c.state for c in cache])
        if i >= cfg.sliding_window:
            assert sum(c.nbytes for c, s in zip(cache, cfg.swa_layers) if s) == ring_bytes, i
    assert all(c.capacity == cfg.sliding_window for c, s in zip(cache, cfg.swa_layers) if s)
    assert all(c.capacity >= steps for c, s in zip(cache, cfg.swa_layers) if not s)


def test_decode_step_takes_the_planes_the_attention_hands_out(tiny, monkeypatch):
    """The attention with its norms hands the planes out whole, the token's slot written, and the
    caches take them (MUSE_MLX_KV_WRITE=through, the default), or hands the token's K/V out for a
    scatter into the planes after it (layer): the same logits and planes, bit for bit, either way
    (the kernel's copy against its oracle is test_decode_kernels.py's, in the emulator); any other
    value is an error."""
    from muse_mlx.decode import DecodeStep

    def address(a):  # where a plane's bytes are (the CPU's buffer, no copy)
        view = np.asarray(a)
        return view.__array_interface__["data"][0]

    model = load_model(tiny("muse-glimmer"), "pinned")
    runs, in_place = {}, {}
    for mode in ("through", "layer"):
        monkeypatch.setenv("MUSE_MLX_KV_WRITE", mode)
        cache = model.make_cache()
        model(mx.array([TOKENS[:6]]), cache)
        step = DecodeStep(model, cache, capacity=64, compiled=False)
        assert model.route.takes_norms_into_attention(cache[0].kv)
        logits, in_place[mode] = [], 0
        for t in TOKENS[6:12]:
            before = [address(c.kv) for c in cache]
            logits.append(np.array(step(mx.array([t]))))
            in_place[mode] += sum(address(c.kv) == b for c, b in zip(cache, before))
        runs[mode] = logits, [np.array(c.kv) for c in cache], [c.offset for c in cache]
    # through makes new planes every token; the scatters write in place where nothing holds the
    # plane, which on the CPU, whose evaluations have run by then, is every plane
    assert in_place["through"] == 0 and in_place["layer"] == 6 * model.cfg.n_layer
    (la, pa, oa), (lb, pb, ob) = runs["through"], runs["layer"]
    assert oa == ob == [12] * model.cfg.n_layer
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))
    for x, y in zip(pa, pb):
        np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16))
    monkeypatch.setenv("MUSE_MLX_KV_WRITE", "end")
    with pytest.raises(ValueError, match="MUSE_MLX_KV_WRITE='end': expected through or layer"):
        step(mx.array([3]))


def test_decode_step_equals_the_models_own_decode_path(tiny):
    """DecodeStep passes position and slots as arrays (so a GPU can replay one compiled trace);
    the arithmetic is the decode path's, bit for bit, and the caches advance the same way."""
    from muse_mlx.decode import DecodeStep

    model = load_model(tiny("muse-glimmer"), "pinned")
    a, b = model.make_cache(), model.make_cache()
    for c in (a, b):
        model(mx.array([TOKENS[:6]]), c)
    step = DecodeStep(model, b, capacity=64, compiled=False)
    for t in TOKENS[6:]:
        want = np.array(model(mx.array([[t]]), a)[0, -1])
        got = np.array(step(mx.array([t])))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    for c, d in zip(a, b):
        assert c.offset == d.offset == len(TOKENS)
        n = min(c.capacity, d.capacity)
        np.testing.assert_array_equal(np.array(c.kv)[:, :, :, :n].view(np.uint16),
                                      np.array(d.kv)[:, :, :, :n].view(np.uint16))
    # the caches moved on without the step (more prompt): the step's position follows them
    for c in (a, b):
        model(mx.array([TOKENS[:3]]), c)
    for t in TOKENS[:4]:
        want = np.array(model(mx.array([[t]]), a)[0, -1])
        np.testing.assert_array_equal(np.array(step(mx.array([t]))).view(np.uint32), want.view(np.uint32))
    assert a[0].offset == b[0].offset == len(TOKENS) + 7
    with pytest.raises(ValueError, match="prepared for 64 positions"):
        for _ in range(64):
            step(mx.array([1]))
