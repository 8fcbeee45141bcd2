"""Compaction across writers: a finished 64-rank run folds to two files per table, and a reader counting rows
all the while never sees a row lost or doubled; a snapshot's lease keeps every file it planned, sources and
covers alike; writers still running are left to merge on their own; commit records and begin records go
with the last segment of a folded writer, and a flush committed late (a writer taken for dead) still counts."""

from __future__ import annotations

import os
import threading
import time

import duckdb
import numpy as np
import pytest

from dynascope.demo.synthetic import ClusterSpec
from dynascope.store import RunWriter, live_files, open_store
from dynascope.store import compact_across as across_mod
from dynascope.store import flush as flush_mod
from dynascope.store.catalog import list_runs
from dynascope.store.compact import compact_store
from dynascope.store.layout import COMMITS, MERGED, list_segments, segment_name
from dynascope.store.rollup_across import BY_TENSOR, covers
from dynascope.store.schema import TABLES
from dynascope.store.snapshot import open_snapshot

from helpers.as_written import as_written  # noqa: F401 - the fixture pytestmark names
from helpers.cluster_truth import planted_cluster
from helpers.waiting import wait_until

pytestmark = pytest.mark.usefixtures("as_written")  # compaction's input: runs as written

SMALL = ClusterSpec(ranks=64, steps=6, layers=1, tensor_every=3, checkpoint_every=3, samples_per_worker=8)
# The tables writers write; compaction adds its own rollup across ranks (BY_TENSOR) once a run is finished.
WRITTEN = tuple(t for t in TABLES if t != BY_TENSOR)
COUNTS = "SELECT " + ", ".join(f"(SELECT count(*) FROM {t})" for t in WRITTEN)


def content(run) -> dict[str, tuple]:
    """Rows and an order-free hash of every row, per table."""
    with open_store(run) as s:
        return {t: s.rows(f"SELECT count(*), sum(hash(COLUMNS(*))) FROM {t}")[0] for t in WRITTEN}


def files_per_table(run) -> dict[str, int]:
    """Files per table, but the run's empty schema journal (one per table, whatever the writers)."""
    return {t: sum(1 for d, _, names in os.walk(run / t) for n in names  # os.walk: dirs may vanish meanwhile
                   if not (n == "000000000000.jsonl" and os.path.basename(d) == "writer=_schema")) for t in TABLES}


def counted(files: list[str]) -> int:
    """Rows of ``files`` read as another engine reads a plan: the files themselves, later."""
    return duckdb.sql(f"SELECT count(*) FROM read_parquet({files!r}, union_by_name = true)").fetchall()[0][0]


def fold(run, **kw):
    return compact_store(run, grace_s=0.0, settle_s=0.05, wait=True, repair_after_s=0, **kw)


def test_a_finished_run_folds_to_two_files_per_table_under_a_counting_reader(tmp_path):
    run, truth = planted_cluster(tmp_path, SMALL)
    before = content(run)
    expected = tuple(before[t][0] for t in WRITTEN)
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
    with open_store(run) as s:  # every tensor_stats row pooled across ranks once, by the finished run's compaction
        assert stats.rollups_written == 1 and covers(s, None)
        assert s.rows(f"SELECT count(*) FROM {BY_TENSOR} WHERE sharded")[0][0] > 0
    (row,) = list_runs(run).iter_rows(named=True)
    assert (row["status"], row["ranks"], row["steps"]) == ("finished", 80, SMALL.steps)
    assert not any((run / COMMITS).iterdir())  # every writer closed: its commit and begin records went too
    assert all(sorted(live_files(run, t)) == sorted(str(p) for p in (run / t).rglob("*.parquet")) for t in TABLES)
    again = compact_store(run, grace_s=0.5, settle_s=0.1, wait=True, repair_after_s=0)
    assert (again.new_segments, again.removed_segments, again.writers_folded, again.rollups_written) == (0, 0, 0, 0)


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


def test_snapshots_keep_what_they_planned_through_a_fold(tmp_path):
    """A job planned before the fold reads the writers' own segments, one planned after reads the merged files
    and covers; each lease keeps its files on disk (sources, then covers) until released, and both count
    exactly what the store held."""
    run, _ = planted_cluster(tmp_path, SMALL)
    want = {t: v[0] for t, v in content(run).items()}
    before = open_snapshot(run)
    fold(run)
    after = open_snapshot(run)
    try:
        assert any(f"/{MERGED}/" in f for f in after.files("timings"))
        assert not any(f"/{MERGED}/" in f for f in before.files("timings"))
        for snap in (before, after):
            assert {t: counted(snap.files(t)) for t in WRITTEN} == want
        before.release()
        fold(run)  # the sources may go now; the covers the second plan read stay
        assert all(os.path.exists(f) for t in TABLES for f in after.files(t))
        assert {t: counted(after.files(t)) for t in WRITTEN} == want
        assert any(not os.path.exists(f) for f in before.files("timings"))
    finally:
        before.release()
        after.release()
    fold(run)
    assert all(n <= 2 for n in files_per_table(run).values()), files_per_table(run)
    assert {t: v[0] for t, v in content(run).items()} == want


def test_a_flush_committed_after_its_writer_was_folded_still_counts(tmp_path):
    """A writer taken for crashed left a flush renamed but not committed: the fold leaves it out (it is no
    data) and its cover does not reach it, so when the writer, alive after all, commits it, it counts."""
    run = tmp_path / "r"
    with RunWriter(run, rank=0) as creator:  # rank 0 creates the run; rank 1 is the one taken for dead
        creator.append("scalars", {"step": [0], "key": "k", "value": 0.0})
    w = RunWriter(run, rank=1, flush_secs=3600)
    w.append("runs", {"name": "r1"})  # number 0, in a directory of its own: scalars start at 1
    for i in range(3):
        w.append("scalars", {"step": np.arange(i * 10, i * 10 + 10), "key": "k", "value": 1.0})
        w.flush()
    wdir = run / "scalars" / f"writer={w.writer_id}"
    last = max(wdir.glob("*.parquet"))
    late = wdir / segment_name(w._seq, w._seq)  # the next number, renamed but not committed
    late.write_bytes(last.read_bytes())
    past = time.time() - 3 * 3600  # beyond twice its flush interval: taken for crashed
    os.utime(run / "_writers" / f"{w.writer_id}.json", (past, past))
    stats = fold(run)
    assert stats.writers_folded >= 1 and not (wdir / last.name).exists()
    with open_store(run) as s:
        assert s.rows("SELECT count(*) FROM scalars")[0][0] == 31
    flush_mod._write_commit(run, w.writer_id, w._seq, w._seq, [late], [])
    with open_store(run) as s:
        assert s.rows("SELECT count(*) FROM scalars")[0][0] == 41
    fold(run)
    with open_store(run) as s:
        assert s.rows("SELECT count(*) FROM scalars")[0][0] == 41
    assert (run / COMMITS / f"writer={w.writer_id}" / "begin.json").exists()  # not closed: it may write again
    w.close()
    with open_store(run) as s:
        assert s.rows("SELECT count(*) FROM scalars")[0][0] == 41


def test_rollups_of_a_writer_without_commit_records_fold_after_their_source(tmp_path, monkeypatch):
    """``repair`` compares a source directory with its rollup directories, so a writer without commit records
    never has its rollups folded away while its source rows are still in place."""
    run = tmp_path / "r"
    rng = np.random.default_rng(0)
    with RunWriter(run, flush_secs=3600) as w:
        for step in range(4):
            w.append("tensor_stats", {"step": step, "tensor": [f"layers.{i}.mlp.weight" for i in range(5)],
                                      "numel": 100, "update_norm": rng.random(5), "w_norm": 1.0})
            w.flush()
    for p in (run / COMMITS).rglob("*.json"):  # as a dynascope without commit records wrote it
        p.unlink()
    real = across_mod._publish

    def no_source(tmp, mdir, *args):  # the source's fold is dropped (renames ran late)
        return False if mdir.parent.name == "tensor_stats" else real(tmp, mdir, *args)

    monkeypatch.setattr(across_mod, "_publish", no_source)
    fold(run)
    for table in ("tensor_stats", "tensor_stats_by_kind", "tensor_stats_by_layer"):
        assert not list((run / table / MERGED).glob("*.parquet")), table
    monkeypatch.setattr(across_mod, "_publish", real)
    stats = fold(run)
    assert stats.repaired_segments == 0 and stats.skipped == []
    with open_store(run) as s:
        assert s.rows("SELECT (SELECT count(*) FROM tensor_stats), (SELECT sum(tensors) FROM tensor_stats_by_kind),"
                      " (SELECT sum(tensors) FROM tensor_stats_by_layer)")[0] == (20, 20, 20)
    assert all(n <= 2 for n in files_per_table(run).values()), files_per_table(run)


def test_a_fold_whose_renames_ran_late_is_dropped_whole(tmp_path, monkeypatch):
    """The merged file's rename is the last, and it too must land before the files take effect: when it runs
    late, the covers and the merged file go, and every writer keeps its rows where they were."""
    run = tmp_path / "r"
    for r in range(2):
        with RunWriter(run, rank=r, flush_secs=3600) as w:
            w.append("scalars", {"step": np.arange(10), "key": "k", "value": float(r + 1)})
    before = content(run)
    real = os.replace

    def late(src, dst):
        if f"/{MERGED}/" in str(dst):
            time.sleep(0.2)  # past the 50 ms settle time
        real(src, dst)

    monkeypatch.setattr(across_mod.os, "replace", late)
    stats = compact_store(run, grace_s=0.0, settle_s=0.05, wait=True, repair_after_s=0)
    assert stats.writers_folded == 0 and any("renames ran into the settle time" in line for line in stats.skipped)
    assert not list(run.glob(f"*/{MERGED}/*.parquet"))
    assert not list(run.glob("*/writer=r*/*.v*.parquet"))  # no cover left behind
    assert content(run) == before
