"""The spectral probe: the low-rank summary of W_t − W_0 (``stats.spectra``) on a schedule."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dynascope.probes.protocol import Probe, Rows, StepContext
from dynascope.probes.reference import LazyRef
from dynascope.probes.schedule import every
from dynascope.stats.spectra import Spectra

__all__ = ["SpectralProbe"]


class SpectralProbe(Spectra, Probe):
    """Records the low-rank summary of W_t − W_0 for 2-D weights, on a schedule and a time budget.

    ``schedule(step) -> bool`` says when to record (default: every 10 steps); the other arguments are
    ``stats.spectra.Spectra``'s (k, time_budget, niter, oversample, dtype).
    """

    name = "spectral"

    def __init__(self, k: int = 8, time_budget: float | None = 0.05, schedule: Callable[[int], bool] | None = None,
                 *, niter: int = 4, oversample: int = 8, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(k, time_budget, niter=niter, oversample=oversample, dtype=dtype)
        self._schedule = schedule if schedule is not None else every(10)

    def schedule(self, step: int) -> bool:
        return self.due(step)

    def after(self, ctx: StepContext) -> Rows | None:
        """The ``spectra`` rows of this step's record (θ₀ of each 2-D weight read only if it is reached)."""
        ref = ctx.reference
        if ref is None:
            return None
        named = [(t.name, t.local()) for t in ctx.tracked if t.local().ndim == 2]
        lazy = {n: LazyRef(ref, n, w) for n, w in named if ref.has(n)}
        rows = self.record(ctx.step, ctx.stage, named, lazy)
        return {"spectra": {k: [r.get(k) for r in rows] for k in rows[0]}} if rows else None

    def summarize(self, rows: Rows) -> dict[str, float]:
        energies = [e for e in rows.get("spectra", {}).get("rank1_energy", []) if e is not None]
        return {"spectral/rank1_energy": float(sum(energies) / len(energies))} if energies else {}

    def due(self, step: int) -> bool:
        """Whether the schedule asks for a record at ``step`` (never raises)."""
        try:
            return bool(self._schedule(step))
        except Exception:
            return False

