"""Per-tensor statistics of one recorded step: plan the window, compute on device, pack, unpack to rows.

Cost model (see benchmarks/probe_overhead.py for the measured figures). Every recorded step, for every
tracked tensor: ‖W‖ and ‖g‖ (batched norms, no extra memory; a finite norm also proves NaN/Inf counts
are 0). The statistics that need the pre-step weights, θ₀ or several passes over the data — ‖ΔW‖,
changed/sign-flip counts, drift, max|g| and zero/near-zero gradient counts — run on a *window* of
tensors that rotates through the model, sized by ``memory_budget``: the share of parameter bytes the
probe may hold at its peak, i.e. the window's pre-step snapshot plus one chunk's temporaries (θ₀ is
read from disk a chunk at a time, every statistic is computed a chunk at a time; see ``plan``). At the
default 0.1 each tensor gets the full set every ~13 windows; ``memory_budget >= 2`` (θ₀ resident + a
full snapshot) gives every statistic for every tensor at every record. Columns of tensors outside the
window are NULL.
The window also has a time budget (``time_budget``, share of wall-clock step time, default 1.5%): a
window is taken only while the windows' measured host time stays under that share, so on a small or
fast model the full set comes less often instead of slowing every step. ``memory_budget=None`` (or
``time_budget=None``) lifts that limit.

Everything stays on device until one float64 vector per record is copied to the host (pinned memory,
non-blocking, on CUDA) and unpacked into rows by the resolver thread.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from dynascope.probes.grad_stats import grad_counts, grad_norms
from dynascope.probes.params import Tracked
from dynascope.probes.reference import Reference
from dynascope.probes.update_stats import (
    DEFAULT_CHUNK_ELEMS,
    UPDATE_STAT_COLUMNS,
    UpdateStats,
    chunked_update_stats,
    norms,
    transient_bytes,
)
from dynascope.store.writer import now_us

__all__ = ["Record", "TensorStats", "rows_from_record", "summarize"]

# Share of the budget a window's snapshot leaves to one chunk's temporaries (ΔW, masks, θ₀'s chunk).
# The chunk is sized from whatever the snapshot leaves over, so a tensor alone in its window (often the
# embedding: ~10% of a small model) may take more than 1 − RESERVE and still fit. A larger reserve means
# larger chunks, i.e. fewer op launches per byte, at the price of more windows per rotation.
RESERVE = 1 / 4
MIN_CHUNK_ELEMS = 1024


class Record:
    """What the training thread hands to the resolver: one host vector plus the index bookkeeping."""

    def __init__(self, step: int, stage: str | None, tracked: list[Tracked]) -> None:
        self.step, self.stage, self.tracked = step, stage, tracked
        self.time_us = now_us()
        self.window: list[int] = []
        self.chunk_elems: int | None = DEFAULT_CHUNK_ELEMS
        self.with_grad: list[int] = []
        self.window_grad: list[int] = []
        self.drift: list[int] = []
        self.has_update = False
        self.host: torch.Tensor | None = None
        self.event: Any = None
        self.parts: dict[str, torch.Tensor] = {}


class TensorStats:
    """Plans windows under the memory budget and computes one record's statistics on device."""

    def __init__(self, memory_budget: float | None, grad_tol: float | None, eta: float = 1e-3,
                 time_budget: float | None = 0.015) -> None:
        self.memory_budget = memory_budget
        self.time_budget = None if memory_budget is None else time_budget
        self._debt_s = 0.0  # window time spent beyond what time_budget × elapsed step time allows
        self.grad_tol, self.eta = grad_tol, eta
        self.update = UpdateStats(eta)
        self.reference: Reference | None = None
        self._cursor = 0
        self._chunk: int | None = DEFAULT_CHUNK_ELEMS  # chunk size of the last planned window
        self._rec: Record | None = None
        self._early_window: list[int] | None = None

    def budget_bytes(self, tracked: list[Tracked]) -> float:
        """Bytes the windowed statistics may hold at peak: snapshot + one chunk's temporaries."""
        total = sum(t.nbytes for t in tracked)
        if self.memory_budget is None:
            return math.inf
        resident = total if self.reference is not None and self.reference.resident else 0
        return self.memory_budget * total - resident

    def tick(self, step_s: float) -> None:
        """Called once per step with the step's wall time: earns back window time."""
        if self.time_budget is not None:
            self._debt_s = max(self._debt_s - self.time_budget * step_s, -self.time_budget * step_s)

    def _timed(self, t0: float) -> None:
        self._debt_s += time.perf_counter() - t0

    def plan(self, tracked: list[Tracked]) -> list[int]:
        """Next window and the chunk size of its statistics.

        A budget that holds every tensor (``memory_budget >= 2`` with θ₀ resident, or None) takes them
        all, in chunks of ``DEFAULT_CHUNK_ELEMS``. Otherwise tensors from the rotating cursor join while
        their snapshot fits ``(1 − RESERVE)`` of the budget (always at least one), and the chunk is sized
        so the temporaries fit what the snapshot leaves: the peak stays within the budget as long as
        each tensor leaves room for a chunk of ``MIN_CHUNK_ELEMS`` (~22 KiB of fp32 temporaries).
        """
        n = len(tracked)
        if n == 0:
            return []
        budget = self.budget_bytes(tracked)
        sizes = [t.nbytes for t in tracked]
        if budget >= sum(sizes):
            self._chunk = DEFAULT_CHUNK_ELEMS
            return list(range(n))
        limit, used, out = budget * (1 - RESERVE), 0, []
        start = self._cursor % n
        for j in range(n):
            i = (start + j) % n
            if out and used + sizes[i] > limit:
                break
            out.append(i)
            used += sizes[i]
        self._cursor = start + len(out)
        per_elem = transient_bytes(1, max(tracked[i].local().element_size() for i in out))
        self._chunk = int(min(max((budget - used) // per_elem, MIN_CHUNK_ELEMS), DEFAULT_CHUNK_ELEMS))
        return sorted(out)

    @torch.no_grad()
    def before(self, step: int, stage: str | None, tracked: list[Tracked], snapshot: bool = True) -> None:
        """Pre-step half: gradients and the ΔW snapshot of the window."""
        rec = Record(step, stage, tracked)
        early, self._early_window = self._early_window, None
        t0 = time.perf_counter()
        if early is not None and not snapshot:
            rec.window = early
        elif self.time_budget is None or self._debt_s <= 0:
            rec.window = self.plan(tracked)
        rec.chunk_elems = self._chunk
        grads = []
        for i, t in enumerate(tracked):
            g = t.grad()
            if g is not None:
                rec.with_grad.append(i)
                grads.append(g)
        gn = grad_norms(grads)
        rec.parts["grad_norms"] = gn
        in_window = set(rec.window)
        pos = [k for k, i in enumerate(rec.with_grad) if i in in_window]
        rec.window_grad = [rec.with_grad[k] for k in pos]
        col = gn[:, 0].unbind() if pos else ()  # 0-d views: picking them needs no host→device index copy
        rec.parts["grad_counts"] = grad_counts([grads[k] for k in pos],
                                               torch.stack([col[k] for k in pos]) if pos else None, self.grad_tol,
                                               chunk_elems=rec.chunk_elems)
        del grads, col
        if snapshot and rec.window:  # after the gradient counts, whose temporaries are gone by now
            self.update.before([tracked[i].local() for i in rec.window])
        self._rec = rec
        if rec.window:
            self._timed(t0)

    @torch.no_grad()
    def after(self) -> Record | None:
        """Post-step half: weights, ΔW, drift; packs everything into one host vector."""
        rec, self._rec = self._rec, None
        if rec is None:
            return None
        tracked = rec.tracked
        locals_ = [t.local() for t in tracked]
        device = locals_[0].device if locals_ else torch.device("cpu")
        rec.parts["w_norm"] = norms(locals_)
        t0 = time.perf_counter()
        if self.update.pending:  # frees each snapshot tensor as soon as its statistics are computed
            rec.parts["update"] = self.update.after([locals_[i] for i in rec.window], rec.chunk_elems)
            rec.has_update = True
        if self.reference is not None:
            rec.parts["drift"] = self._drift(rec, locals_, device)
        if rec.window:
            self._timed(t0)
        flat = torch.cat([p.to(device=device, dtype=torch.float64).reshape(-1) for p in rec.parts.values()])
        shapes = {k: tuple(v.shape) for k, v in rec.parts.items()}
        if flat.is_cuda:
            rec.host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            rec.host.copy_(flat, non_blocking=True)
            rec.event = torch.cuda.Event()
            rec.event.record()
        else:
            rec.host = flat.cpu()  # plain copy (a no-op view on CPU)
        rec.parts = shapes  # type: ignore[assignment]  # only the shapes travel to the resolver
        return rec

    def _drift(self, rec: Record, locals_: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Drift from θ₀ of the window, θ₀ streamed a chunk at a time (never a whole tensor of it)."""
        assert self.reference is not None
        rows = []
        for i in rec.window:
            w = locals_[i]
            read_ref = self.reference.reader(rec.tracked[i].name, w)
            if read_ref is None:
                continue
            rec.drift.append(i)
            flat = w.reshape(-1)
            # (θ₀, W) order: the w_norm column is then ‖W₀‖, the rest is symmetric in the two.
            rows.append(chunked_update_stats(read_ref, lambda lo, hi, f=flat: f[lo:hi], flat.numel(), w.device,
                                             self.eta, signs=False, chunk_elems=rec.chunk_elems))
        if not rows:
            return torch.zeros((0, len(UPDATE_STAT_COLUMNS)), dtype=torch.float64, device=device)
        return torch.stack(rows)

    @torch.no_grad()
    def snapshot_early(self, tracked: list[Tracked]) -> None:
        """Without an optimizer, ΔW spans boundary to boundary: snapshot the next window now, and let
        the next ``before(..., snapshot=False)`` reuse that window."""
        self._early_window = self.plan(tracked)
        self.update.before([tracked[i].local() for i in self._early_window])

    def discard(self) -> None:
        self._rec = None
        self._early_window = None
        self.update.reset()


def _unpack(rec: Record) -> dict[str, np.ndarray]:
    if rec.event is not None:
        rec.event.synchronize()
    arr = rec.host.numpy() if rec.host is not None else np.zeros(0)
    out, off = {}, 0
    for k, shape in rec.parts.items():  # type: ignore[union-attr]
        size = int(np.prod(shape)) if len(shape) else 1
        out[k] = arr[off:off + size].reshape(shape)
        off += size
    return out


def _count(x: float) -> int | None:
    return None if x is None or not math.isfinite(x) else int(x)


def _frac(count: int | None, numel: int) -> float | None:
    return None if count is None or numel == 0 else count / numel


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def rows_from_record(rec: Record) -> dict[str, list]:
    """Columns of the ``tensor_stats`` rows of one record (runs on the resolver thread)."""
    p = _unpack(rec)
    n = len(rec.tracked)
    upd = {i: p["update"][k] for k, i in enumerate(rec.window)} if rec.has_update else {}
    drift = {i: p["drift"][k] for k, i in enumerate(rec.drift)} if "drift" in p else {}
    gn = {i: p["grad_norms"][k] for k, i in enumerate(rec.with_grad)}
    gc = {i: p["grad_counts"][k] for k, i in enumerate(rec.window_grad)}
    cols: dict[str, list] = {}

    def put(name: str, v: Any) -> None:
        cols.setdefault(name, []).append(v)

    for i, t in enumerate(rec.tracked):
        numel = int(t.local().numel())
        w = float(p["w_norm"][i])
        put("tensor", t.name), put("layer", t.layer), put("kind", t.kind), put("shape", t.shape)
        put("dtype", t.dtype), put("numel", numel), put("sharded", t.sharded), put("w_norm", w)
        u = upd.get(i)
        if u is not None:
            nan_c, inf_c = _count(u[5]), _count(u[6])
        else:  # a finite norm proves there is no NaN/Inf element; otherwise unknown here
            nan_c = inf_c = 0 if math.isfinite(w) else None
        put("w_nan_count", nan_c), put("w_inf_count", inf_c)
        dw = float(u[1]) if u is not None else None
        put("update_norm", dw), put("update_ratio", _ratio(dw, w))
        for col, j in (("changed", 2), ("changed_bf16", 3), ("sign_flip", 4)):
            c = _count(u[j]) if u is not None else None
            put(f"{col}_count", c), put(f"{col}_frac", _frac(c, numel))
        d = drift.get(i)
        put("ref_covered", d is not None)
        put("drift_norm", float(d[1]) if d is not None else None)
        put("drift_ratio", _ratio(float(d[1]), float(d[0])) if d is not None else None)
        for col, j in (("drift_changed", 2), ("drift_changed_bf16", 3)):
            c = _count(d[j]) if d is not None else None
            put(f"{col}_count", c), put(f"{col}_frac", _frac(c, numel))
        g, k = gn.get(i), gc.get(i)
        put("grad_norm", float(g[0]) if g is not None else None)
        put("grad_max_abs", float(k[0]) if k is not None else None)
        for col, j in (("grad_zero", 1), ("grad_near_zero", 2)):
            c = _count(k[j]) if k is not None else None
            put(f"{col}_count", c), put(f"{col}_frac", _frac(c, numel))
        if k is not None:
            put("grad_nan_count", _count(k[3])), put("grad_inf_count", _count(k[4]))
        else:
            known = g is not None and math.isfinite(float(g[0]))
            put("grad_nan_count", 0 if known else None), put("grad_inf_count", 0 if known else None)
    if n:
        cols.update(step=rec.step, time_us=rec.time_us, stage=rec.stage)
    return cols


def summarize(cols: dict[str, list]) -> dict[str, float]:
    """Compact per-record summary for listeners: global and per-kind means of the headline fractions."""
    out: dict[str, float] = {}
    kinds = cols.get("kind", [])
    for key in ("update_ratio", "changed_frac", "drift_changed_frac", "grad_zero_frac"):
        vals = cols.get(key, [])
        by_kind: dict[str, list[float]] = {}
        for kind, v in zip(kinds, vals, strict=False):
            if v is not None and math.isfinite(v):
                by_kind.setdefault(kind, []).append(v)
                by_kind.setdefault("", []).append(v)
        for kind, vs in by_kind.items():
            out[f"{key}/{kind}" if kind else key] = float(sum(vs) / len(vs))
    return out
