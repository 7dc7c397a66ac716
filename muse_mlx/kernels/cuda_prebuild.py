"""Our CUDA kernels built ahead of MLX, into the cubin cache MLX reads, so a process does not
compile them at their first launch (the default on CUDA; ``MUSE_MLX_CUDA_PREBUILD=0`` turns it off).

Why: MLX (0.32) compiles a custom kernel with NVRTC at its first launch in every process and
never writes the result to its disk cache (``CustomKernel::eval_gpu`` asks ``get_jit_module`` not
to), about 1.2 s a variant on a 2-core CPU, of which 1.05 s is the ``<cooperative_groups.h>`` its
default header includes (thirty-second session, ``docs/performance-history.md``). But ``JitModule`` still *reads* that
cache (``MLX_PTX_CACHE_DIR``, by default ``<temp>/mlx/<version>/ptx``) for a custom kernel, under
the name it gives the module: the kernel's name, ``_``, and the hex of ``std::hash<std::string>``
of the source it builds. So, at a variant's first launch, this module rebuilds that source as MLX
does (:func:`mlx_source`), hashes it as libstdc++ does (:func:`cxx_string_hash`), and, unless the
file is there already, compiles the same kernel text with NVRTC behind CUDA's half and bfloat16
headers alone (0.05-0.7 s; the same SASS as behind MLX's headers for all 61 release variants,
checked with NVRTC 13.5) and writes the cubin and its lowered name where MLX looks. Later
processes find the files. A name that differs from MLX's only means MLX compiles as before.

What it leans on, read in MLX's source (``mlx/backend/cuda/custom_kernel.cpp`` and
``jit_module.cpp`` at 0.32.2-dev, whose pieces are in 0.32.4's ``libmlx.so``): the source's
layout, the cache's file names (``<module>.ptx``: the cubin; ``<module>.txt``: ``name<TAB>lowered
name`` lines) and NVRTC's options (``--device-as-default-execution-space``, ``sm_<cc>[a]``). A
kernel whose body names an input's ``_shape``, ``_strides`` or ``_ndim`` (MLX passes those as
types of its own headers) or takes a dtype template is left to MLX.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import warnings
from pathlib import Path

import mlx.core as mx

# MLX's custom-kernel header, before the caller's (custom_kernel.cpp's default_header)
MLX_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
# What our texts need of CUDA's headers; cooperative_groups is only named (MLX's `namespace cg =`)
OWN_HEADER = (
    "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"
    "typedef signed char int8_t; typedef unsigned char uint8_t; typedef short int16_t;\n"
    "typedef unsigned short uint16_t; typedef int int32_t; typedef unsigned int uint32_t;\n"
    "typedef long long int64_t; typedef unsigned long long uint64_t;\n"
    "namespace cooperative_groups {}\n"
)
CUDA_TYPES = {  # MLX's dtype_to_cuda_type
    mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
    mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double",
}
MAX_FILE_NAME = 245  # jit_module.cpp's get_ptx_path: longer names become folders of this length
_MASK = (1 << 64) - 1


def enabled() -> bool:
    """``MUSE_MLX_CUDA_PREBUILD``: ``1`` (the default since an H100 run checked MLX's names and the
    bits, 2026-12-05: docs/performance-history.md) builds ahead, ``0`` leaves every build to MLX."""
    text = os.environ.get("MUSE_MLX_CUDA_PREBUILD", "1")
    if text not in ("0", "1"):
        raise ValueError(f"MUSE_MLX_CUDA_PREBUILD={text!r}: expected 0 or 1")
    return text == "1" and not _STATE.get("failed")


def cxx_string_hash(data: bytes, seed: int = 0xC70F6907) -> int:
    """``std::hash<std::string>`` of libstdc++ on a 64-bit machine (``std::_Hash_bytes``, a
    MurmurHash2 variant): eight bytes at a time, little-endian, then the tail's bytes."""
    mul = (0xC6A4A793 << 32) + 0x5BD1E995

    def mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    h = (seed ^ (n * mul)) & _MASK
    whole = n & ~7
    for i in range(0, whole, 8):
        h ^= (mix((int.from_bytes(data[i : i + 8], "little") * mul) & _MASK) * mul) & _MASK
        h = (h * mul) & _MASK
    if n & 7:
        h ^= int.from_bytes(data[whole:], "little")
        h = (h * mul) & _MASK
    h = (mix(h) * mul) & _MASK
    return mix(h)


def _template_suffix(template) -> str:
    """custom_kernel.cpp's template_arguments_hash for int and bool values."""
    out = ""
    for _, v in template or ():
        if isinstance(v, bool):
            out += "_t" if v else "_f"
        elif isinstance(v, int):
            out += f"_{v}"
        else:
            raise TypeError(f"template value {v!r}: only int and bool are rebuilt here")
    return out


def mlx_kernel_name(name: str, template) -> str:
    """The kernel's name in MLX's source: ``custom_kernel_<name><template values>``."""
    return "custom_kernel_" + name + _template_suffix(template)


def asks_shapes(body: str, input_names) -> bool:
    """Whether MLX would pass an input's shape, strides or ndim (the body names them)."""
    return any(f"{n}_{w}" in body for n in input_names for w in ("shape", "strides", "ndim"))


def mlx_source(kernel_name: str, header: str, body: str, input_names, input_dtypes, output_names, output_dtypes,
               template) -> str:
    """The translation unit custom_kernel.cpp's build_kernel makes, after MLX's default header, for
    a kernel that asks for no shapes (:func:`asks_shapes`)."""
    text = header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    text += f"__global__ void {kernel_name}(\n"
    for n, d in zip(input_names, input_dtypes):
        text += f"    const {CUDA_TYPES[d]}* {n},\n"
    for i, (n, d) in enumerate(zip(output_names, output_dtypes)):
        text += f"    {CUDA_TYPES[d]}* {n}" + (",\n" if i < len(output_names) - 1 else ") {\n")
    for k, v in template or ():
        text += f"  constexpr bool {k} = {'true' if v else 'false'};\n" if isinstance(v, bool) else \
            f"  constexpr int {k} = {v};\n"
    if template:
        text += "\n"
    return text + body + "\n}\n\n} // namespace mlx::core::cu\n"


def module_name(kernel_name: str, source: str) -> str:
    """The name MLX gives the module (custom_kernel.cpp: ``{name}_{hash:x}``), of MLX's whole source."""
    return f"{kernel_name}_{cxx_string_hash((MLX_DEFAULT_HEADER + source).encode('utf-8')):x}"


def temp_dir() -> Path:
    """``std::filesystem::temp_directory_path()`` of libstdc++: TMPDIR, TMP, TEMP, TEMPDIR, /tmp."""
    for var in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        if os.environ.get(var):
            return Path(os.environ[var])
    return Path("/tmp")


def cache_dir() -> Path:
    """Where MLX reads built modules: ``MLX_PTX_CACHE_DIR``, else ``<temp>/mlx/<version>/ptx``."""
    given = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(given).absolute() if given else temp_dir().absolute() / "mlx" / mx.__version__ / "ptx"


def ptx_path(cache: Path, module: str) -> Path:
    """jit_module.cpp's get_ptx_path: ``<module>.ptx``, a long name cut into folders of 245."""
    if len(module) <= MAX_FILE_NAME:
        return cache / f"{module}.ptx"
    path, at = cache, 0
    while len(module) - at > MAX_FILE_NAME:
        path, at = path / module[at : at + MAX_FILE_NAME], at + MAX_FILE_NAME
    return path / f"{module[at:]}.ptx"


def _site_dirs() -> list[str]:
    return [p for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))]


class Nvrtc:
    """NVRTC through ctypes: the library MLX's CUDA wheel depends on (nvidia-cuda-nvrtc)."""

    def __init__(self, given: str | None = None, includes: list[str] | None = None):
        """``given``, ``includes``: an NVRTC library and header folders to use (``scripts/kernel_sass.py``'s
        toolchain) instead of the ones found beside MLX."""
        found = [path for d in _site_dirs() for sub in ("cu13", "cu12", "cuda_nvrtc")
                 for path in sorted(glob.glob(os.path.join(d, "nvidia", sub, "lib", "libnvrtc.so*")), reverse=True)
                 if "builtins" not in path]
        # the soname first: MLX's CUDA build links libnvrtc.so.13, so that is the library it compiles with
        for candidate in [given] if given else ["libnvrtc.so.13", "libnvrtc.so.12"] + found + ["libnvrtc.so"]:
            try:
                self.lib = ctypes.CDLL(candidate)
                break
            except OSError:
                continue
        else:
            raise RuntimeError(f"no NVRTC library found ({given or 'pip install nvidia-cuda-nvrtc'})")
        self.lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = (major.value, minor.value)
        if includes is None:
            includes = [os.path.join(d, "nvidia", sub, "include") for d in _site_dirs()
                        for sub in ("cu13", "cu12", "cuda_runtime")]
            home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
            includes.append(os.path.join(home, "include"))
        self.includes = [p for p in includes if os.path.isdir(p)]

    def compile(self, source: str, kernel: str, arch: str) -> tuple[bytes, str]:
        """``source`` -> (cubin, the lowered name of ``kernel``), with MLX's options."""
        cubin, lowered, _ = self.build(source, arch, kernel)
        return cubin, lowered

    def build(self, source: str, arch: str, kernel: str | None = None, options=()) -> tuple[bytes, str | None, str]:
        """``source`` -> (cubin, the lowered name of ``kernel`` or None, NVRTC's log), compiled with
        MLX's options and ``options`` (``scripts/kernel_sass.py`` adds ``--ptxas-options=-v``)."""
        lib, prog = self.lib, ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"prebuild.cu", 0, None, None), "create")
        try:
            if kernel is not None:
                self._check(lib.nvrtcAddNameExpression(prog, kernel.encode()), "name")
            opts = ["--device-as-default-execution-space", f"--gpu-architecture={arch}", *options]
            opts += [f"--include-path={p}" for p in self.includes]
            arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
            failed = lib.nvrtcCompileProgram(prog, len(opts), arr)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            text = log.value.decode(errors="replace")
            if failed:
                raise RuntimeError(f"NVRTC could not compile {kernel or 'the source'}: {text[-2000:]}")
            mangled = None
            if kernel is not None:
                lowered = ctypes.c_char_p()
                self._check(lib.nvrtcGetLoweredName(prog, kernel.encode(), ctypes.byref(lowered)), "lowered name")
                mangled = lowered.value.decode()
            self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
            buf = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, buf), "cubin")
            return buf.raw, mangled, text
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"NVRTC {what} failed ({err})")


_STATE: dict = {}


def _arch() -> str:
    """MLX's NVRTC target for the GPU: ``sm_<major><minor>``, with ``a`` from compute capability 9.
    Asked of ``mx.gpu`` by name: ``mx.device_info()`` describes the *default* device, which is the
    CPU inside a ``with mx.stream(mx.cpu)`` block (the first lease run failed so: H100, 2026-12-05)."""
    info = mx.device_info(mx.gpu)
    major, minor = int(info["compute_capability_major"]), int(info["compute_capability_minor"])
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def write_module(path: Path, kernel_name: str, cubin: bytes, mangled: str) -> None:
    """The two files MLX reads: the lowered name first, then the cubin, each by rename, so that no
    process finds a cubin without its names (MLX reads the .ptx, then the .txt beside it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = f".{os.getpid()}.tmp"
    names, tmp = path.with_suffix(".txt"), path.with_name(path.name + tag)
    names_tmp = names.with_name(names.name + tag)
    names_tmp.write_text(f"mlx::core::cu::{kernel_name}\t{mangled}\n")
    os.replace(names_tmp, names)
    tmp.write_bytes(cubin)
    os.replace(tmp, path)


def ensure(name: str, header: str, body: str, input_names, inputs, output_names, output_dtypes, template,
           compiler=None) -> Path | None:
    """Build a variant ahead of MLX, unless MLX's cache holds it: the file MLX will read, or None
    where this variant is left to MLX (it asks for shapes, has a dtype template or an unknown dtype).
    ``compiler``: ``(source, kernel) -> (cubin, lowered name)``, NVRTC for this GPU by default."""
    dtypes = [getattr(a, "dtype", None) for a in inputs]
    if asks_shapes(body, input_names) or any(d not in CUDA_TYPES for d in list(dtypes) + list(output_dtypes)):
        return None
    try:
        kernel = mlx_kernel_name(name, template)
    except TypeError:
        return None
    source = mlx_source(kernel, header, body, input_names, dtypes, output_names, output_dtypes, template)
    path = ptx_path(cache_dir(), module_name(kernel, source))
    if path.is_file() and path.with_suffix(".txt").is_file():
        _STATE["found"] = _STATE.get("found", 0) + 1
        return path
    if compiler is None:
        if "nvrtc" not in _STATE:
            _STATE["nvrtc"] = Nvrtc()
        nvrtc, arch = _STATE["nvrtc"], _arch()
        compiler = lambda src, k: nvrtc.compile(src, k, arch)  # noqa: E731
    cubin, mangled = compiler(OWN_HEADER + source, f"mlx::core::cu::{kernel}")
    write_module(path, kernel, cubin, mangled)
    _STATE["built"] = _STATE.get("built", 0) + 1
    return path


def counts() -> tuple[int, int]:
    """``(built, found)``: variants this process compiled ahead, and found in MLX's cache already."""
    return _STATE.get("built", 0), _STATE.get("found", 0)


def ensure_or_warn(*args) -> None:
    """:func:`ensure`, where a failure (no NVRTC, a compile error, an unwritable folder) warns once
    and leaves this and every later build to MLX."""
    try:
        ensure(*args)
    except Exception as e:  # noqa: BLE001  (never stop a run: MLX builds the kernel itself)
        _STATE["failed"] = True
        warnings.warn(f"MUSE_MLX_CUDA_PREBUILD: building kernel {args[0]!r} ahead of MLX failed "
                      f"({type(e).__name__}: {e}); MLX builds it and every later one itself", stacklevel=3)
