"""Parameter dynamics aggregates: layer × step heat maps, stage overlays, spectra and gradient health."""

from __future__ import annotations

import polars as pl

from dynascope.dashboard.queries import BUCKET, MAX_POINTS, bounds_cte, in_list
from dynascope.store import StoreConnection, quote_literal
from dynascope.store.pooling import GLOBAL, counted_rollup_sql
from dynascope.store.rollup_across import BY_TENSOR, covers, pooled_sql
from dynascope.store.schema import FIGURES, POOLED, ROLLUP_BLOCK_STEPS, Figure

# Two scans feed the whole page: the writer's per-kind rollup (tensor_stats_by_kind, ~tensors-per-kind
# times fewer rows than tensor_stats) summed per (step, kind, stage) for the series, and its per-layer
# rollup of 16-step blocks (tensor_stats_by_layer) summed per (step bucket, layer, kind, stage) for the heat
# maps (tensor_stats itself when buckets are narrower than a block). Kind and stage filters then pool
# these sums in polars, so changing a filter never re-scans the table. The sums are the rollups' pooled
# columns (store.schema.POOLED, from the statistics' declarations), under the same names whichever table
# they come from, and every figure is a ratio of two of them (store.schema.FIGURES). A rollup's rows count
# as the canonical view counts tensor_stats rows (store.pooling.counted_rollup_sql): replicas and copies once.
_NONFINITE = ("w_nan_count", "grad_nan_count", "w_inf_count", "grad_inf_count")
# Rollup rows written before ``update_w_sq`` existed have only w_sq, every tensor's ‖W‖², which is what they pool.
_ROLLUP_FALLBACK = {"update_w_sq": "CASE WHEN update_sq IS NOT NULL THEN coalesce(update_w_sq, w_sq) END"}
_KEYS = "coalesce(kind, 'other') AS kind, coalesce(stage, '') AS stage"


def _pooled_sql(names: tuple[str, ...], table: str) -> str:
    """``sum(...) AS <pooled column>`` for each of ``names``: the rollup's own column, or from
    tensor_stats_global the same pool of its rows (Σx², Σx, max, or Σnumel where the count, or ``where``, is not NULL)."""
    how = {p[0]: p[1] for p in POOLED}

    def agg(name: str) -> str:
        if table == GLOBAL:
            return pooled_sql(name)
        return f"{'max' if how[name] == 'max' else 'sum'}({_ROLLUP_FALLBACK.get(name, name)})"

    return ",\n    ".join(f"CAST({agg(name)} AS DOUBLE) AS {name}" for name in names)


def _figure(f: Figure) -> pl.Expr:
    num, den = pl.col(f.num).sum(), pl.col(f.den).sum()
    return (num.sqrt() / den.sqrt() if f.root else num / den).alias(f.name)


# Heat-map metrics: label → pooled expression over the cube's sums (the declared figures marked ``heat``).
HEAT_METRICS = {f.label: _figure(f) for f in FIGURES if f.heat}
# The heat maps need only their figures' sums: leaving the others out of a 10M-row heat scan is less to decode.
_HEAT_SUMS = tuple(dict.fromkeys(n for f in FIGURES if f.heat for n in (f.num, f.den)))
_SUMS = tuple(dict.fromkeys([n for f in FIGURES for n in (f.num, f.den)] + list(_NONFINITE)))
_NAN = (pl.col("w_nan_count").fill_null(0) + pl.col("grad_nan_count").fill_null(0)).sum().cast(pl.Int64).alias("nan")
_INF = (pl.col("w_inf_count").fill_null(0) + pl.col("grad_inf_count").fill_null(0)).sum().cast(pl.Int64).alias("inf")


def param_cube(store: StoreConnection, run: str, max_points: int = MAX_POINTS) -> pl.DataFrame:
    """Sums of one run's tensor_stats: ``per_step`` rows hold (step, kind, stage) and the others
    (bucket, layer, kind, stage), bucket being the step rounded down to at most ``max_points``.

    The per-step rows come from the tensor_stats_by_kind rollup. The heat cells of a run of at least 1,600
    steps are whole 16-step blocks (``heat_buckets``), read from the tensor_stats_by_layer rollup; those of
    a shorter run from tensor_stats_by_tensor once compaction wrote it (every row of the run pooled across
    ranks per step and tensor). A run written before a rollup existed (none of its rows there) falls back
    to tensor_stats_global.
    """
    where = f"run_id = {quote_literal(run)} AND step IS NOT NULL"
    per_step_sql = """
        SELECT true AS per_step, step, CAST(NULL AS BIGINT) AS bucket, CAST(NULL AS INTEGER) AS layer,
               {keys}, {sums}
        FROM {table} WHERE {where} GROUP BY ALL"""
    per_step = store.frame(per_step_sql.format(keys=_KEYS, sums=_pooled_sql(_SUMS, "tensor_stats_by_kind"),
                                                table=f"({counted_rollup_sql('tensor_stats_by_kind', where)}) c",
                                                where="true"))
    if per_step.height == 0:
        per_step = store.frame(per_step_sql.format(keys=_KEYS, sums=_pooled_sql(_SUMS, GLOBAL),
                                                    table=GLOBAL, where=where))
    if per_step.height == 0:
        return per_step
    s0, width = heat_buckets(int(per_step["step"].min()), int(per_step["step"].max()), max_points)
    heat_sql = """
        SELECT false AS per_step, CAST(NULL AS BIGINT) AS step, {bucket} AS bucket,
               coalesce(layer, -1) AS layer, {keys}, {sums}
        FROM {table}, (SELECT {s0} AS s0, {w} AS w) bounds WHERE {where} GROUP BY ALL"""
    heat = pl.DataFrame()
    if width % ROLLUP_BLOCK_STEPS == 0:  # whole blocks: the layer rollup has every sum the cells need
        heat = store.frame(heat_sql.format(bucket=BUCKET, s0=s0, w=width, keys=_KEYS,
                                            sums=_pooled_sql(_HEAT_SUMS, "tensor_stats_by_layer"),
                                            table=f"({counted_rollup_sql('tensor_stats_by_layer', where, True)}) c",
                                            where="true"))
    if heat.height == 0 and covers(store, run):  # compacted: tensor_stats pooled across ranks per (step, tensor)
        heat = store.frame(heat_sql.format(bucket=BUCKET, s0=s0, w=width, keys=_KEYS,
                                            sums=_pooled_sql(_HEAT_SUMS, BY_TENSOR), table=BY_TENSOR, where=where))
    if heat.height == 0:
        heat = store.frame(heat_sql.format(bucket=BUCKET, s0=s0, w=width, keys=_KEYS,
                                            sums=_pooled_sql(_HEAT_SUMS, GLOBAL), table=GLOBAL, where=where))
    return pl.concat([heat, per_step], how="diagonal_relaxed").select(per_step.columns)


def heat_buckets(first: int, last: int, max_points: int = MAX_POINTS, min_points: int = 100) -> tuple[int, int]:
    """(first bucket's step, bucket width) cutting steps ``first..last`` into at most ``max_points`` buckets.

    A width of at least ``ROLLUP_BLOCK_STEPS`` is rounded up to whole blocks, aligned on block starts, so a
    bucket is a union of tensor_stats_by_layer rows. So is any run long enough for ``min_points`` whole
    blocks: 100 columns are a readable heat map, and reading the rollup is 16× fewer rows. Only shorter
    runs get narrower buckets, starting at ``first``.
    """
    steps = last - first + 1
    width = max(1, -(-steps // max_points))
    if width < ROLLUP_BLOCK_STEPS and steps < ROLLUP_BLOCK_STEPS * min_points:
        return first, width
    s0 = first // ROLLUP_BLOCK_STEPS * ROLLUP_BLOCK_STEPS
    blocks = -(-(last - s0 + 1) // ROLLUP_BLOCK_STEPS)
    return s0, -(-blocks // max_points) * ROLLUP_BLOCK_STEPS


def stages_and_kinds(cube: pl.DataFrame) -> pl.DataFrame:
    """Distinct (stage, kind) with their step range, in order of first appearance."""
    return (cube.filter(pl.col("per_step")).group_by("stage", "kind")
            .agg(pl.col("step").min().alias("first_step"), pl.col("step").max().alias("last_step"))
            .sort("first_step", "kind"))


def layer_heatmap(cube: pl.DataFrame, stages: tuple[str, ...], kinds: tuple[str, ...]) -> pl.DataFrame:
    """Layer × step-bucket cells with every heat metric; layer −1 holds tensors outside the blocks.

    Ratios are pooled (√Σ‖ΔW‖² / √Σ‖W‖² over the rows with an update, Σ changed / Σ numel), so a cell is the layer as one tensor and
    FSDP shards combine exactly.
    """
    cells = cube.filter(~pl.col("per_step") & pl.col("stage").is_in(stages) & pl.col("kind").is_in(kinds))
    return (cells.group_by("layer", "bucket").agg(**{k: v for k, v in HEAT_METRICS.items()})
            .rename({"bucket": "step"}).sort("layer", "step"))


def _per_step(cube: pl.DataFrame, kinds: tuple[str, ...]) -> pl.DataFrame:
    """Every declared figure, pooled per (step, stage) over ``kinds``, and the NaN/Inf element counts."""
    return (cube.filter(pl.col("per_step") & pl.col("kind").is_in(kinds)).group_by("step", "stage")
            .agg(*[_figure(f) for f in FIGURES], _NAN, _INF).sort("step"))


def _bucketed(df: pl.DataFrame, x: str, values: list[str], by: list[str], max_points: int) -> pl.DataFrame:
    width = max(1, -(-int(df.group_by(by).agg((pl.col(x).max() - pl.col(x).min() + 1).alias("n"))["n"].max()
                      or 1) // max_points))
    aggs = [e for v in values for e in (pl.col(v).mean().alias(v), pl.col(v).min().alias(f"{v}_lo"),
                                        pl.col(v).max().alias(f"{v}_hi"))]
    out = (df.with_columns((pl.col(x) // width * width).alias(x)).group_by(*by, x)
           .agg(pl.col("step").min().alias("first_step") if x != "step" else pl.len().alias("steps"), *aggs))
    # Groups in the order the run reached them (SFT before RL), not by name: every chart of the page colours
    # its series in group order, and the per-step charts (delta sync) list stages by step.
    return out.sort(pl.col("first_step" if x != "step" else x).min().over(by), *by, x)


def stage_overlay(cube: pl.DataFrame, run: str, kinds: tuple[str, ...], max_points: int = MAX_POINTS) -> pl.DataFrame:
    """Pooled update ratio, changed fraction (bit-exact in the stored dtype) and the fraction changed by
    more than 0.1% of |W| (``changed_rel``), per stage against steps since the stage began (mean/min/max
    of the per-step values in each bucket)."""
    ps = _per_step(cube, kinds).with_columns((pl.col("step") - pl.col("step").min().over("stage")).alias("step_in_stage"))
    if ps.height == 0:
        return ps
    return _bucketed(ps, "step_in_stage", ["update_ratio", "changed_frac", "changed_rel_frac"], ["stage"],
                     max_points).with_columns(
        pl.lit(run).alias("run_id"))


def grad_health(cube: pl.DataFrame, run: str, kinds: tuple[str, ...], max_points: int = MAX_POINTS) -> pl.DataFrame:
    """Gradient sparsity (exact zeros, near zeros) per step bucket: mean/min/max of the per-step fractions."""
    ps = _per_step(cube, kinds).filter(pl.col("grad_zero_frac").is_not_null())
    if ps.height == 0:
        return ps
    return _bucketed(ps.with_columns(pl.lit(run).alias("run_id")), "step", ["grad_zero_frac", "grad_near_zero_frac"],
                     ["run_id"], max_points)


def nonfinite_steps(cube: pl.DataFrame, run: str) -> pl.DataFrame:
    """Steps where any weight or gradient held NaN/Inf, with their counts."""
    return (cube.filter(pl.col("per_step")).group_by("step").agg(_NAN, _INF)
            .filter((pl.col("nan") + pl.col("inf")) > 0).sort("step")
            .with_columns(pl.lit(run).alias("run_id")).select("run_id", "step", "nan", "inf"))


def nonfinite_tensors(store: StoreConnection, run: str, steps: tuple[int, ...]) -> pl.DataFrame:
    """The tensors holding NaN/Inf at the given steps (a separate query: naming tensors in the cube would
    drag the tensor column through the whole scan, and steps prune row groups here)."""
    if not steps:
        return pl.DataFrame(schema={"step": pl.Int64, "tensor": pl.String, "nonfinite": pl.Int64})
    return store.frame(f"""
        SELECT step, tensor, CAST(coalesce(w_nan_count, 0) + coalesce(w_inf_count, 0) + coalesce(grad_nan_count, 0)
                                  + coalesce(grad_inf_count, 0) AS BIGINT) AS nonfinite
        FROM tensor_stats_global
        WHERE run_id = {quote_literal(run)} AND step IN ({', '.join(str(int(s)) for s in steps)})
          AND (w_nan_count > 0 OR w_inf_count > 0 OR grad_nan_count > 0 OR grad_inf_count > 0)
        ORDER BY step, nonfinite DESC""")


def _where(runs: tuple[str, ...], kinds: tuple[str, ...]) -> str:
    return f"{in_list('run_id', runs)} AND step IS NOT NULL AND {in_list('kind', kinds)}"


def spectra_series(store: StoreConnection, runs: tuple[str, ...], kinds: tuple[str, ...],
                   max_points: int = MAX_POINTS) -> pl.DataFrame:
    """Rank-1 energy and stable rank of the cumulative ΔW per run, stage and step bucket.

    ``rank1`` is energy-weighted over the selected tensors, Σσ₁² / Σ‖ΔW‖²_F, as in
    ``dynascope.analyses.rank1_dominance``; the band is the per-tensor min/max of σ₁²/‖ΔW‖²_F (the same
    quantity, so the line always lies inside it). Computed here rather than
    through that analysis because it reads only scalar columns (the analysis also reads the u₁/v₁ lists)
    and honours the kind filter.
    """
    where = _where(runs, kinds) + " AND drift_norm > 0 AND len(sigma) > 0"
    return store.frame(f"""
        WITH per_step AS (
            SELECT run_id, coalesce(stage, '') AS stage, step,
                   sum(sigma[1] * sigma[1]) / sum(drift_norm * drift_norm) AS rank1,
                   min(sigma[1] * sigma[1] / (drift_norm * drift_norm)) AS lo,
                   max(sigma[1] * sigma[1] / (drift_norm * drift_norm)) AS hi, avg(stable_rank) AS stable_rank,
                   min(stable_rank) AS sr_lo, max(stable_rank) AS sr_hi
            FROM spectra WHERE {where} GROUP BY ALL),
        {bounds_cte('per_step', 'TRUE', max_points, partition='run_id')}
        SELECT p.run_id, stage, {BUCKET} AS step, avg(rank1) AS rank1, min(lo) AS rank1_lo, max(hi) AS rank1_hi,
               avg(stable_rank) AS stable_rank, min(sr_lo) AS stable_rank_lo, max(sr_hi) AS stable_rank_hi
        FROM per_step p JOIN bounds USING (run_id) GROUP BY ALL ORDER BY p.run_id, stage, step""")


def delta_sync_series(store: StoreConnection, runs: tuple[str, ...]) -> pl.DataFrame:
    """Per run and recorded step: the bytes a bf16 delta weight sync would send, from
    ``dynascope.analyses.delta_sync_bytes`` (both encodings priced, the cheaper kept)."""
    from dynascope.analyses.delta_sync import delta_sync_bytes

    frames = [delta_sync_bytes(store, r) for r in runs]
    return pl.concat(frames) if frames else pl.DataFrame()
