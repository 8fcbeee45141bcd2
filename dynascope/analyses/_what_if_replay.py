"""The what-ifs' one replay engine: each step replayed segment by segment from the rows ``_what_if_load``
read (the model of ByteDance's what-if analysis, OSDI'25, "Understanding Stragglers in Large Model
Training Using What-if Analysis").

Per ``(run_id, role, step)``, each rank's top-level rows are ordered by start time and cut into segments at
its sync rows (category wait/comm): segment k holds the busy rows after the k-th sync and before the
(k+1)-th, and ends with that sync row. The rank's un-instrumented remainder (step row − all top-level rows)
is busy time in its last segment. Then

    step_time = Σ_k ( max_r busy[r, k] + min_r sync[r, k] )

every segment lasting as long as its slowest rank's busy time, plus the collective's own cost, which is what
the least-waiting rank (the one that arrived last) spent in it. With nothing replaced this reproduces the
measured step time (the longest step row) whenever the slowest rank is also the one that waits least,
which holds for synchronous steps.

The questions vary three things: what a replaced rank's busy time becomes (``replaced_busy``: the
cross-rank medians of ``_what_if_medians``), whether a rank's stretch after its last collective of step t
joins its first of step t+1 (``joins_next``, for the RL step's replay), and how a segment's busy time
runs (``slowest``: a device per rank; ``shared_time``: processor-shared devices).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np
import polars as pl

from dynascope.analyses._sorted_runs import (
    Arrays,
    at_runs,
    ends_of,
    order_in_runs,
    runs_of,
    sort_order,
    sorted_in_runs,
)
from dynascope.analyses._what_if_load import RankSteps, step_ids


def among(col: np.ndarray, wanted: Iterable[int] | np.ndarray | None) -> np.ndarray:
    """``col IN wanted`` per entry (all True for None: no restriction)."""
    if wanted is None:
        return np.ones(len(col), dtype=bool)
    return np.isin(col, np.fromiter((int(v) for v in wanted), dtype=np.int64))


def measured(rs: RankSteps) -> pl.DataFrame:
    """Per (grp, step), in step index order: ranks (rank-steps) and step_us (the longest step row)."""
    _, starts = step_ids(rs)
    st = rs.steps
    return pl.DataFrame({"grp": st["grp"][starts], "step": st["step"][starts],
                         "ranks": np.diff(np.append(starts, len(rs))),
                         "step_us": np.maximum.reduceat(st["step_us"], starts) if len(rs) else np.zeros(0)},
                        schema={"grp": pl.Int64, "step": pl.Int64, "ranks": pl.Int64, "step_us": pl.Float64})


def rank_segments(rs: RankSteps, values: np.ndarray, tail: np.ndarray, kept: np.ndarray | None = None) -> Arrays:
    """Per (rank-step, segment) of the ``kept`` rank-steps (a sorted index; None: all), in that order: rs,
    seg, rank, busy (the busy rows' ``values`` summed, the rank-step's ``tail`` in its last segment) and
    sync (the sync rows' ``values`` summed)."""
    r, st = rs.rows, rs.steps
    if kept is None:
        kept = np.arange(len(rs))
        rr, seg, v, sync = r["rs"], r["seg"], values, r["sync"]
    else:
        rows = np.zeros(len(rs), dtype=bool)
        rows[kept] = True
        rows = rows[r["rs"]]
        rr, seg, v, sync = r["rs"][rows], r["seg"][rows], values[rows], r["sync"][rows]
    starts = runs_of(rr, seg)  # rows are sorted by (rank-step, start), so by (rank-step, segment)
    at = at_runs(starts, len(rr))
    waits = np.where(sync, v, 0).astype(float)
    out = {"rs": rr[starts], "seg": seg[starts],
           "busy": np.bincount(at, weights=v - waits, minlength=len(starts)),
           "sync": np.bincount(at, weights=waits, minlength=len(starts))}
    last = ends_of(runs_of(out["rs"]), len(starts))  # each rank-step's last segment, where its tail goes
    if len(last) == len(kept):  # every kept rank-step has rows (the usual case)
        out["busy"][last] += tail[kept]
    else:  # the others' tail is a segment of its own (their last_seg: 0)
        bare = np.setdiff1d(kept, out["rs"][last], assume_unique=True)
        out["busy"][last] += tail[out["rs"][last]]
        out = {c: np.concatenate([a, x]) for (c, a), x in zip(out.items(), (
            bare, st["last_seg"][bare], tail[bare], np.zeros(len(bare))), strict=True)}
        order = sort_order(out["rs"], out["seg"])
        out = {c: a[order] for c, a in out.items()}
    out["rank"] = st["rank"][out["rs"]]
    return out


def replaced_busy(segs: Arrays, c: Arrays, replace: np.ndarray) -> np.ndarray:
    """``segs``' busy time with the busy cells ``c`` (of every rank-step) where ``replace`` holds at their
    cross-rank medians."""
    delta = np.where(replace & ~c["sync"], c["med"] - c["value"], 0.0)
    return segs["busy"] + np.bincount(c["at"], weights=delta, minlength=len(segs["busy"]))


def neighbours(rs: RankSteps, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each ``kept`` rank-step, the position in ``kept`` of the same rank's previous and next kept
    rank-step (by step; -1 for none)."""
    st = rs.steps
    w = sort_order(st["grp"][kept], st["rank"][kept], st["step"][kept])
    g, rank = st["grp"][kept][w], st["rank"][kept][w]
    same = (g[1:] == g[:-1]) & (rank[1:] == rank[:-1])
    prev, nxt = np.full(len(w), -1, dtype=np.int64), np.full(len(w), -1, dtype=np.int64)
    prev[w[1:][same]] = w[:-1][same]
    nxt[w[:-1][same]] = w[1:][same]
    return prev, nxt


def joins_next(rs: RankSteps, kept: np.ndarray, nxt: np.ndarray) -> np.ndarray:
    """Per ``kept`` rank-step: whether its rank's stretch after its last sync row joins the next step's
    first segment. Under data parallelism the ranks' step boundaries drift apart (the probe's per-step work
    sits there), and the work after a rank's last collective of step t and before its first of step t+1 is
    one stretch between two collectives: split at the boundary, each half would wait for its own slowest
    rank. It joins when the rank's next kept rank-step is step t+1 and has a sync row."""
    st = rs.steps
    step, syncs = st["step"][kept], st["syncs"][kept]
    n = np.maximum(nxt, 0)
    return (nxt >= 0) & (step[n] == step + 1) & (syncs[n] > 0) & (syncs > 0)


def moved(rs: RankSteps, segs: Arrays, sid: np.ndarray, joins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (step index, segment) each rank-segment is replayed in: a joining rank-step's last stretch (the
    segment after its last sync row) moves to segment 0 of the next step index. ``sid``/``joins``: per
    rank-step (of ``rs``)."""
    syncs = rs.steps["syncs"][segs["rs"]]
    move = joins[segs["rs"]] & (segs["seg"] == syncs)
    return sid[segs["rs"]] + move, np.where(move, 0, segs["seg"])


def merged(sid: np.ndarray, seg: np.ndarray, rank: np.ndarray, *values: np.ndarray) -> tuple[np.ndarray, ...]:
    """One entry per (step, segment, rank), ``values`` summed: after ``moved``, a rank's joined stretch and
    its next step's first segment are one."""
    order = sort_order(sid, seg, rank)
    starts = runs_of(sid[order], seg[order], rank[order])
    if len(starts) == len(order):
        return (sid, seg, rank, *values)
    keys = (a[order][starts] for a in (sid, seg, rank))
    return (*keys, *(np.add.reduceat(v[order], starts) for v in values))


class Segments(NamedTuple):
    """Rank-segments grouped per (step, segment): ``order`` sorts them by (step, segment, busy), ``by`` by
    (step, segment) alone, ``starts`` begins each (step, segment) in either order, ``ends`` ends it,
    ``sid`` is its step index, ``of`` is each rank-segment's (step, segment)."""

    order: np.ndarray
    by: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    sid: np.ndarray
    of: np.ndarray


def segments(sid: np.ndarray, seg: np.ndarray, busy: np.ndarray) -> Segments:
    """The rank-segments (step index, segment, busy) grouped per (step, segment), busiest last."""
    by = sort_order(sid, seg)  # then by busy within each (step, segment): the same order, stably
    starts = runs_of(sid[by], seg[by])
    order = by[order_in_runs(busy[by], starts)]
    of = np.empty(len(order), dtype=np.int64)
    of[order] = at_runs(starts, len(order))
    return Segments(order, by, starts, ends_of(starts, len(order)), sid[order][starts], of)


def slowest(g: Segments, busy: np.ndarray) -> np.ndarray:
    """Per (step, segment): the largest ``busy`` (the one it is sorted by)."""
    return busy[g.order][g.ends]


def runner_up(g: Segments, busy: np.ndarray) -> np.ndarray:
    """Per (step, segment): the second largest ``busy`` (equal to the largest on a tie; NaN for one rank)."""
    return np.where(g.ends > g.starts, busy[g.order][np.maximum(g.ends - 1, 0)], np.nan)


def most(g: Segments, v: np.ndarray) -> np.ndarray:
    return np.maximum.reduceat(v[g.order], g.starts)


def least(g: Segments, v: np.ndarray) -> np.ndarray:
    return np.minimum.reduceat(v[g.order], g.starts)


def per_step(g: Segments, t: np.ndarray, n_steps: int) -> np.ndarray:
    """Per step index: ``t`` (per (step, segment)) summed."""
    return np.bincount(g.sid, weights=t, minlength=n_steps)


def shared_time(g: Segments, work: np.ndarray, share: Callable[[float], float]) -> np.ndarray:
    """Per (step, segment) of ``g``: the time its ranks' ``work`` (device-µs, one process per rank, all
    started together) takes on processor-shared devices, where ``share(k)`` is each of k running processes'
    share. The jobs finish in order of their work; between two finishes the k still running each do (the
    next one's work − the last one's) at ``share(k)``."""
    starts = g.starts
    w = sorted_in_runs(work[g.by], starts)  # only the sorted work of each (step, segment) matters, not whose
    n = np.diff(np.append(starts, len(w)))
    left = np.repeat(n + starts, n) - np.arange(len(w))  # this job and the ones still running with it
    done = np.concatenate([[0.0], w[:-1]])
    done[starts] = 0.0
    ks = np.flatnonzero(np.bincount(left))  # the job counts present (small: a segment's ranks at most)
    rate = np.zeros(int(ks.max(initial=0)) + 1)
    rate[ks] = [share(float(k)) for k in ks]
    return np.add.reduceat((w - done) / rate[left], starts) if len(w) else np.zeros(0)
