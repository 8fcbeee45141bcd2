"""The two file operations every fold shares: write one merged segment, and delete what no query reads.

``dynascope compact`` (``compact``), a live writer folding its own segments (``own_fold``) and a finished run
put at rest (``at_rest``) all merge and delete through these two, so the live-segment rule is applied one
way: a merged file ``<lo>-<hi>.v<valid_from>`` takes effect ``settle`` after it is written and covers its
sources for every query that starts later; a source is deleted once its first cover has been in effect
for the grace period and no held lease (``snapshot``) pins it.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dynascope.store._columns import ROW_GROUP_ROWS, codecs_like, parquet_options
from dynascope.store.compact_across import remove_spent
from dynascope.store.layout import is_temp, segment_name, valid_from_us
from dynascope.store.repair import conform
from dynascope.store.runfiles import RunFiles, Seg
from dynascope.store.schema import TABLES
from dynascope.store.snapshot import DEFAULT_TTL_S, held_leases
from dynascope.store.snapshot_journals import remove_stale

__all__ = ["Removed", "merge_segments", "remove_merged"]

# Temp files of a writer or compactor that died are removed only when older than this (a live one may be
# writing a large segment right now).
STALE_TMP_S = 3600.0


@dataclass
class Removed:
    """What one ``remove_merged`` call deleted, and the leases it could not read."""

    segments: int = 0  # merged-away segments, spent covers and stale temp files
    commits: int = 0  # commit records none of whose segments was left
    skipped: list[str] = field(default_factory=list)


def merge_segments(table: str, group: list[Seg], settle_us: int) -> int:
    """Write the segments of ``group`` (adjacent, one writer directory) as one merged segment; returns its
    valid_from (µs). The file is renamed into place whole, or not at all."""
    schema = TABLES[table]
    wdir = group[0][2].parent
    tmp = wdir / f".merge-{group[0][0]}-{group[-1][1]}.{uuid.uuid4().hex[:8]}.tmp"
    expected = 0
    try:
        # in the codecs its writer chose, as its first source has them
        with pq.ParquetWriter(tmp, schema, **parquet_options(schema, codecs_like(group[0][2], schema))) as writer:
            # the sources' rows gathered into row groups of ROW_GROUP_ROWS, not one row group per source: a
            # live writer's fold merges seals of a few hundred rows each, and a query pays per row group
            pending: list[pa.Table] = []
            for _, _, src in group:
                pf = pq.ParquetFile(src)
                expected += pf.metadata.num_rows
                for batch in pf.iter_batches(batch_size=ROW_GROUP_ROWS):
                    pending.append(conform(pa.Table.from_batches([batch]), table))
                    pending = _write_full(writer, pending)
            if pending:
                writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP_ROWS)
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


def _write_full(writer: pq.ParquetWriter, pending: list[pa.Table]) -> list[pa.Table]:
    """Write the full row groups of ``pending``'s rows; the rest, fewer than ``ROW_GROUP_ROWS``, waits."""
    rows = sum(t.num_rows for t in pending)
    if rows < ROW_GROUP_ROWS:
        return pending
    whole = pa.concat_tables(pending)
    full = rows - rows % ROW_GROUP_ROWS
    writer.write_table(whole.slice(0, full), row_group_size=ROW_GROUP_ROWS)
    return [whole.slice(full)] if full < rows else []


def remove_merged(files: RunFiles, grace_s: float, closed: set[str] | frozenset[str] = frozenset()) -> Removed:
    """Delete what no query reads any more (``_remove_expired`` per writer directory), then the commit
    records none of whose segments is left, then the covers of folded writers that hide nothing any more
    (``compact_across.remove_spent``; ``closed``: writers whose temp files, and ``begin.json`` with their last
    directory, may go: the caller holds the run). A segment live at a held lease's moment stays, covers included."""
    out = Removed()
    # The clock first, then the leases: a lease this pass cannot see was written after ``now_us``, and its
    # moment is at most ``snapshot.LEASE_SLACK_S`` before that, so what it pins was still live at
    # ``now_us - grace_s`` and nothing below deletes it. (Read the other way round, a pause between the two
    # reads longer than the grace would delete a segment a new lease pins.)
    now_us = time.time_ns() // 1000  # one moment for the whole run: the rule is evaluated once, not per directory
    leases, out.skipped, rows = held_leases(files.run_dir, now_us)
    remove_stale(rows, [lease.path for lease in leases], DEFAULT_TTL_S)  # a dead driver's journal rows
    pinned = frozenset().union(*(files.live(lease.snapshot_us) for lease in leases))
    out.segments = sum(_remove_expired(files, wdir, segs, grace_s, pinned, now_us)
                       for wdir, _, segs in files.writer_dirs())
    for path in files.spent_commits():
        path.unlink(missing_ok=True)
        out.commits += 1
    out.segments += remove_spent(files, grace_s, pinned, set(closed), now_us)
    return out


def _remove_expired(files: RunFiles, wdir: Path, segs: list[Seg], grace_s: float, pinned: frozenset[str],
                    now_us: int) -> int:
    """Delete segments no query has read for ``grace_s`` (unless a lease pins them), segments of flushes
    that were never committed, and stale temp files.

    A segment stops being read when the first merged file containing it takes effect; later merges contain
    that one in turn, so from then on every new query reads a cover instead. The grace counts from that
    first cover, not from the newest: with passes more frequent than ``grace_s`` during a live run, each
    pass re-merges the previous merged file with the new segments, and a cover that young never ages."""
    live_set = files.live(now_us)
    # Covers are merged files (a writer's own segments are disjoint), in effect now.
    covers = [(lo, hi, p, valid_from_us(p)) for lo, hi, p in segs if 0 < valid_from_us(p) <= now_us]
    removed = 0
    for lo, hi, path in segs:
        if str(path) in live_set or str(path) in pinned:
            continue
        key = (lo, -hi, path.name)  # the rule's order: a cover sorts before what it covers
        since = min((v for clo, chi, cp, v in covers if clo <= lo and hi <= chi and (clo, -chi, cp.name) < key),
                    default=None)
        stale = files.uncommitted(wdir, (lo, hi, path)) and _age_s(path) >= STALE_TMP_S
        if (since is not None and (now_us - since) / 1e6 >= grace_s) or stale \
                or files.never_committed(wdir, (lo, hi, path)):
            path.unlink(missing_ok=True)
            removed += 1
    now = time.time()
    try:
        temps = [f for f in wdir.iterdir() if is_temp(f.name)]
    except FileNotFoundError:  # emptied and removed meanwhile (``remove_spent``)
        return removed
    for f in temps:
        try:
            if now - f.stat().st_mtime >= max(grace_s, STALE_TMP_S):
                f.unlink()  # left by a writer or compactor that died mid-write
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
