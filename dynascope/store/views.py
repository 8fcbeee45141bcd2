"""The tables' views: one per table, over the live segments of a run or a store root.

A view reads ``read_parquet(getvariable(...))``: the list of files that the live-segment rule (``live``)
keeps at the query's start, which ``bind`` sets on the query's connection before the query runs. How
DuckDB binds that list decides what a query costs at scale:

- **narrow** (a run whose marker carries the current ``COLUMNS_ID``, and every run of a root likewise):
  the files share one schema, so DuckDB binds the list by its first file, the runs' ``_schema`` segment
  (put first: it holds no rows and was written with the creator's full schema), and reads each other
  file's footer once, when the query scans it.
- **wide** (``union_by_name``): every file's footer is read at bind time as well, so files written with
  older columns (runs from before a column was added, or renamed) read as NULL in the new ones. Runs
  without the current ``COLUMNS_ID`` get this, and so does a narrow store whose query meets a file of
  another schema (a writer of another dynascope version joined the run): ``StoreConnection`` widens its
  views and runs the query again (``MISMATCH``). In a narrow view a later file's extra columns are
  ignored by name and a missing one is an error, never a silent NULL.

Views of the present also read the writers' journals (``journal``): each line of the table's
``*.jsonl`` files that ``live.live_sets`` keeps, typed by ``json_transform`` (``journal_scan``), from the
same listing as the segments'. A run whose ``_schema`` directory holds an empty journal may have them.
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import duckdb

from dynascope.store import projection
from dynascope.store.layout import JOURNAL, StoreLocation
from dynascope.store.projection import select_list
from dynascope.store.schema import TABLES, sql_type

__all__ = ["COLUMNS_ID", "MISMATCH", "Tables", "create_views", "narrow", "tables_of", "typed_nulls", "variable"]

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


def view_sql(table: str, wide: bool = True, journals: bool = False) -> str:
    """``table``'s view: the segments (and, ``journals``, the journals) that ``bind`` lists for the query
    that reads it, on the query's connection."""
    files = f"getvariable({quote_literal(variable('segments', table))})"
    # Narrow: the runs' schema segments first in the list, so DuckDB binds the creator's columns (they hold
    # no rows, so reading them twice adds none); wide: every file's footer, matched by name.
    segments = f"read_parquet({files}{', union_by_name = true' if wide else ''})"
    journal = f"""
        UNION ALL BY NAME
        SELECT * FROM ({journal_scan(f"getvariable({quote_literal(variable('journals', table))})", table)})""" if journals else ""
    return f"""
    CREATE OR REPLACE VIEW {quote_ident(table)} AS
    SELECT {select_list(table, quote_ident)} FROM (
        SELECT * FROM {segments} WHERE getvariable({quote_literal(variable('rows', table))}){journal}
        UNION ALL BY NAME  -- columns added to the schema after a run's segments were written read as NULL
        SELECT {typed_nulls(table, with_old_names=True)} WHERE false)
    """


def variable(kind: str, table: str) -> str:
    """The name of the variable holding ``table``'s ``kind`` list (``bind``): ``segments`` or ``journals``,
    or ``rows`` (false while no segment of the table is live: the list then holds only a file to bind by)."""
    return f"dynascope_{kind}_{table}"


def journal_scan(files: str, table: str) -> str:
    """A query of the whole lines of ``table``'s journals ``files`` (a SQL expression), typed by the schema:
    a line cut short by a crash is not JSON, reads as NULLs and lacks the ``_end`` mark. Views and seals
    both read journals through it, so a sealed segment holds what queries read from its journal.

    Each line is read as a JSON object and typed by ``json_transform``, not by ``read_json``'s ``columns``:
    the same values (NaN and infinities included) and the same NULLs, but ``read_json`` with ``columns`` pays
    ~0.4 ms more per file, which a live run with a journal per writer pays per query (1,280 journals: 0.58
    s against 0.18 s on 2 cores; docs/scale.md).

    The typed lines are a materialized CTE: unnesting the struct makes each column an extract of the one
    ``json_transform`` call, and a query's filter pushed below it would call ``json_transform`` again for
    every column it names (the what-ifs' filter names eight: 0.58 s against 0.25 s over 1,445 journals).
    The CTE types each line once; it costs a count over the same journals 0.16 s against 0.12 s."""
    cols = {f.name: sql_type(f.type) for f in TABLES[table]} | {"_end": "INTEGER"}
    return (f"WITH lines AS MATERIALIZED (SELECT unnest(json_transform(json, {quote_literal(json.dumps(cols))})) "
            f"FROM read_json_objects({files}, format = 'newline_delimited', ignore_errors = true, "
            f"hive_partitioning = false)) SELECT * EXCLUDE (_end) FROM lines WHERE _end IS NOT NULL")


class Tables(NamedTuple):
    """What a store's views read: the tables with segments, those with schema segments (listed first, so a
    narrow view binds its creator's columns) and those whose writers may keep journals."""

    segments: frozenset[str]
    schema: frozenset[str]
    journals: frozenset[str]


def tables_of(loc: StoreLocation, journals: bool = True) -> Tables:
    """``loc``'s tables as ``Tables``; ``journals``: read the writers' journals too (a read of the present;
    the runs created with schema journals)."""
    segments = frozenset(t for t in TABLES if glob.glob(loc.table_glob(t)))
    return Tables(segments, frozenset(t for t in segments if glob.glob(loc.schema_glob(t))),
                  frozenset(t for t in segments if journals and glob.glob(loc.schema_glob(t, JOURNAL))))


def create_views(con: duckdb.DuckDBPyConnection, tables: Tables, wide: bool, retry: Callable) -> None:
    """One view per table on ``con``, whose lists (``bind.Binding.hold``) must be set; ``retry`` runs a
    statement again if a segment vanished while it bound."""
    for table in TABLES:
        if table in tables.segments:
            retry(partial(con.execute, view_sql(table, wide, table in tables.journals)))
        else:  # runs written before this table existed: read_parquet would fail on an empty glob
            con.execute(f"CREATE OR REPLACE VIEW {quote_ident(table)} AS SELECT {typed_nulls(table)} WHERE false")
