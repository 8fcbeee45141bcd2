"""The source of a fused kernel: one generated module per pass of statistics, per input dtypes and copies.

``kernel(...)`` is one pass over a chunk's elements, in blocks (a loop of counts and maxima, one of float64
sums, one of copies per block), with every element function inlined and one accumulator per output; ``kernel_many(ptrs, lens, scalars, out)`` runs it over segments of many tensors given as
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

VERSION = "4"  # of the generated code and of the ops in stats.fused: part of every kernel's hash
BLOCK = 4096  # elements per block: its inputs stay in cache across the block's loops (and fit int32 counts)


def views(s: Statistic) -> set[str]:
    """The element function's arguments that are views of inputs (the rest are scalars)."""
    names: set[str] = set()
    for i in s.inputs:
        names.update((i, f"{i}_bits", f"{i}_key"))
    return names


def _source(statistics: Sequence[Statistic], kinds: dict[str, str], copies: tuple[tuple[str, str], ...]) -> str:
    """The kernel's source: loops over blocks of the elements, each element function inlined, one accumulator
    per output (int64 counts, float64 sums of squares, the maximum of a non-negative fp32 term as its int32
    bits, which order as the values do with NaN above +Inf, so the maximum vectorises and NaN wins).

    Each block runs up to three loops, so that LLVM vectorises each over as many elements as a register
    holds: LLVM picks a loop's vector width from its widest type, so one loop with float64 sums ran 8 lanes
    where the 32-bit work could run 16 (AVX-512). The first loop counts, into int32 counters per block
    (a block's count cannot overflow them; added to int64 after the block), and takes the maxima; the
    second sums the float64 terms; the third copies. Each loop calls only the element functions that feed
    it, and LLVM drops the terms a loop does not use. The block's inputs stay in cache between its loops,
    and an input is read before its memory is written (a copy may overwrite an input: the next snapshot
    over this one), so the statistics' loops store nothing: one loop that also stored could write where it
    reads, and LLVM's vectorised loop came with a check for overlap which, the arena's copy overlapping
    the snapshot exactly, ran the scalar loop instead: ~6x slower (docs/benchmarks.md)."""
    from dynascope.stats.registry import REGISTRY

    args: list[str] = []
    for name, kind in kinds.items():
        args += [f"{name}_v", f"{name}_b"] if kind == "f32" else [f"{name}_b"]
    args += [f"dest{m}" for m in range(len(copies))]
    lines = ["def kernel(" + ", ".join(args + [f"s{j}_{n}" for j, s in enumerate(statistics)
                                               for n in arguments(s.element) if n not in views(s)]  # type: ignore[arg-type]
                                      + ["out"]) + "):",
             f"    n = {args[0]}.shape[0]"]
    how: dict[str, str] = {}  # accumulator → "count", "max" or "sum" (float64)
    for j, s in enumerate(statistics):
        for k, c in enumerate(s.outputs):
            col = REGISTRY.column[c]
            how[f"a{j}_{k}"] = "max" if col.reduce == "max" else "count" if col.integer else "sum"
    for acc, h in how.items():
        lines.append(f"    {acc} = " + ("np.int32(0)" if h == "max" else "0" if h == "count" else "0.0"))
    lines += [f"    for b0 in range(0, n, {BLOCK}):", f"        b1 = min(b0 + {BLOCK}, n)"]
    # Views of the block, indexed from 0 by range(len): known >= 0, so no wraparound (range(b0, b1) on the
    # whole arrays was 5x slower).
    lines += [f"        {a}_blk = {a}[b0:b1]" for a in args]
    lines += [f"        c{acc[1:]} = np.int32(0)" for acc, h in how.items() if h == "count"]
    for part in (("count", "max"), ("sum",)):
        used = [j for j in range(len(statistics)) if any(how[f"a{j}_{k}"] in part
                                                         for k in range(len(statistics[j].outputs)))]
        if not used:
            continue
        lines.append(f"        for i in range({args[0]}_blk.shape[0]):")
        pad = "            "
        for name, kind in kinds.items():
            if kind == "f32":
                lines += [f"{pad}{name} = {name}_v_blk[i]", f"{pad}{name}_bits = {name}_b_blk[i]",
                          f"{pad}{name}_key = ops.key_f32({name}_bits)"]
            else:
                lines += [f"{pad}{name}_bits = {name}_b_blk[i]", f"{pad}{name}_key = np.int32({name}_bits)",
                          f"{pad}{name} = ops.bf16_value({name}_key)"]
        for j in used:
            s = statistics[j]
            call = ", ".join(n if n in views(s) else f"s{j}_{n}" for n in arguments(s.element))  # type: ignore[arg-type]
            lines.append(f"{pad}t{j} = e{j}(ops, {call})")
            for k in range(len(s.outputs)):
                acc, h = f"a{j}_{k}", how[f"a{j}_{k}"]
                if h not in part:
                    continue
                # int32 + bool types as int64 in numba: the cast back keeps the counter (and the loop) 32-bit
                lines.append(f"{pad}{acc} = max({acc}, ops.bits(t{j}[{k}]))" if h == "max" else
                             f"{pad}c{acc[1:]} = np.int32(c{acc[1:]} + t{j}[{k}])" if h == "count" else
                             f"{pad}{acc} += np.float64(t{j}[{k}])")
    if copies:
        lines.append(f"        for i in range({args[0]}_blk.shape[0]):")
    for m, (name, kind) in enumerate(copies):
        lines.append(f"            dest{m}_blk[i] = {name}_v_blk[i]" if kind == "f32" else
                     f"            dest{m}_blk[i] = np.int16(ops.key_f32({name}_b_blk[i]))" if kinds[name] == "f32" else
                     f"            dest{m}_blk[i] = {name}_b_blk[i]")
    lines += [f"        {acc} += c{acc[1:]}" for acc, h in how.items() if h == "count"]
    for i, (acc, h) in enumerate(how.items()):
        lines.append(f"    out[{i}] = ops.value({acc})" if h == "max" else f"    out[{i}] = {acc}")
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
