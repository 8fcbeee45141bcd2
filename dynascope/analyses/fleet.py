"""Fleet summary: one row per run of a store root, computed by DuckDB in this process or by Spark.

Both engines read the same files (the live segments of one ``Snapshot``) under the same table names and
run the same SQL (``fleet_sql``), so they return the same frame. What a file listing answers better than
SQL (status from the writers' heartbeats, ranks from their directories, the run's path) comes from the
snapshot's listing, the same for both engines.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl

from dynascope.analyses.fleet_sql import ended_sql, fleet_sql, update_ratio_sql
from dynascope.core.errors import UserError
from dynascope.store import quote_ident
from dynascope.store.catalog import ranks_of, run_status, writer_ids
from dynascope.store.engines import DuckDBTables, SparkTables, local_spark
from dynascope.store.layout import read_marker, safe_id
from dynascope.store.projection import spark_quote
from dynascope.store.reader import VANISHED_FROM_LIST, retry_vanished
from dynascope.store.snapshot import Snapshot, open_snapshot

__all__ = ["FLEET_COLUMNS", "fleet_summary"]

ENGINES = ("duckdb", "spark")
VANISHED_DEADLINE_S = 30.0
FLEET_COLUMNS: dict[str, Any] = {
    "run_id": pl.String, "name": pl.String, "status": pl.String, "steps": pl.Int64, "ranks": pl.Int64,
    "median_step_ms": pl.Float64, "all_steps_rollout_pct": pl.Float64, "slowest_rank": pl.Int64, "slowest_phase": pl.String,
    "straggler_score": pl.Float64, "median_bf16_unchanged_frac_rl": pl.Float64, "last_drift_unchanged_frac": pl.Float64,
    "last_rank1_energy": pl.Float64, "config_json": pl.String, "path": pl.String,
}


def fleet_summary(store: str | os.PathLike | Snapshot, engine: str = "duckdb", *, spark: Any = None,
                  progress: Callable[[int, int], None] | None = None) -> pl.DataFrame:
    """One row per run under ``store`` (a store root, a run directory, or a ``Snapshot`` of one).

    Columns: run_id, name, status (live | finished | crashed, as ``dynascope runs``), steps, ranks,
    median_step_ms (per step, the slowest rank's step time), all_steps_rollout_pct (rollout phases' share
    of the step time of every timed step of the run, SFT steps included: ``phase_shares`` summed over its
    stages, not the RL stage's share that the report and the demo give), slowest_rank, slowest_phase and straggler_score (``straggler_scores``'
    first row: the rank with the most time at stake and its score, 1 = as fast as the fastest rank),
    median_update_ratio_<stage> (per stage, the median over steps of ‖ΔW‖/‖W‖ pooled over tensors and
    ranks), median_bf16_unchanged_frac_rl (PULSE S₁ per RL step, pooled, median over the steps where
    every tensor has it), last_drift_unchanged_frac (Mukherjee et al.'s update sparsity at the last step
    where every tensor has it), last_rank1_energy (Σσ₁² / Σ‖ΔW‖²_F over the tensors of the last spectral
    record), config_json, path. NULL where a run did not record what a figure needs.

    ``engine``: "duckdb" or "spark" (``spark``: a SparkSession, else a local one). Give a ``Snapshot``
    taken with a lease for a Spark job that may outlive compaction's grace period; with a path, the store
    is listed now without a lease (this function writes nothing), and listed again if a fold deleted a
    listed segment before the engine read it. ``progress(done, total)`` follows the
    listing, run by run.
    """
    if engine not in ENGINES:
        raise UserError(f"unknown engine {engine!r} (duckdb or spark)")
    if isinstance(store, Snapshot):
        return _summary(store, engine, spark)
    # Listed without a lease: a fold that finishes meanwhile (a run's last writer closing, or compaction)
    # deletes segments the listing named. Listing again reads the merged files instead: the same rows.
    return retry_vanished(lambda: _summary(open_snapshot(store, lease_ttl_s=None, progress=progress), engine, spark),
                          deadline_s=VANISHED_DEADLINE_S, vanished=VANISHED_FROM_LIST)


def _summary(snap: Snapshot, engine: str, spark: Any) -> pl.DataFrame:
    tables: DuckDBTables | SparkTables
    if engine == "duckdb":
        tables, q = DuckDBTables(snap), quote_ident
    else:
        tables, q = SparkTables(spark if spark is not None else local_spark(), snap), spark_quote
    try:
        figures = _frame(*tables.rows(fleet_sql(q)))
        ratios = _frame(*tables.rows(update_ratio_sql(q)))
        ended = _frame(*tables.rows(ended_sql(q)))
    finally:
        tables.close()
    return _assemble(snap, figures, ratios, ended)


def _frame(columns: list[str], rows: list[tuple]) -> pl.DataFrame:
    return pl.DataFrame(rows, schema=columns, orient="row", infer_schema_length=None)


def _assemble(snap: Snapshot, figures: pl.DataFrame, ratios: pl.DataFrame, ended: pl.DataFrame) -> pl.DataFrame:
    """The engine's figures joined to what the listing says about each run, in a fixed column order."""
    closed: dict[str, set[str]] = {}
    for run_id, writer in ended.iter_rows():
        closed.setdefault(run_id, set()).add(writer)
    dirs: dict[Path, set[str]] = {}
    for e in snap.listing:  # <run>/<table or _commits>/writer=<id>/<file>
        wdir = Path(e.path).parent
        dirs.setdefault(wdir.parent.parent, set()).add(wdir.name)
    listed = []
    for run_dir in snap.location.run_dirs:
        run_id = str(read_marker(run_dir).get("run_id", run_dir.name))
        w = writer_ids(run_dir, dirs.get(run_dir, set()))
        listed.append((run_id, run_status(run_dir, w, closed.get(run_id, set())), len(ranks_of(w)), str(run_dir)))
    runs = pl.DataFrame(listed, schema={"run_id": pl.String, "status": pl.String, "ranks": pl.Int64,
                                        "path": pl.String}, orient="row")
    stage_cols = {}
    if ratios.height:
        for stage in sorted({s for s in ratios["stage"].to_list()}, key=lambda s: (s is None, s or "")):
            col = f"median_update_ratio_{safe_id(stage).lower() if stage is not None else 'unstaged'}"
            sel = ratios.filter(pl.col("stage").is_null() if stage is None else pl.col("stage") == stage)
            stage_cols[col] = sel.select("run_id", pl.col("median_update_ratio").cast(pl.Float64).alias(col))
    empty = pl.DataFrame(schema={c: t for c, t in FLEET_COLUMNS.items() if c not in ("status", "ranks", "path")})
    figures = figures.cast({c: t for c, t in empty.schema.items() if c in figures.columns}) if figures.height else empty
    out = runs.join(figures, on="run_id", how="full", coalesce=True)
    for frame in stage_cols.values():
        out = out.join(frame, on="run_id", how="left")
    order = [*list(FLEET_COLUMNS)[:10], *stage_cols, *list(FLEET_COLUMNS)[10:]]
    return out.select([pl.col(c).cast(FLEET_COLUMNS.get(c, pl.Float64)) for c in order]).sort("run_id")
