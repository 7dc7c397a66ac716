"""What NVIDIA's compiler makes of our kernels, without a GPU: registers, spills, SASS.

    python scripts/kernel_sass.py [--kernel NAME] [--geometry G[,G..]] [--sweep] [--sass] [--loops]

For every kernel call the engine makes at the release geometry (Muse Glimmer: n_embd 6656,
n_ff 19968, 32/2 heads of 128, vocab 202048), the call is recorded (``which="record"``: nothing
runs, nothing is allocated), the exact translation unit ``mx.fast.cuda_kernel`` would compile is
rebuilt with ``Kernel.cuda_source`` behind the header below (MLX's own default header, minus
MLX's utils.cuh, which the bodies do not use), compiled for sm_90a (what MLX 0.32 asks NVRTC
for on a compute-capability-9 device such as the H200) and disassembled. One line per kernel
and template: registers per thread, spill stores/loads and stack frame (ptxas -v), SASS
instructions (NOPs excluded), counts of key opcodes, the widths of the global loads, and the
hottest loop (the backward branch whose body holds the most FFMA/IDP): its instructions per
iteration and, for the matvecs, per weight one lane handles in one iteration. Each line also gives
the compile's own seconds, and the last line their count and sum beside an empty kernel behind the
same header, with and without cooperative_groups.h: what every process pays at a variant's first
launch, since MLX never writes a custom kernel's build to its disk cache (MLX compiles one variant at
a time; these are one core's seconds of this machine, and MLX's own utils.cuh, left out here, adds to
each). ``--own-header`` compiles behind what ``MUSE_MLX_CUDA_PREBUILD`` uses instead
(``kernels/cuda_prebuild.py``), and ``--prebuild DIR`` times that module building every variant into
DIR and then finding them.

Record mode would pick Metal's/ggml's geometry ("tuned" has no "record" entry), so the calls here
pass the CUDA "tuned" geometry explicitly; ``MUSE_MLX_MV_GEOMETRY``, ``MUSE_MLX_MV_GEOMETRY_Q6K`` and
``MUSE_MLX_Q8_GEOMETRY`` and ``MUSE_MLX_Q8_PRE_GEOMETRY`` override it as they do in the engine (as does
``MUSE_MLX_Q4K_HALVES``, the Q4_K nibble form: record mode has no entry in ``Q4K_HALVES``, so the
unlabelled Q4_K lines are the 2^23 form, and the "halves" and "prepared" lines set form 1, or form 2
(the scales as halves too, the GLU's on CUDA) when ``MUSE_MLX_Q4K_HALVES=2`` is given. Launch bounds and the
staged Q4_K loads (``Q4K_STAGES``, S in the template; ``MUSE_MLX_Q4K_STAGES*`` override it), unlike these, follow CUDA's defaults in record
mode (``GLU_WARPS``, ``HEAD_WARPS``: so the head at its tuned geometry is the bounded
``mul_mv_q6_K_f32_lb128x7``); ``MUSE_MLX_GLU_WARPS`` and ``MUSE_MLX_HEAD_WARPS`` override them, and
the "16 warps" lines set the first to 16), and so
do --geometry, --geometry-q6k, --q8-geometry and --q8-pre-geometry (comma-separated lists give one
line each).

Compilers (``--compiler``): ``nvcc`` (default; ``nvcc -cubin -Xptxas -v``) or ``nvrtc`` (the
library MLX itself calls, through ctypes, with MLX's options). Neither needs a GPU. Install
either with pip into a virtualenv of its own (not the project's), e.g.::

    python3 -m venv /work/cudatools
    /work/cudatools/bin/pip install nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-cccl \
        nvidia-cuda-crt nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump nvidia-cuda-nvrtc

(CUDA 13: everything lands in site-packages/nvidia/cu13/{bin,include,lib}.) For CUDA 12 use
``--compiler nvrtc`` with ``nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12``:
the ``nvidia-cuda-nvcc-cu12`` wheel holds ptxas but no nvcc driver, and PyPI has nvdisasm and
cuobjdump only for CUDA 13 (which disassembles CUDA 12 cubins too). Tools are looked for in
--nvcc's folder, on PATH, then in /work/cudatools (or $CUDATOOLS). The SASS depends on the
compiler's version (13.0 and 13.5 differ in places): the first line printed names it; compare
with the NVRTC the GPU machine's MLX loads.

Examples::

    python scripts/kernel_sass.py                                  # every release call
    python scripts/kernel_sass.py --kernel q4_K_f32 --sweep        # NR0/NSG/U/P variants
    python scripts/kernel_sass.py --kernel mul_mv_q4_K_f32 --sass > q4k.sass
    python scripts/kernel_sass.py --kernel q6_K_f32 --loops        # each loop's opcode mix
    python scripts/kernel_sass.py --compiler nvrtc --as-launched --keep d2   # the #include form MLX
                                                                   # gets: diff d2/*.sass with a run without
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import glob
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muse_mlx import kernels as K  # noqa: E402
from muse_mlx.kernels import attention, cuda_prebuild, mul_mv  # noqa: E402
from muse_mlx.kernels.backend import Kernel, bounded_name  # noqa: E402

from environment import env  # noqa: E402

HEADER = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n#include <cooperative_groups.h>\n"
# NVRTC has no <cstdint>; MLX's utils.cuh brings the fixed-width types through libcu++ instead
NVRTC_HEADER = HEADER.replace("<cstdint>", "<cuda/std/cstdint>")
CUDATOOLS = os.environ.get("CUDATOOLS", "/work/cudatools")
INSTALL = f"""no CUDA toolchain found. Install one from PyPI into a virtualenv of its own (no GPU needed):
    python3 -m venv {CUDATOOLS}
    {CUDATOOLS}/bin/pip install nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-cccl nvidia-cuda-crt \\
        nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump nvidia-cuda-nvrtc
(CUDA 12: --compiler nvrtc with nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12,
plus the CUDA 13 nvidia-cuda-nvdisasm for the SASS). Then pass
    --nvcc {CUDATOOLS}/lib/python3.*/site-packages/nvidia/cu13/bin/nvcc,
put that folder on PATH, or leave the venv at {CUDATOOLS} (set $CUDATOOLS for another place)."""

# Release shapes (muse_mlx.writer MUSE_GLIMMER_30B, synthetic.RELEASE_VOCAB).
D, FF, QW, KVW, VOCAB, HEADS, HEADS_KV, HEAD_DIM, CTX = 6656, 19968, 4096, 256, 202048, 32, 2, 128, 8192
BLOCK = {"q4_K": 144, "q6_K": 210}
SWEEP = ["1x4x1", "2x2x1", "2x2x2", "2x2x4", "2x4x1", "4x2x1", "4x2x2", "4x4x1", "8x1x1", "8x2x1", "2x2x1x1",
         "2x4x1x1", "2x2x1x2"]

KEY_OPS = {  # column -> SASS base opcodes counted in it
    "FFMA": ("FFMA",), "FADD": ("FADD",), "FMUL": ("FMUL",), "LOP3": ("LOP3",), "SHF": ("SHF",),
    "IMAD": ("IMAD",), "IADD3": ("IADD3",), "LDG": ("LDG",), "LDS": ("LDS",), "STL": ("STL",),
    "LDL": ("LDL",), "I2F": ("I2F", "I2FP"), "F2F": ("F2F", "F2FP"), "IDP": ("IDP", "IDP4A"),
    "SHFL": ("SHFL",), "BRA": ("BRA",), "LEA": ("LEA",), "MOV": ("MOV",), "HFMA2": ("HFMA2",),
}  # HFMA2.MMA Rd, -RZ, RZ, imm is how ptxas often materializes a constant (a MOV on another pipe)


class ToolError(RuntimeError):
    pass


# -- the toolchain ------------------------------------------------------------------------------


def _cudatools_bins() -> list[str]:
    pats = ["lib/python3*/site-packages/nvidia/cu1*/bin", "lib/python3*/site-packages/nvidia/cuda_nvcc/bin",
            "lib/python3*/site-packages/nvidia/cuda_*/bin"]
    return sorted({d for p in pats for d in glob.glob(os.path.join(CUDATOOLS, p))}, reverse=True)


def find_tool(name: str, first: list[str] = ()) -> str | None:
    """``name`` in the folders ``first``, then on PATH, then in the cudatools venv."""
    for d in first:
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    if shutil.which(name):
        return shutil.which(name)
    for d in _cudatools_bins():
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return None


def include_dirs(tool: str) -> list[str]:
    """The header folders of a pip-installed toolkit (site-packages/nvidia/*/include): the CUDA 12
    wheels put cuda_fp16.h (runtime) and the CCCL apart from nvcc, whose profile knows only its own."""
    real = os.path.realpath(tool)
    m = re.search(r"^(.*/site-packages/nvidia)/", real)
    roots = [m.group(1)] if m else [str(Path(real).parents[1])]
    out = []
    for root in roots:
        for d in sorted(glob.glob(os.path.join(root, "*", "include"))) + [os.path.join(root, "include")]:
            if os.path.isdir(d) and d not in out:
                out.append(d)
            if os.path.isdir(os.path.join(d, "cccl")):
                out.append(os.path.join(d, "cccl"))
    return out


class Toolchain:
    def __init__(self, nvcc: str | None, compiler: str, arch: str):
        self.arch, self.compiler = arch, compiler
        first = [os.path.dirname(nvcc)] if nvcc else []
        if nvcc and not os.access(nvcc, os.X_OK):
            raise ToolError(f"--nvcc {nvcc}: not an executable\n" + INSTALL)
        self.nvcc = nvcc or find_tool("nvcc")
        if self.nvcc:
            first.append(os.path.dirname(os.path.realpath(self.nvcc)))
        self.nvdisasm = find_tool("nvdisasm", first)
        self.cuobjdump = find_tool("cuobjdump", first)
        self.nvrtc = None
        if compiler == "nvcc":
            if not self.nvcc:
                raise ToolError(INSTALL)
            ptxas = find_tool("ptxas", [os.path.dirname(os.path.realpath(self.nvcc))])
            if not ptxas:
                raise ToolError(f"{self.nvcc} has no ptxas beside it or on PATH\n" + INSTALL)
            self.includes = include_dirs(self.nvcc)
        else:
            self.nvrtc_path = self._find_nvrtc(first)
            self.includes = include_dirs(self.nvrtc_path)
            self.nvrtc = cuda_prebuild.Nvrtc(self.nvrtc_path, self.includes)
        if not (self.nvdisasm or self.cuobjdump):
            raise ToolError("no nvdisasm or cuobjdump (needed for the SASS)\n" + INSTALL)

    def _find_nvrtc(self, first) -> str:
        cands = [os.path.join(str(Path(d).parent), "lib") for d in first] + [
            os.path.join(str(Path(d).parent), "lib") for d in _cudatools_bins()] + glob.glob(
            os.path.join(CUDATOOLS, "lib/python3*/site-packages/nvidia/cuda_nvrtc/lib"))
        for d in cands:
            for lib in sorted(glob.glob(os.path.join(d, "libnvrtc.so*")), reverse=True):
                if "builtins" in lib:
                    continue
                with contextlib.suppress(OSError):
                    ctypes.CDLL(lib)
                    return lib
        with contextlib.suppress(OSError):
            ctypes.CDLL("libnvrtc.so")
            return "libnvrtc.so"
        raise ToolError("libnvrtc not found (pip install nvidia-cuda-nvrtc)\n" + INSTALL)

    def describe(self) -> str:
        if self.compiler == "nvcc":
            v = subprocess.run([self.nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
            return f"nvcc {self.nvcc} ({v[-2] if len(v) > 1 else '?'}), arch {self.arch}"
        major, minor = self.nvrtc.version
        return f"NVRTC {major}.{minor} (MLX's options), arch {self.arch}"

    def compile(self, source: str, work: Path) -> tuple[Path, str]:
        """``source`` -> (cubin, ptxas -v report)."""
        cu, cubin = work / "k.cu", work / "k.cubin"
        cu.write_text(source)
        if self.compiler == "nvcc":
            cmd = [self.nvcc, f"-arch={self.arch}", "-cubin", "-Xptxas", "-v", "-diag-suppress", "177",
                   "-o", str(cubin), str(cu)] + [f"-I{d}" for d in self.includes]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise ToolError(f"nvcc failed:\n{r.stderr[-4000:]}")
            return cubin, r.stdout + r.stderr
        return self._nvrtc_compile(source, cubin)

    def _nvrtc_compile(self, source: str, cubin: Path) -> tuple[Path, str]:
        try:
            code, _, log = self.nvrtc.build(source, self.arch, options=["--ptxas-options=-v"])
        except RuntimeError as e:
            raise ToolError(str(e)) from None
        cubin.write_bytes(code)
        return cubin, log

    def sass(self, cubin: Path) -> str:
        if self.nvdisasm:
            r = subprocess.run([self.nvdisasm, "-c", str(cubin)], capture_output=True, text=True)
        else:
            r = subprocess.run([self.cuobjdump, "-sass", str(cubin)], capture_output=True, text=True)
        if r.returncode != 0:
            raise ToolError(f"disassembly failed:\n{r.stderr[-2000:]}")
        return r.stdout


# -- reading ptxas -v and SASS ------------------------------------------------------------------


def ptxas_stats(log: str) -> dict:
    grab = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else None  # noqa: E731
    return dict(regs=grab(r"Used (\d+) registers"), stack=grab(r"(\d+) bytes stack frame"),
                spill_st=grab(r"(\d+) bytes spill stores"), spill_ld=grab(r"(\d+) bytes spill loads"),
                smem=grab(r"(\d+) bytes smem") or 0)


_INSN = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+|\.L_\w+):")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")


def parse_sass(text: str) -> list[dict]:
    """Instructions in order: address, full opcode (with modifiers), base opcode, text, branch target."""
    insns, labels, pending = [], {}, []
    for line in text.splitlines():
        if m := _LABEL.match(line.strip()):
            pending.append(m.group(1))
            continue
        m = _INSN.match(line)
        if not m:
            continue
        addr, body = int(m.group(1), 16), _PRED.sub("", m.group(2).strip())
        op = body.split()[0] if body else ""
        for lb in pending:
            labels[lb] = addr
        pending = []
        insns.append(dict(addr=addr, op=op, base=op.split(".")[0], text=m.group(2).strip(), target=None))
    for ins in insns:
        if ins["base"] in ("BRA", "BRX", "JMP"):
            if t := re.search(r"`\((\.L\w+)\)", ins["text"]):
                ins["target"] = labels.get(t.group(1))
            elif t := re.search(r"\b0x([0-9a-f]+)\b", ins["text"].split(None, 1)[-1]):
                ins["target"] = int(t.group(1), 16)
    return insns


def opcode_counts(insns) -> collections.Counter:
    return collections.Counter(i["base"] for i in insns if i["base"] != "NOP")


def mem_widths(insns, base: str) -> collections.Counter:
    """``LDG.E.128`` -> '128', ``LDG.E`` -> '32', ``LDG.E.U8`` -> 'U8' ..."""
    out = collections.Counter()
    for i in insns:
        if i["base"] == base:
            mods = i["op"].split(".")[1:]
            w = next((m for m in mods if m in ("128", "64", "U8", "S8", "U16", "S16")), "32")
            out[w] += 1
    return out


def loops(insns) -> list[dict]:
    """Every backward branch's body (target .. branch), innermost first by size. A "backward"
    branch whose span holds an EXIT is not a loop: it is an out-of-line path (the convergence
    fallback of a shuffle under divergence, placed after the exits) jumping back into the code."""
    out = []
    for k, ins in enumerate(insns):
        if ins["target"] is not None and ins["target"] < ins["addr"]:
            start = next(j for j, x in enumerate(insns) if x["addr"] >= ins["target"])
            body = insns[start : k + 1]
            if len(body) > 1 and not any(x["base"] == "EXIT" for x in body):
                out.append(dict(start=ins["target"], end=ins["addr"], body=body))
    return sorted(out, key=lambda lp: len(lp["body"]))


def hot_loops(lps) -> list[dict]:
    """The innermost loops that do arithmetic (FFMA/IDP), most of it first."""
    leaves = [lp for lp in lps if work(lp) and not any(
        o is not lp and lp["start"] <= o["start"] and o["end"] <= lp["end"] and work(o) for o in lps)]
    return sorted(leaves, key=lambda lp: -work(lp))


def work(lp) -> int:
    c = opcode_counts(lp["body"])
    return c["FFMA"] + c["IDP"] + c["HFMA2"]


# Weights one lane handles per block-row, and how to count a loop body's block-rows from its loads.
def weights_in_loop(name: str, lp) -> tuple[int, str] | None:
    body = lp["body"]
    ldg = mem_widths(body, "LDG")
    if name in ("mul_mv_q4_K_f32", "mul_mv_glu_f32", "mul_mv_multi_f32") and ldg["64"]:
        # q4K_lane_sums: per block-row one uint4 header + two uint2 quant runs (LDG.E.64); 32 weights
        br = ldg["64"] // 2
        return 32 * br, f"{br} block-row(s) x 32"
    lds = mem_widths(body, "LDS")
    if name in ("mul_mv_q4_K_f32", "mul_mv_glu_f32", "mul_mv_multi_f32") and lds["64"] and not ldg["U16"]:
        # staged (q4K_stage_round): the same three words per block-row, read from threadgroup memory
        br = lds["64"] // 2
        return 32 * br, f"{br} block-row(s) x 32, staged"
    if name == "mul_mv_q4_K_q8_multi" and opcode_counts(body)["IDP"]:
        br = opcode_counts(body)["IDP"] // 16  # 16 dp4a per block-row (two sub-blocks of 32)
        return 64 * br, f"{br} block-row(s) x 64"
    if name in ("mul_mv_q6_K_f32", "mul_mv_glu_q6K_f32", "mul_mv_multi_f32", "mul_mv_q4_K_q8_multi") and ldg["U16"]:
        # q6K_lane_sums: per block-row three u32 read as ushort pairs + the half d = 7 LDG.E.U16, and the
        # four scales as bytes (U8); in the split form (no byte loads) the half d is the only U16; 16 weights
        br = ldg["U16"] // 7 if ldg["U8"] else ldg["U16"]
        return 16 * br, f"{br} block-row(s) x 16"
    return None


# -- the calls ----------------------------------------------------------------------------------


def zeros_rows(rows: int, k: int, kind: str) -> mx.array:
    return mx.zeros((rows, k // 256 * BLOCK[kind]), dtype=mx.uint8)  # lazy: recording reads only the shape


def geo(g: tuple) -> str:
    return "x".join(str(v) for v in g)


def record_calls(q4_geoms: list[str], q6_geoms: list[str], q8_geoms: list[str], everything: bool,
                 q4_single: list[str] | None = None, q8_pre_geoms: list[str] = (), head: list[str] | None = None,
                 q4_multi: list[str] | None = None):
    """(label, recorded call) for each release launch, once per geometry (the head's own, ``head``,
    the lone and multi Q4_K calls' own, ``q4_single`` and ``q4_multi``, when given, else the Q6_K
    and the GLU's)."""
    out = []

    def rec(label, fn, *a, **kw):
        Kernel.recorded.clear()
        fn(*a, which="record", **kw)
        out.extend((label, c) for c in Kernel.recorded)

    y_d, y_ff = mx.zeros((1, D)), mx.zeros((1, FF))
    q4 = lambda r, k: zeros_rows(r, k, "q4_K")  # noqa: E731
    q6 = lambda r, k: zeros_rows(r, k, "q6_K")  # noqa: E731
    # the halves lines' form: 1, unless MUSE_MLX_Q4K_HALVES=2 asks for the scales as halves too
    halves = "2" if os.environ.get("MUSE_MLX_Q4K_HALVES") == "2" else "1"
    for g in q4_single or q4_geoms:  # the lone Q4_K matrices ("q4_K single" when tuned)
        rec(f"ffn_gate/up {FF}x{D}", K.mul_mv_q4_K, y_d, q4(FF, D), geometry=g)
        rec(f"ffn_down {D}x{FF}", K.mul_mv_q4_K, y_ff, q4(D, FF), geometry=g)
        rec(f"attn_out {D}x{QW}", K.mul_mv_q4_K, mx.zeros((1, QW)), q4(D, QW), geometry=g)
        with env("MUSE_MLX_Q4K_HALVES", halves):  # the lone calls' CUDA form (1)
            rec(f"ffn_down {D}x{FF} halves", K.mul_mv_q4_K, y_ff, q4(D, FF), geometry=g)
            rec(f"attn_out {D}x{QW} halves", K.mul_mv_q4_K, mx.zeros((1, QW)), q4(D, QW), geometry=g)
    prep = mul_mv.Q4KPrepared(y_d, mx.zeros((1, D // 8)), int(halves))  # as a tail prepares them
    qkvg = [(q4(QW, D), "q4_K"), (q4(KVW, D), "q4_K"), (q6(KVW, D), "q6_K"), (q4(QW, D), "q4_K")]
    for g in q4_multi or q4_geoms:  # the q|k|v|gate call ("q4_K multi" when tuned)
        rec(f"q|k|v|gate {QW}+{KVW}+{KVW}(q6)+{QW}", K.mul_mv_multi, y_d, qkvg, geometry=g)
        with env("MUSE_MLX_Q4K_HALVES", halves):
            rec(f"q|k|v|gate {QW}+{KVW}+{KVW}(q6)+{QW} prepared", K.mul_mv_multi, y_d, qkvg, geometry=g, prep=prep)
            # the layers whose attn_v is Q4_K (half of them in the Q4_K_M mix): Q4_K slots only
            rec(f"q|k|v|gate {QW}+{KVW}+{KVW}+{QW} prepared", K.mul_mv_multi, y_d,
                [(q4(QW, D), "q4_K"), (q4(KVW, D), "q4_K"), (q4(KVW, D), "q4_K"), (q4(QW, D), "q4_K")], geometry=g,
                prep=prep)
    for g in q4_geoms:
        glu = lambda form, **kw: rec(f"ffn_gate+up q4_K {FF}x{D} silu{form}", K.mul_mv_glu, y_d, q4(FF, D),  # noqa: E731
                                     q4(FF, D), "q4_K", "silu", geometry=g, **kw)
        glu("")
        with env("MUSE_MLX_Q4K_HALVES", halves):  # a halves form, alone and with prepared activations
            glu(" halves")
            glu(" prepared", prep=prep)
            with env("MUSE_MLX_GLU_WARPS", "16"):  # bounded for 16 warps per SM (128 registers at NSG 2)
                glu(" halves, 16 warps")
                glu(" prepared, 16 warps", prep=prep)
    for g in head or q6_geoms:
        rec(f"head {VOCAB}x{D}", K.mul_mv_q6_K, y_d, q6(VOCAB, D), geometry=g, head=True)
        rec(f"head {VOCAB}x{D} split", K.mul_mv_q6_K, y_d, q6(VOCAB, D), geometry=g, head=True, split=True)
    for g in q6_geoms:
        rec(f"ffn_down {D}x{FF}", K.mul_mv_q6_K, y_ff, q6(D, FF), geometry=g)
        rec(f"ffn_down {D}x{FF} split (CUDA's default)", K.mul_mv_q6_K, y_ff, q6(D, FF), geometry=g, split=True)
        rec(f"ffn_gate+up q6_K {FF}x{D} silu", K.mul_mv_glu, y_d, q6(FF, D), q6(FF, D), "q6_K", "silu", geometry=g)
    for g in q8_geoms:  # the kernel that quantizes per threadgroup: a mix with Q6_K, and by default
        with env("MUSE_MLX_Q8_GEOMETRY", g):  # every all-Q4_K call but the GLU
            rec(f"q8 q|k|v|gate {QW}+{KVW}+{KVW}(q6)+{QW}", K.mul_mv_q8, y_d,
                [(q4(QW, D), "q4_K"), (q4(KVW, D), "q4_K"), (q6(KVW, D), "q6_K"), (q4(QW, D), "q4_K")])
            rec(f"q8 ffn_down {D}x{FF}", K.mul_mv_q8, y_ff, [(q4(D, FF), "q4_K")])
    q6s = lambda r, k: zeros_rows(r, k, "q6_K")  # noqa: E731  (the split form has the raw form's shape)
    # a geometry None: each mul_mv_q8_pre call at CUDA's default for its class (the GLU's, the
    # projections', the head's: mul_mv.q8_call), as in the decode; else every call at that one
    cuda_class = {c: geo(mul_mv.q8_pre_geometry("cuda", c)) for c in ("glu", "few", "many")}
    for g in q8_pre_geoms:  # the GLU (and, forced, the rest): activations quantized once, then mul_mv_q8_pre
        with env("MUSE_MLX_Q8_PRE_GEOMETRY", g or cuda_class["glu"]), \
                env("MUSE_MLX_Q8_PRE_GEOMETRY_FEW", g or cuda_class["few"]), \
                env("MUSE_MLX_Q8_PRE_GEOMETRY_MANY", g or cuda_class["many"]):  # split Q6_K (mv_q8_q6k) takes it anyway
            rec(f"q8 Q6_K split ffn_down {D}x{FF}", K.mul_mv_q8, y_ff, [(q6s(D, FF), "q6_K_split")])
            rec(f"q8 Q6_K split head {VOCAB}x{D}", K.mul_mv_q8, y_d, [(q6s(VOCAB, D), "q6_K_split")])
            rec(f"q8 q|k|v|gate {QW}+{KVW}+{KVW}(q6 split)+{QW}", K.mul_mv_q8, y_d,
                [(q4(QW, D), "q4_K"), (q4(KVW, D), "q4_K"), (q6s(KVW, D), "q6_K_split"), (q4(QW, D), "q4_K")])
            rec(f"q8 ffn_gate+up {FF}x{D} silu, output quantized too", K.mul_mv_q8, y_d,
                [(q4(FF, D), "q4_K"), (q4(FF, D), "q4_K")], glu="silu", q8_out=True)
            # the Q4_K rows in tiles (quants.tile_q4_K_rows; bench.py --parts tiles times them): the GLU at a
            # SIMD group's 16 rows, the all-Q4_K calls at their 4
            rec(f"q8 ffn_gate+up {FF}x{D} silu, output quantized too, rows in tiles of 16", K.mul_mv_q8, y_d,
                [(q4(FF, D), "q4_K"), (q4(FF, D), "q4_K")], glu="silu", q8_out=True, tile=16)
            rec(f"q8 ffn_down {D}x{FF}, rows in tiles of 4", K.mul_mv_q8, y_ff, [(q4(D, FF), "q4_K")],
                q8=mul_mv.quantize_q8_rows(y_ff, which="cpu"), tile=4)
        with env("MUSE_MLX_Q8_PRE_GEOMETRY", g or cuda_class["glu"]), env("MUSE_MLX_Q8_PRE_GEOMETRY_FEW", g or cuda_class["few"]), \
                env("MUSE_MLX_Q8_PRE", "all"):
            rec(f"q8 ffn_down {D}x{FF}", K.mul_mv_q8, y_ff, [(q4(D, FF), "q4_K")])
            rec(f"q8 q|k|v|gate {QW}+{KVW}+{KVW}+{QW}", K.mul_mv_q8, y_d,
                [(q4(QW, D), "q4_K"), (q4(KVW, D), "q4_K"), (q4(KVW, D), "q4_K"), (q4(QW, D), "q4_K")])
            rec(f"q8 ffn_gate+up {FF}x{D} silu", K.mul_mv_q8, y_d, [(q4(FF, D), "q4_K"), (q4(FF, D), "q4_K")],
                glu="silu")
            # attn_output on the attention's quantized output (attn_decode_fused_q8), as the decode runs it
            y_o = mx.zeros((1, QW))
            rec(f"q8 attn_output {D}x{QW}", K.mul_mv_q8, y_o, [(q4(D, QW), "q4_K")],
                q8=mul_mv.quantize_q8_rows(y_o, which="cpu"))
    if everything:
        x, w = mx.zeros((1, D)), mx.zeros((D,))
        rec("attn_norm", K.rms_norm_mul, x, w)
        rec("norm + add", K.rms_norm_mul, x, w, add=x)
        rec("q/k norm", K.rms_norm_mul, mx.zeros((1, 1, QW + 2 * KVW + QW)), mx.zeros((HEADS + HEADS_KV, HEAD_DIM)),
            n=HEAD_DIM, rows=HEADS + HEADS_KV, out_shape=(1, HEADS + HEADS_KV, 1, HEAD_DIM))
        rec("rms_norm_batch", K.rms_norm_batch, mx.zeros((64, D)), w)
        rec("rms_norm_f16", K.rms_norm_f16, x, w)
        rec("tail_dual_eps", K.tail_dual_eps, x, x, w, w, 1e-6, 1e-6)
        rec("tail_dual_eps_q8 (mv_q8)", K.tail_dual_eps_q8, x, x, w, w, 1e-6, 1e-6)
        rec(f"logit_stats {VOCAB}", K.logit_stats, mx.zeros((1, VOCAB)))
        with env("MUSE_MLX_Q4K_HALVES", halves):  # the form the prepared lines above read
            rec("tail_dual_eps_q4 (prepared activations)", K.tail_dual_eps_q4, x, x, w, w, 1e-6, 1e-6)
        rec("tail_32sg", K.tail_32sg, x, x, w, w, 1e-6, 1e-6)
        rec("silu_mul", K.silu_mul, mx.zeros((1, FF)), mx.zeros((1, FF)))
        rec("gelu_mul", K.gelu_mul, mx.zeros((1, FF)), mx.zeros((1, FF)))
        rec("ffn_4r2s", K.ffn_q4k_gate_up_4r2s, y_d, q4(FF, D), q4(FF, D), "silu")
        dtypes = [mx.float32] + ([mx.float16] if "dtype" in inspect.signature(K.dequantize_rows).parameters else [])
        for dt in dtypes:
            kw = {"dtype": dt} if dt != mx.float32 else {}
            rec(f"dequant q4_K {str(dt).split('.')[-1]} (64 rows)", K.dequantize_rows, q4(64, D), "q4_K", **kw)
            rec(f"dequant q6_K {str(dt).split('.')[-1]} (64 rows)", K.dequantize_rows, q6(64, D), "q6_K", **kw)
            rec(f"dequant q4_K {str(dt).split('.')[-1]} (64 rows in tiles of 16: the q8 GLU's tiled form)",
                K.dequantize_rows, q4(64, D), "q4_K", tile=16, **kw)
        rec("embedding row (token_embd q4_K)", K.embed_rows, q4(VOCAB, D), mx.array([7], dtype=mx.int32), "q4_K")
        rec("qk_rope_pack", K.qk_rope_pack, mx.zeros((QW + 2 * KVW,)), mx.zeros((HEADS + HEADS_KV, HEAD_DIM)), 1e-6,
            mx.array([5], dtype=mx.int32), attention.rope_table(HEAD_DIM, 10000.0, 1.0), rows=HEADS + HEADS_KV,
            hkv=HEADS_KV, d=HEAD_DIM, rd=HEAD_DIM, traditional=True, v_offset=QW + KVW, nth=32)
        kv = mx.zeros((2, HEADS_KV, CTX, HEAD_DIM), dtype=mx.float16)
        rec(f"attn_decode ctx {CTX}", K.attn_decode, mx.zeros((HEADS, HEAD_DIM)), kv, mx.array([5], dtype=mx.int32),
            attention.decode_geometry(CTX, 0), 0.088, mx.zeros((QW,)))
        short = attention.FUSED_SPLITS * attention.CMAX  # the longest cache the one-dispatch form takes
        rec(f"attn_decode ctx {short}", K.attn_decode, mx.zeros((HEADS, HEAD_DIM)),
            mx.zeros((2, HEADS_KV, short, HEAD_DIM), dtype=mx.float16), mx.array([5], dtype=mx.int32),
            attention.decode_geometry(short, 0), 0.088, mx.zeros((QW,)))
        if hasattr(attention, "attn_decode_token"):
            token_args = (mx.zeros((QW + 2 * KVW + QW,)), mx.zeros((HEADS + HEADS_KV, HEAD_DIM)), 1e-6,
                          mx.array([5], dtype=mx.int32), attention.rope_table(HEAD_DIM, 10000.0, 1.0),
                          mx.zeros((2, HEADS_KV, short, HEAD_DIM), dtype=mx.float16),
                          attention.decode_geometry(short, 0), 0.088, mx.zeros((QW + 2 * KVW + QW,)))
            token_kw = dict(n_head=HEADS, rd=HEAD_DIM, traditional=False, v_offset=QW + KVW, nth=32,
                            gate_offset=QW + 2 * KVW)
            for label, extra in ((" (with the norms and RoPE)", {}),
                                 (", its output quantized too (q8 route, MUSE_MLX_Q8_ATTN=1)", dict(q8_out=True)),
                                 (", quantized, handing its planes out whole (MUSE_MLX_KV_WRITE=through)",
                                  dict(q8_out=True, through=True))):
                rec(f"attn_decode_token ctx {short}{label}", attention.attn_decode_token, *token_args, **token_kw,
                    **extra)
    return out


def dedupe(calls):
    """One entry per distinct translation unit (kernel, dtypes, template); labels joined."""
    seen: dict[tuple, list] = {}
    for label, c in calls:
        key = (c["kernel"].name, tuple(str(a.dtype) for a in c["inputs"]), tuple(map(str, c["output_dtypes"])),
               tuple(c["template"] or ()), c["bounds"])
        if key in seen:
            if label not in seen[key][0]:
                seen[key][0].append(label)
        else:
            seen[key] = [[label], c]
    return list(seen.values())


# -- main ---------------------------------------------------------------------------------------


def short_template(tmpl) -> str:
    return " ".join(f"{k}={int(v)}" for k, v in (tmpl or []))


def analyse(tc: Toolchain, labels, c, tmp: Path, want_sass: bool, as_launched: bool = False,
            own_header: bool = False) -> dict:
    kernel = c["kernel"]
    header = NVRTC_HEADER if tc.compiler == "nvrtc" else HEADER
    if own_header:  # what MUSE_MLX_CUDA_PREBUILD compiles behind: CUDA's half and bfloat16 headers alone
        header = cuda_prebuild.OWN_HEADER
    src = header + Kernel.recorded_source(c, as_launched)
    start = time.perf_counter()
    cubin, log = tc.compile(src, tmp)
    seconds = time.perf_counter() - start
    text = tc.sass(cubin)
    insns = [i for i in parse_sass(text) if i["base"] != "NOP"]
    counts = opcode_counts(insns)
    lps = loops(insns)
    hot = hot_loops(lps)
    for lp in hot:
        lp["weights"] = weights_in_loop(kernel.name, lp)
    tg = c["threadgroup"]
    return dict(name=bounded_name(kernel.name, c["bounds"]), labels=labels, threads=tg[0] * tg[1] * tg[2], template=c["template"],
                stats=ptxas_stats(log), n=len(insns), counts=counts, ldg=mem_widths(insns, "LDG"),
                lds=mem_widths(insns, "LDS"), loops=lps, hot=hot, sass=text if want_sass else None, ptxas=log,
                compile_s=seconds)


def fmt_widths(c: collections.Counter) -> str:
    order = ["128", "64", "32", "U16", "S16", "U8", "S8"]
    return ",".join(f"{k}x{c[k]}" for k in order if c[k]) or "-"


def warps_per_sm(regs: int | None, smem: int, threads: int) -> int | None:
    """Resident warps per SM on sm_90 as registers, shared memory and the 32-block limit allow
    (64K registers allocated per warp in multiples of 8 per thread, 228 KB of shared memory
    with 1 KB reserved per block, 64 warps at most)."""
    if not regs:
        return None
    wpb = -(-threads // 32)
    by_regs = 65536 // (-(-regs // 8) * 8 * 32) // wpb
    by_smem = 233472 // (smem + 1024) if smem else 32
    return min(by_regs, by_smem, 32, 64 // wpb) * wpb


def print_line(r: dict, ops: list[str]) -> None:
    s = r["stats"]
    cnt = lambda c, col: sum(c[o] for o in KEY_OPS.get(col, (col,)))  # noqa: E731
    print(f"{r['name']}  {short_template(r['template'])}  <- {'; '.join(r['labels'])}")
    occ = warps_per_sm(s["regs"], s["smem"], r["threads"])
    print(f"    regs={s['regs']} spill st/ld={s['spill_st']}/{s['spill_ld']} B stack={s['stack']} B smem={s['smem']} B"
          f" warps/SM<={occ}  SASS={r['n']}  LDG={fmt_widths(r['ldg'])} LDS={fmt_widths(r['lds'])}"
          f"  compile={r['compile_s']:.2f} s")
    print("    " + " ".join(f"{o}={cnt(r['counts'], o)}" for o in ops))
    for lp in r["hot"][:2] or [None]:
        if lp is None:
            print("    hot loop: -")
            continue
        n = len(lp["body"])
        loop = f"{n} insn/iter"
        if lp.get("weights"):
            wts, how = lp["weights"]
            loop += f", {wts} w/lane/iter ({how}) = {n / wts:.2f} insn/w"
        hc = opcode_counts(lp["body"])
        loop += "\n      [" + " ".join(f"{o}={cnt(hc, o)}" for o in ops if cnt(hc, o))
        loop += f"] LDG={fmt_widths(mem_widths(lp['body'], 'LDG'))}"
        print(f"    hot loop {lp['start']:#06x}..{lp['end']:#06x}: {loop}")


def print_loops(r: dict) -> None:
    for k, lp in enumerate(r["loops"]):
        c = opcode_counts(lp["body"])
        print(f"    loop {k}: {lp['start']:#06x}..{lp['end']:#06x}  {len(lp['body'])} insn  "
              f"LDG={fmt_widths(mem_widths(lp['body'], 'LDG'))}  "
              + " ".join(f"{o}={n}" for o, n in c.most_common()))


def main(argv=None) -> int:
    # record mode takes no staged loads (the emulator's default); what CUDA compiles does
    mul_mv.Q4K_STAGES["record"] = mul_mv.Q4K_STAGES["cuda"]
    mul_mv.Q6K_STAGES["record"] = mul_mv.Q6K_STAGES["cuda"]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", help="only kernels whose name contains this (case-insensitive)")
    ap.add_argument("--nvcc", help="the nvcc to use (default: on PATH, else in $CUDATOOLS=/work/cudatools)")
    ap.add_argument("--compiler", choices=("nvcc", "nvrtc"), default="nvcc")
    ap.add_argument("--arch", default="sm_90a", help="default sm_90a: what MLX asks NVRTC for on an H100/H200")
    ap.add_argument("--geometry", help="Q4_K geometries NR0xNSG[xU[xP]], comma-separated (default: CUDA tuned)")
    ap.add_argument("--geometry-q6k", help="Q6_K geometries, comma-separated (default: CUDA tuned)")
    ap.add_argument("--q8-geometry", help="q8 kernel geometries NR0xNSG, comma-separated (default: CUDA's)")
    ap.add_argument("--q8-pre-geometry", help="mul_mv_q8_pre geometries NR0xNSGxLPR, comma-separated "
                                              "(default: CUDA's)")
    ap.add_argument("--sweep", action="store_true", help=f"Q4_K geometries {','.join(SWEEP)}")
    ap.add_argument("--matvec-only", action="store_true", help="skip the norm, elementwise and attention kernels")
    ap.add_argument("--sass", action="store_true", help="print the SASS of each selected kernel")
    ap.add_argument("--loops", action="store_true", help="print every loop's opcode mix")
    ap.add_argument("--ops", help="comma-separated opcode columns (default: " + ",".join(KEY_OPS) + ")")
    ap.add_argument("--keep", help="write each .cu, .cubin, .sass and ptxas log into this folder")
    ap.add_argument("--as-launched", action="store_true",
                    help="compile the source as MLX gets it (header and body behind #include lines, "
                         "backend.Kernel.launch_texts) instead of the texts themselves")
    ap.add_argument("--own-header", action="store_true",
                    help="compile behind cuda_prebuild.OWN_HEADER (what MUSE_MLX_CUDA_PREBUILD builds with) instead of "
                         "the CUDA headers MLX's default header includes: diff the --keep folders' .sass of a run "
                         "with and one without it")
    ap.add_argument("--prebuild", metavar="DIR",
                    help="(NVRTC) build every selected variant as MUSE_MLX_CUDA_PREBUILD does, into DIR as MLX's cache "
                         "folder, twice: the first pass compiles, the second finds the files; prints both times")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends us quietly

    try:
        tc = Toolchain(a.nvcc, a.compiler, a.arch)
    except ToolError as e:
        print(f"kernel_sass: {e}", file=sys.stderr)
        return 2
    q4 = (SWEEP if a.sweep else a.geometry.split(",")) if (a.sweep or a.geometry) else \
        [geo(mul_mv.mv_geometry("tuned", "cuda", "q4_K"))]
    tuned_geometries = not (a.sweep or a.geometry)
    q4_single = [geo(mul_mv.mv_geometry("tuned", "cuda", "q4_K single"))] if tuned_geometries else None
    q4_multi = [geo(mul_mv.mv_geometry("tuned", "cuda", "q4_K multi"))] if tuned_geometries else None
    q6 = a.geometry_q6k.split(",") if a.geometry_q6k else [geo(mul_mv.mv_geometry("tuned", "cuda", "q6_K"))]
    head = None if a.geometry_q6k else [geo(mul_mv.mv_geometry("tuned", "cuda", "q6_K head"))]
    q8 = a.q8_geometry.split(",") if a.q8_geometry else [geo(mul_mv._q8_geometry("cuda"))]
    q8_pre = a.q8_pre_geometry.split(",") if a.q8_pre_geometry else [None]  # None: each call class its own
    calls = dedupe(record_calls(q4, q6, q8, not a.matvec_only, q4_single, q8_pre, head, q4_multi))
    if not a.matvec_only:
        missing = {k.name for k in K.ALL_KERNELS} - {c["kernel"].name for _, c in calls}
        if missing:
            print(f"kernel_sass: no release call recorded for {', '.join(sorted(missing))}", file=sys.stderr)
    if a.kernel:
        calls = [(lb, c) for lb, c in calls if a.kernel.lower() in c["kernel"].name.lower()]
    if not calls:
        print("kernel_sass: no kernel matches", file=sys.stderr)
        return 1
    if a.prebuild:
        return prebuild_all(tc, calls, Path(a.prebuild))
    ops = a.ops.split(",") if a.ops else list(KEY_OPS)
    print(f"# {tc.describe()}", file=sys.stderr if a.sass else sys.stdout)
    keep = Path(a.keep) if a.keep else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    seconds = []
    for k, (labels, c) in enumerate(calls):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                r = analyse(tc, labels, c, Path(tmp), a.sass or bool(keep), a.as_launched, a.own_header)
            except ToolError as e:
                print(f"{c['kernel'].name} {short_template(c['template'])}: {e}", file=sys.stderr)
                return 1
            if keep:
                stem = keep / f"{k:02d}_{c['kernel'].name}"
                for ext in ("cu", "cubin"):
                    shutil.copy(Path(tmp) / f"k.{ext}", f"{stem}.{ext}")
                Path(f"{stem}.sass").write_text(r["sass"])
                Path(f"{stem}.ptxas.txt").write_text(r["ptxas"])
        seconds.append(r["compile_s"])
        if a.sass:
            print(f"// ===== {r['name']}  {short_template(r['template'])}  <- {'; '.join(labels)}")
            print(r["sass"])
            continue
        print_line(r, ops)
        if a.loops:
            print_loops(r)
    print(compile_summary(tc, seconds, a.own_header), file=sys.stderr if a.sass else sys.stdout)
    return 0


def prebuild_all(tc: Toolchain, calls, folder: Path) -> int:
    """Every call's variant through ``cuda_prebuild.ensure`` into ``folder`` (as ``MLX_PTX_CACHE_DIR``)
    with this toolchain's NVRTC, twice: what a first process and a later one pay at first launches."""
    if tc.compiler != "nvrtc":
        print("kernel_sass: --prebuild needs --compiler nvrtc (the library cuda_prebuild calls)", file=sys.stderr)
        return 2
    nvrtc = tc.nvrtc
    compiler = lambda src, kernel: nvrtc.compile(src, kernel, tc.arch)  # noqa: E731
    print(f"# NVRTC {nvrtc.version[0]}.{nvrtc.version[1]} ({tc.nvrtc_path}), arch {tc.arch}, into {folder}")
    os.environ["MLX_PTX_CACHE_DIR"] = str(folder)
    for label in ("first process (builds)", "later process (finds)"):
        seconds, left = [], 0
        for _, c in calls:
            k = c["kernel"]
            header, body = k.launch_texts(c["bounds"])
            start = time.perf_counter()
            path = cuda_prebuild.ensure(bounded_name(k.name, c["bounds"]), header, body, k.inputs, c["inputs"],
                                        k.outputs, c["output_dtypes"], c["template"], compiler=compiler)
            seconds.append(time.perf_counter() - start)
            left += path is None
        ordered = sorted(seconds)
        print(f"# {label}: {len(seconds) - left} variants, {left} left to MLX, {sum(seconds):.2f} s in all, "
              f"median {ordered[len(ordered) // 2]:.3f} s, the dearest {ordered[-1]:.3f} s")
    return 0


def header_seconds(tc: Toolchain, groups: bool = True, own: bool = False) -> float:
    """The fastest of three compiles of an empty kernel behind the header every unit here starts
    with (CUDA's headers that MLX's default header includes, minus MLX's own utils.cuh): the part of
    each compile that no kernel of ours can remove. ``groups=False``: without cooperative_groups.h."""
    header = cuda_prebuild.OWN_HEADER if own else NVRTC_HEADER if tc.compiler == "nvrtc" else HEADER
    if not groups:
        header = header.replace("#include <cooperative_groups.h>\n", "")
    src = header + "__global__ void custom_kernel_empty(float* out) { out[0] = 0.0f; }\n"
    best = float("inf")
    for _ in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            tc.compile(src, Path(tmp))
            best = min(best, time.perf_counter() - start)
    return best


def compile_summary(tc: Toolchain, seconds: list[float], own: bool = False) -> str:
    """One line: the compiles' count, total and median, beside the header's own cost. MLX compiles
    each kernel variant (name, source, template values) at its first launch in every process, one
    after another (it keeps no custom kernel's build on disk); these are one CPU core's seconds here."""
    ordered = sorted(seconds)
    median = ordered[len(ordered) // 2] if ordered else 0.0
    if own:
        return (f"# {len(seconds)} compiles, {sum(seconds):.1f} s in all, median {median:.2f} s; an empty kernel "
                f"behind the same header (cuda_prebuild's) {header_seconds(tc, own=True):.2f} s")
    return (f"# {len(seconds)} compiles, {sum(seconds):.1f} s in all, median {median:.2f} s; an empty kernel "
            f"behind the same header {header_seconds(tc):.2f} s, {header_seconds(tc, groups=False):.2f} s "
            "without cooperative_groups.h")


if __name__ == "__main__":
    sys.exit(main())
