"""wandb: the summary mirror (offline run, read back) and `dynascope import wandb` (.wandb logs, exports)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

import dynascope
from dynascope.cli import app
from dynascope.importers.wandb_history import import_history, read_history
from dynascope.integrations.wandb import WandbMirror

wandb = pytest.importorskip("wandb")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    return tmp_path


def _finished_log(run_dir) -> None:
    # wandb-core flushes the transaction log asynchronously: finish() can return before the exit record
    # is on disk, so wait for it rather than read a half-written log
    deadline = time.monotonic() + 60
    while not read_history(run_dir).complete:
        assert time.monotonic() < deadline, "wandb never flushed its transaction log"
        time.sleep(0.2)


def _rows(run, sql):
    with dynascope.open_store(run) as con:
        return con.sql(sql).fetchall()


def _summary(step: int) -> dict:
    # the shape of Scope's listener summary: global and per-kind figures, phase times
    return {"update_ratio": 1e-3 * (step + 1), "update_ratio/attn": 2e-3 * (step + 1), "update_ratio/mlp": 5e-4,
            "changed_rel_frac": 0.25, "rank1_energy": 0.5 + 0.1 * step, "phase/forward_ms": 3.0 + step,
            "note": "strings are not mirrored", "nan_is_dropped": math.nan}


def test_mirror_offline_round_trip(offline, tmp_path):
    run = wandb.init(project="dynascope-test", dir=str(offline), config={"lr": 0.1})
    mirror = WandbMirror()
    for step in range(3):
        run.log({"train/loss": 1.0 / (step + 1)})  # the trainer's own logging, on wandb's own step
        mirror(step, _summary(step))
    run_dir = run.dir.rsplit("/files", 1)[0]
    run.finish()
    _finished_log(run_dir)
    assert mirror.logged == 3
    assert mirror(9, _summary(9)) is None and mirror.logged == 3  # no active run: nothing, no error

    hist = import_history(run_dir, tmp_path / "imp", step_key="dynascope/step")
    assert hist.config["lr"] == 0.1
    got = _rows(tmp_path / "imp", "SELECT step, key, value FROM scalars WHERE key LIKE 'dynascope/%' "
                                  "AND key <> 'dynascope/step' ORDER BY step, key")
    expected = sorted((s, f"dynascope/{k}", v) for s in range(3) for k, v in _summary(s).items()
                      if isinstance(v, float) and math.isfinite(v))
    assert [(s, k) for s, k, _ in got] == [(s, k) for s, k, _ in expected]
    assert [v for *_, v in got] == pytest.approx([v for *_, v in expected])
    assert _rows(tmp_path / "imp", "SELECT count(*) FROM scalars WHERE key = 'train/loss'") == [(3,)]
    assert _rows(tmp_path / "imp", "SELECT DISTINCT role FROM scalars") == [("wandb",)]


def test_watch_wandb_true_mirrors_the_summaries_without_importing_an_integration(offline, tmp_path):
    # a fresh process: dynascope.watch(wandb=True) alone, as a user's script would call it
    script = textwrap.dedent(f"""
        import sys, torch, wandb, dynascope
        run = wandb.init(project="dynascope-test", dir={str(offline)!r})
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with dynascope.watch(model, opt, run={str(tmp_path / "probe")!r}, wandb=True, memory_budget=None,
                             system_interval_s=None) as scope:
            for _ in range(3):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
            scope.flush()
        print(run.dir.rsplit("/files", 1)[0])
        run.finish()
        print(sorted(m for m in sys.modules if m.startswith("dynascope.integrations")))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    run_dir, imported = out.stdout.strip().splitlines()[-2:]
    assert imported == "[]"  # the mirror is the probes' own listener: no integration was imported
    _finished_log(run_dir)
    hist = import_history(run_dir, tmp_path / "imp", step_key="dynascope/step")
    assert hist.rows > 0
    got = _rows(tmp_path / "imp", "SELECT step, value FROM scalars WHERE key = 'dynascope/update_ratio' "
                                  "ORDER BY step")
    assert [s for s, _ in got] == [0, 1, 2] and all(v > 0 for _, v in got)


def test_mirror_caps_keys():
    mirror = WandbMirror(run=object(), max_keys=4)
    with pytest.warns(RuntimeWarning, match="more than 4 keys"):
        payload = mirror.payload(2, {f"t{i}": float(i) for i in range(50)})
    assert len(payload) == 5 and payload["dynascope/step"] == 2 and payload["dynascope/t0"] == 0.0


def test_import_long_log_and_torn_tail(offline, tmp_path):
    # > 32 KiB of history: records cross the log's block boundaries (FIRST/MIDDLE/LAST framing)
    run = wandb.init(project="dynascope-test", dir=str(offline))
    for step in range(400):
        run.log({f"metric_{k:02d}": step * 100 + k for k in range(12)} | {"text": "x" * 40})
    run_dir = run.dir.rsplit("/files", 1)[0]
    run.finish()
    _finished_log(run_dir)
    (log,) = Path(run_dir).glob("*.wandb")
    assert log.stat().st_size > 3 * 32768

    hist = read_history(log)
    assert hist.rows == 400 and hist.skipped == 400 and hist.warning is None
    by_key = {(s, k): v for s, k, v in zip(hist.step, hist.key, hist.value, strict=True)}
    assert by_key[(399, "metric_11")] == 39911 and by_key[(0, "metric_00")] == 0 and len(by_key) == 4800

    torn = tmp_path / "torn.wandb"
    torn.write_bytes(log.read_bytes()[: log.stat().st_size // 2])
    partial = read_history(torn)
    assert partial.warning and "stopped at byte" in partial.warning and not partial.complete
    assert 100 < partial.rows < 400


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_import_exported_history(tmp_path, fmt):
    rows = [{"_step": s, "_timestamp": 1.7e9 + s, "loss": 2.0 - 0.1 * s, "reward/mean": 0.1 * s, "tag": "a"}
            for s in range(5)]
    path = tmp_path / f"history.{fmt}"
    if fmt == "jsonl":
        rows[2]["nested"] = {"kl": 0.02}
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif fmt == "csv":
        pl.DataFrame(rows).write_csv(path)
    else:
        pl.DataFrame(rows).write_parquet(path)
    result = CliRunner().invoke(app, ["import", "wandb", str(path), "--run", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "imported" in result.output
    got = dict(((s, k), v) for s, k, v in _rows(tmp_path / "r", "SELECT step, key, value FROM scalars"))
    assert got[(4, "loss")] == pytest.approx(1.6) and got[(3, "reward/mean")] == pytest.approx(0.3)
    assert _rows(tmp_path / "r", "SELECT min(time_us) FROM scalars") == [(1_700_000_000_000_000,)]
    if fmt == "jsonl":
        assert got[(2, "nested.kl")] == pytest.approx(0.02)


def test_import_errors_are_one_line(tmp_path):
    bad = tmp_path / "run-x.wandb"
    bad.write_bytes(b"not a wandb log at all")
    result = CliRunner().invoke(app, ["import", "wandb", str(bad), "--run", str(tmp_path / "r")])
    assert result.exit_code == 2 and "not a wandb transaction log" in result.output
    result = CliRunner().invoke(app, ["import", "wandb", str(tmp_path / "nope"), "--run", str(tmp_path / "r")])
    assert result.exit_code == 2 and "no such file" in result.output
