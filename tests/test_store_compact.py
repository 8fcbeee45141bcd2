"""Compaction: same rows before and after, readers never see a loss or a duplicate, old segments go."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynascope.store import RunWriter, merge, open_store
from dynascope.store.compact import compact_store
from dynascope.store.layout import list_segments, segment_name, valid_from_us
from dynascope.store.live import live_files
from dynascope.store.runfiles import RunFiles
from dynascope.store.snapshot import take_lease

from helpers.as_written import as_written  # noqa: F401 - the fixture pytestmark names
from helpers.waiting import wait_until

pytestmark = pytest.mark.usefixtures("as_written")  # compaction's input: runs as written


def segments(run, table="scalars"):
    return {w.name: [s[2].name for s in segs] for w, segs in list_segments(run, table).items() if "_schema" not in w.name}


def write_steps(run, n_flushes, rows=100, start=0):
    w = RunWriter(run, flush_secs=3600)
    for i in range(n_flushes):
        base = start + i * rows
        w.append("scalars", {"step": np.arange(base, base + rows), "key": "k", "value": 1.0})
        w.flush()
    w.close()
    return w


def in_effect(run, table="scalars"):
    """Whether every merged segment of ``run`` has taken effect (its valid_from has passed)."""
    now_us = time.time_ns() // 1000
    return all(valid_from_us(s[2]) <= now_us for segs in list_segments(run, table).values() for s in segs)


def snapshot(run):
    with open_store(run) as s:
        return s.rows("SELECT run_id, rank, step, key, value FROM scalars ORDER BY ALL")


def test_merge_keeps_every_row_once_and_deletes_after_grace(tmp_path):
    run = tmp_path / "r"
    write_steps(run, 12)
    before = snapshot(run)
    stats = compact_store(run, grace_s=0.0, settle_s=0.1)
    assert (stats.merged_segments, stats.new_segments, stats.rows_merged) == (12, 1, 1200)
    assert snapshot(run) == before  # merged and sources both on disk: each row still counted once
    wait_until(lambda: in_effect(run), "the merged segment to take effect")
    assert snapshot(run) == before
    again = compact_store(run, grace_s=0.0, settle_s=0.1)  # deletes the merged-away sources, merges nothing new
    assert again.new_segments == 0 and again.removed_segments == 12
    (files,) = segments(run).values()
    assert len(files) == 1 and ".v" in files[0]
    assert snapshot(run) == before


def test_sources_go_though_every_pass_merges_the_last_merge_again(tmp_path):
    """Passes more frequent than the grace, each finding a new segment of a live writer, merge the previous
    merged file again every time, so the newest cover is never older than one pass. The grace counts from the
    first merge that contained a source: the sources still go, and no row is lost or doubled."""
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=3600)
    removed, merges = [], []
    deadline = time.monotonic() + 120
    i = 0
    while len(merges) < 8 or sum(removed) < 3:  # at least 8 passes, then until the grace has let sources go
        assert time.monotonic() < deadline, f"sources never removed: {removed}"
        w.append("scalars", {"step": np.arange(i * 100, (i + 1) * 100), "key": "k", "value": 1.0})
        w.flush()
        i += 1
        if i == 1:
            continue
        st = compact_store(run, grace_s=0.3, settle_s=0.05)
        merges.append(st.new_segments)
        removed.append(st.removed_segments)
        wait_until(lambda: in_effect(run), "the pass's merge to take effect")  # the next pass: one newer cover
    w.close()
    assert merges == [1] * len(merges)  # every pass re-merged: the newest cover was always one pass old
    assert len(merges) < 60, merges  # passes far more frequent than the grace still let sources go
    rows = snapshot(run)
    assert rows == [(rows[0][0], 0, s, "k", 1.0) for s in range(100 * i)]


def test_reader_polling_during_compaction_sees_constant_rows(tmp_path):
    run = tmp_path / "r"
    write_steps(run, 40, rows=250)
    want = snapshot(run)
    stop, seen, errors = threading.Event(), [], []

    def reader():
        with open_store(run) as s:
            while not stop.is_set():
                try:
                    seen.append(s.rows("SELECT count(*), count(DISTINCT step), sum(step) FROM scalars")[0])
                except Exception as exc:
                    errors.append(repr(exc))

    t = threading.Thread(target=reader)
    t.start()
    for target in (1000, 3000, 20_000):  # merge in stages so merged files are merged again
        polled = len(seen) + len(errors)
        wait_until(lambda p=polled: len(seen) + len(errors) >= p + 2, "the reader to poll")  # through every stage
        compact_store(run, grace_s=0.05, settle_s=0.05, target_rows=target, wait=True)
    stop.set()
    t.join()
    assert errors == []
    assert len(seen) > 5
    assert set(seen) == {(10_000, 10_000, sum(range(10_000)))}
    assert snapshot(run) == want
    (files,) = segments(run).values()
    assert len(files) == 1


def test_old_segments_missing_new_columns_merge_as_null(tmp_path):
    run = tmp_path / "r"
    write_steps(run, 2)
    # Segments written before `stage` existed (by a writer of that time, which kept no commit records):
    # the column is absent from the files, not null in them.
    old = pa.table({"run_id": ["r"], "rank": pa.array([0], pa.int32()), "role": ["trainer"],
                    "step": [99], "key": ["old"], "value": [5.0]})
    (run / "scalars" / "writer=r0-old").mkdir()
    for seq in (50, 51):
        pq.write_table(old, run / "scalars" / "writer=r0-old" / segment_name(seq, seq))
    before = snapshot(run)
    compact_store(run, grace_s=0.0, settle_s=0.05, wait=True)
    assert snapshot(run) == before
    with open_store(run) as s:
        assert s.rows("SELECT stage FROM scalars WHERE key = 'old'") == [(None,), (None,)]
    assert [".v" in f for f in segments(run)["writer=r0-old"]] == [True]  # merged


def test_live_files_match_the_view(tmp_path):
    run = tmp_path / "r"
    write_steps(run, 6)
    wdir = next(w for w in list_segments(run, "scalars") if "_schema" not in w.name)
    # Overlapping history: 1-3 merged, then 1-5 merged again (covers it), plus a merge not yet in effect.
    future = time.time_ns() // 1000 + 3_600_000_000
    for lo, hi, valid in ((1, 3, 1), (1, 5, 2), (1, 6, future)):
        t = pa.concat_tables([pq.read_table(s[2]) for s in list_segments(run, "scalars")[wdir] if lo <= s[0] <= hi
                              and ".v" not in s[2].name])
        pq.write_table(t, wdir / segment_name(lo, hi, valid))
    live = {Path(f).name for f in live_files(run, "scalars") if Path(f).parent == wdir}
    assert live == {segment_name(1, 5, 2), segment_name(6, 6)}
    with open_store(run) as s:
        got = s.sql("SELECT count(*), count(DISTINCT step) FROM scalars").fetchall()
    assert got == [(600, 600)]


def test_a_second_compactor_on_the_same_run_stands_aside(tmp_path):
    run = tmp_path / "r"
    write_steps(run, 3)
    from dynascope.store.compact import _run_lock

    with _run_lock(run) as locked:
        assert locked
        stats = compact_store(run, grace_s=0.0, settle_s=0.05)
    assert stats.new_segments == 0 and "another compaction" in stats.skipped[0]
    assert compact_store(run, grace_s=0.0, settle_s=0.05).new_segments == 1


def test_a_pass_deletes_by_the_clock_it_read_before_the_leases(tmp_path, monkeypatch):
    """A lease can appear while a deleting pass runs. The pass reads its clock, then the leases: a lease it
    missed came after that clock, so the grace it judges by is over no later than the clock says (read the
    other way round, a pass stalled after reading the leases deleted sources a new lease pinned)."""
    run = tmp_path / "r"
    write_steps(run, 4)
    compact_store(run, grace_s=3600, settle_s=0.1)  # merged; the sources stay
    (names,) = segments(run).values()
    (valid,) = {valid_from_us(Path(n)) for n in names if ".v" in n}
    wait_until(lambda: time.time_ns() // 1000 >= valid, "the merged segment to take effect")
    real = merge.held_leases

    def leased_meanwhile(run_dir, now_us=None):
        out = real(run_dir, now_us)
        take_lease(run, valid - 1, ttl_s=600)  # a reader's moment before the merge took effect
        wait_until(lambda: time.time_ns() // 1000 >= valid + 1_000_000, "the grace to pass")
        return out

    monkeypatch.setattr(merge, "held_leases", leased_meanwhile)
    merge.remove_merged(RunFiles.of(run), grace_s=0.5)
    assert list(segments(run).values()) == [names]  # the sources too: the grace was not over at the pass's clock
