"""Decode speed of the release Muse Glimmer geometry, per route, from synthetic in-memory weights.

    python scripts/bench_decode.py [--routes stock,pinned] [--tokens 32] [--small]

A first baseline for the decode benchmark issue (not its full ``bench.py``): the model is
built directly from random but valid raw blocks in llama.cpp's Q4_K_M mix (no file is written
or loaded), 128 prompt tokens are pre-filled, then ``--tokens`` tokens are decoded greedily and
timed per token. Also printed: the device's copy bandwidth, the weight bytes a decode step
reads, the effective bandwidth, peak memory, and the route's dispatches per decoded token.
``--small`` uses a 4-layer geometry (for a CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as T  # noqa: E402

from muse_mlx.config import MUSE_POST_NORM_EPS, ModelConfig  # noqa: E402
from muse_mlx.generate import generate_step, weight_bytes_per_token  # noqa: E402
from muse_mlx.layers import Norm, QEmbedding, QLinear  # noqa: E402
from muse_mlx.model import Model  # noqa: E402
from muse_mlx.routes import make_route  # noqa: E402
from muse_mlx.writer import MUSE_GLIMMER_30B, Geometry, tensor_type  # noqa: E402

VOCAB = 202048
BLOCK_BYTES = {T.Q4_K: 144, T.Q6_K: 210}


def random_blocks(rows: int, cols: int, qtype: T) -> mx.array:
    """Random quants and scales with one small finite f16 super-scale (timing does not care)."""
    nb, size = cols // 256, BLOCK_BYTES[qtype]
    b = mx.random.randint(0, 256, (rows, nb, size)).astype(mx.uint8)
    d = mx.array(np.frombuffer(np.float16(1e-3).tobytes(), np.uint8))
    if qtype == T.Q4_K:
        b[..., 0:2] = d
        b[..., 2:4] = d
    else:
        b[..., 208:210] = d
    out = b.reshape(rows, nb * size)
    mx.eval(out)
    return out


def config(g: Geometry) -> ModelConfig:
    swa = tuple(il % 4 < 3 for il in range(g.n_layer))
    return ModelConfig(
        arch="muse-glimmer", n_layer=g.n_layer, n_embd=g.n_embd, n_ff=g.n_ff, n_head=g.n_head, n_head_kv=g.n_head_kv,
        head_dim=g.head_dim, vocab_size=VOCAB, n_ctx_train=g.n_ctx, rms_eps=g.rms_eps, post_norm_eps=MUSE_POST_NORM_EPS,
        entry_norm=True, embed_scale=None, qk_norm=True, attn_gate=True, activation="silu",
        sliding_window=g.sliding_window, swa_layers=swa, rope_layers=swa, rope_traditional=True, rope_dims=g.head_dim,
        rope_base=10000.0, rope_base_swa=10000.0, rope_scale=1.0, q_scale=None, kq_scale=float(g.head_dim ** -0.5),
        attn_softcap=None, final_softcap=30.0, logit_scale=1.0, tied_output=False,
    )


def build(g: Geometry, route_name: str) -> Model:
    cfg = config(g)
    route = make_route(route_name)
    model = Model(cfg, route)
    D, q, kv = g.n_embd, g.n_head * g.head_dim, g.n_head_kv * g.head_dim

    def lin(name, out_f, in_f):
        qtype = tensor_type(name, (out_f, in_f), "q4_k_m", g.n_layer, False)
        layer = QLinear(random_blocks(out_f, in_f, qtype), qtype, in_f, out_f, route.form_for(qtype))
        mx.eval(layer.parameters())
        return layer

    ones = lambda n, eps: Norm(mx.ones((n,)), eps)  # noqa: E731
    model.token_embd = QEmbedding(random_blocks(VOCAB, D, T.Q4_K), T.Q4_K, D)
    for i, blk in enumerate(model.blk):
        p = f"blk.{i}."
        blk.attn_norm, blk.ffn_norm = ones(D, g.rms_eps), ones(D, g.rms_eps)
        blk.post_attention_norm, blk.post_ffw_norm = ones(D, MUSE_POST_NORM_EPS), ones(D, MUSE_POST_NORM_EPS)
        blk.attn_q_norm, blk.attn_k_norm = ones(g.head_dim, g.rms_eps), ones(g.head_dim, g.rms_eps)
        blk.attn_q, blk.attn_k, blk.attn_v = lin(p + "attn_q.weight", q, D), lin(p + "attn_k.weight", kv, D), lin(p + "attn_v.weight", kv, D)
        blk.attn_gate, blk.attn_output = lin(p + "attn_gate.weight", q, D), lin(p + "attn_output.weight", D, q)
        blk.ffn_gate, blk.ffn_up = lin(p + "ffn_gate.weight", g.n_ff, D), lin(p + "ffn_up.weight", g.n_ff, D)
        blk.ffn_down = lin(p + "ffn_down.weight", D, g.n_ff)
    model.output_norm = ones(D, g.rms_eps)
    model.output = lin("output.weight", VOCAB, D)
    mx.eval(model.parameters())
    return model


def copy_bandwidth() -> float:
    a = mx.random.uniform(shape=(1 << 28,))  # 1 GiB
    mx.eval(a)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        mx.eval(a + 0)
        times.append(time.perf_counter() - t0)
    return 2 * a.nbytes / min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--routes", default="stock,pinned")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    g = Geometry(n_layer=4, n_embd=1024, n_ff=3072, n_head=8, n_head_kv=2, head_dim=128, n_ctx=8192,
                 sliding_window=4096) if args.small else MUSE_GLIMMER_30B
    bw = copy_bandwidth()
    print(f"mlx {mx.__version__} on {mx.default_device()}; copy bandwidth {bw / 1e12:.3f} TB/s; "
          f"{g.n_layer} layers x {g.n_embd}, vocab {VOCAB}", flush=True)
    prompt = mx.array(np.random.default_rng(0).integers(0, VOCAB, 128))
    for name in args.routes.split(","):
        mx.clear_cache()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        model = build(g, name)
        built = time.perf_counter() - t0
        wbytes = weight_bytes_per_token(model)
        times, last = [], time.perf_counter()
        t_prefill = None
        for i, _ in enumerate(generate_step(prompt, model, max_tokens=args.tokens)):
            now = time.perf_counter()
            if i == 0:
                t_prefill = now - last
            else:
                times.append(now - last)
            last = now
        model.route.dispatches.clear()
        cache = model.make_cache()
        model(prompt[None, :8], cache)
        model.route.dispatches.clear()
        model(prompt[None, 8:9], cache, last_only=True)
        per_token = sum(model.route.dispatches.values())
        med = statistics.median(times)
        print(f"{name:7} built in {built:.0f} s; prefill 128 + first token {t_prefill:.2f} s; decode median "
              f"{med * 1e3:.1f} ms/token = {1 / med:.1f} tok/s; weights read/token {wbytes / 1e9:.2f} GB -> "
              f"{wbytes / med / 1e12:.3f} TB/s ({wbytes / med / bw:.0%} of copy); peak memory "
              f"{mx.get_peak_memory() / 1e9:.1f} GB; route ops per token {per_token}", flush=True)
        print(f"        ops: {dict(model.route.dispatches)}", flush=True)
        del model, cache


if __name__ == "__main__":
    main()
