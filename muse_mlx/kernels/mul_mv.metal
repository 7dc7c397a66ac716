// Quantized matrix-vector products over raw GGUF blocks, with llama.cpp's lane arithmetic
// (kernel_mul_mv_q4_K_f32 / kernel_mul_mv_q6_K_f32, ggml-metal mul_mv.metal), written from
// llama-cpp-facts.md A.2/A.3. What fixes the bits: which lane reads which values of which
// block, the order of every float operation inside a lane, and the xor-butterfly simd_sum
// over the 32 lanes of one row. What does not: how many rows a SIMD group takes (NR0), how
// many SIMD groups share a threadgroup (NSG), and how the bytes are loaded -- so those are
// template arguments, ggml's geometry is NR0 = NSG = 2, and every geometry gives ggml's bits
// (tested on the CPU emulator and on the GPU). Every multiply that feeds an add is an explicit
// fma(), in the shape a fast-math compile of ggml's expressions contracts to.
// dst[t, r] = sum_k W[r, k] * y[t, k]; W is [ROWS, K] in blocks of 256; one token per grid z.

// ==== header
// float(v) for an integer v < 2^23, without the integer-to-float unit (a quarter-rate unit on
// NVIDIA): v in the mantissa of 2^23, minus 2^23. Both steps are exact, so the value is float(v).
// `magic` is that 2^23 pattern (0x4B000000), passed in a register whose value the compiler
// cannot know (see q4K_lane_sums): then `(w & mask) | magic` is one three-input logic op (LOP3)
// per weight on NVIDIA, where two constant operands cost two. Same value, same bits.
MUSE_FN float u2f_m(uint v, uint magic) { return as_type<float>(magic | v) - 8388608.0f; }

// Half h (0 low, 1 high) of a word whose two 16-bit halves each hold a value v < 1024 (a 4-bit
// field masked in place): as a half that is the subnormal v * 2^-24, and converting it to float
// is exact and one instruction on NVIDIA (HADD2.F32), where the 2^23 pattern above takes two
// (LOP3, FADD) per value and the mask here is one per two values. The lane's activations are
// scaled up to match (q4K_scale_y), so every product is the reference's, exactly.
MUSE_FN float half_field(uint w, uint h) { return float(as_type<half>(ushort(h != 0u ? w >> 16 : w & 0xFFFFu))); }

// Byte k of x in the mantissa of the pattern `magic` (0x4B000000): as_type<float> of it, minus
// 2^23, is float(byte). One byte-permute instruction on NVIDIA (k a constant), shift-and-mask
// elsewhere; the same word either way.
MUSE_FN uint byte_magic(uint x, uint k, uint magic) {
#if defined(__CUDA_ARCH__)
    return __byte_perm(x, magic, 0x7540u | k);  // bytes: x.k, magic.0, magic.1, magic.3
#else
    return ((x >> (8u * k)) & 0xFFu) | magic;
#endif
}

// Four bytes of the 8-byte pair (lo, hi), byte k of the result the one that nibble k of `sel`
// names (0-3 lo's bytes, 4-7 hi's): one byte-permute instruction on NVIDIA, shifts and masks
// elsewhere; the same word either way.
MUSE_FN uint byte_select(uint lo, uint hi, uint sel) {
#if defined(__CUDA_ARCH__)
    return __byte_perm(lo, hi, sel);
#else
    uint out = 0u;
    for (uint k = 0; k < 4u; ++k) {
        const uint i = (sel >> (4u * k)) & 7u;
        out |= (((i < 4u ? lo : hi) >> (8u * (i & 3u))) & 0xFFu) << (8u * k);
    }
    return out;
#endif
}

// c + the dot product of four unsigned bytes of a (0..255) with four signed bytes of b: one
// dp4a instruction on NVIDIA, the same integer arithmetic byte by byte elsewhere (exact either way).
MUSE_FN int dot4_i8(uint a, int b, int c) {
#if defined(__CUDA_ARCH__)
    return __dp4a(int(a), b, c);
#else
    return c + int(a & 0xFFu) * ((b << 24) >> 24) + int((a >> 8) & 0xFFu) * ((b << 16) >> 24)
             + int((a >> 16) & 0xFFu) * ((b << 8) >> 24) + int(a >> 24) * (b >> 24);
#endif
}

// Copies of 16 bytes from device into threadgroup memory that a SIMD group issues now and uses
// later (the staged weight loads, stage_copies). On NVIDIA from sm_80 on an asynchronous copy
// (cp.async): no register holds the bytes while they are in flight, stage_commit closes a group of
// them and stage_wait<N> waits until at most N groups are still in flight (this thread's copies;
// the other lanes' need a simdgroup_barrier after it). Elsewhere (older NVIDIA GPUs too) a plain
// copy, done at once: the same bytes, so the same bits.
MUSE_FN void stage_copy16(MUSE_TG uint4* dst, device const uint4* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((uint)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
#else
    *dst = *src;
#endif
}

MUSE_FN void stage_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
MUSE_FN void stage_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// The lane's eight scales and mins of a Q4_K block as floats, in the order q4K_block uses them:
// the scales of sub-blocks 2iq, 2iq+1, 2iq+4, 2iq+5, then their mins (ggml's get_scale_min_k4).
// HALVES < 2: the values themselves (the 2^23 pattern); ggml reads the strip as ushorts sc[0],
// sc[2], sc[4] at bytes 4, 8, 12 (+ 2*iq).
MUSE_FN void q4K_strip_floats(uint4 hd, uint iq, uint magic, thread float* v) {
    const uint sh = 16u * iq;
    const uint s0 = (hd.y >> sh) & 0xFFFFu;
    const uint s2 = (hd.z >> sh) & 0xFFFFu;
    const uint s4 = (hd.w >> sh) & 0xFFFFu;
    const uint c0 = s0 & 0x3f3fu;                                    // scales of sub-blocks 2iq, 2iq+1
    const uint c1 = s2 & 0x3f3fu;                                    // their mins
    const uint c2 = (s4 & 0x0f0fu) | ((s0 & 0xc0c0u) >> 2);          // scales of 2iq+4, 2iq+5
    const uint c3 = ((s4 >> 4) & 0x0f0fu) | ((s2 & 0xc0c0u) >> 2);   // their mins
    v[0] = u2f_m(c0 & 0xFFu, magic); v[1] = u2f_m(c0 >> 8, magic);
    v[2] = u2f_m(c2 & 0xFFu, magic); v[3] = u2f_m(c2 >> 8, magic);
    v[4] = u2f_m(c1 & 0xFFu, magic); v[5] = u2f_m(c1 >> 8, magic);
    v[6] = u2f_m(c3 & 0xFFu, magic); v[7] = u2f_m(c3 >> 8, magic);
}

// HALVES = 2: the same eight values times 2^-24, as subnormal halves. `sel` (0x4140 + 0x0202*iq)
// permutes the strip word's bytes 2iq, 2iq+1 into the low bytes of its two halves, the other
// bytes zero; then one mask gives two 6-bit values (the high strip word's nibbles take the two
// high bits from the low words, shifted to bits 4-5).
MUSE_FN void q4K_strip_halves(uint4 hd, uint sel, thread float* v) {
    const uint y = byte_select(hd.y, 0u, sel);  // scales 2iq, 2iq+1 (bits 0-5), high bits of 2iq+4, +5
    const uint z = byte_select(hd.z, 0u, sel);  // mins likewise
    const uint w = byte_select(hd.w, 0u, sel);  // low 4 bits of scales (low nibble), mins (high) of 2iq+4, +5
    const uint c0 = y & 0x003F003Fu;
    const uint c1 = z & 0x003F003Fu;
    const uint c2 = (w & 0x000F000Fu) | ((y >> 2) & 0x00300030u);
    const uint c3 = ((w >> 4) & 0x000F000Fu) | ((z >> 2) & 0x00300030u);
    v[0] = half_field(c0, 0u); v[1] = half_field(c0, 1u);
    v[2] = half_field(c2, 0u); v[3] = half_field(c2, 1u);
    v[4] = half_field(c1, 0u); v[5] = half_field(c1, 1u);
    v[6] = half_field(c3, 0u); v[7] = half_field(c3, 1u);
}

// One Q4_K block's contribution for lane (iq, ir), from its 16-byte header (d, dmin, 12 scale
// bytes) and its two 8-byte quant runs, in ggml's order: nibbles stay in place (x1, x256, x16,
// x4096) in four even/odd accumulators each, then d*(...) - dmin*(...). HALVES = 0: each nibble
// as float(w & mask) through the 2^23 pattern, against the activations as they are. HALVES = 1:
// the same nibble of a word's two ushorts at once as two subnormal halves (half_field): masks
// 0x000F and 0x00F0 in place give ggml's float(q & mask) times 2^-24; 0x0F00 and 0xF000, shifted
// down by 8 first, give it times 2^-32. So yl/yh must come scaled by 2^24 (even values, which meet
// the first two) and 2^32 (odd values): each product is then exactly ggml's.
// HALVES = 2: the nibbles as in 1, and the scales and mins as subnormal halves too
// (q4K_strip_halves: s * 2^-24). Each scale multiplies a sum of products (a0..b1) or a run sum
// (sumy), so those must come 2^24 larger for every product to stay ggml's: yl/yh scaled by 2^48
// (even) and 2^56 (odd), sumy by 2^24. Scaling up keeps every bit, subnormals included (each of
// ggml's lane products and sums is a multiple of 2^-149, so where ggml's is subnormal it is exact,
// and ours, 2^24 above it, is exact too), as long as nothing overflows: exact for |y| < 2^72.
// `sel` is q4K_strip_halves's (HALVES = 2 only).
template <int HALVES>
MUSE_FN float q4K_block(uint4 hd, uint2 qa, uint2 qb, uint iq, thread const float* yl,
                        thread const float* yh, float4 sumy, uint magic, uint sel) {
    const float d = float(as_type<half>(ushort(hd.x & 0xFFFFu)));
    const float dmin = float(as_type<half>(ushort(hd.x >> 16)));
    float sc[8];
    if (HALVES == 2) q4K_strip_halves(hd, sel, sc);
    else q4K_strip_floats(hd, iq, magic, sc);

    float4 acc1 = {0.0f, 0.0f, 0.0f, 0.0f};
    float4 acc2 = {0.0f, 0.0f, 0.0f, 0.0f};
    // Two loops, not one over a per-nibble helper: the halves form works a word (two ushorts) at
    // a time so that its mask and shift serve both; folded into one loop, nvcc/NVRTC 13.5 no
    // longer share them (12-14 % more instructions in the GLU's loop, tried in the tenth session).
    if (HALVES) {
        for (uint k = 0; k < 2; ++k) {  // word k of each run holds ggml's ushorts q1[2k], q1[2k+1]
            const uint wa = k == 0 ? qa.x : qa.y, wb = k == 0 ? qb.x : qb.y;
            const uint sa = wa >> 8, sb = wb >> 8;
            for (uint h = 0; h < 2; ++h) {
                const uint i = 2 * k + h;
                acc1[0] = fma(yl[2 * i + 0], half_field(wa & 0x000F000Fu, h), acc1[0]);
                acc1[1] = fma(yl[2 * i + 1], half_field(sa & 0x000F000Fu, h), acc1[1]);
                acc1[2] = fma(yl[2 * i + 8], half_field(wa & 0x00F000F0u, h), acc1[2]);
                acc1[3] = fma(yl[2 * i + 9], half_field(sa & 0x00F000F0u, h), acc1[3]);
                acc2[0] = fma(yh[2 * i + 0], half_field(wb & 0x000F000Fu, h), acc2[0]);
                acc2[1] = fma(yh[2 * i + 1], half_field(sb & 0x000F000Fu, h), acc2[1]);
                acc2[2] = fma(yh[2 * i + 8], half_field(wb & 0x00F000F0u, h), acc2[2]);
                acc2[3] = fma(yh[2 * i + 9], half_field(sb & 0x00F000F0u, h), acc2[3]);
            }
        }
    } else {
        for (uint i = 0; i < 4; ++i) {
            // ggml's ushort q1[i] is half i&1 of word i/2 of the 8-byte run
            const uint w1 = (i < 2 ? qa.x : qa.y) >> (16u * (i & 1u));
            const uint w2 = (i < 2 ? qb.x : qb.y) >> (16u * (i & 1u));
            acc1[0] = fma(yl[2 * i + 0], u2f_m(w1 & 0x000Fu, magic), acc1[0]);
            acc1[1] = fma(yl[2 * i + 1], u2f_m(w1 & 0x0F00u, magic), acc1[1]);
            acc1[2] = fma(yl[2 * i + 8], u2f_m(w1 & 0x00F0u, magic), acc1[2]);
            acc1[3] = fma(yl[2 * i + 9], u2f_m(w1 & 0xF000u, magic), acc1[3]);
            acc2[0] = fma(yh[2 * i + 0], u2f_m(w2 & 0x000Fu, magic), acc2[0]);
            acc2[1] = fma(yh[2 * i + 1], u2f_m(w2 & 0x0F00u, magic), acc2[1]);
            acc2[2] = fma(yh[2 * i + 8], u2f_m(w2 & 0x00F0u, magic), acc2[2]);
            acc2[3] = fma(yh[2 * i + 9], u2f_m(w2 & 0xF000u, magic), acc2[3]);
        }
    }
    // d*((A0+A1)*s0 + (A2+A3)*s1/16 + (B0+B1)*s4 + (B2+B3)*s5/16) - dmin*(Y0*m0 + ...)
    const float a0 = fma(1.0f / 256.0f, acc1[1], acc1[0]);
    const float a1 = fma(1.0f / 256.0f, acc1[3], acc1[2]);
    const float b0 = fma(1.0f / 256.0f, acc2[1], acc2[0]);
    const float b1 = fma(1.0f / 256.0f, acc2[3], acc2[2]);
    float scaled = (a1 * sc[1]) * (1.0f / 16.0f);
    scaled = fma(a0, sc[0], scaled);
    scaled = fma(b0, sc[2], scaled);
    scaled = fma(b1 * sc[3], 1.0f / 16.0f, scaled);
    float mins = sumy[1] * sc[5];
    mins = fma(sumy[0], sc[4], mins);
    mins = fma(sumy[2], sc[6], mins);
    mins = fma(sumy[3], sc[7], mins);
    return fma(d, scaled, -(dmin * mins));
}

// Values 4s .. 4s+3 of a run of Q4_K blocks, exactly as gguf-py dequantizes them. Value
// v = 32j + l of a block (sub-block j) is nibble j%2 of quant byte 32(j/2) + l.
MUSE_FN float4 q4K_dequant4(device const uchar* w, uint s) {
    const uint blk_i = s / 64, v = 4 * (s % 64), j = v / 32, l = v % 32;
    device const uchar* blk = w + (ulong)blk_i * 144u;
    const float d = float(*(device const half*)(blk + 0));
    const float dmin = float(*(device const half*)(blk + 2));
    device const uchar* q = blk + 4;  // the 12-byte scale strip (ggml's get_scale_min_k4)
    uint sc, m;
    if (j < 4) {
        sc = q[j] & 63u;
        m = q[j + 4] & 63u;
    } else {
        sc = (q[j + 4] & 0xFu) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
    const float scale = d * float(sc);
    const float mn = dmin * float(m);
    const uint bytes = (*(device const uint*)(blk + 16 + 32 * (j / 2) + l)) >> (4 * (j % 2));
    float4 out;
    for (int e = 0; e < 4; ++e) out[e] = scale * float((bytes >> (8 * e)) & 0xFu) - mn;
    return out;
}

// Four bytes from a 2-byte aligned address (Q6_K blocks are 210 bytes: only ushorts are aligned).
MUSE_FN uint load_u32_from_u16(device const uchar* p) {
    device const ushort* s = (device const ushort*)p;
    return uint(s[0]) | (uint(s[1]) << 16);
}

// Values 4s .. 4s+3 of a run of nb Q6_K blocks (gguf-py's bits). Value v = 128h + 32k + l: low
// nibble (k < 2) or high nibble of ql byte 64h + l + 32(k%2), high bits 2k.. of qh byte 32h + l.
// Raw blocks (SPLIT 0) are 210 bytes, 2-byte aligned: ushort loads. The split form (SPLIT 1,
// quants.split_q6_K) has 208-byte bodies, 16-byte aligned, and every block's half d after all
// of them: the same words, read whole.
template <int SPLIT>
MUSE_FN float4 q6K_dequant4(device const uchar* w, uint s, uint nb) {
    const uint blk_i = s / 64, v = 4 * (s % 64);
    const uint h = v / 128, k = (v % 128) / 32, l = v % 32;
    device const uchar* blk = w + (ulong)blk_i * (SPLIT ? 208u : 210u);
    device const uchar* dp = SPLIT ? w + (ulong)nb * 208u + 2u * blk_i : blk + 208;
    const float d = float(*(device const half*)dp);
    const float scale = d * float(int(as_type<char>(blk[192 + v / 16])));
    device const uchar* pl = blk + 64 * h + l + 32 * (k % 2);
    device const uchar* ph = blk + 128 + 32 * h + l;
    const uint lo = (SPLIT ? *(device const uint*)pl : load_u32_from_u16(pl)) >> (k < 2 ? 0u : 4u);
    const uint hi = (SPLIT ? *(device const uint*)ph : load_u32_from_u16(ph)) >> (2 * k);
    float4 out;
    for (int e = 0; e < 4; ++e) {
        const uint code = ((lo >> (8 * e)) & 0xFu) | (((hi >> (8 * e)) & 3u) << 4);
        out[e] = scale * float(int(code) - 32);
    }
    return out;
}

// Values 4s .. 4s+3 of a run of nb blocks of type TYPE (0 Q4_K, 1 Q6_K, 2 Q6_K split).
template <int TYPE>
MUSE_FN float4 dequant4(device const uchar* w, uint s, uint nb) {
    return TYPE == 0 ? q4K_dequant4(w, s) : q6K_dequant4<TYPE == 2>(w, s, nb);
}

// Where quad s of a Q4_K matrix's raw rows (NB blocks a row) lies in its tiles of TILE rows
// (quants.tile_q4_K_rows): block o = s / 64 is row o / NB's block o % NB. TILE = 1: s itself.
template <int TILE, int NB>
MUSE_FN uint q4K_tiled_quad(uint s) {
    if (TILE == 1) return s;
    constexpr uint nb = NB > 0 ? NB : 1;  // (NB = 0 goes with TILE = 1: no division by it is left)
    const uint o = s / 64, row = o / nb, j = o % nb;
    return (((row / TILE) * nb + j) * TILE + row % TILE) * 64 + s % 64;
}

// The weight loads of one round of U blocks (jb, jb+4, ...) of each of NR rows: per block-row
// the 16-byte header and the lane's two 8-byte quant runs. Past the row's end a block is read
// again, not used.
template <int NR, int U>
MUSE_FN void q4K_load_round(device const uchar* thread const* row, uint jb, uint nb, uint qoff,
                            thread uint4 (*hd)[NR], thread uint2 (*qa)[NR], thread uint2 (*qb)[NR]) {
    for (int u = 0; u < U; ++u) {
        const uint j = min(jb + 4u * u, nb - 1u);
        for (int r = 0; r < NR; ++r) {
            device const uchar* blk = row[r] + (ulong)j * 144u;
            hd[u][r] = *(device const uint4*)blk;
            qa[u][r] = *(device const uint2*)(blk + qoff);
            qb[u][r] = *(device const uint2*)(blk + qoff + 64u);
        }
    }
}

// Staged weight loads (the exact lanes with S > 0; U = 1). A round of a SIMD group reads BPR
// consecutive blocks of each of its NR rows (Q4_K: 4 of 144 bytes; Q6_K in the split form: 2 of
// 208), CPB 16-byte chunks a block, contiguous in each row; the group copies them into threadgroup
// memory S - 1 rounds ahead, NR * BPR * CPB copies spread over the lanes (lane-chunk k is chunk
// tiisg + 32k: `src[k]` its address in the next round to copy, `blk[k]` its block within a round),
// into slot i % S of S slots of NR * BPR * CPB uint4. Round i then waits for its slot, reads the
// lane's words from it (the same words the register loads read), and copies round i + S - 1 into
// the slot round i - 1 read, which every lane has finished with (the barrier). `left`: the blocks
// from the next round to copy to the row's end; blocks past it are not copied, and not used.
template <int NR, int CPB, int BPR>
MUSE_FN void stage_setup(device const uchar* thread const* row, uint tiisg, device const uchar* thread *src,
                         thread uint* blk) {
    constexpr int RC = CPB * BPR;  // chunks per row and round
    for (int k = 0; k < (NR * RC + 31) / 32; ++k) {
        const uint c = min(tiisg + 32u * k, uint(NR * RC - 1));
        src[k] = row[0];
        for (int r = 1; r < NR; ++r)  // row[c / RC] (a constant index: row[] stays in registers)
            if (c / RC == uint(r)) src[k] = row[r];
        src[k] += 16u * (c % RC);
        blk[k] = (c % RC) / CPB;
    }
}

template <int NR, int CPB, int BPR>
MUSE_FN void stage_copies(device const uchar* thread *src, thread const uint* blk, thread uint& left, uint tiisg,
                          MUSE_TG uint4* slot) {
    constexpr int CH = NR * CPB * BPR;
    if (left >= uint(BPR)) {  // a whole round (all but a row's last): no block to skip
        for (int k = 0; k < (CH + 31) / 32; ++k)
            if ((k + 1) * 32 <= CH || tiisg + 32u * k < uint(CH))
                stage_copy16(slot + tiisg + 32u * k, (device const uint4*)src[k]);
    } else {
        for (int k = 0; k < (CH + 31) / 32; ++k)
            if (((k + 1) * 32 <= CH || tiisg + 32u * k < uint(CH)) && blk[k] < left)
                stage_copy16(slot + tiisg + 32u * k, (device const uint4*)src[k]);
    }
    stage_commit();
    for (int k = 0; k < (CH + 31) / 32; ++k) src[k] += 16u * CPB * BPR;
    left = left > uint(BPR) ? left - uint(BPR) : 0u;
}

// Wait until round i's slot has landed, for every lane.
template <int S>
MUSE_FN void stage_ready() {
    stage_wait<S - 2>();                            // this lane's copies of round i have landed
    simdgroup_barrier(mem_flags::mem_threadgroup);  // and every lane's
}

// Round i's words from slot sl = i % S (a constant once the caller's loop, which runs S rounds a
// turn, is unrolled), then round i + S - 1's copies.
// Q4_K: the lane's header and quant runs.
template <int NR, int S>
MUSE_FN void q4K_stage_round(device const uchar* thread *src, thread const uint* blk, thread uint& left, uint tiisg,
                             uint ix, uint qoff, uint sl, MUSE_TG uint4* stage, thread uint4* hd, thread uint2* qa,
                             thread uint2* qb) {
    constexpr int CH = 36 * NR;
    stage_ready<S>();
    MUSE_TG const uchar* cur = (MUSE_TG const uchar*)(stage + sl * CH);
    for (int r = 0; r < NR; ++r) {
        MUSE_TG const uchar* b = cur + 576u * r + 144u * ix;
        hd[r] = *(MUSE_TG const uint4*)b;
        qa[r] = *(MUSE_TG const uint2*)(b + qoff);
        qb[r] = *(MUSE_TG const uint2*)(b + qoff + 64u);
    }
    stage_copies<NR, 9, 4>(src, blk, left, tiisg, stage + ((sl + S - 1) % S) * CH);
}

// The powers of two q4K_block<HALVES> needs an activation at an even (odd = 0) or odd position
// scaled by: HALVES = 1, 2^24 and 2^32 (exact for |y| < 2^96; beyond, the odd ones overflow where
// ggml's products would not); HALVES = 2, 2^48 and 2^56 (exact for |y| < 2^72). Its run sums: 1,
// and 2^24. The lanes (q4K_scale_y) and the tail that prepares their input (tail_q4) both use these.
template <int HALVES>
MUSE_FN float q4K_y_factor(uint odd) {
    return HALVES == 2 ? (odd ? 72057594037927936.0f : 281474976710656.0f) : (odd ? 4294967296.0f : 16777216.0f);
}
template <int HALVES>
MUSE_FN float q4K_sum_factor() { return HALVES == 2 ? 16777216.0f : 1.0f; }

// yl, yh as q4K_block<HALVES> takes them (q4K_y_factor).
template <int HALVES>
MUSE_FN void q4K_scale_y(thread float* yl, thread float* yh) {
    for (int j = 0; j < 16; ++j) {
        const float f = q4K_y_factor<HALVES>(uint(j & 1));
        yl[j] *= f;
        yh[j] *= f;
    }
}

// Lane sums of NA rows of matrix A (from row a, `ra` rows left) then NB rows of matrix B, all
// against one activation row y: the lane's values of y are loaded once per block and shared by
// every row, and the weight loads of a round of U blocks (ib, ib+4, ...) of every row are
// issued before any of them is used. With P > 0 each round's loads are issued P rounds
// earlier, before the arithmetic of the P rounds before (P + 1 sets of registers, taken in
// turn), so a SIMD group has loads in flight while it computes. Rows past the end read the
// last row again (the caller drops their sums). Blocks are added to each row's sum in ggml's
// order whatever U and P are. HALVES picks q4K_block's nibble form. PREP = 1 (HALVES > 0 only):
// y holds the activations already scaled as q4K_scale_y<HALVES> scales them and sy their run sums
// (HALVES = 2: times 2^24), as the tail that made them writes them (tail_q4: sy[32*block +
// 4*(4*iq + ir) + k] is the lane's sumy[k]), so neither is computed here; the bits are the same.
// S > 0 (U = 1; PP unused): the weights come through S slots of threadgroup memory `stage`, S - 1
// rounds ahead (q4K_stage_round), instead of registers; the same words, so the same bits.
template <int NA, int NB, int U, int PP, int HALVES, int PREP, int S>
MUSE_FN void q4K_lane_sums(device const uchar* a, uint ra, device const uchar* b, uint rb,
                           uint row_bytes, uint nb, device const float* y, device const float* sy,
                           uint tiisg, thread float* sumf, MUSE_TG uint4* stage) {
    constexpr int P = S ? S - 1 : PP;  // staged: S rounds a turn (constant slots), no register loads ahead
    static_assert(S == 0 || U == 1, "staged Q4_K loads take one block a round");
    const uint ix = tiisg / 8;   // lane = 8*ix + 4*iq + ir
    const uint iq = (tiisg % 8) / 4;
    const uint ir = tiisg % 4;
    const uint qoff = 16u + 32u * iq + 8u * ir;
    device const uchar* row[NA + NB];
    for (int r = 0; r < NA + NB; ++r) {
        row[r] = r < NA ? a + (ulong)min(uint(r), ra - 1u) * row_bytes : b + (ulong)min(uint(r - NA), rb - 1u) * row_bytes;
        sumf[r] = 0.0f;
    }
    device const float* yb = y + ix * 256 + 64 * iq + 8 * ir;
    const uint magic = 0x4B000000u | (tiisg >> 5);  // tiisg < 32, so exactly the pattern -- in a register
    const uint sel = 0x4140u + 0x0202u * iq;        // q4K_strip_halves's byte permute (HALVES = 2)
    uint4 hd[P + 1][U][NA + NB];
    uint2 qa[P + 1][U][NA + NB];
    uint2 qb[P + 1][U][NA + NB];
    // S > 0: the first S - 1 rounds' copies (q4K_stage_round); every lane runs ceil(nb/4) rounds,
    // those past its last block too, since the copies and barriers are the SIMD group's
    device const uchar* src[S ? (36 * (NA + NB) + 31) / 32 : 1];
    uint blk[S ? (36 * (NA + NB) + 31) / 32 : 1];
    uint left = nb;
    if (S) {
        stage_setup<NA + NB, 9, 4>(row, tiisg, src, blk);
        for (int e = 0; e + 1 < S; ++e) stage_copies<NA + NB, 9, 4>(src, blk, left, tiisg, stage + e * 36 * (NA + NB));
    }
    for (int e = 0; e < (S ? 0 : P); ++e)  // the first P rounds' loads
        q4K_load_round<NA + NB, U>(row, ix + 4u * U * e, nb, qoff, hd[e], qa[e], qb[e]);
    for (uint ib = ix; (S ? ib - ix : ib) < nb; ib += 4 * U * (P + 1)) {
#pragma unroll
        for (int s = 0; s <= P; ++s) {  // s: the set of registers this round computes from
            const uint cb = ib + 4u * U * s;
            if (s == 0 || (S ? cb - ix : cb) < nb) {  // not `break`: s must stay a constant (see below)
            // P = 0: this round's loads; else those P rounds ahead, into the set used last
            if (S)
                q4K_stage_round<NA + NB, S>(src, blk, left, tiisg, ix, qoff, uint(s), stage, hd[s][0], qa[s][0], qb[s][0]);
            else
                q4K_load_round<NA + NB, U>(row, cb + 4u * U * P, nb, qoff, hd[(s + P) % (P + 1)],
                                           qa[(s + P) % (P + 1)], qb[(s + P) % (P + 1)]);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (cb + 4u * u < nb) {  // not `break`: the loop must unroll, or hd/qa/qb go to local memory
                // yl = values 64iq+8ir+{0..7} and +32; yh = the same +128; sumy[k] sums each run of 8
                device const float4* y4 = (device const float4*)(yb + (cb - ix + 4u * u) * 256u);
                float yl[16];
                float yh[16];
                const float4 v0 = y4[0], v1 = y4[1], v2 = y4[8], v3 = y4[9];
                const float4 v4 = y4[32], v5 = y4[33], v6 = y4[40], v7 = y4[41];
                for (int j = 0; j < 4; ++j) {
                    yl[j] = v0[j]; yl[j + 4] = v1[j]; yl[j + 8] = v2[j]; yl[j + 12] = v3[j];
                    yh[j] = v4[j]; yh[j + 4] = v5[j]; yh[j + 8] = v6[j]; yh[j + 12] = v7[j];
                }
                float4 sumy = {0.0f, 0.0f, 0.0f, 0.0f};
                if (PREP) {
                    sumy = *(device const float4*)(sy + (cb + 4u * u) * 32u + 4u * (4u * iq + ir));
                } else {
                    for (int j = 0; j < 8; ++j) {
                        sumy[0] += yl[j];
                        sumy[1] += yl[j + 8];
                        sumy[2] += yh[j];
                        sumy[3] += yh[j + 8];
                    }
                    if (HALVES) q4K_scale_y<HALVES>(yl, yh);
                    if (HALVES == 2)
                        for (int k = 0; k < 4; ++k) sumy[k] *= q4K_sum_factor<HALVES>();
                }
                for (int r = 0; r < NA + NB; ++r)
                    sumf[r] += q4K_block<HALVES>(hd[s][u][r], qa[s][u][r], qb[s][u][r], iq, yl, yh, sumy, magic, sel);
                }
            }
            }
        }
    }
}

// The weight loads of one round of U Q6_K blocks (jb, jb+2, ...) of each of NR rows: the lane's
// three quant words, its four int8 scales (one per byte) and d. `lane[r]` is row r's first block
// plus the lane's first quant offset; the lane's other fields sit at the same distances from it
// in every block (to_h, to_sc, to_d), so a block's loads need one sum, lane[r] + 210j. (Offsets
// from the block's start, as ggml writes them, cost NVIDIA 9 % more instructions in the
// ffn_down's loop: address arithmetic per field.) Past the row's end a block is read again, not used.
// SPLIT = 1 reads the split form (quants.split_q6_K: 208-byte bodies at 16-byte boundaries, the
// d's apart, `dl[r]` row r's): the same bytes, so the same words, in four loads where the raw
// 2-byte aligned blocks take eleven: three whole words, the 8 aligned scale bytes around the
// lane's four (byte_select picks them with `sc_sel`), and d. WORDS = 0: d alone.
template <int NR, int U, int SPLIT, int WORDS>
MUSE_FN void q6K_load_round(device const uchar* thread const* lane, device const half* thread const* dl,
                            uint jb, uint nb, uint to_h, uint to_sc, uint to_d, uint sc_sel,
                            thread uint (*ql1)[NR], thread uint (*ql2)[NR], thread uint (*qh)[NR],
                            thread uint (*sc)[NR], thread float (*d)[NR]) {
    for (int u = 0; u < U; ++u) {
        const uint j = min(jb + 2u * u, nb - 1u);
        for (int r = 0; r < NR; ++r) {
            if (!WORDS) {  // d alone (the staged form's words come through threadgroup memory)
                d[u][r] = float(dl[r][j]);
            } else if (SPLIT == 1) {
                device const uchar* q = lane[r] + j * 208u;
                ql1[u][r] = *(device const uint*)q;
                ql2[u][r] = *(device const uint*)(q + 32);
                qh[u][r] = *(device const uint*)(q + to_h);
                const uint2 w = *(device const uint2*)(q + to_sc);
                sc[u][r] = byte_select(w.x, w.y, sc_sel);
                d[u][r] = float(dl[r][j]);
            } else {
                device const uchar* q = lane[r] + j * 210u;
                ql1[u][r] = load_u32_from_u16(q);
                ql2[u][r] = load_u32_from_u16(q + 32);
                qh[u][r] = load_u32_from_u16(q + to_h);
                // the lane's four int8 scales sc[is], sc[is+2], sc[is+4], sc[is+6], one per byte
                device const uchar* s = q + to_sc;
                sc[u][r] = uint(s[0]) | (uint(s[2]) << 8) | (uint(s[4]) << 16) | (uint(s[6]) << 24);
                d[u][r] = float(*(device const half*)(q + to_d));
            }
        }
    }
}

// The staged form of a Q6_K round (split form; q6K_lane_sums with S > 0): the lane's three quant
// words and four scales from slot sl, as q6K_load_round reads them from the blocks (`off` is the
// lane's quant offset q_offset_l, to_h and to_sc as there); then round i + S - 1's copies.
template <int NR, int S>
MUSE_FN void q6K_stage_round(device const uchar* thread *src, thread const uint* blk, thread uint& left, uint tiisg,
                             uint ix, uint off, uint to_h, uint to_sc, uint sc_sel, uint sl, MUSE_TG uint4* stage,
                             thread uint* ql1, thread uint* ql2, thread uint* qh, thread uint* sc) {
    constexpr int CH = 26 * NR;
    stage_ready<S>();
    MUSE_TG const uchar* cur = (MUSE_TG const uchar*)(stage + sl * CH);
    for (int r = 0; r < NR; ++r) {
        MUSE_TG const uchar* q = cur + 416u * r + 208u * ix + off;
        ql1[r] = *(MUSE_TG const uint*)q;
        ql2[r] = *(MUSE_TG const uint*)(q + 32);
        qh[r] = *(MUSE_TG const uint*)(q + to_h);
        const uint2 w = *(MUSE_TG const uint2*)(q + to_sc);
        sc[r] = byte_select(w.x, w.y, sc_sel);
    }
    stage_copies<NR, 13, 2>(src, blk, left, tiisg, stage + ((sl + S - 1) % S) * CH);
}

// Q6_K (210-byte blocks, d at the end): lane = 2*tid + ix, tid = 8*ip + il; lane (ip, il, ix)
// walks blocks ix, ix+2, ... and reads 4 values from each of 4 runs of 32 (ggml's order).
// Blocks are 2-byte aligned, so quants are read as ushorts. As for Q4_K, the loads of a round of
// U blocks (i, i+2, ...) of every row are issued before any is used, with P > 0 P rounds
// earlier still; blocks are added in ggml's order. SPLIT = 1: the matrices are in the split form
// (q6K_load_round), `a`/`b` their first rows' bodies (row_bytes = 208 nb apart) and `ad`/`bd` their
// first rows' d's (nb apart); the words, so the arithmetic and the bits, are the raw form's.
template <int NA, int NB, int U, int PP, int SPLIT, int S>
MUSE_FN void q6K_lane_sums(device const uchar* a, uint ra, device const uchar* b, uint rb,
                           uint row_bytes, uint nb, device const float* y, uint tiisg,
                           thread float* sumf, device const half* ad, device const half* bd, MUSE_TG uint4* stage) {
    constexpr int P = S ? S - 1 : PP;  // staged: S rounds a turn (constant slots); d still P rounds ahead
    static_assert(S == 0 || (SPLIT == 1 && U == 1), "staged Q6_K loads take the split form, one block a round");
    const uint tid = tiisg / 2;
    const uint ix = tiisg % 2;
    const uint ip = tid / 8;
    const uint il = tid % 8;
    const uint l0 = 4 * il;
    const uint is = 8 * ip + l0 / 16;
    const uint q_offset_l = 64 * ip + l0;
    const uint q_offset_h = 128 + 32 * ip + l0;
    const uint magic = 0x4B000000u | (tiisg >> 5);  // the 2^23 pattern, in a register (see u2f_m)
    device const uchar* lane[NA + NB];
    device const half* dl[NA + NB];
    for (int r = 0; r < NA + NB; ++r) {
        const uint rr = r < NA ? min(uint(r), ra - 1u) : min(uint(r - NA), rb - 1u);
        lane[r] = (r < NA ? a : b) + (ulong)rr * row_bytes + q_offset_l;
        dl[r] = (r < NA ? ad : bd) + (ulong)rr * nb;
        sumf[r] = 0.0f;
    }
    const uint to_h = q_offset_h - q_offset_l, to_d = 208u - q_offset_l;
    // split: the aligned 8 scale bytes 192 + 8ip.. hold the lane's is, is+2, is+4, is+6 (is - 8ip = il/4)
    const uint to_sc = SPLIT == 1 ? 192u + 8u * ip - q_offset_l : 192u + is - q_offset_l;
    const uint sc_sel = il / 4 ? 0x7531u : 0x6420u;
    uint ql1[P + 1][U][NA + NB];
    uint ql2[P + 1][U][NA + NB];
    uint qh[P + 1][U][NA + NB];
    uint sc[P + 1][U][NA + NB];
    float d[P + 1][U][NA + NB];
    // S > 0: the rows' first S - 1 rounds' copies (stage_copies), every lane ceil(nb/2) rounds
    device const uchar* src[S ? (26 * (NA + NB) + 31) / 32 : 1];
    uint blk[S ? (26 * (NA + NB) + 31) / 32 : 1];
    uint left = nb;
    if (S) {
        device const uchar* row[NA + NB];
        for (int r = 0; r < NA + NB; ++r) row[r] = lane[r] - q_offset_l;
        stage_setup<NA + NB, 13, 2>(row, tiisg, src, blk);
        for (int e = 0; e + 1 < S; ++e) stage_copies<NA + NB, 13, 2>(src, blk, left, tiisg, stage + e * 26 * (NA + NB));
    }
    for (int e = 0; e < P; ++e)  // the first P rounds' loads (staged: their d's)
        q6K_load_round<NA + NB, U, SPLIT, S ? 0 : 1>(lane, dl, ix + 2u * U * e, nb, to_h, to_sc, to_d, sc_sel,
                                                     ql1[e], ql2[e], qh[e], sc[e], d[e]);
    for (uint i = ix; (S ? i - ix : i) < nb; i += 2 * U * (P + 1)) {
#pragma unroll
        for (int s = 0; s <= P; ++s) {  // s: the set of registers this round computes from
            const uint ci = i + 2u * U * s;
            if (s == 0 || (S ? ci - ix : ci) < nb) {  // not `break` (see q4K_lane_sums)
            const int ls = (s + P) % (P + 1);  // P = 0: this round's loads; else those P rounds ahead
            if (S)
                q6K_stage_round<NA + NB, S>(src, blk, left, tiisg, ix, q_offset_l, to_h, to_sc, sc_sel, uint(s), stage,
                                            ql1[s][0], ql2[s][0], qh[s][0], sc[s][0]);
            q6K_load_round<NA + NB, U, SPLIT, S ? 0 : 1>(lane, dl, ci + 2u * U * P, nb, to_h, to_sc, to_d, sc_sel,
                                                         ql1[ls], ql2[ls], qh[ls], sc[ls], d[ls]);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (ci + 2u * u < nb) {  // not `break`: the loop must unroll (see q4K_lane_sums)
                // yl[4l + k] = y[l + 32k] (ggml's order); each run of four is one 16-byte load
                device const float4* yy = (device const float4*)(y + (ci + 2u * u) * 256 + 128 * ip + l0);
                float yl[16];
                for (int k = 0; k < 4; ++k) {
                    const float4 v = yy[8 * k];
                    for (int l = 0; l < 4; ++l) yl[4 * l + k] = v[l];
                }
                for (int r = 0; r < NA + NB; ++r) {
                    // the 6-bit codes of values l = 0..3 of the four runs, one byte each, four to a word:
                    // run 0 = low nibbles of ql1 | qh bits 0-1, run 1 = ql2 | bits 2-3, run 2 = high
                    // nibbles of ql1 | bits 4-5, run 3 = ql2 | bits 6-7
                    const uint code0 = (ql1[s][u][r] & 0x0F0F0F0Fu) | ((qh[s][u][r] << 4) & 0x30303030u);
                    const uint code1 = (ql2[s][u][r] & 0x0F0F0F0Fu) | ((qh[s][u][r] << 2) & 0x30303030u);
                    const uint code2 = ((ql1[s][u][r] >> 4) & 0x0F0F0F0Fu) | (qh[s][u][r] & 0x30303030u);
                    const uint code3 = ((ql2[s][u][r] >> 4) & 0x0F0F0F0Fu) | ((qh[s][u][r] >> 2) & 0x30303030u);
                    float4 sums = {0.0f, 0.0f, 0.0f, 0.0f};
                    for (int l = 0; l < 4; ++l) {
                        // (6-bit code) - 32, exactly: the code in the mantissa of 2^23, minus 2^23 + 32
                        sums[0] = fma(yl[4 * l + 0], as_type<float>(byte_magic(code0, uint(l), magic)) - 8388640.0f, sums[0]);
                        sums[1] = fma(yl[4 * l + 1], as_type<float>(byte_magic(code1, uint(l), magic)) - 8388640.0f, sums[1]);
                        sums[2] = fma(yl[4 * l + 2], as_type<float>(byte_magic(code2, uint(l), magic)) - 8388640.0f, sums[2]);
                        sums[3] = fma(yl[4 * l + 3], as_type<float>(byte_magic(code3, uint(l), magic)) - 8388640.0f, sums[3]);
                    }
                    // sumf += d * (S0*sc[0] + S1*sc[2] + S2*sc[4] + S3*sc[6]), the int8 scales exact in float
                    // (an int8 s as s + 128 in the mantissa of 2^23, minus 2^23 + 128: exact, no I2F)
                    const uint sx = sc[s][u][r] ^ 0x80808080u;
                    const float s0 = as_type<float>(byte_magic(sx, 0u, magic)) - 8388736.0f;
                    const float s2 = as_type<float>(byte_magic(sx, 1u, magic)) - 8388736.0f;
                    const float s4 = as_type<float>(byte_magic(sx, 2u, magic)) - 8388736.0f;
                    const float s6 = as_type<float>(byte_magic(sx, 3u, magic)) - 8388736.0f;
                    float scaled = sums[1] * s2;
                    scaled = fma(sums[0], s0, scaled);
                    scaled = fma(sums[2], s4, scaled);
                    scaled = fma(sums[3], s6, scaled);
                    sumf[r] = fma(d[s][u][r], scaled, sumf[r]);
                }
                }
            }
            }
        }
    }
}

// The row sums of one SIMD group: NR0 rows of a [rows, K] Q4_K matrix; HALVES, PREP, y and sy as
// q4K_lane_sums takes them; S and `stage` too (the SIMD group's S * 36 * NR0 uint4 of threadgroup
// memory when S > 0). (The lone kernels call the helper of their own type, so that the source
// MLX hashes at every launch holds no other type's lanes: docs/kernels.md, "A kernel's source".)
template <int NR0, int U, int P, int HALVES, int PREP, int S>
MUSE_FN void row_sums_q4K(device const uchar* w, uint first_row, uint rows, uint nb, device const float* y,
                          device const float* sy, uint tiisg, thread float* sumf, MUSE_TG uint4* stage) {
    const uint row_bytes = nb * 144u;
    device const uchar* a = w + (ulong)first_row * row_bytes;
    q4K_lane_sums<NR0, 0, U, P, HALVES, PREP, S>(a, rows - first_row, a, 1u, row_bytes, nb, y, sy, tiisg, sumf, stage);
}

// The same for Q6_K (SPLIT 1: the split form, whose d's follow all `rows` rows' bodies; S and
// `stage` only there, the SIMD group's S * 26 * NR0 uint4); y as it is.
template <int SPLIT, int NR0, int U, int P, int S>
MUSE_FN void row_sums_q6K(device const uchar* w, uint first_row, uint rows, uint nb, device const float* y,
                          uint tiisg, thread float* sumf, MUSE_TG uint4* stage) {
    const uint row_bytes = nb * (SPLIT ? 208u : 210u);
    device const uchar* a = w + (ulong)first_row * row_bytes;
    device const half* ad = (device const half*)(w + (ulong)rows * nb * 208u) + (ulong)first_row * nb;
    q6K_lane_sums<NR0, 0, U, P, SPLIT, SPLIT ? S : 0>(a, rows - first_row, a, 1u, row_bytes, nb, y, tiisg, sumf, ad,
                                                      ad, stage);
}

// Either, by TYPE (0 Q4_K, 1 Q6_K, 2 Q6_K split): the multi kernel's slots.
template <int TYPE, int NR0, int U, int P, int HALVES, int PREP, int S>
MUSE_FN void row_sums(device const uchar* w, uint first_row, uint rows, uint nb, device const float* y,
                      device const float* sy, uint tiisg, thread float* sumf, MUSE_TG uint4* stage) {
    if (TYPE == 0)
        row_sums_q4K<NR0, U, P, HALVES, PREP, S>(w, first_row, rows, nb, y, sy, tiisg, sumf, stage);
    else
        row_sums_q6K<TYPE == 2 ? 1 : 0, NR0, U, P, TYPE == 2 ? S : 0>(w, first_row, rows, nb, y, tiisg, sumf, stage);
}

// -- the opt-in int8-activation (q8) matvecs: NOT exact (flag mv_q8) --

// One group of 32 activations -> int8 as llama.cpp's CUDA quantize_q8_1: d = max|y|/127,
// q = round(y/d) (half away from zero), packed four to a word (little-endian), and sum q
// (exact: |sum| <= 32*127). One thread per group, no shuffles.
MUSE_FN void q8_group(device const float* src, thread int4& lo, thread int4& hi, thread float& d,
                      thread int& sum) {
    device const float4* v4 = (device const float4*)src;
    float4 v[8];
    for (int i = 0; i < 8; ++i) v[i] = v4[i];
    float amax = 0.0f;
    for (int i = 0; i < 8; ++i)
        for (int e = 0; e < 4; ++e) amax = max(amax, fabs(v[i][e]));
    d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    sum = 0;
    uint word[8];  // values 4i .. 4i+3
    for (int i = 0; i < 8; ++i) {
        word[i] = 0u;
        for (int e = 0; e < 4; ++e) {
            const int q = int(round(v[i][e] * id));
            sum += q;
            word[i] |= (uint(q) & 0xFFu) << (8u * uint(e));
        }
    }
    lo.x = int(word[0]); lo.y = int(word[1]); lo.z = int(word[2]); lo.w = int(word[3]);
    hi.x = int(word[4]); hi.y = int(word[5]); hi.z = int(word[6]); hi.w = int(word[7]);
}

// One group of 32 values, value `lane` of it in each lane of a whole SIMD group, quantized as
// q8_group quantizes them, into group G of quantize_q8's layout (words 8G .. 8G+7 of oqy; d and
// float(sum q) at 2G, 2G+1 of ods): the maximum by a butterfly of fmax (exact in any order, and
// from 0 as q8_group's loop is, so a NaN drops out the same way), the same d, 1/d and rounding per
// value, the sum of the q by an integer butterfly (exact), each word put together from four
// lanes' bytes. Every lane of the SIMD group must call it.
MUSE_FN void q8_group_lanes(float v, uint lane, ulong G, device uint* oqy, device float* ods) {
    const float amax = simd_max(max(fabs(v), 0.0f));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = int(round(v * id));
    uint word = (uint(q) & 0xFFu) << (8u * (lane % 4u));
    word |= simd_shuffle_xor(word, 1u);
    word |= simd_shuffle_xor(word, 2u);
    uint sum = uint(q);
    for (uint off = 16; off > 0; off >>= 1) sum += simd_shuffle_xor(sum, off);
    if (lane % 4u == 0u) oqy[8 * G + lane / 4u] = word;
    if (lane == 0u) {
        ods[2 * G] = d;
        ods[2 * G + 1] = float(int(sum));
    }
}

// One Q4_K run (the 32 quant bytes of sub-blocks 2tq, 2tq+1 of a block, read as qa, qb after
// the block's 16-byte header hd) against int8 activations y0..y3 (values 64tq .. 64tq+63 of
// the block) with group scales dy0/dy1 and sums sy0/sy1: an exact integer dot per sub-block,
// then sumf += d*sc * (dy*sumi) - dmin*m * (dy*sum q), sub-block 2tq first.
MUSE_FN float q4K_q8_run(uint4 hd, uint4 qa, uint4 qb, uint tq, int4 y0, int4 y1, int4 y2, int4 y3,
                         float dy0, float sy0, float dy1, float sy1, float sumf) {
    // get_scale_min_k4 for sub-blocks j = 2tq, 2tq+1 (bytes 8*(j%4) of the strip words)
    const uint sh = 8u * ((2u * tq) % 4u);
    const uint a0 = hd.y >> sh, a1 = hd.y >> (sh + 8);
    const uint m0w = hd.z >> sh, m1w = hd.z >> (sh + 8);
    const uint h0 = hd.w >> sh, h1 = hd.w >> (sh + 8);
    const bool low = tq < 2;
    const uint sc0 = low ? (a0 & 63u) : ((h0 & 0xFu) | (((a0 >> 6) & 3u) << 4));
    const uint sc1 = low ? (a1 & 63u) : ((h1 & 0xFu) | (((a1 >> 6) & 3u) << 4));
    const uint mn0 = low ? (m0w & 63u) : (((h0 >> 4) & 0xFu) | (((m0w >> 6) & 3u) << 4));
    const uint mn1 = low ? (m1w & 63u) : (((h1 >> 4) & 0xFu) | (((m1w >> 6) & 3u) << 4));
    int s0 = 0, s1 = 0;
    s0 = dot4_i8(qa.x & 0x0F0F0F0Fu, y0.x, s0); s1 = dot4_i8((qa.x >> 4) & 0x0F0F0F0Fu, y2.x, s1);
    s0 = dot4_i8(qa.y & 0x0F0F0F0Fu, y0.y, s0); s1 = dot4_i8((qa.y >> 4) & 0x0F0F0F0Fu, y2.y, s1);
    s0 = dot4_i8(qa.z & 0x0F0F0F0Fu, y0.z, s0); s1 = dot4_i8((qa.z >> 4) & 0x0F0F0F0Fu, y2.z, s1);
    s0 = dot4_i8(qa.w & 0x0F0F0F0Fu, y0.w, s0); s1 = dot4_i8((qa.w >> 4) & 0x0F0F0F0Fu, y2.w, s1);
    s0 = dot4_i8(qb.x & 0x0F0F0F0Fu, y1.x, s0); s1 = dot4_i8((qb.x >> 4) & 0x0F0F0F0Fu, y3.x, s1);
    s0 = dot4_i8(qb.y & 0x0F0F0F0Fu, y1.y, s0); s1 = dot4_i8((qb.y >> 4) & 0x0F0F0F0Fu, y3.y, s1);
    s0 = dot4_i8(qb.z & 0x0F0F0F0Fu, y1.z, s0); s1 = dot4_i8((qb.z >> 4) & 0x0F0F0F0Fu, y3.z, s1);
    s0 = dot4_i8(qb.w & 0x0F0F0F0Fu, y1.w, s0); s1 = dot4_i8((qb.w >> 4) & 0x0F0F0F0Fu, y3.w, s1);
    const float d = float(as_type<half>(ushort(hd.x & 0xFFFFu)));
    const float dmin = float(as_type<half>(ushort(hd.x >> 16)));
    sumf += fma(d * float(sc0), dy0 * float(s0), -((dmin * float(mn0)) * (dy0 * sy0)));
    sumf += fma(d * float(sc1), dy1 * float(s1), -((dmin * float(mn1)) * (dy1 * sy1)));
    return sumf;
}

// The four sums of sixteen int8 activations (y0..y3, four words each): exact integers.
MUSE_FN int4 q8_sums16(int4 y0, int4 y1, int4 y2, int4 y3) {
    const uint ones = 0x01010101u;
    int4 s;
    s.x = dot4_i8(ones, y0.w, dot4_i8(ones, y0.z, dot4_i8(ones, y0.y, dot4_i8(ones, y0.x, 0))));
    s.y = dot4_i8(ones, y1.w, dot4_i8(ones, y1.z, dot4_i8(ones, y1.y, dot4_i8(ones, y1.x, 0))));
    s.z = dot4_i8(ones, y2.w, dot4_i8(ones, y2.z, dot4_i8(ones, y2.y, dot4_i8(ones, y2.x, 0))));
    s.w = dot4_i8(ones, y3.w, dot4_i8(ones, y3.z, dot4_i8(ones, y3.y, dot4_i8(ones, y3.x, 0))));
    return s;
}

// Byte b of w as a signed integer (an int8 scale).
MUSE_FN int sbyte(uint w, uint b) {
    return int(w << (24u - 8u * b)) >> 24;
}

// The dot products of four bytes of each of a split Q6_K run's four groups (q6K_q8_run): a, b the
// ql words, hb the qh word of values l .. l+3 of the run, y0..y3 the groups' activation words.
MUSE_FN void q6K_q8_word(uint a, uint b, uint hb, int y0, int y1, int y2, int y3, thread int& i0,
                         thread int& i1, thread int& i2, thread int& i3) {
    i0 = dot4_i8((a & 0x0F0F0F0Fu) | ((hb << 4) & 0x30303030u), y0, i0);
    i1 = dot4_i8((b & 0x0F0F0F0Fu) | ((hb << 2) & 0x30303030u), y1, i1);
    i2 = dot4_i8(((a >> 4) & 0x0F0F0F0Fu) | (hb & 0x30303030u), y2, i2);
    i3 = dot4_i8(((b >> 4) & 0x0F0F0F0Fu) | ((hb >> 2) & 0x30303030u), y3, i3);
}

// One run of a split Q6_K block against int8 activations: run (h, s) holds the values
// 128h + 32k + 16s + l, l = 0..15, of the four groups of 32 k = 0..3 (ggml's order: the code of
// value 128h + 32k + l is the low (k < 2) or high nibble of ql[64h + 32(k%2) + l] with bits 2k,
// 2k+1 of qh[32h + l] above it; its scale is scales[8h + 2k + l/16]). qa = ql[64h + 16s ..],
// qb = ql[64h + 32 + 16s ..], qh = qh[32h + 16s ..], sw = scales[8h .. 8h+7]; yk the 16 int8
// activations of group k, ysum their sums, dy the groups' scales. Per group an exact integer
// t = sc * (sum code*q - 32 * sum q), then acc = fma(dy_k, t, acc) in k order, sumf = fma(d, acc, sumf).
MUSE_FN float q6K_q8_run(uint4 qa, uint4 qb, uint4 qh, uint2 sw, uint s, float d, int4 y0, int4 y1,
                         int4 y2, int4 y3, int4 ysum, float4 dy, float sumf) {
    int i0 = 0, i1 = 0, i2 = 0, i3 = 0;
    q6K_q8_word(qa.x, qb.x, qh.x, y0.x, y1.x, y2.x, y3.x, i0, i1, i2, i3);
    q6K_q8_word(qa.y, qb.y, qh.y, y0.y, y1.y, y2.y, y3.y, i0, i1, i2, i3);
    q6K_q8_word(qa.z, qb.z, qh.z, y0.z, y1.z, y2.z, y3.z, i0, i1, i2, i3);
    q6K_q8_word(qa.w, qb.w, qh.w, y0.w, y1.w, y2.w, y3.w, i0, i1, i2, i3);
    const int t0 = sbyte(sw.x, s) * (i0 - 32 * ysum.x);
    const int t1 = sbyte(sw.x, s + 2u) * (i1 - 32 * ysum.y);
    const int t2 = sbyte(sw.y, s) * (i2 - 32 * ysum.z);
    const int t3 = sbyte(sw.y, s + 2u) * (i3 - 32 * ysum.w);
    float acc = dy.x * float(t0);
    acc = fma(dy.y, float(t1), acc);
    acc = fma(dy.z, float(t2), acc);
    acc = fma(dy.w, float(t3), acc);
    return fma(d, acc, sumf);
}

// Where row rr's first block lies in a Q4_K matrix of rows in tiles of TILE (quants.tile_q4_K_rows:
// block j of a tile's rows one after another, so a row's blocks are 144*TILE bytes apart); TILE = 1
// is the plain layout, rr * row_bytes.
template <int TILE>
MUSE_FN ulong q4K_row_start(uint rr, uint row_bytes) {
    return (ulong)(rr / TILE) * TILE * row_bytes + (ulong)(rr % TILE) * 144u;
}

// The xor butterfly over each aligned group of W lanes (offsets W/2, ..., 1): simd_sum's order
// within the group (W = 32 is simd_sum), every lane of a group ending with the group's total.
template <int W>
MUSE_FN float lane_group_sum(float v) {
    for (uint off = W / 2; off > 0; off >>= 1) v += simd_shuffle_xor(v, off);
    return v;
}

// ==== kernel: mul_mv_q4_K_f32
// inputs: w [ROWS, K/256*144] (uint8), y [T, K]; outputs: dst [T, ROWS]
// grid (ceil(ROWS/(NR0*NSG))*32, NSG, T), threadgroup (32, NSG, 1); ggml: NR0 = NSG = 2;
// U blocks of loads per row in a round, each round's loads issued P rounds early; HALVES: the
// nibbles' float form (q4K_block); S > 0: the weights staged in threadgroup memory instead, S - 1
// rounds ahead (q4K_stage_round; U = 1, P = 0)
    const uint tiisg = thread_position_in_threadgroup.x;
    const uint sgitg = thread_position_in_threadgroup.y;
    const uint t = threadgroup_position_in_grid.z;
    threadgroup uint4 stage[S ? NSG * S * 36 * NR0 : 1];  // S = 0: unused (Metal allocates what is declared)
    const uint first_row = (threadgroup_position_in_grid.x * NSG + sgitg) * NR0;
    if (first_row >= ROWS) return;  // whole SIMD groups leave together: no simd_sum is cut short
    float sumf[NR0];
    row_sums_q4K<NR0, U, P, HALVES, 0, S>(w, first_row, ROWS, K / 256, y + (ulong)t * K, y, tiisg, sumf,
                                          stage + sgitg * S * 36 * NR0);
    for (int r = 0; r < NR0; ++r) {
        const float total = simd_sum(sumf[r]);
        if (tiisg == 0 && first_row + r < ROWS) dst[(ulong)t * ROWS + first_row + r] = total;
    }

// ==== kernel: mul_mv_q6_K_f32
// inputs: w [ROWS, K/256*210] (uint8; SPLIT 1: in the split form), y [T, K]; outputs: dst [T, ROWS]
// grid (ceil(ROWS/(NR0*NSG))*32, NSG, T), threadgroup (32, NSG, 1); ggml: NR0 = NSG = 2;
// U blocks of loads per row in a round, each round's loads issued P rounds early; S > 0 (split
// form, U = 1): the quant words staged in threadgroup memory instead, S - 1 rounds ahead, the d's
// still P = S - 1 rounds ahead in registers (q6K_stage_round)
    const uint tiisg = thread_position_in_threadgroup.x;
    const uint sgitg = thread_position_in_threadgroup.y;
    const uint t = threadgroup_position_in_grid.z;
    const uint first_row = (threadgroup_position_in_grid.x * NSG + sgitg) * NR0;
    if (first_row >= ROWS) return;
    threadgroup uint4 stage[S ? NSG * S * 26 * NR0 : 1];
    float sumf[NR0];
    row_sums_q6K<SPLIT, NR0, U, P, S>(w, first_row, ROWS, K / 256, y + (ulong)t * K, tiisg, sumf,
                                      stage + sgitg * S * 26 * NR0);
    for (int r = 0; r < NR0; ++r) {
        const float total = simd_sum(sumf[r]);
        if (tiisg == 0 && first_row + r < ROWS) dst[(ulong)t * ROWS + first_row + r] = total;
    }

// ==== part: multi_rows
// kernels mul_mv_multi_f32 (parts multi_rows, multi_any, multi_out: slots of any type) and
// mul_mv_multi_q4K_f32 (multi_rows, multi_q4K, multi_out: Q4_K slots only, whose source then
// holds no Q6_K lanes; docs/kernels.md, "A kernel's source").
// Up to four matrices that read the same activations (q, k, v and the attention gate), in one
// dispatch: each threadgroup belongs to one matrix, each row is computed exactly as the single
// kernels compute it, and the results are concatenated: dst[t] = [W0 y, W1 y, W2 y, W3 y].
// Templates: R0..R3 rows (0 = absent), Y0..Y3 types (0 Q4_K, 1 Q6_K, 2 Q6_K split), K, NR0, NSG, U, P, HALVES,
// PREP (q4K_lane_sums: with PREP the Q4_K matrices read ys and sy, the Q6_K ones y), S (the Q4_K
// matrices' staged loads, as for mul_mv_q4_K_f32; the Q6_K ones load into registers).
// inputs: w0..w3 (absent ones: a placeholder, never read), y [T, K], ys [T, K] and sy [T, K/8]
// (placeholders without PREP); outputs: dst [T, R0+R1+R2+R3]
// grid (sum_i ceil(Ri/(NR0*NSG))*32, NSG, T), threadgroup (32, NSG, 1)
    const uint tiisg = thread_position_in_threadgroup.x;
    const uint sgitg = thread_position_in_threadgroup.y;
    const uint t = threadgroup_position_in_grid.z;
    const uint per_tg = NR0 * NSG;
    const uint g0 = (R0 + per_tg - 1) / per_tg;
    const uint g1 = (R1 + per_tg - 1) / per_tg;
    const uint g2 = (R2 + per_tg - 1) / per_tg;
    uint tg = threadgroup_position_in_grid.x;
    device const uchar* w = w0;
    uint rows = R0, out0 = 0, type = Y0;
    if (tg >= g0 + g1 + g2) {
        tg -= g0 + g1 + g2; w = w3; rows = R3; out0 = R0 + R1 + R2; type = Y3;
    } else if (tg >= g0 + g1) {
        tg -= g0 + g1; w = w2; rows = R2; out0 = R0 + R1; type = Y2;
    } else if (tg >= g0) {
        tg -= g0; w = w1; rows = R1; out0 = R0; type = Y1;
    }
    threadgroup uint4 stage[S ? NSG * S * 36 * NR0 : 1];  // S = 0: unused (Metal allocates what is declared)
    MUSE_TG uint4* own = stage + sgitg * S * 36 * NR0;
    const uint first_row = (tg * NSG + sgitg) * NR0;
    if (first_row >= rows) return;
    float sumf[NR0];
    device const float* yt = y + (ulong)t * K;

// ==== part: multi_any
    if (type == 0) {
        row_sums<0, NR0, U, P, HALVES, PREP, S>(w, first_row, rows, K / 256, PREP ? ys + (ulong)t * K : yt,
                                                PREP ? sy + (ulong)t * (K / 8) : sy, tiisg, sumf, own);
    } else if (type == 2 && (Y0 == 2 || Y1 == 2 || Y2 == 2 || Y3 == 2)) {  // compiled only if used
        row_sums<2, NR0, U, P, 0, 0, 0>(w, first_row, rows, K / 256, yt, yt, tiisg, sumf, own);
    } else {
        row_sums<1, NR0, U, P, 0, 0, 0>(w, first_row, rows, K / 256, yt, yt, tiisg, sumf, own);
    }

// ==== part: multi_q4K
    row_sums_q4K<NR0, U, P, HALVES, PREP, S>(w, first_row, rows, K / 256, PREP ? ys + (ulong)t * K : yt,
                                             PREP ? sy + (ulong)t * (K / 8) : sy, tiisg, sumf, own);

// ==== part: multi_out
    const uint total_rows = R0 + R1 + R2 + R3;
    for (int r = 0; r < NR0; ++r) {
        const float total = simd_sum(sumf[r]);
        if (tiisg == 0 && first_row + r < rows) dst[(ulong)t * total_rows + out0 + first_row + r] = total;
    }

// ==== part: glu_rows
// kernels mul_mv_glu_f32 (parts glu_rows, glu_q4K, glu_out: Q4_K) and mul_mv_glu_q6K_f32 (glu_rows,
// glu_q6K, glu_out: Q6_K), one text each so that neither carries the other's lanes into the source
// MLX hashes at every launch (docs/kernels.md, "A kernel's source").
// The FFN's first half in one dispatch with the unfused kernels' bits: each SIMD group computes
// NR0 rows of the gate matrix and the same NR0 rows of the up matrix exactly as mul_mv does
// (sharing the activation loads), then writes apply_activation<ACT>(gate, up) -- the formula of
// silu_mul_inplace / gelu_mul_inplace. TYPE 0 Q4_K, 1 Q6_K, 2 Q6_K split (both matrices the same).
// HALVES, PREP, S: as for mul_mv_multi_f32 (Q4_K only).
// inputs: wg, wu [ROWS, K/256*bytes] (uint8), y [T, K], ys [T, K], sy [T, K/8] (placeholders
// without PREP); outputs: dst [T, ROWS]
// grid (ceil(ROWS/(NR0*NSG))*32, NSG, T), threadgroup (32, NSG, 1)
    const uint tiisg = thread_position_in_threadgroup.x;
    const uint sgitg = thread_position_in_threadgroup.y;
    const uint t = threadgroup_position_in_grid.z;
    threadgroup uint4 stage[S ? NSG * S * 72 * NR0 : 1];  // S: the 2 NR0 rows' staged weights
    const uint first_row = (threadgroup_position_in_grid.x * NSG + sgitg) * NR0;
    if (first_row >= ROWS) return;
    const uint nb = K / 256;
    const uint row_bytes = nb * (TYPE == 0 ? 144u : TYPE == 1 ? 210u : 208u);
    device const uchar* g = wg + (ulong)first_row * row_bytes;
    device const uchar* u = wu + (ulong)first_row * row_bytes;
    device const float* yt = y + (ulong)t * K;
    float sumf[2 * NR0];

// ==== part: glu_q4K
    q4K_lane_sums<NR0, NR0, U, P, HALVES, PREP, TYPE == 0 ? S : 0>(g, ROWS - first_row, u, ROWS - first_row, row_bytes, nb,
                                                   PREP ? ys + (ulong)t * K : yt,
                                                   PREP ? sy + (ulong)t * (K / 8) : sy, tiisg, sumf,
                                                   stage + sgitg * S * 72 * NR0);

// ==== part: glu_q6K
    {
        // split (TYPE 2): each matrix's d's follow its ROWS rows' bodies
        device const half* gd = (device const half*)(wg + (ulong)ROWS * nb * 208u) + (ulong)first_row * nb;
        device const half* ud = (device const half*)(wu + (ulong)ROWS * nb * 208u) + (ulong)first_row * nb;
        q6K_lane_sums<NR0, NR0, U, P, TYPE == 2 ? 1 : 0, 0>(g, ROWS - first_row, u, ROWS - first_row, row_bytes, nb,
                                                             yt, tiisg, sumf, gd, ud, stage);
    }

// ==== part: glu_out
    for (int r = 0; r < NR0; ++r) {
        const float gate = simd_sum(sumf[r]);
        const float up = simd_sum(sumf[NR0 + r]);
        if (tiisg == 0 && first_row + r < ROWS) dst[(ulong)t * ROWS + first_row + r] = apply_activation<ACT>(gate, up);
    }

// ==== kernel: dequant_f32
// Raw Q4_K (TYPE 0) or Q6_K (TYPE 1) rows, or a split Q6_K matrix (TYPE 2) -> float32, bit-equal to gguf-py (q4K_dequant4,
// q6K_dequant4). For the batched prefill's matmul and the embedding row. A "quad" is 4
// consecutive values; thread s takes four quads, 32 apart, so a SIMD group's stores are four
// contiguous 512-byte runs, and loads all four before converting any.
// inputs: w [n_blocks * block bytes] (uint8), count (element 0) (quads = values / 4);
// outputs: out [n_blocks * 256]; templates TYPE, TILE and NB (a Q4_K matrix in tiles of TILE rows
// of NB blocks, read where its quads lie: q4K_tiled_quad; TILE = 1, NB = 0: raw rows)
    const uint s = thread_position_in_grid.x;
    const uint q0 = (s / 32) * 128 + s % 32;
    float4 v[4];
    for (int k = 0; k < 4; ++k)
        v[k] = dequant4<TYPE>(w, q4K_tiled_quad<TILE, NB>(min(q0 + 32 * k, count[0] - 1)), count[0] / 64);
    for (int k = 0; k < 4; ++k)
        if (q0 + 32 * k < count[0]) ((device float4*)out)[q0 + 32 * k] = v[k];

// ==== kernel: dequant_f16
// The same values rounded to half (round to nearest even), for an f16 prefill matmul.
// inputs: w [n_blocks * block bytes] (uint8), count (element 0) (quads); outputs: out [n_blocks * 256]
// (half); templates TYPE, TILE, NB (as dequant_f32)
    const uint s = thread_position_in_grid.x;
    const uint q0 = (s / 32) * 128 + s % 32;
    float4 v[4];
    for (int k = 0; k < 4; ++k)
        v[k] = dequant4<TYPE>(w, q4K_tiled_quad<TILE, NB>(min(q0 + 32 * k, count[0] - 1)), count[0] / 64);
    for (int k = 0; k < 4; ++k)
        if (q0 + 32 * k < count[0])
            for (int e = 0; e < 4; ++e) out[4 * (q0 + 32 * k) + e] = half(v[k][e]);

// ==== kernel: dequant_at_f32
// Rows tokens[0..T-1] of a raw Q4_K (TYPE 0) or Q6_K (TYPE 1) matrix -> float32, bit-equal to
// gguf-py: the embedding lookup, gather and dequantization in one dispatch, one quad per thread.
// A token id outside the table (negative ids are past it as uint) gives a row of NaN, read from
// nowhere: the model's other paths give such an id NaN logits too (Model.embed's guard), which
// generation reports, where the one-token decode path would otherwise go on with a wrong row.
// inputs: w [R, ROWB] (uint8), tokens [T] (int32), count (element 0) (T * KQ); outputs: out [T, 4*KQ];
// templates TYPE, R (rows), ROWB (bytes per row), KQ (quads per row)
    const uint s = thread_position_in_grid.x;
    if (s >= count[0]) return;
    const uint row = uint(tokens[s / KQ]);
    if (row >= uint(R)) {
        const float quiet_nan = as_type<float>(0x7FC00000u);
        const float4 none = {quiet_nan, quiet_nan, quiet_nan, quiet_nan};
        ((device float4*)out)[s] = none;
        return;
    }
    ((device float4*)out)[s] = dequant4<TYPE>(w + (ulong)row * ROWB, s % KQ, 0);  // raw rows only

// ==== kernel: mul_mv_q4_K_q8_multi
// OPT-IN, NOT EXACT (pinned flag mv_q8): the activations are quantized to int8 per 32 values
// (q8_group, as llama.cpp's CUDA quantize_q8_1 does) and every Q4_K sub-block's dot product is
// an exact integer one (dp4a), scaled once (q4K_q8_run). Lane l of a SIMD group takes the
// 32-byte quant runs p = l, l+32, ... of its rows (run p = block p/4, sub-blocks 2(p%4) and
// 2(p%4)+1); each threadgroup quantizes y into threadgroup memory first, one thread per group
// of 32. Up to four matrices as mul_mv_multi_f32 (Y 0 Q4_K through q8, 1 Q6_K through the
// exact kernel's lanes), or (GLU 1) gate and up rows with the activation ACT applied.
// The GLU takes mul_mv_q4_K_q8_pre instead (activations quantized once; faster there on the H200).
// inputs: w0..w3, y [T, K]; outputs: dst [T, R0+R1+R2+R3] (GLU: [T, R0])
// grid (sum_i ceil(Ri/(NR0*NSG))*32, NSG, T), threadgroup (32, NSG, 1)
    const uint tiisg = thread_position_in_threadgroup.x;
    const uint sgitg = thread_position_in_threadgroup.y;
    const uint t = threadgroup_position_in_grid.z;
    device const float* yt = y + (ulong)t * K;
    threadgroup int4 qw[K / 16];    // the int8 activations, sixteen to an int4
    threadgroup float qd[K / 32];   // each group's scale d
    threadgroup int qs[K / 32];     // each group's sum of q
    for (uint g = sgitg * 32 + tiisg; g < K / 32; g += 32 * NSG) {
        int4 lo, hi;
        float d;
        int sum;
        q8_group(yt + 32 * g, lo, hi, d, sum);
        qw[2 * g] = lo;
        qw[2 * g + 1] = hi;
        qd[g] = d;
        qs[g] = sum;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const uint per_tg = NR0 * NSG;
    const uint g0 = (R0 + per_tg - 1) / per_tg;
    const uint g1 = (R1 + per_tg - 1) / per_tg;
    const uint g2 = (R2 + per_tg - 1) / per_tg;
    uint tg = threadgroup_position_in_grid.x;
    device const uchar* w = w0;
    uint rows = R0, out0 = 0, type = Y0;
    if (GLU == 0) {
        if (tg >= g0 + g1 + g2) {
            tg -= g0 + g1 + g2; w = w3; rows = R3; out0 = R0 + R1 + R2; type = Y3;
        } else if (tg >= g0 + g1) {
            tg -= g0 + g1; w = w2; rows = R2; out0 = R0 + R1; type = Y2;
        } else if (tg >= g0) {
            tg -= g0; w = w1; rows = R1; out0 = R0; type = Y1;
        }
    }
    const uint first_row = (tg * NSG + sgitg) * NR0;
    if (first_row >= rows) return;
    const uint nb = K / 256;
    float sumf[2 * NR0];
    if (type == 1) {  // Q6_K: the exact kernel's lanes on the float activations
        threadgroup uint4 stage[1];  // unused: Q6_K lanes load into registers
        row_sums_q6K<0, NR0, 1, 0, 0>(w, first_row, rows, nb, yt, tiisg, sumf, stage);
    } else {
        const uint row_bytes = nb * 144u;
        device const uchar* rp[2 * NR0];
        for (int r = 0; r < 2 * NR0; ++r) {
            // GLU: rows 0..NR0-1 of the gate (w0), then the same rows of up (w1)
            device const uchar* m = (GLU == 1 && r >= NR0) ? w1 : w;
            const uint rr = min(first_row + uint(r % NR0), rows - 1u);
            rp[r] = m + (ulong)rr * row_bytes;
            sumf[r] = 0.0f;
        }
        const uint tq = tiisg % 4;  // the lane's run within a block: sub-blocks 2tq, 2tq+1
        for (uint p = tiisg; p < nb * 4; p += 32) {
            const uint b = p / 4;
            const uint yq = 16 * b + 4 * tq;  // values 256b + 64tq .. +63
            const int4 y0 = qw[yq], y1 = qw[yq + 1], y2 = qw[yq + 2], y3 = qw[yq + 3];
            const float dy0 = qd[8 * b + 2 * tq], dy1 = qd[8 * b + 2 * tq + 1];
            const float sy0 = float(qs[8 * b + 2 * tq]), sy1 = float(qs[8 * b + 2 * tq + 1]);
            // every row's loads first, so the block's bytes of all rows are in flight together
            uint4 hdr[2 * NR0], qar[2 * NR0], qbr[2 * NR0];
            for (int r = 0; r < (GLU == 1 ? 2 : 1) * NR0; ++r) {
                device const uchar* blk = rp[r] + (ulong)b * 144u;
                hdr[r] = *(device const uint4*)blk;
                qar[r] = *(device const uint4*)(blk + 16 + 32 * tq);
                qbr[r] = *(device const uint4*)(blk + 32 + 32 * tq);
            }
            for (int r = 0; r < (GLU == 1 ? 2 : 1) * NR0; ++r)
                sumf[r] = q4K_q8_run(hdr[r], qar[r], qbr[r], tq, y0, y1, y2, y3, dy0, sy0, dy1, sy1, sumf[r]);
        }
    }
    if (GLU == 1) {
        for (int r = 0; r < NR0; ++r) {
            const float gate = simd_sum(sumf[r]);
            const float up = simd_sum(sumf[NR0 + r]);
            if (tiisg == 0 && first_row + r < rows) dst[(ulong)t * R0 + first_row + r] = apply_activation<ACT>(gate, up);
        }
    } else {
        const uint total_rows = R0 + R1 + R2 + R3;
        for (int r = 0; r < NR0; ++r) {
            const float total = simd_sum(sumf[r]);
            if (tiisg == 0 && first_row + r < rows) dst[(ulong)t * total_rows + out0 + first_row + r] = total;
        }
    }

// ==== kernel: quantize_q8
// OPT-IN, NOT EXACT (flag mv_q8): activations -> int8 per group of 32 (q8_group), written once
// to device memory for mul_mv_q4_K_q8_pre, where mul_mv_q4_K_q8_multi has every threadgroup
// quantize them again. One thread per group.
// inputs: y [T, K]; outputs: qy [T, K/4] (four int8 to a word), ds [T, K/16] (per group: d, float(sum q))
// templates GROUPS (T*K/32); grid (GROUPS, 1, 1)
    const uint g = thread_position_in_grid.x;
    if (g >= GROUPS) return;
    int4 lo, hi;
    float d;
    int sum;
    q8_group(y + 32 * (ulong)g, lo, hi, d, sum);
    device int4* q4 = (device int4*)qy;
    q4[2 * (ulong)g] = lo;
    q4[2 * (ulong)g + 1] = hi;
    ds[2 * (ulong)g] = d;
    ds[2 * (ulong)g + 1] = float(sum);

// ==== part: q8_pre_rows
// kernels mul_mv_q8_pre (parts q8_pre_rows, q8_pre_live, q8_pre_lanes, q8_pre_q6K, q8_pre_q4K,
// q8_pre_out: Q4_K and split Q6_K matrices), mul_mv_q8_pre_q4K (the same without q8_pre_q6K: calls
// of Q4_K matrices only, whose source then holds no Q6_K lanes, see docs/kernels.md, "A kernel's
// source") and mul_mv_q8_pre_q8out (mul_mv_q8_pre_q4K + q8_out, the GLU).
// OPT-IN, NOT EXACT (flag mv_q8): mul_mv_q4_K_q8_multi's arithmetic on activations that
// quantize_q8 wrote once (no per-threadgroup quantization, no threadgroup memory, no barrier),
// for up to four matrices (Y 0 Q4_K; Y 2 Q6_K in the split form, flag mv_q8_q6k: q6K_q8_run) or
// (GLU 1) Q4_K gate and up. A SIMD group is 32/LPR groups of LPR lanes; lane group i takes NR0
// rows, lane l of it the runs p = l, l+LPR, ... of each (four runs of 64 values per block; LPR a
// multiple of 4, so a lane's run within a block, p%4, is fixed), then a butterfly over the LPR
// lanes (lane_group_sum). LPR = 32 is mul_mv_q4_K_q8_multi's order and bits. The loads of U runs
// are issued before their arithmetic (U does not change the bits). TILE: the Q4_K matrices' rows
// in tiles of TILE (quants.tile_q4_K_rows; 1, the plain layout): where the bytes lie, not which.
// inputs: w0..w3, qy [T, K/4], ds [T, K/16]; outputs: dst [T, R0+R1+R2+R3] (GLU: [T, R0])
// grid (sum_i ceil(Ri/(NR0*NSG*32/LPR))*32, NSG, T), threadgroup (32, NSG, 1)
    const uint tiisg = thread_position_in_threadgroup.x;
    const uint sgitg = thread_position_in_threadgroup.y;
    const uint t = threadgroup_position_in_grid.z;
    const uint li = tiisg % LPR, gi = tiisg / LPR;
    const uint per_sg = NR0 * (32 / LPR);
    const uint per_tg = per_sg * NSG;
    const uint g0 = (R0 + per_tg - 1) / per_tg;
    const uint g1 = (R1 + per_tg - 1) / per_tg;
    const uint g2 = (R2 + per_tg - 1) / per_tg;
    uint tg = threadgroup_position_in_grid.x;
    device const uchar* w = w0;
    uint rows = R0, out0 = 0, type = Y0;
    if (GLU == 0) {
        if (tg >= g0 + g1 + g2) {
            tg -= g0 + g1 + g2; w = w3; rows = R3; out0 = R0 + R1 + R2; type = Y3;
        } else if (tg >= g0 + g1) {
            tg -= g0 + g1; w = w2; rows = R2; out0 = R0 + R1; type = Y2;
        } else if (tg >= g0) {
            tg -= g0; w = w1; rows = R1; out0 = R0; type = Y1;
        }
    }
    const uint sg_row = (tg * NSG + sgitg) * per_sg;

// ==== part: q8_pre_live
    if (sg_row >= rows) return;  // the whole SIMD group: its butterflies need all 32 lanes

// ==== part: q8_pre_lanes
    const uint first_row = sg_row + gi * NR0;
    const uint nb = K / 256;
    device const int4* yq4 = (device const int4*)qy + (ulong)t * (K / 16);
    device const float4* ds4 = (device const float4*)ds + (ulong)t * (K / 64);
    const uint tq = li % 4;
    float sumf[2 * NR0];

// ==== part: q8_pre_q6K
    if (type == 2) {
        // Q6_K, split: row rr's block bodies at 208*(rr*nb + j), its d's after all rows' bodies
        const uint h = tq / 2, s = tq % 2;  // the run: values 128h + 32k + 16s + (0..15), k = 0..3
        device const uchar* body[NR0];
        device const half* dd[NR0];
        for (int r = 0; r < NR0; ++r) {
            const uint rr = min(first_row + uint(r), rows - 1u);
            body[r] = w + (ulong)rr * nb * 208u + 64u * h + 16u * s;
            dd[r] = (device const half*)(w + (ulong)rows * nb * 208u) + (ulong)rr * nb;
            sumf[r] = 0.0f;
        }
        for (uint p0 = li; p0 < nb * 4; p0 += LPR * U) {
            int4 yv[U][4];
            float4 e0[U], e1[U];
            uint4 qa[U][NR0], qb[U][NR0], qh[U][NR0];
            uint2 sw[U][NR0];
            half dh[U][NR0];
            for (int u = 0; u < U; ++u) {
                const uint b = min((p0 + u * LPR) / 4, nb - 1u);  // a run past the row: loaded, not added
                for (int k = 0; k < 4; ++k) yv[u][k] = yq4[16 * b + 8 * h + 2 * k + s];
                e0[u] = ds4[4 * b + 2 * h];      // (d, sum) of groups 8b+4h and 8b+4h+1
                e1[u] = ds4[4 * b + 2 * h + 1];  // ... and of 8b+4h+2, 8b+4h+3
                for (int r = 0; r < NR0; ++r) {
                    device const uchar* q = body[r] + (ulong)b * 208u;
                    qa[u][r] = *(device const uint4*)q;                            // ql[64h + 16s ..]
                    qb[u][r] = *(device const uint4*)(q + 32);                     // ql[64h + 32 + 16s ..]
                    qh[u][r] = *(device const uint4*)(q + 128 - 32 * h);           // qh[32h + 16s ..]
                    sw[u][r] = *(device const uint2*)(q + 192 - 56 * h - 16 * s);  // scales[8h .. 8h+7]
                    dh[u][r] = dd[r][b];
                }
            }
            for (int u = 0; u < U; ++u) {
                if (p0 + u * LPR >= nb * 4) break;
                const int4 ysum = q8_sums16(yv[u][0], yv[u][1], yv[u][2], yv[u][3]);
                const float4 dy = {e0[u].x, e0[u].z, e1[u].x, e1[u].z};
                for (int r = 0; r < NR0; ++r)
                    sumf[r] = q6K_q8_run(qa[u][r], qb[u][r], qh[u][r], sw[u][r], s, float(dh[u][r]),
                                         yv[u][0], yv[u][1], yv[u][2], yv[u][3], ysum, dy, sumf[r]);
            }
        }
    } else

// ==== part: q8_pre_q4K
    {
    const uint row_bytes = nb * 144u;
    device const uchar* rp[2 * NR0];
    for (int r = 0; r < 2 * NR0; ++r) {
        device const uchar* m = (GLU == 1 && r >= NR0) ? w1 : w;
        const uint rr = min(first_row + uint(r % NR0), rows - 1u);
        rp[r] = m + q4K_row_start<TILE>(rr, row_bytes);
        sumf[r] = 0.0f;
    }
    const uint nrows = (GLU == 1 ? 2 : 1) * NR0;
    // U runs per iteration (p, p+LPR, ...), every load of all of them first; added in run order
    for (uint p0 = li; p0 < nb * 4; p0 += LPR * U) {
        int4 yv[U][4];
        float4 e[U];
        uint4 hdr[U][2 * NR0], qar[U][2 * NR0], qbr[U][2 * NR0];
        for (int u = 0; u < U; ++u) {
            const uint b = min((p0 + u * LPR) / 4, nb - 1u);  // a run past the row: loaded, not added
            device const int4* yb = yq4 + 16 * b + 4 * tq;  // values 256b + 64tq .. +63
            for (int i = 0; i < 4; ++i) yv[u][i] = yb[i];
            e[u] = ds4[4 * b + tq];  // d, sum of groups 8b+2tq and 8b+2tq+1
            for (uint r = 0; r < nrows; ++r) {
                device const uchar* blk = rp[r] + (ulong)b * (144u * TILE);
                hdr[u][r] = *(device const uint4*)blk;
                qar[u][r] = *(device const uint4*)(blk + 16 + 32 * tq);
                qbr[u][r] = *(device const uint4*)(blk + 32 + 32 * tq);
            }
        }
        for (int u = 0; u < U; ++u) {
            if (p0 + u * LPR >= nb * 4) break;
            for (uint r = 0; r < nrows; ++r)
                sumf[r] = q4K_q8_run(hdr[u][r], qar[u][r], qbr[u][r], tq, yv[u][0], yv[u][1], yv[u][2], yv[u][3],
                                     e[u].x, e[u].y, e[u].z, e[u].w, sumf[r]);
        }
    }
    }

// ==== part: q8_pre_out
    if (GLU == 1) {
        for (int r = 0; r < NR0; ++r) {
            const float gate = lane_group_sum<LPR>(sumf[r]);
            const float up = lane_group_sum<LPR>(sumf[NR0 + r]);
            if (li == 0 && first_row + r < rows) dst[(ulong)t * R0 + first_row + r] = apply_activation<ACT>(gate, up);
        }
    } else {
        const uint total_rows = R0 + R1 + R2 + R3;
        for (int r = 0; r < NR0; ++r) {
            const float total = lane_group_sum<LPR>(sumf[r]);
            if (li == 0 && first_row + r < rows) dst[(ulong)t * total_rows + out0 + first_row + r] = total;
        }
    }

// ==== part: q8_out
// OPT-IN, NOT EXACT (flag mv_q8_q6k; MUSE_MLX_Q8_GLU_OUT=0 turns it off): appended to mul_mv_q8_pre's body
// (kernel mul_mv_q8_pre_q8out, GLU = 1), so that the GLU also writes its output as quantize_q8
// would, for the ffn_down after it: one dispatch fewer per layer. R0 must be a multiple of the
// threadgroup's rows and those of 32 (the wrapper checks), so no SIMD group has left before the
// barrier. After a barrier that makes this threadgroup's writes to dst visible to all its threads,
// one thread per group of 32 rows reads them back and quantizes them (q8_group): the q8 of exactly
// the values written. (A SIMD group per group of 32 from threadgroup memory, q8_group_lanes, gave
// the same words and ran as fast on the H200, 45.4-45.6 against 45.7 us a GLU: not kept.)
// outputs also: oqy [T, R0/4] (uint32), ods [T, R0/16] (per group: d, float(sum q))
    threadgroup_barrier(mem_flags::mem_device);
    const uint og = sgitg * 32 + tiisg;  // the group of 32 rows this thread quantizes, in the threadgroup
    if (og < per_tg / 32) {
        int4 lo, hi;
        float d;
        int sum;
        q8_group(dst + (ulong)t * R0 + tg * per_tg + 32 * og, lo, hi, d, sum);
        const ulong G = (ulong)t * (R0 / 32) + tg * (per_tg / 32) + og;
        device int4* q4 = (device int4*)oqy;
        q4[2 * G] = lo;
        q4[2 * G + 1] = hi;
        ods[2 * G] = d;
        ods[2 * G + 1] = float(sum);
    }
