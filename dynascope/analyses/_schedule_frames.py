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
from dynascope.analyses._rank_steps import RankSteps, as_numpy, at_runs, pack, runs_of, sort_order
from dynascope.store import StoreConnection

_F = pl.Float64


_EMPTY = {"run_id": pl.String, "rank": pl.Int64, "step": pl.Int64, "n": pl.Int64, "gen_max": _F, "gen_cut": _F,
          "n_tail": pl.Int64}


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
        return pl.DataFrame(schema=_EMPTY)
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
                         "gen_max": np.where(m > 0, v[last], np.nan), "gen_cut": cut, "n_tail": tail}, schema=_EMPTY)


def sample_stats(store: StoreConnection, run: str | None, tail_q: float) -> Future[pl.DataFrame]:
    """``_sample_stats`` on a thread of its own: DuckDB reads the samples while the timing rows are sorted."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(_sample_stats, store, run, tail_q)
    finally:
        pool.shutdown(wait=False)


def _lookup(table: Sequence[np.ndarray], query: Sequence[np.ndarray]) -> np.ndarray:
    """For each query row, the index of the equal row of ``table`` (its rows sorted and distinct), or -1."""
    n = len(table[0])
    p = pack(*(np.concatenate([a, b]) for a, b in zip(table, query, strict=True)))  # one packing for both
    if p is None:  # too wide to pack: polars joins them
        t = pl.DataFrame({str(i): a for i, a in enumerate(table)}).with_row_index("at")
        q = pl.DataFrame({str(i): a for i, a in enumerate(query)})
        return q.join(t, on=[str(i) for i in range(len(table))], how="left", maintain_order="left")[
            "at"].fill_null(-1).to_numpy().astype(np.int64)
    tk, qk = p[0][:n], p[0][n:]
    if not n:
        return np.full(len(qk), -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(tk, qk), n - 1)
    return np.where(tk[at] == qk, at, -1)


def inputs_frame(rs: RankSteps, samples: Future[pl.DataFrame], rollout_phases: Sequence[str],
                 sync_phases: Sequence[str], extra_phase: str | None) -> pl.DataFrame | None:
    """The frame ``schedules._inputs_sql`` returns, from ``rs`` and the samples (None for a run without an
    RL step: the SQL's empty frame has the column types)."""
    r, st = rs.rows, rs.steps
    n_rs = len(st["grp"])

    def named(names: Sequence[str]) -> np.ndarray:  # per row: is its phase one of ``names``
        lut = np.zeros(len(rs.phases), dtype=bool)
        lut[rs.codes(names)] = True
        return lut[r["phase"]]

    ro, ws = named(rollout_phases), named(sync_phases)
    extra = named([extra_phase] if extra_phase else [])

    def per_rs(mask: np.ndarray) -> np.ndarray:
        return np.bincount(r["rs"][mask], weights=r["dur_us"][mask], minlength=n_rs)

    ro_at = np.flatnonzero(ro)
    first_ro = runs_of(r["rs"][ro_at])  # rows are sorted by (rank-step, start): the first is the earliest
    kept = r["rs"][ro_at][first_ro]     # the RL rank-steps: they ran a rollout phase
    if not len(kept):
        return None
    ro_start = np.full(n_rs, np.iinfo(np.int64).max)
    ro_start[kept] = r["start_us"][ro_at][first_ro]
    pre = per_rs(~(ro | ws | r["sync"]) & (r["start_us"] < ro_start[r["rs"]]))
    k = {c: st[c][kept] for c in ("grp", "step", "rank", "step_us", "step_start_us", "syncs")}
    k.update(pre_us=pre[kept], ro_us=per_rs(ro)[kept], ws_us=per_rs(ws)[kept], extra_us=per_rs(extra)[kept])
    # the samples of each rank-step, by (run, rank, step)
    smp = samples.result()
    names = smp["run_id"].unique(maintain_order=True).to_list()
    code = {n: i for i, n in enumerate(names)}  # runs in name order (the samples are sorted by name)
    run_of_grp = np.array([code.get(x, -1) for x in rs.groups["run_id"].to_list()], dtype=np.int64)
    s_run = smp["run_id"].replace_strict(names, list(range(len(names))), return_dtype=pl.Int64).to_numpy() \
        if len(names) else np.zeros(0, dtype=np.int64)
    at = _lookup([s_run, smp["rank"].to_numpy(), smp["step"].to_numpy()],
                 [run_of_grp[k["grp"]], k["rank"], k["step"]])
    found = at >= 0

    def sample_col(c: str, default: float) -> np.ndarray:
        v = smp[c].to_numpy().astype(float)[np.maximum(at, 0)] if smp.height else np.zeros(len(at))
        return np.where(found, v, default)

    n_smp, n_tail = sample_col("n", 0).astype(np.int64), sample_col("n_tail", 0).astype(np.int64)
    gen_max, gen_cut = sample_col("gen_max", np.nan), sample_col("gen_cut", np.nan)
    carry_us = np.nan_to_num(gen_max - gen_cut, nan=0.0)
    outside = k["ro_us"] - np.nan_to_num(gen_max, nan=0.0)
    # the window runs per (grp, rank) in step order (kept rank-steps are in (grp, step, rank) order)
    w = sort_order(k["grp"], k["rank"], k["step"])
    g, rank, step, syncs = (k[c][w] for c in ("grp", "rank", "step", "syncs"))
    same_prev = np.r_[False, (g[1:] == g[:-1]) & (rank[1:] == rank[:-1])]
    same_next = np.r_[same_prev[1:], False]
    prev = np.maximum(np.arange(len(w)) - 1, 0)
    nxt = np.minimum(np.arange(len(w)) + 1, max(len(w) - 1, 0))
    lag_carry, lag_tail, carry = (np.empty(len(w)), np.empty(len(w), dtype=np.int64), np.empty(len(w), dtype=bool))
    lag_carry[w] = np.where(same_prev, carry_us[w][prev], 0.0)
    lag_tail[w] = np.where(same_prev, n_tail[w][prev], 0)
    carry[w] = same_next & (step[nxt] == step + 1) & (syncs[nxt] > 0)
    cut_us = outside + gen_cut  # NaN without samples: the rollout as measured
    partial_us = outside + np.fmax(gen_cut, lag_carry)
    # per (grp, step): the slowest rank's pieces (kept rank-steps of a step are contiguous)
    starts = runs_of(k["grp"], k["step"])

    def top(a: np.ndarray) -> np.ndarray:
        return np.maximum.reduceat(a.astype(float), starts)

    out = pl.DataFrame({
        "grp": k["grp"][starts], "step": k["step"][starts], "ranks": np.diff(np.append(starts, len(kept))),
        "measured_us": top(k["step_us"]), "sim_us": _replayed(rs, kept, carry, at_runs(starts, len(kept))),
        "start_us": np.minimum.reduceat(k["step_start_us"], starts),
        "end_us": top(k["step_start_us"] + k["step_us"]), "pre_us": top(k["pre_us"]), "sync_us": top(k["ws_us"]),
        "rollout_us": top(k["ro_us"]), "extra_us": top(k["extra_us"]),
        "rollout_cut_us": top(np.where(np.isnan(cut_us), k["ro_us"], cut_us)),
        "rollout_partial_us": top(np.where(np.isnan(partial_us), k["ro_us"], partial_us)),
        "samples": np.add.reduceat(n_smp, starts), "tail_samples": np.add.reduceat(n_tail, starts),
        "carried_in": np.add.reduceat(lag_tail, starts)})
    return (out.join(rs.groups, on="grp", maintain_order="left")
            .sort("run_id", "role", "step").drop("grp"))


def _replayed(rs: RankSteps, kept: np.ndarray, carry: np.ndarray, step_of: np.ndarray) -> np.ndarray:
    """``what_if``'s replay of each RL step (by ``step_of``, the step index of each kept rank-step): per
    segment the slowest rank's busy time plus the least sync time, a rank's last segment counted in its
    next step when ``carry`` (the carry condition makes that the next step index)."""
    r, st = rs.rows, rs.steps
    carry_rs = np.zeros(len(st["grp"]), dtype=bool)
    carry_rs[kept] = carry
    if len(kept) == len(st["grp"]):  # every rank-step is an RL one (the usual case): no copy
        rr, seg_r, dur, sync = r["rs"], r["seg"], r["dur_us"], r["sync"]
    else:
        is_kept = np.zeros(len(st["grp"]), dtype=bool)
        is_kept[kept] = True
        rows = is_kept[r["rs"]]
        rr, seg_r, dur, sync = (r[c][rows] for c in ("rs", "seg", "dur_us", "sync"))
    per_seg = runs_of(rr, seg_r)  # rows are sorted by (rank-step, start)
    # busy and sync µs per (rank-step, segment), then the remainder rows: busy, in each last segment
    rs_i = np.concatenate([rr[per_seg], kept])
    seg = np.concatenate([seg_r[per_seg], st["last_seg"][kept]])
    at = at_runs(per_seg, len(rr))
    wait_us = np.where(sync, dur, 0).astype(float)
    busy = np.concatenate([np.bincount(at, weights=dur - wait_us, minlength=len(per_seg)),
                           st["step_us"][kept] - st["covered"][kept]])
    wait = np.concatenate([np.bincount(at, weights=wait_us, minlength=len(per_seg)), np.zeros(len(kept))])
    moved = carry_rs[rs_i] & (st["syncs"][rs_i] > 0) & (seg == st["syncs"][rs_i])
    sid = np.full(len(st["grp"]), -1, dtype=np.int64)
    sid[kept] = step_of
    sid = sid[rs_i] + moved
    seg = np.where(moved, 0, seg)
    rank = st["rank"][rs_i]
    n_steps, n_seg = int(step_of.max()) + 1, int(seg.max()) + 1
    lo = int(rank.min())
    n_ranks = int(rank.max()) - lo + 1
    if n_steps * n_seg * n_ranks > 4 * len(rs_i) + 1024:  # sparse ranks: group by sorting instead
        return _replayed_sorted(sid, seg, rank, busy, wait, n_steps)
    # a (step, segment) × rank table of the summed pieces
    key = (sid * n_seg + seg) * n_ranks + (rank - lo)
    size = n_steps * n_seg * n_ranks
    has = (np.bincount(key, minlength=size) > 0).reshape(-1, n_ranks)
    slowest = np.where(has, np.bincount(key, weights=busy, minlength=size).reshape(-1, n_ranks), -np.inf).max(axis=1)
    least = np.where(has, np.bincount(key, weights=wait, minlength=size).reshape(-1, n_ranks), np.inf).min(axis=1)
    ran = has.any(axis=1)  # (a step's last segment may have no rows)
    t = np.where(ran, slowest, 0.0) + np.where(ran, least, 0.0)
    return t.reshape(n_steps, n_seg).sum(axis=1)


def _replayed_sorted(sid: np.ndarray, seg: np.ndarray, rank: np.ndarray, busy: np.ndarray, wait: np.ndarray,
                     n_steps: int) -> np.ndarray:
    """``_replayed``'s table grouped by sorting on (step, segment, rank)."""
    order = sort_order(sid, seg, rank)
    sid, seg, rank, busy, wait = (a[order] for a in (sid, seg, rank, busy, wait))
    per = runs_of(sid, seg, rank)
    busy, wait = np.add.reduceat(busy, per), np.add.reduceat(wait, per)
    sid, seg = sid[per], seg[per]
    segs = runs_of(sid, seg)
    t = np.maximum.reduceat(busy, segs) + np.minimum.reduceat(wait, segs)
    return np.bincount(sid[segs], weights=t, minlength=n_steps)
