"""Weight-holding modules: a quantized linear map, a quantized embedding table, a norm weight.

They hold arrays in the form the route asked for at load time and do no arithmetic of
their own beyond the embedding gather: every hot op goes through the route
(:mod:`muse_mlx.routes`), the one place where stock and pinned divide.

Forms of a :class:`QLinear` (attribute ``form``):
  * ``"blocks"`` -- ``weight`` is the raw GGUF rows, uint8 ``[out, row_bytes]``;
  * ``"affine"`` -- MLX affine quantization, group 32: ``weight`` (uint32), ``scales``
    and ``biases`` (float32), exact for Q4_K/Q5_K/Q8_0 (see :func:`muse_mlx.quants.to_affine`);
  * ``"affine_hi_lo"`` -- Q6_K as the sum of two MLX affine forms, group 64: ``weight``,
    ``scales``, ``biases`` (8 bits) plus ``weight_lo``, ``scales_lo``, ``biases_lo`` (6 bits),
    exact (see :func:`muse_mlx.quants.to_affine_hi_lo`);
  * ``"q6_K_split"`` -- Q6_K only: the raw rows' bytes rearranged so every block's 208-byte body
    starts on a 16-byte boundary (:func:`muse_mlx.quants.split_q6_K`), for aligned loads: the
    opt-in q8 kernels' Q6_K lanes, and the exact ones where ``kernels.mul_mv.Q6K_SPLIT`` says;
  * ``"q4_K_tiled"`` -- Q4_K only: the raw rows' blocks in tiles of ``tile`` rows (block j of a
    tile's rows one after another: :func:`muse_mlx.quants.tile_q4_K_rows`), for the opt-in q8
    GLU's reads (``MUSE_MLX_Q8_TILE``);
  * ``"dense"``  -- a float matrix ``[out, in]`` (F32/F16/BF16 tensors).
"""

from __future__ import annotations

import operator
from functools import reduce

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGMLQuantizationType as T

from .quants import (FORMATS, HI_LO_GROUP, dequantize, join_q6_K, split_q6_K, tile_q4_K_rows, to_affine,
                     to_affine_hi_lo, untile_q4_K_rows)


# the forms that hold the GGUF blocks' bytes (QLinear.raw_blocks)
RAW_FORMS = ("blocks", "q6_K_split", "q4_K_tiled")


class QLinear(nn.Module):
    """``y = x @ W.T`` for a GGUF weight ``W [out, in]`` (no bias)."""

    tile = 1  # rows a tile ("q4_K_tiled"; 1 for every other form)

    def __init__(self, raw: mx.array, qtype: T, in_features: int, out_features: int, form: str, tile: int = 1):
        super().__init__()
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = out_features
        self.form = form
        if (form == "q4_K_tiled") != (tile != 1):
            raise ValueError(f"a tile of {tile} rows goes with the form q4_K_tiled, not {form!r}")
        if form == "affine":
            ((self.weight, self.scales, self.biases, self.bits),) = _affine_in_chunks(
                raw, qtype, lambda rows, qt: (to_affine(rows, qt),))
            self.group_size = 32
        elif form == "affine_hi_lo":
            hi, lo = _affine_in_chunks(raw, qtype, to_affine_hi_lo)
            self.weight, self.scales, self.biases, self.bits = hi
            self.weight_lo, self.scales_lo, self.biases_lo, self.bits_lo = lo
            self.group_size = HI_LO_GROUP
        elif form == "dense":
            self.weight = mx.view(raw, mx.bfloat16) if qtype == T.BF16 else raw
        elif form == "blocks":
            self.weight = raw
        elif form == "q6_K_split":
            if qtype != T.Q6_K:
                raise ValueError(f"the split form is for Q6_K rows, not {qtype.name}")
            split = split_q6_K(raw)  # numpy rows (the loader's) are split on the host, then moved
            self.weight = mx.array(split) if isinstance(split, np.ndarray) else split
        elif form == "q4_K_tiled":
            if qtype != T.Q4_K:
                raise ValueError(f"the tiled form is for Q4_K rows, not {qtype.name}")
            tiled = tile_q4_K_rows(raw, tile)  # (numpy rows are tiled on the host, then moved)
            self.weight, self.tile = (mx.array(tiled) if isinstance(tiled, np.ndarray) else tiled), tile
        else:
            raise ValueError(f"unknown linear form {form!r}")

    # the forms that hold the same bytes, and so can be turned into each other in place (by way of
    # the raw blocks), per block type
    _REFORMS = {T.Q6_K: {"q6_K_split": (split_q6_K, join_q6_K)},
                T.Q4_K: {"q4_K_tiled": (tile_q4_K_rows, untile_q4_K_rows)}}

    def reform(self, form: str, tile: int = 1) -> None:
        """Hold the weight in ``form`` (with ``tile`` rows a tile, "q4_K_tiled") from now on: raw
        blocks and the split or tiled form turn into each other (the same bytes; while one matrix
        is rearranged, about twice its size more is held)."""
        if form == self.form and tile == self.tile:
            return
        forms = self._REFORMS.get(self.qtype, {})
        if (form != "blocks" and form not in forms) or (self.form != "blocks" and self.form not in forms):
            raise ValueError(f"a {self.qtype.name} weight held as {self.form!r} cannot become {form!r}")
        if (form == "q4_K_tiled") != (tile != 1):
            raise ValueError(f"a tile of {tile} rows goes with the form q4_K_tiled, not {form!r}")
        raw = self.raw_blocks()
        self.weight = raw if form == "blocks" else forms[form][0](raw, *((tile,) if tile != 1 else ()))
        mx.eval(self.weight)
        self.form, self.tile = form, tile

    def raw_blocks(self) -> mx.array:
        """The raw GGUF rows, for the forms that hold them (the split one rejoined, the tiled one untiled)."""
        if self.form == "q6_K_split":
            return join_q6_K(self.weight)
        return untile_q4_K_rows(self.weight, self.tile) if self.form == "q4_K_tiled" else self.weight

    def affine_forms(self) -> list[tuple]:
        """The MLX affine forms ``(w, scales, biases, bits)`` whose sum is the matrix: one for
        "affine", hi then lo for "affine_hi_lo" (all of group ``group_size``)."""
        forms = [(self.weight, self.scales, self.biases, self.bits)]
        if self.form == "affine_hi_lo":
            forms.append((self.weight_lo, self.scales_lo, self.biases_lo, self.bits_lo))
        return forms

    def dequantized(self) -> mx.array:
        """The float32 matrix ``[out, in]`` (built on demand; used by the general stock path and tests)."""
        if self.form in ("affine", "affine_hi_lo"):
            return reduce(operator.add, (mx.dequantize(q, s, b, group_size=self.group_size, bits=bits)
                                         for q, s, b, bits in self.affine_forms()))
        if self.form == "dense":
            return self.weight.astype(mx.float32)
        return dequantize(self.raw_blocks(), self.qtype)

    def _extra_repr(self) -> str:
        tiles = f" of {self.tile} rows" if self.tile != 1 else ""
        return f"{self.in_features} -> {self.out_features}, {self.qtype.name} as {self.form}{tiles}"


def with_tile(form: str, rows: int) -> tuple[str, int]:
    """``(form, tile)`` for a weight of ``rows`` rows that the route asks to hold as ``form``: for
    "q4_K_tiled", ``MUSE_MLX_Q8_TILE``'s rows a tile, or the raw blocks where the rows are not
    whole tiles of it; any other form with tile 1."""
    from .kernels.mul_mv import q8_tile

    tile = q8_tile() if form == "q4_K_tiled" else 1
    return ("blocks", 1) if rows % tile else (form, tile)


def tiles_in_pairs(gate: QLinear, up: QLinear) -> None:
    """A GLU's two weights both in tiles of the same rows, or neither: the q8 GLU reads a tiled
    pair, and a lone tiled weight (its partner of another type) would reach readers of raw rows,
    so it is given its raw rows back."""
    if gate.form == up.form == "q4_K_tiled" and gate.tile == up.tile:
        return
    for w in (gate, up):
        if w.form == "q4_K_tiled":
            w.reform("blocks")


def _affine_in_chunks(raw: mx.array, qtype: T, repack, values_per_chunk: int = 1 << 20):
    """``repack`` (raw rows -> a tuple of MLX affine forms ``(w, scales, biases, bits)``), a few
    rows at a time: unpacking makes ~8 bytes of temporaries per weight, so a whole 19968x6656
    matrix at once would need ~1 GB beside the model; 1M weights at a time keep that under
    ~10 MB. Returns the forms, each joined over the chunks."""
    per_row = raw.shape[1] // FORMATS[qtype].type_size * FORMATS[qtype].block_size
    step = max(1, values_per_chunk // per_row)
    parts = []
    for start in range(0, raw.shape[0], step):
        forms = repack(raw[start : start + step], qtype)
        mx.eval([f[:3] for f in forms])
        parts.append(forms)

    def join(chunks):  # one form's chunks
        arrays = tuple(mx.concatenate([c[i] for c in chunks]) if len(chunks) > 1 else chunks[0][i] for i in range(3))
        return arrays + (chunks[0][3],)

    return tuple(join(chunks) for chunks in zip(*parts))


class QEmbedding(nn.Module):
    """Token embedding over quantized rows: gather the raw rows, then dequantize only those."""

    def __init__(self, raw: mx.array, qtype: T, dim: int):
        super().__init__()
        self.qtype = qtype
        self.dim = dim
        self.weight = raw

    def __call__(self, tokens: mx.array) -> mx.array:
        rows = self.weight[tokens]
        if self.qtype == T.BF16:
            return mx.view(rows, mx.bfloat16).astype(mx.float32)
        return dequantize(rows, self.qtype)


class Norm(nn.Module):
    """An RMSNorm weight and its epsilon; the route computes the norm."""

    def __init__(self, weight: mx.array | None, eps: float):
        super().__init__()
        if weight is not None:
            self.weight = weight
        self.eps = eps

    @property
    def gamma(self) -> mx.array | None:
        return self.get("weight")
