"""A live writer folds its own segments, so it holds a bounded number of files however long it runs.

Each flush adds a segment per table it wrote. Every ``EVERY`` (4) flushes the writer thread merges, in each
table's directory, a run of adjacent live segments whose merge leaves ``LEAVE`` (3), so a table holds at
most ``LEAVE + EVERY`` (7) live segments, and ``KEEP`` (8) with the one flush the writer lets land while the
merge settles (``hold_s``). Of the runs that leave the segments' sizes ordered, oldest largest, it takes
the one with the fewest rows (``pick``): a segment joins its older neighbour once it has caught up with it,
so a row is rewritten far fewer times than there are folds. A journal writer
makes a segment per seal, not per flush, and folds every ``SEALED_EVERY`` (2) seals to ``SEALED_LEAVE`` (2):
at most ``SEALED_KEEP`` (5). The merge is compaction's own (``merge``, which ``dynascope compact`` uses too: a
merged file ``<lo>-<hi>.v<valid_from>`` takes effect ``SETTLE_S`` after it is written and covers its sources
for every query that starts later), under the writer's own lock (``lease_lock.writer_lock``), which
``dynascope compact`` takes too before it merges in a writer's directory, so the two never write overlapping
merges while the writers of a run never wait on each other; a writer that finds its lock taken tries again at
its next flush. A source is deleted ``GRACE_S`` after its cover took effect, in the first deletion window
after that (``DELETE_PERIOD_S``), then the commit records none of whose segments is left. A query that began
before and still opens a deleted source runs again (``reader.retry_vanished``), so the grace can be short: it
bounds the files on disk, not the live ones.

Only the writer's own directories are listed (one directory per table and its commit records), never
the run's: at a thousand ranks a fold costs the same as at one. Errors are the writer's to report, once;
a fold that fails leaves every file as it was (the merged file is renamed into place whole, or not at all).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynascope.store import lease_lock
from dynascope.store.layout import COMMITS, SEGMENT_RE
from dynascope.store.live import FOREVER_US, Entry
from dynascope.store.merge import merge_segments, remove_merged
from dynascope.store.runfiles import RunFiles, Seg, num_rows
from dynascope.store.schema import TABLES

__all__ = ["DELETE_PERIOD_S", "DELETE_WINDOW_S", "EVERY", "GRACE_S", "KEEP", "LEAVE", "SEALED_EVERY", "SEALED_KEEP",
           "SEALED_LEAVE", "SETTLE_S", "Upkeep", "fold_own", "hold_s", "pick", "tend", "wake_s"]

KEEP = 8  # live segments per table a writer holds at most
SETTLE_S = 2.0  # a merged file takes effect this long after it is written (compact's settle_s)
GRACE_S = 10.0  # a merged-away source is deleted this long after its cover took effect
MAX_ROWS = 4_000_000  # a merge never makes a file of more rows (compact's target_rows)


EVERY = max(KEEP // 2, 1)  # committed flushes between two folds
LEAVE = max(KEEP - EVERY - 1, 1)  # live segments a fold leaves in a table: one flush may land as it settles
# A journal writer's segments come from its seals (every ``seal_secs``: 300 s for watch()), not its flushes,
# so a fold is due seldom and merges little: it folds every SEALED_EVERY seals down to SEALED_LEAVE, and a
# table holds SEALED_LEAVE + SEALED_EVERY (4) sealed segments and its journal, 5 files a query opens per
# writer instead of 8 (SEALED_KEEP counts a fifth segment: a seal that lands in the 2 s a merge settles).
# It costs 2.5 metadata operations a seal and table where folding every EVERY seals costs 1.75.
SEALED_EVERY = 2
SEALED_LEAVE = 2
SEALED_KEEP = SEALED_LEAVE + SEALED_EVERY + 1  # sealed segments per table a journal writer holds at most
# Deletions happen only in the first DELETE_WINDOW_S of each DELETE_PERIOD_S of the wall clock, the same
# windows for every writer of a run. A query binds every file its glob lists, live or not, so a deletion
# anywhere in a table sends a query of it running again (``reader.retry_vanished``); a thousand writers
# deleting whenever their folds end would hit every query of the live run, again and again. Outside the
# windows nothing is deleted, so a query that meets one runs again once it is over. A writer whose merged-away
# sources wait wakes its thread at the window's start (``wake_s``) whatever its flush interval: watch()'s
# 10 s interval would otherwise land in a 2.5 s window of each 20 s only by the phase of its clock.
DELETE_PERIOD_S = 20.0
DELETE_WINDOW_S = 2.5


@dataclass
class Upkeep:
    """A writer's fold bookkeeping, kept by its flushes and its thread."""

    flushes: int = 0  # committed flushes since its last fold
    deleted_in: int = -1  # the last deletion window it deleted in
    settles_at_us: int = 0  # when its last merge takes effect (its sources count until then)
    delete_from_us: int = 0  # when its merged-away sources may go (0: none wait)


def hold_s(writer: Any) -> float:
    """How long the writer thread holds its next flush: while its last merge settles, one flush may land
    (``KEEP`` counts it), a second waits until the merge takes effect, so a table never holds more than
    ``KEEP`` live segments however fast flushes come. Rows wait in the buffer, never the training thread."""
    up: Upkeep = writer.upkeep
    return max(up.settles_at_us / 1e6 - time.time(), 0.0) if writer.fold and up.flushes >= 1 else 0.0


def wake_s(writer: Any) -> float:
    """Seconds until the writer thread should wake to delete its merged-away sources: the start of the first
    deletion window it has not deleted in, once their grace is over; ``inf`` when none wait."""
    up: Upkeep = writer.upkeep
    if not writer.fold or not up.delete_from_us:
        return math.inf
    now = time.time()
    t = max(now, up.delete_from_us / 1e6)
    window = int(t // DELETE_PERIOD_S)
    if t % DELETE_PERIOD_S >= DELETE_WINDOW_S or window == up.deleted_in:
        window += 1
        t = window * DELETE_PERIOD_S + 0.01  # just inside it: the clock's resolution never lands before
    return max(t - now, 0.0)


def tend(writer: Any) -> None:
    """The writer thread's call at each wake: fold once ``EVERY`` flushes were committed since the last
    fold (explicit ``flush()`` calls included) down to ``LEAVE`` live segments per table (a journal writer:
    every ``SEALED_EVERY`` seals, to ``SEALED_LEAVE``), and, once per deletion window, delete what its folds
    merged away. A writer whose ``fold`` is False does neither. Never raises."""
    up: Upkeep = writer.upkeep
    if not writer.fold:
        return
    every, leave = (SEALED_EVERY, SEALED_LEAVE) if writer.journal is not None else (EVERY, LEAVE)
    window = int(time.time() // DELETE_PERIOD_S)
    delete = time.time() % DELETE_PERIOD_S < DELETE_WINDOW_S and up.deleted_in != window
    if up.flushes < every and not delete:
        return
    try:
        valid_us = fold_own(writer.run_dir, writer.writer_id, keep=leave, settle_s=SETTLE_S, grace_s=GRACE_S,
                          delete=delete, merge=up.flushes >= every)
    except Exception as exc:  # a fold is housekeeping: the rows are already committed
        up.flushes = 0
        writer._problem("fold_error", f"folding its own segments failed ({type(exc).__name__}: {exc}); "
                                      "the segments stay as written")
        return
    if valid_us is not None:  # else `dynascope compact` is in its directories: again at the next wake
        if delete and up.delete_from_us <= time.time() * 1e6:
            up.delete_from_us = 0  # this pass deleted every source whose grace was over
        if valid_us:
            up.delete_from_us = max(up.delete_from_us, valid_us + int(GRACE_S * 1e6))
        up.settles_at_us = max(up.settles_at_us, valid_us)
        up.flushes = 0 if up.flushes >= every else up.flushes
        up.deleted_in = window if delete else up.deleted_in


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
             grace_s: float = GRACE_S, *, delete: bool = True, merge: bool = True) -> int | None:
    """Delete what no query of this writer's segments reads any more (``delete``) and merge them down to
    ``keep`` live ones per table (``merge``); returns when the last merge takes effect (µs, 0 for none),
    or None when a ``compact`` holds the writer's lock."""
    with lease_lock.writer_lock(run_dir, writer_id) as locked:
        if not locked:
            return None
        if delete:
            remove_merged(RunFiles.parse(run_dir, _listing(run_dir, writer_id)), grace_s)
        if not merge:
            return 0
        # One listing and one evaluation of the rule for every table: each merge touches its own directory only.
        files = RunFiles.parse(run_dir, _listing(run_dir, writer_id))
        merge_live: frozenset[str] | None = None
        valid_us = 0
        settle_us = max(int(settle_s * 1e6), 50_000)
        for _, table, segs in list(files.writer_dirs()):
            if len(segs) <= keep:
                continue  # fewer files than the bound: nothing to evaluate
            if merge_live is None:
                merge_live = files.live(FOREVER_US)  # every merge already written counts, in effect yet or not
            live = [s for s in segs if str(s[2]) in merge_live]
            group = _cheapest_run(files, live, len(live) - keep + 1)
            if group is not None:
                valid_us = max(valid_us, merge_segments(table, group, settle_us))
    return valid_us


def _cheapest_run(files: RunFiles, live: list[Seg], size: int) -> list[Seg] | None:
    """The ``size`` adjacent committed live segments to merge (``pick``), or the largest shorter run that
    fits under ``MAX_ROWS``; None when no two fit."""
    rows = [num_rows(p) for _, _, p in live]
    ok = [not files.uncommitted(s[2].parent, s) for s in live]  # a flush in progress is not data yet
    run = pick(rows, ok, size)
    return None if run is None else live[run[0]:run[0] + run[1]]


def pick(rows: list[int], ok: list[bool], size: int) -> tuple[int, int] | None:
    """(start, length) of the run of ``size`` adjacent segments (oldest first) to merge: the fewest rows
    together among the runs that leave the segments' rows non-increasing from oldest to newest, else the
    fewest rows; only runs of segments marked ``ok`` and under ``MAX_ROWS``. Shorter runs when none fits.

    The order keeps merges cheap. With the fewest rows alone, the second oldest segment absorbed every
    new one (a merge of 3 adjacent segments of 4 always holds it, and the run without the oldest had the
    fewer rows), so each fold rewrote the run's rows since its start: over 864 seals a row was rewritten 215
    times folding every 2 seals to 2, 107 every 4 to 3. Keeping sizes ordered, a segment grows into its
    older neighbour once it has caught up with it, as in a size-tiered LSM tree: 63 and 12 times."""
    for n in range(min(size, len(rows)), 1, -1):
        best: tuple[tuple[bool, int], int] | None = None
        for i in range(len(rows) - n + 1):
            total = sum(rows[i:i + n])
            if not all(ok[i:i + n]) or total > MAX_ROWS:
                continue
            after = [*rows[:i], total, *rows[i + n:]]
            key = (any(a < b for a, b in itertools.pairwise(after)), total)  # ordered runs first, then fewest
            if best is None or key < best[0]:
                best = (key, i)
        if best is not None:
            return best[1], n
    return None
