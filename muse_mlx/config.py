"""The model configuration, read from GGUF metadata exactly as llama.cpp reads it.

One dataclass covers every architecture; the differences between muse-glimmer, gemma3,
gemma2, qwen3 and llama are fields (post norms, entry norm, QK-norm, gate, activation,
which layers slide and which rotate), so the model code has no per-architecture copies.
References are to llama.cpp 0c1e570 (`src/models/<arch>.cpp`, `src/llama-model.cpp`).
"""

from __future__ import annotations

import numpy as np
from dataclasses import dataclass

from .errors import ModelConfigError
from .gguf_file import GGUFFile

ARCHITECTURES = ("muse-glimmer", "gemma3", "gemma2", "qwen3", "llama")

# A graph constant of llama.cpp's muse-glimmer.cpp, not stored in the checkpoint (Ch 12 §12.2).
MUSE_POST_NORM_EPS = 1e-8


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab_size: int
    n_ctx_train: int
    rms_eps: float
    post_norm_eps: float | None  # None: pre-norm-only architecture (qwen3, llama)
    entry_norm: bool  # muse-glimmer: unweighted rms_norm of the embedding row
    embed_scale: float | None  # gemma: embeddings times sqrt(n_embd), in float32
    qk_norm: bool  # per-head weighted rms_norm of q and k before RoPE
    attn_gate: bool  # muse-glimmer: o = attn * sigmoid(W_gate a) before o_proj
    activation: str  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    sliding_window: int  # 0: no sliding-window layers
    swa_layers: tuple[bool, ...]
    rope_layers: tuple[bool, ...]  # muse-glimmer: RoPE on sliding layers only (NoPE on global ones)
    rope_traditional: bool  # True: llama.cpp NORM (adjacent pairs); False: NEOX (halves)
    rope_dims: int
    rope_base: float
    rope_base_swa: float
    rope_scale: float  # freq_scale on global layers (1/linear factor); sliding layers use 1.0
    q_scale: float | None  # gemma: q *= q_scale before attention (then kq_scale = 1)
    kq_scale: float  # scale applied to q.k inside attention
    attn_softcap: float | None  # gemma2: s = c * tanh(s / c)
    final_softcap: float | None
    logit_scale: float | None  # muse-glimmer: logits *= logit_scale
    tied_output: bool  # output head is token_embd
    rope_freq_factors: bool = False  # llama3 `rope_freqs.weight`

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_head_kv * self.head_dim

    def layer_rope_base(self, layer: int) -> float:
        return self.rope_base_swa if self.swa_layers[layer] else self.rope_base

    def layer_rope_scale(self, layer: int) -> float:
        return 1.0 if self.swa_layers[layer] else self.rope_scale

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "ModelConfig":
        arch = f.get_str("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelConfigError(
                f.path, f"architecture '{arch}' is not supported (supported: {', '.join(ARCHITECTURES)})"
            )
        return _read(f, arch)


def _inv_sqrt(n: int) -> float:
    """``1.0f / sqrtf(float(n))`` evaluated in float32, as llama.cpp computes its attention scales."""
    return float(np.float32(1.0) / np.sqrt(np.float32(n)))


def _positive(f: GGUFFile, key: str, value: int) -> int:
    if value <= 0:
        raise ModelConfigError(f.path, f"metadata key '{key}' must be positive, got {value}")
    return value


def _swa_pattern(f: GGUFFile, arch: str, n_layer: int, default_period: int) -> tuple[bool, ...]:
    """llama.cpp's load_swa_pattern: a per-layer bool array, or a period (the last layer of each is global)."""
    key = f"{arch}.attention.sliding_window_pattern"
    if f.has(key) and f.array_kind(key) is not None:
        values = [bool(v) for v in f.get_array(key)]
        if len(values) != n_layer:
            raise ModelConfigError(f.path, f"metadata key '{key}' has {len(values)} entries for {n_layer} layers")
        return tuple(values)
    period = f.get_int(key, default_period)
    if period < 0:
        raise ModelConfigError(f.path, f"metadata key '{key}' must not be negative, got {period}")
    return tuple(period == 0 or (il % period < period - 1) for il in range(n_layer))


def _read(f: GGUFFile, arch: str) -> ModelConfig:
    k = lambda name: f"{arch}.{name}"  # noqa: E731
    n_layer = _positive(f, k("block_count"), f.get_int(k("block_count")))
    # Per-layer structures are built from block_count: check it against the tensors first.
    stored = sum(1 for name in f.tensors if name.endswith(".attn_norm.weight") and name.startswith("blk."))
    if n_layer != stored:
        raise ModelConfigError(f.path, f"metadata key '{k('block_count')}' = {n_layer}, but the file has {stored} layers of tensors")
    n_embd = _positive(f, k("embedding_length"), f.get_int(k("embedding_length")))
    n_ctx = _positive(f, k("context_length"), f.get_int(k("context_length")))
    for per_layer in ("feed_forward_length", "attention.head_count", "attention.head_count_kv"):
        if f.has(k(per_layer)) and f.array_kind(k(per_layer)) is not None:
            raise ModelConfigError(f.path, f"metadata key '{k(per_layer)}' is per-layer, which is not supported")
    n_ff = _positive(f, k("feed_forward_length"), f.get_int(k("feed_forward_length")))
    n_head = _positive(f, k("attention.head_count"), f.get_int(k("attention.head_count")))
    muse = arch == "muse-glimmer"
    # muse-glimmer declares these keys required; the other archs take llama.cpp's defaults.
    n_head_kv = f.get_int(k("attention.head_count_kv")) if muse else f.get_int(k("attention.head_count_kv"), n_head)
    _positive(f, k("attention.head_count_kv"), n_head_kv)
    if n_head % n_head_kv:
        raise ModelConfigError(f.path, f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    head_k = f.get_int(k("attention.key_length")) if muse else f.get_int(k("attention.key_length"), n_embd // n_head)
    head_v = f.get_int(k("attention.value_length")) if muse else f.get_int(k("attention.value_length"), head_k)
    _positive(f, k("attention.key_length"), head_k)
    if head_v != head_k:
        raise ModelConfigError(f.path, f"key_length {head_k} != value_length {head_v} is not supported")
    rms_eps = f.get_float(k("attention.layer_norm_rms_epsilon"))
    if rms_eps <= 0:
        raise ModelConfigError(f.path, f"metadata key '{k('attention.layer_norm_rms_epsilon')}' must be positive")
    rope_dims = f.get_int(k("rope.dimension_count"), head_k)
    if not 0 < rope_dims <= head_k or rope_dims % 2:
        raise ModelConfigError(f.path, f"rope.dimension_count {rope_dims} does not fit head size {head_k}")
    rope_base = f.get_float(k("rope.freq_base"), 10000.0)
    rope_scale = 1.0
    scaling = f.get_str(k("rope.scaling.type"), "none")
    if scaling == "linear":
        factor = f.get_float(k("rope.scaling.factor"), 1.0)
        rope_scale = 1.0 / factor if factor > 0 else 1.0
    elif scaling != "none":
        raise ModelConfigError(f.path, f"rope scaling type '{scaling}' is not supported (none, linear)")
    vocab = f.shape("token_embd.weight")[0]
    tied = "output.weight" not in f.tensors
    if tied and arch == "muse-glimmer":
        raise ModelConfigError(f.path, "required tensor 'output.weight' is missing (muse-glimmer is not tied)")
    if f.get_int(k("expert_count"), 0) > 0:
        raise ModelConfigError(f.path, "mixture-of-experts models are not supported")

    common = dict(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_k, vocab_size=vocab, n_ctx_train=n_ctx, rms_eps=rms_eps, rope_dims=rope_dims,
        rope_base=rope_base, rope_scale=rope_scale, tied_output=tied,
    )
    none_swa = tuple(False for _ in range(n_layer))
    all_rope = tuple(True for _ in range(n_layer))
    default_kq = _inv_sqrt(head_k)

    if muse:
        window = f.get_int(k("attention.sliding_window"))
        if window <= 0:
            raise ModelConfigError(f.path, f"metadata key '{k('attention.sliding_window')}' must be positive")
        swa = _swa_pattern(f, arch, n_layer, 4)
        # muse-glimmer.cpp does not reset llama_hparams' default soft-cap (30.0) as gemma3.cpp does,
        # so a file without the key is soft-capped at 30; a file may switch it off with 0.
        softcap = f.get_float(k("final_logit_softcapping"), 30.0)
        return ModelConfig(
            **common, post_norm_eps=MUSE_POST_NORM_EPS, entry_norm=True, embed_scale=None, qk_norm=True,
            attn_gate=True, activation="silu", sliding_window=window, swa_layers=swa, rope_layers=swa,
            rope_traditional=True, rope_base_swa=f.get_float(k("rope.freq_base_swa"), rope_base),
            q_scale=None, kq_scale=default_kq, attn_softcap=None, final_softcap=softcap or None,
            logit_scale=f.get_float(k("logit_scale")),
        )
    if arch in ("gemma2", "gemma3"):
        # The 27B checkpoints scale q by 1/sqrt(n_embd/n_head); llama.cpp infers them from the layer count.
        is_27b = n_layer == (46 if arch == "gemma2" else 62)
        q_scale = _inv_sqrt(n_embd // n_head) if is_27b else default_kq
        if arch == "gemma2":
            window = f.get_int(k("attention.sliding_window"), 4096)
            swa = _swa_pattern(f, arch, n_layer, 2)
            base_swa = f.get_float(k("rope.freq_base_swa"), rope_base)
            attn_cap = f.get_float(k("attn_logit_softcapping"), 50.0)
            final_cap = f.get_float(k("final_logit_softcapping"), 30.0)
        else:
            window = f.get_int(k("attention.sliding_window"), 0)
            swa = _swa_pattern(f, arch, n_layer, 6) if window > 0 else none_swa
            base_swa = f.get_float(k("rope.freq_base_swa"), 10000.0) if window > 0 else rope_base
            attn_cap = None
            final_cap = f.get_float(k("final_logit_softcapping"), 0.0) or None
        return ModelConfig(
            **common, post_norm_eps=rms_eps, entry_norm=False, embed_scale=float(np.sqrt(np.float32(n_embd))),
            qk_norm=arch == "gemma3", attn_gate=False, activation="gelu_tanh", sliding_window=max(window, 0),
            swa_layers=swa, rope_layers=all_rope, rope_traditional=False, rope_base_swa=base_swa,
            q_scale=q_scale, kq_scale=1.0, attn_softcap=attn_cap, final_softcap=final_cap, logit_scale=None,
        )
    if arch == "qwen3":
        return ModelConfig(
            **common, post_norm_eps=None, entry_norm=False, embed_scale=None, qk_norm=True, attn_gate=False,
            activation="silu", sliding_window=0, swa_layers=none_swa, rope_layers=all_rope,
            rope_traditional=False, rope_base_swa=rope_base, q_scale=None, kq_scale=default_kq,
            attn_softcap=None, final_softcap=None, logit_scale=None,
        )
    # llama
    scale = f.get_float(k("attention.scale"), 0.0)
    return ModelConfig(
        **common, post_norm_eps=None, entry_norm=False, embed_scale=None, qk_norm=False, attn_gate=False,
        activation="silu", sliding_window=0, swa_layers=none_swa, rope_layers=all_rope,
        rope_traditional=True, rope_base_swa=rope_base, q_scale=None, kq_scale=scale or default_kq,
        attn_softcap=None, final_softcap=None, logit_scale=None,
        rope_freq_factors="rope_freqs.weight" in f.tensors,
    )
