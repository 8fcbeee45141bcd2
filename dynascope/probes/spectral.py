"""The spectral probe: the low-rank summary of W_t − W_0 (``stats.spectra``) on a schedule.

On a host, a record's spectra (two or three randomized SVDs per 2-D weight: seconds for a 135M-parameter
model) run on the post-step pass thread (``probes.background``) while the next forward and backward run,
as the weight statistics do: W_t holds still until the next optimizer step, whose pre-hook waits for them
(``schedule``), and that wait is the probe's time in the step. A tensor whose weights user code changed
in between (its version counter moved) loses its row, with a ``weights_changed`` event.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dynascope.core.clock import now_us
from dynascope.probes.background import PassThread, versions
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
                 *, niter: int = 4, oversample: int = 8, dtype: torch.dtype = torch.float32,
                 passes: PassThread | None = None) -> None:
        super().__init__(k, time_budget, niter=niter, oversample=oversample, dtype=dtype)
        self._schedule = schedule if schedule is not None else every(10)
        self._pass = passes if passes is not None else PassThread()  # shared with the weight pass by watch()

    def schedule(self, step: int) -> bool:
        self._pass.wait()  # the previous record's spectra read W_t: done before the optimizer changes it
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

        def job() -> Rows:
            rows = self.record(step, stage, named, lazy)
            changed = {n for (n, w), v in zip(named, before, strict=True) if w._version != v}
            return _rows([r for r in rows if r["tensor"] not in changed], sorted(changed), step)
        fut = self._pass.submit(job)
        return lambda: fut.result()

    def discard(self) -> None:
        self._pass.wait()

    def close(self) -> None:
        self._pass.wait()

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
