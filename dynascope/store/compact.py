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

Before merging a run, ``repair.repair_rollups`` writes the rollup segments a dead writer never wrote.
The directories of writers that will not write again (closed or crashed) are then folded together into
``writer=_merged`` (``compact_across``), so a finished run keeps a few files per table, not one per writer.

A live writer keeps numbering its segments above any merged range, so its older segments are safe to merge
while it runs. The ``writer=_schema`` directories (one empty typed file per table) are left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dynascope.core.errors import first_line
from dynascope.store._columns import parquet_options
from dynascope.store.compact_across import done_writers, is_writer_dir, merge_across, remove_spent_covers
from dynascope.store.layout import (
    list_segments,
    live_segments,
    locate,
    segment_name,
    valid_from_us,
)
from dynascope.store.repair import REPAIR_AFTER_S, RepairResult, conform, repair_rollups
from dynascope.store.schema import TABLES

LOCK = ".compact.lock"
_FOREVER = 2**62
# Temp files of a writer or compactor that died are removed only when older than this (a live one may be
# writing a large segment right now).
_STALE_TMP_S = 3600.0


@dataclass
class CompactStats:
    """What one ``compact_store`` call did."""

    merged_segments: int = 0  # source segments merged into new ones
    new_segments: int = 0  # merged segments written
    removed_segments: int = 0  # merged-away segments and stale temp files deleted
    rows_merged: int = 0
    writers_folded: int = 0  # writer directories of finished writers moved into writer=_merged (``compact_across``)
    repaired_segments: int = 0  # rollup segments written for sources whose writer never wrote them (``repair``)
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
    for run_dir in loc.run_dirs:
        with _run_lock(run_dir) as locked:
            if not locked:  # two compactors could write partly overlapping merges: one run, one compactor
                stats.skipped.append(f"{run_dir}: another compaction is running")
                continue
            # Before any merge: a merge must never join a writer's rollup segments across a missing one, whose
            # rows could then no longer be told apart. Directories still waiting for a repair are not merged.
            repair = repair_rollups(run_dir, repair_after_s)
            stats.repaired_segments += repair.repaired
            stats.skipped += repair.skipped
            last_valid = max(last_valid, _fold(run_dir, repair, settle_us, target_rows, repair_after_s, grace_s,
                                                  stats))
            for wdir, table, segs in _writer_dirs(run_dir):
                stats.removed_segments += _remove_expired(wdir, segs, grace_s)
                segs = [s for s in segs if s[2].exists()]
                try:
                    if wdir in repair.held or (is_writer_dir(wdir) and _folded(segs)):
                        continue  # waiting for a repair, or folded across writers
                    # Build on every earlier merge, in effect yet or not (an earlier call may have used a longer
                    # settle): a new merge then contains or avoids each old one, never half-overlaps it.
                    live = live_segments(segs, at_us=_FOREVER)
                    last_valid = max(last_valid, _merge_dir(table, live, settle_us, target_rows, stats))
                except (OSError, pa.ArrowException) as exc:
                    stats.skipped.append(f"{wdir}: {type(exc).__name__}: {first_line(exc)}")
    if wait and last_valid:
        time.sleep(max(0.0, last_valid / 1e6 + grace_s - time.time()) + 0.01)
        for run_dir in loc.run_dirs:
            with _run_lock(run_dir) as locked:
                for wdir, _, segs in _writer_dirs(run_dir) if locked else ():
                    stats.removed_segments += _remove_expired(wdir, segs, grace_s)
        if stats.writers_folded:  # the covers go once their directories have been quiet for the grace too
            time.sleep(grace_s + 0.01)
            for run_dir in loc.run_dirs:
                with _run_lock(run_dir) as locked:
                    stats.removed_segments += remove_spent_covers(run_dir, grace_s)[0] if locked else 0
    return stats


def _fold(run_dir: Path, repair: RepairResult, settle_us: int, target_rows: int, quiet_s: float, grace_s: float,
          stats: CompactStats) -> int:
    """Fold finished writers across writers (``compact_across``), but those a repair holds or could not check,
    and delete covers that hide nothing any more; returns the last valid_from written. A pass that repaired
    rollups folds nothing: the next pass checks the repair before the rows leave their writer's directory."""
    stats.removed_segments += remove_spent_covers(run_dir, grace_s)[0]
    if repair.repaired:
        return 0
    held = {p.name.removeprefix("writer=") for p in repair.held}
    done = {w: closed for w, closed in done_writers(run_dir, quiet_s).items()
            if w not in held and not any(f"writer={w}" in line for line in repair.skipped)}
    across = merge_across(run_dir, done, settle_us, target_rows)
    stats.writers_folded += across.writers
    stats.merged_segments += across.segments
    stats.new_segments += across.new_segments
    stats.rows_merged += across.rows
    stats.skipped += across.skipped
    return across.last_valid_us


@contextlib.contextmanager
def _run_lock(run_dir: Path):
    """An exclusive, non-blocking lock on the run's compaction lock file; yields whether it was taken."""
    try:
        fh = open(run_dir / LOCK, "a+b")  # held for the with-block
    except OSError:
        yield True  # a read-only store cannot be compacted anyway; the merge reports why
        return
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        fh.close()


def _writer_dirs(run_dir: Path):
    for table in TABLES:
        for wdir, segs in list_segments(run_dir, table).items():
            if wdir.name != "writer=_schema":
                yield wdir, table, segs


def _merge_dir(table: str, live: list[tuple[int, int, Path]], settle_us: int, target_rows: int,
               stats: CompactStats) -> int:
    """Merge runs of consecutive live segments, each up to about ``target_rows`` rows; returns the last valid_from."""
    last_valid = 0
    group: list[tuple[int, int, Path]] = []
    rows = 0
    for seg in [*live, None]:  # None closes the last group
        n = _num_rows(seg[2]) if seg is not None else 0
        if seg is None or (group and rows + n > target_rows):
            if len(group) >= 2:
                last_valid = _merge(table, group, settle_us)
                stats.merged_segments += len(group)
                stats.new_segments += 1
                stats.rows_merged += rows
            group, rows = [], 0
        if seg is not None:
            group.append(seg)
            rows += n
    return last_valid


def _folded(segs: list[tuple[int, int, Path]]) -> bool:
    """Whether a writer directory holds a zero-row cover: its rows went into ``writer=_merged``."""
    return any(".v" in p.name and _num_rows(p) == 0 for _, _, p in segs)


def _num_rows(path: Path) -> int:
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, pa.ArrowException) as exc:  # name the file: the user has to move it away
        raise OSError(f"{path.name}: corrupt segment ({first_line(exc)})") from None


def _merge(table: str, group: list[tuple[int, int, Path]], settle_us: int) -> int:
    """Write the merged segment; returns its valid_from (µs)."""
    schema = TABLES[table]
    wdir = group[0][2].parent
    tmp = wdir / f".merge-{group[0][0]}-{group[-1][1]}.{uuid.uuid4().hex[:8]}.tmp"
    expected = 0
    try:
        with pq.ParquetWriter(tmp, schema, **parquet_options(schema)) as writer:
            for _, _, src in group:
                pf = pq.ParquetFile(src)
                expected += pf.metadata.num_rows
                for batch in pf.iter_batches(batch_size=262_144):
                    writer.write_table(conform(pa.Table.from_batches([batch]), table))
        got = pq.ParquetFile(tmp).metadata.num_rows
        if got != expected:
            raise OSError(f"merged file has {got} rows, its sources {expected}")
        # valid_from is taken only now, just before the rename: the file exists before it takes effect,
        # however long the merge took.
        valid_from = time.time_ns() // 1000 + settle_us
        os.replace(tmp, wdir / segment_name(group[0][0], group[-1][1], valid_from))
    finally:
        tmp.unlink(missing_ok=True)
    return valid_from


def _remove_expired(wdir: Path, segs: list[tuple[int, int, Path]], grace_s: float) -> int:
    """Delete segments no query has read for ``grace_s``, and stale temp files.

    A segment stops being read when the first merged file containing it takes effect; later merges contain
    that one in turn, so from then on every new query reads a cover instead. The grace counts from that
    first cover, not from the newest: with passes more frequent than ``grace_s`` during a live run, each
    pass re-merges the previous merged file with the new segments, and a cover that young never ages."""
    now_us = time.time_ns() // 1000
    live_set = {s[2] for s in live_segments(segs, at_us=now_us)}
    # Covers are merged files (a writer's own segments are disjoint), in effect now.
    covers = [(lo, hi, p, valid_from_us(p)) for lo, hi, p in segs if 0 < valid_from_us(p) <= now_us]
    removed = 0
    for lo, hi, path in segs:
        if path in live_set:
            continue
        key = (lo, -hi, path.name)  # live_segments' order: a cover sorts before what it covers
        since = min((v for clo, chi, cp, v in covers if clo <= lo and hi <= chi and (clo, -chi, cp.name) < key),
                    default=None)
        if since is not None and (now_us - since) / 1e6 >= grace_s:
            path.unlink(missing_ok=True)
            removed += 1
    now = time.time()
    for f in wdir.iterdir():
        try:
            if f.name.startswith(".") and f.name.endswith(".tmp") and now - f.stat().st_mtime >= max(grace_s, _STALE_TMP_S):
                f.unlink()  # left by a writer or compactor that died mid-write
                removed += 1
        except FileNotFoundError:
            pass
    return removed
