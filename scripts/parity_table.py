"""The parity table of docs/parity.md: every architecture, every route and flag, and llama.cpp.

    python scripts/parity_table.py [--kv f16|f32] [--against-llama]

Writes tiny checkpoints (llama.cpp's Q4_K_M mix) of every architecture to a temporary folder
and runs ``muse_mlx.compare`` on each; prints one markdown row per pair.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muse_mlx.compare import DEFAULT_PROMPT, compare  # noqa: E402
from muse_mlx.config import ARCHITECTURES  # noqa: E402
from muse_mlx.gguf_file import GGUFFile  # noqa: E402
from muse_mlx.tokenizer import Tokenizer  # noqa: E402
from muse_mlx.writer import write_tiny  # noqa: E402

ROUTES = ["stock", "pinned", "pinned+tail_32sg", "pinned+ffn_4r2s", "pinned+split_norm_f16"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", default="f16", choices=["f16", "f32"])
    ap.add_argument("--against-llama", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    print(f"mlx {mx.__version__} on {mx.default_device()}, KV planes {args.kv}, contract 1e-4\n")
    print("| arch | a | b | max abs dlogit | max abs dlogprob | differing logits | greedy diverges at | verdict | first difference |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for arch in ARCHITECTURES:
            path = write_tiny(Path(d) / f"{arch}.gguf", arch)
            tokens = Tokenizer.from_gguf(GGUFFile(path)).encode(DEFAULT_PROMPT)
            _, reports = compare(path, ROUTES, tokens, args.max_tokens, args.against_llama, kv=args.kv)
            for p in reports:
                if p.a != "stock" and p.b != "llama.cpp" and p.a != "pinned":
                    continue  # stock vs all, pinned vs its flags, everything vs llama.cpp
                fd = p.first_divergence
                where = "-" if fd is None else f"{'pre' if fd.layer < 0 else 'L' + str(fd.layer)} {fd.op} ({fd.differing}/{fd.elements}, {fd.max_ulp} ULP)"
                print(f"| {arch} | {p.a} | {p.b} | {p.max_abs_logit:.2e} | {p.max_abs_logprob:.2e} | "
                      f"{p.differing_logits}/{p.logits} | {'-' if p.greedy_diverges_at is None else p.greedy_diverges_at} | "
                      f"{'PASS' if p.passed else 'FAIL'} | {where} |", flush=True)


if __name__ == "__main__":
    main()
