"""The forward pass of every architecture against an independent float64 reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from reference import RefModel

from muse_mlx import load_model
from muse_mlx.config import ARCHITECTURES
from muse_mlx.routes import ROUTES
from muse_mlx.writer import QUANT_MIXES, Geometry

TOKENS = [3, 17, 250, 99, 42, 7, 300, 12, 5, 64, 128, 1, 255, 77, 31, 8, 200, 150, 9, 10]  # 20 > window 8


def logits(model, tokens, kv_dtype=mx.float16):
    model.kv_dtype = kv_dtype
    return np.array(model(mx.array([tokens]))[0]).astype(np.float64)


@pytest.mark.parametrize("mix", ["f32", "q4_k_m"])
def test_forward_matches_float64_reference_with_f32_kv(tiny, arch, mix):
    """Tight: with K/V kept in float32, the only difference from float64 is float32 rounding.

    4 layers of 256..512-term float32 dot products and norms move logits of size ~5 by a few
    1e-6 (measured <= 6e-6); 3e-5 leaves room for summation-order changes across MLX builds.
    """
    path = tiny(arch, mix)
    ours = logits(load_model(path), TOKENS, mx.float32)
    ref = RefModel(path, kv_f16=False).forward(TOKENS)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=3e-5)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mix", QUANT_MIXES)
def test_every_quant_mix_on_both_routes_matches_float64_reference(tiny, mix, route):
    """Each mix's dequantization (F16, Q8_0, Q5_K, Q6_K, Q4_K + Q6_K) and each route's
    matvecs against float64 on gguf-py's weights, K/V in float32: the bound of the test above."""
    path = tiny("muse-glimmer", mix)
    ours = logits(load_model(path, route), TOKENS, mx.float32)
    np.testing.assert_allclose(ours, RefModel(path, kv_f16=False).forward(TOKENS), rtol=0, atol=3e-5)


def test_forward_matches_float64_reference_with_f16_kv(tiny, arch):
    """With llama.cpp's f16 K/V planes (the default), in both.

    Rounding a float32 and a float64 value to f16 lands on different f16 neighbours when the
    value sits near a rounding boundary; each such element moves by one f16 ulp (2^-11
    relative), which measured up to 5e-4 on these logits. The bound is 2e-3.

    That bound alone would pass K/V kept in float32 too, so the logits must also sit nearer the
    f16-planes reference than the f32-planes one does: measured 0.09-0.31 of that distance.
    """
    path = tiny(arch)
    ours = logits(load_model(path), TOKENS)
    ref = RefModel(path).forward(TOKENS)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-3)
    f16_effect = np.abs(ref - RefModel(path, kv_f16=False).forward(TOKENS)).max()
    assert np.abs(ours - ref).max() < 0.5 * f16_effect, (np.abs(ours - ref).max(), f16_effect)


def test_stock_route_on_q4_k_model_agrees_with_reference_dequantized_weights(tiny):
    """The stock route's quantized_matmuls on the exact affine repacks (Q4_K; Q6_K as hi + lo) vs
    float64 on gguf-py's weights."""
    path = tiny("muse-glimmer", "q4_k_m")
    model = load_model(path, "stock")
    forms = {(m.qtype.name, m.form) for _, m in model.named_modules() if hasattr(m, "form")}
    assert forms == {("Q4_K", "affine"), ("Q6_K", "affine_hi_lo")}, forms
    ours = logits(model, TOKENS, mx.float32)
    np.testing.assert_allclose(ours, RefModel(path, kv_f16=False).forward(TOKENS), rtol=0, atol=3e-5)


def test_batch_rows_equal_single_sequences(tiny):
    """Batching changes only matmul blocking (on a GPU, which kernel runs): float32 rounding."""
    model = load_model(tiny("muse-glimmer"))
    a, b = TOKENS[:10], TOKENS[10:]
    model.kv_dtype = mx.float32
    both = np.array(model(mx.array([a, b])))
    np.testing.assert_allclose(both[0], logits(model, a, mx.float32), rtol=0, atol=3e-5)
    np.testing.assert_allclose(both[1], logits(model, b, mx.float32), rtol=0, atol=3e-5)


def test_logits_are_float32_with_vocab_width(tiny, arch):
    model = load_model(tiny(arch))
    out = model(mx.array([TOKENS[:4]]))
    assert out.dtype == mx.float32 and out.shape == (1, 4, model.cfg.vocab_size)


def test_sliding_window_hides_tokens_outside_the_window(tiny):
    """One all-sliding layer, window 8: the logits at position t depend only on tokens t-7..t."""
    g = Geometry(n_layer=1, sliding_window=8, swa_pattern=(True,))
    model = load_model(tiny("muse-glimmer", "f32", geometry=g))
    base = logits(model, TOKENS, mx.float32)
    changed = list(TOKENS)
    changed[0] = 123
    moved = np.abs(logits(model, changed, mx.float32) - base).max(axis=1)
    assert moved[0] > 0 and moved[7] > 0  # position 7 still sees token 0 (7 - 0 < 8)
    np.testing.assert_array_equal(moved[8:], 0)  # position 8 no longer does (8 - 0 >= 8)


def test_global_layers_see_the_whole_prefix(tiny):
    g = Geometry(n_layer=1, sliding_window=8, swa_pattern=(False,))
    model = load_model(tiny("muse-glimmer", "f32", geometry=g))
    base = logits(model, TOKENS, mx.float32)
    changed = list(TOKENS)
    changed[0] = 123
    assert (np.abs(logits(model, changed, mx.float32) - base).max(axis=1) > 0).all()


def test_muse_glimmer_ropes_only_sliding_layers(tiny):
    from muse_mlx.gguf_file import GGUFFile
    from muse_mlx.config import ModelConfig

    cfg = ModelConfig.from_gguf(GGUFFile(tiny("muse-glimmer")))
    assert cfg.swa_layers == (True, True, True, False)  # llama.cpp's default period 4
    assert cfg.rope_layers == cfg.swa_layers and cfg.rope_traditional
    assert cfg.post_norm_eps == 1e-8 and cfg.entry_norm and cfg.attn_gate
    assert cfg.final_softcap == 30.0  # llama_hparams' default, which muse-glimmer.cpp keeps


@pytest.mark.parametrize("arch_name", ARCHITECTURES)
def test_every_architecture_builds_its_own_graph_switches(tiny, arch_name):
    from muse_mlx.gguf_file import GGUFFile
    from muse_mlx.config import ModelConfig

    cfg = ModelConfig.from_gguf(GGUFFile(tiny(arch_name)))
    expect = {
        "muse-glimmer": dict(activation="silu", qk_norm=True, attn_gate=True, embed_scale=None),
        "gemma3": dict(activation="gelu_tanh", qk_norm=True, attn_gate=False, tied_output=True),
        "gemma2": dict(activation="gelu_tanh", qk_norm=False, attn_softcap=50.0, final_softcap=30.0),
        "qwen3": dict(activation="silu", qk_norm=True, post_norm_eps=None, rope_traditional=False),
        "llama": dict(activation="silu", qk_norm=False, post_norm_eps=None, rope_traditional=True),
    }[arch_name]
    for key, value in expect.items():
        assert getattr(cfg, key) == value, key


@pytest.mark.parametrize("mix", ["q4_k_m", "q8_0", "f16"])
def test_the_gguf_reader_parses_as_gguf_pys_own(tiny, arch, mix):
    """GGUFFile's reader (gguf-py's, its mapping a plain ndarray view) gives gguf-py's GGUFReader's
    fields, values and tensors, and tensor data that is a read-only view of the file, not a copy."""
    from gguf import GGUFReader

    from muse_mlx.gguf_file import GGUFFile

    path = tiny(arch, mix)
    ours, theirs = GGUFFile(path).reader, GGUFReader(path, "r")
    assert not isinstance(ours.data, np.memmap) and isinstance(theirs.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields)
    for key, a in theirs.fields.items():
        b = ours.fields[key]
        assert (a.offset, a.name, a.types, a.data) == (b.offset, b.name, b.types, b.data), key
        assert all(np.array_equal(x, y) for x, y in zip(a.parts, b.parts)), key
        assert a.contents() == b.contents(), key
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in theirs.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ours.tensors]
    for a, b in zip(theirs.tensors, ours.tensors):
        assert np.array_equal(a.data, b.data) and not b.data.flags.writeable
        assert np.shares_memory(b.data, ours.data)
