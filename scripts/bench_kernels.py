"""Per-kernel timings of the big decode matvecs and the norms: pinned kernels vs MLX's stock ops.

    python scripts/bench_kernels.py [--reps 20] [--quick]

Weights are random but valid raw blocks (no quantizer needed), at Muse Glimmer's decode
shapes. Each measurement puts ``reps`` independent calls into one graph and evaluates it
once, so the time per call includes MLX's per-op launch cost but not Python's per-eval
overhead. Bandwidth = weight bytes read per call / time per call.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as T  # noqa: E402

from muse_mlx import kernels as K  # noqa: E402
from muse_mlx.quants import dequantize, to_affine  # noqa: E402

BLOCK = {T.Q4_K: 144, T.Q6_K: 210}


def random_blocks(rows: int, k: int, qtype: T, rng) -> mx.array:
    """Valid raw blocks: random quants and scales, small finite f16 super-scales."""
    nb = k // 256
    raw = rng.integers(0, 256, size=(rows, nb, BLOCK[qtype]), dtype=np.uint8)
    d = (rng.uniform(1e-4, 1e-3, size=(rows, nb))).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    if qtype == T.Q4_K:
        raw[..., 0:2] = d
        raw[..., 2:4] = d
    else:
        raw[..., 208:210] = d
    return mx.array(raw.reshape(rows, -1))


def timed(fn, inputs, reps: int) -> float:
    """Seconds per call: ``reps`` calls on distinct inputs, one graph, one eval (median of 5)."""
    mx.eval(fn(inputs[0]))  # compile / warm up
    times = []
    for _ in range(5):
        outs = [fn(x) for x in inputs[:reps]]
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"mlx {mx.__version__}, device {mx.default_device()}, kernels: {K.backend()}, reps {args.reps}")
    print(f"{'op':44} {'shape':>16} {'us/call':>9} {'GB/s':>8}")
    shapes = [(19968, 6656, "ffn_gate/up"), (6656, 19968, "ffn_down"), (4096, 6656, "attn_q"), (202048, 6656, "head")]
    if args.quick:
        shapes = [(4096, 6656, "attn_q")]
    for rows, k, label in shapes:
        xs = [mx.random.normal((1, k)) for _ in range(args.reps)]
        for qtype in (T.Q4_K, T.Q6_K):
            w = random_blocks(rows, k, qtype, rng)
            mx.eval(w)
            nbytes = w.nbytes
            fn = K.mul_mv_q4_K if qtype == T.Q4_K else K.mul_mv_q6_K
            t = timed(lambda x: fn(x, w), xs, args.reps)
            print(f"{'pinned mul_mv_' + qtype.name:44} {f'{rows}x{k}':>16} {t * 1e6:9.1f} {nbytes / t / 1e9:8.0f}  {label}")
            if qtype == T.Q4_K:
                aw, s, b, bits = to_affine(w, qtype)
                mx.eval(aw, s, b)
                abytes = aw.nbytes + s.nbytes + b.nbytes
                t = timed(lambda x: mx.quantized_matmul(x, aw, s, b, transpose=True, group_size=32, bits=bits), xs, args.reps)
                print(f"{'stock quantized_matmul (affine, f32 scales)':44} {f'{rows}x{k}':>16} {t * 1e6:9.1f} {abytes / t / 1e9:8.0f}  {label}")
            elif rows * k <= 6656 * 19968:
                t = timed(lambda x: x @ dequantize(w, qtype).T, xs, min(args.reps, 4))
                print(f"{'stock dequantize+matmul (Q6_K)':44} {f'{rows}x{k}':>16} {t * 1e6:9.1f} {nbytes / t / 1e9:8.0f}  {label}")
            del w
    n = 6656
    xs = [mx.random.normal((1, n)) for _ in range(args.reps)]
    wv = mx.random.normal((n,))
    for name, fn in [
        ("pinned rms_norm_mul (ggml)", lambda x: K.rms_norm_mul(x, wv, 1e-5, geometry="seeds")),
        ("stock mx.fast.rms_norm", lambda x: mx.fast.rms_norm(x, wv, 1e-5)),
        ("pinned tail_dual_eps", lambda x: K.tail_dual_eps(x, x, wv, wv, 1e-8, 1e-5, "seeds")[1]),
        ("stock rms_norm + add + rms_norm", lambda x: mx.fast.rms_norm(x + mx.fast.rms_norm(x, wv, 1e-8), wv, 1e-5)),
        ("pinned silu_mul_inplace (19968)", lambda x: K.silu_mul(mx.tile(x, (1, 3)), mx.tile(x, (1, 3)))),
    ]:
        t = timed(fn, xs, args.reps)
        print(f"{name:44} {f'1x{n}':>16} {t * 1e6:9.1f}")


if __name__ == "__main__":
    main()
