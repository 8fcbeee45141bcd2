"""The run catalog behind ``dynascope runs``: one row per run with its status, size and progress.

Status comes from files, not from a daemon:

- ``finished``: every writer that ever wrote to the run recorded a ``run_end`` event at close;
- ``live``: some writer without ``run_end`` touched its heartbeat (``_writers/<id>.json``, refreshed every
  flush interval) within ``2 × flush_secs + LIVE_MARGIN_S``;
- ``crashed``: neither (a writer died without closing, or its machine went away).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import duckdb
import polars as pl

from dynascope.core.errors import StoreError, first_line
from dynascope.store.layout import (
    HEARTBEATS,
    MARKER,
    SEGMENT_RE,
    is_writer_dir,
    locate,
    printable,
    read_marker,
)
from dynascope.store.reader import explain_error, open_store
from dynascope.store.views import quote_ident

LIVE_MARGIN_S = 5.0
_RANK = re.compile(r"^r(\d+)-")
_STEP_TABLES = ("tensor_stats", "spectra", "timings", "samples", "scalars")


def steps_sql(quote: Callable[[str], str] = quote_ident) -> str:
    """Steps per run (columns run_id, steps): the one count ``dynascope runs`` and ``dynascope report`` show.

    The training steps the run recorded: the timing probe writes one step row per rank and optimizer step,
    so those count when present. Rows logged after the last step (a final eval at step N) carry a step
    number but are no step. Runs without step rows (checkpoint diffs, imported histories) count the
    distinct steps of their per-step tables. Plain SQL that Spark runs too, with ``quote`` for its identifiers.
    """
    union = " UNION ALL ".join(f"SELECT run_id, step FROM {quote(t)}" for t in _STEP_TABLES)
    return f"""
        WITH st AS (SELECT run_id, COUNT(DISTINCT step) AS n FROM {quote('timings')}
                    WHERE step IS NOT NULL AND stream IS NULL
                      AND (category = 'step' OR (category IS NULL AND phase = 'step')) GROUP BY run_id),
        any_step AS (SELECT run_id, COUNT(DISTINCT step) AS n FROM ({union}) u WHERE step IS NOT NULL GROUP BY run_id)
        SELECT any_step.run_id, coalesce(st.n, any_step.n) AS steps FROM any_step LEFT JOIN st
        ON any_step.run_id = st.run_id"""

SCHEMA = {
    "run_id": pl.Utf8, "name": pl.Utf8, "status": pl.Utf8, "steps": pl.Int64, "ranks": pl.Int64,
    "restarts": pl.Int64, "size_bytes": pl.Int64, "last_write_us": pl.Int64, "start_us": pl.Int64, "path": pl.Utf8, "problem": pl.Utf8,
}


def list_runs(path: str | os.PathLike) -> pl.DataFrame:
    """One row per run under ``path`` (a run directory or a store root), newest first.

    Columns: run_id, name, status (live | finished | crashed), steps (``steps_sql``), ranks, restarts (the
    most times one rank's process was started again: ``restart`` events, ``store.lineage``), size_bytes,
    last_write_us, start_us, path, problem (why a run could not be read, or null).
    """
    rows = []
    for run_dir in _run_dirs(Path(path).expanduser()):
        try:
            rows.append(_describe(run_dir))
        except StoreError as exc:  # garbage or newer marker: list the run with the reason, keep the others
            name = printable(run_dir.name)
            rows.append((name, name, "crashed", None, 0, None, 0, None, None, printable(run_dir),
                         printable(first_line(exc))))
    rows = [tuple(printable(v) if isinstance(v, str) else v for v in r) for r in rows]  # invalid UTF-8 names
    df = pl.DataFrame(rows, schema=SCHEMA, orient="row") if rows else pl.DataFrame(schema=SCHEMA)
    return df.sort("start_us", descending=True, nulls_last=True)


def _run_dirs(path: Path) -> list[Path]:
    if path.is_dir() and not (path / MARKER).exists():
        runs = sorted(d.resolve() for d in path.iterdir() if d.is_dir() and (d / MARKER).exists())
        if runs:
            return runs
    return list(locate(path).run_dirs)  # a run directory, or the error for a path that holds no runs


def _describe(run_dir: Path) -> tuple:
    meta = read_marker(run_dir)
    run_id = str(meta.get("run_id", run_dir.name))
    files = _files(run_dir)
    size = sum(st.st_size for _, st in files)
    seg_times = [st.st_mtime_ns // 1000 for p, st in files if SEGMENT_RE.match(p.name)]
    writers = writer_ids(run_dir, (p.parent.name for p, _ in files))
    ranks = ranks_of(writers)
    name, steps, restarts, problem = run_dir.name, None, None, None
    ended: set[str] = set()
    try:
        name, steps, restarts, ended = _query(run_dir)
    except (StoreError, OSError) as exc:
        problem = first_line(exc)
    except duckdb.Error as exc:  # a segment that reads badly past its footer
        problem = explain_error(exc, f"{run_dir}: could not read")
    status = run_status(run_dir, writers, ended)
    start = meta.get("created_us") if isinstance(meta.get("created_us"), int) else None
    return (run_id, name, status, steps, len(ranks), restarts, size, max(seg_times, default=None), start, str(run_dir),
            problem)


def _files(run_dir: Path) -> list[tuple[Path, os.stat_result]]:
    """Every regular file of the run, without following symlinks (a hostile run may contain loops)."""
    out = []
    for dirpath, _, names in os.walk(run_dir, followlinks=False):
        for n in names:
            p = Path(dirpath) / n
            try:
                st = p.lstat()
            except OSError:
                continue
            out.append((p, st))
    return out


def _query(run_dir: Path) -> tuple[str, int | None, int, set[str]]:
    with open_store(run_dir) as store:
        names = store.rows("SELECT name FROM runs WHERE name IS NOT NULL ORDER BY start_us LIMIT 1")
        counted = store.rows(f"SELECT sum(steps) FROM ({steps_sql()})")[0][0]
        restarts = store.rows("SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM events "
                              "WHERE event = 'restart' GROUP BY rank, role)")[0][0]
        ended: set[str] = set()
        for (fields,) in store.rows("SELECT fields_json FROM events WHERE event = 'run_end'"):
            try:
                ended.add(json.loads(fields)["writer_id"])
            except (TypeError, ValueError, KeyError):
                continue
    return ((names[0][0] if names else run_dir.name), (None if counted is None else int(counted)), int(restarts),
            ended)


def writer_ids(run_dir: Path, dir_names: Iterable[str]) -> set[str]:
    """The ids of a run's writers: those of the ``writer=<id>`` directories among ``dir_names`` (not the
    toolkit's ``writer=_schema`` and ``writer=_merged``) and of the heartbeats, which outlive the directories
    that compaction folds together once their writers finished."""
    beats = {p.stem for p in (run_dir / HEARTBEATS).glob("*.json")}
    return beats | {n.removeprefix("writer=") for n in set(dir_names) if is_writer_dir(n)}


def ranks_of(writers: set[str]) -> set[int]:
    """The ranks of a run's writers (their ids start ``r<rank>-``)."""
    return {int(m.group(1)) for w in writers if (m := _RANK.match(w))}


def writer_hosts(run_dir: str | os.PathLike) -> list[tuple[str, int, str]]:
    """(role, rank, host) of each writer that kept a heartbeat in the run (``_writers/<id>.json``): the one
    record of every rank's host, where only the process that created the run wrote a ``runs`` row."""
    out = set()
    hb_dir = Path(run_dir) / HEARTBEATS
    for f in hb_dir.glob("*.json") if hb_dir.is_dir() else ():
        try:
            beat = json.loads(f.read_text(encoding="utf-8"))
            out.add((str(beat.get("role") or ""), int(beat["rank"]), str(beat["host"])))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            continue  # a heartbeat being rewritten, or not one of ours
    return sorted(out, key=lambda r: (r[0], r[1]))


def run_status(run_dir: Path, writers: set[str], ended: set[str]) -> str:
    """live | finished | crashed (see the module docstring) from the writer ids of the run's segment
    directories, those that wrote ``run_end``, and the heartbeat files."""
    hb_dir = run_dir / HEARTBEATS
    beats = {}
    if hb_dir.is_dir():
        for f in hb_dir.glob("*.json"):
            try:
                flush = float(json.loads(f.read_text(encoding="utf-8")).get("flush_secs", 2.0))
                beats[f.stem] = (f.stat().st_mtime, flush)
            except (OSError, ValueError, AttributeError, UnicodeDecodeError):
                continue
    writers = writers | set(beats)
    if writers and writers <= ended:
        return "finished"
    now = time.time()
    for w in writers - ended:
        if w in beats and now - beats[w][0] <= 2 * beats[w][1] + LIVE_MARGIN_S:
            return "live"
    if not writers and now - (run_dir / MARKER).stat().st_mtime <= LIVE_MARGIN_S:
        return "live"  # just created; nothing flushed yet
    return "crashed"
