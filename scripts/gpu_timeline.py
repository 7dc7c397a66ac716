"""Where a decoded token's time goes on an NVIDIA GPU: every kernel's start and end, from CUPTI.

    python scripts/gpu_timeline.py --file PATH [--route pinned] [--flags mv_q8] [--ctx 128] [--tokens 8]
                                   [--prefill 512 [--prefill-mode batched] [--prefill-wait-ab]]
                                   [--prefill-commit-ab] [--host] [--env-ab NAME=V1,V2]

Decodes ``--tokens`` tokens of a checkpoint FILE (made if missing: the release geometry, as
``bench.py`` makes it) the way ``bench.py`` and ``generate`` do (compiled ``DecodeStep``,
pipelined with ``mx.async_eval``), with CUPTI's activity API recording what the GPU ran. It
prints, per token: the span on the GPU, the time inside kernels, the gaps between them, and
per kernel the count, the mean and the total; ``--json`` writes the records too.

``--host`` also records the host's side: every CUDA runtime and driver call MLX makes (its name,
count and time, e.g. how long graph instantiation and launch take) and, where the MLX build emits
them, its NVTX ranges (``CustomKernel::eval_gpu``, ...), through CUPTI as NVTX's injection library
(none came through from MLX 0.32.4's CUDA wheel). CUPTI adds its own cost to every recorded call,
so the host's wall clock is slower with it.

``--prefill N`` traces one prefill of N tokens first (``--prefill-mode``, as ``generate`` runs it;
``--prefill-wait-ab`` also with each group of layers waited for before the next is built), its
figures per whole prefill; ``--ctx ""`` then skips the decode.

Timings in ``bench.py`` replay an op alone; this shows the ops as they run together, with the
idle time between them that no per-kernel table can show.

CUPTI is NVIDIA's profiling library: ``libcupti.so`` of the driver's CUDA major version, from
``pip install nvidia-cuda-cupti`` or a CUDA toolkit. ``--cupti PATH`` (or ``MUSE_MLX_CUPTI``)
names it; otherwise it is looked for beside the other ``nvidia`` wheels and on the loader path.
The records are read with ctypes, at the offsets of ``CUpti_ActivityKernel10`` (CUDA 13.0's
``cupti_activity.h``); their first fields have kept these offsets since CUDA 11.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import ctypes.util
import glob
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

KIND_MEMCPY, KIND_MEMSET, KIND_DRIVER, KIND_RUNTIME, KIND_CONCURRENT_KERNEL, KIND_MARKER = 1, 2, 4, 5, 10, 12
GPU_KINDS = (KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET)
HOST_KINDS = (KIND_DRIVER, KIND_RUNTIME, KIND_MARKER)
# byte offsets in the activity records (cupti_activity.h, CUDA 13.0; checked with offsetof)
_START, _END = 16, 24
_KERNEL_STREAM, _KERNEL_GRID, _KERNEL_BLOCK, _KERNEL_NAME = 48, 52, 64, 104
_COPY_STREAM, _COPY_BYTES = 40, 8
_API_CBID, _API_START, _API_END, _API_THREAD = 4, 8, 16, 28  # CUpti_ActivityAPI
_MARKER_FLAGS, _MARKER_TIME, _MARKER_ID, _MARKER_NAME = 4, 8, 16, 40  # CUpti_ActivityMarker2
MARKER_START, MARKER_END = 1 << 1, 1 << 2  # CUPTI_ACTIVITY_FLAG_MARKER_{START,END}
DOMAIN_OF_KIND = {KIND_DRIVER: 1, KIND_RUNTIME: 2}  # CUPTI_CB_DOMAIN_{DRIVER,RUNTIME}_API
_BUFFER_BYTES = 8 << 20


class CuptiError(RuntimeError):
    pass


def find_cupti(explicit: str | None = None) -> str:
    """The path of libcupti, or a CuptiError that says where it was looked for."""
    candidates = [explicit or os.environ.get("MUSE_MLX_CUPTI")]
    for root in sys.path:
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "lib", "libcupti.so*")))
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "cuda_cupti", "lib", "libcupti.so*")))
    candidates.append(ctypes.util.find_library("cupti"))
    for c in candidates:
        if c and (os.path.exists(c) or "/" not in c):
            return c
    raise CuptiError("libcupti not found: pip install nvidia-cuda-cupti (the driver's CUDA major version), "
                     "or pass --cupti PATH / set MUSE_MLX_CUPTI")


class KernelTimeline:
    """Records the kernels, copies and memsets the GPU runs inside a ``with`` block.

    ``records`` is a list of dicts: ``kind`` ("kernel", "memcpy", "memset"), ``name``,
    ``start``/``end`` (ns, the GPU's timestamps on CPU time), ``stream`` and, for kernels,
    ``grid``/``block``. ``host=True`` also fills ``host_records``: the CUDA runtime and driver
    calls ("runtime", "driver": ``name``, ``start``/``end``, ``thread``) and NVTX range ends and
    starts ("marker": ``id``, ``flags``, ``time``, ``name``); see ``enable_nvtx``."""

    def __init__(self, library: str | None = None, host: bool = False):
        path = find_cupti(library)
        self.kinds = GPU_KINDS + (HOST_KINDS if host else ())
        self.host_records: list[dict] = []
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise CuptiError(f"cannot load {path}: {e}") from None
        self.records: list[dict] = []
        self._buffers: dict[int, ctypes.Array] = {}
        request = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
                                   ctypes.POINTER(ctypes.c_size_t))
        complete = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t,
                                    ctypes.c_size_t)
        self._request, self._complete = request(self._on_request), complete(self._on_complete)

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            msg = ctypes.c_char_p()
            self._lib.cuptiGetResultString(result, ctypes.byref(msg))
            raise CuptiError(f"{what} failed: {msg.value.decode() if msg.value else result}")

    def _on_request(self, buffer, size, max_records):
        buf = (ctypes.c_uint64 * (_BUFFER_BYTES // 8))()  # 8-byte aligned, as CUPTI requires
        self._buffers[ctypes.addressof(buf)] = buf
        buffer[0] = ctypes.addressof(buf)
        size[0] = _BUFFER_BYTES
        max_records[0] = 0

    def _on_complete(self, context, stream_id, buffer, size, valid):
        record = ctypes.c_void_p()
        while self._lib.cuptiActivityGetNextRecord(ctypes.c_void_p(buffer), ctypes.c_size_t(valid),
                                                   ctypes.byref(record)) == 0:
            r = parse_record(record.value)
            if r is not None:
                (self.records if r["kind"] in ("kernel", "memcpy", "memset") else self.host_records).append(r)
        self._buffers.pop(buffer, None)

    def api_name(self, kind: int, cbid: int) -> str:
        """The name of runtime or driver call ``cbid`` (e.g. "cudaGraphLaunch")."""
        name = ctypes.c_char_p()
        if self._lib.cuptiGetCallbackName(DOMAIN_OF_KIND[kind], cbid, ctypes.byref(name)) != 0 or not name.value:
            return f"{'driver' if kind == KIND_DRIVER else 'runtime'} call {cbid}"
        return name.value.decode(errors="replace")

    def __enter__(self):
        self._check(self._lib.cuptiActivityRegisterCallbacks(self._request, self._complete), "cuptiActivityRegisterCallbacks")
        for kind in self.kinds:
            self._check(self._lib.cuptiActivityEnable(kind), f"cuptiActivityEnable({kind})")
        return self

    def __exit__(self, *exc):
        self._check(self._lib.cuptiActivityFlushAll(1), "cuptiActivityFlushAll")  # 1: forced flush
        for kind in self.kinds:
            self._lib.cuptiActivityDisable(kind)
        names: dict[tuple, str] = {}
        for r in self.host_records:
            if "cbid" in r:
                key = (KIND_DRIVER if r["kind"] == "driver" else KIND_RUNTIME, r.pop("cbid"))
                if key not in names:
                    names[key] = self.api_name(*key)
                r["name"] = names[key]
        return False


def enable_nvtx(library: str | None = None) -> None:
    """Make CUPTI NVTX's injection library, so that MLX's NVTX ranges become marker records.
    NVTX reads the variable at its first call, so this must run before MLX's first GPU work."""
    os.environ["NVTX_INJECTION64_PATH"] = find_cupti(library)


def parse_record(addr: int) -> dict | None:
    """One activity record at ``addr`` as a dict (None for kinds not asked for)."""
    u32 = lambda off: ctypes.c_uint32.from_address(addr + off).value  # noqa: E731
    u64 = lambda off: ctypes.c_uint64.from_address(addr + off).value  # noqa: E731
    kind = u32(0)
    if kind == KIND_CONCURRENT_KERNEL:
        name = ctypes.c_char_p.from_address(addr + _KERNEL_NAME).value or b"?"
        return dict(kind="kernel", name=short_name(name.decode(errors="replace")), start=u64(_START), end=u64(_END),
                    stream=u32(_KERNEL_STREAM), grid=[u32(_KERNEL_GRID + 4 * i) for i in range(3)],
                    block=[u32(_KERNEL_BLOCK + 4 * i) for i in range(3)])
    if kind in (KIND_MEMCPY, KIND_MEMSET):
        what = "memcpy" if kind == KIND_MEMCPY else "memset"
        return dict(kind=what, name=f"{what} {u64(_COPY_BYTES)} B", start=u64(_START), end=u64(_END),
                    stream=u32(_COPY_STREAM))
    if kind in (KIND_DRIVER, KIND_RUNTIME):
        return dict(kind="driver" if kind == KIND_DRIVER else "runtime", cbid=u32(_API_CBID), start=u64(_API_START),
                    end=u64(_API_END), thread=u32(_API_THREAD))
    if kind == KIND_MARKER:
        name = ctypes.c_char_p.from_address(addr + _MARKER_NAME).value
        return dict(kind="marker", id=u32(_MARKER_ID), flags=u32(_MARKER_FLAGS), time=u64(_MARKER_TIME),
                    name=name.decode(errors="replace") if name else None)
    return None


_NESTED = re.compile(r"(\d+)")


def short_name(mangled: str) -> str:
    """A readable kernel name: MLX's custom kernels by their own name, C++ kernels by their
    qualified name without template arguments (a partial Itanium demangle: enough to group)."""
    m = re.search(r"custom_kernel_([A-Za-z0-9_]+)", mangled)
    if m:
        return re.sub(r"_[0-9a-f]{8,}$", "", m.group(1))
    if not mangled.startswith("_Z"):
        return mangled
    s = mangled[2:]
    nested = s.startswith("N")
    s = s[1:] if nested else s
    parts = []
    while s and s[0].isdigit():
        n = int(_NESTED.match(s).group(1))
        digits = len(str(n))
        parts.append(s[digits:digits + n])
        s = s[digits + n:]
        if not nested:
            break
        # skip one template-argument list ("I...E") after a component, nesting included
        if s.startswith("I"):
            depth = 0
            for i, ch in enumerate(s):
                depth += ch == "I"
                depth -= ch == "E"
                if depth == 0:
                    s = s[i + 1:]
                    break
    return "::".join(parts) or mangled


def summarize(records: list[dict], tokens: int) -> dict:
    """Per-token span, busy time, gaps and per-name totals of one stream's records.

    The records are ordered by start; ``busy`` is the union of their intervals, a gap is the
    idle time between one record's end and the next one's start (overlaps count as none)."""
    recs = sorted(records, key=lambda r: r["start"])
    if not recs:
        raise ValueError("no GPU activity was recorded")
    span = recs[-1]["end"] - recs[0]["start"]
    gaps, busy, reach = [], 0, recs[0]["start"]
    for r in recs:
        if r["start"] > reach:
            gaps.append(r["start"] - reach)
        else:
            gaps.append(0)
        busy += max(0, r["end"] - max(reach, r["start"]))
        reach = max(reach, r["end"])
    gaps = gaps[1:]  # the first record has no predecessor
    by_name: dict[str, dict] = {}
    for i, r in enumerate(recs):
        e = by_name.setdefault(r["name"], dict(name=r["name"], count=0, total_ns=0, gap_before_ns=0))
        e["count"] += 1
        e["total_ns"] += r["end"] - r["start"]
        if i:
            e["gap_before_ns"] += gaps[i - 1]
    rows = sorted(by_name.values(), key=lambda e: -e["total_ns"])
    for e in rows:
        e["per_token"] = e["count"] / tokens
        e["mean_us"] = e["total_ns"] / e["count"] / 1e3
        e["ms_per_token"] = e["total_ns"] / tokens / 1e6
        e["gap_ms_per_token"] = e["gap_before_ns"] / tokens / 1e6
    big = [g for g in gaps if g > 20_000]
    # A CUDA graph runs its branches on streams of their own; a chain of kernels that hops between
    # streams waits across them (about 1.5 us a hop on the H200: twenty-fourth session)
    streams = collections.Counter(r.get("stream") for r in recs)
    return dict(
        tokens=tokens, records=len(recs), span_ms_per_token=span / tokens / 1e6,
        busy_ms_per_token=busy / tokens / 1e6, gap_ms_per_token=sum(gaps) / tokens / 1e6,
        median_gap_us=statistics.median(gaps) / 1e3 if gaps else 0.0,
        gaps_over_20us=len(big), gaps_over_20us_ms_per_token=sum(big) / tokens / 1e6, by_name=rows,
        streams=len(streams), on_busiest_stream=max(streams.values()) / len(recs),
    )


def host_ranges(records: list[dict]) -> list[dict]:
    """The host records as intervals: API calls as they are, NVTX ranges paired by id (a start
    carries the name, its end the same id). A range whose start or end is missing is dropped."""
    out = [dict(kind=r["kind"], name=r["name"], start=r["start"], end=r["end"]) for r in records
           if r["kind"] in ("runtime", "driver")]
    open_ranges: dict[int, dict] = {}
    for r in sorted((r for r in records if r["kind"] == "marker"), key=lambda r: r["time"]):
        if r["flags"] & MARKER_START:
            open_ranges[r["id"]] = r
        elif r["flags"] & MARKER_END and r["id"] in open_ranges:
            first = open_ranges.pop(r["id"])
            out.append(dict(kind="nvtx", name=first["name"] or "?", start=first["time"], end=r["time"]))
    return out


def summarize_host(records: list[dict], units: int, wall_ns: float) -> dict:
    """Per name (NVTX range or API call): count and total host time per unit, and each name's
    share of the host's wall clock (NVTX ranges nest, and API calls run inside them)."""
    by_name: dict[tuple, dict] = {}
    for r in host_ranges(records):
        e = by_name.setdefault((r["kind"], r["name"]), dict(kind=r["kind"], name=r["name"], count=0, total_ns=0))
        e["count"] += 1
        e["total_ns"] += r["end"] - r["start"]
    rows = sorted(by_name.values(), key=lambda e: -e["total_ns"])
    for e in rows:
        e["per_unit"] = e["count"] / units
        e["mean_us"] = e["total_ns"] / e["count"] / 1e3
        e["ms_per_unit"] = e["total_ns"] / units / 1e6
        e["share_of_wall"] = e["total_ns"] / wall_ns if wall_ns else 0.0
    return dict(units=units, wall_ms_per_unit=wall_ns / units / 1e6, by_name=rows)


def print_host_summary(h: dict, unit: str = "token", top: int = 25) -> None:
    print(f"  host, per {unit} (wall clock {h['wall_ms_per_unit']:.3f} ms; NVTX ranges include the calls inside them):")
    print(f"    {'kind':7s} {'name':46s} {'per ' + unit:>9s} {'mean us':>9s} {'ms/' + unit:>9s} {'of wall':>8s}")
    for e in h["by_name"][:top]:
        print(f"    {e['kind']:7s} {e['name'][:46]:46s} {e['per_unit']:9.2f} {e['mean_us']:9.2f} {e['ms_per_unit']:9.3f} "
              f"{100 * e['share_of_wall']:7.1f}%")
    if len(h["by_name"]) > top:
        rest = h["by_name"][top:]
        print(f"    ({len(rest)} more names: {sum(e['ms_per_unit'] for e in rest):.3f} ms per {unit} together)")
    if not any(e["kind"] == "nvtx" for e in h["by_name"]):
        print("    (no NVTX ranges were recorded: this MLX build may have none, or NVTX was set up before --host)")


def print_summary(s: dict, label: str, unit: str = "token") -> None:
    """``unit``: what one of ``s['tokens']`` is ("prefill": the figures are per whole prefill)."""
    print(f"\n{label}: {s['records']} GPU records over {s['tokens']} {unit}s")
    rate = f"{1e3 / s['span_ms_per_token']:.1f} tok/s" if unit == "token" else f"{1e3 / s['span_ms_per_token']:.2f} per s"
    print(f"  per {unit}: span {s['span_ms_per_token']:.3f} ms = {rate}; "
          f"in kernels {s['busy_ms_per_token']:.3f} ms; idle between them {s['gap_ms_per_token']:.3f} ms "
          f"(median gap {s['median_gap_us']:.2f} us; {s['gaps_over_20us']} gaps > 20 us, "
          f"{s['gaps_over_20us_ms_per_token']:.3f} ms/token)")
    print(f"  on {s['streams']} stream(s), {100 * s['on_busiest_stream']:.0f} % of the records on the busiest; "
          f"gaps under 20 us: {s['gap_ms_per_token'] - s['gaps_over_20us_ms_per_token']:.3f} ms per {unit}")
    print(f"  {'kernel':44s} {'per ' + unit:>9s} {'mean us':>9s} {'ms/' + unit:>9s} {'gap before, ms/' + unit:>21s}")
    small = [e for e in s["by_name"] if e["ms_per_token"] < 0.01]
    for e in s["by_name"]:
        if e not in small:
            print(f"  {e['name'][:44]:44s} {e['per_token']:9.2f} {e['mean_us']:9.2f} {e['ms_per_token']:9.3f} "
                  f"{e['gap_ms_per_token']:21.3f}")
    if small:
        print(f"  ({len(small)} more kinds under 0.01 ms per {unit}: {sum(e['ms_per_token'] for e in small):.3f} ms "
              f"per {unit} together)")


def trace_decode(model, ctx: int, tokens: int, warmup: int, compiled: bool, library: str | None, host: bool = False):
    """The timeline of ``tokens`` decoded tokens after ``warmup`` untimed ones (bench.py's loop),
    and the host's wall clock over them."""
    import mlx.core as mx
    import numpy as np
    from bench import decode_tokens, fill_cache, greedy_step

    cache = model.make_cache()
    fill_cache(model, cache, ctx, np.random.default_rng(0))
    step = greedy_step(model, cache, ctx + warmup + tokens + 2, compiled)
    y = step(mx.array([1]))
    for _ in range(warmup):
        y = step(y.reshape(1))
    y.item()
    mx.synchronize()
    with KernelTimeline(library, host) as tl:
        t0 = time.perf_counter()
        decode_tokens(step, y, tokens)
        mx.synchronize()
        wall = time.perf_counter() - t0
    return tl, wall


def trace_prefill(model, n: int, mode: str, pipeline: bool, library: str | None, host: bool = False,
                  matmul_commits: bool | None = None):
    """The timeline of one ``n``-token prefill in ``mode`` (a warm-up prefill first), as generate
    runs it, and its wall clock; ``pipeline=False``: each group of layers waited for before the
    next is built; ``matmul_commits``: see generate.batched_prefill (default: generate's)."""
    import mlx.core as mx
    import numpy as np
    from muse_mlx.generate import batched_prefill

    prompt = mx.array(np.random.default_rng(0).integers(0, model.cfg.vocab_size, n))[None]
    with batched_prefill(model.route, mode, pipeline=pipeline, matmul_commits=matmul_commits):
        for record in (False, True):
            cache = model.make_cache()
            model.prepare_decode(cache, n + 8)
            mx.eval([c.kv for c in cache])
            mx.synchronize()
            with KernelTimeline(library, host) if record else contextlib.nullcontext() as tl:
                t0 = time.perf_counter()
                mx.eval(model(prompt, cache, last_only=True), [c.kv for c in cache])
                mx.synchronize()
                wall = time.perf_counter() - t0
            del cache
    return tl, wall


def trace_chain(n: int, library: str | None):
    """Records of a dependent chain of ``n`` tiny custom kernels (llama's norm of 256 floats),
    compiled: the GPU-side cost of one launch, without the work of a decode."""
    import mlx.core as mx
    from bench import norm_chain

    f = mx.compile(norm_chain(n))
    x = mx.random.normal((1, 256))
    mx.eval(f(x))
    mx.synchronize()
    with KernelTimeline(library) as tl:
        mx.eval(f(x))
        mx.synchronize()
    return tl.records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", required=True, help="checkpoint path (a synthetic file of the release geometry, or of --thin's, is made if missing)")
    ap.add_argument("--thin", action="store_true", help="the file is bench.py --thin's geometry (the release layers "
                    "and heads, narrow matrices): the host's side with almost no work in the kernels")
    ap.add_argument("--route", default="pinned", help="route to load (default: %(default)s)")
    ap.add_argument("--flags", default="", help="comma-separated flag sets, '+' inside one, an empty set is no "
                    "flags: ',mv_q8' traces both (default: no flags)")
    ap.add_argument("--ctx", default="128", help="comma-separated contexts; empty: no decode (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=8, help="tokens recorded per case (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=4, help="tokens decoded before recording (default: %(default)s)")
    ap.add_argument("--not-compiled", action="store_true", help="run the decode step without mx.compile")
    ap.add_argument("--geometries", default="", help="comma-separated matvec geometries to trace, each Q4K/Q6K as "
                    "NR0xNSG[xU[xP]] (e.g. 2x2x2/4x4x1x1), set through MUSE_MLX_MV_GEOMETRY{,_Q6K} (default: the tuned ones)")
    ap.add_argument("--env-ab", action="append", default=[], help="NAME=V1,V2,...: trace every decode case once per "
                    "value of the environment variable NAME (a kernel switch such as MUSE_MLX_Q8_TAIL; read when the "
                    "step is traced; a switch of the weights' form such as MUSE_MLX_Q8_TILE re-forms them through "
                    "Model.set_flags), in turn, twice over; repeated, one such sweep after another, each with the "
                    "other sweeps' variables as the command's environment leaves them; A+B=a1+b1,a2+b2,... moves several "
                    "variables together")
    ap.add_argument("--prefill", type=int, default=0, help="also trace one prefill of this many tokens (default: none)")
    ap.add_argument("--prefill-mode", default="batched", help="comma-separated prefill modes to trace (default: %(default)s)")
    ap.add_argument("--prefill-wait-ab", action="store_true",
                    help="trace each prefill also waiting for each group of layers before building the next")
    ap.add_argument("--prefill-commit-ab", action="store_true",
                    help="trace each prefill also with every batched weight matmul in a CUDA graph of its own and without "
                    "(generate's default: with, for the float32 mode on CUDA)")
    ap.add_argument("--host", action="store_true", help="also record the host's CUDA calls and MLX's NVTX ranges "
                    "(slows the host a little)")
    ap.add_argument("--cupti", default=None, help="path of libcupti.so (default: MUSE_MLX_CUPTI or a search)")
    ap.add_argument("--json", default=None, help="write the summaries and raw records to this file")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench
    import mlx.core as mx
    from environment import describe_settings, env, env_settings, setting_dict, settings_in_effect
    from muse_mlx import load_model
    from muse_mlx.synthetic import RELEASE_VOCAB, ensure_synthetic
    from muse_mlx.writer import MUSE_GLIMMER_30B

    if not mx.cuda.is_available():
        print("gpu_timeline.py needs MLX's CUDA backend (CUPTI records NVIDIA GPUs only)", file=sys.stderr)
        return 2
    try:
        find_cupti(args.cupti)
    except CuptiError as e:
        print(e, file=sys.stderr)
        return 2
    if args.host:
        enable_nvtx(args.cupti)
    path = Path(args.file)
    ensure_synthetic(path, *((bench.THIN_GEOMETRY, bench.THIN_VOCAB) if args.thin else (MUSE_GLIMMER_30B, RELEASE_VOCAB)),
                     "q4_k_m", 0)
    flag_sets = bench.flag_sets(args.route, args.flags)
    out = dict(file=str(path), mlx=mx.__version__, environment=settings_in_effect(), cases=[])
    print(describe_settings(out["environment"]))
    chain = summarize(trace_chain(200, args.cupti), 1)
    print_summary(chain, "a compiled chain of 200 tiny custom kernels")
    out["chain"] = chain
    geometries = [tuple(g.split("/")) for g in args.geometries.split(",")] if args.geometries else [None]
    for g in geometries:
        if g is not None and len(g) != 2:
            print(f"--geometries: {'/'.join(g)!r} is not Q4K/Q6K", file=sys.stderr)
            return 2
    try:
        settings = env_settings(args.env_ab)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    model = load_model(path, args.route, progress=False)
    if args.prefill:
        schedules = [(True, None)] + ([(False, None)] if args.prefill_wait_ab else [])
        schedules += [(True, True), (True, False)] if args.prefill_commit_ab else []
        for mode in args.prefill_mode.split(","):
            for pipeline, commits in schedules:
                tl, wall = trace_prefill(model, args.prefill, mode, pipeline, args.cupti, args.host, commits)
                label = (f"{args.route}, one prefill of {args.prefill} tokens ({mode}"
                         + ("" if pipeline else ", waiting for each group of layers")
                         + ("" if commits is None else ", a graph per matmul" if commits else ", no graph per matmul")
                         + ")")
                s = summarize(tl.records, 1)
                s["wall_ms"] = wall * 1e3
                print_summary(s, label, unit="prefill")
                print(f"  host wall clock: {wall * 1e3:.1f} ms = {args.prefill / wall:.0f} tok/s")
                case = dict(label=label, route=args.route, prefill=args.prefill, mode=mode, pipeline=pipeline,
                            matmul_commits=commits, summary=s, records=tl.records)
                if args.host:
                    case["host"] = summarize_host(tl.host_records, 1, wall * 1e9)
                    print_host_summary(case["host"], unit="prefill")
                out["cases"].append(case)
                mx.clear_cache()
    cases = [(flags, g, ctx, v) for flags in dict.fromkeys(flag_sets) for g in geometries
             for ctx in (int(c) for c in args.ctx.split(",") if c) for v in settings]
    for flags, g, ctx, (env_name, env_value) in cases:
        if g is not None:  # read at each launch, so the next trace of the step takes them
            os.environ["MUSE_MLX_MV_GEOMETRY"], os.environ["MUSE_MLX_MV_GEOMETRY_Q6K"] = g
        with env(env_name, env_value):
            model.set_flags(flags)  # (inside: a switch of the weights' form, e.g. MUSE_MLX_Q8_TILE, re-forms them)
            tl, wall = trace_decode(model, ctx, args.tokens, args.warmup, not args.not_compiled, args.cupti,
                                    args.host)
        general = not model.uses_decode_path(mx.zeros((1, 1), dtype=mx.int32), model.make_cache())
        label = (f"{args.route}{'+' + '+'.join(flags) if flags else ''}, ctx {ctx}"
                 + (f", geometry Q4_K {g[0]} Q6_K {g[1]}" if g else "")
                 + (f", {env_name}={env_value}" if env_name is not None else "")
                 + (" (the general forward: this route has no decode path, nothing is compiled)" if general else ""))
        s = summarize(tl.records, args.tokens)
        s["wall_ms_per_token"] = wall / args.tokens * 1e3
        print_summary(s, label)
        print(f"  host wall clock: {s['wall_ms_per_token']:.3f} ms per token")
        case = dict(label=label, route=args.route, flags=list(flags), ctx=ctx, geometry=g, summary=s,
                    records=tl.records, env=setting_dict(env_name, env_value))
        if args.host:
            case["host"] = summarize_host(tl.host_records, args.tokens, wall * 1e9)
            print_host_summary(case["host"])
        out["cases"].append(case)
        mx.clear_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
