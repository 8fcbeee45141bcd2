"""Stage one trace file: its events, streamed through DuckDB's JSON reader, into small Parquet files.

Only three kinds of event are kept (the rest — CPU ops, flows, metadata — is read and dropped in C++):

* ``gpu``: anything with an integer ``args.stream`` (kernels, memcpy/memset, CUDA syncs), as HTA defines
  GPU activity;
* ``annotation``: ``user_annotation`` (record_function, ProfilerStep#N) and ``gpu_user_annotation``;
* ``launch``: CPU-side events carrying a ``correlation`` id (cudaLaunchKernel, cudaMemcpyAsync, ...), so a
  GPU row can be tied to the call that launched it and to the step that call was in.

Times are kept as integer nanoseconds. DuckDB reads a JSON number as a double and renders it as its
shortest decimal, which is cast exactly to DECIMAL: µs values written with ≤ 17 significant digits
(ns-resolution traces relative to ``baseTimeNanoseconds``, or µs-since-epoch ones) survive unrounded.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import duckdb

from dynascope.importers.trace_json import ChunkRejected

COLUMNS = {
    "cat": "VARCHAR", "name": "VARCHAR", "pid": "VARCHAR", "ts": "VARCHAR", "dur": "VARCHAR",
    "args": 'STRUCT("stream" VARCHAR, "correlation" VARCHAR, "device" VARCHAR)',
}

# HTA keeps events with a duration and a category other than 'Trace' (the profiler's own span). Rows that
# cannot be GPU work, an annotation or a launch are dropped before any per-row conversion.
_SELECT = """
SELECT kind, cat, name, pid, dynascope_ns(ts) AS ts_ns, dynascope_ns(dur) AS dur_ns, stream, corr, device FROM (
    SELECT CASE WHEN stream IS NOT NULL AND stream <> -1 THEN 'gpu'
                WHEN cat IN ('user_annotation', 'gpu_user_annotation') THEN 'annotation'
                WHEN corr IS NOT NULL THEN 'launch' END AS kind, *
    FROM (SELECT cat, name, TRY_CAST(pid AS BIGINT) AS pid, ts, dur,
                 TRY_CAST(args.stream AS BIGINT) AS stream,
                 TRY_CAST(args.correlation AS BIGINT) AS corr,
                 TRY_CAST(args.device AS BIGINT) AS device
          FROM ev
          WHERE dur IS NOT NULL AND cat IS NOT NULL AND cat <> 'Trace'
            AND (args.stream IS NOT NULL OR args.correlation IS NOT NULL
                 OR cat IN ('user_annotation', 'gpu_user_annotation'))))
WHERE kind IS NOT NULL AND ts_ns IS NOT NULL AND dur_ns IS NOT NULL
"""

_NS_MACRO = """
CREATE OR REPLACE MACRO dynascope_ns(x) AS coalesce(
    CAST(round(TRY_CAST(x AS DECIMAL(38, 6)) * 1000) AS BIGINT),
    CAST(round(TRY_CAST(x AS DOUBLE) * 1000) AS BIGINT))
"""


def connect(threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """A private in-memory DuckDB for staging (never the user's store connection)."""
    con = duckdb.connect(":memory:")
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    con.execute("SET preserve_insertion_order = false")
    con.execute("SET enable_progress_bar = false")
    con.execute(_NS_MACRO)
    return con


class ChunkStager:
    """A ``stream_events`` sink: parses each run of events and writes the kept rows to ``out_dir``."""

    def __init__(self, con: duckdb.DuckDBPyConnection, out_dir: Path) -> None:
        self.con, self.out_dir = con, out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.chunks = 0
        self.bytes = 0

    def __call__(self, events: bytes) -> None:
        final = self.out_dir / f"{self.chunks:06d}.parquet"
        tmp = final.with_name(final.name + ".tmp")
        try:
            ev = self.con.read_json(io.BytesIO(b"[" + events + b"]"), format="array", columns=COLUMNS)
            ev.query("ev", _SELECT).write_parquet(str(tmp), compression="zstd")
        except (duckdb.InvalidInputException, duckdb.ConversionException) as exc:
            tmp.unlink(missing_ok=True)
            raise ChunkRejected(str(exc)) from None
        os.replace(tmp, final)
        self.chunks += 1
        self.bytes += len(events)
