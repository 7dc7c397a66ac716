// The sandwich tail: after a sub-block, fold its post-norm into the residual and produce the
// next sub-block's pre-normed input, in one dispatch:
//     hidden += rms_norm(src, eps1) * weight1
//     output  = rms_norm(hidden, eps2) * weight2
// MLX kernels cannot write their inputs, so `hidden` comes in and `hidden_out` goes out.

// ==== kernel: fused_norm_residual_rms_norm_32sg
// Seeds Ch 12 §12.4.3, carried verbatim from the seed
// (crates/muser-engine/src/shaders/ferrite/rmsnorm_batch_tail.metal:142): the legacy
// one-token tail. 1,024 threads = 32 SIMD groups, 33 floats of threadgroup memory, rsqrt,
// thread 0 adds the 32 partials serially. NOT exact against llama.cpp (the reason it is
// opt-in): its reduction tree and rsqrt differ from ggml's.
// inputs: hidden, src [rows, N], weight1, weight2 [N], eps1, eps2 (element 0)
// outputs: hidden_out, output [rows, N]
    const uint n = N;
    const uint row = threadgroup_position_in_grid.x;
    const uint tid = thread_index_in_threadgroup;
    const uint sgitg = simdgroup_index_in_threadgroup;
    const uint lid = thread_index_in_simdgroup;
    threadgroup float shared[33];
    const uint n4 = n >> 2u;
    device const float4* hidden_in4 = (device const float4*)(hidden + row * n);
    device float4* hidden4 = (device float4*)(hidden_out + row * n);
    device const float4* src4 = (device const float4*)(src + row * n);
    device float4* output4 = (device float4*)(output + row * n);
    device const float4* weight14 = (device const float4*)weight1;
    device const float4* weight24 = (device const float4*)weight2;

    float sum_src = 0.0f;
    for (uint i = tid; i < n4; i += 1024u)
        sum_src += dot(src4[i], src4[i]);
    sum_src = simd_sum(sum_src);
    if (lid == 0u) shared[sgitg] = sum_src;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0u) {
        float total = 0.0f;
        for (uint group = 0u; group < 32u; ++group) total += shared[group];
        shared[32] = rsqrt(total / float(n) + eps1[0]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const float inv_src = shared[32];
    float sum_hidden = 0.0f;
    for (uint i = tid; i < n4; i += 1024u) {
        const float4 value = hidden_in4[i] + src4[i] * inv_src * weight14[i];
        hidden4[i] = value;
        sum_hidden += dot(value, value);
    }
    sum_hidden = simd_sum(sum_hidden);
    if (lid == 0u) shared[sgitg] = sum_hidden;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0u) {
        float total = 0.0f;
        for (uint group = 0u; group < 32u; ++group) total += shared[group];
        shared[32] = rsqrt(total / float(n) + eps2[0]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const float inv_hidden = shared[32];
    for (uint i = tid; i < n4; i += 1024u)
        output4[i] = hidden4[i] * inv_hidden * weight24[i];

// ==== kernel: fused_norm_residual_rms_norm_batch_dual_eps
// Seeds Ch 12 §12.4.4: the serving tail, exact. The seeds give its contract, not its text;
// this body is written to meet it: the same bits as llama.cpp's two kernels run separately,
// kernel_rms_norm_mul_add (hidden = (src*scale1)*w1 + hidden, eps1) and then
// kernel_rms_norm_mul (output = (hidden*scale2)*w2, eps2) -- ggml's reduction with ggml's
// thread count NTH, 1.0f/sqrt, llama's expression shapes.
// One token's row is one threadgroup, so the kernel is bound by latency, not bandwidth: every
// thread loads all its values of src, hidden and both weights before the first reduction (one
// memory round trip instead of three), and keeps the new hidden in registers for the second
// norm (the values it stored; nothing is read back from memory).
// inputs: hidden, src [rows, N], weight1, weight2 [N], eps1, eps2 (element 0)
// outputs: hidden_out, output [rows, N]
    constexpr uint n4 = N / 4;
    constexpr uint PER = (n4 + NTH - 1) / NTH;  // float4s per thread
    const uint row = threadgroup_position_in_grid.x;
    const uint tid = thread_index_in_threadgroup;
    const uint sgitg = simdgroup_index_in_threadgroup;
    const uint tiisg = thread_index_in_simdgroup;
    threadgroup float shmem[32];
    device const float4* h4 = (device const float4*)(hidden + row * N);
    device const float4* s4 = (device const float4*)(src + row * N);
    device float4* hout4 = (device float4*)(hidden_out + row * N);
    device float4* out4 = (device float4*)(output + row * N);
    device const float4* w14 = (device const float4*)weight1;
    device const float4* w24 = (device const float4*)weight2;

    const float e1 = eps1[0], e2 = eps2[0];
    float4 sv[PER], hv[PER], w1v[PER], w2v[PER];
    for (uint k = 0; k < PER; ++k) {
        const uint i = tid + k * NTH;
        if (i < n4) { sv[k] = s4[i]; hv[k] = h4[i]; w1v[k] = w14[i]; w2v[k] = w24[i]; }
    }

    // kernel_rms_norm_mul_add over src
    if (sgitg == 0) shmem[tiisg] = 0.0f;
    float sumf = 0.0f;
    for (uint k = 0; k < PER; ++k)
        if (tid + k * NTH < n4) sumf += dot(sv[k], sv[k]);
    sumf = simd_sum(sumf);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tiisg == 0) shmem[sgitg] = sumf;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    sumf = simd_sum(shmem[tiisg]);
    const float scale1 = 1.0f / sqrt(sumf / float(N) + e1);
    for (uint k = 0; k < PER; ++k) {
        const uint i = tid + k * NTH;
        if (i < n4) { hv[k] = fma(sv[k] * scale1, w1v[k], hv[k]); hout4[i] = hv[k]; }
    }

    // kernel_rms_norm_mul over the new hidden; the barrier first, because SIMD group 0 re-zeroes
    // the slots every thread has just read
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sgitg == 0) shmem[tiisg] = 0.0f;
    sumf = 0.0f;
    for (uint k = 0; k < PER; ++k)
        if (tid + k * NTH < n4) sumf += dot(hv[k], hv[k]);
    sumf = simd_sum(sumf);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tiisg == 0) shmem[sgitg] = sumf;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    sumf = simd_sum(shmem[tiisg]);
    const float scale2 = 1.0f / sqrt(sumf / float(N) + e2);
    float4 ov[PER];  // the outputs as stored, for a part appended below (tail_q8, tail_q4)
    for (uint k = 0; k < PER; ++k) {
        const uint i = tid + k * NTH;
        if (i < n4) { ov[k] = (hv[k] * scale2) * w2v[k]; out4[i] = ov[k]; }
    }

// ==== part: tail_q8
// OPT-IN, NOT EXACT (flag mv_q8): appended to the exact tail's body (kernel
// fused_norm_residual_rms_norm_batch_dual_eps_q8), so that the tail also writes its output as
// quantize_q8 would (q8_group's arithmetic: d = max|y|/127, q = round(y/d), four int8 to a word,
// the sum of q) for mul_mv_q4_K_q8_pre: one dispatch fewer per layer. A group of 32 values is
// eight float4s held by eight neighbouring threads of one SIMD group (NTH is a multiple of 32 and
// N of 32), combined with xor shuffles; a maximum and an integer sum are exact in any order, so
// the bits are quantize_q8's for finite values. Each thread quantizes the registers it stored
// (ov), so the values quantized are exactly those written, with no read back from memory.
// outputs also: qy [rows, N/4] (uint32), ds [rows, N/16] (per group: d, float(sum q))
    for (uint k = 0; k < PER; ++k) {  // every thread runs every k: the shuffles need the whole SIMD group
        const uint i = tid + k * NTH;
        const bool live = i < n4;  // a whole group is live or not: n4 is a multiple of 8
        float4 o = {0.0f, 0.0f, 0.0f, 0.0f};
        if (live) o = ov[k];
        float amax = 0.0f;
        for (int e = 0; e < 4; ++e) amax = max(amax, fabs(o[e]));
        for (uint m = 1u; m < 8u; m <<= 1u) amax = max(amax, simd_shuffle_xor(amax, m));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint word = 0u;
        int sum = 0;
        for (int e = 0; e < 4; ++e) {
            const int q = int(round(o[e] * id));
            sum += q;
            word |= (uint(q) & 0xFFu) << (8u * uint(e));
        }
        for (uint m = 1u; m < 8u; m <<= 1u) sum += int(simd_shuffle_xor(uint(sum), m));
        if (live) {
            qy[row * n4 + i] = word;
            if ((i & 7u) == 0u) {
                ds[row * (N / 16) + i / 4] = d;
                ds[row * (N / 16) + i / 4 + 1] = float(sum);
            }
        }
    }

// ==== part: tail_q4
// Appended to the exact tail's body (kernel fused_norm_residual_rms_norm_batch_dual_eps_q4), so
// that the tail also writes its output in the form the Q4_K matvecs after it read with PREP = 1
// (q4K_lane_sums): ys, the values scaled as q4K_scale_y<HALVES> scales them (q4K_y_factor: exact,
// powers of two), and sy, every run of 8 values summed as ggml's lanes sum them (from 0.0f, in
// order), then times q4K_sum_factor (1 for HALVES = 1), at
// sy[32*block + 4*(4*iq + ir) + k] for the run at 64*iq + 8*ir + 32*(k%2) +
// 128*(k/2) of its block of 256. A run is the float4s 2j and 2j+1, held by neighbouring threads
// (NTH is even), so the even one adds its partner's four values after its own. Each thread takes
// the registers it stored (ov), so the values are exactly those written, with no read back from
// memory (that read cost two round trips to L2 per tail). Rows of a multiple of 256.
// outputs also: ys [rows, N], sy [rows, N/8]
    for (uint k = 0; k < PER; ++k) {  // every thread runs every k: the shuffles need the whole SIMD group
        const uint i = tid + k * NTH;
        const bool live = i < n4;  // a whole run is live or not: n4 is even
        float4 o = {0.0f, 0.0f, 0.0f, 0.0f};
        if (live) o = ov[k];
        float4 other;
        for (int e = 0; e < 4; ++e) other[e] = simd_shuffle_xor(o[e], 1u);
        if (live) {
            const float even = q4K_y_factor<HALVES>(0u), odd = q4K_y_factor<HALVES>(1u);
            const float4 f = {even, odd, even, odd};
            ((device float4*)ys)[row * n4 + i] = o * f;
            if ((i & 1u) == 0u) {
                float run = 0.0f;
                for (int e = 0; e < 4; ++e) run += o[e];
                for (int e = 0; e < 4; ++e) run += other[e];
                const uint j = i / 2u, at = 8u * (j % 32u);  // the run's offset in its block
                const uint slot = 4u * (4u * ((at >> 6) & 1u) + ((at >> 3) & 3u)) + 2u * (at >> 7) + ((at >> 5) & 1u);
                sy[row * (N / 8) + 32u * (j / 32u) + slot] = run * q4K_sum_factor<HALVES>();
            }
        }
    }
