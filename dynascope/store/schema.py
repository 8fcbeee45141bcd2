"""Schema v3 of the dynascope store: one Arrow schema per table, long format, typed columns.

Every table carries ``run_id``; per-step tables carry ``step`` and ``rank``; rows that happen at a
moment carry ``time_us`` (wall clock, µs since the epoch). Units live in column names.
"""

from __future__ import annotations

import pyarrow as pa

from dynascope.stats.base import Column, Figure
from dynascope.stats.registry import REGISTRY

__all__ = ["COLUMN", "FIGURES", "POOLED", "RENAMED", "ROLLUP_BLOCK_STEPS", "SCHEMA_VERSION", "TABLES", "TABLE_NAMES",
           "TENSOR_STATS_COLUMNS", "Column", "Figure", "sql_type"]

SCHEMA_VERSION = 3

# Columns renamed since an earlier schema, per table: {new name: old name}. Readers map the old name onto
# the new one, so runs written with schema v1 still open. v2 gave each quantity one word: "update" is the
# per-step ΔW = W_t − W_{t−1}, "drift" is W_t − W₀, counts end in _count, and an event's type is `event`
# (`kind` is only ever a tensor's module kind). v3 named the η-relative change measure for what it is,
# `changed_rel_*` (|ΔW| > η·max|W|), where `changed_bf16_*` read as the bf16-cast comparison, which is
# PULSE's `bf16_unchanged_*`.
_V1_POOLED = {"update_sq": "dw_sq", "w_nan_count": "w_nan", "w_inf_count": "w_inf",
              "grad_nan_count": "grad_nan", "grad_inf_count": "grad_inf",
              "changed_rel_count": "changed_bf16_count", "changed_rel_numel": "changed_bf16_numel"}
RENAMED: dict[str, dict[str, str]] = {
    "tensor_stats": {"update_norm": "dw_norm", "w_nan_count": "w_nan", "w_inf_count": "w_inf",
                     "grad_nan_count": "grad_nan", "grad_inf_count": "grad_inf",
                     "changed_rel_count": "changed_bf16_count", "changed_rel_frac": "changed_bf16_frac",
                     "drift_changed_rel_count": "drift_changed_bf16_count",
                     "drift_changed_rel_frac": "drift_changed_bf16_frac"},
    "tensor_stats_by_kind": _V1_POOLED,
    "tensor_stats_by_layer": _V1_POOLED,
    "spectra": {"drift_norm": "dw_fro"},
    "events": {"event": "kind"},
}

_f64, _i64, _i32, _str, _bool = pa.float64(), pa.int64(), pa.int32(), pa.string(), pa.bool_()

# Per-tensor columns of tensor_stats, after the (run_id, rank, role, step, time_us, stage) every row has:
# the tensor's description, then every declared statistic's columns (dynascope.stats: one declaration per
# statistic, with its type, unit, cross-rank reduction, derivation and rollup pools). Under FSDP/DTensor
# a row describes the local shard: numel is the shard's element count.
TENSOR_STATS_COLUMNS: tuple[Column, ...] = REGISTRY.columns
COLUMN = {c.name: c for c in TENSOR_STATS_COLUMNS}

# Pooled columns of the tensor_stats rollups, from the registry: sums of squares and counts, each count
# beside the element count it is out of, so a ratio over any set of rows is Σ/Σ. ``tensors`` counts rows.
POOLED: tuple[tuple[str, str, str, str | None], ...] = REGISTRY.pooled  # (rollup column, how, source, where)
_POOLED = [("tensors", _i64)] + [
    (name, _i64 if how == "numel" or (how == "sum" and COLUMN[src].integer) else
     (COLUMN[src].type if how == "max" and COLUMN[src].integer else _f64)) for name, how, src, _ in POOLED]
# Figures pooled from the rollups' columns (Σnum / Σden), as the statistics declare them: the dashboard's.
FIGURES = REGISTRY.figures
# Steps per row of tensor_stats_by_layer (blocks start at multiples of it).
ROLLUP_BLOCK_STEPS = 16

TABLES: dict[str, pa.Schema] = {
    "runs": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("name", _str), ("start_us", _i64), ("host", _str), ("world_size", _i32),
        ("framework", _str), ("config_json", _str), ("dynascope_version", _str), ("schema_version", _i32),
    ]),
    # One row per tensor per recorded step per rank. Under FSDP/DTensor a row describes the local shard:
    # numel is the shard's element count and the *_sq / *_count columns combine exactly across ranks.
    # ``generation``: when the writing process started (µs since the epoch): a rank restarted from a
    # checkpoint writes its replayed steps again under a later one, and the latest counts (store.pooling).
    "tensor_stats": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("step", _i64), ("time_us", _i64), ("stage", _str),
        *[(c.name, c.type) for c in TENSOR_STATS_COLUMNS], ("generation", _i64),
    ]),
    # Rollups of tensor_stats that the writer keeps beside it (dynascope/store/rollup.py), each with sums
    # that pool exactly (Σ‖·‖², counts and the numel they are out of). Each tensor_stats segment gets one of
    # each. by_kind: one row per (step, rank, stage, kind), for per-step series (~tensors-per-kind times
    # fewer rows). by_layer: one row per (block of ROLLUP_BLOCK_STEPS steps, rank, stage, kind, layer), for
    # layer × step heat maps whose step buckets are whole blocks; ``step`` is the block's first step, and a
    # block that two flushes split has a row from each (sum them). ``holds`` (shard | replica | whole) and
    # ``generation`` say how the rank held those rows and which process wrote them: pool rollup rows across
    # ranks through store.pooling.counted_rollup_sql, which applies the canonical view's rule to them.
    "tensor_stats_by_kind": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("step", _i64), ("time_us", _i64), ("stage", _str), ("kind", _str), *_POOLED,
        ("holds", _str), ("generation", _i64),
    ]),
    "tensor_stats_by_layer": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("step", _i64), ("time_us", _i64), ("stage", _str), ("kind", _str), ("layer", _i32), *_POOLED,
        ("holds", _str), ("generation", _i64),
    ]),
    # Written by compaction once a run's writers are done (dynascope/store/rollup_across.py): one row per
    # (step, tensor): the canonical row (tensor_stats_global) as the pooled sums of the rollups above
    # (``tensors``: the tensor_stats rows it stands for), plus what the delta-sync pricing needs (rows
    # with S₁, Σnumel beside drift_zero_count, ⌈numel/8⌉ bitmap bytes).
    "tensor_stats_by_tensor": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str), ("step", _i64), ("time_us", _i64), ("stage", _str),
        ("tensor", _str), ("layer", _i32), ("kind", _str), ("dtype", _str), ("sharded", _bool), *_POOLED,
        ("bf16_rows", _i64), ("drift_zero_numel", _i64), ("bitmap_bytes", _i64),
    ]),
    # Low-rank summary of the cumulative ΔW = W_t − W_0 for one 2-D tensor at one record.
    "spectra": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("step", _i64), ("time_us", _i64), ("stage", _str),
        ("tensor", _str), ("layer", _i32), ("kind", _str), ("rows", _i64), ("cols", _i64), ("k", _i32),
        ("drift_norm", _f64), ("sigma", pa.list_(_f64)),
        ("rank1_energy", _f64), ("topk_energy", _f64), ("stable_rank", _f64), ("effective_rank", _f64),
        ("u1", pa.list_(pa.float32())), ("v1", pa.list_(pa.float32())),
        ("angle_left_deg", _f64), ("angle_right_deg", _f64),
        ("off_principal_energy", _f64), ("spectral_drift", _f64), ("compute_ms", _f64),
    ]),
    "timings": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("step", _i64), ("phase", _str), ("parent", _str),
        ("start_us", _i64), ("dur_us", _i64), ("device", _str),
        ("category", _str),  # step | phase | wait | comm (probes); kernel | memcpy | comm | annotation | cpu_op (traces)
        ("stream", _i64),
        # Exact times of imported profiler traces (ns-resolution Kineto traces); NULL for probe rows.
        ("start_ns", _i64), ("dur_ns", _i64),
        # Which clock dur_us comes from: "cuda_event" (device time between two events on the stream the
        # phase ran on) or "host" (perf_counter); start_us is the host wall clock either way. NULL: imported.
        ("clock", _str),
    ]),
    "samples": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("step", _i64), ("time_us", _i64),
        ("sample_id", _i64), ("group_id", _i64), ("prompt_len", _i32), ("response_len", _i32),
        ("reward", _f64), ("gen_start_us", _i64), ("gen_end_us", _i64), ("gen_ms", _f64),
        ("policy_version", _i64), ("trainer_version", _i64),
        # Trainer↔rollout log-prob gap |log π_rollout − log π_trainer| over the sample's tokens
        # (probes.rollout_consistency.logprob_gap_columns): tokens compared, Σ|Δ|, max |Δ|, tokens over the threshold,
        # tokens whose importance ratio exp(Δ) lies outside [0.9, 1.1].
        ("logprob_gap_tokens_count", _i64), ("logprob_gap_sum_nats", _f64), ("logprob_gap_max_nats", _f64),
        ("logprob_gap_over_count", _i64), ("logprob_gap_threshold_nats", _f64), ("logprob_ratio_outside_count", _i64),
    ]),
    "scalars": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("step", _i64), ("time_us", _i64), ("stage", _str), ("key", _str), ("value", _f64),
    ]),
    "events": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("step", _i64), ("time_us", _i64), ("event", _str), ("severity", _str),
        ("message", _str), ("dur_us", _i64), ("fields_json", _str),
    ]),
    "system": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("time_us", _i64), ("device", _str),
        ("gpu_util_pct", _f64), ("mem_used_bytes", _i64), ("mem_total_bytes", _i64),
        ("power_w", _f64), ("temp_c", _f64), ("sm_clock_mhz", _f64),
        ("cpu_pct", _f64), ("rss_bytes", _i64),
    ]),
}

TABLE_NAMES = tuple(TABLES)


def sql_type(t: pa.DataType) -> str:
    """The DuckDB type of a schema column's Arrow type."""
    if pa.types.is_list(t):
        return sql_type(t.value_type) + "[]"
    return {pa.int64(): "BIGINT", pa.int32(): "INTEGER", pa.float64(): "DOUBLE", pa.float32(): "FLOAT",
            pa.string(): "VARCHAR", pa.bool_(): "BOOLEAN"}[t]
