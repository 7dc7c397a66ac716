"""Opening a GGUF file: the `gguf` package's memory-mapped reader behind typed, checked accessors.

Nothing here copies tensor data: ``tensor(name).data`` is a numpy view into the mapping.
Every failure is a :class:`GGUFError` (or :class:`ModelConfigError`) naming the file and
the key or tensor at fault.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from .errors import GGUFError, ModelConfigError
from .gguf_check import check_gguf
from .quants import FORMATS

_INT_TYPES = {
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
}
_FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}


class _Reader(GGUFReader):
    """``gguf.GGUFReader``, its mapping held as a plain ndarray view of the memmap: the same fields,
    tensors and zero-copy views (the mapping lives as long as any view of it), but every slice the
    reader takes (one or more per metadata element: 600,000 for a 202,048-token vocabulary) skips
    ``np.memmap``'s per-slice bookkeeping, which took two thirds of opening such a file (8.9 against
    2.8 s on a 2-core CPU, thirty-second session)."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value) -> None:  # GGUFReader.__init__ assigns its np.memmap here
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value


class GGUFFile:
    """A GGUF file opened read-only through ``gguf.GGUFReader``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise GGUFError(self.path, "no such file")
        if not self.path.is_file():
            raise GGUFError(self.path, "not a regular file")
        check_gguf(self.path)  # counts, lengths, extents and types, before the reader trusts them
        try:
            self.reader = _Reader(self.path, "r")
        except Exception as e:  # the reader raises ValueError/KeyError/IndexError on bad input
            raise GGUFError(self.path, f"cannot parse the GGUF structure: {e}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    # -- metadata -------------------------------------------------------------------

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def _field(self, key: str):
        field = self.reader.fields.get(key)
        if field is None:
            raise ModelConfigError(self.path, f"required metadata key '{key}' is missing")
        return field

    def _kind(self, key: str) -> tuple[GGUFValueType, GGUFValueType | None]:
        types = self._field(key).types
        return types[0], (types[-1] if types[0] == GGUFValueType.ARRAY else None)

    def _wrong(self, key: str, expected: str) -> ModelConfigError:
        main, sub = self._kind(key)
        got = main.name + (f" of {sub.name}" if sub is not None else "")
        return ModelConfigError(self.path, f"metadata key '{key}' has type {got}, expected {expected}")

    def _get(self, key: str, default: Any, kinds: set, expected: str):
        """The value of ``key`` if its type is one of ``kinds``; ``default`` when absent (if given)."""
        if default is not ... and not self.has(key):
            return default
        if self._kind(key)[0] not in kinds:
            raise self._wrong(key, expected)
        try:
            return self._field(key).contents()
        except UnicodeDecodeError:
            raise ModelConfigError(self.path, f"metadata key '{key}' holds text that is not valid UTF-8") from None

    def get_int(self, key: str, default: Any = ...) -> int:
        return int(self._get(key, default, _INT_TYPES, "an integer"))

    def get_float(self, key: str, default: Any = ...) -> float:
        value = float(self._get(key, default, _INT_TYPES | _FLOAT_TYPES, "a number"))
        if not np.isfinite(value):
            raise ModelConfigError(self.path, f"metadata key '{key}' is not finite ({value})")
        return value

    def get_str(self, key: str, default: Any = ...) -> str:
        return self._get(key, default, {GGUFValueType.STRING}, "a string")

    def get_bool(self, key: str, default: Any = ...) -> bool:
        return bool(self._get(key, default, {GGUFValueType.BOOL}, "a bool"))

    def get_array(self, key: str, default: Any = ...) -> list:
        return self._get(key, default, {GGUFValueType.ARRAY}, "an array")

    def array_kind(self, key: str) -> GGUFValueType | None:
        return self._kind(key)[1] if self.has(key) else None

    # -- tensors --------------------------------------------------------------------

    def tensor(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise ModelConfigError(self.path, f"required tensor '{name}' is missing")
        if GGMLQuantizationType(t.tensor_type) not in FORMATS:
            raise ModelConfigError(
                self.path,
                f"tensor '{name}' has type {GGMLQuantizationType(t.tensor_type).name}, which this engine does not support "
                f"(supported: {', '.join(f.name for f in FORMATS.values())})",
            )
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape in row-major (numpy) order: ``(rows, cols)`` for a matrix stored as ggml ``{cols, rows}``."""
        return tuple(int(d) for d in reversed(self.tensor(name).shape.tolist()))

    def expect_shape(self, name: str, shape: tuple[int, ...]) -> None:
        got = self.shape(name)
        if got != tuple(shape):
            raise ModelConfigError(self.path, f"tensor '{name}' has shape {list(got)}, expected {list(shape)}")
