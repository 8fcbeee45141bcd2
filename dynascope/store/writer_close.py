"""How a ``RunWriter`` closes: its last flushes, its ``run_end``, and, for the run's last writer, the run at rest.

The last flushes run on a thread of their own: on a stalled file system (an NFS or Lustre hang) ``close``
returns at the deadline and reports the rows still unwritten; a flush that lands later is whole (its commit
record), and a writer without ``run_end`` reads as crashed. A writer whose last flushes all landed marks
itself closed (``at_rest.mark_closed``); if every writer of the run is then done, this one folds the run's
writers together (``at_rest.settle``, one pass) with what is left of the deadline, and leaves the deletions
that wait out grace periods to a process of its own (``at_rest.settle_later``). That fold is housekeeping:
if it cannot finish in time, ``close`` returns anyway and the next open of the run, or ``dynascope
compact``, finishes it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from dynascope.core.clock import now_us
from dynascope.store import at_rest, node, open_writers
from dynascope.store.backlog import Backlog
from dynascope.store.buffer import TableBuffer
from dynascope.store.flush import release_arrow_memory
from dynascope.store.schema import TABLES

if TYPE_CHECKING:
    from dynascope.store.writer import RunWriter

__all__ = ["close_writer", "forget"]

_MARGIN_S = 0.5  # the fold at close stops passing this long before close's deadline


def close_writer(w: RunWriter, timeout_s: float) -> None:
    """``RunWriter.close``: flush, stop the thread, record ``run_end``, and settle the run if this writer was
    its last, all within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    done: object = None
    while True:  # a node's writer first refuses further flushes and lets those answered land
        if w.node is not None and w.node is not done:
            w.node.before_close(min(2.0, timeout_s / 4))
        done = w.node
        with w._lock:  # a sender taking the node writer's place does so under this lock, unless closed
            if w.node is done:
                w._closed = True
                w._wake.notify_all()
                w._room.notify_all()
                break
    w._thread.join(timeout_s)
    flushed = threading.Event()
    last = threading.Thread(target=_last_work, args=(w, flushed, deadline),
                            name=f"dynascope-writer-close-{w.rank}", daemon=True)
    last.start()
    flushed.wait(max(deadline - time.monotonic(), 0.0))
    if not flushed.is_set():
        with w._lock:
            pending = w._buffered + w._backlog.rows
        w.close_timed_out = True
        w._problem("close_timeout", f"close gave up after {timeout_s:g} s with the disk not answering: "
                   f"{pending} rows still buffered and a flush in progress; they are written if the disk "
                   "comes back before the process exits", emit_event=False)
    else:  # the run's fold, if this writer is its last, bounded by the same deadline
        last.join(max(deadline - time.monotonic(), 0.0))
    if w.node is not None:  # a sender's link, once its last flushes went through it
        w.node.after_close()
    open_writers.discard(w)


def _last_work(w: RunWriter, flushed: threading.Event, deadline: float) -> None:
    """The close thread: the last flushes, then (all written, the writer thread stopped) the closed mark and,
    if no writer of the run writes any more, the run's fold; the deletions that wait out its grace periods
    go to a process of their own (``at_rest.settle_later``). A close called meanwhile waits for the end of
    this (``RunWriter.close``), so the process does not exit under it."""
    try:
        _last_flushes_and_fold(w, flushed, deadline)
    finally:
        w._close_done.set()


def _last_flushes_and_fold(w: RunWriter, flushed: threading.Event, deadline: float) -> None:
    try:
        whole = _final_flushes(w)
        if w.journal is not None and (wait := (w.journal.effective_us - now_us()) / 1e6) > 0:
            # the last seal in effect before close returns: readers of segments only (snapshots, Spark)
            # then see every row as soon as the writer is closed
            time.sleep(min(wait, max(deadline - time.monotonic(), 0.0)))
    finally:
        flushed.set()
    if not whole or w._thread.is_alive() or not w.fold:
        return  # a writer that may still write, whose rows did not all land, or that keeps its files as written
    try:
        at_rest.mark_closed(w.run_dir, w.writer_id)
        # A pass started after close's deadline (the flushes outlasted it) would run on while the process
        # exits, a thread inside DuckDB or Arrow then: the fold goes to a process of its own instead.
        late = time.monotonic() > deadline - _MARGIN_S
        if late or not at_rest.settle(w.run_dir, deadline - _MARGIN_S, once=True):
            at_rest.settle_later(w.run_dir)
    except Exception as exc:  # housekeeping: the rows are committed; the next open or compact folds them
        w._problem("fold_error", f"folding the finished run failed ({type(exc).__name__}: {exc}); "
                                 "the next open or `dynascope compact` folds it", emit_event=False)


def _flush(w: RunWriter) -> None:
    try:
        w.flush()
    except Exception as exc:
        w._problem("writer_error", f"final flush failed: {type(exc).__name__}: {exc}", emit_event=False)


def _final_flushes(w: RunWriter) -> bool:
    """Flush until nothing is pending (``run_end`` included); True when every row landed."""
    for attempt in range(4):  # later passes write events produced by earlier ones, and retry failed writes
        if attempt == 1:
            # run_end lets `dynascope runs` tell a finished run from a crashed one (one per writer).
            with w._lock:
                w._pending_events.append({
                    "event": "run_end", "severity": "info", "message": "writer closed",
                    "writer_id": w.writer_id, "rows_written": w.rows_written,
                    "rows_dropped": w.rows_dropped, "write_errors": w.write_errors, **node.describe(w.node)})
        _flush(w)
        if attempt >= 1 and not w._pending_events and not w._buffered and not w._backlog.rows:
            break
    for attempt in range(2):  # the journal's rows into segments: other engines and reads of the past see segments only
        try:
            with w._flush_lock:
                w._seal(force=True)
        except Exception as exc:
            w._problem("writer_error", f"final seal failed: {type(exc).__name__}: {exc}", emit_event=False)
        with w._lock:
            reported = bool(w._pending_events)
        if not reported or attempt:
            break
        # A seal that failed (renames late on a loaded host, a full disk) reported it as an event: written, and
        # sealed with the rest by a second try. The rows are committed either way (journals count), so the
        # writer is still closed, and the run's fold seals whatever journals are left (``seal_orphans``).
        _flush(w)
    with w._lock:
        lost = w._buffered + w._backlog.rows
        unsaid = bool(w._pending_events)  # run_end among them, perhaps
        w._buffers = {t: TableBuffer() for t in TABLES}
        w._buffered = w._buffered_bytes = 0
        w._backlog, w._pending_events = Backlog(), []  # (the lock stays: close may still hold it)
    if lost:
        w.rows_dropped += lost
        w._problem("rows_lost", f"{lost} rows could not be written before close and were dropped",
                   emit_event=False)
    w._heartbeat()
    release_arrow_memory()  # the final flushes ran on this thread: its heap kept their pages
    return not lost and not unsaid


def forget(w: RunWriter) -> None:
    """A forked child's copy of a writer: fresh locks, no buffers, closed, and a ``close`` that returns at
    once (the parent's locks and events may have been held at the fork, by threads the child lacks)."""
    w._fresh_state()
    w._closed = w.forked = True
    w._close_once, w._close_done = threading.Lock(), threading.Event()
    w._close_once.acquire()
    w._close_done.set()
    w.journal = None  # the parent's files: not this process's to write or seal
    if w.node is not None:
        w.node.forget()  # the parent's sockets: closed here, still open there
        w.node = None
