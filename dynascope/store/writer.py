"""The store writer: buffer rows in memory, flush immutable Parquet segments from a background thread.

One ``RunWriter`` per process. ``append`` only queues the caller's batch (``buffer``) under a lock and never
touches the disk, so it cannot block training (unless ``max_block_s`` asks it to wait for room). A daemon
thread converts the queued batches to Arrow and writes them every ``flush_rows`` rows or ``flush_secs``
seconds, and at ``close``/atexit, as one commit (``flush``: a table's segment with its rollups, and one
commit record naming them); it also touches the writer's heartbeat file so ``dynascope runs`` can tell
live from crashed. Every few flushes the thread folds the writer's own segments (``own_fold``), so each
table of it holds a bounded number of files. ``close`` records a ``run_end`` event, within its timeout
whatever the disk does, and the run's last writer to close folds the run's writers together
(``writer_close``, ``at_rest``).

Failures never propagate into the caller: a failed write keeps its rows as they were encoded (``backlog``;
bounded with the buffer by ``max_buffer_rows`` and ``max_buffer_bytes``, oldest dropped first and counted),
warns once per kind, and is retried with exponential backoff; the run directory is recreated if it
vanished; a batch that cannot be typed is dropped alone. Dropped rows, write errors and thread errors
become rows in ``events``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa

from dynascope.core.clock import now_us
from dynascope.core.version import __version__
from dynascope.core.warn import warn
from dynascope.store import at_rest, lineage, open_writers, own_fold, preempt, writer_close
from dynascope.store.backlog import Backlog, Backoff
from dynascope.store.buffer import TableBuffer, batch_len, drop_oldest, salvage, take_all, to_arrow
from dynascope.store.flush import (
    Flushed,
    Group,
    release_arrow_memory,
    with_rollups,
    write_begin,
    write_empty_segments,
    write_flush,
)
from dynascope.store.journal import Journal
from dynascope.store.layout import MARKER, create_run, heartbeat_path, read_marker, safe_id, touch_heartbeat
from dynascope.store.node import attach as attach_node
from dynascope.store.node import node_key
from dynascope.store.rollup import ROLLUP_TABLES
from dynascope.store.rollup_across import BY_TENSOR
from dynascope.store.schema import SCHEMA_VERSION, TABLES
from dynascope.store.views import COLUMNS_ID

__all__ = ["RunWriter", "release_arrow_memory"]

class RunWriter:
    """Append-only writer for one process of one run.

    Args:
        run_dir: the run directory (created with its marker if missing).
        rank, role: identify this process; every row carries them (role None or "": ``trainer``).
        flush_rows / flush_secs: flush when either is reached.
        max_buffer_rows / max_buffer_bytes: rows and bytes held in memory at most (buffered and awaiting a
            retry); beyond either the oldest batches are dropped and counted.
        max_block_s: how long ``append`` may wait for room before dropping (0, the default: never blocks).
        run_name, world_size, framework, config: recorded in ``runs`` by the process that creates the run.
        fold: keep its files bounded: fold its own segments every few flushes (``own_fold``) and, as the
            run's last writer to close, the run's writers together (``at_rest``). Default: on, unless the
            environment sets ``DYNASCOPE_FOLD=0`` (``at_rest.auto_fold``).
        seal_secs: append each flush to a journal per table, sealed into segments this often and at close
            (``journal``: no file created per flush); None (the default here): a segment per flush.
        node: share one writer per node (``node``): True, or a key naming the node (default: the host
            name); None: ``DYNASCOPE_NODE_WRITER``, off unless set.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        rank: int = 0,
        role: str | None = "trainer",
        flush_rows: int = 200_000,
        flush_secs: float = 2.0,
        max_buffer_rows: int = 5_000_000,
        max_buffer_bytes: int = 256 << 20,
        max_block_s: float = 0.0,
        run_name: str | None = None,
        world_size: int = 1,
        framework: str = "pytorch",
        config: dict | None = None,
        compression: str = "auto",
        fold: bool | None = None,
        seal_secs: float | None = None,
        node: bool | str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.rank, self.role = int(rank), str(role or "trainer")  # None: not given, as in ``watch``
        self.flush_rows, self.flush_secs = int(flush_rows), float(flush_secs)
        self.max_buffer_rows, self.max_buffer_bytes = int(max_buffer_rows), int(max_buffer_bytes)
        self.max_block_s = float(max_block_s)
        self.compression = compression
        self.writer_id = safe_id(f"r{self.rank}-{self.role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        self.rows_written = 0
        # fold its own segments (``own_fold``) and, closing last, the run's (``at_rest``)
        self.fold = at_rest.auto_fold() if fold is None else bool(fold)
        self.upkeep = own_fold.Upkeep()  # its fold's bookkeeping: flushes since the last, deletion windows
        self.journal = None if seal_secs is None else Journal(self.run_dir, self.writer_id, seal_secs, compression=compression)
        self.rows_dropped = 0
        self.write_errors = 0
        self._seq = 0
        self._begun = False  # this writer's begin record is on disk (see ``flush.write_begin``)
        self._fresh_state()
        self._backoff = Backoff(self.flush_secs)
        self._closed = False
        self._close_once, self._close_done = threading.Lock(), threading.Event()  # the first close; its end
        self.forked = False  # a copy inherited through fork (``open_writers``): inert
        self.close_timed_out = False  # close() returned at its deadline with a flush still running
        self._failing = False  # inside a streak of failed segment writes
        self._warned: set[str] = set()
        self._unreported_drops: dict[str, tuple[int, int]] = {}
        self.generation = now_us()  # this process's start: its rows outrank an earlier process's (lineage)
        self.run_id = self._init_run(run_name, world_size, framework, config or {})
        # pyarrow's first conversion imports pandas when installed (~0.3-1 s holding the GIL): done here,
        # on the thread that makes the writer, so it does not land in a training step at the first flush.
        pa.array([0])
        self._heartbeat_path = heartbeat_path(self.run_dir, self.writer_id)
        self._heartbeat()
        key = node_key(node)
        self.node = None if key is None else attach_node(self, key)  # the node's writer, or a sender to it
        self._thread = threading.Thread(target=self._loop, name=f"dynascope-writer-{self.rank}", daemon=True)
        self._thread.start()
        open_writers.add(self)
        preempt.install(open_writers.close_all)  # SIGTERM flushes, then chains to the handler that was there

    def _fresh_state(self) -> None:
        """Locks and empty buffers: at start, and in a forked child (``_forget``)."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the thread waits here for rows
        self._room = threading.Condition(self._lock)  # a blocked append waits here for space
        self._flush_lock = threading.Lock()  # one flush at a time (thread, close, explicit flush)
        self._buffers: dict[str, TableBuffer] = {t: TableBuffer() for t in TABLES}
        self._buffered = self._buffered_bytes = 0
        self._backlog = Backlog()  # encoded groups whose write failed, retried as they are
        self._pending_events: list[dict[str, Any]] = []

    def _init_run(self, name: str | None, world_size: int, framework: str, config: dict) -> str:
        run_id = safe_id(self.run_dir.name)
        meta = _marker(run_id)
        if create_run(self.run_dir, meta, write_empty_segments):
            self.append("runs", {
                "name": name or self.run_dir.name, "start_us": meta["created_us"], "host": socket.gethostname(),
                "world_size": world_size, "framework": framework,
                "config_json": json.dumps(config, default=str, sort_keys=True),
                "dynascope_version": __version__, "schema_version": SCHEMA_VERSION,
            })
            return run_id
        lineage.note_restart(self)  # a second process of this rank: a restart, a resume, a directory reused
        return str(read_marker(self.run_dir).get("run_id", run_id))

    # ---- the hot path -------------------------------------------------------------------------------
    def append(self, table: str, columns: dict[str, Any]) -> None:
        """Buffer a batch: ``columns`` maps column → list/array (all one length) or a scalar to broadcast.

        Never raises for bad data on the training thread's behalf: unknown tables or ragged columns are
        reported as an ``events`` row and a warning.
        """
        try:
            n = batch_len(columns)
        except ValueError as exc:
            self._problem("bad_batch", f"{table}: {exc}")
            return
        if table not in TABLES:
            self._problem("bad_batch", f"unknown table {table!r}")
            return
        if table == BY_TENSOR:  # compaction's own: its rows stand for tensor_stats rows only as it wrote them
            self._problem("bad_batch", f"{table} is written by `dynascope compact`, not appended to")
            return
        if n == 0:
            return
        with self._lock:
            if self._closed:
                return
            if self.max_block_s > 0 and self._over_locked(n) > (0, 0):
                self._wake.notify()
                self._room.wait_for(lambda: self._closed or self._over_locked(n) <= (0, 0), timeout=self.max_block_s)
            buf = self._buffers[table]
            before = buf.nbytes
            buf.add(n, columns)
            self._buffered += n
            self._buffered_bytes += buf.nbytes - before
            if self._over_locked() > (0, 0):
                self._drop_oldest_locked()
            if self._buffered >= self.flush_rows:
                self._wake.notify()

    def event(self, kind: str, message: str = "", *, step: int | None = None, severity: str = "info",
              dur_us: int | None = None, **fields: Any) -> None:
        """Record an event row (checkpoint, fault, restart, warning...)."""
        self.append("events", {
            "step": step, "time_us": now_us(), "event": kind, "severity": severity, "message": message,
            "dur_us": dur_us, "fields_json": json.dumps(fields, default=str) if fields else None,
        })

    def _over_locked(self, extra_rows: int = 0) -> tuple[int, int]:
        """Rows and bytes held beyond the bounds (each <= 0 when within), counting the backlog."""
        return (max(self._buffered + self._backlog.rows + extra_rows - self.max_buffer_rows, 0),
                max(self._buffered_bytes + self._backlog.nbytes - self.max_buffer_bytes, 0))

    def _drop_oldest_locked(self) -> None:
        # Oldest first: the backlog's groups (older than anything buffered), then the buffers' batches.
        # The count becomes one events row per table at the next flush (not one per drop: a writer far
        # behind drops on every append).
        rows, nbytes = self._over_locked()
        dropped = self._backlog.drop_oldest(rows, nbytes)
        rows -= sum(n for n, _ in dropped.values())
        nbytes -= sum(b for _, b in dropped.values())
        from_buffers = drop_oldest(self._buffers, rows, nbytes) if rows > 0 or nbytes > 0 else {}
        self._buffered -= sum(n for n, _ in from_buffers.values())
        self._buffered_bytes -= sum(b for _, b in from_buffers.values())
        for part in (dropped, from_buffers):
            for table, (n, b) in part.items():
                self.rows_dropped += n
                r0, b0 = self._unreported_drops.get(table, (0, 0))
                self._unreported_drops[table] = (r0 + n, b0 + b)

    # ---- flushing -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        due = time.monotonic() + self.flush_secs  # the next flush
        retry = 0.0  # a deletion wake that could not delete (a compact holds the lock) waits a second
        while True:
            with self._lock:
                early = False
                if not self._closed and self._buffered < self.flush_rows:
                    now = time.monotonic()
                    wake = max(own_fold.wake_s(self), retry - now)
                    notified = self._wake.wait(max(min(due - now, wake), 0.0))  # appends notify to flush
                    early = wake < due - now and not notified and not self._closed
                while not early and not self._closed and (backoff := self._backoff.wait_s()) > 0:  # failed writes
                    self._wake.wait(backoff)
                while not early and not self._closed and (hold := own_fold.hold_s(self)) > 0:  # a merge settling
                    self._wake.wait(hold)
                if self._closed:
                    return
            if early:  # woken for a deletion window (``own_fold.wake_s``), not to flush
                own_fold.tend(self)
                retry = time.monotonic() + 1.0
                continue
            due = time.monotonic() + self.flush_secs
            self._heartbeat()
            seq = self._seq
            try:
                self.flush()
            except Exception as exc:  # never let the thread die silently
                self._problem("writer_error", f"flush failed: {type(exc).__name__}: {exc}")
            if self._seq != seq:  # it wrote: give Arrow's memory back
                release_arrow_memory()
            own_fold.tend(self)  # every few flushes (explicit ones too), fold its own segments

    def flush(self) -> None:
        """Write everything buffered now as one commit (called by the thread; safe to call from anywhere)."""
        with self._flush_lock:
            with self._lock:
                groups = self._backlog.take()  # older than anything buffered: first in the commit
                self._room.notify_all()
            # A backlog drops whole groups: a writer that fell behind writes its rows in flush_rows parts
            groups += [g for table, buf in take_all(self).items() for part in buf.split(self.flush_rows)
                       if (g := self._group(table, part)) is not None]
            if not groups:
                self._seal()  # a journal's seal falls due without new rows too
                return
            try:
                if not (self.run_dir / MARKER).exists():
                    self._recreate_run_dir()
                done = self._commit(groups)
            except Exception as exc:
                done = Flushed(failed=[(g, exc) for g in groups], next_seq=self._seq)
            self._seq = done.next_seq
            self.upkeep.flushes += bool(done.committed) and self.journal is None
            # rows_written counts what was appended, not derived rows
            self.rows_written += sum(a.num_rows for g in done.committed for t, a in g.parts if t not in ROLLUP_TABLES)
            for g, err in done.failed:
                self.write_errors += 1
                # One events row per streak of failures (it lands once writing works again), not one per retry.
                self._problem("write_error", f"{g.table}: segment write failed ({type(err).__name__}: {err}); rows "
                              f"kept in memory and retried as encoded, backing off to {self._backoff.cap_s:g} s",
                              emit_event=not self._failing)
                self._failing = True
                with self._lock:
                    self._backlog.keep(g)
                    if self._over_locked() > (0, 0):
                        self._drop_oldest_locked()
            self._backoff.record(ok=not done.failed)
            if done.committed and not done.failed and self._failing:
                self._failing = False
                with self._lock:
                    self._pending_events.append({"event": "write_recovered", "severity": "info",
                                                 "message": "segment writes succeed again",
                                                 "write_errors": self.write_errors})
            self._seal()

    def _seal(self, force: bool = False) -> None:
        """Seal the journal when due (``force``: at close); a seal wrote segments, which the fold counts."""
        if self.journal is not None:
            self.upkeep.flushes += self.journal.tend(force, self._problem)

    def _commit(self, groups: list[Group]) -> Flushed:
        """Write the groups' segments and commit record, or journal them, or hand them to the node's writer
        (the seam tests use to fail the disk)."""
        if self.node is not None and self.node.alive:
            if (done := self.node.forward(groups)) is not None:
                return done
            groups = [self._rolled(g.table, g.parts[0][1], g.buffered) for g in groups]  # it fell back
        if not self._begun:
            write_begin(self.run_dir, self.writer_id)
            self._begun = True
        if self.journal is not None:
            return self.journal.write(groups, self._seq)
        return write_flush(self.run_dir, self.writer_id, self._seq, groups, self.compression)

    def _group(self, table: str, buf: TableBuffer) -> Group | None:
        """A table's buffered rows as Arrow, with their rollups: one group of the commit."""
        try:
            arrow = self._to_arrow(table, buf)
        except Exception:
            arrow, buf = salvage(table, buf, self._to_arrow, lambda n, exc: self._bad_batch(table, n, exc))
            if arrow is None:
                return None
        if self.node is not None and self.node.alive:  # the node's writer computes rollups over all it writes
            return Group(table, [(table, arrow)], buf)
        return self._rolled(table, arrow, buf)

    def _rolled(self, table: str, arrow: pa.Table, buf: TableBuffer) -> Group:
        return with_rollups(table, arrow, buf, lambda name, exc: self._problem(
            "rollup_error", f"{name}: rollup failed ({type(exc).__name__}: {exc})"))

    def _to_arrow(self, table: str, buf: TableBuffer) -> pa.Table:
        return to_arrow(table, buf, self.run_id, self.rank, self.role, self.generation)

    def _bad_batch(self, table: str, n: int, exc: Exception) -> None:
        self.rows_dropped += n
        self._problem("bad_batch", f"{table}: a batch of {n} rows could not be typed and was dropped "
                                   f"({type(exc).__name__}: {exc})")

    def _recreate_run_dir(self) -> None:
        self._problem("run_dir_missing", f"{self.run_dir} vanished; recreating it", emit_event=False)
        meta = {**_marker(self.run_id), "recreated": True}
        create_run(self.run_dir, meta, write_empty_segments)
        self._begun = False
        if self.journal is not None:
            self.journal.reset()  # its files went with the directory
        self._heartbeat()
        with self._lock:
            self._pending_events.append({"event": "run_dir_recreated", "severity": "warning",
                                         "message": f"{self.run_dir} was deleted during the run and recreated"})

    def _heartbeat(self) -> None:
        """Touch this writer's heartbeat file so ``dynascope runs`` can tell a live run from a crashed one."""
        touch_heartbeat(self._heartbeat_path, {"writer_id": self.writer_id, "rank": self.rank, "role": self.role,
                                               "pid": os.getpid(), "host": socket.gethostname(),
                                               "flush_secs": self.flush_secs})

    def _problem(self, kind: str, message: str, emit_event: bool = True) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warn(f"dynascope: {message}", RuntimeWarning, stacklevel=3)
        if emit_event:
            with self._lock:
                self._pending_events.append({"event": kind, "severity": "warning", "message": message})

    # ---- shutdown -----------------------------------------------------------------------------------
    def close(self, timeout_s: float = 30.0) -> None:
        """Flush what is buffered and stop the thread, within ``timeout_s`` whatever the disk does; the run's
        last writer to close also folds the run's writers together in what is left of it (``writer_close``,
        ``at_rest``). Once: a close while another is under way (SIGTERM's, then the exit's) waits, within
        ``timeout_s``, for that one's last work to end instead of letting the process end under it."""
        if self._close_once.acquire(blocking=False):
            writer_close.close_writer(self, timeout_s)
        else:
            self._close_done.wait(timeout_s)

    def __enter__(self) -> RunWriter:
        return self
    def __exit__(self, *exc: object) -> None:
        self.close()

    def _forget(self) -> None:
        """In a forked child (``open_writers``): inert (``writer_close.forget``)."""
        writer_close.forget(self)


def _marker(run_id: str) -> dict[str, Any]:
    """A run's marker as its creator writes it: the schema version and columns its segments carry."""
    return {"schema_version": SCHEMA_VERSION, "columns": COLUMNS_ID, "run_id": run_id, "created_us": now_us()}
