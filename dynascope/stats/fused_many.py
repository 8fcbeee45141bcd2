"""Many tensors through one fused kernel call: the pass of a whole record without a Python loop per tensor.

``stats.fused`` compiles a pass's statistics into one loop over a chunk's elements; called once per tensor,
the Python around each call (readers, a ``Chunk``, the kernel's look-up, the partial results as tensors)
cost more than the loop itself on a model of a hundred small tensors: at full coverage on the reference
workload about half the weight pass and most of the gradient counts in the step. Here the segments of
many tensors (flat element ranges of each input, at most ``chunk_elems`` elements in all per call, so
streamed inputs such as θ₀ read from disk stay bounded as before) go to the kernel's ``kernel_many`` as
arrays of addresses and lengths, and each tensor's partial results are combined as its columns'
``reduce`` says (sums added, sums of squares added then rooted, maxima with NaN winning), as chunks are.

A tensor whose inputs cannot run fused (another dtype or device, a kernel still compiling) is left to the
caller (``Pass.run_many`` runs it alone).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from dynascope.stats.elementwise import reduces_of
from dynascope.stats.fused import MIN_SPLIT, FusedKernel, _workers, kernel_for, threads

if TYPE_CHECKING:
    from torch import Tensor

    from dynascope.stats.base import Settings, Statistic

__all__ = ["Item", "run_many"]

_ELEM = {"f32": 4, "bf16": 2}


class Item(NamedTuple):
    """One tensor of a pass: a reader per input (``(lo, hi)`` → flat elements), its element count, the
    values of its ``given`` columns, and (input, destination reader) pairs to copy into as it is read."""

    readers: dict[str, Callable[[int, int], Tensor]]
    numel: int
    given: dict[str, Any] | None = None
    copies: Sequence[tuple[str, Callable[[int, int], Tensor]]] = ()


class _Batch:
    """Segments waiting for one call of one kernel, and the tensors they point into (kept alive)."""

    def __init__(self, fk: FusedKernel) -> None:
        self.fk = fk
        self.ptrs: list[list[int]] = []
        self.lens: list[int] = []
        self.scalars: list[list[float]] = []
        self.items: list[int] = []
        self.keep: list[list[Tensor]] = []
        self.elems = 0
        self.sizes = [_ELEM[k] for k in fk.kinds.values()] + [_ELEM[k] for _, k in fk.copies]

    def add(self, item: int, tensors: list[Tensor], scalars: list[float]) -> None:
        n = tensors[0].numel()
        self.ptrs.append([t.data_ptr() for t in tensors])
        self.lens.append(n)
        self.scalars.append(scalars)
        self.items.append(item)
        self.keep.append(tensors)
        self.elems += n

    def run(self, sums: np.ndarray, maxima: np.ndarray) -> None:
        """One call (or one per thread, segments cut at equal element counts), results into ``sums``/``maxima``."""
        fk = self.fk
        ptrs = np.array(self.ptrs, dtype=np.int64).reshape(len(self.lens), len(self.sizes))
        lens = np.array(self.lens, dtype=np.int64)
        scal = np.array(self.scalars, dtype=np.float32).reshape(len(self.lens), -1)
        items = np.array(self.items, dtype=np.int64)
        parts = max(min(threads(), self.elems // MIN_SPLIT), 1)
        if parts > 1:
            ptrs, lens, scal, items, cuts = _split(ptrs, lens, scal, items, np.array(self.sizes), parts)
        out = np.zeros((len(lens), len(fk.outputs)))
        if parts == 1:
            fk.many(ptrs, lens, scal, out)
        else:
            def one(j: int) -> None:
                lo, hi = cuts[j], cuts[j + 1]
                fk.many(ptrs[lo:hi], lens[lo:hi], scal[lo:hi], out[lo:hi])
            list(_workers().map(one, range(parts)))
        is_max = fk._max
        np.add.at(sums, items, np.where(is_max, 0.0, out))
        np.maximum.at(maxima, items, np.where(is_max, out, 0.0))
        self.ptrs, self.lens, self.scalars, self.items, self.keep, self.elems = [], [], [], [], [], 0


def _split(ptrs: np.ndarray, lens: np.ndarray, scal: np.ndarray, items: np.ndarray, sizes: np.ndarray,
           parts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """The segments cut at ``parts`` equal element counts: (ptrs, lens, scalars, items, first row of each part)."""
    ends = np.cumsum(lens)
    starts = ends - lens
    bounds = [int(ends[-1]) * j // parts for j in range(parts + 1)]
    seg, lo, hi, cuts = [], [], [], [0]
    for a, b in zip(bounds, bounds[1:], strict=False):  # the segments overlapping [a, b), clipped to it
        s = np.arange(np.searchsorted(ends, a, "right"), np.searchsorted(starts, b, "left"))
        s_lo, s_hi = np.maximum(starts[s], a), np.minimum(ends[s], b)
        keep = s_hi > s_lo
        seg.append(s[keep])
        lo.append(s_lo[keep] - starts[s[keep]])
        hi.append(s_hi[keep] - starts[s[keep]])
        cuts.append(cuts[-1] + int(keep.sum()))
    idx, off, end = np.concatenate(seg), np.concatenate(lo), np.concatenate(hi)
    return ptrs[idx] + off[:, None] * sizes[None, :], end - off, scal[idx], items[idx], cuts


def run_many(statistics: Sequence[Statistic], inputs: Sequence[str], items: Sequence[Item], settings: Settings,
             chunk_elems: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(float64 [len(items), len(outputs)], bool [len(items)]): each item's results by the fused kernels, and
    which items ran (the others cannot run fused: the caller runs them one at a time)."""
    from dynascope.stats.base import Chunk
    from dynascope.stats.engine import chunk_ranges

    n_out = sum(len(s.outputs) for s in statistics)
    sums, maxima = np.zeros((len(items), n_out)), np.zeros((len(items), n_out))
    done = np.zeros(len(items), dtype=bool)
    batches: dict[int, _Batch] = {}
    kernels: dict[tuple, FusedKernel | None] = {}
    limit = chunk_elems or (1 << 62)
    for k, it in enumerate(items):
        batch = None
        scalars: list[float] = []
        for lo, hi in chunk_ranges(it.numel, chunk_elems):
            tensors = [it.readers[name](lo, hi) for name in inputs] + [dest(lo, hi) for _, dest in it.copies]
            if batch is None:
                sig = tuple((t.dtype, t.device.type, t.is_contiguous()) for t in tensors)
                if sig not in kernels:
                    x = _chunk(Chunk(it.numel, settings, it.given), inputs, tensors, it.copies)
                    kernels[sig] = got = kernel_for(statistics, x)
                    if got is None:  # not compiled yet (ask again next time) or never fused (this signature)
                        kernels.pop(sig)
                fk = kernels.get(sig)
                if fk is None or fk.many is None or not all(t.is_contiguous() for t in tensors):
                    break
                scalars = _scalars(fk, _chunk(Chunk(it.numel, settings, it.given), inputs, tensors, it.copies))
                batch = batches.get(id(fk))
                if batch is None:
                    batch = batches[id(fk)] = _Batch(fk)
                done[k] = True
            if batch.elems and batch.elems + (hi - lo) > limit:
                batch.run(sums, maxima)
            batch.add(k, tensors, scalars)
    for batch in batches.values():
        if batch.lens:
            batch.run(sums, maxima)
    how = np.array(reduces_of(tuple(c for s in statistics for c in s.outputs)))
    out = np.where(how == "max", maxima, sums)
    out[:, how == "norm"] = np.sqrt(out[:, how == "norm"])
    return out, done


def _chunk(x: Any, inputs: Sequence[str], tensors: list[Tensor], copies: Sequence[tuple[str, Any]]) -> Any:
    for name, t in zip(inputs, tensors, strict=False):
        x.set(name, t)
    x.copies = [(name, t) for (name, _), t in zip(copies, tensors[len(inputs):], strict=True)]
    return x


def _scalars(fk: FusedKernel, x: Any) -> list[float]:
    """The kernel's per-tensor scalars (η, a threshold), as ``FusedKernel.run`` passes them (fp32)."""
    values: dict[str, Any] = {}
    for s in fk.statistics:
        if s.scalars is not None:
            values.update(s.scalars(x))
    return [float(np.float32(float(values[n]))) for n in fk._scalars]
