"""Rollups of runs written before commit records, rebuilt when they do not account for their source rows.

A writer commits each flush's ``tensor_stats`` segment together with its rollup segments (``flush``), so a
process killed mid-flush leaves all of them or none, and nothing here applies to it. A writer that kept no
commit records (a run written by an earlier dynascope) may have died between a source segment and its
rollups, or with rollup writes failing, leaving rows out of the rollups for good: the dashboard, which
reads the rollups, would under-count them.

Rows carry no segment number, so which source a rollup row came from cannot be told once segments are
merged. Nothing is guessed: per writer, the rows each rollup step key accounts for (its ``tensors``
column) are compared with the source rows of that key; if they differ, the writer's whole rollup is
computed again from its sources, with the writer's own functions, into one merged segment that covers
every rollup segment of that writer (``0-<hi>.v<t>``), and the old ones are deleted after the grace period
like any merged-away segment. Only writers quiet for ``repair_after_s`` are rebuilt.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dynascope.core.errors import first_line
from dynascope.store._columns import parquet_options
from dynascope.store.layout import heartbeat_path, is_writer_dir, segment_name
from dynascope.store.projection import former_names
from dynascope.store.rollup import ROLLUPS
from dynascope.store.runfiles import FOREVER_US, RunFiles, Seg
from dynascope.store.schema import TABLES

# A writer whose newest source or heartbeat is this recent may still be writing rollups.
REPAIR_AFTER_S = 30.0
_BATCH = 262_144


@dataclass
class RepairResult:
    """What ``repair_rollups`` did for one run."""

    repaired: int = 0  # rollup segments rebuilt
    skipped: list[str] = field(default_factory=list)  # one line per writer directory left alone, and why
    held: set[str] = field(default_factory=set)  # writer directory names not checked or not rebuilt yet
    last_valid_us: int = 0  # when the last rebuilt segment takes effect


def repair_rollups(files: RunFiles, repair_after_s: float = REPAIR_AFTER_S, settle_us: int = 2_000_000) -> RepairResult:
    """Rebuild the rollups of every writer of the run that keeps no commit records and whose rollups do not
    account for its source rows; the rebuilt segment takes effect ``settle_us`` after it is written.

    ``writer=_merged`` holds the rows of writers checked before they were folded (``compact_across``), and a
    writer part of whose tables are folded already (a cover in its source or rollup directory) is left to
    finish folding: its source and rollup rows no longer sit in the directories compared here."""
    out = RepairResult()
    live = files.live(FOREVER_US)
    for source, rolls in ROLLUPS.items():
        # A run with no rows in a rollup was written before it existed: the dashboard reads the source (exact).
        rolls = tuple((n, r) for n, r in rolls if any(w.parent.name == n and w.name != "writer=_schema" and s
                                                     for w, s in files.segs.items()))
        for wdir, _, segs in files.writer_dirs() if rolls else ():
            if wdir.parent.name != source or wdir.name in files.keeps or not is_writer_dir(wdir.name):
                continue  # committed flushes: every source segment came with its rollups
            srcs = [s for s in segs if str(s[2]) in live]
            rdirs = [files.run_dir / name / wdir.name for name, _ in rolls]
            try:
                if not srcs or any(files.is_cover(s[2]) for d in [wdir, *rdirs] for s in files.segs.get(d, [])
                                   if str(s[2]) in live):
                    continue
                keys = [_step_rows(s[2]) for s in srcs]
            except OSError as exc:  # its rows cannot be counted, so nothing here can be checked
                out.skipped.append(f"{wdir}: rollups not checked: {first_line(exc)}")
                out.held.add(wdir.name)
                continue
            for name, roll in rolls:
                rdir = files.run_dir / name / wdir.name
                try:
                    if _accounted(keys, [s for s in files.segs.get(rdir, []) if str(s[2]) in live], source, roll):
                        continue
                    if _is_fresh(srcs, files.run_dir, wdir, repair_after_s):
                        out.skipped.append(f"{rdir}: does not account for every {source} row; rebuilt once the "
                                           f"writer is quiet for {repair_after_s:g} s")
                        out.held.add(wdir.name)
                        continue
                    valid = _rebuild(files, srcs, wdir, rdir, source, name, roll, settle_us)
                    out.repaired += 1
                    out.last_valid_us = max(out.last_valid_us, valid)
                except (OSError, ValueError, KeyError, pa.ArrowException) as exc:
                    out.skipped.append(f"{rdir}: rollup rebuild failed: {type(exc).__name__}: {first_line(exc)}")
                    out.held.add(wdir.name)
    return out


def _accounted(step_rows: list[Counter], rolls: list[Seg], source: str, roll: Callable[..., pa.Table]) -> bool:
    """Whether the rollup segments account for exactly the source rows of every rollup step key."""
    want: Counter = Counter()
    for counts in step_rows:
        want.update(_rollup_keys(counts, source, roll))
    got: Counter = Counter()
    for _, _, path in rolls:
        t = _read(path, ["step", "tensors"])
        got.update(_sum_by(t["step"], t["tensors"]))
    return +want == +got


def _rebuild(files: RunFiles, srcs: list[Seg], wdir: Path, rdir: Path, source: str, name: str,
             roll: Callable[..., pa.Table], settle_us: int) -> int:
    """One segment with the rollup of every source segment, batch by batch (a merged source of millions of
    rows fits in memory: a group split across batches is two rows, which pool like a step split across two
    flushes), covering every rollup segment the writer has."""
    writer_seqs = [hi for w, segs in files.segs.items() if w.name == wdir.name for _, hi, _ in segs]
    hi = max([*writer_seqs, *(h for _, h, _ in files.segs.get(rdir, []))]) + 1  # beyond any earlier rebuild
    rdir.mkdir(parents=True, exist_ok=True)
    tmp = rdir / f".rebuild-{uuid.uuid4().hex[:12]}.tmp"
    schema = TABLES[name]
    try:
        with pq.ParquetWriter(tmp, schema, **parquet_options(schema)) as out:
            for _, _, path in srcs:
                try:
                    for batch in pq.ParquetFile(path).iter_batches(batch_size=_BATCH):
                        out.write_table(conform(roll(conform(pa.Table.from_batches([batch]), source)), name))
                except (OSError, pa.ArrowException) as exc:
                    raise OSError(f"{path.name}: corrupt segment ({first_line(exc)})") from None
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        valid = time.time_ns() // 1000 + settle_us  # after the file exists, like a merge (``compact``)
        os.replace(tmp, rdir / segment_name(0, hi, valid))
    finally:
        tmp.unlink(missing_ok=True)
    return valid


def _read(path: Path, columns: list[str] | None = None) -> pa.Table:
    """A segment's columns; an unreadable file is an OSError naming it (the user has to move it away)."""
    try:
        return pq.ParquetFile(path).read(columns=columns)
    except (OSError, pa.ArrowException) as exc:
        raise OSError(f"{path.name}: corrupt segment ({first_line(exc)})") from None


def _step_rows(path: Path) -> Counter:
    """Rows per step of a source segment."""
    return _sum_by(_read(path, ["step"])["step"])


def _rollup_keys(step_rows: Counter, source: str, roll: Callable[..., pa.Table]) -> Counter:
    """Rows per rollup step key (a step, or its block: whatever ``roll`` makes of it).

    ``roll`` runs on one row per distinct step whose ``numel`` is that step's row count, so the rollup's own
    sums count the rows: rolling every row (all statistics NULL) would cost ~7 ms per 1,000 rows.
    """
    distinct = pa.table({"step": pa.array(list(step_rows), pa.int64()),
                         "numel": pa.array(list(step_rows.values()), pa.int64())})
    t = roll(conform(distinct, source))
    return _sum_by(t["step"], t["numel"])


def _sum_by(keys: pa.ChunkedArray, weights: pa.ChunkedArray | None = None) -> Counter:
    """Σ ``weights`` (default 1 per row) per key; a NULL key is a group of its own, as in the rollups."""
    k = keys.combine_chunks()
    w = np.ones(len(k)) if weights is None else weights.combine_chunks().fill_null(0).to_numpy(zero_copy_only=False)
    valid = k.is_valid().to_numpy(zero_copy_only=False)
    uniq, inv = np.unique(k.fill_null(0).to_numpy(zero_copy_only=False)[valid], return_inverse=True)
    sums = np.bincount(inv, weights=w[valid], minlength=len(uniq))
    out = Counter(dict(zip(uniq.tolist(), sums.astype(np.int64).tolist(), strict=True)))
    if not valid.all():
        out[None] += int(w[~valid].sum())
    return +out


def _is_fresh(srcs: list[Seg], run_dir: Path, wdir: Path, quiet_s: float) -> bool:
    now = time.time()
    try:
        if now - max(s[2].stat().st_mtime for s in srcs) < quiet_s:
            return True
    except FileNotFoundError:
        return True  # merged away meanwhile: leave it to the next call
    try:  # a live writer retries its failed rollups at every flush: rebuilding now would race it
        return now - heartbeat_path(run_dir, wdir.name.removeprefix("writer=")).stat().st_mtime < quiet_s
    except FileNotFoundError:
        return False


def conform(t: pa.Table, table: str) -> pa.Table:
    """``t`` in ``table``'s current schema: columns cast to its types, columns renamed since it was written
    read from their old names, columns added since then NULL (old segments; compaction's merge uses it too)."""
    schema = TABLES[table]

    def column(f: pa.Field) -> pa.ChunkedArray | pa.Array:
        for name in (f.name, *former_names(table, f.name)):
            if name in t.column_names:
                return t.column(name).cast(f.type)
        return pa.nulls(t.num_rows, f.type)
    return pa.Table.from_arrays([column(f) for f in schema], schema=schema)
