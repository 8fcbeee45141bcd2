"""``dynascope import trace``: PyTorch-profiler (Kineto) Chrome traces, one file per rank → ``timings`` rows.

Rows written (all with ``start_ns``/``dur_ns`` exact, ``start_us``/``dur_us`` rounded):

* GPU activity: category ``kernel``, ``comm`` (NCCL kernels), ``memcpy`` (memcpy and memset) or ``wait``
  (CUDA sync events); ``device`` ``cuda:N``, ``stream``, ``phase`` = kernel name, ``parent`` = the CPU
  call that launched it (cudaLaunchKernel, ...; NULL when the launch is not in the trace);
* annotations: category ``annotation``, ``device`` ``cpu`` (record_function, ProfilerStep#N) or ``cuda:N``
  (gpu_user_annotation).

``step`` is N of the last ``ProfilerStep#N`` that began at or before the row (for GPU rows: before its
launch), so a kernel belongs to the step that launched it; rows before the first step get N−1; a trace
without ProfilerStep puts everything in step 0. Times are wall clock: ``baseTimeNanoseconds`` is added
when the trace has it.

The rank is ``distributedInfo.rank``, else a number in the file name (``rank-3``, ``rank3``, ``_rank_3``),
else the file's position in the argument list. Two files with the same rank are an error.

Nothing is half-imported: every file is parsed and staged in a hidden sibling directory of the run first;
only when all files are good are the rows written, as one writer directory that is renamed into
``<run>/timings/`` in a single step, so readers see all of the import or none of it.
"""

from __future__ import annotations

import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynascope.importers.trace_json import BLOCK, TraceFormatError, stream_events
from dynascope.importers.trace_stage import ChunkStager, connect
from dynascope.store import RunWriter, StoreError, quote_literal
from dynascope.store.layout import MARKER, read_marker, safe_id, segment_name, writer_dir
from dynascope.store.schema import TABLES

__all__ = ["ImportResult", "import_command", "import_traces"]

_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
_SUFFIXES = (".json", ".json.gz", ".gz")


@dataclass
class ImportResult:
    """What an import wrote: the files per rank, row counts per category, and how long it took."""

    run_dir: Path
    files: dict[int, Path] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    time_base_ns: dict[int, int] = field(default_factory=dict)
    bytes_read: int = 0
    seconds: float = 0.0


def trace_files(paths: list[Path]) -> list[Path]:
    """Expand directories to the trace files directly inside them (sorted); keep files as given."""
    out: list[Path] = []
    for p in paths:
        p = Path(p).expanduser()
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(_SUFFIXES))
            if not found:
                raise StoreError(f"{p}: no .json or .json.gz trace files in this directory")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise StoreError(f"{p}: no such file or directory")
    if not out:
        raise StoreError("no trace files given")
    return out


def _rank_of(meta: dict[str, Any], path: Path, position: int) -> int:
    info = meta.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), (int, str)) and str(info["rank"]).isdigit():
        return int(info["rank"])
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else position


def _check_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise StoreError(f"{run_dir}: exists and is not a directory")
    if (run_dir / MARKER).exists():
        read_marker(run_dir)  # refuses runs written by a newer schema
        prior = sorted((run_dir / "timings").glob("writer=trace-import-*"))
        if prior:
            raise StoreError(f"{run_dir}: already holds an imported trace ({prior[0].name}); import into a new run")
    elif run_dir.is_dir() and any(run_dir.iterdir()):
        raise StoreError(f"{run_dir}: exists, is not empty and is not a dynascope run")


def import_traces(paths: list[Path], run_dir: Path, *, block: int = BLOCK, threads: int | None = None) -> ImportResult:
    """Import trace files into ``run_dir`` (created if missing); see the module docstring for the rows.

    Raises StoreError (one line) for unreadable, truncated or non-trace files, rank clashes, or a run
    that already holds an imported trace; in every such case the run is left as it was.
    """
    t0 = time.perf_counter()
    files = trace_files(paths)
    run_dir = Path(run_dir).expanduser().resolve()
    _check_run_dir(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    import_id = f"trace-import-{uuid.uuid4().hex[:10]}"
    stage = run_dir.parent / f".{run_dir.name}.{import_id}.tmp"
    con = connect(threads)
    result = ImportResult(run_dir)
    try:
        by_rank: dict[int, tuple[Path, Path, dict[str, Any]]] = {}
        for position, path in enumerate(files):
            stager = ChunkStager(con, stage / f"file{position:05d}")
            meta = stream_events(path, stager, block=block)
            rank = _rank_of(meta, path, position)
            if rank in by_rank:
                raise TraceFormatError(f"{path}: claims rank {rank}, as does {by_rank[rank][0]}; "
                                       "give one file per rank")
            by_rank[rank] = (path, stager.out_dir, meta)
            result.bytes_read += stager.bytes
        run_id = safe_id(run_dir.name)
        if (run_dir / MARKER).exists():
            run_id = str(read_marker(run_dir).get("run_id", run_id))
        staged_writer = stage / "writer"
        staged_writer.mkdir()
        for seq, rank in enumerate(sorted(by_rank)):
            path, rows_dir, meta = by_rank[rank]
            counts = _write_rank(con, rows_dir, staged_writer / segment_name(seq, seq), run_id, rank, meta)
            for cat, n in counts.items():
                result.rows[cat] = result.rows.get(cat, 0) + n
            result.files[rank] = path
            result.time_base_ns[rank] = _time_base_ns(meta)
        _publish(run_dir, staged_writer, import_id, result)
    finally:
        con.close()
        shutil.rmtree(stage, ignore_errors=True)
    result.seconds = time.perf_counter() - t0
    return result


def _publish(run_dir: Path, staged_writer: Path, import_id: str, result: ImportResult) -> None:
    """Create the run if needed, then move the staged writer directory into it in one rename."""
    writer = RunWriter(run_dir, rank=0, role="import", framework="kineto", world_size=len(result.files),
                       config={"trace_files": {str(r): str(p) for r, p in result.files.items()}})
    try:
        target = writer_dir(run_dir, "timings", import_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        staged_writer.rename(target)  # atomic: the whole import appears at once
        # time_base_ns: what each file's timestamps were relative to (analyses that mimic HTA's float64
        # arithmetic need the file's own numbers back).
        writer.event("trace_import", f"imported {len(result.files)} trace file(s)", rows=result.rows,
                     files={str(r): str(p) for r, p in result.files.items()},
                     time_base_ns={str(r): b for r, b in result.time_base_ns.items()})
    finally:
        writer.close()


def _write_rank(con: Any, rows_dir: Path, out: Path, run_id: str, rank: int, meta: dict[str, Any]) -> dict[str, int]:
    """Join one rank's staged rows (launch → step), write its final timings segment, count rows."""
    base_ns = _time_base_ns(meta)
    files = sorted(rows_dir.glob("*.parquet"))
    tmp = out.with_name(out.name + ".tmp")  # COPY writes in place: a failure must not leave a segment
    cols = ", ".join(f"CAST({c} AS {_duck_type(c)}) AS {c}" for c in TABLES["timings"].names)
    source = ("SELECT * FROM read_parquet([" + ", ".join(quote_literal(str(f)) for f in files) + "])"
              if files else "SELECT NULL::VARCHAR AS kind, NULL::VARCHAR AS cat, NULL::VARCHAR AS name, "
              "NULL::BIGINT AS pid, NULL::BIGINT AS ts_ns, NULL::BIGINT AS dur_ns, NULL::BIGINT AS stream, "
              "NULL::BIGINT AS corr, NULL::BIGINT AS device WHERE false")
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
           (ts_ns + {base_ns}) // 1000 AS start_us, CAST(round(dur_ns / 1000.0) AS BIGINT) AS dur_us,
           CASE WHEN kind = 'gpu' THEN 'cuda:' || coalesce(device, pid)
                WHEN cat = 'gpu_user_annotation' THEN 'cuda:' || pid ELSE 'cpu' END AS device,
           CASE WHEN kind = 'annotation' THEN 'annotation'
                WHEN cat = 'cuda_sync' THEN 'wait'
                WHEN regexp_matches(name, '^nccl', 'i') THEN 'comm'
                WHEN cat IN ('gpu_memcpy', 'gpu_memset') OR regexp_matches(name, '^(Memcpy|Memset)') THEN 'memcpy'
                ELSE 'kernel' END AS category,
           CASE WHEN kind = 'gpu' THEN stream END AS stream,
           ts_ns + {base_ns} AS start_ns, dur_ns
    FROM stepped
    ) ORDER BY start_ns) TO {quote_literal(str(tmp))} (FORMAT parquet, COMPRESSION zstd)
    """)
    tmp.rename(out)
    counts = con.execute(f"SELECT category, count(*) FROM read_parquet({quote_literal(str(out))}) GROUP BY 1").fetchall()
    return {c: int(n) for c, n in counts}


def _time_base_ns(meta: dict[str, Any]) -> int:
    """Newer Kineto writes timestamps relative to ``baseTimeNanoseconds``; older ones are µs since epoch."""
    base = meta.get("baseTimeNanoseconds")
    return int(base) if isinstance(base, (int, float)) and not isinstance(base, bool) else 0


def _duck_type(col: str) -> str:
    t = str(TABLES["timings"].field(col).type)
    return {"string": "VARCHAR", "int32": "INTEGER", "int64": "BIGINT", "double": "DOUBLE"}[t]


def import_command(paths: list[Path], run: Path, *, console: Any = None) -> ImportResult:
    """The CLI body: import, then print one summary line per rank and the totals."""
    result = import_traces(list(paths), run)
    if console is not None:
        for rank, path in sorted(result.files.items()):
            console.print(f"rank {rank}: {path}", markup=False, highlight=False)
        rows = ", ".join(f"{n} {cat}" for cat, n in sorted(result.rows.items())) or "no rows"
        console.print(f"imported {len(result.files)} file(s), {result.bytes_read / 1e6:.1f} MB of events "
                      f"in {result.seconds:.2f} s: {rows} → {result.run_dir}", markup=False, highlight=False)
    return result
