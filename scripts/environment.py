"""A setting for the span of a measurement: the engine reads its ``MUSE_MLX_*`` variables (launch
geometries, which q8 kernel) each time it builds a kernel call, so a script sets them around the
calls it times or records, and puts them back afterwards."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def env(name: str, value: str | None):
    """``os.environ[name] = value`` inside the block (``None``: leave it as it is)."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
