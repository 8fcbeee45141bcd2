"""``what_if`` and ``what_if_steps`` over ``RankSteps``: the model and results of their SQL in
``stragglers`` (which runs when ``rank_steps`` cannot: NULL keys), as reductions over sorted runs.
Every function here is called with at least one rank-step (the callers return the empty frame first)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import polars as pl

from dynascope.analyses._rank_segments import segment_phases
from dynascope.analyses._rank_steps import (
    Arrays,
    RankSteps,
    at_runs,
    runs_of,
    sort_order,
    step_ids,
)


def _in(rs: RankSteps, values: Iterable[str | int] | None, col: np.ndarray, phase: bool) -> np.ndarray:
    """``col IN values`` per row (all True for None: no restriction); phase names become their codes."""
    if values is None:
        return np.ones(len(col), dtype=bool)
    wanted = rs.codes(values) if phase else np.array([int(v) for v in values], dtype=np.int64)
    return np.isin(col, wanted)


def _per_rank(s: Arrays, rs: RankSteps, replace: np.ndarray) -> Arrays:
    """Busy and sync µs per (rank-step, segment), and ``new_busy`` with the rows where ``replace`` holds
    set to their median."""
    starts = runs_of(s["rs"], s["seg"])
    busy = ~s["sync"]
    at = at_runs(starts, len(busy))
    pr = {"rs": s["rs"][starts], "sid": s["sid"][starts], "seg": s["seg"][starts], "at": at}

    def per(w: np.ndarray) -> np.ndarray:  # sums per (rank-step, segment), in row order like reduceat
        return np.bincount(at, weights=w, minlength=len(starts))

    busy_us = np.where(busy, s["dur_us"], 0.0)
    pr["busy"] = per(busy_us)
    pr["new_busy"] = per(np.where(busy & replace, s["med_us"], busy_us))
    pr["sync"] = per(s["dur_us"] - busy_us)
    pr["rank"] = rs.steps["rank"][pr["rs"]]
    return pr


def _segments(pr: Arrays, n_steps: int) -> tuple[Arrays, np.ndarray, np.ndarray]:
    """Per (step, segment): the two largest busy times (``max2`` NaN for one rank, equal to ``max1`` on a
    tie), the largest replaced busy time and the least sync time; per step the simulated time as measured
    and replaced; and each rank-segment's (step, segment) index."""
    order = sort_order(pr["sid"], pr["seg"], pr["busy"])
    starts = runs_of(pr["sid"][order], pr["seg"][order])
    ends = np.append(starts[1:], len(order)) - 1
    busy = pr["busy"][order]
    sg = {"sid": pr["sid"][order][starts], "max1": busy[ends],
          "max2": np.where(ends > starts, busy[np.maximum(ends - 1, 0)], np.nan),
          "max_new": np.maximum.reduceat(pr["new_busy"][order], starts),
          "min_sync": np.minimum.reduceat(pr["sync"][order], starts)}
    of_pr = np.empty(len(order), dtype=np.int64)
    of_pr[order] = at_runs(starts, len(order))
    sim = np.bincount(sg["sid"], weights=sg["max1"] + sg["min_sync"], minlength=n_steps)
    new = np.bincount(sg["sid"], weights=sg["max_new"] + sg["min_sync"], minlength=n_steps)
    return sg, np.stack([sim, new]), of_pr


def _measured(rs: RankSteps) -> pl.DataFrame:
    """Per (grp, step): ranks and the longest step row, in step index order."""
    _, starts = step_ids(rs)
    st = rs.steps
    return pl.DataFrame({"grp": st["grp"][starts], "step": st["step"][starts],
                         "ranks": np.diff(np.append(starts, len(st["grp"]))),
                         "step_us": np.maximum.reduceat(st["step_us"], starts)},
                        schema={"grp": pl.Int64, "step": pl.Int64, "ranks": pl.Int64, "step_us": pl.Float64})


def what_if_steps_frame(rs: RankSteps, ranks: Iterable[int] | str | None, phases: Iterable[str] | None,
                        schema: dict) -> pl.DataFrame:
    """``stragglers.what_if_steps`` of ``rs``."""
    if not len(rs.steps["grp"]):
        return pl.DataFrame(schema=schema)
    s = segment_phases(rs)
    if ranks is None:
        replace = np.zeros(len(s["rs"]), dtype=bool)
    else:
        rank = rs.steps["rank"][s["rs"]]
        replace = (np.ones(len(rank), dtype=bool) if ranks == "all" else _in(rs, ranks, rank, False)) \
            & _in(rs, phases, s["phase"], True)
    m = _measured(rs)
    _, (sim, new), _ = _segments(_per_rank(s, rs, replace), m.height)
    df = m.with_columns(sim_us=sim, new_us=new).join(rs.groups, on="grp").select(
        "run_id", "role", "step", "ranks", (pl.col("step_us") / 1e3).alias("measured_ms"),
        (pl.col("sim_us") / 1e3).alias("simulated_base_ms"), (pl.col("new_us") / 1e3).alias("simulated_ms"),
        ((pl.col("sim_us") - pl.col("new_us")) / 1e3).alias("saved_ms"))
    return df.sort("run_id", "role", "step").cast(schema)


def _sum_by(keys: list[np.ndarray], weights: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Sums of ``weights`` per distinct combination of ``keys``: the combinations and their sums."""
    code = np.zeros(len(weights), dtype=np.int64)
    span = 1
    for k in keys:  # the keys' offsets from their minimum, combined (small codes: ranks, phases, groups)
        lo, width = (int(k.min()), int(k.max() - k.min()) + 1) if len(k) else (0, 1)
        code, span = code * width + (k - lo), span * width
    if span > 4 * len(code) + 1024:  # sparse: number the combinations present
        _, code = np.unique(code, return_inverse=True)
        span = int(code.max(initial=-1)) + 1
    sums = np.bincount(code.ravel(), weights=weights, minlength=span)
    present = np.bincount(code.ravel(), minlength=span) > 0
    first = np.zeros(span, dtype=np.int64)
    first[code[::-1]] = np.arange(len(code))[::-1]  # a row of each combination
    return [k[first[present]] for k in keys], sums[present]


def what_if_frame(rs: RankSteps, ranks: Iterable[int] | None, phases: Iterable[str] | None, by_phase: bool,
                  schema: dict) -> pl.DataFrame:
    """``stragglers.what_if`` of ``rs`` (its docstring has the one-pass pricing of one-rank scenarios)."""
    if not len(rs.steps["grp"]):
        return pl.DataFrame(schema=schema)
    s = segment_phases(rs)
    pr = _per_rank(s, rs, _in(rs, phases, s["phase"], True))
    m = _measured(rs)
    sg, (sim, new), of_pr = _segments(pr, m.height)
    tot = m.with_columns(sim_us=sim, saved=sim - new).group_by("grp").agg(
        pl.len().alias("steps"), pl.col("step_us").sum(), pl.col("sim_us").sum(), pl.col("saved").sum().alias("all_us"))
    # the slowest other rank: max2 for the rank holding max1 (equal to it on a tie), else max1
    max1 = sg["max1"][of_pr]
    other = np.nan_to_num(np.where(pr["busy"] == max1, sg["max2"][of_pr], max1), nan=0.0)
    grp = rs.steps["grp"][pr["rs"]]
    chosen = _in(rs, ranks, pr["rank"], False)
    (g, r), saved = _sum_by([grp[chosen], pr["rank"][chosen]], (max1 - np.maximum(other, pr["new_busy"]))[chosen])
    res = [pl.DataFrame({"grp": g, "rank": r, "saved_us": saved}, schema={"grp": pl.Int64, "rank": pl.Int64,
                                                                         "saved_us": pl.Float64})
           .select("grp", pl.format("rank {}", "rank").alias("scenario"), "rank", pl.lit(None, pl.String).alias("phase"),
                   "saved_us")]
    if by_phase:
        res.append(_by_phase(rs, s, pr, max1, other, grp, chosen, phases))
    res.append(tot.select("grp", pl.lit("all ranks").alias("scenario"), pl.lit(None, pl.Int64).alias("rank"),
                          pl.lit(None, pl.String).alias("phase"), pl.col("all_us").alias("saved_us")))
    sim_, saved_, step = pl.col("sim_us"), pl.col("saved_us"), pl.col("step_us")
    df = pl.concat(res).join(tot, on="grp").join(rs.groups, on="grp").select(
        "run_id", "role", "scenario", "rank", "phase", "steps", (step / 1e3).alias("measured_ms"),
        (sim_ / 1e3).alias("simulated_base_ms"), ((sim_ - saved_) / 1e3).alias("simulated_ms"),
        (saved_ / 1e3).alias("saved_ms"), (100 * saved_ / sim_).alias("saved_pct"),
        (100 * (sim_ - step).abs() / step).alias("reproduction_error_pct"))
    return df.sort("run_id", "role", "saved_ms", "scenario", descending=[False, False, True, False]).cast(schema)


def _by_phase(rs: RankSteps, s: Arrays, pr: Arrays, max1: np.ndarray, other: np.ndarray, grp: np.ndarray,
              chosen: np.ndarray, phases: Iterable[str] | None) -> pl.DataFrame:
    """One scenario per chosen (rank, phase): only that phase of that rank at its median."""
    busy = ~s["sync"]
    (at, ph), delta = _sum_by([pr["at"][busy], s["phase"][busy]], (s["med_us"] - s["dur_us"])[busy])
    saved_row = max1[at] - np.maximum(other[at], pr["busy"][at] + delta)
    (g, r, p), saved = _sum_by([grp[at], pr["rank"][at], ph], saved_row)
    bp = pl.DataFrame({"grp": g, "rank": r, "phase": p, "saved_us": saved},
                      schema={"grp": pl.Int64, "rank": pl.Int64, "phase": pl.Int64, "saved_us": pl.Float64})
    ks = pl.DataFrame({"grp": grp[chosen], "rank": pr["rank"][chosen]}, schema={"grp": pl.Int64, "rank": pl.Int64}).unique()
    wanted = busy & _in(rs, phases, s["phase"], True)
    names = pl.DataFrame({"phase": np.unique(s["phase"][wanted])}, schema={"phase": pl.Int64}).with_columns(
        phase_name=pl.col("phase").replace_strict(list(range(len(rs.phases))), rs.phases, return_dtype=pl.String))
    return (ks.join(names, how="cross").join(bp, on=["grp", "rank", "phase"], how="left")
            .select("grp", pl.format("rank {} {}", "rank", "phase_name").alias("scenario"), "rank",
                    pl.col("phase_name").alias("phase"), pl.col("saved_us").fill_null(0.0)))
