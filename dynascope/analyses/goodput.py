"""Goodput: how much wall time went to useful training rather than checkpoints, failures and restarts.

Event kinds read from ``events`` (write them with ``RunWriter.event(kind, message, step=, dur_us=, ...)``):

- ``checkpoint_save``: ``dur_us`` = time spent saving; ``time_us`` = when the save finished; ``step`` = the
  step saved.
- ``checkpoint_load``: ``dur_us`` = time spent loading; ``step`` = the step loaded.
- ``fault``: ``time_us`` = when the failure happened or was detected; ``message`` says what.
- ``restart``: ``time_us`` = when the restarted job came up; ``step`` (or the field ``resumed_step``) = the
  step training resumes from.

For each restart, the failure time is the latest ``fault`` since the previous restart, or, without one,
the last recorded activity (timing row end or scalar) before the restart. Lost work is the time from the
last ``checkpoint_save`` before the failure (or the run's first activity) to the failure; downtime is the
failure to the restart. Goodput = (wall − checkpoint save/load time − lost work − downtime) / wall, with
wall time from the run's first to last activity.

A sharded checkpoint is one save written by every rank: the events of one kind and step are one checkpoint,
whose time is the wall-clock span from the first rank's start to the last rank's end (summed over ranks,
1,024 ranks saving together for 25 s would count 7 hours). Events without a step are one checkpoint each.
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause

__all__ = ["EVENT_KINDS", "goodput_incidents", "goodput_summary"]

EVENT_KINDS = ("checkpoint_save", "checkpoint_load", "fault", "restart")


def checkpoints_sql(events: str) -> str:
    """One row per checkpoint (``run_id, event, span_us``) from ``events``, a relation of checkpoint events:
    the events of one run, kind and step are the ranks' parts of one checkpoint, its span the wall-clock time
    from the first part's start to the last part's end; an event without a step is a checkpoint of its own."""
    return f"""SELECT run_id, event, MAX(time_us) - MIN(time_us - coalesce(dur_us, 0)) AS span_us
        FROM (SELECT *, CASE WHEN step IS NULL THEN row_number() OVER () END AS alone FROM {events})
        GROUP BY run_id, event, step, alone"""


def _ctes(run: str | None) -> str:
    rc = run_clause(run)
    kinds = ", ".join(f"'{k}'" for k in EVENT_KINDS)
    return f"""
        ev AS (SELECT run_id, event, time_us, step, dur_us, fields_json FROM events
               WHERE event IN ({kinds}) AND time_us IS NOT NULL{rc}),
        act AS (SELECT run_id, start_us + coalesce(dur_us, 0) AS t, start_us AS t0, step FROM timings
                WHERE start_us IS NOT NULL{rc}
                UNION ALL SELECT run_id, time_us, time_us, step FROM scalars WHERE time_us IS NOT NULL{rc}),
        span AS (SELECT run_id, MIN(t0) AS first_us, MAX(t) AS last_us FROM (
                    SELECT run_id, t, t0 FROM act UNION ALL SELECT run_id, time_us, time_us - coalesce(dur_us, 0) FROM ev)
                 GROUP BY run_id),
        rs AS (SELECT run_id, time_us AS restart_us,
                      coalesce(step, TRY_CAST(json_extract_string(fields_json, '$.resumed_step') AS BIGINT)) AS resumed_step,
                      coalesce(LAG(time_us) OVER (PARTITION BY run_id ORDER BY time_us), -1) AS prev_us
               FROM ev WHERE event = 'restart'),
        f AS (SELECT rs.*,
                  (SELECT MAX(time_us) FROM ev WHERE ev.run_id = rs.run_id AND ev.event = 'fault'
                      AND ev.time_us <= rs.restart_us AND ev.time_us > rs.prev_us) AS fault_us,
                  (SELECT MAX(t) FROM act WHERE act.run_id = rs.run_id AND act.t <= rs.restart_us
                      AND act.t > rs.prev_us) AS last_act_us,
                  (SELECT MAX(step) FROM act WHERE act.run_id = rs.run_id AND act.t <= rs.restart_us
                      AND act.t > rs.prev_us) AS last_step
              FROM rs),
        g AS (SELECT *, coalesce(fault_us, last_act_us) AS failure_us,
                     CASE WHEN fault_us IS NOT NULL THEN 'fault' ELSE 'last_activity' END AS failure_source FROM f),
        inc AS (SELECT g.*,
                    (SELECT MAX(time_us) FROM ev WHERE ev.run_id = g.run_id AND ev.event = 'checkpoint_save'
                        AND ev.time_us <= g.failure_us) AS ckpt_us,
                    (SELECT arg_max(step, time_us) FROM ev WHERE ev.run_id = g.run_id AND ev.event = 'checkpoint_save'
                        AND ev.time_us <= g.failure_us) AS ckpt_step,
                    span.first_us
                FROM g JOIN span USING (run_id))"""


def goodput_incidents(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """One row per restart: failure time and source, last checkpoint, lost work and downtime.

    Columns: run_id, restart_us, resumed_step, failure_us, failure_source (fault | last_activity),
    last_checkpoint_us, last_checkpoint_step, last_step, lost_steps, lost_work_ms, downtime_ms.
    """
    return frame(as_store(store), f"""
        WITH {_ctes(run)}
        SELECT run_id, restart_us, resumed_step, failure_us, failure_source, ckpt_us AS last_checkpoint_us,
               ckpt_step AS last_checkpoint_step, last_step, last_step - resumed_step AS lost_steps,
               greatest(failure_us - coalesce(ckpt_us, first_us), 0) / 1000.0 AS lost_work_ms,
               greatest(restart_us - failure_us, 0) / 1000.0 AS downtime_ms
        FROM inc ORDER BY run_id, restart_us""")


def goodput_summary(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Per run: wall time, checkpoints saved/loaded and their wall-clock time, faults, restarts, lost work,
    downtime and goodput.

    Columns: run_id, wall_ms, checkpoint_saves, checkpoint_save_ms, checkpoint_loads, checkpoint_load_ms,
    faults, restarts, lost_work_ms, downtime_ms, productive_ms, goodput_pct. Runs without any activity are
    absent.
    """
    return frame(as_store(store), f"""
        WITH {_ctes(run)},
        lost AS (SELECT run_id, SUM(greatest(failure_us - coalesce(ckpt_us, first_us), 0)) AS lost_us,
                        SUM(greatest(restart_us - failure_us, 0)) AS down_us FROM inc GROUP BY run_id),
        ck AS ({checkpoints_sql("(SELECT * FROM ev WHERE event IN ('checkpoint_save', 'checkpoint_load'))")}),
        cnt AS (SELECT run_id,
                    COUNT(*) FILTER (event = 'checkpoint_save') AS checkpoint_saves,
                    coalesce(SUM(span_us) FILTER (event = 'checkpoint_save'), 0) AS save_us,
                    COUNT(*) FILTER (event = 'checkpoint_load') AS checkpoint_loads,
                    coalesce(SUM(span_us) FILTER (event = 'checkpoint_load'), 0) AS load_us,
                    COUNT(*) FILTER (event = 'fault') AS faults, COUNT(*) FILTER (event = 'restart') AS restarts
                FROM (SELECT run_id, event, span_us FROM ck
                      UNION ALL SELECT run_id, event, NULL FROM ev WHERE event IN ('fault', 'restart'))
                GROUP BY run_id),
        t AS (SELECT span.run_id, (span.last_us - span.first_us)::DOUBLE AS wall_us,
                     coalesce(checkpoint_saves, 0) AS checkpoint_saves, coalesce(save_us, 0) AS save_us,
                     coalesce(checkpoint_loads, 0) AS checkpoint_loads, coalesce(load_us, 0) AS load_us,
                     coalesce(faults, 0) AS faults, coalesce(restarts, 0) AS restarts,
                     coalesce(lost_us, 0) AS lost_us, coalesce(down_us, 0) AS down_us
              FROM span LEFT JOIN cnt USING (run_id) LEFT JOIN lost USING (run_id))
        SELECT run_id, wall_us / 1000.0 AS wall_ms, checkpoint_saves, save_us / 1000.0 AS checkpoint_save_ms,
               checkpoint_loads, load_us / 1000.0 AS checkpoint_load_ms, faults, restarts,
               lost_us / 1000.0 AS lost_work_ms, down_us / 1000.0 AS downtime_ms,
               greatest(wall_us - save_us - load_us - lost_us - down_us, 0) / 1000.0 AS productive_ms,
               100.0 * greatest(wall_us - save_us - load_us - lost_us - down_us, 0) / nullif(wall_us, 0) AS goodput_pct
        FROM t ORDER BY run_id""")
