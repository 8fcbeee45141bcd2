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

from collections.abc import Iterable
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


def sort_order(*keys: np.ndarray) -> np.ndarray:
    """``np.lexsort`` order of ``keys`` (most significant first): one integer sort when the keys, all
    integer-valued, pack into 63 bits, which is several times faster than sorting on each key in turn."""
    lo = [int(k.min()) if len(k) else 0 for k in keys]
    bits = [int(int(k.max()) - m).bit_length() if len(k) else 0 for k, m in zip(keys, lo, strict=True)]
    if sum(bits) > 62 or any(k.dtype.kind == "f" and not np.all(k == np.floor(k)) for k in keys):
        return np.lexsort(keys[::-1])
    packed = np.zeros(len(keys[0]), dtype=np.int64)
    for k, m, b in zip(keys, lo, bits, strict=True):
        packed = (packed << b) | (k - m).astype(np.int64)
    return np.argsort(packed, kind="stable")


def codes(col: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """Indices and names of a column DuckDB returned as an ENUM (one dictionary for every chunk)."""
    chunks = col.chunks
    names = chunks[0].dictionary.to_pylist() if chunks else []
    idx = [c.indices.to_numpy(zero_copy_only=False) for c in chunks]
    return (np.concatenate(idx).astype(np.int64) if idx else np.zeros(0, dtype=np.int64)), names


def _read(store: StoreConnection, run: str | None, v: Vocabulary) -> pa.Table:
    return store.arrow(f"""
        SELECT run_id::{v.run_ids} AS run_id, coalesce(role, '')::{v.roles} AS role, rank, step,
               coalesce(phase, {quote_literal(REMAINDER)})::{v.phases} AS phase, ({STEP_ROW}) AS is_step,
               {SYNC} AS sync, start_us, dur_us
        FROM timings WHERE (({TOP_LEVEL}) OR ({STEP_ROW})){run_clause(run)}""")


def rank_steps(store: StoreConnection, run: str | None) -> RankSteps | None:
    """The top-level and step rows of ``run`` as ``RankSteps``; None when there are none, or a key, start
    or duration is NULL (the SQL handles both)."""
    t = with_vocabulary(store, run, lambda v: _read(store, run, v))
    if any(t[c].null_count for c in ("run_id", "rank", "step", "start_us", "dur_us")):
        return None
    run_c, runs = codes(t["run_id"])
    role_c, roles = codes(t["role"])
    phase_c, phases = codes(t["phase"])  # REMAINDER is one of them, as in the SQL
    n_roles = max(len(roles), 1)
    pair = run_c * n_roles + role_c
    grp_ids = np.flatnonzero(np.bincount(pair, minlength=len(runs) * n_roles))  # the pairs present
    number = np.zeros(len(runs) * n_roles, dtype=np.int64)
    number[grp_ids] = np.arange(len(grp_ids))
    grp = number[pair]
    groups = pl.DataFrame({"grp": np.arange(len(grp_ids), dtype=np.int64),
                           "run_id": [runs[g // n_roles] for g in grp_ids],
                           "role": [roles[g % n_roles] for g in grp_ids]},
                          schema={"grp": pl.Int64, "run_id": pl.String, "role": pl.String})
    col = {"grp": grp, "rank": t["rank"].to_numpy().astype(np.int64),
           "step": t["step"].to_numpy(), "start_us": t["start_us"].to_numpy(), "dur_us": t["dur_us"].to_numpy(),
           "phase": phase_c, "is_step": t["is_step"].to_numpy(zero_copy_only=False),
           "sync": t["sync"].to_numpy(zero_copy_only=False)}
    # in the order each writer wrote its rows (rank, step, start): the sort finds them nearly sorted
    order = sort_order(col["grp"], col["rank"], col["step"], col["start_us"])
    col = {k: v[order] for k, v in col.items()}
    n = len(order)
    if not n:
        return None
    first = runs_of(col["grp"], col["rank"], col["step"])
    rs = at_runs(first, n)
    # A row's segment: the sync rows of its rank-step that start strictly before it, i.e. (rows sorted by
    # start) the sync rows before the first row that starts when it does.
    sync_i = col["sync"].astype(np.int64)
    before = np.cumsum(sync_i) - sync_i
    same = runs_of(rs, col["start_us"])
    seg = before[same[at_runs(same, n)]] - before[first[rs]]
    step_row = col["is_step"]
    top = ~step_row
    big = np.iinfo(np.int64)
    has_step = np.logical_or.reduceat(step_row, first)
    steps = {"grp": col["grp"][first], "step": col["step"][first], "rank": col["rank"][first],
             "step_us": np.maximum.reduceat(np.where(step_row, col["dur_us"], big.min), first).astype(float),
             "step_start_us": np.minimum.reduceat(np.where(step_row, col["start_us"], big.max), first),
             "covered": np.add.reduceat(np.where(top, col["dur_us"], 0), first).astype(float),
             "syncs": np.add.reduceat(sync_i, first),
             "last_seg": np.maximum.reduceat(np.where(top, seg, 0), first)}
    # the rank-steps with a step row, numbered in (grp, step, rank) order
    steps = {k: v[has_step] for k, v in steps.items()}
    by_step = sort_order(steps["grp"], steps["step"], steps["rank"])
    steps = {k: v[by_step] for k, v in steps.items()}
    number = np.full(len(first), -1, dtype=np.int64)
    number[np.flatnonzero(has_step)[by_step]] = np.arange(len(by_step))
    # rows moved, rank-step by rank-step, into that order: rank-step blocks of rows, each by start
    at = _blocks(first, n, np.flatnonzero(has_step)[by_step])
    keep = top[at]
    at = at[keep]
    rows = {"rs": number[rs[at]], "seg": seg[at], "phase": col["phase"][at], "sync": col["sync"][at],
            "start_us": col["start_us"][at], "dur_us": col["dur_us"][at]}
    return RankSteps(rows, steps, groups, phases)


def _blocks(first: np.ndarray, n: int, chosen: np.ndarray) -> np.ndarray:
    """Positions of the rows of blocks ``chosen`` (block i: rows first[i] up to the next block), in that
    order."""
    length = np.diff(np.append(first, n))[chosen]
    start = np.cumsum(length) - length
    return np.repeat(first[chosen] - start, length) + np.arange(int(length.sum()))


def step_ids(rs: RankSteps) -> tuple[np.ndarray, np.ndarray]:
    """Per rank-step the index of its (grp, step), and the first rank-step of each (grp, step)."""
    starts = runs_of(rs.steps["grp"], rs.steps["step"])
    return at_runs(starts, len(rs.steps["grp"])), starts


def segment_phases(rs: RankSteps) -> Arrays:
    """Top-level rows summed per (rank-step, segment, phase, sync), each rank-step's remainder row after
    them (busy, in its last segment), sorted by (rank-step, segment); with ``med_us``, the cross-rank
    median of each busy (grp, step, seg, phase) (``rows`` of ``_timing_rows.rows_sql``)."""
    r, st = rs.rows, rs.steps
    n_ph = len(rs.phases)
    # rows are sorted by (rank-step, start), so by (rank-step, segment): sum repeats within each segment,
    # unless (the usual case) no (phase, sync) occurs twice in one
    cell = r["phase"] * 2 + r["sync"]
    seg_starts = runs_of(r["rs"], r["seg"])
    if len(seg_starts) and _repeats(cell, seg_starts):
        key = ((r["rs"] * (int(r["seg"].max(initial=0)) + 1) + r["seg"]) * n_ph * 2 + cell)
        order = np.argsort(key, kind="stable")
        starts = runs_of(key[order])
        rs_i, seg, phase, sync = (r[c][order][starts] for c in ("rs", "seg", "phase", "sync"))
        dur = np.add.reduceat(r["dur_us"][order], starts).astype(float)
    else:
        rs_i, seg, phase, sync = r["rs"], r["seg"], r["phase"], r["sync"]
        dur = r["dur_us"].astype(float)
    # each rank-step's remainder row goes after its last row
    n_rs = len(st["grp"])
    at = np.searchsorted(rs_i, np.arange(n_rs), side="right")
    rem = rs.phases.index(REMAINDER)
    rs_i = np.insert(rs_i, at, np.arange(n_rs))
    seg = np.insert(seg, at, st["last_seg"])
    phase = np.insert(phase, at, rem)
    sync = np.insert(sync, at, False)
    dur = np.insert(dur, at, st["step_us"] - st["covered"])
    sid, _ = step_ids(rs)
    out = {"rs": rs_i, "sid": sid[rs_i], "seg": seg, "phase": phase, "sync": sync, "dur_us": dur}
    out["med_us"] = _median_by(out)
    return out


def _repeats(cell: np.ndarray, starts: np.ndarray) -> bool:
    """Whether some run (from ``starts``) holds a value of ``cell`` twice: more rows than distinct bits
    (values beyond 64 share bits, which can only report a repeat that is not there)."""
    bits = np.bitwise_or.reduceat(np.left_shift(np.uint64(1), (cell % 64).astype(np.uint64)), starts)
    return bool(np.any(np.bitwise_count(bits) < np.diff(np.append(starts, len(cell)))))


def _median_by(s: Arrays) -> np.ndarray:
    """Per busy row: the median of ``dur_us`` over the busy rows of its (grp, step, seg, phase) (NaN for
    sync rows, which never read it)."""
    dense = _median_dense(s)
    if dense is not None:
        return dense
    busy = np.flatnonzero(~s["sync"])
    seg_span = int(s["seg"].max(initial=0)) + 1
    key = (s["sid"][busy] * seg_span + s["seg"][busy]) * (int(s["phase"].max(initial=0)) + 1) + s["phase"][busy]
    order = sort_order(key, s["dur_us"][busy])
    v = s["dur_us"][busy][order]
    starts = runs_of(key[order])
    counts = np.diff(np.append(starts, len(order)))
    lo, hi = v[starts + (counts - 1) // 2], v[starts + counts // 2]
    med = lo + (hi - lo) * 0.5
    out = np.full(len(s["dur_us"]), np.nan)
    out[busy[order]] = med[at_runs(starts, len(order))]
    return out


def _median_dense(s: Arrays) -> np.ndarray | None:
    """``_median_by`` when every step has as many rank-steps and every rank-step the same (segment, phase,
    sync) rows in the same order (synchronous ranks running the same phases): the medians of a
    (steps × ranks × rows) array along its ranks. None otherwise."""
    starts = runs_of(s["rs"])
    width = len(s["rs"]) // max(len(starts), 1)
    steps = runs_of(s["sid"][starts])
    ranks = len(starts) // max(len(steps), 1)
    if width * len(starts) != len(s["rs"]) or ranks * len(steps) != len(starts) or not width * ranks:
        return None
    cell = ((s["seg"] * (int(s["phase"].max()) + 1) + s["phase"]) * 2 + s["sync"]).reshape(-1, width)
    if not (np.all(np.diff(starts) == width) and np.all(np.diff(steps) == ranks) and np.all(cell == cell[0])
            and len(np.unique(cell[0])) == width):  # (a phase named like the remainder shares its cell)
        return None
    v = np.sort(s["dur_us"].reshape(len(steps), ranks, width), axis=1)
    lo, hi = v[:, (ranks - 1) // 2, :], v[:, ranks // 2, :]
    med = np.repeat((lo + (hi - lo) * 0.5)[:, None, :], ranks, axis=1).ravel()
    return np.where(s["sync"], np.nan, med)
