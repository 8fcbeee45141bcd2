"""The store on a real file system that fails: a FUSE mount (``helpers/faultfs.py``) whose writes stall, or
answer ENOSPC or EIO, on command, under a live training loop and a live writer.

- A stall (an NFS or Lustre server that stops answering) must not stall training: no step waits on it,
  ``close`` keeps its deadline, and the rows land once the server answers again.
- A full or failing disk loses no row the writer acknowledged, and every row it could not keep is
  counted in a ``rows_dropped`` event: kept + dropped = appended, exactly.
- A journal that grows while a query reads it (FUSE, like network file systems, can read fewer bytes than
  the size it reported a moment before) never fails the query.
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import dynascope
from dynascope.store import RunWriter, open_store

from helpers.waiting import wait_until

pytestmark = pytest.mark.skipif(not (os.path.exists("/dev/fuse") and shutil.which("fusermount")),
                                reason="needs /dev/fuse and fusermount (Debian's fuse, installed by .ci/run)")
# fusepy raises OSError, not ImportError, when libfuse itself is missing: both mean "skip", not "error".
pytest.importorskip("fuse", reason="needs fusepy (a dev extra) and libfuse2", exc_type=(ImportError, OSError))
from helpers.faultfs import Mount  # noqa: E402 - needs fusepy, checked just above


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Mount]:
    m = Mount(tmp_path)  # the daemon's own deadline: a mount that never comes up fails the test
    try:
        yield m
    finally:
        m.close()


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


@pytest.mark.slow
def test_a_stalled_file_system_stalls_neither_training_nor_close(mount: Mount) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scope = dynascope.watch(model, opt, run=mount.path / "run", system_interval_s=None, memory_budget=None)
    scope.writer.flush_secs = 0.2  # flush often, so flushes are caught mid-stall
    x = torch.randn(16, 32)
    healthy = [_step(model, opt, x) for _ in range(30)]
    wait_until(lambda: (mount.backing / "run" / "tensor_stats").is_dir(), "the run on the mount")
    mount.set("stall")
    stalled, t0 = [], time.monotonic()
    while time.monotonic() - t0 < 3.0:  # the stall lasts 3 s of training, far longer than any step
        stalled.append(_step(model, opt, x))
    steps = len(healthy) + len(stalled)
    t1 = time.monotonic()
    scope.close(timeout_s=1.0)
    closed_in = time.monotonic() - t1
    print(f"\nstep time, healthy {statistics.median(healthy) * 1e3:.2f} ms, stalled "
          f"{statistics.median(stalled) * 1e3:.2f} ms (median), slowest {max(stalled) * 1e3:.1f} ms; "
          f"close {closed_in:.2f} s")
    # A step that waited on the file system would wait until the stall ended: the slowest step would be
    # seconds long, and the loop would have run a fraction of the steps it runs in 3 s.
    assert max(stalled) < 2.0, "a step waited on the stalled file system"
    assert len(stalled) >= 0.25 * 3.0 / statistics.median(healthy), (len(stalled), statistics.median(healthy))
    assert closed_in < 3.0, "close() waited past its deadline"
    mount.set("ok")  # the server answers again: what close left in flight lands, whole

    def landed() -> bool:
        with open_store(mount.backing / "run") as con:
            return con.rows("SELECT count(DISTINCT step) FROM tensor_stats")[0][0] == steps

    wait_until(landed, "the stalled steps' rows, once the file system answers", timeout_s=60)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["enospc", "eio"])
def test_a_failing_disk_keeps_acknowledged_rows_and_counts_every_drop(mount: Mount, fault: str) -> None:
    w = RunWriter(mount.path / "run", flush_secs=0.05, flush_rows=1000, max_buffer_bytes=1 << 20)
    rows = 100

    def batch(step: int) -> dict:
        return {"step": step, "key": [f"m{i}" for i in range(rows)], "value": np.full(rows, float(step))}

    for step in range(50):
        w.append("scalars", batch(step))
    w.flush()  # acknowledged: these rows are on disk
    acknowledged = 50 * rows
    mount.set(fault)
    for step in range(50, 500):  # ~3 MiB of rows against a 1 MiB bound while the disk refuses every write
        w.append("scalars", batch(step))
    wait_until(lambda: w.write_errors >= 2 and w.rows_dropped > 0, f"the writer to meet {fault} and drop rows")
    mount.set("ok")
    w.close(timeout_s=30)
    with open_store(mount.backing / "run") as con:
        kept, low = con.rows("SELECT count(*), min(step) FROM scalars")[0]
        first = con.rows("SELECT count(*) FROM scalars WHERE step < 50")[0][0]
        dropped = con.rows("SELECT sum(CAST(json_extract(fields_json, '$.dropped') AS BIGINT)) FROM events "
                           "WHERE event = 'rows_dropped'")[0][0]
    assert first == acknowledged and low == 0  # nothing acknowledged was lost
    assert dropped == w.rows_dropped > 0  # every drop is in an event
    assert kept + w.rows_dropped == 500 * rows  # and every row is kept or counted


@pytest.mark.slow
def test_a_journal_growing_on_the_mount_never_fails_a_query(mount: Mount) -> None:
    # Past its first 16 MiB buffer DuckDB reads a journal in ranges planned from the file's size: of a
    # journal being appended to on this mount, between 1 query in 40 and 1 in 6 came up short before such
    # a read ran again (reader.retry_vanished; tests/test_journal.py holds the rule itself)
    run = mount.path / "run"
    w = RunWriter(run, flush_secs=0.05, seal_secs=3600.0, fold=False)
    batch = {"step": np.arange(2000), "key": "k" * 64, "value": np.linspace(0.0, 1.0, 2000)}
    appended = [0]

    def append() -> None:
        w.append("scalars", batch)
        w.flush()
        appended[0] += 2000

    while sum(p.stat().st_size for p in run.glob("scalars/writer=r*/*.jsonl")) < 20 << 20:
        assert appended[0] < 2_000_000, "the journal did not grow"
        append()
    stop = threading.Event()

    def keep_appending() -> None:
        while not stop.is_set():
            append()

    appender = threading.Thread(target=keep_appending)
    appender.start()
    counts = []
    try:
        for _ in range(30):
            with open_store(run) as con:
                counts.append(con.rows("SELECT count(*) FROM scalars")[0][0])
    finally:
        stop.set()
        appender.join()
        w.close()
    assert counts == sorted(counts) and counts[-1] > counts[0], counts  # each query read the journal as it grew
    with open_store(run) as con:
        assert con.rows("SELECT count(*) FROM scalars")[0][0] == appended[0]
