"""The rollup compaction keeps across ranks: ``tensor_stats_by_tensor``, one row per (step, tensor).

The writer's rollups (``rollup.py``) pool one process's rows, so under FSDP a (step, tensor) still has a
row per rank in every table: 14.8M ``tensor_stats`` rows at 1,024 ranks × 50 records of 291 tensors,
which the delta-sync and per-layer analyses and the layer heat map of a short run read in full. Once
every writer of a run is done, ``dynascope compact`` pools the run's rows across ranks:

- each (step, tensor) becomes one row, the canonical view's (``tensor_stats_global``, ``store.pooling``):
  a sharded tensor's shards pooled, a replicated one's lowest rank, a replayed step's latest process;
  ``rank`` is the lowest rank that held it.

Each row holds the pooled sums of the other rollups (``store.schema.POOLED``; ``tensors`` counts the
``tensor_stats`` rows it stands for, replicas and replaced rows included) and what the delta-sync pricing
needs beyond them (``bf16_rows``, ``drift_zero_numel``, ``bitmap_bytes``). Sums of squares and counts pool exactly, so any query that sums ``tensor_stats_global``
rows per step or coarser gets the same answer from it.

It is written into ``tensor_stats_by_tensor/writer=_merged/`` like a merged segment, numbered to cover any
earlier one, and it counts for a run only while it pooled every row the run has: ``covers`` compares
its ``tensors`` with the run's ``tensor_stats`` rows (a count, no scan of the values), so rows written after
it (a writer back from a crash, a resumed run) send queries back to ``tensor_stats`` until the next
compaction rebuilds it.
"""

from __future__ import annotations

import os
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq

from dynascope.store._columns import parquet_options
from dynascope.store.layout import HEARTBEATS, MERGED, is_writer_dir, segment_name
from dynascope.store.pooling import global_sql
from dynascope.store.reader import StoreConnection, open_store, quote_literal
from dynascope.store.runfiles import RunFiles
from dynascope.store.schema import POOLED, TABLES, sql_type

__all__ = ["BY_TENSOR", "all_done", "covers", "pooled_sql", "refresh"]

BY_TENSOR = "tensor_stats_by_tensor"
_BY_NAME = {p[0]: p for p in POOLED}


def pooled_sql(name: str) -> str:
    """The aggregate over ``tensor_stats`` rows that gives the rollups' pooled column ``name``: Σx², Σx,
    max, or Σnumel where the count (or the column named by ``where``) is not NULL."""
    _, how, src, where = _BY_NAME[name]
    x = {"sq": f"{src} * {src}", "sum": src, "max": src, "numel": "numel"}[how]
    cond = where if where is not None else src if how == "numel" else None
    x = f"CASE WHEN {cond} IS NOT NULL THEN {x} END" if cond is not None else x
    return f"{'max' if how == 'max' else 'sum'}({x})"


def _build_sql(run: str) -> str:
    """The run's rows of ``tensor_stats_by_tensor``: the canonical rows (``store.pooling``, one per step and
    tensor) as the rollups' pooled sums, each beside the count of ``tensor_stats`` rows it stands for."""
    schema = TABLES[BY_TENSOR]
    extra = {"tensors": "any_value(r.n)", "bf16_rows": "count(bf16_unchanged_count)",
             "drift_zero_numel": "sum(CASE WHEN drift_zero_count IS NOT NULL THEN numel END)",
             "bitmap_bytes": "sum(ceil(numel / 8.0))", "rank": "any_value(r.rank)", "time_us": "max(time_us)",
             "sharded": "coalesce(sharded, false)"}
    keys = ["run_id", "role", "step", "stage", "tensor", "layer", "kind", "dtype"]
    cols = [f"CAST({extra.get(f.name) or (f'g.{f.name}' if f.name in keys else pooled_sql(f.name))} "
            f"AS {sql_type(f.type)}) AS {f.name}" for f in schema]
    one_run = f"(SELECT * FROM tensor_stats WHERE run_id = {quote_literal(run)})"
    return f"""
        WITH g AS ({global_sql(one_run)}),
        r AS (SELECT run_id, role, stage, step, tensor, count(*) AS n, min(rank) AS rank FROM {one_run} t
              WHERE step IS NOT NULL AND tensor IS NOT NULL GROUP BY ALL)
        SELECT {', '.join(cols)} FROM g JOIN r ON g.run_id = r.run_id AND g.role IS NOT DISTINCT FROM r.role
              AND g.stage IS NOT DISTINCT FROM r.stage AND g.step = r.step AND g.tensor = r.tensor
        GROUP BY {', '.join('g.' + k for k in keys)}, g.sharded"""


def covers(store: StoreConnection, run: str | None) -> bool:
    """Whether ``tensor_stats_by_tensor`` pooled every ``tensor_stats`` row of ``run`` (every run: None)
    as the store stands now, so queries may read it instead."""
    where = "" if run is None else f" WHERE run_id = {quote_literal(run)}"
    pooled = dict(store.rows(f"SELECT run_id, sum(tensors) FROM {BY_TENSOR}{where} GROUP BY run_id"))
    if not pooled:  # never compacted since it finished (or live): no count of tensor_stats needed
        return False
    return pooled == dict(store.rows(f"SELECT run_id, count(*) FROM tensor_stats{where} GROUP BY run_id"))


def refresh(files: RunFiles, settle_us: int) -> int:
    """Write the run's ``tensor_stats_by_tensor`` if it does not pool every ``tensor_stats`` row the run
    holds now (the caller checked that no writer of the run writes any more); returns the new file's
    valid_from (µs), 0 if none was written."""
    with open_store(files.run_dir) as store:
        runs = [r for (r,) in store.rows("SELECT DISTINCT run_id FROM tensor_stats WHERE run_id IS NOT NULL")]
        stale = [r for r in runs if not covers(store, r)]
        if not stale:
            return 0
        table = pa.concat_tables([store.arrow(_build_sql(r)) for r in stale]).cast(TABLES[BY_TENSOR])
        if len(stale) < len(runs):  # keep the other runs' rows of the file this one replaces
            table = pa.concat_tables([store.arrow(f"SELECT * FROM {BY_TENSOR} WHERE run_id NOT IN "
                                                  f"({', '.join(quote_literal(r) for r in stale)})")
                                     .cast(TABLES[BY_TENSOR]), table])
    mdir = files.run_dir / BY_TENSOR / MERGED
    mdir.mkdir(parents=True, exist_ok=True)
    # Numbered to cover every earlier rollup file of the run (the live-segment rule then reads this one).
    hi = max((h for _, h, _ in files.segs.get(mdir, [])), default=-1) + 1
    tmp = mdir / f".rollup-{uuid.uuid4().hex[:12]}.tmp"
    try:
        pq.write_table(table, tmp, **parquet_options(table.schema))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        valid_us = time.time_ns() // 1000 + settle_us
        os.replace(tmp, mdir / segment_name(0, hi, valid_us))
    finally:
        tmp.unlink(missing_ok=True)
    return valid_us


def all_done(files: RunFiles, done: dict[str, bool]) -> bool:
    """No writer of the run writes any more: every writer directory's and heartbeat's writer is ``done``."""
    ids = {w.name.removeprefix("writer=") for w in files.segs if is_writer_dir(w.name)}
    ids |= {p.stem for p in (files.run_dir / HEARTBEATS).glob("*.json")}
    return bool(done) and ids <= set(done)
