"""Hostile and broken files: every one fails with the project's own error, before big allocations."""

from __future__ import annotations

import contextlib
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muse_mlx import GGUFError, ModelConfigError, MuseError, load, load_model
from muse_mlx.gguf_check import check_gguf
from muse_mlx.writer import Geometry, write_tiny

SMALL = Geometry(n_layer=1, n_ff=256)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A valid ~400 KB muse-glimmer checkpoint and its layout."""
    path = write_tiny(tmp_path_factory.mktemp("robust") / "small.gguf", "muse-glimmer", "q4_k_m", geometry=SMALL)
    return path, path.read_bytes(), check_gguf(path)


# Python-heap bytes (numpy's included) a refused file may cost: a valid load of `small` peaks at
# about 1.4 MB, a refusal at under 1 MB; believing a count of 10^7 tensors or 2.7 * 10^9 layers
# would cost gigabytes. (A bound on memory, not time: the same on any machine.)
HEAP_LIMIT = 16 << 20


@contextlib.contextmanager
def _heap_peak():
    """``peak()`` after the block: the most bytes tracemalloc saw allocated during it."""
    tracemalloc.start()
    result = []
    try:
        yield lambda: result[0]
    finally:
        result.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def _variant(tmp_path, data: bytes, name="bad.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _cuts(layout) -> list[int]:
    """Truncation points in every region: header, metadata, tensor table, padding, data, the last byte."""
    kv, table, start, size = layout["kv_end"], layout["tensor_table_end"], layout["data_start"], layout["size"]
    points = [0, 3, 4, 7, 8, 16, 23, 24, 25, 40, 100, kv // 2, kv - 1, kv, kv + 5, (kv + table) // 2, table - 1,
              table, start - 1, start, start + 1]
    points += [off + n // 2 for _, off, n in layout["tensors"]] + [size - 1]
    return sorted(set(p for p in points if 0 <= p < size))


def test_truncation_anywhere_is_a_clear_error(small, tmp_path):
    path, data, layout = small
    for cut in _cuts(layout):
        with pytest.raises(GGUFError) as e:
            load_model(_variant(tmp_path, data[:cut]))
        assert "bad.gguf" in str(e.value), cut


def test_wrong_magic(small, tmp_path):
    _, data, _ = small
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_model(_variant(tmp_path, b"GGML" + data[4:]))


@pytest.mark.parametrize("version", [0, 1, 4, 0xFFFFFFFF])
def test_unsupported_version(small, tmp_path, version):
    _, data, _ = small
    with pytest.raises(GGUFError, match=f"GGUF version {version} is not supported"):
        load_model(_variant(tmp_path, data[:4] + struct.pack("<I", version) + data[8:]))


@pytest.mark.parametrize("field,value", [("tensors", 1 << 62), ("kv", 1 << 40), ("tensors", 10_000_000)])
def test_absurd_counts_fail_at_once(small, tmp_path, field, value):
    _, data, _ = small
    off = 8 if field == "tensors" else 16
    bad = _variant(tmp_path, data[:off] + struct.pack("<Q", value) + data[off + 8 :])
    with _heap_peak() as peak, pytest.raises(GGUFError, match="impossible counts"):
        load_model(bad)
    assert peak() < HEAP_LIMIT  # refused before anything was built for the count


def test_absurd_string_length(small, tmp_path):
    _, data, _ = small
    # the first key's length (right after the 24-byte header) claims an exabyte
    bad = data[:24] + struct.pack("<Q", 1 << 60) + data[32:]
    with pytest.raises(GGUFError, match="truncated: the name of metadata entry 0 .* needs"):
        load_model(_variant(tmp_path, bad))


def test_absurd_array_length(small, tmp_path):
    _, data, _ = small
    key = b"tokenizer.ggml.tokens"
    i = data.index(key) + len(key) + 4 + 4  # after the key, the value type (ARRAY) and element type
    bad = data[:i] + struct.pack("<Q", 1 << 50) + data[i + 8 :]
    with pytest.raises(GGUFError, match="tokenizer.ggml.tokens"):
        load_model(_variant(tmp_path, bad))


def _tensor_field_offset(data: bytes, layout, name: str) -> int:
    """Byte offset of tensor ``name``'s description (its name length) in the tensor table."""
    return data.index(struct.pack("<Q", len(name)) + name.encode(), layout["kv_end"])


def _patch_tensor_offset(data, layout, name, new_offset):
    i = _tensor_field_offset(data, layout, name)
    rank_at = i + 8 + len(name)
    (rank,) = struct.unpack_from("<I", data, rank_at)
    off_at = rank_at + 4 + 8 * rank + 4
    return data[:off_at] + struct.pack("<Q", new_offset) + data[off_at + 8 :]


def test_tensor_offset_past_the_end(small, tmp_path):
    _, data, layout = small
    bad = _patch_tensor_offset(data, layout, "output.weight", 1 << 40)
    with pytest.raises(GGUFError, match="'output.weight' ends at byte .* past the end of the file"):
        load_model(_variant(tmp_path, bad))


def test_overlapping_tensors(small, tmp_path):
    _, data, layout = small
    first_offset = layout["tensors"][0][1] - layout["data_start"]
    bad = _patch_tensor_offset(data, layout, "blk.0.attn_q.weight", first_offset)
    with pytest.raises(GGUFError, match="overlaps"):
        load_model(_variant(tmp_path, bad))


def test_misaligned_tensor_data(small, tmp_path):
    _, data, layout = small
    _, abs_off, _ = next(t for t in layout["tensors"] if t[0] == "blk.0.attn_q.weight")
    bad = _patch_tensor_offset(data, layout, "blk.0.attn_q.weight", abs_off - layout["data_start"] + 4)
    with pytest.raises(GGUFError, match="not aligned to 32"):
        load_model(_variant(tmp_path, bad))


def test_duplicate_tensor_names(small, tmp_path):
    _, data, layout = small
    i = _tensor_field_offset(data, layout, "blk.0.attn_k.weight") + 8
    bad = data[:i] + b"blk.0.attn_q.weight" + data[i + len("blk.0.attn_k.weight") :]
    with pytest.raises(GGUFError, match="tensor 'blk.0.attn_q.weight' appears twice"):
        load_model(_variant(tmp_path, bad))


def test_unknown_tensor_type(small, tmp_path):
    _, data, layout = small
    name = "blk.0.attn_q.weight"
    i = _tensor_field_offset(data, layout, name) + 8 + len(name)
    (rank,) = struct.unpack_from("<I", data, i)
    t_at = i + 4 + 8 * rank
    bad = data[:t_at] + struct.pack("<I", 999) + data[t_at + 4 :]
    with pytest.raises(GGUFError, match=f"tensor '{name}' has unknown type 999"):
        load_model(_variant(tmp_path, bad))


def test_metadata_of_the_wrong_type(small, tmp_path):
    _, data, _ = small
    key = b"muse-glimmer.block_count"
    i = data.index(key) + len(key)  # the value type: UINT32 (4) -> INT8 (1) keeps the length valid? no: use FLOAT32
    bad = data[:i] + struct.pack("<I", 6) + data[i + 4 :]  # FLOAT32: same size as UINT32
    with pytest.raises(ModelConfigError, match="'muse-glimmer.block_count' has type FLOAT32, expected an integer"):
        load_model(_variant(tmp_path, bad))


def test_infinite_scale_in_a_quantized_block(small, tmp_path):
    _, data, layout = small
    _, off, _ = next(t for t in layout["tensors"] if t[0] == "blk.0.ffn_gate.weight")
    i = off + 144 * 3  # the d of the 4th Q4_K block: row 3 (a row of 256 values is one block)
    bad = data[:i] + np.float16(np.inf).tobytes() + data[i + 2 :]
    with pytest.raises(ModelConfigError, match="'blk.0.ffn_gate.weight' holds a non-finite scale in row 3"):
        load_model(_variant(tmp_path, bad))


def test_nan_in_a_norm(small, tmp_path):
    _, data, layout = small
    _, off, _ = next(t for t in layout["tensors"] if t[0] == "output_norm.weight")
    bad = data[:off + 8] + np.float32(np.nan).tobytes() + data[off + 12 :]
    with pytest.raises(ModelConfigError, match="'output_norm.weight' holds a non-finite value at index 2"):
        load_model(_variant(tmp_path, bad))


# -- fuzzing ---------------------------------------------------------------------------------

FUZZ = {"n": 0, "loaded": 0, "errors": {}}


def _mutations(size: int, hot: int):
    """Byte edits, biased towards the parsed region (the first ``hot`` bytes) where structure lives."""
    pos = st.one_of(st.integers(0, hot - 1), st.integers(0, size - 1))
    edit = st.tuples(pos, st.sampled_from(["set", "flip", "zero", "ff"]), st.integers(0, 255))
    return st.tuples(st.lists(edit, min_size=1, max_size=6), st.one_of(st.none(), st.integers(0, size)))


def _apply(data: bytes, edits, cut) -> bytes:
    b = bytearray(data)
    for pos, kind, v in edits:
        b[pos] = {"set": v, "flip": b[pos] ^ (1 << (v % 8)), "zero": 0, "ff": 0xFF}[kind]
    return bytes(b if cut is None else b[:cut])


def _fuzz_once(tmp_path, data, edits, cut):
    p = _variant(tmp_path, _apply(data, edits, cut), "fuzz.gguf")
    FUZZ["n"] += 1
    try:
        load(p)
        FUZZ["loaded"] += 1
    except MuseError as e:
        kind = type(e).__name__
        FUZZ["errors"][kind] = FUZZ["errors"].get(kind, 0) + 1


@pytest.fixture(scope="module")
def fuzz_small(small, tmp_path_factory):
    return small, tmp_path_factory.mktemp("fuzz")


def _fuzz(fuzz_small, cases: int) -> None:
    (path, data, layout), tmp = fuzz_small

    @settings(max_examples=cases, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(_mutations(len(data), layout["data_start"]))
    def run(mutation):
        _fuzz_once(tmp, data, *mutation)

    run()


def test_fuzzed_files_load_or_fail_cleanly(fuzz_small):
    """Mutated checkpoints either load or raise MuseError -- never another exception, never a hang."""
    _fuzz(fuzz_small, 150)
    assert FUZZ["n"] >= 150


@pytest.mark.slow
def test_fuzzed_files_load_or_fail_cleanly_long(fuzz_small):
    _fuzz(fuzz_small, 3000)
    print(f"\nfuzz: {FUZZ}")


def test_block_count_must_match_the_tensors(small, tmp_path):
    """Found by the fuzzer: a corrupted block_count of ~10^12 built per-layer tuples until memory ran out."""
    _, data, _ = small
    key = b"muse-glimmer.block_count"
    i = data.index(key) + len(key) + 4  # the UINT32 value
    bad = data[:i] + struct.pack("<I", 0xA3000001) + data[i + 4 :]
    path = _variant(tmp_path, bad)
    with _heap_peak() as peak, pytest.raises(ModelConfigError,
                                             match=r"block_count' = 2734686209, but the file has 1 layers of tensors"):
        load_model(path)
    assert peak() < HEAP_LIMIT
