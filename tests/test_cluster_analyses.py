"""Cluster analyses on a synthetic 4-rank run written with the real RunWriter and read back through DuckDB.

The run plants a straggler (rank 2's backward is 1.5× the others') and a long rollout tail (one sample per
rank takes 4× the others), so every expected figure below is derived from the planted numbers.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import polars as pl
import pytest

import dynascope.analyses
import dynascope.analyses.findings as findings
import dynascope.analyses.goodput as goodput
import dynascope.analyses.instability as instability
import dynascope.analyses.rollouts as rollouts
import dynascope.analyses.steps as steps
import dynascope.analyses.stragglers as stragglers
import dynascope.analyses.throughput as throughput
import dynascope.analyses.what_if_rank as what_if_rank
import dynascope.analyses.what_if_rank_shared as what_if_rank_shared
import dynascope.analyses.what_if_schedule as what_if_schedule
import dynascope.analyses.what_if_schedule_inputs as what_if_schedule_inputs
from dynascope.store import RunWriter, open_store
from dynascope.store.events import write_detected_events

from helpers.planted_cluster import (
    BACKWARD,
    COLLECTIVE,
    GAP,
    GROUP,
    RANKS,
    ROLLOUT_LONG,
    ROLLOUT_SHORT,
    SAMPLES_PER_RANK,
    SLOW_FACTOR,
    SLOW_RANK,
    STEPS,
    T0,
    planted_step_ms,
    write_async_run,
    write_synthetic_run,
)
from helpers.planted_cluster import write_series as _write_series


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return write_synthetic_run(tmp_path_factory.mktemp("cluster") / "run")


def test_step_breakdown_sums_to_step_time(run):
    df = steps.step_breakdown(run)
    assert set(df["phase"]) == {"rollout", "reward", "forward", "backward", "allreduce", "optimizer", "(uninstrumented)"}
    per = df.group_by(["rank", "step"]).agg(pl.col("dur_ms").sum(), pl.col("step_ms").first())
    assert (per["dur_ms"] - per["step_ms"]).abs().max() < 0.01
    rem = df.filter(pl.col("phase") == "(uninstrumented)")["dur_ms"]
    assert rem.min() == pytest.approx(GAP, rel=0.01) and rem.max() == pytest.approx(GAP, rel=0.01)


def test_idle_time_names_waiting_ranks(run):
    df = steps.idle_time(run)
    slow = df.filter(pl.col("rank") == SLOW_RANK)
    fast = df.filter(pl.col("rank") != SLOW_RANK)
    assert slow["sync_wait_ms"].max() == 0.0
    assert slow["wait_ms"].mean() == pytest.approx(COLLECTIVE, rel=0.05)
    # the others wait ~50 ms for rank 2's backward, measured (barrier rows) and implied (busy times) alike
    assert fast["sync_wait_ms"].mean() == pytest.approx(BACKWARD * (SLOW_FACTOR - 1), rel=0.03)
    assert fast["idle_ms"].mean() == pytest.approx(BACKWARD * (SLOW_FACTOR - 1) + COLLECTIVE, rel=0.03)


def test_critical_path_is_the_straggler(run):
    df = steps.critical_path(run)
    assert len(df) == STEPS
    assert set(df["bound_rank"]) == {SLOW_RANK} and set(df["bound_phase"]) == {"backward"}
    assert df["phase_excess_ms"].mean() == pytest.approx(BACKWARD * (SLOW_FACTOR - 1), rel=0.03)
    assert set(df["longest_phase"]) == {"rollout"}


def test_straggler_scores_flag_exactly_the_planted_rank_and_phase(run):
    df = stragglers.straggler_scores(run, window=5)
    flagged = df.filter(pl.col("status") != "ok")
    assert flagged.select("rank", "phase", "status").rows() == [(SLOW_RANK, "backward", "persistent")]
    row = flagged.row(0, named=True)
    assert row["windows"] == STEPS // 5 and row["flagged_windows"] == STEPS // 5
    assert row["score"] == pytest.approx(1 / SLOW_FACTOR, rel=0.01)
    assert row["slowdown_x"] == pytest.approx(SLOW_FACTOR, rel=0.01)
    assert row["slow_steps_pct"] == 100.0
    med = stragglers.straggler_scores(run, window=5, baseline="median")
    assert med.filter(pl.col("status") != "ok")[["rank", "phase"]].rows() == [(SLOW_RANK, "backward")]
    with pytest.raises(ValueError):
        stragglers.straggler_scores(run, baseline="slowest")


def test_what_if_reproduces_measured_step_times(run):
    df = what_if_rank.what_if_steps(run)
    assert len(df) == STEPS and set(df["ranks"]) == {RANKS}
    assert ((df["simulated_base_ms"] - df["measured_ms"]).abs() / df["measured_ms"]).max() < 1e-6
    assert (df["saved_ms"] == 0).all()


def test_what_if_saving_matches_the_analytic_value(run):
    analytic_pct = 100 * BACKWARD * (SLOW_FACTOR - 1) / planted_step_ms()
    df = what_if_rank.what_if(run, by_phase=True)
    top = df.row(0, named=True)
    assert top["scenario"] in ("rank 2", "all ranks")
    by_rank = {r["scenario"]: r for r in df.iter_rows(named=True)}
    for name in ("rank 2", "rank 2 backward", "all ranks"):
        assert by_rank[name]["saved_pct"] == pytest.approx(analytic_pct, rel=0.02), name
        assert by_rank[name]["reproduction_error_pct"] < 1e-6
    for r in (0, 1, 3):  # making a fast rank median changes nothing
        assert abs(by_rank[f"rank {r}"]["saved_pct"]) < 0.2
    steps = what_if_rank.what_if_steps(run, ranks=[SLOW_RANK], phases=["backward"])
    assert steps["saved_ms"].mean() == pytest.approx(BACKWARD * (SLOW_FACTOR - 1), rel=0.02)


def test_rollout_long_tail_and_tail_wait_share(run):
    df = rollouts.rollout_long_tail(run)
    assert len(df) == STEPS
    row = df.row(0, named=True)
    assert row["samples"] == RANKS * SAMPLES_PER_RANK
    assert row["response_len_p50_tokens"] == ROLLOUT_SHORT and row["response_len_max_tokens"] == ROLLOUT_LONG
    assert row["gen_p50_ms"] == ROLLOUT_SHORT and row["gen_max_ms"] == ROLLOUT_LONG
    tw = rollouts.tail_wait_share(run)
    expect = 100 * (ROLLOUT_LONG - ROLLOUT_SHORT) / planted_step_ms()
    assert tw["tail_wait_ms"].to_list() == [ROLLOUT_LONG - ROLLOUT_SHORT] * STEPS
    assert tw["tail_wait_pct"].mean() == pytest.approx(expect, rel=0.01)


def test_zero_variance_groups(run):
    df = rollouts.zero_variance_groups(run)
    groups = RANKS * SAMPLES_PER_RANK // GROUP
    assert df["groups"].to_list() == [groups] * STEPS
    assert df["zero_variance_groups"].to_list() == [1] * STEPS
    assert df["zero_variance_pct"][0] == pytest.approx(100 / groups)
    assert df["wasted_samples"][0] == GROUP


def test_async_staleness(run):
    df = rollouts.async_staleness(run)
    # odd ranks consume samples one version stale from step 1 on
    stale = dict(zip(df["staleness_steps"].to_list(), df["samples"].to_list(), strict=True))
    odd = RANKS // 2 * SAMPLES_PER_RANK
    assert stale == {0: STEPS * RANKS * SAMPLES_PER_RANK - odd * (STEPS - 1), 1: odd * (STEPS - 1)}
    assert df["share_pct"].sum() == pytest.approx(100)


def test_rollout_train_overlap_and_weight_sync(tmp_path, run):
    df = rollouts.rollout_train_overlap(write_async_run(tmp_path / "async"))
    row = df.row(0, named=True)
    assert (row["wall_ms"], row["rollout_ms"], row["train_ms"], row["overlap_ms"]) == (400, 300, 250, 150)
    assert row["overlap_pct"] == pytest.approx(37.5) and row["disaggregated"]
    assert (row["weight_syncs"], row["weight_sync_ms"]) == (2, 20)
    # in the synchronous run every rank does both: overlap there is only jitter between ranks
    assert not rollouts.rollout_train_overlap(run)["disaggregated"][0]


def test_weight_syncs_are_the_overlapping_parts_of_one_step(tmp_path):
    """Two trainer ranks broadcasting at once are one sync; a rollout worker's load that its own step count
    also calls step 0, long after, is a sync of its own, not one 100 ms span with the trainers'."""
    ms = 1000
    for rank, (start, dur) in enumerate([(0, 10), (5, 7)]):
        with RunWriter(tmp_path / "syncs", rank=rank, world_size=3, role="trainer") as w:
            w.append("timings", {"phase": "weight_sync", "category": "comm", "step": 0,
                                 "start_us": T0 + start * ms, "dur_us": dur * ms})
    with RunWriter(tmp_path / "syncs", rank=2, world_size=3, role="rollout") as w:
        w.append("timings", {"phase": "weight_sync", "category": "phase", "step": [0, None],
                             "start_us": [T0 + 100 * ms, None], "dur_us": [3 * ms, 4 * ms]})
    with open_store(tmp_path / "syncs") as con:
        spans = sorted(r[2] for r in con.sql(rollouts.weight_syncs_sql()).fetchall())
    assert spans == [3 * ms, 4 * ms, 12 * ms]


def test_throughput_mfu_matches_hand_computed_flops(tmp_path):
    cfg = {"n_params": 1_000_000, "model": {"num_hidden_layers": 2, "hidden_size": 64}}
    for r in range(2):
        with RunWriter(tmp_path / "mfu", rank=r, world_size=2, config=cfg) as w:
            for step in range(3):
                w.append("timings", {"phase": "train", "category": "phase", "step": step, "start_us": T0,
                                     "dur_us": 100_000})
                w.append("timings", {"phase": "forward", "parent": "train", "category": "phase", "step": step,
                                     "start_us": T0, "dur_us": 30_000})
                if r == 0:
                    w.append("samples", {"step": step, "prompt_len": [10] * 8, "response_len": [20] * 8})
            w.append("system", {"time_us": T0, "device": "NVIDIA H100 80GB HBM3"})
    df = throughput.throughput_mfu(tmp_path / "mfu", peak_tflops=1.0)
    train = df.filter(pl.col("phase") == "train")
    assert train["rank"].to_list() == [0, 1] and train["tokens"].to_list() == [360.0, 360.0]
    flops = 6 * 1e6 * 120 + 6 * 2 * 64 * (8 * 30**2 / 2)  # per rank per step
    assert train["achieved_tflops"][0] == pytest.approx(flops / 0.1 / 1e12)
    assert train["mfu_pct"][0] == pytest.approx(100 * flops / 0.1 / 1e12)
    fwd = df.filter(pl.col("phase") == "forward").row(0, named=True)
    assert fwd["achieved_tflops"] == pytest.approx(flops / 3 / 0.03 / 1e12)
    assert throughput.throughput_mfu(tmp_path / "mfu")["peak_tflops"][0] == 989.0  # looked up from the device
    with pytest.raises(ValueError, match="peak"):
        throughput.throughput_mfu(tmp_path / "mfu", device="cpu")
    with RunWriter(tmp_path / "mfu", rank=0) as w:  # a run that logs its token count instead of samples
        w.append("scalars", {"step": 7, "key": "tokens", "value": 1000.0})
        w.append("timings", {"phase": "step", "category": "step", "step": 7, "start_us": T0, "dur_us": 500_000})
    step7 = throughput.throughput_mfu(tmp_path / "mfu", peak_tflops=1.0).filter(pl.col("phase") == "step")
    assert step7["tokens"].to_list() == [1000.0] and not step7["attention_included"][0]
    assert step7["achieved_tflops"][0] == pytest.approx(6 * 1e6 * 1000 / 0.5 / 1e12)
    assert throughput.peak_tflops_for("NVIDIA A10") == 125.0
    assert throughput.peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312.0
    assert throughput.peak_tflops_for("NVIDIA H100 PCIe") == 756.0
    assert throughput.peak_tflops_for("AMD Instinct MI300X") == 1307.4
    assert throughput.peak_tflops_for("cpu") is None


def test_detect_instability_finds_and_writes_events_once(tmp_path):
    run_dir = tmp_path / "unstable"
    _write_series(run_dir)
    df = instability.detect_instability(run_dir)
    assert write_detected_events(run_dir, df, instability.DETECTOR) == 4
    got = sorted((r["event"], r["step"]) for r in df.iter_rows(named=True))
    assert got == [("entropy_collapse", 20), ("grad_norm_spike", 25), ("nan_inf", 12), ("nan_inf", 33)]
    spike = df.filter(pl.col("event") == "grad_norm_spike").row(0, named=True)
    assert spike["rank"] == 1 and spike["robust_z"] > 6 and spike["value"] == 9.0
    assert "a.weight" in df.filter(pl.col("step") == 12)["source"][0]
    assert write_detected_events(run_dir, instability.detect_instability(run_dir), instability.DETECTOR) == 0
    with open_store(run_dir) as con:
        ev = con.sql("SELECT event, step, rank, role, fields_json FROM events WHERE role = 'analysis' "
                     "AND event <> 'run_end' ORDER BY step").fetchall()
    assert [(k, s, r) for k, s, r, _, _ in ev] == [("nan_inf", 12, 1), ("entropy_collapse", 20, 1),
                                                   ("grad_norm_spike", 25, 1), ("nan_inf", 33, 1)]
    assert json.loads(ev[2][4])["detector"] == "dynascope.instability"


def test_goodput_from_checkpoint_fault_restart_events(tmp_path):
    s = 1_000_000
    with RunWriter(tmp_path / "gp") as w:
        # steps 0-7 run, a fault hits during step 8, the job restarts from the step-5 checkpoint
        steps = list(range(8)) + list(range(5, 10))
        starts = [T0 + i * s for i in range(8)] + [T0 + 10.5 * s + i * s for i in range(5)]
        w.append("timings", {"phase": "step", "category": "step", "step": steps,
                             "start_us": [int(x) for x in starts], "dur_us": s})
        w.append("events", {"event": ["checkpoint_save", "fault", "restart", "checkpoint_load"],
                            "time_us": [T0 + 5 * s, int(T0 + 8.5 * s), T0 + 10 * s, int(T0 + 10.3 * s)],
                            "step": [5, None, 5, 5], "dur_us": [200_000, None, None, 300_000]})
    inc = goodput.goodput_incidents(tmp_path / "gp").row(0, named=True)
    assert inc["failure_source"] == "fault" and inc["last_checkpoint_step"] == 5
    assert (inc["lost_work_ms"], inc["downtime_ms"], inc["lost_steps"]) == (3500, 1500, 2)
    g = goodput.goodput_summary(tmp_path / "gp").row(0, named=True)
    assert g["wall_ms"] == 15_500 and g["checkpoint_save_ms"] == 200 and g["checkpoint_load_ms"] == 300
    assert (g["faults"], g["restarts"]) == (1, 1)
    assert g["goodput_pct"] == pytest.approx(100 * 10_000 / 15_500)


ALL = {
    "step_breakdown": lambda p: steps.step_breakdown(p), "idle_time": lambda p: steps.idle_time(p),
    "critical_path": lambda p: steps.critical_path(p), "straggler_scores": lambda p: stragglers.straggler_scores(p),
    "what_if": lambda p: what_if_rank.what_if(p), "what_if_steps": lambda p: what_if_rank.what_if_steps(p),
    "what_if_shared": lambda p: what_if_rank_shared.what_if_shared(p, ranks=[SLOW_RANK], devices=2),
    "schedule_inputs": lambda p: what_if_schedule_inputs.schedule_inputs(p),
    "schedule_what_if": lambda p: what_if_schedule.schedule_what_if(p),
    "schedule_staleness": lambda p: what_if_schedule.schedule_staleness(p),
    "rollout_long_tail": lambda p: rollouts.rollout_long_tail(p), "tail_wait_share": lambda p: rollouts.tail_wait_share(p),
    "zero_variance_groups": lambda p: rollouts.zero_variance_groups(p),
    "async_staleness": lambda p: rollouts.async_staleness(p),
    "rollout_train_overlap": lambda p: rollouts.rollout_train_overlap(p),
    "throughput_mfu": lambda p: throughput.throughput_mfu(p, n_params=1e6, peak_tflops=1.0),
    "detect_instability": lambda p: instability.detect_instability(p),
    "goodput": lambda p: goodput.goodput_summary(p), "goodput_incidents": lambda p: goodput.goodput_incidents(p),
}
MODULES = (steps, stragglers, what_if_rank, what_if_rank_shared, what_if_schedule, what_if_schedule_inputs, rollouts,
           throughput, instability, goodput, findings)


def test_public_names_resolve_from_the_package():
    for mod in MODULES:
        for name in mod.__all__:
            assert getattr(dynascope.analyses, name) is getattr(mod, name), name


def test_every_analysis_returns_an_empty_frame_with_its_columns_on_an_empty_run(tmp_path, run):
    RunWriter(tmp_path / "empty").close()
    assert findings.ranked_findings(tmp_path / "empty").is_empty()
    with open_store(tmp_path / "empty") as e, open_store(run) as f:
        for name, fn in ALL.items():
            empty, full = fn(e), fn(f)
            assert empty.is_empty(), name
            assert empty.columns == full.columns, name


def test_trace_only_rows_do_not_crash_step_analyses(tmp_path):
    with RunWriter(tmp_path / "trace", rank=0) as w:  # what a Kineto import writes: no step rows
        w.append("timings", {"phase": ["aten::mm", "nccl:all_reduce", "ProfilerStep#3"],
                             "category": ["kernel", "comm", "annotation"], "step": [None, None, 3],
                             "start_us": [T0, T0 + 10, T0], "dur_us": [5, 7, 100], "stream": 7})
    with open_store(tmp_path / "trace") as con:
        for fn in ALL.values():
            fn(con)  # no crash
    assert what_if_rank.what_if(tmp_path / "trace").is_empty()
    assert steps.critical_path(tmp_path / "trace").is_empty()


def test_imported_trace_rows_leave_step_analyses_unchanged(tmp_path, run):
    mixed = write_synthetic_run(tmp_path / "mixed", steps=4)
    with RunWriter(mixed, rank=0) as w:  # GPU rows of an imported trace: same steps, stream set, no parent
        w.append("timings", {"phase": ["ncclDevKernel_AllReduce", "cudaDeviceSynchronize", "sm90_gemm", "forward"],
                             "category": ["comm", "wait", "kernel", "annotation"], "step": 1,
                             "start_us": T0 + 5_000, "dur_us": 40_000, "stream": [7, 7, 7, None],
                             "device": "cuda:0"})
    plain = write_synthetic_run(tmp_path / "plain", steps=4)
    for fn in (steps.step_breakdown, steps.idle_time, steps.critical_path, what_if_rank.what_if_steps,
               stragglers.straggler_scores):
        # step_breakdown's rows come in no set order
        a, b = (fn(r).drop("run_id").sort(pl.all()) if fn is steps.step_breakdown else fn(r).drop("run_id")
                for r in (mixed, plain))
        assert a.height and a.equals(b), fn.__name__


@pytest.mark.parametrize("analysis", ["step_breakdown", "idle_time", "critical_path", "phase_shares"])
def test_step_analyses_scan_timings_once(run, monkeypatch, analysis):
    # On a live run each scan of timings lists and opens every writer's files: the phases and the step rows
    # come from one materialized scan, not one each (and no query to list the names first).
    from dynascope.analyses import step_shares
    from dynascope.store.reader import StoreConnection

    scans = []
    frame = StoreConnection.frame
    monkeypatch.setattr(StoreConnection, "frame", lambda self, sql, params=None: scans.append(
        len(re.findall(r"\bFROM timings\b", sql))) or frame(self, sql, params))
    got = getattr(steps if hasattr(steps, analysis) else step_shares, analysis)(run)
    assert got.height and [n for n in scans if n] == [1]


def test_findings_queries_scan_timings_once(run):
    from dynascope.analyses import findings_sql, findings_steps

    queries = [findings_sql.idle_sql("r"), findings_sql.uninstrumented_sql("r"),
               findings_sql.probe_cost_sql("r", "dynascope"), findings_sql.schedule_sql("r", ("rollout",), ("sync",)),
               findings_steps._per_rank_sql("r")]
    assert [len(re.findall(r"\bFROM timings\b", sql)) for sql in queries] == [1] * 5


def test_a_null_category_counts_as_a_phase_in_every_step_analysis(tmp_path):
    # NULL category means 'phase' (trace imports and hand-written rows leave it out): the same run written
    # with NULL and with 'phase' must give the same answers, row for row.
    from dynascope.analyses import step_shares

    for name, category in (("null", None), ("phase", "phase")):
        for r in range(3):
            with RunWriter(tmp_path / name, rank=r) as w:
                for step in range(4):
                    t = T0 + step * 10**6
                    w.append("timings", {"phase": ["fwd", "bwd", "sync"], "step": step,
                                         "category": [category, category, "wait"],
                                         "start_us": [t, t + 1_000, t + 3_000 + 500 * r],
                                         "dur_us": [1_000, 2_000 + 500 * r, 1_500 - 500 * r]})
                    w.append("timings", {"phase": "step", "category": "step", "step": step, "start_us": t,
                                         "dur_us": 5_000})
    for f in (steps.step_breakdown, steps.idle_time, steps.critical_path, step_shares.phase_shares):
        null, phase = (f(tmp_path / n).drop("run_id").sort(pl.all()) for n in ("null", "phase"))
        assert null.height and null.equals(phase), f.__name__
    assert set(steps.step_breakdown(tmp_path / "null")["phase"]) == {"fwd", "bwd", "sync", "(uninstrumented)"}


@pytest.mark.parametrize("n_ranks", [2, 3])
def test_what_if_one_pass_equals_simulating_each_rank(tmp_path, n_ranks):
    """what_if prices every rank in one vectorized pass; it must agree with simulating each rank alone."""
    rng = random.Random(n_ranks)
    for r in range(n_ranks):
        with RunWriter(tmp_path / "rand", rank=r) as w:
            for step in range(6):
                # two sync points; a phase order that differs by rank; a gap nobody instrumented
                order = ["a", "b", "sync1", "c", "sync2", "d"] if r % 2 else ["b", "a", "sync1", "c", "sync2", "d"]
                t, rows = T0 + step * 10**7, {"phase": [], "start_us": [], "dur_us": [], "category": []}
                for p in order:
                    d = rng.randint(1_000, 90_000)
                    rows["phase"].append(p)
                    rows["start_us"].append(t)
                    rows["dur_us"].append(d)
                    rows["category"].append("wait" if p.startswith("sync") else "phase")
                    t += d
                w.append("timings", {**rows, "step": step})
                w.append("timings", {"phase": "step", "category": "step", "step": step, "start_us": T0 + step * 10**7,
                                     "dur_us": t - T0 - step * 10**7 + rng.randint(0, 20_000)})
    df = what_if_rank.what_if(tmp_path / "rand", by_phase=True)
    assert df.height == n_ranks * 6 + 1  # per rank, per (rank, busy phase incl. remainder), all ranks
    for row in df.iter_rows(named=True):
        ranks = "all" if row["rank"] is None else [row["rank"]]
        phases = None if row["phase"] is None else [row["phase"]]
        direct = what_if_rank.what_if_steps(tmp_path / "rand", ranks=ranks, phases=phases)["saved_ms"].sum()
        assert row["saved_ms"] == pytest.approx(direct, abs=1e-6), row["scenario"]
