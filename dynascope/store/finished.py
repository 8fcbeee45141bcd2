"""Which writers of a run will not write again: closed (their ``run_end`` is on disk) or crashed.

Compaction folds such writers' directories together (``compact_across``). A writer is *done* once it has
been quiet for ``quiet_s`` (heartbeat untouched) and either closed or crashed, where crashed means that its
heartbeat is older than twice its flush interval plus a margin, as ``catalog.run_status`` has it. A writer
taken for crashed may still be alive (a paused process), so only a closed writer counts as certain.

Where a writer's ``run_end`` is: in its own ``events`` directory until that is folded, then among the rows
of ``events/writer=_merged``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dynascope.store.layout import HEARTBEATS, MERGED, is_writer_dir
from dynascope.store.runfiles import FOREVER_US, RunFiles

CRASHED_MARGIN_S = 5.0  # ``catalog.LIVE_MARGIN_S``: a heartbeat older than 2 flush intervals + this is a dead writer


def done_writers(files: RunFiles, quiet_s: float) -> dict[str, bool]:
    """The writers of the run that will not write again, quiet for ``quiet_s``: id -> closed (True) or
    crashed (False: heartbeat older than twice its flush interval, or, for a writer that keeps none, its
    newest segment older than ``quiet_s``)."""
    now = time.time()
    beats = {p.stem: p for p in (files.run_dir / HEARTBEATS).glob("*.json")}
    ids = {wdir.name.removeprefix("writer=") for wdir in files.segs if is_writer_dir(wdir.name)}
    newest = dict.fromkeys(ids - set(beats), 0.0)  # writers without a heartbeat (older stores, imports)
    for e in files.listing if newest else ():  # their newest own segment decides
        wid = Path(e.path).parent.name.removeprefix("writer=")
        if wid in newest and e.path.endswith(".parquet") and ".v" not in Path(e.path).name:
            newest[wid] = max(newest[wid], e.mtime_us / 1e6)
    closed = _closed_check(files)
    done: dict[str, bool] = {}
    for wid in set(beats) | set(newest):
        beat = beats.get(wid)
        if beat is None:
            if now - newest[wid] >= quiet_s:
                done[wid] = False
            continue
        age = now - _mtime(beat)
        if age < quiet_s:
            continue
        if closed(wid):
            done[wid] = True
        elif age > 2 * _flush_secs(beat) + CRASHED_MARGIN_S:
            done[wid] = False
    return done


def _closed_check(files: RunFiles) -> Callable[[str], bool]:
    """``closed(writer_id)``: whether its ``run_end`` is in its own events (newest segments first) or among
    the folded ones (read once, on the first writer not found in its own)."""
    live = files.live(FOREVER_US)
    folded: set[str] | None = None

    def closed(wid: str) -> bool:
        nonlocal folded
        segs = files.segs.get(files.run_dir / "events" / f"writer={wid}", [])
        if any(_run_ends(p) for _, _, p in sorted(segs, key=lambda s: -s[1]) if str(p) in live):
            return True
        if folded is None:
            folded = set()
            for _, _, p in files.segs.get(files.run_dir / "events" / MERGED, []):
                if str(p) in live:
                    folded |= _run_ends(p, with_writer=True)
        return wid in folded
    return closed


def _run_ends(path: Path, with_writer: bool = False) -> set[str]:
    """The ``run_end`` rows of an events segment: {""} if any (or, with ``with_writer``, their writers' ids)."""
    try:
        t = pq.read_table(path, columns=["event", "fields_json"] if with_writer else ["event"])
    except (OSError, pa.ArrowException, KeyError):  # corrupt: a fold names it; here it only proves nothing
        return set()
    ends = t.filter(pc.equal(t.column("event"), "run_end"))
    if not with_writer:
        return {""} if ends.num_rows else set()
    out = set()
    for fields in ends.column("fields_json").to_pylist():
        try:
            out.add(str(json.loads(fields)["writer_id"]))
        except (TypeError, ValueError, KeyError):
            continue
    return out


def _flush_secs(beat: Path) -> float:
    try:
        return float(json.loads(beat.read_text(encoding="utf-8")).get("flush_secs", 2.0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 2.0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
