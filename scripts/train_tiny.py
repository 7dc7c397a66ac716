"""Train a small real muse-glimmer model with MLX and export it as GGUF.

    python scripts/train_tiny.py --size cpu --steps 600 --batch 8 --seq 64 --out models/   # a CPU
    python scripts/train_tiny.py --steps 1000 --batch 32 --out models/   # a GPU: the shipped model
    python scripts/train_tiny.py --size small --steps 2000 --batch 32    # a GPU: a larger one

Corpus: the English documentation that ships with every CPython -- the docstrings of the
standard library's modules, classes and functions, and the language reference topics of
``pydoc_data`` (Python Software Foundation License). ``--corpus FILE`` trains on a saved
corpus instead (one document per line-separated block, see ``--save-corpus``), which is how
a run on another machine reproduces this one. Documents are split 95/5 by a hash of their
text into training and held-out sets.

The tokenizer is a byte-level BPE trained with the `tokenizers` library. The model is the
muse-glimmer graph of llama.cpp (sandwich norms with the 1e-8 post-norm epsilon, per-head
QK-norm, the attention output gate, SwiGLU, RoPE on sliding-window layers only, the final
soft-cap of 30) in float32 MLX modules whose parameter names are the GGUF tensor names, so
export is a rename-free call of :func:`muse_mlx.writer.write_gguf`.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muse_mlx.vocab import train_byte_bpe  # noqa: E402
from muse_mlx.writer import Geometry, write_gguf  # noqa: E402

SIZES = {
    # hidden must be a multiple of 256 (K-quant rows); n_ff too (ffn_down's rows)
    "cpu": dict(geometry=Geometry(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64, n_ctx=512,
                                  sliding_window=64, rms_eps=1e-5), vocab=1024),
    "tiny": dict(geometry=Geometry(n_layer=4, n_embd=256, n_ff=768, n_head=4, n_head_kv=2, head_dim=64, n_ctx=1024,
                                   sliding_window=128, rms_eps=1e-5), vocab=2048),
    "small": dict(geometry=Geometry(n_layer=6, n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, head_dim=64, n_ctx=1024,
                                    sliding_window=256, rms_eps=1e-5), vocab=4096),
}
POST_NORM_EPS = 1e-8
SOFTCAP = 30.0


# -- corpus ----------------------------------------------------------------------------------


def stdlib_documents() -> list[str]:
    """Docstrings of the standard library (tests and tools left out) and the reference topics."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip", "pydoc_data")
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in rel for part in skip):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40:
                    docs.append(doc.strip())
    try:
        from pydoc_data.topics import topics

        docs += [topics[k].strip() for k in sorted(topics)]
    except ImportError:
        pass
    seen, out = set(), []
    for d in docs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def split(docs: list[str]) -> tuple[list[str], list[str]]:
    held = [d for d in docs if int(hashlib.sha1(d.encode()).hexdigest(), 16) % 20 == 0]
    train = [d for d in docs if int(hashlib.sha1(d.encode()).hexdigest(), 16) % 20 != 0]
    return train, held


SEP = "\n\n\x1e\n\n"  # between documents in a saved corpus


# -- model -----------------------------------------------------------------------------------


class Norm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = mx.ones((dim,))


class Block(nn.Module):
    def __init__(self, g: Geometry, sliding: bool):
        super().__init__()
        q, kv, D = g.n_head * g.head_dim, g.n_head_kv * g.head_dim, g.n_embd
        self.attn_norm, self.post_attention_norm = Norm(D), Norm(D)
        self.ffn_norm, self.post_ffw_norm = Norm(D), Norm(D)
        self.attn_q_norm, self.attn_k_norm = Norm(g.head_dim), Norm(g.head_dim)
        self.attn_q, self.attn_k, self.attn_v = (nn.Linear(D, q, bias=False), nn.Linear(D, kv, bias=False),
                                                 nn.Linear(D, kv, bias=False))
        self.attn_gate, self.attn_output = nn.Linear(D, q, bias=False), nn.Linear(q, D, bias=False)
        self.ffn_gate, self.ffn_up = nn.Linear(D, g.n_ff, bias=False), nn.Linear(D, g.n_ff, bias=False)
        self.ffn_down = nn.Linear(g.n_ff, D, bias=False)
        self.g, self.sliding = g, sliding

    def __call__(self, h, mask):
        g, eps = self.g, self.g.rms_eps
        B, T, _ = h.shape
        a = mx.fast.rms_norm(h, self.attn_norm.weight, eps)
        q = mx.fast.rms_norm(self.attn_q(a).reshape(B, T, g.n_head, g.head_dim), self.attn_q_norm.weight, eps)
        k = mx.fast.rms_norm(self.attn_k(a).reshape(B, T, g.n_head_kv, g.head_dim), self.attn_k_norm.weight, eps)
        v = self.attn_v(a).reshape(B, T, g.n_head_kv, g.head_dim)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        if self.sliding:  # RoPE on sliding layers only (NoPE on global ones), adjacent pairs
            q = mx.fast.rope(q, g.head_dim, traditional=True, base=g.rope_base, scale=1.0, offset=0)
            k = mx.fast.rope(k, g.head_dim, traditional=True, base=g.rope_base, scale=1.0, offset=0)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(g.head_dim), mask=mask)
        o = o.transpose(0, 2, 1, 3).reshape(B, T, -1) * mx.sigmoid(self.attn_gate(a))
        h = h + mx.fast.rms_norm(self.attn_output(o), self.post_attention_norm.weight, POST_NORM_EPS)
        f = mx.fast.rms_norm(h, self.ffn_norm.weight, eps)
        d = self.ffn_down(nn.silu(self.ffn_gate(f)) * self.ffn_up(f))
        return h + mx.fast.rms_norm(d, self.post_ffw_norm.weight, POST_NORM_EPS)


class TrainModel(nn.Module):
    """muse-glimmer in float32, parameters named like the GGUF tensors (``blk`` = ``blk.N``)."""

    def __init__(self, g: Geometry, vocab: int):
        super().__init__()
        self.g = g
        self.token_embd = nn.Embedding(vocab, g.n_embd)
        swa = [il % 4 < 3 for il in range(g.n_layer)]  # llama.cpp's default period 4
        self.blk = [Block(g, s) for s in swa]
        self.swa = swa
        self.output_norm = Norm(g.n_embd)
        self.output = nn.Linear(g.n_embd, vocab, bias=False)

    def __call__(self, tokens):
        T = tokens.shape[1]
        i, j = mx.arange(T)[:, None], mx.arange(T)[None, :]
        causal = j <= i
        masks = {False: causal, True: causal & ((i - j) < self.g.sliding_window)}
        h = mx.fast.rms_norm(self.token_embd(tokens), None, self.g.rms_eps)
        for block, s in zip(self.blk, self.swa):
            h = block(h, masks[s])
        logits = self.output(mx.fast.rms_norm(h, self.output_norm.weight, self.g.rms_eps))
        return mx.tanh(logits / SOFTCAP) * SOFTCAP

    def gguf_weights(self) -> dict[str, np.ndarray]:
        """``{gguf tensor name: float32 array}`` -- the flattened parameter paths are the names."""
        out = {}
        for path, value in tree_flatten(self.parameters()):
            out[path] = np.array(value, dtype=np.float32)
        return out


# -- training --------------------------------------------------------------------------------


def batches(data: np.ndarray, batch: int, seq: int, rng):
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        x = np.stack([data[s : s + seq + 1] for s in starts])
        yield mx.array(x[:, :-1]), mx.array(x[:, 1:])


def evaluate(model, data: np.ndarray, seq: int, max_windows: int = 64) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping windows of held-out tokens."""
    n = min(max_windows, (len(data) - 1) // seq)
    x = np.stack([data[i * seq : i * seq + seq + 1] for i in range(n)])
    losses = []
    for i in range(0, n, 8):
        xb = mx.array(x[i : i + 8])
        loss = nn.losses.cross_entropy(model(xb[:, :-1]), xb[:, 1:], reduction="mean")
        losses.append(float(loss) * xb.shape[0])
    return sum(losses) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-seconds", type=float, default=None, help="stop training after this long (then export)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", help="train on this saved corpus instead of this Python's standard library")
    ap.add_argument("--save-corpus", help="write the corpus used (documents separated by a record separator)")
    ap.add_argument("--out", default="models", help="folder for the GGUF files, the loss log and the plot")
    ap.add_argument("--name", default="muse-glimmer-tiny-pydoc")
    ap.add_argument("--export-only", action="store_true",
                    help="skip training: write the GGUF files from --out's vocab.json and weights-*.npz")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.export_only:
        g, vocab, weights = load_checkpoint(out)
        export(weights, g, vocab, out, args.name)
        return
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    spec = SIZES[args.size]
    g = spec["geometry"]

    docs = Path(args.corpus).read_text().split(SEP) if args.corpus else stdlib_documents()
    if args.save_corpus:
        Path(args.save_corpus).write_text(SEP.join(docs))
    train_docs, held_docs = split(docs)
    corpus_sha = hashlib.sha256(SEP.join(docs).encode()).hexdigest()
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f} MB, sha256 {corpus_sha[:16]}; "
          f"held out {len(held_docs)}", flush=True)
    t0 = time.time()
    vocab = train_byte_bpe(train_docs, spec["vocab"])
    vocab.chat_template = ""  # a base model: prompts are plain text, not chat turns
    tok = _hf_tokenizer(vocab)
    eot = vocab.eos_id
    encode = lambda texts: np.array([t for d in texts for t in tok.encode(d).ids + [eot]], dtype=np.int32)  # noqa: E731
    train_ids, held_ids = encode(train_docs), encode(held_docs)
    print(f"tokenizer: {len(vocab)} tokens ({time.time() - t0:.0f} s); {len(train_ids)} training tokens, "
          f"{len(held_ids)} held out", flush=True)
    (out / "heldout.txt").write_text("\n\n".join(held_docs))

    model = TrainModel(g, len(vocab))
    for _, p in tree_flatten(model.parameters()):
        mx.eval(p)
    n_params = sum(p.size for _, p in tree_flatten(model.parameters()))
    warmup = min(100, args.steps // 10 + 1)
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-5, args.lr, warmup),
         optim.cosine_decay(args.lr, max(args.steps - warmup, 1), args.lr / 20)], [warmup]
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.05)

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    step = nn.value_and_grad(model, loss_fn)
    log = []
    print(f"model: {n_params / 1e6:.2f}M parameters, {g.n_layer} layers x {g.n_embd}; device {mx.default_device()}",
          flush=True)
    data = batches(train_ids, args.batch, args.seq, rng)
    t0 = time.time()
    for it in range(1, args.steps + 1):
        x, y = next(data)
        loss, grads = step(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        out_of_time = args.max_seconds is not None and time.time() - t0 > args.max_seconds
        if it % 50 == 0 or it == 1 or out_of_time:
            entry = dict(step=it, loss=float(loss), seconds=round(time.time() - t0, 1))
            if it % 200 == 0 or it == args.steps or out_of_time:
                entry["heldout"] = evaluate(model, held_ids, args.seq)
            log.append(entry)
            print(json.dumps(entry), flush=True)
        if out_of_time:
            break
    weights = model.gguf_weights()
    meta = dict(size=args.size, steps=log[-1]["step"], batch=args.batch, seq=args.seq, lr=args.lr, seed=args.seed,
                params=n_params, corpus_sha256=corpus_sha, documents=len(docs), python=platform.python_version(),
                mlx=mx.__version__, device=str(mx.default_device()), train_tokens=int(len(train_ids)),
                heldout_tokens=int(len(held_ids)), geometry=asdict(g), log=log)
    (out / "train_log.json").write_text(json.dumps(meta, indent=1))
    save_checkpoint(out, g, vocab, weights)
    export(weights, g, vocab, out, args.name)
    plot(log, out / "loss.png")


def save_checkpoint(out: Path, g: Geometry, vocab, weights: dict[str, np.ndarray], shard_bytes: int = 8 << 20) -> None:
    """float32 weights in shards of ~8 MB (small enough to travel back from a GPU machine) + the vocabulary."""
    (out / "vocab.json").write_text(json.dumps(dict(geometry=asdict(g), vocab=asdict(vocab))))
    for old in out.glob("weights-*.npz"):
        old.unlink()
    shard, size, n = {}, 0, 0
    for name, value in weights.items():
        shard[name] = value
        size += value.nbytes
        if size >= shard_bytes:
            np.savez(out / f"weights-{n}.npz", **shard)
            shard, size, n = {}, 0, n + 1
    if shard:
        np.savez(out / f"weights-{n}.npz", **shard)


def load_checkpoint(out: Path):
    from muse_mlx.vocab import Vocab

    meta = json.loads((out / "vocab.json").read_text())
    meta["vocab"]["chat_template"] = ""  # a base model (checkpoints written before this rule had one)
    weights = {}
    for path in sorted(out.glob("weights-*.npz"), key=lambda p: int(p.stem.split("-")[1])):
        with np.load(path) as z:
            weights.update({k: z[k] for k in z.files})
    order = list(TrainModel(Geometry(**meta["geometry"]), len(meta["vocab"]["tokens"])).gguf_weights())
    return Geometry(**meta["geometry"]), Vocab(**meta["vocab"]), {k: weights[k] for k in order}


def _hf_tokenizer(vocab):
    """The trained vocabulary as a `tokenizers` object, exactly as muse_mlx reads it from a GGUF."""
    from muse_mlx.tokenizer import _bpe_pre_tokenizer
    from tokenizers import Tokenizer, decoders, models

    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)},
                                   merges=[tuple(m.split(" ")) for m in vocab.merges], ignore_merges=False))
    backend.pre_tokenizer = _bpe_pre_tokenizer(vocab.pre, "train_tiny")
    backend.decoder = decoders.ByteLevel()
    return backend


def export(weights, g: Geometry, vocab, out: Path, name: str) -> None:
    for mix in ("f32", "q4_k_m"):
        path = write_gguf(out / f"{name}-{mix}.gguf", "muse-glimmer", g, weights, vocab, mix, name=name)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", flush=True)


def plot(log, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss plot")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([e["step"] for e in log], [e["loss"] for e in log], label="training batch")
    held = [e for e in log if "heldout" in e]
    ax.plot([e["step"] for e in held], [e["heldout"] for e in held], "o-", label="held out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
