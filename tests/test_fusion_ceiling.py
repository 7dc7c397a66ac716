"""scripts/fusion_ceiling.py's accounting (the bytes it streams are the bytes a token reads) and,
where NVRTC is installed, that its CUDA kernels compile. Its speeds come from a GPU
(docs/performance.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import fusion_ceiling as fc  # noqa: E402

from muse_mlx.synthetic import SMALL_GEOMETRY, SMALL_VOCAB, write_synthetic  # noqa: E402

# what a decoded token reads of the file: every layer matrix and the head (the embedding: one row)
READ = ("attn_q", "attn_k", "attn_v", "attn_gate", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def test_the_stream_reads_the_bytes_the_file_holds_for_a_token(tmp_path):
    path = tmp_path / "s.gguf"
    write_synthetic(path, SMALL_GEOMETRY, SMALL_VOCAB, "q4_k_m", 0)
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    layers = fc.token_plan(SMALL_GEOMETRY, SMALL_VOCAB, "q4_k_m", ctx=128)
    assert len(layers) == SMALL_GEOMETRY.n_layer + 1 and [s.name for s in layers[-1]] == ["head"]
    assert layers[-1][0].nbytes == sizes["output.weight"]
    g = SMALL_GEOMETRY
    for i, stages in enumerate(layers[:-1]):
        by = {s.name: s for s in stages}
        held = [sizes[f"blk.{i}.{n}.weight"] for n in READ]
        assert sum(s.nbytes for s in stages if s.name != "attention") == sum(held)
        assert by["gate+up"].nbytes == sizes[f"blk.{i}.ffn_gate.weight"] + sizes[f"blk.{i}.ffn_up.weight"]
        # the K and V planes at context 128, f16
        assert by["attention"].nbytes == 2 * 128 * g.n_head_kv * g.head_dim * 2
        # each stage's input is the output of the one before, or a tail's (the residual's width)
        for a, b in zip(stages, stages[1:]):
            assert b.k == (g.n_embd if b.tail else a.rows) or (b.name == "ffn_down" and b.k == g.n_ff)


def test_the_plan_lays_each_layer_end_to_end_and_the_head_apart():
    layers = fc.token_plan(SMALL_GEOMETRY, SMALL_VOCAB, "q4_k_m")
    rows = fc.plan_rows(layers)
    assert rows.shape == (sum(len(s) for s in layers), fc.PLAN_COLUMNS) and rows.dtype == np.int32
    at = 0
    for stages in layers[:-1]:
        chunk, at = rows[at : at + len(stages)], at + len(stages)
        assert (chunk[:, 0] == 0).all() and chunk[0, 1] == 0
        assert (chunk[1:, 1] == chunk[:-1, 1] + chunk[:-1, 2]).all()  # end to end, in 16-byte words
        assert list(chunk[:, 2]) == [-(-s.nbytes // 16) for s in stages]
        assert list(chunk[:, 5]) == [int(s.tail) for s in stages]
    assert list(rows[-1, :2]) == [1, 0] and rows[-1, 5] == 1


def test_the_kernels_compile_for_the_gpu():
    """Where NVRTC is installed (not on CI): every kernel, barrier flavor, ring, tail form, loads in flight,
    chunks handed out and barrier times builds for sm_90."""
    from muse_mlx.kernels.cuda_prebuild import OWN_HEADER, Nvrtc, mlx_source

    try:
        nvrtc = Nvrtc()
    except RuntimeError as e:
        pytest.skip(str(e))
    f32, u32, i32 = mx.float32, mx.uint32, mx.int32
    cases = [("fusion_stage", fc.STAGE_BODY, ["w", "x"], [u32, f32], ["out"], [f32],
              [("OFF", 0), ("LEN", 100), ("K", 64), ("ROWS", 32)]),
             ("fusion_tail", fc.TAIL_BODY, ["src", "hidden", "norms"], [f32] * 3, ["hidden_out", "y"], [f32] * 2,
              [("D", 256)])]
    cases += [("fusion_folded", fc.FOLDED_BODY, ["w", "src", "hidden", "norms"], [u32] + [f32] * 3,
               ["out", "hidden_out"], [f32] * 2, [("OFF", 0), ("LEN", 100), ("K", 256), ("ROWS", 32), ("D", 256),
                                                 ("STAGED", staged)]) for staged in (0, 1)]
    for flavor in fc.BARRIERS.values():
        for ring, tail_one, staged, partials in ((0, 0, 0, 0), (4, 0, 0, 0), (4, 1, 0, 0), (0, 0, 1, 0), (0, 1, 1, 0),
                                                 (4, 0, 1, 0), (0, 0, 0, 1), (0, 1, 0, 1), (4, 0, 0, 1), (0, 0, 2, 0),
                                                 (0, 1, 2, 0)):
            cases.append(("fusion_fused", fc.FUSED_BODY, ["w", "wh", "plan", "prev", "norms"],
                          [u32, u32, i32, f32, f32], ["state", "sync"], [f32, u32],
                          [("STAGES", 6), ("D", 256), ("CAP", 1024), ("BARRIERS", 1), ("PREV_ACT", 0),
                           ("PREV_HID", 1), ("FLAVOR", flavor), ("RING", ring), ("TAIL_ONE", tail_one),
                           ("STAGED", staged), ("PARTIALS", partials)]))
        cases.append(("fusion_barrier_probe", fc.PROBE_BODY, ["unused"], [f32], ["sync"], [u32],
                      [("ITERS", 4), ("FLAVOR", flavor)]))
    # every kernel with one load at a time and with four (--in-flight)
    groups_at, times_at, _ = fc.sync_layout(6, 132)
    cases = [(*c[:-1], c[-1] + [("IN_U", u), ("CHUNKS", chunks), ("TIMES", times), ("TIMES_AT", times_at),
                                      ("GROUPS_AT", groups_at)])
             for u in (1, 4) for c in cases
             for chunks, times in (((0, 0), (4, 0), (0, 1)) if c[0] == "fusion_fused" and ("RING", 0) in c[-1]
                                   else ((0, 0),))]
    for name, body, ins, in_types, outs, out_types, template in cases:
        source = OWN_HEADER + mlx_source(name, fc.HEADER, body, ins, in_types, outs, out_types, template)
        cubin, lowered, _ = nvrtc.build(source, "sm_90", f"mlx::core::cu::{name}")
        assert cubin[:4] == b"\x7fELF" and lowered.encode() in cubin


@pytest.mark.parametrize("extra", [["--rings", "13"], ["--rings", "12", "--staged-tails"],
                                   ["--rings", "12", "--tail-partials"],
                                   ["--rings", "0", "--staged-tails", "--norms-ahead", "--blocks-per-sm", "2"]])
def test_a_fused_grid_that_cannot_be_resident_is_refused(extra, capsys):
    """The grid barrier needs every threadgroup resident at once: 1,024 threads an SM with a ring of 13
    chunks (208 KB) and ys, or of 12 with a staged tail's two vectors, pass an SM's 228 KB, as do two
    threadgroups each staging four vectors; the script says so before it touches a GPU (12 chunks
    alone fit)."""
    d = fc.MUSE_GLIMMER_30B.n_embd
    assert fc.fused_shared_bytes(12, 1024, d) + 1024 <= fc.SM_SHARED
    blocks = extra[extra.index("--blocks-per-sm") + 1] if "--blocks-per-sm" in extra else "1"
    threads = "512" if blocks == "2" else "1024"
    with pytest.raises(SystemExit) as e:
        fc.main(["--modes=", "--threads", threads, "--blocks-per-sm", "1", *extra])
    assert e.value.code == 2
    assert f"--rings {extra[1]}: {blocks} threadgroups of {threads} threads need" in capsys.readouterr().err


def test_norms_ahead_needs_staged_tails(capsys):
    with pytest.raises(SystemExit) as e:
        fc.main(["--modes=", "--norms-ahead"])
    assert e.value.code == 2 and "--norms-ahead goes with --staged-tails" in capsys.readouterr().err


@pytest.mark.parametrize("scale", ["1.5", "-0.1", "nan"])
def test_bytes_scale_outside_zero_to_one_is_refused(scale, capsys):
    with pytest.raises(SystemExit) as e:
        fc.main(["--modes=", "--bytes-scale", scale])
    assert e.value.code == 2 and f"--bytes-scale {float(scale)}: expected a fraction from 0 to 1" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--chunks", "4", "--rings", "4"], ["--chunks", "65"], ["--chunks", "-1"]])
def test_chunks_are_refused_with_a_ring_or_out_of_range(extra, capsys):
    with pytest.raises(SystemExit) as e:
        fc.main(["--modes=", *extra])
    assert e.value.code == 2 and f"--chunks {extra[1]}: a whole number up to 64, and not with --rings" in \
        capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--in-flight", "4"], ["--in-flight", "2"], ["--barrier", "tree"],
                                   ["--barrier", "flag", "--tail-by-one"]])
def test_partial_sum_tails_are_refused_where_they_need_too_many_registers(extra, capsys):
    with pytest.raises(SystemExit) as e:
        fc.main(["--modes=", "--tail-partials", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--tail-partials: not with" in err and "more than 64 registers" in err


@pytest.mark.parametrize("layers, blocks", [(52, 132), (53, 132), (102, 264), (52, 1056)])
def test_the_counter_array_keeps_its_parts_apart(layers, blocks):
    """The chunk counters (one a stage), the tree barrier's group counters and the times never overlap,
    each counter on its own 128-byte line, for any stage count and grid (the thirty-seventh session's
    review found fixed offsets that collided past 52 layers or 768 threadgroups)."""
    stages = 5 * layers + 1
    groups_at, times_at, words = fc.sync_layout(stages, blocks)
    chunk_lines = {fc.SYNC_WORDS + 32 * s for s in range(stages)}
    group_lines = {groups_at + 32 * g for g in range(-(-blocks // fc.FC_GROUP))}
    assert min(chunk_lines) >= fc.SYNC_WORDS and not chunk_lines & group_lines
    assert max(chunk_lines) < groups_at and max(group_lines) < times_at and times_at % 2 == 0
    assert words == times_at + 4 * (stages - 1) * blocks  # two 64-bit times a barrier and threadgroup


def test_the_fused_kernels_fit_1024_threads_an_sm():
    """Where NVRTC is installed (not on CI): at the release geometry, the fused kernel forms the script
    accepts at 1,024 threads need at most 64 registers a thread (the register file's 65,536 / 1,024), or
    the grid could not be resident and every barrier would give up."""
    from muse_mlx.kernels.cuda_prebuild import OWN_HEADER, Nvrtc, mlx_source

    try:
        nvrtc = Nvrtc()
    except RuntimeError as e:
        pytest.skip(str(e))
    f32, u32, i32 = mx.float32, mx.uint32, mx.int32
    groups_at, times_at, _ = fc.sync_layout(261, 132)
    worst = {}
    for flavor in (1, 4):
        for staged, partials in ((0, 0), (1, 0), (2, 0), (0, 1)):
            for in_u in ((1,) if partials else (1, 4)):
                if partials and flavor == 4:
                    continue  # refused (too_many_registers)
                for chunks, times in ((0, 0), (4, 1)):
                    t = [("STAGES", 261), ("D", 6656), ("CAP", 39936), ("BARRIERS", 1), ("PREV_ACT", 0),
                         ("PREV_HID", 1), ("FLAVOR", flavor), ("RING", 0), ("TAIL_ONE", 0), ("STAGED", staged),
                         ("PARTIALS", partials), ("IN_U", in_u), ("CHUNKS", chunks), ("TIMES", times),
                         ("TIMES_AT", times_at), ("GROUPS_AT", groups_at)]
                    source = OWN_HEADER + mlx_source("fusion_fused", fc.HEADER, fc.FUSED_BODY,
                                                     ["w", "wh", "plan", "prev", "norms"], [u32, u32, i32, f32, f32],
                                                     ["state", "sync"], [f32, u32], t)
                    _, _, log = nvrtc.build(source, "sm_90", "mlx::core::cu::fusion_fused",
                                            options=["--ptxas-options=-v"])
                    used = [int(w) for line in str(log).splitlines() if "Used" in line
                            for w, nxt in zip(line.split(), line.split()[1:]) if nxt.startswith("registers")]
                    assert used, log
                    worst[(flavor, staged, partials, in_u, chunks)] = used[0]
    assert max(worst.values()) <= 64, {k: v for k, v in worst.items() if v > 64}


def test_the_token_word_sum_is_every_planned_word_folded_once():
    """The fused kernels' checksum is checked against this sum of the buffers: each stage's words,
    each folded by xor into 32 bits, added mod 2^32 (here against a plain loop over the same words)."""
    rng = np.random.default_rng(5)
    w = rng.integers(0, 2**32, 4 * 300, dtype=np.uint64).astype(np.uint32)
    wh = rng.integers(0, 2**32, 4 * 50, dtype=np.uint64).astype(np.uint32)
    rows = np.array([[0, 0, 120, 0, 0, 0], [0, 120, 180, 0, 0, 1], [1, 0, 50, 0, 0, 1], [0, 0, 7, 0, 0, 0]],
                    dtype=np.int32)
    want = 0
    for b, off, n in rows[:, :3].tolist():
        words = (w if b == 0 else wh).reshape(-1, 4)[off:off + n]
        for x, y, z, t in words.tolist():
            want = (want + (x ^ y ^ z ^ t)) % 2**32
    assert fc.token_word_sum(rows, w, wh) == want
    assert fc.token_word_sum(rows[:3], w, wh) != want  # a stage's words left out is seen


def test_barrier_waits_read_skew_lag_and_wait():
    """Two barriers of three threadgroups (arrival, release; ns), worked by hand."""
    t = np.array([[[100, 500], [300, 520], [400, 510]],
                  [[1000, 1900], [1000, 1950], [1800, 1900]]], dtype=np.uint64)
    w = fc.barrier_waits(t)
    assert list(w["skew"]) == [300, 800] and list(w["lag"]) == [100, 100]
    assert np.allclose(w["wait"], [(400 + 220 + 110) / 3, (900 + 950 + 100) / 3])


def test_barrier_times_are_refused_with_a_tail_by_one(capsys):
    with pytest.raises(SystemExit) as e:
        fc.main(["--modes=", "--barrier-times", "--tail-by-one"])
    assert e.value.code == 2 and "--barrier-times: the fused kernel's own barriers only" in capsys.readouterr().err


def test_a_launch_the_driver_refuses_is_reported_and_any_other_error_is_not():
    err = RuntimeError("cudaGraphInstantiate(&handle_, graph, nullptr, nullptr, 0) failed: too many resources "
                       "requested for launch")
    why = fc.not_launched(err, 1024)
    assert why.startswith("not run:") and "1024 threads an SM" in why and "too many resources" in why
    assert fc.not_launched(RuntimeError("an illegal memory access was encountered"), 1024) is None
