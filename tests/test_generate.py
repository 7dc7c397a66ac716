"""Generation: the decode loop against the full forward, determinism, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from muse_mlx import RequestError, load
from muse_mlx.generate import generate, generate_step, stream_generate
from muse_mlx.kernels import backend
from muse_mlx.sampling import make_sampler


def test_greedy_tokens_are_the_argmax_of_the_full_forward(tiny):
    """Teacher-forced check: each greedy token is the argmax of a fresh full forward over the prefix."""
    model, tok = load(tiny("muse-glimmer"))
    prompt = tok.encode("Hello world")
    got = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=12, prefill_step_size=3)]
    seq = list(prompt)
    for t in got:
        full = np.array(model(mx.array([seq]))[0, -1])
        # ties aside, argmax must agree; the decode path rounds like the full forward (f16 planes)
        assert full[t] >= full.max() - 1e-3
        seq.append(t)
    assert len(got) == 12


@pytest.mark.parametrize("eval_logprobs", [True, False])
def test_each_tokens_logprobs_are_its_logits_normalized(tiny, eval_logprobs):
    """The log-probabilities generate_step yields, evaluated with the token or left lazy, are the
    step's logits minus their float64 log-sum-exp, and the greedy token is the logits' argmax."""
    model, tok = load(tiny("muse-glimmer"))
    prompt = tok.encode("Hello world")
    seq, seen = list(prompt), []
    for t, logprobs in generate_step(mx.array(prompt), model, max_tokens=5, eval_logprobs=eval_logprobs):
        seen.append((t, logprobs))
    for t, logprobs in seen:  # read after the loop: a lazy one is still what its step computed
        full = np.array(model(mx.array([seq]))[0, -1], np.float64)
        top = full.max()
        np.testing.assert_allclose(np.array(logprobs, np.float64), full - top - np.log(np.exp(full - top).sum()),
                                   atol=1e-3)  # the decode path's f16 planes against the full forward's (as above)
        assert full[t] >= top - 1e-3
        seq.append(t)


def test_greedy_generation_is_deterministic(tiny):
    model, tok = load(tiny("gemma3"))
    a = generate(model, tok, "The quick", max_tokens=16)
    b = generate(model, tok, "The quick", max_tokens=16)
    assert a == b


def test_seeded_sampling_is_reproducible(tiny):
    """The same seed draws the same tokens; another seed, or greedy decoding, does not (the tiny
    model's next-token distributions are broad, so 10 draws all equal by chance is ~impossible).
    What a draw's distribution is, is test_sampling.py's."""
    model, tok = load(tiny("qwen3"))

    def run(seed, sampler):
        mx.random.seed(seed)
        return [r.token for r in stream_generate(model, tok, "Hi", max_tokens=10, sampler=sampler)]

    sampled = make_sampler(0.9, 0.95, 40, 0.01)
    seven = run(7, sampled)
    assert run(7, sampled) == seven
    assert run(8, sampled) != seven and run(7, make_sampler(0.0)) != seven


def test_stream_reports_statistics(tiny):
    model, tok = load(tiny("llama"))
    responses = list(stream_generate(model, tok, "Hello", max_tokens=5))
    last = responses[-1]
    assert last.generation_tokens == len(responses) <= 5
    assert last.prompt_tokens == len(tok.encode("Hello"))
    assert last.finish_reason in ("length", "stop") and last.peak_memory > 0


@pytest.mark.parametrize("kwargs,msg", [
    (dict(prompt=""), "empty"),
    (dict(max_tokens=0), "max-tokens"),
    (dict(prompt=[10**6]), "outside the vocabulary"),
    (dict(prefill_step_size=0), "prefill-step-size must be at least 1, got 0"),
])
def test_bad_requests(tiny, kwargs, msg):
    model, tok = load(tiny("muse-glimmer"))
    args = dict(prompt="Hi", max_tokens=4) | kwargs
    with pytest.raises(RequestError, match=msg):
        list(stream_generate(model, tok, **args))


def test_generate_step_checks_prompt_ids(tiny):
    """generate_step, the lowest layer, checks ids too: past the vocabulary the embedding's gather
    would read past its table."""
    model, _ = load(tiny("muse-glimmer"))
    with pytest.raises(RequestError, match=r"token id -1 \(position 1\) is outside the vocabulary"):
        next(generate_step(mx.array([3, -1, 5]), model, max_tokens=2))


@pytest.mark.parametrize("temp,top_p,msg", [(-1, 1.0, "temperature"), (float("nan"), 1.0, "temperature"),
                                            (0.5, 0.0, "top-p"), (0.5, 1.5, "top-p")])
def test_bad_sampling_values(temp, top_p, msg):
    with pytest.raises(RequestError, match=msg):
        make_sampler(temp, top_p)


def _cli(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "muse_mlx.generate", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_cli_default_demo_model(tmp_path):
    r = _cli("--prompt", "Hello", "--max-tokens", "20", env_extra={"MUSE_MLX_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "trained on Python's documentation" in r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "=" * 10
    assert any(line.startswith("Prompt: ") and "tokens-per-sec" in line for line in lines)
    assert any(line.startswith("Generation: 20 tokens") for line in lines)
    assert any(line.startswith("Peak memory: ") for line in lines)
    assert any(line.startswith("Bandwidth achieved: ") for line in lines)
    if backend() == "cpu":  # the kernels' first-launch builds are reported only where kernels run
        assert not any(line.startswith("Kernel variants") for line in lines)


def test_stats_report_the_kernel_builds_where_kernels_run(monkeypatch, capsys, tiny):
    """The statistics name how many kernel variants the process launched: on CUDA what they cost
    (found in MLX's cache, compiled ahead, or each an NVRTC compile when building ahead is off),
    elsewhere the count alone, and nothing where none were launched (the CPU)."""
    import muse_mlx.generate as G

    model = load(tiny("muse-glimmer"))[0]
    last = G.GenerationResponse("x", 1, None, 3, 10.0, 4, 20.0, 0.1, None)
    monkeypatch.setattr(G.cuda_prebuild, "counts", lambda: (2, 20))
    monkeypatch.setattr(G.cuda_prebuild, "cache_dir", lambda: "/cache")
    for which, count, prebuild, want in (
            ("cuda", 23, "1", "Kernel variants launched in this process: 23: 20 found built in /cache, 2 compiled "
                              "ahead into it, 1 compiled by MLX\n"),
            ("cuda", 23, "0", "Kernel variants built at their first launch in this process: 23: NVRTC compiles each"),
            ("metal", 5, "1", "Kernel variants built at their first launch in this process: 5\n"),
            ("cuda", 0, "1", None)):
        monkeypatch.setenv("MUSE_MLX_CUDA_PREBUILD", prebuild)
        monkeypatch.setattr(G, "backend", lambda which=which: which)
        monkeypatch.setattr(G, "variants_launched", lambda w, count=count, which=which: count if w == which else 0)
        G._print_stats(model, last)
        out = capsys.readouterr().out
        if want is None:
            assert "Kernel variants" not in out
        else:
            assert want in out


def test_cli_with_model_and_chat_template(tiny):
    """The prompt goes through the file's chat template with the system prompt (as many prompt
    tokens as the rendered conversation has), or as plain text with --ignore-chat-template;
    --verbose False prints neither the separators nor the statistics."""
    path = str(tiny("gemma2"))
    _, tok = load(path)
    rendered = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert "Be brief." in rendered and "Hi" in rendered
    templated = len(tok.encode(rendered, add_special_tokens=False))
    plain = len(tok.encode("Hi"))
    assert templated > plain
    for extra, n in [((), templated), (("--ignore-chat-template",), plain)]:
        r = _cli("--model", path, "--prompt", "Hi", "--system-prompt", "Be brief.", "--max-tokens", "4", *extra)
        assert r.returncode == 0, r.stderr
        assert f"Prompt: {n} tokens," in r.stdout, (extra, r.stdout)
    r = _cli("--model", path, "--prompt", "Hi", "--system-prompt", "Be brief.", "--max-tokens", "4",
             "--verbose", "False")
    assert r.returncode == 0, r.stderr
    assert "=" * 10 not in r.stdout and "Prompt:" not in r.stdout


def test_cli_prompt_on_stdin_must_be_utf8(tmp_path):
    r = subprocess.run([sys.executable, "-m", "muse_mlx.generate", "--prompt", "-", "--max-tokens", "2"],
                       input=b"ok \xff\xfe", capture_output=True, timeout=300,
                       env=dict(os.environ, MUSE_MLX_CACHE=str(tmp_path)))
    assert r.returncode == 2 and b"Traceback" not in r.stderr
    assert b"error: the prompt on standard input is not valid UTF-8: byte 0xff at offset 3" in r.stderr


def test_cli_says_when_the_chat_template_refuses_the_messages(tmp_path):
    """Gemma's templates refuse a system message: one line naming the file and the template's words."""
    import dataclasses

    from muse_mlx.vocab import tiny_vocab
    from muse_mlx.writer import write_tiny

    refusing = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    path = write_tiny(tmp_path / "t.gguf", "gemma2", vocab=dataclasses.replace(tiny_vocab(), chat_template=refusing))
    r = _cli("--model", str(path), "--prompt", "Hi", "--system-prompt", "Be brief.", "--max-tokens", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{path} refuses these messages: System role not supported" in errors[0]


@pytest.mark.parametrize("args,msg", [
    (["--model", "/no/such.gguf"], "/no/such.gguf: no such file"),
    (["--temp", "nan"], "temperature"),
    (["--top-p", "0"], "top-p"),
    (["--max-tokens", "0"], "max-tokens"),
    (["--route", "warp"], "unknown route"),
    (["--flag", "tail_32sg"], "pinned route"),
    (["--seed", "-1"], "--seed must be in [0, 2^64), got -1"),
    (["--prompt", b"\xff abc"], "the text is not valid UTF-8: an undecodable byte at character"),
])
def test_cli_errors_are_one_line_without_traceback(tmp_path, args, msg):
    r = _cli(*args, env_extra={"MUSE_MLX_CACHE": str(tmp_path)})
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and msg in errors[0]


def test_cli_pinned_route_with_flags(tiny):
    r = _cli("--model", str(tiny("muse-glimmer")), "--route", "pinned", "--flag", "tail_32sg", "--flag", "ffn_4r2s",
             "--prompt", "Hi", "--max-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert any(line.startswith("Generation: 3 tokens") for line in r.stdout.splitlines())


def test_pinned_and_stock_generate_the_same_greedy_tokens(tiny):
    path = tiny("qwen3")
    stock, tok = load(path, "stock")
    pinned, _ = load(path, "pinned")
    assert generate(stock, tok, "The quick", max_tokens=8) == generate(pinned, tok, "The quick", max_tokens=8)


def test_cli_prefill_modes_and_q8_flag(tiny):
    """Every --prefill mode, --no-compile and the mv_q8 flag generate through the CLI (what the modes
    compute is the next test's and test_pinned_route.py's)."""
    for extra in (["--prefill", "exact"], ["--prefill", "batched", "--no-compile"], ["--prefill", "batched-f16"],
                  ["--flag", "mv_q8"]):
        r = _cli("--model", str(tiny("muse-glimmer")), "--route", "pinned", "--prompt", "Hello there, world",
                 "--ignore-chat-template", "--max-tokens", "3", *extra)
        assert r.returncode == 0, r.stderr
        assert any(line.startswith("Generation: 3 tokens") for line in r.stdout.splitlines())


def test_exact_and_batched_prefill_give_the_same_greedy_tokens(tiny):
    """Batched prefill changes the prompt's rounding (matmul instead of matvec), not its meaning."""
    model, tok = load(tiny("muse-glimmer"), "pinned")
    prompt = mx.array(tok.encode("The quick brown fox jumps over the lazy dog"))
    exact = [t for t, _ in generate_step(prompt, model, max_tokens=6, prefill="exact")]
    batched = [t for t, _ in generate_step(prompt, model, max_tokens=6, prefill="batched")]
    assert exact == batched
    with pytest.raises(RequestError, match="prefill must be one of"):
        next(generate_step(prompt, model, prefill="fast"))
    stock, _ = load(tiny("muse-glimmer"), "stock")
    with pytest.raises(RequestError, match="batched-f16 needs the pinned route"):
        next(generate_step(prompt, stock, prefill="batched-f16"))
