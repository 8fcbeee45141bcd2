"""Real processes append to one store while readers poll it and a compactor merges under them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dynascope.store import RunWriter, open_store
from dynascope.store.compact import compact_store

from helpers.as_written import as_written  # noqa: F401 - the fixture pytestmark names

pytestmark = pytest.mark.usefixtures("as_written")  # compaction's input, no settling process beside it

# A writer process: `rows` rows with unique integer ids in `step`, paced so readers see it grow.
CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from dynascope.store import RunWriter
    run, rank, rows, batch, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    w = RunWriter(run, rank=rank, flush_secs=0.1, flush_rows=50_000)
    base = rank * 10_000_000
    for start in range(0, rows, batch):
        w.append("scalars", {"step": np.arange(base + start, base + start + batch), "key": "x", "value": 1.0})
        time.sleep(pause)
    w.close()
""")


def spawn(run, rank, rows, batch=2000, pause=0.005):
    return subprocess.Popen([sys.executable, "-c", CHILD, str(run), str(rank), str(rows), str(batch), str(pause)])


def poll(path, procs, sql="SELECT count(*) FROM scalars"):
    """Counts seen every 100 ms until every process exits, then once more; errors are collected, not raised."""
    seen, errors = [], []
    with open_store(path) as store:
        while True:
            done = all(p.poll() is not None for p in procs)
            try:  # on its own cursor, again if compaction deleted a file mid-query (StoreConnection.rows)
                seen.append(store.rows(sql)[0][0])
            except Exception as exc:  # the test asserts there are none
                errors.append(repr(exc))
            if done:
                return seen, errors
            time.sleep(0.1)


@pytest.mark.slow
def test_eight_writers_and_a_polling_reader(tmp_path):
    run = tmp_path / "run"
    RunWriter(run).close()  # the run exists before the reader opens it
    procs = [spawn(run, rank, 200_000) for rank in range(8)]
    seen, errors = poll(run, procs)
    assert [p.wait() for p in procs] == [0] * 8
    assert errors == []
    assert seen == sorted(seen), "the row count went down"
    assert seen[-1] == 1_600_000
    assert len(set(seen)) > 3  # the reader really watched it grow
    with open_store(run) as s:
        assert s.rows("SELECT count(DISTINCT step) FROM scalars") == [(1_600_000,)]


@pytest.mark.slow
def test_compaction_under_live_writers_and_readers(tmp_path):
    """Two runs under one root, two writers each, a compactor looping, a reader per run and one on the root."""
    root = tmp_path / "root"
    for name in ("a", "b"):
        RunWriter(root / name).close()
    procs = [spawn(root / name, rank, 60_000, batch=200, pause=0.01)
             for name in ("a", "b") for rank in range(2)]
    stop = threading.Event()
    compactions = []

    def compactor():
        while not stop.is_set():
            compactions.append(compact_store(root, grace_s=0.5, settle_s=0.2, target_rows=30_000))

    t = threading.Thread(target=compactor)
    t.start()
    results = {}
    readers = [threading.Thread(target=lambda p=p: results.__setitem__(p, poll(p, procs)))
               for p in (root / "a", root / "b", root)]
    for r in readers:
        r.start()
    for r in readers:
        r.join()
    stop.set()
    t.join()
    final = compact_store(root, grace_s=0.0, settle_s=0.0, wait=True)  # merge and delete everything left
    assert [p.wait() for p in procs] == [0] * 4
    for path, (seen, errors) in results.items():
        assert errors == [], path
        assert seen == sorted(seen), f"{path}: the row count went down"
    assert results[root][0][-1] == 240_000
    assert sum(c.new_segments for c in compactions) > 0, "the compactor never merged while writers ran"
    assert sum(c.removed_segments for c in compactions) > 0, "nor deleted a merged-away segment under readers"
    assert final.removed_segments > 0
    with open_store(root) as s:
        assert s.sql("SELECT run_id, count(*), count(DISTINCT (rank, step)) FROM scalars GROUP BY 1 ORDER BY 1"
                          ).fetchall() == [("a", 120_000, 120_000), ("b", 120_000, 120_000)]
