"""``what_if`` for ranks that share devices: ranks replaced by the median, replayed under processor sharing.

``what_if_steps`` assumes each rank has its own device, so a rank's phase takes as long whatever the others
do. When ranks share devices (four gloo ranks on two CPU cores, time-sliced GPUs) that is false: while a slow
rank is still generating, the others train with less competition, and a phase measured in that run is
shorter than it would be with every rank busy. So a measured duration is first turned into *work*: a rank
busy (inside its step row, outside its sync rows) from a to b received ∫ₐᵇ min(1, devices / (busy ranks(t)
+ background)) dt device-µs (less what time slicing costs, ``_schedule_sim.process_share``). The step is then replayed as in ``what_if`` — segments between sync rows, the
collective costing the least wait of any rank — except that a segment's busy work runs processor-shared:
every busy rank gets an equal share (at most one device), and the share grows as ranks finish.
With at least as many devices as ranks (plus background) every rate is 1 and this is ``what_if_steps``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.analyses._schedule_sim import process_share, timeslice_of
from dynascope.analyses.steps import STEP_ROW, SYNC, TOP_LEVEL
from dynascope.analyses.stragglers import _STEP_SCHEMA, REMAINDER, what_if_steps

__all__ = ["what_if_shared"]


def shared_time(work: np.ndarray, devices: float, background: float, timeslice: float = 1.0) -> float:
    """Time for jobs of ``work`` device-µs started together, one process each, on shared ``devices``."""
    t = done = 0.0
    w = np.sort(work)
    for i, x in enumerate(w):
        t += (x - done) / process_share(devices, len(w) - i + background, timeslice)
        done = x
    return t


def _work(g: pl.DataFrame, devices: float, background: float, timeslice: float = 1.0) -> pl.DataFrame:
    """Each row's work (device-µs) from the busy ranks over time: steps are busy, sync rows are not."""
    busy = g.filter(pl.col("is_step") | pl.col("sync"))
    sign = np.where(busy["is_step"].to_numpy(), 1, -1)
    t = np.concatenate([busy["start_us"].to_numpy(), busy["end_us"].to_numpy()]).astype(float)
    d = np.concatenate([sign, -sign])
    order = np.lexsort((d, t))
    t, n = t[order], np.cumsum(d[order])  # busy ranks from each event to the next
    counts, which = np.unique(n, return_inverse=True)  # a few distinct busy counts: one share each
    rate = np.array([process_share(devices, float(k) + background, timeslice) for k in counts])[which]
    cum = np.concatenate([[0.0], np.cumsum(rate[:-1] * np.diff(t))])
    at = lambda col: np.interp(g[col].to_numpy().astype(float), t, cum)  # noqa: E731
    return g.with_columns(work=pl.Series(at("end_us") - at("start_us")))


def _join_across_steps(parts: pl.DataFrame, key: list[str]) -> pl.DataFrame:
    """A rank's work after its last collective of step t and before its first of step t+1 is one stretch
    between two collectives: replayed as one segment, counted in step t+1 (as ``schedule_inputs`` does).
    Split at the step boundary, each half would wait for its own slowest rank (4-5% too long on the demo's
    4-rank runs on 2 cores)."""
    syncs = parts.filter(pl.col("sync")).group_by(key).agg(syncs=pl.col("seg").max() + 1)
    following = syncs.select(*key[:-1], pl.col("step") - 1, next_syncs=pl.col("syncs"))
    parts = parts.join(syncs, on=key, how="left").join(following, on=key, how="left")
    move = (pl.col("seg") == pl.col("syncs")) & pl.col("next_syncs").is_not_null()
    return parts.with_columns(step=pl.when(move).then(pl.col("step") + 1).otherwise(pl.col("step")),
                              seg=pl.when(move).then(0).otherwise(pl.col("seg"))).drop("syncs", "next_syncs")


def what_if_shared(store: StoreLike, run: str | None = None, *, ranks: Iterable[int] | str | None = None,
                   phases: Iterable[str] | None = None, devices: float, background: float = 0.0,
                   target_background: float | None = None, timeslice_efficiency: float = 1.0) -> pl.DataFrame:
    """``what_if_steps`` for ranks sharing ``devices`` (with ``background`` other runnable processes while
    the run was measured, ``target_background`` in the replay; default the same). ``timeslice_efficiency``:
    the part of the devices' capacity that does work when one rank more than there are devices shares them
    (``schedule_what_if``'s parameter of that name; default 1, ideal sharing).

    Same columns as ``what_if_steps``: run_id, role, step, ranks, measured_ms, simulated_base_ms,
    simulated_ms, saved_ms; ``ranks``/``phases`` choose what is replaced by the cross-rank median (of work).
    """
    con = as_store(store)
    n_ranks = frame(con, f"SELECT COUNT(DISTINCT rank) AS n FROM timings WHERE {STEP_ROW}{run_clause(run)}").item()
    target = background if target_background is None else target_background
    ts = timeslice_of(timeslice_efficiency)
    if n_ranks + max(background, target) <= devices:  # nobody shares: every rate is 1
        return what_if_steps(con, run, ranks=ranks, phases=phases)
    rows = frame(con, f"""
        WITH t AS (
            SELECT run_id, coalesce(role, '') AS role, rank, step, phase, {SYNC} AS sync, {STEP_ROW} AS is_step,
                   start_us, start_us + dur_us AS end_us
            FROM timings WHERE (({TOP_LEVEL}) OR ({STEP_ROW})){run_clause(run)})
        SELECT * FROM t SEMI JOIN (SELECT run_id, role, rank, step FROM t WHERE is_step)
            USING (run_id, role, rank, step)
        ORDER BY run_id, role, rank, step, is_step, start_us, sync""")
    if rows.is_empty():
        return pl.DataFrame(schema=_STEP_SCHEMA)
    out = []
    for _, g in rows.group_by(["run_id", "role"], maintain_order=True):
        g = _work(g, devices, background, ts)
        key = ["run_id", "role", "rank", "step"]
        rows_g = g.filter(~pl.col("is_step")).with_columns(
            seg=pl.col("sync").cast(pl.Int64).cum_sum().over(key) - pl.col("sync").cast(pl.Int64))
        step = g.filter(pl.col("is_step")).select(*key, pl.col("work").alias("step_work"),
                                                  (pl.col("end_us") - pl.col("start_us")).alias("step_us"))
        # the remainder: the rank's busy work in its step not covered by rows, in its last segment
        cover = rows_g.group_by(key).agg(pl.col("work").filter(~pl.col("sync")).sum().alias("covered"),
                                         pl.col("work").filter(pl.col("sync")).sum().alias("sync_work"),
                                         pl.col("seg").max())
        rem = step.join(cover, on=key, how="left").select(
            *key, pl.col("seg").fill_null(0), pl.lit(REMAINDER).alias("phase"), pl.lit(False).alias("sync"),
            (pl.col("step_work") - pl.col("sync_work").fill_null(0) - pl.col("covered").fill_null(0)).alias("work"),
            pl.lit(0.0).alias("dur_us"))
        parts = pl.concat([rows_g.select(*key, "seg", "phase", "sync", "work",
                                         (pl.col("end_us") - pl.col("start_us")).cast(pl.Float64).alias("dur_us")),
                           rem.cast({"seg": pl.Int64})])
        parts = parts.group_by([*key, "seg", "phase", "sync"]).agg(pl.col("work").sum(), pl.col("dur_us").sum())
        parts = parts.with_columns(med=pl.col("work").median().over(["step", "seg", "phase", "sync"]))
        chosen = pl.lit(False) if ranks is None else (pl.lit(True) if ranks == "all" else pl.col("rank").is_in(list(ranks)))
        if phases is not None:
            chosen = chosen & pl.col("phase").is_in(list(phases))
        parts = parts.with_columns(new=pl.when(chosen & ~pl.col("sync")).then(pl.col("med")).otherwise(pl.col("work")))
        parts = _join_across_steps(parts, key)
        per = parts.group_by(["step", "seg", "rank"]).agg(
            pl.col("work").filter(~pl.col("sync")).sum().alias("busy"), pl.col("new").filter(~pl.col("sync")).sum(),
            pl.col("dur_us").filter(pl.col("sync")).sum().alias("wait"))
        for (s,), seg in per.group_by(["step"]):
            base = new = 0.0
            for _, one in seg.group_by("seg"):
                base += shared_time(one["busy"].to_numpy(), devices, target, ts) + one["wait"].min()
                new += shared_time(one["new"].to_numpy(), devices, target, ts) + one["wait"].min()
            st = step.filter(pl.col("step") == s)
            out.append({"run_id": g["run_id"][0], "role": g["role"][0], "step": s, "ranks": st.height,
                        "measured_ms": st["step_us"].max() / 1e3, "simulated_base_ms": base / 1e3,
                        "simulated_ms": new / 1e3, "saved_ms": (base - new) / 1e3})
    return pl.DataFrame(out, schema=_STEP_SCHEMA).sort(["run_id", "role", "step"])
