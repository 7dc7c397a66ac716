"""Where the host's time goes in a batched prefill: per group of layers, and per op alone.

    python scripts/prefill_host_probe.py [--file PATH] [--ops]

Default: for each prefill mode and evaluation schedule, three prefills of 512 tokens of the
release-geometry file (made if missing, as bench.py makes it; the first run is a warm-up), with
the model's ``mx.async_eval``/``mx.eval`` calls timed on the host: how long starting a group of
layers takes (``async_eval``), how long the host then waits for the group before (``eval``), and
how long it builds the next group in between. A prefill bound by the GPU spends its time waiting;
one bound by the host spends it in ``async_eval``.

``--ops``: no model; eight independent calls of each big prefill op (a TF32 and an f16 matmul of
512 tokens, a dequantization to f32 and to f16) started by one ``async_eval``: the host's time per
op to start them, then the wait for them.

MLX's own settings (the ``MLX_*`` variables, e.g. ``MLX_USE_CUDA_GRAPHS=0``) are printed first.
Results: docs/performance-history.md (fifth session).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as T  # noqa: E402

import muse_mlx.model as model_module  # noqa: E402
from muse_mlx import kernels as K  # noqa: E402
from muse_mlx import load_model, synthetic  # noqa: E402
from muse_mlx.generate import batched_prefill  # noqa: E402
from muse_mlx.synthetic import RELEASE_VOCAB, ensure_synthetic  # noqa: E402
from muse_mlx.writer import MUSE_GLIMMER_30B  # noqa: E402

SCHEDULES = [  # (mode, evaluate every this many layers, start the next group before waiting)
    ("batched", 1, True), ("batched", 1, False), ("batched", 2, True), ("batched", 4, True), ("batched", 0, True),
    ("batched-f16", 4, True), ("batched-f16", 1, True),
]


class TimedMLX:
    """``muse_mlx.model``'s view of ``mlx.core``, with its two evaluation calls timed into ``log``."""

    def __init__(self, log: list):
        self.log = log

    def __getattr__(self, name):
        return getattr(mx, name)

    def async_eval(self, *a):
        t0 = time.perf_counter()
        mx.async_eval(*a)
        self.log.append(("async", t0, time.perf_counter()))

    def eval(self, *a):
        t0 = time.perf_counter()
        mx.eval(*a)
        self.log.append(("eval", t0, time.perf_counter()))


def ms(values) -> str:
    return f"{statistics.mean(values) * 1e3:.2f}" if values else "-"


def prefill_schedules(path: Path, n: int = 512) -> None:
    log: list = []
    model = load_model(path, "pinned", progress=False)
    model_module.mx = TimedMLX(log)
    prompt = mx.array(np.random.default_rng(0).integers(0, model.cfg.vocab_size, n))[None]
    for mode, sync, pipeline in SCHEDULES:
        walls = []
        mx.reset_peak_memory()
        with batched_prefill(model.route, mode, sync, pipeline):
            for _ in range(3):
                cache = model.make_cache()
                model.prepare_decode(cache, n + 8)
                mx.eval([c.kv for c in cache])
                mx.synchronize()
                log.clear()
                t0 = time.perf_counter()
                mx.eval(model(prompt, cache, last_only=True), [c.kv for c in cache])
                mx.synchronize()
                walls.append(time.perf_counter() - t0)
                del cache
        starts = [e - s for k, s, e in log if k == "async"]
        waits = [e - s for k, s, e in log if k == "eval"]
        builds = [s2 - e1 for (_, _, e1), (_, s2, _) in itertools.pairwise(log)]
        best = min(walls[1:])
        print(f"{mode} every {sync} layers{'' if pipeline else ', waiting for each'}: {best * 1e3:.1f} ms "
              f"({n / best:.0f} tok/s), runs {[round(w * 1e3, 1) for w in walls]} ms; last run: "
              f"{len(starts)} async_eval of {ms(starts)} ms, {len(waits)} waits of {ms(waits)} ms, "
              f"builds of {ms(builds)} ms; peak {mx.get_peak_memory() / 1e9:.1f} GB", flush=True)
        mx.clear_cache()


def single_ops(reps: int = 8) -> None:
    rng = np.random.default_rng(0)
    x32 = mx.random.normal((512, 6656))
    x16 = x32.astype(mx.float16)
    big = mx.array(synthetic.random_blocks(19968, 6656, T.Q4_K, rng))
    small = mx.array(synthetic.random_blocks(4096, 6656, T.Q4_K, rng))
    w = {(r, dt): K.dequantize_rows(m, "q4_K", dt) for r, m in ((19968, big), (4096, small))
         for dt in (mx.float32, mx.float16)}
    mx.eval(x32, x16, big, small, w)
    cases = [
        ("matmul f32 (TF32) 512x6656 @ 6656x19968", lambda i: (x32 + i) @ w[19968, mx.float32].T),
        ("matmul f16 512x6656 @ 6656x19968", lambda i: (x16 + i) @ w[19968, mx.float16].T),
        ("matmul f32 (TF32) 512x6656 @ 6656x4096", lambda i: (x32 + i) @ w[4096, mx.float32].T),
        ("matmul f16 512x6656 @ 6656x4096", lambda i: (x16 + i) @ w[4096, mx.float16].T),
        ("dequantize_rows 19968x6656 -> f32", lambda i: K.dequantize_rows(big[i:], "q4_K", mx.float32)),
        ("dequantize_rows 19968x6656 -> f16", lambda i: K.dequantize_rows(big[i:], "q4_K", mx.float16)),
        ("add f32 512x6656", lambda i: x32 + i),
    ]
    for name, op in cases:
        for _ in range(3):  # the last of three, so that every plan and kernel is built
            outs = [op(i) for i in range(reps)]
            mx.synchronize()
            t0 = time.perf_counter()
            mx.async_eval(outs)
            t1 = time.perf_counter()
            mx.eval(outs)
            t2 = time.perf_counter()
        print(f"{name:44s} async_eval {(t1 - t0) / reps * 1e3:7.3f} ms per op, then wait "
              f"{(t2 - t1) / reps * 1e3:7.3f} ms per op", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", default="/tmp/mg.gguf", help="release-geometry checkpoint (made if missing; "
                                                          "default: %(default)s)")
    ap.add_argument("--ops", action="store_true", help="time the big prefill ops alone instead (no model)")
    args = ap.parse_args(argv)
    print("MLX settings:", {k: v for k, v in os.environ.items() if k.startswith("MLX_")} or "defaults", flush=True)
    if args.ops:
        single_ops()
        return 0
    path = Path(args.file)
    ensure_synthetic(path, MUSE_GLIMMER_30B, RELEASE_VOCAB, "q4_k_m", 0)
    prefill_schedules(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
