"""muse_mlx: MLX inference for GGUF checkpoints of the Muse Glimmer family.

``load(path, route="stock"|"pinned")`` -> ``(model, tokenizer)``; ``generate`` and
``stream_generate`` run text generation. See README.md for the two routes.
"""

__version__ = "0.1.0"

from .errors import GGUFError, ModelConfigError, MuseError, NumericalError, RequestError, RouteError  # noqa: E402
from .loader import load, load_model  # noqa: E402

__all__ = [
    "GGUFError", "ModelConfigError", "MuseError", "NumericalError", "RequestError", "RouteError",
    "load", "load_model", "__version__",
]
