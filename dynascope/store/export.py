"""Export a store to one self-contained DuckDB file or to Parquet."""

from __future__ import annotations

import os
from pathlib import Path

import duckdb

from dynascope.core.errors import StoreError, first_line
from dynascope.store.reader import open_store
from dynascope.store.schema import TABLES
from dynascope.store.views import quote_ident, quote_literal


def export_store(path: str | os.PathLike, duckdb_path: str | os.PathLike | None = None,
                 parquet_dir: str | os.PathLike | None = None) -> dict[str, int]:
    """Copy every table of a run (or root) into ``duckdb_path`` or one Parquet file per table.

    The copy is a snapshot of the segments live when it starts; returns rows per table.
    """
    for target in (duckdb_path, parquet_dir):
        if target is not None and not Path(target).expanduser().parent.is_dir():
            raise StoreError(f"{Path(target).parent}: no such directory")
    store = open_store(path, read_only=False)
    counts: dict[str, int] = {}
    tmp: Path | None = None
    try:
        # One transaction: every table comes from the same listing of segments.
        store.execute("BEGIN TRANSACTION")
        for table in TABLES:
            store.execute(f"CREATE TEMP TABLE {quote_ident('_x_' + table)} AS SELECT * FROM {quote_ident(table)}")
            counts[table] = store.sql(f"SELECT count(*) FROM {quote_ident('_x_' + table)}").fetchall()[0][0]
        if duckdb_path is not None:
            out = Path(duckdb_path).expanduser()
            if out.exists():
                raise StoreError(f"{out}: already exists; refusing to overwrite")
            tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            store.execute(f"ATTACH {quote_literal(str(tmp))} AS export_db")
            for table in TABLES:
                store.execute(f"CREATE TABLE export_db.{quote_ident(table)} AS "
                              f"SELECT * FROM {quote_ident('_x_' + table)}")
            store.execute("COMMIT")
            store.execute("DETACH export_db")
            os.replace(tmp, out)
        if parquet_dir is not None:
            d = Path(parquet_dir).expanduser()
            d.mkdir(exist_ok=True)
            for table in TABLES:
                store.execute(f"COPY (SELECT * FROM {quote_ident('_x_' + table)}) TO "
                              f"{quote_literal(str(d / (table + '.parquet')))} (FORMAT parquet)")
            store.execute("COMMIT")
    except duckdb.Error as exc:
        raise StoreError(f"export failed: {first_line(exc)}") from None
    finally:
        store.close()
        if tmp is not None:  # a failed export leaves nothing behind
            tmp.unlink(missing_ok=True)
            tmp.with_name(tmp.name + ".wal").unlink(missing_ok=True)
    return counts
