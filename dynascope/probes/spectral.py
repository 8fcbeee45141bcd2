"""The spectral probe: the low-rank summary of W_t − W_0 (``stats.spectra``) on a schedule.

On a host, a record's spectra (two or three randomized SVDs per 2-D weight: seconds for a 135M-parameter
model) run on the post-step pass thread (``probes.background``) while the next forward and backward run,
as the weight statistics do. Where that step's weight pass copies every W_t into the arena as the next
pre-step snapshot (full coverage, ``probes.weight_pass``), the spectra read those copies, which hold still
until the next weight pass, queued behind them on the same thread: the next optimizer step need not wait
for them, and they have two steps' forward and backward to run beside (a 135M model's 4 s of SVDs made
the next step wait up to 1.6 s on 2 cores; docs/benchmarks.md). Otherwise they read the live weights, and
the next step's pre-hook waits for them (``schedule``); that wait is then the probe's time in the step. A
tensor whose live weights user code changed meanwhile (its version counter moved) loses its row, with a
``weights_changed`` event.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from dynascope.core.clock import now_us
from dynascope.probes.background import PassThread, versions
from dynascope.probes.protocol import Probe, Rows, StepContext
from dynascope.probes.reference import LazyRef
from dynascope.probes.schedule import every
from dynascope.stats.spectra import Spectra

__all__ = ["Copies", "SpectralProbe"]


class Copies(Protocol):
    """What the spectra ask of the weight statistics (``probes.tensors.TensorStats``)."""

    def carries(self, step: int) -> bool: ...

    def copies(self, step: int) -> dict[str, torch.Tensor] | None: ...


class SpectralProbe(Spectra, Probe):
    """Records the low-rank summary of W_t − W_0 for 2-D weights, on a schedule and a time budget.

    ``schedule(step) -> bool`` says when to record (default: every 10 steps); the other arguments are
    ``stats.spectra.Spectra``'s (k, time_budget, niter, oversample, dtype).
    """

    name = "spectral"

    def __init__(self, k: int = 8, time_budget: float | None = 0.05, schedule: Callable[[int], bool] | None = None,
                 *, niter: int = 4, oversample: int = 8, dtype: torch.dtype = torch.float32,
                 passes: PassThread | None = None, weights: Copies | None = None) -> None:
        super().__init__(k, time_budget, niter=niter, oversample=oversample, dtype=dtype)
        self._schedule = schedule if schedule is not None else every(10)
        self._pass = passes if passes is not None else PassThread()  # shared with the weight pass by watch()
        self._weights = weights  # the weight statistics, whose pass may copy W_t (watch() links them)

    def schedule(self, step: int) -> bool:
        self._pass.wait()  # spectra that read the live W_t: done before the optimizer changes it
        return self.due(step)

    def after(self, ctx: StepContext) -> Rows | Callable[[], Rows] | None:
        """The ``spectra`` rows of this step's record (θ₀ of each 2-D weight read only if it is reached); on a
        host, computed on the pass thread and collected by the resolver."""
        ref = ctx.reference
        if ref is None:
            return None
        named = [(t.name, t.local()) for t in ctx.tracked if t.local().ndim == 2]
        lazy = {n: LazyRef(ref, n, w) for n, w in named if ref.has(n)}
        step, stage = ctx.step, ctx.stage
        if ctx.manual or any(w.device.type != "cpu" for _, w in named):
            return _rows(self.record(step, stage, named, lazy), []) or None
        before = versions([w for _, w in named])
        copied = self._weights is not None and self._weights.carries(step)

        def job() -> Rows:
            held = self._weights.copies(step) if copied else None  # type: ignore[union-attr]
            if held is not None and all(n in held for n, _ in named):
                return _rows(self.record(step, stage, [(n, held[n]) for n, _ in named], lazy), [], step)
            # The live weights (where the weight pass failed before its copies, the optimizer may be writing
            # them now: the version counters drop what it touched).
            rows = self.record(step, stage, named, lazy)
            changed = {n for (n, w), v in zip(named, before, strict=True) if w._version != v}
            return _rows([r for r in rows if r["tensor"] not in changed], sorted(changed), step)
        # The SVDs use the training thread's count of threads; a job on the copies does not hold the step.
        fut = self._pass.submit(job, threads=None, holds=not copied)
        return lambda: fut.result()

    def discard(self) -> None:
        self._pass.wait(everything=True)

    def close(self) -> None:
        self._pass.wait(everything=True)

    def summarize(self, rows: Rows) -> dict[str, float]:
        energies = [e for e in rows.get("spectra", {}).get("rank1_energy", []) if e is not None]
        return {"spectral/rank1_energy": float(sum(energies) / len(energies))} if energies else {}

    def due(self, step: int) -> bool:
        """Whether the schedule asks for a record at ``step`` (never raises)."""
        try:
            return bool(self._schedule(step))
        except Exception:
            return False



def _rows(rows: list[dict[str, Any]], changed: list[str], step: int = 0) -> Rows:
    out: Rows = {"spectra": {k: [r.get(k) for r in rows] for k in rows[0]}} if rows else {}
    if changed:
        out["events"] = {"step": step, "time_us": now_us(), "event": "weights_changed", "severity": "warning",
                         "message": f"weights of {len(changed)} tensors changed between the optimizer step and the end "
                                    f"of the spectra (e.g. {changed[0]}): no spectra row for them at this step"}
    return out
