"""The values a replaced rank takes: the cross-rank median of each (step, segment, phase).

A rank-step's rows are summed per (segment, phase, sync) into *cells*, its remainder (step time no row
covers) a busy cell of its last segment; a busy cell's median is over the busy cells of the same (run, role,
step, segment, phase) on every rank. (A phase named like the remainder shares its medians with it.)

Synchronous ranks usually run the same phases in the same order every step. Then every rank-step has the
same cells, they form a (steps × ranks × cells) array, and the medians are a sort along its ranks.
Otherwise the cells are grouped by sorting (repeated phases summed, medians per group).
"""

from __future__ import annotations

import numpy as np

from dynascope.analyses._sorted_runs import Arrays, at_runs, runs_of, sort_order
from dynascope.analyses._what_if_load import RankSteps, step_ids
from dynascope.analyses.steps import REMAINDER


def cells(rs: RankSteps, values: np.ndarray, tail: np.ndarray) -> Arrays:
    """Per (rank-step, segment, phase, sync): the rows' ``values`` summed (µs, or work), each rank-step's
    ``tail`` (its remainder) after them, sorted by (rank-step, segment): rs, sid (the (grp, step) index),
    seg, phase, sync, value, med (the cross-rank median of a busy cell; NaN for sync cells), at (the
    cell's (rank-step, segment) index, as ``_what_if_replay.rank_segments`` numbers them)."""
    r = {**rs.rows, "value": values}
    st = rs.steps
    n_rs = len(rs)
    sid, _ = step_ids(rs)
    rem = rs.phases.index(REMAINDER)
    end = {"seg": st["last_seg"], "phase": np.full(n_rs, rem, dtype=r["phase"].dtype),
           "sync": np.zeros(n_rs, dtype=bool), "value": tail}
    width = _uniform_width(r, n_rs)
    if width is not None:  # every rank-step alike: append the remainder as one more column
        cols = {c: np.concatenate([r[c].reshape(n_rs, width).astype(end[c].dtype, copy=False), end[c][:, None]],
                                  axis=1).ravel() for c in ("seg", "phase", "sync", "value")}
        out = {"rs": np.repeat(np.arange(n_rs), width + 1), "sid": np.repeat(sid, width + 1), **cols}
        med = _median_of_ranks(out, sid, n_rs, width + 1, rem)
        out["med"] = med if med is not None else _median_sorted(out)
    else:
        out = _summed(r, rs)
        per = np.bincount(out["rs"], minlength=n_rs) + 1
        last = np.zeros(len(out["rs"]) + n_rs, dtype=bool)  # rank-step k's cells move down by k places
        last[np.cumsum(per) - 1] = True
        row = ~last

        def spread(a: np.ndarray, t: np.ndarray) -> np.ndarray:
            o = np.empty(len(last), dtype=a.dtype)
            o[row], o[last] = a, t
            return o

        out = {"rs": np.repeat(np.arange(n_rs), per), "sid": np.repeat(sid, per),
               **{c: spread(out[c], end[c]) for c in ("seg", "phase", "sync", "value")}}
        out["med"] = _median_sorted(out)
    out["at"] = at_runs(runs_of(out["rs"], out["seg"]), len(out["rs"]))
    return out


def _uniform_width(r: Arrays, n_rs: int) -> int | None:
    """Rows per rank-step when every rank-step has the same (segment, phase, sync) rows in the same order,
    no (phase, sync) twice (nothing to sum); None otherwise."""
    n = len(r["rs"])
    if not n_rs or n % n_rs or not n:
        return None
    width = n // n_rs
    if not np.array_equal(r["rs"][::width], np.arange(n_rs)) or np.any(r["rs"][width - 1::width] != np.arange(n_rs)):
        return None
    cell = (r["seg"] * (int(r["phase"].max()) + 1) + r["phase"]) * 2 + r["sync"]
    first = cell[:width]
    pair = r["phase"][:width] * 2 + r["sync"][:width]
    if len(np.unique(pair)) != width or not np.all(cell.reshape(n_rs, width) == first):
        return None
    return width


def _summed(r: Arrays, rs: RankSteps) -> Arrays:
    """The rows summed per (rank-step, segment, phase, sync), by (rank-step, segment). Rows are sorted by
    (rank-step, start), so by (rank-step, segment): only a repeated (phase, sync) in a segment needs the
    sort."""
    cell = r["phase"] * 2 + r["sync"]
    seg_starts = runs_of(r["rs"], r["seg"])
    cols = {c: r[c] for c in ("rs", "seg", "phase", "sync")}
    if len(seg_starts) and _repeats(cell, seg_starts):
        key = (r["rs"] * (int(r["seg"].max(initial=0)) + 1) + r["seg"]) * len(rs.phases) * 2 + cell
        order = np.argsort(key, kind="stable")
        starts = runs_of(key[order])
        cols = {c: v[order][starts] for c, v in cols.items()}
        cols["value"] = np.add.reduceat(r["value"][order], starts).astype(float)
    else:
        cols["value"] = r["value"].astype(float)
    return cols


def _repeats(cell: np.ndarray, starts: np.ndarray) -> bool:
    """Whether some run (from ``starts``) holds a value of ``cell`` twice: more rows than distinct bits
    (values beyond 64 share bits, which can only report a repeat that is not there)."""
    bits = np.bitwise_or.reduceat(np.left_shift(np.uint64(1), (cell % 64).astype(np.uint64)), starts)
    return bool(np.any(np.bitwise_count(bits) < np.diff(np.append(starts, len(cell)))))


def _median_of_ranks(s: Arrays, sid: np.ndarray, n_rs: int, width: int, rem: int) -> np.ndarray | None:
    """The medians when every step has as many rank-steps and each of its ``width`` columns is one (segment,
    phase): medians of a (steps × ranks × columns) array along its ranks. None when the steps have
    different rank counts, or a column shares its (segment, phase) with the remainder (a phase named like
    it), whose median then pools both."""
    steps = runs_of(sid)
    ranks = n_rs // max(len(steps), 1)
    if not ranks or ranks * len(steps) != n_rs or np.any(np.diff(steps) != ranks):
        return None
    seg, phase, sync = s["seg"][:width], s["phase"][:width], s["sync"][:width]
    if np.any((seg[:-1] == seg[-1]) & (phase[:-1] == rem) & ~sync[:-1]):
        return None
    v = np.sort(s["value"].reshape(len(steps), ranks, width).transpose(0, 2, 1), axis=-1)  # ranks last
    lo, hi = v[..., (ranks - 1) // 2], v[..., ranks // 2]
    med = np.where(sync, np.nan, lo + (hi - lo) * 0.5)  # sync cells never read it
    return np.repeat(med[:, None, :], ranks, axis=1).ravel()


def _median_sorted(s: Arrays) -> np.ndarray:
    """Per busy cell: the median of ``value`` over the busy cells of its (grp, step, seg, phase) (NaN for
    sync cells, which never read it)."""
    busy = np.flatnonzero(~s["sync"])
    seg_span = int(s["seg"].max(initial=0)) + 1
    key = (s["sid"][busy] * seg_span + s["seg"][busy]) * (int(s["phase"].max(initial=0)) + 1) + s["phase"][busy]
    order = sort_order(key, s["value"][busy])
    v = s["value"][busy][order]
    starts = runs_of(key[order])
    counts = np.diff(np.append(starts, len(order)))
    lo, hi = v[starts + (counts - 1) // 2], v[starts + counts // 2]
    med = lo + (hi - lo) * 0.5
    out = np.full(len(s["value"]), np.nan)
    out[busy[order]] = med[at_runs(starts, len(order))]
    return out
