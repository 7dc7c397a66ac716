"""Pinned-exact kernels: Metal sources run through ``mx.fast.metal_kernel`` (Apple Silicon) or
``mx.fast.cuda_kernel`` (NVIDIA, behind ``prelude.cuh``), with an exact-order oracle for each
that runs wherever there is no GPU. Every function here is a plain function on ``mx.array``s.

=====================================  ====================================================
function                               reference
=====================================  ====================================================
``rms_norm_mul(x, w, eps, add)``       llama.cpp ``kernel_rms_norm_mul_f32_4`` (F = 1/2/3)
``rms_norm_batch(x, w, eps)``          seeds Ch 12 §12.4.1 ``rms_norm_batch``
``rms_norm_f16(x, w, eps)``            seeds Ch 12 §12.7 split no-fast-math norm (F16)
``tail_dual_eps(h, src, w1, w2, ..)``  seeds Ch 12 §12.4.4 exact dual-epsilon tail
``tail_32sg(h, src, w1, w2, ..)``      seeds Ch 12 §12.4.3 legacy 32-SIMD-group tail
``tail_dual_eps_q8(h, src, ..)``       the exact tail + its output as q8 activations (mv_q8)
``tail_dual_eps_q4(h, src, ..)``       the exact tail + its output prepared for the exact Q4_K lanes (prep=)
``mul_mv_q4_K(y, w)``                  llama.cpp ``kernel_mul_mv_q4_K_f32``
``mul_mv_q6_K(y, w)``                  llama.cpp ``kernel_mul_mv_q6_K_f32``
``mul_mv_multi(y, [(w, kind), ..])``   the same rows for up to 4 matrices, one dispatch
``mul_mv_glu(y, wg, wu, kind, act)``   gate + up matvecs and the activation, one dispatch
``dequantize_rows(w, kind)``           raw rows -> float32, bit-equal to gguf-py
``embed_rows(w, tokens, kind)``        rows ``tokens`` of raw rows -> float32 (the embedding)
``mul_mv_q8(y, [(w, kind), ..], glu)``  opt-in int8-activation Q4_K matvec (flag mv_q8; NOT exact)
``attn_decode(q, kv, pos, geom, ..)``  one token's GQA attention + output gate (not pinned)
``qk_rope_pack(y, w, eps, pos, rope)``  Q/K-norms, RoPE and the f16 K/V of a token, one dispatch
``attn_decode_token(y, .., kv, ..)``    the two above in one dispatch (caches of <= 1,024); K/V handed out
``logit_stats(logits)``                 a row's argmax, log-sum-exp and finite check, one pass (not pinned)
``silu_mul(g, u)`` / ``gelu_mul``      seeds Ch 18 ``muser_silu_mul_inplace`` / ggml geglu
``ffn_q4k_gate_up_4r2s(x, wg, wu)``    seeds Ch 18 §18.5 ``ffn_q4k_gate_up_silu_4r2s``
=====================================  ====================================================
"""

from . import attention, ffn, logits, mul_mv, norm_tail, rms_norm
from .attention import attn_decode, attn_decode_token, qk_rope_pack, rope_table
from .backend import backend, variants_launched
from .ffn import ffn_q4k_gate_up_4r2s, gelu_mul, silu_mul
from .logits import logit_stats
from .mul_mv import dequantize_rows, embed_rows, mul_mv_glu, mul_mv_multi, mul_mv_q4_K, mul_mv_q6_K, mul_mv_q8
from .norm_tail import tail_32sg, tail_dual_eps, tail_dual_eps_q4, tail_dual_eps_q8
from .rms_norm import GEOMETRIES, norm_threads, rms_norm_batch, rms_norm_f16, rms_norm_mul

ALL_KERNELS = rms_norm.KERNELS + norm_tail.KERNELS + mul_mv.KERNELS + ffn.KERNELS + attention.KERNELS + logits.KERNELS

__all__ = [
    "attn_decode", "attn_decode_token", "qk_rope_pack", "rope_table", "dequantize_rows", "embed_rows", "mul_mv_glu", "mul_mv_multi", "mul_mv_q8",
    "backend", "variants_launched", "ffn_q4k_gate_up_4r2s", "logit_stats", "gelu_mul", "silu_mul", "mul_mv_q4_K", "mul_mv_q6_K",
    "tail_32sg", "tail_dual_eps", "tail_dual_eps_q4", "tail_dual_eps_q8", "GEOMETRIES", "norm_threads", "rms_norm_batch", "rms_norm_f16",
    "rms_norm_mul", "ALL_KERNELS",
]
