"""Measure how far llama.cpp's logits are from ours on the project's tiny checkpoints.

    python scripts/llama_cpp_gap.py            # needs: pip install -e ".[llama]"

Prints one row per architecture and quant mix: max |Δlogit| (ours vs llama.cpp, and each vs
the float64 reference of tests/reference.py) and how often both rank the same token first.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference import RefModel  # noqa: E402

from muse_mlx import load  # noqa: E402
from muse_mlx.config import ARCHITECTURES  # noqa: E402
from muse_mlx.writer import write_tiny  # noqa: E402

TEXT = "Hello world, the quick brown fox jumps over the lazy dog. This is a tiny model."


def main() -> None:
    import llama_cpp

    print(f"llama-cpp-python {llama_cpp.__version__}, mlx {mx.__version__}, CPU backend, {len(TEXT)} chars")
    print(f"{'arch':14} {'mix':7} {'tokens':>6} {'|ours-llama|':>13} {'|ours-f64|':>11} {'|llama-f64|':>12} {'same argmax':>12}")
    with tempfile.TemporaryDirectory() as d:
        for arch in ARCHITECTURES:
            for mix in ("f32", "q4_k_m"):
                path = write_tiny(Path(d) / f"{arch}-{mix}.gguf", arch, mix)
                model, tok = load(path)
                ids = tok.encode(TEXT)
                ours = np.array(model(mx.array([ids]))[0], dtype=np.float64)
                llm = llama_cpp.Llama(model_path=str(path), logits_all=True, verbose=False, n_ctx=128, flash_attn=False)
                llm.eval(ids)
                theirs = np.array(llm.scores[: len(ids)], dtype=np.float64)
                ref = RefModel(path).forward(ids)
                same = (ours.argmax(-1) == theirs.argmax(-1)).mean()
                print(f"{arch:14} {mix:7} {len(ids):6d} {np.abs(ours - theirs).max():13.3e} "
                      f"{np.abs(ours - ref).max():11.3e} {np.abs(theirs - ref).max():12.3e} {same:12.1%}")


if __name__ == "__main__":
    main()
