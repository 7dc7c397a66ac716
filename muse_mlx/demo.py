"""The model `python -m muse_mlx.generate` runs when no ``--model`` is given.

No real Muse Glimmer file can be downloaded, so the package writes a tiny random-weight
muse-glimmer checkpoint on first use and caches it (``$MUSE_MLX_CACHE``, else
``$XDG_CACHE_HOME/muse_mlx``, else ``~/.cache/muse_mlx``).
"""

from __future__ import annotations

import os
from pathlib import Path

from . import __version__

DEMO_NOTE = "random-weight demo model: every part of the engine runs, but the text it makes is noise"


def cache_dir() -> Path:
    if os.environ.get("MUSE_MLX_CACHE"):
        return Path(os.environ["MUSE_MLX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "muse_mlx"


def demo_model_path() -> Path:
    """Path of the cached demo checkpoint, writing it first if needed (deterministic, ~1 MB)."""
    from .writer import write_tiny

    path = cache_dir() / f"demo-muse-glimmer-q4_k_m-v{__version__}.gguf"
    if not path.exists():
        write_tiny(path, "muse-glimmer", "q4_k_m", seed=0)
    return path
