"""Compaction across writers: a finished 64-rank run folds to two files per table, and a reader counting rows
all the while never sees a row lost or doubled; writers still running are left to merge on their own."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from dynascope.demo.synthetic import ClusterSpec
from dynascope.store import RunWriter, open_store
from dynascope.store.catalog import list_runs
from dynascope.store.compact import compact_store
from dynascope.store.compact_across import MERGED
from dynascope.store.layout import list_segments
from dynascope.store.schema import TABLES

from helpers.cluster_truth import planted_cluster
from helpers.waiting import wait_until

SMALL = ClusterSpec(ranks=64, steps=6, layers=1, tensor_every=3, checkpoint_every=3, samples_per_worker=8)
COUNTS = "SELECT " + ", ".join(f"(SELECT count(*) FROM {t})" for t in TABLES)


def content(run) -> dict[str, tuple]:
    """Rows and an order-free hash of every row, per table."""
    with open_store(run) as s:
        return {t: s.rows(f"SELECT count(*), sum(hash(COLUMNS(*))) FROM {t}")[0] for t in TABLES}


def files_per_table(run) -> dict[str, int]:
    return {t: sum(1 for p in (run / t).rglob("*") if p.is_file()) for t in TABLES}


def test_a_finished_run_folds_to_two_files_per_table_under_a_counting_reader(tmp_path):
    run, truth = planted_cluster(tmp_path, SMALL)
    before = content(run)
    expected = tuple(before[t][0] for t in TABLES)
    assert before["timings"][0] == truth["rows"]["timings"] > 0
    assert max(files_per_table(run).values()) > 80  # one directory per writer per table, several segments each
    seen: list[tuple] = []
    stop = threading.Event()
    failure: list[BaseException] = []

    def reader() -> None:
        try:
            with open_store(run) as s:
                deadline = time.monotonic() + 600
                while not stop.is_set() and time.monotonic() < deadline:
                    seen.append(s.rows(COUNTS)[0])
        except BaseException as exc:  # reported by the main thread
            failure.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        wait_until(lambda: seen, "the reader's first count")
        stats = compact_store(run, grace_s=0.5, settle_s=0.1, wait=True, repair_after_s=0)
        n = len(seen)
        wait_until(lambda: len(seen) >= n + 2, "two counts after the compaction")
    finally:
        stop.set()
        thread.join(60)
    assert not failure, failure
    assert len(seen) >= 3 and all(got == expected for got in seen), {got for got in seen if got != expected}
    # trainers: runs, events, timings, tensor_stats and its two rollups (and rank 0's scalars); workers: runs,
    # events, timings, samples
    assert stats.writers_folded == 64 * 6 + 1 + 16 * 4
    assert stats.skipped == []
    # What is left: each table's empty typed segment and its merged rows, no writer directory.
    assert all(n <= 2 for n in files_per_table(run).values()), files_per_table(run)
    assert all({w.name for w in list_segments(run, t)} <= {"writer=_schema", MERGED} for t in TABLES)
    assert content(run) == before
    (row,) = list_runs(run).iter_rows(named=True)
    assert (row["status"], row["ranks"], row["steps"]) == ("finished", 80, SMALL.steps)
    again = compact_store(run, grace_s=0.5, settle_s=0.1, wait=True, repair_after_s=0)
    assert (again.new_segments, again.removed_segments, again.writers_folded) == (0, 0, 0)


def test_writers_still_running_are_not_folded(tmp_path):
    run = tmp_path / "r"
    done = [RunWriter(run, rank=r, flush_secs=3600) for r in range(3)]
    live = RunWriter(run, rank=3, flush_secs=3600)
    for i, w in enumerate([*done, live]):
        w.append("scalars", {"step": np.arange(10), "key": "k", "value": float(i)})
        w.flush()
    for w in done:
        w.close()
    before = content(run)
    stats = compact_store(run, grace_s=0.0, settle_s=0.05, wait=True, repair_after_s=0)
    assert stats.writers_folded == 7  # the closed writers' scalars and events (run_end), rank 0's runs row
    dirs = {w.name.split("-")[0] for w in list_segments(run, "scalars")}
    assert dirs == {"writer=_schema", "writer=_merged", "writer=r3"}
    assert content(run) == before
    live.append("scalars", {"step": np.arange(10, 20), "key": "k", "value": 3.0})
    live.close()
    with open_store(run) as s:
        assert s.rows("SELECT count(*), sum(value) FROM scalars")[0] == (50, 10 * (0 + 1 + 2) + 20 * 3.0)
    stats = compact_store(run, grace_s=0.0, settle_s=0.05, wait=True, repair_after_s=0)
    assert stats.writers_folded == 2
    with open_store(run) as s:
        assert s.rows("SELECT count(*), sum(value) FROM scalars")[0] == (50, 90.0)
    assert files_per_table(run)["scalars"] == 2  # the schema file; the two folds were merged into one


def test_a_corrupt_segment_keeps_its_writer_out_and_the_others_fold(tmp_path):
    run = tmp_path / "r"
    for r in range(3):
        with RunWriter(run, rank=r, flush_secs=3600) as w:
            for i in range(3):
                w.append("scalars", {"step": np.arange(i * 10, i * 10 + 10), "key": "k", "value": float(r)})
                w.flush()
    bad_dir = next(w for w in list_segments(run, "scalars") if w.name.startswith("writer=r1-"))
    bad = sorted(bad_dir.glob("*.parquet"))[1]
    bad.write_bytes(bad.read_bytes()[:100])
    stats = compact_store(run, grace_s=0.0, settle_s=0.05, wait=True, repair_after_s=0)
    assert any(str(bad_dir) in line and "not folded" in line for line in stats.skipped)
    assert {w.name.split("-")[0] for w in list_segments(run, "scalars")} == {"writer=_schema", MERGED, "writer=r1"}
    bad.unlink()  # what the user does with a corrupt segment; the rest reads exactly
    with open_store(run) as s:
        assert s.rows("SELECT count(*), sum(value) FROM scalars")[0] == (80, 0.0 * 30 + 1.0 * 20 + 2.0 * 30)


def test_a_writer_taken_for_crashed_that_writes_again_loses_nothing(tmp_path):
    """A writer whose heartbeat went stale is folded like a crashed one, except its directory holding its
    segment 0, whose cover would span segment 1: the number its next segment takes if that lands there."""
    run = tmp_path / "r"
    w = RunWriter(run, rank=0, flush_secs=3600)  # creates the run: its runs row is segment 0
    w.flush()
    past = time.time() - 3 * 3600
    os.utime(run / "_writers" / f"{w.writer_id}.json", (past, past))
    stats = compact_store(run, settle_s=0.05, repair_after_s=0)  # a cover would stay for the grace period
    assert stats.writers_folded == 0
    w.append("runs", {"name": "resumed"})  # segment 1, in the same directory
    w.append("scalars", {"step": np.arange(10), "key": "k", "value": 1.0})
    w.close()
    with open_store(run) as s:
        assert s.rows("SELECT count(*) FROM runs")[0][0] == 2
        assert s.rows("SELECT count(*), sum(value) FROM scalars")[0] == (10, 10.0)
    stats = compact_store(run, grace_s=0.0, settle_s=0.05, wait=True, repair_after_s=0)
    assert stats.writers_folded == 3  # closed now: runs, scalars and events (run_end)
    with open_store(run) as s:
        assert s.rows("SELECT count(*) FROM runs")[0][0] == 2
