"""Peak memory and KV-cache bytes as generation runs past the sliding window towards the context.

    python scripts/memory_curve.py [--arch muse-glimmer] [--ctx 4096] [--route stock]

A tiny checkpoint (window 8, context --ctx) generates greedily; at each checkpoint length the
script prints MLX's peak memory, the sliding layers' and the global layers' cache bytes, and
what a cache of that length must hold. Sliding layers stay at window - 1 positions; global
layers grow in 256-position steps; the peak follows the cache, not the length.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muse_mlx import load_model  # noqa: E402
from muse_mlx.generate import generate_step  # noqa: E402
from muse_mlx.writer import Geometry, write_tiny  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="muse-glimmer")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--route", default="stock")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = write_tiny(Path(d) / "m.gguf", args.arch, geometry=Geometry(n_ctx=args.ctx))
        model = load_model(path, args.route)
        weights = mx.get_active_memory()
        cache = model.make_cache()
        cfg = model.cfg
        marks = {n for n in (64, 256, 512, 1024, 2048, 3072, 4000) if n < args.ctx - 8}
        print(f"{args.arch} on {mx.default_device()}, route {args.route}: weights {weights / 1e6:.2f} MB, "
              f"window {cfg.sliding_window}, context {args.ctx}, layers sliding {sum(cfg.swa_layers)} / global "
              f"{cfg.n_layer - sum(cfg.swa_layers)}")
        print(f"{'tokens':>7} {'peak MB':>9} {'sliding KV bytes':>17} {'global KV bytes':>16} {'global bytes needed':>20}")
        per_pos = 2 * cfg.n_head_kv * cfg.head_dim * 2 * (cfg.n_layer - sum(cfg.swa_layers))
        mx.reset_peak_memory()
        for i, _ in enumerate(generate_step(mx.array([1, 2, 3]), model, max_tokens=max(marks), cache=cache), start=4):
            if i in marks:
                sliding = sum(c.nbytes for c, s in zip(cache, cfg.swa_layers) if s)
                glob = sum(c.nbytes for c, s in zip(cache, cfg.swa_layers) if not s)
                print(f"{i:7d} {mx.get_peak_memory() / 1e6:9.2f} {sliding:17d} {glob:16d} {per_pos * i:20d}", flush=True)


if __name__ == "__main__":
    main()
