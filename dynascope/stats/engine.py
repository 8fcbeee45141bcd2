"""The engine: declared statistics over flat chunks of one tensor's inputs, partial results combined.

Statistics that read the same inputs form a ``Pass``: each chunk of those inputs is read once and every
kernel of the pass runs on it, one after another, so one kernel's temporaries are freed before the next
one's and all are bounded by the chunk, not by the tensor (``transient_bytes`` gives the bound the
memory budget reserves). A chunk's partial results (sums, sums of squares, maxima) combine as their
columns' ``reduce`` says, so any chunking, like any sharding, gives the whole tensor's value.

Where the inputs come from is the caller's business: the live probe reads the tracked parameters, its
pre-step snapshot, θ₀ streamed from disk and the S_k snapshot; ``dynascope diff`` reads checkpoints.
Both hand the engine one ``Reader`` per input, ``read(lo, hi)`` → the tensor's flat elements [lo, hi).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from dynascope.stats.base import DEFAULT_CHUNK_ELEMS, Chunk, Settings, Statistic
from dynascope.stats.fused import prepare, run_chunk
from dynascope.stats.fused_many import Item, run_many
from dynascope.stats.registry import REGISTRY

__all__ = ["DEFAULT_CHUNK_ELEMS", "DRIFT_STATS", "DRIFT_STAT_COLUMNS", "UPDATE_STATS", "UPDATE_STAT_COLUMNS",
           "Pass", "Reader", "chunk_ranges", "chunk_rows", "compute", "flat_reader", "outputs_of",
           "passes", "per_tensor", "transient_bytes", "weight_drift_stats", "weight_update_stats",
           "whole_tensor_values"]

Reader = Callable[[int, int], Tensor]  # (lo, hi) -> the tensor's flat elements [lo, hi)


def chunk_ranges(numel: int, chunk_elems: int | None) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` ranges covering ``numel`` elements, ``chunk_elems`` at a time (at least one range)."""
    step = max(int(chunk_elems or numel), 1)
    lo = 0
    while True:
        hi = min(lo + step, numel)
        yield lo, hi
        lo = hi
        if lo >= numel:
            return


def chunk_rows(n_chunks: int, n_cols: int, device: torch.device | str) -> Tensor:
    """float64 [n_chunks, 1 + n_cols]: one row per chunk for its partial results (column 0 holds the
    float64 zero each row is stacked after, for exact promotion), allocated before the chunk loop.

    Why not a list of 0-d results: each chunk's few small results would outlive its large temporaries,
    and glibc carves such small blocks out of the holes those temporaries leave, so the next chunk's
    temporaries no longer fit the holes and extend the heap. A 2 MiB tensor in 14k-element chunks
    left 2-9 MiB of free but resident heap behind this way (about one run in two), for the rest of the run.
    """
    return torch.empty((n_chunks, 1 + n_cols), dtype=torch.float64, device=device)


def outputs_of(statistics: Iterable[Statistic]) -> tuple[str, ...]:
    """The partial results (column names) a pass of ``statistics`` returns, in order."""
    return tuple(c for s in statistics for c in s.outputs)


def transient_bytes(chunk_elems: int, element_size: int = 4, statistics: Iterable[Statistic] | None = None) -> int:
    """Upper bound of the temporaries one chunk of ``statistics`` (default: every declared one) allocates:
    their kernels run one at a time on a chunk, so the largest one's."""
    stats = REGISTRY.statistics if statistics is None else statistics
    return max((s.transient_bytes(chunk_elems, element_size) for s in stats if s.kernel is not None), default=0)


class Pass:
    """Statistics that read the same inputs, run together over each chunk of one tensor (or, batched,
    over a list of whole tensors)."""

    def __init__(self, statistics: Sequence[Statistic]) -> None:
        self.statistics = tuple(statistics)
        first = self.statistics[0]
        self.tier, self.batched = first.tier, first.batched is not None and first.tier != "window"
        self.inputs = tuple(dict.fromkeys(i for s in self.statistics for i in s.inputs))
        self.given = tuple(dict.fromkeys(g for s in self.statistics for g in s.given))
        self.outputs = outputs_of(self.statistics)
        self.element_wise = all(s.element is not None for s in self.statistics)
        self.key = f"{self.tier}:{','.join(self.inputs)}"
        reduce = [REGISTRY.column[c].reduce for c in self.outputs]
        self._norm, self._max = [r == "norm" for r in reduce], [r == "max" for r in reduce]
        self._masks: dict[torch.device, tuple[Tensor, Tensor | None]] = {}

    def __repr__(self) -> str:
        return f"Pass({self.key}: {', '.join(s.name for s in self.statistics)})"

    def run_batched(self, tensors: list[Tensor]) -> Tensor:
        """float64 [len(tensors), len(outputs)] for whole tensors of the one input (the "every" and
        "cadence" tiers: one fused pass over every tensor)."""
        parts = [s.batched(tensors) for s in self.statistics]  # type: ignore[misc]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def prepare(self, dtypes: dict[str, torch.dtype], copies: Sequence[tuple[str, torch.dtype]] = ()) -> None:
        """Start loading the fused kernel this pass will use for host inputs of ``dtypes`` (and copies into
        destinations of those dtypes) in the background (``stats.fused.prepare``); nothing where it runs unfused."""
        if not self.element_wise:
            return
        x = Chunk(1, Settings())
        for name in self.inputs:
            x.set(name, torch.zeros(1, dtype=dtypes[name]))
        x.copies = [(name, torch.zeros(1, dtype=d)) for name, d in copies]
        prepare(self.statistics, x)

    def run(self, readers: dict[str, Reader], numel: int, device: torch.device, settings: Settings = Settings(), *,
            given: dict[str, Tensor] | None = None, chunk_elems: int | None = DEFAULT_CHUNK_ELEMS,
            copies: Sequence[tuple[str, Reader]] = ()) -> Tensor:
        """float64 [len(outputs)] for one tensor of ``numel`` elements, ``chunk_elems`` at a time, its inputs
        given as readers of flat ranges (so θ₀ can be streamed from disk chunk by chunk). ``copies``: (input,
        destination) pairs, the destination a reader of flat ranges of a tensor the input's elements are
        copied (or cast) into as they are read (after the statistics read a chunk, so a destination may be
        the memory of another input, element for element)."""
        ranges = list(chunk_ranges(numel, chunk_elems))
        m = chunk_rows(len(ranges), len(self.outputs), device)
        zero = torch.zeros((), dtype=torch.float64, device=device)  # float64 first: stacking promotes exactly
        x = Chunk(numel, settings, given)
        for j, (lo, hi) in enumerate(ranges):
            for name in self.inputs:
                x.set(name, readers[name](lo, hi))
            x.copies = [(name, dest(lo, hi)) for name, dest in copies]
            fused = run_chunk(self.statistics, x) if self.element_wise else None
            if fused is not None:  # every statistic in one loop over the chunk's elements (stats.fused)
                m[j, 0] = 0.0
                m[j, 1:] = fused
                continue
            parts = [zero]
            for s in self.statistics:  # one kernel at a time: its temporaries are freed before the next one's
                parts += s.kernel(x)  # type: ignore[misc]
            torch.stack(parts, out=m[j])
            del parts
            for name, dest in x.copies:
                dest.copy_(getattr(x, name))
            for name in self.inputs:  # this chunk's inputs go before the next one's are read
                x.set(name, None)
        m = m[:, 1:]
        is_norm, is_max = self._mask(device)
        out = torch.where(is_norm, m.square().sum(0).sqrt(), m.sum(0))
        return out if is_max is None else torch.where(is_max, m.amax(0), out)

    def run_many(self, items: Sequence[Item], settings: Settings = Settings(), *,
                 chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
        """float64 [len(items), len(outputs)]: ``run`` of each tensor (``stats.fused_many.Item``: its readers,
        numel, given values and copies). Host tensors that run fused go through one kernel call per
        ``chunk_elems`` elements of all of them (``stats.fused_many``); the rest run one at a time."""
        if not items:
            return torch.zeros((0, len(self.outputs)), dtype=torch.float64)
        res, done = run_many(self.statistics, self.inputs, items, settings, chunk_elems) if self.element_wise else (
            None, [False] * len(items))
        if all(done):
            return torch.from_numpy(res)
        rows = []
        for k, it in enumerate(items):
            if done[k]:
                rows.append(torch.from_numpy(res[k]))  # type: ignore[index]
                continue
            device = it.readers[self.inputs[0]](0, 0).device
            rows.append(self.run(it.readers, it.numel, device, settings, given=it.given, chunk_elems=chunk_elems,
                                 copies=it.copies))
        return torch.stack([r.to(rows[-1].device) for r in rows])

    def _mask(self, device: torch.device) -> tuple[Tensor, Tensor | None]:
        masks = self._masks.get(device)
        if masks is None:  # once per device: a host→device copy per tensor would sync on CUDA
            masks = self._masks[device] = (torch.tensor(self._norm, device=device),
                                           torch.tensor(self._max, device=device) if any(self._max) else None)
        return masks


def passes(statistics: Iterable[Statistic]) -> list[Pass]:
    """``statistics`` grouped into passes: those of one tier that read the same inputs, in declaration order."""
    groups: dict[tuple, list[Statistic]] = {}
    for s in statistics:
        if s.kernel is None and s.batched is None:
            continue
        groups.setdefault((s.tier, frozenset(s.inputs), s.batched is not None and s.tier != "window"), []).append(s)
    return [Pass(g) for g in groups.values()]


def compute(statistics: Sequence[Statistic] | Pass, tensors: dict[str, Tensor], settings: Settings = Settings(), *,
            given: dict[str, Tensor] | None = None, chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
    """float64 [len(outputs)] of one tensor's whole inputs (``{"new": w, "old": w_prev}``), chunk by chunk."""
    p = statistics if isinstance(statistics, Pass) else Pass(statistics)
    flat = {name: tensors[name].detach().reshape(-1) for name in p.inputs}
    shapes = {tuple(tensors[name].shape) for name in p.inputs}
    if len(shapes) > 1:
        raise ValueError(f"statistics {[s.name for s in p.statistics]}: inputs of shapes {sorted(shapes)}")
    first = flat[p.inputs[0]]
    readers = {name: flat_reader(f) for name, f in flat.items()}
    return p.run(readers, first.numel(), first.device, settings, given=given, chunk_elems=chunk_elems)


def flat_reader(t: Tensor) -> Reader:
    """A reader of ``t``'s flat elements (views, no copy)."""
    flat = t.reshape(-1)
    return lambda lo, hi: flat[lo:hi]


def per_tensor(statistics: Sequence[Statistic], tensors: dict[str, list[Tensor]], settings: Settings = Settings(), *,
               given: dict[str, Tensor] | None = None, chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
    """float64 [n, len(outputs)]: ``compute`` for n tensors given per input as lists of equal length;
    ``given`` holds float64 [n] per given column."""
    p = Pass(statistics)
    lists = [tensors[name] for name in p.inputs]
    n = len(lists[0])
    if any(len(lst) != n for lst in lists):
        raise ValueError(f"statistics {[s.name for s in p.statistics]}: {[len(lst) for lst in lists]} tensors per input")
    if n == 0:
        return torch.zeros((0, len(p.outputs)), dtype=torch.float64)
    with torch.no_grad():
        return torch.stack([compute(p, {name: lst[i] for name, lst in zip(p.inputs, lists, strict=True)}, settings,
                                    given={k: v[i] for k, v in (given or {}).items()}, chunk_elems=chunk_elems)
                            for i in range(n)])


def whole_tensor_values(tensors: dict[str, Tensor], settings: Settings = Settings(),
                        statistics: Iterable[Statistic] | None = None, *,
                        chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> dict[str, float]:
    """Every declared statistic (default: the registry's) whose inputs are all in ``tensors`` — one tensor's
    whole inputs, e.g. from checkpoints — as {output name: value}, chunk by chunk. A statistic whose outputs
    another one here gives as well (‖W‖, which the update's pass gives) is left out; one that is ``given``
    a value runs after the pass that computes it."""
    stats = [s for s in (REGISTRY.statistics if statistics is None else statistics)
             if s.kernel is not None and set(s.inputs) <= set(tensors)]
    stats = [s for s in stats if not any(t is not s and set(s.outputs) < set(t.outputs) for t in stats)]
    groups: dict[tuple[bool, frozenset[str]], list[Statistic]] = {}
    for s in sorted(stats, key=lambda s: bool(s.given)):
        groups.setdefault((bool(s.given), frozenset(s.inputs)), []).append(s)
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for group in groups.values():
            p = Pass(group)
            res = compute(p, {name: tensors[name] for name in p.inputs}, settings,
                          given={g: out[g] for g in p.given}, chunk_elems=chunk_elems)
            out.update(zip(p.outputs, res.unbind(), strict=True))
    return dict(zip(out, torch.stack(list(out.values())).tolist(), strict=True)) if out else {}


# The statistics of a pair of weight tensors, as public functions (tests, benchmarks, users' own loops).
UPDATE_STATS = REGISTRY.reading("new", "old")
DRIFT_STATS = REGISTRY.reading("ref", "new")
UPDATE_STAT_COLUMNS = outputs_of(UPDATE_STATS)
DRIFT_STAT_COLUMNS = outputs_of(DRIFT_STATS)


def weight_update_stats(new: list[Tensor], old: list[Tensor], eta: float = 1e-3, *,
                        chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
    """Per-tensor statistics of the update ``new − old``: float64 [n, len(UPDATE_STAT_COLUMNS)] on device.

    ``old`` is the earlier weights (same shapes). Counts are exact integers held in float64;
    ``changed_count`` is NaN (unknown) when the two dtypes differ, since a bit-exact comparison is then
    undefined. Temporaries are bounded by ``transient_bytes(chunk_elems)``. Nothing is copied to the host.
    """
    return per_tensor(UPDATE_STATS, {"new": new, "old": old}, Settings(eta=eta), chunk_elems=chunk_elems)


def weight_drift_stats(current: list[Tensor], base: list[Tensor], eta: float = 1e-3, *,
                       chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
    """Per-tensor drift of ``current`` from ``base`` (θ₀): float64 [n, len(DRIFT_STAT_COLUMNS)] on device."""
    return per_tensor(DRIFT_STATS, {"ref": base, "new": current}, Settings(eta=eta), chunk_elems=chunk_elems)
