"""The model `python -m muse_mlx.generate` runs when no ``--model`` is given.

No real Muse Glimmer file can be downloaded here, so the package ships a small one it trained
itself (``scripts/train_tiny.py``; docs/quality.md): 4.5M parameters of the muse-glimmer
architecture, trained on the documentation that comes with CPython, stored in llama.cpp's
Q4_K_M mix (2.8 MB). Should the file be missing from an installation, a random-weight
checkpoint is written and cached instead (``$MUSE_MLX_CACHE``, else
``$XDG_CACHE_HOME/muse_mlx``, else ``~/.cache/muse_mlx``), with a note saying so.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import __version__

TRAINED = Path(__file__).parent / "data" / "muse-glimmer-tiny-pydoc-q4_k_m.gguf"
TRAINED_NOTE = "muse-glimmer-tiny-pydoc: 4.5M parameters trained on Python's documentation, Q4_K_M"
RANDOM_NOTE = "random-weight demo model: every part of the engine runs, but the text it makes is noise"


def cache_dir() -> Path:
    if os.environ.get("MUSE_MLX_CACHE"):
        return Path(os.environ["MUSE_MLX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "muse_mlx"


def random_model_path() -> Path:
    """Path of the cached random-weight checkpoint, writing it first if needed (deterministic, ~1 MB)."""
    from .writer import write_tiny

    path = cache_dir() / f"demo-muse-glimmer-q4_k_m-v{__version__}.gguf"
    if not path.exists():
        write_tiny(path, "muse-glimmer", "q4_k_m", seed=0)
    return path


def default_model() -> tuple[Path, str]:
    """The default model and a line describing it."""
    if TRAINED.exists():
        return TRAINED, TRAINED_NOTE
    return random_model_path(), RANDOM_NOTE
