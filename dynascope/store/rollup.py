"""Rollups the writer keeps beside a table, so the heaviest per-step charts never scan every row.

``tensor_stats`` holds one row per tensor per step per rank: 50M rows for a 500-tensor model on 4 ranks
over 25k steps. A per-step, per-kind series over it is a 250k-group hash aggregate that no layout makes
sub-second on 2 cores. ``tensor_stats_by_kind`` holds the same steps pooled per (step, rank, stage, kind):
sums of squares and counts, each beside the element count it is out of, so any ratio the dashboard draws
(‖ΔW‖/‖W‖ = √Σdw² / √Σw², changed fraction = Σchanged / Σnumel) pools exactly across tensors and ranks.

The writer computes it from each tensor_stats segment it writes, on its own thread, with one Arrow
group-by; the rollup segment follows its source in the same flush.
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

from dynascope.store.schema import TABLES

_KEYS = ["run_id", "rank", "role", "step", "stage", "kind"]


def _square(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    return pc.multiply(col, col)


def _where_valid(col: pa.ChunkedArray | pa.Array, value: pa.ChunkedArray | pa.Array) -> pa.Array:
    """``value`` where ``col`` is not null, else null: the element count a nullable count is out of."""
    return pc.if_else(pc.is_valid(col), value, pa.scalar(None, value.type))


def tensor_stats_by_kind(t: pa.Table) -> pa.Table:
    """Pool a tensor_stats table per (run_id, rank, role, step, stage, kind); schema ``tensor_stats_by_kind``."""
    schema = TABLES["tensor_stats_by_kind"]
    if t.num_rows == 0:
        return pa.Table.from_batches([], schema=schema)  # schema.empty_table() would import pandas
    # Group keys must be plain (dictionary keys would group fine but make the output schema differ).
    keys = {k: (t[k].cast(pa.string()) if pa.types.is_dictionary(t[k].type) else t[k]) for k in _KEYS}
    numel = t["numel"]
    derived = {
        **keys,
        "time_us": t["time_us"], "numel": numel,
        "w_sq": _square(t["w_norm"]), "dw_sq": _square(t["dw_norm"]), "update_ratio": t["update_ratio"],
        "changed_count": t["changed_count"], "changed_numel": _where_valid(t["changed_count"], numel),
        "changed_bf16_count": t["changed_bf16_count"],
        "changed_bf16_numel": _where_valid(t["changed_bf16_count"], numel),
        "sign_flip_count": t["sign_flip_count"], "w_nan": t["w_nan"], "w_inf": t["w_inf"],
        "drift_sq": _square(t["drift_norm"]),
        "drift_w_sq": _where_valid(t["drift_norm"], _square(t["w_norm"])),
        "drift_changed_count": t["drift_changed_count"],
        "drift_numel": _where_valid(t["drift_norm"], numel),
        "grad_sq": _square(t["grad_norm"]), "grad_max_abs": t["grad_max_abs"],
        "grad_zero_count": t["grad_zero_count"], "grad_near_zero_count": t["grad_near_zero_count"],
        "grad_numel": _where_valid(t["grad_zero_count"], numel), "grad_nan": t["grad_nan"], "grad_inf": t["grad_inf"],
    }
    aggs = [("time_us", "max"), ([], "count_all"), ("update_ratio", "max"), ("grad_max_abs", "max")]
    aggs += [(c, "sum") for c in derived if c not in _KEYS and c not in ("time_us", "update_ratio", "grad_max_abs")]
    out = pa.table(derived).group_by(_KEYS, use_threads=False).aggregate(aggs)
    rename = {"time_us_max": "time_us", "count_all": "tensors", "grad_max_abs_max": "grad_max_abs"}
    out = out.rename_columns([rename.get(c, c.removesuffix("_sum")) for c in out.column_names])
    return pa.table([out[f.name].cast(f.type) for f in schema], schema=schema)


# source table -> (rollup table, how to make it); the writer writes the rollup of every segment of the source.
ROLLUPS: dict[str, tuple[str, Callable[[pa.Table], pa.Table]]] = {
    "tensor_stats": ("tensor_stats_by_kind", tensor_stats_by_kind),
}
ROLLUP_TABLES = frozenset(name for name, _ in ROLLUPS.values())
