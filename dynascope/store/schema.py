"""Schema v3 of the dynascope store: one Arrow schema per table, long format, typed columns.

Every table carries ``run_id``; per-step tables carry ``step`` and ``rank``; rows that happen at a
moment carry ``time_us`` (wall clock, µs since the epoch). Units live in column names.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

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


@dataclass(frozen=True)
class Column:
    """One ``tensor_stats`` column, declared once: type, unit, how it combines across ranks, how it pools.

    ``reduce``: how the values of one tensor's shards (FSDP/DTensor, one row per rank) combine into the
    whole tensor's value, torchmetrics' ``dist_reduce_fx``: "sum", "norm" (root of the summed squares),
    "max", "all" (booleans), "first" (metadata every shard shares); None for keys and derived columns.
    A derived column is re-computed from combined states, never combined itself: ``frac_of`` (that count
    over ``numel``) or ``ratio`` (numerator, denominator). ``pool``: the rollup columns this one feeds,
    as (rollup column, how, where): "sq" Σx², "sum" Σx, "max", "numel" Σnumel over rows where ``where``
    (default: this column) is not NULL, so every count pools beside the element count it is out of.
    """

    name: str
    type: pa.DataType
    unit: str = ""  # "elements", "steps"; "" for norms, ratios and fractions (dimensionless or the weights' unit)
    reduce: str | None = None
    frac_of: str | None = None
    ratio: tuple[str, str] | None = None
    pool: tuple[tuple[str, str, str | None], ...] = ()
    doc: str = ""

    @property
    def integer(self) -> bool:
        return pa.types.is_integer(self.type)


def _count(name: str, doc: str, numel: str | None = None) -> Column:
    """An element count that sums across shards and pools as a sum (and, with ``numel``, beside its Σnumel)."""
    pool = ((name, "sum", None),) + (((numel, "numel", None),) if numel else ())
    return Column(name, _i64, "elements", "sum", pool=pool, doc=doc)


def _frac(count: str) -> Column:
    return Column(count.removesuffix("_count") + "_frac", _f64, frac_of=count, doc=f"{count} / numel")


# Per-tensor columns of tensor_stats, after the (run_id, rank, role, step, time_us, stage) every row has.
# Under FSDP/DTensor a row describes the local shard: numel is the shard's element count.
TENSOR_STATS_COLUMNS: tuple[Column, ...] = (
    Column("tensor", _str, doc="parameter name, wrapper prefixes removed (core.naming.normalize_name)"),
    Column("layer", _i32, reduce="first"), Column("kind", _str, reduce="first"),
    Column("shape", _str, reduce="first"), Column("dtype", _str, reduce="first"),
    Column("numel", _i64, "elements", "sum", pool=(("numel", "sum", None),)),
    Column("sharded", _bool),
    # weights and the step update ΔW = W_t − W_{t−1}
    Column("w_norm", _f64, reduce="norm", pool=(("w_sq", "sq", None), ("update_w_sq", "sq", "update_norm"),
                                                ("drift_w_sq", "sq", "drift_norm")), doc="‖W_t‖"),
    Column("update_norm", _f64, reduce="norm", pool=(("update_sq", "sq", None),), doc="‖W_t − W_{t−1}‖"),
    Column("update_ratio", _f64, ratio=("update_norm", "w_norm"), pool=(("update_ratio_max", "max", None),)),
    _count("changed_count", "bits differ in the parameter's dtype", "changed_numel"), _frac("changed_count"),
    _count("changed_rel_count", "|ΔW| > η·max(|W_t|, |W_{t−1}|), η = 1e-3", "changed_rel_numel"),
    _frac("changed_rel_count"),
    _count("sign_flip_count", "sign(W_t)·sign(W_{t−1}) < 0"), _frac("sign_flip_count"),
    _count("bf16_unchanged_count", "PULSE S₁: bf16(W_t) bitwise equal to bf16(W_{t−1})", "bf16_unchanged_numel"),
    _frac("bf16_unchanged_count"),
    _count("bf16_unchanged_k_count", "PULSE S_k: bf16(W_t) bitwise equal to bf16(W_{t−k})", "bf16_unchanged_k_numel"),
    _frac("bf16_unchanged_k_count"),
    Column("bf16_k_steps", _i32, "steps", "first", pool=(("bf16_k_steps", "max", None),), doc="k of S_k"),
    _count("w_nan_count", "NaN elements of W_t"), _count("w_inf_count", "±Inf elements of W_t"),
    # drift against the reference weights θ₀ (null when this tensor's θ₀ is not held)
    Column("ref_covered", _bool, reduce="all"),
    Column("drift_norm", _f64, reduce="norm", pool=(("drift_sq", "sq", None), ("drift_numel", "numel", None)),
           doc="‖W_t − W₀‖"),
    Column("drift_ratio", _f64, ratio=("drift_norm", "ref_norm"), doc="‖W_t − W₀‖ / ‖W₀‖"),
    _count("drift_changed_count", "bits of W_t and W₀ differ"), _frac("drift_changed_count"),
    _count("drift_changed_rel_count", "|W_t − W₀| > η·max(|W_t|, |W₀|)"), _frac("drift_changed_rel_count"),
    _count("drift_unchanged_count", "Mukherjee et al.: isclose(bf16(W_t) − bf16(W₀), 0, atol=1e-5)"),
    _frac("drift_unchanged_count"),
    _count("drift_zero_count", "bf16(W_t) − bf16(W₀) == 0"), _frac("drift_zero_count"),
    # gradient at the step (null when the param had no grad)
    Column("grad_norm", _f64, reduce="norm", pool=(("grad_sq", "sq", None),)),
    _count("grad_zero_count", "g == 0", "grad_numel"), _frac("grad_zero_count"),
    _count("grad_near_zero_count", "|g| ≤ tol·rms(g) of this shard"), _frac("grad_near_zero_count"),
    Column("grad_max_abs", _f64, reduce="max", pool=(("grad_max_abs", "max", None),)),
    _count("grad_nan_count", "NaN elements of g"), _count("grad_inf_count", "±Inf elements of g"),
)
COLUMN = {c.name: c for c in TENSOR_STATS_COLUMNS}

# Pooled columns of the tensor_stats rollups, from the registry: sums of squares and counts, each count
# beside the element count it is out of, so a ratio over any set of rows is Σ/Σ. ``tensors`` counts rows.
POOLED: tuple[tuple[str, str, str, str | None], ...] = tuple(  # (rollup column, how, source column, where)
    (name, how, c.name, where) for c in TENSOR_STATS_COLUMNS for name, how, where in c.pool)
_POOLED = [("tensors", _i64)] + [
    (name, _i64 if how == "numel" or (how == "sum" and COLUMN[src].integer) else
     (COLUMN[src].type if how == "max" and COLUMN[src].integer else _f64)) for name, how, src, _ in POOLED]
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
    "tensor_stats": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("step", _i64), ("time_us", _i64), ("stage", _str),
        *[(c.name, c.type) for c in TENSOR_STATS_COLUMNS],
    ]),
    # Rollups of tensor_stats that the writer keeps beside it (dynascope/store/rollup.py), each with sums
    # that pool exactly (Σ‖·‖², counts and the numel they are out of). Each tensor_stats segment gets one of
    # each. by_kind: one row per (step, rank, stage, kind), for per-step series (~tensors-per-kind times
    # fewer rows). by_layer: one row per (block of ROLLUP_BLOCK_STEPS steps, rank, stage, kind, layer), for
    # layer × step heat maps whose step buckets are whole blocks; ``step`` is the block's first step, and a
    # block that two flushes split has a row from each (sum them).
    "tensor_stats_by_kind": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("step", _i64), ("time_us", _i64), ("stage", _str), ("kind", _str), *_POOLED,
    ]),
    "tensor_stats_by_layer": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("step", _i64), ("time_us", _i64), ("stage", _str), ("kind", _str), ("layer", _i32), *_POOLED,
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
    ]),
    "samples": pa.schema([
        ("run_id", _str), ("rank", _i32), ("role", _str),
        ("step", _i64), ("time_us", _i64),
        ("sample_id", _i64), ("group_id", _i64), ("prompt_len", _i32), ("response_len", _i32),
        ("reward", _f64), ("gen_start_us", _i64), ("gen_end_us", _i64), ("gen_ms", _f64),
        ("policy_version", _i64), ("trainer_version", _i64),
        # Trainer↔rollout log-prob gap |log π_rollout − log π_trainer| over the sample's tokens
        # (probes.rollout_consistency.logprob_gap_columns): tokens compared, Σ|Δ|, max |Δ|, tokens over the threshold.
        ("logprob_gap_tokens_count", _i64), ("logprob_gap_sum_nats", _f64), ("logprob_gap_max_nats", _f64),
        ("logprob_gap_over_count", _i64), ("logprob_gap_threshold_nats", _f64),
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
