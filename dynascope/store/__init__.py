"""The run store: schema, writer, reader."""

from dynascope.store.layout import SchemaVersionError, StoreError, first_line
from dynascope.store.reader import (
    StoreConnection,
    open_store,
    quote_ident,
    quote_literal,
    retry_vanished,
    run_sql,
)
from dynascope.store.schema import SCHEMA_VERSION, TABLES
from dynascope.store.writer import RunWriter, now_us

__all__ = [
    "SCHEMA_VERSION", "TABLES", "RunWriter", "first_line", "SchemaVersionError", "StoreConnection", "StoreError",
    "now_us", "open_store", "quote_ident", "quote_literal", "retry_vanished", "run_sql",
]
