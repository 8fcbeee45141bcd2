"""One projection per table that reads segments of every schema version under today's column names.

A column renamed in a later schema (``schema.RENAMED``: new name → old name, or several) is read from
whichever name a segment carries; renames chain across versions (v1 ``a`` → v2 ``b`` → v3 ``c`` reads
``coalesce(c, b, a)``). A column added after a segment was written reads as NULL. The engines differ only
in how they make every name exist with its type before the projection runs: DuckDB unions the files with a
zero-row typed relation (``reader``), Spark reads them with an explicit schema (``spark_ddl``).
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

from dynascope.store.schema import RENAMED, TABLES, sql_type


def former_names(table: str, name: str) -> list[str]:
    """The names ``name`` had in older schemas, newest first (renames followed back through every version)."""
    renamed = RENAMED.get(table, {})
    current = set(TABLES[table].names)
    out: list[str] = []
    todo = [name]
    while todo:
        olds = renamed.get(todo.pop(0))
        for old in [olds] if isinstance(olds, str) else list(olds or ()):
            if old != name and old not in out and old not in current:  # a name reused today is not an alias
                out.append(old)
                todo.append(old)
    return out


def read_columns(table: str) -> list[tuple[str, pa.DataType]]:
    """Every name a segment of ``table`` may carry: today's columns, then their former names (same types)."""
    fields = [(f.name, f.type) for f in TABLES[table]]
    return fields + [(old, t) for name, t in fields for old in former_names(table, name)]


def select_list(table: str, quote: Callable[[str], str]) -> str:
    """The projection's select list, today's columns in schema order, with ``quote`` for identifiers."""
    cols = []
    for name in TABLES[table].names:
        olds = former_names(table, name)
        q = quote(name)
        cols.append(f"coalesce({q}, {', '.join(quote(o) for o in olds)}) AS {q}" if olds else q)
    return ", ".join(cols)


def spark_quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def spark_type(t: pa.DataType) -> str:
    """Spark SQL's name for a schema column's Arrow type."""
    if pa.types.is_list(t):
        return f"ARRAY<{spark_type(t.value_type)}>"
    sql = sql_type(t)
    return {"INTEGER": "INT", "VARCHAR": "STRING"}.get(sql, sql)


def spark_ddl(table: str) -> str:
    """The schema to read ``table``'s segments with in Spark (``spark.read.schema(ddl)``): every name of
    ``read_columns``, so absent ones read as NULL and no footer has to be opened to merge schemas."""
    return ", ".join(f"{spark_quote(n)} {spark_type(t)}" for n, t in read_columns(table))
