"""Ranked findings: the analyses turned into plain sentences, each with its numbers and a backing query.

Each finding carries the time at stake over the whole run (``at_stake_ms``: what fixing it would save, or
the time it already cost), so findings sort by what matters most; findings that cost no time directly
(instability, MFU, staleness) follow, ordered by severity.

``numbers`` holds everything the sentence says (``findings_text`` writes the sentence from them alone), and
``sql`` (built in ``findings_sql``) is a read-only query over the store's tables (``dynascope sql RUN
"<sql>"``) whose first row returns the finding's numbers under the same names. This module decides which
findings to raise: the thresholds below, and the numbers each carries.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import polars as pl

from dynascope.analyses import findings_consistency as C
from dynascope.analyses import findings_sql as S
from dynascope.analyses._common import StoreLike, as_store, frame, in_parallel, shared_reads
from dynascope.analyses._findings import Finding
from dynascope.analyses._findings import first_row as _first_row
from dynascope.analyses._findings import found as _found
from dynascope.analyses._findings import rnd as _r
from dynascope.analyses.findings_clock import clock_offset
from dynascope.analyses.findings_cluster import MIN_CLUSTER_RANKS, slow_nodes
from dynascope.analyses.findings_dynamics import delta_sync, dynamics
from dynascope.analyses.findings_gpu import gpu_idle
from dynascope.analyses.findings_steps import idle, remainder
from dynascope.analyses.goodput import goodput_summary
from dynascope.analyses.instability import detect_instability
from dynascope.analyses.outliers import cluster_outliers
from dynascope.analyses.probe_time import DEFAULT_PROBE_COST, PROBE_PHASE, probe_cost
from dynascope.analyses.rollouts import (
    async_staleness,
    rollout_train_overlap,
    tail_wait_summary,
    zero_variance_groups,
)
from dynascope.analyses.slower_ranks import rank_busy
from dynascope.analyses.stragglers import straggler_scores
from dynascope.analyses.throughput import throughput_mfu
from dynascope.analyses.what_if_rank import what_if
from dynascope.core.errors import first_line
from dynascope.store import quote_literal

__all__ = ["Finding", "collect_findings", "probe_cost_numbers", "ranked_findings", "tail_wait_numbers"]

_SEVERITY = {"error": 0, "warning": 1, "info": 2}

# Thresholds: below these a finding is noise on a real cluster, or not worth a reader's attention.
MIN_SLOWDOWN_X = 1.05  # a rank under 5% slower than the fastest is within step-to-step jitter
MIN_SAVED_PCT = 0.5  # a straggler whose what-if saves under 0.5% of step time costs nothing to chase
MAX_STRAGGLERS = 3  # slow (rank, phase) pairs reported; the what-if orders them by time at stake
MIN_RANK_COST_PCT = 5.0  # a whole rank worth naming costs at least 5% of step time...
WARN_RANK_COST_PCT = 10.0  # ...and is a warning from 10%
MIN_IMBALANCE_PCT = 2.0  # evenly fast ranks still lose this much to ordinary spread; below it, no finding
MIN_TAIL_PCT = 1.0  # tail wait under 1% of step time is sampling noise
WARN_TAIL_PCT = 10.0
WARN_ZERO_VARIANCE_PCT = 20.0  # a fifth of the groups teaching nothing is worth changing the batch for
MIN_PROBE_PCT = 3.0  # watch()'s defaults cost ~1.5% of a step (1.015×): above 3% the run asked for more coverage
SQL_STEPS_SHOWN = 50  # instability queries list at most this many steps


def _whole_rank(w: dict[str, Any] | None) -> dict[str, Any]:
    """The whole rank's what-if beside a phase's ("what if rank R ran at the median": the ``what_if``
    scenario ``rank R``, the figure the dashboard's Stragglers and What-if tables show); nothing when no
    scenario priced it."""
    if w is None:
        return {}
    return {"rank_saved_ms": _r(w["saved_ms"]), "rank_saved_pct": _r(w["saved_pct"], 2)}


def _stragglers(con, run: str) -> list[Finding]:
    """Slow (rank, phase) pairs, each priced by the what-if; then a rank that costs time without one slow phase."""
    scores = straggler_scores(con, run)
    # Roles with a node's worth of ranks: a rank is slow when cluster_outliers says so (against the spread
    # of healthy ranks measured in the run), and a node's ranks are the node's finding, not one each.
    big = scores.group_by("role").agg(pl.col("rank").n_unique().alias("ranks")).filter(
        pl.col("ranks") >= MIN_CLUSTER_RANKS)["role"].to_list()
    outliers = cluster_outliers(con, run) if big else None
    slow = None if outliers is None else outliers.filter(pl.col("kind") == "rank")
    verdict = {} if slow is None else {(r["role"], r["rank"], r["phase"]): r for r in slow.iter_rows(named=True)}
    scores = scores.filter(pl.col("role").is_in(big) | (pl.col("status") != "ok"))
    wi = what_if(con, run, by_phase=True)
    saved = {(r["role"], r["rank"], r["phase"]): r for r in wi.iter_rows(named=True)}
    priced = []
    for s in scores.iter_rows(named=True):
        top = s["phase"].split("/")[0]  # what-if replaces top-level phases: price a nested one by its parent
        w = saved.get((s["role"], s["rank"], top))
        if s["role"] in big:
            if (s["role"], s["rank"], s["phase"]) not in verdict:
                continue
            v = verdict[(s["role"], s["rank"], s["phase"])]
            s = {**s, "status": v["status"], "against_x": v["slowdown_x"], "threshold_x": v["threshold_x"],
                 "slow_steps": v["slow_steps_count"]}
        # Without step rows there is no what-if, so only persistent stragglers are reported then.
        elif s["slowdown_x"] < MIN_SLOWDOWN_X or (w is not None and w["saved_pct"] < MIN_SAVED_PCT) or (
                w is None and s["status"] != "persistent"):
            continue
        # Time at stake: the what-if's saving, else the time the rank spent beyond the cross-rank median.
        priced.append((w["saved_ms"] if w else s["excess_ms"], s, top, w))
    # Most time at stake first: a steep slowdown in a short phase must not crowd out a costly one.
    priced.sort(key=lambda p: (-p[0], p[1]["status"], p[1]["score"]))
    out, seen = [], set()
    for stake, s, top, w in priced:
        if (s["role"], s["rank"], top) in seen:
            continue
        seen.add((s["role"], s["rank"], top))
        sql = S.straggler_sql(run, s["role"], s["rank"], s["phase"])
        n = {"rank": s["rank"], "role": s["role"], "phase": s["phase"], "status": s["status"], "steps": s["steps"],
             "run_median_ms": _r(_first_row(con, sql).get("run_median_ms")), "slowdown_x": _r(s["slowdown_x"]),
             "score": _r(s["score"]), "median_ms": _r(s["median_ms"]),
             "cross_rank_median_ms": _r(s["cross_rank_median_ms"]), "slow_steps_pct": _r(s["slow_steps_pct"], 1),
             "flagged_windows": s["flagged_windows"], "windows": s["windows"], "excess_ms": _r(s["excess_ms"]),
             "whatif_phase": top, "whatif_steps": w["steps"] if w else None,
             "saved_ms": _r(w["saved_ms"]) if w else None, "saved_pct": _r(w["saved_pct"], 2) if w else None,
             **_whole_rank(saved.get((s["role"], s["rank"], None))),
             **({"median_slowdown_x": _r(s["against_x"]), "healthy_x": _r(s["threshold_x"]),
                 "slow_steps": s["slow_steps"]} if "against_x" in s else {})}
        out.append(_found(run, "straggler", "warning" if s["status"] == "persistent" else "info", n, sql,
                          max(stake, 0.0), n["saved_pct"]))
        if len(out) == MAX_STRAGGLERS:
            break
    # Whole ranks: "rank 3 costs 27% of step time", when no straggler finding already names that rank, and
    # only a rank that stands out as slower than its role (rank_busy, the dashboard's rule): on ranks that
    # jitter alike, capping any one at the median saves its share of the jitter, faster ranks' too.
    ranks = wi.filter(pl.col("rank").is_not_null() & pl.col("phase").is_null()
                      & (pl.col("saved_pct") >= MIN_RANK_COST_PCT))
    named = {(role, rank) for role, rank, _ in seen}
    slower = {(role or "", int(rank)) for role, rank in rank_busy(con, run).filter(pl.col("slow"))
              .select("role", "rank").iter_rows()}
    for r in ranks.head(MAX_STRAGGLERS).iter_rows(named=True):
        if (r["role"], r["rank"]) in named or (r["role"] or "", r["rank"]) not in slower:
            continue
        by_phase = wi.filter((pl.col("rank") == r["rank"]) & (pl.col("role") == r["role"]) & pl.col("phase").is_not_null())
        n = {"rank": r["rank"], "steps": r["steps"], "saved_ms": _r(r["saved_ms"]), "saved_pct": _r(r["saved_pct"], 2),
             "worst_phase": by_phase["phase"][0] if by_phase.height else None,
             "worst_phase_saved_pct": _r(by_phase["saved_pct"][0], 2) if by_phase.height else None}
        out.append(_found(run, "rank_cost", "warning" if r["saved_pct"] >= WARN_RANK_COST_PCT else "info", n,
                          S.rank_cost_sql(run, r["role"], r["rank"]),
                          r["saved_ms"], r["saved_pct"]))
    if outliers is not None:  # hosts whose ranks are slow together: one finding per node
        out.extend(slow_nodes(con, run, outliers))
    if not out:  # no slow rank stands out: is time still lost to ranks being unevenly fast?
        every = wi.filter(pl.col("scenario") == "all ranks")
        if not every.is_empty() and every["saved_pct"][0] >= MIN_IMBALANCE_PCT:
            r = every.row(0, named=True)
            n = {"steps": r["steps"], "saved_ms": _r(r["saved_ms"]), "saved_pct": _r(r["saved_pct"], 2)}
            out.append(_found(run, "imbalance", "info", n,
                              S.imbalance_sql(run), r["saved_ms"], r["saved_pct"]))
    return out


def tail_wait_numbers(row: dict[str, Any]) -> dict[str, Any]:
    """The numbers of the tail-wait sentence from a ``tail_wait_summary`` row (the report's finding, the
    demo's line and the dashboard's caption say the same thing from it)."""
    return {"steps": row["steps"], "tail_wait_ms": _r(row["tail_wait_ms"]), "step_ms": _r(row["step_ms"]),
            "tail_wait_pct": _r(row["tail_wait_pct"], 2), "median_tail_wait_ms": _r(row["median_tail_wait_ms"]),
            "step_source": row["step_source"]}


def _tail(con, run: str) -> list[Finding]:
    tw = tail_wait_summary(con, run)
    if tw.is_empty() or not tw["step_ms"][0]:
        return []
    r = tw.row(0, named=True)
    if r["tail_wait_pct"] < MIN_TAIL_PCT:
        return []
    n = tail_wait_numbers(r)
    return [_found(run, "rollout_tail", "warning" if r["tail_wait_pct"] >= WARN_TAIL_PCT else "info", n,
                   S.tail_sql(run), r["tail_wait_ms"], r["tail_wait_pct"])]


def _zero_variance(con, run: str) -> list[Finding]:
    z = zero_variance_groups(con, run)
    if z.is_empty() or not z["zero_variance_groups"].sum():
        return []
    groups, zero, wasted = z["groups"].sum(), z["zero_variance_groups"].sum(), z["wasted_samples"].sum()
    pct = 100 * zero / groups
    rollout_ms = frame(con, f"""SELECT coalesce(SUM(m), 0) AS ms FROM (SELECT step, MAX(dur_us) / 1000.0 AS m
        FROM timings WHERE run_id = {quote_literal(run)} AND phase = 'rollout' GROUP BY step)""")["ms"][0]
    stake = rollout_ms * wasted / max(z["samples"].sum(), 1)  # rollout time in proportion to wasted samples
    n = {"groups": groups, "zero_variance_groups": zero, "wasted_samples": wasted, "zero_variance_pct": _r(pct, 2),
         "wasted_rollout_ms": _r(stake)}
    return [_found(run, "zero_variance_groups", "warning" if pct >= WARN_ZERO_VARIANCE_PCT else "info", n,
                   S.zero_variance_sql(run), stake)]


def probe_cost_numbers(row: dict[str, Any]) -> dict[str, Any]:
    """The numbers of the probe-cost sentence from a ``probe_cost`` row (report finding, dashboard caption)."""
    return {"probe_pct": _r(row["probe_pct"], 2), "probe_ms": _r(row["probe_ms"]), "steps": row["steps"],
            "recorded_steps": row["recorded_steps"], "coverage_pct": _r(row["coverage_pct"], 2),
            "default_cost": DEFAULT_PROBE_COST}


def _probe_cost(con, run: str) -> list[Finding]:
    """The probe's own share of step time, when it is above what watch()'s defaults cost."""
    df = probe_cost(con, run)
    if df.is_empty() or df["probe_pct"][0] < MIN_PROBE_PCT:
        return []
    r = df.row(0, named=True)
    n = probe_cost_numbers(r)
    return [_found(run, "probe_cost", "info", n, S.probe_cost_sql(run, PROBE_PHASE), r["probe_ms"], r["probe_pct"])]


def _async(con, run: str) -> list[Finding]:
    out = []
    st = async_staleness(con, run)
    if not st.is_empty() and st["staleness_steps"].max() > 0:
        mean = (st["staleness_steps"] * st["samples"]).sum() / st["samples"].sum()
        out.append(_found(run, "staleness", "info", {"mean_staleness": _r(mean), "max_staleness": st["staleness_steps"].max()},
                          S.staleness_sql(run)))
    ov = rollout_train_overlap(con, run)
    r = ov.row(0, named=True) if not ov.is_empty() else None
    if r and r["disaggregated"] and r["rollout_ms"] and r["train_ms"]:
        # time rollout and training could have run side by side but did not
        alone = min(r["rollout_ms"], r["train_ms"]) - r["overlap_ms"]
        n = {**{k: _r(v) for k, v in r.items() if k not in ("run_id", "disaggregated")}, "alone_ms": _r(alone)}
        out.append(_found(run, "async_overlap", "info", n, S.weight_sync_sql(run), alone + r["weight_sync_ms"]))
    elif r and r["weight_syncs"]:
        out.append(_found(run, "weight_sync", "info", {"weight_syncs": r["weight_syncs"],
                                                       "weight_sync_ms": _r(r["weight_sync_ms"])},
                          S.weight_sync_sql(run), r["weight_sync_ms"]))
    return out


def _goodput(con, run: str) -> list[Finding]:
    g = goodput_summary(con, run)
    if g.is_empty():
        return []
    r = g.row(0, named=True)
    ckpt = r["checkpoint_save_ms"] + r["checkpoint_load_ms"]
    lost = r["lost_work_ms"] + r["downtime_ms"]
    if not ckpt and not lost:
        return []
    n = {k: _r(v) for k, v in r.items() if k != "run_id"}
    return [_found(run, "goodput", "warning" if lost else "info", n, S.goodput_sql(run), ckpt + lost, 100 * (ckpt + lost) / r["wall_ms"])]


def _instability(con, run: str) -> list[Finding]:
    ev = detect_instability(con, run)
    out = []
    for (event,), g in ev.group_by(["event"], maintain_order=True):
        first = g.sort("step").row(0, named=True)
        steps = sorted(set(g["step"].to_list()))
        series = g.filter((pl.col("source") == first["source"]) & (pl.col("role") == first["role"])
                          & (pl.col("rank").eq_missing(first["rank"])))["step"].to_list()
        n = {"events": g.height, "steps": steps, "step": first["step"], "rank": first["rank"],
             "ranks": sorted({r for r in g["rank"].to_list() if r is not None}),
             "source": first["source"], "value": _r(first["value"], 6), "message": first["message"]}
        out.append(_found(run, event, first["severity"], n, S.instability_sql(run, first, sorted(series)[:SQL_STEPS_SHOWN])))
    return out


def _mfu(con, run: str, peak_tflops: float | None = None) -> list[Finding]:
    # Raises without a known peak (CPU, unknown parts: pass peak_tflops) or model size; the caller skips it.
    df = throughput_mfu(con, run, peak_tflops=peak_tflops)
    df = df.filter(pl.col("phase").is_in(["train", "step"]))
    if df.is_empty():
        return []
    phase = "train" if "train" in df["phase"].to_list() else "step"
    d = df.filter(pl.col("phase") == phase)
    # Each role's rows share out the same samples' tokens, so one role speaks for the run: the trainer's
    # when the phase is "step" on several roles (rollout workers time steps too), else the only one.
    roles = sorted(set(d["role"].to_list()))
    d = d.filter(pl.col("role") == ("trainer" if "trainer" in roles else roles[0]))
    n = {"phase": phase, "mfu_pct": _r(d["mfu_pct"].mean(), 2), "peak_tflops": d["peak_tflops"][0],
         "achieved_tflops": _r(d["achieved_tflops"].mean(), 4), "tokens_per_s": _r(d["tokens_per_s"].mean(), 1),
         "tokens": _r(d["tokens"].sum(), 1)}
    return [_found(run, "mfu", "info", n,
                   S.mfu_sql(run))]


MIN_SCHEDULE_GAIN_X = 1.05  # a schedule predicted to gain under 5% is within the replay's own error


def _schedule(con, run: str) -> list[Finding]:
    """The schedule the replay of a synchronous run's pieces predicts the most samples/s for (defaults)."""
    from dynascope.analyses.what_if_schedule import LIMITS, schedule_what_if
    from dynascope.analyses.what_if_schedule_inputs import ROLLOUT_PHASES, SYNC_PHASES

    df = schedule_what_if(con, run)
    if df.is_empty():
        return []
    sync = df.filter(pl.col("schedule") == "sync").row(0, named=True)
    best = df.sort("speedup_x", descending=True).row(0, named=True)
    if best["speedup_x"] is None or best["speedup_x"] < MIN_SCHEDULE_GAIN_X:
        return []
    inp = _first_row(con, S.schedule_sql(run, ROLLOUT_PHASES, SYNC_PHASES))
    n = {"schedule": best["schedule"], "params": best["params"], "speedup_x": _r(best["speedup_x"]),
         "step_ms": _r(best["step_ms"]), "replayed_step_ms": _r(sync["step_ms"]),
         "samples_per_s": _r(best["samples_per_s"]), "staleness_mean": _r(best["staleness_mean"]),
         "truncated_pct": _r(best["truncated_pct"] or best["carried_pct"] or 0.0, 2),
         "calibration_error_pct": _r(sync["calibration_error_pct"], 2), "steps": inp["steps"],
         "measured_step_ms": _r(inp["measured_step_ms"]), "rollout_ms": _r(inp["rollout_ms"]),
         "weight_sync_ms": _r(inp["weight_sync_ms"]), "devices": "one device per rank, shared by its rollout "
         "and training", "limits": LIMITS}
    saved = inp["steps"] * inp["measured_step_ms"] * (1 - 1 / best["speedup_x"])
    return [_found(run, "schedule", "info", n, S.schedule_sql(run, ROLLOUT_PHASES, SYNC_PHASES), saved,
                   100 * (1 - 1 / best["speedup_x"]))]


GENERATORS: list[Callable[[Any, str], list[Finding]]] = [
    _stragglers, _tail, _zero_variance, idle, remainder, _probe_cost, _async, _goodput, _instability, _mfu, dynamics,
    delta_sync, _schedule, C.weight_sync_mismatch, C.logprob_gap, C.kl_to_base, gpu_idle, clock_offset]


def collect_findings(store: StoreLike, run: str | None = None, *,
                     peak_tflops: float | None = None) -> tuple[list[Finding], list[str]]:
    """All findings for ``run`` (or every run in the store), ranked, and notes on analyses that were skipped.

    ``peak_tflops`` (dense peak per device) enables MFU where the device's peak is not known (CPU runs).
    """
    con = as_store(store)
    runs = [run] if run is not None else frame(con, "SELECT DISTINCT run_id FROM runs ORDER BY 1")["run_id"].to_list()
    found: list[Finding] = []
    notes: list[str] = []
    calls = [(r, gen) for r in runs for gen in GENERATORS]
    # The analyses run two at a time, reading the timing rows once (shared_reads); their warnings are
    # the report's notes or nothing. One analysis failing must not sink the report: say why it is missing.
    with shared_reads(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = in_parallel([partial(_mfu, con, r, peak_tflops) if gen is _mfu else partial(gen, con, r)
                               for r, gen in calls])
    for (_, gen), res in zip(calls, results, strict=True):
        if isinstance(res, Exception):
            notes.append(f"{gen.__name__.lstrip('_')}: {first_line(res)}")
        else:
            found.extend(res)
    found.sort(key=lambda f: (-f.at_stake_ms, _SEVERITY.get(f.severity, 3), f.finding))
    return found, notes


_COLUMNS = {"position": pl.Int64, "run_id": pl.String, "finding": pl.String, "severity": pl.String,
            "at_stake_ms": pl.Float64, "at_stake_pct": pl.Float64, "sentence": pl.String, "numbers_json": pl.String,
            "sql": pl.String}


def ranked_findings(store: StoreLike, run: str | None = None, *, peak_tflops: float | None = None) -> pl.DataFrame:
    """Ranked findings as a frame. Columns: position (1 = most time at stake), run_id, finding, severity,
    at_stake_ms, at_stake_pct, sentence, numbers_json, sql. ``peak_tflops`` as in ``collect_findings``."""
    found, _ = collect_findings(store, run, peak_tflops=peak_tflops)
    rows = [{"position": i + 1, **{k: v for k, v in asdict(f).items() if k != "numbers"},
             "numbers_json": json.dumps(f.numbers, default=str)} for i, f in enumerate(found)]
    return pl.DataFrame(rows, schema=_COLUMNS).select(*_COLUMNS)
