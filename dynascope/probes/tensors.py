"""The ``tensor_stats`` probe: every declared statistic, over the tensors its tier covers, within budgets.

Cost model (see benchmarks/probe_overhead.py for the measured figures). Every recorded step, for every
tracked tensor: ‖g‖ (batched norms, no extra memory; a finite norm also proves NaN/Inf counts are 0);
‖W‖ for every tensor at every ``w_norm_every``-th record (default 8, the first included) and for the
window's tensors at every record, which is where ``update_ratio`` needs it. Both passes read every
parameter's bytes, so on a host they are bound by memory bandwidth (~2% of the reference step together),
and ‖W‖ moves slowly: at lr ~1e-6 by about 1e-6 of itself per step. The statistics of the "window" tier —
those that need the pre-step weights, θ₀ or several passes over the data — run on a window of tensors
that rotates through the model within the memory and time budgets (``probes.window``); columns of
tensors outside the window are NULL. S_k runs on every tensor at the records k steps after a snapshot.

The statistics are the declared ones (``stats.REGISTRY``), grouped into passes of those that read the same
inputs (``stats.engine.passes``). This probe is their source of tensors: it provides each pass's inputs
per tensor — the gradient before the step, the weights after it, the pre-step snapshot (``old``), θ₀
streamed from disk (``ref``) and S_k's bf16 snapshot (``k_snapshot``) — and a pass runs on the tensors
whose inputs it holds. Everything stays on device until one float64 vector per record is copied to the
host (pinned memory, non-blocking, on CUDA); the resolver thread unpacks it into rows (``probes.rows``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dynascope.core.naming import normalize_name
from dynascope.core.warn import warn
from dynascope.probes.background import PassThread, versions
from dynascope.probes.loss_scale import Unscale
from dynascope.probes.params import LocalViews, Tracked
from dynascope.probes.protocol import Probe, Rows, StepContext, resolved_rows
from dynascope.probes.rows import Record, summarize, tensor_stats_batch, tracked_columns
from dynascope.probes.schedule import Schedule, every
from dynascope.probes.snapshots import Bf16History, StepSnapshot
from dynascope.probes.weight_pass import prepare, weight_pass
from dynascope.probes.window import Window
from dynascope.stats.base import Settings, Statistic
from dynascope.stats.builtin.grad import DEFAULT_GRAD_TOL
from dynascope.stats.engine import Pass, Reader, flat_reader, passes, transient_bytes
from dynascope.stats.fused_many import Item
from dynascope.stats.registry import REGISTRY

__all__ = ["DRIFT_EVERY", "TIME_BUDGET", "W_NORM_EVERY", "TensorStats"]

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
    """Per-tensor statistics of each recorded step (the ``tensor_stats`` table) under the memory budget.

    ``statistics``: the declared statistics to compute (default: every one in ``stats.REGISTRY``)."""

    name = "tensor_stats"

    def __init__(self, memory_budget: float | None, grad_tol: float | None, eta: float = 1e-3,
                 time_budget: float | None = TIME_BUDGET, schedule: Schedule | None = None,
                 bf16_k: int | None = None, run_dir: Path | None = None, rank: int = 0,
                 drift_every: int = DRIFT_EVERY, w_norm_every: int = W_NORM_EVERY,
                 statistics: Sequence[Statistic] | None = None) -> None:
        for name, n in (("drift_every", drift_every), ("w_norm_every", w_norm_every)):
            if int(n) < 1:
                raise ValueError(f"{name} must be >= 1, got {n}")
        self.w_norm_every = int(w_norm_every)
        self._records = 0  # records made so far: every w_norm_every-th has ‖W‖ of every tensor
        self.memory_budget = memory_budget
        stats = REGISTRY.statistics if statistics is None else tuple(statistics)
        self.window = Window(memory_budget, time_budget, drift_every, lambda e: transient_bytes(1, e, stats))
        self._schedule = schedule if schedule is not None else every(1)
        self.settings = Settings(eta=float(eta), grad_tol=DEFAULT_GRAD_TOL if grad_tol is None else float(grad_tol))
        all_passes = passes(stats)
        self.grad_passes = [p for p in all_passes if "grad" in p.inputs]  # before the step: batched ones first
        self.grad_passes.sort(key=lambda p: not p.batched)
        self.weight_passes = [p for p in all_passes if "grad" not in p.inputs]  # after it
        self._needs_old = any("old" in p.inputs for p in self.weight_passes)  # a pre-step snapshot to take
        self.snapshot = StepSnapshot()
        self.reference: Any = None  # θ₀ (dynascope.probes.reference.Reference), set by the scope
        self.history = None if not bf16_k else Bf16History(
            int(bf16_k), Path(run_dir or ".") / "reference" / f"bf16-k-r{rank}.safetensors")
        self._rec: Record | None = None
        self._columns: tuple[list[Tracked], dict[str, Any]] | None = None  # the tracked list's own columns
        self._early_window: list[int] | None = None
        self._k_bytes = 0  # S_k's snapshot as the budget counts it (when resident)
        self._pass = PassThread()  # the post-step weight pass, beside the next forward (probes.background)
        self._merged: dict[tuple[int, ...], Pass] = {}
        self._carry_step: int | None = None  # the step whose pass carries W_t into the arena (``copies``)
        self._copies: tuple[int, dict[str, torch.Tensor]] | None = None

    def schedule(self, step: int) -> bool:
        """The user's schedule, plus the steps at which S_k takes its snapshot (k steps before a record).

        The scope asks at every step's boundary, in the optimizer's pre-hook: the previous step's weight
        pass is waited for here, so the optimizer never changes weights that pass is still reading."""
        self._pass.wait()
        return bool(self._schedule(step)) or self._snapshot_due(step)

    def prepare(self, tracked: list[Tracked], step: int) -> None:
        """Before the first record: at full coverage on a host, its snapshot and kernels readied off the
        training thread (``weight_pass.prepare``); a sharded run's group for the time budget's agreement
        made here, in ``watch()``, not inside a step (``probes.agreement``)."""
        self.window.prepare(tracked)
        prepare(self, tracked, step)

    def _resident_bytes(self, tracked: list[Tracked]) -> float:
        held = sum(t.nbytes for t in tracked) if self.reference is not None and self.reference.resident else 0
        return held + (self._k_bytes if self.history is not None and self.history.resident_bytes else 0)

    def plan(self, tracked: list[Tracked]) -> list[int]:
        """The next window (``Window.plan``), with θ₀'s and S_k's resident bytes taken off the budget."""
        return self.window.plan(tracked, self._resident_bytes(tracked))

    # ---- the two halves ----------------------------------------------------------------------------
    @torch.no_grad()
    def before(self, ctx: StepContext) -> None:
        """Pre-step half: gradients and the ΔW snapshot of the window. Without an optimizer this runs at
        the start of the step (the previous boundary) and only snapshots; the gradients wait for ``after``,
        as they do when a closure computes them inside the step (``ctx.grads_after``)."""
        if not self._schedule(ctx.step):  # a step scheduled only for S_k's snapshot, taken in after()
            return
        self.window.tick()
        if ctx.manual or ctx.grads_after:  # the gradients are not this step's yet: after() reads them
            self._early_window = self.window.next(ctx.tracked, self._resident_bytes(ctx.tracked), timed=False)
            if self._needs_old:
                self.snapshot.take([ctx.tracked[i].local() for i in self._early_window], self._finish_pass)
            return
        self._grads(ctx, snapshot=True)

    def _grads(self, ctx: StepContext, snapshot: bool) -> None:
        tracked = ctx.tracked
        rec = Record(ctx.step, ctx.stage, tracked)
        early, self._early_window = self._early_window, None
        t0 = time.perf_counter()
        if early is not None and not snapshot:
            rec.window = early
        else:
            rec.window = self.window.next(tracked, self._resident_bytes(tracked))
        rec.chunk_elems = self.window.chunk
        notice = self.window.take_notice()
        if notice is not None:  # the ranks' windows may part from here: said once, as an event of this record
            warn(f"dynascope: {notice}", RuntimeWarning, stacklevel=2)
            rec.notes.append(("probe_error", notice))
        with_grad, grads = [], []
        for i, t in enumerate(tracked):
            g = t.grad()
            if g is not None:
                with_grad.append(i)
                grads.append(g)
        # A model over several devices in one process (device_map="auto"): the record's values gather on an
        # accelerator, so its one copy to the host stays asynchronous
        device = next((g.device for g in grads if g.device.type != "cpu"), torch.device("cpu"))
        given: dict[str, tuple[torch.Tensor, ...]] = {}  # batched results by column: 0-d views per gradient
        in_window = set(rec.window)
        unscale = Unscale(ctx, device)
        if ctx.scale_unknown is not None:
            rec.notes.append(("grad_scale_unknown", ctx.scale_unknown))
        for p in self.grad_passes:
            if p.batched:
                res = p.run_batched(grads).to(device)
                # the passes after it get the norms of the gradients they read (still scaled, like them)
                given.update((c, res[:, j].unbind()) for j, c in enumerate(p.outputs))
                rec.add(p.key, p.outputs, with_grad, unscale(p.outputs, res))
                continue
            pos = [k for k, i in enumerate(with_grad) if p.tier == "every" or i in in_window]
            pos = [k for k in pos if all(g in given for g in p.given)]
            items = [Item({"grad": flat_reader(grads[k])}, grads[k].numel(),
                          {g: _on(given[g][k], grads[k].device) for g in p.given}) for k in pos]
            rec.add(p.key, p.outputs, [with_grad[k] for k in pos],
                    unscale(p.outputs, p.run_many(items, self.settings, chunk_elems=rec.chunk_elems).to(device)))
        if ctx.found_inf is not None:  # a fused step under a GradScaler: a no-op where the scaler found Inf/NaN
            rec.found_inf = ctx.found_inf
        del grads, given
        if snapshot and rec.window and self._needs_old:  # after the gradient counts, whose temporaries are gone
            self.snapshot.take([tracked[i].local() for i in rec.window], self._finish_pass)
        self._rec = rec
        if rec.window:
            self.window.charge(t0)

    @torch.no_grad()
    def after(self, ctx: StepContext) -> Callable[[], Rows] | None:
        """Post-step half: the weight statistics of the step (‖W‖, ΔW, drift, S_k), packed into one host vector."""
        if not self._schedule(ctx.step):
            self._pass.wait()
            self._snapshot(ctx.step, ctx.tracked, [t.local() for t in ctx.tracked])
            return None
        if ctx.manual or ctx.grads_after:
            self._grads(ctx, snapshot=False)
        rec, self._rec = self._rec, None
        if rec is None:
            return None
        rec.update_keys = [p.key for p in self.weight_passes if "old" in p.inputs]
        tracked = rec.tracked
        locals_ = LocalViews(tracked)
        device = locals_[0].device if tracked else torch.device("cpu")
        every_tensor = self._records % self.w_norm_every == 0 or len(rec.window) == len(tracked)
        self._records += 1
        inputs, held = self._inputs(rec, ctx, locals_)
        # Which tensors each chunked pass covers: its tier's tensors whose inputs this record holds (the
        # weights after the step always; asking for them first would make a view of every tensor).
        tiers = {"window": rec.window, "every": range(len(tracked)),
                 "cadence": range(len(tracked)) if every_tensor else rec.window}
        plans = [(p, [i for i in tiers[p.tier] if all(n == "new" or inputs[n](i) is not None for n in p.inputs)]
                  if held.issuperset(p.inputs) else []) for p in self.weight_passes if not p.batched]
        batched = []
        for p in self.weight_passes:  # batched (‖W‖): not for the tensors a chunked pass gives it to
            if p.batched:
                covered = {i for q, rows in plans if set(p.outputs) <= set(q.outputs) for i in rows}
                batched.append((p, [i for i in tiers[p.tier] if i not in covered]))
        read = sorted({i for _, rows in plans + batched for i in rows})
        # Beside the next forward only at full coverage: a windowed record's small pass on a third thread stalled
        # the forward's intra-op threads at their barriers on 2 cores (default set 1.17x vs 0.99x inline).
        background = device.type == "cpu" and not ctx.manual and len(rec.window) == len(tracked)
        # With every tensor in the record and the next step recorded, the pass copies W_t into the arena as
        # the next pre-step snapshot (weight_pass), where the spectra can read it while the next step runs.
        carry = self._needs_old and background and bool(rec.window) and bool(self._schedule(ctx.step + 1))
        before = versions([locals_[i] for i in read])
        self._carry_step = ctx.step if carry else None
        step = ctx.step

        def job() -> None:
            weight_pass(self, rec, plans, batched, inputs, locals_, step, carry)
            changed = {i for i, v0, v1 in zip(read, before, versions([locals_[i] for i in read]), strict=True) if v0 != v1}
            if changed:  # written by something other than the optimizer while the pass read them: no values
                rec.drop_rows([p.key for p, _ in plans + batched], changed)
                rec.notes.append(("weights_changed", f"weights of {len(changed)} tensors changed between the "
                                  f"optimizer step and the end of the probe's pass (e.g. {tracked[min(changed)].name}): "
                                  "their weight statistics are NULL at this step"))
            rec.pack(device)
        # On a host the pass runs beside the next forward; the next step's pre-hook waits for it (background.py).
        if background:
            rec.done = self._pass.submit(job)
        else:
            job()
        return _RecordRows(self, rec)

    def _inputs(self, rec: Record, ctx: StepContext,
                locals_: LocalViews) -> tuple[dict[str, Callable[[int], Reader | None]], set[str]]:
        """Per input, tracked index → a reader of its flat elements, or None where this record lacks it; and
        the inputs this record holds for some tensor."""
        tracked, window = rec.tracked, rec.window
        old: dict[int, torch.Tensor] = {}
        if self.snapshot.pending:
            old = dict(zip(window, self.snapshot.pop(len(window)), strict=True))
        due: set[int] = set()
        if ctx.reference is not None and any("ref" in p.inputs for p in self.weight_passes):
            full = len(window) == len(tracked)
            due = {i for i in window if self.window.drift_due(tracked[i].name, full)}
        hist = self.history
        k_due = hist is not None and hist.due(ctx.step)
        held = {n for n, has in (("new", True), ("old", bool(old)), ("ref", bool(due)), ("k_snapshot", k_due)) if has}
        return {
            "new": lambda i: flat_reader(locals_[i]),
            "old": lambda i: flat_reader(old[i]) if i in old else None,
            "ref": lambda i: ctx.reference.reader(tracked[i].name, locals_[i]) if i in due else None,
            "k_snapshot": lambda i: hist.reader(normalize_name(tracked[i].name), locals_[i])  # type: ignore[union-attr]
            if k_due else None,
        }, held

    def resolve_many(self, results: list[Any]) -> list[Rows]:
        """One batch of rows for each run of consecutive records of one tracked list (usually all of them)."""
        out: list[Rows] = []
        group: list[Record] = []
        for res in [*results, None]:
            rec = res.rec if isinstance(res, _RecordRows) and res.probe is self else None
            if group and (rec is None or rec.tracked is not group[0].tracked):
                out.append(self._rows(group))
                group = []
            if rec is not None:
                group.append(rec)
            elif res is not None:
                out.append(resolved_rows(res))
        return out

    def _rows(self, recs: list[Record]) -> Rows:
        """The ``tensor_stats`` batch of consecutive records, and an ``events`` row per note they carry."""
        rows: dict[str, Any] = {"tensor_stats": tensor_stats_batch(recs, self._tracked_columns(recs[0].tracked))}
        notes = [(r, kind, n) for r in recs for kind, n in r.notes]
        if notes:
            rows["events"] = {"step": [r.step for r, _, _ in notes], "time_us": [r.time_us for r, _, _ in notes],
                              "event": [k for _, k, _ in notes], "severity": "warning",
                              "message": [n for _, _, n in notes]}
        return rows

    def _tracked_columns(self, tracked: list[Tracked]) -> dict[str, Any]:
        """``tracked_columns(tracked)``, rebuilt only when the scope discovers a new tracked list (resolver
        thread: one per scope, so no lock)."""
        if self._columns is None or self._columns[0] is not tracked:
            self._columns = (tracked, tracked_columns(tracked))
        return self._columns[1]

    def _snapshot_due(self, step: int) -> bool:
        return self.history is not None and self.history.wanted(step, self._schedule)

    def _snapshot(self, step: int, tracked: list[Tracked], locals_: Sequence[torch.Tensor]) -> None:
        """S_k's next snapshot, when one is due: resident if the budget holds it beside a full window."""
        hist = self.history
        assert hist is not None
        t0 = time.perf_counter()  # charged to the time budget: the windowed statistics back off after it

        def named() -> list[tuple[str, torch.Tensor]]:  # a view of every weight: only when a snapshot is taken
            return [(normalize_name(t.name), w) for t, w in zip(tracked, locals_, strict=True)]
        if hist.refresh(step, self._schedule, named, lambda: self.history_resident(tracked, locals_)):
            self.window.charge(t0)

    def history_resident(self, tracked: list[Tracked], locals_: Sequence[torch.Tensor]) -> bool:
        """Whether the budget holds S_k's bf16 snapshot in memory beside a full window."""
        # bf16 bytes as the budget counts tensors (Tracked.nbytes), the same on every rank of a sharded run:
        # its ranks' windows are planned from the budget left (probes.window)
        total = sum(t.nbytes for t in tracked)
        need = self._k_bytes = sum(t.nbytes * 2 // w.element_size() for t, w in zip(tracked, locals_, strict=True))
        return self.memory_budget is None or self.memory_budget * total - self._resident_bytes(tracked) - need >= total

    def summarize(self, rows: Rows) -> dict[str, float]:
        return summarize(rows.get("tensor_stats", {}))

    def carries(self, step: int) -> bool:
        """Whether this step's queued weight pass copies every tracked tensor's W_t into the arena."""
        return self._carry_step == step

    def copies(self, step: int) -> dict[str, torch.Tensor] | None:
        """Tensor name → its W_t in the arena, once this step's weight pass has copied it there; valid on the
        pass thread until the next weight pass overwrites it (a pre-hook that copies into the arena itself
        first waits for every job, ``_finish_pass``). None where this step's pass copied nothing."""
        copies = self._copies
        return copies[1] if copies is not None and copies[0] == step else None

    def _finish_pass(self) -> None:
        self._pass.wait(everything=True)

    def discard(self) -> None:
        self._pass.wait(everything=True)
        self._rec, self._copies, self._carry_step = None, None, None
        self._early_window = None
        self.snapshot.reset()

    def close(self) -> None:
        self._pass.close()
        self._copies = None
        self.snapshot.close()
        self.window.close()
        if self.history is not None:
            self.history.drop()


def _on(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A given value where its gradient is (a copy only for a model over several devices, where a host
    gradient's threshold waits for its norm on the accelerator)."""
    return x if x.device == device else x.to(device)


class _RecordRows:
    """What ``after`` returns: the record, resolved alone when called, or with others by ``resolve_many``."""

    __slots__ = ("probe", "rec")

    def __init__(self, probe: TensorStats, rec: Record) -> None:
        self.probe, self.rec = probe, rec

    def __call__(self) -> Rows:
        return self.probe._rows([self.rec])
