"""The fused pass: every element-wise statistic of a pass compiled by numba into one loop over the elements.

The element functions of a pass's statistics (``stats.elementwise``) are inlined into one generated loop
that reads each element of each input once, computes every term from registers and keeps one accumulator
per output: no tensor-sized temporaries, no cast materialised. On a host this runs at the memory's speed
(benchmarks/full_coverage.py); evaluated on chunk tensors, the same functions made ~20 ATen passes, each
writing a temporary. The bf16 cast is computed on the int32 view, round to nearest even as PyTorch's cast
(every NaN to the one pattern a tensor's cast gives it, 0xFFFF), so a bf16 key costs a few integer ops.

Used for host tensors of fp32 or bf16 when numba is installed; anything else (accelerators, fp16/fp64,
statistics declared with a chunk ``kernel``) runs the same functions on chunk tensors, with the same
values (tests/test_stats_fused.py holds the two equal, boundary values included). A pass's kernel is
compiled once per machine: the generated source is written to a cache directory (named by a hash of the
source and of every element function's code) and numba caches its machine code beside it. Until it is
compiled, which takes a few seconds in a background thread, the pass runs on chunk tensors.

The kernels release the GIL; a chunk is split over ``threads()`` threads (the caller's share of the cores:
``torch.get_num_threads()`` on the training thread, one on the probe's background thread).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dynascope.core.warn import warn
from dynascope.stats.elementwise import arguments, reduces_of
from dynascope.stats.fused_source import module_text, views

if TYPE_CHECKING:
    from torch import Tensor

    from dynascope.stats.base import Chunk, Statistic

__all__ = ["FusedKernel", "available", "kernel_for", "prepare", "serial", "threads", "wait_compiled"]

MIN_SPLIT = 1 << 16  # elements per thread at least: below that a thread's hand-off costs more than it saves
_local = threading.local()
_lock = threading.Lock()
_kernels: dict[str, FusedKernel | Future | None] = {}
_pool: ThreadPoolExecutor | None = None
_compiler: ThreadPoolExecutor | None = None


def available() -> bool:
    """Whether numba is installed (and not switched off by ``DYNASCOPE_FUSED=0``; ``DYNASCOPE_FUSED=sync``
    compiles each kernel when first needed instead of in the background, for value comparisons)."""
    return os.environ.get("DYNASCOPE_FUSED", "1") != "0" and importlib.util.find_spec("numba") is not None


def threads() -> int:
    """Threads a chunk is split over on this thread: ``serial()`` says one, otherwise torch's count."""
    n = getattr(_local, "threads", None)
    if n is None:
        import torch

        n = torch.get_num_threads()
    return max(int(n), 1)


@contextmanager
def serial() -> Iterator[None]:
    """Run the fused kernels of this thread on this thread alone (the probe's background pass)."""
    old = getattr(_local, "threads", None)
    _local.threads = 1
    try:
        yield
    finally:
        _local.threads = old


def _kind(t: Tensor) -> str | None:
    import torch

    if t.device.type != "cpu" or t.layout != torch.strided:
        return None
    return {torch.float32: "f32", torch.bfloat16: "bf16"}.get(t.dtype)


class FusedKernel:
    """A compiled pass: ``run(chunk)`` → float64 [len(outputs)] partial results of one chunk (per output: the
    count or sum, the root of the summed squares, the maximum), as the statistics' chunk kernels give them."""

    def __init__(self, statistics: Sequence[Statistic], kinds: dict[str, str], copies: tuple[tuple[str, str], ...],
                 fn: Any, many: Any = None) -> None:
        self.statistics, self.kinds, self.copies, self.fn, self.many = tuple(statistics), kinds, copies, fn, many
        self.outputs = tuple(c for s in self.statistics for c in s.outputs)
        reduces = reduces_of(self.outputs)
        self._norm = np.array([r == "norm" for r in reduces])
        self._max = np.array([r == "max" for r in reduces])
        self._scalars = [n for s in self.statistics for n in arguments(s.element) if n not in views(s)]  # type: ignore[arg-type]

    def _arrays(self, x: Chunk) -> list[np.ndarray]:
        import torch

        out = []
        for name, kind in self.kinds.items():
            t = getattr(x, name).reshape(-1)
            if kind == "f32":
                out += [t.numpy(), t.view(torch.int32).numpy()]
            else:
                out.append(t.view(torch.int16).numpy())
        for _, dest in x.copies:
            out.append(dest.numpy() if dest.dtype == torch.float32 else dest.view(torch.int16).numpy())
        return out

    def run(self, x: Chunk) -> np.ndarray:
        arrays = self._arrays(x)
        scalars: dict[str, Any] = {}
        for s in self.statistics:
            if s.scalars is not None:
                scalars.update(s.scalars(x))
        values = [np.float32(float(scalars[n])) for n in self._scalars]  # a host tensor: a read, not a sync
        n = arrays[0].shape[0]
        parts = max(min(threads(), n // MIN_SPLIT), 1)
        rows = np.zeros((parts, len(self.outputs)))
        bounds = [n * i // parts for i in range(parts + 1)]

        def one(i: int) -> None:
            lo, hi = bounds[i], bounds[i + 1]
            self.fn(*[a[lo:hi] for a in arrays], *values, rows[i])
        if parts == 1:
            one(0)
        else:
            list(_workers().map(one, range(parts)))
        out = rows.sum(0)
        out[self._norm] = np.sqrt(out[self._norm])
        out[self._max] = rows[:, self._max].max(0)
        return out


def _workers() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(os.cpu_count() or 1, 1), thread_name_prefix="dynascope-fused")
        return _pool


def kernel_for(statistics: Sequence[Statistic], x: Chunk, wait: bool = False) -> FusedKernel | None:
    """The fused kernel of ``statistics`` for the inputs of chunk ``x``, or None when they cannot run fused
    (not all element-wise, an input that is not a host fp32/bf16 tensor, inputs of different dtypes) or
    while it compiles (in the background; ``wait`` compiles it now)."""
    key = _submit(statistics, x)
    if key is None:
        return None
    with _lock:
        got = _kernels[key]
    if isinstance(got, Future):
        if not (wait or got.done() or os.environ.get("DYNASCOPE_FUSED") == "sync"):
            return None
        try:
            got = got.result()
        except Exception as exc:  # a statistic numba cannot compile runs on chunk tensors for good
            warn(f"dynascope: fused statistics kernel not compiled ({type(exc).__name__}: {exc}); "
                 "these statistics run on chunk tensors, same values, slower", RuntimeWarning, stacklevel=2)
            got = None
        with _lock:
            _kernels[key] = got
    return got


def prepare(statistics: Sequence[Statistic], x: Chunk) -> None:
    """Start compiling (or loading from the cache) the kernel ``kernel_for`` will want for chunks like ``x``,
    on the compile thread, so that a run's first record finds it ready instead of running on chunk tensors."""
    _submit(statistics, x)


def _submit(statistics: Sequence[Statistic], x: Chunk) -> str | None:
    """The kernel's key, its build submitted if it was not yet; None where the statistics cannot run fused on
    ``x``'s inputs."""
    if not available() or any(s.element is None for s in statistics):
        return None
    inputs = dict.fromkeys(i for s in statistics for i in s.inputs)
    kinds = {i: _kind(getattr(x, i)) for i in inputs}
    if any(k is None for k in kinds.values()) or len({k for i, k in kinds.items() if i != "k_snapshot"}) > 1:
        return None
    copies = tuple((i, _kind(d)) for i, d in x.copies)
    if any(i not in kinds or k is None or (k == "f32" and kinds[i] != "f32") or not d.is_contiguous()
           for (i, k), (_, d) in zip(copies, x.copies, strict=True)):
        return None
    key = ("|".join(f"{s.name}" for s in statistics) + "|" + ",".join(f"{i}:{k}" for i, k in kinds.items())
           + "|" + ",".join(f"{i}>{k}" for i, k in copies))
    with _lock:
        if key not in _kernels:
            _kernels[key] = _compile_pool().submit(_build, tuple(statistics), kinds, copies)  # type: ignore[arg-type]
    return key


def wait_compiled() -> None:
    """Wait for every kernel being compiled (tests, benchmarks)."""
    for got in list(_kernels.values()):
        if isinstance(got, Future):
            got.exception()


def _compile_pool() -> ThreadPoolExecutor:
    global _compiler
    if _compiler is None:
        _compiler = ThreadPoolExecutor(1, thread_name_prefix="dynascope-compile")
    return _compiler


def _cache_dir() -> Path:
    for d in (os.environ.get("DYNASCOPE_CACHE"), os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                                os.path.expanduser("~/.cache"), "dynascope"),
              os.path.join(tempfile.gettempdir(), f"dynascope-{os.getuid() if hasattr(os, 'getuid') else 0}")):
        if not d:
            continue
        path = Path(d) / "kernels"
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise OSError("no writable cache directory for the fused kernels")


def _build(statistics: tuple[Statistic, ...], kinds: dict[str, str], copies: tuple[tuple[str, str], ...]) -> FusedKernel:
    name, text = module_text(statistics, kinds, copies)
    path = _cache_dir() / name
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # whole or absent, whichever process writes it
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    fk = FusedKernel(statistics, kinds, copies, mod.kernel, mod.kernel_many)
    _warm(fk)
    return fk


def _warm(fk: FusedKernel) -> None:
    """Compile (or load from the cache) the machine code for the types the kernel will be called with."""
    arrays: list[np.ndarray] = []
    for kind in fk.kinds.values():
        arrays += [np.zeros(1, np.float32), np.zeros(1, np.int32)] if kind == "f32" else [np.zeros(1, np.int16)]
    arrays += [np.zeros(1, np.float32 if kind == "f32" else np.int16) for _, kind in fk.copies]
    fk.fn(*arrays, *[np.float32(0)] * len(fk._scalars), np.zeros(len(fk.outputs)))
    fk.many(np.zeros((0, len(fk.kinds) + len(fk.copies)), np.int64), np.zeros(0, np.int64),
            np.zeros((0, len(fk._scalars)), np.float32), np.zeros((0, len(fk.outputs))))


# ---- what the element functions see as ``ops``, and the compiled form of the functions they call ------
def jitted(fn: Callable[..., Any]) -> Any:
    """``fn`` compiled inline by numba, with the plain functions it calls compiled the same way."""
    from numba import njit

    names = {n: fn.__globals__[n] for n in fn.__code__.co_names if isinstance(fn.__globals__.get(n), types.FunctionType)}
    if names:
        fn = types.FunctionType(fn.__code__, {**fn.__globals__, **{n: jitted(g) for n, g in names.items()}},
                                fn.__name__, fn.__defaults__, fn.__closure__)
    return njit(inline="always")(fn)


def _make_ops() -> types.ModuleType:
    from llvmlite import ir  # type: ignore[import-untyped]
    from numba import njit
    from numba import types as nt
    from numba.extending import intrinsic

    @intrinsic
    def bits(typingctx: Any, x: Any) -> Any:  # fp32 → its int32 bits
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], ir.IntType(32))
        return nt.int32(nt.float32), codegen

    @intrinsic
    def value(typingctx: Any, x: Any) -> Any:  # int32 bits → the fp32 value
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], ir.FloatType())
        return nt.float32(nt.int32), codegen

    def pointer(to: Any) -> Any:  # an address (int64) → a typed pointer, for ``carray`` (kernel_many)
        @intrinsic
        def ptr(typingctx: Any, addr: Any) -> Any:
            def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
                return builder.inttoptr(args[0], context.get_value_type(nt.CPointer(to)))
            return nt.CPointer(to)(nt.int64), codegen
        return ptr

    # The bf16 cast on the int32 bits, written in LLVM IR so that it stays 32-bit: in numba, int32 arithmetic
    # types as int64, and the loop vectorised over 64-bit lanes (half the elements per instruction). Its adds
    # cannot overflow except for a NaN pattern, whose result the select replaces.
    @intrinsic
    def key_f32(typingctx: Any, b: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            # PyTorch's fp32 → bf16: round to nearest even on the bits; a tensor's cast gives every NaN 0xFFFF.
            i32 = ir.IntType(32)
            x = context.cast(builder, args[0], signature.args[0], nt.int32)
            odd = builder.and_(builder.lshr(x, i32(16)), i32(1))
            r = builder.ashr(builder.add(builder.add(x, i32(0x7FFF)), odd), i32(16))
            nan = builder.icmp_signed(">", builder.and_(x, i32(0x7FFFFFFF)), i32(0x7F800000))
            return builder.select(nan, i32(-1), r)
        return nt.int32(b), codegen

    @intrinsic
    def bf16_value(typingctx: Any, key: Any) -> Any:  # a bf16 pattern (int32, its sign extended) → the fp32 value
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            key32 = context.cast(builder, args[0], signature.args[0], nt.int32)
            return builder.bitcast(builder.shl(key32, ir.IntType(32)(16)), ir.FloatType())
        return nt.float32(key), codegen

    @njit(inline="always")
    def bf16_round(x: Any) -> Any:
        return bf16_value(key_f32(bits(np.float32(x))))  # type: ignore[call-arg]

    mod = types.ModuleType("dynascope_fused_ops")
    mod.__dict__.update(bits=bits, value=value, key_f32=key_f32, bf16_value=bf16_value, bf16_round=bf16_round,
                        ptr_f32=pointer(nt.float32), ptr_i32=pointer(nt.int32), ptr_i16=pointer(nt.int16))
    return mod


def __getattr__(name: str) -> Any:  # OPS is built on first use: importing numba takes ~0.5 s
    if name == "OPS":
        with _lock:
            ops = globals().get("_OPS")
            if ops is None:
                ops = globals()["_OPS"] = _make_ops()
        return ops
    raise AttributeError(name)


def run_chunk(statistics: Sequence[Statistic], x: Chunk) -> Tensor | None:
    """float64 [len(outputs)] of one chunk by the fused kernel, or None where it cannot run (see ``kernel_for``)."""
    fk = kernel_for(statistics, x)
    if fk is None:
        return None
    import torch

    return torch.from_numpy(fk.run(x))
