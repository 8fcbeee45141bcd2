"""Compaction across writers: finished writers' rows folded into a few files per table, whatever the writer count.

Merging within a writer directory leaves one file per writer per table: 1,024 ranks and 256 rollout workers
leave ~13,000 files in a run, which every query lists and opens. Once a writer will not write again
(``finished.done_writers``), its rows move into ``<table>/writer=_merged/``, about ``target_rows`` rows a
file, under the live-segment rule readers already apply (``live``), with nothing added to it:

1. the live segments of a group of writer directories (``RunFiles.live``: committed flushes and merges) are
   written to one file ``writer=_merged/<n>-<n>.v<t>.parquet``;
2. in each of those directories, a zero-row *cover* ``<lo>-<hi>.v<t>.parquet`` spans the segments whose rows
   went in. Both take effect at the same ``t``: a query that starts before ``t`` reads the writers' own
   segments and neither new file; one that starts at or after ``t`` reads the merged file, and the cover
   hides the sources. Every file is renamed into place before ``t`` (if the renames run late, the covers and the
   merged file are removed and the merge is dropped), so each row is read once at every moment.
   Covers and the merged file are merged segments: they count by their ``t``, so they need no commit record;
3. the sources go once the cover has been in effect for the grace period and no lease pins them, like any
   merged-away segment (``compact._remove_expired``), and their commit records once none of their segments
   is left (``RunFiles.spent_commits``). The covers, which hide nothing once the sources are gone, go once
   their directory has been quiet for another grace period (a query that listed a source before its
   deletion has finished by then) and no lease pins them, and the empty writer directory with them
   (``remove_spent``). A closed writer with no directory left in any table then loses its ``begin.json``
   too, so a finished run's queries do not list one commit directory per writer: with no segment of that
   writer left, the record changes nothing a reader counts.

The files of ``writer=_merged`` are numbered in the order of their merges, so later passes merge them with
each other like any writer's segments; ``writer=_merged`` keeps no commit records.
"""

from __future__ import annotations

import functools
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
from dynascope.store._columns import ROW_GROUP_ROWS, codecs_like, parquet_options
from dynascope.store.flush import BEGIN, commit_dir
from dynascope.store.journal import journals_in
from dynascope.store.layout import MERGED, is_temp, is_writer_dir, segment_name, valid_from_us
from dynascope.store.repair import conform
from dynascope.store.rollup import ROLLUPS
from dynascope.store.runfiles import FOREVER_US, RunFiles, Seg
from dynascope.store.schema import TABLES

_RENAME_US = 5_000  # time allowed per rename before the files take effect (a slow network file system)
_RANK = re.compile(r"^writer=r(\d+)-")
_SOURCE_OF = {name: source for source, rolls in ROLLUPS.items() for name, _ in rolls}


@dataclass
class AcrossStats:
    """What one fold across writers did."""

    writers: int = 0  # writer directories whose rows moved into merged files
    new_segments: int = 0
    segments: int = 0  # source segments whose rows moved
    rows: int = 0
    last_valid_us: int = 0
    folded: set[Path] = field(default_factory=set)  # the writer directories whose rows moved
    skipped: list[str] = field(default_factory=list)


def fold_writers(files: RunFiles, writers: dict[str, bool], settle_us: int, target_rows: int) -> AcrossStats:
    """Fold the directories of ``writers`` (``done_writers``: id -> closed) into ``writer=_merged``, table by
    table in ``TABLES`` order, so a source table folds before its rollups (``_foldable``)."""
    out = AcrossStats()
    live = files.live(FOREVER_US)
    by_table: dict[str, list[tuple[Path, list[Seg]]]] = {}
    for wdir, table, segs in files.writer_dirs():
        if is_writer_dir(wdir.name) and wdir.name.removeprefix("writer=") in writers:
            by_table.setdefault(table, []).append((wdir, segs))
    for table in TABLES:
        todo = [(wdir, mine) for wdir, segs in by_table.get(table, [])
                if (mine := _foldable(files, live, table, wdir, segs, writers, out))]
        todo.sort(key=lambda d: (int(m.group(1)) if (m := _RANK.match(d[0].name)) else -1, d[0].name))
        mdir = files.run_dir / table / MERGED
        number = max((hi for _, hi, _ in files.segs.get(mdir, [])), default=-1) + 1
        try:
            if todo:
                _fold_table(mdir, table, number, todo, settle_us, target_rows, out)
        except (OSError, pa.ArrowException) as exc:
            out.skipped.append(f"{files.run_dir / table}: {type(exc).__name__}: {first_line(exc)}")
    return out


def _foldable(files: RunFiles, live: frozenset[str], table: str, wdir: Path, segs: list[Seg],
              writers: dict[str, bool], out: AcrossStats) -> list[Seg]:
    """The live segments of a writer directory to fold now, or none.

    Not yet: a directory holding the writer's segment 0 of a writer that did not close (``_cover_range``);
    a rollup directory of a writer without commit records whose source directory still holds rows, since
    ``repair`` compares the two and must never see the rollup folded away from a source still in place."""
    mine = [s for s in segs if str(s[2]) in live and s[2].exists()]
    if not mine or (mine[0][0] == 0 and not writers[wdir.name.removeprefix("writer=")]):
        return []
    try:
        if all(files.is_cover(p) for _, _, p in mine):
            return []  # folded already
        source = _SOURCE_OF.get(table)
        sdir = files.run_dir / str(source) / wdir.name
        if source and wdir.name not in files.keeps and sdir not in out.folded and not all(
                files.is_cover(p) for _, _, p in files.segs.get(sdir, []) if str(p) in live and p.exists()):
            return []
    except OSError as exc:
        out.skipped.append(f"{wdir}: {first_line(exc)}; not folded")
        return []
    return mine


def _fold_table(mdir: Path, table: str, number: int, todo: list[tuple[Path, list[Seg]]], settle_us: int,
                target_rows: int, out: AcrossStats) -> None:
    """Stream the directories' live segments into merged files of about ``target_rows`` rows, each writer
    whole in one of them, row groups of ``ROW_GROUP_ROWS``. DuckDB reads a writer's segments (one query per
    directory: ~5x faster than pyarrow per small file); pyarrow writes, in the writer's encodings."""
    schema = TABLES[table]
    mdir.mkdir(exist_ok=True)
    group: list[tuple[Path, list[Seg]]] = []
    pending: list[pa.RecordBatch] = []
    rows = pending_rows = 0
    tmp = mdir / f".merge-{uuid.uuid4().hex[:12]}.tmp"
    writer: pq.ParquetWriter | None = None
    con = duckdb.connect(":memory:")
    # the codecs the writers chose (RunWriter's compression), as the first directory's first segment has them
    like = codecs_like(todo[0][1][0][2], schema) if todo and todo[0][1] else "auto"

    def write_pending() -> None:
        nonlocal writer, rows, pending, pending_rows
        writer = writer or pq.ParquetWriter(tmp, schema, **parquet_options(schema, like))
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
    with open(tmp, "rb") as fh:  # its sources are deleted after the grace period: it must survive a crash
        os.fsync(fh.fileno())
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
        placed.append(mdir / segment_name(number, number, valid))
        os.replace(tmp, placed[-1])
        # Checked after the last rename: a query that starts at ``valid`` must list every one of them.
        if time.time_ns() // 1000 >= valid - settle_us // 2:  # too slow to be sure all were in place in time
            for p in placed:
                p.unlink(missing_ok=True)
            out.skipped.append(f"{mdir}: renames ran into the settle time; this merge across writers is dropped")
            return False
    finally:
        for ctmp, _, _, _ in staged:
            ctmp.unlink(missing_ok=True)
    out.writers += len(group)
    out.folded |= {wdir for wdir, _ in group}
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
    names no segment of this directory that can count now or later: numbers only grow, every committed
    number inside the live range is in it, and a number below it that no commit covers never will be.
    Above (a directory holding the writer's segment 0) it is safe only once the writer has closed, which
    ``fold_writers`` checks."""
    lo, hi = min(s[0] for s in live), max(s[1] for s in live)
    return (lo - 1, hi) if lo > 0 else (lo, hi + 1)


def remove_spent(files: RunFiles, grace_s: float, pinned: frozenset[str], closed: set[str], now_us: int) -> int:
    """Delete covers that hide nothing any more (see the module docstring) and the emptied writer
    directories, then the ``begin.json`` of each ``closed`` writer that has no directory left; returns the
    files removed. ``now_us``: the moment ``pinned`` was computed for."""
    now = now_us / 1e6
    removed = 0
    for wdir, _, segs in files.writer_dirs():
        left = [p for _, _, p in segs if p.exists()]
        try:
            if not is_writer_dir(wdir.name) or not left or not all(files.is_cover(p) for p in left):
                continue  # rows are still here: sources waiting for their grace, or a writer's own segments
        except OSError:  # a corrupt segment: left alone, named by the merge that reads it
            continue
        if any(str(p) in pinned or not 0 < valid_from_us(p) <= (now - grace_s) * 1e6 for p in left) \
                or now - _mtime(wdir) < grace_s or not _drop_journals(wdir, [(lo, hi) for lo, hi, p in segs if p in left]):
            continue
        for p in left:
            p.unlink(missing_ok=True)
            removed += 1
        if wdir.name.removeprefix("writer=") in closed:
            _drop_if_only_temps(wdir)
            continue
        try:
            wdir.rmdir()  # fails if a file arrived meanwhile (a temp file of a writer back from the dead)
        except OSError:
            pass
    for wid in closed:
        cdir = commit_dir(files.run_dir, wid)
        wdirs = [files.run_dir / t / f"writer={wid}" for t in TABLES]
        # A pass killed between staging a cover and renaming it leaves a temp file, which can outlive every
        # segment of its directory; no listing of segments sees that directory again. The caller holds the
        # run and the writer is closed, so nothing writes there: a directory without segments loses its
        # temp files, and goes once empty.
        if any(os.path.lexists(w) and (w in files.segs or not _drop_if_only_temps(w)) for w in wdirs):
            continue
        try:
            if {p.name for p in cdir.iterdir()} != {BEGIN}:
                continue  # commit records of segments still on disk, or a temp file
            (cdir / BEGIN).unlink()
            cdir.rmdir()
            removed += 1
        except OSError:
            continue
    return removed


def _drop_if_only_temps(wdir: Path) -> bool:
    """Delete ``wdir``'s temp files and then ``wdir``; True if it is gone (False if anything else is in it).
    Only for a closed writer's directory, by a caller that holds the run (``lease_lock.run_lock``)."""
    try:
        for name in os.listdir(wdir):
            if is_temp(name):
                (wdir / name).unlink(missing_ok=True)
        wdir.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _drop_journals(wdir: Path, covers: list[tuple[int, int]]) -> bool:
    """Delete the directory's journals before its covers, which hide them too (a journal outliving its cover
    would count again); False, deleting none, if one is not covered (a writer's journal not sealed yet)."""
    journals = journals_in(wdir)
    if journals is None or not all(any(lo <= n <= hi for lo, hi in covers) for n, _ in journals):
        return False
    for _, path in journals:
        path.unlink(missing_ok=True)
    return True


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
