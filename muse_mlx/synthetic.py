"""Synthetic muse-glimmer checkpoints: random but valid blocks at any geometry, streamed to disk.

A decode benchmark needs a FILE of the release geometry (about 16.9 GB in Q4_K_M) that both
this engine and llama.cpp load. Quantizing float weights at that size would take hours, so the
quant fields are random bytes and only the fields that must be sane are set: every block's f16
scales become small positive values, so activations stay finite through 52 layers (the post-norms
bound each residual update). The tensor names, order and types and the metadata are
``writer.write_gguf``'s; the vocabulary is a byte-level BPE of exactly the requested size.

    python -m muse_mlx.synthetic --out muse-glimmer-synthetic.gguf [--small] [--seed N]

The file is written tensor by tensor from one pool of random bytes (drawing one tensor while a
thread writes the last), so memory stays at the pool plus two buffers of the largest tensor
(about 2.5 GB at the release geometry), and it is renamed into place only when complete. The
same parameters always give the same bytes, and they are stored in the file, so
``ensure_synthetic`` can reuse it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import mmap
import os
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from tqdm import tqdm

from . import vocab as vocab_mod
from .errors import MuseError
from .gguf_check import _Cursor, check_gguf
from .quants import FORMATS
from .vocab import Vocab, byte_alphabet
from .writer import MUSE_GLIMMER_30B, QUANT_MIXES, Geometry, _metadata, _tokenizer, tensor_shapes, tensor_type

ARCH = "muse-glimmer"
NAME = "muse-glimmer-synthetic"
PARAMS_KEY = "muse_mlx.synthetic"  # JSON of the parameters; llama.cpp ignores unknown keys
FORMAT_VERSION = 1  # bump when the bytes written for the same parameters change

RELEASE_VOCAB = 202048
# A CPU-sized member of the same shape family (bench.py --small).
SMALL_GEOMETRY = Geometry(
    n_layer=4, n_embd=1024, n_ff=3072, n_head=8, n_head_kv=2, head_dim=128, n_ctx=8192,
    sliding_window=4096, rms_eps=1e-5,
)
SMALL_VOCAB = 32768

POOL_BYTES = 256 << 20  # random bytes drawn once; tensors are windows of it

# Byte ranges of each block's f16 scale fields: Q4_K/Q5_K d and dmin, Q6_K d (after its int8
# sub-scales), Q8_0 d. Every other byte of a block is valid whatever its value.
_SCALE_BYTES = {T.Q4_K: (0, 4), T.Q5_K: (0, 4), T.Q6_K: (208, 210), T.Q8_0: (0, 2)}
SCALE_RANGE = (1e-4, 1e-3)
# Any 16 random bits -> an f16 spread evenly over SCALE_RANGE: one table gather per field.
_SCALE_TABLE = np.linspace(*SCALE_RANGE, 1 << 16).astype(np.float16).view(np.uint16)


# -- the vocabulary ---------------------------------------------------------------------------


# Space and lowercase letters by English frequency, then the rest of printable ASCII, then
# every other byte: the merges of small vocabularies are the ones ASCII text uses.
_FIRST_BYTES = " etaoinshrdlcumwfgypbvkjxqz"


def _byte_order() -> list[int]:
    first = [ord(c) for c in _FIRST_BYTES]
    printable = [b for b in range(0x20, 0x7F) if b not in first]
    return first + printable + [b for b in range(256) if not 0x20 <= b < 0x7F]


def _pairs(chars: list[str]):
    """Every ordered pair of ``chars``, the pairs among the first k characters before any other."""
    for k, c in enumerate(chars):
        yield from (a + " " + c for a in chars[:k])
        yield from (c + " " + b for b in chars[: k + 1])


def synthetic_vocab(size: int) -> Vocab:
    """A gpt2 byte-level BPE of exactly ``size`` tokens: bytes, merged pairs then triples, specials.

    Every merged token comes from one merge listed in rank order ("a b" -> "ab", then "ab c" ->
    "abc"), so any text round-trips; bos/eos/chat template are ``vocab._assemble``'s.
    """
    n_special = len(vocab_mod.SPECIALS)
    n_merges = size - 256 - n_special if isinstance(size, int) else -1
    capacity = 256 * 256 + 256 * 256 * 256
    if not 0 <= n_merges <= capacity:
        raise ValueError(f"size must be an int in [{256 + n_special}, {256 + n_special + capacity}], got {size!r}")
    alphabet = byte_alphabet()
    chars = [alphabet[b] for b in _byte_order()]
    merges = list(itertools.islice(_pairs(chars), n_merges))
    if n_merges > len(merges):  # then each pair, in its rank order, followed by each byte
        triples = (m.replace(" ", "") + " " + c for m in merges for c in chars)
        merges += itertools.islice(triples, n_merges - len(merges))
    v = vocab_mod._assemble(merges)
    if len(v) != size:  # every merge makes a new token; a change to _assemble must not break that
        raise AssertionError(f"synthetic vocabulary has {len(v)} tokens, wanted {size}")
    return v


# -- random blocks ----------------------------------------------------------------------------


def _valid_scales(out: np.ndarray, qtype: T) -> None:
    """Random bytes -> valid blocks: every f16 scale field mapped into SCALE_RANGE (in place)."""
    lo, hi = _SCALE_BYTES[qtype]
    fields = out.reshape(-1, FORMATS[qtype].type_size)[:, lo:hi].view(np.uint16)
    fields[...] = _SCALE_TABLE[fields]


def random_blocks(rows: int, cols: int, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """``[rows, row_bytes]`` uint8 of random valid ``qtype`` blocks, the file's kind of weights,
    for timing and geometry checks that need a matrix but no file."""
    out = rng.integers(0, 256, size=rows * (cols // FORMATS[qtype].block_size) * FORMATS[qtype].type_size,
                       dtype=np.uint8)
    _valid_scales(out, qtype)
    return out.reshape(rows, -1)


class _RandomSource:
    """Seeded random bytes: one pool drawn once, tensors filled from windows at random offsets."""

    def __init__(self, seed: int, pool_bytes: int):
        self.rng = np.random.default_rng(seed)
        self.pool = np.frombuffer(self.rng.bytes(pool_bytes), dtype=np.uint8)

    def fill(self, out: np.ndarray) -> None:
        """Fill the flat uint8 ``out`` with pool windows (a tensor larger than the pool takes several)."""
        n, pos = out.size, 0
        while pos < n:
            take = min(n - pos, self.pool.size)
            start = int(self.rng.integers(0, self.pool.size - take + 1))
            out[pos : pos + take] = self.pool[start : start + take]
            pos += take

    def quantized(self, out: np.ndarray, qtype: T) -> None:
        """Random blocks of ``qtype`` whose f16 scale fields are small, positive and finite."""
        self.fill(out)
        _valid_scales(out, qtype)

    def floats(self, out: np.ndarray, rows: int, cols: int, dtype) -> np.ndarray:
        """A float matrix (the f32/f16 mixes) of uniform values with variance 1/cols, as matvecs want."""
        raw = out[: rows * cols]
        self.fill(raw)
        scale = np.float32(np.sqrt(3.0 / cols) / 128.0)
        values = raw.view(np.int8).astype(np.float32) * scale
        return values.astype(dtype)

    def norm(self, name: str, n: int) -> np.ndarray:
        # muse-glimmer's converter makes q_norm the constant qk_scale_factor and k_norm ones
        # (as writer.random_weights does); other norm weights are near 1.
        if name.endswith("attn_q_norm.weight"):
            return np.full(n, 1.25, dtype=np.float32)
        if name.endswith("attn_k_norm.weight"):
            return np.ones(n, dtype=np.float32)
        return (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32)


# -- the file ---------------------------------------------------------------------------------


class _Background:
    """Writes tensors in order on one thread while the caller draws the next: two buffers take turns.

    numpy releases the GIL while it copies, gathers and writes, so drawing and writing overlap.
    """

    def __init__(self, w: GGUFWriter, largest: int, bar):
        self.w, self.bar, self.error = w, bar, None
        self.free: queue.Queue = queue.Queue()
        for _ in range(2):
            self.free.put(np.empty(largest, dtype=np.uint8))
        self.todo: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="synthetic-writer", daemon=True)
        self.thread.start()

    def buffer(self) -> np.ndarray:
        """A buffer no write is using (waits for one)."""
        return self.free.get()

    def write(self, data: np.ndarray, buffer: np.ndarray | None = None) -> None:
        """Queue ``data`` (a view of ``buffer``, which goes back to the free list once written)."""
        if self.error is not None:
            raise self.error
        self.todo.put((data, buffer))

    def _run(self) -> None:
        while (item := self.todo.get()) is not None:
            data, buffer = item
            if self.error is None:
                try:
                    self.w.write_tensor_data(data)
                    self.bar.update(data.nbytes)
                except BaseException as e:  # handed to the caller; keep draining so it never blocks
                    self.error = e
            if buffer is not None:
                self.free.put(buffer)

    def finish(self, raise_error: bool = True) -> None:
        self.todo.put(None)
        self.thread.join()
        if raise_error and self.error is not None:
            raise self.error


def _check(geometry, vocab_size, mix, seed) -> None:
    if not isinstance(geometry, Geometry):
        raise ValueError(f"geometry must be a muse_mlx.writer.Geometry, got {type(geometry).__name__}")
    for field in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "n_ctx", "sliding_window"):
        value = getattr(geometry, field)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"geometry.{field} must be a positive int, got {value!r}")
    if geometry.n_head % geometry.n_head_kv:
        raise ValueError(f"geometry.n_head ({geometry.n_head}) must be a multiple of n_head_kv ({geometry.n_head_kv})")
    minimum = 256 + len(vocab_mod.SPECIALS)
    if not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ValueError(f"vocab_size must be an int of at least {minimum}, got {vocab_size!r}")
    if mix not in QUANT_MIXES:
        raise ValueError(f"mix must be one of {', '.join(QUANT_MIXES)}, got {mix!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")


def params_json(geometry: Geometry, vocab_size: int, mix: str, seed: int) -> str:
    """What identifies a synthetic file's bytes, as stored under ``muse_mlx.synthetic``."""
    params = {"format": FORMAT_VERSION, "geometry": dataclasses.asdict(geometry),
              "vocab_size": vocab_size, "mix": mix, "seed": seed}
    return json.dumps(params, sort_keys=True)


def _layout(g: Geometry, vocab_size: int, mix: str) -> list[tuple[str, tuple[int, ...], T, int]]:
    """(name, numpy shape, type, bytes) of every tensor, in file order."""
    out = []
    for name, shape in tensor_shapes(ARCH, g, vocab_size).items():
        qtype = tensor_type(name, shape, mix, g.n_layer, tied=False)
        fmt = FORMATS[qtype]
        n = int(np.prod(shape))
        out.append((name, shape, qtype, n // fmt.block_size * fmt.type_size))
    return out


def write_synthetic(path, geometry: Geometry = MUSE_GLIMMER_30B, vocab_size: int = RELEASE_VOCAB,
                    mix: str = "q4_k_m", seed: int = 0, progress: bool = True) -> Path:
    """Stream a random-block muse-glimmer GGUF of ``geometry`` to ``path``; returns the path."""
    _check(geometry, vocab_size, mix, seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    layout = _layout(geometry, vocab_size, mix)
    largest = max(nbytes for *_, nbytes in layout)

    w = GGUFWriter(tmp, ARCH)
    w.add_string("general.name", NAME)
    w.add_string(PARAMS_KEY, params_json(geometry, vocab_size, mix, seed))
    _metadata(w, ARCH, geometry)
    _tokenizer(w, synthetic_vocab(vocab_size))
    # Every tensor's info goes first: the header and tensor table precede all data.
    for name, shape, qtype, nbytes in layout:
        if qtype in (T.F32, T.F16):
            w.add_tensor_info(name, shape, np.float32 if qtype == T.F32 else np.float16, nbytes)
        else:
            w.add_tensor_info(name, (shape[0], nbytes // shape[0]), np.uint8, nbytes, raw_dtype=qtype)

    source = _RandomSource(seed, min(POOL_BYTES, largest))
    bar = tqdm(total=sum(n for *_, n in layout), unit="B", unit_scale=True, desc=f"writing {path.name}",
               disable=not progress, leave=False, file=sys.stderr)
    out = _Background(w, largest, bar)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shape, qtype, nbytes in layout:
            if len(shape) == 1:  # a norm: tensor_type keeps every vector F32
                out.write(source.norm(name, shape[0]))
                continue
            buf = out.buffer()
            if qtype in (T.F32, T.F16):
                out.write(source.floats(buf, shape[0], shape[1], np.float32 if qtype == T.F32 else np.float16), buf)
            else:
                source.quantized(buf[:nbytes], qtype)
                out.write(buf[:nbytes], buf)
        out.finish()
        w.close()
    except BaseException:
        out.finish(raise_error=False)
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    os.replace(tmp, path)  # readers never see a half-written file
    return path


def stored_params(path) -> str | None:
    """The parameters JSON of a file written by ``write_synthetic``, or None for any other GGUF.

    Reads only the leading metadata (where ``write_synthetic`` puts its keys) after the bounded
    structural check, which also finds a truncated file: gguf.GGUFReader takes seconds to parse
    a 202,048-token vocabulary, the check a fraction of one.
    """
    path = Path(path)
    check_gguf(path)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(path, buf)
        c.pos = 4 + 4 + 8  # magic, version, tensor count
        found = {}
        for i in range(min(c.u64("the metadata count"), 3)):  # architecture, name, parameters
            key = c.string(f"the name of metadata entry {i}")
            found[key] = c.value(c.u32(f"the type of '{key}'"), f"metadata '{key}'")
    if found.get("general.name") != NAME or not isinstance(found.get(PARAMS_KEY), str):
        return None
    return found[PARAMS_KEY]


def ensure_synthetic(path, geometry: Geometry = MUSE_GLIMMER_30B, vocab_size: int = RELEASE_VOCAB,
                     mix: str = "q4_k_m", seed: int = 0, progress: bool | None = None) -> Path:
    """Reuse ``path`` if ``write_synthetic`` wrote it with these parameters, else (re)write it.

    A file at ``path`` that is not a synthetic checkpoint is never overwritten (ValueError):
    it may be a real model. ``progress`` None shows a bar when stderr is a terminal.
    """
    progress = sys.stderr.isatty() if progress is None else progress
    _check(geometry, vocab_size, mix, seed)
    path = Path(path)
    want = params_json(geometry, vocab_size, mix, seed)
    if path.exists():
        if not path.is_file():
            raise ValueError(f"path {str(path)!r} exists and is not a file")
        try:
            have = stored_params(path)
        except MuseError as e:
            raise ValueError(f"path {str(path)!r} exists and is not a readable GGUF ({e}); remove it first") from None
        if have is None:
            raise ValueError(f"path {str(path)!r} exists and is not a synthetic checkpoint; refusing to overwrite it")
        if have == want:
            print(f"synthetic: reused {path} ({path.stat().st_size / 1e9:.2f} GB, same parameters)", file=sys.stderr)
            return path
        print(f"synthetic: {path} was written with other parameters; rewriting", file=sys.stderr)
    total = sum(n for *_, n in _layout(geometry, vocab_size, mix))
    print(f"synthetic: writing {path} ({total / 1e9:.2f} GB of tensors, {geometry.n_layer} layers x "
          f"{geometry.n_embd}, vocab {vocab_size}, {mix}, seed {seed})", file=sys.stderr)
    t0 = time.perf_counter()
    write_synthetic(path, geometry, vocab_size, mix, seed, progress)
    dt = time.perf_counter() - t0
    size = path.stat().st_size
    print(f"synthetic: wrote {path}: {size / 1e9:.2f} GB in {dt:.1f} s ({size / 1e6 / dt:.0f} MB/s)", file=sys.stderr)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m muse_mlx.synthetic",
        description="Write (or reuse) a random-block muse-glimmer GGUF in llama.cpp's Q4_K_M mix.",
    )
    ap.add_argument("--out", required=True, type=Path, help="the GGUF file to write, or to reuse if it matches")
    ap.add_argument("--small", action="store_true",
                    help=f"a CPU-sized geometry ({SMALL_GEOMETRY.n_layer} layers x {SMALL_GEOMETRY.n_embd}, "
                         f"vocab {SMALL_VOCAB}) instead of the release one ({MUSE_GLIMMER_30B.n_layer} x "
                         f"{MUSE_GLIMMER_30B.n_embd}, vocab {RELEASE_VOCAB})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random blocks (default 0)")
    args = ap.parse_args(argv)
    g, v = (SMALL_GEOMETRY, SMALL_VOCAB) if args.small else (MUSE_GLIMMER_30B, RELEASE_VOCAB)
    try:
        ensure_synthetic(args.out, g, v, "q4_k_m", args.seed)
    except ValueError as e:
        ap.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
