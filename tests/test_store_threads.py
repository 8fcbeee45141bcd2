"""One StoreConnection shared by many threads, as the dashboard shares its cached store between Streamlit's
script threads and its prefetch pool: ``frame``/``rows``/``arrow`` run each call on its own cursor and retry
when compaction deletes a segment mid-query, so a writer appending and ``compact`` merging cause no errors."""

from __future__ import annotations

import threading
import time

import numpy as np
import polars as pl
import pytest

from dynascope.store import RunWriter, StoreConnection, StoreError, open_store
from dynascope.store.compact import compact_store

THREADS = 8
BATCHES, BATCH = 150, 200


def _writer(run, stop: threading.Event) -> None:
    """Rows with unique steps, flushed every few batches: many small segments for compaction to merge."""
    with RunWriter(run, flush_secs=0.05, flush_rows=1_000) as w:
        for b in range(BATCHES):
            w.append("scalars", {"step": np.arange(b * BATCH, (b + 1) * BATCH), "key": "x", "value": 1.0})
            time.sleep(0.01)
    stop.set()


def _reader(store: StoreConnection, i: int, stop: threading.Event, seen: list[int], errors: list[str]) -> None:
    """Count rows through the three entry points in turn until the writer is done, then once more."""
    sql = "SELECT count(*) AS n FROM scalars WHERE key = $key"
    while True:
        done = stop.is_set()
        try:
            way = (len(seen) + i) % 3
            if way == 0:
                n = store.frame(sql, {"key": "x"})["n"][0]
            elif way == 1:
                n = store.rows(sql, {"key": "x"})[0][0]
            else:
                n = store.arrow(sql, {"key": "x"}).column("n")[0].as_py()
            seen.append(int(n))
        except Exception as exc:  # the test asserts there are none
            errors.append(repr(exc))
        if done:
            return


def test_eight_threads_share_one_store_while_it_is_written_and_compacted(tmp_path):
    run = tmp_path / "run"
    RunWriter(run).close()  # the run exists before the store is opened
    stop, halt_compactor = threading.Event(), threading.Event()
    compactions = []

    def compactor():
        while not halt_compactor.is_set():
            compactions.append(compact_store(run, grace_s=0.1, settle_s=0.05, target_rows=100_000))
            time.sleep(0.02)

    seen: list[list[int]] = [[] for _ in range(THREADS)]
    errors: list[str] = []
    with open_store(run) as store:
        threads = [threading.Thread(target=_writer, args=(run, stop)), threading.Thread(target=compactor)]
        threads += [threading.Thread(target=_reader, args=(store, i, stop, seen[i], errors)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads[2:] + threads[:1]:
            t.join()
        halt_compactor.set()
        threads[1].join()
        assert store.rows("SELECT count(*), count(DISTINCT step) FROM scalars") == [(BATCHES * BATCH,) * 2]

    assert errors == []
    for i, counts in enumerate(seen):
        assert counts == sorted(counts), f"thread {i}: the row count went down"
        assert counts[-1] == BATCHES * BATCH
        assert len(set(counts)) > 3, f"thread {i} never saw the store grow"
    assert sum(c.new_segments for c in compactions) > 0, "compaction never merged under the readers"
    assert sum(c.removed_segments for c in compactions) > 0, "nor deleted a merged-away segment under them"


def test_the_small_api(tmp_path):
    run = tmp_path / "run"
    with RunWriter(run) as w:
        w.append("scalars", {"step": [1, 2, 3], "key": ["a", "b", "a"], "value": [1.0, 2.0, 3.0]})
    with open_store(run) as store:
        df = store.frame("SELECT step, value FROM scalars WHERE key = ? ORDER BY step", ["a"])
        assert isinstance(df, pl.DataFrame) and df.rows() == [(1, 1.0), (3, 3.0)]
        assert store.rows("SELECT count(*) FROM scalars WHERE value > $v", {"v": 1.5}) == [(2,)]
        assert store.arrow("SELECT key FROM scalars ORDER BY step").column("key").to_pylist() == ["a", "b", "a"]
        for call in (store.frame, store.rows, store.arrow):
            with pytest.raises(StoreError, match="refused"):
                call("CREATE TABLE t AS SELECT 1")
        assert not hasattr(store, "fetchall")  # DuckDB's connection methods are no longer forwarded
