"""Readers: a DuckDB connection with one view per table over every live segment of a run or a root.

Views re-glob on every query, so segments flushed after ``open_store`` appear without reopening. The
segment-exclusion rule (see ``layout``) is evaluated in SQL, so compaction never shows a row twice.

``read_only=True`` (the default) locks the connection down: DuckDB may only touch the store's own
directory (``allowed_directories``), external access and extension loading are off, the configuration is
locked, and statements other than queries are refused before they reach DuckDB.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import duckdb
import pyarrow as pa

from dynascope.core.errors import StoreError, first_line
from dynascope.store.layout import StoreLocation, locate
from dynascope.store.schema import RENAMED, TABLES, sql_type

if TYPE_CHECKING:  # polars is imported by DuckDB when a frame is asked for
    import polars as pl

T = TypeVar("T")
# Query parameters as DuckDB takes them: a sequence for ``?`` / ``$1``, a mapping for ``$name``.
Params = Sequence[Any] | Mapping[str, Any] | None

# Statement types a user may run on a read-only connection.
_ALLOWED_STATEMENTS = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
_EXPLAIN_PREFIX = re.compile(r"^\s*EXPLAIN\s+(?:ANALY[SZ]E\s+)?(?:\([^)]*\)\s*)?", re.IGNORECASE)


def quote_literal(text: str) -> str:
    """A SQL string literal for ``text`` (names from user data are never pasted in raw)."""
    return "'" + str(text).replace("'", "''") + "'"


def quote_ident(name: str) -> str:
    return '"' + str(name).replace('"', '""') + '"'


def _view_sql(loc: StoreLocation, table: str) -> str:
    pattern = quote_literal(loc.table_glob(table))
    cols = ", ".join(_column_sql(table, c) for c in TABLES[table].names)
    typed = _typed_nulls(table, with_old_names=True)
    # The rule in ``layout``: a segment counts when it is in effect (merged ones carry a valid-from time,
    # compared with the query's start) and no earlier segment in (lo, hi desc, name) order of the same
    # writer dir reaches as far. A window, not a self-join: writer dirs can hold thousands of segments.
    return f"""
    CREATE OR REPLACE VIEW {quote_ident(table)} AS
    WITH seg AS (
        SELECT file, regexp_extract(file, '^(.*)/(\\d{{12}})-(\\d{{12}})(?:\\.v(\\d{{1,20}}))?\\.parquet$',
                                    ['dir', 'lo', 'hi', 'valid']) AS s
        FROM glob({pattern})
    ), fin AS (
        SELECT file, s.dir AS dir, CAST(s.lo AS BIGINT) AS lo, CAST(s.hi AS BIGINT) AS hi FROM seg
        WHERE s.dir <> '' AND (s.valid = '' OR CAST(s.valid AS HUGEINT) <= epoch_us(get_current_timestamp()))
    ), live AS (
        SELECT file FROM (
            SELECT file, hi, max(hi) OVER (PARTITION BY dir ORDER BY lo, hi DESC, file
                                           ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS reach
            FROM fin)
        WHERE reach IS NULL OR reach < hi
    )
    SELECT {cols} FROM (
        SELECT * FROM read_parquet({pattern}, union_by_name = true, filename = '_segment_file')
        WHERE _segment_file IN (SELECT file FROM live)
        UNION ALL BY NAME  -- columns added to the schema after a run's segments were written read as NULL
        SELECT {typed} WHERE false)
    """


def retry_vanished(fetch: Callable[[], T], attempts: int = 8) -> T:
    """Run ``fetch`` (a query and its fetch), again if a segment vanished between listing and reading it.

    DuckDB lists a query's files when it binds and opens them while it runs; a compaction that deletes a
    merged-away segment in between fails that query with "No such file". Running it again lists the
    files anew and reads the merged segment instead, so the rows are the same.
    """
    for attempt in range(attempts):
        try:
            return fetch()
        except duckdb.IOException as exc:
            if "No such file" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.02 * (attempt + 1))  # let a compaction that is deleting a batch of segments finish
    raise AssertionError("unreachable")


def _column_sql(table: str, name: str) -> str:
    """A view column: a column renamed since an older schema reads its old name in that schema's segments."""
    old = RENAMED.get(table, {}).get(name)
    return f"coalesce({quote_ident(name)}, {quote_ident(old)}) AS {quote_ident(name)}" if old else quote_ident(name)


def _typed_nulls(table: str, with_old_names: bool = False) -> str:
    fields = [(f.name, f.type) for f in TABLES[table]]
    if with_old_names:  # so the view binds whether or not any segment of an older schema is present
        types = dict(fields)
        fields += [(old, types[new]) for new, old in RENAMED.get(table, {}).items()]
    return ", ".join(f"CAST(NULL AS {sql_type(t)}) AS {quote_ident(n)}" for n, t in fields)


class StoreConnection:
    """A store opened for queries: a DuckDB database with one view per table.

    ``frame``, ``rows`` and ``arrow`` are the way in for code that queries the store, and are safe to call
    from many threads at once: each call runs on a cursor of its own (one DuckDB connection refuses a
    second call while one is running) and runs again if compaction deleted a segment mid-query
    (``retry_vanished``). ``sql``, ``execute`` and ``query`` hand out DuckDB's relation or connection for
    interactive use; they share one connection, so call them from one thread at a time. On a read-only
    store every one of them refuses statements other than SELECT/EXPLAIN.
    """

    def __init__(self, con: duckdb.DuckDBPyConnection, location: StoreLocation, read_only: bool) -> None:
        self._con = con
        self.location = location
        self.read_only = read_only

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
                rel = cur.sql(sql, params=params)
                if rel is None:
                    raise StoreError("SQL error: statement returned no result")
                return fetch(rel)
            finally:
                cur.close()

        return retry_vanished(attempt)

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
                    name = str(kind).rsplit(".", 1)[-1]
                    raise StoreError(f"refused: EXPLAIN of a {name} statement is not allowed on a read-only store")
            if kind not in _ALLOWED_STATEMENTS:
                name = str(kind).rsplit(".", 1)[-1]
                raise StoreError(f"refused: {name} statements are not allowed on a read-only store (queries only)")

    def sql(self, query: str, params: Params = None) -> duckdb.DuckDBPyRelation:
        """DuckDB's relation for ``query``, on the shared connection (one thread at a time)."""
        self.check(query)
        return self._con.sql(query, params=params)

    def execute(self, query: str, params: Params = None) -> duckdb.DuckDBPyConnection:
        """Run ``query`` on the shared connection (one thread at a time) and return it for fetching."""
        self.check(query)
        return self._con.execute(query, params)

    query = sql

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> StoreConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(path: str | os.PathLike, read_only: bool = True, threads: int | None = None) -> StoreConnection:
    """Open a run directory or a store root as a DuckDB connection with one view per table.

    Raises ``StoreError`` (one-line message) for a missing path, a directory that is not a store, or a run
    written with a newer schema.
    """
    loc = locate(path)
    con = duckdb.connect(":memory:")
    try:
        con.execute("SET enable_progress_bar = false")  # it would interleave with CSV/JSON on stdout
        if threads:
            con.execute(f"SET threads = {int(threads)}")
        for table in TABLES:
            if glob.glob(loc.table_glob(table)):
                con.execute(_view_sql(loc, table))
            else:  # runs written before this table existed: read_parquet would fail on an empty glob
                con.execute(f"CREATE VIEW {quote_ident(table)} AS SELECT {_typed_nulls(table)} WHERE false")
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
    return StoreConnection(con, loc, read_only)


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
