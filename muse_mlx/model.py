"""The transformer as MLX modules, one graph for every supported architecture.

Module attributes carry GGUF tensor names (``token_embd``, ``blk[i].attn_q``,
``blk[i].post_attention_norm``, ``output_norm`` ...), so loading needs no rename table.
The graph follows llama.cpp's ``src/models/muse-glimmer.cpp``; the other architectures
switch parts of it off or on through :class:`~muse_mlx.config.ModelConfig`.

The norm that opens each sub-block is computed by the *previous* tail, as the reference
engine fuses it: a block receives ``(hidden, a)`` where ``a`` is its already-normed input,
and returns ``(hidden, a_next)`` with the next layer's ``attn_norm`` (or ``output_norm``)
applied. On the stock route that is just the same ops in the same order.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cache import kv_write_mode, make_cache
from .config import ModelConfig
from .decode import position_array
from .layers import Norm
from .routes import Route
from .trace import tap, tracing


def attention_mask(T: int, offset: int, n_kept: int, window: int):
    """Boolean mask ``[T, n_kept + T]`` (True = attend), or None when every key is visible.

    Keys are the ``n_kept`` cached positions ending at ``offset - 1``, then the ``T`` new
    ones. Query ``i`` sees key ``p`` iff ``p <= i`` and, with a window, ``i - p < window``
    (llama.cpp's LLAMA_SWA_TYPE_STANDARD).
    """
    q_pos = offset + np.arange(T)[:, None]
    k_pos = offset - n_kept + np.arange(n_kept + T)[None, :]
    visible = k_pos <= q_pos
    if window > 0:
        visible &= (q_pos - k_pos) < window
    if visible.all():
        return None
    return mx.array(visible)


def attend(q, k, v, scale: float, mask, softcap: float | None):
    """Softmax attention with GQA. ``k``/``v`` are the cache planes, read as float32."""
    k, v = k.astype(mx.float32), v.astype(mx.float32)
    if softcap is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    # gemma2's attention soft-cap has no fused MLX op: scores by hand, grouped for GQA.
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, H // Hkv, T, D)
    s = (qg * scale) @ k[:, :, None].swapaxes(-1, -2)
    s = mx.tanh(s / softcap) * softcap
    if mask is not None:
        s = mx.where(mask, s, -mx.inf)
    p = mx.softmax(s, axis=-1, precise=True)
    return (p @ v[:, :, None]).reshape(B, H, T, D)


class Block(nn.Module):
    """One transformer layer; attributes named like ``blk.N.*`` in the GGUF file."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.cfg = cfg
        self.is_swa = cfg.swa_layers[layer]
        self.use_rope = cfg.rope_layers[layer]
        self.rope_base = cfg.layer_rope_base(layer)
        self.rope_scale = cfg.layer_rope_scale(layer)
        # Weights are attached by the loader: attn_norm, attn_q, attn_k, attn_v, attn_output,
        # and where the architecture has them attn_gate, attn_q_norm, attn_k_norm,
        # post_attention_norm, ffn_norm, ffn_gate, ffn_up, ffn_down, post_ffw_norm.
        self.rope_freqs = None

    def attention(self, a: mx.array, route: Route, mask, cache, kv_dtype) -> mx.array:
        cfg = self.cfg
        B, T, _ = a.shape
        il = self.layer
        q = tap("Qcur", route.linear(a, self.attn_q), il).reshape(B, T, cfg.n_head, cfg.head_dim)
        k = tap("Kcur", route.linear(a, self.attn_k), il).reshape(B, T, cfg.n_head_kv, cfg.head_dim)
        v = tap("Vcur", route.linear(a, self.attn_v), il).reshape(B, T, cfg.n_head_kv, cfg.head_dim)
        gate = tap("attn_gate_proj", route.linear(a, self.attn_gate), il) if cfg.attn_gate else None
        if cfg.qk_norm:
            q = tap("Qcur_normed", route.norm(q, self.attn_q_norm), il)
            k = tap("Kcur_normed", route.norm(k, self.attn_k_norm), il)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        if self.use_rope:
            offset = 0 if cache is None else cache.offset
            q = tap("Qcur_rope", self._rope(q, offset), il)
            k = tap("Kcur_rope", self._rope(k, offset), il)
        if cfg.q_scale is not None:
            q = tap("Qcur_scaled", q * np.float32(cfg.q_scale), il)
        # llama.cpp's cache planes are f16, and attention reads the cache (the current token included).
        k = tap("k_cache", k.astype(kv_dtype), il)
        v = tap("v_cache", v.astype(kv_dtype), il)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = attend(q, k, v, cfg.kq_scale, mask, cfg.attn_softcap)
        o = tap("attn_out", o.transpose(0, 2, 1, 3).reshape(B, T, cfg.q_width), il)
        if gate is not None:
            o = tap("attn_gated", route.attn_gate(o, gate), il)
        return tap("attn_o_proj", route.linear(o, self.attn_output), il)

    def decode_attention(self, a: mx.array, route: Route, cache, pos: mx.array, slot) -> mx.array:
        """One new token (batch 1) straight into the cache planes, in as few dispatches as the route has.

        The four projections are one matvec dispatch. Where the one-dispatch attention fits, it
        also takes the Q- and K-norms and RoPE and hands out the planes with the token's K/V at
        ``slot`` (or the K/V, for a scatter after it: ``cache.kv_write_mode``); else the norms,
        RoPE and the f16 K and V are one more dispatch, K and V are written in place at ``slot``,
        and the attention and its output gate read the planes. Every kernel reads its part of the projection output where
        it lies (an offset, not a slice: each slice or reshape would be one more op per layer).
        ``pos`` is the token's position as an int32 [1] array, so nothing here depends on a
        Python-side count.
        """
        cfg, il = self.cfg, self.layer
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qw, kw = cfg.q_width, cfg.kv_width
        ws = [self.attn_q, self.attn_k, self.attn_v] + ([self.attn_gate] if cfg.attn_gate else [])
        y = tap("QKVG", route.project(a, ws), il)  # [1, 1, q | k | v | gate]
        norm_w = self.qk_norm_weights() if cfg.qk_norm else None
        rope = self.rope_table() if self.use_rope else None
        # q*q_scale then a scale of 1 is, bit for bit, the kernel's q*scale with scale = q_scale
        scale = cfg.kq_scale if cfg.q_scale is None else cfg.q_scale
        gate = y if cfg.attn_gate else None
        if route.takes_norms_into_attention(cache.kv) and not tracing():
            # the norms and RoPE inside the attention's dispatch, which reads the token's own K/V from
            # registers and hands out the planes with its slot written (or the K/V for a write after
            # it: kv_write_mode)
            through = kv_write_mode() == "through"
            o, kv = route.attn_decode_token(y, norm_w, cfg.rms_eps, pos, rope, cfg, cache.kv,
                                            cache.decode_geometry(), scale, gate, qw + kw, qw + 2 * kw,
                                            (1, 1, qw), (2, 1, Hkv, 1, D), through=through)
            if through:
                cache.kv = kv
            else:
                cache.write_token(kv, slot)
        else:
            # the Q/K-norms, RoPE and the f16 K/V for the cache: one dispatch (its outputs are traced)
            qk, kv = route.qk_rope_pack(y, norm_w, cfg.rms_eps, pos, rope, cfg, qw + kw,
                                        (1, H + Hkv, 1, D), (2, 1, Hkv, 1, D))
            qk, kv = tap("QKcur", qk, il), tap("kv_cache", kv, il)
            cache.write_token(kv, slot)
            o = route.attn_decode(qk, cache.kv, pos, cache.decode_geometry(), scale, H, gate, qw + 2 * kw, (1, 1, qw))
        o = tap("attn_gated" if cfg.attn_gate else "attn_out", o, il)
        return tap("attn_o_proj", route.linear(o, self.attn_output), il)

    def qk_norm_weights(self) -> mx.array:
        """``[n_head + n_head_kv, head_dim]``: the Q-norm weight per query head, then the K-norm per KV head."""
        if getattr(self, "_qk_w", None) is None:
            cfg = self.cfg
            self._qk_w = mx.concatenate([
                mx.broadcast_to(self.attn_q_norm.gamma, (cfg.n_head, cfg.head_dim)),
                mx.broadcast_to(self.attn_k_norm.gamma, (cfg.n_head_kv, cfg.head_dim)),
            ])
            mx.eval(self._qk_w)
        return self._qk_w

    def rope_table(self) -> mx.array:
        """The decode kernel's RoPE constants for this layer (:func:`~muse_mlx.kernels.rope_table`), made once."""
        if getattr(self, "_rope_t", None) is None:
            from .kernels import rope_table

            cfg = self.cfg
            freqs = None if self.rope_freqs is None else np.array(self.rope_freqs)
            self._rope_t = rope_table(cfg.rope_dims, self.rope_base, self.rope_scale, freqs)
            mx.eval(self._rope_t)
        return self._rope_t

    def _rope(self, x: mx.array, offset: int) -> mx.array:
        cfg = self.cfg
        if self.rope_freqs is not None:
            return mx.fast.rope(
                x, cfg.rope_dims, traditional=cfg.rope_traditional, base=None,
                scale=self.rope_scale, offset=offset, freqs=self.rope_freqs,
            )
        return mx.fast.rope(
            x, cfg.rope_dims, traditional=cfg.rope_traditional, base=self.rope_base,
            scale=self.rope_scale, offset=offset,
        )

    def __call__(self, hidden, a, route: Route, mask, cache, next_norm: Norm, kv_dtype=mx.float16, decode=None):
        il, last = self.layer, self.layer + 1 == self.cfg.n_layer
        if decode is not None:
            o = self.decode_attention(a, route, cache, *decode)
        else:
            o = self.attention(a, route, mask, cache, kv_dtype)
        post = self.post_attention_norm if self.cfg.post_norm_eps is not None else None
        hidden, f = route.residual_norm(hidden, o, post, self.ffn_norm, feeds_ffn=True)
        hidden, f = tap("ffn_inp", hidden, il), tap("ffn_norm", f, il)
        mid = tap("ffn_act", route.ffn_gate_up(f, self.ffn_gate, self.ffn_up, self.cfg.activation), il)
        d = tap("ffn_out", route.linear(mid, self.ffn_down), il)
        post = self.post_ffw_norm if self.cfg.post_norm_eps is not None else None
        hidden, a = route.residual_norm(hidden, d, post, next_norm, feeds_head=last)
        # the next layer's pre-norm comes out of this tail (or the output norm, after the last)
        return tap("l_out", hidden, il), tap("result_norm" if last else "attn_norm", a, -1 if last else il + 1)


class Model(nn.Module):
    """``model(tokens)`` -> float32 logits ``[B, T, vocab]``; with a cache, continues decoding."""

    def __init__(self, cfg: ModelConfig, route: Route):
        super().__init__()
        self.cfg = cfg
        self.route = route
        route.configure(cfg)
        self.blk = [Block(cfg, i) for i in range(cfg.n_layer)]
        # float16 as llama.cpp stores K/V; float32 keeps them unrounded (a more exact, larger cache).
        self.kv_dtype = mx.float16
        # token_embd, output_norm and output are attached by the loader.

    def make_cache(self) -> list:
        return make_cache(self.cfg)

    def set_flags(self, flags) -> None:
        """Switch the route's opt-in flags on the loaded model, each Q6_K weight (and each GLU's
        Q4_K weight) then held in the form the route asks for (the split form comes and goes with
        ``mv_q8_q6k``, the tiled one with ``mv_q8`` where ``MUSE_MLX_Q8_TILE`` asks for it; turned in
        place, one matrix at a time). A tied head keeps the embedding's blocks: splitting it would
        hold a second copy of the table. A DecodeStep made before keeps the weights and kernels it
        traced: make a new one after switching."""
        from .kernels.mul_mv import q8_pre_glu, q8_tile
        from .layers import RAW_FORMS, QLinear, tiles_in_pairs, with_tile
        from .routes import check_flags
        from gguf import GGMLQuantizationType as T

        flags = check_flags(self.route.name, flags)
        q8_tile()  # (both read first: a bad value then leaves the model as it was)
        q8_pre_glu()
        self.route.flags = flags
        # A compiled decode step that is garbage but sits in a reference cycle (DecodeStep -> its
        # mx.compile of a bound method -> DecodeStep) holds the arrays it traced until the cycle is
        # collected: without this, the old forms outlived the switch (4.1-4.5 GB more on the H200).
        gc.collect()
        for name, lin in self.named_modules():
            if (isinstance(lin, QLinear) and lin.qtype in (T.Q4_K, T.Q6_K) and lin.form in RAW_FORMS
                    and not (lin is self.output and self.cfg.tied_output)):
                form = self.route.form_for(lin.qtype, name.rsplit(".", 1)[-1])  # (blk.3.ffn_gate: "ffn_gate")
                lin.reform(*with_tile(form, lin.out_features))
        for block in self.blk:
            tiles_in_pairs(block.ffn_gate, block.ffn_up)

    def prepare_decode(self, cache: list, total: int) -> None:
        """Everything the decode path reads besides the token: planes with room for ``total``
        positions, their kernel arguments, the stacked Q/K-norm weights (made outside any trace)."""
        for c in cache:
            c.reserve_for(self.cfg, total)
            c.decode_geometry()
        for b in self.blk:
            if self.cfg.qk_norm:
                b.qk_norm_weights()
            if b.use_rope:
                b.rope_table()

    def embed(self, tokens: mx.array) -> mx.array:
        """Token rows (dequantized), scaled or normed as the architecture's graph does; an id outside
        the vocabulary gets a row of NaN (``Route.embed``)."""
        cfg = self.cfg
        x = tap("inp_embd", self.route.embed(self.token_embd, tokens))
        if cfg.embed_scale is not None:
            x = tap("inp_scaled", x * np.float32(cfg.embed_scale))  # ggml_scale by sqrtf(n_embd), in f32
        if cfg.entry_norm:
            x = tap("embd_norm", self.route.norm(x, Norm(None, cfg.rms_eps)))
        return x

    def uses_decode_path(self, tokens: mx.array, cache) -> bool:
        """Whether this call takes the one-token decode path (the route's fused decode kernels)."""
        B, T = tokens.shape
        return (B == 1 and T == 1 and cache is not None and self.kv_dtype == mx.float16
                and self.route.fast_decode(self.cfg))

    def __call__(self, tokens: mx.array, cache: list | None = None, last_only: bool = False,
                 positions=None) -> mx.array:
        """``positions`` (decode only): ``(pos, slots)`` -- the token's position as an int32 [1]
        array and each layer's cache slot (ints or int32 [1] arrays); by default from the caches.
        An id outside the vocabulary gives NaN logits (the route's embedding gives it a row of NaN:
        ``Route.embed``, and the pinned route's kernel). ``generate`` and ``compare`` refuse such ids
        before they run."""
        cfg, route = self.cfg, self.route
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [B, T], got {tokens.shape}")
        T = tokens.shape[1]
        decode = self.uses_decode_path(tokens, cache)
        hidden = self.embed(tokens)
        # with positions given, the caller owns the caches' allocation and counts (a compiled step)
        advance = decode and positions is None
        if decode:
            masks = {False: None, True: None}
            if advance:
                self.prepare_decode(cache, cache[0].offset + 1)
                positions = (position_array(cache[0].offset)[:1], [c.slot(c.offset) for c in cache])
            pos, slots = positions
        else:
            masks = self._masks(T, cache)
        a = tap("attn_norm", route.norm(hidden, self.blk[0].attn_norm), 0)
        in_flight = None  # a batched prefill's last group of layers, still running on the device
        for i, block in enumerate(self.blk):
            nxt = self.blk[i + 1].attn_norm if i + 1 < cfg.n_layer else self.output_norm
            c = None if cache is None else cache[i]
            hidden, a = block(hidden, a, route, masks[block.is_swa], c, nxt, self.kv_dtype,
                              (pos, slots[i]) if decode else None)
            if route.batched is not None and route.layer_sync and not decode and (i + 1) % route.layer_sync == 0:
                # a batched prefill dequantizes every matrix of a layer: evaluating every few
                # layers frees them before later layers' exist (the GPU may run far ahead). The
                # group is started, then the one before it waited for, so that the device runs one
                # group while the host builds the next: at most two groups' matrices at a time.
                if route.layer_pipeline:
                    mx.async_eval(hidden, a)
                    if in_flight is not None:
                        mx.eval(in_flight)
                    in_flight = (hidden, a)
                else:
                    mx.eval(hidden, a)
        if advance:
            for c in cache:
                c.offset += 1
        if last_only and a.shape[1] > 1:  # (a slice of one token would be a new array: the route's
            a = a[:, -1:, :]               # hand-off from the tail to the head goes by identity)
        logits = route.head(a, self.output)
        if cfg.logit_scale is not None and cfg.logit_scale != 1.0:  # x * 1.0 is x: one op fewer
            logits = logits * np.float32(cfg.logit_scale)
        if cfg.final_softcap is not None:
            c = np.float32(cfg.final_softcap)
            logits = mx.tanh(logits * (np.float32(1.0) / c)) * c
        return tap("result_output", logits)

    def _masks(self, T: int, cache):
        """The two masks of a forward (global layers, sliding layers), made once."""
        cfg = self.cfg
        out = {}
        for swa in (False, True):
            layer = next((i for i, s in enumerate(cfg.swa_layers) if s == swa), None)
            if layer is None:
                continue
            c = None if cache is None else cache[layer]
            offset = 0 if c is None else c.offset
            n_kept = 0 if c is None else c.n_kept
            out[swa] = attention_mask(T, offset, n_kept, cfg.sliding_window if swa else 0)
        return out
