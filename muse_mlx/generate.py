"""Text generation: ``generate_step`` -> ``stream_generate`` -> ``generate`` -> the CLI.

Each layer is usable on its own from Python. The decode loop follows mlx-lm: the graph of
step n+1 is built and queued (``mx.async_eval``) before token n is read back, so Python
runs while the device computes. Prompts are pre-filled in chunks, evaluating the cache
after each. The CLI prints what ``mlx_lm.generate`` prints, plus the weight bandwidth.

    python -m muse_mlx.generate --prompt "Hello" --max-tokens 20
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Generator

import mlx.core as mx

from .decode import DecodeStep
from .errors import MuseError, NumericalError, RequestError
from .kernels import cuda_prebuild
from .kernels.backend import backend, cuda_source_mode, variants_launched
from .kernels.logits import logit_stats, logits_mode
from .sampling import greedy, make_sampler

DEFAULT_MAX_TOKENS = 100
DEFAULT_PREFILL_STEP = 512

generation_stream = mx.new_thread_local_stream(mx.default_device())


@dataclass
class GenerationResponse:
    """One step of :func:`stream_generate` (field names as in mlx-lm)."""

    text: str
    token: int
    logprobs: mx.array
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None


# how a prompt is pre-filled: the dtype a batched prefill dequantizes to (None: matvecs), and
# every how many layers it is evaluated (bounding the dequantized matrices alive at once). On the
# H200 (docs/performance-history.md, fifth session), with each group started before the previous one is
# waited for, every layer is as fast as any longer period in both modes and needs the least memory
PREFILL_MODES = {"batched": (mx.float32, 1), "batched-f16": (mx.float16, 1), "exact": (None, 0)}


def next_token(logits: mx.array, sampler=greedy) -> tuple[mx.array, mx.array, mx.array]:
    """``(token [B], logprobs [B, V], finite [B])`` of logits ``[B, V]``: what generation reads from
    a decoded token's logits. Their argmax, log-sum-exp and finite check come from one pass
    (:func:`~muse_mlx.kernels.logits.logit_stats`: two launches on a GPU, where MLX's logsumexp,
    subtraction, argmax, isfinite and all took five); :func:`~muse_mlx.sampling.greedy` takes its token
    from there (the argmax of the logits), any other sampler draws from ``logprobs``. ``finite``
    is 1 where every logit is finite; ``logprobs`` is lazy. A sampler other than ``greedy`` itself
    (a wrapped or compiled one too) draws from ``logprobs``: its argmax may then differ from the
    logits' where two logits are one float32 step apart."""
    token, logprobs, finite = _logit_pass()(logits)
    return (token if sampler is greedy else sampler(logprobs)), logprobs, finite


_LOGIT_PASSES: dict = {}


def _logit_pass():
    """``logits -> (argmax, logprobs, finite)``, on a GPU under ``mx.compile``: replayed, the two
    kernels cost no Python a token (an uncompiled custom kernel's call cost the H200's host about
    20 µs more than a compiled one's, by the sixth session's decode rates). A function per backend,
    ``MUSE_MLX_LOGITS`` value and CUDA source form, so that an in-process A/B of a switch gets both;
    MLX traces it again for a new input shape or stream. Without a GPU (or with the oracles forced)
    it is not compiled, as the decode step is not: MLX's compiled CPU ops need a C++ compiler at run
    time."""
    which = backend()
    key = (which, logits_mode(which), cuda_source_mode() if which == "cuda" else None)
    if key not in _LOGIT_PASSES:
        def logit_pass(logits):
            stats = logit_stats(logits)
            return stats.token, logits - stats.lse[..., None], stats.finite

        _LOGIT_PASSES[key] = logit_pass if which == "cpu" else mx.compile(logit_pass)
    return _LOGIT_PASSES[key]


def check_token_ids(cfg, ids) -> None:
    """Raise :class:`RequestError` for an id outside the vocabulary: the embedding's gather does not
    check its indices (past the table it reads other memory; on the CPU that crashed the process)."""
    for at, t in enumerate(ids):
        if not 0 <= t < cfg.vocab_size:
            raise RequestError(f"token id {t} (position {at}) is outside the vocabulary (0..{cfg.vocab_size - 1})")


def generate_step(
    prompt: mx.array, model, *, max_tokens: int = DEFAULT_MAX_TOKENS, sampler=None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP, cache=None, prefill_callback=None,
    prefill: str = "batched", compiled: bool | None = None, eval_logprobs: bool = True,
) -> Generator[tuple[int, mx.array], None, None]:
    """Yield ``(token, logprobs)`` pairs, one per generated token, for a 1-D prompt of ids.

    ``prefill="batched"`` pre-fills the prompt with matmuls (on the pinned route: an exact
    dequantization and MLX's float32 matmul instead of one matvec per token; MLX's CUDA matmul
    rounds its float32 operands to TF32 unless ``MLX_ENABLE_TF32=0``); ``"batched-f16"``
    dequantizes to half and rounds the activations to half (llama.cpp Metal's mul_mm operands;
    the products are summed in float32, and MLX rounds the sums to half too); ``"exact"``
    keeps the route's one-token matvec kernels for every prompt token (slow; each token's matvecs
    give batch-1 bits, while a chunk's attention is MLX's, as in any multi-token forward).
    Decoding goes through :class:`~muse_mlx.decode.DecodeStep` when the route has a one-token
    decode path (``compiled``: replay one ``mx.compile`` trace; default: on a GPU). Each token's
    log-probabilities are evaluated with it (``eval_logprobs``, as mlx-lm does); ``False`` leaves them
    lazy, one launch a token fewer for a caller that does not read them (:func:`generate`, the CLI),
    while one read later waits for the step queued after it.
    """
    if prompt.ndim != 1 or prompt.size == 0:
        raise RequestError("the prompt must contain at least one token")
    if prefill not in PREFILL_MODES:
        raise RequestError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {prefill!r}")
    if prefill_step_size < 1:
        raise RequestError(f"prefill-step-size must be at least 1, got {prefill_step_size}")
    if max_tokens < 0:
        raise RequestError(f"max-tokens must be at least 0, got {max_tokens}")
    if prefill == "batched-f16" and not model.route.batches_prefill:
        raise RequestError(f"prefill mode batched-f16 needs the pinned route: the {model.route.name} route "
                           "pre-fills with MLX's own ops")
    history = prompt.tolist()
    check_token_ids(model.cfg, history)
    sampler = sampler or make_sampler()
    cache = model.make_cache() if cache is None else cache
    # room for the whole run now, so that decoding never reallocates the planes
    capacity = cache[0].offset + prompt.size + max_tokens
    for c in cache:
        c.reserve_for(model.cfg, capacity)
    decode = None
    if model.uses_decode_path(mx.zeros((1, 1), dtype=mx.int32), cache):
        decode = DecodeStep(model, cache, capacity, compiled)

    def step(y):
        with mx.stream(generation_stream):
            if decode is not None:
                logits = decode(y)[None]
            else:
                logits = model(y.reshape(1, -1), cache, last_only=True)[:, -1, :]
            token, logprobs, finite = next_token(logits, sampler)
            return token[0], logprobs[0], finite[0]

    with mx.stream(generation_stream), batched_prefill(model.route, prefill):
        done, total = 0, prompt.size - 1
        while prompt.size > 1:
            n = min(prefill_step_size, prompt.size - 1)
            model(prompt[None, :n], cache, last_only=True)
            mx.eval([c.state for c in cache])
            prompt = prompt[n:]
            done += n
            if prefill_callback is not None:
                prefill_callback(done, total)
            mx.clear_cache()
    y, logprobs, finite = step(prompt)
    mx.async_eval(y, finite, *([logprobs] if eval_logprobs else []))
    n = 0
    while n < max_tokens:
        if n + 1 < max_tokens:
            next_y, next_logprobs, next_finite = step(y)
            mx.async_eval(next_y, next_finite, *([next_logprobs] if eval_logprobs else []))
        token = int(y.item())
        if not finite.item():
            _raise_nonfinite(model, history, n)
        history.append(token)
        yield token, logprobs
        if n % 256 == 255:
            mx.clear_cache()
        n += 1
        if n < max_tokens:
            y, logprobs, finite = next_y, next_logprobs, next_finite


@contextlib.contextmanager
def batched_prefill(route, mode: str = "batched", layer_sync: int | None = None, pipeline: bool = True,
                    matmul_commits: bool | None = None):
    """While active, the route runs multi-token inputs as matmuls (see :func:`generate_step`),
    evaluated every ``layer_sync`` layers (default: the mode's) and, unless ``pipeline`` is False,
    each group started before the previous one is waited for; ``matmul_commits``: each weight matmul in
    a CUDA graph of its own (default: for the float32 mode on MLX's CUDA backend, see
    ``Route.matmul_commits``). A route without a batched prefill of its own (stock) keeps its
    matmuls and takes only ``matmul_commits`` (default: off)."""
    before = route.batched, route.layer_sync, route.layer_pipeline, route.matmul_commits
    if route.batches_prefill:
        route.batched, route.layer_sync = PREFILL_MODES[mode]
        if layer_sync is not None:
            route.layer_sync = layer_sync
        route.layer_pipeline = pipeline
    if matmul_commits is None:
        matmul_commits = (route.batched is not None and route.batched == mx.float32 and mx.default_device() == mx.gpu
                          and mx.cuda.is_available())
    route.matmul_commits = matmul_commits
    try:
        yield
    finally:
        route.batched, route.layer_sync, route.layer_pipeline, route.matmul_commits = before


def _raise_nonfinite(model, tokens: list[int], n: int):
    """Stop with the place where NaN/Inf first appears, found by re-running the tokens traced."""
    from .trace import first_nonfinite

    where = first_nonfinite(model, tokens)
    at = "" if where is None else (
        f": it first appears in {'the embedding' if where[0] < 0 else f'layer {where[0]}'}, op {where[1]}"
    )
    raise NumericalError(f"the logits for generated token {n} are not finite (NaN or Inf){at}")


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("the prompt is empty")
        return tokenizer.encode(prompt)
    ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]
    if not ids:
        raise RequestError("the prompt is empty")
    return ids


def stream_generate(model, tokenizer, prompt, max_tokens: int = DEFAULT_MAX_TOKENS, **kwargs):
    """Yield :class:`GenerationResponse` objects as text is produced.

    ``prompt`` is text (encoded with the file's BOS rule) or a list of token ids.
    Keyword arguments go to :func:`generate_step` (``sampler``, ``prefill_step_size``, ...).
    """
    if max_tokens < 1:
        raise RequestError(f"max-tokens must be at least 1, got {max_tokens}")
    ids = _prompt_ids(tokenizer, prompt)
    limit = model.cfg.n_ctx_train
    if len(ids) >= limit:
        raise RequestError(f"the prompt has {len(ids)} tokens; the model's context is {limit}")
    max_tokens = min(max_tokens, limit - len(ids))  # (generate_step checks the ids)
    detok = tokenizer.detokenizer()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_tps = 0.0
    n = 0
    for n, (token, logprobs) in enumerate(
        generate_step(mx.array(ids), model, max_tokens=max_tokens, **kwargs), start=1
    ):
        if n == 1:
            prompt_time = time.perf_counter() - tic
            prompt_tps = len(ids) / prompt_time
            tic = time.perf_counter()
        if token in tokenizer.eos_ids:
            yield GenerationResponse(
                detok.finalize(), token, logprobs, len(ids), prompt_tps, n,
                n / max(time.perf_counter() - tic, 1e-9), mx.get_peak_memory() / 1e9, "stop",
            )
            return
        text = detok.add_token(token)
        if n == max_tokens:
            text += detok.finalize()
        yield GenerationResponse(
            text, token, logprobs, len(ids), prompt_tps, n,
            n / max(time.perf_counter() - tic, 1e-9), mx.get_peak_memory() / 1e9,
            "length" if n == max_tokens else None,
        )


def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """Generate and return the text; with ``verbose``, stream it and print mlx-lm's statistics.
    (The log-probabilities are not read here, so they are not evaluated: ``eval_logprobs``.)"""
    kwargs.setdefault("eval_logprobs", False)
    if verbose:
        print("=" * 10, flush=True)
    text, last = "", None
    try:
        for last in stream_generate(model, tokenizer, prompt, **kwargs):
            text += last.text
            if verbose:
                print(last.text, end="", flush=True)
    finally:
        if verbose:
            _print_stats(model, last)
    return text


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a decode step reads: every parameter except the embedding table."""
    from mlx.utils import tree_flatten

    embd = id(model.token_embd.weight)
    seen, total = set(), 0
    for _, a in tree_flatten(model.parameters()):
        if id(a) not in seen and id(a) != embd:
            seen.add(id(a))
            total += a.nbytes
    if model.cfg.tied_output:  # the tied head reads the whole table
        total += model.token_embd.weight.nbytes
    return total


def _print_stats(model, last: GenerationResponse | None) -> None:
    print()
    print("=" * 10)
    if last is None:
        print("No text generated for this prompt")
        return
    print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
    print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec")
    print(f"Peak memory: {last.peak_memory:.3f} GB")
    gbps = weight_bytes_per_token(model) * last.generation_tps / 1e9
    print(f"Bandwidth achieved: {gbps:.3f} GB/s (weights read per token x generation tokens-per-sec)")
    which = backend()
    launched = variants_launched(which)
    if launched and which == "cuda":  # why a process's first prompt is slow, where it is
        print(kernel_builds_line(launched, cuda_prebuild.enabled(), *cuda_prebuild.counts(),
                                 cuda_prebuild.cache_dir()))
    elif launched:
        print(f"Kernel variants built at their first launch in this process: {launched}")


def kernel_builds_line(launched: int, prebuild: bool, built: int, found: int, cache) -> str:
    """What a CUDA process's kernel variants cost it: NVRTC compiles, MLX's or ours, or none."""
    if not prebuild:
        return (f"Kernel variants built at their first launch in this process: {launched}: NVRTC compiles each, "
                "about a second, in every process, mostly inside the prompt's time (building ahead is off: "
                "MUSE_MLX_CUDA_PREBUILD=0, or it failed and warned why)")
    left = launched - built - found  # variants cuda_prebuild leaves to MLX (shape-reading kernels)
    return (f"Kernel variants launched in this process: {launched}: {found} found built in {cache}, {built} compiled "
            f"ahead into it" + (f", {left} compiled by MLX" if left else ""))


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m muse_mlx.generate",
        description="Generate text from a GGUF checkpoint with muse_mlx.",
    )
    p.add_argument("--model", help="path to a GGUF file (default: the small muse-glimmer model shipped with the package)")
    p.add_argument("--prompt", "-p", default="Hello", help="the prompt; '-' reads it from stdin (default: %(default)s)")
    p.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 is off (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens; 0 is off (default: %(default)s)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p times the best probability (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling, 0 to 2^64-1 (default: none)")
    p.add_argument("--route", default="stock", help="'stock' (MLX's ops) or 'pinned' (reference-order kernels) (default: %(default)s)")
    p.add_argument("--flag", action="append", default=[], dest="flags", metavar="NAME",
                   help="opt-in pinned-route kernel, repeatable: tail_32sg, ffn_4r2s, split_norm_f16, mv_q8, "
                        "mv_q8_q6k (with mv_q8); see docs/kernels.md")
    p.add_argument("--system-prompt", default=None, help="a system message for the chat template")
    p.add_argument("--ignore-chat-template", action="store_true", help="encode the prompt as raw text (with the file's BOS rule)")
    p.add_argument("--prefill-step-size", type=int, default=DEFAULT_PREFILL_STEP, help="prompt tokens per prefill chunk (default: %(default)s)")
    p.add_argument("--prefill", choices=PREFILL_MODES, default="batched",
                   help="'batched': the prompt through matmuls (pinned: exact dequantization + MLX float32 matmul); "
                        "'batched-f16': the same with weights and activations rounded to half (faster, not exact); "
                        "'exact': the route's one-token matvecs for every prompt token (their batch-1 bits; a chunk's "
                        "attention is MLX's) (default: %(default)s)")
    p.add_argument("--no-compile", action="store_true",
                   help="decode without mx.compile (by default the decode step is one compiled graph on a GPU)")
    p.add_argument("--verbose", type=_str2bool, default=True, help="True: stream text and print statistics; False: print only the text (default: True)")
    return p


def _str2bool(s: str) -> bool:
    if s.lower() in ("true", "1", "yes"):
        return True
    if s.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {s!r}")


def build_prompt(tokenizer, prompt: str, system_prompt: str | None, ignore_chat_template: bool) -> list[int]:
    """Token ids for a CLI prompt: rendered through the chat template when the file has one."""
    if not prompt:
        raise RequestError("the prompt is empty")
    if ignore_chat_template or not tokenizer.chat_template:
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": prompt}
    ]
    # The template writes BOS itself, so the rendered text is encoded without special tokens.
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    try:
        return _run(args)
    except MuseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _stdin_text() -> str:
    """The prompt on standard input, decoded as UTF-8 whatever the locale."""
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the prompt on standard input is not valid UTF-8: byte 0x{data[e.start]:02x} "
                           f"at offset {e.start}") from None


def _run(args) -> int:
    from .loader import load
    from .routes import make_route

    sampler = make_sampler(args.temp, args.top_p, args.top_k, args.min_p)
    if args.max_tokens < 1:
        raise RequestError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.prefill_step_size < 1:
        raise RequestError(f"--prefill-step-size must be at least 1, got {args.prefill_step_size}")
    route = make_route(args.route, args.flags)
    prompt = _stdin_text() if args.prompt == "-" else args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    path = args.model
    if path is None:
        from .demo import default_model

        path, note = default_model()
        print(f"[muse_mlx] no --model given: {path} ({note})", file=sys.stderr)
    if args.seed is not None:
        if not 0 <= args.seed < 2**64:
            raise RequestError(f"--seed must be in [0, 2^64), got {args.seed}")
        mx.random.seed(args.seed)
    model, tokenizer = load(path, route=route)
    ids = build_prompt(tokenizer, prompt, args.system_prompt, args.ignore_chat_template)
    try:
        text = generate(model, tokenizer, ids, verbose=args.verbose, max_tokens=args.max_tokens,
                        sampler=sampler, prefill_step_size=args.prefill_step_size, prefill=args.prefill,
                        compiled=False if args.no_compile else None)
    except KeyboardInterrupt:
        print("\n[muse_mlx] interrupted", file=sys.stderr)
        return 130
    if not args.verbose:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
