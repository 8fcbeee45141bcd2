"""``schedule_inputs`` over ``RankSteps``: the pieces of ``schedules._inputs_sql`` (which runs when
``rank_steps`` cannot: NULL keys), as reductions over sorted runs. The SQL's comments explain each piece;
NULLs of the SQL (no samples, no previous step) are NaN here until the last step."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import polars as pl
import pyarrow.compute as pc

from dynascope.analyses._common import run_clause
from dynascope.analyses._rank_steps import RankSteps, at_runs, runs_of, sort_order
from dynascope.store import StoreConnection

_F = pl.Float64


def _sample_stats(store: StoreConnection, run: str | None, tail_q: float) -> pl.DataFrame:
    """Per (run_id, rank, step) of the samples: n (rows), gen_max, gen_cut (the ``tail_q`` quantile, as
    DuckDB's quantile_cont interpolates it) and n_tail (generations longer than the cut)."""
    t = store.arrow(f"""SELECT run_id, rank, step, gen_end_us - gen_start_us AS d FROM samples
                        WHERE step IS NOT NULL AND run_id IS NOT NULL AND rank IS NOT NULL{run_clause(run)}""")
    enc = pc.dictionary_encode(t["run_id"]).combine_chunks()
    run_c = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    rank, step = (t[c].to_numpy().astype(np.int64) for c in ("rank", "step"))
    missing = t["d"].is_null().to_numpy(zero_copy_only=False)
    d = t["d"].fill_null(0).to_numpy().astype(np.int64)
    order = sort_order(run_c, rank, step, missing.astype(np.int64), d)  # a group's durations first, sorted
    run_c, rank, step, missing, d = run_c[order], rank[order], step[order], missing[order], d[order]
    starts = runs_of(run_c, rank, step)
    if not len(starts):
        return pl.DataFrame(schema={"run_id": pl.String, "rank": pl.Int64, "step": pl.Int64, "n": pl.Int64,
                                    "gen_max": _F, "gen_cut": _F, "n_tail": pl.Int64})
    n = np.diff(np.append(starts, len(d)))
    m = np.add.reduceat(~missing, starts)  # durations present
    v = d.astype(float)
    last = np.maximum(starts + m - 1, starts)
    rn = (m - 1) * tail_q
    lo, hi = v[starts + np.floor(np.maximum(rn, 0)).astype(np.int64)], v[starts + np.ceil(np.maximum(rn, 0)).astype(np.int64)]
    cut = np.where(m > 0, lo + (hi - lo) * (rn - np.floor(rn)), np.nan)
    tail = np.add.reduceat((v > cut[at_runs(starts, len(v))]) & ~missing, starts)
    return pl.DataFrame({"run_id": np.array(enc.dictionary.to_pylist(), dtype=object)[run_c[starts]].tolist(),
                         "rank": rank[starts], "step": step[starts], "n": n,
                         "gen_max": np.where(m > 0, v[last], np.nan), "gen_cut": cut, "n_tail": tail},
                        schema={"run_id": pl.String, "rank": pl.Int64, "step": pl.Int64, "n": pl.Int64,
                                "gen_max": _F, "gen_cut": _F, "n_tail": pl.Int64})


def sample_stats(store: StoreConnection, run: str | None, tail_q: float) -> Future[pl.DataFrame]:
    """``_sample_stats`` on a thread of its own: DuckDB reads the samples while the timing rows are sorted."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(_sample_stats, store, run, tail_q)
    finally:
        pool.shutdown(wait=False)


def inputs_frame(rs: RankSteps, samples: Future[pl.DataFrame], rollout_phases: Sequence[str],
                 sync_phases: Sequence[str], extra_phase: str | None) -> pl.DataFrame | None:
    """The frame ``schedules._inputs_sql`` returns, from ``rs`` and the samples (None for a run without an
    RL step: the SQL's empty frame has the column types)."""
    r, st = rs.rows, rs.steps
    n_rs = len(st["grp"])
    ro, ws = np.isin(r["phase"], rs.codes(rollout_phases)), np.isin(r["phase"], rs.codes(sync_phases))
    extra = np.isin(r["phase"], rs.codes([extra_phase] if extra_phase else []))

    def per_rs(mask: np.ndarray) -> np.ndarray:
        return np.bincount(r["rs"][mask], weights=r["dur_us"][mask], minlength=n_rs)

    ro_start = np.full(n_rs, np.iinfo(np.int64).max)
    ro_rs, first_ro = np.unique(r["rs"][ro], return_index=True)  # rows are sorted by start: the first is the min
    ro_start[ro_rs] = r["start_us"][np.flatnonzero(ro)[first_ro]]
    pre = per_rs(~(ro | ws | r["sync"]) & (r["start_us"] < ro_start[r["rs"]]))
    keep = np.zeros(n_rs, dtype=bool)
    keep[ro_rs] = True  # an RL rank-step: it ran a rollout phase
    if not keep.any():
        return None
    k = {c: st[c][keep] for c in ("grp", "step", "rank", "step_us", "step_start_us", "syncs")}
    k.update(pre_us=pre[keep], ro_us=per_rs(ro)[keep], ws_us=per_rs(ws)[keep], extra_us=per_rs(extra)[keep])
    ks = pl.DataFrame(k).with_columns(pl.Series("rs", np.flatnonzero(keep))).join(rs.groups, on="grp",
                                                                                   maintain_order="left")
    rk = ks.join(samples.result(), on=["run_id", "rank", "step"], how="left", maintain_order="left")
    rk = rk.with_columns(pl.col("n").fill_null(0), pl.col("n_tail").fill_null(0),
                         (pl.col("gen_max") - pl.col("gen_cut")).fill_nan(None).fill_null(0.0).alias("carry_us"),
                         (pl.col("ro_us") - pl.col("gen_max").fill_nan(None).fill_null(0.0)).alias("outside_us"),
                         pl.col("gen_cut").fill_nan(None))
    # rk is in (grp, step, rank) order; the window runs per (grp, rank) in step order
    w = sort_order(rk["grp"].to_numpy(), rk["rank"].to_numpy(), rk["step"].to_numpy())
    g, rank, step, syncs = (rk[c].to_numpy()[w] for c in ("grp", "rank", "step", "syncs"))
    same_prev = np.r_[False, (g[1:] == g[:-1]) & (rank[1:] == rank[:-1])]
    same_next = np.r_[same_prev[1:], False]
    prev = np.maximum(np.arange(len(w)) - 1, 0)
    nxt = np.minimum(np.arange(len(w)) + 1, max(len(w) - 1, 0))
    lag_carry, lag_tail, carry = (np.empty(len(w)), np.empty(len(w), dtype=np.int64), np.empty(len(w), dtype=bool))
    lag_carry[w] = np.where(same_prev, rk["carry_us"].to_numpy()[w][prev], 0.0)
    lag_tail[w] = np.where(same_prev, rk["n_tail"].to_numpy()[w][prev], 0)
    carry[w] = same_next & (step[nxt] == step + 1) & (syncs[nxt] > 0)
    cut = pl.col("outside_us") + pl.col("gen_cut")
    rk = rk.with_columns(cut_us=cut, partial_us=pl.col("outside_us") + pl.max_horizontal("gen_cut", pl.Series(lag_carry)),
                         carried_in=pl.Series(lag_tail), carry=pl.Series(carry))
    sim = _replayed(rs, rk["rs"].to_numpy(), carry)
    return rk.join(sim, on=["grp", "step"], maintain_order="left").group_by("grp", "step", maintain_order=True).agg(
        pl.col("run_id").first(), pl.col("role").first(), pl.len().cast(pl.Int64).alias("ranks"),
        pl.col("step_us").max().alias("measured_us"), pl.col("sim_us").first(),
        pl.col("step_start_us").min().alias("start_us"),
        (pl.col("step_start_us") + pl.col("step_us")).max().alias("end_us"),
        pl.col("pre_us").max(), pl.col("ws_us").max().alias("sync_us"), pl.col("ro_us").max().alias("rollout_us"),
        pl.col("extra_us").max(), pl.col("cut_us").fill_null(pl.col("ro_us")).max().alias("rollout_cut_us"),
        pl.col("partial_us").fill_null(pl.col("ro_us")).max().alias("rollout_partial_us"),
        pl.col("n").sum().alias("samples"), pl.col("n_tail").sum().alias("tail_samples"),
        pl.col("carried_in").sum()).sort("run_id", "role", "step").drop("grp")


def _replayed(rs: RankSteps, kept: np.ndarray, carry: np.ndarray) -> pl.DataFrame:
    """``what_if``'s replay of each RL step (grp, step, sim_us): per segment the slowest rank's busy time
    plus the least sync time, a rank's last segment counted in its next step when ``carry``."""
    r, st = rs.rows, rs.steps
    is_kept = np.zeros(len(st["grp"]), dtype=bool)
    is_kept[kept] = True
    carry_rs = np.zeros(len(st["grp"]), dtype=bool)
    carry_rs[kept] = carry
    rows = np.flatnonzero(is_kept[r["rs"]])
    dur, sync = r["dur_us"][rows].astype(float), r["sync"][rows]
    per_seg = runs_of(r["rs"][rows], r["seg"][rows])  # rows are sorted by (rank-step, start)
    # busy and sync µs per (rank-step, segment), then the remainder rows: busy, in each last segment
    rs_i = np.concatenate([r["rs"][rows][per_seg], kept])
    seg = np.concatenate([r["seg"][rows][per_seg], st["last_seg"][kept]])
    busy = np.concatenate([np.add.reduceat(np.where(sync, 0.0, dur), per_seg) if len(rows) else np.zeros(0),
                           st["step_us"][kept] - st["covered"][kept]])
    wait = np.concatenate([np.add.reduceat(np.where(sync, dur, 0.0), per_seg) if len(rows) else np.zeros(0),
                           np.zeros(len(kept))])
    moved = carry_rs[rs_i] & (st["syncs"][rs_i] > 0) & (seg == st["syncs"][rs_i])
    grp, rank = st["grp"][rs_i], st["rank"][rs_i]
    step = st["step"][rs_i] + moved
    seg = np.where(moved, 0, seg)
    order = sort_order(grp, step, seg, rank)
    grp, step, seg, rank, busy, wait = (a[order] for a in (grp, step, seg, rank, busy, wait))
    per = runs_of(grp, step, seg, rank)
    busy, wait = np.add.reduceat(busy, per), np.add.reduceat(wait, per)
    grp, step, seg = grp[per], step[per], seg[per]
    segs = runs_of(grp, step, seg)
    t = np.maximum.reduceat(busy, segs) + np.minimum.reduceat(wait, segs)
    steps = runs_of(grp[segs], step[segs])
    return pl.DataFrame({"grp": grp[segs][steps], "step": step[segs][steps], "sim_us": np.add.reduceat(t, steps)},
                        schema={"grp": pl.Int64, "step": pl.Int64, "sim_us": _F})
