"""Weight and step-update statistics: ‖W‖, ‖ΔW‖, changed fractions, sign flips (two-step probe).

The maths is the pure function ``weight_update_stats(new, old)``; the checkpoint diff calls it on two
checkpoints and the live probe on the pre-step snapshot and the post-step weights, so both report the
same numbers. ``UpdateStats`` is the thin two-step wrapper: ``before`` snapshots, ``after`` computes.

Changed fractions, two ways:
* bit-exact: the element's bits differ in the parameter's own dtype (an update smaller than half an
  ulp is rounded away and does not count — the quantity low-precision training actually sees);
* bf16-relative ("The Path Not Taken", 2025): |ŵ − w| > η·max(|w|, |ŵ|), η = 1e-3, i.e. a change a
  bf16 copy of the weight could resolve, whatever the master dtype.

Every statistic is a sum (of squares, or of counts) over elements, so tensors are processed in flat
chunks of ``chunk_elems`` elements: the temporaries (ΔW in fp32, |W|, masks) are bounded by the chunk,
not by the largest tensor (``transient_bytes`` gives the bound the probe's memory budget reserves).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

__all__ = ["DEFAULT_CHUNK_ELEMS", "UPDATE_STAT_COLUMNS", "UPDATE_REDUCTIONS", "Reader", "UpdateStats", "chunk_ranges", "chunk_rows", "chunked_update_stats",
           "norms", "tensor_update_stats", "transient_bytes", "wide", "weight_update_stats"]

UPDATE_STAT_COLUMNS = ("w_norm", "update_norm", "changed_count", "changed_bf16_count", "sign_flip_count",
                       "w_nan_count", "w_inf_count")

# How each state combines across ranks when a tensor is sharded (FSDP/DTensor): "norm" = root of the
# sum of squares, "sum" = plain sum. Used by dynascope.probes.combine.
UPDATE_REDUCTIONS = {"w_norm": "norm", "update_norm": "norm", "changed_count": "sum", "changed_bf16_count": "sum",
                     "sign_flip_count": "sum", "w_nan_count": "sum", "w_inf_count": "sum"}

# Without a budget: 4M elements, i.e. temporaries of at most ~100 MB whatever the tensor's size.
DEFAULT_CHUNK_ELEMS = 1 << 22

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def wide(t: Tensor) -> Tensor:
    """``t`` in a dtype wide enough to difference and accumulate (fp32 for 16-bit floats)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def transient_bytes(chunk_elems: int, element_size: int = 4) -> int:
    """Upper bound of the temporaries one chunk of ``weight_update_stats`` or ``grad_counts`` allocates:
    at most five wide (≥ fp32) buffers of the chunk alive at once (ΔW, the scale, |new|, and the
    widened copies of 16-bit inputs, or θ₀'s chunk read from disk) plus two boolean masks."""
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


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1)  # a view for the contiguous tensors parameters are; a copy otherwise


def norms(tensors: list[Tensor]) -> Tensor:
    """L2 norms of ``tensors`` as float64 [n], batched with ``torch._foreach_norm``.

    16-bit tensors accumulate in fp32 (``dtype=``) so a bf16 weight's norm is not itself rounded to bf16.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    if all(t.dtype == torch.float32 for t in tensors):  # the common case: one batched call, one cast
        return torch.stack(torch._foreach_norm(tensors)).to(torch.float64)
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


def _chunk_stats(a: Tensor, b: Tensor, eta: float, signs: bool) -> list[Tensor]:
    """One flat chunk's partial results as 0-d tensors: ‖a‖, ‖a−b‖ (combined as root of the sum of
    squares), then counts: changed, changed-bf16, and with ``signs`` sign flips, NaN, Inf."""
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
    abs_a = aw.abs()
    inf = torch.count_nonzero(abs_a == float("inf")) if signs else None  # reuses |a|: one pass fewer
    torch.maximum(scale, abs_a, out=scale)
    del abs_a
    scale.mul_(eta)
    out.append(torch.count_nonzero(d.abs_() > scale))
    del d, scale, aw, bw
    if signs:
        # sign(a)·sign(b) is exactly ±1, 0 or NaN: no underflow, unlike a·b of two tiny values.
        flip = torch.sign(a).mul_(torch.sign(b))
        out.append(torch.count_nonzero(flip < 0))
        del flip
        out += [torch.count_nonzero(torch.isnan(a)), inf]
    return out


Reader = Callable[[int, int], Tensor]  # (lo, hi) -> the tensor's flat elements [lo, hi)


def chunked_update_stats(new: Reader, old: Reader, numel: int, device: torch.device, eta: float = 1e-3, *,
                         signs: bool = True, chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
    """float64 [7] (``UPDATE_STAT_COLUMNS``) for one tensor of ``numel`` elements given as two readers
    of flat ranges, ``chunk_elems`` at a time — so θ₀ can be streamed from disk chunk by chunk."""
    nan = torch.full((), float("nan"), dtype=torch.float64, device=device)
    ranges = list(chunk_ranges(numel, chunk_elems))
    m = chunk_rows(len(ranges), 7 if signs else 4, device)
    zero = nan.new_zeros(())  # float64 first: stacking promotes the rest to it exactly
    for j, (lo, hi) in enumerate(ranges):
        torch.stack([zero, *_chunk_stats(new(lo, hi), old(lo, hi), eta, signs)], out=m[j])
    m = m[:, 1:]
    acc = torch.cat([m[:, :2].square().sum(0).sqrt(), m[:, 2:].sum(0)])
    return acc if signs else torch.cat([acc, nan.expand(3)])


def tensor_update_stats(new: Tensor, old: Tensor, eta: float = 1e-3, *, signs: bool = True,
                        chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
    """float64 [7] (``UPDATE_STAT_COLUMNS``) for one pair of tensors, ``chunk_elems`` at a time."""
    if new.shape != old.shape:
        raise ValueError(f"weight_update_stats: shape {tuple(new.shape)} vs {tuple(old.shape)}")
    fn, fo = _flat(new.detach()), _flat(old.detach())
    return chunked_update_stats(lambda lo, hi: fn[lo:hi], lambda lo, hi: fo[lo:hi], fn.numel(), fn.device,
                                eta, signs=signs, chunk_elems=chunk_elems)


def weight_update_stats(new: list[Tensor], old: list[Tensor], eta: float = 1e-3, *,
                        signs: bool = True, chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
    """Per-tensor statistics of the update ``new − old``: float64 [n, 7] on the tensors' device.

    Columns are ``UPDATE_STAT_COLUMNS``. ``old`` is the earlier weights (same shapes). Counts are exact
    integers held in float64; ``changed_count`` is NaN (unknown) when the two dtypes differ, since a
    bit-exact comparison is then undefined. ``signs=False`` skips the sign-flip, NaN and Inf passes
    (NaN in those columns) for callers that do not record them (drift). Temporaries are bounded by
    ``transient_bytes(chunk_elems)``. Nothing is copied to the host.
    """
    if len(new) != len(old):
        raise ValueError(f"weight_update_stats: {len(new)} new tensors vs {len(old)} old")
    if not new:
        return torch.zeros((0, len(UPDATE_STAT_COLUMNS)), dtype=torch.float64)
    with torch.no_grad():
        return torch.stack([tensor_update_stats(a, b, eta, signs=signs, chunk_elems=chunk_elems)
                            for a, b in zip(new, old, strict=True)])


class UpdateStats:
    """Two-step probe for one optimizer step: ``before(params)`` snapshots, ``after(params)`` computes.

    The snapshot lives in buffers allocated for this step only; ``after`` frees each tensor's copy as
    soon as its statistics are computed, so the extra memory is the size of the tensors handed to
    ``before`` (the scope hands it a budgeted window) plus one chunk's temporaries.
    """

    columns = UPDATE_STAT_COLUMNS
    reductions = UPDATE_REDUCTIONS

    def __init__(self, eta: float = 1e-3) -> None:
        self.eta = float(eta)
        self._snap: list[Tensor | None] | None = None

    @property
    def pending(self) -> bool:
        return self._snap is not None

    @torch.no_grad()
    def before(self, params: list[Tensor]) -> None:
        self._snap = [torch.empty_like(p) for p in params]
        if params:
            torch._foreach_copy_(self._snap, params)

    @torch.no_grad()
    def after(self, params: list[Tensor], chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
        snap, self._snap = self._snap, None
        if snap is None or len(snap) != len(params):
            raise RuntimeError("UpdateStats.after without a matching before")
        if not params:
            return weight_update_stats([], [])
        out = []
        for i, p in enumerate(params):
            old, snap[i] = snap[i], None  # drop the list's reference: the copy is freed after its stats
            out.append(tensor_update_stats(p, old, self.eta, chunk_elems=chunk_elems))  # type: ignore[arg-type]
            del old
        return torch.stack(out)

    def reset(self) -> None:
        self._snap = None
