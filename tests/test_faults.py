"""Faults during real (short) training: the loop always finishes, losses are bounded and counted."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch

import dynascope
from dynascope.store import RunWriter, open_store

from helpers.tiny_training import tiny_training
from helpers.waiting import wait_until


def events(run, kind):
    with open_store(run) as s:
        return s.sql(f"SELECT count(*) FROM events WHERE event = '{kind}'").fetchall()[0][0]


def test_run_dir_deleted_mid_training(tmp_path):
    run = tmp_path / "run"
    w = RunWriter(run, flush_secs=0.02)

    def delete(step):
        if step == 10:
            w.flush()
            os.rename(run, tmp_path / "gone")  # vanishes in one step (rmtree races the writer's recreation)
            shutil.rmtree(tmp_path / "gone")
        if step == 11:  # the writer thread meets the missing directory on its own, at its next flush
            wait_until(lambda: (run / "dynascope.json").exists(), "the writer to recreate the run directory")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tiny_training(40, scope=True, writer=w, on_step=delete) == 40
        w.close()
    vanished = [c for c in caught if "vanished" in str(c.message)]
    assert len(vanished) == 1, [str(c.message) for c in caught]  # warns once
    assert (run / "dynascope.json").exists()
    with open_store(run) as s:
        # the loop's own metrics (the probes also log scalars, resolved off-thread and possibly later)
        steps = {r[0] for r in s.sql("SELECT DISTINCT step FROM scalars WHERE key LIKE 'fault/%'").fetchall()}
        assert steps == set(range(11, 40))  # everything appended after the deletion survived
        assert s.sql("SELECT count(*) FROM tensor_stats WHERE step > 11").fetchall()[0][0] > 0
    assert events(run, "run_dir_recreated") == 1


DISK_FULL = textwrap.dedent("""
    import json, resource, signal, sys
    sys.path.insert(0, sys.argv[2])
    from helpers.tiny_training import tiny_training
    from dynascope.store import RunWriter
    w = RunWriter(sys.argv[1], flush_secs=0.02, max_buffer_rows=2_000)
    # From here on no file may grow past 1 KiB: every segment write fails with EFBIG, like a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
    steps = tiny_training(60, scope=True, writer=w)
    w.close(timeout_s=5)
    print(json.dumps({"steps": steps, "dropped": w.rows_dropped, "errors": w.write_errors, "written": w.rows_written}))
""")


@pytest.mark.slow
def test_disk_full_training_finishes_and_counts_drops(tmp_path):
    out = subprocess.run([sys.executable, "-c", DISK_FULL, str(tmp_path / "run"), os.path.dirname(__file__)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["steps"] == 60
    assert stats["errors"] > 0 and stats["written"] == 0
    assert stats["dropped"] >= 60 * 50  # every scalars row was counted as dropped, none silently lost
    assert "segment write failed" in out.stderr  # the warning
    assert "Traceback" not in out.stderr


def test_transient_write_errors_lose_nothing(tmp_path, monkeypatch):
    import dynascope.store.flush as flush_mod

    real, failures = flush_mod.pq.write_table, {"left": 5}

    def flaky(*args, **kwargs):
        if failures["left"] > 0:
            failures["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    w = RunWriter(tmp_path / "run", flush_secs=0.01)
    monkeypatch.setattr(flush_mod.pq, "write_table", flaky)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_training(30, writer=w)
        # the writer thread retries on its own until the disk takes the rows again
        # (rows_written also counts the run's own rows: the runs row, the write_error events)
        wait_until(lambda: failures["left"] == 0 and w.rows_written >= 30 * 50, "the writer to get past 5 failures")
        w.close()
    assert failures["left"] == 0 and w.write_errors == 5 and w.rows_dropped == 0
    assert any("No space left" in str(c.message) for c in caught)
    with open_store(tmp_path / "run") as s:
        assert s.sql("SELECT count(*) FROM scalars").fetchall() == [(30 * 50,)]
    assert events(tmp_path / "run", "write_error") >= 1 and events(tmp_path / "run", "write_recovered") >= 1


def test_exception_in_writer_thread_is_reported(tmp_path):
    class Buggy(RunWriter):
        calls = 0

        def flush(self):
            Buggy.calls += 1
            if Buggy.calls == 2:  # the thread's second flush hits a bug
                raise RuntimeError("boom")
            super().flush()

    w = Buggy(tmp_path / "run", flush_secs=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_training(20, writer=w)
        wait_until(lambda: Buggy.calls >= 3, "the writer thread's flush after the failed one")  # it lived on
        w.close()
    assert any("flush failed: RuntimeError: boom" in str(c.message) for c in caught)
    assert events(tmp_path / "run", "writer_error") == 1
    with open_store(tmp_path / "run") as s:  # the thread lived on: nothing was lost
        assert s.sql("SELECT count(*) FROM scalars").fetchall() == [(20 * 50,)]


def test_writer_slower_than_training_drops_oldest(tmp_path):
    class Slow(RunWriter):
        def _commit(self, groups):
            time.sleep(0.25)  # far slower than a training step
            return super()._commit(groups)

    w = Slow(tmp_path / "run", flush_secs=0.01, max_buffer_rows=200)
    assert tiny_training(60, scope=True, writer=w) == 60  # training finished: the writer never blocked it
    # The probe's rows arrive in bursts from its own thread (up to scope.close()), so which training-loop
    # batch was oldest at each overflow depends on timing. What the policy promises is order of arrival:
    # a batch appended after everything else is the newest and survives.
    w.append("scalars", {"step": 60, "key": "fault/last", "value": 1.0})
    w.close()
    assert w.rows_dropped > 0
    with open_store(tmp_path / "run") as s:
        recorded = s.rows("SELECT sum(CAST(json_extract(fields_json, '$.dropped') AS BIGINT)) FROM events "
                          "WHERE event = 'rows_dropped'")[0][0]
        assert recorded == w.rows_dropped  # every dropped row is counted in an events row
        assert s.rows("SELECT step FROM scalars WHERE key = 'fault/last'") == [(60,)]
        # the largest table (the loop's 50 scalars a step) is the one that lost rows
        assert s.rows("SELECT count(*) FROM events WHERE event = 'rows_dropped' "
                      "AND json_extract_string(fields_json, '$.table') = 'scalars'")[0][0] >= 1
        assert s.rows("SELECT count(*) FROM scalars WHERE key LIKE 'fault/m%'")[0][0] < 60 * 50


# ---- SIGKILL during flushes -----------------------------------------------------------------------------
BATCH = 500


def _flush_forever(run: str, fd: int) -> None:
    w = RunWriter(run, flush_secs=3600, flush_rows=10**9)
    os.write(fd, struct.pack("q", -1))  # the run exists
    i = 0
    while True:
        w.append("scalars", {"step": np.arange(i * BATCH, (i + 1) * BATCH), "key": "k", "value": float(i)})
        w.flush()  # synchronous: when it returns, batch i is on disk
        os.write(fd, struct.pack("q", i))
        i += 1


def _kill_one(args: tuple[str, float, bool]) -> int:
    # from_ready: the delay counts from the run's creation, not from the fork, so those kills land among
    # the flushes however long the writer's start-up takes on a loaded machine.
    run, delay, from_ready = args
    r, wfd = os.pipe()
    pid = os.fork()  # pool workers are daemons and may not start multiprocessing children; fork directly
    if pid == 0:
        os.close(r)
        try:
            _flush_forever(run, wfd)
        finally:
            os._exit(1)
    os.close(wfd)
    data = b""
    if from_ready and select.select([r], [], [], 120)[0]:  # a deadline, not a wait for a fixed time
        data = os.read(r, 8)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    return struct.unpack("q", data[-8:])[0] if len(data) >= 8 else -1


@pytest.mark.slow
def test_sigkill_at_100_random_points(tmp_path):
    rng = random.Random(1234)
    # half the kills count from the fork (some land while the run is being created), half from the run's
    # creation (they land among the flushes)
    jobs = [(str(tmp_path / f"run{i:03d}"), rng.uniform(0.0, 0.8), i % 2 == 1) for i in range(100)]
    # spawned workers: a worker forked from this many-threaded process can inherit a lock another thread
    # held at the fork (a pool's queue lock), and wait on it for ever
    with mp.get_context("spawn").Pool(4) as pool:
        durable = pool.map_async(_kill_one, jobs).get(timeout=900)
    runs = [j[0] for j in jobs if os.path.exists(os.path.join(j[0], "dynascope.json"))]
    with open_store(tmp_path) as s:  # the root of 100 killed runs opens, and every run reads
        rows = s.sql("SELECT run_id, count(*), min(step), max(step), count(DISTINCT step) "
                          "FROM scalars GROUP BY 1").fetchall()
    got = {r[0]: r[1:] for r in rows}
    killed_mid_flush = 0
    for (run, _, _), last in zip(jobs, durable, strict=True):
        rid = os.path.basename(run)
        n, lo, hi, distinct = got.get(rid, (0, None, None, 0))
        assert n % BATCH == 0, f"{rid}: a partial batch was read"
        assert n >= (last + 1) * BATCH, f"{rid}: a flushed batch was lost"
        assert n <= (last + 2) * BATCH  # at most the one batch whose flush finished as the kill landed
        if n:
            assert (lo, hi, distinct) == (0, n - 1, n), f"{rid}: rows missing or doubled"
        killed_mid_flush += any(f.endswith(".tmp") for _, _, fs in os.walk(run) for f in fs)
    assert len(runs) >= 25  # kills also land while a run is being created: those leave no marker, no run
    assert killed_mid_flush > 0  # some kills really landed inside a segment write


def test_system_sampler_last_sample_error_is_reported(tmp_path):
    """A sample that fails at close (the last one, which short runs rely on) warns and leaves an event row."""
    run = tmp_path / "run"
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scope = dynascope.watch(model, opt, run=run, system_interval_s=3600)

    class Gone:
        def cpu_percent(self, interval):
            raise ProcessLookupError("process vanished")

    scope.system._proc = Gone()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with pytest.warns(RuntimeWarning, match="system sampler stopped: ProcessLookupError"):
        scope.close()
    with open_store(run) as s:
        rows = s.rows("SELECT fields_json->>'probe', message FROM events WHERE event = 'probe_error'")
    assert [r[0] for r in rows] == ["system"], rows
    assert "process vanished" in rows[0][1]
