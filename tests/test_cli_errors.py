"""Bad input through the CLI: one clear line on stderr, exit code 2, a traceback only with --debug."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dynascope.cli import app
from dynascope.store import RunWriter


@pytest.fixture()
def run(tmp_path):
    path = tmp_path / "root" / "r"
    with RunWriter(path, fold=False) as w:  # its segments as written: the tests damage one of them
        w.append("scalars", {"step": list(range(300)), "key": "loss", "value": 1.0})
    return path


def segment(run):
    return next(p for p in (run / "scalars").glob("writer=r*/*.parquet"))


def fails(args, *needles):
    out = CliRunner().invoke(app, [str(a) for a in args])
    assert out.exit_code == 2, out.output
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error"), out.stderr
    assert "Traceback" not in out.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_paths_that_are_not_stores(tmp_path, run):
    fails(["sql", tmp_path / "nope", "SELECT 1"], "no such file")
    (tmp_path / "file.txt").write_text("x")
    fails(["sql", tmp_path / "file.txt", "SELECT 1"], "not a directory")
    (tmp_path / "empty").mkdir()
    fails(["sql", tmp_path / "empty", "SELECT 1"], "not a dynascope run")
    fails(["runs", tmp_path / "empty"], "not a dynascope run")
    fails(["export", run], "exactly one of")
    fails(["compact", run, "--grace-s", "-1"], ">= 0")


@pytest.mark.parametrize("content, needle", [
    (os.urandom(64), "unreadable run marker"),
    (b'{"schema_version": 1', "unreadable run marker"),  # truncated
    (b'{"run_id": "x"}', "no integer schema_version"),
    (b'[1, 2]', "no integer schema_version"),
    (b'{"schema_version": 7}', "schema v7"),
])
def test_bad_markers(run, content, needle):
    (run / "dynascope.json").write_bytes(content)
    fails(["sql", run, "SELECT 1"], needle)
    fails(["sql", run.parent, "SELECT 1"], needle)  # one bad run makes the root refuse, naming it
    fails(["export", run, run.parent.parent / "x.duckdb"], needle)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_segment_is_refused_by_name(run, damage):
    seg = segment(run)
    data = seg.read_bytes()
    seg.write_bytes({"garbage": os.urandom(len(data)), "truncated": data[: len(data) // 2], "empty": b""}[damage])
    line = fails(["sql", run, "SELECT count(*) FROM scalars"], str(seg), "corrupt segment", "move it out")
    assert len(line) < 400
    compacted = CliRunner().invoke(app, ["compact", str(run)])
    assert compacted.exit_code == 0 and f"{seg.parent}: OSError: {seg.name}: corrupt segment" in compacted.stderr
    seg.rename(run.parent.parent / "quarantine.parquet")  # what the message says to do
    out = CliRunner().invoke(app, ["sql", str(run), "SELECT count(*) AS n FROM scalars", "-f", "csv"])
    assert out.exit_code == 0 and out.stdout.splitlines() == ['"n"', "0"]


def test_symlink_loops_do_not_hang_or_crash(run):
    (run / "scalars" / "writer=loop").symlink_to("..")
    (run / "loop").symlink_to(run)
    out = CliRunner().invoke(app, ["sql", str(run), "SELECT count(*) AS n FROM scalars", "-f", "csv"])
    assert out.exit_code == 0 and out.stdout.splitlines() == ['"n"', "300"]
    assert CliRunner().invoke(app, ["runs", str(run.parent)]).exit_code == 0
    assert CliRunner().invoke(app, ["compact", str(run)]).exit_code == 0


def test_sql_errors_and_row_cap(run):
    fails(["sql", run, "SELEC 1"], "syntax error")
    fails(["sql", run, "SELECT * FROM no_such_table"], "no_such_table")
    fails(["sql", run, ""], "empty query")
    fails(["sql", run, "SELECT 1", "--format", "xml"], "unknown --format")
    fails(["sql", run, "SELECT 1", "--max-rows", "0"], "at least 1")
    fails(["sql", run, "SELECT 1", "--format", "parquet"], "needs --out")
    out = CliRunner().invoke(app, ["sql", str(run), "SELECT * FROM range(1000000000) LIMIT 999999999999",
                                   "-f", "csv", "--max-rows", "5"])
    assert out.exit_code == 0
    assert out.stdout.splitlines() == ['"range"', "0", "1", "2", "3", "4"]
    assert "capped at 5 rows" in out.stderr


def test_invalid_utf8_names(tmp_path, run):
    bad = os.fsdecode(bytes(tmp_path) + b"/bad\xffname")
    os.makedirs(bad)
    fails(["sql", bad, "SELECT 1"], "not valid UTF-8")
    os.rename(run, os.fsdecode(bytes(run.parent) + b"/r\xff"))
    line = fails(["sql", run.parent, "SELECT 1"], "not valid UTF-8")
    assert "\\udcff" in line or "\\xff" in line
    out = CliRunner().invoke(app, ["runs", str(run.parent)])
    assert out.exit_code == 0 and "not valid UTF-8" in out.stdout


def test_real_process_exit_codes_and_debug(run):
    cmd = [sys.executable, "-c", "from dynascope.cli import app; app()"]  # the console script, without PATH
    bad = subprocess.run([*cmd, "sql", str(run), "SELECT * FROM read_csv('/etc/passwd')"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    assert "root:" not in bad.stdout
    debug = subprocess.run([*cmd, "--debug", "sql", str(run), "SELEC"], capture_output=True, text=True, timeout=120)
    assert debug.returncode == 2 and "Traceback" in debug.stderr  # the traceback, and still the user-error status
    missing = subprocess.run([*cmd, "--debug", "runs", str(run.parent / "nope")], capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "Traceback" in missing.stderr and "nope" in missing.stderr
    ok = subprocess.run([*cmd, "sql", str(run), "SELECT count(*) AS n FROM scalars", "-f", "json"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and json.loads(ok.stdout) == {"n": 300}


def test_python_dash_m_runs_the_cli(run):
    """``python -m dynascope.cli`` is the console script (it once exited 0 having run nothing)."""
    out = subprocess.run([sys.executable, "-m", "dynascope.cli", "sql", str(run), "SELECT count(*) AS n FROM scalars",
                          "-f", "json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout) == {"n": 300}, out.stderr
    bad = subprocess.run([sys.executable, "-m", "dynascope.cli", "sql", str(run), "SELEC"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
