"""A snapshot's journal rows: what live writers flushed since their last seal, copied once into Parquet.

Queries of the present read the writers' journals (``journal``); other engines read Parquet only, and a
journal is deleted ``journal.GRACE_S`` after its seal, so a job planned on a snapshot could not read one
later. A snapshot therefore reads, when it is taken, every journal that counts at its moment (the live-segment
rule, ``live.live_sets``), up to the size it had when listed, whole lines only, and writes one Parquet file
per table into a directory of its own beside its lease, ``_leases/<lease>.rows/``. ``Snapshot.files`` lists
that file with the table's segments; ``release`` deletes the directory, and compaction deletes one that no
held lease names once it is ``DEFAULT_TTL_S`` old (a driver that died).

A journal sealed after the moment is still read here: the segment of its seal takes effect after the moment,
so the snapshot's segments leave it out and each row is read once. A journal deleted before it is read (the
taker stalled for longer than a seal's settle and grace) raises ``Vanished``: the snapshot takes a new moment.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import duckdb

from dynascope.store.flush import atomic_write
from dynascope.store.journal import read_journal
from dynascope.store.live import Entry

ROWS = ".rows"  # a snapshot's directory of journal rows: ``_leases/<lease name>.rows/<table>.parquet``


class Vanished(Exception):
    """A journal that counted at the snapshot's moment was deleted before it was read."""


def copy_journals(journals: Iterable[Entry], out_dir: Path) -> dict[str, str]:
    """Each table's rows in ``journals`` (their first ``size`` bytes, whole lines) as one Parquet file in
    ``out_dir``; returns {table: path} for the tables with rows. ``out_dir`` is made only if some have."""
    by_table: dict[str, list[Entry]] = {}
    for e in journals:
        by_table.setdefault(e.path.rsplit("/", 3)[-3], []).append(e)
    out: dict[str, str] = {}
    con = duckdb.connect(":memory:")
    try:
        con.execute("SET enable_progress_bar = false")
        for table, entries in sorted(by_table.items()):
            lines = b"".join(_whole_lines(e) for e in sorted(entries))
            if not lines:
                continue
            out_dir.mkdir(parents=True, exist_ok=True)
            raw = out_dir / f".{table}.jsonl"  # one file: DuckDB reads it as the views read the journals
            raw.write_bytes(lines)
            try:
                rows = read_journal(con, raw, table)
            finally:
                raw.unlink(missing_ok=True)
            if rows.num_rows:
                atomic_write(rows, out_dir / f"{table}.parquet")
                out[table] = str(out_dir / f"{table}.parquet")
    finally:
        con.close()
    return out


def _whole_lines(e: Entry) -> bytes:
    """The journal's first ``e.size`` bytes up to its last newline: a line being appended is left out."""
    try:
        with open(e.path, "rb") as fh:
            data = fh.read(e.size)
    except FileNotFoundError:
        raise Vanished(e.path) from None
    return data[:data.rfind(b"\n") + 1]


def remove_stale(rows: Iterable[Path], held: Iterable[Path], max_age_s: float) -> int:
    """Delete the rows directories ``rows`` (``snapshot.held_leases`` lists them) that no held lease names
    and are ``max_age_s`` old."""
    names = {p.name.removesuffix(".json") + ROWS for p in held}
    removed = 0
    for d in rows:
        if d.name in names:
            continue
        try:
            if time.time() - d.stat().st_mtime >= max_age_s:
                shutil.rmtree(d, ignore_errors=True)
                removed += 1
        except FileNotFoundError:
            continue
    return removed
