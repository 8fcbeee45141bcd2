"""The dashboard without a browser: its server process and launcher (warm imports, the path check, loopback
by default), and the numbers behind its charts, checked against the raw rows of the same fixture store that
``test_dashboard_browser`` serves."""

from __future__ import annotations

import time
import urllib.request

import polars as pl
import pytest
from dashboard_fixtures import make_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from dynascope.store import open_store

    with open_store(make_store(tmp_path_factory.mktemp("numbers"))) as s:
        yield s


def test_server_warms_its_imports_without_noise(tmp_path):
    """The server process (dynascope.dashboard.serve) imports the pages during start-up; its log must stay
    free of tracebacks and of the "No runtime found" warning an import before the runtime would log."""
    from dashboard_fixtures import write_small_run

    from dynascope.dashboard.serve import serving

    log = tmp_path / "server.log"
    with serving(write_small_run(tmp_path / "run"), log=log) as base:
        with urllib.request.urlopen(f"{base}/", timeout=30) as r:
            assert r.status == 200
        deadline = time.monotonic() + 60  # the warm-up thread runs on after the server is healthy
        while "dynascope: dashboard pages loaded" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    text = log.read_text()
    assert "You can now view your Streamlit app" in text and "dynascope: dashboard pages loaded in" in text, text
    assert "No runtime found" not in text and "Traceback" not in text, text[-2000:]
    assert "found in sys.modules" not in text, text[-2000:]  # runpy's warning: the package imported serve itself


def test_launch_checks_path_and_warns_off_loopback(tmp_path, monkeypatch, capsys):
    from dynascope.dashboard import serve as dashboard
    from dynascope.store import StoreError

    with pytest.raises(StoreError, match="no such file"):
        dashboard.launch(tmp_path / "missing")
    root = make_store(tmp_path / "root")
    calls = []

    class FakeServer:  # stands in for the Streamlit process: records the command line, exits at once
        def __init__(self, cmd: list[str]) -> None:
            calls.append(cmd)

        def wait(self, timeout: float | None = None) -> int:
            return 0

    monkeypatch.setattr(dashboard.subprocess, "Popen", FakeServer)
    assert dashboard.launch(root, host="127.0.0.1", port=8765) == 0
    assert "no authentication" not in capsys.readouterr().err
    dashboard.launch(root, host="0.0.0.0", port=8766)
    assert "no authentication" in capsys.readouterr().err
    cmd = calls[-1]
    assert cmd[cmd.index("--server.address") + 1] == "0.0.0.0" and cmd[cmd.index("--server.port") + 1] == "8766"
    assert cmd[-2:] == ["--", str(root.resolve())] and cmd[cmd.index("--server.headless") + 1] == "true"
    assert [dashboard.is_loopback(h) for h in ("localhost", "127.0.0.2", "::1", "0.0.0.0", "10.0.0.1")] == \
        [True, True, True, False, False]


def test_server_process_binds_loopback_unless_told():
    """``python -m dynascope.dashboard.serve run app.py`` adds 127.0.0.1 where Streamlit would bind every
    interface; an explicit address is kept."""
    from dynascope.dashboard.serve import server_args

    assert server_args(["run", "app.py", "--", "/runs"]) == \
        ["run", "app.py", "--server.address", "127.0.0.1", "--", "/runs"]
    assert server_args(["run", "app.py", "--server.address", "0.0.0.0"]).count("--server.address") == 1
    assert server_args(["run", "app.py", "--server.address=::1"]) == ["run", "app.py", "--server.address=::1"]
    assert server_args(["version"]) == ["version"]


def test_heatmap_cells_pool_the_raw_rows(store):
    """A heat-map cell is √Σ‖ΔW‖²/√Σ‖W‖² and Σchanged/Σnumel of its rows, checked against the raw table."""
    from dynascope.dashboard.queries import params

    cube = params.param_cube(store, "grpo-sync")
    hm = params.layer_heatmap(cube, ("sft", "rl"), ("q", "k", "mlp"))
    raw = store.sql("SELECT step, update_norm, w_norm, changed_count, numel FROM tensor_stats "
                    "WHERE run_id = 'grpo-sync' AND layer = 2 AND kind IN ('q', 'k', 'mlp') AND step = 11").pl()
    cell = hm.filter((pl.col("layer") == 2) & (pl.col("step") == 11)).row(0, named=True)
    upd = raw.filter(pl.col("update_norm").is_not_null())  # ‖W‖ of the rows that have an update
    assert cell["update ratio ‖ΔW‖/‖W‖"] == pytest.approx(
        (upd["update_norm"] ** 2).sum() ** 0.5 / (upd["w_norm"] ** 2).sum() ** 0.5)
    assert cell["step-changed fraction"] == pytest.approx(raw["changed_count"].sum() / raw["numel"].sum())
    nf = params.nonfinite_steps(cube, "grpo-sync")
    assert nf["step"].to_list() == [13] and nf["nan"].to_list() == [3]
    named = params.nonfinite_tensors(store, "grpo-sync", (13,))
    assert named.height == 1 and named["nonfinite"].item() == 3


def test_per_step_sums_from_the_rollup_equal_the_raw_rows(store):
    """The page's series read tensor_stats_by_kind; pooling tensor_stats_global (the fallback for runs
    written before the rollup existed) must give the same frame."""
    from dynascope.dashboard.queries import params
    from dynascope.store.pooling import GLOBAL

    cube = params.param_cube(store, "grpo-sync").filter(pl.col("per_step"))
    raw = store.frame(f"""
        SELECT true AS per_step, step, CAST(NULL AS BIGINT) AS bucket, CAST(NULL AS INTEGER) AS layer,
               {params._KEYS}, {params._pooled_sql(params._SUMS, GLOBAL)}
        FROM {GLOBAL} WHERE run_id = 'grpo-sync' AND step IS NOT NULL GROUP BY ALL""").cast(cube.schema)
    assert cube.height > 0 and store.sql("SELECT count(*) FROM tensor_stats_by_kind").fetchall()[0][0] > 0
    key = ["step", "kind", "stage"]
    a, b = cube.sort(key), raw.sort(key)
    assert a.select(key).equals(b.select(key))
    assert {"update_sq", "update_w_sq", "changed_count", "changed_numel", "bf16_unchanged_count", "drift_sq",
            "drift_w_sq", "grad_zero_count", "grad_near_zero_count", "grad_numel", "w_nan_count"} <= set(params._SUMS)
    for col in params._SUMS:
        x, y = a[col].to_list(), b[col].to_list()
        assert [v is None for v in x] == [v is None for v in y], col  # NULL sums match exactly
        assert [v for v in x if v is not None] == pytest.approx([v for v in y if v is not None], rel=1e-12,
                                                                 nan_ok=True), col


def test_overlay_and_gradients_follow_the_stages(store):
    from dynascope.dashboard.queries import params

    cube = params.param_cube(store, "grpo-sync")
    kinds = tuple(params.stages_and_kinds(cube)["kind"].unique())
    ov = params.stage_overlay(cube, "grpo-sync", kinds)
    by_stage = {s: g for (s,), g in ov.group_by("stage")}
    # Stages in the order the run reached them, as the per-step charts list them: the same colour each
    assert ov["stage"].unique(maintain_order=True).to_list() == ["sft", "rl"]
    assert by_stage["sft"]["step_in_stage"].min() == 0 and by_stage["rl"]["first_step"].min() == 9
    # The fixture's RL steps move an order of magnitude less and change a smaller share than SFT.
    assert by_stage["rl"]["update_ratio"].mean() < by_stage["sft"]["update_ratio"].mean() / 5
    assert by_stage["rl"]["changed_frac"].max() < by_stage["sft"]["changed_frac"].min()
    gh = params.grad_health(cube, "grpo-sync", kinds)
    assert gh.filter(pl.col("step") > 8)["grad_zero_frac"].min() > gh.filter(pl.col("step") <= 8)["grad_zero_frac"].max()


def test_cluster_queries_find_the_slow_rank(store):
    from dynascope.analyses import what_if
    from dynascope.dashboard.queries import cluster
    from dynascope.dashboard.queries.ranks import with_rank_costs

    sc = with_rank_costs(cluster.straggler_table(store, "grpo-sync"), what_if(store, "grpo-sync"))
    slow = sc.row(0, named=True)
    assert slow["rank"] == 1 and slow["slowest_share_pct"] == 100.0 and slow["whatif_saved_ms"] > 0 and slow["slow"]
    # the fast rank is the slowest in no step: capping it at the median saves next to nothing
    assert sc.filter(pl.col("rank") == 0)["whatif_saved_ms"].item() < 0.05 * slow["whatif_saved_ms"]
    assert not sc.filter(pl.col("rank") == 0)["slow"].item()
    bd = cluster.phase_breakdown(store, "grpo-sync")
    per_rank = bd.group_by("rank").agg(pl.col("ms_per_step").sum()).sort("rank")["ms_per_step"].to_list()
    steps = store.sql("SELECT rank, avg(dur_us) / 1000 FROM timings WHERE run_id = 'grpo-sync' AND phase = 'step' "
                      "GROUP BY rank ORDER BY rank").fetchall()
    assert per_rank == pytest.approx([s[1] for s in steps])  # phases + un-instrumented = the step
    assert per_rank[0] == pytest.approx(per_rank[1], rel=0.05)  # synchronous: the fast rank waits
    g = cluster.gantt(store, "grpo-sync", 20, 22, limit=5)
    assert g.height == 5 and g["total"][0] > 5 and g["dur_ms"].is_sorted(descending=True)


def test_cluster_queries_match_the_step_analyses(store):
    """The page's breakdown and busy-time queries skip the analyses' per-phase grouping; the numbers must not move."""
    from dynascope.analyses import step_breakdown
    from dynascope.analyses.steps import top_level_sql
    from dynascope.dashboard.queries import cluster

    sb = step_breakdown(store, run="grpo-sync")
    n = sb.filter(pl.col("step_ms").is_not_null()).group_by("role", "rank").agg(pl.col("step").n_unique().alias("n"))
    want = (sb.group_by("role", "rank", "phase").agg(pl.col("dur_ms").sum()).join(n, on=["role", "rank"])
            .select("role", "rank", "phase", (pl.col("dur_ms") / pl.col("n")).alias("ms_per_step")).sort(pl.all()))
    got = cluster.phase_breakdown(store, "grpo-sync").sort(pl.all())
    assert got.select("role", "rank", "phase").equals(want.select("role", "rank", "phase"))
    assert got["ms_per_step"].to_list() == pytest.approx(want["ms_per_step"].to_list(), rel=1e-12)
    busy = store.sql(f"SELECT rank, avg(d) / 1000.0 FROM (SELECT rank, step, sum(dur_us) AS d FROM "
                     f"({top_level_sql('grpo-sync')}) WHERE NOT sync GROUP BY ALL) GROUP BY rank ORDER BY rank").fetchall()
    sc = cluster.straggler_table(store, "grpo-sync").sort("rank")
    assert sc["mean_busy_ms"].to_list() == pytest.approx([b for _, b in busy], rel=1e-12)


def test_spectra_series_matches_rank1_dominance(store):
    """The chart's push-down query and the analysis agree on Σσ₁²/Σ‖ΔW‖² at every step."""
    from dynascope.analyses import rank1_dominance
    from dynascope.dashboard.queries import params

    kinds = tuple(store.sql("SELECT DISTINCT kind FROM spectra").pl()["kind"])
    mine = params.spectra_series(store, ("grpo-sync",), kinds).sort("step")
    theirs = rank1_dominance(store, run="grpo-sync").filter(pl.col("level") == "overall").sort("step")
    assert mine["step"].to_list() == theirs["step"].to_list()
    assert mine["rank1"].to_list() == pytest.approx(theirs["rank1_energy"].to_list())
