"""The writer's buffers: batches queued per table, the drop policy when they fill, and their Arrow form.

``append`` only queues a caller's batch (a dict of lists, arrays or scalars); batches stay whole so that
under pressure the oldest can be dropped and counted. The writer thread turns a table's batches into one
Arrow table (``to_arrow``: NumPy repeats, dictionary-encoded strings, via ``_columns``), and a batch that
cannot be typed is dropped alone (``salvage``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from dynascope.store._columns import build_column, classify
from dynascope.store.schema import TABLES


class TableBuffer:
    """Column lists for one table; batches are kept whole so the oldest can be dropped under pressure."""

    __slots__ = ("batches", "rows")

    def __init__(self) -> None:
        self.batches: deque[tuple[int, dict[str, Any]]] = deque()
        self.rows = 0

    def add(self, n: int, columns: dict[str, Any]) -> None:
        self.batches.append((n, columns))
        self.rows += n


def batch_len(columns: dict[str, Any]) -> int:
    """Rows in a batch: the common length of its list/array columns (1 when all are scalars)."""
    n = None
    for name, v in columns.items():
        if isinstance(v, (list, tuple)) or (hasattr(v, "__len__") and getattr(v, "ndim", 1) > 0 and not isinstance(v, (str, bytes))):
            if n is None:
                n = len(v)
            elif len(v) != n:
                raise ValueError(f"column {name!r} has {len(v)} values, expected {n}")
    return 1 if n is None else n


def drop_oldest(buffers: dict[str, TableBuffer], excess: int) -> dict[str, int]:
    """Drop at least ``excess`` rows, oldest batches of the largest table first; rows dropped per table.

    Oldest by arrival, not by step: a probe's rows come from its own thread, after the step they describe.
    """
    dropped: dict[str, int] = {}
    while excess > 0:
        table, victim = max(buffers.items(), key=lambda kv: kv[1].rows)
        if not victim.batches:
            break
        n, _ = victim.batches.popleft()
        victim.rows -= n
        excess -= n
        dropped[table] = dropped.get(table, 0) + n
    return dropped


def to_arrow(table: str, buf: TableBuffer, run_id: str, rank: int, role: str) -> pa.Table:
    """The buffered batches of ``table`` as one Arrow table in its schema; the writer's own columns
    (run_id always, rank and role wherever a batch did not give them) filled in."""
    schema = TABLES[table]
    parts: dict[str, list] = {name: [] for name in schema.names}
    off = 0
    for n, cols in buf.batches:
        for name, v in cols.items():
            if name in parts and name != "run_id":
                t = type(v)  # inline the common cases: this loop runs once per batch per column
                if t is list or t is tuple:
                    parts[name].append((off, "l", v, n))
                elif v is None or t is int or t is float or t is str or t is bool:
                    parts[name].append((off, "s", v, n))
                else:
                    parts[name].append(classify(off, v, n))
        off += n
    parts["run_id"] = [(0, "s", run_id, off)]
    for name, default in (("rank", rank), ("role", role)):
        given = parts[name]
        if not given:
            parts[name] = [(0, "s", default, off)]
        elif len(given) < len(buf.batches) or any(p[1] == "s" and p[2] is None for p in given):
            parts[name] = _fill_default(given, default, buf.batches)
    return pa.Table.from_arrays([build_column(parts[f.name], f.type, off) for f in schema], names=schema.names)


def salvage(table: str, buf: TableBuffer, convert: Callable[[str, TableBuffer], pa.Table],
            dropped: Callable[[int, Exception], None]) -> tuple[pa.Table | None, TableBuffer]:
    """Type batch by batch and drop only the batches that fail (``dropped(rows, error)`` for each); the
    rest as one table (None if nothing is left) and the buffer that holds them."""
    good = TableBuffer()
    for n, cols in buf.batches:
        one = TableBuffer()
        one.add(n, cols)
        try:
            convert(table, one)
        except Exception as exc:
            dropped(n, exc)
            continue
        good.add(n, cols)
    return (convert(table, good) if good.rows else None), good


def _fill_default(given: list, default: Any, batches: Any) -> list:
    """Parts for rank/role where some batches gave the column and others leave it to the writer."""
    by_off = {p[0]: p for p in given if not (p[1] == "s" and p[2] is None)}
    out, off = [], 0
    for n, _ in batches:
        out.append(by_off.get(off, (off, "s", default, n)))
        off += n
    return out
