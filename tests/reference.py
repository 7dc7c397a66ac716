"""An independent float64 numpy forward of every supported architecture, for the tests.

Written from llama.cpp's graphs (``src/models/{muse-glimmer,gemma3,gemma2,qwen3,llama}.cpp``)
and gguf-py's dequantizer, sharing no code with muse_mlx: metadata and tensors are read
with ``gguf.GGUFReader``, weights dequantized with ``gguf.quants.dequantize``, and every
op is plain float64 numpy. K and V are rounded to float16 where llama.cpp stores them.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class RefModel:
    def __init__(self, path, kv_f16: bool = True):
        self.kv_f16 = kv_f16
        r = GGUFReader(path)
        self.meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
        self.arch = a = self.meta["general.architecture"]
        self.w = {}
        for t in r.tensors:
            x = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
            self.w[t.name] = x.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        m = lambda k, d=None: self.meta.get(f"{a}.{k}", d)  # noqa: E731
        self.n_layer = m("block_count")
        self.n_embd = m("embedding_length")
        self.n_head = m("attention.head_count")
        self.n_kv = m("attention.head_count_kv", self.n_head)
        self.hd = m("attention.key_length", self.n_embd // self.n_head)
        self.eps = m("attention.layer_norm_rms_epsilon")
        self.base = m("rope.freq_base", 10000.0)
        self.window = m("attention.sliding_window", 4096 if a == "gemma2" else 0)
        period = {"muse-glimmer": 4, "gemma3": 6, "gemma2": 2}.get(a, 0)
        pattern = m("attention.sliding_window_pattern")
        if a in ("qwen3", "llama") or (a == "gemma3" and self.window <= 0):
            self.swa = [False] * self.n_layer
        elif isinstance(pattern, list):
            self.swa = [bool(b) for b in pattern]
        else:
            self.swa = [il % period < period - 1 for il in range(self.n_layer)]
        if a == "muse-glimmer":
            self.base_swa = m("rope.freq_base_swa", self.base)
        elif a == "gemma2":
            self.base_swa = m("rope.freq_base_swa", self.base)
        else:
            self.base_swa = m("rope.freq_base_swa", 10000.0)
        self.logit_scale = m("logit_scale", None)
        # llama_hparams' default final soft-cap is 30; only gemma3.cpp resets it to 0.
        default_cap = 30.0 if a in ("gemma2", "muse-glimmer") else 0.0
        self.final_cap = m("final_logit_softcapping", default_cap)
        self.attn_cap = m("attn_logit_softcapping", 50.0) if a == "gemma2" else 0.0

    # -- ops --------------------------------------------------------------------------

    @staticmethod
    def rms(x, eps, w=None):
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        return y if w is None else y * w

    def rope(self, x, pos, base, neox):
        """x [T, H, D]: llama.cpp's rope; NORM rotates (2i, 2i+1), NEOX rotates (i, i + D/2)."""
        D = x.shape[-1]
        i = np.arange(D // 2)
        theta = pos[:, None] * base ** (-2.0 * i / D)  # [T, D/2]
        c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        if neox:
            a, b = x[..., : D // 2], x[..., D // 2 :]
            return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
        return out

    def forward(self, tokens) -> np.ndarray:
        """Logits [T, vocab] for one sequence, full causal attention (llama.cpp semantics)."""
        a, w = self.arch, self.w
        T = len(tokens)
        pos = np.arange(T, dtype=np.float64)
        x = w["token_embd.weight"][np.asarray(tokens)]
        if a in ("gemma2", "gemma3"):
            x = x * np.sqrt(self.n_embd)
        if a == "muse-glimmer":
            x = self.rms(x, self.eps)
        sandwich = a in ("muse-glimmer", "gemma2", "gemma3")
        post_eps = 1e-8 if a == "muse-glimmer" else self.eps
        for il in range(self.n_layer):
            p = f"blk.{il}."
            h = self.rms(x, self.eps, w[p + "attn_norm.weight"])
            q = (h @ w[p + "attn_q.weight"].T).reshape(T, self.n_head, self.hd)
            k = (h @ w[p + "attn_k.weight"].T).reshape(T, self.n_kv, self.hd)
            v = (h @ w[p + "attn_v.weight"].T).reshape(T, self.n_kv, self.hd)
            if p + "attn_q_norm.weight" in w:
                q = self.rms(q, self.eps, w[p + "attn_q_norm.weight"])
                k = self.rms(k, self.eps, w[p + "attn_k_norm.weight"])
            rope_here = self.swa[il] if a == "muse-glimmer" else True
            if rope_here:
                base = self.base_swa if self.swa[il] else self.base
                neox = a in ("gemma2", "gemma3", "qwen3")
                q, k = self.rope(q, pos, base, neox), self.rope(k, pos, base, neox)
            if a in ("gemma2", "gemma3"):
                q = q / np.sqrt(self.hd)
                kq_scale = 1.0
            else:
                kq_scale = 1.0 / np.sqrt(self.hd)
            if self.kv_f16:  # the f16 KV cache
                k = k.astype(np.float16).astype(np.float64)
                v = v.astype(np.float16).astype(np.float64)
            rep = self.n_head // self.n_kv
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            s = np.einsum("thd,shd->hts", q, k)
            if self.attn_cap:
                s = self.attn_cap * np.tanh(s / self.attn_cap)
            s = s * kq_scale
            i, j = np.arange(T)[:, None], np.arange(T)[None, :]
            visible = j <= i
            if self.swa[il]:
                visible &= (i - j) < self.window
            s = np.where(visible[None], s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", s, v).reshape(T, -1)
            if a == "muse-glimmer":
                g = h @ w[p + "attn_gate.weight"].T
                o = o / (1.0 + np.exp(-g))
            o = o @ w[p + "attn_output.weight"].T
            if sandwich:
                o = self.rms(o, post_eps, w[p + "post_attention_norm.weight"])
            x = x + o
            f = self.rms(x, self.eps, w[p + "ffn_norm.weight"])
            gate, up = f @ w[p + "ffn_gate.weight"].T, f @ w[p + "ffn_up.weight"].T
            if a in ("gemma2", "gemma3"):
                act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
            else:
                act = gate / (1.0 + np.exp(-gate))
            d = (act * up) @ w[p + "ffn_down.weight"].T
            if sandwich:
                d = self.rms(d, post_eps, w[p + "post_ffw_norm.weight"])
            x = x + d
        x = self.rms(x, self.eps, w["output_norm.weight"])
        head = w.get("output.weight", w["token_embd.weight"])
        logits = x @ head.T
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.final_cap:
            logits = self.final_cap * np.tanh(logits / self.final_cap)
        return logits
