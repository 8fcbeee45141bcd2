"""`dynascope import wandb` refuses, in one line and before writing, a --step-key no row logs (every step
would be NULL) and a second import of the same history into a run (every row would be doubled)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
from typer.testing import CliRunner

from dynascope import open_store
from dynascope.cli import app


def _history(tmp_path: Path) -> Path:
    path = tmp_path / "history.csv"
    pl.DataFrame([{"_step": s, "train/global_step": 10 * s, "loss": 2.0 - 0.1 * s} for s in range(5)]).write_csv(path)
    return path


def _import(path: Path, run: Path, *args: str):
    return CliRunner().invoke(app, ["import", "wandb", str(path), "--run", str(run), *args])


def _one_line(result) -> str:
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    return lines[0]


def _scalars(run: Path) -> list[tuple]:
    with open_store(run) as con:
        return con.sql("SELECT step, key, value FROM scalars ORDER BY ALL").fetchall()


def test_a_step_key_no_row_logs_is_refused(tmp_path):
    hist, run = _history(tmp_path), tmp_path / "run"
    line = _one_line(_import(hist, run, "--step-key", "nosuchkey"))
    assert "'nosuchkey'" in line and "train/global_step" in line, line
    assert not run.exists()
    assert _import(hist, run, "--step-key", "train/global_step").exit_code == 0
    assert {s for s, _, _ in _scalars(run)} == {0, 10, 20, 30, 40}


def test_the_same_history_twice_is_refused(tmp_path):
    hist, run = _history(tmp_path), tmp_path / "run"
    assert _import(hist, run).exit_code == 0
    before = _scalars(run)
    assert len(before) == 10  # loss and train/global_step at five steps
    line = _one_line(_import(hist, run))
    assert "already holds the wandb history" in line, line
    assert _scalars(run) == before
    other = tmp_path / "other.csv"
    other.write_bytes(hist.read_bytes())
    assert _import(other, run).exit_code == 0  # another source may go into the same run
    assert len(_scalars(run)) == 20
