"""Rollups the writer keeps beside a table, so the heaviest charts never scan every row.

``tensor_stats`` holds one row per tensor per step per rank: 50M rows for a 500-tensor model on 4 ranks
over 25k steps. A per-step, per-kind series over it is a 250k-group hash aggregate that no layout makes
sub-second on 2 cores. ``tensor_stats_by_kind`` holds the same steps pooled per (step, rank, stage, kind):
sums of squares and counts, each beside the element count it is out of, so any ratio the dashboard draws
(‖ΔW‖/‖W‖ = √Σdw² / √Σw², changed fraction = Σchanged / Σnumel) pools exactly across tensors and ranks.

The layer × step heat maps need the layer, and a real model has about one tensor per (layer, kind), so
no per-step rollup shrinks them. ``tensor_stats_by_layer`` pools blocks of ``ROLLUP_BLOCK_STEPS`` steps
per (rank, stage, kind, layer) instead: a heat map whose step buckets are whole blocks reads 16× fewer
rows. Sums are additive, so a block split across two flushes is two rows that a query sums.

The writer computes both from each tensor_stats segment it writes, on its own thread, with NumPy
group-bys; the rollup segments follow their source in the same flush.

Each rollup row also says how its rank held the rows it pools (``holds``: ``shard``, ``replica`` of a
shard, or ``whole`` tensors) and which process wrote them (``generation``), so that pooling rollup rows
across ranks follows the canonical view's rule (``store.pooling.counted_rollup_sql``): an HSDP replica's or
a DDP copy's sums must not add to the shards', and a replayed step counts its latest process only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dynascope.store.pooling import holds_of
from dynascope.store.schema import POOLED, ROLLUP_BLOCK_STEPS, TABLES

_KIND_KEYS = ["run_id", "rank", "role", "step", "stage", "kind", "holds", "generation"]
_LAYER_KEYS = [*_KIND_KEYS, "layer"]


def _codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, pa.Array]:
    """Integer codes of a key column (null is a value of its own) and the distinct values they index."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_dictionary(col.type):  # the writer's strings: re-encode so null gets a code too
        col = col.cast(col.type.value_type)
    enc = pc.dictionary_encode(col, null_encoding="encode")
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64), enc.dictionary


def _numbers(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray] | None:
    """(values as float64 with nulls as 0, validity mask), or None when every value is NULL (most of a
    flush's update and drift columns: the rotating window covers few of its rows)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if arr.null_count == len(arr):
        return None
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    return arr.fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64), valid


Numbers = dict[str, "tuple[np.ndarray, np.ndarray] | None"]


def _with_holds(t: pa.Table) -> pa.Table:
    """``t`` with ``holds`` (``store.pooling.holds_of`` per row) and ``generation`` (NULL where absent)."""
    n = t.num_rows
    sharded = t["sharded"].to_pylist() if "sharded" in t.column_names else [None] * n
    replica = t["replica"].to_pylist() if "replica" in t.column_names else [None] * n
    t = t.append_column("holds", pa.array([holds_of(s, r) for s, r in zip(sharded, replica, strict=True)],
                                          pa.string()))
    return t if "generation" in t.column_names else t.append_column("generation", pa.nulls(n, pa.int64()))


def tensor_stats_by_kind(t: pa.Table, numbers: Numbers | None = None) -> pa.Table:
    """Pool a tensor_stats table per (run_id, rank, role, step, stage, kind, holds, generation); schema
    ``tensor_stats_by_kind``. ``numbers``: a dict the rollups of one table share, so each source column is
    converted once."""
    return _pool(_with_holds(t), _KIND_KEYS, TABLES["tensor_stats_by_kind"], numbers)


def tensor_stats_by_layer(t: pa.Table, numbers: Numbers | None = None) -> pa.Table:
    """Pool a tensor_stats table per (run_id, rank, role, step block, stage, kind, layer); schema
    ``tensor_stats_by_layer``, whose ``step`` is the first step of a block of ``ROLLUP_BLOCK_STEPS``."""
    if t.num_rows:
        step = t["step"]  # block start; integer division on non-negative steps (nulls stay null)
        block = pc.multiply(pc.divide(step, pa.scalar(ROLLUP_BLOCK_STEPS, step.type)),
                            pa.scalar(ROLLUP_BLOCK_STEPS, step.type))
        t = t.set_column(t.schema.get_field_index("step"), "step", block)
    return _pool(_with_holds(t), _LAYER_KEYS, TABLES["tensor_stats_by_layer"], numbers)


def _pool(t: pa.Table, keys: list[str], schema: pa.Schema, numbers: Numbers | None = None) -> pa.Table:
    """Sums of ``t``'s statistics per distinct ``keys``, as ``schema``.

    NumPy, not ``Table.group_by``: that loads Arrow's Acero engine, ~6 MiB of resident memory in every
    training process for a group-by of a few thousand rows. Sums follow SQL: NULLs are skipped, and a
    group with no value is NULL.
    """
    if t.num_rows == 0:
        return pa.Table.from_batches([], schema=schema)  # schema.empty_table() would import pandas
    codes, values = zip(*(_codes(t[k]) for k in keys), strict=True)
    flat = np.ravel_multi_index(codes, [max(len(v), 1) for v in values])
    uniq, group = np.unique(flat, return_inverse=True)
    n = len(uniq)
    out: dict[str, pa.Array] = {k: v.take(pa.array(c)) for k, v, c in
                                zip(keys, values, np.unravel_index(uniq, [max(len(v), 1) for v in values]),
                                    strict=True)}
    numbers = {} if numbers is None else numbers
    present = set(t.column_names)

    def column(name: str) -> tuple[np.ndarray, np.ndarray] | None:
        if name not in numbers:  # a column an older segment lacks is NULL throughout
            numbers[name] = _numbers(t[name]) if name in present else None
        return numbers[name]

    def total(x: np.ndarray, valid: np.ndarray, typ: pa.DataType) -> pa.Array:
        sums = np.bincount(group, weights=np.where(valid, x, 0.0), minlength=n)
        return pa.array(sums if pa.types.is_floating(typ) else sums.round().astype(np.int64), type=typ,
                        mask=np.bincount(group, weights=valid, minlength=n) == 0)

    def peak(x: np.ndarray, valid: np.ndarray, typ: pa.DataType) -> pa.Array:
        best = np.full(n, -np.inf)
        np.maximum.at(best, group[valid], x[valid])
        return pa.array(best, mask=np.bincount(group, weights=valid, minlength=n) == 0).cast(typ)

    # Each pooled column as the registry declares it (store.schema.POOLED): Σx², Σx, max, or the Σnumel a
    # count is out of (over the rows where that count, or the column named by ``where``, is not NULL).
    types = {f.name: f.type for f in schema}
    stamp = column("time_us")
    out["time_us"] = pa.nulls(n, types["time_us"]) if stamp is None else peak(*stamp, types["time_us"])
    out["tensors"] = pa.array(np.bincount(group, minlength=n), type=types["tensors"])
    numel = column("numel")
    for name, how, src, where in POOLED:
        got, cond = column(src), column(where) if where is not None else None
        if got is None or (where is not None and cond is None) or (how == "numel" and numel is None):
            out[name] = pa.nulls(n, types[name])
            continue
        x, ok = got
        if cond is not None:
            ok = ok & cond[1]
        if how == "sq":
            out[name] = total(x ** 2, ok, types[name])
        elif how == "sum":
            out[name] = total(x, ok, types[name])
        elif how == "max":
            out[name] = peak(x, ok, types[name])
        else:  # "numel"
            assert numel is not None
            out[name] = total(numel[0], numel[1] & ok, types[name])
    return pa.table([out[f.name] if out[f.name].type == f.type else out[f.name].cast(f.type) for f in schema],
                    schema=schema)


# source table -> its rollups (table, how to make it); the writer writes each rollup of every source segment.
ROLLUPS: dict[str, tuple[tuple[str, Callable[..., pa.Table]], ...]] = {
    "tensor_stats": (("tensor_stats_by_kind", tensor_stats_by_kind), ("tensor_stats_by_layer", tensor_stats_by_layer)),
}
ROLLUP_TABLES = frozenset(name for rolls in ROLLUPS.values() for name, _ in rolls)
