"""phase_shares and probe_cost sum in DuckDB; here they are held to the plain definition over
step_breakdown's per-rank, per-step, per-phase rows (how both were computed before), on a run with the
cases that tell the two apart: two roles, nested and one-off phases, a step without a step row, steps
labelled by tensor_stats (through the by_kind rollup), by scalars or not at all, the probe's own phase, and
a run whose rollup is missing (its stages then come from tensor_stats)."""

from __future__ import annotations

import shutil

import polars as pl
import pytest

from dynascope.analyses import phase_shares, probe_cost
from dynascope.analyses.probe_time import PROBE_PHASE
from dynascope.analyses.steps import step_breakdown
from dynascope.store import RunWriter, open_store

KEYS = ["run_id", "role", "rank", "step"]


def naive_stages(con, run: str) -> pl.DataFrame:
    labelled = pl.concat([
        con.frame(f"SELECT run_id, coalesce(role, '') AS role, rank, step, stage, 0 AS pref FROM {t} "
                  f"WHERE stage IS NOT NULL AND step IS NOT NULL AND run_id = '{run}'")
        for t in ("tensor_stats",)] + [
        con.frame(f"SELECT run_id, coalesce(role, '') AS role, rank, step, stage, 1 AS pref FROM scalars "
                  f"WHERE stage IS NOT NULL AND step IS NOT NULL AND run_id = '{run}'")])
    counted = labelled.group_by([*KEYS, "stage", "pref"]).len("n")
    return counted.sort("pref", pl.col("n").cast(pl.Int64) * -1, "stage").group_by(KEYS).agg(pl.col("stage").first())


def naive_phase_shares(con, run: str) -> pl.DataFrame:
    b = step_breakdown(con, run).filter(pl.col("step_ms").is_not_null()).join(naive_stages(con, run), on=KEYS,
                                                                              how="left", nulls_equal=True)
    groups = ["run_id", "role", "stage"]
    totals = b.unique(KEYS).group_by(groups).agg(pl.col("step").n_unique().alias("steps"), pl.col("step_ms").sum())
    per = b.group_by([*groups, "phase"]).agg(pl.col("dur_ms").sum())
    return (per.join(totals, on=groups, how="left", nulls_equal=True)
            .with_columns((100 * pl.col("dur_ms") / pl.col("step_ms")).alias("share_pct")))


def naive_probe_cost(con, run: str) -> dict:
    b = step_breakdown(con, run).filter(pl.col("step_ms").is_not_null())
    steps = b.unique(KEYS)
    ts = con.frame(f"SELECT update_norm, step FROM tensor_stats WHERE run_id = '{run}' AND step IS NOT NULL")
    probe = b.filter(pl.col("phase") == PROBE_PHASE)["dur_ms"].sum()
    return {"steps": steps["step"].n_unique(), "probe_ms": probe, "step_ms": steps["step_ms"].sum(),
            "probe_pct": 100 * probe / steps["step_ms"].sum(), "recorded_steps": ts["step"].n_unique(),
            "coverage_pct": 100 * ts["update_norm"].count() / ts.height}


def write_run(run, steps: int = 12, probe: bool = True) -> None:
    """Trainers 0-2 and a rollout worker 0 (ranks of two roles numbered from 0 each)."""
    writers = [RunWriter(run, rank=r, role="trainer", world_size=3, flush_secs=60) for r in range(3)]
    writers.append(RunWriter(run, rank=0, role="rollout", world_size=1, flush_secs=60))
    t = 1_700_000_000_000_000
    for step in range(steps):
        for i, w in enumerate(writers):
            trainer = i < 3
            phases = ([("forward", 40_000 + 1000 * i, "phase"), ("backward", 80_000 * (1.3 if i == 2 else 1), "phase"),
                       ("grad_reduce", 5_000, "comm"), (PROBE_PHASE if probe else "log", 700 + 10 * step, "phase"),
                       ("optimizer", 9_000, "phase")] if trainer else
                      [("rollout", 120_000 + 3000 * step, "phase"), ("train_wait", 10_000, "wait")])
            if step == 5 and i == 0:
                phases.append(("eval", 300_000, "phase"))  # a one-off phase
            start, names = t, []
            for name, us, cat in phases:
                names.append((name, start, int(us), cat))
                start += int(us)
            w.append("timings", {"step": step, "phase": [n[0] for n in names], "start_us": [n[1] for n in names],
                                 "dur_us": [n[2] for n in names], "category": [n[3] for n in names]})
            # a nested phase, inside forward: summed into nothing at the top level
            w.append("timings", {"step": step, "phase": "attention", "parent": "forward", "start_us": t,
                                 "dur_us": 10_000, "category": "phase"})
            if not (step == 7 and i == 1):  # rank 1 lost the step row of step 7
                w.append("timings", {"step": step, "phase": "step", "category": "step", "start_us": t,
                                     "dur_us": start - t + 2_000})
            stage = "sft" if step < 4 else "rl"
            if trainer and step % 3 == 0:  # tensor_stats on some steps, with a minority label
                w.append("tensor_stats", {"step": step, "stage": [stage] * 3 + ["other"], "tensor": list("abcd"),
                                          "numel": 10, "update_norm": [1.0, None, 2.0, 3.0], "sharded": True})
            elif step % 3 == 1 and i != 1:  # scalars label the others (rank 1 never)
                w.append("scalars", {"step": step, "stage": stage, "key": "loss", "value": 1.0})
        t = start + 10_000
    for w in writers:
        w.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sums")
    write_run(root / "rolled")
    write_run(root / "unrolled")
    write_run(root / "unprobed", probe=False)
    shutil.rmtree(root / "unrolled" / "tensor_stats_by_kind")  # as written before the rollup existed
    with open_store(root) as con:
        yield con


@pytest.mark.parametrize("run", ["rolled", "unrolled"])
def test_phase_shares_equal_the_per_row_definition(runs, run):
    got = phase_shares(runs, run)
    want = naive_phase_shares(runs, run)
    key = ["role", "stage", "phase"]
    got, want = got.sort(key, nulls_last=True), want.sort(key, nulls_last=True)
    assert got.height == want.height > 20
    assert got.select(key).equals(want.select(key))
    assert set(got["stage"].to_list()) == {"sft", "rl", None}  # steps labelled by each source, and unlabelled
    for col in ("dur_ms", "step_ms", "share_pct"):
        assert got[col].to_list() == pytest.approx(want[col].to_list(), rel=1e-12), col
    assert got["steps"].to_list() == want["steps"].cast(pl.UInt32).to_list()
    # within a (role, stage) the shares, the remainder included, add up to the step time
    assert got.group_by("role", "stage").agg(pl.col("share_pct").sum())["share_pct"].to_list() == \
        pytest.approx([100.0] * got.select("role", "stage").unique().height)


@pytest.mark.parametrize("run", ["rolled", "unrolled"])
def test_probe_cost_equals_the_per_row_definition(runs, run):
    got = probe_cost(runs, run).row(0, named=True)
    want = naive_probe_cost(runs, run)
    assert got["steps"] == want["steps"] and got["recorded_steps"] == want["recorded_steps"]
    for col in ("probe_ms", "step_ms", "probe_pct", "coverage_pct"):
        assert got[col] == pytest.approx(want[col], rel=1e-12), col


def test_a_run_without_the_probe_phase_has_no_probe_cost(runs):
    assert probe_cost(runs, "unprobed").is_empty()
    assert set(probe_cost(runs)["run_id"]) == {"rolled", "unrolled"}
