"""A record of one step's tensor statistics, and its rows: named parts in, ``tensor_stats`` columns out.

The training thread fills a ``Record`` with device results, one ``Part`` per statistic family (the
tracked tensors it covers, the column names of its values), packed into one float64 vector that is
copied to the host once. The resolver thread unpacks it by name and ``tensor_row`` types each row as
``store.schema``'s column registry declares: the live probe and ``dynascope diff`` both end there.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch

from dynascope.core.clock import now_us
from dynascope.probes.params import Tracked
from dynascope.probes.update_stats import DEFAULT_CHUNK_ELEMS
from dynascope.store.schema import TENSOR_STATS_COLUMNS

__all__ = ["Part", "Record", "rows_from_record", "rows_from_records", "summarize", "tensor_columns",
           "tensor_row"]


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


def tensor_columns(tracked: list[Tracked]) -> dict[str, Any]:
    """The per-tensor columns every record of ``tracked`` repeats (names, layer, kind, shape, dtype,
    sharded, numel). The probe builds them once per tracked list and hands the same lists to the writer at
    every record, so its string columns are converted once per flush (``store._columns`` dictionary-encodes
    a list it has seen by identity)."""
    return {"tensor": [t.name for t in tracked], "layer": [t.layer for t in tracked],
            "kind": [t.kind for t in tracked], "shape": [t.shape for t in tracked],
            "dtype": [t.dtype for t in tracked], "sharded": [t.sharded for t in tracked],
            "numel": np.array([int(t.local().numel()) for t in tracked], dtype=np.int64)}


def rows_from_record(rec: Record, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Columns of the ``tensor_stats`` rows of one record: ``rows_from_records([rec], meta)``."""
    return rows_from_records([rec], meta)


def rows_from_records(recs: list[Record], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Columns of the ``tensor_stats`` rows of records of one tracked list, record after record (runs on the
    resolver thread), as Arrow arrays typed by the registry (NULL where a tensor had no value), derived as
    ``tensor_row`` derives them. ``meta``: ``tensor_columns(tracked)``, when the caller keeps it.

    Vectorised over tensors and records: a Python loop over every tensor and column took ~4 ms per record
    of a 100-tensor model, on a thread that holds the GIL the training thread needs between its ops; and
    each column's derivation and Arrow conversion has a fixed cost (~45 columns, ~0.5 ms a record), which
    the resolver pays once for a batch of records instead of once per record.
    """
    if not recs or not recs[0].tracked:
        return {}
    n, r_count = len(recs[0].tracked), len(recs)
    total = n * r_count
    vals: dict[str, np.ndarray] = {}
    have: dict[str, np.ndarray] = {}

    def put(name: str, idx: np.ndarray, x: Any) -> None:
        if name not in vals:
            vals[name], have[name] = np.full(total, np.nan), np.zeros(total, dtype=bool)
        vals[name][idx] = x
        have[name][idx] = True

    for r, rec in enumerate(recs):
        if len(rec.tracked) != n:
            raise ValueError(f"records of different tracked lists in one batch ({len(rec.tracked)} != {n})")
        if rec.event is not None:
            rec.event.synchronize()  # the record's single device→host copy, waited for here
        arr = rec.host.numpy() if rec.host is not None else np.zeros(0)
        off = 0
        for key, part in rec.parts.items():
            size = len(part.rows) * len(part.columns)
            block = arr[off:off + size].reshape(len(part.rows), len(part.columns))
            off += size
            if not part.rows:  # a family that covered no tensor this record (e.g. drift outside its turn)
                continue
            idx = np.asarray(part.rows, dtype=np.int64) + r * n
            for j, c in enumerate(part.columns):
                put(c, idx, block[:, j])
            for c, x in rec.constants.get(key, {}).items():
                put(c, idx, x)
    meta = tensor_columns(recs[0].tracked) if meta is None else meta
    numel = meta["numel"] if r_count == 1 else np.tile(meta["numel"], r_count)
    if "ref_covered" not in vals:
        vals["ref_covered"] = have.get("drift_norm", np.zeros(total, dtype=bool)).astype(np.float64)
        have["ref_covered"] = np.ones(total, dtype=bool)
    # A finite norm proves there is no NaN/Inf element, so those counts are 0 without a pass over the data.
    for norm, counts in (("w_norm", ("w_nan_count", "w_inf_count")), ("grad_norm", ("grad_nan_count", "grad_inf_count"))):
        if norm in vals:
            finite = have[norm] & np.isfinite(vals[norm])
            for c in counts:
                put(c, np.flatnonzero(finite & ~have.get(c, np.zeros(total, dtype=bool))), 0.0)
    cols: dict[str, Any] = dict(meta) if r_count == 1 else _repeated(meta, r_count)
    # Only a few columns hold a value in most records (the window is often empty: ‖g‖ and the counts a
    # finite norm proves are all there is); a column whose sources are all unset is one shared NULL array.
    filled = {name: bool(h.any()) for name, h in have.items()}
    with np.errstate(divide="ignore", invalid="ignore"):
        for col in TENSOR_STATS_COLUMNS:
            if col.name in cols:
                continue
            if not all(filled.get(c, False) for c in _SOURCES[col.name]):
                cols[col.name] = _nulls(total, col.type)
                continue
            if col.frac_of is not None:
                x = vals[col.frac_of]
                ok = have[col.frac_of] & np.isfinite(x) & (numel != 0)
                v = x / np.where(numel != 0, numel, 1)
            elif col.ratio is not None:
                a, b = vals[col.ratio[0]], vals[col.ratio[1]]
                ok = have[col.ratio[0]] & have[col.ratio[1]] & (b != 0)
                v = a / np.where(ok, b, 1.0)
            else:
                v = vals[col.name]
                ok = have[col.name] & np.isfinite(v) if col.integer else have[col.name]
            if col.integer or pa.types.is_boolean(col.type):
                v = np.where(ok, v, 0).astype(np.int64 if col.integer else bool)
            cols[col.name] = pa.array(v, type=col.type, mask=None if ok.all() else ~ok)
    if r_count == 1:
        cols.update(step=recs[0].step, time_us=recs[0].time_us, stage=recs[0].stage)
        return cols
    cols["step"] = np.repeat(np.fromiter((rec.step for rec in recs), np.int64, r_count), n)
    cols["time_us"] = np.repeat(np.fromiter((rec.time_us for rec in recs), np.int64, r_count), n)
    stages = [rec.stage for rec in recs]
    cols["stage"] = stages[0] if stages.count(stages[0]) == r_count else _dictionary(stages, np.repeat(
        np.arange(r_count, dtype=np.int32), n))
    return cols


def _repeated(meta: dict[str, Any], times: int) -> dict[str, Any]:
    """``tensor_columns`` repeated for ``times`` records: strings as dictionary arrays over the one list of
    names (the writer stores them dictionary-encoded as they are), the rest tiled."""
    n = len(meta["numel"])
    tiled = np.tile(np.arange(n, dtype=np.int32), times)
    out: dict[str, Any] = {}
    for name, v in meta.items():
        if name in ("tensor", "kind", "shape", "dtype"):
            out[name] = _dictionary(v, tiled)
        elif name == "layer":  # NULL for tensors outside a numbered layer
            out[name] = pa.array(v, type=pa.int32()).take(pa.array(tiled))
        else:
            out[name] = np.tile(np.asarray(v), times)
    return out


def _dictionary(values: list[Any], indices: np.ndarray) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(indices, type=pa.int32()), pa.array(values, type=pa.string()))


# The statistics each column is derived from: its own value, the count of a fraction, the two of a ratio.
_SOURCES = {c.name: (c.frac_of,) if c.frac_of is not None else c.ratio if c.ratio is not None else (c.name,)
            for c in TENSOR_STATS_COLUMNS}


@functools.lru_cache(maxsize=64)
def _nulls(n: int, type_: pa.DataType) -> pa.Array:
    """An all-NULL column of ``n`` rows (Arrow arrays are immutable, so records share it)."""
    return pa.nulls(n, type_)


def summarize(cols: dict[str, Any]) -> dict[str, float]:
    """Compact per-record summary for listeners: global and per-kind means of the headline fractions."""
    out: dict[str, float] = {}
    kinds = cols.get("kind")
    if not kinds:
        return out
    k = np.array(kinds, dtype=object)
    groups = {kind: np.flatnonzero(k == kind) for kind in dict.fromkeys(kinds)}
    for key in ("update_ratio", "changed_frac", "bf16_unchanged_frac", "drift_changed_frac",
                "drift_unchanged_frac", "grad_zero_frac"):
        col = cols.get(key)
        if col is None or (isinstance(col, pa.Array) and col.null_count == len(col)):
            continue
        x = col.to_numpy(zero_copy_only=False) if isinstance(col, pa.Array) else np.array(col, dtype=np.float64)
        for kind, idx in (("", None), *groups.items()):
            v = x if idx is None else x[idx]
            v = v[np.isfinite(v)]  # NULL arrives as NaN; non-finite values are left out of the mean
            if v.size:
                out[f"{key}/{kind}" if kind else key] = float(v.mean())
    return out

