"""Narrow views: a run created with the current columns is bound by its schema segment, not by every file's
footer; a file with fewer columns widens the views and the query runs again; runs without the current
columns id are read by name from the start."""

from __future__ import annotations

import json
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


def _probe_side_of_the_live_join(s) -> str:
    """The operator under the left (probe) child of the hash join that keeps the live files' rows: a hash
    join holds its right (build) child in memory and streams its left."""
    plan = json.loads(s.rows("EXPLAIN (FORMAT json) SELECT count(*) FROM timings")[0][1])

    def joins(n):
        if n["name"] == "HASH_JOIN" and "_segment_file" in str(n.get("extra_info", {}).get("Conditions", "")):
            yield n
        for c in n.get("children", []):
            yield from joins(c)

    def scans(n):
        yield n["name"]
        for c in n.get("children", []):
            yield from scans(c)

    (join,) = [j for root in plan for j in joins(root) if "READ_PARQUET" in scans(j)]
    return "read_parquet" if "READ_PARQUET" in scans(join["children"][0]) else "live files"


@pytest.mark.parametrize("wide", [False, True])
def test_the_segments_stream_past_the_live_files(tmp_path: Path, wide: bool) -> None:
    """A narrow glob is estimated at its first file's rows (the schema segment's: none), and a hash join
    builds on the side estimated smaller: without the view's row of NULLs the join held every row of the
    table, all columns, to keep those of the live files (~350 bytes a row for a count, docs/scale.md)."""
    run, _ = _run(tmp_path)
    if wide:
        meta = json.loads((run / MARKER).read_text())
        del meta["columns"]
        (run / MARKER).write_text(json.dumps(meta))
    with open_store(run) as s:
        assert _probe_side_of_the_live_join(s) == "read_parquet"
        assert s.rows("SELECT count(*) FROM timings") == [(6,)]
