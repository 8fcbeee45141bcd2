"""`dynascope runs`, `export`, and schema versioning, on real run directories."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import duckdb
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from dynascope.cli import app
from dynascope.store import SCHEMA_VERSION, RunWriter, SchemaVersionError, StoreError, open_store
from dynascope.store.catalog import list_runs
from dynascope.store.export import export_store


def make_run(path, ranks=1, steps=5, close=True, **kw):
    writers = [RunWriter(path, rank=r, world_size=ranks, flush_secs=0.1, **kw) for r in range(ranks)]
    for w in writers:
        w.append("scalars", {"step": list(range(steps)), "key": "loss", "value": 1.0})
        w.flush()
    if close:
        for w in writers:
            w.close()
    return writers


def test_statuses_steps_ranks(tmp_path):
    make_run(tmp_path / "done", ranks=2, steps=7, run_name="the 'done' run")
    (live,) = make_run(tmp_path / "live", close=False)
    # A crashed run: a writer process killed outright, so no run_end and a heartbeat that stops.
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from dynascope.store import RunWriter\n"
        "w = RunWriter(sys.argv[1], flush_secs=0.1)\n"
        "w.append('scalars', {'step': [0, 1, 2], 'key': 'x', 'value': 1.0}); w.flush()\n"
        "print('ready', flush=True); time.sleep(60)"), str(tmp_path / "crashed")], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGKILL)
    child.wait()
    for hb in (tmp_path / "crashed" / "_writers").iterdir():  # its last sign of life was long ago
        os.utime(hb, (time.time() - 3600, time.time() - 3600))
    df = list_runs(tmp_path)
    by_id = {r["run_id"]: r for r in df.iter_rows(named=True)}
    assert by_id["done"]["status"] == "finished"
    assert by_id["done"]["name"] == "the 'done' run"
    assert (by_id["done"]["steps"], by_id["done"]["ranks"]) == (7, 2)
    assert by_id["live"]["status"] == "live"
    assert by_id["crashed"]["status"] == "crashed" and by_id["crashed"]["steps"] == 3
    assert all(r["size_bytes"] > 0 and r["last_write_us"] > 0 and r["start_us"] > 0 for r in by_id.values())
    live.close()
    assert {r["run_id"]: r["status"] for r in list_runs(tmp_path).iter_rows(named=True)}["live"] == "finished"
    out = CliRunner().invoke(app, ["runs", str(tmp_path)])
    assert out.exit_code == 0 and "finished" in out.stdout and "crashed" in out.stdout


def test_catalog_lists_a_bad_run_with_its_problem(tmp_path):
    make_run(tmp_path / "good")
    make_run(tmp_path / "newer")
    marker = tmp_path / "newer" / "dynascope.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "schema_version": 99}))
    rows = {r["run_id"]: r for r in list_runs(tmp_path).iter_rows(named=True)}
    assert rows["good"]["problem"] is None
    assert "schema v99" in rows["newer"]["problem"]


def test_newer_schema_is_a_clear_error(tmp_path):
    make_run(tmp_path / "r")
    marker = tmp_path / "r" / "dynascope.json"
    newer = SCHEMA_VERSION + 1
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "schema_version": newer}))
    with pytest.raises(SchemaVersionError, match=f"schema v{newer}.*upgrade dynascope"):
        open_store(tmp_path / "r")
    with pytest.raises(SchemaVersionError):
        RunWriter(tmp_path / "r")  # a second process must not append old-format rows to it either
    out = CliRunner().invoke(app, ["sql", str(tmp_path / "r"), "SELECT 1"])
    assert out.exit_code == 2 and "upgrade dynascope" in out.stderr and "Traceback" not in out.output


def test_export_duckdb_and_parquet(tmp_path):
    make_run(tmp_path / "r", ranks=2, steps=50)
    out = CliRunner().invoke(app, ["export", str(tmp_path / "r"), str(tmp_path / "out.duckdb")])
    assert out.exit_code == 0, out.output
    con = duckdb.connect(str(tmp_path / "out.duckdb"), read_only=True)
    assert con.sql("SELECT count(*), count(DISTINCT rank) FROM scalars").fetchall() == [(100, 2)]
    assert con.sql("SELECT count(*) FROM events WHERE event = 'run_end'").fetchall() == [(2,)]
    con.close()
    again = CliRunner().invoke(app, ["export", str(tmp_path / "r"), str(tmp_path / "out.duckdb")])
    assert again.exit_code == 2 and "refusing to overwrite" in again.stderr
    counts = export_store(tmp_path / "r", parquet_dir=tmp_path / "pq")
    assert counts["scalars"] == 100
    assert pq.read_table(tmp_path / "pq" / "scalars.parquet").num_rows == 100
    assert pq.read_table(tmp_path / "pq" / "tensor_stats.parquet").num_rows == 0
    with pytest.raises(StoreError, match="no such directory"):
        export_store(tmp_path / "r", duckdb_path=tmp_path / "missing" / "x.duckdb")
    assert not list((tmp_path).glob(".*.tmp"))
