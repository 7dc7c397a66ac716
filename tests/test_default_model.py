"""The shipped model: a real (tiny) language model, the same on both routes and in llama.cpp."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from muse_mlx import load
from muse_mlx.demo import TRAINED, default_model
from muse_mlx.generate import generate
from muse_mlx.perplexity import llama_cpp_perplexity, perplexity

HELDOUT = Path(__file__).parent / "data" / "pydoc-heldout.txt"
COMMON = {"the", "of", "a", "is", "to", "and", "in", "be", "if", "for", "an", "or", "that", "this", "value", "file",
          "object", "return", "returns", "function", "module", "name", "not", "with", "as", "by", "are"}


@pytest.fixture(scope="module")
def tokens():
    _, tok = load(TRAINED)
    return tok.encode(HELDOUT.read_text())[:1024]


def test_the_default_model_is_the_trained_one():
    path, note = default_model()
    assert path == TRAINED and path.stat().st_size < 4_000_000 and "trained" in note
    model, _ = load(path)
    assert model.cfg.arch == "muse-glimmer" and (model.cfg.n_layer, model.cfg.n_embd) == (4, 256)


def test_held_out_perplexity_is_that_of_a_language_model(tokens):
    """Text the model never saw: uniform guessing over 2,048 tokens scores 2,048; the trained model ~30."""
    model, _ = load(TRAINED)
    assert perplexity(model, tokens, 128).ppl < 60


def test_routes_agree_on_perplexity(tokens):
    """One 64-token window (the pinned route runs its exact-order oracles on a CPU: slow)."""
    stock = perplexity(load(TRAINED, "stock")[0], tokens[:64], 64)
    pinned = perplexity(load(TRAINED, "pinned")[0], tokens[:64], 64)
    assert abs(stock.nll - pinned.nll) < 1e-4  # nats per token; the routes differ in float32 rounding only


def test_generated_text_is_recognisably_english():
    model, tok = load(TRAINED)
    text = generate(model, tok, "Return the", max_tokens=40)
    words = set(re.findall(r"[a-z]+", text.lower()))
    assert len(words & COMMON) >= 3, text


@pytest.mark.llama_cpp
def test_llama_cpp_perplexity_agrees(tokens):
    """llama.cpp's CPU backend rounds activations to 8 bits before Q4_K products (docs/quality.md)."""
    pytest.importorskip("llama_cpp")
    ours = perplexity(load(TRAINED)[0], tokens, 128)
    theirs = llama_cpp_perplexity(TRAINED, tokens, 128)
    assert abs(ours.nll - theirs.nll) < 0.01
