"""``python -m muse_mlx.perplexity``: perplexity of a model on a text, per route, and in llama.cpp.

The text is tokenized once (the file's tokenizer, BOS as the file says) and cut into
windows of ``--ctx`` tokens; each window is run from an empty cache and every position but
the first predicts the next token. llama.cpp's logits for the same windows (``--against
llama.cpp``) are scored by the same code, so the two numbers differ only by the engines.

    python -m muse_mlx.perplexity --model m.gguf --file heldout.txt --routes stock,pinned --against llama.cpp
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import MuseError, RequestError


@dataclass
class Perplexity:
    engine: str
    nll: float  # mean negative log-likelihood, nats per token
    tokens: int  # tokens scored
    seconds: float

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


def windows(tokens: list[int], ctx: int) -> list[list[int]]:
    """Non-overlapping windows of ``ctx`` tokens (the last may be shorter, but at least 2)."""
    out = [tokens[i : i + ctx] for i in range(0, len(tokens), ctx)]
    return [w for w in out if len(w) >= 2]


def score(logits: np.ndarray, window: list[int]) -> tuple[float, int]:
    """Sum of -log p(next token) over a window, from its [T, vocab] logits (in float64)."""
    x = logits[:-1].astype(np.float64)
    m = x.max(-1, keepdims=True)
    logz = m[:, 0] + np.log(np.exp(x - m).sum(-1))
    target = np.asarray(window[1:])
    return float((logz - x[np.arange(len(target)), target]).sum()), len(target)


def perplexity(model, tokens: list[int], ctx: int = 128, name: str = "") -> Perplexity:
    t0 = time.perf_counter()
    nll, n = 0.0, 0
    for w in windows(tokens, ctx):
        s, k = score(np.array(model(mx.array([w]))[0], dtype=np.float32), w)
        nll, n = nll + s, n + k
    return Perplexity(name, nll / n, n, time.perf_counter() - t0)


def llama_cpp_perplexity(path, tokens: list[int], ctx: int = 128) -> Perplexity:
    try:
        import llama_cpp
    except ImportError:
        raise RequestError("--against llama.cpp needs llama-cpp-python: pip install -e \".[llama]\"") from None
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, verbose=False, n_ctx=ctx, flash_attn=False)
    nll, n = 0.0, 0
    for w in windows(tokens, ctx):
        llm.reset()
        llm.eval(w)
        s, k = score(np.array(llm.scores[: len(w)], dtype=np.float32), w)
        nll, n = nll + s, n + k
    return Perplexity("llama.cpp", nll / n, n, time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m muse_mlx.perplexity", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--file", required=True, help="UTF-8 text to score")
    ap.add_argument("--routes", default="stock", help="comma-separated routes, flags as pinned+flag (default: %(default)s)")
    ap.add_argument("--ctx", type=int, default=128, help="tokens per window (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens of the text")
    ap.add_argument("--against", choices=["llama.cpp"], default=None, help="also score with llama.cpp")
    args = ap.parse_args(argv)
    try:
        from .compare import parse_route
        from .loader import load

        if args.ctx < 2:
            raise RequestError(f"--ctx must be at least 2, got {args.ctx}")
        if args.max_tokens is not None and args.max_tokens < 2:
            raise RequestError(f"--max-tokens must be at least 2, got {args.max_tokens}")
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise RequestError(f"{args.file}: cannot read the text ({e})") from None
        results, tokens = [], None
        for spec in [r for r in args.routes.split(",") if r.strip()]:
            name, flags = parse_route(spec)
            model, tok = load(args.model, name, flags)
            if args.ctx > model.cfg.n_ctx_train:
                raise RequestError(f"--ctx {args.ctx} is longer than the model's context ({model.cfg.n_ctx_train})")
            if tokens is None:
                tokens = tok.encode(text)[: args.max_tokens]
                if len(tokens) < 2:
                    raise RequestError(f"{args.file}: fewer than 2 tokens to score")
            results.append(perplexity(model, tokens, args.ctx, spec))
        if args.against == "llama.cpp":
            results.append(llama_cpp_perplexity(args.model, tokens, args.ctx))
        print(f"{args.model}: {len(tokens)} tokens of {args.file}, windows of {args.ctx}")
        print(f"{'engine':24} {'tokens scored':>13} {'nats/token':>11} {'perplexity':>11} {'seconds':>8}")
        for r in results:
            print(f"{r.engine:24} {r.tokens:13d} {r.nll:11.5f} {r.ppl:11.4f} {r.seconds:8.1f}")
    except MuseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
