"""Bad files and bad requests fail with the project's own errors, naming the file and the problem."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from muse_mlx import GGUFError, ModelConfigError, RouteError, load, load_model
from muse_mlx.routes import make_route
from muse_mlx.writer import default_geometry, random_weights, write_gguf
from muse_mlx.vocab import tiny_vocab


def _write(tmp_path, arch="muse-glimmer", mutate=None, geometry=None, drop_keys=(), name="m.gguf", mix="f32"):
    """A tiny checkpoint with its weights or metadata changed first."""
    g = geometry or default_geometry(arch)
    v = tiny_vocab()
    w = random_weights(arch, g, len(v))
    if mutate:
        mutate(w)
    path = tmp_path / name
    write_gguf(path, arch, g, w, v, mix)
    if drop_keys:
        _rewrite(path, drop_keys)
    return path


def _rewrite(path, drop_keys=(), retype=None):
    """Copy a GGUF through gguf-py's reader and writer, dropping keys or re-encoding tensors."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(path)
    out = path.with_name("rewritten.gguf")
    w = GGUFWriter(out, r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k in drop_keys or k.startswith("GGUF.") or k == "general.architecture":
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            w.add_array(k, f.contents())
        elif f.types[0] == GGUFValueType.STRING:
            w.add_string(k, f.contents())
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    for t in r.tensors:
        data, qtype = np.asarray(t.data), T(t.tensor_type)
        if retype and t.name in retype:
            qtype = retype[t.name]
            data = gguf_quants.quantize(data, qtype)
        w.add_tensor(t.name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shutil.move(out, path)


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="no such file") as e:
        load(tmp_path / "nope.gguf")
    assert "nope.gguf" in str(e.value)


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load(p)


def test_missing_rms_epsilon_names_the_key(tmp_path):
    p = _write(tmp_path, drop_keys={"muse-glimmer.attention.layer_norm_rms_epsilon"})
    with pytest.raises(ModelConfigError, match="'muse-glimmer.attention.layer_norm_rms_epsilon' is missing"):
        load_model(p)


def test_missing_logit_scale_names_the_key(tmp_path):
    p = _write(tmp_path, drop_keys={"muse-glimmer.logit_scale"})
    with pytest.raises(ModelConfigError, match="muse-glimmer.logit_scale"):
        load_model(p)


def test_unknown_architecture(tmp_path):
    p = _write(tmp_path)
    data = bytearray(p.read_bytes())
    i = data.index(b"muse-glimmer")
    data[i : i + 12] = b"muse-shimmer"  # same length: every offset stays valid
    p.write_bytes(bytes(data))
    with pytest.raises(ModelConfigError, match="architecture 'muse-shimmer' is not supported"):
        load_model(p)


def test_missing_tensor(tmp_path):
    p = _write(tmp_path, mutate=lambda w: w.pop("blk.2.attn_gate.weight"))
    with pytest.raises(ModelConfigError, match="'blk.2.attn_gate.weight' is missing"):
        load_model(p)


def test_wrong_tensor_shape(tmp_path):
    def shrink(w):
        w["blk.1.ffn_up.weight"] = w["blk.1.ffn_up.weight"][:256]
    p = _write(tmp_path, mutate=shrink)
    with pytest.raises(ModelConfigError, match=r"'blk.1.ffn_up.weight' has shape \[256, 256\], expected \[512, 256\]"):
        load_model(p)


def test_tensor_the_graph_would_ignore(tmp_path):
    def extra(w):
        w["blk.0.attn_q.bias"] = np.zeros(256, np.float32)
    p = _write(tmp_path, mutate=extra)
    with pytest.raises(ModelConfigError, match="would ignore.*blk.0.attn_q.bias"):
        load_model(p)


def test_non_finite_norm_weight(tmp_path):
    def poison(w):
        w["blk.3.ffn_norm.weight"][5] = np.nan
    p = _write(tmp_path, mutate=poison)
    with pytest.raises(ModelConfigError, match="'blk.3.ffn_norm.weight' holds a non-finite value at index 5"):
        load_model(p)


def test_unsupported_tensor_type(tmp_path):
    p = _write(tmp_path, arch="llama")
    _rewrite(p, retype={"blk.0.attn_q.weight": T.Q4_0})
    with pytest.raises(ModelConfigError, match="'blk.0.attn_q.weight' has type Q4_0, which this engine does not support"):
        load_model(p)


def test_truncated_file(tmp_path):
    p = _write(tmp_path)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError):
        load_model(p)


def test_unknown_route_and_flags():
    with pytest.raises(RouteError, match="unknown route 'fast'"):
        make_route("fast")
    with pytest.raises(RouteError, match="unknown flag"):
        make_route("pinned", ["turbo"])
    with pytest.raises(RouteError, match="apply only to the pinned route"):
        make_route("stock", ["tail_32sg"])
    with pytest.raises(RouteError, match="mv_q8_q6k works only together with mv_q8"):
        make_route("pinned", ["mv_q8_q6k"])


def test_missing_tokenizer(tmp_path):
    g = default_geometry("llama")
    w = random_weights("llama", g, 300)
    p = write_gguf(tmp_path / "notok.gguf", "llama", g, w, None, "f32")
    load_model(p)  # the model alone loads
    with pytest.raises(ModelConfigError, match="the file has no tokenizer"):
        load(p)


def test_loading_needs_far_less_than_twice_the_file(tmp_path, capfd):
    """Weights are copied tensor by tensor from the mapping: peak MLX memory ~ the model, not 2x the file.

    pinned keeps the raw blocks (1x the quantized bytes). stock repacks Q4_K to affine with float32
    scales (6.0 vs 4.5 bits per weight) and Q6_K to its exact hi/lo pair (16 vs 6.56 bits); a
    tensor's repack is built in chunks and joined, so the peak is the model plus at most one
    tensor's form twice over (the chunks and their join).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from muse_mlx.writer import Geometry, write_tiny

    g = Geometry(n_layer=4, n_embd=1024, n_ff=4096, n_head=8, n_head_kv=2, head_dim=128)
    path = write_tiny(tmp_path / "mid.gguf", "muse-glimmer", "q4_k_m", geometry=g)
    size = path.stat().st_size
    for route in ("pinned", "stock"):
        mx.clear_cache()
        mx.reset_peak_memory()
        model = load_model(path, route, progress=True)
        peak = mx.get_peak_memory()
        held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        if route == "pinned":
            assert peak < 1.1 * size, peak / size
        else:
            forms = [sum(v.nbytes for _, v in tree_flatten(m.parameters()))
                     for _, m in model.named_modules() if hasattr(m, "form")]
            assert 1.3 * size < held < 1.6 * size, held / size
            assert peak < held + 2 * max(forms) + (8 << 20), (peak / size, held / size)
        del model
    assert "loading mid.gguf" in capfd.readouterr().err  # the progress bar


def test_perplexity_cli_refuses_bad_requests_in_one_line(tiny, tmp_path, capsys):
    """python -m muse_mlx.perplexity: each bad value is one error line and status 2 (a negative
    --max-tokens used to score a slice from the end, and a window past the model's context ran)."""
    from muse_mlx.perplexity import main

    model = str(tiny("qwen3"))
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    (tmp_path / "bad.txt").write_bytes(b"ok \xff")
    n_ctx = load(model)[0].cfg.n_ctx_train
    for args, msg in [(["--ctx", "1"], "--ctx must be at least 2"),
                      (["--max-tokens", "-3"], "--max-tokens must be at least 2, got -3"),
                      (["--ctx", str(n_ctx + 1)], f"--ctx {n_ctx + 1} is longer than the model's context ({n_ctx})"),
                      (["--routes", "warp"], "unknown route"),
                      (["--file", str(tmp_path / "bad.txt")], "cannot read the text")]:
        argv = ["--model", model, "--file", str(text)] + args
        assert main(argv) == 2, args
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0], (args, err)
    assert main(["--model", model, "--file", str(text), "--max-tokens", "20"]) == 0
    assert "20 tokens of" in capsys.readouterr().out


@pytest.mark.parametrize("mix", ["q4_k_m", "q8_0"])
def test_the_pinned_decode_path_gives_an_id_outside_the_table_nan_logits(tiny, mix):
    """On the one-token decode path (no guard ops) the pinned route's embedding itself gives an
    id outside the table a NaN row, the Q4_K table through its kernel, a Q8_0 one through MLX's
    gather, so its logits are NaN; a valid id after it, on a fresh cache, decodes as before."""
    import mlx.core as mx

    model, _ = load(tiny("muse-glimmer", mix=mix), route="pinned")
    V = model.cfg.vocab_size

    def decode(token):
        cache = model.make_cache()
        model(mx.array([[3, 5]]), cache)
        assert model.uses_decode_path(mx.array([[token]]), cache)
        return np.array(model(mx.array([[token]]), cache))

    before = decode(7)
    assert np.isfinite(before).all()
    for bad in (V, -1):
        assert np.isnan(decode(bad)).all(), bad
    assert np.array_equal(decode(7), before)


@pytest.mark.parametrize("route", ["stock", "pinned"])
def test_an_id_outside_the_vocabulary_gives_nan_logits_not_a_crash(tiny, route):
    """model(ids) does not read the ids back; an id past the table reads row 0 and makes its row NaN
    (it used to read past the table: a crash on the CPU). Valid ids keep their bits."""
    import mlx.core as mx

    model, _ = load(tiny("muse-glimmer"), route=route)
    V = model.cfg.vocab_size
    ids = mx.array([[3, 5, 7]])
    assert np.array_equal(np.array(model.route.embed(model.token_embd, ids)), np.array(model.token_embd(ids)))
    for bad in (V, -1, 10**6):
        logits = np.array(model(mx.array([[3, bad, 7]])))
        assert np.isnan(logits).all(), bad  # the row's NaN reaches every position through attention's sums
