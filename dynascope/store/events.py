"""Writing analysis results back into a run as ``events`` rows: the one place the toolkit does that.

Analyses return frames and never write; the CLI (``dynascope report --write-events``) or a user passes a
frame of detected events here. Each row becomes one event with role ``analysis``; ``fields_json``
carries ``{"detector", "source", "value", "baseline", "robust_z"}``, and rows a previous call already
wrote for the same detector (same rank, step, event and source) are skipped, so writing is idempotent.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import polars as pl

from dynascope.core.clock import now_us
from dynascope.core.errors import StoreError
from dynascope.store.reader import open_store, quote_literal
from dynascope.store.writer import RunWriter

__all__ = ["write_detected_events"]

_NEEDED = ("run_id", "rank", "step", "event", "severity", "source", "message")


def _clean(v: Any) -> Any:
    """JSON has no NaN/Inf: keep them as strings."""
    return v if v is None or not isinstance(v, float) or math.isfinite(v) else str(v)


def write_detected_events(run_dir: str | os.PathLike, detected: pl.DataFrame, detector: str) -> int:
    """Append the rows of ``detected`` (one run's events, e.g. ``detect_instability``) to ``run_dir``'s
    ``events`` table; returns how many were new."""
    missing = [c for c in _NEEDED if c not in detected.columns]
    if missing:
        raise ValueError(f"detected events lack column(s) {', '.join(missing)}")
    if detected.is_empty():
        return 0
    if detected["run_id"].n_unique() > 1:
        raise StoreError("detected events come from several runs: write one run's events into its own directory")
    with open_store(run_dir) as target:
        done = set(target.rows(f"""
            SELECT rank, step, event, json_extract_string(fields_json, '$.source') FROM events
            WHERE json_extract_string(fields_json, '$.detector') = {quote_literal(detector)}"""))
    new = detected.filter([(r["rank"], r["step"], r["event"], r["source"]) not in done
                           for r in detected.iter_rows(named=True)])
    if new.is_empty():
        return 0
    fields = [json.dumps({"detector": detector, "source": r["source"],
                          **{k: _clean(r.get(k)) for k in ("value", "baseline", "robust_z")}})
              for r in new.iter_rows(named=True)]
    writer = RunWriter(run_dir, role="analysis")
    try:
        writer.append("events", {"rank": new["rank"].to_list(), "step": new["step"].to_list(), "time_us": now_us(),
                                 "event": new["event"].to_list(), "severity": new["severity"].to_list(),
                                 "message": new["message"].to_list(), "fields_json": fields})
    finally:
        writer.close()
    return new.height
