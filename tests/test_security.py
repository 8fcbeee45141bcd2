"""Every SQL surface a user (or a dashboard visitor) can type into must stay inside the store, read-only."""

from __future__ import annotations

import duckdb
import pytest
from typer.testing import CliRunner

from dynascope.analyses._common import run_clause
from dynascope.cli import app
from dynascope.store import RunWriter, StoreError, open_store, quote_ident, quote_literal, run_sql
from dynascope.store.catalog import list_runs
from dynascope.store.compact import compact_store
from dynascope.store.export import export_store

HOSTILE = "x'; DROP TABLE runs; --\"q\"; SELECT 1 --"


@pytest.fixture()
def store_dir(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret\n")
    run = tmp_path / "store" / "r"
    with RunWriter(run) as w:
        w.append("scalars", {"step": [0, 1], "key": "loss", "value": [2.0, 1.0]})
    return tmp_path


def escapes(tmp: str) -> list[str]:
    secret = f"{tmp}/secret.txt"
    return [
        f"COPY (SELECT 1) TO '{tmp}/out.csv'",
        f"COPY scalars TO '{tmp}/out.parquet' (FORMAT parquet)",
        f"SELECT * FROM read_csv('{secret}')",
        "SELECT * FROM read_csv('/etc/passwd')",
        f"SELECT * FROM read_text('{secret}')",
        f"SELECT * FROM read_blob('{secret}')",
        f"SELECT * FROM read_json('{secret}')",
        f"SELECT * FROM glob('{tmp}/*')",
        "SELECT * FROM glob('/etc/*')",
        f"SELECT * FROM '{secret}'",
        f"SELECT * FROM read_text('{tmp}/store/../secret.txt')",
        f"ATTACH '{tmp}/x.duckdb' AS x",
        "INSTALL httpfs", "LOAD httpfs", "INSTALL 'https://example.com/x.duckdb_extension'",
        "SET enable_external_access = true", "RESET enable_external_access",
        f"SET allowed_directories = ['{tmp}/']", "SET lock_configuration = false",
        "PRAGMA enable_profiling", "PRAGMA threads = 1",
        "CREATE SECRET s (TYPE s3, KEY_ID 'a', SECRET 'b')",
        "SELECT * FROM read_parquet('https://example.com/x.parquet')",
        "SELECT * FROM read_parquet('s3://bucket/x.parquet')",
        f"EXPORT DATABASE '{tmp}/dump'",
        f"IMPORT DATABASE '{tmp}/dump'",
        "CREATE TABLE t AS SELECT 1", "DROP VIEW scalars", "CREATE OR REPLACE VIEW scalars AS SELECT 1",
        "INSERT INTO scalars SELECT * FROM scalars", "CALL pragma_version()",
        f"SELECT 1; COPY (SELECT 1) TO '{tmp}/x.csv'",
        f"SELECT * FROM query('COPY (SELECT 1) TO ''{tmp}/x.csv''')",
        f"SELECT * FROM query_table('{secret}')",
        "DETACH memory", "USE system", "CHECKPOINT", "VACUUM",
        # inside the store the file system is open to DuckDB, so writes there must be refused by type
        f"COPY (SELECT 1) TO '{tmp}/store/planted.csv'",
        f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{tmp}/store/planted.csv'",
        f"EXPLAIN COPY (SELECT 1) TO '{tmp}/store/planted.csv'",
        f"/* hi */ EXPLAIN ANALYZE COPY (SELECT 1) TO '{tmp}/store/planted.csv'",
        "EXPLAIN ANALYZE CREATE TABLE t AS SELECT 1",
        f"EXPLAIN ANALYZE ATTACH '{tmp}/store/x.duckdb'",
    ]


def test_escapes_are_refused_on_every_surface(store_dir):
    tmp = str(store_dir)
    store = open_store(store_dir / "store")
    runner = CliRunner()
    for q in escapes(tmp):
        with pytest.raises(StoreError):
            run_sql(store, q)
        with pytest.raises((StoreError, duckdb.Error)):  # the raw relation API: DuckDB's own refusal
            store.sql(q).fetchall()
        for call in (store.frame, store.rows, store.arrow):  # the toolkit's API: each call on its own cursor
            with pytest.raises((StoreError, duckdb.Error)):
                call(q)
        out = runner.invoke(app, ["sql", str(store_dir / "store"), q])
        assert out.exit_code == 2, (q, out.output)
        assert "Traceback" not in out.output
        assert "top secret" not in out.output
    for leftover in ("out.csv", "out.parquet", "x.csv", "x.duckdb", "dump", "store/planted.csv", "store/x.duckdb"):
        assert not (store_dir / leftover).exists(), leftover
    # and the store's own views keep working on the same locked connection
    assert run_sql(store, "SELECT count(*) AS n FROM scalars").to_pylist() == [{"n": 2}]
    assert run_sql(store, "SELECT key FROM scalars LIMIT 1 OFFSET 1").num_rows == 1
    assert run_sql(store, "EXPLAIN ANALYZE SELECT count(*) FROM scalars").num_rows == 1
    store.close()


def test_symlink_out_of_the_store_is_not_followed(store_dir):
    run = store_dir / "store" / "r"
    (run / "escape").symlink_to(store_dir)
    store = open_store(store_dir / "store")
    with pytest.raises(StoreError):
        run_sql(store, f"SELECT * FROM read_text('{run}/escape/secret.txt')")
    store.close()


def test_hostile_names_are_escaped_everywhere(tmp_path):
    root = tmp_path / "root"
    run = root / "run 'quoted'; DROP \"x\""  # the path goes into glob patterns and ATTACH strings
    # fold=False: its segments as written, for `compact` below to merge under the hostile names
    with RunWriter(run, run_name=HOSTILE, rank=0, role=HOSTILE, fold=False) as w:
        w.append("tensor_stats", {"step": [1, 2], "tensor": [HOSTILE, "ok"], "kind": HOSTILE, "w_norm": 1.0})
        w.flush()
        w.append("tensor_stats", {"step": 3, "tensor": HOSTILE, "w_norm": 2.0})
    with open_store(root) as s:
        assert s.rows(f"SELECT count(*) FROM tensor_stats WHERE tensor = {quote_literal(HOSTILE)}") \
            == [(2,)]
        rid = s.rows("SELECT DISTINCT run_id FROM tensor_stats")[0][0]
        assert s.rows(f"SELECT count(*) FROM tensor_stats WHERE true {run_clause(rid)}") == [(3,)]
        assert s.rows(f"SELECT count(*) FROM tensor_stats WHERE true {run_clause(HOSTILE)}") == [(0,)]
        assert s.rows(f"SELECT {quote_ident(HOSTILE)} FROM (SELECT 1 AS {quote_ident(HOSTILE)})") \
            == [(1,)]
        assert s.rows("SELECT name, role FROM runs") == [(HOSTILE, HOSTILE)]
    assert list_runs(root)["name"].to_list() == [HOSTILE]
    stats = compact_store(root, grace_s=0.0, settle_s=0.05, wait=True)
    assert stats.new_segments == 3 and not stats.skipped  # tensor_stats and its two rollups (by kind, by layer)
    counts = export_store(root, duckdb_path=tmp_path / "it's; out.duckdb")
    assert counts["tensor_stats"] == 3 and counts["tensor_stats_by_kind"] == 3  # (1, hostile) (2, ok) (3, null)
    out = CliRunner().invoke(app, ["runs", str(root)])
    assert out.exit_code == 0 and "DROP" in out.stdout  # printed as text, not interpreted


@pytest.mark.parametrize(("query", "named"), [("INSTALL httpfs", "INSTALL"), ("force install httpfs", "INSTALL"),
                                               ("LOAD httpfs", "LOAD"), ("EXPLAIN ANALYZE INSTALL httpfs", "INSTALL")])
def test_a_refusal_names_the_statement_written(store_dir, query, named):
    store = open_store(store_dir / "store")
    with pytest.raises(StoreError, match=rf"refused: (EXPLAIN of a )?{named} statement"):
        run_sql(store, query)
    store.close()
