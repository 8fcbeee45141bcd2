"""What `dynascope sql` and `dynascope runs` print: tab-separated values through a pipe, a table on a terminal
that never cuts a value (one block per row when too wide), on a real run directory."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from dynascope.cli import app
from dynascope.cli_output import print_runs, write_result
from dynascope.core.clock import now_us
from dynascope.store import RunWriter, open_store, run_sql
from dynascope.store.catalog import list_runs
from dynascope.store.schema import TABLE_NAMES

CLI = [sys.executable, "-c", "from dynascope.cli import app; app()"]  # the console script, without PATH
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_tables") / "a-run-with-a-rather-long-name"
    t = now_us()
    with RunWriter(path, rank=0, role="trainer", flush_secs=60) as w:
        for step in range(3):
            w.append("timings", {"step": step, "phase": ["forward", "backward"], "parent": "train", "category": "phase",
                                 "start_us": t + 1000 * step, "dur_us": [1234, 5678], "device": "cpu"})
    return path


def _tsv(text: str) -> list[list[str]]:
    return [line.split("\t") for line in text.splitlines()]


def test_a_pipe_gets_tab_separated_values(run):
    """Through a pipe (a real process), every column and value whole: the header, then one line per row."""
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run([*CLI, "sql", str(run), "SELECT * FROM timings ORDER BY step, phase LIMIT 3"],
                         capture_output=True, text=True, timeout=120, check=True, env=env).stdout
    with open_store(run) as con:
        want = run_sql(con, "SELECT * FROM timings ORDER BY step, phase LIMIT 3")
    rows = _tsv(out)
    assert rows[0] == want.column_names and len(rows) == 4
    for got, expected in zip(rows[1:], want.to_pylist(), strict=True):
        assert got == ["" if v is None else str(v) for v in expected.values()]
    listed = subprocess.run([*CLI, "runs", str(run.parent)], capture_output=True, text=True, timeout=120, check=True,
                            env=env).stdout
    header, row = _tsv(listed)
    catalog = list_runs(run.parent).row(0, named=True)
    assert header == list(catalog) and dict(zip(header, row, strict=True))["start_us"] == str(catalog["start_us"])


def test_tsv_escapes_tabs_newlines_and_backslashes(run):
    out = CliRunner().invoke(app, ["sql", str(run), "SELECT 'a' || chr(9) || 'b' AS x, NULL AS y, "
                                   "'l1' || chr(10) || 'l2\\z' AS z"])
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines() == ["x\ty\tz", "a\\tb\t\tl1\\nl2\\\\z"]


def test_a_terminal_table_never_cuts_a_value(run):
    """At 80 columns a 13-column row does not fit: each row becomes a block of (column, value) lines."""
    with open_store(run) as con:
        result = run_sql(con, "SELECT * FROM timings ORDER BY step, phase LIMIT 2")
    buf = io.StringIO()
    write_result(result, "auto", None, Console(file=buf, width=80, force_terminal=True))
    text = ANSI.sub("", buf.getvalue())
    assert max(len(line) for line in text.splitlines()) <= 80
    for row in result.to_pylist():
        for name, value in row.items():
            if value is not None:
                assert re.search(rf"^{name}\s+{re.escape(str(value))}\s*$", text, re.M), (name, value, text)
    narrow = io.StringIO()  # a few columns fit: an ordinary table
    with open_store(run) as con:
        few = run_sql(con, "SELECT step, phase FROM timings LIMIT 1")
    write_result(few, "auto", None, Console(file=narrow, width=80, force_terminal=True))
    assert "┃ step ┃ phase" in ANSI.sub("", narrow.getvalue())


def test_runs_table_keeps_the_start_date_whole(run):
    buf = io.StringIO()
    print_runs(list_runs(run.parent), Console(file=buf, width=80, force_terminal=True), "auto")
    text = ANSI.sub("", buf.getvalue())
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", text) and run.name in text, text


def test_sql_help_names_every_table():
    text = " ".join(CliRunner().invoke(app, ["sql", "--help"], env={"COLUMNS": "200"}).output.split())
    missing = [t for t in TABLE_NAMES if not re.search(rf"\b{t}\b", text)]
    assert not missing, missing
