"""Synthetic checkpoints: random-block files of a muse-glimmer geometry that load, decode and are reused."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from reference import RefModel

from muse_mlx import load
from muse_mlx import synthetic
from muse_mlx.gguf_file import GGUFFile
from muse_mlx.quants import FORMATS
from muse_mlx.synthetic import (
    NAME, SCALE_RANGE, ensure_synthetic, params_json, stored_params, synthetic_vocab, write_synthetic,
)
from muse_mlx.vocab import SPECIALS, byte_alphabet
from muse_mlx.writer import QUANT_MIXES, Geometry, tensor_shapes, use_more_bits

# The release shape family at toy size: 256-multiple widths (K-quant rows), GQA, both Q4_K_M
# branches of use_more_bits (layer 0 keeps Q4_K attn_v/ffn_down, layer 1 gets Q6_K).
TINY = Geometry(n_layer=2, n_embd=512, n_ff=1024, n_head=4, n_head_kv=2, head_dim=128, n_ctx=8192,
                sliding_window=4096, rms_eps=1e-5)
VOCAB = 2000
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "  spaces,\ttabs\nand 12345 digits ~!@#"]


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("synthetic") / "tiny.gguf", TINY, VOCAB, seed=0, progress=False)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("route", ["stock", "pinned"])
def test_loads_and_runs_on_both_routes(tiny_file, route):
    model, tok = load(tiny_file, route)
    ids = tok.encode(TEXTS[1])
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), VOCAB)
    assert bool(mx.isfinite(logits).all())


def test_tensors_follow_the_q4_k_m_rule(tiny_file):
    f = GGUFFile(tiny_file)
    shapes = tensor_shapes("muse-glimmer", TINY, VOCAB)
    assert list(f.tensors) == list(shapes)  # writer.write_gguf's names and order
    for name, shape in shapes.items():
        assert f.shape(name) == shape, name
        if len(shape) == 1:
            want = T.F32
        elif name == "output.weight":
            want = T.Q6_K
        elif name.endswith(("attn_v.weight", "ffn_down.weight")):
            want = (T.Q4_K, T.Q6_K)[int(name.split(".")[1])]  # llama.cpp's rule for 2 layers (below)
        else:  # token_embd, attn_q/k/gate/output, ffn_gate/up
            want = T.Q4_K
        assert T(f.tensors[name].tensor_type) == want, name
    types = {T(t.tensor_type) for n, t in f.tensors.items() if n.endswith("ffn_down.weight")}
    assert types == {T.Q4_K, T.Q6_K}  # both branches are in the file


def test_more_bits_picks_llama_cpp_s_layers():
    """llama-quant.cpp's use_more_bits: the first and last eighth, and every third layer between
    them, counted from the first eighth's end. At the release's 52 layers, 26 (the issue's count)."""
    picked = [i for i in range(52) if use_more_bits(i, 52)]
    assert picked == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 44,
                      45, 46, 47, 48, 49, 50, 51]
    assert [use_more_bits(i, 2) for i in range(2)] == [False, True]
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]


def test_norms_are_near_one(tiny_file):
    f = GGUFFile(tiny_file)
    for name, t in f.tensors.items():
        if name.endswith("attn_q_norm.weight"):
            assert np.all(t.data == 1.25)
        elif name.endswith("attn_k_norm.weight"):
            assert np.all(t.data == 1.0)
        elif name.endswith("norm.weight"):
            assert np.all(np.abs(t.data - 1.0) < 1.0), name


def test_every_block_scale_is_small_positive_finite(tiny_file):
    f = GGUFFile(tiny_file)
    offsets = {T.Q4_K: (0, 2), T.Q6_K: (208,)}  # d, dmin / d
    seen = 0
    for name, t in f.tensors.items():
        qtype = T(t.tensor_type)
        if qtype not in offsets:
            continue
        blocks = np.asarray(t.data).reshape(-1, FORMATS[qtype].type_size)
        for o in offsets[qtype]:
            d = blocks[:, o : o + 2].copy().view(np.float16).astype(np.float32)
            assert np.isfinite(d).all() and (d > 0).all(), name
            assert d.min() >= SCALE_RANGE[0] * 0.999 and d.max() <= SCALE_RANGE[1] * 1.001, name
        seen += blocks.shape[0]
    assert seen > 0


@pytest.mark.parametrize("mix", QUANT_MIXES)
def test_every_mix_and_fallback_types_match_float64_reference(tmp_path, mix):
    """n_embd 288 and n_ff 272 are not whole 256-blocks: tensor_type falls back to Q8_0 and F16
    there. The logits (K/V in float32) against float64 on gguf-py's weights, as test_model.py's.

    The random K-quant blocks give logits up to ~30 (float weights ~4), and float32 rounding moves
    them in proportion: measured up to 3.0e-6 of the largest logit (Q6_K at 512 wide, 8.9e-5),
    1e-6 elsewhere. The bound is 1e-5 of it."""
    for g in (TINY, Geometry(n_layer=1, n_embd=288, n_ff=272, n_head=4, n_head_kv=2, head_dim=64)):
        path = write_synthetic(tmp_path / f"{mix}-{g.n_embd}.gguf", g, 600, mix, progress=False)
        model, tok = load(path)
        model.kv_dtype = mx.float32
        ids = tok.encode("Hello world")
        ours = np.array(model(mx.array([ids]))[0], np.float64)
        ref = RefModel(path, kv_f16=False).forward(ids)
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_vocabulary_has_the_size_and_round_trips(tiny_file):
    _, tok = load(tiny_file)
    assert tok.vocab_size == VOCAB
    assert tok.bos_token == "<|bos|>" and tok.eos_token == "<|eot|>"
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and tok.decode(ids) == text
    assert len(tok.encode(TEXTS[1], add_special_tokens=False)) < len(TEXTS[1])  # merges are used


@pytest.mark.parametrize("size", [256 + len(SPECIALS), 2000, 256 * 256 + 261, 202048])
def test_synthetic_vocab_is_exact_and_every_merge_makes_its_token(size):
    v = synthetic_vocab(size)
    assert len(v) == len(v.types) == size and len(set(v.tokens)) == size
    assert v.tokens[:256] == byte_alphabet()
    assert v.tokens[-len(SPECIALS):] == list(SPECIALS) and v.bos_id == size - len(SPECIALS)
    index = {t: i for i, t in enumerate(v.tokens)}
    for rank, m in enumerate(v.merges):  # merge k makes token 256 + k, from earlier tokens
        a, b = m.split(" ")
        assert index[a] < 256 + rank and index[b] < 256 + rank and index[a + b] == 256 + rank


@pytest.mark.parametrize("size", [260, 256 ** 3 + 256 ** 2 + 262, "2000"])
def test_synthetic_vocab_rejects_bad_sizes(size):
    with pytest.raises(ValueError, match="size"):
        synthetic_vocab(size)


def test_same_seed_same_bytes_other_seed_other_bytes(tiny_file, tmp_path):
    again = write_synthetic(tmp_path / "again.gguf", TINY, VOCAB, seed=0, progress=False)
    other = write_synthetic(tmp_path / "other.gguf", TINY, VOCAB, seed=1, progress=False)
    assert sha256(again) == sha256(tiny_file)
    assert sha256(other) != sha256(tiny_file)
    assert not list(tmp_path.glob("*.partial"))


def test_parameters_are_stored(tiny_file):
    f = GGUFFile(tiny_file)
    assert f.get_str("general.name") == NAME
    assert stored_params(tiny_file) == params_json(TINY, VOCAB, "q4_k_m", 0)


def test_ensure_reuses_a_match_and_rewrites_a_mismatch(tmp_path, capsys):
    path = ensure_synthetic(tmp_path / "m.gguf", TINY, VOCAB, "q4_k_m", 0, progress=False)
    assert "writing" in capsys.readouterr().err
    stamp = path.stat().st_mtime_ns
    assert ensure_synthetic(path, TINY, VOCAB, "q4_k_m", 0, progress=False) == path
    assert "reused" in capsys.readouterr().err
    assert path.stat().st_mtime_ns == stamp
    ensure_synthetic(path, TINY, VOCAB, "q4_k_m", 5, progress=False)
    assert "other parameters" in capsys.readouterr().err
    assert stored_params(path) == params_json(TINY, VOCAB, "q4_k_m", 5)


def test_ensure_never_overwrites_other_files(tmp_path, tiny):
    real = tiny("muse-glimmer")
    before = sha256(real)
    with pytest.raises(ValueError, match="not a synthetic checkpoint"):
        ensure_synthetic(real, TINY, VOCAB, "q4_k_m", 0, progress=False)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        ensure_synthetic(junk, TINY, VOCAB, "q4_k_m", 0, progress=False)
    assert sha256(real) == before and junk.read_bytes() == b"not a gguf"


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(mix="q4_k_s"), "mix"),
        (dict(vocab_size=100), "vocab_size"),
        (dict(seed=-1), "seed"),
        (dict(geometry=Geometry(n_layer=0)), "geometry.n_layer"),
        (dict(geometry=Geometry(n_head=3, n_head_kv=2)), "geometry.n_head"),
    ],
)
def test_bad_parameters_name_themselves(tmp_path, kwargs, param):
    args = dict(geometry=TINY, vocab_size=VOCAB, mix="q4_k_m", seed=0) | kwargs
    with pytest.raises(ValueError, match=param):
        write_synthetic(tmp_path / "bad.gguf", progress=False, **args)
    assert not list(tmp_path.iterdir())


def test_cli_small_writes_then_reuses(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(synthetic, "SMALL_GEOMETRY", TINY)  # the real --small is 79 MB
    monkeypatch.setattr(synthetic, "SMALL_VOCAB", VOCAB)
    out = tmp_path / "cli.gguf"
    synthetic.main(["--out", str(out), "--small", "--seed", "2"])
    assert stored_params(out) == params_json(TINY, VOCAB, "q4_k_m", 2)
    synthetic.main(["--out", str(out), "--small", "--seed", "2"])
    assert "reused" in capsys.readouterr().err


def test_small_geometry_is_the_release_shape_family():
    g, r = synthetic.SMALL_GEOMETRY, synthetic.MUSE_GLIMMER_30B
    assert (g.head_dim, g.n_head_kv, g.n_ctx, g.sliding_window) == (r.head_dim, r.n_head_kv, r.n_ctx, r.sliding_window)
    assert g.n_embd % 256 == g.n_ff % 256 == 0 and synthetic.SMALL_VOCAB < synthetic.RELEASE_VOCAB


@pytest.mark.llama_cpp
def test_llama_cpp_loads_evaluates_and_tokenizes_like_us(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    # 70,000 tokens: past the 65,536 pair merges, so triples are in play too.
    path = write_synthetic(tmp_path / "llama.gguf", TINY, 70000, seed=3, progress=False)
    _, tok = load(path)
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, verbose=False, n_ctx=128, flash_attn=False)
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=True) == tok.encode(text)
    ids = tok.encode(TEXTS[1])[:8]
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)])
    assert logits.shape == (len(ids), 70000) and np.isfinite(logits).all()


def test_random_blocks_without_a_file_are_valid():
    """The benchmark's and GPU check's in-memory matrices: the file's kind of blocks."""
    rng = np.random.default_rng(5)
    for qtype in (T.Q4_K, T.Q6_K):
        raw = synthetic.random_blocks(7, 512, qtype, rng)
        assert raw.shape == (7, 2 * FORMATS[qtype].type_size) and raw.dtype == np.uint8
        values = gguf_dequantize(raw, qtype)
        assert np.isfinite(values).all() and np.abs(values).max() > 0
        lo, hi = synthetic._SCALE_BYTES[qtype]
        scales = raw.reshape(-1, FORMATS[qtype].type_size)[:, lo:hi].copy().view(np.float16).astype(np.float32)
        assert (scales >= synthetic.SCALE_RANGE[0] * 0.999).all() and (scales <= synthetic.SCALE_RANGE[1] * 1.001).all()
