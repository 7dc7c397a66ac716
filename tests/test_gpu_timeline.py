"""scripts/gpu_timeline.py: the timeline arithmetic, the record reader and the name shortener
(the CUPTI calls themselves need an NVIDIA GPU; docs/performance.md has what they measured)."""

import ctypes
import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_timeline as gt  # noqa: E402


def rec(name, start, end):
    return dict(kind="kernel", name=name, start=start, end=end, stream=7)


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
