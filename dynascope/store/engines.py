"""The store's tables on a query engine, read from a snapshot's files: DuckDB in this process, or Spark.

Both engines get the same thing under each table's name: the live segments of a ``Snapshot`` (the
live-segment rule, ``live``), read under today's column names (``projection``). A query written in the
SQL both engines accept then returns the same rows on either. The ``writer=_schema`` segments hold no rows
(they give DuckDB's glob-based views a typed file before any data lands) and are left out here.

Spark reads with an explicit schema, so no file footer is opened to merge schemas, and with
``spark.sql.files.ignoreMissingFiles`` left off: a segment deleted between planning and reading must fail
the job (take a lease), never silently drop its rows.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Iterable
from typing import Any

import duckdb

from dynascope.store.pooling import GLOBAL, global_sql
from dynascope.store.projection import select_list, spark_ddl, spark_quote
from dynascope.store.schema import TABLES
from dynascope.store.snapshot import Snapshot
from dynascope.store.views import quote_ident, quote_literal, typed_nulls

__all__ = ["DuckDBTables", "SparkTables", "local_spark"]


def _data_files(snap: Snapshot, table: str) -> list[str]:
    return [f for f in snap.files(table) if "/writer=_schema/" not in f]


class DuckDBTables:
    """A private in-memory DuckDB connection with one view per table over the snapshot's files."""

    def __init__(self, snap: Snapshot, tables: Iterable[str] = TABLES) -> None:
        self.snapshot = snap
        self.con = duckdb.connect(":memory:")
        self.con.execute("SET enable_progress_bar = false")
        for table in tables:
            files = _data_files(snap, table)
            nulls = typed_nulls(table, with_old_names=True)  # every name the projection may read
            source = (f"SELECT * FROM read_parquet([{', '.join(quote_literal(f) for f in files)}], union_by_name = true)"
                      f" UNION ALL BY NAME SELECT {nulls} WHERE false") if files else f"SELECT {nulls} WHERE false"
            self.con.execute(f"CREATE VIEW {quote_ident(table)} AS SELECT {select_list(table, quote_ident)} "
                             f"FROM ({source})")
        if "tensor_stats" in tables:  # the canonical per-tensor view, as open_store has it
            self.con.execute(f"CREATE VIEW {GLOBAL} AS {global_sql()}")

    def rows(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """(column names, rows) of ``sql``."""
        rel = self.con.sql(sql)
        return list(rel.columns), rel.fetchall()

    def close(self) -> None:
        self.con.close()


class SparkTables:
    """Temporary views in ``spark``, one per table, over the snapshot's files."""

    def __init__(self, spark: Any, snap: Snapshot, tables: Iterable[str] = TABLES) -> None:
        self.snapshot, self.spark = snap, spark
        for table in tables:
            files, ddl = _data_files(snap, table), spark_ddl(table)
            df = spark.read.schema(ddl).parquet(*files) if files else spark.createDataFrame([], ddl)
            raw = f"dynascope_files_{table}"
            df.createOrReplaceTempView(raw)
            spark.sql(f"SELECT {select_list(table, spark_quote)} FROM {raw}").createOrReplaceTempView(table)
        if "tensor_stats" in tables:  # the same canonical view, in Spark's SQL
            spark.sql(global_sql(quote=spark_quote)).createOrReplaceTempView(GLOBAL)

    def rows(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        df = self.spark.sql(sql)
        return list(df.columns), [tuple(r) for r in df.collect()]

    def close(self) -> None:
        pass  # the session belongs to the caller


def local_spark(memory: str = "1g", cores: int = 2) -> Any:
    """A local SparkSession sized for one machine (``local[cores]``, ``memory`` of driver heap), quiet."""
    from pyspark.sql import SparkSession

    warehouse = tempfile.mkdtemp(prefix="dynascope-spark-")  # not ./spark-warehouse in the caller's directory
    try:
        spark = (SparkSession.builder.master(f"local[{cores}]").appName("dynascope")
                 .config("spark.sql.warehouse.dir", warehouse)
                 .config("spark.driver.memory", memory)
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.sql.shuffle.partitions", str(max(2, cores * 2)))
                 # list a job's files in the driver: a listing job per table costs more than it saves locally
                 .config("spark.sql.sources.parallelPartitionDiscovery.threshold", "100000")
                 .config("spark.sql.session.timeZone", "UTC")
                 .getOrCreate())
    except BaseException:  # no session (no Java, a JVM that would not start): nothing to keep the directory for
        shutil.rmtree(warehouse, ignore_errors=True)
        raise
    spark.sparkContext.setLogLevel("ERROR")
    if warehouse in (spark.conf.get("spark.sql.warehouse.dir", "") or ""):  # removed with the session, at the latest at exit
        weakref.finalize(spark, shutil.rmtree, warehouse, True)
    else:  # a session already running (getOrCreate) keeps its own
        shutil.rmtree(warehouse, ignore_errors=True)
    return spark
