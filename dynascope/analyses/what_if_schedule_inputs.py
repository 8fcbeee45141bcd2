"""What the schedule what-if replays: each synchronous RL step cut into the pieces on its critical path.

From a synchronous RL run (each step: weight sync → rollout → training on the same devices) the store holds
per-rank phase spans and per-sample generation times. Per step (a step whose ranks ran a rollout phase),
``schedule_inputs`` reduces them to four pieces, each the slowest rank's:

- ``pre``: trainer work before the step's rollout starts (an evaluation, say);
- ``sync``: weight sync into the rollout engine (``sync_phases``);
- ``rollout``: rollout-side work (``rollout_phases``: generation, reward);
- ``train``: the rest of the step as ``what_if`` replays it (``_what_if_replay``: Σ over segments of the
  slowest busy rank plus the collective's own cost, remainder included, a rank's stretch across the step
  boundary joined into the next step) — training, reference log-probs, all-reduce, optimizer.

and, for the tail schedules, per rank and step from ``gen_end_us − gen_start_us``: the ``tail_pct``-th
percentile of the generation times (as DuckDB's ``quantile_cont``), the longest one, and how many samples
ran past the percentile (a sample without an end counts in ``samples_count`` only).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import polars as pl
import pyarrow.compute as pc

from dynascope.analyses._common import StoreLike, as_store, run_clause
from dynascope.analyses._sorted_runs import as_numpy, at_runs, lookup, runs_of, sort_order
from dynascope.analyses._what_if_load import RankSteps, load_rank_steps
from dynascope.analyses._what_if_replay import (
    joins_next,
    least,
    merged,
    moved,
    neighbours,
    per_step,
    rank_segments,
    segments,
    slowest,
)
from dynascope.store import StoreConnection

__all__ = ["schedule_inputs"]

ROLLOUT_PHASES = ("rollout", "generate", "generation", "reward")
SYNC_PHASES = ("weight_sync", "sync_weights", "update_weights")

_F = pl.Float64
_SAMPLES = {"run_id": pl.String, "rank": pl.Int64, "step": pl.Int64, "n": pl.Int64, "gen_max": _F, "gen_cut": _F,
            "n_tail": pl.Int64}
_PIECES = {"run_id": pl.String, "role": pl.String, "step": pl.Int64, "ranks": pl.Int64, "measured_us": _F,
           "sim_us": _F, "start_us": pl.Int64, "end_us": _F, "pre_us": _F, "sync_us": _F, "rollout_us": _F,
           "extra_us": _F, "rollout_cut_us": _F, "rollout_partial_us": _F, "samples": pl.Int64,
           "tail_samples": pl.Int64, "carried_in": pl.Int64}


def _sample_stats(store: StoreConnection, run: str | None, tail_q: float) -> pl.DataFrame:
    """Per (run_id, rank, step) of the samples, in that order: n (rows), gen_max, gen_cut (the ``tail_q``
    quantile, as DuckDB's quantile_cont interpolates it) and n_tail (generations longer than the cut)."""
    one = run is not None  # one run asked for: its id is not read
    t = store.arrow(f"""SELECT {'' if one else 'run_id, '}rank, step, coalesce(gen_end_us - gen_start_us, 0) AS d,
                               gen_end_us - gen_start_us IS NULL AS missing FROM samples
                        WHERE step IS NOT NULL AND run_id IS NOT NULL AND rank IS NOT NULL{run_clause(run)}""")
    if one:
        names, run_c = [run], np.zeros(t.num_rows, dtype=np.int64)
    else:
        enc = pc.dictionary_encode(t["run_id"]).combine_chunks()
        names = enc.dictionary.to_pylist()
        # runs by name, so that the rows come out in (run_id, rank, step) order
        by_name = np.argsort(np.array(names, dtype=object)).astype(np.int64) if names else np.zeros(0, np.int64)
        rename = np.empty(len(names), dtype=np.int64)
        rename[by_name] = np.arange(len(names))
        run_c = rename[as_numpy(enc.indices).astype(np.int64)]
        names = [names[i] for i in by_name]
    rank, step = (as_numpy(t[c]).astype(np.int64) for c in ("rank", "step"))
    missing, d = as_numpy(t["missing"]), as_numpy(t["d"]).astype(np.int64)
    order = sort_order(run_c, rank, step, missing.astype(np.int64), d)  # a group's durations first, sorted
    run_c, rank, step, missing, d = run_c[order], rank[order], step[order], missing[order], d[order]
    starts = runs_of(run_c, rank, step)
    if not len(starts):
        return pl.DataFrame(schema=_SAMPLES)
    n = np.diff(np.append(starts, len(d)))
    m = np.add.reduceat(~missing, starts)  # durations present
    v = d.astype(float)
    last = np.maximum(starts + m - 1, starts)
    rn = (m - 1) * tail_q
    lo, hi = v[starts + np.floor(np.maximum(rn, 0)).astype(np.int64)], v[starts + np.ceil(np.maximum(rn, 0)).astype(np.int64)]
    cut = np.where(m > 0, lo + (hi - lo) * (rn - np.floor(rn)), np.nan)
    tail = np.add.reduceat((v > cut[at_runs(starts, len(v))]) & ~missing, starts)
    return pl.DataFrame({"run_id": np.array(names, dtype=object)[run_c[starts]].tolist(),
                         "rank": rank[starts], "step": step[starts], "n": n,
                         "gen_max": np.where(m > 0, v[last], np.nan), "gen_cut": cut, "n_tail": tail}, schema=_SAMPLES)


def _sample_stats_started(store: StoreConnection, run: str | None, tail_q: float) -> Future[pl.DataFrame]:
    """``_sample_stats`` on a thread of its own: DuckDB reads the samples while the timing rows are sorted."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(_sample_stats, store, run, tail_q)
    finally:
        pool.shutdown(wait=False)


def _pieces(rs: RankSteps, smp: pl.DataFrame, rollout_phases: Sequence[str], sync_phases: Sequence[str],
            extra_phase: str | None) -> pl.DataFrame:
    """Per RL step (its rank-steps ran a rollout phase): the pieces in µs, the slowest rank's."""
    r, st = rs.rows, rs.steps
    n_rs = len(rs)

    def named(names: Sequence[str]) -> np.ndarray:  # per row: is its phase one of ``names``
        lut = np.zeros(len(rs.phases), dtype=bool)
        lut[rs.codes(names)] = True
        return lut[r["phase"]]

    def per_rs(mask: np.ndarray) -> np.ndarray:
        return np.bincount(r["rs"][mask], weights=r["dur_us"][mask], minlength=n_rs)

    ro, ws, extra = named(rollout_phases), named(sync_phases), named([extra_phase] if extra_phase else [])
    ro_at = np.flatnonzero(ro)
    first_ro = runs_of(r["rs"][ro_at])  # rows are sorted by (rank-step, start): the first is the earliest
    kept = r["rs"][ro_at][first_ro]     # the RL rank-steps: they ran a rollout phase
    if not len(kept):
        return pl.DataFrame(schema=_PIECES)
    ro_start = np.full(n_rs, np.iinfo(np.int64).max)
    ro_start[kept] = r["start_us"][ro_at][first_ro]
    pre = per_rs(~(ro | ws | r["sync"]) & (r["start_us"] < ro_start[r["rs"]]))
    k = {c: st[c][kept] for c in ("grp", "step", "rank", "step_us", "step_start_us")}
    k.update(pre_us=pre[kept], ro_us=per_rs(ro)[kept], ws_us=per_rs(ws)[kept], extra_us=per_rs(extra)[kept])
    # the samples of each rank-step, by (run, rank, step)
    names = smp["run_id"].unique(maintain_order=True).to_list()
    code = {n: i for i, n in enumerate(names)}  # runs in name order (the samples are sorted by name)
    run_of_grp = np.array([code.get(x, -1) for x in rs.groups["run_id"].to_list()], dtype=np.int64)
    s_run = smp["run_id"].replace_strict(names, list(range(len(names))), return_dtype=pl.Int64).to_numpy() \
        if len(names) else np.zeros(0, dtype=np.int64)
    at = lookup([s_run, smp["rank"].to_numpy(), smp["step"].to_numpy()], [run_of_grp[k["grp"]], k["rank"], k["step"]])
    found = at >= 0

    def sample_col(c: str, default: float) -> np.ndarray:
        v = smp[c].to_numpy().astype(float)[np.maximum(at, 0)] if smp.height else np.zeros(len(at))
        return np.where(found, v, default)

    n_smp, n_tail = sample_col("n", 0).astype(np.int64), sample_col("n_tail", 0).astype(np.int64)
    gen_max, gen_cut = sample_col("gen_max", np.nan), sample_col("gen_cut", np.nan)
    carry_us = np.nan_to_num(gen_max - gen_cut, nan=0.0)  # partial rollout: what the longest sample carries on
    outside = k["ro_us"] - np.nan_to_num(gen_max, nan=0.0)
    prev, nxt = neighbours(rs, kept)  # the same rank's previous and next RL step
    lag_carry, lag_tail = np.where(prev >= 0, carry_us[prev], 0.0), np.where(prev >= 0, n_tail[prev], 0)
    cut_us = outside + gen_cut  # NaN without samples: the rollout as measured
    partial_us = outside + np.fmax(gen_cut, lag_carry)
    # per (grp, step): the slowest rank's pieces (kept rank-steps of a step are contiguous)
    starts = runs_of(k["grp"], k["step"])

    def top(a: np.ndarray) -> np.ndarray:
        return np.maximum.reduceat(a.astype(float), starts)

    out = pl.DataFrame({
        "grp": k["grp"][starts], "step": k["step"][starts], "ranks": np.diff(np.append(starts, len(kept))),
        "measured_us": top(k["step_us"]), "sim_us": _replayed(rs, kept, nxt, at_runs(starts, len(kept)), len(starts)),
        "start_us": np.minimum.reduceat(k["step_start_us"], starts),
        "end_us": top(k["step_start_us"] + k["step_us"]), "pre_us": top(k["pre_us"]), "sync_us": top(k["ws_us"]),
        "rollout_us": top(k["ro_us"]), "extra_us": top(k["extra_us"]),
        "rollout_cut_us": top(np.where(np.isnan(cut_us), k["ro_us"], cut_us)),
        "rollout_partial_us": top(np.where(np.isnan(partial_us), k["ro_us"], partial_us)),
        "samples": np.add.reduceat(n_smp, starts), "tail_samples": np.add.reduceat(n_tail, starts),
        "carried_in": np.add.reduceat(lag_tail, starts)})
    return (out.join(rs.groups, on="grp", maintain_order="left")
            .sort("run_id", "role", "step").drop("grp").select(list(_PIECES)).cast(_PIECES))


def _replayed(rs: RankSteps, kept: np.ndarray, nxt: np.ndarray, step_of: np.ndarray, n_steps: int) -> np.ndarray:
    """``what_if``'s replay of each RL step (``step_of``: each kept rank-step's step index), a rank's
    stretch across the step boundary joined into the next step (``nxt``: its next kept rank-step)."""
    segs = rank_segments(rs, rs.rows["dur_us"], rs.steps["step_us"] - rs.steps["covered"], kept)
    sid, joins = np.full(len(rs), -1, dtype=np.int64), np.zeros(len(rs), dtype=bool)
    sid[kept], joins[kept] = step_of, joins_next(rs, kept, nxt)
    sid, seg = moved(rs, segs, sid, joins)
    sid, seg, _, busy, wait = merged(sid, seg, segs["rank"], segs["busy"], segs["sync"])
    g = segments(sid, seg, busy)
    return per_step(g, slowest(g, busy) + least(g, wait), n_steps)


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
    started: list[Future[pl.DataFrame]] = []  # the samples are read while NumPy sorts the timing rows
    rs = load_rank_steps(con, run, after_read=lambda: started.append(_sample_stats_started(con, run, tail_pct / 100)))
    df = _pieces(rs, started[0].result(), rollout_phases, sync_phases, behaviour_logprob_phase)
    ms = {c: pl.col(f"{c}_us") / 1e3 for c in ("pre", "sync", "rollout", "extra", "rollout_cut", "rollout_partial")}
    return df.select(
        "run_id", "role", "step", "ranks", (pl.col("measured_us") / 1e3).alias("measured_ms"),
        (pl.col("sim_us") / 1e3).alias("replayed_ms"), *(e.alias(f"{c}_ms") for c, e in ms.items()),
        ((pl.col("sim_us") - pl.col("pre_us") - pl.col("sync_us") - pl.col("rollout_us")).clip(lower_bound=0) / 1e3)
        .alias("train_ms"),
        pl.col("samples").alias("samples_count"), pl.col("tail_samples").alias("tail_samples_count"),
        pl.col("carried_in").alias("carried_in_count"), "start_us", "end_us")
