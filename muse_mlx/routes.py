"""The seam: every hot op of the model, on the stock route and on the pinned route, side by side.

Nothing else in the engine branches on the route. A route is chosen at load time
(``muse_mlx.load(path, route=...)``) and decides two things:

* the form each quantized weight is kept in on the device (:meth:`Route.form_for`);
* how each op computes: the standalone norm, the norm tail (post-norm + residual + next
  pre-norm), the matvec, the FFN activation, and the attention output gate.

``stock`` uses MLX's own ops (``mx.fast.rms_norm``, ``mx.quantized_matmul``, ``nn.silu``):
fast, portable, rounded however MLX rounds. ``pinned`` runs custom kernels whose float
operations follow the reference engine (llama.cpp's ggml-metal kernels and the seeds'
Muser kernels) in order; see :mod:`muse_mlx.kernels`.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from gguf import GGMLQuantizationType as T

from .errors import RouteError
from .layers import Norm, QLinear
from .quants import FORMATS

ROUTES = ("stock", "pinned")

# Opt-in fusions of the pinned route, named after the reference engine's kernels.
PINNED_FLAGS = {
    "tail_32sg": "legacy one-token dual-eps tail (rsqrt, serial 32-partial combine): NOT exact vs llama.cpp",
    "ffn_4r2s": "fused Q4_K gate+up+activation kernel (ffn_q4k_gate_up_silu_4r2s): NOT exact vs llama.cpp",
}


class Route:
    """Base: the op set every route implements."""

    name = "?"

    def __init__(self, flags: frozenset[str] = frozenset()):
        self.flags = flags

    def form_for(self, qtype: T) -> str:
        raise NotImplementedError

    def norm(self, x: mx.array, norm: Norm) -> mx.array:
        raise NotImplementedError

    def residual_norm(self, hidden: mx.array, src: mx.array, post: Norm | None, nxt: Norm):
        """``hidden += post(src)`` (or ``+= src`` without a post norm); return ``(hidden, nxt(hidden))``."""
        raise NotImplementedError

    def linear(self, x: mx.array, w: QLinear) -> mx.array:
        raise NotImplementedError

    def glu(self, gate: mx.array, up: mx.array, activation: str) -> mx.array:
        raise NotImplementedError

    def ffn_gate_up(self, x: mx.array, gate: QLinear, up: QLinear, activation: str) -> mx.array:
        # llama.cpp's build_ffn computes up first, then gate, then the GLU.
        u = self.linear(x, up)
        g = self.linear(x, gate)
        return self.glu(g, u, activation)

    def attn_gate(self, o: mx.array, g: mx.array) -> mx.array:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name + (f" (+{', '.join(sorted(self.flags))})" if self.flags else "")


class StockRoute(Route):
    """MLX's own ops."""

    name = "stock"

    def form_for(self, qtype: T) -> str:
        if qtype in (T.F32, T.F16, T.BF16):
            return "dense"
        # Q6_K has no MLX mode (group 16): it stays raw and is dequantized per call, exactly.
        return "affine" if FORMATS[qtype].affine_bits else "blocks"

    def norm(self, x, norm):
        return mx.fast.rms_norm(x, norm.gamma, norm.eps)

    def residual_norm(self, hidden, src, post, nxt):
        hidden = hidden + (src if post is None else mx.fast.rms_norm(src, post.gamma, post.eps))
        return hidden, mx.fast.rms_norm(hidden, nxt.gamma, nxt.eps)

    def linear(self, x, w):
        if w.form == "affine":
            return mx.quantized_matmul(
                x, w.weight, w.scales, w.biases, transpose=True, group_size=32, bits=w.bits
            )
        return x @ w.dequantized().T

    def glu(self, gate, up, activation):
        act = nn.silu(gate) if activation == "silu" else nn.gelu_approx(gate)
        return act * up

    def attn_gate(self, o, g):
        return o * mx.sigmoid(g)


class PinnedRoute(Route):
    """Custom kernels in the reference engine's float-operation order (issue: pinned kernels)."""

    name = "pinned"

    def __init__(self, flags=frozenset()):
        raise RouteError("the pinned route is not yet available in this build; use route='stock'")


def make_route(name: str = "stock", flags=()) -> Route:
    """Build a route by name, checking its flags."""
    flags = frozenset(flags or ())
    if name not in ROUTES:
        raise RouteError(f"unknown route '{name}' (choose from: {', '.join(ROUTES)})")
    unknown = flags - set(PINNED_FLAGS)
    if unknown:
        raise RouteError(
            f"unknown flag(s) {', '.join(sorted(unknown))} (pinned-route flags: {', '.join(PINNED_FLAGS)})"
        )
    if name == "stock":
        if flags:
            raise RouteError(f"flag(s) {', '.join(sorted(flags))} apply only to the pinned route")
        return StockRoute()
    return PinnedRoute(flags)
