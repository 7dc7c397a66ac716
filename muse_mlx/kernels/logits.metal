// What a decoded token's logits are read for: the greedy pick (argmax), the log-sum-exp that turns
// them into log-probabilities, and whether all of them are finite, in one pass over each row.
// Not pinned (llama.cpp's samplers are not reproduced); a fixed order of our own, the same on every
// GPU: muse_mlx/kernels/logits.py, docs/kernels.md "The logits' statistics".
//
// Each thread keeps a running state over the values it reads, in index order: the maximum m, the
// first index holding it, s = the sum of exp(v - m) (rescaled whenever m grows), and a count of
// values that are not finite. Two states merge with the greater maximum winning (the lower index
// on a tie), so the argmax is the first index of the maximum, as mx.argmax's. Reductions are trees
// of merges with the lower half first: lane l < off merges lane l + off into itself.

// ==== header

constant uint LOGIT_NONE = 0xFFFFFFFFu;  // no index yet: loses every tie
constant uint LOGIT_THREADS = 256;       // threads of a threadgroup in both kernels: 8 SIMD groups

// exp(a - m) for a <= m, and 0 for a = -inf (whose exp(-inf - -inf) would be a NaN)
MUSE_FN float logit_weight(float a, float m) { return a == -INFINITY ? 0.0f : exp(a - m); }

// a value v at index i into the running state
MUSE_FN void logit_step(thread float& m, thread float& s, thread uint& idx, thread uint& bad, float v, uint i) {
    bad += (as_type<uint>(v) & 0x7F800000u) == 0x7F800000u ? 1u : 0u;  // inf or NaN, tested on the bits
    if (v > m) {
        s = fma(s, logit_weight(m, v), 1.0f);
        m = v;
        idx = i;
    } else {
        s = s + logit_weight(v, m);
    }
}

// state B merged into state A (A's own values first in s's fma)
MUSE_FN void logit_merge(thread float& m, thread float& s, thread uint& idx, thread uint& bad,
                         float m2, float s2, uint i2, uint b2) {
    const bool take = m2 > m || (m2 == m && i2 < idx);
    const float mm = take ? m2 : m;
    s = fma(s, logit_weight(m, mm), s2 * logit_weight(m2, mm));
    m = mm;
    idx = take ? i2 : idx;
    bad += b2;
}

// a SIMD group's 32 states merged, the lower half first at every step (lane 0 holds the tree's root)
MUSE_FN void logit_simd_merge(thread float& m, thread float& s, thread uint& idx, thread uint& bad) {
    for (uint off = 16; off > 0; off >>= 1) {
        const float m2 = simd_shuffle_xor(m, off);
        const float s2 = simd_shuffle_xor(s, off);
        const uint i2 = simd_shuffle_xor(idx, off);
        const uint b2 = simd_shuffle_xor(bad, off);
        logit_merge(m, s, idx, bad, m2, s2, i2, b2);
    }
}

// the threadgroup's 8 SIMD groups' states merged into thread 0's: each group's root, then group 0
// merges the 8 roots, padded to 32 with empty states (merging one into a state of finite or -inf
// maximum changes nothing, bit for bit). tid: the thread's index in the threadgroup (a helper cannot
// name Metal's thread attributes, which are the kernel's parameters there).
MUSE_FN void logit_group_merge(thread float& m, thread float& s, thread uint& idx, thread uint& bad, uint tid,
                               MUSE_TG float* tm, MUSE_TG float* ts, MUSE_TG uint* ti, MUSE_TG uint* tb) {
    const uint lane = tid % 32, sg = tid / 32;
    logit_simd_merge(m, s, idx, bad);
    if (lane == 0) {
        tm[sg] = m;
        ts[sg] = s;
        ti[sg] = idx;
        tb[sg] = bad;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg == 0) {
        const bool live = lane < LOGIT_THREADS / 32;
        m = live ? tm[lane] : -INFINITY;
        s = live ? ts[lane] : 0.0f;
        idx = live ? ti[lane] : LOGIT_NONE;
        bad = live ? tb[lane] : 0u;
        logit_simd_merge(m, s, idx, bad);
    }
}

// ==== kernel: logit_stats_partial
// Template: N values a row, G threadgroups a row (of LOGIT_THREADS each). Grid (G * 256, rows).
// Thread j of a row (j = 256 g + t) reads values j, j + S, j + 2S, ... (S = 256 G: coalesced),
// four loads issued before their four steps. Writes the threadgroup's state to slot row * G + g.
threadgroup float tm[8];  // LOGIT_THREADS / 32
threadgroup float ts[8];
threadgroup uint ti[8];
threadgroup uint tb[8];
const uint row = threadgroup_position_in_grid.y, g = threadgroup_position_in_grid.x;
const uint S = G * LOGIT_THREADS;
device const float* x = logits + (ulong)row * N;
float m = -INFINITY, s = 0.0f;
uint idx = LOGIT_NONE, bad = 0;
for (uint i0 = g * LOGIT_THREADS + thread_index_in_threadgroup; i0 < N; i0 += 4 * S) {
    float v[4];
    for (uint k = 0; k < 4; ++k) {
        v[k] = i0 + k * S < N ? x[i0 + k * S] : 0.0f;
    }
    for (uint k = 0; k < 4; ++k) {
        if (i0 + k * S < N) {
            logit_step(m, s, idx, bad, v[k], i0 + k * S);
        }
    }
}
logit_group_merge(m, s, idx, bad, thread_index_in_threadgroup, tm, ts, ti, tb);
if (thread_index_in_threadgroup == 0) {
    const uint at = row * G + g;
    part_m[at] = m;
    part_s[at] = s;
    part_idx[at] = idx;
    part_bad[at] = bad;
}

// ==== kernel: logit_stats_combine
// Template: G (= LOGIT_THREADS) states a row. Grid (256, rows): thread t takes the row's state t;
// thread 0 writes the row's argmax (0 where no value beat -inf), log-sum-exp m + log(s), and 1
// where every value is finite (else 0).
threadgroup float tm[8];  // LOGIT_THREADS / 32
threadgroup float ts[8];
threadgroup uint ti[8];
threadgroup uint tb[8];
const uint row = threadgroup_position_in_grid.y, at = row * G + thread_index_in_threadgroup;
float m = part_m[at], s = part_s[at];
uint idx = part_idx[at], bad = part_bad[at];
logit_group_merge(m, s, idx, bad, thread_index_in_threadgroup, tm, ts, ti, tb);
if (thread_index_in_threadgroup == 0) {
    token[row] = idx == LOGIT_NONE ? 0u : idx;
    lse[row] = m + log(s);
    finite[row] = bad == 0 ? 1u : 0u;
}
