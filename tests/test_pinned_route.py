"""The pinned route through the whole model: against float64, against stock, flags, dispatch counts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from reference import RefModel

from muse_mlx import load_model

TOKENS = [3, 17, 250, 99, 42, 7, 300, 12, 5, 64, 128, 1]


def logits(model, tokens=TOKENS):
    model.kv_dtype = mx.float32
    return np.array(model(mx.array([tokens]))[0]).astype(np.float64)


def test_pinned_route_matches_float64_reference(tiny, arch):
    """Same bound as the stock route's test: only float32 rounding separates the two."""
    path = tiny(arch)
    np.testing.assert_allclose(logits(load_model(path, "pinned")), RefModel(path, kv_f16=False).forward(TOKENS),
                               rtol=0, atol=3e-5)


def test_pinned_and_stock_routes_agree(tiny, arch):
    """Different reduction orders and roundings, same math: logits ~5 agree to a few 1e-6."""
    path = tiny(arch)
    np.testing.assert_allclose(logits(load_model(path, "pinned")), logits(load_model(path, "stock")), rtol=0, atol=3e-5)


def test_pinned_route_is_deterministic(tiny):
    path = tiny("muse-glimmer")
    a, b = logits(load_model(path, "pinned")), logits(load_model(path, "pinned"))
    np.testing.assert_array_equal(a.view(np.uint64), b.view(np.uint64))


@pytest.mark.parametrize("flag", ["tail_32sg", "ffn_4r2s"])
def test_legacy_fusions_move_the_logits_slightly(tiny, flag):
    """The seeds' war stories in miniature: same tokens, different bits."""
    path = tiny("muse-glimmer")
    base, fused = logits(load_model(path, "pinned")), logits(load_model(path, "pinned", [flag]))
    assert (base != fused).any()
    np.testing.assert_allclose(fused, base, rtol=0, atol=3e-5)
    assert (base.argmax(-1) == fused.argmax(-1)).all()


def test_split_norm_seam_rounds_through_f16(tiny):
    path = tiny("muse-glimmer")
    base, split = logits(load_model(path, "pinned")), logits(load_model(path, "pinned", ["split_norm_f16"]))
    assert 1e-5 < np.abs(base - split).max() < 5e-2  # f16 rounding of every norm output


def test_fused_ffn_dtype_guard_falls_back(tiny):
    """ffn_4r2s exists for Q4_K only: a Q8_0 model takes the unfused path."""
    model = load_model(tiny("muse-glimmer", "q8_0"), "pinned", ["ffn_4r2s"])
    model(mx.array([TOKENS[:3]]))
    assert "ffn_q4k_gate_up_silu_4r2s" not in model.route.dispatches
    model = load_model(tiny("muse-glimmer"), "pinned", ["ffn_4r2s"])
    model(mx.array([TOKENS[:3]]))
    assert model.route.dispatches["ffn_q4k_gate_up_silu_4r2s"] == model.cfg.n_layer


def test_dispatches_per_decoded_token_follow_the_seeds_accounting(tiny):
    """Ch 12 §12.5: 2 standalone norms + 2 per layer fused tails, plus 2 QK-norms per layer."""
    model = load_model(tiny("muse-glimmer"), "pinned")
    cache = model.make_cache()
    model(mx.array([TOKENS[:5]]), cache)
    model.route.dispatches.clear()
    model(mx.array([[7]]), cache, last_only=True)
    d, L = model.route.dispatches, model.cfg.n_layer
    assert d["rms_norm_mul"] == 2 + 2 * L
    assert d["fused_norm_residual_rms_norm_batch_dual_eps"] == 2 * L
    assert d["silu_mul_inplace"] == L
    # q, k, v, attn_gate, attn_output, ffn_gate, ffn_up, ffn_down per layer, and the head
    assert d["mul_mv_q4_K_f32"] + d["mul_mv_q6_K_f32"] == 8 * L + 1
