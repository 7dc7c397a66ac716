// The FFN activation: the unfused control kernels (SiLU and its GELU twin) and the opt-in
// fused Q4_K gate+up+activation kernel of seeds Ch 18.

// ==== header
// llama.cpp's GELU constants (ggml-metal kernels/common.h:88-91).
constant float GELU_COEF_A = 0.044715f;
constant float SQRT_2_OVER_PI = 0.79788456080286535587989211986876f;

// ggml's geglu: 0.5*x*(1 + tanh(sqrt(2/pi)*x*(1 + a*x*x))), the inner a*x*x + 1 as the fma a
// fast-math compile makes of it.
MUSE_FN float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + precise::tanh(SQRT_2_OVER_PI * x * fma(GELU_COEF_A * x, x, 1.0f)));
}

// Seeds Ch 18 §18.5: the activation is chosen when the pipeline is built (a function constant
// in the reference engine, a template argument ACT here): 0 = SiLU, 1 = GELU.
template <int ACT>
MUSE_FN float apply_activation(float g, float up) {
    if (ACT == 1) {
        return gelu_tanh(g) * up;
    } else {
        // SiLU (default): g * sigmoid(g) * up
        return (g / (1.0f + exp(-g))) * up;
    }
}

// q4k_v4_dual_row_mac: two consecutive Q4_K rows against one lane's registers (the seeds
// name it, shaders/ferrite/_q4k_helpers.metal:34-88, but do not quote it). The lane layout is
// the V4 one (ix/iq/ir, as the Q4_K matvec); each of the lane's four sub-blocks keeps ONE
// running sum over its 8 values, in value order -- unlike ggml, which splits even and odd
// values -- then the d*(...) - dmin*(...) epilogue. So its sums are not the matvec's bits.
MUSE_FN void q4k_v4_dual_row_mac(device const uchar* blk, uint row_bytes, uint rows_left,
                                 thread const float* yl, thread const float* yh, float4 sumy,
                                 uint iq, uint ir, thread float* sumf) {
    for (uint row = 0; row < 2 && row < rows_left; ++row) {
        device const uchar* b = blk + row * row_bytes;
        const float d = float(*(device const half*)(b + 0));
        const float dmin = float(*(device const half*)(b + 2));
        device const ushort* sc = (device const ushort*)(b + 4) + iq;
        ushort sc16[4];
        sc16[0] = sc[0] & 0x3f3f;
        sc16[1] = sc[2] & 0x3f3f;
        sc16[2] = ((sc[4] >> 0) & 0x0f0f) | ((sc[0] & 0xc0c0) >> 2);
        sc16[3] = ((sc[4] >> 4) & 0x0f0f) | ((sc[2] & 0xc0c0) >> 2);
        thread const uchar* sc8 = (thread const uchar*)sc16;
        device const uchar* q1 = b + 16 + 32 * iq + 8 * ir;
        device const uchar* q2 = q1 + 64;
        float4 acc = {0.0f, 0.0f, 0.0f, 0.0f};
        for (uint k = 0; k < 8; ++k) {
            acc[0] = fma(yl[k + 0], float(q1[k] & 0x0F), acc[0]);
            acc[1] = fma(yl[k + 8], float(q1[k] >> 4), acc[1]);
            acc[2] = fma(yh[k + 0], float(q2[k] & 0x0F), acc[2]);
            acc[3] = fma(yh[k + 8], float(q2[k] >> 4), acc[3]);
        }
        float scaled = acc[1] * float(sc8[1]);
        scaled = fma(acc[0], float(sc8[0]), scaled);
        scaled = fma(acc[2], float(sc8[4]), scaled);
        scaled = fma(acc[3], float(sc8[5]), scaled);
        float mins = sumy[1] * float(sc8[3]);
        mins = fma(sumy[0], float(sc8[2]), mins);
        mins = fma(sumy[2], float(sc8[6]), mins);
        mins = fma(sumy[3], float(sc8[7]), mins);
        sumf[row] += fma(d, scaled, -(dmin * mins));
    }
}

// ==== kernel: silu_mul_inplace
// Seeds Ch 18 §18.6, muser_silu_mul_inplace (shaders/muse_reference.metal:4), carried
// verbatim: one thread per element, gate = (v / (1 + exp(-v))) * up. MLX kernels cannot
// write an input, so the result goes to `out` instead of back into `gate`.
// inputs: gate, up [count], count (element 0); outputs: out [count]
    const uint index = thread_position_in_grid.x;
    if (index < count[0]) {
        float value = gate[index];
        out[index] = (value / (1.0f + exp(-value))) * up[index];
    }

// ==== kernel: gelu_mul_inplace
// The GELU twin for the gemma architectures: ggml's kernel_geglu formula, one thread per
// element.
// inputs: gate, up [count], count (element 0); outputs: out [count]
    const uint index = thread_position_in_grid.x;
    if (index < count[0]) {
        out[index] = gelu_tanh(gate[index]) * up[index];
    }

// ==== kernel: ffn_q4k_gate_up_silu_4r2s
// Seeds Ch 18 §18.5 (shaders/ferrite/ffn_fused_tail.metal:485), carried verbatim: 64 threads
// (2 SIMD groups), 4 output rows per threadgroup, 2 per SIMD group; each lane loads its 32 x
// values once (V4 pattern) and feeds them to both the gate and the up rows; lane 0 writes
// apply_activation(gate, up). Adapted to MLX: rows/cols are the templates ROWS/COLS, the
// activation the template ACT, grid z walks tokens, and the helper is told how many rows
// remain so that it never reads past the matrix (the seed's helper reads both rows).
// inputs: W_gate, W_up [rows, cols/256*144] (uint8), x [T, cols]; outputs: out [T, rows]
// grid (ceil(rows/4)*64, 1, T), threadgroup (64, 1, 1)
    const uint rows = ROWS;
    const uint cols = COLS;
    const uint tgid = threadgroup_position_in_grid.x;
    const uint token = threadgroup_position_in_grid.z;
    const uint lid = thread_index_in_simdgroup;
    const uint sgid = simdgroup_index_in_threadgroup;
    device float* out_t = out + token * rows;

    const uint n_blocks    = cols / 256u;
    const uint block_bytes = 144u;
    const uint row_bytes   = n_blocks * block_bytes;

    // 2 rows per SIMD, 2 SIMDs = 4 rows per TG
    const uint base_row = tgid * 4u + sgid * 2u;
    if (base_row >= rows) return;

    // V4 thread partitioning: 4 sub-groups of 8 threads for block stride
    const uint ix = lid / 8u;   // 0..3 — block stride index
    const uint it = lid % 8u;   // 0..7 — position within block
    const uint iq = it / 4u;    // 0 or 1 — half-block selector
    const uint ir = it % 4u;    // 0..3 — quarter within half

    // x-vector pointer: each thread reads 8 positions per block (stride-4 blocks)
    device const float* xp = x + token * cols + ix * 256u + 64u * iq + 8u * ir;

    float yl[16], yh[16];
    float gate_sumf[2] = {0.f, 0.f};
    float up_sumf[2]   = {0.f, 0.f};

    for (uint ib = ix; ib < n_blocks; ib += 4u) {
        // Load x slice into registers (8 elements × 4 positions)
        float4 sumy = {0.f, 0.f, 0.f, 0.f};
        for (uint i = 0u; i < 8u; i++) {
            yl[i]     = xp[i];       sumy[0] += yl[i];
            yl[i + 8] = xp[i + 32];  sumy[1] += yl[i + 8];
            yh[i]     = xp[i + 128]; sumy[2] += yh[i];
            yh[i + 8] = xp[i + 160]; sumy[3] += yh[i + 8];
        }

        // Gate weight: 2 rows starting at base_row + sgid*2
        device const uchar* gate_blk = W_gate + (ulong)base_row * (ulong)row_bytes
                                       + (ulong)ib * block_bytes;
        q4k_v4_dual_row_mac(gate_blk, row_bytes, rows - base_row, yl, yh, sumy, iq, ir, gate_sumf);

        // Up weight: same 2 rows
        device const uchar* up_blk = W_up + (ulong)base_row * (ulong)row_bytes
                                     + (ulong)ib * block_bytes;
        q4k_v4_dual_row_mac(up_blk, row_bytes, rows - base_row, yl, yh, sumy, iq, ir, up_sumf);

        xp += 4u * 256u;  // advance by 4 blocks (stride)
    }

    // Reduction across all 32 threads in each SIMD
    const float gr0 = simd_sum(gate_sumf[0]);
    const float gr1 = simd_sum(gate_sumf[1]);
    const float ur0 = simd_sum(up_sumf[0]);
    const float ur1 = simd_sum(up_sumf[1]);

    if (lid == 0u) {
                                    out_t[base_row]      = apply_activation<ACT>(gr0, ur0);
        if (base_row + 1u < rows)   out_t[base_row + 1u] = apply_activation<ACT>(gr1, ur1);
    }
