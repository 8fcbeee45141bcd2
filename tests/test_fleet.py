"""The fleet summary's figures are the package's analyses of the same quantities, run by run.

Each column is held against the analysis a user would call for it on one run (straggler_scores,
delta_sync_bytes, phase_shares, rank1_dominance, list_runs) on a fleet of a 3-rank run with a straggler,
a 1-rank run and the schema-v1 fixture; Spark's frame is held equal to this one in test_spark.py.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal
from typer.testing import CliRunner

from dynascope.analyses.delta_sync import delta_sync_bytes
from dynascope.analyses.dynamics import rank1_dominance
from dynascope.analyses.fleet import FLEET_COLUMNS, fleet_summary
from dynascope.analyses.rollouts import ROLLOUT_PHASES
from dynascope.analyses.step_shares import phase_shares
from dynascope.analyses.stragglers import straggler_scores
from dynascope.cli import app
from dynascope.store import at_rest, open_store
from dynascope.store.catalog import list_runs

from helpers.fleet_runs import write_synthetic_run
from helpers.waiting import wait_until

V1 = Path(__file__).parent / "fixtures" / "v1run"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fleet") / "runs"
    write_synthetic_run(root / "multi", ranks=3, steps=24, seed=1, flush_every=5)
    write_synthetic_run(root / "single", ranks=1, steps=12, seed=2)
    shutil.copytree(V1, root / "v1run")
    # At rest before any test reads or copies them: the last close leaves the fold's deletions to a process
    # of its own (at_rest.settle_later), and a copy made meanwhile meets directories it is removing.
    for run in ("multi", "single"):
        wait_until(lambda r=run: at_rest.settle(root / r, time.monotonic() + 30), f"{run} to come to rest", 120)
    return root


@pytest.fixture(scope="module")
def summary(fleet: Path) -> pl.DataFrame:
    seen: list[tuple[int, int]] = []
    out = fleet_summary(fleet, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 3), (2, 3), (3, 3)]  # the listing reports run by run (the CLI draws a bar from it)
    return out


def _close(a: float | None, b: float | None, rel: float = 1e-12) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, rel_tol=rel))


def test_one_row_per_run_with_every_column(summary: pl.DataFrame) -> None:
    assert summary["run_id"].to_list() == ["multi", "single", "v1run"]
    stages = ["median_update_ratio_rl", "median_update_ratio_sft"]
    assert summary.columns == [*list(FLEET_COLUMNS)[:10], *stages, *list(FLEET_COLUMNS)[10:]]
    v1 = summary.row(2, named=True)
    assert v1["median_bf16_unchanged_frac_rl"] is None and v1["last_drift_unchanged_frac"] is None  # not recorded
    assert v1["steps"] == 4 and v1["median_update_ratio_rl"] is not None  # read under v2's names


def test_status_steps_and_ranks_are_what_dynascope_runs_says(fleet: Path, summary: pl.DataFrame) -> None:
    runs = list_runs(fleet).sort("run_id")
    assert summary.select("run_id", "status", "steps", "ranks").rows() == runs.select(
        "run_id", "status", "steps", "ranks").rows()
    assert summary["ranks"].to_list() == [3, 1, 1]


def test_the_straggler_is_straggler_scores_first_row(fleet: Path, summary: pl.DataFrame) -> None:
    with open_store(fleet) as con:
        for row in summary.iter_rows(named=True):
            scores = straggler_scores(con, row["run_id"])
            if scores.is_empty():
                assert row["slowest_rank"] is None and row["straggler_score"] is None
                continue
            first = scores.row(0, named=True)
            assert (row["slowest_rank"], row["slowest_phase"]) == (first["rank"], first["phase"])
            assert _close(row["straggler_score"], first["score"])
    multi = summary.row(0, named=True)
    assert multi["slowest_rank"] == 2 and multi["straggler_score"] < 0.75  # the slow rank, 1.5x slower


def test_s1_is_delta_sync_bytes_per_rl_step_median(fleet: Path, summary: pl.DataFrame) -> None:
    with open_store(fleet) as con:
        for run_id in ("multi", "single"):
            steps = delta_sync_bytes(con, run_id, stage="rl")
            want = (1 - steps["changed_pct"] / 100).median()
            got = summary.filter(pl.col("run_id") == run_id)["median_bf16_unchanged_frac_rl"].item()
            assert steps.height > 5 and _close(got, want, 1e-12), run_id


def test_rollout_share_step_time_and_sparsity_follow_their_analyses(fleet: Path, summary: pl.DataFrame) -> None:
    with open_store(fleet) as con:
        for row in summary.iter_rows(named=True):
            run_id = row["run_id"]
            shares = phase_shares(con, run_id)
            total = shares.unique(["role", "stage"]).select(pl.col("step_ms").sum()).item()
            rollout = shares.filter(pl.col("phase").is_in(ROLLOUT_PHASES))["dur_ms"].sum()
            assert _close(row["all_steps_rollout_pct"], 100 * rollout / total), run_id
            step_ms = con.frame(f"""SELECT median(ms) AS ms FROM (SELECT step, max(dur_us) / 1000.0 AS ms
                FROM timings WHERE run_id = '{run_id}' AND category = 'step' GROUP BY step)""")["ms"].item()
            assert _close(row["median_step_ms"], step_ms), run_id
            r1 = rank1_dominance(con, run_id).filter(pl.col("level") == "overall").sort("step")
            # Σ(rank1_energy·‖ΔW‖²)/Σ‖ΔW‖² against Σσ₁²/Σ‖ΔW‖²: the probe computes rank1_energy in the
            # weights' dtype (float32 here), so the two agree to its precision
            assert _close(row["last_rank1_energy"], r1["rank1_energy"][-1], 1e-6), run_id
            mk = con.frame(f"""SELECT sum(drift_unchanged_count) / sum(numel) AS f FROM tensor_stats
                WHERE run_id = '{run_id}' AND rank = 0 AND step = (SELECT max(step) FROM tensor_stats
                WHERE run_id = '{run_id}' AND drift_unchanged_count IS NOT NULL)""")["f"].item()
            assert _close(row["last_drift_unchanged_frac"], mk), run_id
            per_stage = con.frame(f"""SELECT stage, median(r) AS r FROM (SELECT stage, step,
                sqrt(sum(update_norm * update_norm) / sum(w_norm * w_norm)) AS r FROM tensor_stats
                WHERE run_id = '{run_id}' AND update_norm IS NOT NULL GROUP BY stage, step) GROUP BY stage""")
            for stage, ratio in per_stage.iter_rows():
                assert _close(row[f"median_update_ratio_{stage}"], ratio, 1e-9), (run_id, stage)


def test_runs_without_rollups_give_the_same_figures_from_their_rows(fleet: Path, summary: pl.DataFrame,
                                                                    tmp_path: Path) -> None:
    root = tmp_path / "runs"
    shutil.copytree(fleet / "multi", root / "multi")
    for wdir in (root / "multi" / "tensor_stats_by_kind").glob("writer=*"):
        if wdir.name != "writer=_schema":  # the writers' rows, or what they were folded into at rest
            shutil.rmtree(wdir)  # a run written before the rollup existed
    with open_store(root) as con:
        assert con.rows("SELECT count(*) FROM tensor_stats_by_kind") == [(0,)]
    got = fleet_summary(root).drop("path")
    want = summary.filter(pl.col("run_id") == "multi").drop("path")
    for col in want.columns:
        a, b = got[col].item(), want[col].item()
        assert _close(a, b, 1e-12) if isinstance(a, float) else a == b, col


def test_dynascope_fleet_writes_the_frame_and_takes_a_lease(fleet: Path, summary: pl.DataFrame, tmp_path: Path) -> None:
    out = tmp_path / "fleet.parquet"
    res = CliRunner().invoke(app, ["fleet", str(fleet), "-o", str(out)])
    assert res.exit_code == 0, res.output
    # DuckDB sums in whatever order its threads meet the rows: equal to the last bits, not bitwise
    assert_frame_equal(pl.read_parquet(out), summary, rel_tol=1e-12, abs_tol=0.0)
    assert list((fleet / "_leases").glob("*.json")) == []  # released
    shown = CliRunner().invoke(app, ["fleet", str(fleet)])
    assert shown.exit_code == 0 and "straggler_score" in shown.stdout and "multi" in shown.stdout
    bad = CliRunner().invoke(app, ["fleet", str(fleet), "--engine", "hive"])
    assert bad.exit_code == 2 and "unknown --engine 'hive'" in bad.output
