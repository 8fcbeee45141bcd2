"""The one protocol every probe follows: when it runs, its two halves around the optimizer step, its rows.

Cockpit's shape for quantities that span an update. For each step the scope asks every probe
``schedule(step)``; the probes that answer True get ``before(ctx)`` in the optimizer's step pre-hook
(pre-step weights and gradients are there) and ``after(ctx)`` in its post-hook (or, without an
optimizer, both at the ``scope.step()`` boundary). ``after`` returns the rows the probe produced:
``{table: {column: list | scalar}}``, or a callable that returns them, which the resolver thread calls
so that waiting for the device happens off the training thread; that thread collects a few seconds of
steps and hands each probe their results together (``resolve_many``). ``summarize(rows)`` gives the compact
numbers listeners (the wandb mirror) receive; ``close()`` releases what the probe holds.

``watch()`` composes a list of these. A probe never raises into training: the scope guards every call,
and a failure becomes a warning and a ``probe_error`` event naming ``probe.name``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynascope.probes.params import Tracked

__all__ = ["Listener", "Probe", "Rows", "StepContext", "join_rows", "resolved_rows"]

Rows = dict[str, dict[str, Any]]  # table -> columns of that table (equal-length lists or scalars)
Listener = Callable[[int, dict[str, float]], None]


@dataclass
class StepContext:
    """What a probe sees at one step: its index and stage, the tracked tensors, θ₀ and the run."""

    step: int
    stage: str | None
    tracked: list[Tracked]
    reference: Any = None  # dynascope.probes.reference.Reference or None
    manual: bool = False  # no optimizer: ``before`` and ``after`` both run at the scope.step() boundary
    # optimizer.step(closure): the closure computes the gradients inside the step (LBFGS, Lightning's
    # automatic optimization), so before the step they are the last step's; read them after it
    grads_after: bool = False
    # The loss scale still in ``.grad`` at the pre-hook: a fused optimizer under ``torch.amp.GradScaler``
    # gets the scale (``optimizer.grad_scale``) and unscales inside its kernel, so the gradients the probe
    # reads are scaled. ``found_inf``: the scaler's device flag; the fused step is a no-op where it is set.
    grad_scale: Any = None
    found_inf: Any = None
    # Why the gradients' scale cannot be known (an optimizer handed the scaler itself), or None
    scale_unknown: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Probe:
    """Base class with the protocol's defaults: scheduled every step, no rows, nothing to release."""

    name = "probe"

    def schedule(self, step: int) -> bool:
        return True

    def before(self, ctx: StepContext) -> None:
        """Pre-step half (optimizer step pre-hook)."""

    def after(self, ctx: StepContext) -> Rows | Callable[[], Rows] | None:
        """Post-step half: the rows produced, or a callable run on the resolver thread that returns them."""
        return None

    def resolve_many(self, results: list[Rows | Callable[[], Rows]]) -> list[Rows]:
        """Rows of several steps' ``after`` results, in step order, each list item one batch for the writer.

        The resolver thread hands a probe the results of the steps it collected (a few seconds' worth) at
        once; a probe whose rows convert faster together than one step at a time overrides this. By default
        each step's rows are made, and consecutive steps' rows of a table are joined (``join_rows``)."""
        return join_rows([resolved_rows(r) for r in results])

    def summarize(self, rows: Rows) -> dict[str, float]:
        """Compact numbers for listeners from this probe's resolved rows of one step."""
        return {}

    def discard(self) -> None:
        """Forget a half-done step (``before`` ran but ``after`` cannot)."""

    def close(self) -> None:
        """Release threads, files and buffers."""


def resolved_rows(result: Rows | Callable[[], Rows]) -> Rows:
    """The rows of one ``after`` result: the rows themselves, or what the callable returns."""
    return result() if callable(result) else result


def join_rows(rows_list: list[Rows]) -> list[Rows]:
    """``rows_list`` with consecutive batches of one table joined when they have the same columns, each a
    list or a scalar: the writer's flush has a cost per batch it holds (~0.05 ms), and a probe
    writes a few rows a step. Batches of other shapes (arrays, ragged lists) stay as they are."""
    out: list[Rows] = []
    open_: dict[str, tuple[tuple[str, ...], dict[str, list]]] = {}  # table -> (its columns, the joined batch)
    for rows in rows_list:
        for table, cols in rows.items():
            n = _length(cols)
            keys = tuple(cols)
            joined = open_.get(table)
            if n is None or joined is None or joined[0] != keys:
                if n is None:  # not joinable: written as it is, after what was joined before it
                    open_.pop(table, None)
                    out.append({table: cols})
                    continue
                joined = open_[table] = (keys, {k: [] for k in keys})
                out.append({table: joined[1]})
            for k, v in cols.items():
                if isinstance(v, list):
                    joined[1][k].extend(v)
                else:
                    joined[1][k].extend([v] * n)
    return out


def _length(cols: dict[str, Any]) -> int | None:
    """Rows in a batch of lists and scalars (1 when every column is a scalar); None for any other batch."""
    n = None
    for v in cols.values():
        if isinstance(v, list):
            if n is not None and len(v) != n:
                return None
            n = len(v)
        elif not (v is None or isinstance(v, (int, float, str, bool))):
            return None
    return 1 if n is None else n
