"""Delta weight sync: the bytes a trainer would send to its inference engine if it shipped only the bf16
elements that changed in a step, against the full bf16 weights, and the sync time that implies.

An element must be sent when its bf16 cast changed across the optimizer step (PULSE's S₁ complement,
``numel − bf16_unchanged_count``). Two encodings are priced for each step, pooled over the tensors:

- value+index: 2 B (bf16 value) + 4 B (int32 index within the tensor) per changed element;
- bitmap: ⌈numel/8⌉ B per tensor (one bit per element) + 2 B per changed element;

``delta_bytes`` is the cheapest of the two and of sending the full bf16 weights (``full_bf16_bytes`` =
2·numel), per step (``encoding`` names it). Value+index wins below 1/32 ≈ 3.1% changed, the bitmap above
it, and the full weights once nearly everything changed (a delta sync falls back to them).

Where the run has ``weight_sync`` timings, the measured bandwidth is what a full sync of the weights as
stored (numel × the dtype's bytes) moved in the run's median ``weight_sync`` span (the slowest rank's
per step), and the implied times are the bytes divided by it.
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.store import StoreError, quote_literal
from dynascope.store.pooling import GLOBAL
from dynascope.store.rollup_across import BY_TENSOR, covers

__all__ = ["DTYPE_BYTES", "delta_sync_bytes", "delta_sync_summary", "summarize_delta_sync"]

VALUE_BYTES, INDEX_BYTES = 2, 4
ENCODINGS = ("value+index", "bitmap", "full")  # cheapest per changed element first
_ENCODING_CODE = {e: i for i, e in enumerate(ENCODINGS)}
# bytes per element of the dtype strings the probe records (torch's str(dtype) without "torch.")
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}

_SCHEMA = {"run_id": pl.String, "stage": pl.String, "step": pl.Int64, "tensors": pl.Int64, "numel": pl.Int64,
           "changed_count": pl.Int64, "changed_pct": pl.Float64, "full_bf16_bytes": pl.Int64,
           "value_index_bytes": pl.Int64, "bitmap_bytes": pl.Int64, "delta_bytes": pl.Int64, "encoding": pl.String,
           "delta_pct": pl.Float64, "weight_sync_ms": pl.Float64, "sync_bytes_per_s": pl.Float64,
           "full_bf16_sync_ms": pl.Float64, "delta_sync_ms": pl.Float64}


def _columns(con) -> set[str]:
    return {r[0] for r in con.rows("SELECT column_name FROM (DESCRIBE tensor_stats)")}


def delta_sync_bytes(store: StoreLike, run: str | None = None, stage: str | None = None) -> pl.DataFrame:
    """Per recorded step: what a bf16 delta sync would send, in both encodings, and the implied sync time.

    Columns: run_id, stage, step, tensors, numel, changed_count (elements whose bf16 cast changed),
    changed_pct, full_bf16_bytes, value_index_bytes, bitmap_bytes, delta_bytes (the cheapest of the two
    and the full bf16 weights), encoding (value+index | bitmap | full),
    delta_pct (delta_bytes / full_bf16_bytes), weight_sync_ms (the run's median measured sync, null
    without ``weight_sync`` timings), sync_bytes_per_s, full_bf16_sync_ms and delta_sync_ms (implied).
    A tensor counts once per step, as ``tensor_stats_global`` has it (shards pooled, replicas once). Steps
    where some tensor has no S₁ (outside the probe's window), or whose rows hold fewer elements than the
    run's fullest step (a shard's row lost), are left out rather than priced from part of the weights.
    """
    con = as_store(store)
    if "bf16_unchanged_count" not in _columns(con):
        raise StoreError("tensor_stats has no bf16_unchanged_count (PULSE S₁): record with a probe that writes it")
    where = run_clause(run) + ("" if stage is None else f" AND stage = {quote_literal(stage)}")
    dtype_bytes = " ".join(f"WHEN {quote_literal(k)} THEN {v}" for k, v in DTYPE_BYTES.items())
    # One row per (step, tensor), the canonical view's: compacted, its pooled sums; else the view itself.
    if covers(con, run):
        rows = f"""
            SELECT run_id, stage, step, numel, dtype, bf16_rows AS has_s1,
                   bf16_unchanged_numel - bf16_unchanged_count AS changed, bitmap_bytes
            FROM {BY_TENSOR} WHERE step IS NOT NULL{where}"""
    else:
        rows = f"""
            SELECT run_id, stage, step, numel, dtype, CASE WHEN bf16_unchanged_count IS NOT NULL THEN 1 ELSE 0 END
                   AS has_s1, numel - bf16_unchanged_count AS changed, ceil(numel / 8.0) AS bitmap_bytes
            FROM {GLOBAL} WHERE step IS NOT NULL{where}"""
    per_step = frame(con, f"""
        WITH rows AS ({rows})
        SELECT run_id, any_value(stage) AS stage, step, count(*) AS tensors,
               sum(numel)::BIGINT AS numel, sum(has_s1) = count(*) AS complete,
               sum(changed)::BIGINT AS changed_count, sum(bitmap_bytes)::BIGINT AS bitmap_index_bytes,
               sum(numel * CASE dtype {dtype_bytes} ELSE 4 END)::BIGINT AS stored_bytes
        FROM rows GROUP BY run_id, step ORDER BY run_id, step""")
    if per_step.is_empty():
        return pl.DataFrame(schema=_SCHEMA)
    sync = frame(con, f"""
        SELECT run_id, median(ms) AS weight_sync_ms FROM (
            SELECT run_id, step, max(dur_us) / 1000.0 AS ms FROM timings
            WHERE phase = 'weight_sync' AND dur_us > 0{run_clause(run)} GROUP BY run_id, step)
        GROUP BY run_id""")
    if sync.is_empty():
        sync = pl.DataFrame(schema={"run_id": pl.String, "weight_sync_ms": pl.Float64})
    stored = per_step.group_by("run_id").agg(pl.col("stored_bytes").median().alias("full_stored_bytes"))
    whole = pl.col("complete") & (pl.col("numel") == pl.col("numel").max().over("run_id"))
    df = (per_step.filter(whole).join(stored, on="run_id", how="left")
          .join(sync, on="run_id", how="left"))
    full = 2 * pl.col("numel")
    vi = (VALUE_BYTES + INDEX_BYTES) * pl.col("changed_count")
    bm = pl.col("bitmap_index_bytes") + VALUE_BYTES * pl.col("changed_count")
    bw = pl.col("full_stored_bytes") / (pl.col("weight_sync_ms") / 1000.0)
    df = df.with_columns(full_bf16_bytes=full, value_index_bytes=vi, bitmap_bytes=bm).with_columns(
        delta_bytes=pl.min_horizontal("value_index_bytes", "bitmap_bytes", "full_bf16_bytes"),
        encoding=pl.when(pl.min_horizontal("value_index_bytes", "bitmap_bytes") >= pl.col("full_bf16_bytes"))
        .then(pl.lit("full")).when(pl.col("value_index_bytes") <= pl.col("bitmap_bytes"))
        .then(pl.lit("value+index")).otherwise(pl.lit("bitmap")),
        changed_pct=100.0 * pl.col("changed_count") / pl.col("numel"),
        sync_bytes_per_s=pl.when(pl.col("weight_sync_ms") > 0).then(bw),
    ).with_columns(
        delta_pct=100.0 * pl.col("delta_bytes") / pl.col("full_bf16_bytes"),
        full_bf16_sync_ms=1000.0 * pl.col("full_bf16_bytes") / pl.col("sync_bytes_per_s"),
        delta_sync_ms=1000.0 * pl.col("delta_bytes") / pl.col("sync_bytes_per_s"),
    )
    return df.select([pl.col(c).cast(t) for c, t in _SCHEMA.items()])


def delta_sync_summary(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Per run and stage: median changed_pct and delta_pct over the recorded steps, the encoding most
    steps chose, and the median implied full and delta sync times (null without weight_sync timings).

    The first step of each stage is left out: Adam's first update moves every weight by about η
    (bias-corrected m/√v = ±1), which is not the steady state a sync is sized for.
    """
    return summarize_delta_sync(delta_sync_bytes(store, run))


def summarize_delta_sync(df: pl.DataFrame) -> pl.DataFrame:
    """``delta_sync_summary`` of a ``delta_sync_bytes`` frame already at hand (one scan for both)."""
    schema = {"run_id": pl.String, "stage": pl.String, "steps": pl.Int64, "changed_pct": pl.Float64,
              "delta_pct": pl.Float64, "encoding": pl.String, "full_bf16_bytes": pl.Int64,
              "full_bf16_sync_ms": pl.Float64, "delta_sync_ms": pl.Float64}
    if df.is_empty():
        return pl.DataFrame(schema=schema)
    df = df.filter(pl.col("step") > pl.col("step").min().over("run_id", "stage"))
    # The encoding most steps chose; a tie goes to the cheaper per element (``ENCODINGS`` order). Polars'
    # mode lists tied values in no fixed order, so ``mode().first()`` named either one, run to run.
    code = pl.col("encoding").replace_strict(_ENCODING_CODE, return_dtype=pl.Int8)
    out = df.group_by("run_id", "stage", maintain_order=True).agg(
        pl.len().alias("steps"), pl.col("changed_pct").median(), pl.col("delta_pct").median(),
        code.mode().min().alias("encoding"), pl.col("full_bf16_bytes").median().cast(pl.Int64),
        pl.col("full_bf16_sync_ms").median(), pl.col("delta_sync_ms").median())
    out = out.with_columns(pl.col("encoding").replace_strict(dict(enumerate(ENCODINGS)), return_dtype=pl.String))
    return out.select([pl.col(c).cast(t) for c, t in schema.items()])
