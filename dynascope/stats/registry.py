"""The declared statistics: the built-in ones, then those of the modules ``DYNASCOPE_STATISTICS`` names.

Every module of ``dynascope/stats/builtin/`` is a statistic family and declares ``STATISTICS``, a tuple of
``Statistic``; the ones in ``BUILTIN`` come first in that order, any other file of that folder after
them, by name, so a new statistic is one new file there. A user's statistics live in their own module,
named (comma-separated) in the environment variable ``DYNASCOPE_STATISTICS`` of every process that
writes or reads the run: the trainer, ``dynascope dashboard``, the CLI (see docs/statistics.md).

The registry is read once, when ``dynascope.store`` is first imported, and never changes afterwards:
the ``tensor_stats`` table, its rollups, the row derivation and the dashboard's pooled figures all come
from ``REGISTRY``. Nothing here imports torch.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from pathlib import Path

from dynascope.core.errors import UserError
from dynascope.stats.base import INPUTS, TENSOR_COLUMNS, Column, Figure, Statistic

__all__ = ["BUILTIN", "ENV", "REGISTRY", "Registry"]

BUILTIN = ("weights", "update", "signs", "bf16_visibility", "drift", "drift_sparsity", "grad")
ENV = "DYNASCOPE_STATISTICS"
_REDUCE = ("sum", "norm", "max")
_POOL = ("sq", "sum", "max", "numel")


def _modules() -> list[str]:
    found = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent / "builtin")])
                   if not m.name.startswith("_"))
    names = [f"dynascope.stats.builtin.{m}" for m in BUILTIN + tuple(m for m in found if m not in BUILTIN)]
    return names + [m.strip() for m in os.environ.get(ENV, "").split(",") if m.strip()]


def _load(modules: list[str]) -> list[Statistic]:
    out: list[Statistic] = []
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:
            raise UserError(f"{ENV}: cannot import statistics module {name!r} ({exc})") from None
        stats = getattr(mod, "STATISTICS", None)
        if not isinstance(stats, tuple) or not all(isinstance(s, Statistic) for s in stats):
            raise UserError(f"statistics module {name!r} must declare STATISTICS, a tuple of Statistic")
        out.extend(stats)
    return out


class Registry:
    """The declared statistics and everything derived from them.

    ``columns``: the stored ``tensor_stats`` columns after (run_id, rank, role, step, time_us, stage), the
    tensor's description first; ``column``: every declared column by name, partial results included;
    ``pooled``: the rollup columns as (rollup column, how, source column, where); ``figures``: the pooled
    figures; ``summary``: the columns listeners get per-kind means of.
    """

    def __init__(self, statistics: list[Statistic]) -> None:
        self.statistics = tuple(statistics)
        declared = TENSOR_COLUMNS + tuple(c for s in self.statistics for c in s.columns)
        self.column: dict[str, Column] = {}
        for c in declared:
            if c.name in self.column:
                raise UserError(f"tensor_stats column {c.name!r} is declared twice")
            self.column[c.name] = c
        self.columns = tuple(c for c in declared if c.stored)
        self.pooled = tuple((name, how, c.name, where) for c in self.columns for name, how, where in c.pool)
        self.figures: tuple[Figure, ...] = tuple(f for s in self.statistics for f in s.figures)
        self.summary = tuple(c.name for c in self.columns if c.summary)
        self._check()

    def reading(self, *inputs: str) -> tuple[Statistic, ...]:
        """The statistics with a chunk kernel that read exactly ``inputs`` (in any order)."""
        want = set(inputs)
        return tuple(s for s in self.statistics if s.kernel is not None and set(s.inputs) == want)

    def _check(self) -> None:
        """Every name a declaration uses refers to a declared column, so a typo fails at import, once."""
        col = self.column
        outputs = {o for s in self.statistics for o in s.outputs}

        def need(name: str | None, what: str) -> None:
            if name is not None and name not in col:
                raise UserError(f"{what} names {name!r}, which no statistic declares")

        for s in self.statistics:
            for o in s.outputs:
                need(o, f"statistic {s.name}'s output")
                if col[o].reduce not in _REDUCE:
                    raise UserError(f"output {o} of {s.name} must declare reduce in {_REDUCE}, not {col[o].reduce!r}")
            for g in s.given:
                if g not in outputs:
                    raise UserError(f"statistic {s.name} is given {g!r}, which no statistic outputs")
            for i in s.inputs:
                assert i in INPUTS
        for c in col.values():
            for ref in (c.frac_of, c.flag_of, c.zero_where_finite, *(c.ratio or ())):
                need(ref, f"column {c.name}")
            for _, how, where in c.pool:
                need(where, f"column {c.name}'s pool")
                if how not in _POOL:
                    raise UserError(f"column {c.name}: pool how must be one of {_POOL}, not {how!r}")
        names = [p[0] for p in self.pooled]
        if len(set(names)) != len(names):
            raise UserError(f"a rollup column is declared twice: {sorted({n for n in names if names.count(n) > 1})}")
        pooled = set(names)
        for f in self.figures:
            for name in (f.num, f.den):
                if name not in pooled:
                    raise UserError(f"figure {f.name} pools {name!r}, which no column's pool declares")


REGISTRY = Registry(_load(_modules()))
