"""scripts/bench.py end to end on a tiny synthetic checkpoint (a smoke test: speed is measured
on a GPU, see docs/performance.md): every section runs and its numbers are consistent."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench  # noqa: E402


def test_bench_reports_every_route_and_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLX_MAX_OPS_PER_BUFFER", "100")  # a setting the figures depend on: recorded
    monkeypatch.setenv("MUSE_MLX_Q8_TAIL", "1")
    monkeypatch.setenv("MUSE_MLX_NOT_A_SWITCH_X", "")
    monkeypatch.setenv("OTHER_VARIABLE_X", "1")
    out = tmp_path / "r.json"
    rc = bench.main(["--tiny", "--file", str(tmp_path / "t.gguf"), "--parts", "model", "--tokens", "2", "--runs", "1",
                     "--prefill", "8", "--contexts", "4,12", "--flags", ",mv_q8", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["copy_tb_s"] > 0 and r["read_tb_s"] > 0 and r["geometry"]["layers"] == 4
    env = r["environment"]
    assert env["MLX_MAX_OPS_PER_BUFFER"] == "100" and env["MUSE_MLX_Q8_TAIL"] == "1"
    assert env["MUSE_MLX_NOT_A_SWITCH_X"] == "" and "OTHER_VARIABLE_X" not in env
    assert all(k.startswith(("MLX_", "MUSE_MLX_")) for k in env)
    assert "MLX_MAX_OPS_PER_BUFFER=100" in capsys.readouterr().out
    names = [e["route"] for e in r["routes"]]
    assert names == ["pinned", "pinned+mv_q8", "stock"]
    L = r["geometry"]["layers"]
    for e in r["routes"]:
        assert e["file_bytes"] == (tmp_path / "t.gguf").stat().st_size
        # pinned reads the file's raw blocks (all but the embedding); stock its 6-bit affine repack
        assert 0 < e["weight_bytes"] < (e["file_bytes"] if e["route"].startswith("pinned") else 2 * e["file_bytes"])
        assert [d["ctx"] for d in e["decode"]] == [4, 12]
        for d in e["decode"]:
            assert d["tok_s"] > 0
            assert d["tb_s"] == pytest.approx(e["weight_bytes"] * d["tok_s"] / 1e12)
            assert d["of_copy"] == pytest.approx(d["tb_s"] / r["copy_tb_s"])
            # the host and wait times are the median run's own (not another run's, nor an average of
            # two): they add up to that run's time per token
            assert d["host_ms"] > 0 and d["wait_ms"] >= 0
            assert d["host_ms"] + d["wait_ms"] == pytest.approx(1e3 / d["tok_s"])
    # the pinned decode path's accounting (tests/test_pinned_route.py): 2 + 7 per layer (a short cache:
    # the norms, RoPE and attention in one dispatch) + head + embedding
    assert r["routes"][0]["dispatches"]["route_ops"] == 2 + 7 * L + 2
    assert set(r["routes"][0]["prefill_tok_s"]) == {"batched", "batched-f16"}
    assert min(r["routes"][0]["prefill_tok_s"].values()) > 0 and r["routes"][2]["prefill_tok_s"]["batched"] > 0
    assert list(r["routes"][1]["prefill_tok_s"]) == ["batched"]  # a flag set: its forms, batched alone


def test_bench_q8_part_times_every_call_and_variant(tmp_path, monkeypatch):
    """--parts q8: every call (GLU, ffn_down, the projections, attn_output, and with the split Q6_K
    matrices of mv_q8_q6k ffn_down, the projections and the head) at every variant, the GLU's
    fastest geometry of the new kernel set for the rest of the run, and the fastest over the split
    ffn_down and projections as the geometry of the calls of few rows."""
    for name in ("MUSE_MLX_Q8_PRE_GEOMETRY", "MUSE_MLX_Q8_PRE_GEOMETRY_FEW"):
        monkeypatch.setenv(name, "1x4x8")  # recorded, so the run's own setting is undone
        monkeypatch.delenv(name)
    out = tmp_path / "q8.json"
    assert bench.main(["--tiny", "--parts", "q8", "--kernel-reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["q8"]
    pre = [f"pre {g}" for g in bench.Q8_PRE_SWEEP]
    labels = [r["label"] for r in rows if r["variant"] == "exact"]
    assert len(labels) == 7 and labels[0].startswith("ffn_gate+up")
    assert [lb for lb in labels if "split" in lb] == labels[4:]
    for label in labels:
        want = ["exact"] + ([] if "split" in label else ["q8 per-threadgroup"]) + pre
        assert [r["variant"] for r in rows if r["label"] == label] == want
        assert all(r["us"] > 0 and r["gbps"] > 0 for r in rows if r["label"] == label)
    picked = [r for r in rows if r["label"] == "picked for the GLU"][0]["variant"]
    glu = {r["variant"]: r["us"] for r in rows if r["label"] == labels[0] and r["variant"].startswith("pre ")}
    assert picked == min(glu, key=glu.get)
    few = {v: sum(r["us"] for r in rows if r["label"] in labels[4:6] and r["variant"] == v) for v in pre}
    picked_few = [r for r in rows if r["label"] == "picked for the calls of few rows"][0]["variant"]
    assert picked_few == min(few, key=few.get)
    assert os.environ["MUSE_MLX_Q8_PRE_GEOMETRY_FEW"] == picked_few[4:]
    assert os.environ["MUSE_MLX_Q8_PRE_GEOMETRY"] == picked[4:]


def test_bench_tiles_part_checks_and_times_every_tile(tmp_path, monkeypatch):
    """--parts tiles: each all-Q4_K q8 call on raw rows and in every tile size that divides its
    rows, two sweeps; a tiled output that differs from the raw rows' stops
    the run with the call named (here: tiles whose bytes never moved; the tiny GLU's rows are of one
    block, whose tiles are the raw rows, so the ffn_down is the first to differ)."""
    out = tmp_path / "tiles.json"
    assert bench.main(["--tiny", "--parts", "tiles", "--kernel-reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["tiles"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    assert len(labels) == 4 and labels[0].startswith("ffn_gate+up")
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        tiles = sorted({r["tile"] for r in mine})
        assert tiles[0] == 1 and len(tiles) >= 2, (label, tiles)
        assert len(mine) == 2 * len(tiles) and all(r["us"] > 0 for r in mine)
    from muse_mlx import quants

    monkeypatch.setattr(quants, "tile_q4_K_rows", lambda rows, tile: rows)
    with pytest.raises(SystemExit, match=r"ffn_down \d+x\d+ in tiles of 4 differs from its raw rows"):
        bench.main(["--tiny", "--parts", "tiles", "--kernel-reps", "1"])


def test_bench_logits_part_times_the_pick_both_ways(tmp_path):
    """--parts logits: logit_stats, MLX's ops for the same, and MLX's argmax alone, at the vocabulary."""
    out = tmp_path / "logits.json"
    assert bench.main(["--tiny", "--parts", "logits", "--kernel-reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["logits"]
    assert [r["op"].split(" over ")[0] for r in rows] == [
        "logit_stats", "MLX's argmax + logsumexp + isfinite.all", "MLX's argmax alone"]
    assert all(r["us"] > 0 and " 2048" in r["op"] for r in rows)


def test_bench_env_ab_over_a_form_switch_re_forms_the_weights(tmp_path, monkeypatch):
    """--env-ab MUSE_MLX_Q8_TILE=1,16: each decode case runs with the GLU's weights in that value's
    form (Model.set_flags re-forms them), alternated, twice over; the prefill after them runs on
    the form the environment asks for (here unset: the CPU's raw rows), not the last value's."""
    from muse_mlx.layers import QLinear
    from muse_mlx.model import Model

    seen, set_flags = [], Model.set_flags

    def spy(model, flags):
        set_flags(model, flags)
        forms = {m.form for n, m in model.named_modules() if isinstance(m, QLinear) and n.endswith("ffn_gate")}
        seen.append((os.environ.get("MUSE_MLX_Q8_TILE"), forms))

    def gate_forms(model):
        return {m.form for n, m in model.named_modules() if isinstance(m, QLinear) and n.endswith("ffn_gate")}

    prefill_forms, prefill_rate = [], bench.prefill_rate
    monkeypatch.setattr(bench, "prefill_rate", lambda model, *a, **kw: prefill_forms.append(gate_forms(model))
                        or prefill_rate(model, *a, **kw))
    monkeypatch.setattr(Model, "set_flags", spy)
    monkeypatch.delenv("MUSE_MLX_Q8_TILE", raising=False)
    out = tmp_path / "r.json"
    assert bench.main(["--tiny", "--file", str(tmp_path / "t.gguf"), "--parts", "model", "--tokens", "2", "--runs", "1",
                       "--prefill", "8", "--contexts", "4", "--routes", "pinned", "--flags", "mv_q8", "--compiled-only",
                       "--env-ab", "MUSE_MLX_Q8_TILE=1,16", "--json", str(out)]) == 0
    ab = [(v, f) for v, f in seen if v is not None]
    assert ab == [("1", {"blocks"}), ("16", {"q4_K_tiled"})] * 2
    decode = json.loads(out.read_text())["routes"][0]["decode"]
    assert [d["env"] for d in decode] == [{"MUSE_MLX_Q8_TILE": v} for v in ("1", "16", "1", "16")]
    assert prefill_forms == [{"blocks"}]


def test_bench_env_ab_moves_several_variables_together(tmp_path, monkeypatch):
    """--env-ab A+B=a1+b1,a2+b2: each decode case runs with both variables at that value's pair (the
    q8 GLU's geometry with its tiles, the sweep the thirty-first session planned), the weights
    re-formed where one of them is a form switch, and the report names each variable apart."""
    from muse_mlx.layers import QLinear
    from muse_mlx.model import Model

    seen, set_flags = [], Model.set_flags

    def spy(model, flags):
        set_flags(model, flags)
        forms = {m.form for n, m in model.named_modules() if isinstance(m, QLinear) and n.endswith("ffn_gate")}
        seen.append((os.environ.get("MUSE_MLX_Q8_TILE"), os.environ.get("MUSE_MLX_Q8_PRE_GEOMETRY"), forms))

    monkeypatch.setattr(Model, "set_flags", spy)
    monkeypatch.delenv("MUSE_MLX_Q8_TILE", raising=False)
    monkeypatch.delenv("MUSE_MLX_Q8_PRE_GEOMETRY", raising=False)
    out = tmp_path / "r.json"
    assert bench.main(["--tiny", "--file", str(tmp_path / "t.gguf"), "--parts", "model", "--tokens", "2", "--runs", "1",
                       "--contexts", "4", "--routes", "pinned", "--flags", "mv_q8", "--compiled-only", "--prefill", "0",
                       "--env-ab", "MUSE_MLX_Q8_PRE_GEOMETRY+MUSE_MLX_Q8_TILE=2x4x4x1+1,1x4x4x1+16",
                       "--json", str(out)]) == 0
    ab = [s for s in seen if s[0] is not None]
    assert ab == [("1", "2x4x4x1", {"blocks"}), ("16", "1x4x4x1", {"q4_K_tiled"})] * 2
    decode = json.loads(out.read_text())["routes"][0]["decode"]
    assert [d["env"] for d in decode] == [{"MUSE_MLX_Q8_PRE_GEOMETRY": g, "MUSE_MLX_Q8_TILE": t}
                                          for g, t in [("2x4x4x1", "1"), ("1x4x4x1", "16")] * 2]
    assert "MUSE_MLX_Q8_TILE" not in os.environ and "MUSE_MLX_Q8_PRE_GEOMETRY" not in os.environ


@pytest.mark.parametrize("spec", ["A+B=1,2", "A+B=1+2,3", "A+=1+2", "A=", "A+B=1++2"])
def test_env_ab_spec_that_does_not_give_each_variable_a_value_is_refused(spec):
    from environment import env_settings
    with pytest.raises(ValueError, match="--env-ab"):
        env_settings([spec])
