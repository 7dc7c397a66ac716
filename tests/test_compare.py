"""The compare tool: identical routes pass with equal SHA-256; a one-ULP perturbation is caught and traced."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from muse_mlx.compare import Run, compare, grade, run_route, ulp_distance

TOKENS = [3, 17, 250, 99, 42, 7, 300, 12, 5, 64]


def test_identical_routes_have_equal_sha_and_pass(tiny):
    runs, (report,) = compare(tiny("muse-glimmer"), ["stock", "stock"], TOKENS, max_tokens=4)
    assert runs[0].sha256 == runs[1].sha256
    assert report.passed and report.differing_logits == 0 and report.max_abs_logit == 0.0
    assert report.first_divergence is None and report.greedy_diverges_at is None


def _flip_one_ulp(layer, op):
    def edit(name, il, x):
        if name == op and il == layer:
            a = np.array(x)
            bits = a.view(np.uint16 if a.dtype == np.float16 else np.uint32).copy()
            bits.reshape(-1)[5] += 1  # the next float up: one ULP
            return mx.array(bits.view(a.dtype))
        return x

    return edit


@pytest.mark.parametrize("layer,op", [(1, "v_cache"), (2, "k_cache")])
def test_one_ulp_in_one_kv_plane_is_caught_and_traced(tiny, layer, op):
    path = tiny("muse-glimmer")
    base = run_route(path, "pinned", TOKENS, 2, trace=True)
    bad = run_route(path, "pinned", TOKENS, 2, edit=_flip_one_ulp(layer, op))
    report = grade(base, bad)
    assert report.differing_logits > 0 and base.sha256 != bad.sha256
    d = report.first_divergence
    assert (d.layer, d.op, d.differing, d.max_ulp) == (layer, op, 1, 1)
    assert report.first_kv_divergence == d
    assert [la for la, _ in report.per_layer][: layer] == list(range(layer))
    assert all(e == 0 for la, e in report.per_layer if la < layer)  # the layers before it are untouched


def test_grade_measures_what_it_says():
    logits = np.zeros((2, 4), np.float32)
    other = logits.copy()
    other[1, 2] = 3e-4
    a, b = Run("a", logits, [1, 2, 3], 0.0), Run("b", other, [1, 2, 4], 0.0)
    r = grade(a, b)
    assert r.differing_logits == 1 and r.max_abs_logit == pytest.approx(3e-4)
    assert r.greedy_diverges_at == 2 and not r.passed
    # the log-softmax of a row moves every entry when one logit moves
    assert 1e-4 < r.max_abs_logprob < 3e-4


def test_ulp_distance_counts_representable_steps():
    x = np.float32([1.0, -1.0, 0.0])
    y = np.nextafter(x, np.float32(np.inf))
    np.testing.assert_array_equal(ulp_distance(x, y), [1, 1, 1])
    assert ulp_distance(np.float32([0.0]), np.float32([-0.0]))[0] == 1
    h = np.float16([2.0])
    assert ulp_distance(h, np.nextafter(h, np.float16(3)))[0] == 1


def test_cli_writes_json_and_reports_flags(tiny, tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "muse_mlx.compare", "--model", str(tiny("qwen3")), "--routes", "stock",
                        "--flags", "ffn_4r2s", "--max-tokens", "2", "--json", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert [x["route"] for x in report["routes"]] == ["stock", "pinned+ffn_4r2s"]
    assert report["pairs"][0]["first_divergence"]["op"]  # routes differ: traced to an op
    assert "first difference at" in r.stdout


def test_cli_rejects_unknown_flags(tiny):
    r = subprocess.run([sys.executable, "-m", "muse_mlx.compare", "--model", str(tiny("qwen3")), "--routes",
                        "pinned+warp"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "unknown flag" in r.stderr and "Traceback" not in r.stderr


def test_cli_refuses_bad_token_files_and_paths_in_one_line(tiny, tmp_path, capsys):
    """An id past the vocabulary used to crash the process (the embedding's gather reads past its
    table); a missing token file and an unwritable --json were tracebacks."""
    from muse_mlx.compare import main

    model = str(tiny("qwen3"))
    (tmp_path / "oob.json").write_text("[1, 2, 99999999]")
    (tmp_path / "ok.json").write_text(json.dumps(TOKENS))
    for args, msg in [(["--tokens-file", str(tmp_path / "oob.json")], "token id 99999999 (position 2) is outside the vocabulary"),
                      (["--tokens-file", str(tmp_path / "none.json")], "cannot read the token ids"),
                      (["--prompt", ""], "the prompt is empty"),
                      (["--tokens-file", str(tmp_path / "ok.json"), "--max-tokens", "100000"], "exceed the model's context"),
                      (["--tokens-file", str(tmp_path / "ok.json"), "--max-tokens", "1", "--no-trace", "--routes", "stock",
                        "--json", str(tmp_path / "no" / "r.json")], "cannot write the report")]:
        assert main(["--model", model] + args) == 2, args
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0], (args, err)


def test_plot_draws_each_pair_per_layer(tiny, tmp_path, monkeypatch):
    """--plot: a PNG with one curve per pair, its points the report's per-layer errors."""
    import matplotlib.axes
    import matplotlib.image

    from muse_mlx.compare import write_plot

    _, reports = compare(tiny("gemma2"), ["stock", "pinned"], TOKENS, max_tokens=0)
    assert reports and all(p.per_layer for p in reports)
    drawn = []
    semilogy = matplotlib.axes.Axes.semilogy
    monkeypatch.setattr(matplotlib.axes.Axes, "semilogy",
                        lambda ax, x, y, **kw: drawn.append((list(x), list(y))) or semilogy(ax, x, y, **kw))
    write_plot(reports, tmp_path / "p.png")
    assert drawn == [([l for l, _ in p.per_layer], [max(e, 1e-12) for _, e in p.per_layer]) for p in reports]
    image = matplotlib.image.imread(tmp_path / "p.png")
    assert image.shape[:2] == (480, 840) and image.std() > 0
