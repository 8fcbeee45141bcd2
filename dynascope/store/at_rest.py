"""A finished run at rest: once none of its writers will write again, their directories are folded together
and what that leaves behind is deleted, so the run holds a few files per table with no manual command.

Who does it: the last writer to close (``RunWriter.close``: the fold, on its closing thread within close's
deadline), then a process of its own for the deletions that wait out grace periods (``settle_later``), which
any reader that opens a finished run left untidy also starts (``open_store``; neither with
``DYNASCOPE_FOLD=0``), the way ``dynascope compact`` would and under its lock (``lease_lock.run_lock``): one of them
at a time. A writer leaves ``_writers/<id>.closed`` once its ``run_end`` is committed and its thread has
stopped; the run is finished when every writer with a heartbeat has that marker or a heartbeat older than a
crashed writer's (twice its flush interval plus ``finished.CRASHED_MARGIN_S``). One listing of ``_writers``
tells, so a writer that is not the last pays nothing more. Only closed writers are folded here: a crashed
writer's directories, and those of writers without commit records (older runs, imports), are left to
``dynascope compact``, which waits for them to be quiet and checks their rollups.

Each step is a compaction step (``compact_across.fold_writers``, then ``merge.remove_merged``), safe under
kill -9 at any point and within the live-segment rule, with held leases honoured: a fold interrupted, or
whose grace periods outlast the deadline, is finished by the next close, open or ``dynascope compact``.
The grace here is short (``GRACE_S``): a query that still opens a deleted segment runs again
(``reader.retry_vanished``), and an engine reading a file list takes a lease (``snapshot``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from dynascope.store import journal, lease_lock
from dynascope.store.compact_across import fold_writers
from dynascope.store.finished import CRASHED_MARGIN_S
from dynascope.store.layout import HEARTBEATS, is_writer_dir
from dynascope.store.merge import remove_merged
from dynascope.store.runfiles import RunFiles
from dynascope.store.schema import TABLES

__all__ = ["CLOSED", "GRACE_S", "SETTLE_S", "auto_fold", "finished_writers", "mark_closed", "settle", "settle_later"]

CLOSED = ".closed"  # <run>/_writers/<writer_id>.closed: its run_end is committed, it writes no more
SETTLE_S = 2.0  # the fold takes effect this long after it is written (compact's settle_s)
GRACE_S = 1.0  # its sources, then its covers, go this long after they stop being read
TARGET_ROWS = 4_000_000  # rows per merged file (compact's target_rows)
_spawned: dict[Path, subprocess.Popen] = {}  # the settling process this process started per run
_spawned_lock = threading.Lock()


def auto_fold() -> bool:
    """Whether writers and readers fold on their own (the default). ``DYNASCOPE_FOLD=0`` turns it off: writers
    keep every segment as written and readers fold nothing, so only ``dynascope compact`` merges."""
    return os.environ.get("DYNASCOPE_FOLD", "1") != "0"


def mark_closed(run_dir: Path, writer_id: str) -> None:
    """Declare that this writer will not write again (its last flush is committed)."""
    (run_dir / HEARTBEATS / f"{writer_id}{CLOSED}").touch()


def finished_writers(run_dir: Path) -> dict[str, bool] | None:
    """Every writer of the run with a heartbeat -> closed (True) or crashed (False), or None while one of them
    may still write (and for a run without heartbeats: nothing here says it is finished)."""
    try:
        names = os.listdir(run_dir / HEARTBEATS)
    except OSError:
        return None
    closed = {n.removesuffix(CLOSED) for n in names if n.endswith(CLOSED)}
    beats = [n.removesuffix(".json") for n in names if n.endswith(".json") and not n.startswith(".")]
    if not beats:
        return None
    now = time.time()
    for wid in beats:
        if wid in closed:
            continue
        beat = run_dir / HEARTBEATS / f"{wid}.json"
        try:
            age = now - beat.stat().st_mtime
            flush_s = float(json.loads(beat.read_text(encoding="utf-8")).get("flush_secs", 2.0))
        except (OSError, ValueError, TypeError, AttributeError):
            return None  # being written, or unreadable: not known to be done
        if age <= 2 * flush_s + CRASHED_MARGIN_S:
            return None  # alive, as far as anyone can tell
    return {wid: wid in closed for wid in beats}


def _untidy(run_dir: Path, writers: set[str] | dict[str, bool]) -> bool:
    """Whether any table still holds a directory of one of ``writers`` (one listing per table)."""
    for table in TABLES:
        try:
            names = os.listdir(run_dir / table)
        except OSError:
            continue
        if any(is_writer_dir(n) and n.removeprefix("writer=") in writers for n in names):
            return True
    return False


def settle(run_dir: Path, until: float, settle_s: float | None = None, grace_s: float | None = None,
           once: bool = False) -> bool:
    """Fold the closed writers of ``run_dir`` together and delete what no query reads any more, passing
    again as grace periods end, until ``until`` (``time.monotonic()``; ``once``: one pass); True once the run
    is at rest. Returns False at once while a writer may still write. While another compactor holds the run
    (a closing writer's pass, ``dynascope compact``) it waits for it, passing when it can (``once``: False)."""
    settle_s = SETTLE_S if settle_s is None else settle_s
    grace_s = GRACE_S if grace_s is None else grace_s
    settle_us = max(int(settle_s * 1e6), 50_000)
    pause = max(min(grace_s, settle_s) / 2, 0.02)
    while True:
        with lease_lock.run_lock(run_dir) as locked:
            if locked:
                writers = finished_writers(run_dir)
                if writers is None:
                    return False
                if _fold_pass(run_dir, writers, grace_s, settle_us):
                    return True
        if once or time.monotonic() + pause > until:
            return False
        time.sleep(pause)


def _fold_pass(run_dir: Path, writers: dict[str, bool], grace_s: float, settle_us: int) -> bool:
    """One pass of ``settle``, under the run's lock; True if the run is at rest after it."""
    closed = {w for w, c in writers.items() if c}
    files = RunFiles.of(run_dir)
    # journals of writers that will not seal them: sealed for them, or deleted once covered
    if journal.seal_orphans(files, set(writers), grace_s):
        files = RunFiles.of(run_dir)
    done = remove_merged(files, grace_s, closed)
    if done.segments or done.commits:
        files = RunFiles.of(run_dir)
    # Closed writers only: a crashed one (its segment 0 may lie under a cover's range) and writers
    # without commit records (older runs, imports) wait for `dynascope compact`.
    fold_writers(files, {w: True for w in closed if f"writer={w}" in files.keeps}, settle_us, TARGET_ROWS)
    # A directory a killed pass left with only a temp file went above (``remove_spent``).
    return not _untidy(run_dir, closed)


def settle_later(run_dir: Path, seconds: float = 120.0) -> None:
    """If ``run_dir`` is finished and not at rest, settle it in a process of its own (``python -m
    dynascope.store.at_rest``, detached, at low priority; one at a time per run per process): the grace
    periods that end after this process has exited are its to wait out, and no thread of this process is
    left inside Arrow or DuckDB when it exits. Cheap when there is nothing to do (a listing of ``_writers``,
    and one of each table while a finished run is untidy); never raises."""
    if not auto_fold():
        return
    try:
        writers = finished_writers(run_dir)
        closed = {w for w, c in (writers or {}).items() if c}
        if not closed or not _untidy(run_dir, closed) or not os.access(run_dir, os.W_OK):
            return
    except OSError:
        return
    with _spawned_lock:
        for run, proc in list(_spawned.items()):
            if proc.poll() is not None:  # exited (reaped here): at rest, or at its deadline and due a successor
                del _spawned[run]
        if run_dir in _spawned:
            return
        try:
            _spawned[run_dir] = subprocess.Popen(
                [sys.executable, "-m", "dynascope.store.at_rest", str(run_dir), str(seconds), str(SETTLE_S),
                 str(GRACE_S)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, close_fds=True)
        except OSError:  # no process to spare: the next open, or `dynascope compact`, does it
            pass


def _forget_spawned() -> None:
    """In a forked child: the parent's settling processes are not the child's to wait for, and a thread of
    the parent may have held the lock at the fork."""
    global _spawned_lock
    _spawned_lock = threading.Lock()
    _spawned.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_spawned)


if __name__ == "__main__":  # settle_later's process: RUN SECONDS SETTLE_S GRACE_S
    with contextlib.suppress(OSError):
        os.nice(10)  # housekeeping: behind the training and the readers on the machine
    run, secs, settle_arg, grace_arg = sys.argv[1:5]
    settle(Path(run), time.monotonic() + float(secs), float(settle_arg), float(grace_arg))
