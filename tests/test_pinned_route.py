"""The pinned route through the whole model: against float64, against stock, flags, dispatch counts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from reference import RefModel

from muse_mlx import kernels as K
from muse_mlx import load_model
from muse_mlx.kernels import attention

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


def test_q8_matvecs_move_logits_by_the_activation_rounding(tiny):
    """mv_q8 rounds every Q4_K matvec's input to int8 per 32 values (~0.4 % of a group's max):
    the logits move visibly, far less than their spread, and the dispatches are the q8 ones."""
    path = tiny("muse-glimmer")
    base = logits(load_model(path, "pinned"))
    model = load_model(path, "pinned", ["mv_q8"])
    q8 = logits(model)
    assert model.route.dispatches["mul_mv_q4_K_q8"] > 0
    err = np.abs(q8 - base).max()
    assert 1e-4 < err < 0.1 * base.std(), err
    assert (q8.argmax(-1) == base.argmax(-1)).mean() >= 0.75
    model.kv_dtype = mx.float16  # the decode path's planes
    cache = model.make_cache()
    model(mx.array([TOKENS[:5]]), cache)
    model.route.dispatches.clear()
    model(mx.array([[7]]), cache)
    d = model.route.dispatches
    assert d["mul_mv_q4_K_q8 (multi)"] == d["mul_mv_q4_K_q8 (glu)"] == model.cfg.n_layer
    # the tail before each GLU writes the GLU's int8 activations too: one tail of the two per layer
    assert d["fused_norm_residual_rms_norm_batch_dual_eps_q8"] == d["fused_norm_residual_rms_norm_batch_dual_eps"]
    assert d["fused_norm_residual_rms_norm_batch_dual_eps_q8"] == model.cfg.n_layer
    assert "q8" not in model.route._forms  # taken by the GLU


def test_q8_q6k_splits_the_Q6_K_weights_and_gives_them_back(tiny, monkeypatch):
    """mv_q8_q6k holds every untied Q6_K matrix split and runs it through the q8 kernel: the logits
    move by about what mv_q8 moves them, every Q6_K matvec of a decoded token (ffn_down, head,
    attn_v among the projections) is a q8 one, and the split weights dequantize to the blocks'
    values. Switching the flags on the loaded model (Model.set_flags) turns the forms back and forth:
    without the flag it is the exact route again, bit for bit, and with it, the model loaded with it."""
    from muse_mlx.layers import QLinear
    from muse_mlx.routes import RouteError

    path = tiny("muse-glimmer")
    exact_model = load_model(path, "pinned")
    base, q8 = logits(exact_model), logits(load_model(path, "pinned", ["mv_q8"]))
    model = load_model(path, "pinned", ["mv_q8", "mv_q8_q6k"])
    q6 = {name: m for name, m in model.named_modules() if isinstance(m, QLinear) and m.qtype == T.Q6_K}
    assert q6 and all(m.form == "q6_K_split" for m in q6.values())
    exact = dict(exact_model.named_modules())
    for name, m in q6.items():
        np.testing.assert_array_equal(np.array(m.dequantized()), np.array(exact[name].dequantized()))
    both = logits(model)
    assert 1e-4 < np.abs(both - q8).max() < 0.1 * base.std()
    assert (both.argmax(-1) == base.argmax(-1)).mean() >= 0.75
    model.kv_dtype = mx.float16
    cache = model.make_cache()
    model(mx.array([TOKENS[:5]]), cache)
    model.route.dispatches.clear()
    calls, q8_mv = [], K.mul_mv_q8

    def spy(y, weights, **kw):
        calls.append(([k for _, k in weights], kw.get("q8") is not None))
        return q8_mv(y, weights, **kw)

    monkeypatch.setattr(K, "mul_mv_q8", spy)
    model(mx.array([[7]]), cache)
    monkeypatch.undo()
    # per layer the projections, attn_output, the GLU, ffn_down, then the head: quantized by the tail
    # before them, ffn_down by the GLU (MUSE_MLX_Q8_GLU_OUT's default), attn_output by the attention
    # (MUSE_MLX_Q8_ATTN's), but for layer 0's projections (after the standalone attn_norm)
    L = model.cfg.n_layer
    assert [given for _, given in calls] == [False, True, True, True] + [True] * 4 * (L - 1) + [True]
    assert sum("q6_K_split" in kinds for kinds, _ in calls) > L // 2  # split matrices among them
    d = dict(model.route.dispatches)  # this token's (the decode step below adds its own)
    # the same through the decode step (last_only): the head still takes the last tail's q8
    from muse_mlx.decode import DecodeStep

    step = DecodeStep(model, model.make_cache(), 16, compiled=False)
    step(mx.array([3]))
    calls.clear()
    monkeypatch.setattr(K, "mul_mv_q8", spy)
    step(mx.array([7]))
    monkeypatch.undo()
    assert calls[-1] == (["q6_K_split"], True) and "q8" not in model.route._forms
    # one q8 call each, but for those among the projections (one call per layer for all of them)
    alone = [n for n in q6 if n.rsplit(".", 1)[-1] not in ("attn_q", "attn_k", "attn_v", "attn_gate")]
    assert "output" in alone and d["mul_mv_q6_K_q8"] == len(alone)
    assert d["mul_mv_q4_K_q8 (multi)"] == model.cfg.n_layer and d.get("mul_mv_q6_K_f32", 0) == 0
    # every tail writes its output quantized too, and the GLU, the projections or the head take it
    assert d["fused_norm_residual_rms_norm_batch_dual_eps_q8"] == 2 * model.cfg.n_layer
    assert d.get("fused_norm_residual_rms_norm_batch_dual_eps", 0) == 0
    model.set_flags(())
    assert all(m.form == "blocks" for m in q6.values())
    np.testing.assert_array_equal(logits(model).view(np.uint64), base.view(np.uint64))
    model.set_flags(["mv_q8", "mv_q8_q6k"])
    np.testing.assert_array_equal(logits(model).view(np.uint64), both.view(np.uint64))
    with pytest.raises(RouteError, match="mv_q8_q6k works only together with mv_q8"):
        model.set_flags(["mv_q8_q6k"])


def test_q8_glu_output_feeds_the_ffn_down(tiny, monkeypatch):
    """MUSE_MLX_Q8_GLU_OUT=1 (the default, with mv_q8_q6k): the GLU also returns its output quantized and every
    ffn_down after it takes that instead of quantizing: a split Q6_K one, which quantized it in a
    dispatch of its own before, and a Q4_K one, which then takes mul_mv_q8_pre's lanes instead of
    quantizing per threadgroup (whose bits may differ from those of the run without it). So the logits are those of the GLU_OUT=0 run whose ffn_downs are
    handed quantize_q8's words of their input, bit for bit (on the CPU the GLU's q8 is quantize_q8's
    oracle; the kernel's is test_decode_kernels.py::test_q8_glu_writes_its_output_quantized)."""
    from muse_mlx.layers import QLinear

    model = load_model(tiny("muse-glimmer"), "pinned", ["mv_q8", "mv_q8_q6k"])
    model.kv_dtype = mx.float16
    split_downs = sum(1 for b in model.blk if isinstance(b.ffn_down, QLinear) and b.ffn_down.form == "q6_K_split")
    assert 0 < split_downs < model.cfg.n_layer
    n_ff = model.cfg.n_ff
    out, given = {}, {}
    q8_mv = K.mul_mv_q8
    for mode, hand in (("0", False), ("1", False), ("0", True), (None, False)):
        if mode is None:
            monkeypatch.delenv("MUSE_MLX_Q8_GLU_OUT")
        else:
            monkeypatch.setenv("MUSE_MLX_Q8_GLU_OUT", mode)
        cache = model.make_cache()
        model(mx.array([TOKENS[:5]]), cache)
        calls = []

        def spy(y, weights, **kw):
            down = len(weights) == 1 and kw.get("glu") is None and y.shape[-1] == n_ff
            if hand and down and kw.get("q8") is None:
                kw["q8"] = K.mul_mv.quantize_q8_rows(y)
            calls.append((down, weights[0][1], kw.get("q8") is not None))
            return q8_mv(y, weights, **kw)

        monkeypatch.setattr(K, "mul_mv_q8", spy)
        out[mode, hand] = np.array(model(mx.array([[7]]), cache))
        monkeypatch.setattr(K, "mul_mv_q8", q8_mv)
        given[mode, hand] = [kind for down, kind, q8 in calls if down and q8]
    assert given["0", False] == []
    assert len(given["1", False]) == model.cfg.n_layer and given["1", False].count("q6_K_split") == split_downs
    assert given[None, False] == given["1", False]  # on by default
    np.testing.assert_array_equal(out["1", False].view(np.uint32), out["0", True].view(np.uint32))
    monkeypatch.setenv("MUSE_MLX_Q8_GLU_OUT", "maybe")
    with pytest.raises(ValueError, match="MUSE_MLX_Q8_GLU_OUT"):
        model(mx.array([[7]]), model.make_cache())


def test_exact_route_on_split_Q6_K_weights_keeps_its_bits(tiny, monkeypatch):
    """MUSE_MLX_Q6K_SPLIT=1 (CUDA's default, mul_mv.Q6K_SPLIT): the exact route holds every untied
    Q6_K matrix split and runs the exact Q6_K kernels on it (split=True), and its logits are the
    raw blocks' bit for bit, through the model and the decode step; with mv_q8 alone the blocks stay
    (its Q6_K lanes read them). The kernels' own bits on the split form: test_decode_kernels.py
    (emulator) and gpu_check.py."""
    from muse_mlx.decode import DecodeStep
    from muse_mlx.layers import QLinear

    path = tiny("muse-glimmer")
    monkeypatch.setenv("MUSE_MLX_Q6K_SPLIT", "0")
    raw_model = load_model(path, "pinned")
    base = logits(raw_model)
    monkeypatch.setenv("MUSE_MLX_Q6K_SPLIT", "1")
    model = load_model(path, "pinned")
    q6 = [m for _, m in model.named_modules() if isinstance(m, QLinear) and m.qtype == T.Q6_K]
    assert q6 and all(m.form == "q6_K_split" for m in q6)
    splits, mv6 = [], K.mul_mv_q6_K

    def spy(y, w, **kw):
        splits.append(kw.get("split", False))
        return mv6(y, w, **kw)

    monkeypatch.setattr(K, "mul_mv_q6_K", spy)
    np.testing.assert_array_equal(logits(model).view(np.uint64), base.view(np.uint64))
    assert splits and all(splits)
    steps = {}
    for name, m in (("raw", raw_model), ("split", model)):
        m.kv_dtype = mx.float16
        step = DecodeStep(m, m.make_cache(), 16, compiled=False)
        steps[name] = [np.array(step(mx.array([t]))) for t in TOKENS[:4]]
        m.route.dispatches.clear()
        step(mx.array([9]))
        steps[name + " dispatches"] = dict(m.route.dispatches)
    for a, b in zip(steps["raw"], steps["split"]):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert steps["raw dispatches"] == steps["split dispatches"]
    model.set_flags(["mv_q8"])
    assert all(m.form == "blocks" for m in q6)
    monkeypatch.setenv("MUSE_MLX_Q6K_SPLIT", "yes")
    with pytest.raises(ValueError, match="MUSE_MLX_Q6K_SPLIT='yes': expected 0 or 1"):
        load_model(path, "pinned")


def test_split_form_is_made_on_the_host_so_loading_peaks_no_higher(tiny, monkeypatch):
    """The loader splits Q6_K rows before they reach the device: made there, the raw rows were held
    beside the split copy (the release head: 2.2 GB more at load on the H200, nineteenth session).
    So a load with the split form peaks no higher than one with the raw blocks."""
    path, peaks = tiny("muse-glimmer"), {}
    for split in ("0", "1"):
        monkeypatch.setenv("MUSE_MLX_Q6K_SPLIT", split)
        mx.clear_cache()
        mx.reset_peak_memory()
        model = load_model(path, "pinned")
        peaks[split] = mx.get_peak_memory()
        forms = {m.form for _, m in model.named_modules() if getattr(m, "qtype", None) == T.Q6_K}
        assert forms == {"q6_K_split" if split == "1" else "blocks"}
        del model
    assert peaks["1"] <= peaks["0"], peaks


def test_batched_prefill_on_split_Q6_K_rows_keeps_the_exact_bits(tiny, monkeypatch):
    """A batched prefill runs no matvec kernel: its Q6_K matmuls dequantize the split matrices as
    they are held (kind "q6_K_split", no rejoined copy), with mv_q8_q6k and with the exact route's
    own split form (MUSE_MLX_Q6K_SPLIT=1), so its logits are the raw blocks', bit for bit."""
    from muse_mlx.generate import batched_prefill

    path = tiny("muse-glimmer")
    out, kinds, dequant = {}, [], K.dequantize_rows

    def spy(w, kind, *a, **kw):
        kinds.append(kind)
        return dequant(w, kind, *a, **kw)

    monkeypatch.setattr(K, "dequantize_rows", spy)
    for split, flags in (("0", ()), ("0", ("mv_q8", "mv_q8_q6k")), ("1", ())):
        monkeypatch.setenv("MUSE_MLX_Q6K_SPLIT", split)
        model = load_model(path, "pinned", flags)
        model.kv_dtype = mx.float32
        kinds.clear()
        with batched_prefill(model.route, "batched"):
            out[split, flags] = np.array(model(mx.array([TOKENS]))[0])
        assert model.route.dispatches["dequant_matmul"] > 0 and model.route.dispatches["mul_mv_q6_K_q8"] == 0
        held = "q6_K_split" if flags or split == "1" else "q6_K"
        assert held in kinds and ({"q6_K", "q6_K_split"} - {held}).isdisjoint(kinds), kinds
    want = out["0", ()].view(np.uint32)
    for key, got in out.items():
        np.testing.assert_array_equal(got.view(np.uint32), want, err_msg=str(key))


def test_switching_forms_frees_the_old_ones_a_dead_compiled_step_traced(tiny):
    """Model.set_flags collects garbage first: a compiled function in a reference cycle (as a
    dropped DecodeStep is) keeps the arrays it traced until the cycle is collected, so the Q6_K
    matrices' old form would outlive the switch (seen on the H200: 4.1 GB)."""
    import gc

    from muse_mlx.layers import QLinear

    model = load_model(tiny("muse-glimmer"), "pinned")
    q6 = [m for _, m in model.named_modules() if isinstance(m, QLinear) and m.qtype == T.Q6_K]
    q6_bytes = sum(m.weight.nbytes for m in q6)

    class Step:  # a cycle through a compiled bound method, reading every Q6_K weight
        def __init__(self):
            self.fn = mx.compile(self.step)

        def step(self, x):
            return x + sum(m.weight.astype(mx.float32).sum() for m in q6)

    gc.disable()
    try:
        mx.eval(Step().fn(mx.array(0.0)))
        before = mx.get_active_memory()
        model.set_flags(["mv_q8", "mv_q8_q6k"])
        grown = mx.get_active_memory() - before
    finally:
        gc.enable()
    assert all(m.form == "q6_K_split" for m in q6)
    assert grown < q6_bytes // 2, (grown, q6_bytes)


def test_q8_activations_from_the_tail_change_no_bits(tiny, monkeypatch):
    """MUSE_MLX_Q8_TAIL=0 quantizes the GLU's input in a dispatch of its own (quantize_q8), the
    default in the tail before it: a dispatch fewer, the same decoded logits. On the CPU both run
    the oracles, so this checks the route's hand-off and counts; that the kernel's q8 words equal
    quantize_q8's is test_decode_kernels.py::test_tail_with_q8_output (emulator) and gpu_check."""
    model = load_model(tiny("muse-glimmer"), "pinned", ["mv_q8"])
    model.kv_dtype = mx.float16
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("MUSE_MLX_Q8_TAIL", mode)
        cache = model.make_cache()
        model(mx.array([TOKENS[:5]]), cache)
        model.route.dispatches.clear()
        out[mode] = np.array(model(mx.array([[7]]), cache))
        tails = model.route.dispatches["fused_norm_residual_rms_norm_batch_dual_eps_q8"]
        assert tails == (model.cfg.n_layer if mode == "1" else 0)
    np.testing.assert_array_equal(out["0"].view(np.uint32), out["1"].view(np.uint32))
    monkeypatch.setenv("MUSE_MLX_Q8_TAIL", "yes")
    with pytest.raises(ValueError, match="MUSE_MLX_Q8_TAIL"):
        model(mx.array([[7]]), model.make_cache())


def test_q8_attention_hands_attn_output_its_activations_quantized(tiny, monkeypatch):
    """MUSE_MLX_Q8_ATTN=1 (flag mv_q8): the attention with its norms also returns its output
    quantized, and each layer's attn_output takes it: quantize_q8's words of exactly that output,
    and the same decoded logits as without (attn_output at 32 lanes a row either way). On the CPU
    this checks the hand-off and the values handed over; that the kernel writes those words is
    test_decode_kernels.py::test_attention_writes_its_output_quantized (emulator)."""
    from muse_mlx.kernels import mul_mv

    model = load_model(tiny("muse-glimmer"), "pinned", ["mv_q8"])
    model.kv_dtype = mx.float16
    real = K.mul_mv_q8
    handed = []

    def spy(y, weights, *a, q8=None, glu=None, **kw):
        if q8 is not None and glu is None:  # not the GLU: attn_output
            want_qy, want_ds = mul_mv.quantize_q8_rows(y, which="cpu")
            np.testing.assert_array_equal(np.array(q8[0]), np.array(want_qy))
            np.testing.assert_array_equal(np.array(q8[1]).view(np.uint32), np.array(want_ds).view(np.uint32))
            handed.append(weights[0][0].shape)
        return real(y, weights, *a, q8=q8, glu=glu, **kw)

    monkeypatch.setattr(K, "mul_mv_q8", spy)
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("MUSE_MLX_Q8_ATTN", mode)
        cache = model.make_cache()
        model(mx.array([TOKENS[:5]]), cache)
        assert model.route.takes_norms_into_attention(cache[0].kv)
        handed.clear()
        out[mode] = np.array(model(mx.array([[7]]), cache))
        assert len(handed) == (model.cfg.n_layer if mode == "1" else 0)
        assert "q8" not in model.route._forms  # every quantized output was taken
    np.testing.assert_array_equal(out["0"].view(np.uint32), out["1"].view(np.uint32))
    monkeypatch.setenv("MUSE_MLX_Q8_ATTN", "on")
    with pytest.raises(ValueError, match="MUSE_MLX_Q8_ATTN='on': expected 0 or 1"):
        model(mx.array([[7]]), model.make_cache())


def test_tails_prepare_the_q4_K_matvecs_inputs_where_a_gpu_takes_them(tiny, monkeypatch):
    """On a GPU (here forced: on the CPU the oracles read y either way) each tail that feeds a
    Q4_K projection or GLU also writes its output prepared for it (tail_dual_eps_q4), and the
    projection and the GLU take it, each in the nibble form of its own kind (here the GLU's 2, the
    projections' 1); the last tail, before the Q6_K head, does not. The bits are the oracles' either
    way; that the kernels' are too is test_decode_kernels.py (emulator) and gpu_check."""
    from muse_mlx.kernels import mul_mv

    model = load_model(tiny("muse-glimmer"), "pinned")
    model.kv_dtype = mx.float16
    taken = []
    glu, multi = mul_mv.mul_mv_glu, mul_mv.mul_mv_multi
    monkeypatch.setitem(mul_mv.Q4K_HALVES, "cpu", {"q4_K": 2, "q4_K single": 1, "q4_K multi": 1})

    def spy(fn, form):
        def call(y, *a, prep=None, **kw):
            if prep is not None:  # exactly the form of this call's input, not another's
                assert prep.form == form  # prepared for this kind of call
                want = mul_mv.q4_K_prepared(y, prep.form)
                for got, exp in ((prep.ys, want.ys), (prep.sy, want.sy)):
                    np.testing.assert_array_equal(np.array(got).view(np.uint32), np.array(exp).view(np.uint32))
            taken.append(prep is not None)
            return fn(y, *a, **kw)
        return call

    out = {}
    for forced in (False, True):
        monkeypatch.setattr(mul_mv, "q4K_prep", lambda which, kind, f=forced: f)
        monkeypatch.setattr(K, "mul_mv_glu", spy(glu, 2))
        monkeypatch.setattr(K, "mul_mv_multi", spy(multi, 1))
        cache = model.make_cache()
        model(mx.array([TOKENS[:5]]), cache)
        model.route.dispatches.clear()
        taken.clear()
        out[forced] = np.array(model(mx.array([[7]]), cache))
        d, L = model.route.dispatches, model.cfg.n_layer
        tails = d["fused_norm_residual_rms_norm_batch_dual_eps_q4"]
        assert tails == (2 * L - 1 if forced else 0)
        assert tails + d["fused_norm_residual_rms_norm_batch_dual_eps"] == 2 * L
        # layer 0's projection reads the entry norm's output: not prepared
        assert taken == ([False] + [True] * (2 * L - 1) if forced else [False] * (2 * L))
        assert "q4_K" not in model.route._forms  # every prepared output was taken
    np.testing.assert_array_equal(out[False].view(np.uint32), out[True].view(np.uint32))
    for flag in ("mv_q8", "ffn_4r2s"):  # kernels that read y: no tail prepares for them
        flagged = load_model(tiny("muse-glimmer"), "pinned", [flag])
        flagged(mx.array([[7]]), flagged.make_cache())
        d = flagged.route.dispatches
        assert d["fused_norm_residual_rms_norm_batch_dual_eps_q4"] == (0 if flag == "mv_q8" else flagged.cfg.n_layer - 1)


def test_the_head_takes_its_own_geometry(tiny, monkeypatch):
    """The vocabulary head is the one Q6_K matvec launched as a head (its own tuned geometry; the
    same kernel and bits as any Q6_K matvec), in the prefill's last step and in each decoded token."""
    from muse_mlx.kernels import mul_mv

    model = load_model(tiny("muse-glimmer"), "pinned")
    assert model.output.qtype == T.Q6_K
    heads = []
    q6 = mul_mv.mul_mv_q6_K

    def spy(y, w, head=False, **kw):
        heads.append((head, w.shape[0]))
        return q6(y, w, head=head, **kw)

    monkeypatch.setattr(K, "mul_mv_q6_K", spy)
    model.kv_dtype = mx.float16
    cache = model.make_cache()
    model(mx.array([TOKENS[:5]]), cache)
    heads.clear()
    model(mx.array([[7]]), cache)
    assert [h for h in heads if h[0]] == [(True, model.cfg.vocab_size)]
    assert all(rows != model.cfg.vocab_size for head, rows in heads if not head)
    tuned = mul_mv.MV_GEOMETRIES["tuned"]["cuda"]
    assert mul_mv.mv_geometry("tuned", "cuda", "q6_K head") == tuned["q6_K head"]


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


def test_dispatches_per_decoded_token_follow_the_seeds_accounting(tiny, monkeypatch):
    """Ch 12 §12.5: 2 standalone norms + 2 per layer fused tails; the decode path adds one
    projection dispatch per layer (q, k, v, gate), one GLU dispatch (gate, up, SiLU), and one
    dispatch for the Q/K-norms, RoPE, the f16 K/V and the attention (this cache is short; with a
    long one, or MUSE_MLX_ATTN=apart, the norms and RoPE are a dispatch of their own, and a long
    one's attention takes two: the partial pass and the combine)."""
    model = load_model(tiny("muse-glimmer"), "pinned")
    cache = model.make_cache()
    model(mx.array([TOKENS[:5]]), cache)
    model.route.dispatches.clear()
    model(mx.array([[7]]), cache, last_only=True)
    d, L = model.route.dispatches, model.cfg.n_layer
    assert d["rms_norm_mul"] == 2
    assert d["fused_norm_residual_rms_norm_batch_dual_eps"] == 2 * L
    assert d["mul_mv_multi_f32"] == L and d["mul_mv_glu_q4_K_f32"] == L
    assert d["attn_decode_fused (+ qk_rope_pack)"] == L
    assert not {"qk_rope_pack", "attn_decode_fused", "attn_decode_partial + combine"} & set(d)
    # attn_output and ffn_down per layer, and the head
    assert d["mul_mv_q4_K_f32"] + d["mul_mv_q6_K_f32"] == 2 * L + 1
    assert d["dequant_at"] == 1  # the token's embedding row, gathered and dequantized
    assert sum(d.values()) == 2 + 7 * L + 1 + 1
    monkeypatch.setenv("MUSE_MLX_ATTN", "apart")
    model.route.dispatches.clear()
    model(mx.array([[8]]), cache, last_only=True)
    assert d["qk_rope_pack"] == L and d["attn_decode_fused"] == L and sum(d.values()) == 2 + 8 * L + 2
    monkeypatch.delenv("MUSE_MLX_ATTN")
    # past 1,024 cached positions the attention is two dispatches
    long_cache = model.make_cache()
    for c in long_cache:
        c.reserve_for(model.cfg, 2048)
    model(mx.array([TOKENS[:5]]), long_cache)
    model.route.dispatches.clear()
    model(mx.array([[7]]), long_cache, last_only=True)
    long = [not attention.fused_fits(c.kv.shape[-2], model.cfg.head_dim) for c in long_cache]
    assert any(long)  # (the sliding-window layers' ring buffers stay short)
    assert model.route.dispatches["attn_decode_partial + combine"] == 2 * sum(long)
    assert model.route.dispatches["qk_rope_pack"] == sum(long)
    assert model.route.dispatches.get("attn_decode_fused (+ qk_rope_pack)", 0) == L - sum(long)


def test_a_traced_decode_records_the_norms_and_keeps_the_bits(tiny):
    """Under a trace the decode path launches the Q/K-norms and RoPE on their own, so that their
    output is recorded (the attention that takes them in would hide it): the same bits either way."""
    from muse_mlx.trace import Trace

    model = load_model(tiny("muse-glimmer"), "pinned")
    a, b = model.make_cache(), model.make_cache()
    for c in (a, b):
        model(mx.array([TOKENS[:5]]), c)
    model.route.dispatches.clear()
    plain = np.array(model(mx.array([[7]]), a)[0, -1])
    assert "qk_rope_pack" not in model.route.dispatches
    with Trace() as t:
        traced = np.array(model(mx.array([[7]]), b)[0, -1])
    assert [layer for layer, name, _ in t.entries if name == "QKcur"] == list(range(model.cfg.n_layer))
    np.testing.assert_array_equal(traced.view(np.uint32), plain.view(np.uint32))
    for c, d in zip(a, b):
        np.testing.assert_array_equal(np.array(c.kv).view(np.uint16), np.array(d.kv).view(np.uint16))


def test_prefill_dispatches_one_matvec_per_matrix_unless_batched(tiny):
    """A multi-token forward keeps the batch-1 matvec bits (one dispatch per matrix for all its
    tokens); generation's batched prefill swaps them for an exact dequantize + matmul."""
    from muse_mlx.generate import batched_prefill

    model = load_model(tiny("muse-glimmer"), "pinned")
    exact = logits(model, TOKENS)
    assert model.route.dispatches["dequant_matmul"] == 0
    with batched_prefill(model.route):
        batched = logits(model, TOKENS)
    assert model.route.dispatches["dequant_matmul"] == 8 * model.cfg.n_layer + 1  # and the head
    # dequantize + matmul vs the ggml matvec: float32 rounding of the same products
    np.testing.assert_allclose(batched, exact, rtol=0, atol=3e-5)
    assert (batched != exact).any()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
def test_f16_prefill_matmul_is_a_half_rounded_product(qtype):
    """batched-f16: the product of the half-rounded weights (gguf-py's values, to nearest) and the
    half-rounded activations, summed in float32 and rounded to half (MLX's f16 matmul gives f16).
    Reference: float64 sums of the same halves, rounded to half. float32 accumulation can move a
    sum across a half rounding boundary, so a few outputs may land one half-step away, no more."""
    from gguf.quants import dequantize as gguf_dequantize

    from muse_mlx.layers import QLinear
    from muse_mlx.quantizers import quantize
    from muse_mlx.routes import make_route

    rng = np.random.default_rng(3)
    w32 = rng.standard_normal((48, 512)).astype(np.float32)
    raw = quantize(w32, qtype)
    lin = QLinear(mx.array(raw), qtype, 512, 48, "blocks")
    x = rng.standard_normal((9, 512)).astype(np.float32)
    route = make_route("pinned")
    route.batched = mx.float16
    got = np.array(route.linear(mx.array(x), lin)).astype(np.float64)
    route.batched = mx.float32
    f32 = np.array(route.linear(mx.array(x), lin)).astype(np.float64)
    wh = gguf_dequantize(raw, qtype).reshape(48, 512).astype(np.float16).astype(np.float64)
    want = x.astype(np.float16).astype(np.float64) @ wh.T
    step = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)  # one half-step at each output
    want = want.astype(np.float16).astype(np.float64)
    assert (np.abs(got - want) <= step).all()
    assert (got == want).mean() > 0.95
    assert (np.abs(f32 - want) > step).any()  # the float32 prefill's operands are not rounded


def test_batched_prefill_evaluated_layer_by_layer_gives_the_same_bits(tiny):
    """generate evaluates a batched prefill every few layers (to bound its memory), each group
    started before the previous one is waited for, and on CUDA every matmul committed on its own: a
    schedule, not a change of arithmetic, so every period, pipelined or not, committed per matmul or
    not, gives the one-graph logits bit for bit."""
    from muse_mlx.generate import batched_prefill

    model = load_model(tiny("muse-glimmer"), "pinned")
    out = {}
    for period, pipeline, commits in ((0, True, False), (1, True, False), (3, True, False), (1, False, False),
                                      (3, False, False), (1, True, True), (0, True, True)):
        with batched_prefill(model.route, "batched", period, pipeline, commits):
            assert model.route.matmul_commits == commits
            out[period, pipeline, commits] = logits(model, TOKENS)
        assert model.route.matmul_commits is False  # restored
    for key in out:
        np.testing.assert_array_equal(out[0, True, False].view(np.uint64), out[key].view(np.uint64))


def test_stock_prefill_committed_per_matmul_gives_the_same_bits(tiny):
    """The stock route keeps MLX's matmuls in a prefill; committing each one on its own (the CUDA
    graph workaround, off by default there) changes when they run, not what they compute."""
    from muse_mlx.generate import batched_prefill

    model = load_model(tiny("muse-glimmer"), "stock")
    plain = logits(model, TOKENS)
    with batched_prefill(model.route, "batched", matmul_commits=True):
        assert model.route.matmul_commits and model.route.batched is None  # stock has no batched mode
        committed = logits(model, TOKENS)
    assert model.route.matmul_commits is False
    with batched_prefill(model.route):
        assert model.route.matmul_commits is False  # the default for stock
    np.testing.assert_array_equal(plain.view(np.uint32), committed.view(np.uint32))


def test_graph_per_matmul_is_the_default_for_the_float32_prefill_on_cuda(monkeypatch):
    """MLX's CUDA graphs with TF32 GEMMs are the case the commits are for (Route.matmul_commits):
    on by default there, off for half precision, for the stock route and off CUDA."""
    from muse_mlx.generate import batched_prefill
    from muse_mlx.routes import make_route

    pinned, stock = make_route("pinned"), make_route("stock")
    with batched_prefill(pinned, "batched"):
        assert pinned.matmul_commits is (mx.default_device() == mx.gpu and mx.cuda.is_available())
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    for route, mode, want in ((pinned, "batched", True), (pinned, "batched-f16", False), (pinned, "exact", False),
                              (stock, "batched", False)):
        with batched_prefill(route, mode):
            assert route.matmul_commits is want, (route.name, mode)
        assert route.matmul_commits is False


def test_q8_glu_weights_in_tiles_give_the_same_logits(tiny, monkeypatch):
    """MUSE_MLX_Q8_TILE=16 holds each GLU's gate and up in tiles of 16 rows for the q8 route
    (quants.tile_q4_K_rows; rows of two blocks here, so the bytes do move), and the logits of a
    prefill (the batched dequantization reads the tiles) and of decoded tokens (the q8 GLU reads
    them) are the raw rows', bit for bit. Model.set_flags gives the raw rows back without mv_q8 and
    tiles them again with it; a tile that the rows are not whole multiples of leaves them raw; a bad
    value is an error that names the variable."""
    from muse_mlx.layers import QLinear
    from muse_mlx.writer import Geometry

    path = tiny("muse-glimmer", geometry=Geometry(n_embd=512, n_ff=512, head_dim=64, n_head=4, n_head_kv=2))
    flags = ["mv_q8", "mv_q8_q6k"]

    from muse_mlx.generate import batched_prefill

    def run(model):
        model.kv_dtype = mx.float16
        cache = model.make_cache()
        with batched_prefill(model.route):  # a prompt's matmuls on the dequantized rows
            outs = [np.array(model(mx.array([TOKENS[:6]]), cache)[0])]
        outs += [np.array(model(mx.array([[t]]), cache)[0]) for t in (7, 300)]
        return [o.view(np.uint32) for o in outs]

    monkeypatch.setenv("MUSE_MLX_Q8_TILE", "1")  # raw rows on every backend (CUDA's default tiles them)
    raw = run(load_model(path, "pinned", flags))
    monkeypatch.setenv("MUSE_MLX_Q8_TILE", "16")
    model = load_model(path, "pinned", flags)
    forms = {n: (m.form, m.tile) for n, m in model.named_modules() if isinstance(m, QLinear)}
    glu = {n for n in forms if n.rsplit(".", 1)[-1] in ("ffn_gate", "ffn_up")}
    assert glu and all(forms[n] == ("q4_K_tiled", 16) for n in glu)
    assert all(forms[n][0] != "q4_K_tiled" for n in forms if n not in glu)
    model.route.dispatches.clear()
    for got, want in zip(run(model), raw):
        np.testing.assert_array_equal(got, want)
    d = model.route.dispatches
    assert d["mul_mv_q4_K_q8 (glu)"] == 2 * model.cfg.n_layer  # the two decoded tokens
    assert d["dequant_matmul"] >= 2 * model.cfg.n_layer  # the prompt's, gate and up among them
    model.set_flags(())
    assert all(m.form == "blocks" for n, m in model.named_modules() if n in glu)
    model.set_flags(flags)
    assert all((m.form, m.tile) == ("q4_K_tiled", 16) for n, m in model.named_modules() if n in glu)
    for got, want in zip(run(model), raw):
        np.testing.assert_array_equal(got, want)
    monkeypatch.setenv("MUSE_MLX_Q8_TILE", "24")  # 512 rows are not whole tiles of 24
    assert all(m.form == "blocks" for n, m in load_model(path, "pinned", flags).named_modules() if n in glu)
    monkeypatch.setenv("MUSE_MLX_Q8_TILE", "16")
    monkeypatch.setenv("MUSE_MLX_Q8_PRE", "0")  # the GLU's per-threadgroup kernel reads raw rows only
    assert all(m.form == "blocks" for n, m in load_model(path, "pinned", flags).named_modules() if n in glu)
    monkeypatch.delenv("MUSE_MLX_Q8_PRE")
    monkeypatch.setenv("MUSE_MLX_Q8_TILE", "sixteen")
    with pytest.raises(ValueError, match="MUSE_MLX_Q8_TILE='sixteen'"):
        load_model(path, "pinned", flags)
    with pytest.raises(ValueError, match="MUSE_MLX_Q8_TILE='sixteen'"):  # and leaves the model as it was
        model.set_flags(())
    assert model.route.flags == frozenset(flags)
    assert all((m.form, m.tile) == ("q4_K_tiled", 16) for n, m in model.named_modules() if n in glu)
    monkeypatch.setenv("MUSE_MLX_Q8_TILE", "16")
    # with the legacy fused FFN, whose kernel reads raw rows (and takes the GLU before mv_q8 does)
    model.set_flags(flags + ["ffn_4r2s"])
    assert all(m.form == "blocks" for n, m in model.named_modules() if n in glu)


def test_q8_tile_default_per_backend(monkeypatch):
    """Unset, MUSE_MLX_Q8_TILE is the backend's entry of mul_mv.Q8_TILE (CUDA tiles, the rest keep
    raw rows until timed there); set, it wins on every backend."""
    from muse_mlx.kernels import mul_mv

    monkeypatch.delenv("MUSE_MLX_Q8_TILE", raising=False)
    assert mul_mv.q8_tile("cuda") == mul_mv.Q8_TILE["cuda"] > 1
    assert mul_mv.q8_tile("metal") == mul_mv.q8_tile("cpu") == 1
    for which, want in (("cuda", mul_mv.Q8_TILE["cuda"]), ("cpu", 1)):  # unnamed: the backend in use
        monkeypatch.setattr(mul_mv, "backend", lambda which=which: which)
        assert mul_mv.q8_tile() == want
    monkeypatch.setenv("MUSE_MLX_Q8_TILE", "1")
    assert mul_mv.q8_tile("cuda") == 1
    monkeypatch.setenv("MUSE_MLX_Q8_TILE", "64")
    assert mul_mv.q8_tile("cpu") == 64


def test_a_lone_tiled_glu_weight_gets_its_raw_rows_back(tmp_path, monkeypatch):
    """A GLU whose gate and up differ in type (here up is Q6_K) is not the q8 GLU's: its Q4_K gate
    keeps its raw rows, at load and through Model.set_flags, and a prefill and a decoded token give
    what they give without MUSE_MLX_Q8_TILE, bit for bit."""
    from gguf import GGMLQuantizationType as T
    from muse_mlx import writer
    from muse_mlx.generate import batched_prefill
    from muse_mlx.writer import Geometry

    plain = writer.tensor_type
    monkeypatch.setattr(writer, "tensor_type", lambda name, *a: T.Q6_K if name.endswith("ffn_up.weight")
                        else plain(name, *a))
    path = writer.write_tiny(tmp_path / "mixed.gguf", "muse-glimmer",
                             geometry=Geometry(n_embd=512, n_ff=512, head_dim=64, n_head=4, n_head_kv=2))
    flags = ["mv_q8", "mv_q8_q6k"]

    def run(model):
        cache = model.make_cache()
        with batched_prefill(model.route):
            first = np.array(model(mx.array([TOKENS[:5]]), cache)[0])
        return first.view(np.uint32), np.array(model(mx.array([[7]]), cache)[0]).view(np.uint32)

    raw, raw_q8 = run(load_model(path, "pinned", flags)), run(load_model(path, "pinned", ["mv_q8"]))
    monkeypatch.setenv("MUSE_MLX_Q8_TILE", "16")
    model = load_model(path, "pinned", flags)
    gate, up = model.blk[0].ffn_gate, model.blk[0].ffn_up
    assert (gate.qtype, up.qtype) == (T.Q4_K, T.Q6_K) and gate.form == "blocks" and gate.tile == 1
    for got, want in zip(run(model), raw):
        np.testing.assert_array_equal(got, want)
    model.set_flags(["mv_q8"])
    assert gate.form == "blocks"
    for got, want in zip(run(model), raw_q8):
        np.testing.assert_array_equal(got, want)
