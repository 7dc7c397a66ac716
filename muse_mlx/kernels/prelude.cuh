// The Metal vocabulary the kernel bodies use, mapped onto CUDA so that the same source
// compiles through mx.fast.cuda_kernel. Keep it small enough to check by eye: every line
// says what a Metal name means on NVIDIA. The address-space words (device, thread,
// threadgroup, constant) cannot be macros here -- CUDA's own __device__ expands to
// __attribute__((device)) -- so backend.py rewrites those four words in the text instead.
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
#define ulong unsigned long long   // Metal's ulong is 64-bit (a macro: some hosts typedef ulong)
#define half __half
#define MUSE_FN __device__ __forceinline__
// A pointer to threadgroup memory in a helper's parameters (Metal: `threadgroup T*`): a generic
// pointer here, which NVCC/NVRTC resolve to shared memory once the helper is inlined.
#define MUSE_TG

// (Each block below a line `// -- only where the source names A B` is in a kernel's source only
// where its header or body names A or B: MLX hashes a kernel's whole source at every launch, see
// backend.cuda_prelude; `// -- always` ends the optional blocks.)
// -- only where the source names thread_index_in_threadgroup thread_index_in_simdgroup simdgroup_index_in_threadgroup
// Thread positions. MLX launches ceil(grid / threadgroup) blocks of `threadgroup` threads.
#define thread_index_in_threadgroup (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z))
#define thread_index_in_simdgroup (thread_index_in_threadgroup & 31u)
#define simdgroup_index_in_threadgroup (thread_index_in_threadgroup >> 5)
// -- only where the source names thread_position_in_threadgroup
#define thread_position_in_threadgroup make_uint3(threadIdx.x, threadIdx.y, threadIdx.z)
// -- only where the source names threadgroup_position_in_grid
#define threadgroup_position_in_grid make_uint3(blockIdx.x, blockIdx.y, blockIdx.z)
// -- only where the source names thread_position_in_grid
#define thread_position_in_grid make_uint3(blockIdx.x * blockDim.x + threadIdx.x, \
    blockIdx.y * blockDim.y + threadIdx.y, blockIdx.z * blockDim.z + threadIdx.z)

// -- only where the source names threadgroup_barrier mem_flags
namespace mem_flags {
constexpr int mem_device = 1, mem_threadgroup = 2;
}
// A device-memory barrier also publishes global writes to the block (ggml's split-kernel boundary).
__device__ __forceinline__ void threadgroup_barrier(int flags) {
  if (flags & mem_flags::mem_device) __threadfence();
  __syncthreads();
}

// -- only where the source names simd_sum
// simd_sum: an xor butterfly over the 32 lanes (offsets 16, 8, 4, 2, 1); every lane gets the
// total. Apple's lane order is undocumented; the oracles model this one.
__device__ __forceinline__ float simd_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 16);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v;
}

// -- only where the source names simdgroup_barrier
// Orders the SIMD group's threadgroup-memory accesses: __syncwarp (a memory barrier among its lanes).
__device__ __forceinline__ void simdgroup_barrier(int) { __syncwarp(); }

// -- only where the source names simd_shuffle_xor
__device__ __forceinline__ uint simd_shuffle_xor(uint v, uint mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
__device__ __forceinline__ float simd_shuffle_xor(float v, uint mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
// -- only where the source names simd_max
__device__ __forceinline__ float simd_max(float v) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// -- only where the source names float4 dot
// float4 with Metal's component indexing and element-wise arithmetic.
struct __align__(16) muse_float4 {
  float x, y, z, w;
  __device__ __forceinline__ float& operator[](int i) { return (&x)[i]; }
  __device__ __forceinline__ float operator[](int i) const { return (&x)[i]; }
};
#define float4 muse_float4
#define F4_OP(op)                                                                          \
  __device__ __forceinline__ float4 operator op(float4 a, float4 b) {                      \
    return {a.x op b.x, a.y op b.y, a.z op b.z, a.w op b.w};                               \
  }                                                                                        \
  __device__ __forceinline__ float4 operator op(float4 a, float s) {                       \
    return {a.x op s, a.y op s, a.z op s, a.w op s};                                       \
  }                                                                                        \
  __device__ __forceinline__ float4 operator op(float s, float4 a) {                       \
    return {s op a.x, s op a.y, s op a.z, s op a.w};                                       \
  }
F4_OP(+)
F4_OP(-)
F4_OP(*)
F4_OP(/)
#undef F4_OP
__device__ __forceinline__ float4 fma(float4 a, float4 b, float4 c) {
  return {fmaf(a.x, b.x, c.x), fmaf(a.y, b.y, c.y), fmaf(a.z, b.z, c.z), fmaf(a.w, b.w, c.w)};
}
__device__ __forceinline__ float4 fma(float4 a, float s, float4 c) {
  return {fmaf(a.x, s, c.x), fmaf(a.y, s, c.y), fmaf(a.z, s, c.z), fmaf(a.w, s, c.w)};
}
// dot as a left-to-right FMA chain: x*x', then + y*y', + z*z', + w*w' (each fused).
__device__ __forceinline__ float dot(float4 a, float4 b) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, a.x * b.x)));
}

// -- only where the source names as_type
// as_type<T>(u): Metal's bit-for-bit reinterpretation, for the pairs the bodies use.
template <typename T, typename U> __device__ T as_type(U u);
template <> __device__ __forceinline__ float as_type<float, uint>(uint u) { return __uint_as_float(u); }
template <> __device__ __forceinline__ uint as_type<uint, float>(float f) { return __float_as_uint(f); }
template <> __device__ __forceinline__ __half as_type<__half, ushort>(ushort u) { return __ushort_as_half(u); }
template <> __device__ __forceinline__ char as_type<char, uchar>(uchar u) { return (char)(signed char)u; }
template <> __device__ __forceinline__ char4 as_type<char4, uint>(uint u) {  // little-endian: x = byte 0
  return make_char4((signed char)(u & 0xFFu), (signed char)((u >> 8) & 0xFFu),
                    (signed char)((u >> 16) & 0xFFu), (signed char)(u >> 24));
}

// -- always
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// -- only where the source names precise
// rsqrt(float), sqrt, exp, fma: CUDA's own float overloads (rsqrt is approximate, like Metal's).
namespace precise {
__device__ __forceinline__ float tanh(float x) { return tanhf(x); }
}
