"""The samplers' draws against a numpy reference of mlx-lm's filters (top-p, then min-p, then top-k)
and the tempered softmax over what they keep."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_logits import lse64

from muse_mlx.sampling import make_sampler

# 12 distinct logits: every filter below cuts a different number of them
LOGITS = np.array([2.0, 1.7, 1.5, 1.1, 0.9, 0.4, 0.1, -0.3, -0.8, -1.4, -2.2, -3.5])
DRAWS = 40_000


def _log_softmax(x: np.ndarray) -> np.ndarray:
    return x - lse64(x[None])[0]


def reference_probs(logits: np.ndarray, temp: float, top_p: float, top_k: int, min_p: float) -> np.ndarray:
    """Each token's probability of being drawn, in float64."""
    lp = _log_softmax(logits)
    keep = np.ones(lp.shape, bool)
    if top_p < 1:  # the smallest prefix (by probability) whose mass reaches top_p
        order = np.argsort(-lp)
        before = np.cumsum(np.exp(lp[order])) - np.exp(lp[order])
        keep[order[before >= top_p]] = False
    if min_p > 0:
        keep &= lp >= lp.max() + np.log(min_p)
    if top_k > 0:
        kept = np.flatnonzero(keep)
        keep[kept[np.argsort(-lp[kept])[top_k:]]] = False
    scaled = np.where(keep, lp / temp, -np.inf)
    p = np.exp(scaled - scaled.max())
    return p / p.sum()


@pytest.mark.parametrize("temp,top_p,top_k,min_p", [
    (1.0, 1.0, 0, 0.0),
    (0.5, 1.0, 0, 0.0),
    (1.6, 1.0, 0, 0.0),
    (1.0, 0.8, 0, 0.0),
    (1.0, 1.0, 5, 0.0),
    (1.0, 1.0, 0, 0.1),
    (0.9, 0.95, 4, 0.18),  # top-p keeps 8 of 12, then min-p 6, then top-k 4
])
def test_draw_frequencies_match_the_tempered_filtered_softmax(temp, top_p, top_k, min_p):
    """40,000 draws in one batch: no token outside the kept set, and each token's count within
    5 binomial standard deviations of its reference expectation."""
    want = reference_probs(LOGITS, temp, top_p, top_k, min_p)
    mx.random.seed(11)
    rows = mx.broadcast_to(mx.array(_log_softmax(LOGITS), mx.float32), (DRAWS, LOGITS.size))
    drawn = np.array(make_sampler(temp, top_p, top_k, min_p)(rows))
    counts = np.bincount(drawn, minlength=LOGITS.size)
    assert counts[want == 0].sum() == 0, (counts, want)
    spread = 5 * np.sqrt(DRAWS * want * (1 - want)) + 1
    assert np.all(np.abs(counts - DRAWS * want) <= spread), (counts, np.round(DRAWS * want))


def test_the_filters_cut_what_the_reference_says():
    """The cases above are not vacuous: each filter leaves the number of tokens stated there."""
    kept = [np.count_nonzero(reference_probs(LOGITS, 1.0, *f)) for f in
            [(0.95, 0, 0.0), (1.0, 0, 0.18), (0.95, 0, 0.18), (0.95, 4, 0.18), (0.8, 0, 0.0), (1.0, 5, 0.0),
             (1.0, 0, 0.1)]]
    assert kept == [8, 6, 6, 4, 5, 5, 8]
