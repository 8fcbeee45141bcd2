"""The timing rows of each rank-step cut into segments, as sorted arrays: the fast path of the what-ifs.

The same model as ``_timing_rows`` (the SQL the what-ifs fall back to): each rank-step's top-level rows cut
into segments at its sync rows, the rank's remainder (step row − top-level rows) in its last segment.
The what-ifs need many aggregates keyed by rank-step and segment, and hash aggregation pays for each one
over all rows. Here the rows are read once and sorted by (run, role, step, rank, start): a rank-step's
rows are then contiguous, a row's segment is a running count of the sync rows before it, the rows of a
(rank-step, segment) are contiguous too, and every aggregate is a ``reduceat`` over these runs. (The sort
goes by rank first, the order each writer wrote in, so it finds the rows nearly sorted; the rank-steps are
then put in step order whole.)

Names become integer codes: ``grp`` numbers the (run_id, role) pairs, ``phase`` the phase names (REMAINDER
among them). Rows with a NULL key, start or duration would take SQL's NULL semantics, which this path does
not model: ``rank_steps`` returns None for them and the caller runs the SQL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np
import polars as pl
import pyarrow as pa

from dynascope.analyses._common import run_clause
from dynascope.analyses._timing_rows import Vocabulary, with_vocabulary
from dynascope.analyses.steps import REMAINDER, STEP_ROW, SYNC, TOP_LEVEL
from dynascope.store import StoreConnection, quote_literal

Arrays = dict[str, np.ndarray]


class RankSteps(NamedTuple):
    """``rows``: the top-level rows of the rank-steps that have a step row, each rank-step's rows together
    and by start time (rs: rank-step index, seg, phase, sync, start_us, dur_us); ``steps``: per rank-step in
    (grp, step, rank) order (grp, step, rank, step_us, step_start_us, covered, syncs, last_seg);
    ``groups``: grp → run_id, role; ``phases``: phase code → name."""

    rows: Arrays
    steps: Arrays
    groups: pl.DataFrame
    phases: list[str]

    def codes(self, names: Iterable[object]) -> np.ndarray:
        """Phase codes of ``names`` (absent names have none)."""
        index = {p: i for i, p in enumerate(self.phases)}
        return np.array([index[str(n)] for n in names if str(n) in index], dtype=np.int64)


def runs_of(*keys: np.ndarray) -> np.ndarray:
    """Start index of each run of equal ``keys`` in arrays sorted by them."""
    n = len(keys[0])
    new = np.zeros(n, dtype=bool)
    if n:
        new[0] = True
        for k in keys:
            new[1:] |= k[1:] != k[:-1]
    return np.flatnonzero(new)


def at_runs(starts: np.ndarray, n: int) -> np.ndarray:
    """For each of ``n`` positions, the index of the run (from ``runs_of``) it belongs to."""
    mark = np.zeros(n, dtype=np.int64)
    mark[starts[1:]] = 1
    return np.cumsum(mark)


def pack(*keys: np.ndarray) -> tuple[np.ndarray, list[int]] | None:
    """``keys`` (most significant first) packed into one int64 that orders like them, and each key's bit
    width; None when they are not all integer-valued or need more than 62 bits."""
    if any(k.dtype.kind == "f" and not np.all(k == np.floor(k)) for k in keys):
        return None
    lo = [int(k.min()) if len(k) else 0 for k in keys]
    bits = [int(int(k.max()) - m).bit_length() if len(k) else 0 for k, m in zip(keys, lo, strict=True)]
    if sum(bits) > 62:
        return None
    packed = np.zeros(len(keys[0]), dtype=np.int64)
    for k, m, b in zip(keys, lo, bits, strict=True):
        if b:  # a constant key orders nothing
            packed <<= b
            packed |= k.astype(np.int64, copy=False) - m
    return packed, bits


def sort_order(*keys: np.ndarray) -> np.ndarray:
    """``np.lexsort`` order of ``keys`` (most significant first): one integer sort when the keys, all
    integer-valued, pack into 63 bits, which is several times faster than sorting on each key in turn."""
    p = pack(*keys)
    return np.lexsort(keys[::-1]) if p is None else np.argsort(p[0], kind="stable")


_NUMPY = {pa.bool_(): np.bool_, pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32,
          pa.int64(): np.int64, pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32,
          pa.uint64(): np.uint64, pa.float32(): np.float32, pa.float64(): np.float64}


def as_numpy(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A primitive Arrow column as NumPy, read from its buffers. (pyarrow's own conversion imports pandas
    the first time a process uses it: 0.4 s of a first what-if.) Columns with NULLs take pyarrow's."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    parts = []
    for c in chunks:
        if c.null_count or c.type not in _NUMPY:
            parts.append(c.to_numpy(zero_copy_only=False))
        elif c.type == pa.bool_():  # bit-packed
            bits = np.unpackbits(np.frombuffer(c.buffers()[1], dtype=np.uint8), bitorder="little")
            parts.append(bits[c.offset:c.offset + len(c)].view(np.bool_))
        else:
            dtype = np.dtype(_NUMPY[c.type])
            parts.append(np.frombuffer(c.buffers()[1], dtype=dtype, count=len(c), offset=c.offset * dtype.itemsize))
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=_NUMPY.get(col.type, np.float64))


def codes(col: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """Indices and names of a column DuckDB returned as an ENUM (one dictionary for every chunk)."""
    chunks = col.chunks
    names = chunks[0].dictionary.to_pylist() if chunks else []
    idx = [as_numpy(c.indices) for c in chunks]
    return (np.concatenate(idx).astype(np.int64) if idx else np.zeros(0, dtype=np.int64)), names


def _read(store: StoreConnection, run: str | None, v: Vocabulary) -> pa.Table:
    run_id = "" if run is not None else f"run_id::{v.run_ids} AS run_id, "
    return store.arrow(f"""
        SELECT {run_id}coalesce(role, '')::{v.roles} AS role, rank, step,
               coalesce(phase, {quote_literal(REMAINDER)})::{v.phases} AS phase, ({STEP_ROW}) AS is_step,
               {SYNC} AS sync, start_us, dur_us
        FROM timings WHERE (({TOP_LEVEL}) OR ({STEP_ROW})){run_clause(run)}""")


def rank_steps(store: StoreConnection, run: str | None,
               after_read: Callable[[], object] | None = None) -> RankSteps | None:
    """The top-level and step rows of ``run`` as ``RankSteps``; None when there are none, or a key, start
    or duration is NULL (the SQL handles both). ``after_read`` runs once DuckDB has read the rows, before
    the arrays are built (a caller starts other reads there, which then share the cores with NumPy
    instead of with this read)."""
    t = with_vocabulary(store, run, lambda v: _read(store, run, v))
    if after_read is not None:
        after_read()
    keys = ("rank", "step", "start_us", "dur_us") + (() if run is not None else ("run_id",))
    if any(t[c].null_count for c in keys):
        return None
    n = t.num_rows
    if not n:
        return None
    # one run asked for: its id is not read (a constant column)
    run_c, runs = (np.zeros(n, dtype=np.int64), [run]) if run is not None else codes(t["run_id"])
    role_c, roles = codes(t["role"])
    phase_c, phases = codes(t["phase"])  # REMAINDER is one of them, as in the SQL
    n_roles = max(len(roles), 1)
    if len(runs) * n_roles == 1:  # one (run, role): no pairs to number
        grp_ids, grp = np.zeros(1, dtype=np.int64), np.zeros(n, dtype=np.int64)
    else:
        pair = run_c * n_roles + role_c
        grp_ids = np.flatnonzero(np.bincount(pair, minlength=len(runs) * n_roles))  # the pairs present
        number = np.zeros(len(runs) * n_roles, dtype=np.int64)
        number[grp_ids] = np.arange(len(grp_ids))
        grp = number[pair]
    groups = pl.DataFrame({"grp": np.arange(len(grp_ids), dtype=np.int64),
                           "run_id": [runs[g // n_roles] for g in grp_ids],
                           "role": [roles[g % n_roles] for g in grp_ids]},
                          schema={"grp": pl.Int64, "run_id": pl.String, "role": pl.String})
    rank, step = as_numpy(t["rank"]).astype(np.int64), as_numpy(t["step"])
    start, dur = as_numpy(t["start_us"]), as_numpy(t["dur_us"])
    order, rs, first = _by_rank_step(grp, step, rank, start)
    is_step = as_numpy(t["is_step"])[order]
    # the rank-steps with a step row, numbered in that order (their step row: the longest, the earliest start)
    srow = np.flatnonzero(is_step)
    s_first = runs_of(rs[srow])
    with_step = rs[srow][s_first]
    n_rs = len(with_step)
    at, s_at = order[first[with_step]], order[srow]  # positions in the rows as read
    steps = {"grp": grp[at], "step": step[at], "rank": rank[at],
             "step_us": np.maximum.reduceat(dur[s_at], s_first).astype(float) if n_rs else np.zeros(0),
             "step_start_us": np.minimum.reduceat(start[s_at], s_first) if n_rs else np.zeros(0, dtype=np.int64)}
    if n_rs == len(first):  # every rank-step has its step row (the usual case)
        keep = np.flatnonzero(~is_step)
        rows = {"rs": rs[keep]}
    else:
        number = np.full(len(first), -1, dtype=np.int64)
        number[with_step] = np.arange(n_rs)
        keep = np.flatnonzero(~is_step & (number[rs] >= 0))
        rows = {"rs": number[rs[keep]]}
    src = order[keep]  # their top-level rows, gathered once from the rows as read
    rows.update(phase=phase_c[src], sync=as_numpy(t["sync"])[src], start_us=start[src],
                dur_us=dur[src])
    rows["seg"] = _segments_of(rows["rs"], rows["start_us"], rows["sync"])
    steps["covered"] = np.bincount(rows["rs"], weights=rows["dur_us"], minlength=n_rs)
    steps["syncs"] = np.bincount(rows["rs"][rows["sync"]], minlength=n_rs).astype(np.int64)
    last = np.zeros(n_rs, dtype=np.int64)  # segments never decrease along a rank-step: its last row's
    if len(keep):
        ends = np.append(runs_of(rows["rs"])[1:], len(keep)) - 1
        last[rows["rs"][ends]] = rows["seg"][ends]
    steps["last_seg"] = last
    return RankSteps(rows, steps, groups, phases)


def _by_rank_step(grp: np.ndarray, step: np.ndarray, rank: np.ndarray,
                  start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows' order by (grp, step, rank, start), the rank-step index of each row in that order, and each
    rank-step's first row. Each writer wrote a rank's rows by step, so the sort merges a few long runs; the
    rank-steps come out in (grp, step, rank) order, each one's rows contiguous and by start."""
    p = pack(grp, step, rank, start)
    if p is not None:  # one integer sort; the rank-step is the key without its start bits
        packed, bits = p
        order = np.argsort(packed, kind="stable")
        first = runs_of(packed[order] >> bits[-1])
    else:
        order = np.lexsort((start, rank, step, grp))
        first = runs_of(grp[order], step[order], rank[order])
    return order, at_runs(first, len(order)), first


def _segments_of(rs: np.ndarray, start: np.ndarray, sync: np.ndarray) -> np.ndarray:
    """A row's segment: the sync rows of its rank-step that start strictly before it. Rows are sorted by
    (rank-step, start), so that is the sync rows before it, unless one of them starts when it does: then
    the count stops at the first row that starts when it does."""
    n = len(rs)
    if not n:
        return np.zeros(0, dtype=np.int64)
    before = np.cumsum(sync, dtype=np.int64)
    before -= sync
    first = runs_of(rs)
    base = np.repeat(before[first], np.diff(np.append(first, n)))
    if np.any((rs[1:] == rs[:-1]) & (start[1:] == start[:-1])):  # equal starts in a rank-step
        same = runs_of(rs, start)
        before = before[same[at_runs(same, n)]]
    before -= base
    return before


def step_ids(rs: RankSteps) -> tuple[np.ndarray, np.ndarray]:
    """Per rank-step the index of its (grp, step), and the first rank-step of each (grp, step)."""
    starts = runs_of(rs.steps["grp"], rs.steps["step"])
    return at_runs(starts, len(rs.steps["grp"])), starts
