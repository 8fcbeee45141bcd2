"""The writer's buffers: batches queued per table, the drop policy when they fill, and their Arrow form.

``append`` only queues a caller's batch (a dict of lists, arrays or scalars); batches stay whole so that
under pressure the oldest can be dropped and counted. The writer thread turns a table's batches into one
Arrow table (``to_arrow``: NumPy repeats, dictionary-encoded strings, via ``_columns``), and a batch that
cannot be typed is dropped alone (``salvage``).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from dynascope.core.clock import now_us
from dynascope.store._columns import build_column, classify
from dynascope.store.schema import TABLES

if TYPE_CHECKING:
    from dynascope.store.writer import RunWriter


ARROW = "__arrow__"  # a batch's only key when it is an Arrow table of the table's schema already (``to_arrow``)


class TableBuffer:
    """Column lists for one table; batches are kept whole so the oldest can be dropped under pressure.
    ``nbytes`` estimates the memory they hold (``batch_bytes``), for the writer's byte bound."""

    __slots__ = ("batches", "nbytes", "rows", "sizes")

    def __init__(self) -> None:
        self.batches: deque[tuple[int, dict[str, Any]]] = deque()
        self.sizes: deque[int] = deque()
        self.rows = 0
        self.nbytes = 0

    def add(self, n: int, columns: dict[str, Any]) -> None:
        b = batch_bytes(n, columns)
        self.batches.append((n, columns))
        self.sizes.append(b)
        self.rows += n
        self.nbytes += b

    def extend(self, later: TableBuffer) -> None:
        """``later``'s batches after this buffer's own."""
        self.batches.extend(later.batches)
        self.sizes.extend(later.sizes)
        self.rows += later.rows
        self.nbytes += later.nbytes

    def where(self, keep: Callable[[dict[str, Any]], bool]) -> TableBuffer:
        """The batches whose columns ``keep`` holds for, in order, with their sizes."""
        out = TableBuffer()
        for (n, cols), b in zip(self.batches, self.sizes, strict=True):
            if keep(cols):
                out.batches.append((n, cols))
                out.sizes.append(b)
                out.rows += n
                out.nbytes += b
        return out

    def split(self, max_rows: int) -> list[TableBuffer]:
        """Whole batches in consecutive parts of about ``max_rows`` rows (one part when it holds fewer)."""
        if self.rows <= max_rows:
            return [self]
        parts = [TableBuffer()]
        for (n, cols), b in zip(self.batches, self.sizes, strict=True):
            if parts[-1].rows >= max_rows:
                parts.append(TableBuffer())
            last = parts[-1]
            last.batches.append((n, cols))
            last.sizes.append(b)
            last.rows += n
            last.nbytes += b
        return parts

    def pop_oldest(self) -> tuple[int, int]:
        """Drop the oldest batch: its rows and bytes."""
        n, _ = self.batches.popleft()
        b = self.sizes.popleft()
        self.rows -= n
        self.nbytes -= b
        return n, b


# What a list column's element holds in CPython: its pointer and a float/int object (strings are
# usually interned names or short); an estimate only, kept cheap since it runs on the caller's thread.
LIST_ITEM_BYTES = 32


def batch_bytes(n: int, columns: dict[str, Any]) -> int:
    """Memory a batch holds, estimated: arrays' ``nbytes``, ``LIST_ITEM_BYTES`` per list element, 0 for a
    scalar broadcast to every row (the caller's objects, which the buffer keeps alive)."""
    total = 0
    for v in columns.values():
        nb = getattr(v, "nbytes", None)
        if isinstance(nb, int):
            total += nb
        elif isinstance(v, (list, tuple)):
            total += LIST_ITEM_BYTES * len(v)
    return total


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


def drop_oldest(buffers: dict[str, TableBuffer], rows: int, nbytes: int = 0) -> dict[str, tuple[int, int]]:
    """Drop oldest batches, of the largest table first, until at least ``rows`` rows and ``nbytes`` bytes
    are gone (or nothing is left); the rows and bytes dropped per table.

    Oldest by arrival, not by step: a probe's rows come from its own thread, after the step they describe.
    """
    dropped: dict[str, tuple[int, int]] = {}
    while rows > 0 or nbytes > 0:
        table, victim = max(buffers.items(), key=lambda kv: (kv[1].nbytes, kv[1].rows) if nbytes > 0 else kv[1].rows)
        if not victim.batches:
            break
        n, b = victim.pop_oldest()
        rows, nbytes = rows - n, nbytes - b
        r0, b0 = dropped.get(table, (0, 0))
        dropped[table] = (r0 + n, b0 + b)
    return dropped


def to_arrow(table: str, buf: TableBuffer, run_id: str, rank: int, role: str, generation: int | None = None) -> pa.Table:
    """The buffered batches of ``table`` as one Arrow table in its schema; the writer's own columns
    (run_id always, rank, role and generation wherever a batch did not give them) filled in. A batch that
    is an Arrow table already (``{ARROW: table}``: a flush a node writer received, ``store.node``) is
    taken as it is, with its own rank, role and generation."""
    received = [cols[ARROW] for _, cols in buf.batches if ARROW in cols]
    if not received:
        return _build(table, buf, run_id, rank, role, generation)
    own = buf.where(lambda cols: ARROW not in cols)
    return concat(table, ([_build(table, own, run_id, rank, role, generation)] if own.rows else []) + received)


def concat(table: str, parts: list[pa.Table]) -> pa.Table:
    """Arrow tables of ``table`` as one in its schema, string columns dictionary-encoded as ``_build``
    makes them (rebuilding them from their values cost ~9× as much)."""
    if all(p.schema.equals(parts[0].schema) for p in parts[1:]):  # as the same writers' code made them
        return pa.concat_tables(parts).unify_dictionaries().combine_chunks()
    cols, have = [], [set(p.column_names) for p in parts]
    for f in TABLES[table]:
        chunks = [p.column(f.name) if f.name in h else pa.chunked_array([pa.nulls(p.num_rows, f.type)])
                  for p, h in zip(parts, have, strict=True)]
        typ = f.type
        if any(pa.types.is_dictionary(c.type) for c in chunks):
            typ = pa.dictionary(pa.int32(), f.type)
            chunks = [c if pa.types.is_dictionary(c.type) else pc.dictionary_encode(c) for c in chunks]
        cols.append(pa.chunked_array([a for c in chunks for a in (c if c.type == typ else c.cast(typ)).chunks], typ))
    return pa.Table.from_arrays(cols, names=TABLES[table].names).unify_dictionaries().combine_chunks()


def _build(table: str, buf: TableBuffer, run_id: str, rank: int, role: str, generation: int | None) -> pa.Table:
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
    for name, default in (("rank", rank), ("role", role), ("generation", generation)):
        if name not in parts:
            continue
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


def take_all(w: RunWriter) -> dict[str, TableBuffer]:
    """Everything a writer has buffered, emptied from it, with its pending events (drops, write errors) as
    ``events`` rows."""
    with w._lock:
        taken = {t: b for t, b in w._buffers.items() if b.rows}
        for t in taken:
            w._buffers[t] = TableBuffer()
        w._buffered -= sum(b.rows for b in taken.values())
        w._buffered_bytes -= sum(b.nbytes for b in taken.values())
        w._room.notify_all()
        pending, w._pending_events = w._pending_events, []
        drops, w._unreported_drops = w._unreported_drops, {}
    for table, (n, b) in drops.items():
        msg = (f"writer buffer full ({w.max_buffer_rows} rows or {w.max_buffer_bytes >> 20} MiB, "
               f"buffered and awaiting a retry): dropped the oldest {n} {table} rows ({b >> 10} KiB)")
        w._problem("rows_dropped", msg, emit_event=False)
        pending.append({"event": "rows_dropped", "severity": "warning", "message": msg, "table": table,
                        "dropped": n, "bytes": b})
    for ev in pending:
        taken.setdefault("events", TableBuffer()).add(1, {
            "time_us": now_us(), "event": ev.pop("event"), "severity": ev.pop("severity"),
            "message": ev.pop("message"), "fields_json": json.dumps(ev)})
    return taken
