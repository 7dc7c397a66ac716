"""The seam: every hot op of the model, on the stock route and on the pinned route, side by side.

Nothing else in the engine branches on the route. A route is chosen at load time
(``muse_mlx.load(path, route=...)``) and decides two things:

* the form each quantized weight is kept in on the device (:meth:`Route.form_for`);
* how each op computes: the standalone norm, the norm tail (post-norm + residual + next
  pre-norm), the matvec, the FFN activation, and the attention output gate.

``stock`` uses MLX's own ops (``mx.fast.rms_norm``, ``mx.quantized_matmul``, ``nn.silu``):
fast, portable, rounded however MLX rounds. ``pinned`` runs custom kernels whose float
operations follow the reference engine (llama.cpp's ggml-metal kernels and the seeds'
Muser kernels) in order; see :mod:`muse_mlx.kernels`.
"""

from __future__ import annotations

import operator
from collections import Counter
from functools import reduce

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGMLQuantizationType as T

from . import kernels
from .errors import RouteError
from .layers import RAW_FORMS, Norm, QLinear
from .quants import FORMATS

ROUTES = ("stock", "pinned")
_KIND = {T.Q4_K: "q4_K", T.Q6_K: "q6_K"}  # the raw-block types the pinned matvecs read
GLU_ROLES = ("ffn_gate", "ffn_up")  # the weights a GLU reads (Route.form_for's role: the tensor name's)


def _kind_of(w) -> str:
    """The kernels' name for how a raw-form weight's bytes lie: its type's, or the split form's."""
    return "q6_K_split" if w.form == "q6_K_split" else _KIND[w.qtype]

# Opt-in fusions of the pinned route, named after the reference engine's kernels.
PINNED_FLAGS = {
    "tail_32sg": "legacy one-token dual-eps tail (rsqrt, serial 32-partial combine): NOT exact vs llama.cpp",
    "ffn_4r2s": "fused Q4_K gate+up+activation kernel (ffn_q4k_gate_up_silu_4r2s): NOT exact vs llama.cpp",
    "split_norm_f16": "cross-vendor seam: every norm split into an F16 unweighted RMS and an F16 weight multiply",
    "mv_q8": "Q4_K matvecs on int8 activations (per-32 scales, as llama.cpp's CUDA q8_1) with integer dots: NOT exact, fast",
    "mv_q8_q6k": "with mv_q8, the Q6_K matvecs too, over Q6_K blocks split at load for 16-byte loads: NOT exact",
}
# flags that only make sense on top of another
FLAG_NEEDS = {"mv_q8_q6k": "mv_q8"}


class Route:
    """Base: the op set every route implements, and a count of the dispatches it issues."""

    name = "?"
    batches_prefill = False  # whether `batched` (below) changes anything: pinned only

    def __init__(self, flags: frozenset[str] = frozenset()):
        self.flags = flags
        self.dispatches: Counter[str] = Counter()
        # Batched prefill (generate_step turns it on while it pre-fills): the pinned route then
        # runs inputs of more than MATVEC_MAX_TOKENS tokens through a dequantization to this
        # dtype and MLX's matmul instead of a matvec per token. None: off. float32: the exact
        # values (MLX's float32 matmul, TF32 on CUDA unless MLX_ENABLE_TF32=0); float16: weights
        # and activations rounded to half, as llama.cpp's Metal mul_mm rounds them (MLX's f16
        # matmul sums in float32 but also rounds its output to half, which ggml does not).
        self.batched = None
        # batched prefill: evaluate every this many layers (bounds its memory; 0: one graph);
        # set with `batched` by generate.batched_prefill
        self.layer_sync = 0
        # ... starting each group before waiting for the one before (False: wait for each group
        # before building the next, which leaves the device idle meanwhile; kept to measure it)
        self.layer_pipeline = True
        # batched prefill: give every weight matmul a CUDA graph of its own (set by
        # batched_prefill). MLX (0.32) cannot update a captured graph holding a cuBLAS kernel
        # with a cluster shape of y or z above 1 (the H200's float32 TF32 GEMMs), so it
        # instantiates one per commit and destroys it right after the launch; the destruction
        # took as long as the graph's GPU time (2.1 ms per layer-sized graph, measured with
        # gpu_timeline.py --host), so the host could not run ahead of the device. A graph of one
        # matmul waits for that matmul alone, and the next matrix's dequantization, committed
        # before it, is already queued.
        self.matmul_commits = False

    def configure(self, cfg) -> None:
        """Called once the model's configuration is known (the pinned route picks its norm geometry)."""

    def _commit(self, *arrays: mx.array) -> None:
        """End the CUDA graph being built at ``arrays``, when ``matmul_commits`` asks for it."""
        if self.matmul_commits:
            mx.async_eval(*arrays)

    def count(self, op: str, n: int = 1) -> None:
        self.dispatches[op] += n

    def form_for(self, qtype: T, role: str | None = None) -> str:
        """The form (``layers.QLinear``) a weight of ``qtype`` is held in; ``role``: what it is in
        its block, e.g. ``"ffn_gate"`` (the GGUF name's part before ``.weight``), where known."""
        raise NotImplementedError

    def norm(self, x: mx.array, norm: Norm) -> mx.array:
        raise NotImplementedError

    def residual_norm(self, hidden: mx.array, src: mx.array, post: Norm | None, nxt: Norm,
                      feeds_ffn: bool = False, feeds_head: bool = False):
        """``hidden += post(src)`` (or ``+= src`` without a post norm); return ``(hidden, nxt(hidden))``.
        ``feeds_ffn``: the result is the FFN's input (a route may prepare it for its FFN kernel);
        ``feeds_head``: it is the output norm's, for the vocabulary head (nothing to prepare).

        Unfused here: the route's own norm, an add, the norm again."""
        if post is not None:
            src = self.norm(src, post)
        self.count("add")
        hidden = hidden + src
        return hidden, self.norm(hidden, nxt)

    def linear(self, x: mx.array, w: QLinear) -> mx.array:
        raise NotImplementedError

    def embed(self, table, tokens: mx.array) -> mx.array:
        """Embedding rows, dequantized exactly (:class:`~muse_mlx.layers.QEmbedding`). An id outside
        the table reads row 0 and gets a row of NaN, so its logits are NaN, which generation reports:
        MLX's gather does not check its indices (past the table it read other memory, and on the CPU
        crashed the process). A valid id's row is unchanged."""
        ok = (tokens >= 0) & (tokens < table.weight.shape[0])
        return mx.where(ok[..., None], table(mx.where(ok, tokens, 0)), np.float32(np.nan))

    def head(self, x: mx.array, w: QLinear) -> mx.array:
        """The vocabulary head: :meth:`linear`, unless a route launches it differently."""
        return self.linear(x, w)

    def project(self, x: mx.array, ws: list[QLinear]) -> mx.array:
        """Several projections of the same input, concatenated on the last axis."""
        return mx.concatenate([self.linear(x, w) for w in ws], axis=-1)

    def fast_decode(self, cfg) -> bool:
        """Whether this route has the one-token decode path for a model of this configuration."""
        return False

    def glu(self, gate: mx.array, up: mx.array, activation: str) -> mx.array:
        raise NotImplementedError

    def ffn_gate_up(self, x: mx.array, gate: QLinear, up: QLinear, activation: str) -> mx.array:
        """The FFN's first half: ``act(x @ gate.T) * (x @ up.T)``.

        llama.cpp's build_ffn computes up first, then gate, then the GLU."""
        u = self.linear(x, up)
        g = self.linear(x, gate)
        return self.glu(g, u, activation)

    def attn_gate(self, o: mx.array, g: mx.array) -> mx.array:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name + (f" (+{', '.join(sorted(self.flags))})" if self.flags else "")


class StockRoute(Route):
    """MLX's own ops."""

    name = "stock"

    def form_for(self, qtype: T, role: str | None = None) -> str:
        if qtype in (T.F32, T.F16, T.BF16):
            return "dense"
        if qtype == T.Q6_K:
            return "affine_hi_lo"  # no MLX mode has its 16-value groups: two exact ones summed
        return "affine" if FORMATS[qtype].affine_bits else "blocks"

    def norm(self, x, norm):
        self.count("rms_norm")
        return mx.fast.rms_norm(x, norm.gamma, norm.eps)

    def linear(self, x, w):
        many_rows = x.size // x.shape[-1] > 1  # a prefill's tokens, not one decoded token
        if many_rows:
            self._commit(x)
        if w.form in ("affine", "affine_hi_lo"):
            # one quantized_matmul per form, summed in order (Q6_K: hi, then + lo)
            forms = w.affine_forms()
            self.count("quantized_matmul", len(forms))
            if len(forms) > 1:
                self.count("add", len(forms) - 1)
            y = reduce(operator.add, (mx.quantized_matmul(x, q, s, b, transpose=True, group_size=w.group_size,
                                                          bits=bits) for q, s, b, bits in forms))
        else:
            self.count("dequantize_matmul" if w.form == "blocks" else "matmul")
            y = x @ w.dequantized().T
        if many_rows:
            self._commit(y)
        return y

    def glu(self, gate, up, activation):
        self.count(activation + "_mul", 2)
        act = nn.silu(gate) if activation == "silu" else nn.gelu_approx(gate)
        return act * up

    def attn_gate(self, o, g):
        self.count("sigmoid_mul", 2)
        return o * mx.sigmoid(g)


class PinnedRoute(Route):
    """Custom kernels whose float operations follow the reference engine in order.

    Serving defaults as the reference engine has them (seeds Ch 12 §12.5, Ch 18 §18.6):
    llama's standalone norm for the entry norm, layer 0's pre-norm and the QK-norms; the
    exact dual-epsilon tail after every sandwich sub-block; the FFN as two ggml Q4_K matvecs
    plus ``silu_mul_inplace``; the Q6_K matvec where tensors are Q6_K. Q5_K/Q8_0/float
    tensors have no pinned kernel and take the stock op. Opt-in flags swap in the legacy
    fusions (``tail_32sg``, ``ffn_4r2s``) or the cross-vendor split norm (``split_norm_f16``).
    """

    name = "pinned"
    batches_prefill = True
    # llama.cpp's Metal backend runs kernel_mul_mv for batches of up to 3 tokens.
    MATVEC_MAX_TOKENS = 3

    def __init__(self, flags=frozenset()):
        super().__init__(check_flags(self.name, flags))
        self.geometry = "llama"
        # a tail's output in a matvec's input form, per form ("q8" for the q8 GLU, "q4_K" prepared
        # for the exact Q4_K lanes): (output, form) until the matvec after the tail takes it
        self._forms: dict[str, tuple] = {}
        self._stock = StockRoute()

    def configure(self, cfg):
        # The seeds pin next_pow2 threads for muse-glimmer; today's llama.cpp rounds up to 32.
        self.geometry = "seeds" if cfg.arch == "muse-glimmer" else "llama"

    def form_for(self, qtype: T, role: str | None = None) -> str:
        if (qtype == T.Q4_K and role in GLU_ROLES and "mv_q8" in self.flags and "ffn_4r2s" not in self.flags
                and kernels.mul_mv.q8_tile() > 1 and kernels.mul_mv.q8_pre_glu()):
            return "q4_K_tiled"  # read by the q8 GLU's lanes, and untiled by the batched prefill's dequantization
        if qtype == T.Q6_K and "mv_q8_q6k" in self.flags:
            return "q6_K_split"  # read by mul_mv_q8_pre's Q6_K lanes only
        if qtype == T.Q6_K and "mv_q8" not in self.flags and kernels.mul_mv.q6K_split(kernels.backend()):
            return "q6_K_split"  # the exact Q6_K lanes' aligned loads, the same bits (mul_mv.Q6K_SPLIT)
        if qtype in (T.Q4_K, T.Q6_K):
            return "blocks"
        return self._stock.form_for(qtype)

    def norm(self, x, norm):
        if "split_norm_f16" in self.flags and norm.gamma is not None:
            self.count("rms_norm_f16 + mul_f16", 2)
            return kernels.rms_norm_f16(x, norm.gamma, norm.eps, self.geometry).astype(mx.float32)
        self.count("rms_norm_mul")
        return kernels.rms_norm_mul(x, norm.gamma, norm.eps, geometry=self.geometry)

    def residual_norm(self, hidden, src, post, nxt, feeds_ffn=False, feeds_head=False):
        if post is None or "split_norm_f16" in self.flags:
            return super().residual_norm(hidden, src, post, nxt)
        if "tail_32sg" in self.flags:
            self.count("fused_norm_residual_rms_norm_32sg")
            return kernels.tail_32sg(hidden, src, post.gamma, nxt.gamma, post.eps, nxt.eps)
        # the q8 GLU's activations come out of the tail too (ffn_gate_up takes them); with the split
        # Q6_K matrices (mv_q8_q6k), whose calls all take them quantized beforehand, also those of
        # the projections after it and of the head (project and linear take them)
        q8_next = feeds_ffn or "mv_q8_q6k" in self.flags
        if (q8_next and "mv_q8" in self.flags and not self._batched(src) and src.shape[-1] % 32 == 0
                and kernels.mul_mv.q8_from_tail()):
            self.count("fused_norm_residual_rms_norm_batch_dual_eps_q8")
            hidden, out, q8 = kernels.tail_dual_eps_q8(hidden, src, post.gamma, nxt.gamma, post.eps, nxt.eps,
                                                       self.geometry)
            self._forms["q8"] = (out, q8)
            return hidden, out
        # the exact Q4_K matvec after the tail reads its output scaled and summed by the tail; not
        # before the head, the q8 kernels or the legacy fused FFN, which read y
        takes_prep = not feeds_head and "mv_q8" not in self.flags and not (feeds_ffn and "ffn_4r2s" in self.flags)
        kind = "q4_K" if feeds_ffn else "q4_K multi"  # the GLU, or the q|k|v|gate call
        if (takes_prep and not self._batched(src) and src.shape[-1] % 256 == 0
                and kernels.mul_mv.q4K_prep(kernels.backend(), kind)):
            self.count("fused_norm_residual_rms_norm_batch_dual_eps_q4")
            hidden, out, prep = kernels.tail_dual_eps_q4(hidden, src, post.gamma, nxt.gamma, post.eps, nxt.eps,
                                                         self.geometry, kind=kind)
            self._forms["q4_K"] = (out, prep)
            return hidden, out
        self.count("fused_norm_residual_rms_norm_batch_dual_eps")
        return kernels.tail_dual_eps(hidden, src, post.gamma, nxt.gamma, post.eps, nxt.eps, self.geometry)

    def _form_of(self, x, form: str):
        """``x`` in the input form ``form``, if the tail that made it wrote that form (taken once)."""
        out, held = self._forms.pop(form, (None, None))
        return held if out is x else None

    def _batched(self, x) -> bool:
        return self.batched is not None and x.size // x.shape[-1] > self.MATVEC_MAX_TOKENS

    def linear(self, x, w):
        if w.form in RAW_FORMS and w.qtype in _KIND:
            if self._batched(x):
                self.count("dequant_matmul")
                # a split matrix is read as it is held: no rejoined copy per prompt chunk
                wd = kernels.dequantize_rows(w.weight, _kind_of(w), self.batched, tile=w.tile)
                xd = x.astype(wd.dtype)
                self._commit(xd, wd)
                y = xd @ wd.T
                self._commit(y)
                return y.astype(x.dtype)
            if w.form == "q6_K_split" and "mv_q8_q6k" in self.flags:
                self.count("mul_mv_q6_K_q8")
                return kernels.mul_mv_q8(x, [(w.weight, "q6_K_split")], q8=self._form_of(x, "q8"))
            if "mv_q8" in self.flags and w.qtype == T.Q4_K:
                # x quantized by the GLU before it, if it was (mv_q8_q6k, unless MUSE_MLX_Q8_GLU_OUT=0)
                self.count("mul_mv_q4_K_q8")
                return kernels.mul_mv_q8(x, [(w.weight, "q4_K")], q8=self._form_of(x, "q8"), tile=w.tile)
            self.count(f"mul_mv_{_KIND[w.qtype]}_f32")
            if w.tile != 1:  # (Model.set_flags gives the raw rows back when mv_q8 goes)
                raise ValueError(f"a Q4_K weight in tiles of {w.tile} rows is read by the q8 GLU (mv_q8) and "
                                 "the batched prefill only")
            if w.qtype == T.Q4_K:
                return kernels.mul_mv_q4_K(x, w.weight)
            return kernels.mul_mv_q6_K(x, w.weight, split=w.form == "q6_K_split")
        self.count("stock_linear")
        return self._stock.linear(x, w)

    def head(self, x, w):
        # the same kernel and bits as linear(); only its launch geometry is its own
        exact = w.form == "blocks" or (w.form == "q6_K_split" and "mv_q8_q6k" not in self.flags)
        if exact and w.qtype == T.Q6_K and not self._batched(x):
            self.count("mul_mv_q6_K_f32")
            return kernels.mul_mv_q6_K(x, w.weight, head=True, split=w.form == "q6_K_split")
        return self.linear(x, w)

    def project(self, x, ws):
        # One dispatch for all of them when every matrix is raw Q4_K/Q6_K blocks (llama.cpp runs
        # them one by one; each row gets the same bits either way).
        if len(ws) <= 4 and not self._batched(x) and all(w.form in RAW_FORMS and w.qtype in _KIND and w.tile == 1
                                                         for w in ws):
            mats = [(w.weight, _kind_of(w)) for w in ws]
            if "mv_q8" in self.flags:
                self.count("mul_mv_q4_K_q8 (multi)")
                return kernels.mul_mv_q8(x, mats, q8=self._form_of(x, "q8"))
            self.count("mul_mv_multi_f32")
            prep = self._form_of(x, "q4_K") if any(k == "q4_K" for _, k in mats) else None
            return kernels.mul_mv_multi(x, mats, prep=prep)
        return super().project(x, ws)

    def embed(self, table, tokens):
        # the same exact dequantization as QEmbedding's MLX ops, in one dispatch, which gives an id
        # outside the table a row of NaN itself; the other tables take the guarded gather
        if table.qtype in _KIND:
            self.count("dequant_at")
            return kernels.embed_rows(table.weight, tokens, _KIND[table.qtype])
        return super().embed(table, tokens)

    def fast_decode(self, cfg) -> bool:
        from .kernels.attention import partial_threadgroup_bytes

        g = cfg.n_head // cfg.n_head_kv
        fits = partial_threadgroup_bytes(g, cfg.head_dim) <= 32 * 1024  # Metal's threadgroup memory limit
        scales = cfg.q_scale is None or cfg.kq_scale == 1.0  # one scale inside the kernel
        # head rows are read in 16-byte words of eight halves
        return (cfg.attn_softcap is None and cfg.head_dim % 8 == 0 and cfg.head_dim <= 1024 and fits and scales
                and "split_norm_f16" not in self.flags)

    def qk_rope_pack(self, y, weights, eps, pos, rope, cfg, v_offset, qk_shape, kv_shape):
        """A token's Q/K-norms (the pinned norm's bits), RoPE and f16 K/V: one dispatch."""
        self.count("qk_rope_pack")
        return kernels.qk_rope_pack(
            y, weights, eps, pos, rope, rows=cfg.n_head + cfg.n_head_kv, hkv=cfg.n_head_kv, d=cfg.head_dim,
            rd=cfg.rope_dims, traditional=cfg.rope_traditional, v_offset=v_offset,
            nth=kernels.norm_threads(cfg.head_dim, self.geometry), qk_shape=qk_shape, kv_shape=kv_shape)

    def takes_norms_into_attention(self, planes) -> bool:
        """Whether :meth:`attn_decode_token` serves a token of these planes ([2, 1, HKV, cap, D])."""
        return kernels.attention.with_its_norms(planes.shape[-2], planes.shape[-1])

    def attn_decode_token(self, y, weights, eps, pos, rope, cfg, planes, geometry, scale, gate, v_offset,
                          gate_offset, out_shape, kv_shape, through=False):
        """:meth:`qk_rope_pack` and the one-dispatch :meth:`attn_decode` in one dispatch (the same
        bits): ``(out, kv)``, the token's f16 K/V for the caller to write into the planes (with
        ``through``, the planes with its slot written, for the cache to take as they are). With
        ``mv_q8`` and ``MUSE_MLX_Q8_ATTN=1`` it also writes ``out`` quantized, for attn_output."""
        self.count("attn_decode_fused (+ qk_rope_pack)")
        q8_out = "mv_q8" in self.flags and cfg.q_width % 32 == 0 and kernels.mul_mv.q8_from_attention()
        res = kernels.attention.attn_decode_token(
            y, weights, eps, pos, rope, planes, geometry, scale, gate, n_head=cfg.n_head, rd=cfg.rope_dims,
            traditional=cfg.rope_traditional, v_offset=v_offset, nth=kernels.norm_threads(cfg.head_dim, self.geometry),
            gate_offset=gate_offset, out_shape=out_shape, kv_shape=kv_shape, q8_out=q8_out, through=through)
        if q8_out:
            self._forms["q8"] = (res[0], res[2])
        return res[:2]

    def attn_decode(self, q, planes, pos, geometry, scale, n_head, gate, gate_offset, out_shape):
        # one dispatch where the cache is short enough for it, else the partial pass and the combine
        fused = kernels.attention.one_dispatch(planes.shape[-2], planes.shape[-1])
        if fused:
            self.count("attn_decode_fused")
        else:
            self.count("attn_decode_partial + combine", 2)
        return kernels.attn_decode(q, planes, pos, geometry, scale, gate, n_head=n_head, gate_offset=gate_offset,
                                   out_shape=out_shape, fused=fused)

    def glu(self, gate, up, activation):
        self.count(f"{activation}_mul_inplace")
        return (kernels.silu_mul if activation == "silu" else kernels.gelu_mul)(gate, up)

    def ffn_gate_up(self, x, gate, up, activation):
        # x quantized by the tail that made it, if it did (the same bits as quantizing it here)
        q8 = self._form_of(x, "q8")
        prep = self._form_of(x, "q4_K")
        # The dtype guard of seeds Ch 18 §18.6: the fused kernel exists for Q4_K only.
        fusable = all(w.form == "blocks" and w.qtype == T.Q4_K for w in (gate, up))
        tiled = gate.form == up.form == "q4_K_tiled" and gate.tile == up.tile  # (the q8 GLU's form only)
        if "ffn_4r2s" in self.flags and fusable:
            self.count("ffn_q4k_gate_up_silu_4r2s")
            return kernels.ffn_q4k_gate_up_4r2s(x, gate.weight, up.weight, activation)
        split = gate.form == up.form == "q6_K_split" and "mv_q8_q6k" not in self.flags
        same = (gate.form == up.form == "blocks" or split) and gate.qtype == up.qtype and gate.qtype in _KIND
        if "mv_q8" in self.flags and (fusable or tiled) and not self._batched(x):
            self.count("mul_mv_q4_K_q8 (glu)")
            mats = [(gate.weight, "q4_K"), (up.weight, "q4_K")]
            if "mv_q8_q6k" in self.flags and kernels.mul_mv.q8_from_glu():
                # its output quantized too, for the ffn_down (linear takes it)
                out, q8_out = kernels.mul_mv_q8(x, mats, glu=activation, q8=q8, q8_out=True, tile=gate.tile)
                if q8_out is not None:
                    self._forms["q8"] = (out, q8_out)
                return out
            return kernels.mul_mv_q8(x, mats, glu=activation, q8=q8, tile=gate.tile)
        if same and not self._batched(x):
            # gate, up and the activation in one dispatch, with the three unfused kernels' bits
            self.count(f"mul_mv_glu_{_KIND[gate.qtype]}_f32")
            return kernels.mul_mv_glu(x, gate.weight, up.weight, _kind_of(gate), activation,
                                      prep=prep if gate.qtype == T.Q4_K else None)
        return super().ffn_gate_up(x, gate, up, activation)

    def attn_gate(self, o, g):
        # ggml_sigmoid (1/(1+exp(-x))) then ggml_mul, as MLX ops: no custom kernel of its own.
        self.count("sigmoid_mul", 2)
        return o * (1.0 / (1.0 + mx.exp(-g)))


def check_flags(name: str, flags) -> frozenset[str]:
    """``flags`` as a set, if route ``name`` takes them; else a RouteError naming the problem."""
    flags = frozenset(flags or ())
    if name not in ROUTES:
        raise RouteError(f"unknown route '{name}' (choose from: {', '.join(ROUTES)})")
    unknown = flags - set(PINNED_FLAGS)
    if unknown:
        raise RouteError(
            f"unknown flag(s) {', '.join(sorted(unknown))} (pinned-route flags: {', '.join(PINNED_FLAGS)})"
        )
    if name == "stock" and flags:
        raise RouteError(f"flag(s) {', '.join(sorted(flags))} apply only to the pinned route")
    for flag, needs in FLAG_NEEDS.items():
        if flag in flags and needs not in flags:
            raise RouteError(f"flag {flag} works only together with {needs}")
    return flags


def make_route(name: str = "stock", flags=()) -> Route:
    """Build a route by name, checking its flags."""
    flags = check_flags(name, flags)
    return StockRoute() if name == "stock" else PinnedRoute(flags)
