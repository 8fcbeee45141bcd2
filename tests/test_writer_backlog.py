"""A writer whose disk fails: its memory is bounded in bytes, failed rows are not re-encoded, retries back off."""

from __future__ import annotations

import errno
import threading
import time

import numpy as np

from dynascope.store import RunWriter, open_store
from dynascope.store.backlog import Backoff

from helpers.waiting import wait_until


def scalars(step: int, n: int = 100) -> dict:
    return {"step": step, "key": [f"m{i}" for i in range(n)], "value": np.full(n, float(step))}


class Failing(RunWriter):
    """A disk that answers ENOSPC while ``full`` is set; counts commit attempts and rows encoded."""

    def __init__(self, *args, **kwargs) -> None:
        self.full = threading.Event()
        self.full.set()
        self.attempts = 0
        self.times: list[float] = []
        self.encoded = {"scalars": 0}
        super().__init__(*args, **kwargs)

    def _commit(self, groups):
        self.attempts += 1
        if self.full.is_set():
            self.times.append(time.monotonic())
            raise OSError(errno.ENOSPC, "No space left on device")
        return super()._commit(groups)

    def _to_arrow(self, table, buf):
        if table in self.encoded:
            self.encoded[table] += buf.rows
        return super()._to_arrow(table, buf)


def held_bytes(w: RunWriter) -> int:
    with w._lock:
        return w._buffered_bytes + w._backlog.nbytes


def test_a_full_disk_holds_at_most_max_buffer_bytes(tmp_path):
    bound = 1 << 20
    w = Failing(tmp_path / "r", flush_secs=0.01, flush_rows=2000, max_buffer_bytes=bound)
    peak = 0
    for step in range(400):  # 40k rows, ~2.5 MiB of batches and more once encoded: well past the bound
        w.append("scalars", scalars(step))
        peak = max(peak, held_bytes(w))
    wait_until(lambda: w.attempts >= 3, "the writer to fail a few flushes")
    assert peak <= bound + 100 * 40  # within one batch of the bound, on the append side
    assert held_bytes(w) <= bound
    assert w.rows_dropped > 0 and w.max_buffer_rows > 40_000  # the byte bound, not the row bound, dropped them
    w.full.clear()
    w.close()
    with open_store(tmp_path / "r") as s:
        kept, newest = s.rows("SELECT count(*), max(step) FROM scalars")[0]
        recorded = s.rows("SELECT json_extract_string(fields_json, '$.table'), "
                          "sum(CAST(json_extract(fields_json, '$.dropped') AS BIGINT)), "
                          "min(CAST(json_extract(fields_json, '$.bytes') AS BIGINT)) FROM events "
                          "WHERE event = 'rows_dropped' GROUP BY 1")
        assert s.rows("SELECT count(*) FROM runs") == [(1,)]  # the largest table lost rows, not the run's own
    assert [(t, d) for t, d, _ in recorded] == [("scalars", w.rows_dropped)]  # the events say what went
    assert recorded[0][2] > 0  # and how many bytes
    assert kept + w.rows_dropped == 400 * 100  # every row written or counted
    assert newest == 399  # the oldest went first


def test_failed_rows_are_retried_as_encoded(tmp_path):
    w = Failing(tmp_path / "r", flush_secs=0.01)
    for step in range(20):
        w.append("scalars", scalars(step))
    wait_until(lambda: w.attempts >= 4, "four failed flushes")
    w.full.clear()
    w.close()
    assert w.rows_dropped == 0
    assert w.encoded["scalars"] == 20 * 100  # each row encoded once, however many flushes failed
    with open_store(tmp_path / "r") as s:
        assert s.rows("SELECT count(*), count(DISTINCT step) FROM scalars") == [(2000, 20)]


def test_retries_back_off_while_the_disk_stays_full(tmp_path):
    w = Failing(tmp_path / "r", flush_secs=0.01)
    w.append("scalars", scalars(0))
    wait_until(lambda: len(w.times) >= 6, "six failed flushes")
    gaps = np.diff(w.times[:6])
    # Without backoff a 10 ms writer tries every 10 ms; with it the k-th wait is 10 ms * 2**k (a loaded
    # machine only lengthens them).
    assert all(g >= 0.9 * 0.01 * 2 ** (k + 1) for k, g in enumerate(gaps)), gaps
    w.full.clear()
    w.append("scalars", scalars(1))
    w.close(timeout_s=10)  # close writes at once: it does not wait out the backoff
    assert not w.close_timed_out and w.rows_dropped == 0
    with open_store(tmp_path / "r") as s:
        assert s.rows("SELECT count(*) FROM scalars") == [(200,)]


def test_backoff_doubles_to_its_cap_and_resets():
    b = Backoff(0.5, cap_s=4.0)
    assert [b.record(ok=False) for _ in range(5)] == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert 3.5 < b.wait_s() <= 4.0
    assert b.record(ok=True) == 0.0 and b.wait_s() == 0.0 and b.failures == 0
