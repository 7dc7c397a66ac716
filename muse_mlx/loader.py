"""``muse_mlx.load``: a GGUF file -> (model, tokenizer), weights kept quantized on the device.

Tensors are copied from the memory-mapped file one at a time and evaluated at once, so
the peak is the model plus one tensor's temporaries, never two copies of the file
(the mapping is page cache, which the OS reclaims). Every tensor is checked against the
shape the configuration implies before anything is allocated for it.
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T
from tqdm import tqdm

from .config import ModelConfig
from .errors import ModelConfigError
from .gguf_file import GGUFFile
from .kernels.backend import in_device_memory
from .layers import Norm, QEmbedding, QLinear, tiles_in_pairs, with_tile
from .model import Model
from .quants import FORMATS, QUANTIZED
from .routes import Route, make_route
from .tokenizer import Tokenizer

# Progress is shown for files at least this large (or when asked).
PROGRESS_MIN_BYTES = 256 << 20


class _Weights:
    """Reads tensors from an open GGUF file, checking shape, type and values."""

    def __init__(self, f: GGUFFile, route: Route, progress: bool | None):
        self.f = f
        self.route = route
        self.used: set[str] = set()
        total = sum(t.n_bytes for t in f.tensors.values())
        show = progress if progress is not None else (total >= PROGRESS_MIN_BYTES and sys.stderr.isatty())
        self.bar = tqdm(
            total=total, unit="B", unit_scale=True, desc=f"loading {f.path.name}", disable=not show, leave=False
        )

    def _raw(self, name: str, shape: tuple[int, ...]):
        self.f.expect_shape(name, shape)
        t = self.f.tensor(name)
        self.used.add(name)
        self.bar.update(t.n_bytes)
        return t, T(t.tensor_type)

    def norm(self, name: str, dim: int, eps: float) -> Norm:
        t, qtype = self._raw(name, (dim,))
        if qtype in QUANTIZED:
            raise ModelConfigError(self.f.path, f"norm tensor '{name}' is {qtype.name}; norms must be F32/F16/BF16")
        w = np.asarray(t.data)
        w = w.view(np.uint16).astype(np.uint32) << 16 if qtype == T.BF16 else w
        w = w.view(np.float32) if qtype == T.BF16 else w.astype(np.float32)
        if not np.isfinite(w).all():
            bad = int(np.flatnonzero(~np.isfinite(w))[0])
            raise ModelConfigError(self.f.path, f"norm tensor '{name}' holds a non-finite value at index {bad} ({w[bad]})")
        arr = mx.array(w.reshape(dim))
        mx.eval(arr)
        return Norm(arr, eps)

    def _host(self, t) -> np.ndarray:
        data = np.asarray(t.data)
        self._check_finite(t.name, data, T(t.tensor_type))
        return data

    def _device(self, t) -> mx.array:
        arr = mx.array(self._host(t))
        mx.eval(arr)
        return arr

    def _check_finite(self, name: str, data: np.ndarray, qtype: T) -> None:
        """No NaN/Inf scales or weights: they would turn every logit into NaN, far from here."""
        rows = data.reshape(data.shape[0], -1) if data.ndim > 1 else data.reshape(1, -1)
        step = max(1, (1 << 24) // max(rows.shape[1], 1))  # bounded temporaries on big tensors
        for start in range(0, rows.shape[0], step):
            part = rows[start : start + step]
            values = _scale_fields(part, qtype)
            if not np.isfinite(values).all():
                bad = np.argwhere(~np.isfinite(values))[0]
                what = "scale" if qtype in QUANTIZED else "value"
                raise ModelConfigError(
                    self.f.path, f"tensor '{name}' holds a non-finite {what} in row {start + int(bad[0])}"
                )

    def linear(self, name: str, out_features: int, in_features: int) -> QLinear:
        t, qtype = self._raw(name, (out_features, in_features))
        fmt = FORMATS[qtype]
        if in_features % fmt.block_size:
            raise ModelConfigError(self.f.path, f"tensor '{name}' rows ({in_features}) are not whole {fmt.name} blocks")
        form, tile = with_tile(self.route.form_for(qtype, name.rsplit(".", 2)[-2] if name.count(".") >= 2 else None),
                               out_features)
        # the split form is made on the host: made on the device, the raw rows would be held beside
        # it for a while (2.2 GB more at the release head's load, seen on the H200); the tiled form,
        # of a GLU's 75 MB matrices, on the device (on the host it took 0.17 s a matrix, 18 s a load)
        raw = self._host(t) if form == "q6_K_split" else self._device(t)
        lin = QLinear(raw, qtype, in_features, out_features, form, tile)
        mx.eval(lin.parameters())
        return lin

    def embedding(self, name: str, vocab: int, dim: int):
        t, qtype = self._raw(name, (vocab, dim))
        raw = in_device_memory(self._device(t))  # read a row per token: see in_device_memory
        return raw, qtype, QEmbedding(raw, qtype, dim)

    def vector(self, name: str, n: int) -> mx.array:
        t, qtype = self._raw(name, (n,))
        if qtype != T.F32:
            raise ModelConfigError(self.f.path, f"tensor '{name}' must be F32, got {qtype.name}")
        return self._device(t)

    def finish(self) -> None:
        self.bar.close()
        unused = sorted(set(self.f.tensors) - self.used)
        if unused:
            shown = ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else "")
            raise ModelConfigError(
                self.f.path,
                f"{len(unused)} tensor(s) this engine would ignore (refusing to run a different graph): {shown}",
            )


# where each block keeps its f16 scales: d (and dmin) at the start, Q6_K's d at the end
_SCALE_OFFSETS = {T.Q8_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def _scale_fields(rows: np.ndarray, qtype: T) -> np.ndarray:
    """The float values a finiteness check must see: each block's f16 scales, or the floats themselves."""
    if qtype in _SCALE_OFFSETS:
        blocks = rows.reshape(rows.shape[0], -1, FORMATS[qtype].type_size)
        return np.stack([blocks[..., o : o + 2].copy().view(np.float16)[..., 0] for o in _SCALE_OFFSETS[qtype]], axis=-1)
    if qtype == T.BF16:
        return (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return rows


def load_model(path, route: str | Route = "stock", flags=(), progress: bool | None = None) -> Model:
    """Load the model of a GGUF file on the given route (``"stock"`` or ``"pinned"``)."""
    f = path if isinstance(path, GGUFFile) else GGUFFile(path)
    cfg = ModelConfig.from_gguf(f)
    r = route if isinstance(route, Route) else make_route(route, flags)
    w = _Weights(f, r, progress)
    model = Model(cfg, r)
    D, H = cfg.n_embd, cfg.head_dim
    raw_embd, embd_type, model.token_embd = w.embedding("token_embd.weight", cfg.vocab_size, D)
    for i, blk in enumerate(model.blk):
        p = f"blk.{i}."
        blk.attn_norm = w.norm(p + "attn_norm.weight", D, cfg.rms_eps)
        blk.attn_q = w.linear(p + "attn_q.weight", cfg.q_width, D)
        blk.attn_k = w.linear(p + "attn_k.weight", cfg.kv_width, D)
        blk.attn_v = w.linear(p + "attn_v.weight", cfg.kv_width, D)
        blk.attn_output = w.linear(p + "attn_output.weight", D, cfg.q_width)
        if cfg.attn_gate:
            blk.attn_gate = w.linear(p + "attn_gate.weight", cfg.q_width, D)
        if cfg.qk_norm:
            blk.attn_q_norm = w.norm(p + "attn_q_norm.weight", H, cfg.rms_eps)
            blk.attn_k_norm = w.norm(p + "attn_k_norm.weight", H, cfg.rms_eps)
        if cfg.post_norm_eps is not None:
            blk.post_attention_norm = w.norm(p + "post_attention_norm.weight", D, cfg.post_norm_eps)
            blk.post_ffw_norm = w.norm(p + "post_ffw_norm.weight", D, cfg.post_norm_eps)
        blk.ffn_norm = w.norm(p + "ffn_norm.weight", D, cfg.rms_eps)
        blk.ffn_gate = w.linear(p + "ffn_gate.weight", cfg.n_ff, D)
        blk.ffn_up = w.linear(p + "ffn_up.weight", cfg.n_ff, D)
        tiles_in_pairs(blk.ffn_gate, blk.ffn_up)
        blk.ffn_down = w.linear(p + "ffn_down.weight", D, cfg.n_ff)
    if cfg.rope_freq_factors:
        factors = w.vector("rope_freqs.weight", cfg.rope_dims // 2)
        # llama.cpp divides theta by the factor: theta = pos * base^(-2i/d) / factor.
        exps = mx.arange(0, cfg.rope_dims, 2, dtype=mx.float32) / cfg.rope_dims
        freqs = mx.power(mx.array(cfg.rope_base, dtype=mx.float32), exps) * factors
        for blk in model.blk:
            blk.rope_freqs = freqs
    model.output_norm = w.norm("output_norm.weight", D, cfg.rms_eps)
    if cfg.tied_output:
        form = r.form_for(embd_type)
        # the embedding reads the same table as blocks: a split head would be a second copy
        model.output = QLinear(raw_embd, embd_type, D, cfg.vocab_size, "blocks" if form == "q6_K_split" else form)
    else:
        model.output = w.linear("output.weight", cfg.vocab_size, D)
    mx.eval(model.parameters())
    w.finish()
    return model


def load(path: str | os.PathLike, route: str | Route = "stock", flags=(), progress: bool | None = None):
    """Load ``(model, tokenizer)`` from a GGUF file.

    ``route`` is ``"stock"`` (MLX's ops) or ``"pinned"`` (reference-order kernels);
    ``flags`` switches on the pinned route's opt-in fusions. Raises a
    :class:`~muse_mlx.errors.MuseError` naming the file and the problem on bad input.
    """
    f = GGUFFile(path)
    tokenizer = Tokenizer.from_gguf(f)  # first: a missing tokenizer fails before the weights load
    return load_model(f, route, flags, progress), tokenizer
