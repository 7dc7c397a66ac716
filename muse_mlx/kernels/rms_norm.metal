// RMSNorm kernels. Bodies for mx.fast.metal_kernel: MLX writes the signature (inputs,
// outputs, template arguments, and the thread-position attributes the body names).

// ==== kernel: rms_norm_batch
// Seeds Ch 12 §12.4.1, the Ferrite-lineage base kernel, carried verbatim from the seed
// (crates/muser-engine/src/shaders/ferrite/rmsnorm_batch_tail.metal:1). Geometry: one row
// per threadgroup, 128 threads = 4 SIMD groups, float4 loads; thread 0 adds the four
// partials and calls rsqrt. Adapted to MLX only in its header: n is the template N, eps a
// one-element array, the positions come from MLX's attribute names.
// inputs: x [rows, N], weight [N], eps (element 0); outputs: out [rows, N]
    const uint n = N;
    const uint tgid = threadgroup_position_in_grid.x;
    const uint tid = thread_index_in_threadgroup;
    const uint sgitg = simdgroup_index_in_threadgroup;
    const uint lid = thread_index_in_simdgroup;
    threadgroup float shared[5];

    const uint batch = tgid;
    device const float* xb  = x   + batch * n;
    device       float* ob  = out + batch * n;
    device const float4* xb4 = (device const float4*)xb;
    device const float4* wb4 = (device const float4*)weight;
    device float4* ob4 = (device float4*)ob;
    const uint n4 = n >> 2u;

    float sum_sq = 0.0f;
    for (uint i = tid; i < n4; i += 128u)
        sum_sq += dot(xb4[i], xb4[i]);
    sum_sq = simd_sum(sum_sq);
    if (lid == 0u) shared[sgitg] = sum_sq;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0u)
        shared[4] = rsqrt((shared[0] + shared[1] + shared[2] + shared[3]) / float(n) + eps[0]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float inv_rms = shared[4];
    for (uint i = tid; i < n4; i += 128u)
        ob4[i] = xb4[i] * inv_rms * wb4[i];

// ==== kernel: rms_norm_mul
// llama.cpp's kernel_rms_norm_fuse_impl<float4, F> (ggml-metal norm.metal:107-184), written
// from llama-cpp-facts.md A.1: one row per threadgroup of NTH threads (a multiple of 32,
// chosen by the caller's named geometry); each thread sums dot(x, x) over its strided
// float4s; simd_sum; lane 0 of each SIMD group publishes to one of 32 zeroed slots; every
// SIMD group simd_sums the 32 slots again; scale = 1.0f/sqrt(sum/N + eps).
// MODE 1: y = x*scale; 2: y = (x*scale)*w; 3: y = (x*scale)*w + a (ggml's NORM_MUL_ADD,
// written as the fma a fast-math compile contracts it to). WROW 1: w holds one weight row per
// row of x (the Q- and K-norms of a token in one dispatch; each row's bits as if alone).
// inputs: x [rows, N], w [N] or [rows, N], a [rows, N], eps (element 0); outputs: out [rows, N]
    const uint row = threadgroup_position_in_grid.x;
    const uint tid = thread_index_in_threadgroup;
    const uint sgitg = simdgroup_index_in_threadgroup;
    const uint tiisg = thread_index_in_simdgroup;
    const uint n4 = N / 4;
    threadgroup float shmem[32];
    if (sgitg == 0) shmem[tiisg] = 0.0f;

    device const float4* x4 = (device const float4*)(x + row * N);
    device const float4* w4 = (device const float4*)(w + (WROW ? row * N : 0));
    device const float4* a4 = (device const float4*)(a + (MODE == 3 ? row * N : 0));
    device float4* y4 = (device float4*)(out + row * N);

    float sumf = 0.0f;
    for (uint i = tid; i < n4; i += NTH) sumf += dot(x4[i], x4[i]);
    sumf = simd_sum(sumf);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tiisg == 0) shmem[sgitg] = sumf;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    sumf = simd_sum(shmem[tiisg]);

    const float mean = sumf / float(N);
    const float scale = 1.0f / sqrt(mean + eps[0]);
    for (uint i = tid; i < n4; i += NTH) {
        if (MODE == 1) {
            y4[i] = x4[i] * scale;
        } else if (MODE == 2) {
            y4[i] = (x4[i] * scale) * w4[i];
        } else {
            y4[i] = fma(x4[i] * scale, w4[i], a4[i]);
        }
    }

// ==== kernel: rms_norm_f16
// The cross-vendor seam, first half (seeds Ch 12 §12.7): the unweighted norm, written as
// F16, with no approximate functions. Same reduction as rms_norm_mul.
// inputs: x [rows, N], eps (element 0); outputs: out [rows, N] (float16)
    const uint row = threadgroup_position_in_grid.x;
    const uint tid = thread_index_in_threadgroup;
    const uint sgitg = simdgroup_index_in_threadgroup;
    const uint tiisg = thread_index_in_simdgroup;
    const uint n4 = N / 4;
    threadgroup float shmem[32];
    if (sgitg == 0) shmem[tiisg] = 0.0f;
    device const float4* x4 = (device const float4*)(x + row * N);

    float sumf = 0.0f;
    for (uint i = tid; i < n4; i += NTH) sumf += dot(x4[i], x4[i]);
    sumf = simd_sum(sumf);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tiisg == 0) shmem[sgitg] = sumf;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    sumf = simd_sum(shmem[tiisg]);

    const float scale = 1.0f / sqrt(sumf / float(N) + eps[0]);
    for (uint i = tid; i < n4; i += NTH) {
        const float4 v = x4[i] * scale;
        for (uint k = 0; k < 4; ++k) out[row * N + 4 * i + k] = half(v[k]);
    }

// ==== kernel: mul_f16
// The cross-vendor seam, second half: the learned weight applied in F16. A product of two
// F16 values is exact in float32, so rounding it once to F16 is F16 multiplication.
// inputs: x [rows, N] (float16), w [N] (float16), count (element 0); outputs: out [rows, N] (float16)
    const uint i = thread_position_in_grid.x;
    if (i < count[0]) out[i] = half(float(x[i]) * float(w[i % N]));
