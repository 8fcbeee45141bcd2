"""`dynascope report` end to end: findings on the planted 4-rank run, rendered by the real CLI in every format."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from dynascope.analyses.findings import ranked_findings
from dynascope.analyses.throughput import throughput_mfu
from dynascope.cli import app
from dynascope.store import RunWriter, open_store, run_sql

from helpers.planted_cluster import (
    BACKWARD,
    SLOW_FACTOR,
    SLOW_RANK,
    planted_step_ms,
    write_async_run,
    write_synthetic_run,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("report")
    return {"straggler": write_synthetic_run(root / "straggler"),
            "even": write_synthetic_run(root / "even", steps=10, slow_rank=None)}


def test_findings_name_the_straggler_and_rank_by_time_at_stake(runs):
    df = ranked_findings(runs["straggler"])
    assert df.columns == ["position", "run_id", "finding", "severity", "at_stake_ms", "at_stake_pct", "sentence",
                          "numbers_json", "sql"]
    assert df["position"].to_list() == list(range(1, df.height + 1))  # a place in the ranking, not a process rank
    assert df["at_stake_ms"].to_list() == sorted(df["at_stake_ms"].to_list(), reverse=True)
    strag = df.filter(pl.col("finding") == "straggler")
    assert strag.height == 1
    row = strag.row(0, named=True)
    assert row["sentence"].startswith(f"rank {SLOW_RANK} (trainer) is 1.50× slower in backward")
    assert "100% of steps" in row["sentence"] and "persistent" in row["sentence"]
    nums = json.loads(row["numbers_json"])
    assert (nums["rank"], nums["phase"]) == (SLOW_RANK, "backward")
    assert row["at_stake_pct"] == pytest.approx(100 * BACKWARD * (SLOW_FACTOR - 1) / planted_step_ms(), rel=0.02)
    tail = df.filter(pl.col("finding") == "rollout_tail").row(0, named=True)
    assert tail["sentence"].startswith("45% of RL step time is tail wait after the median rollout finished")
    assert "zero_variance_groups" in df["finding"].to_list()


def test_even_run_has_no_straggler_finding(runs):
    kinds = ranked_findings(runs["even"])["finding"].to_list()
    assert "straggler" not in kinds and "imbalance" not in kinds and "rollout_tail" in kinds


def test_async_run_reports_overlap_and_sync_run_does_not(runs, tmp_path):
    df = ranked_findings(write_async_run(tmp_path / "async"))
    row = df.filter(pl.col("finding") == "async_overlap").row(0, named=True)
    assert row["sentence"] == ("rollout and training overlapped 38% of wall time (150 ms); 100 ms of the shorter "
                               "side ran alone; weight sync took 20 ms over 2 syncs")
    assert row["at_stake_ms"] == 120
    assert "async_overlap" not in ranked_findings(runs["straggler"])["finding"].to_list()


def test_every_findings_sql_runs_on_a_read_only_store(runs):
    df = ranked_findings(runs["straggler"])
    with open_store(runs["straggler"]) as con:
        for sql in df["sql"]:
            assert run_sql(con, sql).num_rows > 0, sql
        slow = run_sql(con, df.filter(pl.col("finding") == "straggler")["sql"][0]).to_pylist()
    assert slow[0]["rank"] == SLOW_RANK  # the backing query shows the slow rank first


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.items = 0

    def handle_starttag(self, tag, attrs):
        if tag not in ("meta", "br"):
            self.stack.append(tag)
        self.items += tag == "li"

    def handle_endtag(self, tag):
        assert self.stack.pop() == tag


@pytest.mark.parametrize("fmt", ["text", "markdown", "html"])
def test_cli_report_renders_every_format(runs, tmp_path, fmt):
    out = tmp_path / f"report.{fmt}"
    res = CliRunner().invoke(app, ["report", str(runs["straggler"]), "--format", fmt, "--out", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text(encoding="utf-8")
    assert f"rank {SLOW_RANK} (trainer) is 1.50× slower in backward" in text
    assert "tail wait after the median rollout finished" in text
    assert "SELECT rank, COUNT(*) AS steps, median(us)" in text.replace("&#x27;", "'")
    if fmt == "html":
        tags = _Tags()
        tags.feed(text)
        assert tags.stack == [] and tags.items >= 5
    if fmt == "markdown":
        assert text.startswith("# dynascope report") and "```sql" in text


def test_cli_report_to_stdout_and_errors(runs, tmp_path):
    res = CliRunner().invoke(app, ["report", str(runs["straggler"])])
    assert res.exit_code == 0 and "persistent straggler" in res.output
    bad = CliRunner().invoke(app, ["report", str(runs["straggler"]), "--format", "pdf"])
    assert bad.exit_code == 2 and "unknown --format 'pdf'" in bad.output
    missing = CliRunner().invoke(app, ["report", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "no such file" in missing.output


def test_report_on_an_empty_run(tmp_path):
    RunWriter(tmp_path / "empty").close()
    for fmt in ("text", "markdown", "html"):
        res = CliRunner().invoke(app, ["report", str(tmp_path / "empty"), "--format", fmt])
        assert res.exit_code == 0, res.output
        assert "No findings" in res.output


def test_cli_report_peak_tflops_enables_mfu_on_cpu(tmp_path):
    run = tmp_path / "cpu"
    with RunWriter(run, rank=0, config={"n_params": 2_000_000}) as w:
        for step in range(4):
            w.append("timings", {"phase": "train", "category": "phase", "step": step, "start_us": 10**15 + step * 10**6,
                                 "dur_us": 250_000})
            w.append("samples", {"step": step, "prompt_len": [16] * 4, "response_len": [48] * 4})
        w.append("system", {"time_us": 10**15, "device": "cpu"})
    plain = CliRunner().invoke(app, ["report", str(run)])
    assert plain.exit_code == 0, plain.output
    assert "MFU" not in plain.output and "mfu: peak FLOP/s unknown for device (cpu)" in plain.output
    assert "--peak-tflops" in plain.output  # the note says how to give the peak
    res = CliRunner().invoke(app, ["report", str(run), "--peak-tflops", "0.5"])
    assert res.exit_code == 0, res.output
    mfu = 100 * 6 * 2e6 * (4 * 64) / 0.25 / 1e12 / 0.5  # 6·N·tokens per step, over the step's time, vs the peak
    assert f"train MFU is {mfu:.1f}% of the 0.5 TFLOP/s peak" in res.output
    assert "mfu:" not in res.output  # no longer skipped
    bad = CliRunner().invoke(app, ["report", str(run), "--peak-tflops", "0"])
    assert bad.exit_code == 2 and "--peak-tflops must be a positive number" in bad.output
    with pytest.raises(ValueError, match="peak_tflops must be > 0"):  # the API refuses it too
        throughput_mfu(run, peak_tflops=-1.0)
