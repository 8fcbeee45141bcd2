"""Readers: a DuckDB connection with one view per table over every live segment of a run or a root.

Views re-glob on every query, so segments flushed after ``open_store`` appear without reopening. The
segment-exclusion rule (see ``layout``) is evaluated in SQL, so compaction never shows a row twice.

``read_only=True`` (the default) locks the connection down: DuckDB may only touch the store's own
directory (``allowed_directories``), external access and extension loading are off, the configuration is
locked, and statements other than queries are refused before they reach DuckDB.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import duckdb

from dynascope.store.layout import StoreError, StoreLocation, locate
from dynascope.store.schema import TABLES

# Statement types a user may run on a read-only connection.
_ALLOWED_STATEMENTS = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


def quote_literal(text: str) -> str:
    """A SQL string literal for ``text`` (names from user data are never pasted in raw)."""
    return "'" + str(text).replace("'", "''") + "'"


def quote_ident(name: str) -> str:
    return '"' + str(name).replace('"', '""') + '"'


def _view_sql(loc: StoreLocation, table: str) -> str:
    pattern = quote_literal(loc.table_glob(table))
    cols = ", ".join(quote_ident(c) for c in TABLES[table].names)
    # Live segments: drop any file whose [lo, hi] is covered by a wider file in the same writer dir.
    return f"""
    CREATE OR REPLACE VIEW {quote_ident(table)} AS
    WITH seg AS (
        SELECT file,
               regexp_extract(file, '^(.*)/(\\d{{12}})-(\\d{{12}})\\.parquet$', ['dir', 'lo', 'hi']) AS s
        FROM glob({pattern})
    ), live AS (
        SELECT a.file FROM seg a
        WHERE a.s.dir <> '' AND NOT EXISTS (
            SELECT 1 FROM seg b
            WHERE b.s.dir = a.s.dir AND b.file <> a.file
              AND CAST(b.s.lo AS BIGINT) <= CAST(a.s.lo AS BIGINT)
              AND CAST(b.s.hi AS BIGINT) >= CAST(a.s.hi AS BIGINT))
    )
    SELECT {cols} FROM read_parquet({pattern}, union_by_name = true, filename = '_segment_file')
    WHERE _segment_file IN (SELECT file FROM live)
    """


class StoreConnection:
    """A DuckDB connection over a store; forwards everything to DuckDB.

    On a read-only connection, ``sql``/``execute``/``query`` refuse anything but SELECT/EXPLAIN.
    """

    def __init__(self, con: duckdb.DuckDBPyConnection, location: StoreLocation, read_only: bool) -> None:
        self._con = con
        self.location = location
        self.read_only = read_only

    @property
    def path(self) -> Path:
        return self.location.path

    def check(self, query: str) -> None:
        """Raise ``StoreError`` unless every statement in ``query`` is a read-only query."""
        if not self.read_only:
            return
        try:
            statements = duckdb.extract_statements(query)
        except duckdb.Error as exc:
            raise StoreError(f"SQL error: {_first_line(exc)}") from None
        if not statements:
            raise StoreError("SQL error: empty query")
        for st in statements:
            if st.type not in _ALLOWED_STATEMENTS:
                kind = str(st.type).rsplit(".", 1)[-1]
                raise StoreError(f"refused: {kind} statements are not allowed on a read-only store (queries only)")

    def sql(self, query: str, params: Any = None) -> duckdb.DuckDBPyRelation:
        self.check(query)
        return self._con.sql(query, params=params)

    def execute(self, query: str, params: Any = None) -> duckdb.DuckDBPyConnection:
        self.check(query)
        return self._con.execute(query, params)

    query = sql

    def close(self) -> None:
        self._con.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._con, name)

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
        if threads:
            con.execute(f"SET threads = {int(threads)}")
        for table in TABLES:
            con.execute(_view_sql(loc, table))
        if read_only:
            con.execute("SET allowed_directories = [" + quote_literal(str(loc.path) + os.sep) + "]")
            con.execute("SET autoinstall_known_extensions = false")
            con.execute("SET autoload_known_extensions = false")
            con.execute("SET enable_external_access = false")
            con.execute("SET lock_configuration = true")
    except duckdb.Error as exc:
        con.close()
        raise StoreError(f"{loc.path}: could not open store: {_first_line(exc)}") from None
    return StoreConnection(con, loc, read_only)


def run_sql(store: StoreConnection, query: str, max_rows: int | None = None):
    """Run one user query on a (locked) store and return a pyarrow Table, capped at ``max_rows``.

    Errors come back as ``StoreError`` with a one-line message.
    """
    store.check(query)
    try:
        rel = store._con.sql(query)
        if rel is None:
            raise StoreError("SQL error: statement returned no result")
        reader = rel.fetch_record_batch(rows_per_batch=min(max_rows or 100_000, 100_000))
        batches, n = [], 0
        for batch in reader:
            if max_rows is not None and n + batch.num_rows > max_rows:
                batches.append(batch.slice(0, max_rows - n))
                n = max_rows
                break
            batches.append(batch)
            n += batch.num_rows
        import pyarrow as pa

        return pa.Table.from_batches(batches, schema=reader.schema)
    except duckdb.Error as exc:
        raise StoreError(f"SQL error: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def table_names() -> Iterable[str]:
    return TABLES.keys()
