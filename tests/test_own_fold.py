"""A live writer folds its own segments (``store.own_fold``): however many flushes it makes, each table of
it holds at most ``KEEP`` live segments, the files on disk stay bounded, and every query in between reads
each row exactly once, beside a ``dynascope compact`` running at the same time."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dynascope.store.merge as merge
import dynascope.store.own_fold as own_fold
import dynascope.store.reader as reader
from dynascope.store import RunWriter, open_store
from dynascope.store.compact import compact_store
from dynascope.store.layout import segment_name
from dynascope.store.live import FOREVER_US, live_files
from dynascope.store.reader import retry_vanished
from dynascope.store.schema import TABLES

from helpers.waiting import wait_until

FLUSHES = 120


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settle, grace and deletion windows scaled down with the flush interval (0.05 s here, 2 s by default)."""
    monkeypatch.setattr(own_fold, "SETTLE_S", 0.05)
    monkeypatch.setattr(own_fold, "GRACE_S", 0.25)
    monkeypatch.setattr(own_fold, "DELETE_PERIOD_S", 0.5)
    monkeypatch.setattr(own_fold, "DELETE_WINDOW_S", 0.1)


def _own(run: Path, table: str, writer_id: str) -> tuple[int, int]:
    """(live segments, parquet files on disk) of the writer's directory of ``table``."""
    wdir = run / table / f"writer={writer_id}"
    live = [f for f in live_files(run, table) if f"/writer={writer_id}/" in f]
    return len(live), len(list(wdir.glob("*.parquet")))


def _flush_many(w: RunWriter, n: int, on_flush=lambda i: None) -> None:
    for i in range(n):
        seq = w._seq
        w.append("scalars", {"step": i, "key": [f"m{k}" for k in range(50)], "value": np.full(50, float(i))})
        w.append("tensor_stats", {"step": i, "tensor": ["a", "b"], "numel": [4, 4], "w_norm": [1.0, 2.0]})
        wait_until(lambda seq=seq: w._seq > seq, "the writer thread's flush")  # noqa: B023
        on_flush(i)


def test_a_journal_writer_holds_at_most_sealed_keep_segments_per_table(tmp_path: Path, quick: None) -> None:
    """A journal writer makes a segment a seal, not a flush, and folds every ``SEALED_EVERY`` seals: over
    many seals each table holds at most ``SEALED_KEEP`` live segments beside its journal (and at most
    ``SEALED_LEAVE + SEALED_EVERY`` once every merge written takes effect), and every query reads each row
    once."""
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=0.02, seal_secs=0.1)
    peak, seals = [0, 0], set()
    wdir = run / "scalars" / f"writer={w.writer_id}"
    for i in range(FLUSHES):
        w.append("scalars", {"step": i, "key": [f"m{k}" for k in range(50)], "value": np.full(50, float(i))})
        wait_until(lambda n=50 * (i + 1): w.rows_written >= n, "the writer thread's flush")  # noqa: B023
        for k, at_us in enumerate((None, FOREVER_US)):
            peak[k] = max(peak[k], len([f for f in live_files(run, "scalars", at_us=at_us) if str(wdir) in f]))
        seals.update(p.name for p in wdir.glob("*.parquet") if re.match(r"(\d{12})-\1\.v", p.name))
        with open_store(run) as con:
            assert con.rows("SELECT count(*) FROM scalars")[0][0] == 50 * (i + 1), i
    w.close()
    assert len(seals) > 4 * own_fold.SEALED_KEEP, len(seals)  # unfolded, the table would hold each seal
    assert 0 < peak[0] <= own_fold.SEALED_KEEP, peak
    assert peak[1] <= own_fold.SEALED_LEAVE + own_fold.SEALED_EVERY, peak
    with open_store(run) as con:
        assert con.rows("SELECT count(*), count(DISTINCT step) FROM scalars") == [(50 * FLUSHES, FLUSHES)]


def test_a_writer_holds_at_most_keep_live_segments_per_table(tmp_path: Path, quick: None) -> None:
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=0.02)
    peaks = {"scalars": [0, 0], "tensor_stats": [0, 0]}
    seen: list[int] = []

    def check(i: int) -> None:
        for table, peak in peaks.items():
            live, on_disk = _own(run, table, w.writer_id)
            peak[0], peak[1] = max(peak[0], live), max(peak[1], on_disk)
        with open_store(run) as con:  # every row once, at every moment: none lost, none read twice
            seen.append(con.rows("SELECT count(*) FROM scalars")[0][0])
            assert seen[-1] == 50 * (i + 1), (i, seen[-1])

    _flush_many(w, FLUSHES, check)
    w.close()
    # what took effect after the last flush settles: the bound holds at the end as all along
    wait_until(lambda: _own(run, "scalars", w.writer_id)[0] <= own_fold.KEEP, "the last merge to take effect")
    for table, (live, on_disk) in peaks.items():
        # a merge takes effect SETTLE_S after it is written: its sources count until then (a flush or two)
        assert live <= own_fold.KEEP + 2, (table, live)
        assert on_disk <= 4 * own_fold.KEEP, (table, on_disk)  # sources wait GRACE_S, then go
    assert FLUSHES > 10 * own_fold.KEEP  # unfolded, each table would hold one file per flush
    with open_store(run) as con:
        assert con.rows("SELECT count(*), count(DISTINCT step) FROM scalars") == [(50 * FLUSHES, FLUSHES)]
        assert con.rows("SELECT count(*) FROM tensor_stats") == [(2 * FLUSHES,)]


def test_folding_beside_dynascope_compact_loses_and_doubles_nothing(tmp_path: Path, quick: None) -> None:
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=0.02)
    stop, errors = threading.Event(), []

    def compactor() -> None:
        while not stop.is_set():
            try:
                compact_store(run, grace_s=0.25, settle_s=0.05)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    t = threading.Thread(target=compactor)
    t.start()
    try:
        def check(i: int) -> None:
            with open_store(run) as con:
                assert con.rows("SELECT count(*) FROM scalars")[0][0] == 50 * (i + 1), i
        _flush_many(w, 60, check)
    finally:
        stop.set()
        t.join(timeout=60)
        w.close()
    assert not errors, errors
    with open_store(run) as con:
        assert con.rows("SELECT count(*), count(DISTINCT step) FROM scalars") == [(50 * 60, 60)]


def test_a_writer_told_not_to_fold_keeps_every_segment(tmp_path: Path, quick: None) -> None:
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=0.02, fold=False)
    _flush_many(w, 3 * own_fold.KEEP)
    w.close()
    assert _own(run, "scalars", w.writer_id) == (3 * own_fold.KEEP, 3 * own_fold.KEEP)


def test_a_writer_that_flushes_seldom_deletes_in_the_first_window(tmp_path: Path, quick: None) -> None:
    """watch()'s writer flushes every 10 s, less often than deletion windows come: its thread wakes for the
    first window after its merged-away sources' grace, not at its next flush, which here is 10 minutes off."""
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=600, flush_rows=50)  # flushes when 50 rows arrive, never on the clock
    wdir = run / "scalars" / f"writer={w.writer_id}"
    try:
        for i in range(2 * own_fold.EVERY):
            seq = w._seq
            w.append("scalars", {"step": i, "key": [f"m{k}" for k in range(50)], "value": np.full(50, float(i))})
            wait_until(lambda seq=seq: w._seq > seq, "the writer thread's flush")  # noqa: B023
        wait_until(lambda: any(".v" in f.name for f in wdir.glob("*.parquet")), "a merge")
        wait_until(lambda: _own(run, "scalars", w.writer_id) == (len(list(wdir.glob("*.parquet"))),) * 2 and
                   w.upkeep.delete_from_us == 0, "the merged-away sources deleted", timeout_s=30)
        with open_store(run) as con:
            assert con.rows("SELECT count(*) FROM scalars")[0][0] == 50 * 2 * own_fold.EVERY
    finally:
        w.close()


def test_a_query_that_meets_a_deletion_window_runs_again_once_it_is_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writers delete merged-away sources only in shared windows of the wall clock, a thousand of them in the
    same window: a query that met one waits for its end and runs once more, not once per deletion."""
    monkeypatch.setattr(own_fold, "DELETE_PERIOD_S", 6.0)
    monkeypatch.setattr(own_fold, "DELETE_WINDOW_S", 1.0)
    wait_until(lambda: time.time() % 6.0 < 0.3, "a deletion window to begin", timeout_s=10)
    phases: list[float] = []

    def query() -> str:
        phases.append(time.time() % 6.0)
        if phases[-1] < 1.0:  # in the window, some file the query listed is gone by the time it opens it
            raise duckdb.IOException('Cannot open file "s.parquet": No such file or directory')
        return "rows"

    assert retry_vanished(query) == "rows"
    assert len(phases) == 2, phases  # a back-off of 20 ms would have run it ~40 times in the window
    assert phases[1] >= 1.0 + reader.WINDOW_SPILL_S - 0.05, phases


def _rewrites_per_row(every: int, leave: int, seals: int) -> float:
    """The fold's rule over ``seals`` equal segments: rows its merges rewrote, per row written."""
    rows: list[int] = []
    rewritten = 0
    for i in range(1, seals + 1):
        rows.append(1000)
        if i % every == 0 and len(rows) > leave:
            start, n = own_fold.pick(rows, [True] * len(rows), len(rows) - leave + 1)
            assert n == len(rows) - leave + 1  # the whole run: the fold leaves exactly `leave`
            rows[start:start + n] = [sum(rows[start:start + n])]
            rewritten += rows[start]
        assert len(rows) <= leave + every
    return rewritten / (1000 * seals)


def test_a_fold_rewrites_rows_far_fewer_times_than_it_folds() -> None:
    # 864 segments: a journal writer's seals over three days at 5 minutes, and as many flushes of a writer
    # without a journal. The run with the fewest rows alone rewrote every row since the run's start at each
    # fold: 215 and 107 times a row (docs/scale.md).
    assert _rewrites_per_row(own_fold.SEALED_EVERY, own_fold.SEALED_LEAVE, 864) < 63
    assert _rewrites_per_row(own_fold.EVERY, own_fold.LEAVE, 864) < 12


def test_a_fold_merges_only_committed_segments_under_max_rows() -> None:
    big = own_fold.MAX_ROWS - 10
    assert own_fold.pick([5, 4, 3, 2], [True, True, False, True], 3) == (0, 2)  # never across an uncommitted one
    assert own_fold.pick([big, 20, 4, 3], [True] * 4, 3) == (1, 3)  # the ordered run would pass MAX_ROWS
    assert own_fold.pick([big, 20], [True] * 2, 2) is None
    assert own_fold.pick([9, 5, 4, 1], [True] * 4, 2) == (2, 2)  # 9, 5, 5: ordered; 4 + 1 is fewest of those


@pytest.mark.parametrize("per_group", [merge.ROW_GROUP_ROWS, 100])
def test_a_merge_gathers_its_sources_into_full_row_groups(tmp_path: Path, per_group: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A merged file's row groups hold ``ROW_GROUP_ROWS`` rows each (the last the rest), not one per source:
    a live query pays per row group, and a writer's folds merge seals of a few hundred rows. The rows stay
    those of the sources, in their order."""
    monkeypatch.setattr(merge, "ROW_GROUP_ROWS", per_group)
    wdir = tmp_path / "scalars" / "writer=w"
    wdir.mkdir(parents=True)
    schema = TABLES["scalars"]
    group = []
    for i in range(3):  # three seals of 70 rows, one row group each
        path = wdir / segment_name(i, i)
        steps = np.arange(70 * i, 70 * (i + 1))
        pq.write_table(pa.table({"step": steps, "key": ["m"] * 70, "value": steps * 0.5},
                                schema=pa.schema([schema.field(c) for c in ("step", "key", "value")])), path)
        group.append((i, i, path))
    valid = merge.merge_segments("scalars", group, settle_us=0)
    md = pq.ParquetFile(wdir / segment_name(0, 2, valid)).metadata
    sizes = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
    assert sizes == ([210] if per_group > 210 else [100, 100, 10]), sizes
    merged = pq.read_table(wdir / segment_name(0, 2, valid))
    assert merged.schema.equals(schema)
    assert merged["step"].to_pylist() == list(range(210))
    assert merged["value"].to_pylist() == [s * 0.5 for s in range(210)]
