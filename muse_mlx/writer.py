"""Writing GGUF checkpoints: tiny random models for every architecture, or given weights.

Files are written with gguf-py's ``GGUFWriter`` and the project's own deterministic
quantizers, with the metadata llama.cpp reads for each architecture, so the same files
load in llama.cpp (the comparator). The same seed always gives the same bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from .config import ARCHITECTURES
from .quantizers import quantize
from .vocab import Vocab, tiny_vocab


@dataclass(frozen=True)
class Geometry:
    n_layer: int = 4
    n_embd: int = 256
    n_ff: int = 512
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_ctx: int = 512
    sliding_window: int = 8
    rms_eps: float = 1e-6
    rope_base: float = 10000.0
    rope_base_swa: float | None = None
    logit_scale: float = 1.0
    final_softcap: float | None = None
    attn_softcap: float | None = None
    swa_pattern: tuple[bool, ...] | None = None  # written as the per-layer bool array key


# Muse Glimmer's release geometry (muse-glimmer.md); the vocabulary comes from the Vocab.
MUSE_GLIMMER_30B = Geometry(
    n_layer=52, n_embd=6656, n_ff=19968, n_head=32, n_head_kv=2, head_dim=128, n_ctx=8192,
    sliding_window=4096, rms_eps=1e-5,
)

QUANT_MIXES = ("q4_k_m", "f32", "f16", "q8_0", "q6_k", "q5_k")


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M rule for which attn_v / ffn_down tensors get Q6_K (llama-quant.cpp)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], mix: str, n_layer: int, tied: bool) -> T:
    """The GGML type ``mix`` gives tensor ``name`` (shape in numpy order, [out, in])."""
    if len(shape) < 2 or name.endswith("_norm.weight") or name == "rope_freqs.weight":
        return T.F32
    if mix in ("f32", "f16"):
        return T.F32 if mix == "f32" else T.F16
    if mix == "q8_0":
        want = T.Q8_0
    elif mix == "q6_k":
        want = T.Q6_K
    elif mix == "q5_k":
        want = T.Q5_K
    else:  # q4_k_m
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            want = T.Q6_K
        elif name.endswith("attn_v.weight") or name.endswith("ffn_down.weight"):
            want = T.Q6_K if use_more_bits(layer, n_layer) else T.Q4_K
        else:
            want = T.Q4_K
    # Rows that are not whole 256-blocks cannot hold a K-quant (llama.cpp falls back the same way).
    if shape[-1] % 256 and want in (T.Q4_K, T.Q5_K, T.Q6_K):
        want = T.Q8_0
    if shape[-1] % 32 and want == T.Q8_0:
        want = T.F16
    return want


def tensor_shapes(arch: str, g: Geometry, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``arch`` at geometry ``g``, in the order the file stores them."""
    D, q, kv = g.n_embd, g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    tied = arch in ("gemma2", "gemma3")
    shapes = {"token_embd.weight": (vocab, D)}
    sandwich = arch in ("muse-glimmer", "gemma2", "gemma3")
    for i in range(g.n_layer):
        p = f"blk.{i}."
        shapes[p + "attn_norm.weight"] = (D,)
        shapes[p + "attn_q.weight"] = (q, D)
        shapes[p + "attn_k.weight"] = (kv, D)
        shapes[p + "attn_v.weight"] = (kv, D)
        if arch == "muse-glimmer":
            shapes[p + "attn_gate.weight"] = (q, D)
        if arch in ("muse-glimmer", "gemma3", "qwen3"):
            shapes[p + "attn_q_norm.weight"] = (g.head_dim,)
            shapes[p + "attn_k_norm.weight"] = (g.head_dim,)
        shapes[p + "attn_output.weight"] = (D, q)
        if sandwich:
            shapes[p + "post_attention_norm.weight"] = (D,)
        shapes[p + "ffn_norm.weight"] = (D,)
        shapes[p + "ffn_gate.weight"] = (g.n_ff, D)
        shapes[p + "ffn_up.weight"] = (g.n_ff, D)
        shapes[p + "ffn_down.weight"] = (D, g.n_ff)
        if sandwich:
            shapes[p + "post_ffw_norm.weight"] = (D,)
    shapes["output_norm.weight"] = (D,)
    if not tied:
        shapes["output.weight"] = (vocab, D)
    return shapes


def random_weights(arch: str, g: Geometry, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic random float32 weights with sane scales (unit-ish activations)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(arch, g, vocab).items():
        if name.endswith("attn_q_norm.weight") and arch == "muse-glimmer":
            # The converter synthesizes q_norm as the constant qk_scale_factor, k_norm as ones.
            out[name] = np.full(shape, 1.25, dtype=np.float32)
        elif name.endswith("attn_k_norm.weight") and arch == "muse-glimmer":
            out[name] = np.ones(shape, dtype=np.float32)
        elif len(shape) == 1:
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name == "token_embd.weight":
            # Gemma scales embeddings up by sqrt(n_embd); keep its rows small so activations stay unit-ish.
            std = 1.0 / np.sqrt(shape[1]) if arch in ("gemma2", "gemma3") else 1.0
            out[name] = (std * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return out


def _metadata(w: GGUFWriter, arch: str, g: Geometry) -> None:
    k = lambda name: f"{arch}.{name}"  # noqa: E731
    w.add_uint32(k("context_length"), g.n_ctx)
    w.add_uint32(k("embedding_length"), g.n_embd)
    w.add_uint32(k("block_count"), g.n_layer)
    w.add_uint32(k("feed_forward_length"), g.n_ff)
    w.add_uint32(k("attention.head_count"), g.n_head)
    w.add_uint32(k("attention.head_count_kv"), g.n_head_kv)
    w.add_uint32(k("attention.key_length"), g.head_dim)
    w.add_uint32(k("attention.value_length"), g.head_dim)
    w.add_float32(k("attention.layer_norm_rms_epsilon"), g.rms_eps)
    w.add_float32(k("rope.freq_base"), g.rope_base)
    if g.rope_base_swa is not None:
        w.add_float32(k("rope.freq_base_swa"), g.rope_base_swa)
    if arch in ("muse-glimmer", "gemma2", "gemma3"):
        w.add_uint32(k("attention.sliding_window"), g.sliding_window)
        if g.swa_pattern is not None:
            w.add_array(k("attention.sliding_window_pattern"), [bool(b) for b in g.swa_pattern])
    if arch == "muse-glimmer":
        w.add_float32(k("logit_scale"), g.logit_scale)
    if g.final_softcap is not None:
        w.add_float32(k("final_logit_softcapping"), g.final_softcap)
    if arch == "gemma2" and g.attn_softcap is not None:
        w.add_float32(k("attn_logit_softcapping"), g.attn_softcap)


def _tokenizer(w: GGUFWriter, v: Vocab) -> None:
    w.add_string("tokenizer.ggml.model", v.model)
    if v.model == "gpt2":
        w.add_string("tokenizer.ggml.pre", v.pre)
    w.add_array("tokenizer.ggml.tokens", v.tokens)
    w.add_array("tokenizer.ggml.token_type", v.types)
    if v.merges:
        w.add_array("tokenizer.ggml.merges", v.merges)
    if v.scores is not None:
        w.add_array("tokenizer.ggml.scores", [float(x) for x in v.scores])
    if v.unk_id is not None:
        w.add_uint32("tokenizer.ggml.unknown_token_id", v.unk_id)
    w.add_uint32("tokenizer.ggml.bos_token_id", v.bos_id)
    w.add_uint32("tokenizer.ggml.eos_token_id", v.eos_id)
    w.add_bool("tokenizer.ggml.add_bos_token", v.add_bos)
    if v.chat_template:
        w.add_string("tokenizer.chat_template", v.chat_template)


def write_gguf(path, arch: str, g: Geometry, weights: dict[str, np.ndarray], vocab: Vocab | None,
               mix: str = "q4_k_m", name: str | None = None) -> Path:
    """Write ``weights`` (float32, numpy [out, in] order) as a GGUF of ``arch`` with quant ``mix``."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r} (choose from {', '.join(ARCHITECTURES)})")
    if mix not in QUANT_MIXES:
        raise ValueError(f"unknown quant mix {mix!r} (choose from {', '.join(QUANT_MIXES)})")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    w = GGUFWriter(tmp, arch)
    w.add_string("general.name", name or f"tiny-{arch}")
    _metadata(w, arch, g)
    if vocab is not None:
        _tokenizer(w, vocab)
    tied = "output.weight" not in weights
    for tname, x in weights.items():
        qtype = tensor_type(tname, x.shape, mix, g.n_layer, tied)
        data = quantize(x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x, qtype)
        if x.ndim == 1:
            w.add_tensor(tname, data.reshape(-1), raw_dtype=qtype if qtype != T.F32 else None)
        else:
            w.add_tensor(tname, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)  # readers never see a half-written file
    return path


def write_tiny(path, arch: str = "muse-glimmer", mix: str = "q4_k_m", seed: int = 0,
               geometry: Geometry | None = None, vocab: Vocab | None = None) -> Path:
    """A random-weight checkpoint of ``arch``: small, deterministic, loadable by llama.cpp."""
    g = geometry or default_geometry(arch)
    v = vocab or tiny_vocab()
    return write_gguf(path, arch, g, random_weights(arch, g, len(v), seed), v, mix)


def default_geometry(arch: str) -> Geometry:
    """The tiny geometry used by tests and the demo; gemma2 gets its soft-caps."""
    g = Geometry()
    if arch == "gemma2":
        g = replace(g, attn_softcap=50.0, final_softcap=30.0)
    if arch in ("gemma3",):
        g = replace(g, rope_base_swa=10000.0, rope_base=1e6)
    return g
