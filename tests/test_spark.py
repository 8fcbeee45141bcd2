"""Apache Spark (pyspark, local[2], 1 GB heap) reads a fleet of runs exactly as DuckDB's views do.

One SparkSession serves every test here (``spark``). The fleet: a 3-rank run, the schema-v1 fixture, a
1-rank run, and a run a live writer process keeps appending to. Spark reads what the live-segment rule
names (``live_files`` / ``snapshot``), under today's column names (``projection``), and must count what
DuckDB counts at the same moment: right after a compaction pass that left merged-away files, and for a
job that outlives compaction's grace period while writers and a compactor run (a lease keeps its files).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from polars.testing import assert_frame_equal

from dynascope.analyses.fleet import fleet_summary
from dynascope.store import TABLES, RunWriter, open_store, snapshot
from dynascope.store.compact import compact_store
from dynascope.store.engines import SparkTables
from dynascope.store.layout import segment_name, valid_from_us
from dynascope.store.projection import spark_ddl
from dynascope.store.rollup_across import BY_TENSOR
from dynascope.store.schema import RENAMED
from dynascope.store.snapshot import open_snapshot

from helpers.as_written import module_as_written  # noqa: F401 - autouse: the fleet is compaction's input, as written
from helpers.fleet_runs import write_synthetic_run

pytest.importorskip("pyspark", reason="pyspark is in the dev extra: pip install -e '.[dev]'")
if shutil.which("java") is None:
    pytest.skip("no java on PATH (Debian: apt-get install openjdk-17-jre-headless)", allow_module_level=True)

pytestmark = pytest.mark.slow
V1 = Path(__file__).parent / "fixtures" / "v1run"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "store.md"

LIVE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dynascope.store import RunWriter
    run, stop = sys.argv[1], Path(sys.argv[2])
    w = RunWriter(run, flush_secs=0.5, config={"live": True})
    step = 0
    while not stop.exists():
        w.append("scalars", {"step": step, "key": ["a", "b"], "value": [1.0, float(step)]})
        w.append("timings", {"step": step, "phase": ["forward", "step"], "category": ["phase", "step"],
                             "start_us": 0, "dur_us": [1000 + step, 3000 + step]})
        w.append("tensor_stats", {"step": step, "stage": "rl", "tensor": ["x", "y"], "kind": "mlp",
                                  "numel": [4, 8], "w_norm": [1.0, 2.0], "update_norm": [0.1, 0.2]})
        step += 1
        time.sleep(0.02)
    w.close()
""")


@pytest.fixture(scope="session")
def spark():
    from dynascope.store.engines import local_spark

    session = local_spark(memory="1g", cores=2)
    yield session
    session.stop()


class Live:
    """Writer processes appending to runs under a root until ``stop``."""

    def __init__(self, runs: list[Path], stop: Path) -> None:
        self.stop_file = stop
        self.procs = [subprocess.Popen([sys.executable, "-c", LIVE, str(r), str(stop)]) for r in runs]
        self.runs = runs

    def wait_for_rows(self, rows: int = 200, deadline_s: float = 120.0) -> None:
        end = time.monotonic() + deadline_s
        for run in self.runs:
            while True:
                assert time.monotonic() < end, f"{run}: the live writer wrote nothing in {deadline_s} s"
                assert all(p.poll() is None for p in self.procs), "a live writer died"
                if (run / "dynascope.json").exists():
                    with open_store(run) as con:
                        if con.rows("SELECT count(*) FROM scalars")[0][0] >= rows:
                            break
                time.sleep(0.05)

    def stop(self) -> None:
        self.stop_file.touch()
        assert [p.wait(timeout=120) for p in self.procs] == [0] * len(self.procs)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet") / "runs"
    write_synthetic_run(root / "multi", ranks=3, steps=16, seed=1, flush_every=2)
    write_synthetic_run(root / "single", ranks=1, steps=9, seed=2, flush_every=3)
    shutil.copytree(V1, root / "v1run")
    live = Live([root / "live"], root.parent / "stop-live")
    live.wait_for_rows()
    yield root
    live.stop()


def _compacted(root: Path) -> Path:
    """One compaction pass that leaves the merged-away segments on disk, then until its merges take effect:
    the live run's flushes (a segment per table every half second) would otherwise be hundreds of files."""
    compact_store(root, grace_s=3600, settle_s=0.05)
    _wait_in_effect(root)
    return root


def _wait_in_effect(root: Path) -> None:
    """Until every merged file under ``root`` has taken effect (its valid_from is past)."""
    end = time.monotonic() + 30
    while max((valid_from_us(p) for p in root.rglob("*.v*.parquet")), default=0) > time.time_ns() // 1000:
        assert time.monotonic() < end
        time.sleep(0.02)


def _count(spark, table: str) -> int:
    return spark.sql(f"SELECT count(*) FROM {table}").collect()[0][0]


def test_spark_counts_what_duckdb_counts_right_after_compaction(spark, fleet):
    stats = compact_store(fleet, grace_s=3600, settle_s=0.05)  # merged-away segments stay on disk
    assert stats.new_segments > 0 and stats.removed_segments == 0
    _wait_in_effect(fleet)
    with snapshot(fleet) as snap:
        SparkTables(spark, snap)
        with open_store(fleet, at_us=snap.at_us) as con:
            for table in TABLES:
                want = con.rows(f'SELECT count(*) FROM "{table}"')[0][0]
                assert _count(spark, table) == want, table
            agg = "SELECT run_id, phase, count(*) AS n, sum(dur_us) AS dur_us FROM timings GROUP BY run_id, phase"
            duck = sorted(con.rows(agg))
        assert sorted(tuple(r) for r in spark.sql(agg).collect()) == duck
        assert {r[0] for r in duck} == {"multi", "single", "v1run", "live"} and len(duck) > 10
    # What a plain glob reads: every merged-away segment beside its merged file, so every row twice.
    ddl = spark_ddl("scalars")
    globbed = spark.read.schema(ddl).parquet(str(fleet / "multi" / "scalars" / "*" / "*.parquet")).count()
    with open_store(fleet / "multi") as con:
        exact = con.rows("SELECT count(*) FROM scalars")[0][0]
    assert exact > 0 and globbed == 2 * exact


def test_spark_counts_what_duckdb_counts_through_a_fold_across_writers(spark, tmp_path):
    """Finished writers folded into writer=_merged (sources and covers still on disk): a job planned before
    the fold and one planned after each read, on Spark, exactly the rows DuckDB counts at their moment."""
    root = tmp_path / "runs"
    write_synthetic_run(root / "folded", ranks=3, steps=8, seed=3, flush_every=2)
    with open_store(root) as con:
        want = {t: con.rows(f'SELECT count(*) FROM "{t}"')[0][0] for t in TABLES}
    before = open_snapshot(root)
    try:
        stats = compact_store(root, grace_s=3600, settle_s=0.05, repair_after_s=0)
        assert stats.writers_folded > 0 and stats.skipped == []
        _wait_in_effect(root)
        after = open_snapshot(root)
        try:
            assert any("/writer=_merged/" in f for f in after.files("timings"))
            assert not any("/writer=_merged/" in f for f in before.files("timings"))
            for snap in (before, after):
                SparkTables(spark, snap)
                with open_store(root, at_us=snap.at_us) as con:
                    for table in TABLES:  # the same on both engines; the writers' rows as before the fold
                        got = _count(spark, table)
                        assert got == con.rows(f'SELECT count(*) FROM "{table}"')[0][0], table
                        assert table == BY_TENSOR or got == want[table], table
        finally:
            after.release()
    finally:
        before.release()
    assert want["timings"] > 0 and want["scalars"] > 0


def test_fleet_summary_is_the_same_frame_on_spark_and_duckdb(spark, fleet):
    snap = open_snapshot(_compacted(fleet))
    try:
        duck = fleet_summary(snap, "duckdb")
        sparked = fleet_summary(snap, "spark", spark=spark)
    finally:
        snap.release()
    assert duck.height == 4 and duck["status"].to_list() == ["live", "finished", "finished", "finished"]
    assert duck.filter(pl.col("run_id") == "multi")["slowest_rank"].to_list() == [2]
    assert duck["median_bf16_unchanged_frac_rl"].null_count() == 2  # the v1 and live runs record no S₁
    assert_frame_equal(duck, sparked, rel_tol=1e-9, abs_tol=0.0)


def _recipe(tag: str) -> str:
    text = DOCS.read_text(encoding="utf-8")
    return re.search(r"```python\n(# recipe: " + re.escape(tag) + r".*?)```", text, re.S).group(1)


def test_the_docs_spark_recipes_run_as_written(spark, fleet):
    names = {"root": str(_compacted(fleet)), "spark": spark}
    exec(compile(_recipe("spark-snapshot"), "docs/store.md:spark-snapshot", "exec"), names)
    with open_store(fleet, at_us=names["snap"].at_us) as con:
        want = con.rows("SELECT run_id, phase, count(*), sum(dur_us) FROM timings GROUP BY run_id, phase")
    assert sorted(tuple(r) for r in names["timings"]) == sorted(want) and len(want) > 10
    at = time.time_ns() // 1000
    exec(compile(_recipe("spark-files"), "docs/store.md:spark-files", "exec"), names)
    df = names["tensor_stats"]
    assert df.columns == TABLES["tensor_stats"].names
    with open_store(fleet, at_us=at) as con:
        want = con.rows("SELECT count(*), sum(update_norm) FROM tensor_stats WHERE run_id <> 'live'")[0]
    got = df.filter("run_id <> 'live'").selectExpr("count(*)", "sum(update_norm)").collect()[0]
    assert got[0] == want[0] and got[1] == pytest.approx(want[1], rel=1e-12)
    # the v1 run's values arrive under today's names
    assert df.filter("run_id = 'v1run' AND update_norm IS NOT NULL").count() == 16


def test_a_v1_run_reads_the_same_names_and_values_on_both_engines(spark, fleet):
    """Every table of the schema-v1 run, row for row and column for column, through each engine's projection."""
    with snapshot(fleet) as snap:
        SparkTables(spark, snap)
        with open_store(fleet, at_us=snap.at_us) as con:
            for table in TABLES:
                sql = f"SELECT * FROM {table} WHERE run_id = 'v1run'"
                duck = con.sql(sql.replace(table, f'"{table}"', 1))
                sparked = spark.sql(sql)
                assert sparked.columns == duck.columns == TABLES[table].names, table
                want = sorted(map(repr, duck.fetchall()))
                assert sorted(repr(tuple(r)) for r in sparked.collect()) == want, table
                assert table in ("samples", "system") or len(want) > 0, table


def test_renames_chained_across_versions_read_under_todays_name(spark, tmp_path, monkeypatch):
    """v1 called it ``val_v1``, v2 ``val_v2``, today ``value``: both engines read all three as ``value``."""
    monkeypatch.setitem(RENAMED, "scalars", {"value": "val_v2", "val_v2": "val_v1"})
    root = tmp_path / "runs"
    write_synthetic_run(root / "new", ranks=1, steps=3)
    for name, writer, seq in (("val_v1", "r0-v1", 7), ("val_v2", "r0-v2", 8)):
        d = root / "new" / "scalars" / f"writer={writer}"  # written by writers of that time: no commit records
        d.mkdir()
        pq.write_table(pa.table({"run_id": ["new"], "step": pa.array([100 + seq], pa.int64()), "key": ["old"],
                                 name: [float(seq)]}), d / segment_name(seq, seq))
    want = [(107, 7.0), (108, 8.0)]
    with open_store(root) as con:
        assert con.rows("SELECT step, value FROM scalars WHERE key = 'old' ORDER BY step") == want
    with snapshot(root) as snap:
        SparkTables(spark, snap, ["scalars"])
        got = spark.sql("SELECT step, value FROM scalars WHERE key = 'old' ORDER BY step").collect()
    assert [tuple(r) for r in got] == want


def test_a_spark_job_that_outlives_the_grace_period_reads_its_snapshot(spark, tmp_path):
    root = tmp_path / "runs"
    live = Live([root / "a", root / "b"], tmp_path / "stop")
    stop, passes = threading.Event(), []

    def compactor() -> None:
        while not stop.is_set():
            passes.append((time.time(), compact_store(root, grace_s=0.5, settle_s=0.1)))

    try:
        live.wait_for_rows()
        thread = threading.Thread(target=compactor)
        thread.start()
        ddl = spark_ddl("scalars")
        with snapshot(root) as snap:
            planned = snap.files("scalars")
            job = spark.read.schema(ddl).parquet(*planned)  # planned now: Spark has listed its files
            with open_store(root, at_us=snap.at_us) as con:
                want = con.rows("SELECT count(*) FROM scalars")[0][0]
            pinned = _wait_for_expiry(root, planned, passes)
            assert all(Path(p).exists() for p in pinned)  # past their grace, kept by the lease
            assert job.count() == want
        _wait_until(lambda: not all(Path(p).exists() for p in pinned), passes)  # released: deleted
        # The same job without a lease (held only while DuckDB counts the snapshot, then released): it fails,
        # loudly, and ignoreMissingFiles would hide the loss.
        bare = open_snapshot(root)
        job = spark.read.schema(ddl).parquet(*bare.files("scalars"))
        with open_store(root, at_us=bare.at_us) as con:
            want = con.rows("SELECT count(*) FROM scalars")[0][0]
        bare.release()
        _wait_until(lambda: not all(Path(p).exists() for p in bare.files("scalars")), passes)
        # it fails, naming a file it could not read: FAILED_READ_FILE.FILE_NOT_EXIST, or another subclass of
        # FAILED_READ_FILE when the compactor, still running, deletes a file while Spark opens it
        with pytest.raises(Exception) as failed:
            job.count()
        assert re.search("FAILED_READ_FILE|FileNotFound|does not exist", str(failed.value)), str(failed.value)
        spark.conf.set("spark.sql.files.ignoreMissingFiles", "true")
        try:
            assert job.count() < want  # rows silently lost
        finally:
            spark.conf.unset("spark.sql.files.ignoreMissingFiles")
    finally:
        stop.set()
        live.stop()
    thread.join()
    assert sum(s.removed_segments for _, s in passes) > 0


def _wait_until(condition, passes: list, deadline_s: float = 90.0) -> None:
    """Until ``condition()`` holds after a compaction pass that started after now."""
    end, since = time.monotonic() + deadline_s, time.time()
    while not (condition() and any(t > since for t, _ in passes)):
        assert time.monotonic() < end, "the compactor did not get there in time"
        time.sleep(0.05)


def _wait_for_expiry(root: Path, planned: list[str], passes: list) -> list[str]:
    """The planned segments that a merge in effect for longer than the grace period covers, once a
    compaction pass has run since (without the lease it would have deleted them)."""
    def expired() -> list[str]:
        now = time.time_ns() // 1000
        out = []
        for p in map(Path, planned):
            merged = [m for m in p.parent.glob("*.v*.parquet")
                      if 0 < valid_from_us(m) < now - 600_000 and int(m.name[:12]) <= int(p.name[:12])
                      and int(m.name[13:25]) >= int(p.name[13:25]) and m != p]
            if merged and ".v" not in p.name:
                out.append(str(p))
        return out

    _wait_until(lambda: bool(expired()), passes)
    return expired()


def test_spark_reads_the_rows_a_live_writer_holds_in_journals(spark, tmp_path):
    # Between seals a writer's rows sit in its journals, which Spark cannot read: the snapshot copies the rows
    # that count at its moment, so Spark counts what DuckDB's views of the present count, each row once, and
    # a seal after the moment (the writer closing) neither loses nor doubles any.
    root = tmp_path / "runs"
    writers = [RunWriter(root / "a", rank=r, flush_secs=3600, seal_secs=3600) for r in range(2)]
    for step in range(40):
        for w in writers:
            w.append("scalars", {"step": step, "key": ["a", "b"], "value": [1.0, float(step)]})
            w.append("timings", {"step": step, "phase": ["forward", "step"], "category": ["phase", "step"],
                                 "start_us": 0, "dur_us": [1000 + step, 3000 + step]})
    writers[0].close()  # its rows sealed into segments
    writers[1].flush()  # its rows in journals
    sql = {"scalars": "SELECT count(*), sum(value) FROM scalars", "timings": "SELECT count(*), sum(dur_us) FROM timings"}
    with open_store(root) as con:
        want = {t: tuple(con.rows(q)[0]) for t, q in sql.items()}
    assert want["scalars"] == (160, 2 * (40 + sum(range(40))))
    with snapshot(root, journals=False) as bare:
        SparkTables(spark, bare, ["scalars"])
        assert _count(spark, "scalars") == 80  # segments alone: rank 1's rows missing
    with snapshot(root) as snap:
        assert {"scalars", "timings"} <= set(snap.rows)
        SparkTables(spark, snap, ["scalars", "timings"])
        writers[1].close()  # seals: its segments take effect after the snapshot's moment
        for table, q in sql.items():
            assert tuple(spark.sql(q).collect()[0]) == want[table], table
        rows_dir = snap.rows_dir
    assert rows_dir is not None and not rows_dir.exists()
    with snapshot(root) as snap:  # all sealed now: the same rows from segments, nothing copied
        SparkTables(spark, snap, ["scalars", "timings"])
        assert snap.rows == {} and all(tuple(spark.sql(q).collect()[0]) == want[t] for t, q in sql.items())


def test_a_local_session_leaves_no_warehouse_directory(spark, tmp_path):
    # The session's warehouse directory goes with it (at the latest at exit); a call that finds a session
    # running (getOrCreate) removes the one it made at once.
    from dynascope.store.engines import local_spark

    made = lambda: set(Path(tempfile.gettempdir()).glob("dynascope-spark-*"))  # noqa: E731
    before = made()
    assert local_spark() is spark and made() == before
    code = ("from dynascope.store.engines import local_spark; "
            "print(local_spark().conf.get('spark.sql.warehouse.dir'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    warehouse = Path(out.stdout.strip().splitlines()[-1].removeprefix("file:"))
    assert warehouse.name.startswith("dynascope-spark-") and not warehouse.exists()
