"""A writer's journal (``store.journal``): flushes append to one file per table instead of creating files,
queries of the present read the journal's rows exactly once before, during and after its seal, the sealed
segments hold the same values, and a writer killed with its journals unsealed loses no committed row."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest

import dynascope.store.journal as journal
import dynascope.store.own_fold as own_fold
from dynascope.store import RunWriter, at_rest, open_store
from dynascope.store.live import live_files
from dynascope.store.reader import retry_vanished

from helpers import killed_writer
from helpers.waiting import wait_until

ODD = ["plain", "", None, 'quote " and \\ backslash', "new\nline", "ünïcode ✓", "x" * 300]


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settle and grace periods scaled down, for the seal and for the writer's own fold."""
    for mod in (journal, own_fold):
        monkeypatch.setattr(mod, "SETTLE_S", 0.3)
        monkeypatch.setattr(mod, "GRACE_S", 0.5)
    monkeypatch.setattr(own_fold, "DELETE_PERIOD_S", 0.5)
    monkeypatch.setattr(own_fold, "DELETE_WINDOW_S", 0.2)


def _rows(i: int) -> dict:
    values = [float(i), math.nan, math.inf, -math.inf, 1e-300, 0.1 + i, None]
    return {"step": i, "key": [f"k{k}:{ODD[k]}" if ODD[k] is not None else None for k in range(7)], "value": values}


def _files(run: Path, writer_id: str) -> dict[str, list[str]]:
    return {t.name: sorted(f.name for f in (t / f"writer={writer_id}").iterdir())
            for t in run.iterdir() if (t / f"writer={writer_id}").is_dir() and t.name != "_commits"}


def test_flushes_append_to_one_file_per_table_and_read_exactly(tmp_path: Path) -> None:
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=3600, seal_secs=3600)
    for i in range(200):
        w.append("scalars", _rows(i))
        w.append("spectra", {"step": i, "tensor": "w", "k": 2, "sigma": [[1.5, float(i), math.nan]],
                             "u1": [[np.float32(0.1).item(), -2.5]], "v1": [None]})
        w.flush()
    files = _files(run, w.writer_id)
    assert all(len(names) == 1 and names[0].endswith(".jsonl") for names in files.values()), files
    expected = [(i, k, v) for i in range(200) for k, v in zip(_rows(i)["key"], _rows(i)["value"], strict=True)]
    with open_store(run) as s:
        got = s.rows("SELECT step, key, value FROM scalars ORDER BY step, value NULLS LAST, key NULLS LAST")
        spectra = s.rows("SELECT step, sigma, u1, v1 FROM spectra ORDER BY step")
    assert len(got) == len(expected) == 1400
    assert _same(got, expected)
    assert [r[0] for r in spectra] == list(range(200)) and spectra[7][1][:2] == [1.5, 7.0] and math.isnan(spectra[7][1][2])
    assert spectra[7][2] == [np.float32(0.1).item(), -2.5] and spectra[7][3] is None  # float32 lists, exactly
    assert _sealed(run) == []  # other engines read segments only: nothing sealed yet
    w.close()
    with open_store(run) as s:  # sealed at close: the same values from the segment, for every engine
        sealed = s.rows("SELECT step, key, value FROM scalars ORDER BY step, value NULLS LAST, key NULLS LAST")
        assert str(s.rows("SELECT step, sigma, u1, v1 FROM spectra ORDER BY step")) == str(spectra)
    assert _same(sealed, got)
    files = wait_until(lambda: _sealed(run), "the sealed segment in effect (its settle after close)")
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet({files!r})").fetchall() == [(1400,)]


def _sealed(run: Path) -> list[str]:
    return [f for f in live_files(run, "scalars") if "writer=_schema" not in f]


def _same(a: list, b: list) -> bool:
    key = lambda r: (r[0], r[2] is None, -1 if r[2] is None or math.isnan(r[2]) else r[2], r[1] or "")  # noqa: E731
    return all(x[0] == y[0] and x[1] == y[1] and (x[2] == y[2] or (x[2] is not None and y[2] is not None and
               math.isnan(x[2]) and math.isnan(y[2]))) for x, y in zip(sorted(a, key=key), sorted(b, key=key), strict=True))


def test_every_query_reads_each_row_once_while_the_writer_seals(tmp_path: Path, quick: None) -> None:
    """Seals every few flushes, the sealed journals deleted after their grace, and the writer's own fold
    merging the sealed segments: a counting reader sees, at every moment, every row flushed before its
    query started and none that was not appended by its end (a flush may land while it runs)."""
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=0.03, seal_secs=0.15)
    done, appended = [0], [0]  # rows flushed, rows handed to the writer
    stop = threading.Event()
    counts: list[tuple[int, int, int]] = []
    failure: list[BaseException] = []

    def read() -> None:
        try:
            while not stop.is_set():
                lo = done[0]
                with open_store(run) as s:
                    n = s.rows("SELECT count(*) FROM scalars")[0][0]
                counts.append((lo, n, appended[0]))
        except BaseException as exc:  # reported by the test thread
            failure.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        deadline = time.monotonic() + 8
        i = 0
        while time.monotonic() < deadline or len(counts) < 20:
            appended[0] = 50 * (i + 1)
            w.append("scalars", {"step": i, "key": [f"m{k}" for k in range(50)], "value": np.full(50, float(i))})
            i += 1
            wait_until(lambda n=50 * i: w.rows_written >= n, "the writer thread's flush")  # noqa: B023
            done[0] = 50 * i
            assert time.monotonic() < deadline + 120, "the reader made too few queries"
    finally:
        stop.set()
        reader.join(60)
    assert not failure, failure
    bad = [c for c in counts if not c[0] <= c[1] <= c[2]]
    assert not bad, bad[:5]
    assert own_fold.SEALED_KEEP >= len([f for f in live_files(run, "scalars") if w.writer_id in f])
    sealed = [f for f in (run / "scalars" / f"writer={w.writer_id}").glob("*.jsonl")]
    # sealed journals are deleted after their settle and grace: the open one, and those sealed since then
    assert len(sealed) <= 2 + math.ceil((journal.SETTLE_S + journal.GRACE_S) / 0.15), sealed
    w.close()
    with open_store(run) as s:
        assert s.rows("SELECT count(*), count(DISTINCT step) FROM scalars") == [(50 * i, i)]


def test_a_failed_append_is_cut_back_and_written_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=3600, seal_secs=3600)
    w.append("scalars", _rows(0))
    w.flush()
    real = os.write
    calls = [0]

    def half(fd: int, data) -> int:  # the disk fills halfway through the next flush's bytes
        calls[0] += 1
        if calls[0] == 1:
            real(fd, bytes(data[: len(data) // 2]))
            raise OSError(28, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(journal.os, "write", half)
    with pytest.warns(RuntimeWarning, match="segment write failed"):
        w.append("scalars", _rows(1))
        w.flush()
    with open_store(run) as s:
        assert s.rows("SELECT count(*) FROM scalars") == [(7,)]  # the half-written flush reads as nothing
    monkeypatch.setattr(journal.os, "write", real)
    w._backoff.record(ok=True)  # the retry waits out no backoff here
    w.flush()
    w.close()
    with open_store(run) as s:
        assert s.rows("SELECT step, count(*) FROM scalars GROUP BY step ORDER BY step") == [(0, 7), (1, 7)]


def test_a_failing_seal_is_reported_once_and_tried_less_often(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=3600, seal_secs=0.01)  # a seal is due at every flush
    monkeypatch.setattr(journal, "SEAL_RETRY_S", 3600.0)
    real, tries = journal.seal_files, []

    def full(paths, *args, **kwargs):
        tries.append(len(paths))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal, "seal_files", full)
    with pytest.warns(RuntimeWarning, match="sealing the journal failed"):
        for i in range(10):
            w.append("scalars", _rows(i))
            w.flush()
    assert len(tries) == 1  # then it waits, however many flushes come
    w.journal.retry_at = 0.0  # the wait is over: tried again, not reported again
    w.append("scalars", _rows(10))
    w.flush()
    assert len(tries) == 2 and w.journal.failures == 2 and w.journal.retry_at - time.monotonic() > 3000  # waits again
    monkeypatch.setattr(journal, "seal_files", real)
    w.journal.retry_at = 0.0
    w.flush()
    assert w.journal.failures == 0 and w.journal.base is None  # sealed
    w.close()
    with open_store(run) as s:
        assert s.rows("SELECT count(*), count(DISTINCT step) FROM scalars") == [(77, 11)]
        assert s.rows("SELECT count(*) FROM events WHERE event = 'seal_error'") == [(1,)]


def test_a_seal_renamed_late_has_longer_the_next_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host loaded far past its cores a seal's rename can land after the 1 s in which the segment takes
    effect: that seal is undone, and the next has twice as long."""
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=3600, seal_secs=0.01)  # a seal is due at every flush
    real, seals = os.replace, set()

    def slow(src, dst):  # each seal's renames, late by 1.2 s (its segments share their time .v<t>)
        if ".seal-" in str(src) and (t := str(dst).rsplit(".v", 1)[-1]) not in seals:
            seals.add(t)
            time.sleep(1.2)
        real(src, dst)

    monkeypatch.setattr(os, "replace", slow)
    with pytest.warns(RuntimeWarning, match=r"renamed after they took effect \(1 s\)"):
        w.append("scalars", _rows(0))
        w.flush()
    assert w.journal.failures == 1 and w.journal.base is not None  # undone: the journal still counts
    w.journal.retry_at = 0.0
    w.flush()
    assert w.journal.failures == 0 and w.journal.base is None  # sealed, in 2 s
    monkeypatch.setattr(os, "replace", real)
    w.close()
    with open_store(run) as s:
        assert s.rows("SELECT count(*), count(DISTINCT step) FROM scalars") == [(7, 1)]




def test_a_writer_killed_leaves_journals_that_count_and_are_sealed_for_it(
        tmp_path: Path, quick: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(at_rest, "CRASHED_MARGIN_S", 0.5)  # the dead writer is known dead a second after
    run = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-c", killed_writer.SCRIPT, str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    acked = -1
    while acked < 40:
        acked = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    rest = proc.stdout.read().split()
    proc.wait(30)
    acked = int(rest[-1]) if rest else acked
    with open_store(run) as s:
        n, steps = s.rows("SELECT count(*), count(DISTINCT step) FROM scalars")[0]
    assert n == killed_writer.KEYS * steps and acked + 1 <= steps <= acked + 2, (n, steps, acked)  # whole flushes, the last maybe
    jfile = next((run / "scalars").glob("writer=r0-*/*.jsonl"))
    with open(jfile, "ab") as f:  # a line cut short by the kill
        f.write(b'{"run_id":"r","rank":0,"role":"trainer","step":99999,"key":"m0","val')
    with open_store(run) as s:
        assert s.rows("SELECT count(*) FROM scalars") == [(n,)]
    # The heartbeat goes stale, the run's fold seals the journal for the dead writer, and deletes it once covered.
    wait_until(lambda: at_rest.settle(run, time.monotonic() + 1.0, 0.3, 0.5) is not None and not list(
        (run / "scalars").glob("writer=r0-*/*.jsonl")), "the orphan journal sealed and deleted", timeout_s=120)
    with open_store(run) as s:
        assert s.rows("SELECT count(*), count(DISTINCT step) FROM scalars") == [(n, steps)]
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet({live_files(run, 'scalars')!r})").fetchall() == [(n,)]


def test_a_closed_run_comes_to_rest_without_journals(tmp_path: Path, quick: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writers close; the run's fold moves their sealed segments into ``writer=_merged``, and its
    deletions take the journals before the covers that hide them: at rest, no writer directory is left."""
    monkeypatch.setattr(at_rest, "SETTLE_S", 0.3)
    monkeypatch.setattr(at_rest, "GRACE_S", 0.5)
    run = tmp_path / "r"
    writers = [RunWriter(run, rank=r, flush_secs=3600, seal_secs=3600) for r in range(2)]
    for i in range(30):
        for r, w in enumerate(writers):
            w.append("scalars", {"step": i, "key": f"r{r}", "value": float(i)})
            w.flush()
        if i == 14:
            for w in writers:
                w._seal(force=True)  # a first generation sealed mid-run, the second at close
    for w in writers:
        w.close()
    wait_until(lambda: at_rest.settle(run, time.monotonic() + 1.0, 0.3, 0.5), "the run at rest", timeout_s=120)
    left = sorted(str(p.relative_to(run)) for p in run.glob("*/writer=r*/*"))
    assert left == [], left
    with open_store(run) as s:
        assert s.rows("SELECT count(*), count(DISTINCT (step, key)) FROM scalars") == [(60, 60)]


def test_a_journal_read_short_runs_the_query_again_and_a_parquet_file_read_short_fails_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of a journal that its writer is appending to can come up short on FUSE and network file
    systems (tests/test_faults_fuse.py grows one on a mount): the query runs again. A Parquet file read
    short is corrupt, and says so at once."""
    monkeypatch.setattr(own_fold, "DELETE_WINDOW_S", 0.0)  # no deletion window to wait out between runs
    tries: list[int] = []

    def query(path: str) -> str:
        tries.append(1)
        if len(tries) < 3:
            raise duckdb.IOException(f'IO Error: Could not read enough bytes from file "{path}": attempted to '
                                     'read 80772 bytes from location 19604604')
        return "rows"

    assert retry_vanished(lambda: query("/runs/a/scalars/writer=r0-x/000000000012.jsonl")) == "rows"
    assert len(tries) == 3
    tries.clear()
    with pytest.raises(duckdb.IOException, match="Could not read enough bytes"):
        retry_vanished(lambda: query("/runs/a/scalars/writer=r0-x/000000000001-000000000011.parquet"))
    assert len(tries) == 1


@pytest.mark.parametrize("failing", [1, 99])  # the seal at close fails once; every time (a full disk)
def test_a_seal_that_fails_at_close_is_reported_and_the_writer_still_closed(
        tmp_path: Path, quick: None, monkeypatch: pytest.MonkeyPatch, failing: int) -> None:
    """On a loaded host the last seal's renames can land late. Its rows are committed (journals count), so
    the writer is closed all the same, with the failure written as an event, and the run comes to rest on
    its own: a writer left unmarked would read as crashed and keep its directory until ``dynascope compact``."""
    monkeypatch.setattr(at_rest, "SETTLE_S", 0.3)
    monkeypatch.setattr(at_rest, "GRACE_S", 0.5)
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=3600, seal_secs=3600)
    for i in range(5):
        w.append("scalars", _rows(i))
        w.flush()
    real, tries = journal.seal_files, []

    def late(paths, *args, **kwargs):
        tries.append(len(paths))
        if len(tries) <= failing:
            raise TimeoutError("sealed segments renamed after they took effect (0.3 s)")
        return real(paths, *args, **kwargs)

    monkeypatch.setattr(journal, "seal_files", late)
    with pytest.warns(RuntimeWarning, match="sealing the journal failed"):
        w.close()
    # the seal at close, and again with the event it reported; one that keeps failing, once more by the fold
    assert len(tries) == (2 if failing == 1 else 3)
    assert (run / "_writers" / f"{w.writer_id}.closed").exists()
    monkeypatch.setattr(journal, "seal_files", real)  # the run's fold seals what the writer could not
    wait_until(lambda: at_rest.settle(run, time.monotonic() + 1.0, 0.3, 0.5), "the run at rest", timeout_s=120)
    assert sorted(str(p.relative_to(run)) for p in run.glob("*/writer=r*/*")) == []
    with open_store(run) as s:
        assert s.rows("SELECT count(*), count(DISTINCT step) FROM scalars") == [(35, 5)]
        assert s.rows("SELECT count(*) FROM events WHERE event = 'seal_error'") == [(1,)]
        assert s.rows("SELECT count(*) FROM events WHERE event = 'run_end'") == [(1,)]


def test_a_filtered_query_types_each_journal_line_once(tmp_path: Path) -> None:
    """A filter pushed below the journal's typing would call ``json_transform`` once per column it names
    (the what-ifs' filter names eight); the typed lines are read once, and the filter gives the same rows."""
    run = tmp_path / "r"
    with RunWriter(run, flush_secs=3600, seal_secs=3600) as w:
        rows = [{"rank": 0, "step": s, "phase": p, "parent": par, "start_us": s * 100 + i, "dur_us": i + 1,
                 "category": cat} for s in range(50) for i, (p, par, cat) in enumerate(
                    [("fwd", None, "phase"), ("bwd", None, "phase"), ("k", "fwd", "kernel"), ("step", None, "step")])]
        w.append("timings", {k: [r[k] for r in rows] for k in rows[0]})
        w.flush()
        assert all(n.endswith(".jsonl") for n in _files(run, w.writer_id)["timings"])  # the rows are in the journal
        where = "step IS NOT NULL AND phase <> 'step' AND coalesce(parent, '') = '' AND category = 'phase'"
        with open_store(run) as s:
            plan = "".join(str(r[1]) for r in s.rows(f"EXPLAIN SELECT step, phase, dur_us FROM timings WHERE {where}"))
            got = s.rows(f"SELECT step, phase, dur_us FROM timings WHERE {where} ORDER BY step, phase")
    assert plan.count("json_transform") == 1, plan
    want = sorted((r["step"], r["phase"], r["dur_us"]) for r in rows if r["category"] == "phase")
    assert got == want and len(got) == 100
