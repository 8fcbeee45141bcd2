"""Stragglers: which rank is slow in which phase, and what it costs.

``straggler_scores`` follows NVIDIA's straggler detection (nvidia-resiliency-ext): within a window of steps
a rank's *relative performance score* for a phase is the reference rank's median time divided by this
rank's median time (1.0 = as fast as the reference, 0.5 = twice as slow). A rank is flagged in a window when
its score is below ``threshold``; flagged in more than ``persistent_frac`` of the windows it is a
*persistent* straggler, in fewer a *transient* one.

``what_if`` follows ByteDance's what-if analysis (OSDI'25, "Understanding Stragglers in Large Model Training
Using What-if Analysis"): re-simulate each step with some ranks' phase durations replaced by the cross-rank
median and report the step time saved. The simulation model, per ``(run_id, role, step)``:

    Each rank's top-level rows (see ``steps``) are ordered by start time and cut into segments at its sync
    rows (category wait/comm): segment k holds the busy rows after the k-th sync and before the (k+1)-th,
    and ends with that sync row. The rank's un-instrumented remainder (step row − all top-level rows) is
    busy time in its last segment. Then

        step_time = Σ_k ( max_r busy[r, k] + min_r sync[r, k] )

    i.e. every segment lasts as long as its slowest rank's busy time, plus the collective's own cost, which
    is what the least-waiting rank (the one that arrived last) spent in it. A replaced rank's busy rows take
    the median over ranks of the same (step, segment, phase). With nothing replaced this reproduces the
    measured step time (the longest step row) whenever the slowest rank is also the one that waits least,
    which holds for synchronous steps; ``reproduction_error_pct`` reports how far off it is otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.analyses.steps import SYNC, TOP_LEVEL, step_rows_sql

__all__ = ["straggler_scores", "what_if", "what_if_steps"]

REMAINDER = "(uninstrumented)"
_G = ["run_id", "role", "step"]


def straggler_scores(store: StoreLike, run: str | None = None, *, window: int = 10, threshold: float = 0.75,
                     reference: str = "fastest", persistent_frac: float = 0.5,
                     min_median_ms: float = 5.0) -> pl.DataFrame:
    """Per rank and phase: relative performance score over windows of ``window`` steps.

    ``reference`` is ``"fastest"`` (NVIDIA's default: the fastest rank's median) or ``"median"`` (the
    cross-rank median). Columns: run_id, role, rank, phase, steps, windows, flagged_windows, score (median
    over windows), median_ms, cross_rank_median_ms, slowdown_x (1 / score: how many times slower than the
    reference), slow_steps_pct (steps whose per-step score is below threshold), excess_ms (time at stake:
    per window, the rank's median beyond the cross-rank median times the window's steps, summed over the
    run), status (persistent | transient | ok). Rows come most time at stake first.
    A phase whose median is under ``min_median_ms`` on every rank is left out: a 1 ms phase twice as slow
    on one rank scores like a real straggler but costs nothing worth chasing.
    Phases are all ``category='phase'`` rows at any nesting level, summed per step and named by their
    place: ``backward`` at the top level, ``train/forward`` for a forward inside train (a forward in
    rollout is different work). Only phases seen on at least two ranks in a step are compared.
    """
    if reference not in ("fastest", "median"):
        raise ValueError(f"reference must be 'fastest' or 'median', not {reference!r}")
    if window < 1 or not 0 < threshold <= 1:
        raise ValueError("window must be ≥ 1 and threshold in (0, 1]")
    if not min_median_ms >= 0:
        raise ValueError("min_median_ms must be ≥ 0")
    agg = "MIN" if reference == "fastest" else "median"
    thr = float(threshold)
    con = as_store(store)
    return frame(con, f"""
        WITH d AS (
            SELECT run_id, coalesce(role, '') AS role, rank, step,
                   CASE WHEN coalesce(parent, '') IN ('', 'step') THEN phase ELSE parent || '/' || phase END AS phase,
                   SUM(dur_us) AS dur_us
            FROM timings
            WHERE step IS NOT NULL AND phase IS NOT NULL AND phase <> 'step' AND stream IS NULL
              AND coalesce(category, 'phase') = 'phase'{run_clause(run)}
            GROUP BY ALL),
        g AS (
            SELECT *, (step - MIN(step) OVER (PARTITION BY run_id, role)) // {int(window)} AS win,
                   COUNT(*) OVER (PARTITION BY run_id, role, step, phase) AS nranks,
                   {agg}(dur_us) OVER (PARTITION BY run_id, role, step, phase) AS step_ref_us
            FROM d),
        wm AS (
            SELECT run_id, role, rank, phase, win, median(dur_us) AS rank_med_us, COUNT(*) AS n,
                   SUM(CASE WHEN step_ref_us / nullif(dur_us, 0) < {thr} THEN 1 ELSE 0 END) AS slow_steps
            FROM g WHERE nranks >= 2 GROUP BY ALL),
        ws AS (
            SELECT *, {agg}(rank_med_us) OVER w / nullif(rank_med_us, 0) AS score,
                   median(rank_med_us) OVER w AS cross_med_us
            FROM wm WINDOW w AS (PARTITION BY run_id, role, phase, win)),
        agg AS (
            SELECT run_id, role, rank, phase, SUM(n)::BIGINT AS steps, COUNT(*) AS windows,
                   SUM(CASE WHEN score < {thr} THEN 1 ELSE 0 END)::BIGINT AS flagged_windows,
                   median(score) AS score, median(rank_med_us) / 1000.0 AS median_ms,
                   median(cross_med_us) / 1000.0 AS cross_rank_median_ms,
                   100.0 * SUM(slow_steps) / SUM(n) AS slow_steps_pct,
                   SUM(greatest(rank_med_us - cross_med_us, 0) * n) / 1000.0 AS excess_ms
            FROM ws GROUP BY ALL)
        SELECT run_id, role, rank, phase, steps, windows, flagged_windows, score, median_ms,
               cross_rank_median_ms, 1.0 / nullif(score, 0) AS slowdown_x, slow_steps_pct, excess_ms,
               CASE WHEN flagged_windows > {float(persistent_frac)} * windows THEN 'persistent'
                    WHEN flagged_windows > 0 THEN 'transient' ELSE 'ok' END AS status
        FROM agg
        QUALIFY MAX(median_ms) OVER (PARTITION BY run_id, role, phase) >= {float(min_median_ms)}
        ORDER BY excess_ms DESC, score ASC NULLS LAST, run_id, role, rank, phase""")


def _segments(con, run: str | None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Top-level rows summed per (rank, step, segment, phase), and the step rows."""
    rows = frame(con, f"""
        WITH t AS (
            SELECT run_id, coalesce(role, '') AS role, rank, step, phase, {SYNC} AS sync, start_us, dur_us
            FROM timings WHERE {TOP_LEVEL}{run_clause(run)}),
        s AS (
            SELECT *, coalesce(SUM(CASE WHEN sync THEN 1 ELSE 0 END) OVER (
                       PARTITION BY run_id, role, rank, step ORDER BY start_us, sync
                       ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)::BIGINT AS seg
            FROM t)
        SELECT run_id, role, rank, step, seg, phase, sync, SUM(dur_us)::DOUBLE AS dur_us
        FROM s GROUP BY ALL""")
    steps = frame(con, step_rows_sql(run)).select(*_G, "rank", pl.col("step_us").cast(pl.Float64))
    if rows.is_empty() or steps.is_empty():
        return rows.clear(), steps.clear()
    # The remainder: step time not covered by top-level rows, busy time in the rank's last segment.
    per_rank = rows.group_by([*_G, "rank"]).agg(pl.col("dur_us").sum().alias("covered"), pl.col("seg").max())
    rem = steps.join(per_rank, on=[*_G, "rank"], how="left").select(
        *_G, "rank", pl.col("seg").fill_null(0).cast(rows.schema["seg"]), pl.lit(REMAINDER).alias("phase"),
        pl.lit(False).alias("sync"), (pl.col("step_us") - pl.col("covered").fill_null(0.0)).alias("dur_us"))
    rows = rows.join(steps.select(*_G, "rank"), on=[*_G, "rank"], how="semi")
    rows = pl.concat([rows, rem.select(rows.columns).cast(rows.schema)])
    med = (rows.filter(~pl.col("sync")).group_by([*_G, "seg", "phase"])
           .agg(pl.col("dur_us").median().alias("med_us")))
    return rows.join(med, on=[*_G, "seg", "phase"], how="left"), steps


def _per_rank(rows: pl.DataFrame, replace: pl.Expr) -> pl.DataFrame:
    """Busy and sync µs per (step, segment, rank) with the rows selected by ``replace`` set to their median."""
    dur = pl.when(replace & ~pl.col("sync")).then(pl.col("med_us")).otherwise(pl.col("dur_us"))
    return rows.with_columns(dur.alias("d")).group_by([*_G, "seg", "rank"]).agg(
        pl.col("d").filter(~pl.col("sync")).sum().alias("busy"),
        pl.col("d").filter(pl.col("sync")).sum().alias("sync"))


def _simulate(rows: pl.DataFrame, replace: pl.Expr) -> pl.DataFrame:
    """Simulated step time (µs) per step: Σ over segments of (slowest busy + least sync)."""
    seg = _per_rank(rows, replace).group_by([*_G, "seg"]).agg((pl.col("busy").max() + pl.col("sync").min()).alias("t"))
    return seg.group_by(_G).agg(pl.col("t").sum().alias("sim_us"))


def _saved_each_rank(rows: pl.DataFrame, phases: Iterable[str] | None) -> pl.DataFrame:
    """µs saved per (run, role, rank) when only that rank is replaced, for every rank in one pass.

    With only rank r replaced, a segment's slowest busy time is max(slowest other rank, r's replaced busy);
    the slowest other rank is the segment's top value, or its second value when r holds the top.
    """
    base = _per_rank(rows, pl.lit(False))
    repl = _per_rank(rows, _mask(None, phases)).select(*_G, "seg", "rank", pl.col("busy").alias("new_busy"))
    seg = base.group_by([*_G, "seg"]).agg(pl.col("busy").sort(descending=True).head(2).alias("top"))
    seg = seg.with_columns(max1=pl.col("top").list.get(0), max2=pl.col("top").list.get(1, null_on_oob=True))
    per = base.join(repl, on=[*_G, "seg", "rank"]).join(seg, on=[*_G, "seg"])
    other = pl.when(pl.col("busy") == pl.col("max1")).then(pl.col("max2")).otherwise(pl.col("max1"))
    new_max = pl.max_horizontal(other.fill_null(0.0), pl.col("new_busy"))
    per = per.with_columns(saved=pl.col("max1") - new_max)
    return per.group_by(["run_id", "role", "rank"]).agg(pl.col("saved").sum().alias("saved_us"))


def _mask(ranks: Iterable[int] | None, phases: Iterable[str] | None) -> pl.Expr:
    m = pl.lit(True) if ranks is None else pl.col("rank").is_in(list(ranks))
    return m if phases is None else m & pl.col("phase").is_in(list(phases))


_STEP_SCHEMA = {"run_id": pl.String, "role": pl.String, "step": pl.Int64, "ranks": pl.UInt32,
                "measured_ms": pl.Float64, "simulated_base_ms": pl.Float64, "simulated_ms": pl.Float64,
                "saved_ms": pl.Float64}


def what_if_steps(store: StoreLike, run: str | None = None, *, ranks: Iterable[int] | str | None = None,
                  phases: Iterable[str] | None = None) -> pl.DataFrame:
    """Per step: measured step time, the simulated time as measured, and simulated with replacement.

    ``ranks``: None replaces nothing, ``"all"`` every rank, or a list of ranks; ``phases``: None means every
    busy phase including the un-instrumented remainder. Columns: run_id, role, step, ranks, measured_ms,
    simulated_base_ms, simulated_ms, saved_ms.
    """
    rows, steps = _segments(as_store(store), run)
    if rows.is_empty():
        return pl.DataFrame(schema=_STEP_SCHEMA)
    base = _simulate(rows, pl.lit(False))
    if ranks is None:
        sim = base.rename({"sim_us": "new_us"})
    else:
        sim = _simulate(rows, _mask(None if ranks == "all" else ranks, phases)).rename({"sim_us": "new_us"})
    measured = steps.group_by(_G).agg(pl.len().alias("ranks"), pl.col("step_us").max())
    return (measured.join(base, on=_G).join(sim, on=_G).sort(_G).select(
        *_G, "ranks", (pl.col("step_us") / 1e3).alias("measured_ms"), (pl.col("sim_us") / 1e3).alias("simulated_base_ms"),
        (pl.col("new_us") / 1e3).alias("simulated_ms"), ((pl.col("sim_us") - pl.col("new_us")) / 1e3).alias("saved_ms"))
        .cast(_STEP_SCHEMA))


_WHAT_IF_SCHEMA = {"run_id": pl.String, "role": pl.String, "scenario": pl.String, "rank": pl.Int64,
                   "phase": pl.String, "steps": pl.UInt32, "measured_ms": pl.Float64,
                   "simulated_base_ms": pl.Float64, "simulated_ms": pl.Float64, "saved_ms": pl.Float64,
                   "saved_pct": pl.Float64, "reproduction_error_pct": pl.Float64}


def what_if(store: StoreLike, run: str | None = None, *, ranks: Iterable[int] | None = None,
            phases: Iterable[str] | None = None, by_phase: bool = False) -> pl.DataFrame:
    """Step time saved if a rank (each rank in turn, and all ranks at once) ran at the cross-rank median.

    One scenario per rank (``ranks`` limits which) plus ``"all ranks"``; with ``by_phase`` also one per
    (rank, phase). ``phases`` limits which phases are replaced (None: all busy phases and the remainder).
    Totals are over all steps: saved_pct = saved_ms / simulated_base_ms; reproduction_error_pct compares
    the unreplaced simulation with the measured step times (see the module docstring for the model).
    """
    rows, steps = _segments(as_store(store), run)
    if rows.is_empty():
        return pl.DataFrame(schema=_WHAT_IF_SCHEMA)
    measured = steps.group_by(_G).agg(pl.col("step_us").max()).join(_simulate(rows, pl.lit(False)), on=_G)
    tot = measured.group_by(["run_id", "role"]).agg(pl.len().alias("steps"), pl.col("step_us").sum(),
                                                    pl.col("sim_us").sum())
    chosen = sorted(set(rows["rank"].to_list()) if ranks is None else set(ranks))
    # One-rank scenarios: all ranks at once, vectorized (see _saved_each_rank); then "all ranks".
    parts = [_saved_each_rank(rows, phases).filter(pl.col("rank").is_in(chosen)).with_columns(
        scenario=pl.format("rank {}", pl.col("rank")), phase=pl.lit(None, pl.String))]
    if by_phase:
        phase_list = sorted(set(rows.filter(~pl.col("sync"))["phase"].to_list()))
        for p in phase_list if phases is None else [p for p in phase_list if p in set(phases)]:
            parts.append(_saved_each_rank(rows, [p]).filter(pl.col("rank").is_in(chosen)).with_columns(
                scenario=pl.format("rank {} {}", pl.col("rank"), pl.lit(p)), phase=pl.lit(p)))
    every = measured.join(_simulate(rows, _mask(None, phases)).rename({"sim_us": "new_us"}), on=_G)
    parts.append(every.group_by(["run_id", "role"]).agg((pl.col("sim_us") - pl.col("new_us")).sum().alias("saved_us"))
                 .with_columns(rank=pl.lit(None, pl.Int64), scenario=pl.lit("all ranks"), phase=pl.lit(None, pl.String)))
    cols = ["run_id", "role", "rank", "scenario", "phase", "saved_us"]
    res = pl.concat([p.select(cols).cast({"rank": pl.Int64}) for p in parts]).join(tot, on=["run_id", "role"])
    res = res.with_columns(
        measured_ms=pl.col("step_us") / 1e3, simulated_base_ms=pl.col("sim_us") / 1e3,
        simulated_ms=(pl.col("sim_us") - pl.col("saved_us")) / 1e3, saved_ms=pl.col("saved_us") / 1e3,
        saved_pct=100 * pl.col("saved_us") / pl.col("sim_us"),
        reproduction_error_pct=100 * (pl.col("sim_us") - pl.col("step_us")).abs() / pl.col("step_us"))
    return res.select(list(_WHAT_IF_SCHEMA)).cast(_WHAT_IF_SCHEMA).sort(
        ["run_id", "role", "saved_ms", "scenario"], descending=[False, False, True, False])
