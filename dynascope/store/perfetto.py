"""Export a run's timings and events as a Chrome-trace JSON file that Perfetto and chrome://tracing open.

Layout, as torchtitan's and Kineto's traces use it:

* one process track per (run, role, rank), named ``"<role> rank <n>"``;
* one thread track per stream: ``host`` for the probe's phases (they carry no stream), ``stream <n>`` for
  an imported trace's GPU streams;
* each ``timings`` row is a complete slice (``ph: X``). Perfetto nests slices on one track by time, so a
  phase sits under its step and a sub-phase under its phase, with ``parent`` kept in the slice's args;
* each step's start and each ``events`` row is an instant (``ph: i``), on its process (or global when the
  event names no rank).

Slices that overlap on one track without nesting (two timers around the same work, for instance) would be
drawn wrongly or dropped by the viewer, so such a slice moves to an extra track beside it (``host #2``):
nothing is dropped and nothing is drawn inside a slice it is not part of.

Times are written relative to ``baseTimeNanoseconds`` (the run's first row), in µs with ns decimals, as
Kineto writes them: absolute µs since the epoch would lose the ns digits in a double. A rank whose clock
offset was measured (``probes.clocks``; ``store.clock_offsets``) is drawn on its reference rank's clock:
its times less its offset, and its track's name says by how much, so ranks on skewed hosts line up.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import duckdb

from dynascope.core.errors import StoreError, first_line
from dynascope.store.clock_offsets import OFFSETS_SQL
from dynascope.store.reader import StoreConnection, open_store, retry_vanished
from dynascope.store.snapshot import snapshot

__all__ = ["export_perfetto"]

_BATCH = 50_000  # rows fetched at a time: the export streams, whatever the run's size

_SLICES = """
SELECT run_id, role, rank, stream, step, phase, parent, category, device,
       coalesce(start_ns, start_us * 1000) AS t0, coalesce(dur_ns, dur_us * 1000) AS d
FROM timings
WHERE coalesce(start_ns, start_us * 1000) IS NOT NULL AND coalesce(dur_ns, dur_us * 1000) >= 0
ORDER BY run_id, role, rank, stream NULLS FIRST, t0, d DESC
"""
_EVENTS = """
SELECT run_id, role, rank, step, time_us, event, severity, message, fields_json
FROM events WHERE time_us IS NOT NULL ORDER BY time_us
"""
_BASE = """
SELECT least((SELECT min(coalesce(start_ns, start_us * 1000)) FROM timings),
             (SELECT min(time_us) * 1000 FROM events))
"""


@dataclass
class _Track:
    """The lanes of one (process, stream) track: each lane is a stack of open slices' end times."""

    lanes: list[list[int]] = field(default_factory=list)

    def place(self, t0: int, t1: int) -> int:
        """The first lane where [t0, t1] nests inside what is open there, or after it; opens one if none."""
        for i, stack in enumerate(self.lanes):
            while stack and stack[-1] <= t0:
                stack.pop()
            if not stack or t1 <= stack[-1]:
                stack.append(t1)
                return i
        self.lanes.append([t1])
        return len(self.lanes) - 1


class _Writer:
    """Writes events one per line into the open ``traceEvents`` array, numbering processes and threads."""

    def __init__(self, fh: IO[str], base_ns: int, multi_run: bool,
                 offsets: dict[tuple[str, str, int | None], int] | None = None) -> None:
        self.fh, self.base_ns, self.multi_run = fh, base_ns, multi_run
        self.offsets = offsets or {}  # ns to take off a (run, role, rank)'s times
        self.first = True
        self.pids: dict[tuple[str, str, int | None], int] = {}
        self.tids: dict[tuple[int, int | None, int], int] = {}
        self.counts = {"slices": 0, "instants": 0, "processes": 0, "threads": 0}

    def emit(self, event: dict[str, Any]) -> None:
        self.fh.write(("\n" if self.first else ",\n") + json.dumps(event, separators=(",", ":"), default=str))
        self.first = False

    def us(self, ns: int, key: tuple[str, str, int | None] | None = None) -> float:
        off = self.offsets.get(key, 0) if key is not None else 0
        return round((ns - off - self.base_ns) / 1000, 3)

    def pid(self, run_id: str, role: str | None, rank: int | None) -> int:
        key = (run_id, role or "", rank)
        if key not in self.pids:
            pid = self.pids[key] = len(self.pids) + 1
            name = f"{role or 'process'} rank {rank}" if rank is not None else (role or "run")
            off = self.offsets.get(key)
            if off:
                name += f" (clock {off / 1e6:+.3f} ms, aligned)"
            if self.multi_run:
                name = f"{run_id}: {name}"
            self.emit({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
            self.emit({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
            self.counts["processes"] += 1
        return self.pids[key]

    def tid(self, pid: int, stream: int | None, lane: int) -> int:
        key = (pid, stream, lane)
        if key not in self.tids:
            tid = self.tids[key] = len(self.tids) + 1
            name = "host" if stream is None else f"stream {stream}"
            self.emit({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": name if lane == 0 else f"{name} #{lane + 1}"}})
            self.counts["threads"] += 1
        return self.tids[key]


def _slices(cur: StoreConnection, w: _Writer) -> None:
    tracks: dict[tuple[int, int | None], _Track] = {}
    res = cur.execute(_SLICES)
    while rows := res.fetchmany(_BATCH):
        for run_id, role, rank, stream, step, phase, parent, category, device, t0, d in rows:
            pid = w.pid(run_id, role, rank)
            lane = tracks.setdefault((pid, stream), _Track()).place(int(t0), int(t0) + int(d))
            args = {k: v for k, v in (("step", step), ("parent", parent), ("device", device), ("stream", stream))
                    if v is not None}
            w.emit({"ph": "X", "name": phase, "cat": category or "phase", "pid": pid,
                    "tid": w.tid(pid, stream, lane), "ts": w.us(int(t0), (run_id, role or "", rank)),
                    "dur": round(int(d) / 1000, 3),
                    "args": args})
            w.counts["slices"] += 1
            if category == "step" and step is not None:
                w.emit({"ph": "i", "s": "p", "name": f"step {step}", "cat": "step", "pid": pid,
                        "tid": w.tid(pid, stream, lane), "ts": w.us(int(t0), (run_id, role or "", rank))})
                w.counts["instants"] += 1


def _events(cur: StoreConnection, w: _Writer) -> None:
    res = cur.execute(_EVENTS)
    while rows := res.fetchmany(_BATCH):
        for run_id, role, rank, step, time_us, event, severity, message, fields_json in rows:
            try:
                fields = json.loads(fields_json) if fields_json else None
            except ValueError:
                fields = fields_json
            args = {k: v for k, v in (("step", step), ("severity", severity), ("message", message),
                                      ("fields", fields)) if v is not None}
            out: dict[str, Any] = {"ph": "i", "name": event or "event", "cat": "event",
                                   "ts": w.us(int(time_us) * 1000, (run_id, role or "", rank)), "args": args}
            if rank is None:
                out.update(s="g", pid=0, tid=0)
            else:
                pid = w.pid(run_id, role, rank)
                out.update(s="p", pid=pid, tid=0)
            w.emit(out)
            w.counts["instants"] += 1


def export_perfetto(path: str | os.PathLike, out: str | os.PathLike) -> dict[str, int]:
    """Write the run (or every run of a root) at ``path`` to ``out`` as Chrome-trace JSON.

    Returns counts of slices, instants, processes and threads written. The file appears whole or not at
    all (written beside it, then renamed); an existing file is never overwritten.
    """
    target = Path(out).expanduser()
    if not target.parent.is_dir():
        raise StoreError(f"{target.parent}: no such directory")
    if target.exists():
        raise StoreError(f"{target}: already exists; refusing to overwrite")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    # A leased moment pins its segments against compaction, but a journal's seal that ran late takes its
    # segments back (``journal.seal_files``): the export is made again, at a new moment.
    return retry_vanished(lambda: _export(path, target, tmp))


def _export(path: str | os.PathLike, target: Path, tmp: Path) -> dict[str, int]:
    # One leased moment for every query: rows a live writer commits meanwhile are not half in, and
    # compaction cannot delete a segment under the export.
    with snapshot(path, holder="perfetto-export") as snap:
        store = open_store(path, at_us=snap.at_us)
        try:
            offsets: dict[tuple[str, str, int | None], int] = {
                (run_id, role or "", int(rank)): round(off * 1000)
                for run_id, role, rank, off, _, _ in store.execute(OFFSETS_SQL).fetchall()}
            # a track moved back in time by its offset still starts at or after the base
            base_ns = int(store.execute(_BASE).fetchall()[0][0] or 0) - max([0, *offsets.values()])
            runs = store.execute("SELECT count(DISTINCT run_id) FROM timings").fetchall()[0][0]
            with tmp.open("w", encoding="utf-8") as fh:
                fh.write(f'{{"displayTimeUnit":"ms","baseTimeNanoseconds":{base_ns},"traceEvents":[')
                w = _Writer(fh, base_ns, multi_run=runs > 1, offsets=offsets)
                _slices(store, w)
                _events(store, w)
                fh.write("\n]}\n")
            os.replace(tmp, target)
            return w.counts
        except duckdb.Error as exc:
            raise StoreError(f"perfetto export failed: {first_line(exc)}") from None
        finally:
            store.close()
            tmp.unlink(missing_ok=True)
