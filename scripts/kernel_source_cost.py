"""Host time per custom-kernel launch against the size of the kernel's source (NVIDIA only).

    python scripts/kernel_source_cost.py

MLX's CUDA backend hashes a custom kernel's whole source at every launch
(``CustomKernel::eval_gpu``, MLX 0.32), so the host's cost of a launch grows with the text. This
times a chain of 400 tiny dependent kernels, compiled and not, whose sources differ only by a
comment of 0-32 KB, and prints the median host time per kernel (15 runs). The GPU's work is
negligible, so the chain is bound by the host. Each size is timed twice: with the comment in the
source MLX gets, and in a file that source names by one #include line (what the engine's kernels do
since the twenty-ninth session: ``backend.Kernel.launch_texts``), whose cost should not grow with
the text. ``muse_mlx.kernels.backend.needed_header`` trimmed the texts for the same reason
(docs/kernels.md, "A kernel's source").
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

N, REPS = 400, 15
BODY = "int i = threadIdx.x; if (i < 64) y[i] = x[i] + 1.0f;"


def per_kernel_us(kernel, compiled: bool) -> tuple[float, float]:
    """(median, min) host microseconds per kernel of the chain."""

    def chain(x):
        for _ in range(N):
            x = kernel(inputs=[x], output_shapes=[(64,)], output_dtypes=[mx.float32], grid=(64, 1, 1),
                       threadgroup=(64, 1, 1))[0]
        return x

    fn = mx.compile(chain) if compiled else chain
    x = mx.zeros((64,))
    mx.eval(fn(x))  # builds the kernel and, compiled, the trace
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        mx.eval(fn(x))
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e6 * times[len(times) // 2] / N, 1e6 * times[0] / N


def main() -> int:
    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        print("kernel_source_cost: needs MLX's CUDA backend (mx.fast.cuda_kernel)", file=sys.stderr)
        return 2
    print(f"mlx {mx.__version__}, {mx.default_device()}")
    with tempfile.TemporaryDirectory(prefix="source_cost_") as tmp:
        run_sizes(Path(tmp))
    return 0


def run_sizes(folder: Path) -> None:
    """Each size inline and behind an #include of a file in ``folder`` (which must outlive the runs:
    NVRTC reads the file when MLX first compiles the kernel)."""
    for kb in (0, 4, 8, 16, 32):
        pad = ("// " + "x" * 76 + "\n") * (kb * 1024 // 80)
        (folder / f"pad_{kb}.cuh").write_text(pad)
        for where, header in (("inline", pad), ("file", f'#include "{folder}/pad_{kb}.cuh"\n')):
            kernel = mx.fast.cuda_kernel(name=f"source_cost_{kb}_{where}", input_names=["x"], output_names=["y"],
                                         source=BODY, header=header)
            for compiled in (True, False):
                med, low = per_kernel_us(kernel, compiled)
                label = "compiled" if compiled else "uncompiled"
                print(f"source +{kb:2d} KB {where:6s} {label:10s}: {med:6.2f} us per kernel "
                      f"(median of {REPS}; min {low:.2f})", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
