"""Repair of rollup segments a writer never wrote, run by compaction before it merges anything.

The writer writes each ``tensor_stats`` segment, then one segment per rollup (``rollup.ROLLUPS``) in the same
flush. A writer killed in between, or one whose rollup writes kept failing until it died, leaves those rows
out of the rollups for good: the dashboard, which reads the rollups, under-counts them. This module finds
such source segments and writes their rollups, computed with the writer's own functions.

Rollup segments carry no pointer to their source. The writer gives every segment of a flush the next
number of one per-writer sequence (source ``s``, then its rollups ``s+1``, ``s+2``), and a repaired
rollup takes its source's own name; so a source counts as rolled up when a rollup segment's range meets
``[lo, hi + j]``, ``j`` being the sequence numbers right after it that no other table holds. That guess
is checked before anything is written: per rollup step key, the writer's source rows must equal the rows
its rollups account for (their ``tensors`` column) plus exactly the rows of the segments found missing.
Anything else (retried rollups written out of order, merged sources whose rollups are partly there) is
reported and left alone: a wrong guess would count rows twice, which is worse than counting them never.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dynascope.core.errors import first_line
from dynascope.store._columns import parquet_options
from dynascope.store.layout import heartbeat_path, list_segments, live_segments
from dynascope.store.rollup import ROLLUP_TABLES, ROLLUPS
from dynascope.store.schema import RENAMED, TABLES

# A source this recent, or of a writer whose heartbeat is this recent, may still get its rollup from the
# writer (it writes them right after the source, and retries failed ones every flush).
REPAIR_AFTER_S = 30.0
_FOREVER = 2**62
_BATCH = 262_144

Seg = tuple[int, int, Path]


@dataclass
class RepairResult:
    """What ``repair_rollups`` did for one run."""

    repaired: int = 0  # rollup segments written
    skipped: list[str] = field(default_factory=list)  # one line per writer directory left alone, and why
    held: set[Path] = field(default_factory=set)  # writer directories not to merge yet (a repair is pending)


def repair_rollups(run_dir: Path, repair_after_s: float = REPAIR_AFTER_S) -> RepairResult:
    """Write the missing rollup segments of every writer of ``run_dir`` whose sources are quiet.

    Returns how many it wrote, one line per rollup it could not check or repair, and the writer
    directories that must not be merged yet because a source there may still get its rollup.
    """
    out = RepairResult()
    for source, rolls in ROLLUPS.items():
        # Rollups are listed before their sources: a source written in between then looks un-rolled (and is
        # fresh, so left alone), never the other way round.
        roll_dirs = {name: list_segments(run_dir, name) for name, _ in rolls}
        # A run with no rows in a rollup was written before it existed: the dashboard reads the source (exact).
        rolls = tuple((n, r) for n, r in rolls if any(w.name != "writer=_schema" and s for w, s in roll_dirs[n].items()))
        for wdir, segs in list_segments(run_dir, source).items() if rolls else ():
            srcs = live_segments(segs, at_us=_FOREVER)
            if wdir.name.startswith("writer=_") or not srcs:  # _schema, and _merged (rows of finished writers)
                continue
            try:
                src_rows = [_num_rows(s[2]) for s in srcs]
            except OSError as exc:  # its rows cannot be counted, so nothing here can be checked
                out.skipped.append(f"{wdir}: rollups not checked: {first_line(exc)}")
                continue
            step_rows: dict[Path, Counter] = {}
            for name, roll in rolls:
                rdir = run_dir / name / wdir.name
                found = live_segments(roll_dirs[name].get(rdir, []), at_us=_FOREVER)
                try:
                    pair = _Pair(source, srcs, src_rows, name, roll, found, step_rows)
                    _repair_one(pair, run_dir, repair_after_s, out)
                except (OSError, ValueError, KeyError, pa.ArrowException) as exc:
                    out.skipped.append(f"{rdir}: rollup repair failed: {type(exc).__name__}: {first_line(exc)}")
    return out


@dataclass
class _Pair:
    """One writer's segments of a source table and of one of its rollups."""

    source: str
    srcs: list[Seg]
    src_rows: list[int]
    name: str  # the rollup table
    roll: Callable[[pa.Table], pa.Table]
    rolls: list[Seg]
    step_rows: dict[Path, Counter]  # rows per step of each source, read once for all its rollups


def _repair_one(g: _Pair, run_dir: Path, repair_after_s: float, out: RepairResult) -> None:
    wdir = g.srcs[0][2].parent
    rdir = run_dir / g.name / wdir.name
    rolled: Counter = Counter()
    for _, _, path in g.rolls:
        rolled.update(_rolled_counts(path))
    missing_rows = sum(g.src_rows) - rolled.total()
    if missing_rows == 0:
        return  # the usual case: every source row is in this rollup once
    if missing_rows < 0:
        out.skipped.append(f"{rdir}: {-missing_rows} more rows rolled up than {g.source} holds; left alone")
        return
    after = _free_after(run_dir, wdir.name, len(ROLLUPS[g.source]))
    gaps = [s for s in g.srcs if not any(lo <= s[1] + after(s[1]) and s[0] <= hi for lo, hi, _ in g.rolls)]
    for _, _, path in g.srcs:
        if path not in g.step_rows:
            g.step_rows[path] = _step_rows(path)
    per_src = {s[2]: _rollup_keys(g.step_rows[s[2]], g.source, g.roll) for s in g.srcs}
    unexplained: Counter = Counter()
    for counts in per_src.values():
        unexplained.update(counts)
    unexplained.subtract(rolled)
    for s in gaps:
        unexplained.subtract(per_src[s[2]])
    fresh = [s for s in gaps if _is_fresh(s[2], run_dir, wdir, repair_after_s)]
    if fresh:
        out.held |= {wdir, rdir}  # merging now could join this rollup's segments across the gap
    if any(unexplained.values()):
        suspects = [s[2].name for s in g.srcs if s not in gaps and ".v" in s[2].name
                    and any(unexplained[k] for k in per_src[s[2]])]
        which = (f"merged {suspects[0]} is only partly rolled up" if suspects else
                 f"the {len(gaps)} segment(s) with none hold {sum(per_src[s[2]].total() for s in gaps)} rows")
        out.skipped.append(f"{rdir}: {missing_rows} {g.source} rows are missing from {g.name}; {which} (rows carry "
                           "no segment number, so they cannot be told apart): not repaired")
        return
    for lo, hi, path in gaps:
        if (lo, hi, path) in fresh:
            out.skipped.append(f"{rdir}: {path.name} has no {g.name} yet; repaired once quiet for {repair_after_s:g} s")
            continue
        # The source's own name: its sequence number is free here (each number names one segment of the
        # writer), and the next call sees it and repairs nothing. The writer names a rollup it writes late
        # differently (with its next number), so a source is only repaired once its writer is quiet.
        _atomic_write(_roll_segment(path, g), rdir / path.name)
        out.repaired += 1


def _roll_segment(path: Path, g: _Pair) -> pa.Table:
    """The rollup of a source segment, batch by batch so that a merged one of millions of rows fits in
    memory: a group split across two batches is two rows, which pool like a step split across two flushes."""
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=_BATCH)
        parts = [g.roll(conform(pa.Table.from_batches([b]), g.source)) for b in batches]
    except (OSError, pa.ArrowException) as exc:
        raise OSError(f"{path.name}: corrupt segment ({first_line(exc)})") from None
    return conform(pa.concat_tables(parts), g.name)


def _free_after(run_dir: Path, writer: str, most: int) -> Callable[[int], int]:
    """``after(hi)``: how many of the sequence numbers after ``hi`` (at most ``most``) no other table holds:
    where the writer put that segment's rollups."""
    held = {lo for table in TABLES if table not in ROLLUP_TABLES
            for lo, hi, _ in list_segments(run_dir, table).get(run_dir / table / writer, []) if lo == hi}

    def after(hi: int) -> int:
        n = 0
        while n < most and hi + n + 1 not in held:
            n += 1
        return n
    return after


def _read(path: Path, columns: list[str] | None = None) -> pa.Table:
    """A segment's columns; an unreadable file is an OSError naming it (the user has to move it away)."""
    try:
        return pq.ParquetFile(path).read(columns=columns)
    except (OSError, pa.ArrowException) as exc:
        raise OSError(f"{path.name}: corrupt segment ({first_line(exc)})") from None


def _num_rows(path: Path) -> int:
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, pa.ArrowException) as exc:
        raise OSError(f"{path.name}: corrupt segment ({first_line(exc)})") from None


def _rolled_counts(path: Path) -> Counter:
    """Source rows per rollup step key in a rollup segment (its ``tensors`` column counts them)."""
    t = _read(path, ["step", "tensors"])
    return _sum_by(t["step"], t["tensors"])


def _step_rows(path: Path) -> Counter:
    """Rows per step of a source segment."""
    return _sum_by(_read(path, ["step"])["step"])


def _rollup_keys(step_rows: Counter, source: str, roll: Callable[[pa.Table], pa.Table]) -> Counter:
    """Rows per rollup step key (a step, or its block: whatever ``roll`` makes of it).

    ``roll`` runs on one row per distinct step whose ``numel`` is that step's row count, so the rollup's own
    sums count the rows: rolling every row (all statistics NULL) would cost ~7 ms per 1,000 rows.
    """
    distinct = pa.table({"step": pa.array(list(step_rows), pa.int64()),
                         "numel": pa.array(list(step_rows.values()), pa.int64())})
    t = roll(conform(distinct, source))
    return _sum_by(t["step"], t["numel"])


def _sum_by(keys: pa.ChunkedArray, weights: pa.ChunkedArray | None = None) -> Counter:
    """Σ ``weights`` (default 1 per row) per key; a NULL key is a group of its own, as in the rollups."""
    k = keys.combine_chunks()
    w = np.ones(len(k)) if weights is None else weights.combine_chunks().fill_null(0).to_numpy(zero_copy_only=False)
    valid = k.is_valid().to_numpy(zero_copy_only=False)
    uniq, inv = np.unique(k.fill_null(0).to_numpy(zero_copy_only=False)[valid], return_inverse=True)
    sums = np.bincount(inv, weights=w[valid], minlength=len(uniq))
    out = Counter(dict(zip(uniq.tolist(), sums.astype(np.int64).tolist(), strict=True)))
    if not valid.all():
        out[None] += int(w[~valid].sum())
    return +out


def _is_fresh(path: Path, run_dir: Path, wdir: Path, quiet_s: float) -> bool:
    now = time.time()
    try:
        if now - path.stat().st_mtime < quiet_s:
            return True
    except FileNotFoundError:
        return True  # merged away meanwhile: leave it to the next call
    try:  # a live writer retries its failed rollups at every flush: repairing too would count them twice
        return now - heartbeat_path(run_dir, wdir.name.removeprefix("writer=")).stat().st_mtime < quiet_s
    except FileNotFoundError:
        return False


def conform(t: pa.Table, table: str) -> pa.Table:
    """``t`` in ``table``'s current schema: columns cast to its types, columns renamed since it was written
    read from their old name, columns added since then NULL (old segments; compaction's merge uses it too)."""
    schema, renamed = TABLES[table], RENAMED.get(table, {})

    def column(f: pa.Field) -> pa.ChunkedArray | pa.Array:
        for name in (f.name, renamed.get(f.name)):
            if name in t.column_names:
                return t.column(name).cast(f.type)
        return pa.nulls(t.num_rows, f.type)
    return pa.Table.from_arrays([column(f) for f in schema], schema=schema)


def _atomic_write(table: pa.Table, final: Path) -> None:
    """tmp + fsync + rename, like the writer: a reader sees the whole segment or nothing."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh, **parquet_options(table.schema))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
