"""One kernel source, three places to run it: Metal, CUDA, or (on CPU) its exact-order oracle.

Kernel bodies live in ``*.metal`` files beside this module, one file per family, split into
sections by marker lines::

    // ==== header            helper functions shared by the family's kernels
    // ==== kernel: <name>    the body of one kernel (MLX generates the signature)
    // ==== part: <name>      a fragment that a kernel appends to another's body (``parts``)

On Apple Silicon a body goes to ``mx.fast.metal_kernel``; on NVIDIA the same text goes to
``mx.fast.cuda_kernel`` behind ``prelude.cuh``, which maps the Metal vocabulary the bodies
use, after :func:`to_cuda` drops the address-space words. Without a GPU (or with
``MUSE_MLX_KERNELS=oracle``) callers get the oracle instead.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
import warnings
from pathlib import Path

import mlx.core as mx

from . import cuda_prebuild

HERE = Path(__file__).parent
METAL_PRELUDE = "#define MUSE_FN inline\n#define MUSE_TG threadgroup\n"
_MARK = re.compile(r"^// ==== (header|(?:kernel|part): (\w+))\s*$", re.M)
# Metal address spaces -> CUDA: global and private memory need no word, threadgroup memory is
# __shared__, and file-scope `constant` values become constexpr (see prelude.cuh).
_ADDRESS_SPACE = re.compile(r"\b(device|thread|threadgroup|constant)\b(?=\s)")
_CUDA_SPELLING = {"device": "", "thread": "", "threadgroup": "__shared__", "constant": "constexpr"}


_LINE_COMMENT = re.compile(r"[ \t]*//[^\n]*")


_INDENT_AND_BLANK_LINES = re.compile(r"^[ \t]+|\n(?=\n)", re.M)
_PADDED_CONTINUATION = re.compile(r"[ \t]+\\\n")  # the padding before a macro's line continuation


def _compact(text: str) -> str:
    """``text`` without comments, indentation, blank lines or padding before line continuations:
    MLX hashes a kernel's whole source on every launch (``CustomKernel::eval_gpu``, MLX 0.32), so
    the text NVRTC sees is kept short (the .metal and .cuh files keep all of it for readers).
    Raises ValueError on what this line-comment rule would misread: a ``/*`` comment, ``//`` or
    ``/*`` inside a string or character literal, a ``//`` comment continued by a backslash."""
    code = _LITERAL.sub("", text)
    if "/*" in code or any("//" in s or "/*" in s for s in _LITERAL.findall(text)) or \
            re.search(r"//[^\n]*\\\n", text):
        raise ValueError("a kernel text holds a /* comment, a comment marker inside a literal, or a "
                         "// comment continued by a backslash, which backend._compact cannot drop safely")
    text = _INDENT_AND_BLANK_LINES.sub("", _LINE_COMMENT.sub("", text))
    return _PADDED_CONTINUATION.sub("\\\n", text)


_LITERAL = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'')
_WORD = re.compile(r"[\w.]")
_OPERATOR = set("=+-*/%<>&|^!~?:")


def _squeeze(text: str) -> str:
    """Compacted CUDA text (:func:`_compact`) with the whitespace that separates no two tokens
    dropped: a preprocessor line (and its continuations) stays as it is, on its own line; the code
    between them becomes one line, and a space between two characters survives only where both are
    word characters (two names would merge) or both operator characters (``- -``, ``/ *``, ``> >``
    would become other tokens), or next to a string or character literal. The tokens are the same,
    so the program is (``tests/test_kernels.py`` compares every kernel's token sequence; NVRTC's
    machine code was compared with ``scripts/kernel_sass.py --keep``, docs/kernels.md); the text is
    about 15 % shorter, and it is what MLX hashes at every launch."""
    out, code, in_macro = [], [], False

    def flush():
        if not code:
            return
        text = "\n".join(code)
        literals = []

        def hide(m):
            literals.append(m.group(0))
            return f"\x00{len(literals) - 1}\x00"

        parts = re.split(r"\s+", _LITERAL.sub(hide, text).strip())
        joined = parts[0]
        for nxt in parts[1:]:
            a, b = joined[-1], nxt[0]
            keep = ("\x00" in (a, b) or (_WORD.match(a) and _WORD.match(b)) or (a in _OPERATOR and b in _OPERATOR))
            joined += (" " if keep else "") + nxt
        out.append(re.sub("\x00(\\d+)\x00", lambda m: literals[int(m.group(1))], joined))
        code.clear()

    for line in text.split("\n"):
        if in_macro or line.lstrip().startswith("#"):
            flush()
            out.append(line)
            in_macro = line.endswith("\\")
        elif line.strip():
            code.append(line)
    flush()
    return "\n".join(out) + "\n"


def metal_compact(metal_text: str) -> str:
    """The text Metal gets: :func:`_compact`, then :func:`_squeeze` (the same tokens, so the same
    program). MLX's Metal backend also reads a custom kernel's whole source at every launch (it
    compares it with the one its library was built from, or hashes it, by version), and the
    .metal files' comments make up half of their text."""
    return _squeeze(_compact(metal_text))


def to_cuda(metal_text: str) -> str:
    """The one textual change CUDA needs: Metal's address-space qualifiers (the text compacted, see
    :func:`_compact`, then squeezed: :func:`_squeeze`)."""
    return _squeeze(_ADDRESS_SPACE.sub(lambda m: _CUDA_SPELLING[m.group(1)], _compact(metal_text)))


_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_TRAILING_TEMPLATE_ARGS = re.compile(r"<[^<>]*>\s*$")


def header_items(header: str) -> list[tuple[str | None, str]]:
    """A family header split into its top-level items (a function with the comment above it, a
    file-scope constant, a preprocessor line), in order, each with the name it defines (None for
    a preprocessor line). Raises ValueError on what the split cannot place, so a header that
    outgrows it fails every kernel's build instead of dropping a helper."""
    items, start, depth, i, n = [], 0, 0, 0, len(header)
    code_seen = False  # whether the pending item has code yet (not only comments and blank lines)
    while i < n:
        if header.startswith("//", i):
            end = header.find("\n", i)
            i = n if end < 0 else end
            continue
        if header.startswith("/*", i):
            end = header.find("*/", i)
            if end < 0:
                raise ValueError("an unterminated /* comment in a kernel header")
            i = end + 2
            continue
        c = header[i]
        if c == "#" and depth == 0 and header[header.rfind("\n", 0, i) + 1 : i].strip() == "":
            if code_seen:
                raise ValueError(f"a preprocessor line inside a top-level item: {header[i:i + 60]!r}")
            end = header.find("\n", i)
            end = n if end < 0 else end
            items.append((None, header[start:end + 1]))
            start, i = end + 1, end + 1
            continue
        if not c.isspace():
            code_seen = True
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth < 0:
                raise ValueError("an unbalanced '}' in a kernel header")
        if depth == 0 and c in "};":
            end = i + 1
            while end < n and header[end] in " \t":
                end += 1
            if c == "}" and end < n and header[end] == ";":
                end += 1
            end = header.find("\n", end)
            end = n if end < 0 else end
            items.append((_defined_name(header[start:i + 1]), header[start:end + 1]))
            start, i, code_seen = end + 1, end + 1, False
            continue
        i += 1
    if depth != 0 or header[start:].strip():
        raise ValueError(f"a kernel header ends inside an item: {header[start:start + 60]!r}")
    return items


def _defined_name(item: str) -> str:
    """The name an item defines: the last identifier before its first '(', '[', '=' or '{',
    past a specialization's template arguments (``as_type<float, uint>(``)."""
    code = _BLOCK_COMMENT.sub("", _LINE_COMMENT.sub("", item))
    head = re.split(r"[(\[={]", code, maxsplit=1)[0]
    head = _TRAILING_TEMPLATE_ARGS.sub("", head)
    names = _IDENTIFIER.findall(head)
    if not names:
        raise ValueError(f"no name found for a kernel header item: {code.strip()[:60]!r}")
    return names[-1]


@functools.lru_cache(maxsize=None)
def needed_header(header: str, body: str) -> str:
    """The items of ``header`` that ``body`` calls, directly or through other items, in the
    header's order (preprocessor lines always). What a kernel does not call is not in its
    source, so MLX's per-launch hash of the source (see :func:`_compact`) covers less text."""
    items = header_items(header)
    by_name: dict[str, list[int]] = {}
    for k, (name, _) in enumerate(items):
        if name is not None:
            by_name.setdefault(name, []).append(k)
    keep = {k for k, (name, _) in enumerate(items) if name is None}
    todo = [body] + [items[k][1] for k in keep]
    while todo:
        for ident in set(_IDENTIFIER.findall(_LINE_COMMENT.sub("", todo.pop()))):
            for k in by_name.get(ident, ()):
                if k not in keep:
                    keep.add(k)
                    todo.append(items[k][1])
    return "".join(text for k, (_, text) in enumerate(items) if k in keep)


@functools.lru_cache(maxsize=None)
def sections(family: str) -> dict[str, str]:
    """``{"header": ..., "<kernel>": body}`` of ``<family>.metal``."""
    text = (HERE / f"{family}.metal").read_text()
    marks = list(_MARK.finditer(text))
    out = {}
    for m, nxt in zip(marks, marks[1:] + [None]):
        out[m.group(2) or "header"] = text[m.end() : nxt.start() if nxt else len(text)].strip("\n") + "\n"
    return out


_PRELUDE_BLOCK = re.compile(r"^// -- (?:only where the source names (.+)|always)$", re.M)


@functools.lru_cache(maxsize=None)
def _prelude_blocks() -> tuple[tuple[frozenset[str] | None, str], ...]:
    """prelude.cuh as (names, compacted and squeezed text) blocks: ``None`` for a block every kernel
    gets, else the names one of which a kernel's source must name to get it."""
    text = (HERE / "prelude.cuh").read_text()
    blocks, start, names = [], 0, None
    for m in _PRELUDE_BLOCK.finditer(text):
        blocks.append((names, text[start:m.start()]))
        names = frozenset(m.group(1).split()) if m.group(1) else None
        start = m.end()
    blocks.append((names, text[start:]))
    return tuple((n, _squeeze(_compact(t))) for n, t in blocks if t.strip())


def cuda_prelude(source: str | None = None) -> str:
    """prelude.cuh, compacted and squeezed (it is in every kernel's source: see :func:`_squeeze`);
    with the ``source`` of a kernel (its header and body), only the optional blocks whose names it
    uses (the same machine code: what a kernel does not name, it does not use)."""
    used = None if source is None else set(_IDENTIFIER.findall(source))
    return "".join(t for names, t in _prelude_blocks() if names is None or used is None or names & used)


def backend() -> str:
    """``"metal"``, ``"cuda"`` or ``"cpu"`` (the oracles); ``MUSE_MLX_KERNELS=oracle`` forces the oracles."""
    if os.environ.get("MUSE_MLX_KERNELS", "").lower() == "oracle":
        return "cpu"
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "cpu"


def variants_launched(which: str | None = None) -> int:
    """How many kernel variants (a kernel with one set of launch bounds, template values and
    dtypes) this process has launched on backend ``which`` (default: every GPU backend). MLX builds
    each at its first launch: on CUDA one NVRTC compile of about a second (1.04-1.86 s on a 2-core
    CPU: thirty-second session, docs/performance-history.md), in every process, since MLX keeps no custom
    kernel's build on disk (``MUSE_MLX_CUDA_PREBUILD``: :mod:`.cuda_prebuild`)."""
    return sum(1 for v in Kernel.launched if which is None or v[0] == which)


def in_device_memory(arr: mx.array) -> mx.array:
    """On CUDA, a copy of ``arr`` in device memory (the same bits); elsewhere ``arr`` itself.

    MLX (0.32) keeps arrays made from host data in CUDA managed memory, which moves to the GPU
    page by page on first touch, and back when the host touches the page: an embedding table
    read one row per token faulted its pages over every token (30-200 us per token on the H200,
    measured with ``scripts/gpu_timeline.py``). What a GPU kernel computes is allocated in
    device memory -- unless it is 8 bytes or less (below)."""
    if arr.nbytes <= SCALAR_POOL_BYTES:  # checked everywhere, so a CPU run catches it too
        raise ValueError(f"an array of {arr.nbytes} bytes would stay in MLX's managed scalar pool")
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return arr
    return bit_copy(arr)


def bit_copy(arr: mx.array) -> mx.array:
    """A new buffer holding ``arr``'s bits, written by a kernel (``mx.copy`` would share the
    buffer): the words xor 0, so -0.0, NaN payloads and denormals come through unchanged."""
    word = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[arr.itemsize]
    out = mx.view(mx.view(arr, word) ^ mx.array(0, dtype=word), arr.dtype)
    mx.eval(out)  # `arr` is still referenced here, so its buffer cannot be donated to `out`
    return out


# MLX's CUDA allocator serves every buffer of at most 8 bytes -- a host-made scalar or a kernel's
# one-element output alike -- from one pool of managed memory that the GPU maps but the host also
# writes (each new scalar), so a kernel's read of such a buffer can be a read across PCIe. The
# decode path's small arrays are therefore made wider than that: constants of four elements,
# the position of four (muse_mlx.decode).
SCALAR_POOL_BYTES = 8
_CONSTANTS: dict[tuple, mx.array] = {}


def constant(value, dtype=mx.float32, at_least: int = 4) -> mx.array:
    """A kernel's scalar argument (an epsilon, a count) as element 0 of an array of at least four
    (``at_least``) in device memory, made once per value: a fresh ``mx.array`` per call would be one
    more upload per dispatch, and a one-element one would live in MLX's managed scalar pool (above)."""
    key = (value, dtype, at_least, str(mx.default_device()))  # made on the CPU, an array stays in host memory
    if key not in _CONSTANTS:
        wide = max(at_least, 2 * SCALAR_POOL_BYTES // dtype.size)  # past the pool whatever the element size
        _CONSTANTS[key] = in_device_memory(mx.array([value] * wide, dtype=dtype))
    return _CONSTANTS[key]


_CUDA_TYPES = {
    mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.uint8: "uint8_t",
    mx.int8: "int8_t", mx.uint32: "uint32_t", mx.int32: "int32_t",
}


def launch_bounds(bounds: tuple[int, int] | None) -> str:
    """Header text that gives the kernel after it ``__launch_bounds__(threads, min_blocks)``.

    MLX writes a custom kernel's signature itself (``__global__ void custom_kernel_<name>(...)``),
    so the bound rides on ``__global__``: redefined here, after every include, to what CUDA's
    host_defines.h makes of it plus the bound (checked against CUDA 13.5's; the nvcc test in
    tests/test_kernels.py finds the bound in the PTX). Only the one kernel of the unit follows it."""
    if bounds is None:
        return ""
    threads, min_blocks = bounds
    return f"#undef __global__\n#define __global__ __location__(global) __launch_bounds__({threads}, {min_blocks})\n"


def bounds_of(threadgroup, min_blocks: int) -> tuple[int, int] | None:
    """The launch bounds (threads, min_blocks) of a launch of ``threadgroup`` asking for
    ``min_blocks`` resident threadgroups per SM; None for none (0). A bounded build is filed
    under ``("cuda", bounds_of(...))`` (:meth:`Kernel.build`)."""
    return (threadgroup[0] * threadgroup[1] * threadgroup[2], min_blocks) if min_blocks else None


def bounded_name(name: str, bounds: tuple[int, int] | None) -> str:
    return name if bounds is None else f"{name}_lb{bounds[0]}x{bounds[1]}"


# MLX's CUDA backend hashes a custom kernel's whole source at every launch (CustomKernel::eval_gpu
# names the module by std::hash of it, MLX 0.32), about 0.25 us a KB on the H200's hosts: 2 us a
# launch for the average kernel, 0.7 ms a decoded token. So on CUDA the header and the body MLX gets
# are each one #include line naming a file that holds the text; NVRTC reads the files once, when it
# compiles (they must still be there then: they are written when the kernel is built). The files are
# named by a hash of their content, so a changed text is a new file, a new source and a new module in
# MLX's cache, never a stale one.
SOURCE_MODES = ("file", "inline")


def cuda_source_mode() -> str:
    """``MUSE_MLX_CUDA_SOURCE``: ``file`` (default: texts behind #include lines) or ``inline``
    (the texts themselves, as before)."""
    mode = os.environ.get("MUSE_MLX_CUDA_SOURCE", "file").lower()
    if mode not in SOURCE_MODES:
        raise ValueError(f"MUSE_MLX_CUDA_SOURCE={mode!r}: expected one of {', '.join(SOURCE_MODES)}")
    return mode


def cuda_source_dir() -> Path:
    """Where the included texts go: ``MUSE_MLX_CUDA_SOURCE_DIR``, else ``$XDG_CACHE_HOME`` (or
    ``~/.cache``) ``/muse_mlx/cuda-sources``."""
    given = os.environ.get("MUSE_MLX_CUDA_SOURCE_DIR")
    if given:
        return Path(given).expanduser().absolute()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache).absolute() / "muse_mlx" / "cuda-sources"


_INCLUDE_FAILED: set[str] = set()


def included(text: str, label: str) -> str | None:
    """``#include "<file>"`` for a file holding ``text`` (written if missing, atomically, so that
    processes sharing the folder never read half a file); None, after one warning, where the folder
    cannot be written or its path cannot be quoted. ``label`` begins the file's name."""
    folder = cuda_source_dir()
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]
    path = folder / f"{label}.{digest}.cuh"
    if any(c in str(path) for c in '"\\\n'):
        problem = "its path holds a quote, backslash or newline"
    else:
        try:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                folder.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, path)
            return f'#include "{path}"\n'
        except OSError as e:
            problem = str(e)
    if str(folder) not in _INCLUDE_FAILED:
        _INCLUDE_FAILED.add(str(folder))
        warnings.warn(f"kernel sources go inline (MLX hashes them at every launch): cannot use {folder} "
                      f"for them ({problem}); set MUSE_MLX_CUDA_SOURCE_DIR to a writable folder", stacklevel=3)
    return None


_INCLUDE_LINE = re.compile(r'^#include "([^"\n]+\.cuh)"\n', re.M)


def expand_includes(text: str) -> str:
    """``text`` with each of :func:`included`'s lines replaced by its file's text: what NVRTC compiles."""
    folder = str(cuda_source_dir())
    return _INCLUDE_LINE.sub(lambda m: Path(m.group(1)).read_text(encoding="utf-8") if m.group(1).startswith(folder) else m.group(0),
                             text)


class Kernel:
    """A named kernel body, built once per backend (and, on CUDA, per launch bound) on first use.

    ``which="record"`` runs nothing: the call (input and output dtypes, shapes, grid,
    threadgroup, template, launch bounds) is appended to :attr:`recorded` and zeros are returned, so
    tests can rebuild the exact source MLX would compile on a machine without that GPU.
    """

    recorded: list[dict] = []
    # every variant launched on a GPU in this process, as MLX tells its modules apart (the kernel's
    # name with its launch bounds, template values, dtypes; the text is the kernel's own): on CUDA
    # each is one NVRTC compile at its first launch, in every process (see variants_launched)
    launched: set[tuple] = set()

    def __init__(self, family: str | None, name: str, inputs: list[str], outputs: list[str], body: str | None = None,
                 uses: tuple[str, ...] = (), parts: tuple[str, ...] = ()):
        self.family, self.name = family, name
        self.inputs, self.outputs = inputs, outputs
        self._body = body  # a body given inline (the GPU check's probes) instead of a .metal section
        self.uses = uses  # other families whose header helpers the body calls
        self.parts = parts  # sections whose texts, in order, are the body (default: the kernel's own)
        self._built = {}
        self._texts = {}  # on CUDA, per build: the (header, body) MLX got, for cuda_prebuild

    @property
    def body(self) -> str:
        if self._body is not None:
            return self._body
        return "".join(sections(self.family)[p] for p in self.parts or (self.name,))

    @property
    def header(self) -> str:
        """The helpers of this kernel's families (``uses``, then its own) that its body calls."""
        families = self.uses + (() if self.family is None else (self.family,))
        return needed_header("".join(sections(f).get("header", "") for f in families), self.body)

    def build(self, which: str, bounds: tuple[int, int] | None = None):
        """The MLX kernel for ``which``; on CUDA, ``bounds`` = (threads, min_blocks) builds a
        variant of its own name with those launch bounds (MLX caches a kernel by its name)."""
        # (on CUDA the source mode too, so that an in-process A/B of MUSE_MLX_CUDA_SOURCE gets both forms)
        key = (which, bounds, cuda_source_mode()) if which == "cuda" else (which, None)
        if key not in self._built:
            if which == "metal":
                header, source = self.metal_texts()
                self._built[key] = mx.fast.metal_kernel(
                    name=self.name, input_names=self.inputs, output_names=self.outputs, source=source, header=header,
                )
            elif which == "cuda":
                header, source = self._texts[key] = self.launch_texts(bounds)
                self._built[key] = mx.fast.cuda_kernel(
                    name=bounded_name(self.name, bounds), input_names=self.inputs, output_names=self.outputs,
                    source=source, header=header,
                )
            else:
                raise ValueError(f"no GPU kernel for backend {which!r}")
        return self._built[key]

    def metal_texts(self) -> tuple[str, str]:
        """The (header, body) :meth:`build` hands ``mx.fast.metal_kernel``: the prelude and this
        kernel's helpers, and its body, each compacted (:func:`metal_compact`)."""
        return METAL_PRELUDE + metal_compact(self.header), metal_compact(self.body)

    def metal_source_preview(self):
        """The Metal builder, usable on any machine inside ``mx.export_function`` (to print the source)."""
        header, source = self.metal_texts()
        return mx.fast.metal_kernel(
            name=self.name, input_names=self.inputs, output_names=self.outputs, source=source, header=header,
        )

    def cuda_header(self, bounds: tuple[int, int] | None = None) -> str:
        """The header MLX's CUDA build puts before the kernel: the prelude's blocks this kernel names,
        its launch bounds, then its families' helpers."""
        return cuda_prelude(self.header + self.body) + launch_bounds(bounds) + to_cuda(self.header)

    def launch_texts(self, bounds: tuple[int, int] | None = None) -> tuple[str, str]:
        """The (header, body) :meth:`build` hands ``mx.fast.cuda_kernel``: :meth:`cuda_header` and the
        body in CUDA's words, each as one #include line of a file holding it (:func:`included`),
        or, with ``MUSE_MLX_CUDA_SOURCE=inline`` or where the files cannot be written, the texts."""
        header, body = self.cuda_header(bounds), to_cuda(self.body)
        if cuda_source_mode() == "file":
            # a body that names an input's _shape, _strides or _ndim gets them from MLX only if its
            # source text does (MLX 0.32 looks for the words there): such a body stays inline
            asks = any(f"{n}_{w}" in body for n in self.inputs for w in ("shape", "strides", "ndim"))
            label = bounded_name(self.name, bounds)
            inc_header = included(header, label + ".header")
            inc_body = None if asks or inc_header is None else included(body, label + ".body")
            if inc_header is not None:
                header = inc_header
            if inc_body is not None:
                body = inc_body
        return header, body

    def cuda_source(self, input_dtypes, output_dtypes, template, bounds: tuple[int, int] | None = None,
                    as_launched: bool = False) -> str:
        """The translation unit ``mx.fast.cuda_kernel`` compiles (mirrors MLX 0.32's build_kernel),
        minus MLX's own default header, which the caller supplies; ``bounds`` as for :meth:`build`.
        ``as_launched``: with the #include lines MLX gets (:meth:`launch_texts`), not the texts."""
        header, body = self.launch_texts(bounds) if as_launched else (self.cuda_header(bounds), to_cuda(self.body))
        params = [f"    const {_CUDA_TYPES[d]}* {n}" for n, d in zip(self.inputs, input_dtypes)]
        params += [f"    {_CUDA_TYPES[d]}* {n}" for n, d in zip(self.outputs, output_dtypes)]
        consts = "".join(f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {int(v)};\n" for k, v in template or [])
        return (
            header
            + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void custom_kernel_{bounded_name(self.name, bounds)}(\n" + ",\n".join(params) + ") {\n"
            + consts + body + "\n}\n\n} // namespace mlx::core::cu\n"
        )

    @staticmethod
    def recorded_source(call: dict, as_launched: bool = False) -> str:
        """:meth:`cuda_source` of a call recorded in :attr:`recorded` (its kernel, dtypes, template, bounds)."""
        return call["kernel"].cuda_source([a.dtype for a in call["inputs"]], call["output_dtypes"], call["template"],
                                          call["bounds"], as_launched)

    def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template, which=None,
                 min_blocks: int = 0, **kw):
        """``min_blocks``: on CUDA, compile for at least that many resident threadgroups per SM
        (``__launch_bounds__``; 0, ptxas's own register choice). Metal has no such bound."""
        which = which or backend()
        bounds = bounds_of(threadgroup, min_blocks)
        if which == "record":
            Kernel.recorded.append(dict(
                kernel=self, inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                grid=grid, threadgroup=threadgroup, template=template, bounds=bounds,
            ))
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]
        k = self.build(which, bounds)
        # (about 2 us a call on a 2-core CI machine; an uncompiled launch costs MLX's host ~20 us)
        mode = cuda_source_mode() if which == "cuda" else None
        variant = (which, self.name, bounds, mode, tuple(template or ()), tuple(getattr(a, "dtype", None) for a in inputs),
                   tuple(output_dtypes))
        if variant not in Kernel.launched:
            Kernel.launched.add(variant)
            if which == "cuda" and cuda_prebuild.enabled():  # MLX reads the module this writes
                header, body = self._texts[(which, bounds, mode)]
                cuda_prebuild.ensure_or_warn(bounded_name(self.name, bounds), header, body, self.inputs, inputs,
                                             self.outputs, output_dtypes, template)
        return k(
            inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
            grid=grid, threadgroup=threadgroup, template=template, **kw,
        )
