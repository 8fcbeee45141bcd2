"""A writer's journal: rows reach readers a flush after they are recorded, with no file created per flush.

A flush of segments costs the file system's metadata servers a create and a rename per table, and an
unlink when a fold merges the segment away: ~22 operations a flush for ``watch()``'s tables, ~8,000 an hour
per writer at a flush every 10 s. A journal turns the flushes into appends. Each flush appends its rows as
JSON lines (DuckDB's ``to_json`` of each row, ending in ``"_end":1``) to one file per table of the writer,
``<run>/<table>/writer=<id>/<n>.jsonl``, and fsyncs it; the file was created once.

Every ``seal_secs`` (or once the journals hold ``seal_bytes``), and at close, the writer *seals* them: each
journal's rows become a segment ``<n>-<n>.v<t>.parquet`` of its directory, a merged segment in ``live``'s
terms, which counts from ``t`` (``SETTLE_S`` after it is written) and from then covers journal ``n``
(``live.live_sets``). A query that starts before ``t`` reads the journal, one that starts later reads
the segment (whose file it listed, since it was renamed before ``t``): each row once, at every moment. The
journal is deleted ``GRACE_S`` after ``t``; a query still reading it then runs again
(``reader.retry_vanished``). Later folds merge the sealed segments like any others and cover ``n`` in turn.

- **Numbers.** A journal generation reserves one number per table (its index in ``TABLES`` above the
  writer's next number), so a journal's number names the one segment that seals it.
- **Whole lines.** A line cut short by a crash is not JSON: readers get a row of NULLs, dropped by
  ``_end IS NULL``. A write that fails is cut back to the last whole line (or, failing that, ended by a
  newline before the next) and its rows go back to the writer's backlog, as a failed segment write's do.
- **One parser.** Sealing reads the journal with DuckDB's reader, as queries do, so a sealed segment holds
  exactly the values queries read from the journal.
- **Orphans.** A writer killed before its seal leaves its journals; queries still read them, and the run's
  fold (``at_rest``) seals them on its behalf once the writer is done (``seal_orphans``), and deletes
  journals that a segment covers.

Live queries read journals (``open_store`` of the present), and snapshots copy them for other engines
(``snapshot_journals``); reads at a past ``at_us`` and ``live_files`` read segments only, so they lack a
live writer's last ``seal_secs`` of rows.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa

from dynascope.core.clock import now_us
from dynascope.store.flush import Flushed, Group, write_parquet
from dynascope.store.layout import (
    JOURNAL_RE,
    journal_name,
    schema_journal,
    segment_name,
    valid_from_us,
    writer_dir,
)
from dynascope.store.runfiles import FOREVER_US, RunFiles
from dynascope.store.schema import TABLES
from dynascope.store.views import journal_scan

__all__ = ["GRACE_S", "SEAL_BYTES", "SEAL_SECS", "Journal", "journals_in", "read_journal", "seal_orphans"]

SEAL_SECS = 300.0  # watch()'s default: ~30 metadata operations a seal, ~400 a writer-hour
SEAL_BYTES = 32 << 20  # a writer's journals are sealed once they hold this much: bounds what a query parses
# A sealed segment counts this long after its file is written: time for its renames (a handful; a merge's
# ``own_fold.SETTLE_S`` is 2 s), and the wait of a closing writer for its last seal (``writer_close``).
# After a failed seal the next has twice as long, up to 4 s: on a host loaded far past its cores, renames
# late by a second failed a quarter of 1,280 writers' seals, and each failure put off the next seal 10 s.
SETTLE_S = 1.0
SETTLE_MAX_S = 4.0
ORPHAN_SETTLE_S = 5.0  # the same, for a dead or closed writer's journals sealed on its behalf (``seal_orphans``)
SEAL_RETRY_S = 10.0  # the first wait after a failed seal (it doubles while seals keep failing)
GRACE_S = 10.0  # a sealed journal is deleted this long after its segment took effect
_INDEX = {t: i for i, t in enumerate(TABLES)}


@dataclass
class _File:
    path: Path
    fd: int
    size: int = 0  # bytes of whole lines
    dirty: bool = False  # a write failed after ``size``: cut back, or end the partial line, before the next


@dataclass(eq=False)
class Journal:
    """One writer's journals: ``write`` appends a flush, ``tend`` seals when due and deletes sealed files."""

    run_dir: Path
    writer_id: str
    seal_secs: float = SEAL_SECS
    seal_bytes: int = SEAL_BYTES
    compression: str = "auto"
    base: int | None = None  # the generation's first reserved number; None: no generation open
    started: float = 0.0
    files: dict[str, _File] = field(default_factory=dict)
    sealed: list[tuple[int, list[Path]]] = field(default_factory=list)  # (delete after µs, journals)
    effective_us: int = 0  # when the last seal's segments take effect
    failures: int = 0  # seals failed in a row
    retry_at: float = 0.0  # time.monotonic() of the next try after a failure
    _con: duckdb.DuckDBPyConnection | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def write(self, groups: list[Group], seq: int) -> Flushed:
        """Append ``groups`` (each whole or not at all); ``next_seq`` reserves a generation's numbers."""
        out = Flushed(next_seq=seq)
        if self.base is None:
            self.base, self.started = seq, time.monotonic()
        out.next_seq = max(seq, self.base + len(TABLES))
        for g in groups:
            marks: list[_File] = []
            try:
                for table, arrow in g.parts:
                    f = self._file(table)
                    marks.append(f)
                    _append(f, self._encode(arrow))
            except Exception as exc:
                for f in marks:
                    _cut(f)
                out.failed.append((g, exc))
                continue
            for f in marks:
                f.size = os.lseek(f.fd, 0, os.SEEK_END)
            out.committed.append(g)
        return out

    def tend(self, force: bool, problem: Callable[[str, str], None]) -> bool:
        """Seal when due (``force``: now) and delete the journals sealed a grace ago; True if it sealed.
        A seal that fails is reported to ``problem`` once a run of failures, and tried again after a wait
        that doubles from ``SEAL_RETRY_S`` up to ``seal_secs`` or ``SEAL_RETRY_S``, whichever is longer (a
        full disk: one event, not one a flush)."""
        sealed = False
        if force or (self.due() and time.monotonic() >= self.retry_at):
            try:
                sealed = self.seal()
                self.failures = 0
            except Exception as exc:
                self.failures += 1
                self.retry_at = time.monotonic() + min(SEAL_RETRY_S * 2 ** min(self.failures - 1, 20),
                                                         max(self.seal_secs, SEAL_RETRY_S))
                if self.failures == 1:
                    problem("seal_error", f"sealing the journal failed ({type(exc).__name__}: {exc}); it is still "
                                          f"read, and sealed again in {SEAL_RETRY_S:g} s, then less often")
        self.delete_sealed()
        return sealed

    def due(self) -> bool:
        return self.base is not None and (time.monotonic() - self.started >= self.seal_secs
                                          or sum(f.size for f in self.files.values()) >= self.seal_bytes)

    def seal(self) -> bool:
        """Write every journal of the generation as its segment; True if it did, False with nothing to
        seal. A write that fails raises, and the journals stay and count."""
        if self.base is None:
            return False
        if not self.files:
            self.base = None
            return False
        settle_s = min(SETTLE_S * 2 ** min(self.failures, 8), SETTLE_MAX_S)
        t = self.effective_us = seal_files([f.path for f in self.files.values()], self._connection(), self.compression,
                                           settle_s)
        for f in self.files.values():
            _close(f.fd)
        self.sealed.append((t + int(GRACE_S * 1e6), [f.path for f in self.files.values()]))
        self.files, self.base = {}, None
        return True

    def delete_sealed(self) -> None:
        """Delete the journals whose segments took effect ``GRACE_S`` ago."""
        now, keep = now_us(), []
        for after, paths in self.sealed:
            if after > now:
                keep.append((after, paths))
                continue
            for p in paths:
                try:
                    p.unlink(missing_ok=True)
                except OSError:
                    keep.append((after, [p]))  # tried again at the next flush; ``seal_orphans`` if it never works
        self.sealed = keep

    def reset(self) -> None:
        """Forget the generation (its directory vanished): its files are gone."""
        for f in self.files.values():
            _close(f.fd)
        self.files, self.base, self.sealed = {}, None, []

    def _file(self, table: str) -> _File:
        f = self.files.get(table)
        if f is None:
            assert self.base is not None
            d = writer_dir(self.run_dir, table, self.writer_id)
            d.mkdir(parents=True, exist_ok=True)
            schema = schema_journal(self.run_dir, table)
            if not schema.exists():  # a run made by an older version: readers look for journals by it
                schema.parent.mkdir(parents=True, exist_ok=True)
                schema.touch()
            path = d / journal_name(self.base + _INDEX[table])
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)
            f = self.files[table] = _File(path, fd, os.lseek(fd, 0, os.SEEK_END))
        return f

    def _encode(self, arrow: pa.Table) -> bytes:
        cur = self._connection().cursor()
        try:
            cur.register("rows", arrow)
            text = cur.sql("SELECT string_agg(to_json(r)::VARCHAR, chr(10)) FROM (SELECT *, 1 AS _end FROM rows) r"
                           ).fetchall()[0][0]
        finally:
            cur.close()
        return (text + "\n").encode() if text else b""

    def _connection(self) -> duckdb.DuckDBPyConnection:
        with self._lock:
            if self._con is None:
                _journals.add(self)
                self._con = duckdb.connect(":memory:")
                # one thread: the journal is written and sealed on the writer's thread, beside training
                self._con.execute("SET threads = 1; SET enable_progress_bar = false")
            return self._con


_journals: weakref.WeakSet[Journal] = weakref.WeakSet()


def _forget_connections() -> None:
    """In a forked child: DuckDB crashes freeing a connection its parent made, so each journal's is kept
    from ever being freed (a reference nobody holds), and the journal makes a new one if it needs one."""
    for j in list(_journals):
        if j._con is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(j._con))
            j._con = None
        j._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_connections)


def read_journal(con: duckdb.DuckDBPyConnection, path: Path, table: str | None = None) -> pa.Table:
    """A journal's whole lines as its table's rows, typed by the schema, read as queries read them;
    ``table``: for a file outside its table's directory (default: the directory it is in)."""
    table = path.parent.parent.name if table is None else table
    cur = con.cursor()
    try:
        out: pa.Table = cur.sql(journal_scan("?", table), params=[str(path)]).to_arrow_table()
    finally:
        cur.close()
    return out.cast(TABLES[table])


def seal_files(paths: list[Path], con: duckdb.DuckDBPyConnection, compression: str = "auto",
               settle_s: float = SETTLE_S) -> int:
    """Write each journal ``<n>.jsonl`` as ``<n>-<n>.v<t>.parquet`` beside it, all renamed before ``t``, or
    none (and raise); returns ``t``. ``t`` is taken once the files are written, so only the renames must fit
    in ``settle_s``."""
    staged: list[tuple[Path, int]] = []
    renamed: list[Path] = []
    try:
        for p in paths:
            tmp = p.with_name(f".seal-{uuid.uuid4().hex[:12]}.tmp")
            staged.append((tmp, int(p.name[:12])))
            write_parquet(read_journal(con, p), tmp, compression)
        t = now_us() + int(settle_s * 1e6)
        for tmp, n in staged:
            final = tmp.with_name(segment_name(n, n, t))
            os.replace(tmp, final)
            renamed.append(final)
        if now_us() >= t:  # renamed late: a query that started after t may not have listed them
            raise TimeoutError(f"sealed segments renamed after they took effect ({settle_s:g} s)")
        return t
    except BaseException:
        for q in [tmp for tmp, _ in staged] + renamed:
            try:
                q.unlink(missing_ok=True)
            except OSError:
                pass
        raise


def journals_in(wdir: Path) -> list[tuple[int, Path]] | None:
    """A writer directory's journals as (number, path); None if it cannot be listed."""
    try:
        return [(int(n[:12]), wdir / n) for n in os.listdir(wdir) if JOURNAL_RE.match(n)]
    except OSError:
        return None


def seal_orphans(files: RunFiles, writers: set[str], grace_s: float = GRACE_S) -> int:
    """For the done ``writers`` of a run: seal their journals that no live segment covers, and delete those
    one has covered for ``grace_s``. Returns the journals sealed or deleted."""
    live = files.live(FOREVER_US)
    todo, done, now = [], 0, now_us()
    for w in writers:
        for table in TABLES:
            d = writer_dir(files.run_dir, table, w)
            covering = [(lo, hi, valid_from_us(p)) for lo, hi, p in files.segs.get(d, []) if str(p) in live]
            for n, path in journals_in(d) or []:
                covers = [v for lo, hi, v in covering if lo <= n <= hi]
                if not covers:
                    todo.append(path)
                elif all(v + grace_s * 1e6 <= now for v in covers):
                    path.unlink(missing_ok=True)
                    done += 1
    if todo:
        con = duckdb.connect(":memory:")
        try:
            # Nobody waits for these rows to move (they count from the journal meanwhile): a longer settle,
            # so a pass at low priority on a busy machine does not run late and roll its renames back
            # under a reader that already listed them.
            seal_files(todo, con, settle_s=ORPHAN_SETTLE_S)
            done += len(todo)
        finally:
            con.close()
    return done


def _append(f: _File, data: bytes) -> None:
    if f.dirty:
        try:
            os.ftruncate(f.fd, f.size)
        except OSError:
            data = b"\n" + data  # the partial line becomes one of its own, not JSON, read as nothing
        f.dirty = False
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(f.fd, view):]
        os.fsync(f.fd)
    except BaseException:
        f.dirty = True
        raise


def _cut(f: _File) -> None:
    """Cut a journal back to its last whole line after a failed flush."""
    try:
        os.ftruncate(f.fd, f.size)
        f.dirty = False
    except OSError:
        f.dirty = True


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass

