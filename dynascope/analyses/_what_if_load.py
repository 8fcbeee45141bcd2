"""The what-ifs' one load step: what they read, normalised once.

``load_rank_steps`` reads the top-level and step rows of the timings (see ``steps``) once and sorts them by
(run, role, step, rank, start): a rank-step's rows are then contiguous, a row's segment (the sync rows of
its rank-step that start before it) is a running count, and the rows of a (rank-step, segment) are
contiguous too, so every aggregate of the replay (``_what_if_replay``) is a ``reduceat`` over these runs.

Rows the model cannot place are left out here, so nothing downstream meets a NULL: a row needs its run, its
rank, its start and its duration (``step`` is part of every top-level and step row's definition, and a
NULL role is the empty role, as in every analysis). A top-level row left out leaves its time to its
rank-step's remainder (the step time no row covers); a rank-step whose step rows are all left out is left
out with its rows, like a rank-step without a step row.

``measured_devices`` normalises the device model's inputs, which are measurements and carry their noise:
a measured ``timeslice_efficiency`` above 1 (time slicing that lost nothing, within noise) is replayed as
1, the model's ideal sharing, with a note.

Names become integer codes: ``grp`` numbers the (run_id, role) pairs, ``phase`` the phase names (the
remainder's among them). Ranks stay rank numbers, so a later step can group them by host.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import polars as pl
import pyarrow as pa

from dynascope.analyses._common import once, run_clause
from dynascope.analyses._sorted_runs import Arrays, as_numpy, at_runs, pack, runs_of, stable_order
from dynascope.analyses.steps import REMAINDER, STEP_ROW, SYNC, TOP_LEVEL
from dynascope.store import StoreConnection, quote_literal


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

    def __len__(self) -> int:  # rank-steps
        return len(self.steps["grp"])


def step_ids(rs: RankSteps) -> tuple[np.ndarray, np.ndarray]:
    """Per rank-step the index of its (grp, step), and the first rank-step of each (grp, step)."""
    starts = runs_of(rs.steps["grp"], rs.steps["step"])
    return at_runs(starts, len(rs)), starts


Read = tuple[pa.Table, list[list[str]], Arrays]


def _coded(col: pa.ChunkedArray, extra: Iterable[str] = ()) -> tuple[np.ndarray, list[str]]:
    """The 0-based codes of a string column without NULLs in its sorted distinct names (with ``extra``), and
    those names (through polars: pyarrow's compute functions import pandas, 0.4 s)."""
    s = pl.from_arrow(col)
    assert isinstance(s, pl.Series)
    names = sorted({*s.unique().to_list(), *extra})
    return s.cast(pl.Enum(names)).to_physical().to_numpy().astype(np.int64), names


def _read(store: StoreConnection, run: str | None) -> Read:
    """The rows, the names of runs, roles and phases among them (each sorted), and their codes as NumPy.

    One query: the names come from the rows read, coded here, not listed by a query of their own. On a
    live run every query lists and opens each writer's files, which costs more than the rows (a second
    query would double it), and a name written between two queries would have no code. With one run there
    is no run_id column (its code is 0)."""
    placed = "rank IS NOT NULL AND start_us IS NOT NULL AND dur_us IS NOT NULL" + (
        " AND run_id IS NOT NULL" if run is None else run_clause(run))
    t = store.arrow(f"""
        SELECT {"" if run is not None else "run_id, "}coalesce(role, '') AS role, rank, step,
               coalesce(phase, {quote_literal(REMAINDER)}) AS phase,
               ({STEP_ROW}) AS is_step, {SYNC} AS sync, start_us, dur_us
        FROM timings WHERE (({TOP_LEVEL}) OR ({STEP_ROW})) AND {placed}""")
    # DuckDB hands back a chunk per file scanned (~8,600 on a live run of 1,280 writers); one copy into
    # whole columns costs less than converting and coding them chunk by chunk
    t = t.combine_chunks()
    columns: Arrays = {}
    names: list[list[str]] = [[run] if run is not None else [], [], []]
    for i, (c, extra) in enumerate((("run_id", ()), ("role", ()), ("phase", (REMAINDER,)))):
        if c in t.column_names:
            columns[c], names[i] = _coded(t[c], extra)
    if run is None and len(names[0]) == 1:  # one run: code 0, as with a run given
        del columns["run_id"]
    t = t.drop_columns([c for c in ("run_id", "role", "phase") if c in t.column_names])  # coded: the names' memory back
    return t, [n or [""] for n in names], columns


_GROUPS = {"grp": pl.Int64, "run_id": pl.String, "role": pl.String}


def _empty() -> RankSteps:
    i, f = np.zeros(0, dtype=np.int64), np.zeros(0)
    rows = {"rs": i, "seg": i, "phase": i, "sync": np.zeros(0, dtype=bool), "start_us": i, "dur_us": i}
    steps = {"grp": i, "step": i, "rank": i, "step_us": f, "step_start_us": i, "covered": f, "syncs": i,
             "last_seg": i}
    return RankSteps(rows, steps, pl.DataFrame(schema=_GROUPS), [REMAINDER])


def load_rank_steps(store: StoreConnection, run: str | None,
                    after_read: Callable[[], object] | None = None) -> RankSteps:
    """The top-level and step rows of ``run`` (None: every run) as ``RankSteps``. ``after_read`` runs once
    DuckDB has read the rows, before the arrays are built (a caller starts other reads there, which then
    share the cores with NumPy instead of with this read). Inside ``shared_reads`` the rows are read once
    for every what-if of the block; their arrays are read-only, since every caller shares them."""
    called = []

    def read() -> RankSteps:
        called.append(True)
        return _loaded(store, run, after_read)

    rs = once((store, "rank_steps", run), read)
    if after_read is not None and not called:  # read before: the caller's other reads start now
        after_read()
    return rs


def _loaded(store: StoreConnection, run: str | None, after_read: Callable[[], object] | None) -> RankSteps:
    t, (runs, roles, phases), c = _read(store, run)  # the remainder's name is one of the phases
    if after_read is not None:
        after_read()
    n = t.num_rows
    if not n:
        return _empty()
    run_c = c["run_id"] if "run_id" in c else np.zeros(n, dtype=np.int64)
    role_c, phase_c = c["role"], c["phase"]
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
                           "role": [roles[g % n_roles] for g in grp_ids]}, schema=_GROUPS)
    rank, step = as_numpy(t["rank"]).astype(np.int64), as_numpy(t["step"])
    start, dur = as_numpy(t["start_us"]), as_numpy(t["dur_us"])
    is_step = as_numpy(t["is_step"])
    order, rs, first = _by_rank_step(grp, step, rank, start, is_step)
    is_step = is_step[order]
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
    rows.update(phase=phase_c[src], sync=as_numpy(t["sync"])[src], start_us=start[src], dur_us=dur[src])
    rows["seg"] = _segments_of(rows["rs"], rows["start_us"], rows["sync"])
    steps["covered"] = np.bincount(rows["rs"], weights=rows["dur_us"], minlength=n_rs)
    steps["syncs"] = np.bincount(rows["rs"][rows["sync"]], minlength=n_rs).astype(np.int64)
    last = np.zeros(n_rs, dtype=np.int64)  # segments never decrease along a rank-step: its last row's
    if len(keep):
        ends = np.append(runs_of(rows["rs"])[1:], len(keep)) - 1
        last[rows["rs"][ends]] = rows["seg"][ends]
    steps["last_seg"] = last
    for a in (*rows.values(), *steps.values()):
        a.flags.writeable = False
    return RankSteps(rows, steps, groups, phases)


def _by_rank_step(grp: np.ndarray, step: np.ndarray, rank: np.ndarray, start: np.ndarray,
                  is_step: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An order of the rows by (grp, step, rank), each rank-step's rows other than its step rows by start,
    stably (its step rows anywhere in it: they are only ever reduced per rank-step), the rank-step index of
    each row in that order, and each rank-step's first row. The rank-steps come out in (grp, step, rank)
    order."""
    p = pack(grp, step, rank)
    if p is not None:
        # A writer writes a step's rows in time order, so the rows as read are usually by start within each
        # rank-step already: then the order by rank-step alone is the order, and a plain sort of the keys
        # with their positions gives it (a stable sort that includes the start costs several times more).
        packed, bits = p
        order = stable_order(packed, sum(bits))
        rows = order[~is_step[order]]
        key, at = packed[rows], start[rows]
        if not np.any((key[1:] == key[:-1]) & (at[1:] < at[:-1])):
            first = runs_of(packed[order])
            return order, at_runs(first, len(order)), first
    p = pack(grp, step, rank, start)
    if p is not None:  # one integer sort; the rank-step is the key without its start bits
        packed, bits = p
        order = np.argsort(packed, kind="stable")
        key = packed[order]
        del packed
        key >>= bits[-1]  # in place: a fresh array's pages cost more than the shift
        first = runs_of(key)
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


@dataclass(frozen=True)
class Devices:
    """The device model's inputs (docs/schedules.md §2): ``count`` devices the measured ranks shared (None:
    one per rank), ``background`` other runnable processes on them while the run was measured and
    ``target_background`` in the replay, ``timeslice`` the part of a pool's capacity that does work when
    one process more than it has devices shares it; ``note`` says what normalising them changed."""

    count: float | None
    background: float = 0.0
    target_background: float = 0.0
    timeslice: float = 1.0
    note: str = ""

    def for_ranks(self, ranks: int) -> Devices:
        """These inputs with ``count`` set: as given, or one device per rank."""
        return self if self.count is not None else replace(self, count=float(ranks))

    def share(self, procs: float) -> float:
        """Each of ``procs`` runnable processes' share of the ``count`` devices (``process_share``)."""
        assert self.count is not None, "for_ranks() sets the device count"
        return process_share(self.count, procs, self.timeslice)


def measured_devices(devices: float | None = None, background: float = 0.0, target_background: float | None = None,
                     timeslice_efficiency: float = 1.0) -> Devices:
    """``Devices`` from an analysis's arguments, checked. ``timeslice_efficiency`` is measured (one process
    alone against n at once, as ``benchmarks/whatif_validation.py`` does), so it carries the
    measurement's noise: a value above 1 says time slicing lost nothing measurable, which the model
    replays as 1, its ideal sharing, and says so in ``note`` and a warning. Zero, negative and NaN are
    not noise but a wrong input, and raise."""
    target = background if target_background is None else target_background
    if devices is not None and not devices > 0:
        raise ValueError(f"devices must be > 0, not {devices}")
    if not (background >= 0 and target >= 0):
        raise ValueError("background and target_background must be ≥ 0")
    ts = float(timeslice_efficiency)
    if math.isnan(ts) or ts <= 0:
        raise ValueError(f"timeslice_efficiency must be in (0, 1], not {timeslice_efficiency}")
    note = ""
    if ts > 1:
        note = f"timeslice_efficiency=1 (measured {ts:g}: above 1, no loss within its noise)"
        warnings.warn(f"{note}: the model's ideal sharing", stacklevel=3)
        ts = 1.0
    return Devices(None if devices is None else float(devices), float(background), float(target), ts, note)


def process_share(capacity: float, procs: float, timeslice: float = 1.0) -> float:
    """Each of ``procs`` runnable processes' share of ``capacity`` devices: at most one device, an equal part
    of the pool when there are more processes than devices.

    ``timeslice``: the part of the pool's capacity that still does work when one process more than it has
    devices time-slices it (each switch costs the switch and refilled caches; 1 is ideal sharing, and
    ``benchmarks/whatif_validation.py`` measured 0.84-0.96 for three and four demo processes on two
    cores). With a fraction of a process in excess (a background load) the loss is that fraction of it,
    beyond one process it stays as measured.
    """
    if procs <= capacity:
        return 1.0
    used = 1.0 - (1.0 - timeslice) * min(1.0, procs - capacity)
    return used * capacity / procs
