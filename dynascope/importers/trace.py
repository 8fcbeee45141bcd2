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

import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynascope.core.errors import StoreError
from dynascope.importers.trace_json import BLOCK, TraceFormatError, stream_events
from dynascope.importers.trace_stage import ChunkStager, connect, write_segment
from dynascope.store import RunWriter
from dynascope.store.layout import HEARTBEATS, MARKER, read_marker, safe_id, segment_name, writer_dir

__all__ = ["ImportResult", "import_traces"]

_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
_SUFFIXES = (".json", ".json.gz", ".gz")
# Files parsed at once: each holds a few blocks and a DuckDB parse in memory.
_MAX_PARALLEL_FILES = 4


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
        # The import's directory, or (once compaction folded it into writer=_merged) its writer's heartbeat.
        prior = sorted((run_dir / "timings").glob("writer=trace-import-*")) or sorted((run_dir / HEARTBEATS).glob("r*-import-*.json"))
        if prior:
            raise StoreError(f"{run_dir}: already holds an imported trace ({prior[0].name}); import into a new run")
    elif run_dir.is_dir() and any(run_dir.iterdir()):
        raise StoreError(f"{run_dir}: exists, is not empty and is not a dynascope run")


@dataclass
class _Done:
    """One imported file: its rank's segment, written in the staging directory."""

    path: Path
    rank: int
    meta: dict[str, Any]
    segment: Path
    rows: dict[str, int]
    bytes_read: int


def import_traces(paths: list[Path], run_dir: Path, *, block: int = BLOCK, threads: int | None = None) -> ImportResult:
    """Import trace files into ``run_dir`` (created if missing); see the module docstring for the rows.

    Up to ``threads`` files (default: the CPU count, at most 4) are parsed at once. Raises StoreError (one
    line) for unreadable, truncated or non-trace files, rank clashes, or a run that already holds an
    imported trace; in every such case the run is left as it was.
    """
    t0 = time.perf_counter()
    files = trace_files(paths)
    run_dir = Path(run_dir).expanduser().resolve()
    _check_run_dir(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    run_id = safe_id(run_dir.name)
    if (run_dir / MARKER).exists():
        run_id = str(read_marker(run_dir).get("run_id", run_id))
    import_id = f"trace-import-{uuid.uuid4().hex[:10]}"
    stage = run_dir.parent / f".{run_dir.name}.{import_id}.tmp"
    staged_writer = stage / "writer"
    result = ImportResult(run_dir)
    try:
        staged_writer.mkdir(parents=True)
        done: dict[int, _Done] = {}
        with closing(_import_all(files, stage, run_id, block, threads)) as results:
            for d in results:
                if d.rank in done:
                    raise TraceFormatError(f"{d.path}: claims rank {d.rank}, as does {done[d.rank].path}; "
                                           "give one file per rank")
                done[d.rank] = d
        for seq, rank in enumerate(sorted(done)):
            d = done[rank]
            d.segment.rename(staged_writer / segment_name(seq, seq))
            for cat, n in d.rows.items():
                result.rows[cat] = result.rows.get(cat, 0) + n
            result.files[rank] = d.path
            result.time_base_ns[rank] = _time_base_ns(d.meta)
            result.bytes_read += d.bytes_read
        _publish(run_dir, staged_writer, import_id, result)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    result.seconds = time.perf_counter() - t0
    return result


def _import_all(files: list[Path], stage: Path, run_id: str, block: int,
                threads: int | None) -> Iterator[_Done]:
    """Import the files a few at a time (the work runs in DuckDB and zlib, outside the GIL) and yield them
    in order, so the first bad file in the argument list is the one reported. Closing it (an error, Ctrl-C)
    stops the others at their next chunk and waits for them: nothing may write into the staging directory
    once it is removed."""
    workers = max(1, min(len(files), threads or os.cpu_count() or 1, _MAX_PARALLEL_FILES))
    stop = threading.Event()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="dynascope-trace-import")
    try:
        futures = [pool.submit(_import_file, path, position, stage, run_id, block, workers, stop)
                   for position, path in enumerate(files)]
        for future in futures:
            yield future.result()
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)


def _import_file(path: Path, position: int, stage: Path, run_id: str, block: int, workers: int,
                 stop: threading.Event) -> _Done:
    """Stream one file's kept events to Parquet, then write its rank's segment."""
    # A DuckDB of its own, closed after the file: its buffers go back rather than pile up across files.
    # Files run in parallel: one thread each (more would only add buffers); a lone file gets them all.
    con = connect(1 if workers > 1 else None)
    staged = stage / f"file{position:05d}"
    try:
        stager = ChunkStager(con, staged, stop=stop)
        try:
            meta = stream_events(path, stager, block=block)
        finally:
            stager.close()
        rank = _rank_of(meta, path, position)
        segment = stage / f"file{position:05d}.segment"
        rows = write_segment(con, staged, segment, run_id, rank, _time_base_ns(meta))
    finally:
        con.close()
        shutil.rmtree(staged, ignore_errors=True)  # free the disk as soon as the segment is written
    return _Done(path, rank, meta, segment, rows, stager.bytes)


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


def _time_base_ns(meta: dict[str, Any]) -> int:
    """Newer Kineto writes timestamps relative to ``baseTimeNanoseconds``; older ones are µs since epoch."""
    base = meta.get("baseTimeNanoseconds")
    return int(base) if isinstance(base, (int, float)) and not isinstance(base, bool) else 0
