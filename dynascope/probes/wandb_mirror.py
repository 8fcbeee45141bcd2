"""Mirror dynascope's compact per-step summary to the active wandb run: a listener of the scope.

``watch(..., wandb=True)`` (or ``DynascopeCallback(wandb=True)``) adds a ``WandbMirror`` to the scope; the
probes hold it, so every way into ``watch()`` has it, and wandb itself is imported only when it is made.
At the probe cadence it logs the summary dict — global and per-module-kind update ratio, sparsity, rank-1
energy, phase times — under ``dynascope/``, against its own x-axis ``dynascope/step`` so it never fights
the trainer's own wandb step counter. Per-tensor rows stay in the dynascope store: a summary with more than
``max_keys`` keys is cut (and says so once) rather than flooding the wandb run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dynascope.core.extras import require
from dynascope.core.warn import warn

__all__ = ["PREFIX", "STEP_KEY", "WandbMirror"]

PREFIX = "dynascope/"
STEP_KEY = PREFIX + "step"


class WandbMirror:
    """Listener ``fn(step, summary)`` that logs ``summary`` to ``wandb.run`` under ``dynascope/``.

    Args:
        run: a wandb run; default: whatever ``wandb.run`` is at each call (nothing is logged while none is active).
        max_keys: most summary keys logged per call; the summary is compact by contract, this is a guard.
    """

    def __init__(self, run: Any = None, *, max_keys: int = 256) -> None:
        self._wandb = require("wandb", "dynascope's wandb mirror")
        self._run = run
        self.max_keys = int(max_keys)
        self._defined: set[int] = set()  # ids of runs on which the dynascope/* step axis is declared
        self._warned: set[str] = set()
        self.logged = 0

    def _active_run(self) -> Any:
        return self._run if self._run is not None else getattr(self._wandb, "run", None)

    def __call__(self, step: int, summary: Mapping[str, Any]) -> None:
        run = self._active_run()
        if run is None:
            return
        try:
            data = self.payload(step, summary)
            if id(run) not in self._defined:
                # a custom x-axis: HF's WandbCallback and TRL log with their own step, which would otherwise
                # make wandb drop our rows as "steps out of order"
                run.define_metric(STEP_KEY)
                run.define_metric(PREFIX + "*", step_metric=STEP_KEY)
                self._defined.add(id(run))
            run.log(data)
            self.logged += 1
        except Exception as exc:  # a mirror must never break the training loop
            self._warn_once("log", f"dynascope: wandb mirror failed ({type(exc).__name__}: {exc}); continuing")

    def payload(self, step: int, summary: Mapping[str, Any]) -> dict[str, float]:
        """The dict logged for one call: finite numbers only, prefixed, plus the ``dynascope/step`` axis."""
        out: dict[str, float] = {STEP_KEY: int(step)}
        for key, value in summary.items():
            if len(out) > self.max_keys:
                self._warn_once("max_keys", f"dynascope: wandb mirror summary has more than {self.max_keys} keys; "
                                            "the rest stay in the dynascope store only")
                break
            number = _as_float(value)
            if number is not None:
                name = str(key)
                out[name if name.startswith(PREFIX) else PREFIX + name] = number
        return out

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warn(message, RuntimeWarning, stacklevel=3)


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    try:
        number = float(value)  # numbers, numpy scalars and one-element tensors all convert
    except (TypeError, ValueError, RuntimeError):
        return None
    return number if math.isfinite(number) else None
