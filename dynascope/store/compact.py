"""Compaction: merge each writer's small segments into larger ones without losing or duplicating a row.

Readers may be querying while this runs, and DuckDB opens a query's files lazily, so compaction only ever
adds files, and deletes a file only when no query can still be reading it:

1. Consecutive live segments of a writer directory are merged into ``<lo>-<hi>.v<valid_from>.parquet``
   (tmp + rename) with ``valid_from`` = now + ``settle_s``. Queries that start earlier ignore it; queries
   that start later read it instead of its sources and, having started after it was written, also listed
   it (see ``layout``). ``settle_s`` must exceed the clock skew between machines sharing the store.
2. A source is deleted once the first merged file containing it has been in effect for ``grace_s``, so a
   query that started before and is still reading the source can finish. By default that happens on a later call;
   ``wait=True`` sleeps out settle + grace and deletes them in the same call.

Only committed segments are merged (a flush in progress is not data yet, see ``flush``); a merged file
needs no commit record, and a commit record is deleted once none of its segments is left. A segment that
was live at the ``snapshot_us`` of a lease still held (``snapshot``) is not deleted, however old its cover.
Before merging a run, ``repair.repair_rollups`` rebuilds the rollups of a writer that wrote no commit
records (runs written before them) if they do not account for its source rows. The directories of writers
that will not write again (closed or crashed, ``finished``) are then folded together into
``writer=_merged`` (``compact_across``), so a finished run keeps a few files per table, not one per writer.
Once no writer of a run writes any more, its ``tensor_stats`` rows are pooled across ranks per (step,
tensor) into ``tensor_stats_by_tensor`` (``rollup_across``).

A live writer keeps numbering its segments above any merged range, so its older segments are safe to merge
while it runs. The ``writer=_schema`` directories (one empty typed file per table) are left alone.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa

from dynascope.core.errors import StoreError, first_line
from dynascope.store import journal, lease_lock
from dynascope.store.compact_across import AcrossStats, fold_writers
from dynascope.store.finished import done_writers
from dynascope.store.layout import locate
from dynascope.store.merge import merge_segments, remove_merged
from dynascope.store.repair import REPAIR_AFTER_S, RepairResult, repair_rollups
from dynascope.store.rollup_across import BY_TENSOR, all_done, refresh
from dynascope.store.runfiles import FOREVER_US, RunFiles, num_rows

LOCK = lease_lock.RUN_LOCK


@dataclass
class CompactStats:
    """What one ``compact_store`` call did."""

    merged_segments: int = 0  # source segments merged into new ones
    new_segments: int = 0  # merged segments written
    removed_segments: int = 0  # merged-away segments and stale temp files deleted
    removed_commits: int = 0  # commit records deleted once none of their segments was left
    rows_merged: int = 0
    writers_folded: int = 0  # writer directories of finished writers moved into writer=_merged (``compact_across``)
    repaired_segments: int = 0  # rollup segments written for sources whose writer never wrote them (``repair``)
    rollups_written: int = 0  # tensor_stats_by_tensor files of finished runs (``rollup_across``)
    skipped: list[str] = field(default_factory=list)  # one line per writer directory left alone, and why


def compact_store(path: str | os.PathLike, grace_s: float = 60.0, *, settle_s: float = 2.0,
                  target_rows: int = 4_000_000, wait: bool = False,
                  repair_after_s: float = REPAIR_AFTER_S) -> CompactStats:
    """Merge small segments of every run under ``path`` (a run directory or a store root).

    Args:
        grace_s: a merged-away segment is deleted once its merged file has been in effect this long.
        settle_s: a merged file takes effect this long after it is written.
        target_rows: a merged segment holds at most about this many rows.
        wait: sleep out ``settle_s + grace_s`` and delete the merged-away segments before returning (and,
            where writers were folded together, another ``grace_s`` for the covers left in their directories).
        repair_after_s: write missing rollup segments only for sources (and writers) quiet this long; writers
            quiet this long that closed or crashed are folded together across writers.
    """
    loc = locate(path)
    stats = CompactStats()
    settle_us = max(int(settle_s * 1e6), 50_000)  # > 0: a merged file must exist before it takes effect
    last_valid = 0
    closed: dict[Path, set[str]] = {}  # per run, the writers known closed (their begin.json goes with their last directory)
    for run_dir in loc.run_dirs:
        with _run_lock(run_dir) as locked:
            if not locked:  # two compactors could write partly overlapping merges: one run, one compactor
                stats.skipped.append(f"{run_dir}: another compaction is running")
                continue
            files = RunFiles.of(run_dir)
            repair = repair_rollups(files, repair_after_s, settle_us)
            last_valid = max(last_valid, repair.last_valid_us)
            stats.repaired_segments += repair.repaired
            stats.skipped += repair.skipped
            if repair.repaired:
                files = RunFiles.of(run_dir)
            done = done_writers(files, repair_after_s)
            if journal.seal_orphans(files, set(done), grace_s):  # before they fold
                files = RunFiles.of(run_dir)
            closed[run_dir] = {w for w, c in done.items() if c}
            stats.removed_segments += _remove(files, grace_s, stats, closed[run_dir])
            folded = _fold(files, repair, done, settle_us, target_rows, stats)
            last_valid = max(last_valid, folded.last_valid_us)
            if folded.new_segments:  # writer=_merged's new files merge with its earlier ones in this pass
                files = RunFiles.of(run_dir)
            # Build on every earlier merge, in effect yet or not (an earlier call may have used a longer
            # settle): a new merge then contains or avoids each old one, never half-overlaps it.
            merge_live = files.live(FOREVER_US)
            for wdir, table, segs in files.writer_dirs():
                if wdir in folded.folded:
                    continue  # its rows just moved into writer=_merged
                try:
                    with lease_lock.writer_lock(run_dir, wdir.name.removeprefix("writer=")) as mine:
                        if not mine:  # its writer is folding it right now; it stays bounded by that fold
                            continue
                        live = [s for s in segs if str(s[2]) in merge_live and s[2].exists()]
                        last_valid = max(last_valid, _merge_dir(table, live, settle_us, target_rows, stats))
                except (OSError, pa.ArrowException) as exc:
                    stats.skipped.append(f"{wdir}: {type(exc).__name__}: {first_line(exc)}")
            if all_done(files, done):  # no row will arrive: pool the run's tensor rows across ranks
                try:
                    valid_us = refresh(files, settle_us)
                    stats.rollups_written += valid_us > 0
                    last_valid = max(last_valid, valid_us)  # ``wait`` deletes the rollup it replaces too
                except (OSError, pa.ArrowException, duckdb.Error, StoreError) as exc:
                    stats.skipped.append(f"{run_dir / BY_TENSOR}: {type(exc).__name__}: {first_line(exc)}")
    if wait and last_valid:
        pauses = [max(0.0, last_valid / 1e6 + grace_s - time.time())]  # the merged-away segments' grace
        if stats.writers_folded:  # then the covers', counted from the deletion of their sources
            pauses.append(grace_s)
        for pause in pauses:
            time.sleep(pause + 0.01)
            for run_dir in loc.run_dirs:
                with _run_lock(run_dir) as locked:
                    if locked:
                        stats.removed_segments += _remove(RunFiles.of(run_dir), grace_s, stats,
                                                          closed.get(run_dir, set()))
    return stats


def _fold(files: RunFiles, repair: RepairResult, done: dict[str, bool], settle_us: int, target_rows: int,
          stats: CompactStats) -> AcrossStats:
    """Fold finished writers across writers (``compact_across``), but those a repair holds or could not check.
    A pass that rebuilt rollups folds nothing: the next pass checks them before rows leave their directory."""
    if repair.repaired:
        done = {}
    across = fold_writers(files, {w: c for w, c in done.items() if f"writer={w}" not in repair.held},
                          settle_us, target_rows)
    stats.writers_folded += across.writers
    stats.merged_segments += across.segments
    stats.new_segments += across.new_segments
    stats.rows_merged += across.rows
    stats.skipped += across.skipped
    return across


def _remove(files: RunFiles, grace_s: float, stats: CompactStats, closed: set[str]) -> int:
    """Delete what no query reads any more (``merge.remove_merged``), counted into ``stats``; returns the
    segments removed."""
    done = remove_merged(files, grace_s, closed)
    stats.skipped += [p for p in done.skipped if p not in stats.skipped]
    stats.removed_commits += done.commits
    return done.segments


def _run_lock(run_dir: Path) -> contextlib.AbstractContextManager[bool]:
    """The run's compaction lock (``lease_lock.run_lock``); yields whether it was taken."""
    return lease_lock.run_lock(run_dir)


def _merge_dir(table: str, live: list[tuple[int, int, Path]], settle_us: int, target_rows: int,
               stats: CompactStats) -> int:
    """Merge runs of consecutive live segments, each up to about ``target_rows`` rows; returns the last valid_from."""
    last_valid = 0
    group: list[tuple[int, int, Path]] = []
    rows = 0
    for seg in [*live, None]:  # None closes the last group
        n = num_rows(seg[2]) if seg is not None else 0
        if seg is None or (group and rows + n > target_rows):
            if len(group) >= 2:
                last_valid = merge_segments(table, group, settle_us)
                stats.merged_segments += len(group)
                stats.new_segments += 1
                stats.rows_merged += rows
            group, rows = [], 0
        if seg is not None:
            group.append(seg)
            rows += n
    return last_valid
