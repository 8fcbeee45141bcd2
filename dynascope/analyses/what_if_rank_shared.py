"""What if a rank ran as fast as the others, when ranks share devices: ``what_if_shared``.

``what_if_steps`` gives each rank a device of its own, so a rank's phase takes as long whatever the others
do. When ranks share devices (four gloo ranks on two CPU cores, time-sliced GPUs) that is false: while a
slow rank is still generating, the others train with less competition, and a phase measured in that run is
shorter than it would be with every rank busy. So a measured duration is first turned into *work*: a rank
busy (inside its step row, outside its sync rows) from a to b received ∫ₐᵇ share(busy ranks(t) +
background) dt device-µs (``Devices.share``: at most one device each, less what time slicing costs). The
step is then replayed as in ``what_if`` (``_what_if_replay``), except that a segment's busy work runs
processor-shared: every busy rank gets an equal share, and the share grows as ranks finish. A rank's work
after its last collective of a step joins its next step's first segment (as ``schedule_inputs`` replays
it). With at least as many devices as ranks (plus background) every rate is 1 and this is
``what_if_steps``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import polars as pl

from dynascope.analyses._common import StoreLike, as_store
from dynascope.analyses._sorted_runs import sort_order
from dynascope.analyses._what_if_load import Devices, RankSteps, load_rank_steps, measured_devices, step_ids
from dynascope.analyses._what_if_replay import (
    joins_next,
    least,
    measured,
    merged,
    moved,
    neighbours,
    per_step,
    segments,
    shared_time,
)
from dynascope.analyses.what_if_rank import replaced, replay_steps, steps_frame

__all__ = ["what_if_shared"]


def work_of(rs: RankSteps, dev: Devices) -> tuple[np.ndarray, np.ndarray]:
    """Each row's and each rank-step's work (device-µs) from the busy ranks of its (run, role) over time:
    ranks are busy inside their step rows and outside their sync rows."""
    r, st = rs.rows, rs.steps
    start, end = r["start_us"], r["start_us"] + r["dur_us"]
    s_start = st["step_start_us"]
    s_end = s_start + st["step_us"]
    row_grp = st["grp"][r["rs"]]
    row_work, step_work = np.zeros(len(start)), np.zeros(len(rs))
    for g in range(rs.groups.height):
        rows, steps = np.flatnonzero(row_grp == g), np.flatnonzero(st["grp"] == g)
        if not len(steps):  # a (run, role) whose rank-steps all lack a step row: nothing to replay
            continue
        sync = r["sync"][rows]
        syncs, busy = rows[sync], rows[~sync]
        ns, ny = len(steps), len(syncs)
        t = np.concatenate([s_start[steps], start[syncs], s_end[steps], end[syncs]]).astype(float)
        d = np.concatenate([np.ones(ns), -np.ones(ny), -np.ones(ns), np.ones(ny)])
        order = sort_order(t, d)  # one integer sort: the times are whole µs
        n = np.cumsum(d[order])  # busy ranks from each event to the next
        t = t[order]
        cum = np.concatenate([[0.0], np.cumsum(_rates(n, dev)[:-1] * np.diff(t))])
        # An event's own time is in t: its integral is read at its place (what np.interp returns there, since
        # events at one time share one value), and only the busy rows' ends are interpolated.
        at = np.empty(len(order), dtype=np.int64)
        at[order] = np.arange(len(order))
        c = cum[at]
        step_work[steps] = c[ns + ny:2 * ns + ny] - c[:ns]
        row_work[syncs] = c[2 * ns + ny:] - c[ns:ns + ny]
        row_work[busy] = np.interp(end[busy].astype(float), t, cum) - np.interp(start[busy].astype(float), t, cum)
    return row_work, step_work


def _rates(n: np.ndarray, dev: Devices) -> np.ndarray:
    """Each busy rank's rate while ``n`` ranks are busy (plus the background), from one share per count."""
    lo, hi = (int(n.min()), int(n.max())) if len(n) else (0, -1)
    counts = np.arange(lo, hi + 1)
    if len(counts) > 4 * len(n) + 1024:  # counts far apart: one share per count present
        counts, n = np.unique(n, return_inverse=True)
        lo = 0
    rate = np.array([dev.share(float(k) + dev.background) for k in counts])
    return rate[(n - lo).astype(np.int64)]


def what_if_shared(store: StoreLike, run: str | None = None, *, ranks: Iterable[int] | str | None = None,
                   phases: Iterable[str] | None = None, devices: float, background: float = 0.0,
                   target_background: float | None = None, timeslice_efficiency: float = 1.0) -> pl.DataFrame:
    """``what_if_steps`` for ranks sharing ``devices`` (with ``background`` other runnable processes while
    the run was measured, ``target_background`` in the replay; default the same). ``timeslice_efficiency``:
    the part of the devices' capacity that does work when one rank more than there are devices shares them
    (``schedule_what_if``'s parameter of that name; default 1, ideal sharing; a measured value above 1 is
    replayed as 1).

    Same columns as ``what_if_steps``: run_id, role, step, ranks, measured_ms, simulated_base_ms,
    simulated_ms, saved_ms; ``ranks``/``phases`` choose what is replaced by the cross-rank median (of work).
    """
    dev = measured_devices(devices, background, target_background, timeslice_efficiency)
    rs = load_rank_steps(as_store(store), run)
    assert dev.count is not None
    if len(np.unique(rs.steps["rank"])) + max(dev.background, dev.target_background) <= dev.count:
        return replay_steps(rs, ranks, phases)  # nobody shares: every rate is 1
    row_work, step_work = work_of(rs, dev)
    values = np.where(rs.rows["sync"], rs.rows["dur_us"], row_work)  # busy rows' work, sync rows' µs
    tail = step_work - np.bincount(rs.rows["rs"], weights=row_work, minlength=len(rs))
    segs, _, new = replaced(rs, values, tail, ranks, phases)
    everyone = np.arange(len(rs))
    sid, seg = moved(rs, segs, step_ids(rs)[0], joins_next(rs, everyone, neighbours(rs, everyone)[1]))
    sid, seg, _, busy, new, wait = merged(sid, seg, segs["rank"], segs["busy"], new, segs["sync"])
    m = measured(rs)
    g = segments(sid, seg, busy)
    least_wait = least(g, wait)

    def share(k: float) -> float:
        return dev.share(k + dev.target_background)

    return steps_frame(rs, m, per_step(g, shared_time(g, busy, share) + least_wait, m.height),
                       per_step(g, shared_time(g, new, share) + least_wait, m.height))
