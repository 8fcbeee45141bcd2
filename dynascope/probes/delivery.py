"""Where the probes' results go once the resolver thread has them: rows to the writer, summaries to listeners.

The scope hands each step's ``(probe, after() result)`` pairs to the resolver thread, which calls
``Delivery.deliver`` with the steps it collected. Each probe converts its results of all of them at once
(``Probe.resolve_many``); listeners get one summary per step, so with a listener attached the steps
resolve one by one. A failure is reported through the scope (a warning and a ``probe_error`` event) and
costs only the step it happened in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dynascope.probes.protocol import Listener, Probe, Rows, resolved_rows
from dynascope.store.writer import RunWriter

__all__ = ["Delivery", "StepResults"]

# one recorded step as the resolver holds it: (step, stage, [(probe, what its after() returned)])
StepResults = tuple[int, str | None, list[tuple[Probe, Any]]]


class Delivery:
    """Writes resolved rows to ``writer`` and calls ``listeners`` with each step's summary."""

    def __init__(self, writer: RunWriter, report: Callable[[str, BaseException], None]) -> None:
        self.writer = writer
        self.report = report
        self.listeners: list[Listener] = []

    def deliver(self, items: list[StepResults]) -> None:
        """Rows of the steps the resolver collected, each probe's converted together."""
        if self.listeners or len(items) == 1:
            for item in items:
                self.deliver_step(*item)
            return
        results: dict[int, tuple[Probe, list[Any]]] = {}
        for _, _, out in items:
            for p, res in out:
                results.setdefault(id(p), (p, []))[1].append(res)
        for p, batch in results.values():
            try:
                rows_list = p.resolve_many(batch)
            except Exception as exc:  # report it, then resolve step by step: one bad step costs only itself
                self.report(f"resolve:{p.name}", exc)
                rows_list = [rows for res in batch if (rows := self._rows_or_none(p, res))]
            for rows in rows_list:
                self._write(rows)

    def deliver_step(self, step: int, stage: str | None, out: list[tuple[Probe, Any]]) -> None:
        """One step's rows, and its summary to every listener."""
        summary: dict[str, float] = {}
        for p, res in out:
            try:
                rows: Rows = resolved_rows(res)
                self._write(rows)
                if self.listeners:
                    summary.update(p.summarize(rows))
            except Exception as exc:
                self.report(f"resolve:{p.name}", exc)
        if out:
            for fn in list(self.listeners):
                try:
                    fn(step, summary)
                except Exception as exc:
                    self.report(f"listener:{getattr(fn, '__name__', type(fn).__name__)}", exc)

    def _rows_or_none(self, p: Probe, res: Any) -> Rows | None:
        try:
            return resolved_rows(res)
        except Exception as exc:
            self.report(f"resolve:{p.name}", exc)
            return None

    def _write(self, rows: Rows) -> None:
        for table, cols in rows.items():
            if cols:
                self.writer.append(table, cols)
