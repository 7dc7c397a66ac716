"""A setting for the span of a measurement: the engine reads its ``MUSE_MLX_*`` variables (launch
geometries, which q8 kernel) each time it builds a kernel call, so a script sets them around the
calls it times or records, and puts them back afterwards. And the settings a whole run was made
under (:func:`settings_in_effect`), for its log and report."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def env(name: str | None, value: str | None):
    """``os.environ[name] = value`` inside the block (a ``None`` name or value: leave it as it is).
    A joint setting, ``A+B`` with ``a+b`` (an ``--env-ab`` spec over several variables), sets each."""
    if name is None or value is None:
        yield
        return
    setting = setting_dict(name, value)
    old = {n: os.environ.get(n) for n in setting}
    os.environ.update(setting)
    try:
        yield
    finally:
        for n, v in old.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def setting_dict(name: str | None, value: str | None) -> dict[str, str]:
    """A setting as ``{variable: value}`` (for :func:`env` and a report): one entry per variable of a
    joint one; ValueError where the counts of variables and values differ."""
    if name is None or value is None:
        return {}
    names, values = name.split("+"), value.split("+")
    if len(names) != len(values):
        raise ValueError(f"{name}={value}: {len(names)} variables, {len(values)} values")
    return dict(zip(names, values))


def sets_form_switch(name: str | None) -> bool:
    """Whether a setting (joint or not) sets one of :data:`FORM_SWITCHES`."""
    return name is not None and any(n in FORM_SWITCHES for n in name.split("+"))


# Switches the engine reads when it makes a weight's form (at load and in Model.set_flags), not at
# each launch: an --env-ab over one has the model's weights re-formed for each value (set_flags).
FORM_SWITCHES = ("MUSE_MLX_Q8_TILE", "MUSE_MLX_Q6K_SPLIT")


def env_settings(specs: list[str]) -> list[tuple[str | None, str | None]]:
    """The settings a measurement runs, one ``(NAME, value)`` each, from ``--env-ab`` specs
    ``NAME=V1,V2,...``: each spec's values in turn, twice over (alternated, so that a drift between
    runs shows as such), one spec after another. With no spec, one setting that leaves the
    environment as it is, ``(None, None)``. Several variables move together as ``A+B=a1+b1,a2+b2``
    (a launch geometry with the weights' tile, say). A malformed spec raises ValueError naming it."""
    settings = []
    for spec in specs:
        name, sep, values = spec.partition("=")
        if not sep or not name or not values or "" in name.split("+"):
            raise ValueError(f"--env-ab: {spec!r} is not NAME=V1,V2,... (or A+B=a1+b1,a2+b2,...)")
        width = len(name.split("+"))
        for v in values.split(","):
            if len(v.split("+")) != width or "" in v.split("+"):
                raise ValueError(f"--env-ab: {spec!r}: value {v!r} does not give each of {width} variables one value")
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
