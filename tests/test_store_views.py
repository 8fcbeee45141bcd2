"""Narrow views: a run created with the current columns is bound by its schema segment, not by every file's
footer; a file with fewer columns widens the views and the query runs again; runs without the current
columns id are read by name from the start."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynascope.store import RunWriter, open_store
from dynascope.store.layout import MARKER, locate, segment_name
from dynascope.store.views import COLUMNS_ID, narrow

from helpers.as_written import as_written  # noqa: F401 - the fixture pytestmark names

pytestmark = pytest.mark.usefixtures("as_written")  # every segment as written: no fold changes the files


def _run(tmp_path: Path, flushes: int = 3) -> tuple[Path, str]:
    run = tmp_path / "run"
    with RunWriter(run, flush_secs=3600) as w:
        for f in range(flushes):
            w.append("timings", {"step": [2 * f, 2 * f + 1], "phase": "forward", "dur_us": 7, "category": "phase"})
            w.flush()
        wid = w.writer_id
    return run, wid


def _schema_of(run: Path, wid: str, names: list[str]) -> pa.Schema:
    schema = pq.read_schema(next((run / "timings" / f"writer={wid}").glob("*.parquet")))
    return pa.schema([schema.field(n) for n in names])


def _view(s) -> str:
    return s.rows("SELECT sql FROM duckdb_views() WHERE view_name = 'timings'")[0][0].lower()


def test_the_marker_names_the_columns(tmp_path: Path) -> None:
    run, _ = _run(tmp_path, 1)
    assert json.loads((run / MARKER).read_text())["columns"] == COLUMNS_ID


def test_narrow_and_wide_views_read_the_same_rows(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    assert narrow(locate(run))
    with open_store(run) as s:
        got = s.rows("SELECT step, phase, dur_us, category FROM timings ORDER BY step")
        assert "union_by_name" not in _view(s)
    assert got == [(i, "forward", 7, "phase") for i in range(6)]
    meta = json.loads((run / MARKER).read_text())
    del meta["columns"]  # as a run of an earlier version: read by name
    (run / MARKER).write_text(json.dumps(meta))
    assert not narrow(locate(run))
    with open_store(run) as s:
        assert "union_by_name" in _view(s)
        assert s.rows("SELECT step, phase, dur_us, category FROM timings ORDER BY step") == got


def test_the_schema_segment_binds_the_columns(tmp_path: Path) -> None:
    """A compaction's merged file sorts first in the glob; written from writers without a column, it must not
    decide the view's columns: the schema segment does."""
    run, wid = _run(tmp_path)
    merged = run / "timings" / "writer=_merged"
    merged.mkdir()
    short = pa.table({"run_id": ["run"], "step": [50], "phase": ["forward"], "dur_us": [9]})
    pq.write_table(short.cast(_schema_of(run, wid, short.column_names)), merged / segment_name(0, 0, 1))
    with open_store(run) as s:
        assert s.rows("SELECT count(*), count(category) FROM timings") == [(7, 6)]


def test_a_file_with_fewer_columns_widens_the_views(tmp_path: Path) -> None:
    run, wid = _run(tmp_path)
    # A segment as a writer of an older version writes it: without `category`, committed by its own record.
    old = pa.table({"run_id": ["run"], "step": [100], "phase": ["forward"], "dur_us": [7]})
    old = old.cast(_schema_of(run, wid, old.column_names))
    wdir = run / "timings" / "writer=r9-old"
    wdir.mkdir()
    pq.write_table(old, wdir / segment_name(1, 1))
    with open_store(run) as s:
        got = s.rows("SELECT step, category FROM timings ORDER BY step")
        assert got == [(0, "phase"), (1, "phase"), (2, "phase"), (3, "phase"), (4, "phase"), (5, "phase"),
                       (100, None)]
        assert "union_by_name" in _view(s)  # widened for good: the next query binds by name at once


def _fold_and_spoil_the_sources(run: Path, wid: str) -> None:
    """Cover the writer's segments with one merged segment, as its fold does, and leave the sources
    unreadable, as they are on disk until the fold's deletion window (a reader that opened them would fail)."""
    wdir = run / "timings" / f"writer={wid}"
    sources = sorted(wdir.glob("*.parquet"))
    merged = pa.concat_tables([pq.read_table(p) for p in sources])
    nums = [int(p.name[:12]) for p in sources]
    pq.write_table(merged, wdir / segment_name(min(nums), max(nums), time.time_ns() // 1000 - 1_000_000))
    for p in sources:
        p.write_bytes(b"merged away")


@pytest.mark.parametrize("wide", [False, True])
def test_a_query_opens_only_the_live_files(tmp_path: Path, wide: bool) -> None:
    """A view over the table's glob, filtered by the live-segment rule, opened every file the glob listed
    (DuckDB prunes by name only for a constant list), merged-away sources included: at 1,280 live writers
    those were up to half of what a query opened. The views read the rule's list, set per query."""
    run, wid = _run(tmp_path)
    # Enough live files that DuckDB's join filter on file names is a range, not a list (its
    # dynamic_or_filter_threshold is 50): with fewer, the filtered glob skipped the sources too.
    with RunWriter(run, rank=1, flush_secs=3600) as w:
        for step in range(100, 180):
            w.append("timings", {"step": [step], "phase": "forward", "dur_us": 7, "category": "phase"})
            w.flush()
    if wide:
        meta = json.loads((run / MARKER).read_text())
        del meta["columns"]
        (run / MARKER).write_text(json.dumps(meta))
    _fold_and_spoil_the_sources(run, wid)
    with open_store(run) as s:
        assert s.rows("SELECT count(*), sum(step) FILTER (step < 100) FROM timings") == [(86, 15)]
        assert s.sql("SELECT count(*) FROM timings").fetchall() == [(86,)]  # the shared connection binds too
        assert s.rows("SELECT count(*) FROM tensor_stats_global") == [(0,)]  # a view of views binds its tables
    with open_store(run, at_us=1) as s:  # before any segment: the view binds, and reads no row
        assert s.rows("SELECT count(*), count(category) FROM timings") == [(0, 0)]

