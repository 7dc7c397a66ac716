"""A decode for an outside profiler: warm up, then decode inside one CUDA profiler range.

    ncu --clock-control none --profile-from-start off --kernel-name regex:mul_mv --launch-count 60 \\
        --set full -o decode python scripts/profile_decode.py --file PATH [--flags mv_q8+mv_q8_q6k]
    ncu --import decode.ncu-rep --page details > decode-details.txt

Loads a checkpoint (the release geometry's synthetic file, made if missing), decodes ``--warmup``
tokens (every custom kernel compiled, every CUDA graph built), then calls ``cuProfilerStart``,
decodes ``--tokens`` tokens the way ``bench.py`` does (compiled step, pipelined) and calls
``cuProfilerStop``. With ``--profile-from-start off``, Nsight Compute (``ncu``) then profiles only
the decode's kernels, not the loading or the JIT compilation. ``ncu`` runs each profiled kernel
alone, replayed once per group of counters, so its durations are of kernels without neighbours;
``gpu_timeline.py`` has them as they run together.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", required=True, help="checkpoint path (a synthetic file of the release geometry is made if missing)")
    ap.add_argument("--route", default="pinned", help="route to load (default: %(default)s)")
    ap.add_argument("--flags", default="", help="one flag set, '+' between flags (default: none)")
    ap.add_argument("--ctx", type=int, default=128, help="context of the decode (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=1, help="tokens decoded inside the range (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=4, help="tokens decoded before the range (default: %(default)s)")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench
    import mlx.core as mx
    import numpy as np

    from muse_mlx import load_model
    from muse_mlx.synthetic import RELEASE_VOCAB, ensure_synthetic
    from muse_mlx.writer import MUSE_GLIMMER_30B

    if not mx.cuda.is_available():
        print("profile_decode.py needs MLX's CUDA backend (the range is a CUDA profiler range)", file=sys.stderr)
        return 2
    cuda = ctypes.CDLL("libcuda.so.1")
    path = Path(args.file)
    ensure_synthetic(path, MUSE_GLIMMER_30B, RELEASE_VOCAB, "q4_k_m", 0)
    model = load_model(path, args.route, progress=False)
    model.set_flags(tuple(f for f in args.flags.split("+") if f))
    cache = model.make_cache()
    bench.fill_cache(model, cache, args.ctx, np.random.default_rng(0))
    step = bench.greedy_step(model, cache, args.ctx + args.warmup + args.tokens + 2, True)
    y = step(mx.array([1]))
    for _ in range(args.warmup):
        y = step(y.reshape(1))
    y.item()
    mx.synchronize()
    if cuda.cuProfilerStart() != 0:
        print("cuProfilerStart failed", file=sys.stderr)
        return 2
    y = bench.decode_tokens(step, y, args.tokens)
    mx.synchronize()
    cuda.cuProfilerStop()
    print(f"decoded {args.tokens} token(s) inside the profiler range; last token {y.item()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
