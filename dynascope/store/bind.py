"""Which files a query's views read, decided once per query, on the query's own connection.

A table's view reads ``read_parquet(getvariable(...))``: a list of the files that the live-segment rule
(``live``) keeps at the query's start, set on the connection that runs the query, just before it runs.
DuckDB opens only those files. A view over the table's whole glob, filtered by the rule in the same
query, opened every file the glob listed: DuckDB prunes files by name only for a constant filter, and the
rule's file list is a subquery. Between a fold and its deletion window a writer's directory holds the
fold's sources beside the merged segment, and for 10 s after a seal the sealed journal beside its
segment; at 1,280 live writers those were up to half of the files a query opened.

A query binds the tables it names, and those named by the views it names (``global`` and a user's own),
or every table when it names none. DuckDB's variables belong to one connection, so threads on cursors of
their own bind their own lists.
"""

from __future__ import annotations

import re

import duckdb

from dynascope.store.layout import JOURNAL, StoreLocation
from dynascope.store.live import live_ctes
from dynascope.store.views import Tables, quote_ident, quote_literal, variable


class Binding:
    """The file lists of the views of ``tables`` (``views.Tables``) at ``at`` (a SQL expression, µs since
    the epoch), with commit records up to ``commit_at``."""

    def __init__(self, loc: StoreLocation, tables: Tables, at: str, commit_at: str | None) -> None:
        self.loc, self.at, self.commit_at = loc, at, commit_at
        self.tables, self.schema, self.journals = tables

    def hold(self, con: duckdb.DuckDBPyConnection) -> None:
        """Lists that bind every view and read no row: what a view is created with."""
        for table in self.tables:
            self._set(con, table, [], [])

    def bind(self, con: duckdb.DuckDBPyConnection, query: str) -> None:
        """Set the lists of every table ``query`` may read, as the live-segment rule has them now."""
        tables = sorted(self.named(con, query))
        if not tables:
            return
        listed = [self.loc.table_glob(t) for t in tables] + [self.loc.commit_glob()]
        listed += [self.loc.journal_glob(t) for t in tables if t in self.journals]
        listing = "(" + " UNION ALL ".join(f"SELECT file FROM glob({quote_literal(g)})" for g in listed) + ")"
        found = con.execute(live_ctes(listing, self.at, self.commit_at)
                            + " SELECT file, false FROM live UNION ALL SELECT file, true FROM jlive").fetchall()
        segments: dict[str, list[str]] = {t: [] for t in tables}
        journals: dict[str, list[str]] = {t: [] for t in tables}
        for file, journal in found:  # <run>/<table>/<writer dir>/<file>
            (journals if journal else segments)[file.rsplit("/", 3)[-3]].append(file)
        for table in tables:
            self._set(con, table, sorted(segments[table]), sorted(journals[table]))

    def named(self, con: duckdb.DuckDBPyConnection, query: str) -> set[str]:
        """The tables ``query`` names, itself or through views; every table if it names none (a name
        built at run time is not seen: its view then fails to bind, never reads a stale list)."""
        defined = {name: sql for name, sql in con.execute(
            "SELECT view_name, sql FROM duckdb_views() WHERE NOT internal").fetchall() if name not in self.tables}
        seen: set[str] = set()
        todo = [query]
        while todo:
            text = todo.pop()
            for name in [*self.tables, *defined]:
                if name not in seen and re.search(rf"\b{re.escape(name)}\b", text, re.IGNORECASE):
                    seen.add(name)
                    if name in defined:
                        todo.append(defined[name])
        found = seen & self.tables
        return found if found or seen else set(self.tables)

    def _set(self, con: duckdb.DuckDBPyConnection, table: str, segments: list[str], journals: list[str]) -> None:
        head = [self.loc.schema_glob(table)] if table in self.schema else []
        # A view must bind to some file: with no live segment, any of the table's, its rows filtered out.
        files = head + segments or [self.loc.table_glob(table)]
        con.execute(f"SET VARIABLE {quote_ident(variable('segments', table))} = ?", [files])
        con.execute(f"SET VARIABLE {quote_ident(variable('rows', table))} = ?", [bool(segments)])
        if table in self.journals:  # the runs' empty schema journals bind the scan when no journal counts
            listed = journals or [self.loc.schema_glob(table, JOURNAL)]
            con.execute(f"SET VARIABLE {quote_ident(variable('journals', table))} = ?", [listed])
