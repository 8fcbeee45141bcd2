"""A record of one step's tensor statistics, and its rows: named parts in, ``tensor_stats`` columns out.

The training thread fills a ``Record`` with device results, one ``Part`` per statistic family (the
tracked tensors it covers, the column names of its values), packed into one float64 vector that is
copied to the host once. The resolver thread unpacks it by name and ``tensor_row`` types each row as
``store.schema``'s column registry declares: the live probe and ``dynascope diff`` both end there.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

from dynascope.core.clock import now_us
from dynascope.probes.params import Tracked
from dynascope.probes.update_stats import DEFAULT_CHUNK_ELEMS
from dynascope.store.schema import TENSOR_STATS_COLUMNS

__all__ = ["Part", "Record", "rows_from_record", "summarize", "tensor_row"]


class Part(NamedTuple):
    """One statistic family's results in a record: ``columns`` per row, one row per tracked index in ``rows``."""

    columns: tuple[str, ...]
    rows: list[int]


class Record:
    """What the training thread hands to the resolver: one host vector plus the index bookkeeping."""

    def __init__(self, step: int, stage: str | None, tracked: list[Tracked]) -> None:
        self.step, self.stage, self.tracked = step, stage, tracked
        self.time_us = now_us()
        self.window: list[int] = []
        self.chunk_elems: int | None = DEFAULT_CHUNK_ELEMS
        self.parts: dict[str, Part] = {}
        self.values: dict[str, torch.Tensor] = {}  # device results, [len(rows), len(columns)] per part
        self.constants: dict[str, Any] = {}  # per-record values of the rows a part covers (bf16_k_steps)
        self.host: torch.Tensor | None = None
        self.event: Any = None

    def add(self, key: str, columns: tuple[str, ...], rows: list[int], values: torch.Tensor) -> None:
        self.parts[key] = Part(columns, rows)
        self.values[key] = values.reshape(len(rows), len(columns))


def _unpack(rec: Record) -> dict[int, dict[str, float]]:
    """Tracked index → {column: value} from the record's host vector (waits for the copy here)."""
    if rec.event is not None:
        rec.event.synchronize()
    arr = rec.host.numpy() if rec.host is not None else np.zeros(0)
    out: dict[int, dict[str, float]] = {i: {} for i in range(len(rec.tracked))}
    off = 0
    for key, part in rec.parts.items():
        size = len(part.rows) * len(part.columns)
        block = arr[off:off + size].reshape(len(part.rows), len(part.columns))
        off += size
        const = rec.constants.get(key, {})
        for r, i in enumerate(part.rows):
            out[i].update(zip(part.columns, block[r].tolist(), strict=True))
            out[i].update(const)
    return out


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def tensor_row(values: dict[str, Any], numel: int) -> dict[str, Any]:
    """One ``tensor_stats`` row from the named statistics of one tensor, as the registry types them:
    counts become ints (NaN, i.e. undefined, becomes NULL), fractions ``count / numel`` and ratios are
    derived, and a column with no value is NULL. Shared by the live probe and ``dynascope diff``."""
    v = dict(values, numel=numel)
    v.setdefault("ref_covered", "drift_norm" in v)
    # A finite norm proves there is no NaN/Inf element, so those counts are 0 without a pass over the data.
    for norm, counts in (("w_norm", ("w_nan_count", "w_inf_count")), ("grad_norm", ("grad_nan_count", "grad_inf_count"))):
        if v.get(norm) is not None and math.isfinite(v[norm]):
            for c in counts:
                v.setdefault(c, 0)
    row: dict[str, Any] = {}
    for col in TENSOR_STATS_COLUMNS:
        if col.frac_of is not None:
            x = _finite_or_none(v.get(col.frac_of))
            row[col.name] = None if x is None or numel == 0 else x / numel
        elif col.ratio is not None:
            a, b = v.get(col.ratio[0]), v.get(col.ratio[1])
            row[col.name] = None if a is None or b is None or b == 0 else a / b
        elif col.integer:
            x = _finite_or_none(v.get(col.name))
            row[col.name] = None if x is None else int(x)
        else:
            row[col.name] = v.get(col.name)
    return row


def rows_from_record(rec: Record) -> dict[str, list]:
    """Columns of the ``tensor_stats`` rows of one record (runs on the resolver thread)."""
    values = _unpack(rec)
    cols: dict[str, list] = {}
    for i, t in enumerate(rec.tracked):
        v = values[i]
        v.update(tensor=t.name, layer=t.layer, kind=t.kind, shape=t.shape, dtype=t.dtype, sharded=t.sharded)
        for name, val in tensor_row(v, int(t.local().numel())).items():
            cols.setdefault(name, []).append(val)
    if rec.tracked:
        cols.update(step=rec.step, time_us=rec.time_us, stage=rec.stage)
    return cols


def summarize(cols: dict[str, list]) -> dict[str, float]:
    """Compact per-record summary for listeners: global and per-kind means of the headline fractions."""
    out: dict[str, float] = {}
    kinds = cols.get("kind", [])
    for key in ("update_ratio", "changed_frac", "bf16_unchanged_frac", "drift_changed_frac",
                "drift_unchanged_frac", "grad_zero_frac"):
        vals = cols.get(key, [])
        by_kind: dict[str, list[float]] = {}
        for kind, v in zip(kinds, vals, strict=False):
            if v is not None and math.isfinite(v):
                by_kind.setdefault(kind, []).append(v)
                by_kind.setdefault("", []).append(v)
        for kind, vs in by_kind.items():
            out[f"{key}/{kind}" if kind else key] = float(sum(vs) / len(vs))
    return out
