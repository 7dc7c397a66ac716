"""Named taps on the model's intermediates, for tracing where two numerics part ways.

The model calls :func:`tap` at every step of the graph (names follow llama.cpp's ``cb()``
names where they exist: ``attn_norm``, ``Qcur_normed``, ``attn_out``, ``ffn_inp``,
``ffn_out``, ``l_out``, ...). Outside a :class:`Trace` a tap returns its input and costs
nothing. Inside one, every tapped array is recorded in execution order, and a tracer may
also replace the value -- which is how the tests perturb one element of one K plane.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

_ACTIVE: contextvars.ContextVar["Trace | None"] = contextvars.ContextVar("muse_trace", default=None)


def tracing() -> bool:
    """Whether a trace is active (a fused path that would hide a traced value steps aside then)."""
    return _ACTIVE.get() is not None


def tap(name: str, x: mx.array, layer: int = -1) -> mx.array:
    """Record ``x`` under ``name`` (and ``layer``) if a trace is active; return the value to use."""
    trace = _ACTIVE.get()
    if trace is None:
        return x
    return trace.record(name, layer, x)


@dataclass
class Trace:
    """Collects ``(layer, name, value)`` in execution order while active (``with Trace() as t``).

    ``edit(name, layer, x) -> x`` may return a changed array to inject a perturbation.
    """

    edit: Callable | None = None
    entries: list[tuple[int, str, np.ndarray]] = field(default_factory=list)

    def record(self, name: str, layer: int, x: mx.array) -> mx.array:
        if self.edit is not None:
            x = self.edit(name, layer, x)
        self.entries.append((layer, name, np.array(x)))
        return x

    def __enter__(self) -> "Trace":
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._token)

    def keys(self) -> list[tuple[int, str]]:
        return [(layer, name) for layer, name, _ in self.entries]


def first_nonfinite(model, tokens: list[int]) -> tuple[int, str] | None:
    """Re-run ``tokens`` with every op tapped; the first ``(layer, op)`` holding NaN or Inf."""
    with Trace() as t:
        model(mx.array([tokens]))
    for layer, name, value in t.entries:
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            return layer, name
    return None
