"""cuda_prebuild: MLX's module names rebuilt (the source build_kernel makes, libstdc++'s string
hash), and the files MLX reads written where and as it reads them. The names are checked against
MLX itself on a GPU (scripts/gpu_check.py --only prebuild); here against g++'s std::hash and the
layout read in MLX's custom_kernel.cpp and jit_module.cpp."""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import pytest

from muse_mlx.kernels import cuda_prebuild as cp
from muse_mlx.kernels.backend import Kernel

STRINGS = [b"", b"a", b"abcdefg", b"abcdefgh", b"abcdefghi", bytes(range(256)) * 3, "µ-kernel\n".encode(),
           (cp.MLX_DEFAULT_HEADER + "namespace mlx::core::cu {\n}\n").encode()]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
def test_cxx_string_hash_is_libstdcxx_std_hash(tmp_path):
    """Every length class of _Hash_bytes (empty, a tail only, whole words, words and a tail, bytes
    above 0x7f) against std::hash<std::string> as g++ builds it."""
    src = tmp_path / "h.cc"
    src.write_text('#include <fstream>\n#include <iostream>\n#include <iterator>\n#include <string>\n'
                   'int main(int c, char** v) { for (int i = 1; i < c; ++i) { std::ifstream f(v[i], std::ios::binary);'
                   ' std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());'
                   ' std::cout << std::hash<std::string>{}(s) << "\\n"; } }\n')
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "h"), str(src)], check=True)
    files = []
    for i, s in enumerate(STRINGS):
        (tmp_path / f"s{i}").write_bytes(s)
        files.append(str(tmp_path / f"s{i}"))
    want = [int(v) for v in subprocess.run([str(tmp_path / "h"), *files], capture_output=True, text=True,
                                           check=True).stdout.split()]
    assert [cp.cxx_string_hash(s) for s in STRINGS] == want


def test_mlx_source_is_build_kernels_text():
    """The translation unit as custom_kernel.cpp's build_kernel writes it (read at MLX 846d176):
    inputs const, outputs not, the template's values as constants and a blank line after them,
    the template's values in the kernel's name."""
    name = cp.mlx_kernel_name("probe", [("N", 3), ("B", True)])
    assert name == "custom_kernel_probe_3_t"
    got = cp.mlx_source(name, "H\n", "BODY;", ["x", "w"], [mx.float32, mx.uint8], ["y", "z"], [mx.float32, mx.uint32],
                        [("N", 3), ("B", True)])
    assert got == ("H\nnamespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
                   "__global__ void custom_kernel_probe_3_t(\n    const float* x,\n    const uint8_t* w,\n"
                   "    float* y,\n    uint32_t* z) {\n  constexpr int N = 3;\n  constexpr bool B = true;\n\n"
                   "BODY;\n}\n\n} // namespace mlx::core::cu\n")
    bare = cp.mlx_source("custom_kernel_k", "", "B;", ["a"], [mx.float16], ["o"], [mx.bfloat16], None)
    assert bare.endswith("(\n    const __half* a,\n    __nv_bfloat16* o) {\nB;\n}\n\n} // namespace mlx::core::cu\n")
    # the module: the name, then the hash of MLX's whole source (its default header first), in hex
    h = cp.cxx_string_hash((cp.MLX_DEFAULT_HEADER + got).encode())
    assert cp.module_name(name, got) == f"custom_kernel_probe_3_t_{h:x}"


def test_cache_folder_and_long_names(tmp_path, monkeypatch):
    """MLX_PTX_CACHE_DIR, else <temp>/mlx/<version>/ptx with libstdc++'s order of temp variables;
    a name longer than 245 characters becomes folders of 245 (jit_module.cpp's get_ptx_path)."""
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    for var in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TEMP", str(tmp_path / "c"))
    monkeypatch.setenv("TMP", str(tmp_path / "b"))
    assert cp.cache_dir() == tmp_path / "b" / "mlx" / mx.__version__ / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mine"))
    assert cp.cache_dir() == tmp_path / "mine"
    name = "n" * 600
    assert cp.ptx_path(tmp_path, name) == tmp_path / ("n" * 245) / ("n" * 245) / ("n" * 110 + ".ptx")
    assert cp.ptx_path(tmp_path, "short") == tmp_path / "short.ptx"


def test_ensure_writes_what_mlx_reads_once(tmp_path, monkeypatch):
    """The cubin at <module>.ptx and 'mlx::core::cu::<kernel><TAB><lowered name>' beside it, no
    temporary file left; compiled from our header and MLX's text, once; a body that asks for an
    input's shape, or an input of no CUDA type, is left to MLX."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cp, "_STATE", {})
    calls = []

    def fake(source, kernel):
        calls.append((source, kernel))
        return b"\x7fELF-cubin", "_Z22custom_kernel_probe_3PKfPf"

    x = mx.zeros((4,))
    args = ("probe", "#include \"h.cuh\"\n", "y[0] = x[0];\n", ["x"], [x], ["y"], [mx.float32], [("N", 3)])
    path = cp.ensure(*args, compiler=fake)
    source = cp.mlx_source("custom_kernel_probe_3", args[1], args[2], ["x"], [mx.float32], ["y"], [mx.float32],
                           [("N", 3)])
    assert path == tmp_path / f"{cp.module_name('custom_kernel_probe_3', source)}.ptx"
    assert path.read_bytes() == b"\x7fELF-cubin"
    assert path.with_suffix(".txt").read_text() == "mlx::core::cu::custom_kernel_probe_3\t_Z22custom_kernel_probe_3PKfPf\n"
    assert calls == [(cp.OWN_HEADER + source, "mlx::core::cu::custom_kernel_probe_3")]
    assert cp.counts() == (1, 0)
    assert cp.ensure(*args, compiler=fake) == path and len(calls) == 1
    assert cp.counts() == (1, 1)  # built once, then found
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, path.with_suffix(".txt").name])
    assert cp.ensure("probe", "", "y[0] = x_shape[0];\n", ["x"], [x], ["y"], [mx.float32], None, compiler=fake) is None
    assert cp.ensure("probe", "", "y[0] = x[0];\n", ["x"], [x.astype(mx.complex64)], ["y"], [mx.float32], None,
                     compiler=fake) is None
    assert len(calls) == 1


def test_a_kernels_first_cuda_launch_builds_it_ahead_once(monkeypatch):
    """With MUSE_MLX_CUDA_PREBUILD=1, each variant's first launch on CUDA hands cuda_prebuild the
    texts MLX got for it (its bounded name, header, body); a repeat, or the switch off, does not."""
    monkeypatch.setattr(Kernel, "launched", set())
    seen = []
    monkeypatch.setattr(cp, "ensure_or_warn", lambda *a: seen.append(a))
    k = Kernel(None, "probe", ["x"], ["y"], body="y[0] = x[0];\n")
    monkeypatch.setattr(k, "build", lambda which, bounds=None: (lambda **kw: [mx.zeros((1,))]))
    k._texts = {("cuda", (64, 2), "file"): ("HEADER", "BODY"), ("cuda", None, "file"): ("H0", "B0")}
    x = mx.zeros((4,))

    def launch(n, min_blocks=2):
        k([x], [(1,)], [mx.float32], (64, 1, 1), (64, 1, 1), [("N", n)], which="cuda", min_blocks=min_blocks)

    monkeypatch.setenv("MUSE_MLX_CUDA_PREBUILD", "0")
    launch(1)
    assert seen == []
    monkeypatch.setenv("MUSE_MLX_CUDA_PREBUILD", "1")
    launch(2)
    launch(2)
    launch(3, min_blocks=0)
    assert [(a[0], a[1], a[2], a[7]) for a in seen] == [("probe_lb64x2", "HEADER", "BODY", [("N", 2)]),
                                                       ("probe", "H0", "B0", [("N", 3)])]
    monkeypatch.setenv("MUSE_MLX_CUDA_PREBUILD", "yes")
    with pytest.raises(ValueError, match="MUSE_MLX_CUDA_PREBUILD='yes'"):
        launch(4)
    monkeypatch.delenv("MUSE_MLX_CUDA_PREBUILD")  # the default since the H100 run of 2026-12-05: on
    launch(5)
    assert [a[7] for a in seen][-1] == [("N", 5)]


def test_a_failed_build_ahead_warns_once_and_leaves_the_rest_to_mlx(monkeypatch):
    monkeypatch.setenv("MUSE_MLX_CUDA_PREBUILD", "1")
    monkeypatch.setattr(cp, "_STATE", {})

    def broken(*a, **kw):
        raise RuntimeError("no NVRTC library found")

    monkeypatch.setattr(cp, "ensure", broken)
    with pytest.warns(UserWarning, match="kernel 'probe'.*RuntimeError: no NVRTC library found.*MLX builds it "
                      "and every later one itself"):
        cp.ensure_or_warn("probe")
    assert not cp.enabled()


def test_the_target_is_the_gpus_while_the_default_device_is_the_cpu(monkeypatch):
    """The first lease run (H100, 2026-12-05) lost every build ahead to a KeyError: inside a
    ``with mx.stream(mx.cpu)`` block ``mx.device_info()`` describes the CPU. The target is read
    of ``mx.gpu`` by name."""
    gpu_info = {"compute_capability_major": 9, "compute_capability_minor": 0, "architecture": "sm_90"}

    def device_info(d=None):  # MLX's: the default device when none is named
        return gpu_info if d == mx.gpu else {"device_name": "cpu"}

    monkeypatch.setattr(cp.mx, "device_info", device_info)
    with mx.stream(mx.cpu):
        assert cp._arch() == "sm_90a"
    gpu_info.update(compute_capability_major=8, compute_capability_minor=6)
    assert cp._arch() == "sm_86"


def test_nvrtc_builds_a_cubin_holding_the_kernel(tmp_path, monkeypatch):
    """Where NVRTC is installed (not on CI): the probe compiles behind our header alone, and the
    cubin holds the lowered name the .txt gives MLX."""
    try:
        nvrtc = cp.Nvrtc()
    except RuntimeError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    path = cp.ensure("probe", "", "y[0] = x[0] + 1.0f;\n", ["x"], [mx.zeros((1,))], ["y"], [mx.float32], [("N", 3)],
                     compiler=lambda src, k: nvrtc.compile(src, k, "sm_90a"))
    mangled = path.with_suffix(".txt").read_text().split("\t")[1].strip()
    cubin = path.read_bytes()
    assert cubin[:4] == b"\x7fELF" and mangled.encode() in cubin and "custom_kernel_probe_3" in mangled


def test_the_clis_line_says_what_the_kernel_builds_cost():
    """generate's closing line on CUDA: with building ahead on, how many variants were found in
    MLX's cache, compiled ahead, or left to MLX; with it off, that each costs an NVRTC compile."""
    from muse_mlx.generate import kernel_builds_line

    on = kernel_builds_line(23, True, 3, 19, "/tmp/mlx/0.32.4/ptx")
    assert on.startswith("Kernel variants launched in this process: 23: 19 found built in /tmp/mlx/0.32.4/ptx, "
                         "3 compiled ahead into it, 1 compiled by MLX")
    assert "compiled by MLX" not in kernel_builds_line(23, True, 0, 23, "/c")
    off = kernel_builds_line(23, False, 0, 0, "/c")
    assert "23: NVRTC compiles each" in off and "MUSE_MLX_CUDA_PREBUILD=0" in off
