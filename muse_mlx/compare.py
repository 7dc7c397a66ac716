"""``python -m muse_mlx.compare``: how far two numerics differ, graded on the reference engine's contract.

For every route (``stock``, ``pinned``, ``pinned+<flag>...``, and with ``--against llama.cpp``
the comparator itself) the same tokens are run teacher-forced (full logits) and continued
greedily. Every pair is graded as the seeds' parity gate grades it (Ch 12 §12.7): max
|Δ logit| and max |Δ log-softmax| each <= 1e-4, the count of differing logits, the SHA-256
of each route's full logits, and identical greedy tokens. When two of our routes differ, both
are re-run with every intermediate tapped (:mod:`muse_mlx.trace`) and the first op whose
outputs differ is reported -- layer, op, how many elements, by how many ULP.

    python -m muse_mlx.compare --model m.gguf --routes stock,pinned,pinned+tail_32sg --json r.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import MuseError, RequestError, RouteError
from .generate import check_token_ids
from .trace import Trace

CONTRACT = 1e-4  # max |Δ logit| and max |Δ normalized logprob|
DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Numerics are a contract, not a feeling."


@dataclass
class Run:
    """One route's results on the shared tokens."""

    spec: str
    logits: np.ndarray  # [T, vocab] float32, teacher-forced
    greedy: list[int]  # the greedy continuation
    seconds: float
    trace: Trace | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(np.ascontiguousarray(self.logits, dtype="<f4").tobytes()).hexdigest()


@dataclass
class Divergence:
    layer: int
    op: str
    differing: int
    elements: int
    max_ulp: int
    max_abs: float


@dataclass
class PairReport:
    a: str
    b: str
    max_abs_logit: float
    max_abs_logprob: float
    differing_logits: int
    logits: int
    sha_a: str
    sha_b: str
    greedy_diverges_at: int | None  # first index of the continuation where the tokens differ
    passed: bool
    first_divergence: Divergence | None = None
    first_kv_divergence: Divergence | None = None  # the first K or V plane (as stored) that differs
    per_layer: list[tuple[int, float]] = field(default_factory=list)  # max |Δ l_out| per layer


def parse_route(spec: str) -> tuple[str, list[str]]:
    name, *flags = spec.strip().split("+")
    return name, flags


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ULPs between two float arrays of the same dtype (float16 or float32)."""
    if a.dtype == np.float16:
        ia, ib = a.view(np.int16).astype(np.int64), b.view(np.int16).astype(np.int64)
        mask = 0x7FFF
    else:
        ia, ib = a.astype(np.float32).view(np.int32).astype(np.int64), b.astype(np.float32).view(np.int32).astype(np.int64)
        mask = 0x7FFFFFFF
    key = lambda i: np.where(i < 0, -(i & mask) - 1, i)  # noqa: E731  monotone in the float value
    return np.abs(key(ia) - key(ib))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


def greedy_tokens(model, tokens: list[int], n: int) -> list[int]:
    from .generate import generate_step

    if n <= 0:
        return []
    return [t for t, _ in generate_step(mx.array(tokens), model, max_tokens=n)]


KV_DTYPES = {"f16": mx.float16, "f32": mx.float32}


def check_tokens(cfg, tokens: list[int], max_tokens: int = 0) -> None:
    """Raise :class:`RequestError` for an id outside the vocabulary (``generate.check_token_ids``) or
    a run longer than the model's context."""
    check_token_ids(cfg, tokens)
    if len(tokens) + max_tokens > cfg.n_ctx_train:
        raise RequestError(f"{len(tokens)} tokens and {max_tokens} to continue exceed the model's context "
                           f"({cfg.n_ctx_train})")


def run_route(path, spec: str, tokens: list[int], max_tokens: int, trace: bool = False, edit=None,
              kv: str = "f16") -> Run:
    """Load ``path`` on route ``spec`` and run the shared tokens (optionally traced)."""
    from .loader import load_model

    name, flags = parse_route(spec)
    model = load_model(path, name, flags)
    check_tokens(model.cfg, tokens, max_tokens)
    model.kv_dtype = KV_DTYPES[kv]
    t0 = time.perf_counter()
    tr = Trace(edit=edit) if (trace or edit) else None
    if tr is not None:
        with tr:
            logits = model(mx.array([tokens]))[0]
    else:
        logits = model(mx.array([tokens]))[0]
    logits = np.array(logits, dtype=np.float32)
    greedy = greedy_tokens(model, tokens, max_tokens)
    return Run(spec, logits, greedy, time.perf_counter() - t0, tr)


def run_llama_cpp(path, tokens: list[int], max_tokens: int) -> Run:
    """The comparator: llama.cpp (through llama-cpp-python) on the same file and tokens."""
    try:
        import llama_cpp
    except ImportError:
        raise RequestError(
            "--against llama.cpp needs llama-cpp-python: pip install -e \".[llama]\" (compiles llama.cpp, ~10 min)"
        ) from None
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, verbose=False, n_ctx=len(tokens) + max_tokens + 8,
                          flash_attn=False)
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    greedy = []
    for _ in range(max_tokens):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(nxt)
        llm.eval([nxt])
    return Run("llama.cpp", logits, greedy, time.perf_counter() - t0)


def first_divergence(a: Trace, b: Trace, ops=None) -> Divergence | None:
    """The first tapped op (in execution order, among ``ops`` if given) whose outputs differ in any bit."""
    for (la, na, xa), (lb, nb, xb) in zip(a.entries, b.entries):
        if (la, na) != (lb, nb) or xa.shape != xb.shape:
            raise RuntimeError(f"traces are not aligned: {(la, na)} vs {(lb, nb)}")
        if ops is not None and na not in ops:
            continue
        if xa.dtype not in (np.float16, np.float32):
            xa, xb = xa.astype(np.float32), xb.astype(np.float32)
        d = ulp_distance(xa, xb)
        if d.any():
            diff = np.abs(xa.astype(np.float64) - xb.astype(np.float64))
            return Divergence(la, na, int((d > 0).sum()), int(d.size), int(d.max()), float(diff.max()))
    return None


def per_layer_error(a: Trace, b: Trace) -> list[tuple[int, float]]:
    out = []
    for (la, na, xa), (_, _, xb) in zip(a.entries, b.entries):
        if na == "l_out":
            out.append((la, float(np.abs(xa.astype(np.float64) - xb.astype(np.float64)).max())))
    return out


def grade(a: Run, b: Run, tol: float = CONTRACT) -> PairReport:
    """The parity contract for one pair of runs."""
    la, lb = a.logits, b.logits
    max_logit = float(np.abs(la.astype(np.float64) - lb.astype(np.float64)).max())
    max_lp = float(np.abs(_log_softmax(la) - _log_softmax(lb)).max())
    differing = int((la.view(np.uint32) != lb.view(np.uint32)).sum())
    div = next((i for i, (x, y) in enumerate(zip(a.greedy, b.greedy)) if x != y), None)
    passed = max_logit <= tol and max_lp <= tol and div is None
    report = PairReport(a.spec, b.spec, max_logit, max_lp, differing, int(la.size), a.sha256, b.sha256, div, passed)
    if a.trace is not None and b.trace is not None and differing:
        report.first_divergence = first_divergence(a.trace, b.trace)
        report.first_kv_divergence = first_divergence(a.trace, b.trace, ops=("k_cache", "v_cache"))
        report.per_layer = per_layer_error(a.trace, b.trace)
    return report


def compare(path, routes: list[str], tokens: list[int], max_tokens: int = 16, against_llama: bool = False,
            trace: bool = True, kv: str = "f16") -> tuple[list[Run], list[PairReport]]:
    """Run every route, then grade every pair of runs."""
    runs = [run_route(path, spec, tokens, max_tokens, trace, kv=kv) for spec in routes]
    if against_llama:
        runs.append(run_llama_cpp(path, tokens, max_tokens))
    reports = [grade(runs[i], runs[j]) for i in range(len(runs)) for j in range(i + 1, len(runs))]
    return runs, reports


# -- output --------------------------------------------------------------------------------


def print_report(runs: list[Run], reports: list[PairReport], tokens: list[int], model_path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(140, Console().width))
    console.print(f"[bold]{model_path}[/bold]: {len(tokens)} tokens teacher-forced, "
                  f"{len(runs[0].greedy)} greedy; contract: max |Δ logit| and max |Δ logprob| <= {CONTRACT:g}, same greedy tokens")
    t = Table(title="routes")
    for col in ("route", "logits SHA-256", "seconds"):
        t.add_column(col)
    for r in runs:
        t.add_row(r.spec, r.sha256[:32] + "…", f"{r.seconds:.2f}")
    console.print(t)
    t = Table(title="pairs")
    for col in ("a", "b", "max |Δ logit|", "max |Δ logprob|", "differing logits", "greedy diverges at", "verdict"):
        t.add_column(col, justify="right" if col.startswith(("max", "diff", "greedy")) else "left")
    for p in reports:
        verdict = "[green]PASS[/green]" if p.passed else "[red]FAIL[/red]"
        if p.sha_a == p.sha_b:
            verdict += " (same SHA-256)"
        t.add_row(p.a, p.b, f"{p.max_abs_logit:.3e}", f"{p.max_abs_logprob:.3e}", f"{p.differing_logits}/{p.logits}",
                  "-" if p.greedy_diverges_at is None else str(p.greedy_diverges_at), verdict)
    console.print(t)
    for p in reports:
        d = p.first_divergence
        if d is not None:
            where = "before the layers" if d.layer < 0 else f"layer {d.layer}"
            console.print(f"{p.a} vs {p.b}: first difference at {where}, op [bold]{d.op}[/bold]: "
                          f"{d.differing}/{d.elements} elements, up to {d.max_ulp} ULP (max |Δ| {d.max_abs:.3e})")
            kv = p.first_kv_divergence
            if kv is not None:
                console.print(f"    first K/V plane (f16 as stored) that differs: layer {kv.layer} {kv.op}, "
                              f"{kv.differing}/{kv.elements} elements, up to {kv.max_ulp} f16 ULP")


def write_plot(reports: list[PairReport], path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RequestError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(7, 4))
    for p in reports:
        if p.per_layer:
            layers, errs = zip(*p.per_layer)
            ax.semilogy(layers, [max(e, 1e-12) for e in errs], marker="o", label=f"{p.a} vs {p.b}")
    ax.set_xlabel("layer")
    ax.set_ylabel("max |Δ residual stream| after the layer")
    ax.set_title("Error growth through the layers")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report_json(runs, reports, tokens) -> dict:
    return dict(
        tokens=tokens, contract=CONTRACT,
        routes=[dict(route=r.spec, sha256=r.sha256, greedy=r.greedy, seconds=r.seconds) for r in runs],
        pairs=[asdict(p) for p in reports],
    )


def _read_tokens(path: str) -> list[int]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RequestError(f"{path}: cannot read the token ids ({e})") from None
    try:
        data = json.loads(text)
        items = data if isinstance(data, list) else data["tokens"]
    except (json.JSONDecodeError, KeyError, TypeError):
        items = text.replace(",", " ").split()
    try:
        return [int(t) for t in items]
    except ValueError:
        raise RequestError(f"{path}: expected token ids (integers, JSON list or whitespace separated)") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m muse_mlx.compare", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="GGUF file")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="text to encode (with the file's BOS rule); default: a fixed sentence")
    src.add_argument("--tokens-file", default=None, help="token ids (JSON list or whitespace separated)")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens to continue per route (default: %(default)s)")
    ap.add_argument("--routes", default="stock,pinned",
                    help="comma-separated routes; a route may carry pinned flags: pinned+tail_32sg+ffn_4r2s (default: %(default)s)")
    ap.add_argument("--flags", default="", help="comma-separated pinned flags: adds the route pinned+<flags> to --routes")
    ap.add_argument("--against", choices=["llama.cpp"], default=None, help="also grade against llama.cpp (llama-cpp-python)")
    ap.add_argument("--no-trace", action="store_true", help="skip the first-divergence tracing")
    ap.add_argument("--kv", choices=list(KV_DTYPES), default="f16",
                    help="KV plane precision of our routes: f16 as llama.cpp stores them, or f32 (default: %(default)s)")
    ap.add_argument("--json", default=None, help="write the full report as JSON")
    ap.add_argument("--plot", default=None, help="write a PNG of per-layer error growth (needs matplotlib)")
    args = ap.parse_args(argv)
    try:
        routes = [r for r in args.routes.split(",") if r.strip()]
        if args.flags:
            routes.append("+".join(["pinned"] + [f.strip() for f in args.flags.split(",") if f.strip()]))
        if not routes:
            raise RouteError("no routes given")
        if args.max_tokens < 0:
            raise RequestError(f"--max-tokens must be >= 0, got {args.max_tokens}")
        if args.tokens_file:
            tokens = _read_tokens(args.tokens_file)
        else:
            from .gguf_file import GGUFFile
            from .tokenizer import Tokenizer

            if args.prompt == "":
                raise RequestError("the prompt is empty")
            tokens = Tokenizer.from_gguf(GGUFFile(args.model)).encode(args.prompt or DEFAULT_PROMPT)
        if not tokens:
            raise RequestError("no tokens to compare")
        runs, reports = compare(args.model, routes, tokens, args.max_tokens, args.against == "llama.cpp",
                                trace=not args.no_trace, kv=args.kv)
        print_report(runs, reports, tokens, args.model)
        if args.json:
            try:
                Path(args.json).write_text(json.dumps(report_json(runs, reports, tokens), indent=1))
            except OSError as e:
                raise RequestError(f"--json {args.json}: cannot write the report ({e})") from None
        if args.plot:
            write_plot(reports, args.plot)
    except MuseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
