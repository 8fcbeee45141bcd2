"""The writer's batch conversion, bookkeeping rows and back-pressure, checked by reading the store back."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch

from dynascope.store import RunWriter, open_store


def rows(path, sql):
    with open_store(path) as s:
        return s.rows(sql)


def test_every_column_form_round_trips(tmp_path):
    names = ["a.weight", "b'; DROP TABLE runs; --", "ünïcode \"q\""]
    with RunWriter(tmp_path / "r", rank=3, role="actor", flush_secs=60) as w:
        for step in range(3):  # the same list object every step: the dictionary fast path
            w.append("tensor_stats", {"step": step, "tensor": names, "layer": [0, 1, None],
                                      "w_norm": np.array([1.5, 2.5, 3.5]) * step, "numel": np.int64(7),
                                      "update_norm": torch.tensor([0.25, 0.5, 0.75]), "sharded": [True, False, None]})
        w.append("tensor_stats", {"step": 9, "tensor": ["fresh", None], "rank": 5, "kind": "mlp",
                                  "changed_count": [1, 2]})
        w.append("spectra", {"step": 1, "tensor": "x", "sigma": [[3.0, 1.0]], "u1": [[0.5, 0.25]]})
        w.append("scalars", {"step": list(range(1000)), "key": "loss", "value": np.arange(1000.0)})
    got = rows(tmp_path / "r", "SELECT step, tensor, layer, w_norm, numel, update_norm, sharded, rank, role, kind, "
                               "changed_count FROM tensor_stats ORDER BY step, tensor NULLS LAST")
    want = []
    for step in range(3):
        for i, n in enumerate(names):
            want.append((step, n, [0, 1, None][i], [1.5, 2.5, 3.5][i] * step, 7, [0.25, 0.5, 0.75][i],
                         [True, False, None][i], 3, "actor", None, None))
    want.sort(key=lambda r: (r[0], r[1]))
    want += [(9, "fresh", None, None, None, None, None, 5, "actor", "mlp", 1),
             (9, None, None, None, None, None, None, 5, "actor", "mlp", 2)]
    assert got == want
    assert rows(tmp_path / "r", "SELECT sigma, u1 FROM spectra") == [([3.0, 1.0], [0.5, 0.25])]
    assert rows(tmp_path / "r", "SELECT count(*), sum(value), min(step), max(step) FROM scalars") == \
        [(1000, float(sum(range(1000))), 0, 999)]


def test_close_records_run_end_and_runs_row(tmp_path):
    w = RunWriter(tmp_path / "r", run_name="my 'run'", config={"lr": 1e-3})
    w.append("scalars", {"step": 0, "key": "k", "value": 1.0})
    w.close()
    w.close()  # idempotent
    (fields,) = rows(tmp_path / "r", "SELECT fields_json FROM events WHERE event = 'run_end'")[0]
    assert json.loads(fields)["writer_id"] == w.writer_id
    assert json.loads(fields)["rows_written"] >= 2
    assert rows(tmp_path / "r", "SELECT name, config_json FROM runs") == [("my 'run'", '{"lr": 0.001}')]


def test_bad_batches_become_events_not_exceptions(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RunWriter(tmp_path / "r", flush_secs=60) as w:
            w.append("scalars", {"step": [1, 2], "value": [1.0]})  # ragged
            w.append("nonsense", {"x": 1})
            w.append("scalars", {"step": "not a number", "key": "k"})  # fails when typed at flush
            w.append("scalars", {"step": 5, "key": "ok", "value": 2.0})
    assert any("dynascope" in str(c.message) for c in caught)
    kinds = rows(tmp_path / "r", "SELECT event, count(*) FROM events WHERE event = 'bad_batch' GROUP BY 1")
    assert kinds == [("bad_batch", 3)]
    # the untypeable batch was flushed with a good one: only it is dropped (and counted)
    assert w.rows_dropped == 1
    assert rows(tmp_path / "r", "SELECT step, key, value FROM scalars") == [(5, "ok", 2.0)]


def test_slow_writer_drops_oldest_without_blocking_append(tmp_path):
    gate = threading.Event()

    class Stuck(RunWriter):
        def _commit(self, groups):
            gate.wait()  # the disk hangs until the test has appended everything
            return super()._commit(groups)

    w = Stuck(tmp_path / "r", flush_secs=0.01, max_buffer_rows=1000)
    for step in range(300):  # 30k rows while the writer thread is stuck: append must still return
        w.append("scalars", {"step": step, "key": [f"m{i}" for i in range(100)], "value": np.zeros(100)})
    assert w.rows_dropped >= 300 * 100 - 2 * 1000 - 100
    gate.set()
    w.close()
    kept = rows(tmp_path / "r", "SELECT count(*), min(step), max(step) FROM scalars")[0]
    assert kept[0] + w.rows_dropped == 300 * 100
    assert kept[2] == 299  # the newest rows survive; the oldest went
    dropped = rows(tmp_path / "r", "SELECT sum(CAST(json_extract(fields_json, '$.dropped') AS BIGINT)) "
                                   "FROM events WHERE event = 'rows_dropped'")[0][0]
    assert dropped == w.rows_dropped


def test_max_block_s_lets_append_wait_for_room(tmp_path):
    w = RunWriter(tmp_path / "r", flush_secs=60, flush_rows=500, max_buffer_rows=1000, max_block_s=30)
    for step in range(100):
        w.append("scalars", {"step": step, "key": [f"m{i}" for i in range(100)], "value": np.zeros(100)})
    w.close()
    assert w.rows_dropped == 0
    assert rows(tmp_path / "r", "SELECT count(*) FROM scalars") == [(10_000,)]


def test_pyarrow_conversion_is_warmed_where_the_writer_is_made(tmp_path) -> None:
    """pyarrow imports pandas at its first value conversion; the writer triggers it when it is made (on the
    caller's thread, before training), so its first flush does not import anything inside a step."""
    if importlib.util.find_spec("pandas") is None:
        pytest.skip("pandas is not installed: pyarrow has nothing to import")
    code = ("import sys; from dynascope.store.writer import RunWriter\n"
            "assert 'pandas' not in sys.modules, 'imported before the writer'\n"
            f"w = RunWriter({str(tmp_path / 'r')!r}, flush_secs=60)\n"
            "print('pandas' in sys.modules); w.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
