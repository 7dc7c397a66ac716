"""Run a kernel body on the CPU, with real threads, to check its *source text* against its oracle.

A kernel body (``muse_mlx/kernels/*.metal``) is compiled by g++ behind a CPU prelude that
gives the Metal vocabulary the meanings ``prelude.cuh`` gives it on NVIDIA, and launched
the way MLX launches it: ``ceil(grid / threadgroup)`` blocks per axis (grid in threads),
``threadgroup`` threads per block. So a CPU-only machine can compare a kernel's float32
bits with its oracle's, which otherwise only a GPU could do.

The model, and why it is faithful for these kernels:

* Blocks run one at a time; each block's threads are real ``std::thread``\\ s, so barriers,
  SIMD exchanges and threadgroup memory are exercised for real (a missing barrier is a data
  race here too, though a race may go unnoticed on any given run).
* ``threadgroup`` variables become function-``static``: one copy for the whole process,
  which is exactly one copy per block because blocks never overlap. Like GPU threadgroup
  memory it is not cleared between blocks (it starts zeroed, then holds the last block's
  values), so a kernel that reads slots it never wrote shows up as wrong bits.
* ``simd_sum`` is the prelude's xor butterfly (offsets 16, 8, 4, 2, 1; ``v = v + other``),
  each step a real exchange between the 32 lanes of a SIMD group. The runtime checks that
  every lane a lane reads from took part in the same exchange, so a SIMD operation in
  divergent code, after some lanes returned, or in a SIMD group of fewer than 32 lanes is an
  error (``__shfl_xor_sync`` with a full mask is undefined there on NVIDIA). A
  threadgroup that is not a multiple of 32 is allowed as long as it does no SIMD operation.
* ``threadgroup_barrier`` is a block-wide ``std::barrier`` (which also orders device memory,
  so ``mem_device`` needs nothing more); threads of one block must reach it the same
  number of times (Metal's rule), else the launch fails.
* Float arithmetic is IEEE binary32 on SSE with ``-ffp-contract=off``: ``a*b + c`` is two
  roundings and ``fma`` is ``std::fma``, one rounding. The pinned bodies spell every
  contraction as an explicit ``fma()``, so this is what their text means; a body that leaves
  one to the compiler (the legacy ``tail_32sg``) gets the GPU compilers' default, fusing,
  only with ``contract=True``. ``half`` is ``_Float16`` (conversions
  round to nearest even, as on the GPU). ``exp``/``tanh``/``sin``/``cos`` are the C
  library's ``expf``/``tanhf``/``sinf``/``cosf`` -- *not* the GPU's, so kernels using them
  are compared through an oracle given the same function -- and ``rsqrt(x)`` is ``1.0f / sqrt(x)``, not the GPU's approximation.
* Outputs start as all-ones bytes (a NaN in float) unless ``init_value`` is given, so an
  element the kernel never writes cannot pass a bit comparison; every buffer has guard
  bytes on both sides, and a write past either end fails the launch.

What it cannot see: reads out of bounds (they return neighbouring bytes), races that happen
to resolve benignly, and a GPU compiler's own choices beyond the contraction above. A kernel
that never finishes hangs the caller, and one that crashes takes the process with it.

The thread machinery (``_RUNTIME``) is compiled once into its own shared library; each
kernel is a small translation unit of prelude + header + body that links against it at
load time, so the per-kernel compile stays short (the cache key is a hash of the source).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import subprocess
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

from muse_mlx.kernels.backend import _ADDRESS_SPACE, Kernel

CXX = os.environ.get("CXX", "g++")
# -O1 without -ffast-math keeps every IEEE operation as written; -fno-strict-aliasing because
# the bodies type-pun freely through pointer casts (uchar -> half/ushort, ushort -> uchar), as
# GPU compilers allow; -fsigned-char because Metal's char is signed (it is not on every CPU).
FLAGS = ["-std=c++20", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-fsigned-char", "-pthread", "-shared",
         "-fPIC"]
# contract=True: let g++ fuse a*b + c into one fma wherever it can, the GPU compilers' default
# (nvcc's --fmad, Metal's fast math), for bodies that leave contraction to the compiler. GCC
# forms fmas only under -fexpensive-optimizations (on from -O2), hence the third flag.
CONTRACT_FLAGS = ["-mfma", "-ffp-contract=fast", "-fexpensive-optimizations"]
CACHE = Path(os.environ.get("MUSE_MLX_EMULATOR_CACHE") or Path(tempfile.gettempdir()) / "muse_mlx_emulator")
GUARD = 256  # guard bytes on each side of every buffer (a multiple of 64 keeps data aligned)
_GUARD_BYTE = 0xA5
MAX_THREADS = 1024  # Metal's and CUDA's per-threadgroup limit


class EmulatorError(RuntimeError):
    """A launch the emulator refused or that failed a runtime check."""


class CompileError(EmulatorError):
    """g++ rejected a generated translation unit (the message has its stderr and the source path)."""


# -- the thread runtime (compiled once) -----------------------------------------------------

_RUNTIME = r"""
// The emulator's thread runtime: launches blocks one at a time, a std::thread per GPU thread,
// and implements the two synchronising operations the kernel prelude needs.
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <latch>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace {

using Entry = void (*)(const unsigned* position, void* const* buffers);

// One SIMD group's exchange slots. An exchange writes slot [s & 1] (s = the lane's count of
// SIMD operations so far) and waits for the group; a lane can only write [s & 1] again at
// operation s + 2, after every lane has passed operation s + 1's barrier and so finished
// reading operation s: one barrier per exchange is enough. seq tells a reader whether the
// lane it reads took part in the same operation.
struct SimdGroup {
  explicit SimdGroup(unsigned n) : lanes(n), sync(n) {}
  unsigned lanes;
  std::barrier<> sync;
  uint32_t value[2][32] = {};
  uint64_t seq[2][32] = {};
};

struct Block {
  explicit Block(unsigned n) : sync(n) {}
  std::barrier<> sync;
  std::vector<std::unique_ptr<SimdGroup>> groups;
};

struct Self {
  Block* block;
  SimdGroup* group;
  unsigned lane;
  unsigned where[6];  // thread xyz in the block, block xyz in the grid (for messages)
  uint64_t simd_ops;
  uint64_t barriers;
};
thread_local Self self;

std::mutex error_mutex;
std::string first_error;
std::atomic<bool> failed{false};

void fail(const std::string& what) {
  std::lock_guard<std::mutex> lock(error_mutex);
  if (!failed.exchange(true)) first_error = what;
}

std::string here() {
  char s[160];
  std::snprintf(s, sizeof s, "thread (%u, %u, %u) of block (%u, %u, %u)", self.where[0], self.where[1],
                self.where[2], self.where[3], self.where[4], self.where[5]);
  return s;
}

}  // namespace

extern "C" void muse_emu_fail(const char* what) { fail(here() + ": " + what); }

extern "C" uint32_t muse_emu_exchange(uint32_t value, uint32_t partner) {
  SimdGroup& g = *self.group;
  const uint64_t s = ++self.simd_ops;
  const int slot = int(s & 1);
  g.value[slot][self.lane] = value;
  g.seq[slot][self.lane] = s;
  g.sync.arrive_and_wait();
  if (partner >= 32 || g.seq[slot][partner] != s) {
    fail(here() + ": SIMD operation #" + std::to_string(s) + " reads lane " + std::to_string(partner) +
         ", which did not take part in it (it returned or diverged, or the SIMD group has only " +
         std::to_string(g.lanes) + " lanes)");
    return value;
  }
  return g.value[slot][partner];
}

extern "C" void muse_emu_threadgroup_barrier() {
  ++self.barriers;
  self.block->sync.arrive_and_wait();
}

extern "C" int muse_emu_launch(Entry entry, void* const* buffers, const unsigned* blocks, const unsigned* dims,
                               char* error, size_t error_size) {
  failed = false;
  first_error.clear();
  const unsigned n = dims[0] * dims[1] * dims[2];
  for (unsigned bz = 0; bz < blocks[2] && !failed; ++bz)
    for (unsigned by = 0; by < blocks[1] && !failed; ++by)
      for (unsigned bx = 0; bx < blocks[0] && !failed; ++bx) {
        Block block(n);
        for (unsigned first = 0; first < n; first += 32)
          block.groups.push_back(std::make_unique<SimdGroup>(n - first < 32 ? n - first : 32));
        std::vector<uint64_t> barriers(n), simd_ops(n);
        // Threads wait for `start` so that, if one cannot be created, the others can be told
        // to skip the body instead of waiting forever at a barrier for it.
        std::latch start(1);
        std::atomic<bool> abandon{false};
        std::vector<std::thread> threads;
        threads.reserve(n);
        try {
          for (unsigned tz = 0; tz < dims[2]; ++tz)
            for (unsigned ty = 0; ty < dims[1]; ++ty)
              for (unsigned tx = 0; tx < dims[0]; ++tx) {
                const unsigned linear = tx + dims[0] * (ty + dims[1] * tz);
                threads.emplace_back([&, tx, ty, tz, linear] {
                  start.wait();
                  self = Self{&block, block.groups[linear >> 5].get(), linear & 31u, {tx, ty, tz, bx, by, bz}, 0, 0};
                  if (!abandon) {
                    const unsigned position[12] = {tx, ty, tz, bx, by, bz, dims[0], dims[1], dims[2],
                                                   blocks[0], blocks[1], blocks[2]};
                    try {
                      entry(position, buffers);
                    } catch (const std::exception& e) {
                      fail(here() + ": exception: " + e.what());
                    }
                  }
                  barriers[linear] = self.barriers;
                  simd_ops[linear] = self.simd_ops;
                  // A finished thread no longer holds up the barriers of those still running.
                  self.group->sync.arrive_and_drop();
                  block.sync.arrive_and_drop();
                });
              }
        } catch (const std::system_error& e) {
          abandon = true;
          fail(std::string("could not start a thread: ") + e.what());
        }
        start.count_down();
        for (auto& t : threads) t.join();
        if (failed) break;
        for (unsigned t = 0; t < n; ++t) {
          if (barriers[t] != barriers[0]) {
            fail("block (" + std::to_string(bx) + ", " + std::to_string(by) + ", " + std::to_string(bz) +
                 "): thread " + std::to_string(t) + " reached threadgroup_barrier " + std::to_string(barriers[t]) +
                 " times, thread 0 " + std::to_string(barriers[0]) + " times (a barrier in divergent code)");
            break;
          }
          if (simd_ops[t] != simd_ops[t & ~31u]) {
            fail("block (" + std::to_string(bx) + ", " + std::to_string(by) + ", " + std::to_string(bz) +
                 "): thread " + std::to_string(t) + " did " + std::to_string(simd_ops[t]) +
                 " SIMD operations, lane 0 of its SIMD group " + std::to_string(simd_ops[t & ~31u]));
            break;
          }
        }
      }
  if (failed && error_size) {
    std::strncpy(error, first_error.c_str(), error_size - 1);
    error[error_size - 1] = 0;
  }
  return failed ? 1 : 0;
}
"""

# -- the Metal vocabulary on the CPU (the counterpart of prelude.cuh) ----------------------

PRELUDE = r"""
// The Metal vocabulary of the kernel bodies on the CPU, with prelude.cuh's meanings. Kernel
// code is compiled inside namespace muse_emu, so these names hide the C library's (the
// double `fma`, `exp`, `sqrt` of <math.h> are never picked by accident).
#include <bit>
#include <cmath>
#include <cstdint>

extern "C" {
uint32_t muse_emu_exchange(uint32_t value, uint32_t partner_lane);
void muse_emu_threadgroup_barrier();
void muse_emu_fail(const char* what);
}

namespace muse_emu {

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef uint64_t ulong;  // Metal's ulong is 64-bit
typedef _Float16 half;   // IEEE binary16; float <-> half conversions round to nearest even
#define MUSE_FN inline
#define MUSE_TG  // a threadgroup pointer (Metal's `threadgroup T*`): threadgroup memory is static here

// Vector types with CUDA's alignment (a misaligned vector load faults there, and may here).
struct alignas(8) uint2 {
  uint x, y;
  uint& operator[](unsigned i) {
    if (i > 1) muse_emu_fail("uint2 index out of range");
    return i == 0 ? x : y;
  }
  uint operator[](unsigned i) const { return const_cast<uint2&>(*this)[i]; }
};
struct uint3 {
  uint x, y, z;
};
#define MUSE_VEC4(name, T, align)                       \
  struct alignas(align) name {                          \
    T x, y, z, w;                                       \
    T& operator[](unsigned i) {                         \
      switch (i) {                                      \
        case 0: return x;                               \
        case 1: return y;                               \
        case 2: return z;                               \
        case 3: return w;                               \
      }                                                 \
      muse_emu_fail(#name " index out of range");       \
      return w;                                         \
    }                                                   \
    T operator[](unsigned i) const { return const_cast<name&>(*this)[i]; } \
  };
MUSE_VEC4(uint4, uint, 16)
MUSE_VEC4(int4, int, 16)
MUSE_VEC4(char4, char, 4)  // Metal's char4: as_type<char4>(uint) splits a word, x = byte 0
// float4: Metal's component indexing and element-wise arithmetic, as prelude.cuh defines them.
MUSE_VEC4(float4, float, 16)
#undef MUSE_VEC4

#define MUSE_F4_OP(op)                                                                              \
  inline float4 operator op(float4 a, float4 b) { return {a.x op b.x, a.y op b.y, a.z op b.z, a.w op b.w}; } \
  inline float4 operator op(float4 a, float s) { return {a.x op s, a.y op s, a.z op s, a.w op s}; }         \
  inline float4 operator op(float s, float4 a) { return {s op a.x, s op a.y, s op a.z, s op a.w}; }
MUSE_F4_OP(+)
MUSE_F4_OP(-)
MUSE_F4_OP(*)
MUSE_F4_OP(/)
#undef MUSE_F4_OP

// Math: single IEEE operations; fma is one rounding (libm's fmaf, exact).
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float4 fma(float4 a, float4 b, float4 c) {
  return {std::fma(a.x, b.x, c.x), std::fma(a.y, b.y, c.y), std::fma(a.z, b.z, c.z), std::fma(a.w, b.w, c.w)};
}
inline float4 fma(float4 a, float s, float4 c) {
  return {std::fma(a.x, s, c.x), std::fma(a.y, s, c.y), std::fma(a.z, s, c.z), std::fma(a.w, s, c.w)};
}
// dot as prelude.cuh's left-to-right FMA chain: x*x', then + y*y', + z*z', + w*w' (each fused).
inline float dot(float4 a, float4 b) { return fma(a.w, b.w, fma(a.z, b.z, fma(a.y, b.y, a.x * b.x))); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }  // NOT the GPU's approximate rsqrt
inline float exp(float x) { return std::exp(x); }            // the C library's expf
inline float log(float x) { return std::log(x); }            // logf
inline float sin(float x) { return std::sin(x); }            // sinf
inline float cos(float x) { return std::cos(x); }            // cosf
namespace precise {
inline float tanh(float x) { return std::tanh(x); }          // the C library's tanhf
}
inline uint min(uint a, uint b) { return a < b ? a : b; }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
template <class T, class U>
inline T as_type(U u) { return std::bit_cast<T>(u); }

// Thread positions, set by the runtime before the body runs; read-only like Metal's attributes.
namespace detail {
struct Position {
  uint3 in_threadgroup, threadgroup, in_grid, threads;
  uint linear;
};
inline thread_local Position here;
}  // namespace detail
#define thread_position_in_threadgroup (::muse_emu::detail::here.in_threadgroup)
#define threadgroup_position_in_grid (::muse_emu::detail::here.threadgroup)
#define thread_position_in_grid (::muse_emu::detail::here.in_grid)
#define threads_per_threadgroup (::muse_emu::detail::here.threads)
#define thread_index_in_threadgroup (::muse_emu::detail::here.linear + 0u)
#define thread_index_in_simdgroup (thread_index_in_threadgroup & 31u)
#define simdgroup_index_in_threadgroup (thread_index_in_threadgroup >> 5)

namespace mem_flags {
constexpr int mem_none = 0, mem_device = 1, mem_threadgroup = 2;
}
// std::barrier orders all memory, device and threadgroup alike, so the flags need no cases.
inline void threadgroup_barrier(int) { muse_emu_threadgroup_barrier(); }

// simdgroup_barrier: the SIMD group's lanes all arrive before any goes on (an exchange is a real
// barrier among them, which also orders their memory accesses).
inline void simdgroup_barrier(int) { muse_emu_exchange(0u, 0u); }

// SIMD operations: real exchanges among the 32 lanes (the runtime checks all took part).
template <class T>
inline T simd_shuffle_xor(T v, uint mask) {
  static_assert(sizeof(T) == 4, "the emulator exchanges 32-bit values");
  return std::bit_cast<T>(muse_emu_exchange(std::bit_cast<uint32_t>(v), thread_index_in_simdgroup ^ mask));
}
// prelude.cuh's xor butterfly: v += value of lane ^ off, off = 16, 8, 4, 2, 1.
inline float simd_sum(float v) {
  for (uint off = 16; off > 0; off >>= 1) v = v + simd_shuffle_xor(v, off);
  return v;
}
inline float simd_max(float v) {
  for (uint off = 16; off > 0; off >>= 1) v = std::fmax(v, simd_shuffle_xor(v, off));
  return v;
}

}  // namespace muse_emu
"""

# numpy dtype -> the C type of a kernel parameter
_C_TYPES = {
    np.dtype(np.float32): "float", np.dtype(np.float16): "half", np.dtype(np.uint8): "uint8_t",
    np.dtype(np.int8): "int8_t", np.dtype(np.uint16): "uint16_t", np.dtype(np.int16): "int16_t",
    np.dtype(np.uint32): "uint32_t", np.dtype(np.int32): "int32_t", np.dtype(np.uint64): "uint64_t",
    np.dtype(np.int64): "int64_t",
}
_MX_TO_NP = {
    mx.float32: np.float32, mx.float16: np.float16, mx.uint8: np.uint8, mx.int8: np.int8,
    mx.uint16: np.uint16, mx.int16: np.int16, mx.uint32: np.uint32, mx.int32: np.int32,
    mx.uint64: np.uint64, mx.int64: np.int64,
}


def _np_dtype(d) -> np.dtype:
    if isinstance(d, mx.Dtype):
        if d not in _MX_TO_NP:
            raise EmulatorError(f"the emulator has no C type for {d}")
        return np.dtype(_MX_TO_NP[d])
    dt = np.dtype(d)
    if dt not in _C_TYPES:
        raise EmulatorError(f"the emulator has no C type for {dt}")
    return dt


# -- source ---------------------------------------------------------------------------------

# A threadgroup variable becomes a function-static one, and C++ runs a static's initializer
# once, for the first thread only: `threadgroup float* p = shmem + tid;` would silently give
# every thread thread 0's pointer. CUDA rejects initializers on __shared__, so reject them too.
_THREADGROUP_INIT = re.compile(r"\bthreadgroup\s[^;(){}]*=")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_SPELLING = {"device": "", "thread": "", "threadgroup": "static", "constant": "constexpr"}


def to_cpu(metal_text: str) -> str:
    """backend.to_cuda's rewrite with the CPU's spellings (threadgroup memory is function-static)."""
    bad = _THREADGROUP_INIT.search(_COMMENT.sub("", metal_text))
    if bad:
        raise EmulatorError(f"a threadgroup variable with an initializer cannot be emulated: {bad.group(0)!r}")
    return _ADDRESS_SPACE.sub(lambda m: _SPELLING[m.group(1)], metal_text)


def translation_unit(kernel: Kernel, input_dtypes, output_dtypes, template) -> str:
    """The C++ source for one kernel and template, mirroring ``Kernel.cuda_source``.

    The body becomes ``custom_kernel_<name>(const T* input..., T* output...)`` with each
    template argument a ``constexpr`` at its top; ``muse_emu_thread`` is the entry the
    runtime calls on every thread, after which the positions are set.
    """
    ins = [_np_dtype(d) for d in input_dtypes]
    outs = [_np_dtype(d) for d in output_dtypes]
    if len(ins) != len(kernel.inputs) or len(outs) != len(kernel.outputs):
        raise EmulatorError(f"{kernel.name}: {len(ins)} inputs / {len(outs)} outputs for "
                            f"{kernel.inputs} / {kernel.outputs}")
    for name in kernel.inputs:
        if re.search(rf"\b{name}_(shape|strides|ndim)\b", kernel.body):
            raise EmulatorError(f"{kernel.name}: the emulator does not pass {name}'s shape or strides")
    params = [f"const {_C_TYPES[d]}* {n}" for n, d in zip(kernel.inputs, ins)]
    params += [f"{_C_TYPES[d]}* {n}" for n, d in zip(kernel.outputs, outs)]
    args = [f"(const {_C_TYPES[d]}*)buffers[{i}]" for i, d in enumerate(ins)]
    args += [f"({_C_TYPES[d]}*)buffers[{len(ins) + i}]" for i, d in enumerate(outs)]
    consts = "".join(f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {int(v)};\n"
                     for k, v in template or [])
    fn = f"custom_kernel_{kernel.name}"
    return (
        PRELUDE + "\nnamespace muse_emu {\n\n" + to_cpu(kernel.header)
        + f"\nstatic void {fn}(\n    " + ",\n    ".join(params) + ") {\n" + consts + to_cpu(kernel.body)
        + "\n}\n\n}  // namespace muse_emu\n\n"
        + 'extern "C" void muse_emu_thread(const unsigned* p, void* const* buffers) {\n'
        + "  using namespace muse_emu;  // the parameter types (half, ...)\n"
        + "  muse_emu::detail::here = {uint3{p[0], p[1], p[2]}, uint3{p[3], p[4], p[5]},\n"
        + "      uint3{p[3] * p[6] + p[0], p[4] * p[7] + p[1], p[5] * p[8] + p[2]}, uint3{p[6], p[7], p[8]},\n"
        + "      p[0] + p[6] * (p[1] + p[7] * p[2])};\n"
        + f"  muse_emu::{fn}(" + ", ".join(args) + ");\n}\n"
    )


# -- building and loading -------------------------------------------------------------------

_lock = threading.RLock()  # one compile/launch at a time: the runtime's error state is global
_loaded: dict[str, ctypes.CDLL] = {}


@functools.lru_cache(maxsize=None)
def _compiler_id() -> str:
    return subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]


def _build(source: str, kind: str, extra: tuple[str, ...] = ()) -> Path:
    """Compile ``source`` to a cached shared library named by the hash of source, flags and compiler."""
    flags = FLAGS + list(extra)  # later flags win: -ffp-contract=fast overrides =off
    key = hashlib.sha256("\0".join([_compiler_id(), *flags, source]).encode()).hexdigest()[:24]
    CACHE.mkdir(mode=0o700, parents=True, exist_ok=True)
    if hasattr(os, "getuid") and CACHE.stat().st_uid != os.getuid():  # we load code from here
        raise EmulatorError(f"{CACHE} belongs to another user; set MUSE_MLX_EMULATOR_CACHE")
    so = CACHE / f"{kind}-{key}.so"
    if so.exists():
        return so
    # write-then-rename (atomic) for both files: concurrent test processes may build the same key
    cpp = CACHE / f"{kind}-{key}.cpp"
    tmp = CACHE / f"{kind}-{key}.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp.write_text(source)
    os.replace(tmp, cpp)
    r = subprocess.run([CXX, *flags, "-x", "c++", "-o", str(tmp), str(cpp)], capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise CompileError(f"g++ failed on {cpp}:\n{r.stderr[-6000:]}")
    os.replace(tmp, so)
    return so


def _runtime() -> ctypes.CDLL:
    with _lock:
        if "runtime" not in _loaded:
            # RTLD_GLOBAL: the kernel libraries find muse_emu_exchange & co. here when loaded
            lib = ctypes.CDLL(str(_build(_RUNTIME, "runtime")), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
            lib.muse_emu_launch.restype = ctypes.c_int
            lib.muse_emu_launch.argtypes = [
                ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint),
                ctypes.POINTER(ctypes.c_uint), ctypes.c_char_p, ctypes.c_size_t,
            ]
            _loaded["runtime"] = lib
        return _loaded["runtime"]


def _kernel_library(source: str, contract: bool = False) -> tuple[ctypes.CDLL, Path]:
    with _lock:
        _runtime()
        if contract and not _cpu_has_fma():
            raise EmulatorError("contract=True needs a CPU with FMA instructions")
        path = _build(source, "kernel", tuple(CONTRACT_FLAGS) if contract else ())
        if str(path) not in _loaded:
            _loaded[str(path)] = ctypes.CDLL(str(path), mode=os.RTLD_NOW)
        return _loaded[str(path)], path


@functools.lru_cache(maxsize=None)
def _cpu_has_fma() -> bool:
    try:
        return " fma " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether g++ builds the runtime (C++20, <barrier>) and a kernel using _Float16, and it runs."""
    body = "    y[thread_index_in_threadgroup] = float(half(x[0])) + simd_sum(1.0f);\n"
    try:
        (y,) = emulate(Kernel(None, "probe", ["x"], ["y"], body=body), [np.ones(1, np.float32)], [(32,)],
                       [np.float32], (32, 1, 1), (32, 1, 1))
        return bool((y == 33.0).all())
    except (OSError, subprocess.SubprocessError, EmulatorError):
        return False


# -- launching ------------------------------------------------------------------------------


class _Buffer:
    """A 64-byte-aligned copy of an array with guard bytes on both sides."""

    def __init__(self, shape, dtype, fill: np.ndarray | None = None, fill_byte: int = 0xFF, init_value=None):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = np.empty(nbytes + 2 * GUARD + 64, np.uint8)
        start = (-raw.ctypes.data) % 64
        self.raw = raw[start : start + nbytes + 2 * GUARD]
        self.raw[:] = _GUARD_BYTE
        self.array = self.raw[GUARD : GUARD + nbytes].view(dtype).reshape(shape)
        if fill is not None:
            self.array[...] = fill
        elif init_value is not None:
            self.array[...] = init_value
        else:
            self.raw[GUARD : GUARD + nbytes] = fill_byte
        self.pointer = self.array.ctypes.data

    def guards_intact(self) -> bool:
        return bool((self.raw[:GUARD] == _GUARD_BYTE).all() and (self.raw[-GUARD:] == _GUARD_BYTE).all())


def _as_numpy(a) -> np.ndarray:
    arr = np.asarray(a)  # mx.array -> numpy (a copy of the evaluated array)
    _np_dtype(arr.dtype)
    return np.ascontiguousarray(arr)


def _dims(v, what) -> tuple[int, int, int]:
    v = tuple(int(x) for x in v)
    if len(v) != 3 or min(v) < 1:
        raise EmulatorError(f"{what} must be three positive sizes, got {v}")
    return v


def emulate(kernel: Kernel, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
            init_value=None, contract: bool = False, bounds=None) -> list[np.ndarray]:
    """Run ``kernel`` on the CPU with the arguments ``Kernel.__call__`` receives; returns numpy arrays.

    ``grid`` is in threads, as for MLX: ``ceil(grid / threadgroup)`` blocks per axis, every
    block complete (threads past the grid run too, as on CUDA; bodies bound-check).
    ``init_value`` fills the outputs first (as MLX's does); without it they are all-ones bytes.
    ``contract=True`` models a compiler that fuses ``a*b + c`` (see ``CONTRACT_FLAGS``); it is a
    faithful model only where each such add has a single multiply operand to fuse.
    ``bounds`` (a recorded call's CUDA launch bounds) has no effect: it steers register
    allocation only, which the emulator does not model.
    """
    grid, tg = _dims(grid, "grid"), _dims(threadgroup, "threadgroup")
    n = tg[0] * tg[1] * tg[2]
    if n > MAX_THREADS:
        raise EmulatorError(f"{kernel.name}: a threadgroup of {n} threads (at most {MAX_THREADS})")
    blocks = tuple(-(-g // t) for g, t in zip(grid, tg))
    ins = [_as_numpy(a) for a in inputs]
    out_dtypes = [_np_dtype(d) for d in output_dtypes]
    if len(output_shapes) != len(out_dtypes):
        raise EmulatorError(f"{kernel.name}: {len(output_shapes)} output shapes, {len(out_dtypes)} dtypes")
    lib, path = _kernel_library(translation_unit(kernel, [a.dtype for a in ins], out_dtypes, template), contract)
    in_bufs = [_Buffer(a.shape, a.dtype, fill=a) for a in ins]
    out_bufs = [_Buffer(tuple(s), d, init_value=init_value) for s, d in zip(output_shapes, out_dtypes)]
    bufs = in_bufs + out_bufs
    pointers = (ctypes.c_void_p * max(1, len(bufs)))(*[b.pointer for b in bufs])
    error = ctypes.create_string_buffer(4096)
    with _lock:
        rc = _runtime().muse_emu_launch(
            ctypes.cast(lib.muse_emu_thread, ctypes.c_void_p), pointers, (ctypes.c_uint * 3)(*blocks),
            (ctypes.c_uint * 3)(*tg), error, len(error),
        )
    if rc:
        raise EmulatorError(f"{kernel.name}: {error.value.decode(errors='replace')}\n(source: {path})")
    names = kernel.inputs + kernel.outputs
    for name, b in zip(names, bufs):
        if not b.guards_intact():
            raise EmulatorError(f"{kernel.name}: a write outside buffer {name!r} (source: {path})")
    for name, a, b in zip(kernel.inputs, ins, in_bufs):
        if not np.array_equal(a.view(np.uint8), b.array.view(np.uint8)):
            raise EmulatorError(f"{kernel.name}: input {name!r} was written (source: {path})")
    return [b.array.copy() for b in out_bufs]


# -- running a public kernel function -------------------------------------------------------

_original_call = Kernel.__call__


_options = threading.local()  # the innermost emulate_recorded's options


def _call(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template, which=None, **kw):
    if which != "emulate":
        return _original_call(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template,
                              which=which, **kw)
    outs = emulate(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template,
                   init_value=kw.get("init_value"), contract=_options.contract)
    return [mx.array(o) for o in outs]


@contextlib.contextmanager
def _emulating(contract: bool):
    """``Kernel.__call__`` also serves ``which="emulate"`` for the duration (nests; restored after)."""
    with _lock:
        outer, outer_contract = Kernel.__call__ is _call, getattr(_options, "contract", False)
        Kernel.__call__ = _call
        _options.contract = contract
        try:
            yield
        finally:
            _options.contract = outer_contract
            if not outer:
                Kernel.__call__ = _original_call


def emulate_recorded(fn, *args, contract: bool = False, **kwargs):
    """``fn(*args, which="emulate", **kwargs)`` with every kernel launch run by the emulator.

    ``fn`` is a public kernel function (``muse_mlx.kernels.mul_mv_q4_K``, ``rms_norm_f16``,
    ...). Its launches reach ``Kernel.__call__`` with exactly the arguments a GPU would get;
    for the duration of the call that method runs them here and returns their real outputs
    as mx.arrays, so what ``fn`` returns is what it would return on a GPU: reshapes and
    tuples as ``fn`` makes them, and a function of several launches (``rms_norm_f16``: the
    F16 norm, then ``mul_f16`` on its output) feeds each launch the previous one's emulated
    output because ``fn`` itself passes it on.

    Why not the existing ``which="record"`` mode: it returns fresh zeros that it does not
    keep, so a later launch's input cannot be traced back to an earlier launch's output
    (an identity match needs the placeholders); and a launch that slipped past the emulator
    would then flow on as zeros. ``which="emulate"`` fails loudly there instead (``Kernel.build``
    knows no such backend). Not thread-safe against other code calling kernels meanwhile.
    ``contract`` is passed to :func:`emulate` for every launch.
    """
    with _emulating(contract):
        return fn(*args, which="emulate", **kwargs)
