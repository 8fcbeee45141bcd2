"""What if this RL run overlapped rollout with training: its measured steps replayed under other schedules.

``schedule_inputs`` (``what_if_schedule_inputs``) cuts each synchronous RL step into the pieces on its
critical path (pre, weight sync, rollout, train); ``schedule_what_if`` replays them through a
discrete-event simulation (``_schedule_replay``) of

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
devices between the processes placed on them (losing ``timeslice_efficiency`` of an oversubscribed
pool; ``_what_if_load.measured_devices`` checks these inputs). docs/schedules.md has the model and what
it leaves out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.analyses._schedule_replay import Pieces, Pool, Result, replay, sequential
from dynascope.analyses._what_if_load import Devices, measured_devices
from dynascope.analyses.steps import step_rows_sql
from dynascope.analyses.what_if_schedule_inputs import ROLLOUT_PHASES, SYNC_PHASES, schedule_inputs

__all__ = ["rl_throughput", "schedule_staleness", "schedule_what_if"]

LIMITS = ("memory limits, KV-cache effects, network contention, weight-transfer costs beyond the measured "
          "copy (unless given as publish_ms/load_ms), framework overhead, the cost of time slicing (unless "
          "given as timeslice_efficiency) and sub-linear scaling on other device counts are not modelled")
MAX_STEPS = 1000  # RL steps a schedule replays (evenly spaced ones stand for a longer run; docs/schedules.md)


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


def _simulate(inp: pl.DataFrame, dev: Devices, *, workers: int, staleness: int, publish_ms: float,
              load_ms: float | None, staleness_policy: str, rollout_devices: float | None,
              train_devices: float | None, max_steps: int | None) -> tuple[list[dict], list[dict]]:
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
    dev = dev.for_ranks(ranks)
    d = dev.count
    assert d is not None
    if workers < 1 or staleness < 0:
        raise ValueError("workers must be ≥ 1 and staleness ≥ 0")
    if publish_ms < 0 or (load_ms is not None and load_ms < 0):
        raise ValueError("publish_ms and load_ms must be ≥ 0")
    transfer: dict = {"publish_us": publish_ms * 1e3, "load_us": None if load_ms is None else load_ms * 1e3}
    moved = (f" publish_ms={publish_ms:g}" if publish_ms else "") + (f" load_ms={load_ms:g}" if load_ms is not None else "")
    if staleness_policy not in ("block", "drop"):
        raise ValueError(f"staleness_policy must be 'block' or 'drop', not {staleness_policy!r}")
    rate = ranks * dev.share(ranks + dev.background)  # devices the measured rank group ran on
    background = dev.target_background  # during the schedules
    # A step's pieces in sequence, at the rank group's rate under the schedules' background load.
    slow = rate / (ranks * dev.share(ranks + background))
    off = Pieces(base.pre, base.sync, base.rollout + col["extra_ms"], base.train, n_s)
    where = (f"devices={d:g}" + (f" background={background:g}" if background else "")
             + (f" timeslice_efficiency={dev.timeslice:g}" if dev.timeslice != 1 else "")
             + (f" {dev.note}" if dev.note else ""))
    transfer["timeslice"] = dev.timeslice
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


def _all(store: StoreLike, run: str | None, inputs: dict, dev: Devices, **kw) -> tuple[list[dict], list[dict]]:
    """Every schedule of every (run, role): result rows and staleness-histogram rows."""
    inp = schedule_inputs(store, run, **inputs)
    rows, hist = [], []
    for (run_id, role), part in inp.group_by(["run_id", "role"], maintain_order=True):
        r, h = _simulate(part, dev, **kw)
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
    inputs = {"tail_pct": tail_pct, "rollout_phases": rollout_phases, "sync_phases": sync_phases,
              "behaviour_logprob_phase": behaviour_logprob_phase}
    dev = measured_devices(devices, background, target_background, timeslice_efficiency)
    rows, _ = _all(store, run, inputs, dev, workers=workers, staleness=staleness, publish_ms=publish_ms,
                   load_ms=load_ms, staleness_policy=staleness_policy, rollout_devices=rollout_devices,
                   train_devices=train_devices, max_steps=max_steps)
    if not rows:
        return pl.DataFrame(schema=_SCHEMA)
    return pl.DataFrame([{k: r.get(k) for k in _SCHEMA} for r in rows], schema=_SCHEMA)


def schedule_staleness(store: StoreLike, run: str | None = None, **params) -> pl.DataFrame:
    """Staleness distribution per schedule: run_id, role, schedule, staleness, samples_count, share_pct.

    Staleness = trainer version when a sample is trained on − version of the weights that generated it.
    Takes the parameters of ``schedule_what_if``.
    """
    defaults = {"workers": 2, "staleness": 1, "publish_ms": 0.0, "load_ms": None, "staleness_policy": "block",
                "rollout_devices": None, "train_devices": None, "max_steps": MAX_STEPS}
    device_args = ("devices", "background", "target_background", "timeslice_efficiency")
    input_args = ("tail_pct", "rollout_phases", "sync_phases", "behaviour_logprob_phase")
    unknown = set(params) - set(defaults) - set(device_args) - set(input_args)
    if unknown:
        raise TypeError(f"unknown parameters: {', '.join(sorted(unknown))}")
    dev = measured_devices(**{k: params[k] for k in device_args if k in params})
    inputs = {k: params[k] for k in input_args if k in params}
    _, hist = _all(store, run, inputs, dev, **{k: params.get(k, v) for k, v in defaults.items()})
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
