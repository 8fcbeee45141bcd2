"""Readers: a DuckDB connection with one view per table over every live segment of a run or a root.

Views re-glob on every query, so segments flushed after ``open_store`` appear without reopening. The
segment-exclusion rule (see ``layout``) is evaluated in SQL, so compaction never shows a row twice.

``read_only=True`` (the default) locks the connection down: DuckDB may only touch the store's own
directory (``allowed_directories``), external access and extension loading are off, the configuration is
locked, and statements other than queries are refused before they reach DuckDB.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import duckdb
import pyarrow as pa

from dynascope.core.errors import StoreError, first_line
from dynascope.store import at_rest, own_fold, views
from dynascope.store.bind import Binding
from dynascope.store.layout import StoreLocation, locate
from dynascope.store.pooling import GLOBAL, global_sql
from dynascope.store.views import quote_ident, quote_literal

if TYPE_CHECKING:  # polars is imported by DuckDB when a frame is asked for
    import polars as pl

T = TypeVar("T")
# Query parameters as DuckDB takes them: a sequence for ``?`` / ``$1``, a mapping for ``$name``.
Params = Sequence[Any] | Mapping[str, Any] | None

# Statement types a user may run on a read-only connection.
_ALLOWED_STATEMENTS = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
_EXPLAIN_PREFIX = re.compile(r"^\s*EXPLAIN\s+(?:ANALY[SZ]E\s+)?(?:\([^)]*\)\s*)?", re.IGNORECASE)


# How the engines say a listed file was gone when they opened it: DuckDB reading a glob ("No such file"), and
# for a reader of an explicit file list (``engines``), DuckDB binding it ("No files found") and Spark
# ("FileNotFoundException", "PATH_NOT_FOUND").
VANISHED = ("No such file",)
VANISHED_FROM_LIST = (*VANISHED, "No files found", "FileNotFoundException", "PATH_NOT_FOUND")
# The store's views bind the lists ``bind`` made: DuckDB says "No files found" of a segment or journal that
# vanished since. Of any other path (a user's query naming a file that is not there) it is bad input,
# answered at once.
_LISTED_VANISHED = re.compile(r'No files found that match the pattern "[^"]*/\d{12}(?:-\d{12}(?:\.v\d+)?\.parquet|\.jsonl)"')
# A journal is read while its writer appends to it (or cuts a failed flush's partial line). On FUSE and
# network file systems a read can find fewer bytes than the size DuckDB planned its reads with, past the
# first buffer it reads: the next run reads the journal as it is then. Of a Parquet file, short is corrupt.
_JOURNAL_SHORT = re.compile(r'Could not read enough bytes from file "[^"]*/\d{12}\.jsonl"')


PINNED = "_pinned_"  # the prefix of a table read once into the connection (``StoreConnection.pin``)
# From how many files a table is worth reading once: at 1,280 live writers a query opened ~6,000 files a table
# and each report query paid 0.5-0.9 s for them (docs/scale.md); a run at rest holds a few.
PIN_MIN_FILES = 256
WINDOW_SPILL_S = 0.5  # how long past its deletion window a loaded writer may still be unlinking


def retry_vanished(fetch: Callable[[], T], deadline_s: float = 60.0, vanished: Sequence[str] = VANISHED) -> T:
    """Run ``fetch`` (a query and its fetch, or a listing and its queries), again if a segment vanished
    between listing and reading it.

    A query's files are listed before it runs (``bind``) and opened while it runs; a compaction that
    deletes a merged-away segment in between fails that query with "No such file" (or, at bind, "No files
    found"). Running it again lists the files anew and reads the merged segment instead, so the rows are
    the same. Two folds at once (a
    writer's own and ``dynascope compact``) can delete twice in a row, so it retries until a deadline
    rather than a fixed number of times. Writers delete only in shared windows of the wall clock
    (``own_fold.DELETE_PERIOD_S``): a query that met one runs again once it is over, so a thousand writers
    deleting in the same window cost it one more run, not one per writer. A journal read short while its
    writer appends to it runs again as well. ``vanished``: the error texts that mean a file vanished.
    """
    end = time.monotonic() + deadline_s
    attempt = 0
    while True:
        try:
            return fetch()
        except Exception as exc:
            text = str(exc)
            again = any(s in text for s in vanished) or _LISTED_VANISHED.search(text) or _JOURNAL_SHORT.search(text)
            if not again or time.monotonic() >= end:
                raise
            attempt += 1
            time.sleep(min(_after_deletions(attempt), max(end - time.monotonic(), 0.0)))  # a last run at the deadline


def _after_deletions(attempt: int) -> float:
    """Seconds to wait before running a query again: until the writers' deletion window it met is over
    (with ``WINDOW_SPILL_S`` for a writer that began deleting in it on a loaded machine), or a short
    back-off outside one (a compaction deleting a batch of segments)."""
    phase = time.time() % own_fold.DELETE_PERIOD_S
    end = min(own_fold.DELETE_WINDOW_S + WINDOW_SPILL_S, own_fold.DELETE_PERIOD_S)
    return end - phase if phase < end else min(0.02 * attempt, 0.2)


class StoreConnection:
    """A store opened for queries: a DuckDB database with one view per table.

    ``frame``, ``rows`` and ``arrow`` are the way in for code that queries the store, and are safe to call
    from many threads at once: each call runs on a cursor of its own (one DuckDB connection refuses a
    second call while one is running) and runs again if compaction deleted a segment mid-query
    (``retry_vanished``). ``sql``, ``execute`` and ``query`` hand out DuckDB's relation or connection for
    interactive use; they share one connection, so call them from one thread at a time. On a read-only
    store every one of them refuses statements other than SELECT/EXPLAIN.
    """

    def __init__(self, con: duckdb.DuckDBPyConnection, location: StoreLocation, read_only: bool,
                 widen: Callable[[], None] | None = None, binding: Binding | None = None) -> None:
        self._con = con
        self.location = location
        self.read_only = read_only
        self._binding = binding  # the views' file lists, set on each query's connection (``bind``)
        self._widen = widen  # narrow views (``views``): how to bind them by name, once a file needs it
        self._widen_lock = threading.Lock()
        self._pinned: list[str] = []  # tables read once into the connection (``pin``)

    @property
    def path(self) -> Path:
        return self.location.path

    def frame(self, sql: str, params: Params = None) -> pl.DataFrame:
        """The result of ``sql`` (with ``?``/``$name`` parameters from ``params``) as a polars DataFrame."""
        return self._on_cursor(sql, params, lambda rel: rel.pl())

    def rows(self, sql: str, params: Params = None) -> list[tuple[Any, ...]]:
        """The result of ``sql`` as a list of tuples."""
        return self._on_cursor(sql, params, lambda rel: rel.fetchall())

    def arrow(self, sql: str, params: Params = None) -> pa.Table:
        """The result of ``sql`` as a pyarrow Table."""
        return self._on_cursor(sql, params, lambda rel: rel.to_arrow_table())

    def _on_cursor(self, sql: str, params: Params, fetch: Callable[[duckdb.DuckDBPyRelation], T]) -> T:
        self.check(sql)

        def attempt() -> T:
            cur = self._con.cursor()
            try:
                self._bind(cur, sql)
                rel = cur.sql(sql, params=params)
                if rel is None:
                    raise StoreError("SQL error: statement returned no result")
                return fetch(rel)
            finally:
                cur.close()

        try:
            try:
                return retry_vanished(attempt)
            except Exception as exc:
                if self._widen is None or not any(m in str(exc) for m in views.MISMATCH):
                    raise
            with self._widen_lock:  # a file of another schema: every query from now on binds the glob by name
                if self._widen is not None:
                    self._widen()
                    self._widen = None
                    for table in self._pinned:  # widening made every view anew: the pinned read their copy
                        self._con.execute(_pinned_view(table))
            return retry_vanished(attempt)
        except duckdb.Error as exc:  # narrow views open a table's files when a query scans them, not at open
            text = explain_error(exc, "SQL error")
            if "corrupt segment" in text:
                raise StoreError(text) from None
            raise
        except UnicodeDecodeError as exc:  # a string DuckDB read from a damaged file is not UTF-8
            raise StoreError(f"a value read is not UTF-8 ({exc.reason} at byte {exc.start}): a segment or "
                             "journal this query read is damaged") from None

    def pin(self, tables: Sequence[str], min_files: int | None = None) -> list[str]:
        """Read each of ``tables`` whose query would open at least ``min_files`` files once into this
        connection, so later queries of it read that copy: one moment of the store for a reader that
        queries it many times (``dynascope report``), instead of listing and opening every live file per
        query. The copy may spill to the store's private temp directory. A table that fails to copy stays a
        view (``min_files``: ``PIN_MIN_FILES``). Returns the tables pinned."""
        least = PIN_MIN_FILES if min_files is None else min_files
        done: list[str] = []
        for table in tables:
            if self._binding is None or table not in self._binding.tables:
                continue
            try:
                if not retry_vanished(functools.partial(self._copy, table, least)):
                    continue
            except (duckdb.Error, StoreError):
                continue
            self._con.execute(_pinned_view(table))
            self._binding.unbind(table)
            self._pinned.append(table)
            done.append(table)
        return done

    def _files(self, table: str) -> int:
        """The files a query of ``table`` opens now (its lists set on the shared connection)."""
        assert self._binding is not None
        self._binding.bind(self._con, quote_ident(table))
        kinds = ["segments", *(["journals"] if table in self._binding.journals else [])]
        row = self._con.execute("SELECT " + " + ".join(
            f"coalesce(len(getvariable({quote_literal(views.variable(k, table))})), 0)" for k in kinds)).fetchone()
        return int(row[0]) if row else 0

    def _copy(self, table: str, least: int) -> bool:
        """Copy ``table`` if a query of it opens at least ``least`` files; whether it did. Each attempt lists
        the files anew, so a retry after a vanished file reads the lists of now."""
        if self._files(table) < least:
            return False
        self._con.execute(f"CREATE OR REPLACE TABLE {quote_ident(PINNED + table)} AS SELECT * FROM {quote_ident(table)}")
        return True

    def check(self, query: str) -> None:
        """Raise ``StoreError`` unless every statement in ``query`` is a read-only query."""
        if not self.read_only:
            return
        try:
            statements = duckdb.extract_statements(query)
        except duckdb.Error as exc:
            raise StoreError(f"SQL error: {first_line(exc)}") from None
        if not statements:
            raise StoreError("SQL error: empty query")
        for st in statements:
            kind = st.type
            if kind == duckdb.StatementType.EXPLAIN:
                # EXPLAIN ANALYZE runs its statement (EXPLAIN ANALYZE COPY … TO writes the file): the
                # explained statement must itself be a query.
                inner = _EXPLAIN_PREFIX.sub("", st.query, count=1)
                try:
                    kinds = [i.type for i in duckdb.extract_statements(inner)]
                except duckdb.Error:
                    kinds = []
                kind = duckdb.StatementType.SELECT if kinds == [duckdb.StatementType.SELECT] else kinds[0] if kinds \
                    else duckdb.StatementType.INVALID
                if kind != duckdb.StatementType.SELECT:
                    name = _statement_name(kind, inner)
                    raise StoreError(f"refused: EXPLAIN of a {name} statement is not allowed on a read-only store")
            if kind not in _ALLOWED_STATEMENTS:
                name = _statement_name(kind, st.query)
                raise StoreError(f"refused: {name} statements are not allowed on a read-only store (queries only)")

    def sql(self, query: str, params: Params = None) -> duckdb.DuckDBPyRelation:
        """DuckDB's relation for ``query``, on the shared connection (one thread at a time). It reads the
        files live when it was made, however late it is fetched."""
        self.check(query)
        self._bind(self._con, query)
        return self._con.sql(query, params=params)

    def execute(self, query: str, params: Params = None) -> duckdb.DuckDBPyConnection:
        """Run ``query`` on the shared connection (one thread at a time) and return it for fetching."""
        self.check(query)
        self._bind(self._con, query)
        return self._con.execute(query, params)

    query = sql

    def _bind(self, con: duckdb.DuckDBPyConnection, query: str) -> None:
        if self._binding is not None:
            self._binding.bind(con, query)

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> StoreConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(path: str | os.PathLike, read_only: bool = True, threads: int | None = None,
               at_us: int | None = None) -> StoreConnection:
    """Open a run directory or a store root as a DuckDB connection with one view per table.

    Each query reads the segments live when it starts; with ``at_us`` (µs since the epoch), the segments
    that were live then (a ``snapshot``'s ``at_us``: its lease keeps them on disk). A finished run whose
    writers were not folded together (its last writer's close ran out of time, or it was killed) is folded
    on a thread of this process (``at_rest.settle_later``), so later opens read a few files per table.

    Raises ``StoreError`` (one-line message) for a missing path, a directory that is not a store, or a run
    written with a newer schema.
    """
    loc = locate(path)
    con = duckdb.connect(":memory:")
    try:
        con.execute("SET enable_progress_bar = false")  # it would interleave with CSV/JSON on stdout
        if threads:
            con.execute(f"SET threads = {int(threads)}")
        # Binding reads file schemas: a compaction may delete one in between, so bind again (retry_vanished).
        wide = not views.narrow(loc)
        tables = views.tables_of(loc, journals=at_us is None)
        binding = Binding(loc, tables, None if at_us is None else int(at_us))
        binding.hold(con)
        views.create_views(con, tables, wide, retry_vanished)
        # The canonical per-tensor view: one row per (run, role, stage, step, tensor), pooled by store.pooling's rule.
        retry_vanished(functools.partial(con.execute, f"CREATE OR REPLACE VIEW {GLOBAL} AS {global_sql()}"))
        if read_only:
            # DuckDB also allows its spill directory, by default ./.tmp under the caller's working directory;
            # point it at a private empty directory so queries cannot read whatever sits there.
            spill = tempfile.mkdtemp(prefix="dynascope-duckdb-")
            weakref.finalize(con, shutil.rmtree, spill, True)
            con.execute(f"SET temp_directory = {quote_literal(spill)}")
            con.execute("SET allowed_directories = [" + quote_literal(str(loc.path) + os.sep) + "]")
            con.execute("SET autoinstall_known_extensions = false")
            con.execute("SET autoload_known_extensions = false")
            con.execute("SET enable_external_access = false")
            con.execute("SET lock_configuration = true")
    except duckdb.Error as exc:
        con.close()
        raise StoreError(explain_error(exc, f"{loc.path}: could not open store")) from None
    for run_dir in loc.run_dirs:  # a finished run left untidy is folded behind this reader, for the next one
        at_rest.settle_later(run_dir)
    widen = None if wide else functools.partial(views.create_views, con, tables, True, retry_vanished)
    return StoreConnection(con, loc, read_only, widen, binding)


def _pinned_view(table: str) -> str:
    return f"CREATE OR REPLACE VIEW {quote_ident(table)} AS SELECT * FROM {quote_ident(PINNED + table)}"


StoreLike = StoreConnection | str | os.PathLike  # what the toolkit's readers take: an open store or its path


def as_store(store: StoreLike) -> StoreConnection:
    """An open store for ``store`` (a path is opened read-only)."""
    return store if isinstance(store, StoreConnection) else open_store(store)


def run_sql(store: StoreConnection, query: str, max_rows: int | None = None) -> pa.Table:
    """Run one user query on a (locked) store and return a pyarrow Table, capped at ``max_rows``.

    Safe from many threads, like ``StoreConnection.frame``. Errors come back as ``StoreError`` with a
    one-line message.
    """

    def fetch(rel: duckdb.DuckDBPyRelation) -> pa.Table:
        reader = rel.to_arrow_reader(batch_size=min(max_rows or 100_000, 100_000))
        batches, n = [], 0
        for batch in reader:  # stop reading at the cap: a huge LIMIT never materialises
            if max_rows is not None and n + batch.num_rows > max_rows:
                batches.append(batch.slice(0, max_rows - n))
                break
            batches.append(batch)
            n += batch.num_rows
        return pa.Table.from_batches(batches, schema=reader.schema)

    try:
        return store._on_cursor(query, None, fetch)
    except duckdb.Error as exc:
        raise StoreError(explain_error(exc, "SQL error")) from None


def explain_error(exc: BaseException, context: str) -> str:
    """One line for the user; a corrupt segment is named, with what to do about it."""
    text = first_line(exc)
    m = _BAD_SEGMENT.search(text)
    if m and not isinstance(exc, duckdb.PermissionException) and "No such file" not in text:
        reason = text.split(":", 1)[-1].replace(m.group(0), "").replace("File  ", "").strip()
        return f"{m.group(1)}: corrupt segment ({reason}); move it out of the run directory to read the rest"
    return f"{context}: {text}"


_BAD_SEGMENT = re.compile(r"""["'](/[^"']+\.parquet)["']""")


_INSTALL = re.compile(r"\s*(FORCE\s+)?INSTALL\b", re.IGNORECASE)


def _statement_name(kind: duckdb.StatementType, query: str) -> str:
    """The statement as the user wrote it: DuckDB files INSTALL under the LOAD type."""
    name = str(kind).rsplit(".", 1)[-1]
    return "INSTALL" if name == "LOAD" and _INSTALL.match(query) else name
