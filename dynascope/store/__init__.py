"""The run store: schema, writer, reader."""

from dynascope.core import forks  # noqa: F401 - a forked child never collects a DuckDB connection its parent made
from dynascope.core.errors import StoreError
from dynascope.store.layout import SchemaVersionError
from dynascope.store.live import live_files, live_files_in
from dynascope.store.reader import (
    StoreConnection,
    StoreLike,
    as_store,
    open_store,
    retry_vanished,
    run_sql,
)
from dynascope.store.schema import SCHEMA_VERSION, TABLES
from dynascope.store.snapshot import Snapshot, snapshot
from dynascope.store.views import quote_ident, quote_literal
from dynascope.store.writer import RunWriter

__all__ = [
    "SCHEMA_VERSION", "TABLES", "RunWriter", "SchemaVersionError", "Snapshot", "StoreConnection", "StoreError",
    "StoreLike", "as_store", "live_files", "live_files_in", "open_store", "quote_ident", "quote_literal",
    "retry_vanished", "run_sql", "snapshot",
]
