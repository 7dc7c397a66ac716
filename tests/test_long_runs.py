"""Long runs, interrupts, memory, determinism and numerical guards."""

from __future__ import annotations

import gc
import hashlib
import os
import signal
import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest

from muse_mlx import NumericalError, load, load_model
from muse_mlx.generate import generate, generate_step
from muse_mlx.vocab import tiny_vocab
from muse_mlx.writer import Geometry, default_geometry, random_weights, write_gguf, write_tiny

TOKENS = [3, 17, 250, 99, 42, 7, 300, 12]
SHA_SCRIPT = (
    "import sys, hashlib, numpy as np, mlx.core as mx; from muse_mlx import load_model; "
    "m = load_model(sys.argv[1], sys.argv[2]); "
    "print(hashlib.sha256(np.array(m(mx.array([[3, 17, 250, 99, 42, 7, 300, 12]]))).tobytes()).hexdigest())"
)


def _sha(model) -> str:
    return hashlib.sha256(np.array(model(mx.array([TOKENS]))).tobytes()).hexdigest()


@pytest.mark.parametrize("route", ["stock", "pinned"])
def test_logits_are_bit_identical_across_runs_and_processes(tiny, route):
    path = tiny("muse-glimmer")
    here = {_sha(load_model(path, route)) for _ in range(2)}
    there = {subprocess.run([sys.executable, "-c", SHA_SCRIPT, str(path), route], capture_output=True, text=True,
                            check=True).stdout.strip() for _ in range(2)}
    assert len(here) == 1 and here == there


def test_nonfinite_logits_stop_generation_naming_the_layer(tmp_path):
    g, v = default_geometry("llama"), tiny_vocab()
    w = random_weights("llama", g, len(v))
    w["blk.2.ffn_up.weight"] *= np.float32(1e36)  # finite weights whose products overflow
    w["blk.2.ffn_gate.weight"] *= np.float32(1e36)
    model, tok = load(write_gguf(tmp_path / "overflow.gguf", "llama", g, w, v, "f32"))
    with pytest.raises(NumericalError, match="first appears in layer 2, op ffn_act"):
        generate(model, tok, "Hello", max_tokens=5)


def test_generation_past_the_window_keeps_sliding_caches_bounded(tmp_path):
    """Decode far past the window (8) towards the context (1,024): sliding layers stay a window."""
    g = Geometry(n_ctx=1024)
    model = load_model(write_tiny(tmp_path / "long.gguf", "muse-glimmer", geometry=g))
    cache = model.make_cache()
    sliding, growing = [], []
    for i, _ in enumerate(generate_step(mx.array(TOKENS), model, max_tokens=700, cache=cache), start=1):
        if i % 100 == 0:
            sliding.append(sum(c.nbytes for c, s in zip(cache, model.cfg.swa_layers) if s))
            growing.append(sum(c.nbytes for c, s in zip(cache, model.cfg.swa_layers) if not s))
    assert len(set(sliding)) == 1  # a ring of `window` slots per sliding layer, forever
    # one global layer: 2 planes x 2 heads x 64 x f16 = 512 bytes a position, reserved once for
    # prompt + max_tokens = 708 positions (rounded up to 256-slot steps), so it never reallocates
    per_position = 2 * model.cfg.n_head_kv * model.cfg.head_dim * 2
    assert growing[-1] == growing[0] == per_position * 768
    window_bytes = per_position * model.cfg.sliding_window * sum(model.cfg.swa_layers)
    assert sliding[0] == window_bytes


def test_repeated_load_and_unload_does_not_leak(tiny):
    path = tiny("gemma3")
    mx.clear_cache()
    gc.collect()
    base = mx.get_active_memory()
    for _ in range(5):
        model = load_model(path, "stock")
        model(mx.array([TOKENS]))
        del model
        gc.collect()
    assert mx.get_active_memory() <= base + (1 << 20)


def test_ctrl_c_prints_what_was_produced_and_the_statistics(tiny):
    """SIGINT mid-generation: the text so far, mlx-lm's statistics lines, exit status 130."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "muse_mlx.generate", "--model", str(tiny("muse-glimmer")), "--route", "pinned",
         "--ignore-chat-template", "--prompt", "Hello", "--max-tokens", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    first = proc.stdout.readline()  # "==========" once generation starts
    assert first.strip() == "=" * 10
    # Interrupt only once a generated token's text is out: a loaded 2-core machine can spend
    # longer than any fixed sleep in the prefill, and then there is nothing to report.
    produced = []
    reader = threading.Thread(target=lambda: produced.append(proc.stdout.read(1)), daemon=True)
    reader.start()
    reader.join(timeout=120)
    assert produced and produced[0] and produced[0] != "=", produced
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert "Generation: " in out and "tokens-per-sec" in out and "Peak memory" in out
