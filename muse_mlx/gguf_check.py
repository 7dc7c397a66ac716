"""A bounded structural check of a GGUF file, run before any reader trusts its counts.

A GGUF file is untrusted input: its header says how many keys and tensors follow, how long
every string is and how many elements every array holds. A reader that believes a string
length of 2^60 allocates or loops before it notices. This walk reads only lengths, types
and counts, checks each against the bytes that remain, and raises :class:`GGUFError`
naming the file, the byte offset and the problem; only a file that passes goes on to
``gguf.GGUFReader``. It also checks what a reader does not: tensor extents, alignment,
overlaps, duplicate names, UTF-8.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import GGUFError

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2
# value type -> (struct format, size); 8 = string, 9 = array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, path: Path, buf):
        self.path, self.buf, self.pos, self.size = path, buf, 0, len(buf)

    def fail(self, problem: str) -> GGUFError:
        return GGUFError(self.path, f"{problem} (at byte {self.pos} of {self.size})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated: {what} needs {n} bytes, {self.size - self.pos} remain")

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what):
        return self.unpack("<I", 4, what)

    def u64(self, what):
        return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return self.unpack(fmt, size, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
            etype = self.u32(f"the element type of {what}")
            count = self.u64(f"the length of {what}")
            if etype in _SCALARS:
                size = _SCALARS[etype][1]
                self.need(count * size, f"{what} ({count} elements of {size} bytes)")
                self.pos += count * size
                return None
            if etype not in (_STRING, _ARRAY):
                raise self.fail(f"{what}: unknown element type {etype}")
            # every string or array element takes at least 8 bytes (its length)
            self.need(count * 8, f"{what} ({count} elements)")
            for i in range(count):
                self.value(etype, f"{what}[{i}]", depth + 1)
            return None
        raise self.fail(f"{what}: unknown value type {vtype}")


def check_gguf(path) -> dict:
    """Raise :class:`GGUFError` if ``path`` is not a structurally sound GGUF file.

    Returns the layout: where the metadata and the tensor table end, where the data starts,
    and each tensor's ``(name, absolute offset, bytes)``."""
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFError(path, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
        size = path.stat().st_size
        if size < 24:
            raise GGUFError(path, f"truncated: {size} bytes is shorter than a GGUF header (24)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk(_Cursor(path, buf))


def _walk(c: _Cursor) -> dict:
    c.pos = 4  # after the magic
    version = c.u32("the version")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(c.path, f"GGUF version {version} is not supported (supported: 2, 3)")
    n_tensors = c.u64("the tensor count")
    n_kv = c.u64("the metadata count")
    # a key-value pair takes at least 13 bytes, a tensor description at least 33
    if n_kv * 13 > c.size or n_tensors * 33 > c.size:
        raise c.fail(f"impossible counts: {n_kv} metadata entries and {n_tensors} tensors in {c.size} bytes")
    alignment = 32
    keys = set()
    for i in range(n_kv):
        key = c.string(f"the name of metadata entry {i}")
        if key in keys:
            raise c.fail(f"metadata key '{key}' appears twice")
        keys.add(key)
        vtype = c.u32(f"the type of '{key}'")
        value = c.value(vtype, f"metadata '{key}'")
        if key == "general.alignment":
            if vtype != 4 or value == 0 or value & (value - 1):
                raise c.fail(f"general.alignment must be a uint32 power of two, got {value!r}")
            alignment = value
    kv_end = c.pos
    tensors = []
    names = set()
    for i in range(n_tensors):
        name = c.string(f"the name of tensor {i}")
        if name in names:
            raise c.fail(f"tensor '{name}' appears twice")
        names.add(name)
        n_dims = c.u32(f"the rank of '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor '{name}' has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
        dims = [c.u64(f"dimension {d} of '{name}'") for d in range(n_dims)]
        raw_type = c.u32(f"the type of '{name}'")
        offset = c.u64(f"the offset of '{name}'")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise c.fail(f"tensor '{name}' has unknown type {raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if any(d == 0 for d in dims) or dims[0] % block:
            raise c.fail(f"tensor '{name}' has shape {dims}, not whole {qtype.name} blocks of {block}")
        n = 1
        for d in dims:
            n *= d
            if n > c.size * 64:  # far more elements than any type could pack into the file
                raise c.fail(f"tensor '{name}' has an impossible shape {dims}")
        if offset % alignment:
            raise c.fail(f"tensor '{name}' data offset {offset} is not aligned to {alignment}")
        tensors.append((offset, n // block * type_size, name))
    data_start = -(-c.pos // alignment) * alignment
    end_prev, prev = 0, None
    for offset, nbytes, name in sorted(tensors):
        if offset < end_prev:
            raise GGUFError(c.path, f"tensor '{name}' overlaps tensor '{prev}'")
        if data_start + offset + nbytes > c.size:
            raise GGUFError(c.path, f"tensor '{name}' ends at byte {data_start + offset + nbytes}, past the end "
                                    f"of the file ({c.size} bytes): truncated?")
        end_prev, prev = offset + nbytes, name
    return dict(kv_end=kv_end, tensor_table_end=c.pos, data_start=data_start, size=c.size,
                tensors=[(name, data_start + offset, nbytes) for offset, nbytes, name in sorted(tensors)])
