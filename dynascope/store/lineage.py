"""A run's process lineage: whether a writer opening a run is a restart of a rank that wrote it before.

A rank's writer leaves its heartbeat (``_writers/<writer_id>.json``, named ``r<rank>-<role>-…``) for the
life of the run. A new writer that finds one of its own rank and role is a second process of that rank:
a restart, a resume from a checkpoint, or a run directory reused by accident. Its rows carry a later
``generation`` (its start), so the steps it replays count from it (``store.pooling``); it records a
``restart`` event and says so once. Heartbeats only are listed (one directory, no table scan), so a
writer's start stays cheap at any number of ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dynascope.core.warn import warn
from dynascope.store.layout import HEARTBEATS, safe_id

__all__ = ["earlier_writers", "note_restart"]


def earlier_writers(run_dir: Path, rank: int, role: str, writer_id: str) -> list[str]:
    """Ids of the writers of this rank and role that wrote ``run_dir`` before this one (oldest first)."""
    prefix = safe_id(f"r{rank}-{role}") + "-"
    try:
        beats = [p for p in (run_dir / HEARTBEATS).glob(f"{prefix}*.json") if p.stem != writer_id]
    except OSError:
        return []
    found = []
    for p in beats:
        try:  # the prefix could also match a role that extends this one ("r0-trainer-x-…"): check it
            meta = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(meta, dict) and meta.get("rank") == rank and meta.get("role") == role:
            found.append((p.stat().st_mtime, p.stem))
    return [w for _, w in sorted(found)]


def note_restart(writer: Any) -> None:
    """Where ``writer`` (a ``RunWriter`` joining an existing run) is a second process of its rank: one
    warning and a ``restart`` event (its generation, the process before it, how many came before)."""
    earlier = earlier_writers(writer.run_dir, writer.rank, writer.role, writer.writer_id)
    writer.restarted = bool(earlier)
    if not earlier:
        return
    message = (f"{writer.run_dir} already holds rank {writer.rank} ({writer.role}) of an earlier process "
               f"({len(earlier)} before this one): recording as a restart; the steps this process records "
               "again replace that process's rows in tensor_stats_global. Pass a new run directory to start "
               "a separate run.")
    warn(f"dynascope: {message}", RuntimeWarning, stacklevel=4)
    writer.event("restart", message, severity="warning", generation=writer.generation, previous=earlier[-1],
                 processes=len(earlier))
