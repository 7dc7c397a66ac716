"""What the kernel boundaries of a decoded token cost on CUDA, measured with a plain stream.

    python scripts/fusion_ceiling.py [--modes separate,separate-folded,fused-layer,fused-token,stream] [--runs 5]

The q8 route decodes a release-geometry token in about 5.8 ms on the H200, 0.7 ms short of the
issue's goal, and its timeline spends it in 365 dependent kernels (seven a layer: the q|k|v|gate
matvec, the attention, attn_output, the norm tail, the GLU, ffn_down, the norm tail; then the
head), each with its own ramp and drain (docs/performance.md). Whether one persistent kernel,
which keeps the weight stream going across those boundaries, would recover that time is a
question about the GPU, not about our matvecs' arithmetic. So this script reads the same bytes a
token reads (per layer: q|k|v|gate, the K/V planes at context 128, attn_output, gate+up,
ffn_down; then the head; the byte counts of the Q4_K_M file, :func:`token_plan`) with a kernel
whose work is a minimal stream (16-byte loads folded by xor, every matrix's input vector read
first, as a matvec reads it), in four structures:

* ``separate``: one launch per stage and one single-threadgroup launch per norm tail (two
  reductions over the 6,656-wide residual), as the q8 route runs today;
* ``separate-folded``: one launch per stage, the tails folded into the stage after them: every
  threadgroup of that stage puts its first weight loads in flight, computes the tail itself and
  then streams (the first threadgroup also writes the new residual): 261 launches instead of 365,
  no grid barrier, so no residency condition;
* ``fused-layer``: one launch per layer; the stages inside it are separated by a grid-wide
  barrier (an atomic counter), every threadgroup computes the norm tail itself after the barrier,
  and each threadgroup loads the first slab of its next stage's weights before waiting;
* ``fused-token``: the same for the whole token in one launch (52 layers and the head);
* ``stream``: the fused-token kernel without barriers or tails, the bytes alone: the ceiling.

``--rings`` gives the fused kernels a ring of weight chunks in threadgroup memory, filled by
``cp.async`` in the order each threadgroup reads them: the loads then run ahead of the data, through
every barrier and tail, by as many chunks as the ring holds (a persistent decode kernel's way to
keep the stream going at a dependency). Every fused launch also sums what it read (order-free), and
a case whose sum differs from the token's words summed on the host is void. ``--staged-tails`` copies each norm
tail's two input vectors into threadgroup memory with one round of ``cp.async`` before its passes
(the loop form loads them from L2 again in each pass, each pass waiting on the one before);
``--norms-ahead`` stages the norm weights too, copied in before the barrier ahead of each tail;
``--tail-partials`` has each stage a tail takes leave a threadgroup's sums over its rows, so that the
tail reduces 3 values a threadgroup instead of the vector twice (checked against the loops first).
``--in-flight U`` has every pass over a vector (each stage's read of its input, a tail's passes)
issue U loads a thread at once into U partial sums; at 1 (the default, and every figure before the
thirty-seventh session) each load is waited for before the next is issued, which a real kernel's
input read would not do. ``--bytes-scale 0`` streams no weights: a mode then times its launches,
barriers, input reads and tails alone.

A grid-wide barrier is only safe when every threadgroup is resident at once, so the fused grids
are ``--sms`` x ``--blocks-per-sm``; a barrier that waits more than about a second gives up and
the script reports it (instead of hanging). CUDA only: Metal offers no such guarantee, and these
kernels are a measurement, not a route (they compute nothing a model uses).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muse_mlx.quants import row_bytes  # noqa: E402
from muse_mlx.synthetic import RELEASE_VOCAB  # noqa: E402
from muse_mlx.writer import MUSE_GLIMMER_30B, Geometry, tensor_shapes, tensor_type  # noqa: E402

MODES = ("separate", "separate-folded", "fused-layer", "fused-token", "stream")
PLAN_COLUMNS = 6  # buffer (0 layer, 1 head), offset and length in 16-byte words, input and output length, tail first


@dataclass(frozen=True)
class Stage:
    name: str
    nbytes: int
    k: int  # input vector length
    rows: int  # output vector length
    tail: bool  # a norm tail runs first (its output is the input)


def _bytes(name: str, shape, mix: str, g: Geometry) -> int:
    return shape[0] * row_bytes(tensor_type(name, shape, mix, g.n_layer, False), shape[1])


def _words(nbytes: int) -> int:
    """16-byte words, rounded up: the kernels' unit of offset and length."""
    return -(-nbytes // 16)


def token_plan(g: Geometry = MUSE_GLIMMER_30B, vocab: int = RELEASE_VOCAB, mix: str = "q4_k_m",
               ctx: int = 128) -> list[list[Stage]]:
    """Per layer, the stages a decoded token runs, with the bytes the file holds for each (the
    K/V planes: ``ctx`` positions of f16); then the head, as a last one-stage "layer"."""
    shapes = tensor_shapes("muse-glimmer", g, vocab)
    q, kv, D = g.n_head * g.head_dim, g.n_head_kv * g.head_dim, g.n_embd
    layers = []
    for i in range(g.n_layer):
        p = f"blk.{i}."

        def b(*names):
            return sum(_bytes(p + n + ".weight", shapes[p + n + ".weight"], mix, g) for n in names)

        layers.append([
            Stage("q|k|v|gate", b("attn_q", "attn_k", "attn_v", "attn_gate"), D, 2 * q + 2 * kv, True),
            Stage("attention", 2 * ctx * kv * 2, 2 * q + 2 * kv, q, False),
            Stage("attn_output", b("attn_output"), q, D, False),
            Stage("gate+up", b("ffn_gate", "ffn_up"), D, 2 * g.n_ff, True),
            Stage("ffn_down", b("ffn_down"), g.n_ff, D, False),
        ])
    layers.append([Stage("head", _bytes("output.weight", shapes["output.weight"], mix, g), D, vocab, True)])
    return layers


# -- the kernels (CUDA) ----------------------------------------------------------------------

FC_GROUP = 12  # the tree barrier's threadgroups a group (FLAVOR 4)

HEADER = f"#define FC_GROUP {FC_GROUP}\n" + r"""
#define FC_U 4  // 16-byte loads in flight per thread
__device__ __forceinline__ float fc_block_sum(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) s += red[i];
    return s;
}
// one threadgroup's slab of a stage: [begin, end) in 16-byte words
__device__ __forceinline__ void fc_slab(long long len, int nb, int b, long long& begin, long long& end) {
    const long long per = (len + nb - 1) / nb;
    begin = per * b;
    end = begin + per < len ? begin + per : len;
    if (begin > end) begin = end;
}
__device__ __forceinline__ void fc_first(const uint4* w, long long begin, long long end, uint4 (&pre)[FC_U]) {
    #pragma unroll
    for (int u = 0; u < FC_U; ++u) {
        const long long i = begin + threadIdx.x + (long long)u * blockDim.x;
        pre[u] = i < end ? __ldcs(w + i) : make_uint4(0u, 0u, 0u, 0u);
    }
}
// the stream: the FC_U words already loaded (pre), then the rest, FC_U loads in flight
__device__ __forceinline__ unsigned fc_stream(const uint4* w, long long begin, long long end, const uint4 (&pre)[FC_U]) {
    unsigned acc = 0u;
    #pragma unroll
    for (int u = 0; u < FC_U; ++u) acc += pre[u].x ^ pre[u].y ^ pre[u].z ^ pre[u].w;
    const long long step = (long long)FC_U * blockDim.x;
    for (long long i = begin + threadIdx.x + step; i < end; i += step) {
        uint4 v[FC_U];
        #pragma unroll
        for (int u = 0; u < FC_U; ++u) {
            const long long j = i + (long long)u * blockDim.x;
            v[u] = j < end ? __ldcs(w + j) : make_uint4(0u, 0u, 0u, 0u);
        }
        #pragma unroll
        for (int u = 0; u < FC_U; ++u) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    return acc;
}
// the norm tail: hidden' = hidden + rms(src) * w1, y = rms(hidden') * w2; y into ys (length D),
// hidden' into hout when hout is not null; expect >= 0: first check that every row of src is that
// stage's (flag 2 in *flags if not: the barrier before let a stale row through)
// (src and hidden through L2: another multiprocessor wrote them inside this launch, and L1 is
// not coherent across multiprocessors)
// STAGED = 0: each pass (the check, the sums, the scaling) loads from L2 again, its loads waiting on
// the pass before; STAGED = 1: src and hidden copied at once into threadgroup memory xs (2 D floats)
// by cp.async, 16 bytes a copy, one L2 round trip and no registers held, and the passes read them there
// (cp.async's wait is for every group in flight: a ring's chunks included); STAGED = 2: the norm weights
// too, at xs + 2 D (copied before the barrier ahead of the tail), so that no pass waits on a global
// load (each pass's loop is one load at a time: Nsight Compute, thirty-sixth session)
// x and y (D floats each) into dst and dst + D by cp.async, one group: the tail's src and hidden, or
// its norm weights
__device__ __forceinline__ void fc_stage_pair(const float* x, const float* y, int D, float* dst) {
    for (int i = threadIdx.x; i < D / 4; i += blockDim.x) {
        const unsigned dx = (unsigned)__cvta_generic_to_shared(dst + 4 * i);
        const unsigned dy = (unsigned)__cvta_generic_to_shared(dst + D + 4 * i);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dx), "l"(x + 4 * i) : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dy), "l"(y + 4 * i) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void fc_stage_wait() {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
}
// the sum of f(i) over this thread's indices i < n (threadIdx.x, then a blockDim.x apart), U at a time
// into U partial sums, so that U loads issue before the first is waited for (U = 1: one at a time, each
// iteration's load waited for before the next is issued, as nothing here unrolls: blockDim.x is not a
// constant)
template <int U, typename F>
__device__ __forceinline__ float fc_sum_over(int n, F f) {
    float acc[U];
    #pragma unroll
    for (int u = 0; u < U; ++u) acc[u] = 0.0f;
    int i = threadIdx.x;
    for (; i + (U - 1) * (int)blockDim.x < n; i += U * blockDim.x) {
        #pragma unroll
        for (int u = 0; u < U; ++u) acc[u] += f(i + u * blockDim.x);
    }
    for (; i < n; i += blockDim.x) acc[0] += f(i);
    float s = 0.0f;
    #pragma unroll
    for (int u = 0; u < U; ++u) s += acc[u];
    return s;
}
// every row of a is stage expect's (flag 2 in *flags if not); a in global memory (through L2) or,
// STAGED, in threadgroup memory; U loads at once
template <int STAGED, int U = 1>
__device__ __forceinline__ void fc_check_rows(const float* a, int D, int expect, unsigned* flags) {
    const float stale = fc_sum_over<U>(D, [&](int i) {
        return floorf(STAGED ? a[i] : __ldcg(a + i)) != (float)expect ? 1.0f : 0.0f; });
    if (stale > 0.0f) atomicOr(flags, 2u);
}
// returns the sum of hidden'^2 (the same in every thread); each pass U loads at once (fc_sum_over)
template <int STAGED, int U = 1>
__device__ __forceinline__ float fc_tail(const float* src, const float* hidden, const float* w1, const float* w2,
                                         int D, float* ys, float* hout, float* red, int expect, unsigned* flags,
                                         float* xs) {
    if (STAGED) {
        fc_stage_pair(src, hidden, D, xs);
        fc_stage_wait();
    }
    auto ld = [&](const float* p, int i) { return STAGED ? p[i] : __ldcg(p + i); };
    const float* a = STAGED ? xs : src;
    const float* b = STAGED ? xs + D : hidden;
    const float* n1 = STAGED == 2 ? xs + 2 * D : w1;
    const float* n2 = STAGED == 2 ? xs + 3 * D : w2;
    if (expect >= 0) fc_check_rows<STAGED, U>(a, D, expect, flags);
    const float s = fc_sum_over<U>(D, [&](int i) { return ld(a, i) * ld(a, i); });
    const float scale1 = 1.0f / sqrtf(fc_block_sum(s, red) / D + 1e-5f);
    __syncthreads();
    float h2 = 0.0f;
    for (int i0 = threadIdx.x; i0 < D; i0 += U * blockDim.x) {  // U indices' loads, then their stores
        float av[U], bv[U], nv[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = i0 + u * blockDim.x;
            av[u] = i < D ? ld(a, i) : 0.0f, bv[u] = i < D ? ld(b, i) : 0.0f, nv[u] = i < D ? n1[i] : 0.0f;
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = i0 + u * blockDim.x;
            if (i < D) {
                const float h = bv[u] + av[u] * scale1 * nv[u];
                ys[i] = h;
                if (hout) hout[i] = h;
                h2 += h * h;
            }
        }
    }
    const float hh = fc_block_sum(h2, red);
    const float scale2 = 1.0f / sqrtf(hh / D + 1e-5f);
    for (int i0 = threadIdx.x; i0 < D; i0 += U * blockDim.x) {
        float yv[U], nv[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = i0 + u * blockDim.x;
            yv[u] = i < D ? ys[i] : 0.0f, nv[u] = i < D ? n2[i] : 0.0f;
        }
        #pragma unroll
        for (int u = 0; u < U; ++u)
            if (i0 + u * blockDim.x < D) ys[i0 + u * blockDim.x] = yv[u] * scale2 * nv[u];
    }
    __syncthreads();
    return hh;
}
// three sums over the threadgroup at once (red: 3 floats a warp)
__device__ __forceinline__ void fc_block_sum3(float& a, float& b, float& c, float* red) {
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
        c += __shfl_xor_sync(0xffffffffu, c, o);
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) {
        const int w = threadIdx.x >> 5;
        red[3 * w] = a, red[3 * w + 1] = b, red[3 * w + 2] = c;
    }
    __syncthreads();
    a = b = c = 0.0f;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) a += red[3 * i], b += red[3 * i + 1], c += red[3 * i + 2];
}
// the norm tail from the sums the stage before left, one triple a threadgroup (its rows' sum of a^2,
// of h a w1 and of (a w1)^2, a = src): rms(src) and rms(hidden') then need one reduction of
// 3 x nparts values instead of two over D, and it runs while src and hidden are copied in;
// shh, the sum of hidden^2, comes from the tail before and leaves as that of hidden'
// (|h + s1 a w1|^2 = shh + 2 s1 sum(h a w1) + s1^2 sum((a w1)^2))
__device__ __forceinline__ void fc_tail_from_parts(const float* src, const float* hidden, const float* w1,
                                                   const float* w2, int D, float* ys, float* hout, float* red,
                                                   int expect, unsigned* flags, float* xs, const float* parts,
                                                   int nparts, float& shh) {
    fc_stage_pair(src, hidden, D, xs);
    float a = 0.0f, b = 0.0f, c = 0.0f;
    for (int t = threadIdx.x; t < nparts; t += blockDim.x)
        a += __ldcg(parts + 4 * t), b += __ldcg(parts + 4 * t + 1), c += __ldcg(parts + 4 * t + 2);
    fc_block_sum3(a, b, c, red);
    const float s1 = 1.0f / sqrtf(a / D + 1e-5f);
    shh = shh + 2.0f * s1 * b + s1 * s1 * c;
    const float s2 = 1.0f / sqrtf(shh / D + 1e-5f);
    fc_stage_wait();
    if (expect >= 0) fc_check_rows<1>(xs, D, expect, flags);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float h = xs[D + i] + xs[i] * s1 * w1[i];
        if (hout) hout[i] = h;
        ys[i] = h * s2 * w2[i];
    }
    __syncthreads();
}
// a stage's output: this threadgroup's share of the rows, each row = the stage's index + 0.5 (what
// the fused kernel's tails check); the stream's and the input's sums enter so no load is dropped
__device__ __forceinline__ float fc_write(float* out, int rows, int cap, int nb, int b, unsigned acc, float seed, int id) {
    const float v = (float)id + 0.5f + (acc == 0x9E3779B9u ? 0.25f : 0.0f) + seed * 0.0f;
    const int per = (rows + nb - 1) / nb;
    for (int r = b * per + threadIdx.x; r < (b + 1) * per && r < rows && r < cap; r += blockDim.x) out[r] = v;
    return v;
}
// the ring (RING > 0): chunks of one 16-byte word a thread in threadgroup memory, loaded by cp.async
// in the order the threadgroup reads them (its slab of each stage in turn), RING chunks ahead of the
// one it reads, so the weight loads go on through every barrier and tail. Each thread loads and reads
// only its own word of a chunk: no threadgroup barrier guards the ring
struct FcCursor { int s; long long c, chunks, begin, end; };
__device__ __forceinline__ void fc_cursor_stage(FcCursor& k, const int* plan, int stages) {
    for (k.c = 0; k.s < stages; ++k.s) {  // the next stage with a non-empty slab
        fc_slab(plan[k.s * 6 + 2], gridDim.x, blockIdx.x, k.begin, k.end);
        k.chunks = (k.end - k.begin + blockDim.x - 1) / blockDim.x;
        if (k.chunks > 0) return;
    }
}
__device__ __forceinline__ void fc_put(FcCursor& k, const int* plan, int stages, const uint32_t* w,
                                       const uint32_t* wh, uint4* chunk) {
    if (k.s < stages) {
        const int* p = plan + k.s * 6;
        const uint4* w4 = reinterpret_cast<const uint4*>(p[0] ? wh : w) + p[1];
        const long long i = k.begin + k.c * blockDim.x + threadIdx.x;
        const unsigned dst = (unsigned)__cvta_generic_to_shared(chunk + threadIdx.x);
        // past the slab: 0 bytes copied from a readable address, the word zero-filled (as fc_stream)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(dst), "l"(i < k.end ? w4 + i : w4), "r"(i < k.end ? 16 : 0) : "memory");
        if (++k.c == k.chunks) { ++k.s; fc_cursor_stage(k, plan, stages); }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");  // a group every call, empty past the end
}
// the sum (mod 2^32) of every word's xor-fold the grid read: order-free, so equal across structures
__device__ __forceinline__ void fc_checksum(unsigned* at, unsigned v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(at, v);
}
// the GPU's clock in ns, the same on every multiprocessor (%globaltimer)
__device__ __forceinline__ unsigned long long fc_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned fc_ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// every threadgroup arrives, then waits for all; gives up (flag 1 in sync[1]) after about 2^31
// cycles. FLAVOR 0: a fence, atomicAdd, volatile polls of the counter; 1: a release add and acquire
// polls (gpu scope); 2: as 1, with a short sleep between polls; 3: the last to arrive (an acq_rel
// add returns the count before it) releases the others through a flag of its own 128-byte line,
// sync[32], which changes once a barrier where the counter changes once per threadgroup; 4: in two
// levels, against the burst of 132 adds on one word when every threadgroup arrives at once: each adds to
// its group's counter (FC_GROUP threadgroups a group, groups[32 g], each on its own 128-byte line: see
// sync_layout), the last of a group adds to sync[0], and all poll sync[0] for every group
template <int FLAVOR>
__device__ __forceinline__ void fc_grid_barrier(unsigned* sync, unsigned target, unsigned* groups) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned* poll = FLAVOR == 3 ? sync + 32 : sync;
        unsigned goal = target;  // what poll reaches once every threadgroup has arrived
        if (FLAVOR == 4) {
            const unsigned k = target / gridDim.x, g = blockIdx.x / FC_GROUP;
            const unsigned n = min((unsigned)FC_GROUP, gridDim.x - g * FC_GROUP);  // this group's size
            goal = k * ((gridDim.x + FC_GROUP - 1) / FC_GROUP);
            unsigned before;
            asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                         : "=r"(before) : "l"(groups + 32 * g) : "memory");
            if (before + 1u == k * n) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(sync) : "memory");
        } else if (FLAVOR == 0) {
            __threadfence();
            atomicAdd(sync, 1u);
        } else if (FLAVOR == 3) {
            unsigned before;
            asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(sync) : "memory");
            if (before + 1u == target)
                asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(poll), "r"(target) : "memory");
        } else {
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(sync) : "memory");
        }
        const long long start = clock64();
        // (once one threadgroup gave up, the others stop waiting too: a second a barrier, not minutes)
        while ((FLAVOR == 0 ? *(volatile unsigned*)poll : fc_ld_acquire(poll)) < goal
               && !*(volatile unsigned*)(sync + 1)) {
            if (FLAVOR == 2) __nanosleep(64);
            if (clock64() - start > (1ll << 31)) { atomicExch(sync + 1, 1u); break; }
        }
        if (FLAVOR == 0) __threadfence();
    }
    __syncthreads();
}
"""

# one stage, its own launch; inputs: w (its weights' buffer), x (its input vector)
STAGE_BODY = r"""
    const float seed = fc_sum_over<IN_U>(K, [&](int i) { return x[i]; });
    long long begin, end;
    fc_slab(LEN, gridDim.x, blockIdx.x, begin, end);
    const uint4* w4 = reinterpret_cast<const uint4*>(w) + OFF;
    uint4 pre[FC_U];
    fc_first(w4, begin, end, pre);
    fc_write(out, ROWS, ROWS, gridDim.x, blockIdx.x, fc_stream(w4, begin, end, pre), seed, 0);
"""

# one norm tail, one threadgroup
TAIL_BODY = r"""
    __shared__ float red[32];
    fc_tail<0, IN_U>(src, hidden, norms, norms + D, D, y, hidden_out, red, -1, nullptr, nullptr);
"""

# one stage with the norm tail before it folded in, its own launch; inputs: w, src (the output
# before the tail), hidden, norms; outputs: out, hidden_out (written by the first threadgroup)
FOLDED_BODY = r"""
    __shared__ float red[32];
    __shared__ float ys[D];
    extern __shared__ float fc_xs[];  // STAGED: the tail's src and hidden (2 D floats)
    long long begin, end;
    fc_slab(LEN, gridDim.x, blockIdx.x, begin, end);
    const uint4* w4 = reinterpret_cast<const uint4*>(w) + OFF;
    uint4 pre[FC_U];
    fc_first(w4, begin, end, pre);  // the weights' first loads in flight during the tail
    fc_tail<STAGED, IN_U>(src, hidden, norms, norms + D, D, ys, blockIdx.x == 0 ? hidden_out : nullptr, red, -1,
                          nullptr, fc_xs);
    const float seed = fc_sum_over<IN_U>(K, [&](int i) { return ys[i]; });
    fc_write(out, ROWS, ROWS, gridDim.x, blockIdx.x, fc_stream(w4, begin, end, pre), seed, 0);
"""

# the stages of ``plan`` in one launch. inputs: w (a layer's buffer), wh (the head's), plan,
# prev (the state the launch before left: act[2][CAP], then hid[2][D], then ys_all[D]), norms (w1, w2)
# outputs: state (this launch's act and hid), sync (the barrier's counter; sync[1], flags: 1 a wait
# gave up, 2 a tail read a row its stage had not written; sync[2], the checksum of the words read).
# RING > 0: the weights through a ring of RING chunks in dynamic threadgroup memory (ring_bytes);
# TAIL_ONE: each tail computed by the first threadgroup alone, then a barrier (instead of by every one);
# STAGED: the tails' inputs (1) and norm weights (2) staged in threadgroup memory (fc_tail);
# PARTIALS: every tail but the first from the sums the stage before left (fc_tail_from_parts; its
# inputs staged as with STAGED)
FUSED_BODY = r"""
    __shared__ float red[96];
    __shared__ float ys_own[RING ? 1 : D];
    __shared__ unsigned fc_next;  // CHUNKS: the chunk this threadgroup streams next
    extern __shared__ uint4 fc_dyn[];  // RING > 0: the ring, then ys; STAGED: then xs (2 or 4 D floats)
    uint4* ring = fc_dyn;
    float* ys = RING ? reinterpret_cast<float*>(fc_dyn + RING * blockDim.x) : ys_own;
    float* xs = reinterpret_cast<float*>(fc_dyn + RING * blockDim.x) + (RING ? D : 0);
    float* act = state;
    float* hid = state + 2 * CAP;
    float* ys_all = state + 2 * CAP + 2 * D;  // TAIL_ONE: the tail's output, for every threadgroup
    float* parts = state + 2 * CAP + 3 * D;  // PARTIALS: [2][gridDim.x][4], by the tails' parity
    unsigned arrivals = 0u, total = 0u;
    int tails = 0, slot = 0;
    float shh = 0.0f;  // PARTIALS: the sum of the hidden's squares, from the tail before
    uint4 pre[FC_U];
    long long begin, end;
    FcCursor put{0, 0, 0, 0, 0};
    if (STAGED == 2 && BARRIERS && plan[5] && (!TAIL_ONE || blockIdx.x == 0))  // the first tail's norms
        fc_stage_pair(norms, norms + D, D, xs + 2 * D);
    if (RING) {
        fc_cursor_stage(put, plan, STAGES);
        for (int r = 0; r < RING; ++r) fc_put(put, plan, STAGES, w, wh, ring + r * blockDim.x);
    } else {
        const int* p = plan;
        fc_slab(p[2], gridDim.x * (CHUNKS ? CHUNKS : 1), blockIdx.x, begin, end);
        fc_first(reinterpret_cast<const uint4*>(p[0] ? wh : w) + p[1], begin, end, pre);
    }
    for (int s = 0; s < STAGES; ++s) {
        const int* p = plan + s * 6;
        const uint4* w4 = reinterpret_cast<const uint4*>(p[0] ? wh : w) + p[1];
        const int k = p[3], rows = p[4];
        float seed = 0.0f;
        if (p[5] && BARRIERS) {  // the tail: its input is the stage before's output
            const float* src = s == 0 ? prev + PREV_ACT * CAP : act + ((s - 1) & 1) * CAP;
            const float* h = tails == 0 ? prev + 2 * CAP + PREV_HID * D : hid + ((tails - 1) & 1) * D;
            // by every threadgroup, or (TAIL_ONE) by the first, into ys_all, which a barrier then hands out
            float* hout = blockIdx.x == 0 ? hid + (tails & 1) * D : nullptr;
            // (s > 0: the barrier's test, every row of the stage before is its own)
            if ((!TAIL_ONE || blockIdx.x == 0) && PARTIALS && s > 0)
                fc_tail_from_parts(src, h, norms, norms + D, D, TAIL_ONE ? ys_all : ys, hout, red, s - 1, sync + 1, xs,
                                   parts + (tails & 1) * gridDim.x * 4, gridDim.x, shh);
            else if (!TAIL_ONE || blockIdx.x == 0)
                shh = fc_tail<STAGED, IN_U>(src, h, norms, norms + D, D, TAIL_ONE ? ys_all : ys, hout, red, s - 1, sync + 1,
                                      xs);
            ++tails;
            if (TAIL_ONE) {
                fc_grid_barrier<FLAVOR>(sync, ++arrivals * gridDim.x, sync + GROUPS_AT);
                seed = fc_sum_over<IN_U>(k, [&](int i) { return __ldcg(ys_all + i); });
            } else {
                seed = fc_sum_over<IN_U>(k, [&](int i) { return ys[i]; });
            }
        } else {
            const float* x = s == 0 ? prev + PREV_ACT * CAP : act + ((s - 1) & 1) * CAP;
            seed = fc_sum_over<IN_U>(k, [&](int i) { return __ldcg(x + i); });
        }
        // PARTIALS, a stage whose output a tail takes: the hidden and w1 at this thread's first row, loaded
        // now (they depend on nothing this stage computes), for the sums it leaves the tail
        const bool feeds = PARTIALS && BARRIERS && s + 1 < STAGES && p[6 + 5];
        const float* hc = tails == 0 ? prev + 2 * CAP + PREV_HID * D : hid + ((tails - 1) & 1) * D;
        const int per = (rows + gridDim.x - 1) / gridDim.x;
        const int r0 = blockIdx.x * per + threadIdx.x;
        const int r_end = min(min((int)(blockIdx.x + 1) * per, rows), min(CAP, D));
        float h0 = 0.0f, w0 = 0.0f;
        if (feeds && r0 < r_end) h0 = __ldcg(hc + r0), w0 = norms[r0];
        unsigned acc = 0u;
        if (RING) {  // this stage's chunks from the ring, each refilled with the chunk RING ahead
            long long b, e;
            fc_slab(p[2], gridDim.x, blockIdx.x, b, e);
            for (long long c = (e - b + blockDim.x - 1) / blockDim.x; c > 0; --c) {
                asm volatile("cp.async.wait_group %0;" :: "n"(RING ? RING - 1 : 0) : "memory");
                const uint4 v = ring[slot * blockDim.x + threadIdx.x];
                acc += v.x ^ v.y ^ v.z ^ v.w;
                fc_put(put, plan, STAGES, w, wh, ring + slot * blockDim.x);
                slot = slot + 1 == RING ? 0 : slot + 1;
            }
        } else {
            // CHUNKS: the stage in gridDim.x * CHUNKS chunks, the first by threadgroup, the rest to whichever
            // threadgroup asks first (a counter a stage, each on its own 128-byte line: sync_layout); each
            // asks for its next while it streams the one it has, so the atomic's round trip is hidden
            unsigned grab = 0u;
            if (CHUNKS && threadIdx.x == 0) grab = atomicAdd(sync + 64 + 32 * s, 1u);
            acc = fc_stream(w4, begin, end, pre);
            for (const unsigned nch = gridDim.x * CHUNKS; CHUNKS;) {
                if (threadIdx.x == 0) fc_next = gridDim.x + grab;
                __syncthreads();
                const unsigned c = fc_next;
                __syncthreads();
                if (c >= nch) break;
                if (threadIdx.x == 0) grab = atomicAdd(sync + 64 + 32 * s, 1u);
                fc_slab(p[2], nch, c, begin, end);
                fc_first(w4, begin, end, pre);
                acc += fc_stream(w4, begin, end, pre);
            }
            if (s + 1 < STAGES) {  // the next stage's first loads, before the wait
                const int* q = p + 6;
                fc_slab(q[2], gridDim.x * (CHUNKS ? CHUNKS : 1), blockIdx.x, begin, end);
                fc_first(reinterpret_cast<const uint4*>(q[0] ? wh : w) + q[1], begin, end, pre);
            }
        }
        total += acc;
        const float v = fc_write(act + (s & 1) * CAP, rows, CAP, gridDim.x, blockIdx.x, acc, seed, s);
        if (feeds) {  // this threadgroup's rows' sums for the tail after the barrier
            float saa = 0.0f, sha = 0.0f, sww = 0.0f;
            for (int r = r0; r < r_end; r += blockDim.x) {
                const float aw = v * (r == r0 ? w0 : norms[r]);
                saa += v * v, sha += (r == r0 ? h0 : __ldcg(hc + r)) * aw, sww += aw * aw;
            }
            fc_block_sum3(saa, sha, sww, red);
            if (threadIdx.x == 0) {
                float* q = parts + ((tails & 1) * gridDim.x + blockIdx.x) * 4;
                q[0] = saa, q[1] = sha, q[2] = sww;
            }
        }
        // STAGED == 2: the next tail's norm weights on their way before the barrier
        if (STAGED == 2 && BARRIERS && s + 1 < STAGES && p[6 + 5] && (!TAIL_ONE || blockIdx.x == 0))
            fc_stage_pair(norms, norms + D, D, xs + 2 * D);
        if (BARRIERS && s + 1 < STAGES) {
            // TIMES: when this threadgroup arrived (all its threads done) and left, at sync[TIMES_AT] on
            // (written as they happen: a time held in a register across the barrier cost the launch its
            // residency at 1,024 threads, once the driver had compiled it)
            unsigned long long* at = reinterpret_cast<unsigned long long*>(sync + TIMES_AT)
                                     + 2 * (arrivals * gridDim.x + blockIdx.x);
            if (TIMES) {
                __syncthreads();
                if (threadIdx.x == 0) at[0] = fc_now();
            }
            fc_grid_barrier<FLAVOR>(sync, ++arrivals * gridDim.x, sync + GROUPS_AT);
            if (TIMES && threadIdx.x == 0) at[1] = fc_now();
        }
    }
    fc_checksum(sync + 2, total);
"""


# ITERS grid barriers and nothing else: what one costs
PROBE_BODY = r"""
    for (unsigned i = 1; i <= ITERS; ++i) fc_grid_barrier<FLAVOR>(sync, i * gridDim.x, sync + 64);
"""

BARRIERS = {"fence": 0, "acquire": 1, "sleep": 2, "flag": 3, "tree": 4}
SYNC_WORDS = 64  # the least counter array: the counter, the flags, the release flag at word 32


def too_many_registers(barrier: str, in_flight: int, tail_by_one: bool) -> str | None:
    """Why the fused kernel with ``--tail-partials`` and these settings cannot hold 1,024 threads an SM
    (more than 64 registers a thread, NVRTC 13.5 for sm_90: 66-76), or None."""
    if in_flight > 1:
        return f"not with --in-flight {in_flight} (the kernel needs more than 64 registers a thread)"
    if barrier == "tree" or (barrier == "flag" and tail_by_one):
        return f"not with --barrier {barrier}" + (" and --tail-by-one" if tail_by_one else "") + \
            " (the kernel needs more than 64 registers a thread)"
    return None


def sync_layout(stages: int, blocks: int) -> tuple[int, int, int]:
    """The fused kernel's counter array, in words, each counter on its own 128-byte line: the barrier's
    own 64 words, a chunk counter a stage (``--chunks``), a tree barrier's counter a group of FC_GROUP
    threadgroups, then two 64-bit times a barrier and threadgroup (``--barrier-times``). Returns where
    the group counters and the times start, and the words the whole array needs."""
    groups_at = SYNC_WORDS + 32 * stages
    times_at = groups_at + 32 * -(-blocks // FC_GROUP)
    return groups_at, times_at, times_at + 4 * (stages - 1) * blocks


@functools.cache
def _kernels():
    return dict(
        stage=mx.fast.cuda_kernel(name="fusion_stage", input_names=["w", "x"], output_names=["out"], source=STAGE_BODY,
                                  header=HEADER),
        tail=mx.fast.cuda_kernel(name="fusion_tail", input_names=["src", "hidden", "norms"],
                                 output_names=["hidden_out", "y"], source=TAIL_BODY, header=HEADER),
        probe=mx.fast.cuda_kernel(name="fusion_barrier_probe", input_names=["unused"], output_names=["sync"],
                                  source=PROBE_BODY, header=HEADER),
    )


@functools.cache
def _fused_kernel(shared_bytes: int):
    """The fused kernel with ``shared_bytes`` of dynamic threadgroup memory (its ring, ys, xs)."""
    return mx.fast.cuda_kernel(name="fusion_fused", input_names=["w", "wh", "plan", "prev", "norms"],
                               output_names=["state", "sync"], source=FUSED_BODY, header=HEADER,
                               shared_memory=shared_bytes)


@functools.cache
def _folded_kernel(shared_bytes: int):
    """The folded stage with ``shared_bytes`` of dynamic threadgroup memory (its staged tail's xs)."""
    return mx.fast.cuda_kernel(name="fusion_folded", input_names=["w", "src", "hidden", "norms"],
                               output_names=["out", "hidden_out"], source=FOLDED_BODY, header=HEADER,
                               shared_memory=shared_bytes)


def ring_bytes(ring: int, threads: int, d: int, staged: int = 0) -> int:
    """The fused kernel's dynamic threadgroup memory: the ring's chunks and ys (with a ring), then the
    staged tail's ``staged`` vectors (src and hidden; then w1 and w2)."""
    return (ring * threads * 16 + d * 4 if ring else 0) + staged * d * 4


def fused_shared_bytes(ring: int, threads: int, d: int, staged: int = 0) -> int:
    """A fused threadgroup's threadgroup memory, dynamic and static (red, 96 floats; ys without a ring)."""
    return ring_bytes(ring, threads, d, staged) + 96 * 4 + (4 if ring else d * 4)


def staged_vectors(staged: int, partials: bool) -> int:
    """The D-float vectors a fused threadgroup stages for its tails: src and hidden, then w1 and w2."""
    return 4 if staged == 2 else 2 if staged or partials else 0


SM_SHARED = 228 * 1024  # an H100's or H200's threadgroup memory a multiprocessor (1 KB of it a threadgroup's own)


def _offsets(stages: list[Stage]) -> list[int]:
    """Each stage's offset in its buffer, in 16-byte words (a layer's stages end to end)."""
    at, out = 0, []
    for s in stages:
        out.append(at)
        at += _words(s.nbytes)
    return out


def plan_rows(layers: list[list[Stage]]) -> np.ndarray:
    """The fused kernel's plan: one row of PLAN_COLUMNS per stage, the head's stages reading buffer 1."""
    rows = []
    for li, stages in enumerate(layers):
        head = li == len(layers) - 1 and stages[0].name == "head"
        for s, off in zip(stages, _offsets(stages)):
            rows.append([int(head), off, _words(s.nbytes), s.k, s.rows, int(s.tail)])
    return np.array(rows, dtype=np.int32)


def barrier_waits(t: np.ndarray) -> dict[str, np.ndarray]:
    """Per barrier, from ``t`` [barriers, threadgroups, 2] (arrival, release; ns): ``skew``, the last
    arrival minus the first (how unevenly the threadgroups finished the stage); ``lag``, the first
    release minus the last arrival (the barrier's own latency); ``wait``, a threadgroup's release minus
    its arrival, averaged over the threadgroups (what the barrier cost them)."""
    arrive, leave = t[..., 0].astype(np.int64), t[..., 1].astype(np.int64)
    return dict(skew=arrive.max(1) - arrive.min(1), lag=leave.min(1) - arrive.max(1),
                wait=(leave - arrive).mean(1))


def print_barrier_waits(t: np.ndarray, names: list[str]) -> None:
    """``barrier_waits`` by the stage before each barrier (``names``): medians, means and maxima, in µs."""
    w = barrier_waits(t)
    steps = np.diff(np.unique(t))
    print(f"barrier times, one token ({t.shape[0]} barriers x {t.shape[1]} threadgroups; clock steps seen: "
          f"{steps.min() if steps.size else 0} ns; first arrival to last release "
          f"{(int(t[..., 1].max()) - int(t[..., 0].min())) / 1e6:.3f} ms):", flush=True)
    print(f"  {'after':14s} {'n':>4s}  skew: median  mean   max  lag: median  mean   max  wait: median  mean  (µs)")
    for name in dict.fromkeys(names):
        sel = np.array([n == name for n in names])
        print(f"  {name:14s} {sel.sum():4d} " + "".join(
            f"{np.median(w[k][sel]) / 1e3:13.2f}{w[k][sel].mean() / 1e3:6.2f}" + (f"{w[k][sel].max() / 1e3:6.1f}" if k != "wait" else "")
            for k in ("skew", "lag", "wait")))
    worst = int(np.argmax(w["skew"]))
    print(f"  the largest skew: barrier {worst} (after {names[worst]}), {w['skew'][worst] / 1e3:.1f} µs", flush=True)


def token_word_sum(rows: np.ndarray, w: np.ndarray, wh: np.ndarray) -> int:
    """What a token's fused launches add up in their checksum (``fc_checksum``): every 16-byte word of
    every stage's slice (``plan_rows``: buffer, offset, length) folded by xor into 32 bits, summed mod
    2^32, here from the buffers themselves, so that a launch that skipped or repeated a word is caught."""
    prefix = []
    for buf in (w, wh):  # per buffer, the running sum of its words' folds
        fold = np.bitwise_xor.reduce(np.asarray(buf, dtype=np.uint32).reshape(-1, 4), axis=1).astype(np.uint64)
        prefix.append(np.concatenate([np.zeros(1, np.uint64), np.cumsum(fold, dtype=np.uint64)]))
    total = sum(int(prefix[b][off + n]) - int(prefix[b][off]) for b, off, n in rows[:, :3].tolist())
    return total % 2**32


class Harness:
    def __init__(self, layers: list[list[Stage]], g: Geometry, threads: int, fused_blocks: int, sms: int,
                 barrier: str = "fence", sync_words: int = SYNC_WORDS, tails: bool = True, tail_one: bool = False,
                 staged_tails: int = 0, tail_partials: bool = False, in_flight: int = 1, chunks: int = 0):
        self.layers, self.g, self.threads = layers, g, threads
        self.flavor, self.sync_words = BARRIERS[barrier], max(SYNC_WORDS, sync_words)
        self.tails = tails
        self.ring = 0  # the fused kernels' ring, in chunks (main sets it per --rings value)
        self.tail_one = tail_one
        self.staged = staged_tails  # 0 loops, 1 the inputs staged, 2 and the norm weights ahead
        self.partials = tail_partials
        self.in_flight = in_flight  # loads at once in each pass over a vector (a stage's input, a tail's)
        self.chunks = chunks  # fused kernels: chunks a threadgroup a stage, handed out as asked for (0: slabs)
        self.times = 0  # 1: the fused kernels record each barrier's arrivals and releases (barrier_times)
        # separate_blocks: the separate launches' threadgroups (main sets it per --waves value)
        self.fused_blocks, self.separate_blocks = fused_blocks, 4 * sms
        self.k = _kernels()
        self.D = g.n_embd
        self.cap = max(s.rows for st in layers[:-1] for s in st)
        self.state_size = 2 * self.cap + 3 * self.D + 2 * fused_blocks * 4  # act[2][cap], hid[2][D], ys_all[D], parts
        layer_words = max(sum(_words(s.nbytes) for s in st) for st in layers[:-1])
        head_words = _words(layers[-1][0].nbytes)
        # random words: what a weight file holds (zeros could be cheaper on some memory systems)
        self.w = mx.random.randint(0, 2**31 - 1, (max(layer_words, 1) * 4,), dtype=mx.int32).view(mx.uint32)
        self.wh = mx.random.randint(0, 2**31 - 1, (max(head_words, 1) * 4,), dtype=mx.int32).view(mx.uint32)
        self.norms = mx.random.uniform(0.5, 1.5, (2 * self.D,))
        mx.eval(self.w, self.wh, self.norms)
        self.weight_bytes = sum(s.nbytes for st in layers for s in st)

    def _stage(self, stage: Stage, off: int, x, buf):
        return self.k["stage"](
            inputs=[buf, x], template=[("OFF", off), ("LEN", _words(stage.nbytes)), ("K", stage.k), ("ROWS", stage.rows),
                                       ("IN_U", self.in_flight)],
            grid=(self.separate_blocks * self.threads, 1, 1), threadgroup=(self.threads, 1, 1),
            output_shapes=[(stage.rows,)], output_dtypes=[mx.float32])[0]

    def _tail(self, src, hidden):
        return self.k["tail"](
            inputs=[src, hidden, self.norms], template=[("D", self.D), ("IN_U", self.in_flight)], grid=(1024, 1, 1), threadgroup=(1024, 1, 1),
            output_shapes=[(self.D,), (self.D,)], output_dtypes=[mx.float32, mx.float32])

    def _folded(self, stage: Stage, off: int, src, hidden, buf):
        return _folded_kernel(2 * self.D * 4 if self.staged else 0)(  # (no barrier to put the norms ahead of)
            inputs=[buf, src, hidden, self.norms],
            template=[("OFF", off), ("LEN", _words(stage.nbytes)), ("K", stage.k), ("ROWS", stage.rows), ("D", self.D),
                      ("STAGED", min(self.staged, 1)), ("IN_U", self.in_flight)],
            grid=(self.separate_blocks * self.threads, 1, 1), threadgroup=(self.threads, 1, 1),
            output_shapes=[(stage.rows,), (self.D,)], output_dtypes=[mx.float32, mx.float32])

    def separate(self, carry, folded: bool = False):
        """One token as the q8 route launches it: a kernel per stage and per tail, or (``folded``)
        a kernel per stage, each tail computed by every threadgroup of the stage after it."""
        src, hidden = carry
        for li, stages in enumerate(self.layers):
            buf = self.wh if li == len(self.layers) - 1 else self.w
            x = None
            for s, off in zip(stages, _offsets(stages)):
                if s.tail and folded:
                    x, hidden = self._folded(s, off, src[: self.D], hidden, buf)
                else:
                    if s.tail:
                        hidden, x = self._tail(src[: self.D], hidden)
                    x = self._stage(s, off, x, buf)
                src = x
        return src, hidden

    def _plan(self, layers) -> np.ndarray:
        rows = plan_rows(layers)
        if not self.tails:  # the stages read the output before them from memory, as if no tail ran
            rows[:, 5] = 0
        return rows

    def _fused(self, layers, prev, barriers: bool, prev_act: int, prev_hid: int):
        plan = mx.array(self._plan(layers))
        n = plan.shape[0]
        shared = ring_bytes(self.ring, self.threads, self.D, staged_vectors(self.staged, self.partials))
        groups_at, times_at, words = sync_layout(n, self.fused_blocks)
        # the array as asked for (its size alone moved the barriers' figures: thirty-fifth session), or
        # larger where the chunks, the tree barrier or the times need it
        need = words if self.times else times_at if self.chunks or self.flavor == BARRIERS["tree"] else 0
        return _fused_kernel(shared)(
            inputs=[self.w, self.wh, plan, prev, self.norms],
            template=[("STAGES", n), ("D", self.D), ("CAP", self.cap), ("BARRIERS", int(barriers)),
                      ("PREV_ACT", prev_act), ("PREV_HID", prev_hid), ("FLAVOR", self.flavor), ("RING", self.ring),
                      ("TAIL_ONE", int(self.tail_one)), ("STAGED", self.staged),
                      ("PARTIALS", int(self.partials)), ("IN_U", self.in_flight), ("CHUNKS", self.chunks),
                      ("TIMES", self.times), ("TIMES_AT", times_at), ("GROUPS_AT", groups_at)],
            grid=(self.fused_blocks * self.threads, 1, 1), threadgroup=(self.threads, 1, 1),
            output_shapes=[(self.state_size,), (max(self.sync_words, need),)], output_dtypes=[mx.float32, mx.uint32],
            init_value=0)

    def _parity(self, layers):
        """Where a launch of ``layers`` leaves its last output and its last hidden (act, hid slots)."""
        rows = self._plan(layers)
        return (len(rows) - 1) & 1, (int(rows[:, 5].sum()) - 1) & 1

    def fused_layer(self, state):
        act, hid = self._parity(self.layers[-1:])  # the launch before: the previous token's head
        flags = []
        for li in range(len(self.layers)):
            state, sync = self._fused(self.layers[li:li + 1], state, True, act, hid)
            act, hid = self._parity(self.layers[li:li + 1])
            flags.append(sync[1:3])
        return state, mx.stack(flags)

    def barrier_times(self) -> np.ndarray:
        """A ``fused-token`` launch (after one of the same variant) that records, per barrier and threadgroup,
        when the threadgroup arrived and when it left (ns): [barriers, threadgroups, 2]."""
        if self.tail_one or self.ring:  # (their own barriers would be counted, past the times' space)
            raise ValueError("barrier_times: the fused kernel's own barriers only, not with tail_one or a ring")
        stages = len(self._plan(self.layers))
        n, (_, times_at, _) = stages - 1, sync_layout(stages, self.fused_blocks)
        self.times = 1
        try:  # twice, the second recorded: a variant's first launch ran up to 7 x slower (thirty-seventh session)
            act, hid = self._parity(self.layers)
            for _ in range(2):
                _, sync = self._fused(self.layers, mx.ones((self.state_size,)), True, act, hid)
                mx.eval(sync)
        finally:
            self.times = 0
        if int(sync[1].item()):
            sys.exit(f"--barrier-times: the launch raised flags {int(sync[1].item())} (see sync[1])")
        return np.array(sync[times_at: times_at + 4 * n * self.fused_blocks]).view(np.uint64).reshape(
            n, self.fused_blocks, 2)

    def fused_token(self, state, barriers=True):
        act, hid = self._parity(self.layers)
        state, sync = self._fused(self.layers, state, barriers, act, hid)
        return state, sync[1:3]


def tail_forms_differ(h: Harness) -> float:
    """One token of ``fused-token`` from the same state with each tail by the first threadgroup (so that
    its output lands in the state), in loops and from partial sums: the largest difference of the
    hidden and that output, relative to their largest magnitude."""
    saved = h.tail_one, h.partials, h.staged, h.ring
    h.tail_one, h.staged, h.ring = True, 0, 0
    out = []
    for partials in (False, True):
        h.partials = partials
        state, flags = h.fused_token(mx.ones((h.state_size,)))
        mx.eval(state, flags)
        if int(flags[0].item()):
            sys.exit(f"--tail-partials: the check's launch raised flags {int(flags[0].item())} (see sync[1])")
        out.append(np.array(state[2 * h.cap: 2 * h.cap + 3 * h.D], dtype=np.float64))
    h.tail_one, h.partials, h.staged, h.ring = saved
    return float(np.max(np.abs(out[0] - out[1])) / np.max(np.abs(out[0])))


def barrier_probe(blocks: int, threads: int, flavor: str, sync_words: int, iters: int = 200, runs: int = 3):
    """Seconds per grid barrier (median of ``runs`` launches of ``iters`` barriers after a warm-up),
    or None where a wait gave up."""
    k = _kernels()["probe"]
    unused = mx.zeros((1,))
    secs = []
    for r in range(runs + 1):
        t0 = time.perf_counter()
        sync = k(inputs=[unused], template=[("ITERS", iters), ("FLAVOR", BARRIERS[flavor])],
                 grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
                 output_shapes=[(max(SYNC_WORDS, sync_words, 64 + 32 * -(-blocks // FC_GROUP) if flavor == "tree" else 0),)],
                 output_dtypes=[mx.uint32], init_value=0)[0]
        mx.eval(sync)
        if r:
            secs.append((time.perf_counter() - t0) / iters)
        if int(sync[1].item()):
            return None
    return statistics.median(secs)


def not_launched(err: Exception, threads: int) -> str | None:
    """Why a case did not launch, where the driver refused its build for this grid ("too many resources
    requested for launch": its own compile of the kernel needs more registers than ``threads`` threads
    an SM allow, which NVRTC here may not show); None for any other error, which is the script's own."""
    text = str(err)
    if "too many resources requested for launch" not in text:
        return None
    return (f"not run: the driver's build needs more registers a thread than {threads} threads an SM allow "
            f"({text.strip()})")


def _time(step, carry, tokens: int, runs: int) -> list[float]:
    """Seconds per token of ``runs`` timed runs of ``tokens`` chained steps, after a warm-up run."""
    out = []
    for r in range(runs + 1):
        t0 = time.perf_counter()
        c = carry
        for _ in range(tokens):
            c = step(c)
            mx.async_eval(c)
        mx.eval(c)
        if r:
            out.append((time.perf_counter() - t0) / tokens)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}; empty: none (default: all)")
    ap.add_argument("--layers", type=int, default=MUSE_GLIMMER_30B.n_layer, help="layers of the release geometry (default: 52)")
    ap.add_argument("--sms", type=int, default=132, help="the GPU's multiprocessors (H100 SXM and H200: 132)")
    ap.add_argument("--blocks-per-sm", type=int, default=2, help="fused grids: threadgroups per multiprocessor (default: 2)")
    ap.add_argument("--threads", type=int, default=512, help="threads per threadgroup (default: 512)")
    ap.add_argument("--waves", default="4", help="separate launches: threadgroups per multiprocessor, comma-separated (default: 4)")
    ap.add_argument("--rings", default="0",
                    help="fused kernels (fused-layer, fused-token, stream): the weights through a ring of this many "
                         "chunks (a 16-byte word a thread) in threadgroup memory, loaded ahead by cp.async across "
                         "barriers and tails; 0: a thread's 4 loads in flight, no ring; comma-separated (default: 0)")
    ap.add_argument("--tokens", type=int, default=32, help="chained tokens per timed run (default: 32)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs, after one warm-up (default: 5)")
    ap.add_argument("--barrier", choices=sorted(BARRIERS) + ["auto"], default="fence",
                    help="the fused kernels' grid barrier: fence (a fence, atomicAdd, volatile polls), acquire "
                         "(a release add, acquire polls), sleep (acquire polls with a short sleep), flag (the last to "
                         "arrive releases the others through a flag), tree (in two levels: a counter for each group "
                         "of 12 threadgroups, the last of a group adding to the top one), auto (the "
                         "probe's fastest, with its counter size; implies --probe) (default: fence)")
    ap.add_argument("--sync-words", type=int, default=SYNC_WORDS,
                    help=f"words of the barrier's counter array (a large one is an allocation of its own; "
                         f"default and least: {SYNC_WORDS})")
    ap.add_argument("--no-tails", action="store_true",
                    help="fused kernels: barriers only, no norm tails (what the tails cost)")
    ap.add_argument("--tail-by-one", action="store_true",
                    help="fused kernels: each norm tail computed by the first threadgroup, then a grid barrier "
                         "(instead of by every threadgroup)")
    ap.add_argument("--staged-tails", action="store_true",
                    help="separate-folded and fused kernels: each norm tail's inputs copied at once into threadgroup "
                         "memory by cp.async (one L2 round trip), instead of loaded again by each of its passes")
    ap.add_argument("--norms-ahead", action="store_true",
                    help="with --staged-tails, fused kernels: each tail's norm weights staged too, copied in before "
                         "the barrier ahead of it (they depend on nothing the stages compute)")
    ap.add_argument("--tail-partials", action="store_true",
                    help="fused kernels: each stage whose output a norm tail takes leaves a threadgroup's sums of its "
                         "rows, so the tail needs one reduction of those instead of two over the vector (its inputs "
                         "staged as with --staged-tails); first checks that both forms give the same hidden and output")
    ap.add_argument("--in-flight", type=int, choices=(1, 2, 4), default=1,
                    help="every kernel: loads a thread issues at once in each pass over a vector (a stage's input, "
                         "a norm tail's passes), into as many partial sums; 1: each load waited for before the next "
                         "(the figures before the thirty-seventh session) (default: 1)")
    ap.add_argument("--chunks", type=int, default=0,
                    help="fused kernels: each stage cut into this many chunks a threadgroup, the first by "
                         "threadgroup and the rest to whichever threadgroup asks first (an atomic counter a stage), "
                         "so that no threadgroup waits at a barrier for a slow one's slab; 0: one slab a "
                         "threadgroup (default: 0; not with --rings)")
    ap.add_argument("--barrier-times", action="store_true",
                    help="after the modes, one fused-token launch that records when each threadgroup arrived at "
                         "and left each barrier: per stage, the arrivals' skew, the barrier's own lag and the "
                         "mean wait (not with --tail-by-one or --rings)")
    ap.add_argument("--bytes-scale", type=float, default=1.0,
                    help="every stage's bytes times this (0: no weights at all, so that a mode times its launches, "
                         "barriers and tails alone; default: 1, a token's bytes)")
    ap.add_argument("--probe", action="store_true",
                    help="first time grid barriers alone, per flavor and counter size, at the fused grid")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r} (expected some of {', '.join(MODES)})")
    try:
        waves, rings = ([int(v) for v in a.split(",")] for a in (args.waves, args.rings))
    except ValueError:
        ap.error(f"--waves {args.waves!r} and --rings {args.rings!r}: comma-separated whole numbers")
    if args.norms_ahead and (not args.staged_tails or args.tail_partials):
        ap.error("--norms-ahead goes with --staged-tails, and not with --tail-partials")
    if not 0 <= args.bytes_scale <= 1:
        ap.error(f"--bytes-scale {args.bytes_scale}: expected a fraction from 0 to 1")
    if args.barrier_times and (args.tail_by_one or any(rings)):
        ap.error("--barrier-times: the fused kernel's own barriers only (not with --tail-by-one or --rings)")
    if not 0 <= args.chunks <= 64 or (args.chunks and any(rings)):
        ap.error(f"--chunks {args.chunks}: a whole number up to 64, and not with --rings")
    if args.tail_partials and (why := too_many_registers(args.barrier, args.in_flight, args.tail_by_one)):
        ap.error(f"--tail-partials: {why}")
    staged = 2 if args.norms_ahead else int(args.staged_tails)
    for r in rings:  # every threadgroup of a fused grid must be resident at once (the barriers)
        need = args.blocks_per_sm * (fused_shared_bytes(r, args.threads, MUSE_GLIMMER_30B.n_embd,
                                                        staged_vectors(staged, args.tail_partials)) + 1024)
        if r < 0 or need > SM_SHARED:
            ap.error(f"--rings {r}: {args.blocks_per_sm} threadgroups of {args.threads} threads need {need} bytes of "
                     f"threadgroup memory a multiprocessor, more than its {SM_SHARED}")
    if (args.staged_tails or args.tail_partials) and MUSE_GLIMMER_30B.n_embd % 4:  # cp.async copies 16 bytes
        ap.error(f"--staged-tails, --tail-partials: the width {MUSE_GLIMMER_30B.n_embd} is not a multiple of 4")
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        sys.exit("fusion_ceiling.py needs MLX's CUDA backend (its kernels are CUDA and a measurement of the GPU)")
    g = dataclasses.replace(MUSE_GLIMMER_30B, n_layer=args.layers)
    layers = [[dataclasses.replace(s, nbytes=round(s.nbytes * args.bytes_scale)) for s in st] for st in token_plan(g)]
    print(f"{datetime.date.today()}  mlx {mx.__version__}  {mx.device_info(mx.gpu).get('device_name', '?')}  "
          f"{args.layers} layers + head, {sum(s.nbytes for st in layers for s in st) / 1e9:.3f} GB a token, "
          f"{sum(len(st) for st in layers)} stages; fused grid {args.sms} x {args.blocks_per_sm} x {args.threads} threads"
          + ("; tails: none" if args.no_tails else "; tails: " + ("by one" if args.tail_by_one else "by every")
             + (", from partial sums" if args.tail_partials else ", staged with the norms ahead" if staged == 2
                else ", staged" if staged else ", in loops"))
          + f"; {args.in_flight} load(s) at once a pass" + (f"; {args.chunks} chunks a threadgroup" if args.chunks else "") + (f"; bytes x {args.bytes_scale:g}" if args.bytes_scale != 1 else ""),
          flush=True)
    from bench import memory_bandwidths

    copy, read = memory_bandwidths(1 << 30)
    print(f"copy {copy / 1e12:.3f} TB/s, sums read {read / 1e12:.3f} TB/s", flush=True)
    if args.probe or args.barrier == "auto":
        timed = {}
        for flavor in sorted(BARRIERS):
            for words in (SYNC_WORDS, 1 << 20):
                sec = barrier_probe(args.sms * args.blocks_per_sm, args.threads, flavor, words)
                print(f"barrier {flavor:8s} counter of {words:8d} words: "
                      + ("a wait gave up" if sec is None else f"{sec * 1e6:9.2f} us a barrier"), flush=True)
                if sec is not None:
                    timed[(flavor, words)] = sec
        if args.barrier == "auto":
            if not timed:
                sys.exit("every barrier's wait gave up: the fused grid's threadgroups are not all resident")
            if args.tail_partials:  # the flavors the partial-sum tails cannot take (too_many_registers)
                timed = {k: v for k, v in timed.items()
                         if not too_many_registers(k[0], args.in_flight, args.tail_by_one)}
            args.barrier, args.sync_words = min(timed, key=timed.get)
            print(f"fused kernels: barrier {args.barrier}, counter of {args.sync_words} words", flush=True)
    if not modes and not args.barrier_times:
        return
    h = Harness(layers, g, args.threads, args.sms * args.blocks_per_sm, args.sms, args.barrier,
                args.sync_words, tails=not args.no_tails, tail_one=args.tail_by_one,
                staged_tails=staged, tail_partials=args.tail_partials, in_flight=args.in_flight,
                chunks=args.chunks)
    if args.tail_partials:
        worst = tail_forms_differ(h)
        print(f"tails from partial sums against the loops, one token: largest relative difference {worst:.2e} "
              f"(hidden and the last tail's output)", flush=True)
        if not worst < 1e-4:
            sys.exit("--tail-partials: the two tail forms disagree; its figures would measure a wrong kernel")
    wb = h.weight_bytes
    # the separate launches once per --waves value, the fused ones once per --rings value
    cases = [(m, v) for m in modes for v in (waves if m.startswith("separate") else rings)]
    want_sum = None  # the words a token's fused launches read, summed on the host (token_word_sum)
    for m, v in cases:
        if m.startswith("separate"):
            h.separate_blocks = v * args.sms
            carry = (mx.ones((h.cap,)), mx.ones((h.D,)))
            step = mx.compile(lambda c, folded=m == "separate-folded": h.separate(c, folded))
        else:
            h.ring = v
            state0 = mx.ones((h.state_size,))
            fn = {"fused-layer": h.fused_layer, "fused-token": h.fused_token,
                  "stream": lambda s: h.fused_token(s, barriers=False)}[m]
            compiled = mx.compile(fn)
            flags = []

            def step(c, compiled=compiled, flags=flags):
                s, f = compiled(c)
                flags.append(f)
                return s
            carry = state0
        label = f"{m} ({v} waves)" if m.startswith("separate") else f"{m} (ring {v})" if v else m
        try:
            secs = _time(step, carry, args.tokens, args.runs)
        except RuntimeError as err:
            why = not_launched(err, args.threads * args.blocks_per_sm)
            if why is None:
                raise
            print(f"{label}: {why}", flush=True)
            continue
        if not m.startswith("separate"):
            # per token: (flags, checksum) of each launch
            per = [np.array(f, dtype=np.uint64).reshape(-1, 2) for f in flags]
            seen = int(np.bitwise_or.reduce(np.concatenate([f[:, 0] for f in per])))
            sums = {int(f[:, 1].sum() % 2**32) for f in per}
            if want_sum is None:
                want_sum = token_word_sum(plan_rows(layers), np.array(h.w), np.array(h.wh))
            other_words = sums != {want_sum}
            if seen or other_words:
                why = "; ".join(w for bit, w in ((1, "a grid barrier's wait gave up (threadgroups not all resident?)"),
                                                 (2, "a tail read rows its stage had not written")) if seen & bit)
                if other_words:
                    why += (("; " if why else "") + f"the sum of the words it read ({sorted(sums)[:3]}) is not the "
                            f"token's ({want_sum})")
                print(f"{label}: {why}: figures void", flush=True)
                continue
        med = statistics.median(secs)
        print(f"{label:22s} {med * 1e3:7.3f} ms a token = {1 / med:6.1f} tok/s; {wb / med / 1e12:.3f} TB/s "
              f"= {wb / med / copy:.0%} of copy, {wb / med / read:.0%} of read; "
              f"runs {[round(s * 1e3, 3) for s in secs]}", flush=True)
    if args.barrier_times:
        h.ring = 0
        print_barrier_waits(h.barrier_times(), [s.name for st in layers for s in st][:-1])


if __name__ == "__main__":
    main()
