"""Token samplers over log-probabilities ``[B, vocab]``, in mlx-lm's order: top-p, min-p, top-k."""

from __future__ import annotations

import math

import mlx.core as mx

from .errors import RequestError


def check_sampling(temp: float, top_p: float, top_k: int, min_p: float) -> None:
    """Raise :class:`RequestError` naming the first sampling value that makes no sense."""
    if not isinstance(temp, (int, float)) or math.isnan(temp) or temp < 0 or math.isinf(temp):
        raise RequestError(f"temperature must be a finite number >= 0, got {temp}")
    if math.isnan(top_p) or not 0 < top_p <= 1:
        raise RequestError(f"top-p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise RequestError(f"top-k must be >= 0 (0 = off), got {top_k}")
    if math.isnan(min_p) or not 0 <= min_p <= 1:
        raise RequestError(f"min-p must be in [0, 1], got {min_p}")


def _top_p(logprobs: mx.array, top_p: float) -> mx.array:
    order = mx.argsort(-logprobs, axis=-1)
    sorted_lp = mx.take_along_axis(logprobs, order, axis=-1)
    cum = mx.cumsum(mx.exp(sorted_lp), axis=-1)
    # Keep each token whose preceding mass is below top_p (so the one that crosses stays).
    keep_sorted = (cum - mx.exp(sorted_lp)) < top_p
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, logprobs, -mx.inf)


def _min_p(logprobs: mx.array, min_p: float) -> mx.array:
    threshold = logprobs.max(axis=-1, keepdims=True) + math.log(min_p)
    return mx.where(logprobs >= threshold, logprobs, -mx.inf)


def _top_k(logprobs: mx.array, k: int) -> mx.array:
    if k >= logprobs.shape[-1]:
        return logprobs
    kth = mx.sort(logprobs, axis=-1)[..., -k][..., None]
    return mx.where(logprobs >= kth, logprobs, -mx.inf)


def greedy(logprobs: mx.array) -> mx.array:
    """The greedy sampler: the first index of each row's maximum. Generation recognizes it and takes
    the token from the logits' statistics instead (``muse_mlx.generate.next_token``): the argmax of
    the logits themselves, read in the same pass as their log-sum-exp."""
    return mx.argmax(logprobs, axis=-1)


def make_sampler(temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0):
    """A function ``logprobs [B, V] -> tokens [B]``. ``temp == 0`` is :func:`greedy`."""
    check_sampling(temp, top_p, top_k, min_p)
    if temp == 0:
        return greedy

    def sample(logprobs: mx.array) -> mx.array:
        if 0 < top_p < 1:
            logprobs = _top_p(logprobs, top_p)
        if min_p > 0:
            logprobs = _min_p(logprobs, min_p)
        if top_k > 0:
            logprobs = _top_k(logprobs, top_k)
        return mx.random.categorical(logprobs * (1.0 / temp), axis=-1)

    return sample
