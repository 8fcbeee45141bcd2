"""What-if for the RL schedule: replay a synchronous run's measured pieces under other schedules.

From a synchronous RL run (each step: weight sync → rollout → training on the same devices) the store holds
everything a schedule needs: per-rank phase spans and per-sample generation times. Per step, DuckDB reduces
them to four pieces on the step's critical path (``schedule_inputs``):

- ``pre``: trainer work before the step's rollout starts (an evaluation, say), the slowest rank's;
- ``sync``: weight sync into the rollout engine (``sync_phases``), the slowest rank's;
- ``rollout``: rollout-side work (``rollout_phases``: generation, reward), the slowest rank's;
- ``train``: the rest of the step as ``what_if`` replays it (Σ over segments of the slowest busy rank plus
  the collective's own cost, remainder included) — training, reference log-probs, all-reduce, optimizer.

``schedule_what_if`` replays them through a discrete-event simulation (``_schedule_sim``) of

- (a) ``sync``: as measured; the calibration row (``calibration_error_pct`` against the measured steps);
- (b) ``one_step_off_policy``: rollout of step t+1 runs while step t trains (one worker, staleness 1);
- (c) ``async``: ``workers`` rollout workers and a staleness bound (``staleness_policy`` block or drop);
- (d) ``tail_cut`` / ``partial_rollout``: rollout ends at the ``tail_pct``-th percentile of the step's
  generation times; the longer samples are truncated, or (partial) finish during the next step's rollout;
- (e) ``split``: (c) with rollout on ``rollout_devices`` and training on ``train_devices`` of their own.

(b), (c) and (e) run rollout in processes of its own, so weights cross a process boundary: ``publish_ms``
(the trainer's cost per version) and ``load_ms`` (a worker's, instead of the measured in-process copy)
say what the target's transport costs.

Devices: the measured run had ``ranks`` processes on ``devices`` devices (default: one device per rank;
on a CPU machine pass the cores the processes share) with ``background`` other runnable processes. A
piece measured at d µs is d × (the rank group's rate) device-µs of work, and every schedule shares its
devices between the processes placed on them (losing ``timeslice_efficiency`` of an oversubscribed pool). docs/schedules.md has the model and what it leaves out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.analyses._rank_steps import rank_steps
from dynascope.analyses._schedule_frames import inputs_frame, sample_stats
from dynascope.analyses._schedule_sim import (
    Pieces,
    Pool,
    Result,
    process_share,
    replay,
    sequential,
    timeslice_of,
)
from dynascope.analyses._timing_rows import Vocabulary, frame_with_vocabulary, keyed_sql, seg_sql
from dynascope.analyses.steps import step_rows_sql
from dynascope.analyses.stragglers import _in

__all__ = ["rl_throughput", "schedule_inputs", "schedule_staleness", "schedule_what_if"]

ROLLOUT_PHASES = ("rollout", "generate", "generation", "reward")
SYNC_PHASES = ("weight_sync", "sync_weights", "update_weights")
LIMITS = ("memory limits, KV-cache effects, network contention, weight-transfer costs beyond the measured "
          "copy (unless given as publish_ms/load_ms), framework overhead, the cost of time slicing (unless "
          "given as timeslice_efficiency) and sub-linear scaling on other device counts are not modelled")
_K = "run_id, role, rank, step"
MAX_STEPS = 1000  # RL steps a schedule replays (evenly spaced ones stand for a longer run; docs/schedules.md)


def _inputs_sql(run: str | None, rollout_phases: Sequence[str], sync_phases: Sequence[str],
                extra_phase: str | None, tail_q: float, v: Vocabulary) -> str:
    ro, ws = _in("phase", rollout_phases), _in("phase", sync_phases)
    extra = _in("phase", [extra_phase]) if extra_phase else "FALSE"
    top = "AND NOT is_step"  # the step row's phase is never a rollout, sync or extra phase
    keyed = keyed_sql(run, v, columns=f", {ro} AS ro, {ws} AS ws, {extra} AS extra", aggregates=f""",
                   MIN(start_us) FILTER (WHERE is_step) AS step_start_us,
                   MIN(start_us) FILTER (WHERE ro {top}) AS ro_start, SUM(dur_us) FILTER (WHERE ro {top}) AS ro_us,
                   coalesce(SUM(dur_us) FILTER (WHERE ws {top}), 0) AS ws_us,
                   coalesce(SUM(dur_us) FILTER (WHERE extra {top}), 0) AS extra_us""", having=f" AND bool_or(ro {top})")
    return f"""
        WITH {keyed},
        seg AS (  -- busy and sync µs per rank and segment, remainder in the last one (stragglers' model), and
                  -- the trainer work before the rollout
            SELECT t.run_id, t.role, t.rank, t.step, {seg_sql('t.start_us')} AS seg,
                   SUM(CASE WHEN t.sync THEN 0 ELSE t.dur_us END)::DOUBLE AS busy,
                   SUM(CASE WHEN t.sync THEN t.dur_us ELSE 0 END)::DOUBLE AS sync,
                   SUM(t.dur_us) FILTER (WHERE NOT (t.ro OR t.ws OR t.sync) AND t.start_us < ks.ro_start) AS pre_us
            FROM t JOIN ks USING ({_K}) WHERE NOT t.is_step GROUP BY ALL
            UNION ALL
            SELECT run_id, role, rank, step, {seg_sql('ks.last_us')}, step_us - coalesce(covered, 0), 0.0, NULL FROM ks),
        pre AS (SELECT {_K}, SUM(pre_us) AS pre_us FROM seg GROUP BY ALL),
        d AS (SELECT TRY_CAST(run_id AS {v.run_ids}) AS run_id, rank, step, gen_end_us - gen_start_us AS d
              FROM samples WHERE step IS NOT NULL{run_clause(run)}),
        q AS (SELECT run_id, rank, step, COUNT(*) AS n, MAX(d) AS gen_max, quantile_cont(d, {tail_q}) AS gen_cut
              FROM d GROUP BY ALL),
        smp AS (
            SELECT q.run_id, q.rank, q.step, ANY_VALUE(q.n) AS n, ANY_VALUE(q.gen_max) AS gen_max,
                   ANY_VALUE(q.gen_cut) AS gen_cut, COUNT(*) FILTER (WHERE d.d > q.gen_cut) AS n_tail
            FROM q JOIN d USING (run_id, rank, step) GROUP BY q.run_id, q.rank, q.step),
        rk AS (  -- per rank: the rollout with its tail cut, and (partial rollout) with the carry-over
            SELECT ks.run_id, ks.role, ks.rank, ks.step, ks.syncs, ks.step_us, ks.step_start_us, ks.ro_us, ks.ws_us,
                   ks.extra_us, coalesce(pre.pre_us, 0) AS pre_us, coalesce(smp.n, 0) AS n,
                   coalesce(smp.n_tail, 0) AS n_tail, coalesce(smp.gen_max - smp.gen_cut, 0) AS carry_us,
                   ks.ro_us - coalesce(smp.gen_max, 0) AS outside_us, smp.gen_cut
            FROM ks LEFT JOIN pre USING ({_K}) LEFT JOIN smp USING (run_id, rank, step)),
        -- A rank's work after its last sync row of step t and before its first of step t+1 is one stretch
        -- between two collectives: replay it as one segment (split at the step boundary, each half would
        -- wait for its own slowest rank). It counts in step t+1 (``carry``).
        rk2 AS MATERIALIZED (
            SELECT *, outside_us + gen_cut AS cut_us,
                   outside_us + greatest(gen_cut, coalesce(LAG(carry_us) OVER w, 0)) AS partial_us,
                   coalesce(LAG(n_tail) OVER w, 0) AS carried_in,
                   LEAD(step) OVER w = step + 1 AND LEAD(syncs) OVER w > 0 AS carry
            FROM rk WINDOW w AS (PARTITION BY run_id, role, rank ORDER BY step)),
        per AS (SELECT seg.run_id, seg.role, seg.rank,
                       CASE WHEN nxt.carry AND nxt.syncs > 0 AND seg.seg = nxt.syncs THEN seg.step + 1 ELSE seg.step END AS step,
                       CASE WHEN nxt.carry AND nxt.syncs > 0 AND seg.seg = nxt.syncs THEN 0 ELSE seg.seg END AS seg,
                       SUM(busy) AS busy, SUM(sync) AS sync
                FROM seg JOIN rk2 nxt USING ({_K}) GROUP BY ALL),
        sim AS (
            SELECT run_id, role, step, SUM(t) AS sim_us
            FROM (SELECT run_id, role, step, seg, MAX(busy) + MIN(sync) AS t FROM per GROUP BY ALL) GROUP BY ALL)
        SELECT run_id::VARCHAR AS run_id, role::VARCHAR AS role, step, COUNT(*) AS ranks, MAX(step_us) AS measured_us,
               ANY_VALUE(sim_us) AS sim_us, MIN(step_start_us) AS start_us, MAX(step_start_us + step_us) AS end_us,
               MAX(pre_us)::DOUBLE AS pre_us, MAX(ws_us)::DOUBLE AS sync_us, MAX(ro_us)::DOUBLE AS rollout_us,
               MAX(extra_us)::DOUBLE AS extra_us, MAX(coalesce(cut_us, ro_us))::DOUBLE AS rollout_cut_us,
               MAX(coalesce(partial_us, ro_us))::DOUBLE AS rollout_partial_us, SUM(n)::BIGINT AS samples,
               SUM(n_tail)::BIGINT AS tail_samples, SUM(carried_in)::BIGINT AS carried_in
        FROM rk2 JOIN sim USING (run_id, role, step)
        GROUP BY ALL ORDER BY run_id, role, step"""


def schedule_inputs(store: StoreLike, run: str | None = None, *, tail_pct: float = 90.0,
                    rollout_phases: Sequence[str] = ROLLOUT_PHASES, sync_phases: Sequence[str] = SYNC_PHASES,
                    behaviour_logprob_phase: str | None = None) -> pl.DataFrame:
    """Per synchronous RL step (a step whose ranks ran a rollout phase): the pieces every schedule replays.

    Columns: run_id, role, step, ranks, measured_ms (longest step row), replayed_ms (``what_if``'s
    replay of the step), pre_ms, sync_ms, rollout_ms, train_ms (replayed − the others, floored at 0),
    extra_ms (``behaviour_logprob_phase``, which an off-policy worker adds to each batch),
    rollout_cut_ms / rollout_partial_ms (the rollout ended at the ``tail_pct``-th percentile of the
    step's generation times, without and with last step's carried-over samples), samples_count,
    tail_samples_count (generations longer than the cut), carried_in_count (last step's, partial rollout),
    start_us / end_us (wall clock: the first rank's step start, the last rank's step end).
    Rollout-side pieces are the slowest rank's.
    """
    if not 0 < tail_pct <= 100:
        raise ValueError(f"tail_pct must be in (0, 100], not {tail_pct}")
    con = as_store(store)
    started: list = []  # the samples are read while NumPy sorts the timing rows
    rs = rank_steps(con, run, after_read=lambda: started.append(sample_stats(con, run, tail_pct / 100)))
    samples = started[0] if started else sample_stats(con, run, tail_pct / 100)
    df = None if rs is None else inputs_frame(rs, samples, rollout_phases, sync_phases, behaviour_logprob_phase)
    if df is None:  # the SQL below reads the samples itself; the thread's read is only waited for
        samples.result()
        df = frame_with_vocabulary(con, run, lambda v: _inputs_sql(
            run, rollout_phases, sync_phases, behaviour_logprob_phase, tail_pct / 100, v))
    ms = {c: pl.col(f"{c}_us") / 1e3 for c in ("pre", "sync", "rollout", "extra", "rollout_cut", "rollout_partial")}
    return df.select(
        "run_id", "role", "step", pl.col("ranks").cast(pl.Int64), (pl.col("measured_us") / 1e3).alias("measured_ms"),
        (pl.col("sim_us") / 1e3).alias("replayed_ms"), *(e.alias(f"{c}_ms") for c, e in ms.items()),
        ((pl.col("sim_us") - pl.col("pre_us") - pl.col("sync_us") - pl.col("rollout_us")).clip(lower_bound=0) / 1e3)
        .alias("train_ms"),
        pl.col("samples").alias("samples_count"), pl.col("tail_samples").alias("tail_samples_count"),
        pl.col("carried_in").alias("carried_in_count"), "start_us", "end_us")


_SCHEMA = {"run_id": pl.String, "role": pl.String, "schedule": pl.String, "params": pl.String,
           "steps": pl.Int64, "step_ms": pl.Float64, "samples_per_s": pl.Float64, "speedup_x": pl.Float64,
           "trainer_idle_pct": pl.Float64, "rollout_idle_pct": pl.Float64, "staleness_mean": pl.Float64,
           "staleness_max": pl.Int64, "stale_samples_pct": pl.Float64, "weight_sync_ms": pl.Float64,
           "weight_sync_exposed_pct": pl.Float64, "truncated_pct": pl.Float64, "carried_pct": pl.Float64,
           "dropped_batches_count": pl.Int64, "measured_step_ms": pl.Float64, "calibration_error_pct": pl.Float64}


def _row(name: str, params: str, r: Result, weights: np.ndarray, stale: np.ndarray) -> dict:
    """One output row from a replay; ``stale``/``weights``: staleness and samples of each trained batch."""
    span = max(r.makespan_us, 1e-9)
    return {"schedule": name, "params": params, "steps": r.trained, "step_ms": span / max(r.trained, 1) / 1e3,
            "samples_per_s": r.samples / span * 1e6,
            "trainer_idle_pct": 100 * (1 - r.trainer_busy_us / span),
            "rollout_idle_pct": 100 * (1 - r.rollout_busy_us / (r.workers * span)),
            "staleness_mean": float(np.average(stale, weights=weights)) if weights.sum() > 0 else 0.0,
            "staleness_max": int(stale.max()) if len(stale) else 0,
            "stale_samples_pct": 100 * float(weights[stale > 0].sum() / max(weights.sum(), 1)),
            "weight_sync_ms": (r.sync_us + r.publish_us) / max(r.trained, 1) / 1e3,
            "weight_sync_exposed_pct": 100 * r.sync_exposed_us / span, "dropped_batches_count": r.dropped}


def _simulate(inp: pl.DataFrame, *, devices: float | None, background: float, target_background: float | None,
              workers: int, staleness: int, publish_ms: float, load_ms: float | None,
              staleness_policy: str, rollout_devices: float | None, train_devices: float | None,
              max_steps: int | None, timeslice_efficiency: float) -> tuple[list[dict], list[dict]]:
    """Every schedule for one (run, role): result rows and staleness-histogram rows."""
    # The measured mean step: wall-clock time over the RL steps (ranks' step rows start at different times,
    # so the longest step row of each step overstates it under data parallelism).
    span = inp.select(pl.col("end_us").max() - pl.col("start_us").min()).item()
    measured = span / 1e3 / inp.height if inp.height > 1 else float(inp["measured_ms"].mean())
    if max_steps is not None and inp.height > max_steps:  # evenly spaced steps stand for a long run
        inp = inp[np.unique(np.linspace(0, inp.height - 1, max_steps).round().astype(int)).tolist()]
    col = {c: inp[c].to_numpy().astype(float) * 1e3 for c in
           ("pre_ms", "sync_ms", "rollout_ms", "train_ms", "extra_ms", "rollout_cut_ms", "rollout_partial_ms")}
    n_s = inp["samples_count"].to_numpy().astype(float)
    base = Pieces(col["pre_ms"], col["sync_ms"], col["rollout_ms"], col["train_ms"], n_s)
    ranks = int(inp["ranks"].max())
    d = float(devices if devices is not None else ranks)
    if d <= 0 or background < 0 or workers < 1 or staleness < 0:
        raise ValueError("devices must be > 0, background ≥ 0, workers ≥ 1 and staleness ≥ 0")
    if publish_ms < 0 or (load_ms is not None and load_ms < 0):
        raise ValueError("publish_ms and load_ms must be ≥ 0")
    transfer: dict = {"publish_us": publish_ms * 1e3, "load_us": None if load_ms is None else load_ms * 1e3}
    moved = (f" publish_ms={publish_ms:g}" if publish_ms else "") + (f" load_ms={load_ms:g}" if load_ms is not None else "")
    if staleness_policy not in ("block", "drop"):
        raise ValueError(f"staleness_policy must be 'block' or 'drop', not {staleness_policy!r}")
    ts = timeslice_of(timeslice_efficiency)
    rate = ranks * process_share(d, ranks + background, ts)  # devices the measured rank group ran on
    background = background if target_background is None else target_background  # during the schedules
    if background < 0:
        raise ValueError("target_background must be ≥ 0")
    # A step's pieces in sequence, at the rank group's rate under the schedules' background load.
    slow = rate / (ranks * process_share(d, ranks + background, ts))
    off = Pieces(base.pre, base.sync, base.rollout + col["extra_ms"], base.train, n_s)
    where = (f"devices={d:g}" + (f" background={background:g}" if background else "")
             + (f" timeslice_efficiency={ts:g}" if ts != 1 else ""))
    transfer["timeslice"] = ts
    rows, hist = [], []

    def add(name: str, params: str, r: Result, weights: np.ndarray, stale: np.ndarray, **extra: float) -> None:
        rows.append({**_row(name, params, r, weights, stale), **extra})
        for s in np.unique(stale):
            hist.append({"schedule": name, "staleness": int(s), "samples_count": int(weights[stale == s].sum())})

    zeros = np.zeros(len(base), dtype=int)
    calibration = 100 * abs(sequential(base).makespan_us / len(base) / 1e3 - measured) / measured
    add("sync", where, sequential(base.scaled(slow)), n_s, zeros, measured_step_ms=measured,
        calibration_error_pct=calibration)
    shared = [Pool(d, background)]
    for name, w, s, pol in (("one_step_off_policy", 1, 1, "block"), ("async", workers, staleness, staleness_policy)):
        r = replay(off, pools=shared, trainer_pool=0, trainer_procs=ranks, worker_pool=0, worker_procs=ranks,
                   workers=w, staleness=s, policy=pol, rate=rate, **transfer)
        add(name, f"workers={w} staleness={s} policy={pol} {where}{moved}", r, n_s[:r.trained], np.array(r.staleness))
    total = float(n_s.sum())
    cut = sequential(Pieces(base.pre, base.sync, col["rollout_cut_ms"], base.train, n_s).scaled(slow))
    tail = inp["tail_samples_count"].to_numpy().astype(float)
    add("tail_cut", "", cut, n_s, zeros, truncated_pct=100 * tail.sum() / max(total, 1))
    carried = inp["carried_in_count"].to_numpy().astype(float)
    done = n_s - tail + carried  # samples finished (and trained on) in each step
    part = sequential(Pieces(base.pre, base.sync, col["rollout_partial_ms"], base.train, done).scaled(slow))
    w_part = np.concatenate([n_s - tail, carried])
    add("partial_rollout", "", part, w_part, np.r_[np.zeros(len(base), int), np.ones(len(base), int)],
        carried_pct=100 * tail.sum() / max(total, 1))
    if rollout_devices is None and train_devices is None and d >= 2:
        ro_share = base.rollout.sum() / max((base.rollout + base.train + base.pre).sum(), 1e-9)
        rollout_devices = float(min(max(round(d * ro_share), 1), d - 1))
        train_devices = d - rollout_devices
    if rollout_devices and train_devices:
        g = rollout_devices + train_devices
        pools = [Pool(train_devices, background * train_devices / g), Pool(rollout_devices, background * rollout_devices / g)]
        r = replay(off, pools=pools, trainer_pool=0, trainer_procs=train_devices, worker_pool=1,
                   worker_procs=rollout_devices / workers, workers=workers, staleness=staleness,
                   policy=staleness_policy, rate=rate, **transfer)
        add("split", f"rollout_devices={rollout_devices:g} train_devices={train_devices:g} workers={workers} "
            f"staleness={staleness} policy={staleness_policy}{moved}", r, n_s[:r.trained], np.array(r.staleness))
    for tag, tail_params in (("tail_cut", "cut"), ("partial_rollout", "carry")):
        for row in rows:
            if row["schedule"] == tag:
                row["params"] = f"tail={tail_params} {where}"
    sync_rate = rows[0]["samples_per_s"]
    for row in rows:
        row["speedup_x"] = row["samples_per_s"] / sync_rate if sync_rate else None
    return rows, hist


def _all(store: StoreLike, run: str | None, tail_pct: float, rollout_phases: Sequence[str],
         sync_phases: Sequence[str], behaviour_logprob_phase: str | None, **kw) -> tuple[list[dict], list[dict]]:
    inp = schedule_inputs(store, run, tail_pct=tail_pct, rollout_phases=rollout_phases, sync_phases=sync_phases,
                          behaviour_logprob_phase=behaviour_logprob_phase)
    rows, hist = [], []
    for (run_id, role), part in inp.group_by(["run_id", "role"], maintain_order=True):
        r, h = _simulate(part, **kw)
        rows += [{"run_id": run_id, "role": role, **x} for x in r]
        hist += [{"run_id": run_id, "role": role, **x} for x in h]
    return rows, hist


def schedule_what_if(store: StoreLike, run: str | None = None, *, devices: float | None = None,
                     background: float = 0.0, target_background: float | None = None, workers: int = 2, staleness: int = 1,
                     staleness_policy: str = "block", tail_pct: float = 90.0, publish_ms: float = 0.0,
                     load_ms: float | None = None, rollout_devices: float | None = None, train_devices: float | None = None,
                     behaviour_logprob_phase: str | None = None, rollout_phases: Sequence[str] = ROLLOUT_PHASES,
                     sync_phases: Sequence[str] = SYNC_PHASES, max_steps: int | None = MAX_STEPS,
                     timeslice_efficiency: float = 1.0) -> pl.DataFrame:
    """Predicted step time, samples/s, idle shares, staleness and weight-sync exposure per schedule.

    One row per schedule (sync, one_step_off_policy, async, tail_cut, partial_rollout, split) and
    (run, role) of a synchronous RL run; see the module docstring for the schedules and their parameters.
    ``devices``: devices the measured ranks ran on (default: one per rank; on a CPU machine, the cores
    they share); ``background``: other runnable processes on them while the run was measured, and
    ``target_background`` while the schedules would run (default: the same). ``rollout_devices``/``train_devices``
    place ``split``; by default the devices are divided in proportion to rollout vs training time.
    ``publish_ms``/``load_ms``: the weight transfer of the schedules whose rollout runs in processes of its
    own (one_step_off_policy, async, split), each on a device of its own: what the trainer pays to publish
    a version (default 0) and a worker to load one (default: the measured weight sync, a copy within one
    process). Measure them for the transport the schedule would use (an object store, a NCCL broadcast).
    ``timeslice_efficiency``: the part of its capacity a pool keeps when one process more than it has
    devices shares it (time slicing's switches and refilled caches; default 1, ideal sharing): measure it
    for the machine, as ``benchmarks/whatif_validation.py`` does for the demo's processes on its cores.
    Runs longer than ``max_steps`` RL steps are replayed on that many evenly spaced steps.
    Columns: run_id, role, schedule, params, steps, step_ms, samples_per_s, speedup_x (samples/s over the
    sync replay's), trainer_idle_pct, rollout_idle_pct, staleness_mean, staleness_max, stale_samples_pct,
    weight_sync_ms (loads plus publishing, per trained batch), weight_sync_exposed_pct (share of time the
    trainer waits on a weight load or publishes),
    truncated_pct, carried_pct, dropped_batches_count, measured_step_ms and calibration_error_pct (sync row).
    """
    rows, _ = _all(store, run, tail_pct, rollout_phases, sync_phases, behaviour_logprob_phase, devices=devices,
                   background=background, target_background=target_background, workers=workers, staleness=staleness,
                   publish_ms=publish_ms, load_ms=load_ms, staleness_policy=staleness_policy,
                   rollout_devices=rollout_devices, train_devices=train_devices, max_steps=max_steps,
                   timeslice_efficiency=timeslice_efficiency)
    if not rows:
        return pl.DataFrame(schema=_SCHEMA)
    return pl.DataFrame([{k: r.get(k) for k in _SCHEMA} for r in rows], schema=_SCHEMA)


def schedule_staleness(store: StoreLike, run: str | None = None, **params) -> pl.DataFrame:
    """Staleness distribution per schedule: run_id, role, schedule, staleness, samples_count, share_pct.

    Staleness = trainer version when a sample is trained on − version of the weights that generated it.
    Takes the parameters of ``schedule_what_if``.
    """
    defaults = {"devices": None, "background": 0.0, "target_background": None, "workers": 2, "staleness": 1,
                "publish_ms": 0.0, "load_ms": None, "staleness_policy": "block",
                "rollout_devices": None, "train_devices": None, "max_steps": MAX_STEPS, "timeslice_efficiency": 1.0}
    unknown = set(params) - set(defaults) - {"tail_pct", "rollout_phases", "sync_phases", "behaviour_logprob_phase"}
    if unknown:
        raise TypeError(f"unknown parameters: {', '.join(sorted(unknown))}")
    sim = {k: params.get(k, v) for k, v in defaults.items()}
    _, hist = _all(store, run, params.get("tail_pct", 90.0), params.get("rollout_phases", ROLLOUT_PHASES),
                   params.get("sync_phases", SYNC_PHASES), params.get("behaviour_logprob_phase"), **sim)
    schema = {"run_id": pl.String, "role": pl.String, "schedule": pl.String, "staleness": pl.Int64,
              "samples_count": pl.Int64}
    df = pl.DataFrame(hist, schema=schema)
    return df.with_columns(share_pct=100 * pl.col("samples_count") / pl.col("samples_count").sum()
                           .over(["run_id", "role", "schedule"]))


def rl_throughput(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Measured RL throughput of any run, synchronous or not, to hold a schedule's prediction against.

    The RL steps are the steps of the role that recorded ``samples`` (the trainer consumes them); the span
    runs from the first such step row's start to the last one's end. Columns: run_id, role, steps,
    samples_count, span_ms, step_ms (span / steps), samples_per_s.
    """
    return frame(as_store(store), f"""
        WITH s AS (SELECT run_id, coalesce(role, '') AS role, step, COUNT(*) AS n FROM samples
                   WHERE step IS NOT NULL{run_clause(run)} GROUP BY ALL),
        st AS (SELECT run_id, role, step, MIN(start_us) AS t0, MAX(start_us + step_us) AS t1
               FROM ({step_rows_sql(run)}) GROUP BY ALL)
        SELECT run_id, role, COUNT(*) AS steps, SUM(n)::BIGINT AS samples_count, (MAX(t1) - MIN(t0)) / 1e3 AS span_ms,
               (MAX(t1) - MIN(t0)) / 1e3 / COUNT(*) AS step_ms, SUM(n) / ((MAX(t1) - MIN(t0)) / 1e6) AS samples_per_s
        FROM s JOIN st USING (run_id, role, step) GROUP BY ALL ORDER BY run_id, role""")
