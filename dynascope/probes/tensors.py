"""The ``tensor_stats`` probe: plan the window, compute on device, pack, unpack to rows by column name.

Cost model (see benchmarks/probe_overhead.py for the measured figures). Every recorded step, for every
tracked tensor: ‖g‖ (batched norms, no extra memory; a finite norm also proves NaN/Inf counts are 0);
‖W‖ for every tensor at every ``w_norm_every``-th record (default 8, the first included) and for the
window's tensors at every record, which is where ``update_ratio`` needs it. Both passes read every
parameter's bytes, so on a host they are bound by memory bandwidth (~2% of the reference step together),
and ‖W‖ moves slowly: at lr ~1e-6 by about 1e-6 of itself per step. The statistics that need the
pre-step weights, θ₀, the weights k steps back or several passes over the data — ‖ΔW‖,
changed/sign-flip/bf16-unchanged counts, drift, max|g| and zero/near-zero gradient counts — run on a
*window* of tensors that rotates through the model, sized by ``memory_budget``: the share of parameter
bytes the probe may hold at its peak, i.e. the window's pre-step snapshot plus one chunk's temporaries
(θ₀ is read from disk a chunk at a time, every statistic is computed a chunk at a time; see ``plan``).
At the default 0.1 each tensor gets the full set every ~13 windows; ``memory_budget >= 2`` (θ₀
resident + a full snapshot) gives every statistic for every tensor at every record. Columns of tensors
outside the window are NULL.
The window also has a time budget (``time_budget``, share of wall-clock step time, default 1%): a
window is taken only while the windows' measured host time stays under that share of the time since
the previous record, so on a small or fast model the full set comes less often instead of slowing
every step. ``memory_budget=None`` (or ``time_budget=None``) lifts that limit. Drift, the costliest part
of a window (θ₀ is read back), comes at every ``drift_every``-th window a tensor is in (default 4; every
window when the window holds every tensor), so drift is refreshed once per 4 rotations.

Each statistic family writes a ``Part``: the tracked tensors it covers and its values under their column
names (``update_stats.ChunkStat``). Everything stays on device until one float64 vector per record is
copied to the host (pinned memory, non-blocking, on CUDA); the resolver thread unpacks it into rows,
reading each column's type and derivation (fractions, ratios) from ``store.schema``'s registry.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from dynascope.core.naming import normalize_name
from dynascope.probes.bf16_visibility import Bf16History
from dynascope.probes.grad_stats import GRAD_COUNT_COLUMNS, GRAD_NORM_COLUMNS, grad_counts, grad_norms
from dynascope.probes.params import Tracked
from dynascope.probes.protocol import Probe, Rows, StepContext, rows_of
from dynascope.probes.rows import Record, rows_from_records, summarize, tensor_columns
from dynascope.probes.schedule import Schedule, every
from dynascope.probes.update_stats import (
    BF16_K_STATS,
    DEFAULT_CHUNK_ELEMS,
    DRIFT_STATS,
    UpdateStats,
    chunked_stats,
    norms,
    transient_bytes,
)

__all__ = ["TIME_BUDGET", "TensorStats"]

# Share of the budget a window's snapshot leaves to one chunk's temporaries (ΔW, masks, θ₀'s chunk).
# The chunk is sized from whatever the snapshot leaves over, so a tensor alone in its window (often the
# embedding: ~10% of a small model) may take more than 1 − RESERVE and still fit. A larger reserve means
# larger chunks, i.e. fewer op launches per byte, at the price of more windows per rotation.
RESERVE = 1 / 4
MIN_CHUNK_ELEMS = 1024
# Drift against θ₀ is computed at every DRIFT_EVERY-th window a tensor is in (its first one included).
# Drift is cumulative and moves slowly (at lr ~1e-6 it changes little over a rotation), while streaming θ₀
# and its statistics take nearly half a window's time (benchmarks/probe_ab.py --stats): under the time
# budget, the ΔW rotation gets shorter.
DRIFT_EVERY = 4
# ‖W‖ of every tensor at every W_NORM_EVERY-th record (the first included); the window's tensors at each.
W_NORM_EVERY = 8
# Share of wall time the windows may take. The default set's other in-step work is fixed: ‖g‖ of every
# tensor at every step, a pass over every gradient that on a host is bound by memory bandwidth (~1.2% of
# the reference step), and ‖W‖ at every 8th. With the windows at 1.5% on top, the set cost ~3% of the
# step at the reference workload, the whole of the 1.03x goal; at 1% it leaves room, and the rotation
# there takes ~1.5x as many steps. Where the memory budget binds first (larger models, accelerators, whose
# passes are fast), the rotation does not change.
TIME_BUDGET = 0.01


class TensorStats(Probe):
    """Per-tensor statistics of each recorded step (the ``tensor_stats`` table) under the memory budget."""

    name = "tensor_stats"

    def __init__(self, memory_budget: float | None, grad_tol: float | None, eta: float = 1e-3,
                 time_budget: float | None = TIME_BUDGET, schedule: Schedule | None = None,
                 bf16_k: int | None = None, run_dir: Path | None = None, rank: int = 0,
                 drift_every: int = DRIFT_EVERY, w_norm_every: int = W_NORM_EVERY) -> None:
        for name, n in (("drift_every", drift_every), ("w_norm_every", w_norm_every)):
            if int(n) < 1:
                raise ValueError(f"{name} must be >= 1, got {n}")
        self.w_norm_every = int(w_norm_every)
        self._records = 0  # records made so far: every w_norm_every-th has ‖W‖ of every tensor
        self.memory_budget = memory_budget
        self.drift_every = int(drift_every)
        self._drift_visits: dict[str, int] = {}  # tensor name → windows it has been in
        self.time_budget = None if memory_budget is None else time_budget
        self._schedule = schedule if schedule is not None else every(1)
        self._debt_s = 0.0  # window time spent beyond what time_budget × elapsed time allows
        self._last_t: float | None = None
        self.grad_tol, self.eta = grad_tol, eta
        self.update = UpdateStats(eta)
        self.reference: Any = None  # θ₀ (dynascope.probes.reference.Reference), set by the scope
        self.history = None if not bf16_k else Bf16History(
            int(bf16_k), Path(run_dir or ".") / "reference" / f"bf16-k-r{rank}.safetensors")
        self._cursor = 0
        self._chunk: int | None = DEFAULT_CHUNK_ELEMS  # chunk size of the last planned window
        self._rec: Record | None = None
        self._columns: tuple[list[Tracked], dict[str, Any]] | None = None  # the tracked list's own columns
        self._early_window: list[int] | None = None

    def schedule(self, step: int) -> bool:
        """The user's schedule, plus the steps at which S_k takes its snapshot (k steps before a record)."""
        return bool(self._schedule(step)) or self._snapshot_due(step)

    # ---- budgets -----------------------------------------------------------------------------------
    def _resident_bytes(self, tracked: list[Tracked]) -> float:
        held = sum(t.nbytes for t in tracked) if self.reference is not None and self.reference.resident else 0
        return held + (self.history.resident_bytes if self.history is not None else 0)

    def budget_bytes(self, tracked: list[Tracked]) -> float:
        """Bytes the windowed statistics may hold at peak: snapshot + one chunk's temporaries."""
        if self.memory_budget is None:
            return math.inf
        return self.memory_budget * sum(t.nbytes for t in tracked) - self._resident_bytes(tracked)

    def _tick(self) -> None:
        """Earn back window time: ``time_budget`` of the wall time since the previous record."""
        now = time.perf_counter()
        if self._last_t is not None and self.time_budget is not None:
            elapsed = now - self._last_t
            self._debt_s = max(self._debt_s - self.time_budget * elapsed, -self.time_budget * elapsed)
        self._last_t = now

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

    # ---- the two halves ----------------------------------------------------------------------------
    @torch.no_grad()
    def before(self, ctx: StepContext) -> None:
        """Pre-step half: gradients and the ΔW snapshot of the window. Without an optimizer this runs at
        the start of the step (the previous boundary) and only snapshots; the gradients wait for ``after``,
        as they do when a closure computes them inside the step (``ctx.grads_after``)."""
        if not self._schedule(ctx.step):  # a step scheduled only for S_k's snapshot, taken in after()
            return
        self._tick()
        if ctx.manual or ctx.grads_after:  # the gradients are not this step's yet: after() reads them
            self._early_window = self.plan(ctx.tracked)
            self.update.before([ctx.tracked[i].local() for i in self._early_window])
            return
        self._grads(ctx, snapshot=True)

    def _grads(self, ctx: StepContext, snapshot: bool) -> None:
        tracked = ctx.tracked
        rec = Record(ctx.step, ctx.stage, tracked)
        early, self._early_window = self._early_window, None
        t0 = time.perf_counter()
        if early is not None and not snapshot:
            rec.window = early
        elif self.time_budget is None or self._debt_s <= 0:
            rec.window = self.plan(tracked)
        rec.chunk_elems = self._chunk
        with_grad, grads = [], []
        for i, t in enumerate(tracked):
            g = t.grad()
            if g is not None:
                with_grad.append(i)
                grads.append(g)
        gn = grad_norms(grads)
        rec.add("grad_norms", GRAD_NORM_COLUMNS, with_grad, gn)
        in_window = set(rec.window)
        pos = [k for k, i in enumerate(with_grad) if i in in_window]
        col = gn[:, 0].unbind() if pos else ()  # 0-d views: picking them needs no host→device index copy
        rec.add("grad_counts", GRAD_COUNT_COLUMNS, [with_grad[k] for k in pos],
                grad_counts([grads[k] for k in pos], torch.stack([col[k] for k in pos]) if pos else None,
                            self.grad_tol, chunk_elems=rec.chunk_elems))
        del grads, col
        if snapshot and rec.window:  # after the gradient counts, whose temporaries are gone by now
            self.update.before([tracked[i].local() for i in rec.window])
        self._rec = rec
        if rec.window:
            self._timed(t0)

    @torch.no_grad()
    def after(self, ctx: StepContext) -> Callable[[], Rows] | None:
        """Post-step half: weights, ΔW, drift, S_k; packs everything into one host vector."""
        if not self._schedule(ctx.step):
            self._snapshot(ctx.step, ctx.tracked, [t.local() for t in ctx.tracked])
            return None
        if ctx.manual or ctx.grads_after:
            self._grads(ctx, snapshot=False)
        rec, self._rec = self._rec, None
        if rec is None:
            return None
        tracked = rec.tracked
        locals_ = _Locals(tracked)
        device = locals_[0].device if tracked else torch.device("cpu")
        every_tensor = self._records % self.w_norm_every == 0 or len(rec.window) == len(tracked)
        self._records += 1
        # The update family computes ‖W‖ of the window's tensors in the same pass as ‖ΔW‖: not twice.
        in_update = set(rec.window) if self.update.pending else set()
        with_w = [i for i in (range(len(tracked)) if every_tensor else rec.window) if i not in in_update]
        rec.add("w_norm", ("w_norm",), with_w, norms([locals_[i] for i in with_w]).to(device))
        t0 = time.perf_counter()
        if self.update.pending:
            rec.add("update", self.update.columns, rec.window,
                    self.update.after([locals_[i] for i in rec.window], rec.chunk_elems))
        if ctx.reference is not None:
            self._drift(rec, ctx.reference, locals_, device)
        if rec.window:
            self._timed(t0)
        if self.history is not None:
            self._bf16_k(rec, ctx.step, locals_)
        self._pack(rec, device)
        return _RecordRows(self, rec)

    def resolve_many(self, results: list[Any]) -> list[Rows]:
        """One batch of rows for each run of consecutive records of one tracked list (usually all of them)."""
        out: list[Rows] = []
        group: list[Record] = []
        for res in [*results, None]:
            rec = res.rec if isinstance(res, _RecordRows) and res.probe is self else None
            if group and (rec is None or rec.tracked is not group[0].tracked):
                out.append({"tensor_stats": rows_from_records(group, self._tensor_columns(group[0].tracked))})
                group = []
            if rec is not None:
                group.append(rec)
            elif res is not None:
                out.append(rows_of(res))
        return out

    def _tensor_columns(self, tracked: list[Tracked]) -> dict[str, Any]:
        """``tensor_columns(tracked)``, rebuilt only when the scope discovers a new tracked list (resolver
        thread: one per scope, so no lock)."""
        if self._columns is None or self._columns[0] is not tracked:
            self._columns = (tracked, tensor_columns(tracked))
        return self._columns[1]

    def _drift(self, rec: Record, reference: Any, locals_: _Locals, device: torch.device) -> None:
        """Drift from θ₀ of the window's tensors that are due (``drift_due``), θ₀ streamed a chunk at a time
        (never a whole tensor of it)."""
        rows, out = [], []
        every_tensor = len(rec.window) == len(rec.tracked)
        for i in rec.window:
            if not self.drift_due(rec.tracked[i].name, every_tensor):
                continue
            w = locals_[i]
            read_ref = reference.reader(rec.tracked[i].name, w)
            if read_ref is None:
                continue
            flat = w.reshape(-1)
            rows.append(i)
            out.append(chunked_stats(read_ref, lambda lo, hi, f=flat: f[lo:hi], flat.numel(), w.device, DRIFT_STATS,
                                     self.eta, chunk_elems=rec.chunk_elems))
        cols = tuple(c for s in DRIFT_STATS for c in s.columns)
        rec.add("drift", cols, rows, torch.stack(out) if out else torch.zeros((0, len(cols)), dtype=torch.float64,
                                                                               device=device))

    def drift_due(self, name: str, every_tensor: bool = False) -> bool:
        """Whether this window computes ``name``'s drift: at every ``drift_every``-th window the tensor is
        in, its first one included, and always when the window holds every tensor (the full set)."""
        n = self._drift_visits.get(name, 0)
        self._drift_visits[name] = n + 1
        return every_tensor or n % self.drift_every == 0

    def _bf16_k(self, rec: Record, step: int, locals_: _Locals) -> None:
        """S_k against the bf16 snapshot of step − k (every tensor it holds), then the next snapshot."""
        hist = self.history
        assert hist is not None
        if hist.due(step):
            t0 = time.perf_counter()
            rows, out = [], []
            for i, w in enumerate(locals_):
                read = hist.reader(normalize_name(rec.tracked[i].name), w)
                if read is None:
                    continue
                flat = w.reshape(-1)
                rows.append(i)
                out.append(chunked_stats(lambda lo, hi, f=flat: f[lo:hi], read, flat.numel(), w.device, BF16_K_STATS,
                                         chunk_elems=rec.chunk_elems))
            if out:
                rec.add("bf16_k", BF16_K_STATS[0].columns, rows, torch.stack(out))
                rec.constants["bf16_k"] = {"bf16_k_steps": hist.k}
            self._timed(t0)
        self._snapshot(step, rec.tracked, locals_)

    def _snapshot_due(self, step: int) -> bool:
        """S_k needs a snapshot at ``step``: none is held (or the one held is used up) and step + k records."""
        h = self.history
        return h is not None and (h.step is None or step - h.step >= h.k) and bool(self._schedule(step + h.k))

    def _snapshot(self, step: int, tracked: list[Tracked], locals_: Sequence[torch.Tensor]) -> None:
        hist = self.history
        assert hist is not None
        if hist.step is not None and step - hist.step >= hist.k:
            hist.drop()
        if self._snapshot_due(step):
            t0 = time.perf_counter()  # charged to the time budget: the windowed statistics back off after it
            named = [(normalize_name(t.name), w) for t, w in zip(tracked, locals_, strict=True)]
            total = sum(t.nbytes for t in tracked)
            need = sum(w.numel() * 2 for w in locals_)
            resident = self.memory_budget is None or (
                self.memory_budget * total - self._resident_bytes(tracked) - need >= total)
            hist.take(step, named, resident)
            self._timed(t0)

    def _pack(self, rec: Record, device: torch.device) -> None:
        flat = torch.cat([v.to(device=device, dtype=torch.float64).reshape(-1) for v in rec.values.values()])
        if flat.is_cuda:
            rec.host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            rec.host.copy_(flat, non_blocking=True)
            rec.event = torch.cuda.Event()
            rec.event.record()
        else:
            rec.host = flat.cpu()  # plain copy (a no-op view on CPU)
        rec.values = {k: torch.Size(v.shape) for k, v in rec.values.items()}  # type: ignore[misc]

    def summarize(self, rows: Rows) -> dict[str, float]:
        return summarize(rows.get("tensor_stats", {}))

    def discard(self) -> None:
        self._rec = None
        self._early_window = None
        self.update.reset()

    def close(self) -> None:
        self.update.close()
        if self.history is not None:
            self.history.drop()


class _Locals:
    """``tracked[i].local()``, made on first use: most records read the weights of the window's tensors or
    of none (a detached view per tensor per record was ~0.2 ms of the reference step)."""

    def __init__(self, tracked: list[Tracked]) -> None:
        self._tracked = tracked
        self._made: list[torch.Tensor | None] = [None] * len(tracked)

    def __getitem__(self, i: int) -> torch.Tensor:
        w = self._made[i]
        if w is None:
            w = self._made[i] = self._tracked[i].local()
        return w

    def __len__(self) -> int:
        return len(self._tracked)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self._tracked)))


class _RecordRows:
    """What ``after`` returns: the record, resolved alone when called, or with others by ``resolve_many``."""

    __slots__ = ("probe", "rec")

    def __init__(self, probe: TensorStats, rec: Record) -> None:
        self.probe, self.rec = probe, rec

    def __call__(self) -> Rows:
        return {"tensor_stats": rows_from_records([self.rec], self.probe._tensor_columns(self.rec.tracked))}
