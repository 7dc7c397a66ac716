"""The project's exceptions: every failure a user can cause names the file and the problem."""

from __future__ import annotations


class MuseError(Exception):
    """Base class of every error muse_mlx raises on purpose."""


class GGUFError(MuseError):
    """The file is not a GGUF file we can read, or its contents are inconsistent."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ModelConfigError(GGUFError):
    """The file is a valid GGUF, but not a model this engine can build (key, tensor, shape)."""


class RouteError(MuseError):
    """An unknown route or flag, or a flag that does not apply to the chosen route."""


class RequestError(MuseError):
    """A generation request that cannot be served (empty prompt, bad sampling value, ...)."""


class NumericalError(MuseError):
    """The model produced NaN or Inf; the message names where it first appeared."""
