"""Which files a query's views read, decided once per query, on the query's own connection.

A table's view reads ``read_parquet(getvariable(...))``: a list of the files that the live-segment rule
(``live``) keeps at the query's start, set on the connection that runs the query, just before it runs.
DuckDB opens only those files. A view over the table's whole glob, filtered by the rule in the same
query, opened every file the glob listed: DuckDB prunes files by name only for a constant filter, and the
rule's file list was a subquery. Between a fold and its deletion window a writer's directory holds the
fold's sources beside the merged segment, and for 10 s after a seal the sealed journal beside its
segment; at 1,280 live writers a query of the present took half the time once it skipped them.

A query binds the tables it names, and those named by the views it names (``tensor_stats_global`` and a
user's own), or every table when it names none. DuckDB's variables belong to one connection, so threads
on cursors of their own bind their own lists. The listing is made here (one ``scandir`` a writer
directory) and the rule evaluated in Python (``live.live_sets``): 50 ms for 1,280 writers' 6,400 files,
where DuckDB's ``glob`` and the rule's SQL took 290 ms.
"""

from __future__ import annotations

import os
import re
import time

import duckdb

from dynascope.store.layout import COMMITS, JOURNAL, StoreLocation
from dynascope.store.live import MAX_CLOCK_SKEW_US, entries, files_two_down, live_sets
from dynascope.store.views import Tables, quote_ident, variable


class Binding:
    """The file lists of the views of ``tables`` (``views.Tables``): those live at each query's start, or
    at ``at_us`` (µs since the epoch: a read of the past, which counts commit records up to it exactly)."""

    def __init__(self, loc: StoreLocation, tables: Tables, at_us: int | None = None) -> None:
        self.loc, self.at_us = loc, at_us
        self.tables, self.schema, self.journals = tables

    def unbind(self, table: str) -> None:
        """Stop listing ``table``: its view now reads a copy in the connection (``StoreConnection.pin``)."""
        self.tables, self.schema, self.journals = (s - {table} for s in (self.tables, self.schema, self.journals))

    def hold(self, con: duckdb.DuckDBPyConnection) -> None:
        """Lists that bind every view and read no row: what a view is created with."""
        for table in self.tables:
            self._set(con, table, [], [])

    def bind(self, con: duckdb.DuckDBPyConnection, query: str) -> None:
        """Set the lists of every table ``query`` may read, as the live-segment rule has them now."""
        tables = sorted(self.named(con, query))
        if not tables:
            return
        # the moment before the listing: a flush or merge that lands after it waits for the next query
        at = time.time_ns() // 1000 if self.at_us is None else self.at_us
        # a read of the present counts the records of a writer whose clock runs ahead (``MAX_CLOCK_SKEW_US``)
        commit_at = at + MAX_CLOCK_SKEW_US if self.at_us is None else at
        live, journals = live_sets(self._listing(tables), at, commit_at)
        by_table: dict[tuple[str, bool], list[str]] = {}
        for p in sorted(live | journals):
            by_table.setdefault((_table(p), p in journals), []).append(p)
        for table in tables:
            self._set(con, table, by_table.get((table, False), []),
                      by_table.get((table, True), []) if table in self.journals else [])

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

    def _listing(self, tables: list[str]) -> list[str]:
        """Every commit record and every file of ``tables``' writer directories, in each run here (a root's
        runs listed anew: a run created since the store was opened is read too).

        Commit records first: a record is written after its flush's segments were renamed, so each record
        listed has its segments in the later listing, and a flush counts whole or not at all. Then the
        writers' record directories once more: a writer that began after the first pass wrote its begin
        record before its first segment, so a segment listed is never taken for one of a writer that keeps
        no records (counted at once, committed or not)."""
        runs = [self.loc.path] if not self.loc.is_root else \
            [e.path for e in entries(str(self.loc.path)) if e.is_dir()]
        out: list[str] = []
        for run in runs:
            for top in [COMMITS, *tables]:
                out += [e.path for e in files_two_down(os.path.join(run, top))]
            out += [f"{w.path}/begin.json" for w in entries(os.path.join(run, COMMITS)) if w.is_dir()]
        return out

    def _set(self, con: duckdb.DuckDBPyConnection, table: str, segments: list[str], journals: list[str]) -> None:
        head = [self.loc.schema_glob(table)] if table in self.schema else []
        # A view must bind to some file: with no live segment, any of the table's, its rows filtered out.
        files = head + segments or [self.loc.table_glob(table)]
        con.execute(f"SET VARIABLE {quote_ident(variable('segments', table))} = ?", [files])
        con.execute(f"SET VARIABLE {quote_ident(variable('rows', table))} = ?", [bool(segments)])
        if table in self.journals:  # the runs' empty schema journals bind the scan when no journal counts
            listed = journals or [self.loc.schema_glob(table, JOURNAL)]
            con.execute(f"SET VARIABLE {quote_ident(variable('journals', table))} = ?", [listed])


def _table(path: str) -> str:
    return path.rsplit("/", 3)[-3]  # <run>/<table>/<writer dir>/<file>
