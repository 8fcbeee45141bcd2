"""The source of a fused kernel: one generated module per pass of statistics, per input dtypes and copies.

``kernel(...)`` is one loop over a chunk's elements with every element function inlined and one accumulator
per output; ``kernel_many(ptrs, lens, scalars, out)`` runs it over segments of many tensors given as
addresses (``stats.fused_many``). The module is named by a hash of its text and of every element function's
code (and ``VERSION``), so a change to any of them compiles a new kernel (``stats.fused``).
"""

from __future__ import annotations

import hashlib
import inspect
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dynascope.stats.elementwise import arguments

if TYPE_CHECKING:
    from dynascope.stats.base import Statistic

__all__ = ["VERSION", "module_text", "views"]

VERSION = "3"  # of the generated code and of the ops in stats.fused: part of every kernel's hash
BLOCK = 4096  # elements per block of a kernel with copies (its inputs' block stays in cache for the copies)


def views(s: Statistic) -> set[str]:
    """The element function's arguments that are views of inputs (the rest are scalars)."""
    names: set[str] = set()
    for i in s.inputs:
        names.update((i, f"{i}_bits", f"{i}_key"))
    return names


def _source(statistics: Sequence[Statistic], kinds: dict[str, str], copies: tuple[tuple[str, str], ...]) -> str:
    """The kernel's source: one loop over the elements, each element function inlined, one accumulator
    per output (int64 counts, float64 sums of squares, the maximum of a non-negative fp32 term as its
    int32 bits, which order as the values do with NaN above +Inf, so the maximum vectorises and NaN wins)."""
    from dynascope.stats.registry import REGISTRY

    args: list[str] = []
    for name, kind in kinds.items():
        args += [f"{name}_v", f"{name}_b"] if kind == "f32" else [f"{name}_b"]
    args += [f"dest{m}" for m in range(len(copies))]
    lines = ["def kernel(" + ", ".join(args + [f"s{j}_{n}" for j, s in enumerate(statistics)
                                               for n in arguments(s.element) if n not in views(s)]  # type: ignore[arg-type]
                                      + ["out"]) + "):",
             f"    n = {args[0]}.shape[0]"]
    accs: list[tuple[str, str]] = []
    for j, s in enumerate(statistics):
        for k, c in enumerate(s.outputs):
            how = REGISTRY.column[c].reduce
            init = "np.int32(0)" if how == "max" else "0" if REGISTRY.column[c].integer else "0.0"
            accs.append((f"a{j}_{k}", how or "sum"))
            lines.append(f"    a{j}_{k} = {init}")
    # With copies, the loop runs over blocks of BLOCK elements: the statistics of a block first, then its
    # copies, so an input is read before its memory is written (a copy may overwrite an input: the next
    # snapshot over this one) and the statistics' loop stores nothing. One loop that also stored could write
    # where it reads, so LLVM's vectorised loop came with a check for overlap and, the arena's copy
    # overlapping the snapshot exactly, ran the scalar loop instead: ~6x slower (docs/benchmarks.md).
    pad, x = ("            ", "_blk") if copies else ("        ", "")  # in blocks: loops over views of each block
    if copies:
        arrays = [a for a in args if not a.startswith("dest")] + [f"dest{m}" for m in range(len(copies))]
        lines += [f"    for b0 in range(0, n, {BLOCK}):", f"        b1 = min(b0 + {BLOCK}, n)"]
        lines += [f"        {a}{x} = {a}[b0:b1]" for a in arrays]
        lines.append(f"        for i in range({args[0]}{x}.shape[0]):")  # range(n): known >= 0, no wraparound
    else:
        lines.append("    for i in range(n):")
    for name, kind in kinds.items():
        if kind == "f32":
            lines += [f"{pad}{name} = {name}_v{x}[i]", f"{pad}{name}_bits = {name}_b{x}[i]",
                      f"{pad}{name}_key = ops.key_f32({name}_bits)"]
        else:
            lines += [f"{pad}{name}_bits = {name}_b{x}[i]", f"{pad}{name}_key = np.int32({name}_bits)",
                      f"{pad}{name} = ops.bf16_value({name}_key)"]
    for j, s in enumerate(statistics):
        call = ", ".join(n if n in views(s) else f"s{j}_{n}" for n in arguments(s.element))  # type: ignore[arg-type]
        lines.append(f"{pad}t{j} = e{j}(ops, {call})")
        for k, c in enumerate(s.outputs):
            how = REGISTRY.column[c].reduce
            acc = f"a{j}_{k}"
            lines.append(f"{pad}{acc} = max({acc}, ops.bits(t{j}[{k}]))" if how == "max" else
                         f"{pad}{acc} += t{j}[{k}]" if REGISTRY.column[c].integer else
                         f"{pad}{acc} += np.float64(t{j}[{k}])")
    if copies:
        lines.append(f"        for i in range({args[0]}{x}.shape[0]):")
    for m, (name, kind) in enumerate(copies):
        lines.append(f"            dest{m}{x}[i] = {name}_v{x}[i]" if kind == "f32" else
                     f"            dest{m}{x}[i] = np.int16(ops.key_f32({name}_b{x}[i]))" if kinds[name] == "f32" else
                     f"            dest{m}{x}[i] = {name}_b{x}[i]")
    for i, (acc, how) in enumerate(accs):
        lines.append(f"    out[{i}] = ops.value({acc})" if how == "max" else f"    out[{i}] = {acc}")
    return "\n".join(lines) + "\n"


def _many_source(statistics: Sequence[Statistic], kinds: dict[str, str], copies: tuple[tuple[str, str], ...]) -> str:
    """``kernel_many(ptrs, lens, scalars, out)``: ``kernel`` over segments of many tensors in one call, segment s
    being ``lens[s]`` elements at the addresses ``ptrs[s]`` (one per input, then per copy), its scalars
    ``scalars[s]`` and its partial results ``out[s]`` (``stats.fused_many``)."""
    arrays: list[str] = []
    for m, kind in enumerate([*kinds.values(), *(k for _, k in copies)]):
        arrays += ([f"carray(ops.ptr_f32(p[{m}]), n)"] + ([f"carray(ops.ptr_i32(p[{m}]), n)"] if m < len(kinds) else [])
                  if kind == "f32" else [f"carray(ops.ptr_i16(p[{m}]), n)"])
    n_scalars = len([a for s in statistics for a in arguments(s.element) if a not in views(s)])  # type: ignore[arg-type]
    return ("@njit(nogil=True, cache=True)\ndef kernel_many(ptrs, lens, scalars, out):\n"
            "    for s in range(lens.shape[0]):\n        n = lens[s]\n        p = ptrs[s]\n"
            f"        kernel({', '.join(arrays + [f'scalars[s, {j}]' for j in range(n_scalars)])}, out[s])\n")


def module_text(statistics: Sequence[Statistic], kinds: dict[str, str],
                 copies: tuple[tuple[str, str], ...]) -> tuple[str, str]:
    """(file name, text) of the generated module, named by the hash of everything the kernel inlines."""
    body = _source(statistics, kinds, copies)
    head = ["import numpy as np", "from numba import carray, njit", "from dynascope.stats.fused import jitted, OPS as ops"]
    for j, s in enumerate(statistics):
        fn = s.element
        head.append(f"from {fn.__module__} import {fn.__qualname__} as _e{j}")  # type: ignore[union-attr]
        head.append(f"e{j} = jitted(_e{j})")
    text = ("\n".join(head) + "\n\n\n@njit(nogil=True, cache=True, fastmath={'reassoc', 'contract'})\n" + body
            + "\n\n" + _many_source(statistics, kinds, copies))
    digest = hashlib.sha256((VERSION + text + "".join(_code_of(s.element) for s in statistics)).encode()).hexdigest()
    return f"dynascope_fused_{digest[:24]}.py", text


def _code_of(fn: Any) -> str:
    """An element function's source and that of the plain functions it calls (their change means a new hash)."""
    out = inspect.getsource(fn)
    for name in fn.__code__.co_names:
        g = fn.__globals__.get(name)
        if isinstance(g, types.FunctionType):
            out += _code_of(g)
    return out
