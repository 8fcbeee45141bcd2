"""Snapshots read the rows that writers hold in journals, once, as queries of the present do.

Other engines read Parquet only: a snapshot copies the journal rows that count at its moment into a
Parquet file per table beside its lease (``store/snapshot_journals.py``). Every count here is held against
DuckDB's views of the present over the same files (which read the journals themselves) and the rows
written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import dynascope.store.journal as journal
import dynascope.store.merge as merge
import dynascope.store.snapshot_journals as snapshot_journals
from dynascope.store import RunWriter, at_rest, open_store, snapshot
from dynascope.store.compact import compact_store
from dynascope.store.engines import DuckDBTables
from dynascope.store.runfiles import RunFiles
from dynascope.store.snapshot import LEASES, open_snapshot

from helpers import killed_writer
from helpers.waiting import wait_until

KEYS = 5


def _count(snap, table: str = "scalars") -> tuple[int, int]:
    """(rows, distinct (step, key)) of ``table`` in the snapshot, read as another engine would: its files."""
    duck = DuckDBTables(snap, [table])
    try:
        return duck.rows(f"SELECT count(*), count(DISTINCT (step, key)) FROM {table}")[1][0]
    finally:
        duck.close()


def test_a_killed_writers_journal_rows_are_in_the_snapshot_once(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(at_rest, "CRASHED_MARGIN_S", 0.5)
    run = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-c", killed_writer.SCRIPT, str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    while int(proc.stdout.readline()) < 30:
        pass
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    jfile = next((run / "scalars").glob("writer=r0-*/*.jsonl"))
    with open(jfile, "ab") as f:  # a line cut short by the kill: no row
        f.write(b'{"run_id":"r","rank":0,"role":"trainer","step":99999,"key":"m0","val')
    with open_store(run) as con:
        n = con.rows("SELECT count(*) FROM scalars")[0][0]
    assert n >= 31 * killed_writer.KEYS and n % killed_writer.KEYS == 0
    with snapshot(run) as snap:
        assert "scalars" in snap.rows and _count(snap) == (n, n)
        rows_dir = snap.rows_dir
        with snapshot(run, journals=False) as segments_only:  # segments alone: the journal's rows missing
            assert _count(segments_only) == (0, 0)
    assert rows_dir is not None and not rows_dir.exists()  # released with the lease
    # The run's fold seals the dead writer's journal: the same rows, now from a segment, none copied.
    wait_until(lambda: at_rest.settle(run, time.monotonic() + 1.0, 0.3, 0.5) is not None and not list(
        (run / "scalars").glob("writer=r0-*/*.jsonl")), "the orphan journal sealed and deleted", timeout_s=120)
    with snapshot(run) as snap:
        assert snap.rows == {} and _count(snap) == (n, n)


def test_snapshots_taken_while_a_writer_appends_and_seals_read_each_row_once(tmp_path: Path, monkeypatch) -> None:
    # Seals every 0.2 s (settle 0.1 s, deleted 0.2 s later): snapshots land before, during and after seals.
    monkeypatch.setattr(journal, "SETTLE_S", 0.1)
    monkeypatch.setattr(journal, "GRACE_S", 0.2)
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=3600, seal_secs=0.2)
    flushed, stop = [0], threading.Event()

    def append() -> None:
        step = 0
        while not stop.is_set():
            w.append("scalars", {"step": step, "key": [f"m{k}" for k in range(KEYS)], "value": [1.0] * KEYS})
            w.flush()
            step += 1
            flushed[0] = step * KEYS

    thread = threading.Thread(target=append)
    thread.start()
    seen = []
    try:
        wait_until(lambda: flushed[0] >= 20 * KEYS, "the first flushes", timeout_s=60)
        end = time.monotonic() + 8
        while time.monotonic() < end or len(seen) < 10:
            before = flushed[0]
            with snapshot(run) as snap:
                after = flushed[0] + KEYS  # a flush may be writing while the journal is listed
                n, distinct = _count(snap)
            assert n == distinct and before <= n <= after, (before, n, distinct, after)
            seen.append((n, bool(snap.rows)))
    finally:
        stop.set()
        thread.join()
        w.close()
    sealed = list((run / "scalars").glob("writer=r0-*/*.v*.parquet"))
    assert sealed and any(copied for _, copied in seen), (len(sealed), seen[:5])
    assert not list((run / LEASES).iterdir())  # every lease and its rows released


def test_a_journal_gone_before_it_is_read_takes_a_new_moment(tmp_path: Path, monkeypatch) -> None:
    run = tmp_path / "r"
    with RunWriter(run, flush_secs=3600, seal_secs=3600) as w:
        w.append("scalars", {"step": 0, "key": ["a", "b"], "value": [1.0, 2.0]})
        w.flush()
        read, fails = snapshot_journals._whole_lines, [1]

        def gone_once(e):
            if fails[0]:
                fails[0] -= 1
                raise snapshot_journals.Vanished(e.path)
            return read(e)

        monkeypatch.setattr(snapshot_journals, "_whole_lines", gone_once)
        with snapshot(run) as snap:
            assert _count(snap) == (2, 2) and fails == [0]
        fails[0] = 10  # gone at every moment: it says so, and leaves neither lease nor rows behind
        with pytest.raises(snapshot_journals.Vanished):
            open_snapshot(run)
        assert not list((run / LEASES).iterdir())


def test_compaction_removes_a_dead_drivers_rows_and_keeps_a_held_snapshots(tmp_path: Path) -> None:
    run = tmp_path / "r"
    with RunWriter(run, flush_secs=3600, seal_secs=3600) as w:
        w.append("scalars", {"step": 0, "key": ["a"], "value": [1.0]})
        w.flush()
        held, dead = open_snapshot(run), open_snapshot(run)
        assert held.rows_dir and dead.rows_dir and dead.lease
        dead.lease.unlink()  # the driver died and its lease is gone (or expired)
        old = time.time() - 2 * 3600
        for d in (held.rows_dir, dead.rows_dir):
            os.utime(d, (old, old))
        compact_store(run, grace_s=0.5, settle_s=0.1)
        assert held.rows_dir.exists() and not dead.rows_dir.exists()
        assert _count(held) == (1, 1)
        held.release()


def test_a_fold_pass_lists_each_lease_directory_once(tmp_path: Path, monkeypatch) -> None:
    """The leases and the snapshots' rows come from one listing of each lease directory (the run's and
    its store root's): on a shared file system every listing is a metadata operation, and a writer's fold
    pass reads the leases each time."""
    run = tmp_path / "r"
    stale = tmp_path / LEASES / f"gone{snapshot_journals.ROWS}"  # a dead driver's rows at the store root
    stale.mkdir(parents=True)
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    with RunWriter(run, flush_secs=3600, seal_secs=3600) as w:
        w.append("scalars", {"step": 0, "key": ["a"], "value": [1.0]})
        w.flush()
        held = open_snapshot(run)
        listed: list[Path] = []
        real = Path.iterdir

        def iterdir(self: Path):
            if self.name == LEASES:
                listed.append(self)
            return real(self)

        monkeypatch.setattr(Path, "iterdir", iterdir)
        merge.remove_merged(RunFiles.of(run), grace_s=0.5)
        monkeypatch.undo()
        assert sorted(listed) == sorted([run / LEASES, tmp_path / LEASES])
        assert not stale.exists() and held.rows_dir and held.rows_dir.exists()
        held.release()
