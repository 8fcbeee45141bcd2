"""GPU timeline breakdowns of imported profiler traces, with Holistic Trace Analysis' definitions.

Each rank's GPU activity is its ``timings`` rows on a ``cuda:*`` device with a stream (kernels, NCCL
kernels, memcpy/memset, CUDA syncs — what HTA counts). Kernels are classed by name exactly as HTA 0.5
does (``hta.utils.utils``): COMMUNICATION ``^nccl.*Kernel``; MEMORY ``^(Memcpy|Memset|dma)``;
COMPUTATION anything that neither matches ``^nccl.*Kernel`` nor contains ``Memcpy``/``Sync`` nor starts
with ``Memset``; OTHER the rest. Times are unions of intervals (overlapping kernels count once), in
exact nanoseconds, reported in µs.

Like HTA, when the run holds two or more ``ProfilerStep`` annotations, the last step of each rank is left
out (the profiler stops mid-step) along with GPU work whose launch is not in the trace: only rows
launched before the rank's last ProfilerStep began count. ``exclude_last_step=False`` keeps everything.

``rounding="hta"`` (the default, so numbers match HTA's) repeats HTA's handling of ns-resolution traces:
their float64 µs timestamps are rounded to whole µs, start up and end down, which shortens each kernel by
up to 2 µs (on HTA's ns_resolution_trace, 1.7% idle becomes 2.6%). ``rounding="exact"`` uses the exact
nanosecond times instead; on whole-µs traces the two agree.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, intervals_union_sql, run_clause
from dynascope.store import StoreConnection, StoreError

__all__ = ["comm_comp_overlap", "kernel_type_breakdown", "temporal_breakdown"]

# HTA's rules, in an order that lets each regex run only where a plain prefix/substring test passed (the
# regexes stay, for exactness: RE2's '.' stops at a newline). A leading '.*' regex on every kernel name
# would cost more than the rest of the breakdown.
_CLASS = """CASE
    WHEN starts_with(phase, 'nccl') AND regexp_matches(phase, '^nccl.*Kernel') THEN 'COMMUNICATION'
    WHEN starts_with(phase, 'Memcpy') OR starts_with(phase, 'Memset') OR starts_with(phase, 'dma') THEN 'MEMORY'
    WHEN (contains(phase, 'Memcpy') OR contains(phase, 'Sync')) AND regexp_matches(phase, '^.*(Memcpy|Sync)')
        THEN 'OTHER'
    ELSE 'COMPUTATION' END"""


def _f64_us(ns: str) -> str:
    """SQL for the float64 nearest to ``ns``/1000 µs, as a JSON parser reads the decimal (correctly rounded)."""
    return f"CAST(({ns}) // 1000 || '.' || lpad(CAST(({ns}) % 1000 AS VARCHAR), 3, '0') AS DOUBLE)"


def _kernels_sql(run: str | None, exclude_last_step: bool, rounding: str) -> str:
    """CTEs ending in ``k(run_id, rank, cls, s, e)``: the GPU intervals that count, in ns."""
    if rounding not in ("hta", "exact"):
        raise ValueError(f"rounding must be 'hta' or 'exact', not {rounding!r}")
    rc = run_clause(run)
    keep = "TRUE"
    if exclude_last_step:
        keep = ("NOT coalesce(multi.many, FALSE) OR last.last_step IS NULL "
                "OR (g.parent IS NOT NULL AND g.step <> last.last_step)")
    # HTA 0.5 holds a trace's µs timestamps as float64 and, when they are not all whole µs (ns-resolution
    # Kineto), rounds each start up and each float64 end (start + dur) down to whole µs. "hta" redoes
    # exactly that, on the file's own time base (recorded by the importer), for ranks with fractional starts.
    hta = "coalesce(fr.frac, FALSE)" if rounding == "hta" else "FALSE"
    return f"""
    fr AS (SELECT run_id, rank, bool_or(start_ns % 1000 <> 0) AS frac FROM timings
           WHERE start_ns IS NOT NULL {rc} GROUP BY run_id, rank),
    tb AS (SELECT e.run_id, CAST(b.key AS INTEGER) AS rank, max(CAST(b.value AS BIGINT)) AS base_ns
           FROM events e, json_each(e.fields_json, '$.time_base_ns') b
           WHERE e.event = 'trace_import' {run_clause(run, "e.run_id")} GROUP BY ALL),
    g0 AS (SELECT t.run_id, t.rank, phase, step, parent,
                  coalesce(start_ns, start_us * 1000) AS s, coalesce(dur_ns, dur_us * 1000) AS d,
                  coalesce(tb.base_ns, 0) AS base, {hta} AS hta
           FROM timings t
           LEFT JOIN fr ON fr.run_id = t.run_id AND fr.rank = t.rank
           LEFT JOIN tb ON tb.run_id = t.run_id AND tb.rank = t.rank
           WHERE device LIKE 'cuda%' AND stream IS NOT NULL AND category IN ('kernel', 'comm', 'memcpy', 'wait')
           {run_clause(run, "t.run_id")}),
    g AS (SELECT run_id, rank, phase, step, parent,
                 CASE WHEN hta THEN base + 1000 * CAST(ceil({_f64_us("s - base")}) AS BIGINT) ELSE s END AS s,
                 CASE WHEN hta THEN base + 1000 * CAST(floor({_f64_us("s - base")} + {_f64_us("d")}) AS BIGINT)
                      ELSE s + d END AS e
          FROM g0),
    ps AS (SELECT run_id, rank, phase, step, coalesce(start_ns, start_us * 1000) AS s FROM timings
           WHERE category = 'annotation' AND phase LIKE '%ProfilerStep%' {rc}),
    multi AS (SELECT run_id, count(DISTINCT phase) >= 2 AS many FROM ps GROUP BY run_id),
    last AS (SELECT run_id, rank, arg_max(step, s) AS last_step FROM ps
             WHERE regexp_matches(phase, 'ProfilerStep\\s*#\\s*\\d+') GROUP BY run_id, rank),
    k AS (SELECT g.run_id, g.rank, {_CLASS} AS cls, g.s, g.e FROM g
          LEFT JOIN multi ON multi.run_id = g.run_id
          LEFT JOIN last ON last.run_id = g.run_id AND last.rank = g.rank
          WHERE {keep})"""


@contextmanager
def _opened(store: StoreLike) -> Iterator[StoreConnection]:
    """The store as a connection, closed afterwards only if this call opened it."""
    con = as_store(store)
    try:
        yield con
    finally:
        if con is not store:
            con.close()


def _require_rows(df: pl.DataFrame, store: StoreLike) -> pl.DataFrame:
    if df.is_empty():
        raise StoreError(f"{getattr(store, 'path', store)}: no GPU activity rows (kernel/memcpy/memset with a "
                         "stream on a cuda device); import a profiler trace that recorded GPU activity")
    return df


def temporal_breakdown(store: StoreLike, run: str | None = None, *, exclude_last_step: bool = True,
                       rounding: str = "hta") -> pl.DataFrame:
    """Per rank: idle, compute and non-compute GPU time over the span from the first kernel's start to the
    last kernel's end (``kernel_time_us``), in µs and as % of that span — HTA's ``get_temporal_breakdown``.

    idle = span − union of all GPU intervals; compute = union of COMPUTATION kernels; non-compute = the rest.
    Raises StoreError when the store has no GPU activity rows.
    """
    with _opened(store) as con:
        return _require_rows(frame(con, temporal_breakdown_sql(run, exclude_last_step, rounding)), store)


def temporal_breakdown_sql(run: str | None, exclude_last_step: bool = True, rounding: str = "hta") -> str:
    """``temporal_breakdown``'s query (the report's GPU-idle finding shows it as its backing SQL)."""
    # Union lengths without building the islands: sorted by start, an interval adds what reaches past the
    # furthest end before it. Compute kernels keep that order among themselves, so one window over all
    # kernels gives both unions (the compute one from a running max over compute kernels only).
    w = "PARTITION BY run_id, rank ORDER BY s, e ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING"
    return f"""
    WITH {_kernels_sql(run, exclude_last_step, rounding)},
    prior AS (SELECT run_id, rank, s, e, cls = 'COMPUTATION' AS compute,
                     max(e) OVER ({w}) AS pm, max(e) FILTER (WHERE cls = 'COMPUTATION') OVER ({w}) AS pm_compute
              FROM k),
    per AS (SELECT run_id, rank, max(e) - min(s) AS span_ns,
                   sum(greatest(e - greatest(s, coalesce(pm, s)), 0)) AS busy_ns,
                   coalesce(sum(greatest(e - greatest(s, coalesce(pm_compute, s)), 0)) FILTER (WHERE compute), 0)
                       AS compute_ns
            FROM prior GROUP BY run_id, rank)
    SELECT run_id, rank,
           (span_ns - busy_ns) / 1e3 AS idle_time_us,
           compute_ns / 1e3 AS compute_time_us,
           (busy_ns - compute_ns) / 1e3 AS non_compute_time_us,
           span_ns / 1e3 AS kernel_time_us,
           100.0 * (span_ns - busy_ns) / nullif(span_ns, 0) AS idle_time_pct,
           100.0 * compute_ns / nullif(span_ns, 0) AS compute_time_pct,
           100.0 * (busy_ns - compute_ns) / nullif(span_ns, 0) AS non_compute_time_pct
    FROM per ORDER BY run_id, rank"""


def _state_durations(con: StoreConnection, run: str | None, classes: list[str], exclude_last_step: bool,
                     rounding: str) -> pl.DataFrame:
    """Per rank and overlap state (bit i = classes[i] running): ns spent in that state, by a sweep over
    the per-class unions — what HTA's kernel-type and overlap analyses compute with pandas."""
    bits = " ".join(f"WHEN '{c}' THEN {1 << i}" for i, c in enumerate(classes))
    inlist = ", ".join(f"'{c}'" for c in classes)
    sql = f"""
    WITH {_kernels_sql(run, exclude_last_step, rounding)},
    merged AS ({intervals_union_sql(f"SELECT run_id, rank, cls AS grp, s, e FROM k WHERE cls IN ({inlist})",
                                    "run_id, rank, grp")}),
    edges AS (SELECT run_id, rank, s AS t, CASE grp {bits} END AS d FROM merged
              UNION ALL SELECT run_id, rank, e, -(CASE grp {bits} END) FROM merged),
    sweep AS (SELECT run_id, rank, t,
                     CAST(sum(d) OVER (PARTITION BY run_id, rank ORDER BY t, d ROWS UNBOUNDED PRECEDING) AS BIGINT) AS state,
                     lead(t) OVER (PARTITION BY run_id, rank ORDER BY t, d) - t AS dt FROM edges)
    SELECT run_id, rank, state, CAST(sum(dt) AS BIGINT) AS ns FROM sweep
    WHERE state > 0 AND dt > 0 GROUP BY run_id, rank, state ORDER BY run_id, rank, state"""
    return frame(con, sql)


def kernel_type_breakdown(store: StoreLike, run: str | None = None, *, include_memory: bool = True,
                          exclude_last_step: bool = True,
                          rounding: str = "hta") -> pl.DataFrame:
    """Per rank: GPU time by kernel type, overlaps split out ("COMPUTATION overlapping COMMUNICATION"),
    in µs and as % of the rank's busy time — HTA's ``get_gpu_kernel_breakdown`` kernel-type table, per rank
    (HTA sums it over ranks). MEMORY kernels count unless ``include_memory=False`` (HTA's default too).
    """
    classes = ["COMPUTATION", "COMMUNICATION"] + (["MEMORY"] if include_memory else [])
    with _opened(store) as con:
        states = _require_rows(_state_durations(con, run, classes, exclude_last_step, rounding), store)
    label = {m: " overlapping ".join(c for i, c in enumerate(classes) if m & (1 << i))
             for m in range(1, 1 << len(classes))}
    return (
        states.with_columns(pl.col("state").replace_strict(label, return_dtype=pl.String).alias("kernel_type"))
        .group_by("run_id", "rank", "kernel_type").agg((pl.col("ns").sum() / 1e3).alias("time_us"))
        .with_columns((100 * pl.col("time_us") / pl.col("time_us").sum().over("run_id", "rank")).alias("pct"))
        .sort(["run_id", "rank", "time_us"], descending=[False, False, True])
    )


def comm_comp_overlap(store: StoreLike, run: str | None = None, *, exclude_last_step: bool = True,
                      rounding: str = "hta") -> pl.DataFrame:
    """Per rank: how much of the communication (NCCL) kernel time overlaps computation kernels —
    HTA's ``get_comm_comp_overlap``. ``overlap_pct`` is NaN for a rank without communication kernels.
    """
    with _opened(store) as con:
        states = _state_durations(con, run, ["COMPUTATION", "COMMUNICATION"], exclude_last_step, rounding)
    _require_rows(states, store)
    return (
        states.group_by("run_id", "rank").agg(
            (pl.col("ns").filter(pl.col("state") >= 2).sum() / 1e3).alias("comm_time_us"),
            (pl.col("ns").filter(pl.col("state") == 3).sum() / 1e3).alias("overlap_time_us"),
        )
        .with_columns((100 * pl.col("overlap_time_us") / pl.col("comm_time_us")).alias("overlap_pct"))
        .sort("run_id", "rank")
    )
