"""scripts/gpu_timeline.py: the timeline arithmetic, the record reader and the name shortener
(the CUPTI calls themselves need an NVIDIA GPU; docs/performance.md has what they measured)."""

import ctypes
import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_timeline as gt  # noqa: E402


def rec(name, start, end, stream=7):
    return dict(kind="kernel", name=name, start=start, end=end, stream=stream)


def test_summary_of_a_hand_built_timeline():
    # a: 0-10, b: 15-40, a: 40-50, c: 45-60 (overlaps a), a: 100-110 -- over 2 tokens
    recs = [rec("a", 0, 10_000), rec("b", 15_000, 40_000), rec("a", 40_000, 50_000), rec("c", 45_000, 60_000),
            rec("a", 100_000, 110_000)]
    s = gt.summarize(list(reversed(recs)), tokens=2)  # any input order
    assert s["span_ms_per_token"] == pytest.approx(110e-3 / 2)
    # busy = union: 0-10, 15-60, 100-110 = 65 us
    assert s["busy_ms_per_token"] == pytest.approx(65e-3 / 2)
    # gaps: 5 (a->b), 0 (b->a), 0 (a->c, overlap), 40 (c->a)
    assert s["gap_ms_per_token"] == pytest.approx(45e-3 / 2)
    assert s["median_gap_us"] == pytest.approx(2.5)
    assert s["gaps_over_20us"] == 1 and s["gaps_over_20us_ms_per_token"] == pytest.approx(40e-3 / 2)
    rows = {e["name"]: e for e in s["by_name"]}
    assert rows["a"]["count"] == 3 and rows["a"]["mean_us"] == pytest.approx(10.0)
    assert rows["a"]["gap_ms_per_token"] == pytest.approx(40e-3 / 2)
    assert rows["b"]["gap_ms_per_token"] == pytest.approx(5e-3 / 2)
    assert [e["name"] for e in s["by_name"]] == ["a", "b", "c"]  # by total time
    assert s["streams"] == 1 and s["on_busiest_stream"] == 1.0
    recs[3] = rec("c", 45_000, 60_000, stream=9)  # a branch on a stream of its own
    s = gt.summarize(recs, tokens=2)
    assert s["streams"] == 2 and s["on_busiest_stream"] == pytest.approx(4 / 5)


def test_summary_without_records_is_an_error():
    with pytest.raises(ValueError, match="no GPU activity"):
        gt.summarize([], 1)


def test_short_names():
    assert gt.short_name("custom_kernel_mul_mv_glu_f32_1a2b3c4d5e6f") == "mul_mv_glu_f32"
    assert gt.short_name("_ZN3mlx4core2cu11copy_kernelIfEEvPKT_") == "mlx::core::cu::copy_kernel"
    assert gt.short_name("_ZN3mlx4core2cu6detail10arg_reduceILi32EEEvPKfPj") == "mlx::core::cu::detail::arg_reduce"
    assert gt.short_name("_Z6kernelPf") == "kernel"
    assert gt.short_name("plain_name") == "plain_name"


def test_kernel_record_is_read_at_cuptis_offsets():
    name = ctypes.create_string_buffer(b"custom_kernel_attn_decode_partial")
    buf = ctypes.create_string_buffer(216)
    struct.pack_into("<I", buf, 0, gt.KIND_CONCURRENT_KERNEL)
    struct.pack_into("<QQ", buf, gt._START, 1234, 5678)
    struct.pack_into("<I", buf, gt._KERNEL_STREAM, 13)
    struct.pack_into("<III", buf, gt._KERNEL_GRID, 256, 2, 1)
    struct.pack_into("<III", buf, gt._KERNEL_BLOCK, 64, 1, 1)
    struct.pack_into("<Q", buf, gt._KERNEL_NAME, ctypes.addressof(name))
    r = gt.parse_record(ctypes.addressof(buf))
    assert r == dict(kind="kernel", name="attn_decode_partial", start=1234, end=5678, stream=13, grid=[256, 2, 1],
                     block=[64, 1, 1])
    struct.pack_into("<I", buf, 0, 99)
    assert gt.parse_record(ctypes.addressof(buf)) is None


def test_missing_library_is_named(monkeypatch):
    monkeypatch.setattr(gt.sys, "path", [])
    monkeypatch.setattr(gt.ctypes.util, "find_library", lambda n: None)
    monkeypatch.delenv("MUSE_MLX_CUPTI", raising=False)
    with pytest.raises(gt.CuptiError, match="nvidia-cuda-cupti"):
        gt.find_cupti(None)


def test_script_refuses_without_cuda(capsys, tmp_path):
    import mlx.core as mx

    if mx.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gt.main(["--file", str(tmp_path / "none.gguf")]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_api_and_marker_records_are_read_at_cuptis_offsets():
    # the layouts written out from cupti_activity.h (CUDA 13.0), not from the script's constants:
    # CUpti_ActivityAPI {u32 kind, u32 cbid, u64 start, u64 end, u32 processId, u32 threadId, ...}
    buf = ctypes.create_string_buffer(64)
    struct.pack_into("<IIQQII", buf, 0, 5, 311, 1000, 1750, 77, 42)  # 5: CUPTI_ACTIVITY_KIND_RUNTIME
    assert gt.parse_record(ctypes.addressof(buf)) == dict(kind="runtime", cbid=311, start=1000, end=1750, thread=42)
    struct.pack_into("<I", buf, 0, 4)  # CUPTI_ACTIVITY_KIND_DRIVER
    assert gt.parse_record(ctypes.addressof(buf))["kind"] == "driver"
    # CUpti_ActivityMarker2 {u32 kind, u32 flags, u64 timestamp, u32 id, u32 objectKind,
    # 12-byte objectId, u32 pad, const char* name, const char* domain}
    name = ctypes.create_string_buffer(b"CustomKernel::eval_gpu")
    buf = ctypes.create_string_buffer(64)
    struct.pack_into("<IIQII12sIQQ", buf, 0, 12, 1 << 1, 5000, 9, 0, b"", 0, ctypes.addressof(name), 0)
    assert gt.parse_record(ctypes.addressof(buf)) == dict(kind="marker", id=9, flags=gt.MARKER_START, time=5000,
                                                          name="CustomKernel::eval_gpu")


def test_host_summary_pairs_ranges_by_id_and_counts_calls():
    def marker(i, flags, t, name=None):
        return dict(kind="marker", id=i, flags=flags, time=t, name=name)

    records = [
        marker(1, gt.MARKER_START, 0, "CustomKernel::eval_gpu"), marker(1, gt.MARKER_END, 4_000),
        marker(2, gt.MARKER_START, 5_000, "CustomKernel::eval_gpu"),
        marker(3, gt.MARKER_START, 6_000, "Matmul::eval_gpu"), marker(3, gt.MARKER_END, 9_000),
        marker(2, gt.MARKER_END, 11_000),  # 2 encloses 3: ranges nest
        marker(4, gt.MARKER_START, 12_000, "never closed"),
        marker(5, gt.MARKER_END, 13_000),  # its start was before the recording: dropped
        dict(kind="runtime", name="cudaGraphLaunch", start=1_000, end=3_000, thread=1),
        dict(kind="runtime", name="cudaGraphLaunch", start=7_000, end=8_000, thread=1),
        dict(kind="driver", name="cuGraphLaunch", start=7_100, end=7_900, thread=1),
    ]
    h = gt.summarize_host(records, units=2, wall_ns=20_000)
    rows = {(e["kind"], e["name"]): e for e in h["by_name"]}
    assert set(rows) == {("nvtx", "CustomKernel::eval_gpu"), ("nvtx", "Matmul::eval_gpu"),
                         ("runtime", "cudaGraphLaunch"), ("driver", "cuGraphLaunch")}
    ck = rows[("nvtx", "CustomKernel::eval_gpu")]
    assert ck["count"] == 2 and ck["total_ns"] == 4_000 + 6_000 and ck["per_unit"] == 1.0
    assert ck["ms_per_unit"] == pytest.approx(5e-3) and ck["share_of_wall"] == pytest.approx(0.5)
    launch = rows[("runtime", "cudaGraphLaunch")]
    assert launch["count"] == 2 and launch["mean_us"] == pytest.approx(1.5)
    assert [e["name"] for e in h["by_name"]][0] == "CustomKernel::eval_gpu"  # by total time
    assert h["wall_ms_per_unit"] == pytest.approx(0.01)


def test_env_ab_must_name_a_variable_and_values(capsys, tmp_path, monkeypatch):
    import mlx.core as mx

    if mx.cuda.is_available():
        pytest.skip("this machine has CUDA")
    # without CUDA the script stops before parsing: check the parser through a fake CUDA check
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gt, "find_cupti", lambda explicit=None: "libcupti.so")
    monkeypatch.setattr(gt, "trace_chain", lambda n, library: [rec("k", 0, 1000)])
    monkeypatch.setattr("muse_mlx.synthetic.ensure_synthetic", lambda *a, **k: None)
    assert gt.main(["--file", str(tmp_path / "none.gguf"), "--env-ab", "MUSE_MLX_Q8_TAIL"]) == 2
    assert "is not NAME=V1,V2" in capsys.readouterr().err


def test_profile_decode_without_cuda_says_so_and_writes_nothing(tmp_path):
    """scripts/profile_decode.py (a decode for ncu) needs MLX's CUDA backend: elsewhere it exits 2
    with that reason, before it would write the 16.9 GB checkpoint it was pointed at."""
    import subprocess

    import mlx.core as mx

    if mx.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run")
    script = Path(__file__).resolve().parents[1] / "scripts" / "profile_decode.py"
    target = tmp_path / "mg.gguf"
    proc = subprocess.run([sys.executable, str(script), "--file", str(target)], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "needs MLX's CUDA backend" in proc.stderr
    assert not target.exists()
