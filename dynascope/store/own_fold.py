"""A live writer folds its own segments, so it holds a bounded number of files however long it runs.

Each flush adds a segment per table it wrote. Every ``KEEP // 2`` flushes the writer thread merges, in
each table's directory, the two adjacent live segments whose rows add up least, until ``KEEP // 2`` are
left, so a table never holds more than ``KEEP`` live segments: each new small segment joins its small neighbours first, so a row is
rewritten a few times over a run rather than at every merge. The merge is compaction's own (``compact``:
a merged file ``<lo>-<hi>.v<valid_from>`` takes effect ``SETTLE_S`` after it is written and covers its
sources for every query that starts later), under the run's compaction lock, so ``dynascope compact``
and a folding writer never write overlapping merges; a writer that finds the lock taken tries again at
its next flush. A source is deleted ``GRACE_S`` after its cover took effect, then the commit records none
of whose segments is left. A query that began before and still opens a deleted source runs again
(``reader.retry_vanished``), so the grace can be short: it bounds the files on disk, not the live ones.

Only the writer's own directories are listed (one directory per table and its commit records), never
the run's: at a thousand ranks a fold costs the same as at one. Errors are the writer's to report, once;
a fold that fails leaves every file as it was (the merged file is renamed into place whole, or not at all).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynascope.store.layout import COMMITS, SEGMENT_RE
from dynascope.store.live import FOREVER_US, Entry
from dynascope.store.runfiles import RunFiles, Seg, num_rows
from dynascope.store.schema import TABLES

__all__ = ["GRACE_S", "KEEP", "SETTLE_S", "after_flush", "fold_own"]

KEEP = 8  # live segments per table a writer holds after a fold
SETTLE_S = 2.0  # a merged file takes effect this long after it is written (compact's settle_s)
GRACE_S = 10.0  # a merged-away source is deleted this long after its cover took effect
MAX_ROWS = 4_000_000  # a merge never makes a file of more rows (compact's target_rows)


def after_flush(writer: Any) -> None:
    """The writer thread's call after each flush that wrote segments: every ``KEEP // 2`` flushes, fold down
    to ``KEEP // 2`` live segments per table, so a table never holds more than ``KEEP``. A writer whose
    ``fold`` attribute is False never folds. Never raises."""
    every = max(KEEP // 2, 1)
    done = getattr(writer, "_folded_seq", 0)
    if writer._seq - done < every or getattr(writer, "fold", True) is False:
        return
    writer._folded_seq = writer._seq
    try:
        fold_own(writer.run_dir, writer.writer_id, keep=every, settle_s=SETTLE_S, grace_s=GRACE_S)
    except Exception as exc:  # a fold is housekeeping: the rows are already committed
        writer._problem("fold_error", f"folding its own segments failed ({type(exc).__name__}: {exc}); "
                                      "the segments stay as written")


def _listing(run_dir: Path, writer_id: str, tables: tuple[str, ...] = tuple(TABLES)) -> list[Entry]:
    """This writer's segments of ``tables`` and its commit records, as ``live.list_run`` lists a run."""
    out: list[Entry] = []
    for top, keep in ((run_dir / COMMITS, lambda n: n.endswith(".json")), *(
            (run_dir / t, lambda n: SEGMENT_RE.match(n) is not None) for t in tables)):
        d = top / f"writer={writer_id}"
        try:
            names = [f for f in d.iterdir() if keep(f.name) and not f.name.startswith(".")]
        except (FileNotFoundError, NotADirectoryError):
            continue
        for f in names:
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            out.append(Entry(str(f), st.st_size, st.st_mtime_ns // 1000))
    return out


def fold_own(run_dir: Path, writer_id: str, keep: int = KEEP, settle_s: float = SETTLE_S,
             grace_s: float = GRACE_S) -> int:
    """Merge this writer's segments down to ``keep`` live ones per table and delete what no query reads any
    more; returns the merges written (0 also when another compactor holds the run's lock)."""
    from dynascope.store import compact  # compaction's merge, lock and deletion rules

    with compact._run_lock(run_dir) as locked:
        if not locked:
            return 0
        files = RunFiles.parse(run_dir, _listing(run_dir, writer_id))
        stats = compact.CompactStats()
        compact._remove(files, grace_s, stats, set())
        merges = 0
        settle_us = max(int(settle_s * 1e6), 50_000)
        for wdir, table, _ in list(files.writer_dirs()):
            while True:  # after a merge only this table's directory and the commit records are listed again
                files = RunFiles.parse(run_dir, _listing(run_dir, writer_id, (table,)))
                merge_live = files.live(FOREVER_US)  # every merge already written counts, in effect yet or not
                live = [s for s in files.segs.get(wdir, []) if str(s[2]) in merge_live]
                pair = _cheapest_pair(files, live)
                if len(live) <= keep or pair is None:
                    break
                compact._merge(table, pair, settle_us)
                merges += 1
    return merges


def _cheapest_pair(files: RunFiles, live: list[Seg]) -> list[Seg] | None:
    """The two adjacent live segments with the fewest rows together (under ``MAX_ROWS``), committed ones only."""
    best, best_rows = None, None
    rows = [num_rows(p) for _, _, p in live]
    for i in range(len(live) - 1):
        a, b = live[i], live[i + 1]
        if files.uncommitted(a[2].parent, a) or files.uncommitted(b[2].parent, b):
            continue  # a flush in progress is not data yet
        n = rows[i] + rows[i + 1]
        if n <= MAX_ROWS and (best_rows is None or n < best_rows):
            best, best_rows = [a, b], n
    return best
