"""How far each rank's wall clock was from its reference rank's, as the probe measured it in ``watch()``
(``probes.clocks``: barrier rounds over the ranks' gloo group). Every ``*_us`` column is its host's own clock,
so an offset shifts that rank's rows in any cross-rank timeline: the Perfetto export aligns tracks by these
offsets, and the report names an offset large enough to mislead (``findings_clock``)."""

from __future__ import annotations

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.store.clock_offsets import OFFSETS_SQL

__all__ = ["clock_offsets"]


def clock_offsets(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """One row per measured (run, role, rank): ``offset_ms`` (this rank's clock minus the reference rank's),
    ``uncertainty_ms`` (half the measurement rounds' range) and ``reference_rank``."""
    return frame(as_store(store), f"""
        SELECT run_id, role, rank, offset_us / 1000.0 AS offset_ms, spread_us / 2000.0 AS uncertainty_ms,
               reference_rank
        FROM ({OFFSETS_SQL}) WHERE true {run_clause(run)} ORDER BY run_id, role, rank""")
