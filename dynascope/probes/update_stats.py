"""Weight and step-update statistics: ‖W‖, ‖ΔW‖, changed fractions, sign flips (two-step probe).

The maths is per flat chunk of a pair of tensors, in ``ChunkStat`` families whose outputs are named by
their ``tensor_stats`` columns; ``chunked_stats`` runs a tuple of families over the chunks and combines
the partial results. The checkpoint diff calls the same functions on two checkpoints as the live probe
calls on the pre-step snapshot and the post-step weights, so both report the same numbers.
``UpdateStats`` is the thin two-step wrapper: ``before`` snapshots, ``after`` computes.

Changed fractions, three ways:
* bit-exact: the element's bits differ in the parameter's own dtype (an update smaller than half an
  ulp is rounded away and does not count — the quantity low-precision training actually sees);
* relative (``changed_rel``, "The Path Not Taken", 2025): |ŵ − w| > η·max(|w|, |ŵ|), η = 1e-3, a change
  of at least 0.1% of the weight, whatever the master dtype (not a bf16 cast: that is the next one);
* bf16-bitwise (PULSE S₁, ``bf16_visibility``): the bf16 casts are bitwise identical before and after.
Drift against θ₀ uses the first family under drift names, plus Mukherjee et al.'s bf16 update
sparsity (``drift_sparsity``).

Every statistic is a sum (of squares, or of counts) over elements, so tensors are processed in flat
chunks of ``chunk_elems`` elements: the temporaries (ΔW in fp32, |W|, masks) are bounded by the chunk,
not by the largest tensor (``transient_bytes`` gives the bound the probe's memory budget reserves).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from dynascope.probes.bf16_visibility import bf16_unchanged_count
from dynascope.probes.drift_sparsity import drift_sparsity_counts

__all__ = ["BF16_K_STATS", "DEFAULT_CHUNK_ELEMS", "DRIFT_STATS", "DRIFT_STAT_COLUMNS", "UPDATE_STATS", "UPDATE_STAT_COLUMNS",
           "ChunkStat", "Reader", "SnapshotArena", "UpdateStats", "chunk_ranges", "chunk_rows", "chunked_stats", "columns_of",
           "norms", "tensor_update_stats", "transient_bytes", "weight_drift_stats", "weight_update_stats", "wide"]

# Without a budget: 4M elements, i.e. temporaries of at most ~100 MB whatever the tensor's size.
DEFAULT_CHUNK_ELEMS = 1 << 22

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ChunkStat(NamedTuple):
    """One family of per-chunk statistics of a pair (new, old): ``fn(a, b, eta)`` returns one 0-d partial
    per name in ``columns``; ``combine`` says how partials of chunks combine ("norm": root of the summed
    squares, "sum": a sum). ``columns`` are ``tensor_stats`` column names (``ref_norm``: ‖θ₀‖, kept only
    for ``drift_ratio``)."""

    fn: Callable[[Tensor, Tensor, float], list[Tensor]]
    columns: tuple[str, ...]
    combine: tuple[str, ...]


def wide(t: Tensor) -> Tensor:
    """``t`` in a dtype wide enough to difference and accumulate (fp32 for 16-bit floats)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def transient_bytes(chunk_elems: int, element_size: int = 4) -> int:
    """Upper bound of the temporaries one chunk of the update, drift or gradient statistics allocates:
    at most five wide (≥ fp32) buffers of the chunk alive at once (ΔW, the scale, |new|, and the
    widened copies of 16-bit inputs, or θ₀'s chunk read from disk) plus two boolean masks. The bf16
    families need less (two bf16 casts, a bf16 Δ and masks) and run after the others' are freed."""
    return chunk_elems * (5 * max(4, element_size) + 2)


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


def _square_norm(t: Tensor) -> Tensor:
    """‖t‖² of an fp32 host tensor: a BLAS dot when it is contiguous (see ``norms``)."""
    if not t.is_contiguous():
        return torch.linalg.vector_norm(t).square()
    flat = t.view(-1)
    return torch.dot(flat, flat)


def norms(tensors: list[Tensor]) -> Tensor:
    """L2 norms of ``tensors`` as float64 [n]: a BLAS dot per tensor on a host, ``torch._foreach_norm``
    (batched) elsewhere.

    16-bit tensors accumulate in fp32 (``dtype=``) so a bf16 weight's norm is not itself rounded to bf16.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    if all(t.dtype == torch.float32 for t in tensors):  # the common case
        if all(t.device.type == "cpu" for t in tensors):
            # On a host, ‖t‖² as a BLAS dot: the pass is bound by memory bandwidth, and MKL's dot reads it
            # with both cores where _foreach_norm reads with one (the reference model's 22 MiB of gradients,
            # cold from the backward pass: 2.0 against 2.7 ms). Its blocked sum is also closer to a float64
            # reference (1e-6 against 8e-5 relative at 4M elements); over- and underflow are the same.
            return torch.stack([_square_norm(t) for t in tensors]).to(torch.float64).sqrt()
        return torch.stack(torch._foreach_norm(tensors)).to(torch.float64)  # one fused kernel on a device
    out: list[Tensor | None] = [None] * len(tensors)
    groups: dict[bool, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype in (torch.float32, torch.float64), []).append(i)
    for native, idx in groups.items():
        ts = [tensors[i] for i in idx]
        res = torch._foreach_norm(ts) if native else torch._foreach_norm(ts, 2, dtype=torch.float32)
        for i, r in zip(idx, res, strict=False):
            out[i] = r
    return torch.stack([o.to(torch.float64) for o in out])  # type: ignore[union-attr]


def _norms_and_changes(a: Tensor, b: Tensor, eta: float) -> list[Tensor]:
    """‖a‖, ‖a−b‖, then bit-exact changed and η-relative changed counts."""
    aw = wide(a)
    bw = wide(b).to(aw.dtype)
    d = aw - bw
    out = [torch.linalg.vector_norm(aw), torch.linalg.vector_norm(d)]
    if a.dtype != b.dtype or a.element_size() not in _INT_VIEW:
        out.append(torch.full((), float("nan"), dtype=torch.float64, device=a.device))  # undefined → NULL
    else:
        iv = _INT_VIEW[a.element_size()]
        out.append(torch.count_nonzero(a.view(iv) != b.view(iv)))
    # |d| > η·max(|a|, |b|), the scale built in one buffer (bw's own copy when it was widened).
    scale = bw.abs_() if bw is not b else bw.abs()
    torch.maximum(scale, aw.abs(), out=scale)
    scale.mul_(eta)
    out.append(torch.count_nonzero(d.abs_() > scale))
    return out


def _signs_and_nonfinite(a: Tensor, b: Tensor, eta: float) -> list[Tensor]:
    """Sign flips, then NaN and Inf counts of ``a`` (the new weights)."""
    # sign(a)·sign(b) is exactly ±1, 0 or NaN: no underflow, unlike a·b of two tiny values.
    flip = torch.sign(a).mul_(torch.sign(b))
    return [torch.count_nonzero(flip < 0), torch.count_nonzero(torch.isnan(a)), torch.count_nonzero(torch.isinf(a))]


def _bf16_unchanged(a: Tensor, b: Tensor, eta: float) -> list[Tensor]:
    return bf16_unchanged_count(a, b)


def _drift_sparsity(a: Tensor, b: Tensor, eta: float) -> list[Tensor]:
    return drift_sparsity_counts(a, b)


_NORM2_SUM2 = ("norm", "norm", "sum", "sum")
UPDATE_STATS = (
    ChunkStat(_norms_and_changes, ("w_norm", "update_norm", "changed_count", "changed_rel_count"), _NORM2_SUM2),
    ChunkStat(_signs_and_nonfinite, ("sign_flip_count", "w_nan_count", "w_inf_count"), ("sum",) * 3),
    ChunkStat(_bf16_unchanged, ("bf16_unchanged_count",), ("sum",)),
)
# S_k: bf16(W_t) against the bf16 snapshot of W_{t−k} (the snapshot is already bf16, its cast is itself).
BF16_K_STATS = (ChunkStat(_bf16_unchanged, ("bf16_unchanged_k_count",), ("sum",)),)
# Drift is computed with θ₀ as "new": ``ref_norm`` is then ‖θ₀‖, and every other column is symmetric.
DRIFT_STATS = (
    ChunkStat(_norms_and_changes, ("ref_norm", "drift_norm", "drift_changed_count", "drift_changed_rel_count"),
              _NORM2_SUM2),
    ChunkStat(_drift_sparsity, ("drift_unchanged_count", "drift_zero_count"), ("sum", "sum")),
)


def columns_of(stats: tuple[ChunkStat, ...]) -> tuple[str, ...]:
    """The column names ``chunked_stats(..., stats)`` returns, in order."""
    return tuple(c for s in stats for c in s.columns)


UPDATE_STAT_COLUMNS = columns_of(UPDATE_STATS)
DRIFT_STAT_COLUMNS = columns_of(DRIFT_STATS)

Reader = Callable[[int, int], Tensor]  # (lo, hi) -> the tensor's flat elements [lo, hi)


def chunked_stats(new: Reader, old: Reader, numel: int, device: torch.device, stats: tuple[ChunkStat, ...],
                  eta: float = 1e-3, *, chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
    """float64 [len(columns_of(stats))] for one tensor of ``numel`` elements given as two readers of flat
    ranges, ``chunk_elems`` at a time — so θ₀ can be streamed from disk chunk by chunk."""
    ranges = list(chunk_ranges(numel, chunk_elems))
    combine = [c for s in stats for c in s.combine]
    m = chunk_rows(len(ranges), len(combine), device)
    zero = torch.zeros((), dtype=torch.float64, device=device)  # float64 first: stacking promotes exactly
    for j, (lo, hi) in enumerate(ranges):
        a, b = new(lo, hi), old(lo, hi)
        parts = [zero]
        for s in stats:  # one family at a time: its temporaries are freed before the next one's
            parts += s.fn(a, b, eta)
        torch.stack(parts, out=m[j])
        del a, b, parts
    m = m[:, 1:]
    is_norm = torch.tensor([c == "norm" for c in combine], device=device)
    return torch.where(is_norm, m.square().sum(0).sqrt(), m.sum(0))


def tensor_update_stats(new: Tensor, old: Tensor, eta: float = 1e-3, *,
                        stats: tuple[ChunkStat, ...] = UPDATE_STATS,
                        chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
    """float64 [len(columns_of(stats))] for one pair of tensors, ``chunk_elems`` at a time."""
    if new.shape != old.shape:
        raise ValueError(f"weight_update_stats: shape {tuple(new.shape)} vs {tuple(old.shape)}")
    fn, fo = new.detach().reshape(-1), old.detach().reshape(-1)
    return chunked_stats(lambda lo, hi: fn[lo:hi], lambda lo, hi: fo[lo:hi], fn.numel(), fn.device, stats,
                         eta, chunk_elems=chunk_elems)


def _pairwise(new: list[Tensor], old: list[Tensor], stats: tuple[ChunkStat, ...], eta: float,
              chunk_elems: int | None) -> Tensor:
    if len(new) != len(old):
        raise ValueError(f"weight_update_stats: {len(new)} new tensors vs {len(old)} old")
    if not new:
        return torch.zeros((0, len(columns_of(stats))), dtype=torch.float64)
    with torch.no_grad():
        return torch.stack([tensor_update_stats(a, b, eta, stats=stats, chunk_elems=chunk_elems)
                            for a, b in zip(new, old, strict=True)])


def weight_update_stats(new: list[Tensor], old: list[Tensor], eta: float = 1e-3, *,
                        chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
    """Per-tensor statistics of the update ``new − old``: float64 [n, len(UPDATE_STAT_COLUMNS)] on device.

    ``old`` is the earlier weights (same shapes). Counts are exact integers held in float64;
    ``changed_count`` is NaN (unknown) when the two dtypes differ, since a bit-exact comparison is then
    undefined. Temporaries are bounded by ``transient_bytes(chunk_elems)``. Nothing is copied to the host.
    """
    return _pairwise(new, old, UPDATE_STATS, eta, chunk_elems)


def weight_drift_stats(current: list[Tensor], base: list[Tensor], eta: float = 1e-3, *,
                       chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
    """Per-tensor drift of ``current`` from ``base`` (θ₀): float64 [n, len(DRIFT_STAT_COLUMNS)] on device."""
    return _pairwise(base, current, DRIFT_STATS, eta, chunk_elems)


class SnapshotArena:
    """Host memory for the pre-step snapshots: one flat buffer that every window's snapshot is carved
    from, kept between windows and grown only when a window needs more than any before.

    Why not a fresh buffer per window on CPU: glibc returns a freed multi-MiB block to the OS (trim or
    munmap), so every window's snapshot was faulted in again page by page, and blocks held across the
    optimizer step and then freed reshaped the heap the training step allocates from. A buffer that stays
    put costs its pages once; its size is the largest window's snapshot, within ``memory_budget``.
    Accelerator snapshots stay per window: the caching allocator reuses their blocks without faults, and
    freeing them after the step leaves that memory to the next forward's activations.
    """

    ALIGN = 64  # bytes: every view starts aligned for any dtype and for vectorised kernels

    def __init__(self) -> None:
        self._buf: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def views(self, params: list[Tensor]) -> list[Tensor]:
        """Contiguous uninitialised tensors shaped and typed like ``params``, on their devices (views of
        the buffer for host tensors, fresh ones elsewhere)."""
        sizes = [p.numel() * p.element_size() if p.device.type == "cpu" else -1 for p in params]
        offsets, need = [], 0
        for n in sizes:
            offsets.append(need)
            need += -(-max(n, 0) // self.ALIGN) * self.ALIGN
        buf = self._buf
        if buf is None or buf.numel() < need:
            buf = self._buf = None  # free the smaller buffer before allocating its successor
            buf = self._buf = torch.empty(need, dtype=torch.uint8)
        return [torch.empty(p.shape, dtype=p.dtype, device=p.device) if n < 0 else
                buf[off:off + n].view(p.dtype).view(p.shape)
                for p, n, off in zip(params, sizes, offsets, strict=True)]

    def release(self) -> None:
        self._buf = None


class UpdateStats:
    """Two-step probe for one optimizer step: ``before(params)`` snapshots, ``after(params)`` computes.

    On the host the snapshot is carved from a ``SnapshotArena`` kept between steps; elsewhere it lives
    for the step only. Either way the extra memory is the largest window handed to ``before`` (the scope
    hands it a budgeted window) plus one chunk's temporaries.
    """

    columns = UPDATE_STAT_COLUMNS

    def __init__(self, eta: float = 1e-3) -> None:
        self.eta = float(eta)
        self.arena = SnapshotArena()
        self._snap: list[Tensor] | None = None

    @property
    def pending(self) -> bool:
        return self._snap is not None

    @torch.no_grad()
    def before(self, params: list[Tensor]) -> None:
        self._snap = self.arena.views(params)
        if params:
            torch._foreach_copy_(self._snap, params)

    @torch.no_grad()
    def after(self, params: list[Tensor], chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
        snap, self._snap = self._snap, None
        if snap is None or len(snap) != len(params):
            raise RuntimeError("UpdateStats.after without a matching before")
        if not params:
            return weight_update_stats([], [])
        return torch.stack([tensor_update_stats(p, old, self.eta, chunk_elems=chunk_elems)
                            for p, old in zip(params, snap, strict=True)])

    def reset(self) -> None:
        self._snap = None

    def close(self) -> None:
        """Drop the pending snapshot and give the arena's memory back."""
        self._snap = None
        self.arena.release()
