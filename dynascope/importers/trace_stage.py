"""Stage one trace file: its events, streamed through DuckDB's JSON reader into Parquet files of kept rows
(``ChunkStager``, one file per run of events), then joined into the rank's ``timings`` segment
(``write_segment``).

Only three kinds of event are kept (the rest — CPU ops, flows, metadata — is read and dropped in C++):

* ``gpu``: anything with an integer ``args.stream`` (kernels, memcpy/memset, CUDA syncs), as HTA defines
  GPU activity;
* ``annotation``: ``user_annotation`` (record_function, ProfilerStep#N) and ``gpu_user_annotation``;
* ``launch``: CPU-side events carrying a ``correlation`` id (cudaLaunchKernel, cudaMemcpyAsync, ...), so a
  GPU row can be tied to the call that launched it and to the step that call was in.

Per run of events only the cheap filter runs (JSON parse + a few casts); ``ts``/``dur`` stay text and are
turned into integer nanoseconds once per rank, on the kept rows only, by ``write_segment``. DuckDB reads a
JSON number as a double and renders it as its shortest decimal, which is cast exactly to DECIMAL: µs values
written with ≤ 17 significant digits (ns-resolution traces relative to ``baseTimeNanoseconds``, or
µs-since-epoch ones) survive unrounded.
"""

from __future__ import annotations

import threading
from pathlib import Path

import duckdb

from dynascope.importers.trace_json import ChunkRejected
from dynascope.store import quote_literal
from dynascope.store.schema import TABLES, sql_type

COLUMNS = {
    "cat": "VARCHAR", "name": "VARCHAR", "pid": "VARCHAR", "ts": "VARCHAR", "dur": "VARCHAR",
    "args": 'STRUCT("stream" VARCHAR, "correlation" VARCHAR, "device" VARCHAR)',
}
_COLUMNS_SQL = "{" + ", ".join(f"{quote_literal(k)}: {quote_literal(v)}" for k, v in COLUMNS.items()) + "}"

# HTA keeps events with a duration and a category other than 'Trace' (the profiler's own span). Rows that
# cannot be GPU work, an annotation or a launch are dropped here, before any other per-row work.
_SELECT = """
SELECT kind, cat, name, TRY_CAST(pid AS BIGINT) AS pid, ts, dur, stream, corr, device FROM (
    SELECT CASE WHEN stream IS NOT NULL AND stream <> -1 THEN 'gpu'
                WHEN cat IN ('user_annotation', 'gpu_user_annotation') THEN 'annotation'
                WHEN corr IS NOT NULL THEN 'launch' END AS kind, *
    FROM (SELECT cat, name, pid, ts, dur,
                 TRY_CAST(args.stream AS BIGINT) AS stream,
                 TRY_CAST(args.correlation AS BIGINT) AS corr,
                 TRY_CAST(args.device AS BIGINT) AS device
          FROM read_json({file}, format = 'array', columns = {columns})
          WHERE dur IS NOT NULL AND ts IS NOT NULL AND cat IS NOT NULL AND cat <> 'Trace'
            AND (args.stream IS NOT NULL OR args.correlation IS NOT NULL
                 OR cat IN ('user_annotation', 'gpu_user_annotation'))))
WHERE kind IS NOT NULL
"""

# Exact: the number's shortest decimal text → DECIMAL → ns (hugeint arithmetic, ~0.5 µs a value). The fast
# branches give the same integer without it: whole-µs values (most traces), and values below 2^42 µs with at
# most 3 decimals, where the double is within 500 ulp < 0.5 ns of the decimal (ns-resolution relative times).
# A value whose ns do not fit in BIGINT becomes NULL and its row is dropped.
_NS_MACROS = ("""
CREATE OR REPLACE MACRO dynascope_ns_exact(x) AS coalesce(
    TRY_CAST(round(TRY_CAST(x AS DECIMAL(38, 6)) * 1000) AS BIGINT),
    TRY_CAST(round(TRY_CAST(x AS DOUBLE) * 1000) AS BIGINT))""", """
CREATE OR REPLACE MACRO dynascope_ns_of(x, d) AS CASE
    WHEN d = trunc(d) AND abs(d) < 9e15 THEN CAST(d AS BIGINT) * 1000
    WHEN abs(d) < 4e12 AND NOT contains(x, 'e') AND length(x) - instr(x, '.') <= 3
        THEN CAST(trunc(d) AS BIGINT) * 1000 + CAST(round((d - trunc(d)) * 1000) AS BIGINT)
    ELSE dynascope_ns_exact(x) END""", """
CREATE OR REPLACE MACRO dynascope_ns(x) AS dynascope_ns_of(x, TRY_CAST(x AS DOUBLE))""")

# Staged rows with integer-ns times; rows whose ts or dur is not a number are dropped.
_NS_SQL = """
SELECT kind, cat, name, pid, ts_ns, dur_ns, stream, corr, device FROM (
    SELECT *, dynascope_ns(ts) AS ts_ns, dynascope_ns(dur) AS dur_ns FROM read_parquet({files}))
WHERE ts_ns IS NOT NULL AND dur_ns IS NOT NULL
"""
_NO_ROWS = ("SELECT NULL::VARCHAR AS kind, NULL::VARCHAR AS cat, NULL::VARCHAR AS name, NULL::BIGINT AS pid, "
            "NULL::BIGINT AS ts_ns, NULL::BIGINT AS dur_ns, NULL::BIGINT AS stream, NULL::BIGINT AS corr, "
            "NULL::BIGINT AS device WHERE false")


def connect(threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """A private in-memory DuckDB for staging (never the user's store connection)."""
    con = duckdb.connect(":memory:")
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    con.execute("SET preserve_insertion_order = false")
    con.execute("SET enable_progress_bar = false")
    for macro in _NS_MACROS:
        con.execute(macro)
    return con


class ImportStopped(Exception):
    """The import this file belonged to is being abandoned."""


class ChunkStager:
    """A ``stream_events`` sink: parses each run of events and writes its kept rows to a Parquet file in
    ``out_dir`` (files on disk, so memory stays flat whatever the trace's size). ``con`` is used by this
    stager alone; once ``stop`` is set, the next run of events raises ImportStopped."""

    def __init__(self, con: duckdb.DuckDBPyConnection, out_dir: Path, *, stop: threading.Event | None = None) -> None:
        self.con, self.out_dir, self.stop = con, out_dir, stop
        out_dir.mkdir(parents=True, exist_ok=True)
        # Each run of events goes through a file: DuckDB reads it natively, where a BytesIO would be copied
        # and read back through Python (and ~10 ms more per call).
        self._chunk = out_dir / "chunk.json"
        self._query = _SELECT.format(file=quote_literal(str(self._chunk)), columns=_COLUMNS_SQL)
        self.chunks = 0
        self.bytes = 0
        self._attempts = 0

    def __call__(self, events: memoryview) -> None:
        if self.stop is not None and self.stop.is_set():
            raise ImportStopped("another file of the import failed or it was interrupted")
        with open(self._chunk, "wb") as f:
            f.writelines((b"[", events, b"]"))
        final = self.out_dir / f"{self.chunks:06d}.parquet"
        # A name of its own for every attempt: a run of events DuckDB rejected is cut again and retried, and
        # the failed COPY's clean-up can remove its file after the next COPY has begun; under one name that
        # took the retry's file with it (one import in a few hundred lost its chunk).
        self._attempts += 1
        tmp = final.with_name(f"{final.name}.{self._attempts}.tmp")
        try:
            self.con.execute(f"COPY ({self._query}) TO {quote_literal(str(tmp))} (FORMAT parquet, COMPRESSION lz4)")
        except (duckdb.InvalidInputException, duckdb.ConversionException) as exc:
            tmp.unlink(missing_ok=True)
            raise ChunkRejected(str(exc)) from None
        tmp.rename(final)
        self.chunks += 1
        self.bytes += len(events)

    def close(self) -> None:
        """Remove the scratch file (the staged Parquet files stay, for ``write_segment``)."""
        self._chunk.unlink(missing_ok=True)


def write_segment(con: duckdb.DuckDBPyConnection, staged: Path, out: Path, run_id: str, rank: int,
                  base_ns: int) -> dict[str, int]:
    """Join the rows a ChunkStager staged in ``staged`` (launch → parent and step), write the rank's
    ``timings`` segment to ``out`` (sorted by start), return the row count per category."""
    tmp = out.with_name(out.name + ".tmp")  # COPY writes in place: a failure must not leave a segment
    cols = ", ".join(f"CAST({f.name} AS {sql_type(f.type)}) AS {f.name}" for f in TABLES["timings"])
    files = sorted(staged.glob("*.parquet"))
    source = (_NS_SQL.format(files="[" + ", ".join(quote_literal(str(f)) for f in files) + "]") if files else _NO_ROWS)
    con.execute(f"""
    COPY (SELECT {cols} FROM (
    WITH st AS ({source}),
    launch AS (SELECT corr, min(ts_ns) AS launch_ns, arg_min(name, ts_ns) AS launcher
               FROM st WHERE kind = 'launch' GROUP BY corr),
    steps AS (SELECT ts_ns AS s, CAST(regexp_extract(name, 'ProfilerStep\\s*#\\s*(\\d+)', 1) AS BIGINT) AS n
              FROM st WHERE kind = 'annotation' AND cat = 'user_annotation'
                AND regexp_matches(name, 'ProfilerStep\\s*#\\s*\\d+')),
    first_step AS (SELECT arg_min(n, s) AS n0 FROM steps),
    rows AS (SELECT st.*, l.launcher, coalesce(l.launch_ns, st.ts_ns) AS step_key FROM st
             LEFT JOIN launch l ON st.kind = 'gpu' AND st.corr = l.corr
             WHERE st.kind IN ('gpu', 'annotation')),
    stepped AS (SELECT rows.*, steps.n FROM rows
                ASOF LEFT JOIN steps ON rows.step_key >= steps.s)
    SELECT {quote_literal(run_id)} AS run_id, {int(rank)} AS rank, 'trainer' AS role,
           coalesce(n, greatest((SELECT n0 FROM first_step) - 1, 0), 0) AS step,
           name AS phase,
           CASE WHEN kind = 'gpu' THEN launcher END AS parent,
           (ts_ns + {int(base_ns)}) // 1000 AS start_us, CAST(round(dur_ns / 1000.0) AS BIGINT) AS dur_us,
           CASE WHEN kind = 'gpu' THEN 'cuda:' || coalesce(device, pid)
                WHEN cat = 'gpu_user_annotation' THEN 'cuda:' || pid ELSE 'cpu' END AS device,
           CASE WHEN kind = 'annotation' THEN 'annotation'
                WHEN cat = 'cuda_sync' THEN 'wait'
                WHEN regexp_matches(name, '^nccl', 'i') THEN 'comm'
                WHEN cat IN ('gpu_memcpy', 'gpu_memset') OR regexp_matches(name, '^(Memcpy|Memset)') THEN 'memcpy'
                ELSE 'kernel' END AS category,
           CASE WHEN kind = 'gpu' THEN stream END AS stream,
           ts_ns + {int(base_ns)} AS start_ns, dur_ns,
           NULL::VARCHAR AS clock  -- the profiler's own clocks (start_ns, dur_ns), not a probe's
    FROM stepped
    ) ORDER BY start_ns) TO {quote_literal(str(tmp))} (FORMAT parquet, COMPRESSION zstd)
    """)
    tmp.rename(out)
    counts = con.execute(f"SELECT category, count(*) FROM read_parquet({quote_literal(str(out))}) GROUP BY 1").fetchall()
    return {c: int(n) for c, n in counts}

