"""The tables' views: one per table, over every live segment of a run or a store root.

A view reads ``read_parquet(<the table's glob>)`` and keeps the rows of the files the live-segment rule
(``live``) selects at the query's start. How DuckDB binds that glob decides what a query costs at scale:

- **narrow** (a run whose marker carries the current ``COLUMNS_ID``, and every run of a root likewise):
  the files share one schema, so DuckDB binds the glob by its first file, the run's ``_schema`` segment
  (put first: it holds no rows and was written with the creator's full schema), and reads each other
  file's footer once, when the query scans it.
- **wide** (``union_by_name``): every file's footer is read at bind time as well, so files written with
  older columns (runs from before a column was added, or renamed) read as NULL in the new ones. Runs
  without the current ``COLUMNS_ID`` get this, and so does a narrow store whose query meets a file of
  another schema (a writer of another dynascope version joined the run): ``StoreConnection`` widens its
  views and runs the query again (``MISMATCH``). In a narrow view a later file's extra columns are
  ignored by name and a missing one is an error, never a silent NULL.

Views of the present also read the writers' journals (``journal``): ``read_json`` of the table's
``*.jsonl`` files (``journal_scan``), those that ``live.live_ctes``'s ``jlive`` keeps, from the same listing as the
segments'. A run whose ``_schema`` directory holds an empty journal may have them.

Both open every file the table's glob lists, live or merged away: DuckDB prunes a file by a filter on its
name only where the filter is a constant, and the rule's file list is a subquery.
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Callable
from functools import partial

import duckdb

from dynascope.store import projection
from dynascope.store.layout import JOURNAL, StoreLocation
from dynascope.store.live import live_ctes
from dynascope.store.projection import select_list
from dynascope.store.schema import TABLES, sql_type

__all__ = ["COLUMNS_ID", "MISMATCH", "create_views", "narrow", "typed_nulls"]

# The tables' columns and types, as one short id: a run's marker records its creator's, and readers of
# the same id know every file of the run has these columns.
COLUMNS_ID = hashlib.sha256(json.dumps(
    {t: [(f.name, str(f.type)) for f in s] for t, s in TABLES.items()}, sort_keys=True).encode()).hexdigest()[:16]
# How DuckDB says a file of a glob bound without union_by_name lacks a column of its first file.
MISMATCH = ("schema mismatch",)


def quote_literal(text: str) -> str:
    """A SQL string literal for ``text`` (names from user data are never pasted in raw)."""
    return "'" + str(text).replace("'", "''") + "'"


def quote_ident(name: str) -> str:
    return '"' + str(name).replace('"', '""') + '"'


def typed_nulls(table: str, with_old_names: bool = False) -> str:
    """A select list of typed NULLs for every column (and, ``with_old_names``, every former name): unioned
    by name with the segments, it makes every name exist with its type whatever the segments carry."""
    fields = projection.read_columns(table) if with_old_names else [(f.name, f.type) for f in TABLES[table]]
    return ", ".join(f"CAST(NULL AS {sql_type(t)}) AS {quote_ident(n)}" for n, t in fields)


def narrow(loc: StoreLocation) -> bool:
    """Whether every run here was created with the current columns (its marker's ``columns``, as ``locate``
    read it)."""
    return loc.columns == {COLUMNS_ID}


def view_sql(loc: StoreLocation, table: str, at: str, commit_at: str | None = None, wide: bool = True,
             journals: bool = False) -> str:
    pattern = quote_literal(loc.table_glob(table))
    listed = [pattern, quote_literal(loc.commit_glob())] + ([quote_literal(loc.journal_glob(table))] if journals else [])
    listing = "(" + " UNION ALL ".join(f"SELECT file FROM glob({g})" for g in listed) + ")"
    # Narrow: the runs' schema segments first, so DuckDB binds the creator's columns (they hold no rows, so
    # reading them twice adds none); wide: every file's footer, matched by name.
    files = f"{pattern}, union_by_name = true" if wide else f"[{quote_literal(loc.schema_glob(table))}, {pattern}]"
    # The journals' rows (``journal``) that no counted segment covers.
    journal = f"""
        UNION ALL BY NAME
        {journal_scan(listed[2], table, "filename = '_segment_file'")} AND _segment_file IN (SELECT file FROM jlive)""" \
        if journals else ""
    # The live-segment rule (``live``), over the query's own listing, at the query's start (or ``at_us``).
    # The row of NULLs is for the join's planner, and the filter drops it: a narrow glob is estimated at its
    # first file's rows, the schema segment's none, and a side estimated empty is the one a hash join
    # builds on -- every row of the table held in memory, all its columns, to keep those of a few thousand
    # files (~350 bytes a row for a count). With one row estimated, the live files are the build side.
    return f"""
    CREATE OR REPLACE VIEW {quote_ident(table)} AS
    {live_ctes(listing, at, commit_at)}
    SELECT {select_list(table, quote_ident)} FROM (
        SELECT * FROM (SELECT * FROM read_parquet({files}, filename = '_segment_file')
                       UNION ALL BY NAME SELECT CAST(NULL AS VARCHAR) AS _segment_file)
        WHERE _segment_file IN (SELECT file FROM live){journal}
        UNION ALL BY NAME  -- columns added to the schema after a run's segments were written read as NULL
        SELECT {typed_nulls(table, with_old_names=True)} WHERE false)
    """


def journal_scan(files: str, table: str, options: str = "") -> str:
    """A query of the whole lines of ``table``'s journals ``files`` (a SQL expression), typed by the schema:
    a line cut short by a crash is not JSON, reads as NULLs and lacks the ``_end`` mark. Views and seals
    both read journals through it, so a sealed segment holds what queries read from its journal."""
    cols = [(f.name, sql_type(f.type)) for f in TABLES[table]] + [("_end", "INTEGER")]
    columns = "{" + ", ".join(f"{quote_literal(n)}: {quote_literal(t)}" for n, t in cols) + "}"
    return (f"SELECT * EXCLUDE (_end) FROM read_json({files}, columns = {columns}, format = 'newline_delimited', "
            f"ignore_errors = true, hive_partitioning = false{', ' + options if options else ''}) WHERE _end IS NOT NULL")


def create_views(con: duckdb.DuckDBPyConnection, loc: StoreLocation, at: str, commit_at: str | None, wide: bool,
                 retry: Callable, journals: bool = True) -> None:
    """One view per table on ``con``; ``retry`` runs a statement again if a segment vanished while it bound.
    ``journals``: read the writers' journals too (a read of the present; the runs created with schema journals)."""
    for table in TABLES:
        if glob.glob(loc.table_glob(table)):
            with_journals = journals and bool(glob.glob(loc.schema_glob(table, JOURNAL)))
            retry(partial(con.execute, view_sql(loc, table, at, commit_at, wide, with_journals)))
        else:  # runs written before this table existed: read_parquet would fail on an empty glob
            con.execute(f"CREATE OR REPLACE VIEW {quote_ident(table)} AS SELECT {typed_nulls(table)} WHERE false")
