"""A setting for the span of a measurement: the engine reads its ``MUSE_MLX_*`` variables (launch
geometries, which q8 kernel) each time it builds a kernel call, so a script sets them around the
calls it times or records, and puts them back afterwards. And the settings a whole run was made
under (:func:`settings_in_effect`), for its log and report."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def env(name: str | None, value: str | None):
    """``os.environ[name] = value`` inside the block (a ``None`` name or value: leave it as it is)."""
    if name is None or value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# Switches the engine reads when it makes a weight's form (at load and in Model.set_flags), not at
# each launch: an --env-ab over one has the model's weights re-formed for each value (set_flags).
FORM_SWITCHES = ("MUSE_MLX_Q8_TILE", "MUSE_MLX_Q6K_SPLIT")


def env_settings(specs: list[str]) -> list[tuple[str | None, str | None]]:
    """The settings a measurement runs, one ``(NAME, value)`` each, from ``--env-ab`` specs
    ``NAME=V1,V2,...``: each spec's values in turn, twice over (alternated, so that a drift between
    runs shows as such), one spec after another. With no spec, one setting that leaves the
    environment as it is, ``(None, None)``. A malformed spec raises ValueError naming it."""
    settings = []
    for spec in specs:
        name, sep, values = spec.partition("=")
        if not sep or not name or not values:
            raise ValueError(f"--env-ab: {spec!r} is not NAME=V1,V2,...")
        settings += [(name, v) for v in values.split(",") * 2]
    return settings or [(None, None)]


def settings_in_effect() -> dict[str, str]:
    """The ``MUSE_MLX_*`` and ``MLX_*`` variables set for this process (the engine's switches and
    MLX's own, such as ``MLX_USE_CUDA_GRAPHS`` or ``MLX_MAX_MB_PER_BUFFER``), by name: what a
    measurement's figures depend on besides the code and the machine."""
    return {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("MUSE_MLX_", "MLX_"))}


def describe_settings(settings: dict[str, str]) -> str:
    """One line for a log: ``settings: A=1 B=2``, or that none is set."""
    return "settings: " + (" ".join(f"{k}={v}" for k, v in settings.items()) or "none set (MUSE_MLX_*, MLX_*)")
