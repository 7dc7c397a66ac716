// Decode attention over the f16 KV planes, for one new token: softmax(q K^T * scale) V per
// query head, grouped-query (query head h reads KV head h / G), then the attention output gate.
// Not a pinned kernel: llama.cpp's flash-attention kernels are not reproduced here. Its own
// order is fixed and modelled by the oracle (muse_mlx/kernels/attention.py): scores as an fma
// chain over the head dimension, a split-K softmax (each split: max, exp, sequential sum and
// an fma chain over its keys), and a combine over splits in order.
// The KV planes are one array kv [2, HKV, CAP, D] (K then V). Positions lo..pos are visible
// (lo = pos - WINDOW + 1 on sliding layers); position p lives in slot p % CAP (a ring buffer
// when CAP is the window, a plain buffer when CAP > pos).

// ==== header
// The first position a token at `pos` sees (0, or the window's start on sliding layers), and
// how many splits hold keys when `n` keys are cut, in order, into splits of `cmax`: the partial
// pass and the combine must agree on both. Splits of a fixed size keep the combine's serial
// chain as long as the context needs, whatever the capacity (the grid has capacity / cmax).
MUSE_FN int first_visible(int pos, int window) { return window > 0 ? max(0, pos - window + 1) : 0; }
MUSE_FN int splits_used(int n, int cmax) { return (n + cmax - 1) / cmax; }

// Half e (0..1) of two packed in a 4-byte word (little-endian), as a float.
MUSE_FN float half_in_word(uint word, uint e) {
    return float(as_type<half>(ushort((word >> (16u * (e & 1u))) & 0xFFFFu)));
}

// Half e (0..7) of eight packed in a 16-byte word (little-endian), as a float.
MUSE_FN float half_of(uint4 w, uint e) {
    return half_in_word(e < 4u ? (e < 2u ? w.x : w.y) : (e < 6u ? w.z : w.w), e);
}

// The attention output gate, as ggml_sigmoid then ggml_mul: o * (1 / (1 + exp(-g))). Both
// forms of the attention end with it.
MUSE_FN float attn_gate(float o, float g) { return o * (1.0f / (1.0f + exp(-g))); }

// RoPE's pairs, for element i < rd of a head row: (2j, 2j+1) (trad) or (j, j + rd/2). Whether i is
// its pair's first member, the pair's frequency index j, and the other member; qk_rope_pack and
// the attention with its norms (NEW) both rotate with these.
MUSE_FN bool rope_first(uint i, uint rd, bool trad) { return trad ? (i % 2 == 0) : (i < rd / 2); }
MUSE_FN uint rope_freq(uint i, uint rd, bool trad) {
    return trad ? i / 2 : (rope_first(i, rd, trad) ? i : i - rd / 2);
}
MUSE_FN uint rope_partner(uint i, uint rd, bool trad) {
    const bool first = rope_first(i, rd, trad);
    return trad ? (first ? i + 1 : i - 1) : (first ? i + rd / 2 : i - rd / 2);
}
// o rotated with its pair's other member: x1' = fma(x1, cos, -(x2 * sin)), x2' = fma(x1, sin, x2 * cos).
MUSE_FN float rope_rotate(float o, float other, float c, float sn, bool first) {
    const float x1 = first ? o : other;
    const float x2 = first ? other : o;
    return first ? fma(x1, c, -(x2 * sn)) : fma(x1, sn, x2 * c);
}

// ==== kernel: qk_rope_pack
// The decode path's step from the projections to the attention: the Q- and K-norms (NORM),
// RoPE (ROPE) and the f16 K/V for the cache, in one dispatch. One threadgroup per head row of
// y (ROWS = H + HKV rows of D: the query heads, then the key heads). The norm is
// rms_norm_mul's (the same reduction with NTH threads, the same bits); RoPE is MLX's
// formula with its own, fixed order: theta = (scale * pos) * inv_freq[j], then
// x1' = fma(x1, cos, -(x2 * sin)), x2' = fma(x1, sin, x2 * cos), where the pair (x1, x2) is
// (2j, 2j+1) (TRAD) or (j, j + RD/2), for j < RD/2; values past RD pass through.
// inputs: y (f32: the ROWS head rows from 0, V's HKV rows from VOFF), w [ROWS, D] (norm
//         weights; any array without NORM), eps (element 0), pos (element 0, int32), rope [2 + RD/2]
//         (f32: scale, then inv_freq)
// outputs: qk [ROWS, D] (f32), kv [2, HKV, D] (f16: the key rows of qk, then V)
// grid (NTH * ROWS, 1, 1), threadgroup (NTH, 1, 1); templates D, NTH, ROWS, HKV, NORM, ROPE,
// TRAD, RD, VOFF
    // A few threadgroups of one warp or so: bound by latency. So every load (the row, its norm
    // weights, the rotation's frequencies, V) and the rotation's cos/sin come before the first
    // barrier, and overlap; the values and their order of operations are unchanged.
    constexpr uint D4 = D / 4;
    constexpr uint P4 = (D4 + NTH - 1) / NTH;  // float4s of the row per thread
    constexpr uint PD = (D + NTH - 1) / NTH;   // values of the row per thread
    const uint row = threadgroup_position_in_grid.x;
    const uint tid = thread_index_in_threadgroup;
    const uint sgitg = simdgroup_index_in_threadgroup;
    const uint tiisg = thread_index_in_simdgroup;
    const bool key_row = row >= ROWS - HKV;
    const uint kr = row - (ROWS - HKV);  // key head of this row (rows past ROWS - HKV)
    threadgroup float shmem[32];
    threadgroup float normed[D];
    device const float4* x4 = (device const float4*)(y + row * D);
    device const float4* w4 = (device const float4*)(w + (NORM ? row * D : 0));
    float4 xv[P4], wv[P4];
    for (uint k = 0; k < P4; ++k) {
        const uint i = tid + k * NTH;
        if (i < D4) {
            xv[k] = x4[i];
            if (NORM) wv[k] = w4[i];
        }
    }
    const float e = NORM ? eps[0] : 0.0f;
    const float L = rope[0] * float(pos[0]);
    float cv[PD], sv[PD], vv[PD];
    for (uint k = 0; k < PD; ++k) {
        const uint i = tid + k * NTH;
        if (ROPE && i < RD) {
            const float theta = L * rope[1 + rope_freq(i, RD, TRAD)];
            cv[k] = cos(theta);
            sv[k] = sin(theta);
        }
        if (key_row && i < D) vv[k] = y[VOFF + kr * D + i];
    }
    float scale = 1.0f;
    if (NORM) {  // rms_norm_mul's reduction, line for line
        if (sgitg == 0) shmem[tiisg] = 0.0f;
        float sumf = 0.0f;
        for (uint k = 0; k < P4; ++k)
            if (tid + k * NTH < D4) sumf += dot(xv[k], xv[k]);
        sumf = simd_sum(sumf);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (tiisg == 0) shmem[sgitg] = sumf;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        sumf = simd_sum(shmem[tiisg]);
        const float mean = sumf / float(D);
        scale = 1.0f / sqrt(mean + e);
    }
    for (uint k = 0; k < P4; ++k) {
        const uint i = tid + k * NTH;
        if (i < D4) {
            float4 v = xv[k];
            if (NORM) v = (v * scale) * wv[k];
            for (int e = 0; e < 4; ++e) normed[4 * i + e] = v[e];
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint k = 0; k < PD; ++k) {
        const uint i = tid + k * NTH;
        if (i >= D) break;
        float o = normed[i];
        if (ROPE && i < RD) o = rope_rotate(o, normed[rope_partner(i, RD, TRAD)], cv[k], sv[k], rope_first(i, RD, TRAD));
        qk[row * D + i] = o;
        if (key_row) {
            kv[kr * D + i] = half(o);
            kv[(HKV + kr) * D + i] = half(vv[k]);
        }
    }

// ==== kernel: attn_decode_partial
// One threadgroup per (split, KV head): the G query heads of that KV head against the split's
// keys (at most CMAX of them). Writes the split's max score, sum of exp and unnormalized output
// (splits past the last that holds keys write nothing).
// inputs: q (its first HKV*G*D values, float32), kv [2, HKV, CAP, D] (float16), pos (element 0, int32), geom [4]
//         (int32: cap, window, splits), scale (element 0)
// outputs: part_m, part_l [HKV, SPLITS, G], part_o [HKV, SPLITS, G, D]
// grid (NT*SPLITS, HKV, 1), threadgroup (NT, 1, 1); templates G, D, NT, CMAX, HKV, HS (slices of the
// heads in the output chains: a divisor of G, at most NT/D)
    const uint s = threadgroup_position_in_grid.x;
    const uint kvh = threadgroup_position_in_grid.y;
    const uint tid = thread_position_in_threadgroup.x;
    const int p_new = pos[0];
    const int cap = geom[0];
    const int window = geom[1];
    const int splits = geom[2];
    const int lo = first_visible(p_new, window);
    const int n = p_new - lo + 1;
    const int j0 = int(s) * CMAX;  // split s holds keys j0 .. j0 + CMAX - 1 (those below n)
    const int cnt = max(0, min(n - j0, CMAX));
    const uint part = kvh * uint(splits) + s;  // row of the partial outputs

    // Everything the split reads is loaded first, every load issued before the first barrier
    // (one memory round trip, not one per loop iteration): its key rows into kv4 (f16, eight to
    // a 16-byte word), its value rows into registers (they take kv4's place once the scores are
    // done), the scaled q rows into qs4 -- rows padded to D + 4 floats, so the G heads a SIMD
    // group reads at one d fall in different banks and still load as float4.
    threadgroup float4 qs4[G * (D / 4 + 1)];
    threadgroup uint4 kv4[CMAX * (D / 8)];
    threadgroup float sc[G * CMAX];
    threadgroup float mx[G];
    if (cnt == 0) return;  // past the last non-empty split: the combine never reads it
    device const half* kplane = kv + (ulong)kvh * cap * D;
    device const half* vplane = kv + ((ulong)HKV + kvh) * cap * D;
    constexpr int W = (CMAX * (D / 8) + NT - 1) / NT;  // 16-byte words of K (and of V) per thread
    uint4 vw[W];
    for (int w = 0; w < W; ++w) {
        const int i = int(tid) + NT * w, r = i / (D / 8);
        if (i < CMAX * (D / 8) && r < cnt) {
            const ulong at = (ulong)((lo + j0 + r) % cap) * D + 8 * (i % (D / 8));
            kv4[i] = *(device const uint4*)(kplane + at);
            vw[w] = *(device const uint4*)(vplane + at);
        }
    }
    for (uint i = tid; i < G * D; i += NT) qs4[(i / D) * (D / 4 + 1) + (i % D) / 4][i % 4] = q[(ulong)kvh * G * D + i] * scale[0];
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // scores: PP (key, head) pairs per thread, side by side -- the G threads of a key share its
    // row -- each an fma chain over d = 0, 1, ... (pairs past the split's end repeat its last
    // pair and are not stored)
    constexpr int PP = (G * CMAX + NT - 1) / NT;
    float acc[PP];
    int krow[PP], qrow[PP];
    for (int p = 0; p < PP; ++p) {
        const int i = min(int(tid) + NT * p, G * cnt - 1);
        krow[p] = (i / G) * (D / 8);
        qrow[p] = (i % G) * (D / 4 + 1);
        acc[p] = 0.0f;
    }
    for (int d8 = 0; d8 < D / 8; ++d8) {
        for (int p = 0; p < PP; ++p) {
            const uint4 k8 = kv4[krow[p] + d8];
            const float4 qa = qs4[qrow[p] + 2 * d8], qb = qs4[qrow[p] + 2 * d8 + 1];
            for (int e = 0; e < 8; ++e) acc[p] = fma(e < 4 ? qa[e] : qb[e - 4], half_of(k8, uint(e)), acc[p]);
        }
    }
    for (int p = 0; p < PP; ++p) {
        const int i = int(tid) + NT * p;
        if (i < G * cnt) sc[(i % G) * CMAX + i / G] = acc[p];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int w = 0; w < W; ++w) {  // the scores are done: V takes K's place (read after two more barriers)
        const int i = int(tid) + NT * w;
        if (i < CMAX * (D / 8) && i / (D / 8) < cnt) kv4[i] = vw[w];
    }
    if (tid < G) {
        float m = -INFINITY;
        for (int jj = 0; jj < CMAX; ++jj)  // constant bounds (and a guard): the loads go ahead of the chain
            if (jj < cnt) m = max(m, sc[tid * CMAX + jj]);
        mx[tid] = m;
        part_m[part * G + tid] = m;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = int(tid); i < G * cnt; i += NT) {
        const int g = i / cnt, jj = i % cnt;
        sc[g * CMAX + jj] = exp(sc[g * CMAX + jj] - mx[g]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < G) {
        float l = 0.0f;
        for (int jj = 0; jj < CMAX; ++jj)
            if (jj < cnt) l += sc[tid * CMAX + jj];
        part_l[part * G + tid] = l;
    }
    // outputs: one thread per dimension and slice of G/HS heads (HS slices of D threads when the
    // threadgroup has that many; HS = 1 otherwise, each thread then every head of its dimensions),
    // each head an fma chain over the split's keys in order
    constexpr int GPT = G / HS;
    const int slice = HS > 1 ? int(tid) / D : 0;
    if (slice < HS) {
        for (int d = HS > 1 ? int(tid) % D : int(tid); d < D; d += HS > 1 ? D : NT) {
            float out[GPT];
            for (int g = 0; g < GPT; ++g) out[g] = 0.0f;
            for (int jj = 0; jj < cnt; ++jj) {
                const float v = half_of(kv4[jj * (D / 8) + d / 8], uint(d % 8));
                for (int g = 0; g < GPT; ++g) out[g] = fma(sc[(slice * GPT + g) * CMAX + jj], v, out[g]);
            }
            for (int g = 0; g < GPT; ++g) part_o[((ulong)part * G + slice * GPT + g) * D + d] = out[g];
        }
    }

// ==== kernel: attn_decode_combine
// The splits of one query head combined in order: o = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s,
// then (GATE) the attention output gate o * (1 / (1 + exp(-g))), as ggml_sigmoid then ggml_mul.
// inputs: part_m, part_l, part_o (as written above), gate (HKV*G*D values from offset GOFF), geom [4],
//         pos (element 0)
// outputs: out [HKV*G*D]; grid (D, HKV*G, 1), threadgroup (D, 1, 1); templates G, D, GATE, GOFF,
// CMAX (keys per split), CB (splits whose outputs are loaded at a time; the first CB before anything else)
// Bound by latency at long contexts (128 splits at 4,096 keys), so the threads share the work
// that does not depend on the dimension: M from each thread's maximum over its own splits, and
// each split's weight e^(m_s - M) and sum l_s once, by one thread, into threadgroup memory, SCH
// splits at a time.
    const uint d = thread_position_in_threadgroup.x;
    const uint h = threadgroup_position_in_grid.y;
    const uint kvh = h / G, g = h % G;
    const int splits = geom[2];
    // only the first `used` splits hold keys (as in the partial pass); an empty split would add
    // exp(-inf) * 0 = +0, which changes nothing, so it is not read at all
    const int p_new = pos[0];
    const int window = geom[1];
    const int n = p_new - first_visible(p_new, window) + 1;
    const int used = splits_used(n, CMAX);
    const uint base = kvh * uint(splits);
    // The first CB splits' outputs depend on nothing this kernel computes: their loads go out
    // first, so that their trip to memory overlaps the one for the splits' maxima and sums.
    float po[CB];
    for (int u = 0; u < CB; ++u) po[u] = part_o[(ulong)((base + uint(min(u, used - 1))) * G + g) * D + d];
    constexpr int SCH = 8 * D < 1024 ? 8 * D : 1024;  // splits per round in threadgroup memory
    constexpr int NPT = (SCH + D - 1) / D;            // of those, per thread
    threadgroup float red[D];
    threadgroup float sw[SCH];
    threadgroup float sl[SCH];
    // M: each thread's max over splits d, d + D, ... (the first round's m_s and l_s kept), then
    // every thread's max over those (max: any order, any grouping)
    float pm0[NPT], pl0[NPT];
    float m = -INFINITY;
    for (int k = 0; k < NPT; ++k) {
        const int s = int(d) + k * D;
        if (s < min(used, SCH)) {
            const uint p = (base + uint(s)) * G + g;
            pm0[k] = part_m[p];
            pl0[k] = part_l[p];
            m = max(m, pm0[k]);
        }
    }
    for (int s = SCH + int(d); s < used; s += D) m = max(m, part_m[(base + uint(s)) * G + g]);
    red[d] = m;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float m_all = -INFINITY;
    for (int t = 0; t < D; ++t) m_all = max(m_all, red[t]);
    float num = 0.0f, den = 0.0f;
    for (int c0 = 0; c0 < used; c0 += SCH) {
        const int cn = min(used - c0, SCH);
        if (c0 > 0) threadgroup_barrier(mem_flags::mem_threadgroup);  // the last round's sw, sl are read
        for (int k = 0; k < NPT; ++k) {
            const int s = int(d) + k * D;
            if (s < cn) {
                float sm_s, sl_s;
                if (c0 == 0) {
                    sm_s = pm0[k];
                    sl_s = pl0[k];
                } else {
                    const uint p = (base + uint(c0 + s)) * G + g;
                    sm_s = part_m[p];
                    sl_s = part_l[p];
                }
                sw[s] = exp(sm_s - m_all);
                sl[s] = sl_s;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // CB splits' outputs at a time, all loads issued before the chain that waits for them
        for (int s = 0; s < cn; s += CB) {
            if (c0 > 0 || s > 0)  // (the first CB are loaded above)
                for (int u = 0; u < CB; ++u) po[u] = part_o[(ulong)((base + uint(c0 + min(s + u, cn - 1))) * G + g) * D + d];
            for (int u = 0; u < CB; ++u) {
                if (s + u < cn) {
                    num = fma(sw[s + u], po[u], num);
                    den = fma(sw[s + u], sl[s + u], den);
                }
            }
        }
    }
    float o = num / den;
    if (GATE) o = attn_gate(o, gate[GOFF + h * D + d]);
    out[h * D + d] = o;

// ==== kernel: attn_decode_fused
// attn_decode_partial and attn_decode_combine in one dispatch, for a cache of at most SMAX
// splits (a second launch and its wait are most of a short context's attention time). One
// threadgroup per query head; its NTF/32 SIMD groups take the head's splits in turn, a lane per
// key, and keep each split's max, sum and output in threadgroup memory for the combine at the
// end. Every float operation is one the two kernels do, in their order (the same oracle, the
// same bits): the score of a key is the same fma chain over d, a split's sum and output the same
// chains over its keys, the combine the same chain over splits.
// NEW = 1 takes the step before it in too (qk_rope_pack, one dispatch less a layer): q is then
// the projection output y of qk_rope_pack, and the threadgroup makes its own head's q row and its
// KV head's k row as that kernel does (the same norm at NTH = 32 threads, the same RoPE, then f16
// for K and V). The token's key and value are read from there, not from the cache, whose write
// comes after this dispatch (kvnew, [2, HKV, D] f16: written by the first query head of each
// group, for the caller to scatter into the planes). The same values, so the same bits.
// THRU = 1 (with NEW) hands the planes out whole instead: kvnew is then [2, HKV, cap, D], the input
// planes with the token's slot written, so that the cache takes it as its planes and no write
// follows the dispatch (a scatter a layer and a token: their launches, on the host and the GPU,
// were what the writes cost). The other rows are copied by threadgroups of their own, after the
// query heads' in the grid (CPW words of 16 bytes a thread), on SMs the attention leaves idle: a
// share of the copy in each query head's threadgroup cost it 2.3-2.6 us a layer on the H200.
// inputs: q, kv, pos, geom, scale as attn_decode_partial; gate as attn_decode_combine; nw (its w),
//         eps, rope as qk_rope_pack (NEW only; any arrays otherwise)
// outputs: out [HKV*G*D]; kvnew [2, HKV, D] (NEW only; [2, HKV, cap, D] with THRU);
//          grid (NTF, HKV*G, 1) (THRU: HKV*G + ceil(2*HKV*cap*D/8 / (NTF*CPW)) threadgroups),
//          threadgroup (NTF, 1, 1);
// templates G, D, NTF (>= D), CMAX (32: a split's keys are a SIMD group's lanes), SMAX, HKV, GATE,
// GOFF, NEW, THRU, CPW (THRU: words a copying thread copies), and with NEW those of qk_rope_pack:
// NORM, ROPE, TRAD, RD, VOFF.
// D is 32, 64 or 128: lane l's output dimensions are VPL*l .. VPL*l + VPL - 1, VPL = D/32.
// Bound by latency: the first round's loads are issued before the q row is in threadgroup
// memory, and the serial chains run to constant bounds (with a guard), so their loads are
// issued ahead of the adds.
    const uint tid = thread_position_in_threadgroup.x;
    const uint lane = tid % 32u, sg = tid / 32u;
    const uint h = threadgroup_position_in_grid.y;
    const uint kvh = h / G;
    const int p_new = pos[0];
    const int cap = geom[0];
    if (THRU && h >= HKV * G) {
        // a copy threadgroup: CPW 16-byte words of the planes a thread, all loaded, then stored, but
        // the token's slot (its query heads' threadgroups write that row)
        const uint words = 2u * HKV * uint(cap) * uint(D / 8);
        const uint first = (h - HKV * G) * uint(NTF) * CPW + tid;
        uint4 cw[CPW];
        for (uint k = 0; k < CPW; ++k)
            if (first + k * NTF < words) cw[k] = ((device const uint4*)kv)[first + k * NTF];
        for (uint k = 0; k < CPW; ++k) {
            const uint i = first + k * NTF;
            if (i < words && int((i / uint(D / 8)) % uint(cap)) != p_new % cap) ((device uint4*)kvnew)[i] = cw[k];
        }
        return;
    }
    const int window = geom[1];
    const int lo = first_visible(p_new, window);
    const int n = p_new - lo + 1;
    const int used = splits_used(n, CMAX);
    constexpr int NSG = NTF / 32;
    constexpr int VPL = D / 32;
    threadgroup float qs[D];
    threadgroup float pk[NSG * CMAX];  // each SIMD group's exp(score - max) of its split, by key
    threadgroup float sm[SMAX];        // per split: max score,
    threadgroup float sl[SMAX];        // sum of exp,
    threadgroup float so[SMAX * D];    // unnormalized output
    // NEW: the head's q row and its KV head's k row normed (before RoPE), and the token's K and V
    // as the cache would hold them (f16, in 16-byte words as the cache rows are read)
    threadgroup float nrm[NEW ? 2 * D : 1];
    threadgroup uint4 knew4[NEW ? D / 8 : 1];
    threadgroup uint4 vnew4[NEW ? D / 8 : 1];
    device const half* kplane = kv + (ulong)kvh * cap * D;
    device const half* vplane = kv + ((ulong)HKV + kvh) * cap * D;
    // THRU: the token's K/V rows go to the planes' slot in kvnew (else a plane row apart)
    const int slot = p_new % cap;
    const ulong kv_plane = THRU ? (ulong)cap * D : (ulong)D;
    const ulong kv_slot = THRU ? (ulong)slot * D : 0ul;
    if (!NEW)
        for (uint i = tid; i < D; i += NTF) qs[i] = q[(ulong)h * D + i] * scale[0];
    const int rounds = (used + NSG - 1) / NSG;
    for (int r = 0; r < rounds; ++r) {
        const int s = r * NSG + int(sg);
        const int j0 = s * CMAX;  // split s holds keys j0 .. j0 + CMAX - 1 (those below n)
        const int cnt = max(0, min(n - j0, CMAX));  // 0: no split for this SIMD group this round
        // the lane's key row, and the split's value rows at the lane's dimensions (keys past the
        // split's end repeat its last key; they are not used)
        uint4 k8[D / 8];
        uint vlo[CMAX], vhi[CMAX];
        if (cnt > 0) {
            device const half* krow = kplane + (ulong)((lo + j0 + min(int(lane), cnt - 1)) % cap) * D;
            for (int w = 0; w < D / 8; ++w) k8[w] = *(device const uint4*)(krow + 8 * w);
            for (int jj = 0; jj < CMAX; ++jj) {
                device const half* vrow = vplane + (ulong)((lo + j0 + min(jj, cnt - 1)) % cap) * D + VPL * lane;
                if (VPL == 4) {
                    const uint2 w2 = *(device const uint2*)vrow;
                    vlo[jj] = w2.x;
                    vhi[jj] = w2.y;
                } else if (VPL == 2) {
                    vlo[jj] = *(device const uint*)vrow;
                    vhi[jj] = 0u;
                } else {
                    vlo[jj] = uint(*(device const ushort*)vrow);
                    vhi[jj] = 0u;
                }
            }
        }
        if (NEW && r == 0) {
            // qk_rope_pack's work for this head, at NTH = 32 (D <= 128: a float4 a lane): SIMD group
            // 0 the q row, 1 the k row, 2 the value row; issued after the first round's loads
            const bool own = sg < 2u;
            const uint row = sg == 0u ? h : HKV * G + kvh;  // query heads, then key heads, in y
            float4 xv, wv;
            float cv[VPL], sv[VPL];
            if (own) {
                if (lane < uint(D / 4)) {
                    xv = ((device const float4*)(q + (ulong)row * D))[lane];
                    if (NORM) wv = ((device const float4*)(nw + (ulong)row * D))[lane];
                }
                const float L = rope[0] * float(p_new);
                for (int k = 0; k < VPL; ++k) {
                    const uint i = lane + 32u * uint(k);
                    if (ROPE && i < uint(RD)) {
                        const float theta = L * rope[1 + rope_freq(i, RD, TRAD)];
                        cv[k] = cos(theta);
                        sv[k] = sin(theta);
                    }
                }
                float scl = 1.0f;
                if (NORM) {  // rms_norm_mul's reduction at one SIMD group (its second simd_sum, over
                             // the group totals padded with zeros, adds only zeros: the identity)
                    float sumf = 0.0f;
                    if (lane < uint(D / 4)) sumf += dot(xv, xv);
                    sumf = simd_sum(sumf);
                    const float mean = sumf / float(D);
                    scl = 1.0f / sqrt(mean + eps[0]);
                }
                if (lane < uint(D / 4)) {
                    float4 v = xv;
                    if (NORM) v = (v * scl) * wv;
                    for (int e = 0; e < 4; ++e) nrm[sg * D + 4 * lane + e] = v[e];
                }
            } else if (sg == 2u) {
                for (uint i = lane; i < uint(D); i += 32u) {
                    const half v = half(q[VOFF + kvh * D + i]);
                    ((MUSE_TG half*)vnew4)[i] = v;
                    if (h % G == 0u) kvnew[(HKV + kvh) * kv_plane + kv_slot + i] = v;
                }
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);  // nrm is written
            if (own) {
                for (int k = 0; k < VPL; ++k) {  // RoPE as qk_rope_pack
                    const uint i = lane + 32u * uint(k);
                    float o = nrm[sg * D + i];
                    if (ROPE && i < uint(RD))
                        o = rope_rotate(o, nrm[sg * D + rope_partner(i, RD, TRAD)], cv[k], sv[k], rope_first(i, RD, TRAD));
                    if (sg == 0u) {
                        qs[i] = o * scale[0];
                    } else {
                        const half kh = half(o);
                        ((MUSE_TG half*)knew4)[i] = kh;
                        if (h % G == 0u) kvnew[kvh * kv_plane + kv_slot + i] = kh;
                    }
                }
            }
        }
        if (r == 0) threadgroup_barrier(mem_flags::mem_threadgroup);  // qs (and NEW: the token's K, V) written
        if (NEW && cnt > 0 && j0 + cnt == n) {
            // this split ends with the token itself (key n - 1, split slot cnt - 1): its key and value
            // from threadgroup memory (the cache's slot is written after this dispatch)
            if (int(lane) >= cnt - 1)
                for (int w = 0; w < D / 8; ++w) k8[w] = knew4[w];
            for (int jj = 0; jj < CMAX; ++jj) {
                if (jj >= cnt - 1) {
                    if (VPL == 4) {
                        const uint2 w2 = ((MUSE_TG const uint2*)vnew4)[lane];
                        vlo[jj] = w2.x;
                        vhi[jj] = w2.y;
                    } else if (VPL == 2) {
                        vlo[jj] = ((MUSE_TG const uint*)vnew4)[lane];
                    } else {
                        vlo[jj] = uint(((MUSE_TG const ushort*)vnew4)[lane]);
                    }
                }
            }
        }
        if (cnt > 0) {
            float acc = 0.0f;
            for (int w = 0; w < D / 8; ++w)
                for (int e = 0; e < 8; ++e) acc = fma(qs[8 * w + e], half_of(k8[w], uint(e)), acc);
            const float m = simd_max(int(lane) < cnt ? acc : -INFINITY);  // max: any order
            pk[sg * CMAX + lane] = int(lane) < cnt ? exp(acc - m) : 0.0f;
            if (lane == 0u) sm[s] = m;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (cnt > 0) {
            // the split's CMAX weights (every lane wrote one, 0 past cnt) read before either chain,
            // all at once: the chains then wait on no load (read inside them, under their guards,
            // each step waited for its own)
            float pj[CMAX];
            for (int jj = 0; jj < CMAX; ++jj) pj[jj] = pk[sg * CMAX + jj];
            if (lane == 0u) {
                float l = 0.0f;
                for (int jj = 0; jj < CMAX; ++jj)
                    if (jj < cnt) l += pj[jj];
                sl[s] = l;
            }
            float o[VPL];
            for (int e = 0; e < VPL; ++e) o[e] = 0.0f;
            for (int jj = 0; jj < CMAX; ++jj) {  // a constant trip count: vlo, vhi stay in registers
                if (jj < cnt) {
                    for (int e = 0; e < VPL; ++e) {
                        o[e] = fma(pj[jj], half_in_word(e < 2 ? vlo[jj] : vhi[jj], uint(e)), o[e]);
                    }
                }
            }
            for (int e = 0; e < VPL; ++e) so[s * D + VPL * int(lane) + e] = o[e];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);  // pk is rewritten next round; sm, sl, so read below
    }
    // the combine, as attn_decode_combine: one thread per dimension, the splits in order
    float o = 0.0f;  // (read after the body by part q8_out_attn)
    if (tid < uint(D)) {
        float m_all = -INFINITY;
        for (int s = 0; s < SMAX; ++s)
            if (s < used) m_all = max(m_all, sm[s]);
        float num = 0.0f, den = 0.0f;
        for (int s = 0; s < SMAX; ++s) {
            if (s < used) {
                const float w = exp(sm[s] - m_all);
                num = fma(w, so[s * D + int(tid)], num);
                den = fma(w, sl[s], den);
            }
        }
        o = num / den;
        if (GATE) o = attn_gate(o, gate[GOFF + h * D + tid]);
        out[h * D + tid] = o;
    }

// ==== part: q8_out_attn
// OPT-IN, NOT EXACT (flag mv_q8; MUSE_MLX_Q8_ATTN=1): appended to attn_decode_fused's body (kernel
// attn_decode_fused_q8), so that the attention also writes its output as quantize_q8 would, for
// the q8 attn_output after it, which then reads it through mul_mv_q8_pre instead of quantizing
// per threadgroup (at 32 lanes a row the same bits). A head's D outputs are D/32 groups of 32,
// each one SIMD group's lanes (q8_group_lanes); the float output is the plain kernel's.
// outputs also: oqy [HKV*G*D/4] (uint32), ods [HKV*G*D/16] (per group: d, float(sum q))
    if (tid < uint(D)) q8_group_lanes(o, lane, (ulong)h * (D / 32) + sg, oqy, ods);
