"""Shared fixtures: tiny checkpoints written once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for tests/reference.py

from muse_mlx.config import ARCHITECTURES  # noqa: E402
from muse_mlx.writer import write_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``tiny(arch, mix="q4_k_m", seed=0, **kw)`` -> path of a tiny checkpoint (written once)."""
    made = {}
    root = tmp_path_factory.mktemp("tiny")

    def make(arch: str, mix: str = "q4_k_m", seed: int = 0, geometry=None):
        key = (arch, mix, seed, geometry)
        if key not in made:
            made[key] = write_tiny(root / f"{arch}-{mix}-{seed}-{len(made)}.gguf", arch, mix, seed, geometry)
        return made[key]

    return make


@pytest.fixture(params=ARCHITECTURES)
def arch(request):
    return request.param
