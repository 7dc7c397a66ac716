"""Decode and prefill speed of a Muse Glimmer checkpoint, per route and flag set, beside the roofline.

    python scripts/bench.py [--file PATH] [--small] [--routes pinned,stock] [--json out.json]

Makes (or reuses) a synthetic checkpoint FILE of the release geometry (52 layers x 6,656,
FFN 19,968, 32x128 query heads, 2 KV heads, vocabulary 202,048, llama.cpp's Q4_K_M mix,
random but valid blocks: ``muse_mlx.synthetic``), loads it per route and reports:

* decode tokens/s at context 128 and 4,096 (median of ``--runs`` timed runs after a warm-up),
  and the effective weight bandwidth (weight bytes read per token x tokens/s) as a fraction of
  this device's copy bandwidth, which the script measures first;
* prefill tokens/s for a 512-token prompt (batched prefill);
* per-kernel time and bandwidth of the big matvecs (6656->19968, 19968->6656, 6656->4096,
  the vocabulary head), stock vs pinned;
* peak device memory vs file size, and dispatches per decoded token.

The same script runs on Metal, on CUDA, and (``--small``: a 4-layer geometry of the same shape
family) on a CPU. ``--thin`` keeps the release geometry's 52 layers and attention heads but makes
the matrices narrow (a 512-wide residual stream, FFN 1,024, vocabulary 4,096): each token launches
the same kernels as the release model's, with almost no work in them, so its decode rate
approximates the host's own ceiling for that many MLX primitives per token (it commits fewer
CUDA graphs per token than the release model, whose weights pass MLX's size limit per graph).
For decode at context 4,096 the caches are filled with random f16 values rather than pre-filled,
since decode speed does not depend on what the planes hold.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as T  # noqa: E402

from muse_mlx import kernels as K  # noqa: E402
from muse_mlx import load_model, synthetic  # noqa: E402
from muse_mlx.decode import DecodeStep  # noqa: E402
from muse_mlx.generate import batched_prefill, next_token, weight_bytes_per_token  # noqa: E402
from muse_mlx.layers import QLinear  # noqa: E402
from muse_mlx.quants import split_q6_K  # noqa: E402
from muse_mlx.routes import FLAG_NEEDS, PINNED_FLAGS, StockRoute  # noqa: E402
from muse_mlx.synthetic import RELEASE_VOCAB, SMALL_GEOMETRY, SMALL_VOCAB, ensure_synthetic  # noqa: E402
from muse_mlx.writer import MUSE_GLIMMER_30B, Geometry  # noqa: E402

from environment import (FORM_SWITCHES, describe_settings, env, env_settings, sets_form_switch,  # noqa: E402
                         setting_dict, settings_in_effect)

THIN_GEOMETRY = Geometry(n_layer=52, n_embd=512, n_ff=1024, n_head=32, n_head_kv=2, head_dim=128, n_ctx=8192,
                         sliding_window=4096, rms_eps=1e-5)
THIN_VOCAB = 4096
TINY_GEOMETRY = Geometry(n_layer=4, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64, n_ctx=1024,
                         sliding_window=8, rms_eps=1e-5)

# llama.cpp's own CUDA build on this H200 (commit 0c1e570; the measurements)
LLAMA_CPP_H200 = {"decode_fa": 92.7, "decode_no_fa": 85.7, "prefill_512": 2900.0}


def log(*a):
    print(*a, flush=True)


# -- the device's own ceiling -------------------------------------------------------------


def _seconds_per_rep(run, reps: int = 8) -> float:
    """Best of 5 timings of ``run(reps)`` (which evaluates ``reps`` passes), per pass."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        run(reps)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def memory_bandwidths(n_bytes: int) -> tuple[float, float]:
    """Bytes per second over one array of ``n_bytes``: read + written by a chain of plain copies
    (``a + 0``), and read by sums (nothing written but a scalar). On the H200 a stream that only
    reads goes faster than the copies count (the split Q6_K head read 4.06 TB/s where the copy gave
    3.62-3.74; docs/performance-history.md, thirty-first session)."""
    a = mx.random.uniform(shape=(n_bytes // 4,))
    mx.eval(a)

    def copies(reps):
        b, outs = a, []
        for _ in range(reps):
            b = b + 0.0
            outs.append(b)
        mx.eval(outs)

    copy = 2 * a.nbytes / _seconds_per_rep(copies)
    read = a.nbytes / _seconds_per_rep(lambda reps: mx.eval([mx.sum(a) for _ in range(reps)]))
    return copy, read


# -- per-kernel timings --------------------------------------------------------------------


def random_blocks(rows: int, k: int, qtype: T, rng) -> mx.array:
    """Valid raw blocks on the device (``muse_mlx.synthetic.random_blocks``)."""
    out = mx.array(synthetic.random_blocks(rows, k, qtype, rng))
    mx.eval(out)
    return out


def time_calls(fn, args: list, calls: int) -> float:
    """Device seconds per call: ``fn(*args)`` makes ``calls`` independent calls, replayed as one
    compiled graph (as :func:`time_op`); median of 5."""
    f = mx.compile(fn)
    mx.eval(args, f(*args))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        mx.eval(f(*args))
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def time_op(fn, reps: int, width: int, inputs: list | None = None) -> float:
    """Device seconds per call of ``fn(y)``: ``reps`` calls on distinct activation rows (so that
    nothing is merged) replayed as one compiled graph -- Python's per-call cost, which would
    otherwise dominate a 30-microsecond kernel, is paid once at the trace. Median of 5.
    ``inputs``: the distinct arguments themselves (for an op whose input is not an activation
    row, e.g. a matrix to dequantize: calls on one array would be merged into one)."""
    ys = inputs if inputs is not None else [mx.random.normal((1, width)) for _ in range(reps)]
    f = mx.compile(lambda *a: [fn(y) for y in a])
    mx.eval(ys, f(*ys))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        mx.eval(f(*ys))
        times.append((time.perf_counter() - t0) / len(ys))
    return statistics.median(times)


MATVECS = [  # (label, rows, cols) at the release geometry
    ("ffn_gate/up 6656->19968", 19968, 6656),
    ("ffn_down 19968->6656", 6656, 19968),
    ("attn_q 6656->4096", 4096, 6656),
    ("head 6656->202048", 202048, 6656),
]


def kernel_table(g, vocab: int, reps: int, rng) -> list[dict]:
    rows = []
    stock = StockRoute()
    scale = g.n_embd / MUSE_GLIMMER_30B.n_embd
    shapes = MATVECS if scale == 1 else [
        ("ffn_gate/up", g.n_ff, g.n_embd), ("ffn_down", g.n_embd, g.n_ff), ("attn_q", g.n_head * g.head_dim, g.n_embd),
        ("head", vocab, g.n_embd)]
    for label, R, Kc in shapes:
        for qtype in (T.Q4_K, T.Q6_K):
            if label.startswith("head") and qtype == T.Q4_K:
                continue  # the head is Q6_K in Q4_K_M
            w = random_blocks(R, Kc, qtype, rng)
            kind = "q4_K" if qtype == T.Q4_K else "q6_K"
            head = label.startswith("head")  # the head has a tuned geometry of its own
            fn = K.mul_mv_q4_K if qtype == T.Q4_K else functools.partial(K.mul_mv_q6_K, head=head)
            single = "q4_K single" if kind == "q4_K" else ("q6_K head" if head else kind)  # the call's own geometry
            variants = [(f"pinned mul_mv_{kind} (tuned {K.mul_mv.mv_geometry('tuned', K.backend(), single)})",
                         lambda y: fn(y, w), w.nbytes)]
            variants.append((f"pinned mul_mv_{kind} (ggml 2x2)", lambda y: fn(y, w, geometry="ggml"), w.nbytes))
            if qtype == T.Q4_K:
                variants.append(("pinned mul_mv_q4_K_q8 (opt-in mv_q8)", lambda y: K.mul_mv_q8(y, [(w, "q4_K")]), w.nbytes))
            # the stock route's own op on its own form of the matrix (Q4_K: the affine repack with
            # float32 scales; Q6_K: the hi/lo pair, two quantized_matmuls and an add)
            lin = QLinear(w, qtype, Kc, R, stock.form_for(qtype))
            mx.eval(lin.parameters())
            variants.append(("stock quantized_matmul (affine, f32 scales)" if qtype == T.Q4_K
                             else "stock quantized_matmul x2 (Q6_K hi + lo)",
                             lambda y, lin=lin: stock.linear(y, lin), sum(a.nbytes for f in lin.affine_forms() for a in f[:3])))
            if label.startswith("ffn_gate") and qtype == T.Q4_K:
                w2 = random_blocks(R, Kc, qtype, rng)
                variants.append(("pinned mul_mv_glu (gate+up+silu)", lambda y: K.mul_mv_glu(y, w, w2, kind, "silu"),
                                 2 * w.nbytes))
                variants.append(("pinned mul_mv_q4_K_q8 glu (opt-in mv_q8)",
                                 lambda y: K.mul_mv_q8(y, [(w, kind), (w2, kind)], glu="silu"), 2 * w.nbytes))
            for name, f, nbytes in variants:
                t = time_op(f, reps if R * Kc < 5e8 else max(2, reps // 4), Kc)
                rows.append(dict(op=name, shape=f"{R}x{Kc}", label=label, qtype=kind, us=t * 1e6, gbps=nbytes / t / 1e9))
                log(f"  {name:52} {label:26} {kind}  {t * 1e6:9.1f} us  {nbytes / t / 1e9:7.0f} GB/s")
            w = None  # the matrix is freed before the next is made (the lambdas that read it have run)
    # the four projections of one layer in one dispatch (q, k, v, gate)
    D, q, kv = g.n_embd, g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    ws = [(random_blocks(q, D, T.Q4_K, rng), "q4_K"), (random_blocks(kv, D, T.Q4_K, rng), "q4_K"),
          (random_blocks(kv, D, T.Q6_K, rng), "q6_K"), (random_blocks(q, D, T.Q4_K, rng), "q4_K")]
    nbytes = sum(w.nbytes for w, _ in ws)
    t = time_op(lambda y: K.mul_mv_multi(y, ws), reps, D)
    rows.append(dict(op="pinned mul_mv_multi (q,k,v,gate)", shape=f"{2 * q + 2 * kv}x{D}", label="qkvg", qtype="mix",
                     us=t * 1e6, gbps=nbytes / t / 1e9))
    log(f"  {'pinned mul_mv_multi (q,k,v,gate)':52} {'qkvg':26} mix   {t * 1e6:9.1f} us  {nbytes / t / 1e9:7.0f} GB/s")
    t = time_op(lambda y: mx.concatenate([K.mul_mv_q4_K(y, ws[0][0]), K.mul_mv_q4_K(y, ws[1][0]),
                                          K.mul_mv_q6_K(y, ws[2][0]), K.mul_mv_q4_K(y, ws[3][0])], -1), reps, D)
    rows.append(dict(op="pinned 4 single matvecs (q,k,v,gate)", shape=f"{2 * q + 2 * kv}x{D}", label="qkvg",
                     qtype="mix", us=t * 1e6, gbps=nbytes / t / 1e9))
    log(f"  {'pinned 4 single matvecs (q,k,v,gate)':52} {'qkvg':26} mix   {t * 1e6:9.1f} us  {nbytes / t / 1e9:7.0f} GB/s")
    t = time_op(lambda y: K.mul_mv_q8(y, ws), reps, D)
    rows.append(dict(op="pinned mul_mv_q4_K_q8 multi (opt-in mv_q8)", shape=f"{2 * q + 2 * kv}x{D}", label="qkvg",
                     qtype="mix", us=t * 1e6, gbps=nbytes / t / 1e9))
    log(f"  {'pinned mul_mv_q4_K_q8 multi (opt-in mv_q8)':52} {'qkvg':26} mix   {t * 1e6:9.1f} us  {nbytes / t / 1e9:7.0f} GB/s")
    return rows


SWEEP = ("2x2", "1x4", "2x4", "4x2", "4x4", "2x8", "1x8", "2x2x2", "2x4x2", "4x2x2", "1x4x2", "1x8x2",
         "2x2x1x1", "2x4x1x1", "2x2x1x2")
Q8_SWEEP = ("2x4", "4x4", "4x8", "2x8", "8x4", "1x8", "8x8", "4x2")


def geometry_sweep(reps: int, rng) -> list[dict]:
    """The matvec kernels at every launch geometry in SWEEP (the same bits; only speed differs)."""
    rows = []
    for label, R, Kc in MATVECS:
        for qtype in (T.Q4_K, T.Q6_K):
            if label.startswith("head") and qtype == T.Q4_K:
                continue
            w = random_blocks(R, Kc, qtype, rng)
            fn = K.mul_mv_q4_K if qtype == T.Q4_K else K.mul_mv_q6_K
            line = []
            n = reps if R < 100000 else max(2, reps // 4)
            for geometry in SWEEP:
                t = time_op(lambda y: fn(y, w, geometry=geometry), n, Kc)
                rows.append(dict(label=label, qtype=qtype.name, geometry=geometry, us=t * 1e6, gbps=w.nbytes / t / 1e9))
                line.append(f"{geometry} {w.nbytes / t / 1e9:5.0f}")
            log(f"  {label:26} {qtype.name}: " + "  ".join(line) + "  (GB/s)")
            if qtype == T.Q4_K:
                line = []
                for geometry in Q8_SWEEP:
                    with env("MUSE_MLX_Q8_GEOMETRY", geometry), env("MUSE_MLX_Q8_PRE", "0"):
                        t = time_op(lambda y: K.mul_mv_q8(y, [(w, "q4_K")]), n, Kc)
                    rows.append(dict(label=label, qtype="q4_K_q8", geometry=geometry, us=t * 1e6, gbps=w.nbytes / t / 1e9))
                    line.append(f"{geometry} {w.nbytes / t / 1e9:5.0f}")
                log(f"  {label:26} q8  : " + "  ".join(line) + "  (GB/s)")
            w = None  # as in kernel_table
    return rows


Q8_PRE_SWEEP = ("1x4x8", "1x4x8x2", "2x4x8", "1x8x8", "1x2x8", "1x4x16", "1x4x16x2", "2x4x16", "1x4x4",
                "1x4x4x2", "2x4x4", "4x4x32", "2x4x32x2", "1x4x8x3")


def q8_table(g, vocab: int, reps: int, rng) -> list[dict]:
    """The opt-in q8 matvecs (flag mv_q8) at the release shapes, whole calls as the route makes
    them: the exact kernel for reference, the kernel that quantizes the activations in every
    threadgroup (``MUSE_MLX_Q8_PRE=0``), and quantize_q8 + mul_mv_q8_pre at each geometry
    of Q8_PRE_SWEEP (NR0xNSGxLPR[xU], ``MUSE_MLX_Q8_PRE=all``); then quantize_q8 alone. Sets the
    GLU's fastest pre geometry for the rest of the run (the GLU is the call that takes it)."""
    D, FF, QW, KVW = g.n_embd, g.n_ff, g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    q4 = lambda r, k: random_blocks(r, k, T.Q4_K, rng)  # noqa: E731
    gate, up, down, o = q4(FF, D), q4(FF, D), q4(D, FF), q4(D, QW)
    qkvg = [(q4(r, D), "q4_K") for r in (QW, KVW, KVW, QW)]
    # the split Q6_K calls (flag mv_q8_q6k): ffn_down, the head, attn_v among the projections
    q6 = lambda r, k: random_blocks(r, k, T.Q6_K, rng)  # noqa: E731
    down6, head6, v6 = q6(D, FF), q6(vocab, D), q6(KVW, D)
    down6s, head6s = split_q6_K(down6), split_q6_K(head6)
    qkvg6 = [qkvg[0], qkvg[1], (split_q6_K(v6), "q6_K_split"), qkvg[3]]
    qkvg6_exact = [qkvg[0], qkvg[1], (v6, "q6_K"), qkvg[3]]
    shapes = [  # label, K, Q8 call, exact call, bytes
        (f"ffn_gate+up {FF}x{D} silu", D, lambda y: K.mul_mv_q8(y, [(gate, "q4_K"), (up, "q4_K")], glu="silu"),
         lambda y: K.mul_mv_glu(y, gate, up, "q4_K", "silu"), gate.nbytes + up.nbytes),
        (f"ffn_down {D}x{FF}", FF, lambda y: K.mul_mv_q8(y, [(down, "q4_K")]), lambda y: K.mul_mv_q4_K(y, down),
         down.nbytes),
        (f"q|k|v|gate {QW}+{KVW}+{KVW}+{QW}", D, lambda y: K.mul_mv_q8(y, qkvg), lambda y: K.mul_mv_multi(y, qkvg),
         sum(w.nbytes for w, _ in qkvg)),
        (f"attn_out {D}x{QW}", QW, lambda y: K.mul_mv_q8(y, [(o, "q4_K")]), lambda y: K.mul_mv_q4_K(y, o), o.nbytes),
        (f"ffn_down Q6_K split {D}x{FF}", FF, lambda y: K.mul_mv_q8(y, [(down6s, "q6_K_split")]),
         lambda y: K.mul_mv_q6_K(y, down6), down6.nbytes),
        (f"q|k|v(Q6_K split)|gate {QW}+{KVW}+{KVW}+{QW}", D, lambda y: K.mul_mv_q8(y, qkvg6),
         lambda y: K.mul_mv_multi(y, qkvg6_exact), sum(w.nbytes for w, _ in qkvg6)),
        (f"head Q6_K split {vocab}x{D}", D, lambda y: K.mul_mv_q8(y, [(head6s, "q6_K_split")]),
         lambda y: K.mul_mv_q6_K(y, head6, head=True), head6.nbytes),
    ]
    rows, total = [], {}
    for label, width, q8, exact, nbytes in shapes:
        line = []
        split = "split" in label  # (these take mul_mv_q8_pre whatever MUSE_MLX_Q8_PRE says)
        variants = [("exact", exact, {})] + ([] if split else [("q8 per-threadgroup", q8, {"MUSE_MLX_Q8_PRE": "0"})])
        variants += [(f"pre {geo}", q8, {"MUSE_MLX_Q8_PRE": "all", "MUSE_MLX_Q8_PRE_GEOMETRY": geo,
                                         "MUSE_MLX_Q8_PRE_GEOMETRY_FEW": geo}) for geo in Q8_PRE_SWEEP]
        for name, fn, settings in variants:
            with contextlib.ExitStack() as stack:
                for k, v in settings.items():
                    stack.enter_context(env(k, v))
                t = time_op(fn, reps, width)
            rows.append(dict(label=label, variant=name, us=t * 1e6, gbps=nbytes / t / 1e9))
            total[name] = total.get(name, 0.0) + t
            line.append(f"{name} {t * 1e6:.1f} us {nbytes / t / 1e9:.0f}")
        log(f"  {label}:\n    " + "\n    ".join(line) + "  (GB/s)")
    for width in (D, FF):
        t = time_op(lambda y: K.mul_mv.quantize_q8_rows(y), reps, width)
        rows.append(dict(label=f"quantize_q8 {width}", variant="alone", us=t * 1e6, gbps=0.0))
        log(f"  quantize_q8 of {width} values alone: {t * 1e6:.2f} us")
    glu = {r["variant"]: r["us"] for r in rows if r["label"] == shapes[0][0] and r["variant"].startswith("pre ")}
    best = min(glu, key=glu.get)
    os.environ["MUSE_MLX_Q8_PRE_GEOMETRY"] = best[4:]
    log("  q8 totals over the shapes (us): " + ", ".join(f"{n} {v * 1e6:.1f}" for n, v in total.items()))
    log(f"  fastest pre geometry for the GLU (the call that takes it): {best[4:]}, set for this run")
    rows.append(dict(label="picked for the GLU", variant=best, us=glu[best], gbps=0.0))
    # the calls of few rows that take it by default: the split Q6_K ffn_down and projections
    few = {}
    for r in rows:
        if "split" in r["label"] and not r["label"].startswith("head") and r["variant"].startswith("pre "):
            few[r["variant"]] = few.get(r["variant"], 0.0) + r["us"]
    if few:
        best_few = min(few, key=few.get)
        os.environ["MUSE_MLX_Q8_PRE_GEOMETRY_FEW"] = best_few[4:]
        log(f"  fastest pre geometry for the split Q6_K ffn_down + projections together: {best_few[4:]} "
            f"({few[best_few]:.1f} us), set for this run as MUSE_MLX_Q8_PRE_GEOMETRY_FEW")
        rows.append(dict(label="picked for the calls of few rows", variant=best_few, us=few[best_few], gbps=0.0))
    return rows


# tile sizes per call class: 1, raw rows; 16, a GLU SIMD group's rows at 2x4x4 (a round one run of
# 2,304 bytes); 64 and 256, a threadgroup's and four's; 0, all of a matrix's rows (block j of every
# row one after another: the whole grid's round, roughly, one run)
TILE_SHAPES = {"glu": (1, 16, 64, 256, 0), "few": (1, 4, 16, 64)}


def tiles_table(g, reps: int, rng) -> list[dict]:
    """The q8 route's all-Q4_K calls on rows in tiles (``quants.tile_q4_K_rows``; the route holds
    its GLUs' weights so with ``MUSE_MLX_Q8_TILE``): each call on raw rows and on the same blocks in
    tiles, with the activations quantized beforehand as the route hands them over;
    every tiled output checked bit for bit against the raw rows' (a mismatch stops the run). Two
    sweeps, alternating, so that drift shows."""
    from muse_mlx.quants import tile_q4_K_rows

    D, FF, QW, KVW = g.n_embd, g.n_ff, g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    q4 = lambda r, k: random_blocks(r, k, T.Q4_K, rng)  # noqa: E731
    calls = [  # label, class, K, matrices, GLU
        (f"ffn_gate+up {FF}x{D} silu, q8 out", "glu", D, [q4(FF, D), q4(FF, D)], True),
        (f"ffn_down {D}x{FF}", "few", FF, [q4(D, FF)], False),
        (f"q|k|v|gate {QW}+{KVW}+{KVW}+{QW} (all Q4_K)", "few", D, [q4(r, D) for r in (QW, KVW, KVW, QW)], False),
        (f"attn_output {D}x{QW}", "few", QW, [q4(D, QW)], False),
    ]
    rows = []
    for label, cls, width, mats, glu in calls:
        nbytes = sum(w.nbytes for w in mats)
        tiles = [t or mats[0].shape[0] for t in TILE_SHAPES[cls]]
        tiles = list(dict.fromkeys(t for t in tiles if all(w.shape[0] % t == 0 for w in mats)))
        forms = {t: mats if t == 1 else [tile_q4_K_rows(w, t) for w in mats] for t in tiles}
        y = mx.random.normal((1, width))
        q8 = K.mul_mv.quantize_q8_rows(y)

        def call(t, yy=None, qq=None):
            kw = dict(glu="silu", q8_out=True) if glu else {}
            out = K.mul_mv_q8(y if yy is None else yy, [(w, "q4_K") for w in forms[t]],
                              q8=q8 if qq is None else qq, tile=t, **kw)
            return out[0] if glu else out

        want = np.array(call(1)).view(np.uint32)
        for t in tiles[1:]:
            got = np.array(call(t)).view(np.uint32)
            if not np.array_equal(got, want):
                raise SystemExit(f"bench: {label} in tiles of {t} differs from its raw rows in "
                                 f"{int((got != want).sum())} of {want.size} outputs")
        # distinct quantized activations per call (so that nothing is merged), as flat arguments
        flat = [a for _ in range(reps) for a in K.mul_mv.quantize_q8_rows(mx.random.normal((1, width)))]
        line = []
        for sweep in range(2):
            for t in tiles:
                tt = time_calls(lambda *a, t=t: [call(t, y, (a[i], a[i + 1])) for i in range(0, len(a), 2)], flat, reps)
                rows.append(dict(label=label, tile=t, sweep=sweep, us=tt * 1e6, gbps=nbytes / tt / 1e9))
                line.append(f"sweep {sweep} tile {t}: {tt * 1e6:.1f} us {nbytes / tt / 1e9:.0f}")
        log(f"  {label} (every tiled output bit for bit the raw rows'):\n    " + "\n    ".join(line) + "  (GB/s)")
        mats = forms = None
        mx.clear_cache()
    return rows


def pick_geometries(sweep: list[dict]) -> dict:
    """The fastest geometry per block type (total time over the swept shapes), set for this run."""
    picks = {}
    for qtype, var in (("Q4_K", "MUSE_MLX_MV_GEOMETRY"), ("Q6_K", "MUSE_MLX_MV_GEOMETRY_Q6K"),
                       ("q4_K_q8", "MUSE_MLX_Q8_GEOMETRY")):
        total: dict[str, float] = {}
        for r in sweep:
            if r["qtype"] == qtype:
                total[r["geometry"]] = total.get(r["geometry"], 0.0) + r["us"]
        if total:
            picks[var] = min(total, key=total.get)
            os.environ[var] = picks[var]
    return picks


def logits_table(vocab: int, reps: int) -> list[dict]:
    """What generation reads from a token's logits (``generate.next_token``): ``logit_stats``'s one
    pass against MLX's ops for the same, and against MLX's argmax alone (this script's greedy pick
    until the thirtieth session)."""
    rows = []
    for name, fn in ((f"logit_stats over {vocab} logits (argmax, log-sum-exp, finite)", lambda y: tuple(K.logit_stats(y))),
                     (f"MLX's argmax + logsumexp + isfinite.all over {vocab}",
                      lambda y: (mx.argmax(y, axis=-1), mx.logsumexp(y, axis=-1), mx.isfinite(y).all())),
                     (f"MLX's argmax alone over {vocab}", lambda y: mx.argmax(y, axis=-1))):
        t = time_op(fn, reps, vocab)
        rows.append(dict(op=name, us=t * 1e6))
        log(f"  {name:60} {t * 1e6:9.1f} us")
    return rows


def breakdown_table(g, reps: int, rng) -> list[dict]:
    """Where a token's time goes besides the big matvecs, and what a prefill chunk is made of:
    every small decode kernel of one layer alone, and a prefill matrix's dequantization and matmul."""
    D, H, Hkv, hd = g.n_embd, g.n_head, g.n_head_kv, g.head_dim
    rows = []

    def add(name, fn, width, nbytes=0, inputs=None):
        t = time_op(fn, reps, width, inputs)
        rows.append(dict(op=name, us=t * 1e6, gbps=nbytes / t / 1e9 if nbytes else None))
        log(f"  {name:60} {t * 1e6:9.1f} us" + (f"  {nbytes / t / 1e9:7.0f} GB/s" if nbytes else ""))

    w1, w2 = mx.ones((D,)), mx.ones((D,))
    h = mx.random.normal((1, 1, D))
    add("tail_dual_eps (post-norm + residual + next norm)", lambda y: K.tail_dual_eps(h, y.reshape(1, 1, D), w1, w2,
                                                                                       1e-8, 1e-5, "seeds")[1], D)
    qkw = mx.ones((H + Hkv, hd))
    add("rms_norm_mul, the Q- and K-norms of a token", lambda y: K.rms_norm_mul(y, qkw, 1e-5, n=hd, rows=H + Hkv,
                                                                                out_shape=(1, H + Hkv, 1, hd)), (H + Hkv) * hd)
    add("mx.fast.rope over the Q and K heads", lambda y: mx.fast.rope(y.reshape(1, H + Hkv, 1, hd), hd,
                                                                      traditional=True, base=10000.0, scale=1.0,
                                                                      offset=mx.array([100], dtype=mx.int32)),
        (H + Hkv) * hd)
    table = K.rope_table(hd, 10000.0, 1.0)
    add("qk_rope_pack (the Q/K-norms, RoPE and f16 K/V in one)",
        lambda y: K.qk_rope_pack(y, qkw, 1e-5, mx.array([100], dtype=mx.int32), table, rows=H + Hkv, hkv=Hkv, d=hd,
                                 rd=hd, traditional=True, v_offset=0, nth=K.norm_threads(hd, "llama"))[0],
        (H + Hkv) * hd)
    for ctx, cap, window in ((128, 256, 0), (1000, 1024, 0), (128, 8192, 0), (4096, 8192, 0), (4096, 4096, 4096)):
        kv = (0.5 * mx.random.normal((2, 1, Hkv, cap, hd))).astype(mx.float16)
        geom = K.attention.decode_geometry(cap, window)
        pos = mx.array([ctx], dtype=mx.int32)
        form = "one dispatch" if K.attention.one_dispatch(cap, hd) else "partial + combine"
        add(f"attn_decode {form}, ctx {ctx}, cap {cap}",
            lambda y, kv=kv, geom=geom, pos=pos: K.attn_decode(y, kv, pos, geom, hd ** -0.5, y, n_head=H), H * hd,
            2 * Hkv * (ctx + 1) * hd * 2)
        # (the cache write is not timed alone: held by a closure, its planes would be copied,
        # while the decode step donates them and slice_update writes in place)
    # a prefill chunk: the dequantization of one FFN matrix (each type, each output dtype), then
    # matmuls of 512 tokens against it
    for qt, kind in ((T.Q4_K, "q4_K"), (T.Q6_K, "q6_K")):
        mats = [random_blocks(g.n_ff, D, qt, rng) for _ in range(4)]  # distinct, or compile merges the calls
        for dt, dname in ((mx.float32, "f32"), (mx.float16, "f16")):
            add(f"dequantize_rows (prefill) {g.n_ff}x{D} {kind} -> {dname}",
                lambda wq, kind=kind, dt=dt: K.dequantize_rows(wq, kind, dt), D,
                mats[0].nbytes + g.n_ff * D * dt.size, inputs=mats)
        wq = mats[0]
        del mats
    wf = K.dequantize_rows(wq, kind)
    x = mx.random.normal((512, D))
    mx.eval(wf, x)
    flops = 2 * 512 * D * g.n_ff
    # how MLX's float32 matmul rounds: float32 operands give ~1e-6 relative error, TF32 ~1e-3
    probe = np.random.default_rng(1)
    pa, pb = probe.standard_normal((256, 1024)).astype(np.float32), probe.standard_normal((1024, 256)).astype(np.float32)
    exact = pa.astype(np.float64) @ pb.astype(np.float64)
    f32_err = float(np.abs(np.array(mx.array(pa) @ mx.array(pb)) - exact).max() / np.abs(exact).max())
    rows.append(dict(op="float32 matmul relative error (max |err| / max |out|)", rel_err=f32_err))
    log(f"  float32 matmul relative error {f32_err:.1e} ({'TF32' if f32_err > 1e-4 else 'float32'} operands)")
    for name, a, b in (("f32", x, wf), ("f16 operands", x.astype(mx.float16), wf.astype(mx.float16))):
        mx.eval(a, b)
        t = time_op(lambda y, a=a, b=b: (a + y[0, 0].astype(a.dtype)) @ b.T, max(2, reps // 4), D)
        label = f"matmul 512x{D} @ {D}x{g.n_ff} {name}"
        rows.append(dict(op=label, us=t * 1e6, tflops=flops / t / 1e12))
        log(f"  {label:60} {t * 1e6:9.1f} us  {flops / t / 1e12:7.1f} TFLOP/s")
    return rows


# -- whole-model decode and prefill --------------------------------------------------------


def fill_cache(model, cache, n: int, rng) -> None:
    """Caches as if ``n`` positions had been pre-filled (random f16 planes): decode cost only."""
    model.prepare_decode(cache, n + 512)
    for c in cache:
        c.kv = (0.5 * mx.random.normal(c.kv.shape)).astype(mx.float16)
        c.offset = n
    mx.eval([c.kv for c in cache])


def dispatch_cost(n: int = 200) -> dict:
    """Seconds per op of ``n`` tiny ops: a dependent chain and independent calls, of MLX adds and
    of one custom kernel (llama's norm on 256 floats), each plain and under ``mx.compile``."""
    xs = [mx.random.normal((1, 256)) for _ in range(n)]
    mx.eval(xs)

    def add_chain(v):
        for _ in range(n):
            v = v + 1.0
        return v

    def kernel_fan(*vs):
        return [K.rms_norm_mul(v, None) for v in vs]

    out = {}
    for name, fn, args in (("mlx add, chain", add_chain, xs[:1]), ("custom kernel, chain", norm_chain(n), xs[:1]),
                           ("custom kernel, independent", kernel_fan, xs)):
        for compiled in (False, True):
            f = mx.compile(fn) if compiled else fn
            mx.eval(f(*args))
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                mx.eval(f(*args))
                times.append(time.perf_counter() - t0)
            out[name + (" compiled" if compiled else "")] = statistics.median(times) / n
    return out


def decode_tokens(step, y: mx.array, n: int, waits: list | None = None) -> mx.array:
    """``n`` greedy tokens after ``y``, pipelined as ``generate`` does: each step is queued
    (``mx.async_eval``) before the host waits for the previous token. Returns the last token;
    ``waits`` gets the seconds the host spent waiting for each token in ``item()``. The rest of
    the wall clock is spent building and queueing the steps -- and, on CUDA, in MLX's own wait
    inside ``async_eval`` once more than 10 of its graphs are queued (``MAX_ACTIVE_TASKS``; a
    release token is 16 graphs on the exact route), so a decode bound by the device can show no
    ``item()`` wait.
    ``bench.py --thin`` measures the host's own ceiling instead."""
    for _ in range(n):
        nxt = step(y.reshape(1))
        mx.async_eval(nxt)
        t0 = time.perf_counter()
        y.item()
        if waits is not None:
            waits.append(time.perf_counter() - t0)
        y = nxt
    y.item()
    return y


def norm_chain(n: int):
    """A dependent chain of ``n`` tiny custom kernels (llama's norm of 256 floats): launch cost
    without work."""
    def chain(v):
        for _ in range(n):
            v = K.rms_norm_mul(v, None)
        return v
    return chain


def greedy_step(model, cache, capacity: int, compiled):
    """``token -> next greedy token``: the decode path's ``DecodeStep`` where the route has one
    (``compiled`` as it says), else the model's general forward over the growing cache; the token
    taken as generation takes it (``generate.next_token``: the logits' statistics)."""
    if model.uses_decode_path(mx.zeros((1, 1), dtype=mx.int32), cache):
        step_fn = DecodeStep(model, cache, capacity, compiled)
        return lambda y: next_token(step_fn(y)[None])[0][0]
    return lambda y: next_token(model(y.reshape(1, 1), cache, last_only=True)[:, -1])[0][0]


def decode_rate(model, ctx: int, n_tokens: int, runs: int, compiled, rng) -> dict:
    """Median tokens/s over ``runs`` runs of ``n_tokens`` greedy tokens, pipelined as generate does;
    and, of the median run, the time per token spent building and queueing the steps and waiting
    in ``item()`` (see :func:`decode_tokens` for what each includes)."""
    runs_out = []
    built, warm_start = K.variants_launched(), time.perf_counter()
    for run in range(runs + 1):  # the first run warms up (kernel builds, the compile trace)
        if run == 1:
            warm_s, built = time.perf_counter() - warm_start, K.variants_launched() - built
        cache = model.make_cache()
        fill_cache(model, cache, ctx, rng)
        step = greedy_step(model, cache, ctx + n_tokens + 2, compiled)
        y = step(mx.array([1]))
        mx.async_eval(y)
        y.item()
        waits: list = []
        t0 = time.perf_counter()
        decode_tokens(step, y, n_tokens, waits)
        dt = time.perf_counter() - t0
        if run:
            runs_out.append((n_tokens / dt, (dt - sum(waits)) / n_tokens, sum(waits) / n_tokens))
        del cache
    rates = [r for r, _, _ in runs_out]
    _, host, wait = sorted(runs_out)[len(runs_out) // 2]
    return dict(ctx=ctx, tok_s=statistics.median(rates), runs=rates, host_ms=host * 1e3, wait_ms=wait * 1e3,
                warm_s=warm_s, variants_built=built)


def dispatch_count(model, ctx: int, rng) -> dict:
    """Route ops and MLX graph nodes of one decoded token (traced once, not compiled)."""
    cache = model.make_cache()
    fill_cache(model, cache, ctx, rng)
    model.route.dispatches.clear()
    out = model(mx.array([[1]]), cache, last_only=True)
    ops = dict(model.route.dispatches)
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as f:
        mx.export_to_dot(f.name, out)
        text = Path(f.name).read_text()
    # primitives are the rectangles of MLX's DOT export: `{ 9385... [label ="Add", shape=rectangle]; }`
    prims: dict[str, int] = {}
    for line in text.splitlines():
        if "shape=rectangle" in line:
            label = line.split('label ="', 1)[1].split('"', 1)[0]
            prims[label] = prims.get(label, 0) + 1
    mx.eval(out)
    return dict(route_ops=sum(ops.values()), graph_primitives=sum(prims.values()), by_op=ops, by_primitive=prims)


def prefill_rate(model, n: int, runs: int, rng, vocab: int, mode: str = "batched", layer_sync: int | None = None,
                 pipeline: bool = True, matmul_commits: bool | None = None):
    """(median tokens/s, peak bytes during the prefill) of an ``n``-token prompt; ``layer_sync``:
    evaluate every this many layers (0: one graph; default: the mode's, as generate does);
    ``pipeline=False``: wait for each group before building the next; ``matmul_commits``: each
    matmul in a CUDA graph of its own (default: as generate does; see generate.batched_prefill)."""
    prompt = mx.array(rng.integers(0, vocab, n))
    rates = []
    mx.clear_cache()
    mx.reset_peak_memory()
    with batched_prefill(model.route, mode, layer_sync, pipeline, matmul_commits):
        for run in range(runs + 1):
            cache = model.make_cache()
            model.prepare_decode(cache, n + 8)
            mx.eval([c.kv for c in cache])
            t0 = time.perf_counter()
            out = model(prompt[None], cache, last_only=True)
            mx.eval(out, [c.kv for c in cache])
            dt = time.perf_counter() - t0
            if run:
                rates.append(n / dt)
            del cache
    return statistics.median(rates), mx.get_peak_memory()


def flag_sets(route: str, wanted: str | None) -> list[tuple[str, ...]]:
    if route == "stock":
        return [()]
    sets = [()] + [(FLAG_NEEDS[f], f) if f in FLAG_NEEDS else (f,) for f in PINNED_FLAGS]
    if wanted is not None:
        sets = [tuple(s.split("+")) if s else () for s in wanted.split(",")]
    return sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", default=None, help="synthetic checkpoint path (made if missing; default: in the temp dir)")
    ap.add_argument("--small", action="store_true", help="a 4-layer geometry of the same family (for a CPU)")
    ap.add_argument("--thin", action="store_true", help="the release layers and heads, narrow matrices (512 wide, FFN 1,024): "
                    "the release kernels per token with almost no work (the host's ceiling)")
    ap.add_argument("--tiny", action="store_true", help="the test suite's 4 x 256 geometry (a smoke test in seconds)")
    ap.add_argument("--routes", default="pinned,stock", help="routes to measure, comma-separated (default: %(default)s)")
    ap.add_argument("--flags", default=None,
                    help="pinned flag sets, comma-separated, '+' within a set, '' for none (default: none, then each flag)")
    ap.add_argument("--contexts", default="128,4096", help="decode contexts; empty: no decode (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens per timed run (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per measurement, after one warm-up (default: %(default)s)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill measurement; 0 skips it (default: %(default)s)")
    ap.add_argument("--prefill-modes", default="batched,batched-f16",
                    help="prefill modes measured on the pinned route without flags (default: %(default)s)")
    ap.add_argument("--prefill-sync-ab", action="store_true",
                    help="also time each prefill evaluated every 1, 4 and 13 layers and as one graph, and "
                         "every 1 and 4 layers waiting for each group (besides the mode's default, generate's)")
    ap.add_argument("--prefill-commit-ab", action="store_true",
                    help="also time each prefill with and without every batched weight matmul in a CUDA graph of its own "
                    "(generate's default: with, for the float32 mode on CUDA)")
    ap.add_argument("--parts", default="dispatch,kernels,breakdown,logits,model",
                    help="what to measure, comma-separated, of dispatch, kernels, breakdown, model, q8 (the opt-in "
                         "q8 matvecs per geometry; sets the fastest), tiles (the q8 Q4_K calls on rows in tiles, "
                         "bit for bit against raw rows), logits (what generation reads from a token's logits: "
                         "logit_stats against MLX's ops) (default: %(default)s)")
    ap.add_argument("--no-compile", action="store_true", help="decode without mx.compile (also measured with it by default)")
    ap.add_argument("--compiled-only", action="store_true", help="decode with mx.compile only (not also without it)")
    ap.add_argument("--env-ab", default="", help="NAME=V1,V2,...: time every decode case once per value of the "
                    "engine switch NAME (a MUSE_MLX_* variable), alternated, twice over (a switch of the weights' "
                    "form, " + " or ".join(FORM_SWITCHES) + ", re-forms them for each value); A+B=a1+b1,a2+b2,... moves "
                    "several together")
    ap.add_argument("--kernel-reps", type=int, default=20, help="independent calls per kernel timing (default: %(default)s)")
    ap.add_argument("--sweep", action="store_true", help="time the matvecs at every launch geometry, then stop")
    ap.add_argument("--tune", action="store_true",
                    help="sweep first, then run everything at the fastest geometries found (they change no bits)")
    ap.add_argument("--json", default=None, help="write every number to this JSON file")
    args = ap.parse_args(argv)

    if args.no_compile and args.compiled_only:
        ap.error("--no-compile and --compiled-only exclude each other")
    try:
        settings = env_settings([args.env_ab] if args.env_ab else [])
    except ValueError as e:
        ap.error(str(e))
    g, vocab = (SMALL_GEOMETRY, SMALL_VOCAB) if args.small else (MUSE_GLIMMER_30B, RELEASE_VOCAB)
    if args.tiny:
        g, vocab = TINY_GEOMETRY, 2048
    if args.thin:
        g, vocab = THIN_GEOMETRY, THIN_VOCAB
    if args.small or args.tiny:
        args.contexts = ",".join(str(min(int(c), 512)) for c in args.contexts.split(",") if c)
    rng = np.random.default_rng(0)
    report: dict = dict(
        date=datetime.date.today().isoformat(), mlx=mx.__version__, device=str(mx.default_device()),
        backend=K.backend(), platform=platform.platform(), python=platform.python_version(),
        command="python scripts/bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        geometry=dict(layers=g.n_layer, n_embd=g.n_embd, n_ff=g.n_ff, heads=g.n_head, kv_heads=g.n_head_kv,
                      head_dim=g.head_dim, vocab=vocab),
        environment=settings_in_effect(),
    )
    if K.backend() == "cuda":
        report["gpu"] = os.popen("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader").read().strip()
    probe_bytes = 1 << 24 if args.tiny or args.thin else 1 << 27 if args.small else 1 << 30
    bw, read_bw = memory_bandwidths(probe_bytes)
    report["copy_tb_s"], report["read_tb_s"] = bw / 1e12, read_bw / 1e12
    log(f"mlx {mx.__version__} on {mx.default_device()} ({K.backend()} kernels); copy bandwidth {bw / 1e12:.3f} TB/s "
        f"(read + written), sums read {read_bw / 1e12:.3f} TB/s")
    log(describe_settings(report["environment"]))

    if args.sweep or args.tune:
        log("matvec bandwidth per launch geometry (NR0xNSG[xU[xP]]):")
        report["sweep"] = geometry_sweep(args.kernel_reps, rng)
        if args.sweep:
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=1))
            return 0
        report["tuned"] = pick_geometries(report["sweep"])
        log(f"tuned geometries: {report['tuned']}")
        mx.clear_cache()
    parts = set(args.parts.split(","))
    unknown = parts - {"dispatch", "kernels", "breakdown", "model", "q8", "tiles", "logits"}
    if unknown:
        ap.error(f"unknown part(s) {', '.join(sorted(unknown))} in --parts")
    if K.backend() != "cpu" and "dispatch" in parts:
        report["dispatch_cost_s"] = dispatch_cost()
        log("dispatch cost per op in a dependent chain: " +
            ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in report["dispatch_cost_s"].items()))
    if "q8" in parts:
        log("the opt-in q8 matvecs (flag mv_q8), per kernel and geometry:")
        report["q8"] = q8_table(g, vocab, args.kernel_reps, rng)
        mx.clear_cache()
    if "tiles" in parts:
        log("the q8 route's Q4_K calls on rows in tiles (quants.tile_q4_K_rows):")
        report["tiles"] = tiles_table(g, args.kernel_reps, rng)
        mx.clear_cache()
    if "logits" in parts:
        log("what generation reads from the logits:")
        report["logits"] = logits_table(vocab, args.kernel_reps)
    if "kernels" in parts:
        log("per-kernel timings (one token):")
        report["kernels"] = kernel_table(g, vocab, args.kernel_reps, rng)
        mx.clear_cache()
    if "breakdown" in parts:
        log("the small decode kernels, and a prefill matrix:")
        report["breakdown"] = breakdown_table(g, args.kernel_reps, rng)
        mx.clear_cache()
    if "model" not in parts:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return 0

    size = "-tiny" if args.tiny else "-small" if args.small else "-thin" if args.thin else ""
    path = Path(args.file or Path(tempfile.gettempdir()) / f"muse-glimmer-synthetic{size}.gguf")
    t0 = time.perf_counter()
    ensure_synthetic(path, g, vocab, "q4_k_m", 0)
    file_bytes = path.stat().st_size
    report["file"] = dict(path=str(path), bytes=file_bytes, seconds=time.perf_counter() - t0)
    log(f"checkpoint {path} ({file_bytes / 1e9:.2f} GB) ready in {time.perf_counter() - t0:.0f} s")

    contexts = [int(c) for c in args.contexts.split(",") if c]
    report["routes"] = []
    for route in args.routes.split(","):
        mx.clear_cache()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        model = load_model(path, route, progress=False)
        load_s = time.perf_counter() - t0
        wbytes = weight_bytes_per_token(model)
        loaded_peak = mx.get_peak_memory()
        log(f"{route}: loaded in {load_s:.0f} s; weights read per token {wbytes / 1e9:.2f} GB "
            f"(roofline {bw / wbytes:.0f} tok/s at the copy's rate, {read_bw / wbytes:.0f} at the sums'); peak memory {loaded_peak / 1e9:.1f} GB = "
            f"{loaded_peak / file_bytes:.2f} x file")
        for flags in flag_sets(route, args.flags):
            model.set_flags(flags)
            name = route + "".join("+" + f for f in flags)
            compiles = [False] if (args.no_compile or K.backend() == "cpu" or route == "stock") else \
                [True] if args.compiled_only else [True, False]
            entry = dict(route=name, load_s=load_s, weight_bytes=wbytes, loaded_peak_bytes=loaded_peak,
                         file_bytes=file_bytes, decode=[])
            mx.reset_peak_memory()
            if contexts:
                entry["dispatches"] = dispatch_count(model, contexts[0], rng)
                log(f"  {name}: {entry['dispatches']['route_ops']} route ops, "
                    f"{entry['dispatches']['graph_primitives']} MLX primitives per decoded token")
            else:
                log(f"  {name}:")
            for compiled, ctx, (env_name, env_value) in [(c, x, v) for c in compiles for x in contexts for v in settings]:
                n_tok = args.tokens if route != "stock" else max(8, args.tokens // 4)
                with env(env_name, env_value):
                    if sets_form_switch(env_name):  # the weights in this value's form (each run makes a new step)
                        model.set_flags(model.route.flags)
                    r = decode_rate(model, ctx, n_tok, args.runs, compiled if model.route.fast_decode(model.cfg) else None, rng)
                r.update(compiled=compiled, tb_s=wbytes * r["tok_s"] / 1e12, of_copy=wbytes * r["tok_s"] / bw,
                         of_roofline=r["tok_s"] / (bw / wbytes), of_read=wbytes * r["tok_s"] / read_bw)
                setting = ""
                if env_name is not None:
                    r["env"] = setting_dict(env_name, env_value)
                    setting = f" {env_name}={env_value}"
                entry["decode"].append(r)
                log(f"    decode ctx {ctx:5}{' compiled' if compiled else '         '}{setting}: {r['tok_s']:7.1f} tok/s = "
                    f"{r['tb_s']:.3f} TB/s ({r['of_copy']:.0%} of copy); runs {[round(x, 1) for x in r['runs']]}; "
                    f"per token {r['host_ms']:.2f} ms building and queueing (MLX's own waits included), "
                    f"{r['wait_ms']:.2f} ms waiting in item(); warm-up {r['warm_s']:.1f} s"
                    + (f", {r['variants_built']} kernel variants built" if r["variants_built"] else ""))
            if any(sets_form_switch(name) for name, _ in settings):  # the weights back in the form the environment asks
                model.set_flags(model.route.flags)
            entry["peak_bytes"] = mx.get_peak_memory()  # of the decode runs (the prefill's are apart)
            if contexts:
                log(f"    decode peak memory {entry['peak_bytes'] / 1e9:.1f} GB = "
                    f"{entry['peak_bytes'] / file_bytes:.2f} x file")
            if args.prefill:  # every flag set: a flag can change the weights' forms the prefill reads (q8 tiles)
                modes = args.prefill_modes.split(",") if route == "pinned" and not flags else ["batched"]
                entry["prefill_tok_s"], entry["prefill_peak_bytes"] = {}, {}
                syncs = [(None, True, None)]
                if args.prefill_sync_ab and model.route.batches_prefill:
                    syncs += [(s, p, None) for s, p in ((1, True), (1, False), (4, True), (4, False), (13, True),
                                                        (0, True))]
                if args.prefill_commit_ab:  # the stock route too: its matmuls, committed one by one or not
                    syncs += [(None, True, True), (None, True, False)]
                for mode in modes:
                    for sync, pipeline, commits in syncs:
                        key = mode + ("" if sync is None else f" (eval every {sync} layers)" if sync else " (one graph)")
                        key += "" if pipeline else " (waiting for each)"
                        key += "" if commits is None else " (a graph per matmul)" if commits else " (no graph per matmul)"
                        rate, peak = prefill_rate(model, args.prefill, max(1, args.runs - 1), rng, vocab, mode, sync,
                                                  pipeline, commits)
                        entry["prefill_tok_s"][key], entry["prefill_peak_bytes"][key] = rate, peak
                        log(f"    prefill {args.prefill} ({key}): {rate:.0f} tok/s, peak memory "
                            f"{peak / 1e9:.1f} GB = {peak / file_bytes:.2f} x file")
                        mx.clear_cache()
            report["routes"].append(entry)
        model.set_flags(())
        del model
    report["llama_cpp_h200"] = LLAMA_CPP_H200
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
