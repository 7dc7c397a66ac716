"""Interoperability with the comparator: our files load in llama.cpp and its logits agree with ours.

Needs ``llama-cpp-python`` (``pip install -e ".[llama]"``); skipped when it is absent.
llama.cpp here runs on the CPU backend, which differs from an f32-activation engine in two
known ways (llama-cpp-facts.md C): its K-quant dot products quantize the activations to
8 bits (Q8_K), and its f16 K-cache dot product rounds q to f16. The bounds below are set
from those, and the measured gaps are recorded in docs/interop.md.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from muse_mlx import load

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llama_cpp

TEXT = "Hello world, the quick brown fox jumps over the lazy dog. This is a tiny model."

# f32 weights: only the f16 rounding of q (and of K/V, which both engines do) differs.
# Q4_K_M: every matvec's input is quantized to Q8_K (1/254 of a 256-block's max |x|).
BOUNDS = {"f32": 5e-3, "q4_k_m": 0.25}


def llama_logits(path, ids):
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, verbose=False, n_ctx=128, flash_attn=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


@pytest.mark.parametrize("mix", ["f32", "q4_k_m"])
def test_llama_cpp_logits_agree(tiny, arch, mix):
    path = tiny(arch, mix)
    model, tok = load(path)
    ids = tok.encode(TEXT)
    ours = np.array(model(mx.array([ids]))[0], dtype=np.float64)
    theirs = llama_logits(path, ids)
    assert np.abs(ours - theirs).max() < BOUNDS[mix]
    # and they rank the same token first almost everywhere
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9


def test_llama_cpp_tokenizes_like_us(tiny, arch):
    path = tiny(arch)
    _, tok = load(path)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    assert llm.tokenize(TEXT.encode(), add_bos=True) == tok.encode(TEXT)
