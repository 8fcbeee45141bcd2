"""Compaction across writers: a finished writer's rows folded into a few files per table, whatever the writer count.

Merging within a writer directory leaves one file per writer per table: 1,024 ranks and 256 rollout workers
leave ~7,200 files in a run, which every query lists and opens. Once a writer will not write again (closed,
or crashed; ``done_writers``), this module moves its rows into ``<table>/writer=_merged/``, about
``target_rows`` rows a file, without changing the live-segment rule readers apply (``layout``):

1. the rows of a group of writer directories are written to one file ``writer=_merged/<n>-<n>.v<t>.parquet``;
2. in each of those directories, a zero-row *cover* ``<lo>-<hi>.v<t>.parquet`` spans the segments whose rows
   went in. Both take effect at the same ``t``: a query that starts before ``t`` reads the writers' own
   segments and neither new file; one that starts at or after ``t`` reads the merged file, and the cover
   hides the sources. Every file is renamed into place before ``t`` (if the renames run late, the covers are
   removed before they take effect and the merge is dropped), so each row is read once at every moment;
3. the sources go once the cover has been in effect for the grace period, like any merged-away segment
   (``compact._remove_expired``); the covers, which hide nothing once the sources are gone, go once their
   directory has been quiet for another grace period (a query that listed a source before its deletion has
   finished by then), and the empty writer directory with them (``remove_spent_covers``).

The files of ``writer=_merged`` are numbered in the order of their merges, so later passes merge them with
each other like any writer's segments. Writer ids never start with ``_`` (``layout.safe_id``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from dynascope.core.errors import first_line
from dynascope.store._columns import parquet_options
from dynascope.store.layout import (
    HEARTBEATS,
    SEGMENT_RE,
    list_segments,
    live_segments,
    segment_name,
    valid_from_us,
)
from dynascope.store.repair import _num_rows, conform  # a corrupt file's error names it
from dynascope.store.schema import TABLES

MERGED = "writer=_merged"
ROW_GROUP_ROWS = 262_144  # rows per row group of a merged file (small segments are gathered up to it)
_FOREVER = 2**62
_RENAME_US = 5_000  # time allowed per rename before the files take effect (a slow network file system)
_CRASHED_MARGIN_S = 5.0  # as the catalog's: a heartbeat older than 2 flush intervals + this is a dead writer
_RANK = re.compile(r"^writer=r(\d+)-")

Seg = tuple[int, int, Path]


@dataclass
class AcrossStats:
    """What one pass across writers did."""

    writers: int = 0  # writer directories whose rows moved into merged files
    new_segments: int = 0
    segments: int = 0  # source segments whose rows moved
    rows: int = 0
    last_valid_us: int = 0
    skipped: list[str] = field(default_factory=list)


def is_writer_dir(wdir: Path) -> bool:
    """A directory of a writing process (not ``writer=_schema`` or ``writer=_merged``)."""
    return wdir.name.startswith("writer=") and not wdir.name.startswith("writer=_")


def done_writers(run_dir: Path, quiet_s: float) -> dict[str, bool]:
    """The writers of ``run_dir`` that will not write again, quiet for ``quiet_s``: id -> closed (their
    ``run_end`` is on disk), or crashed (False: heartbeat older than twice its flush interval, or none)."""
    now = time.time()
    beats = {p.stem: p for p in (run_dir / HEARTBEATS).glob("*.json")}
    ids = set(beats)
    for table in TABLES:
        tdir = run_dir / table
        if tdir.is_dir():
            ids |= {d.name.removeprefix("writer=") for d in tdir.iterdir() if is_writer_dir(d)}
    done: dict[str, bool] = {}
    for wid in ids:
        beat = beats.get(wid)
        if beat is None:  # a writer that keeps no heartbeat (an older store): its newest segment decides
            newest = max((_mtime(p) for t in TABLES for p in (run_dir / t / f"writer={wid}").glob("*.parquet")
                          if ".v" not in p.name), default=0.0)
            if now - newest >= quiet_s:
                done[wid] = False
            continue
        age = now - _mtime(beat)
        if age < quiet_s:
            continue
        if _closed(run_dir / "events" / f"writer={wid}"):
            done[wid] = True
        elif age > 2 * _flush_secs(beat) + _CRASHED_MARGIN_S:
            done[wid] = False
    return done


def merge_across(run_dir: Path, writers: dict[str, bool], settle_us: int, target_rows: int) -> AcrossStats:
    """Fold the directories of ``writers`` (``done_writers``) into ``writer=_merged``, table by table."""
    out = AcrossStats()
    for table in TABLES:
        dirs = list_segments(run_dir, table)
        todo = []
        for wdir, segs in dirs.items():
            live = live_segments(segs, at_us=_FOREVER)
            wid = wdir.name.removeprefix("writer=")
            if not is_writer_dir(wdir) or wid not in writers or not live:
                continue
            if live[0][0] == 0 and not writers[wid]:
                continue  # its cover would span the next number (_cover_range): only once the writer closed
            try:
                if all(".v" in s[2].name for s in live) and sum(_num_rows(s[2]) for s in live) == 0:
                    continue  # only covers left: folded already
            except OSError as exc:
                out.skipped.append(f"{wdir}: {first_line(exc)}; not folded")
                continue
            todo.append((wdir, live))
        todo.sort(key=lambda d: (int(m.group(1)) if (m := _RANK.match(d[0].name)) else -1, d[0].name))
        mdir = run_dir / table / MERGED
        try:
            if todo:
                _merge_table(mdir, table, dirs.get(mdir, []), todo, settle_us, target_rows, out)
        except (OSError, pa.ArrowException) as exc:
            out.skipped.append(f"{run_dir / table}: {type(exc).__name__}: {first_line(exc)}")
    return out


def _merge_table(mdir: Path, table: str, merged: list[Seg], todo: list[tuple[Path, list[Seg]]], settle_us: int,
                 target_rows: int, out: AcrossStats) -> None:
    """Stream the directories' live segments into merged files of about ``target_rows`` rows, each writer
    whole in one of them, row groups of ``ROW_GROUP_ROWS``. DuckDB reads a writer's segments (one query per
    directory: ~5x faster than pyarrow per small file); pyarrow writes, in the writer's encodings."""
    schema = TABLES[table]
    mdir.mkdir(exist_ok=True)
    number = max((hi for _, hi, _ in merged), default=-1) + 1
    group: list[tuple[Path, list[Seg]]] = []
    pending: list[pa.RecordBatch] = []
    rows = pending_rows = 0
    tmp = mdir / f".merge-{uuid.uuid4().hex[:12]}.tmp"
    writer: pq.ParquetWriter | None = None
    con = duckdb.connect(":memory:")

    def write_pending() -> None:
        nonlocal writer, rows, pending, pending_rows
        writer = writer or pq.ParquetWriter(tmp, schema, **parquet_options(schema))
        if pending:
            writer.write_table(pa.Table.from_batches(pending, schema=schema))
        rows, pending, pending_rows = rows + pending_rows, [], 0

    def finish(publish: bool) -> None:  # publish the group's file, or drop it (its writers fold next time)
        nonlocal writer, tmp, group, rows, pending, pending_rows, number
        if publish:
            write_pending()
        if writer is not None:
            writer.close()
            writer = None
        if publish and _publish(tmp, mdir, number, group, rows, settle_us, out):
            number += 1
        tmp.unlink(missing_ok=True)
        tmp = mdir / f".merge-{uuid.uuid4().hex[:12]}.tmp"
        group, rows, pending, pending_rows = [], 0, [], 0

    try:
        for wdir, live in todo:
            # A directory's rows join the file once all of them were read, unless they fill a row group first:
            # a corrupt segment then costs only its own directory, which stays as it is.
            mine: list[pa.RecordBatch] = []
            mine_rows, spilled = 0, False
            try:
                for batch in _read_dir(con, [str(s[2]) for s in live], table):
                    mine.append(batch)
                    mine_rows += batch.num_rows
                    if pending_rows + mine_rows >= ROW_GROUP_ROWS:
                        pending, pending_rows = pending + mine, pending_rows + mine_rows
                        mine, mine_rows, spilled = [], 0, True
                        write_pending()
            except OSError as exc:
                out.skipped.append(f"{wdir}: {first_line(exc)}; not folded")
                if spilled:  # part of it is in the file already: the group folds next time
                    finish(publish=False)
                continue
            pending, pending_rows = pending + mine, pending_rows + mine_rows
            group.append((wdir, live))
            if rows + pending_rows >= target_rows:
                finish(publish=True)
        if group:
            finish(publish=True)
    finally:
        con.close()
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)


def _read_dir(con: duckdb.DuckDBPyConnection, paths: list[str], table: str) -> Iterator[pa.RecordBatch]:
    """The rows of a writer directory's segments, in ``table``'s current schema, a batch at a time."""
    schema = TABLES[table]
    try:
        rel = con.sql("SELECT * FROM read_parquet($files, union_by_name = true, hive_partitioning = false)",
                      params={"files": paths})
        reader = rel.to_arrow_reader(ROW_GROUP_ROWS)
        same = reader.schema.equals(schema)  # the writer's own segments; older ones have renamed or fewer columns
        for batch in reader:
            if same:
                yield batch
            else:
                yield from conform(pa.Table.from_batches([batch]), table).to_batches()
    except duckdb.Error as exc:  # name the directory: a corrupt segment there has to be moved away
        raise OSError(f"unreadable segment ({first_line(exc)})") from None


def _publish(tmp: Path, mdir: Path, number: int, group: list[tuple[Path, list[Seg]]], rows: int, settle_us: int,
             out: AcrossStats) -> bool:
    """Cover each writer's merged range and rename the merged file into place, all taking effect at one ``t``."""
    got = pq.ParquetFile(tmp).metadata.num_rows
    if got != rows:
        raise OSError(f"merged file has {got} rows, its sources {rows}")
    cover = _empty_segment(mdir.parent.name)
    staged: list[tuple[Path, Path, int, int]] = []
    placed: list[Path] = []
    try:
        for wdir, live in group:
            ctmp = wdir / f".cover-{uuid.uuid4().hex[:12]}.tmp"
            staged.append((ctmp, wdir, *_cover_range(live)))
            ctmp.write_bytes(cover)
        valid = time.time_ns() // 1000 + settle_us + _RENAME_US * (len(staged) + 1)
        for ctmp, wdir, lo, hi in staged:
            placed.append(wdir / segment_name(lo, hi, valid))
            os.replace(ctmp, placed[-1])
        if time.time_ns() // 1000 >= valid - settle_us // 2:  # too slow to be sure all are in place by ``valid``
            for p in placed:
                p.unlink(missing_ok=True)
            out.skipped.append(f"{mdir}: renames ran into the settle time; this merge across writers is dropped")
            return False
        os.replace(tmp, mdir / segment_name(number, number, valid))
    finally:
        for ctmp, _, _, _ in staged:
            ctmp.unlink(missing_ok=True)
    out.writers += len(group)
    out.segments += sum(len(live) for _, live in group)
    out.new_segments += 1
    out.rows += rows
    out.last_valid_us = max(out.last_valid_us, valid)
    return True


@functools.cache
def _empty_segment(table: str) -> bytes:
    """A zero-row segment of ``table`` as bytes (one per table: writing it afresh costs ~2 ms a cover)."""
    schema = TABLES[table]
    sink = pa.BufferOutputStream()
    # not schema.empty_table(): that imports pandas
    pq.write_table(pa.Table.from_batches([], schema=schema), sink, **parquet_options(schema))
    return sink.getvalue().to_pybytes()


def _cover_range(live: list[Seg]) -> tuple[int, int]:
    """A range strictly wider than every live segment of the directory, so the cover wins by its range alone
    (a cover of exactly one segment's range would lose the name tie-break to it). The number added below
    names no segment of this directory now or later: numbers only grow, and every number inside the live
    range is this directory's or another table's. Above (a directory holding the writer's segment 0) it is
    safe only once the writer has closed, which ``merge_across`` checks."""
    lo, hi = min(s[0] for s in live), max(s[1] for s in live)
    return (lo - 1, hi) if lo > 0 else (lo, hi + 1)


def remove_spent_covers(run_dir: Path, grace_s: float) -> tuple[int, int]:
    """Delete covers that hide nothing any more, once their directory has been quiet for ``grace_s``, and the
    emptied writer directories; returns (files removed, directories whose covers must wait)."""
    now_us = time.time_ns() // 1000
    removed = waiting = 0
    for table in TABLES:
        for wdir, segs in list_segments(run_dir, table).items():
            try:
                if not is_writer_dir(wdir) or not segs or any(".v" not in s[2].name for s in segs) \
                        or any(_num_rows(s[2]) for s in segs):
                    continue  # rows are still here: sources waiting for their grace, or a writer's own merges
            except OSError:  # a corrupt merged file: left alone, named by the merge that reads it
                continue
            if any(not 0 < valid_from_us(s[2]) <= now_us - grace_s * 1e6 for s in segs) \
                    or time.time() - _mtime(wdir) < grace_s:
                waiting += 1
                continue
            for _, _, path in segs:
                path.unlink(missing_ok=True)
                removed += 1
            try:
                wdir.rmdir()  # fails if a file arrived meanwhile (a temp file of a writer back from the dead)
            except OSError:
                pass
    return removed, waiting


def _closed(events_dir: Path) -> bool:
    """Whether a writer's own events hold its ``run_end`` (its last flushes: newest segments first)."""
    try:
        names = [f.name for f in os.scandir(events_dir) if SEGMENT_RE.match(f.name)]
    except FileNotFoundError:
        return False
    for name in sorted(names, key=lambda n: -int(n[13:25])):
        try:
            if "run_end" in pq.read_table(events_dir / name, columns=["event"]).column("event").to_pylist():
                return True
        except (OSError, pa.ArrowException, KeyError):
            continue
    return False


def _flush_secs(beat: Path) -> float:
    try:
        return float(json.loads(beat.read_text(encoding="utf-8")).get("flush_secs", 2.0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 2.0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
