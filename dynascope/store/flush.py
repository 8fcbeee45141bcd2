"""One flush on disk: its segments, then one commit record naming them, so they count together or not at all.

A flush writes a segment per table (a ``tensor_stats`` segment brings one per rollup). Each is written to a
temporary name and fsynced; then they are renamed to consecutive sequence numbers ``lo..hi`` of the
writer; then the commit record ``<run>/_commits/writer=<id>/<lo>-<hi>.v<t>.json`` lists them, ``t`` taken
after the last rename (delta-rs's log, one small file per commit). Readers count a writer's own segment
only once a commit record in effect covers its number (``live``), so a process killed anywhere in a flush
leaves either the whole flush or none of it: never a source segment without its rollups.

A *group* (a source segment and its rollups) whose files cannot be written is taken out whole: its
temporary files are deleted and its rows go back to the buffer for the next flush. The commit record's name
is all a reader needs; its body (files, rows) is for people and tools, so it is written in place (one
create, no rename) and not fsynced.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dynascope.core.clock import now_us
from dynascope.store._columns import parquet_options
from dynascope.store.layout import COMMITS, schema_journal, segment_name, writer_dir
from dynascope.store.rollup import ROLLUPS
from dynascope.store.schema import TABLES

BEGIN = "begin.json"


@dataclass
class Group:
    """A table's segment and its rollups' segments (``parts``: (table, rows)): committed together."""

    table: str
    parts: list[tuple[str, pa.Table]]
    buffered: Any = None  # what goes back to the buffer when the group is not committed


@dataclass
class Flushed:
    """What ``write_flush`` did: the committed groups, the failed ones (with why) and the next number."""

    committed: list[Group] = field(default_factory=list)
    failed: list[tuple[Group, BaseException]] = field(default_factory=list)
    next_seq: int = 0
    commit: Path | None = None


def with_rollups(table: str, arrow: pa.Table, buffered: Any,
                 failed: Callable[[str, Exception], None]) -> Group:
    """A table's segment and its rollups (``rollup.ROLLUPS``) as one group; a rollup that raises is left
    out and reported to ``failed(rollup, error)``: a rollup bug must not cost the source rows."""
    parts = [(table, arrow)]
    numbers: dict = {}  # source columns as NumPy, converted once for every rollup of this segment
    for name, roll in ROLLUPS.get(table, ()):
        try:
            parts.append((name, roll(arrow, numbers)))
        except Exception as exc:
            failed(name, exc)
    return Group(table, parts, buffered)


def commit_dir(run_dir: Path, writer_id: str) -> Path:
    return run_dir / COMMITS / f"writer={writer_id}"


def write_begin(run_dir: Path, writer_id: str) -> None:
    """Declare that this writer keeps commit records, before its first segment: from then on a reader
    counts its segments only once committed (a writer without this file is read as before commits existed)."""
    d = commit_dir(run_dir, writer_id)
    d.mkdir(parents=True, exist_ok=True)
    _write_text(d / BEGIN, json.dumps({"writer_id": writer_id, "commits": 1}))


def write_flush(run_dir: Path, writer_id: str, seq: int, groups: list[Group], compression: str = "auto") -> Flushed:
    """Write ``groups`` as segments numbered from ``seq`` and commit them; see the module docstring."""
    out = Flushed(next_seq=seq)
    staged: list[tuple[Group, list[tuple[Path, Path]]]] = []
    for g in groups:
        tmps: list[tuple[Path, Path]] = []
        try:
            for table, arrow in g.parts:
                d = writer_dir(run_dir, table, writer_id)
                d.mkdir(parents=True, exist_ok=True)
                tmp = d / f".flush-{uuid.uuid4().hex[:12]}.tmp"
                tmps.append((tmp, d))
                write_parquet(arrow, tmp, compression)
        except Exception as exc:
            _unlink(t for t, _ in tmps)
            out.failed.append((g, exc))
            continue
        staged.append((g, tmps))
    renamed: list[Path] = []
    for i, (g, tmps) in enumerate(staged):
        done: list[Path] = []
        try:
            for tmp, d in tmps:
                final = d / segment_name(out.next_seq, out.next_seq)
                out.next_seq += 1  # a number is used up even if the rename fails: it names nothing committed
                os.replace(tmp, final)
                done.append(final)
        except Exception as exc:  # this group and the ones after it wait for the next flush
            _unlink(done)
            _unlink(t for _, rest in staged[i:] for t, _ in rest)
            out.failed += [(later, exc) for later, _ in staged[i:]]
            break
        renamed += done
        out.committed.append(g)
    if not renamed:
        return out
    lo = int(renamed[0].name[:12])
    hi = int(renamed[-1].name[:12])
    try:
        out.commit = _write_commit(run_dir, writer_id, lo, hi, renamed, out.committed)
    except Exception as exc:  # uncommitted segments are no data: remove them and write the rows again later
        _unlink(renamed)
        out.failed = [(g, exc) for g in out.committed] + out.failed
        out.committed = []
    return out


def _write_commit(run_dir: Path, writer_id: str, lo: int, hi: int, files: list[Path], groups: list[Group]) -> Path:
    at = now_us()  # after every rename: a query that starts at or after ``at`` lists them all
    body = {"writer_id": writer_id, "lo": lo, "hi": hi, "time_us": at,
            "files": [str(f.relative_to(run_dir)) for f in files],
            "rows": _rows_per_table(groups)}
    path = commit_dir(run_dir, writer_id) / f"{lo:012d}-{hi:012d}.v{at}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Created in place, not renamed into place: its name commits the flush the moment it exists, and no
    # reader opens the body, so a temporary name would cost the metadata servers a rename per flush for
    # nothing. "x": a name is never reused, so an existing one is a bug to hear of, not to overwrite.
    f = open(path, "x", encoding="utf-8")
    try:  # committed from here on: a body that cannot be written (a full disk) leaves the name, which suffices
        with f:
            f.write(json.dumps(body))
    except OSError:
        pass
    return path


def _rows_per_table(groups: list[Group]) -> dict[str, int]:
    rows: dict[str, int] = {}
    for g in groups:  # a retried group and a new one can hold the same table
        for t, a in g.parts:
            rows[t] = rows.get(t, 0) + a.num_rows
    return rows


def write_parquet(arrow: pa.Table, path: Path, compression: str = "auto") -> None:
    """A segment's bytes, fsynced: after a machine crash the renamed segment is whole, not empty."""
    with open(path, "wb") as fh:
        # store_schema=False (in parquet_options): string columns are dictionary arrays in memory; readers
        # should see strings.
        pq.write_table(arrow, fh, **parquet_options(arrow.schema, compression))
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write(arrow: pa.Table, final: Path, compression: str = "auto") -> None:
    """tmp + fsync + rename: a reader sees the whole segment or nothing."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write_parquet(arrow, tmp, compression)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def write_empty_segments(run_dir: Path) -> None:
    """One zero-row segment per table, so every view has a typed file to read before any data lands."""
    for table, schema in TABLES.items():
        # not schema.empty_table(): that imports pandas (0.4 s, 30 MB) in every process that makes a run
        atomic_write(pa.Table.from_batches([], schema=schema), writer_dir(run_dir, table, "_schema") / segment_name(0, 0))
        schema_journal(run_dir, table).touch()  # readers then look for its writers' journals (``journal``)


def release_arrow_memory() -> bool:
    """Return the pages Arrow's allocator keeps after a flush to the OS; True where it did (mimalloc).

    mimalloc (pyarrow's default pool) keeps the freed pages of each thread's heap for reuse, so the
    writer thread held what its largest flush used, for good: 2-3.5 MiB after the small flushes of a
    6-layer model, 70 MiB after a 200k-row one. ``release_unused`` collects the calling thread's heap
    and purges freed arena ranges; it frees nothing still in use. Called on the writer thread after
    each flush that wrote (0.1-0.2 ms a call on the reference workload of benchmarks/probe_overhead.py;
    the next flush faults its few MiB back in). Only for mimalloc: with jemalloc it purges every arena
    of the process (the user's own Arrow work too), and with the system pool it is ``malloc_trim(0)``,
    which walks every glibc arena under its lock, so the training thread's malloc could wait on it.
    """
    pool = pa.default_memory_pool()
    if pool.backend_name != "mimalloc":
        return False
    pool.release_unused()
    return True


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _unlink(paths) -> None:
    for p in paths:
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass  # a segment left behind uncommitted is no data; compaction removes it
