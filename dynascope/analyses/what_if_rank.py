"""What if a rank (or every rank) ran as fast as the others: the step time it would save.

ByteDance's what-if analysis (OSDI'25, "Understanding Stragglers in Large Model Training Using What-if
Analysis"): replay each step with some ranks' busy time replaced by the cross-rank median and report the
step time saved. The replay (``_what_if_replay``) cuts each rank-step at its collectives; a segment lasts
as long as its slowest rank's busy time plus the collective's own cost. A replaced rank's busy time in a
segment takes, phase by phase, the median over ranks of the same (step, segment, phase)
(``_what_if_medians``). ``reproduction_error_pct`` says how far the unreplaced replay is from the measured
step times (near 0 for synchronous steps).

Each rank has a device of its own here; ``what_if_rank_shared`` asks the same of ranks that share devices.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import polars as pl

from dynascope.analyses._common import StoreLike, as_store
from dynascope.analyses._sorted_runs import Arrays, sum_by
from dynascope.analyses._what_if_load import RankSteps, load_rank_steps, step_ids
from dynascope.analyses._what_if_medians import cells
from dynascope.analyses._what_if_replay import (
    among,
    least,
    measured,
    most,
    per_step,
    rank_segments,
    replaced_busy,
    runner_up,
    segments,
    slowest,
)

__all__ = ["what_if", "what_if_steps"]

STEP_SCHEMA = {"run_id": pl.String, "role": pl.String, "step": pl.Int64, "ranks": pl.UInt32,
               "measured_ms": pl.Float64, "simulated_base_ms": pl.Float64, "simulated_ms": pl.Float64,
               "saved_ms": pl.Float64}
WHAT_IF_SCHEMA = {"run_id": pl.String, "role": pl.String, "scenario": pl.String, "rank": pl.Int64,
                  "phase": pl.String, "steps": pl.UInt32, "measured_ms": pl.Float64,
                  "simulated_base_ms": pl.Float64, "simulated_ms": pl.Float64, "saved_ms": pl.Float64,
                  "saved_pct": pl.Float64, "reproduction_error_pct": pl.Float64}


def replaced(rs: RankSteps, values: np.ndarray, tail: np.ndarray, ranks: Iterable[int] | str | None,
             phases: Iterable[str] | None) -> tuple[Arrays, Arrays | None, np.ndarray]:
    """The rank-segments of ``values`` (µs or work per row; ``tail``: per rank-step), the cells with their
    medians (None when nothing is replaced) and the busy time with ``ranks``' ``phases`` at their medians
    (``ranks``: None, ``"all"`` or a list; ``phases``: None for all)."""
    segs = rank_segments(rs, values, tail)
    if ranks is None:
        return segs, None, segs["busy"]
    c = cells(rs, values, tail)
    chosen = among(rs.steps["rank"][c["rs"]], None if ranks == "all" else ranks)
    return segs, c, replaced_busy(segs, c, chosen & among(c["phase"], _codes(rs, phases)))


def _codes(rs: RankSteps, phases: Iterable[str] | None) -> np.ndarray | None:
    return None if phases is None else rs.codes(phases)


def _in_us(rs: RankSteps) -> tuple[np.ndarray, np.ndarray]:
    """Rows' and remainders' µs: what a device per rank replays."""
    return rs.rows["dur_us"], rs.steps["step_us"] - rs.steps["covered"]


def replay_steps(rs: RankSteps, ranks: Iterable[int] | str | None = None,
                 phases: Iterable[str] | None = None) -> pl.DataFrame:
    """``what_if_steps`` of the rows ``rs``."""
    if not len(rs):
        return pl.DataFrame(schema=STEP_SCHEMA)
    segs, _, new = replaced(rs, *_in_us(rs), ranks, phases)
    m = measured(rs)
    g = segments(step_ids(rs)[0][segs["rs"]], segs["seg"], segs["busy"])
    wait = least(g, segs["sync"])
    return steps_frame(rs, m, per_step(g, slowest(g, segs["busy"]) + wait, m.height),
                       per_step(g, most(g, new) + wait, m.height))


def steps_frame(rs: RankSteps, m: pl.DataFrame, sim_us: np.ndarray, new_us: np.ndarray) -> pl.DataFrame:
    """``what_if_steps``' frame from the measured steps ``m`` (``measured``) and, per step, the replay as
    measured and with replacement (µs)."""
    df = m.with_columns(sim_us=sim_us, new_us=new_us).join(rs.groups, on="grp").select(
        "run_id", "role", "step", "ranks", (pl.col("step_us") / 1e3).alias("measured_ms"),
        (pl.col("sim_us") / 1e3).alias("simulated_base_ms"), (pl.col("new_us") / 1e3).alias("simulated_ms"),
        ((pl.col("sim_us") - pl.col("new_us")) / 1e3).alias("saved_ms"))
    return df.sort("run_id", "role", "step").cast(STEP_SCHEMA)


def what_if_steps(store: StoreLike, run: str | None = None, *, ranks: Iterable[int] | str | None = None,
                  phases: Iterable[str] | None = None) -> pl.DataFrame:
    """Per step: measured step time, the simulated time as measured, and simulated with replacement.

    ``ranks``: None replaces nothing, ``"all"`` every rank, or a list of ranks; ``phases``: None means every
    busy phase including the un-instrumented remainder. Columns: run_id, role, step, ranks, measured_ms,
    simulated_base_ms, simulated_ms, saved_ms.
    """
    return replay_steps(load_rank_steps(as_store(store), run), ranks, phases)


def what_if(store: StoreLike, run: str | None = None, *, ranks: Iterable[int] | None = None,
            phases: Iterable[str] | None = None, by_phase: bool = False) -> pl.DataFrame:
    """Step time saved if a rank (each rank in turn, and all ranks at once) ran at the cross-rank median.

    One scenario per rank (``ranks`` limits which) plus ``"all ranks"``; with ``by_phase`` also one per
    (rank, phase). ``phases`` limits which phases are replaced (None: all busy phases and the remainder).
    Totals are over all steps: saved_pct = saved_ms / simulated_base_ms; reproduction_error_pct compares
    the unreplaced simulation with the measured step times.

    Every one-rank scenario is priced in one pass: with only rank r replaced, a segment's slowest busy time
    is max(slowest other rank, r's replaced busy), and the slowest other rank is the segment's top value,
    or its second one when r alone holds the top.
    """
    rs = load_rank_steps(as_store(store), run)
    if not len(rs):
        return pl.DataFrame(schema=WHAT_IF_SCHEMA)
    segs, c, new = replaced(rs, *_in_us(rs), "all", phases)
    assert c is not None
    m = measured(rs)
    g = segments(step_ids(rs)[0][segs["rs"]], segs["seg"], segs["busy"])
    top, wait = slowest(g, segs["busy"]), least(g, segs["sync"])
    sim, new_us = per_step(g, top + wait, m.height), per_step(g, most(g, new) + wait, m.height)
    tot = m.with_columns(sim_us=sim, saved=sim - new_us).group_by("grp").agg(
        pl.len().alias("steps"), pl.col("step_us").sum(), pl.col("sim_us").sum(), pl.col("saved").sum().alias("all_us"))
    # the slowest other rank: the runner-up for the rank holding the top (equal to it on a tie), else the top
    max1 = top[g.of]
    other = np.nan_to_num(np.where(segs["busy"] == max1, runner_up(g, segs["busy"])[g.of], max1), nan=0.0)
    grp, rank = rs.steps["grp"][segs["rs"]], segs["rank"]
    chosen = among(rank, ranks)
    own = max1 - np.maximum(other, new)
    (gr, r), saved = sum_by([grp[chosen], rank[chosen]], own[chosen])
    res = [pl.DataFrame({"grp": gr, "rank": r, "saved_us": saved},
                        schema={"grp": pl.Int64, "rank": pl.Int64, "saved_us": pl.Float64})
           .select("grp", pl.format("rank {}", "rank").alias("scenario"), "rank", pl.lit(None, pl.String).alias("phase"),
                   "saved_us")]
    if by_phase:
        res.append(_by_phase(rs, c, segs, max1, other, grp, chosen, phases))
    res.append(tot.select("grp", pl.lit("all ranks").alias("scenario"), pl.lit(None, pl.Int64).alias("rank"),
                          pl.lit(None, pl.String).alias("phase"), pl.col("all_us").alias("saved_us")))
    sim_, saved_, step = pl.col("sim_us"), pl.col("saved_us"), pl.col("step_us")
    df = pl.concat(res).join(tot, on="grp").join(rs.groups, on="grp").select(
        "run_id", "role", "scenario", "rank", "phase", "steps", (step / 1e3).alias("measured_ms"),
        (sim_ / 1e3).alias("simulated_base_ms"), ((sim_ - saved_) / 1e3).alias("simulated_ms"),
        (saved_ / 1e3).alias("saved_ms"), (100 * saved_ / sim_).alias("saved_pct"),
        (100 * (sim_ - step).abs() / step).alias("reproduction_error_pct"))
    return df.sort("run_id", "role", "saved_ms", "scenario", descending=[False, False, True, False]).cast(WHAT_IF_SCHEMA)


def _by_phase(rs: RankSteps, c: Arrays, segs: Arrays, max1: np.ndarray, other: np.ndarray, grp: np.ndarray,
              chosen: np.ndarray, phases: Iterable[str] | None) -> pl.DataFrame:
    """One scenario per chosen (rank, phase): only that phase of that rank at its median."""
    busy = ~c["sync"]
    (at, ph), delta = sum_by([c["at"][busy], c["phase"][busy]], (c["med"] - c["value"])[busy])
    saved_row = max1[at] - np.maximum(other[at], segs["busy"][at] + delta)
    (g, r, p), saved = sum_by([grp[at], segs["rank"][at], ph], saved_row)
    bp = pl.DataFrame({"grp": g, "rank": r, "phase": p, "saved_us": saved},
                      schema={"grp": pl.Int64, "rank": pl.Int64, "phase": pl.Int64, "saved_us": pl.Float64})
    ks = pl.DataFrame({"grp": grp[chosen], "rank": segs["rank"][chosen]},
                      schema={"grp": pl.Int64, "rank": pl.Int64}).unique()
    wanted = busy & among(c["phase"], _codes(rs, phases))
    names = pl.DataFrame({"phase": np.unique(c["phase"][wanted])}, schema={"phase": pl.Int64}).with_columns(
        phase_name=pl.col("phase").replace_strict(list(range(len(rs.phases))), rs.phases, return_dtype=pl.String))
    return (ks.join(names, how="cross").join(bp, on=["grp", "rank", "phase"], how="left")
            .select("grp", pl.format("rank {} {}", "rank", "phase_name").alias("scenario"), "rank",
                    pl.col("phase_name").alias("phase"), pl.col("saved_us").fill_null(0.0)))
