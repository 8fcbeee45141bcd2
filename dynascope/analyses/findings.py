"""Ranked findings: the analyses turned into plain sentences, each with its numbers and a backing query.

Each finding carries the time at stake over the whole run (``at_stake_ms``: what fixing it would save, or
the time it already cost), so findings sort by what matters most; findings that cost no time directly
(instability, MFU, staleness) follow, ordered by severity. ``sql`` is a read-only query over the store's
tables that shows the underlying numbers (``dynascope sql RUN "<sql>"``).
"""

from __future__ import annotations

import importlib
import json
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame
from dynascope.analyses.goodput import goodput_summary
from dynascope.analyses.instability import detect_instability
from dynascope.analyses.rollouts import (
    async_staleness,
    rollout_train_overlap,
    tail_wait_share,
    zero_variance_groups,
)
from dynascope.analyses.steps import idle_time, step_breakdown
from dynascope.analyses.stragglers import straggler_scores, what_if
from dynascope.analyses.throughput import throughput_mfu
from dynascope.store import first_line, quote_literal

__all__ = ["Finding", "collect_findings", "ranked_findings"]

_SEVERITY = {"error": 0, "warning": 1, "info": 2}


@dataclass
class Finding:
    """One finding: a sentence, the time at stake, the numbers behind it and a query that shows them."""

    run_id: str
    kind: str
    severity: str
    sentence: str
    at_stake_ms: float = 0.0
    at_stake_pct: float | None = None
    numbers: dict[str, Any] = field(default_factory=dict)
    sql: str = ""


def fmt_ms(ms: float) -> str:
    """A duration for a sentence: '850 ms', '12.3 s', '4.2 min'."""
    if abs(ms) < 1000:
        return f"{ms:.0f} ms"
    return f"{ms / 1000:.1f} s" if abs(ms) < 120_000 else f"{ms / 60_000:.1f} min"


def fmt_pct(pct: float) -> str:
    """A share for a sentence: one decimal below 10%, none above."""
    return f"{pct:.1f}%" if abs(pct) < 10 else f"{pct:.0f}%"


def _r(x: Any, nd: int = 3) -> Any:
    return x if x is None or isinstance(x, (bool, str)) else round(float(x), nd)


def _phase_sql(run: str, path: str) -> str:
    """Per-rank medians of one phase path (``backward`` or ``train/backward``) — the straggler's evidence."""
    parent, _, leaf = path.rpartition("/")
    where = f"phase = {quote_literal(leaf)}" + (f" AND parent = {quote_literal(parent)}" if parent else
                                                 " AND coalesce(parent, '') IN ('', 'step')")
    return (f"SELECT rank, role, COUNT(*) AS steps, median(dur_us) / 1000 AS median_ms FROM timings "
            f"WHERE run_id = {quote_literal(run)} AND {where} AND coalesce(category, 'phase') = 'phase' "
            f"GROUP BY rank, role ORDER BY median_ms DESC")


def _stragglers(con, run: str) -> list[Finding]:
    """Slow (rank, phase) pairs, each priced by the what-if; then a rank that costs time without one slow phase."""
    scores = straggler_scores(con, run).filter(pl.col("status") != "ok")
    wi = what_if(con, run, by_phase=True)
    saved = {(r["role"], r["rank"], r["phase"]): r for r in wi.iter_rows(named=True)}
    priced = []
    for s in scores.iter_rows(named=True):
        top = s["phase"].split("/")[0]  # what-if replaces top-level phases: price a nested one by its parent
        w = saved.get((s["role"], s["rank"], top))
        # Under 5% slower than the fastest rank, or costing under 0.5% of step time, is noise here;
        # without step rows there is no what-if, so only persistent stragglers are reported then.
        if s["slowdown_x"] < 1.05 or (w is not None and w["saved_pct"] < 0.5) or (
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
        saved_pct = w["saved_pct"] if w else None
        role = f" ({s['role']})" if s["role"] else ""
        what = "it" if top == s["phase"] else f"its {top}"
        cut = f"; making {what} median would cut step time {fmt_pct(saved_pct)} ({fmt_ms(stake)} over " \
              f"{w['steps']} steps)" if w else f"; {fmt_ms(stake)} beyond the cross-rank median over the run"
        out.append(Finding(
            run, "straggler", "warning" if s["status"] == "persistent" else "info",
            f"rank {s['rank']}{role} is {s['slowdown_x']:.2f}× slower in {s['phase']} than the fastest rank in "
            f"{s['slow_steps_pct']:.0f}% of steps ({s['status']} straggler, score {s['score']:.2f}){cut}",
            stake, saved_pct,
            {"rank": s["rank"], "phase": s["phase"], "slowdown_x": _r(s["slowdown_x"]), "score": _r(s["score"]),
             "median_ms": _r(s["median_ms"]), "cross_rank_median_ms": _r(s["cross_rank_median_ms"]),
             "slow_steps_pct": _r(s["slow_steps_pct"], 1), "flagged_windows": s["flagged_windows"],
             "windows": s["windows"], "excess_ms": _r(s["excess_ms"]), "saved_ms": _r(w["saved_ms"] if w else 0.0),
             "saved_pct": _r(saved_pct, 2)},
            _phase_sql(run, s["phase"])))
        if len(out) == 3:
            break
    # Whole ranks: "rank 3 costs 27% of step time", when no straggler finding already names that rank.
    ranks = wi.filter(pl.col("rank").is_not_null() & pl.col("phase").is_null() & (pl.col("saved_pct") >= 5))
    named = {(role, rank) for role, rank, _ in seen}
    for r in ranks.head(3).iter_rows(named=True):
        if (r["role"], r["rank"]) in named:
            continue
        by_phase = wi.filter((pl.col("rank") == r["rank"]) & (pl.col("role") == r["role"]) & pl.col("phase").is_not_null())
        worst = f"; most of it in {by_phase['phase'][0]} ({fmt_pct(by_phase['saved_pct'][0])})" if by_phase.height else ""
        out.append(Finding(run, "rank_cost", "warning" if r["saved_pct"] >= 10 else "info",
                           f"rank {r['rank']} costs {fmt_pct(r['saved_pct'])} of step time: at the cross-rank median in "
                           f"every phase it would save {fmt_ms(r['saved_ms'])} over {r['steps']} steps{worst}",
                           r["saved_ms"], r["saved_pct"],
                           {"rank": r["rank"], "saved_ms": _r(r["saved_ms"]), "saved_pct": _r(r["saved_pct"], 2),
                            **{f"saved_pct_{p}": _r(v, 2) for p, v in by_phase.select("phase", "saved_pct").head(3).iter_rows()}},
                           f"SELECT rank, phase, median(dur_us) / 1000 AS median_ms FROM timings WHERE run_id = "
                           f"{quote_literal(run)} AND rank = {int(r['rank'])} AND category IN ('phase', 'step') "
                           f"AND coalesce(parent, '') IN ('', 'step') GROUP BY rank, phase ORDER BY median_ms DESC"))
    if not out:  # no slow rank stands out: is time still lost to ranks being unevenly fast?
        every = wi.filter(pl.col("scenario") == "all ranks")
        if not every.is_empty() and every["saved_pct"][0] >= 2:
            r = every.row(0, named=True)
            out.append(Finding(run, "imbalance", "info",
                               f"ranks are unevenly fast: if every rank ran at the cross-rank median, step time would "
                               f"drop {fmt_pct(r['saved_pct'])} ({fmt_ms(r['saved_ms'])})", r["saved_ms"], r["saved_pct"],
                               {"saved_ms": _r(r["saved_ms"]), "saved_pct": _r(r["saved_pct"], 2)},
                               f"SELECT step, rank, dur_us / 1000 AS step_ms FROM timings WHERE run_id = "
                               f"{quote_literal(run)} AND category = 'step' ORDER BY step, rank"))
    return out


def _tail(con, run: str) -> list[Finding]:
    tw = tail_wait_share(con, run)
    if tw.is_empty() or not tw["step_ms"].sum():
        return []
    tail, total = tw["tail_wait_ms"].sum(), tw["step_ms"].sum()
    pct = 100 * tail / total
    if pct < 1:
        return []
    where = "RL step time" if (tw["step_source"] == "step_rows").all() else "rollout time"
    return [Finding(run, "rollout_tail", "warning" if pct >= 10 else "info",
                    f"{fmt_pct(pct)} of {where} is tail wait after the median rollout finished "
                    f"({fmt_ms(tw['tail_wait_ms'].median())} per step at the median, {fmt_ms(tail)} in all)",
                    tail, pct, {"tail_wait_ms": _r(tail), "step_ms": _r(total), "tail_wait_pct": _r(pct, 2),
                                "steps": tw.height},
                    f"SELECT step, COUNT(*) AS samples, (MAX(gen_end_us) - quantile_cont(gen_end_us, 0.5)) / 1000 "
                    f"AS tail_wait_ms, quantile_cont(response_len, 0.5) AS p50_len, MAX(response_len) AS max_len "
                    f"FROM samples WHERE run_id = {quote_literal(run)} GROUP BY step ORDER BY step")]


def _zero_variance(con, run: str) -> list[Finding]:
    z = zero_variance_groups(con, run)
    if z.is_empty() or not z["zero_variance_groups"].sum():
        return []
    groups, zero, wasted = z["groups"].sum(), z["zero_variance_groups"].sum(), z["wasted_samples"].sum()
    pct = 100 * zero / groups
    rollout_ms = frame(con, f"""SELECT coalesce(SUM(m), 0) AS ms FROM (SELECT step, MAX(dur_us) / 1000.0 AS m
        FROM timings WHERE run_id = {quote_literal(run)} AND phase = 'rollout' GROUP BY step)""")["ms"][0]
    stake = rollout_ms * wasted / max(z["samples"].sum(), 1)
    return [Finding(run, "zero_variance_groups", "warning" if pct >= 20 else "info",
                    f"{fmt_pct(pct)} of GRPO groups ({zero} of {groups}) had zero reward variance: their {wasted} "
                    f"rollouts carried no learning signal" + (f" (~{fmt_ms(stake)} of rollout time)" if stake else ""),
                    stake, None, {"groups": groups, "zero_variance_groups": zero, "wasted_samples": wasted,
                                  "zero_variance_pct": _r(pct, 2)},
                    f"SELECT step, group_id, COUNT(*) AS n, MIN(reward) AS min_reward, MAX(reward) AS max_reward "
                    f"FROM samples WHERE run_id = {quote_literal(run)} AND group_id IS NOT NULL "
                    f"GROUP BY step, group_id HAVING MAX(reward) = MIN(reward) ORDER BY step, group_id")]


def _idle(con, run: str) -> list[Finding]:
    df = idle_time(con, run).filter(pl.col("step_ms").is_not_null())
    if df.is_empty() or df["rank"].n_unique() < 2:
        return []
    per = df.group_by("rank").agg(pl.col("idle_ms").sum(), pl.col("step_ms").sum()).with_columns(
        pct=100 * pl.col("idle_ms") / pl.col("step_ms")).sort("pct", descending=True)
    pct = 100 * per["idle_ms"].sum() / per["step_ms"].sum()
    if pct < 2:
        return []
    stake = per["idle_ms"].sum() / per.height  # wall time: the mean rank's idle time
    return [Finding(run, "idle", "warning" if pct >= 10 else "info",
                    f"ranks spend {fmt_pct(pct)} of step time waiting for peers in collectives and barriers "
                    f"(most: rank {per['rank'][0]}, {fmt_pct(per['pct'][0])})", stake, pct,
                    {"idle_pct": _r(pct, 2), "worst_rank": per["rank"][0], "worst_rank_idle_pct": _r(per["pct"][0], 2)},
                    f"SELECT rank, SUM(dur_us) / 1000 AS wait_ms, COUNT(*) AS rows FROM timings WHERE run_id = "
                    f"{quote_literal(run)} AND category IN ('wait', 'comm') GROUP BY rank ORDER BY wait_ms DESC")]


def _remainder(con, run: str) -> list[Finding]:
    b = step_breakdown(con, run).filter(pl.col("step_ms").is_not_null())
    rem = b.filter(pl.col("phase") == "(uninstrumented)")
    if rem.is_empty():
        return []
    pct = 100 * rem["dur_ms"].sum() / rem["step_ms"].sum()
    if pct < 10:
        return []
    stake = rem["dur_ms"].sum() / rem["rank"].n_unique()
    return [Finding(run, "uninstrumented", "info",
                    f"{pct:.0f}% of step time is outside every instrumented phase (data loading, host work, "
                    f"logging?)", stake, pct, {"uninstrumented_pct": _r(pct, 2)},
                    f"SELECT step, rank, dur_us / 1000 AS step_ms FROM timings WHERE run_id = {quote_literal(run)} "
                    f"AND category = 'step' ORDER BY step, rank")]


def _async(con, run: str) -> list[Finding]:
    out = []
    st = async_staleness(con, run)
    if not st.is_empty() and st["staleness_steps"].max() > 0:
        mean = (st["staleness_steps"] * st["samples"]).sum() / st["samples"].sum()
        out.append(Finding(run, "staleness", "info",
                           f"samples were on average {mean:.2f} policy versions stale when trained on "
                           f"(max {st['staleness_steps'].max()})", 0.0, None,
                           {"mean_staleness": _r(mean), "max_staleness": st["staleness_steps"].max()},
                           f"SELECT trainer_version - policy_version AS staleness, COUNT(*) AS samples FROM samples "
                           f"WHERE run_id = {quote_literal(run)} GROUP BY 1 ORDER BY 1"))
    ov = rollout_train_overlap(con, run)
    r = ov.row(0, named=True) if not ov.is_empty() else None
    if r and r["disaggregated"] and r["rollout_ms"] and r["train_ms"]:
        # time rollout and training could have run side by side but did not
        idle = min(r["rollout_ms"], r["train_ms"]) - r["overlap_ms"]
        sync = f"; weight sync took {fmt_ms(r['weight_sync_ms'])} over {r['weight_syncs']} syncs" if r["weight_syncs"] else ""
        out.append(Finding(run, "async_overlap", "info",
                           f"rollout and training overlapped {fmt_pct(r['overlap_pct'])} of wall time "
                           f"({fmt_ms(r['overlap_ms'])}); {fmt_ms(idle)} of the shorter side ran alone{sync}",
                           idle + r["weight_sync_ms"], None, {k: _r(v) for k, v in r.items() if k != "run_id"},
                           f"SELECT role, rank, phase, start_us, dur_us FROM timings WHERE run_id = {quote_literal(run)}"
                           f" AND phase IN ('rollout', 'train', 'weight_sync') ORDER BY start_us"))
    elif r and r["weight_syncs"]:
        out.append(Finding(run, "weight_sync", "info",
                           f"weight sync took {fmt_ms(r['weight_sync_ms'])} over {r['weight_syncs']} syncs",
                           r["weight_sync_ms"], None, {"weight_syncs": r["weight_syncs"],
                                                        "weight_sync_ms": _r(r["weight_sync_ms"])},
                           f"SELECT step, rank, dur_us / 1000 AS ms FROM timings WHERE run_id = {quote_literal(run)}"
                           f" AND phase IN ('weight_sync', 'sync_weights', 'update_weights') ORDER BY step, rank"))
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
    parts = []
    if ckpt:
        parts.append(f"checkpointing took {100 * ckpt / r['wall_ms']:.1f}% of wall time ({r['checkpoint_saves']} saves, "
                     f"{r['checkpoint_loads']} loads, {fmt_ms(ckpt)})")
    if r["restarts"]:
        parts.append(f"{r['restarts']} restart(s) lost {fmt_ms(r['lost_work_ms'])} of work since the last checkpoint "
                     f"plus {fmt_ms(r['downtime_ms'])} down")
    return [Finding(run, "goodput", "warning" if lost else "info",
                    "; ".join(parts) + f"; goodput {r['goodput_pct']:.0f}%", ckpt + lost, 100 * (ckpt + lost) / r["wall_ms"],
                    {k: _r(v) for k, v in r.items() if k != "run_id"},
                    f"SELECT event, step, time_us, dur_us / 1000 AS dur_ms, message FROM events WHERE run_id = "
                    f"{quote_literal(run)} AND event IN ('checkpoint_save', 'checkpoint_load', 'fault', 'restart') "
                    f"ORDER BY time_us")]


def _instability(con, run: str) -> list[Finding]:
    ev = detect_instability(con, run)
    out = []
    for (kind,), g in ev.group_by(["kind"], maintain_order=True):
        steps = sorted(set(g["step"].to_list()))
        shown = ", ".join(map(str, steps[:5])) + (f" and {len(steps) - 5} more" if len(steps) > 5 else "")
        label = {"grad_norm_spike": "grad-norm spikes", "loss_spike": "loss spikes",
                 "entropy_collapse": "entropy collapse", "nan_inf": "NaN/Inf values"}[kind]
        out.append(Finding(run, kind, g["severity"][0], f"{label} at step {shown}: {g['message'][0]}", 0.0, None,
                           {"events": g.height, "first_step": steps[0], "source": g["source"][0]},
                           f"SELECT step, rank, key, value FROM scalars WHERE run_id = {quote_literal(run)} "
                           f"AND step IN ({', '.join(map(str, steps[:50]))}) ORDER BY key, step, rank"))
    return out


def _mfu(con, run: str, peak_tflops: float | None = None) -> list[Finding]:
    # Raises without a known peak (CPU, unknown parts: pass peak_tflops) or model size; the caller skips it.
    df = throughput_mfu(con, run, peak_tflops=peak_tflops)
    df = df.filter(pl.col("phase").is_in(["train", "step"]))
    if df.is_empty():
        return []
    phase = "train" if "train" in df["phase"].to_list() else "step"
    d = df.filter(pl.col("phase") == phase)
    mfu = d["mfu_pct"].mean()
    return [Finding(run, "mfu", "info", f"{phase} MFU is {mfu:.1f}% of the {d['peak_tflops'][0]:g} TFLOP/s peak "
                    f"({d['achieved_tflops'].mean():.3g} TFLOP/s and {d['tokens_per_s'].mean():.0f} tokens/s per rank)",
                    0.0, None, {"mfu_pct": _r(mfu, 2), "peak_tflops": d["peak_tflops"][0]},
                    f"SELECT step, SUM(prompt_len + response_len) AS tokens FROM samples WHERE run_id = "
                    f"{quote_literal(run)} GROUP BY step ORDER BY step")]


def _dynamics(con, run: str) -> list[Finding]:
    # Guarded: the dynamics analyses may be absent. Imported by module path, not through the package's
    # lazy index, which would import every analysis module (some pull in torch).
    try:
        A = importlib.import_module("dynascope.analyses.dynamics")
    except ImportError:
        return []
    out = []
    r1 = getattr(A, "rank1_dominance", None)
    if r1 is not None:
        df = r1(con, run)
        df = df.filter(pl.col("level") == "overall") if "level" in df.columns else df.clear()
        if not df.is_empty():
            last = df.sort("step").row(-1, named=True)
            out.append(Finding(run, "rank1_dominance", "info",
                               f"at step {last['step']} the cumulative update ΔW is {100 * last['rank1_energy']:.0f}% "
                               f"rank-1 (σ₁² share of ‖ΔW‖², {last['tensors']} tensors)", 0.0, None,
                               {"step": last["step"], "rank1_energy": _r(last["rank1_energy"])},
                               f"SELECT step, SUM(sigma[1] * sigma[1]) / SUM(drift_norm * drift_norm) AS rank1_energy FROM "
                               f"spectra WHERE run_id = {quote_literal(run)} AND drift_norm > 0 GROUP BY step ORDER BY step"))
    sc = getattr(A, "sparsity_comparison", None)
    stages = frame(con, f"SELECT stage FROM tensor_stats WHERE run_id = {quote_literal(run)} AND stage IS NOT NULL "
                        f"GROUP BY stage ORDER BY MIN(step)")["stage"].to_list()
    if sc is not None and len(stages) >= 2:
        df = sc(con, stages[0], stages[1]).filter(pl.col("kind") == "all")
        if not df.is_empty() and df["step_unchanged_frac_a"][0] is not None:
            r = df.row(0, named=True)
            out.append(Finding(run, "update_sparsity", "info",
                               f"a {stages[1]} step left {100 * r['step_unchanged_frac_b']:.1f}% of parameters "
                               f"bit-identical vs {100 * r['step_unchanged_frac_a']:.1f}% in {stages[0]}", 0.0, None,
                               {k: _r(v) for k, v in r.items() if isinstance(v, float)},
                               f"SELECT stage, 1 - SUM(changed_count)::DOUBLE / SUM(numel) AS unchanged_frac FROM "
                               f"tensor_stats WHERE run_id = {quote_literal(run)} GROUP BY stage"))
    return out


GENERATORS: list[Callable[[Any, str], list[Finding]]] = [
    _stragglers, _tail, _zero_variance, _idle, _remainder, _async, _goodput, _instability, _mfu, _dynamics]


def collect_findings(store: StoreLike, run: str | None = None, *,
                     peak_tflops: float | None = None) -> tuple[list[Finding], list[str]]:
    """All findings for ``run`` (or every run in the store), ranked, and notes on analyses that were skipped.

    ``peak_tflops`` (dense peak per device) enables MFU where the device's peak is not known (CPU runs).
    """
    con = as_store(store)
    runs = [run] if run is not None else frame(con, "SELECT DISTINCT run_id FROM runs ORDER BY 1")["run_id"].to_list()
    found: list[Finding] = []
    notes: list[str] = []
    for r in runs:
        for gen in GENERATORS:
            name = gen.__name__.lstrip("_")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    found.extend(_mfu(con, r, peak_tflops) if gen is _mfu else gen(con, r))
            except Exception as exc:  # one analysis failing must not sink the report; say why it is missing
                notes.append(f"{name}: {first_line(exc)}")
    found.sort(key=lambda f: (-f.at_stake_ms, _SEVERITY.get(f.severity, 3), f.kind))
    return found, notes


def ranked_findings(store: StoreLike, run: str | None = None, *, peak_tflops: float | None = None) -> pl.DataFrame:
    """Ranked findings as a frame. Columns: rank, run_id, kind, severity, at_stake_ms, at_stake_pct, sentence,
    numbers_json, sql. ``peak_tflops`` as in ``collect_findings``."""
    found, _ = collect_findings(store, run, peak_tflops=peak_tflops)
    rows = [{"rank": i + 1, **{k: v for k, v in asdict(f).items() if k != "numbers"},
             "numbers_json": json.dumps(f.numbers, default=str)} for i, f in enumerate(found)]
    schema = {"rank": pl.Int64, "run_id": pl.String, "kind": pl.String, "severity": pl.String,
              "sentence": pl.String, "at_stake_ms": pl.Float64, "at_stake_pct": pl.Float64, "sql": pl.String,
              "numbers_json": pl.String}
    return pl.DataFrame(rows, schema=schema).select(
        "rank", "run_id", "kind", "severity", "at_stake_ms", "at_stake_pct", "sentence", "numbers_json", "sql")
