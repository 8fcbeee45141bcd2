"""A finished run at rest with no manual command (``store.at_rest``): the last writer to close folds the
run's writers together, a reader counting all the while sees every row once; a run whose last close did
not fold is folded by the next open; a fold that finds the run held waits for it; a temp file a killed
pass left keeps the run untidy neither here nor under `dynascope compact`; a run with a writer still
writing is left alone; kill -9 anywhere in the fold at close loses and doubles nothing, and the next open
finishes what it left."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import dynascope.store.at_rest as at_rest
from dynascope.store import RunWriter, lease_lock, open_store
from dynascope.store.compact import compact_store
from dynascope.store.flush import commit_dir
from dynascope.store.layout import MERGED
from dynascope.store.schema import TABLES

from helpers.waiting import wait_until

WRITERS, FLUSHES, ROWS = 4, 20, 50


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fold's settle and grace scaled down (2 s and 1 s by default); forked children inherit them."""
    monkeypatch.setattr(at_rest, "SETTLE_S", 0.05)
    monkeypatch.setattr(at_rest, "GRACE_S", 0.1)


def _write(run: Path, fold: bool | None = None) -> list[RunWriter]:
    """``WRITERS`` writers of one run, ``FLUSHES`` flushes of ``ROWS`` scalars each (steps distinct per rank)."""
    ws = [RunWriter(run, rank=r, world_size=WRITERS, flush_secs=3600, flush_rows=10**9, fold=fold)
          for r in range(WRITERS)]
    for i in range(FLUSHES):
        for w in ws:
            w.append("scalars", {"step": np.arange(i * ROWS, (i + 1) * ROWS), "key": "loss", "value": float(w.rank)})
            w.flush()
    return ws


def _counts(run: Path) -> tuple[int, int]:
    with open_store(run) as s:
        return s.rows("SELECT count(*), count(DISTINCT (rank, step)) FROM scalars")[0]


def _files(run: Path) -> dict[str, int]:
    """Parquet files on disk per table."""
    return {t: sum(1 for _ in (run / t).rglob("*.parquet")) for t in TABLES if (run / t).is_dir()}


def _at_rest(run: Path) -> bool:
    writer_dirs = [d for t in TABLES for d in (run / t).glob("writer=*") if d.name not in (MERGED, "writer=_schema")]
    return not writer_dirs and max(_files(run).values()) <= 2


EXPECTED = (WRITERS * FLUSHES * ROWS,) * 2


def test_the_last_writer_to_close_folds_the_run_under_a_counting_reader(tmp_path: Path) -> None:
    run = tmp_path / "r"
    ws = _write(run)
    seen: list[tuple[int, int]] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.append(_counts(run))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for w in ws[:-1]:
            w.close()
        assert not any((run / tb / MERGED).exists() for tb in TABLES)  # a writer still writes: nothing folds
        assert at_rest.settle(run, time.monotonic() + 1) is False
        ws[-1].close()
        wait_until(lambda: _at_rest(run), "the last close to put the run at rest", timeout_s=120)
        wait_until(lambda: len(seen) >= 5, "a few more counts")
    finally:
        stop.set()
        t.join(timeout=60)
    assert seen and set(seen) == {EXPECTED}  # every row once at every moment of the fold and its deletions
    assert _files(run)["scalars"] == 2  # its schema file and one merged file
    assert not any((run / "_commits").iterdir())
    with open_store(run) as s:
        assert s.rows("SELECT count(*) FROM events WHERE event = 'run_end'") == [(WRITERS,)]
        assert s.rows("SELECT rank, sum(value) FROM scalars GROUP BY 1 ORDER BY 1") == [
            (r, float(r) * FLUSHES * ROWS) for r in range(WRITERS)]


def test_a_finished_run_its_last_close_did_not_fold_is_folded_by_the_next_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "r"
    with monkeypatch.context() as m:  # closed, but folding nothing: as a close that ran out of time leaves it
        m.setattr(at_rest, "settle", lambda *a, **k: False)
        m.setattr(at_rest, "settle_later", lambda *a, **k: None)
        for w in _write(run):
            w.close()
    assert not _at_rest(run) and max(_files(run).values()) >= FLUSHES
    assert _counts(run) == EXPECTED  # this open folds the run behind itself
    wait_until(lambda: _at_rest(run), "the open to put the run at rest", timeout_s=120)
    assert _counts(run) == EXPECTED


def test_a_run_with_a_writer_still_writing_is_not_folded_by_an_open(tmp_path: Path) -> None:
    run = tmp_path / "r"
    ws = _write(run)
    for w in ws[1:]:
        w.close()
    assert _counts(run) == EXPECTED
    assert at_rest.finished_writers(run) is None and at_rest.settle(run, time.monotonic() + 1) is False
    assert not any((run / tb / MERGED).exists() for tb in TABLES)
    ws[0].close()
    wait_until(lambda: _at_rest(run), "the last close to put the run at rest", timeout_s=120)


def test_a_settle_that_finds_the_run_held_waits_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Writers that close together each make a pass under the run's lock; the process a closer leaves to
    # finish the fold (settle_later) must wait for a pass in progress, not give up on meeting it.
    run = tmp_path / "r"
    with monkeypatch.context() as m:  # closed, nothing folded
        m.setattr(at_rest, "settle", lambda *a, **k: False)
        m.setattr(at_rest, "settle_later", lambda *a, **k: None)
        for w in _write(run):
            w.close()
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with lease_lock.run_lock(run) as locked:
            assert locked
            held.set()
            release.wait(60)

    t = threading.Thread(target=holder)
    t.start()
    try:
        held.wait(60)
        assert at_rest.settle(run, time.monotonic() + 60, once=True) is False  # one pass: none while held
        threading.Timer(0.5, release.set).start()
        assert at_rest.settle(run, time.monotonic() + 60) is True and release.is_set()
    finally:
        release.set()
        t.join(60)
    assert _at_rest(run) and _counts(run) == EXPECTED


def test_a_temp_file_left_by_a_killed_pass_does_not_keep_the_run_untidy(tmp_path: Path) -> None:
    # A pass killed between staging a cover and renaming it into place leaves the cover's temp file; once
    # the writer's segments have gone it is the directory's last file, and the run must still come to rest.
    run = tmp_path / "r"
    ws = _write(run)
    for w in ws:
        w.close()
    wait_until(lambda: _at_rest(run), "the last close to put the run at rest", timeout_s=120)
    left = run / "scalars" / f"writer={ws[1].writer_id}"
    left.mkdir()
    (left / ".cover-0123456789ab.tmp").write_bytes(b"PAR1")
    assert at_rest._untidy(run, {ws[1].writer_id})
    assert at_rest.settle(run, time.monotonic() + 60) is True
    assert not left.exists() and _at_rest(run) and _counts(run) == EXPECTED


def test_compact_clears_the_temp_file_a_killed_pass_left_in_a_closed_writers_directory(tmp_path: Path) -> None:
    # The same leftover under `dynascope compact`: a temp file as a closed writer's directory's last file.
    # The directory holds no segment, so a pass that walks segments never sees it: the run must still come
    # to rest, the writer's begin.json gone with its last directory.
    run = tmp_path / "r"
    ws = _write(run, fold=False)
    for w in ws:
        w.close()
    wid = ws[1].writer_id
    compact_store(run, grace_s=0.1, settle_s=0.05, repair_after_s=0, wait=True)
    left = run / "scalars" / f"writer={wid}"
    left.mkdir()
    (left / ".cover-0123456789ab.tmp").write_bytes(b"PAR1")
    compact_store(run, grace_s=0.1, settle_s=0.05, repair_after_s=0, wait=True)
    assert not left.exists() and not commit_dir(run, wid).exists()
    assert _at_rest(run) and _counts(run) == EXPECTED


def test_a_forked_child_can_start_a_settling_process_whatever_its_parent_held() -> None:
    # The parent's lock may be held by a thread starting a settling process at the moment of a fork (a
    # DataLoader's workers, a launcher); the child must not inherit it held, nor the parent's processes.
    at_rest._spawned[Path("/nonexistent-parent-run")] = subprocess.Popen([sys.executable, "-c", "pass"])
    with at_rest._spawned_lock:
        pid = os.fork()
        if pid == 0:
            ok = at_rest._spawned_lock.acquire(timeout=10) and not at_rest._spawned
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    at_rest._spawned.pop(Path("/nonexistent-parent-run")).wait(60)
    assert os.waitstatus_to_exitcode(status) == 0


def _close_then_linger(run: str, fd: int) -> None:
    """A child: the run's writers, all closed but the last; a byte on ``fd``; the last close (which folds the
    run); then it waits to be killed."""
    ws = _write(Path(run))
    for w in ws[:-1]:
        w.close()
    os.write(fd, b"r")
    ws[-1].close()
    while True:
        time.sleep(1)


def _kill_during_the_fold(run: Path, delay_s: float) -> None:
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _close_then_linger(str(run), wfd)
        finally:
            os._exit(1)
    os.close(wfd)
    try:
        assert select.select([r], [], [], 120)[0], "the child never reached its last close"
        time.sleep(delay_s)  # how far into the last close and its fold the kill lands
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    finally:
        os.close(r)


@pytest.mark.slow
def test_kill_9_during_the_fold_at_close_loses_and_doubles_nothing(tmp_path: Path) -> None:
    rng = random.Random(43)
    closed, landed_mid_fold = [], 0
    for i in range(12):
        run = tmp_path / f"r{i}"
        _kill_during_the_fold(run, rng.uniform(0.0, 0.6))
        # Before any open: folded part way (the merged file or covers placed, sources or covers left) is what
        # the kill interrupted; it must still read exactly.
        landed_mid_fold += any((run / t / MERGED).exists() for t in TABLES) and not _at_rest(run)
        landed_mid_fold += any(f.endswith(".tmp") for _, _, fs in os.walk(run) for f in fs)
        with open_store(run) as s:  # (this open finishes the fold behind itself)
            assert s.rows("SELECT count(*), count(DISTINCT (rank, step)) FROM scalars")[0] == EXPECTED, i
        if len(list((run / "_writers").glob(f"*{at_rest.CLOSED}"))) == WRITERS:
            closed.append(run)  # killed after its last writer marked itself closed: the run is finished
    assert landed_mid_fold > 0  # some kills really landed inside the fold or its deletions
    assert closed  # (a run killed before that has a writer that may yet write: `dynascope compact` decides)
    for run in closed:  # each open that finds it untidy folds it further behind itself
        wait_until(lambda run=run: _counts(run) == EXPECTED and _at_rest(run), f"{run.name} at rest after opens",
                   timeout_s=120, interval_s=0.2)


def test_the_folds_keep_the_writers_codec(tmp_path: Path) -> None:
    """A writer's ``compression`` survives its own fold's merges and the run's fold at close: the merged
    files are written in the codec their sources were, not re-encoded in the default."""
    import pyarrow.parquet as pq

    def codecs(files: list[Path]) -> set[str]:
        out = set()
        for f in files:
            md = pq.ParquetFile(f).metadata
            out |= {md.row_group(g).column(c).compression for g in range(md.num_row_groups) for c in range(md.num_columns)}
        return out

    run = tmp_path / "r"
    w = RunWriter(run, rank=0, flush_secs=0.2, flush_rows=10**9, compression="snappy")  # wakes to fold
    for i in range(FLUSHES):
        w.append("scalars", {"step": np.arange(i * ROWS, (i + 1) * ROWS), "key": "loss", "value": 1.0})
        w.flush()
    wait_until(lambda: any(".v" in f.name for f in (run / "scalars" / f"writer={w.writer_id}").glob("*.parquet")),
               "the writer's own fold to merge")
    own = [f for f in (run / "scalars" / f"writer={w.writer_id}").glob("*.parquet") if ".v" in f.name]
    assert own and codecs(own) == {"SNAPPY"}
    w.close()
    wait_until(lambda: _at_rest(run), "the close to put the run at rest", timeout_s=120)
    merged = list((run / "scalars" / MERGED).glob("*.parquet"))
    assert merged and codecs(merged) == {"SNAPPY"}
    assert _counts(run) == (FLUSHES * ROWS, FLUSHES * ROWS)
