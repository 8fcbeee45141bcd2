"""A live writer folds its own segments, so it holds a bounded number of files however long it runs.

Each flush adds a segment per table it wrote. Every ``KEEP // 2`` flushes the writer thread merges, in
each table's directory, the run of adjacent live segments whose rows add up least and whose merge leaves
``KEEP // 2``, in one merge, so a table never holds more than ``KEEP`` live segments: each new small
segment joins its small neighbours first, so a row is rewritten a few times over a run rather than at
every fold. The merge is compaction's own (``compact``:
a merged file ``<lo>-<hi>.v<valid_from>`` takes effect ``SETTLE_S`` after it is written and covers its
sources for every query that starts later), under the writer's own lock (``lease_lock.writer_lock``),
which ``dynascope compact`` takes too before it merges in a writer's directory, so the two never write
overlapping merges while the writers of a run never wait on each other; a writer that finds its lock
taken tries again at its next flush. A source is deleted ``GRACE_S`` after its cover took effect, then the commit records none
of whose segments is left. A query that began before and still opens a deleted source runs again
(``reader.retry_vanished``), so the grace can be short: it bounds the files on disk, not the live ones.

Only the writer's own directories are listed (one directory per table and its commit records), never
the run's: at a thousand ranks a fold costs the same as at one. Errors are the writer's to report, once;
a fold that fails leaves every file as it was (the merged file is renamed into place whole, or not at all).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynascope.store import lease_lock
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
    writer._flushes_unfolded = getattr(writer, "_flushes_unfolded", 0) + 1
    if writer._flushes_unfolded < every or getattr(writer, "fold", True) is False:
        return
    writer._flushes_unfolded = 0
    try:
        if fold_own(writer.run_dir, writer.writer_id, keep=every, settle_s=SETTLE_S, grace_s=GRACE_S) is None:
            writer._flushes_unfolded = every  # `dynascope compact` is in its directories: again at the next flush
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
             grace_s: float = GRACE_S) -> int | None:
    """Merge this writer's segments down to ``keep`` live ones per table and delete what no query reads any
    more; returns the merges written, or None when a ``compact`` holds the writer's lock."""
    from dynascope.store import compact  # compaction's merge and deletion rules

    with lease_lock.writer_lock(run_dir, writer_id) as locked:
        if not locked:
            return None
        stats = compact.CompactStats()
        compact._remove(RunFiles.parse(run_dir, _listing(run_dir, writer_id)), grace_s, stats, set())
        # One listing and one evaluation of the rule for every table: each merge touches its own directory only.
        files = RunFiles.parse(run_dir, _listing(run_dir, writer_id))
        merge_live: frozenset[str] | None = None
        merges = 0
        settle_us = max(int(settle_s * 1e6), 50_000)
        for _, table, segs in list(files.writer_dirs()):
            if len(segs) <= keep:
                continue  # fewer files than the bound: nothing to evaluate
            if merge_live is None:
                merge_live = files.live(FOREVER_US)  # every merge already written counts, in effect yet or not
            live = [s for s in segs if str(s[2]) in merge_live]
            group = _cheapest_run(files, live, len(live) - keep + 1)
            if group is not None:
                compact._merge(table, group, settle_us)
                merges += 1
    return merges


def _cheapest_run(files: RunFiles, live: list[Seg], size: int) -> list[Seg] | None:
    """The ``size`` adjacent committed live segments with the fewest rows together (under ``MAX_ROWS``), or
    the largest shorter run that fits; None when no two fit. New small segments join their small neighbours
    first, so a row is rewritten a few times over a run, not at every fold."""
    rows = [num_rows(p) for _, _, p in live]
    ok = [not files.uncommitted(s[2].parent, s) for s in live]  # a flush in progress is not data yet
    for n in range(min(size, len(live)), 1, -1):
        best, best_rows = None, None
        for i in range(len(live) - n + 1):
            total = sum(rows[i:i + n])
            if all(ok[i:i + n]) and total <= MAX_ROWS and (best_rows is None or total < best_rows):
                best, best_rows = live[i:i + n], total
        if best is not None:
            return best
    return None
