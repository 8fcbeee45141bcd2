"""The writer's tensor_stats rollups (by_kind, by_layer) against a naive SQL pooling of tensor_stats, and the
segment layout readers depend on for speed (dictionary-encoded strings, LZ4 floats)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from dynascope.store import RunWriter, StoreConnection, open_store
from dynascope.store.rollup import tensor_stats_by_kind, tensor_stats_by_layer
from dynascope.store.schema import ROLLUP_BLOCK_STEPS

from helpers.rollup_reference import KINDS, NAIVE, NAIVE_BY_LAYER, ROLLED, ROLLED_BY_LAYER
from helpers.rollup_reference import batch as _batch
from helpers.rollup_reference import same as _same


def test_rollup_equals_naive_pooling_across_flushes_and_ranks(tmp_path):
    rng = np.random.default_rng(0)
    run = tmp_path / "r"
    for rank in (0, 1):
        with RunWriter(run, rank=rank, world_size=2, flush_secs=60) as w:
            for step in range(6):
                w.append("tensor_stats", _batch(rng, step, 13, with_drift=step >= 3))
                if step % 2:
                    w.flush()  # several segments, each with its own rollup
    with open_store(run) as s:
        naive = s.rows(NAIVE)
        rolled = s.rows(ROLLED)
        assert s.rows("SELECT count(*) FROM tensor_stats") == [(2 * 6 * 13,)]
    assert len(rolled) == len(naive) == 2 * 6 * 4  # (rank, step, kind incl. null)
    for got, want in zip(rolled, naive, strict=True):
        assert all(_same(g, x) for g, x in zip(got, want, strict=True)), (got, want)


def test_layer_rollup_equals_naive_pooling_over_split_blocks(tmp_path):
    rng = np.random.default_rng(1)
    run = tmp_path / "r"
    steps = 2 * ROLLUP_BLOCK_STEPS + 5
    for rank in (0, 1):
        with RunWriter(run, rank=rank, world_size=2, flush_secs=60) as w:
            for step in range(steps):
                batch = _batch(rng, step, 7, with_drift=step >= 9)
                batch["layer"] = [None if i == 6 else i % 3 for i in range(7)]  # tensors outside the blocks
                w.append("tensor_stats", batch)
                if step % 5 == 4:
                    w.flush()  # flushes split blocks: 5 does not divide the block size
    with open_store(run) as s:
        naive = s.rows(NAIVE_BY_LAYER)
        rolled = s.rows(ROLLED_BY_LAYER)
        split = s.sql("SELECT count(*) FROM (SELECT rank, step, stage, kind, layer FROM tensor_stats_by_layer "
                           "GROUP BY ALL HAVING count(*) > 1)").fetchall()[0][0]
        blocks = {r[0] for r in s.rows("SELECT DISTINCT step FROM tensor_stats_by_layer")}
    assert split > 0  # the test exercises blocks written in pieces
    assert blocks == {0, ROLLUP_BLOCK_STEPS, 2 * ROLLUP_BLOCK_STEPS}
    assert len(rolled) == len(naive) > 0
    for got, want in zip(rolled, naive, strict=True):
        assert all(_same(g, x) for g, x in zip(got, want, strict=True)), (got, want)


def test_rollup_of_an_empty_table_is_empty():
    from dynascope.store.schema import TABLES
    assert tensor_stats_by_kind(TABLES["tensor_stats"].empty_table()).num_rows == 0
    assert tensor_stats_by_layer(TABLES["tensor_stats"].empty_table()).num_rows == 0


def test_segments_use_the_fast_encodings(tmp_path):
    """A dictionary with repeated values (one kind per tensor) made Parquet fall back to PLAIN strings."""
    run = tmp_path / "r"
    with RunWriter(run, flush_secs=60) as w:
        for step in range(50):
            w.append("tensor_stats", {"step": step, "tensor": [f"t{i}" for i in range(40)],
                                      "kind": [KINDS[i % 3] for i in range(40)], "w_norm": np.random.rand(40)})
    # the writer's segment and the file its run was folded into at rest (empty covers hold no row group)
    segs = [p for p in (run / "tensor_stats").rglob("*.parquet") if pq.ParquetFile(p).metadata.num_rows]
    assert segs
    for seg in segs:
        meta = pq.ParquetFile(seg).metadata.row_group(0)
        cols = {meta.column(i).path_in_schema: meta.column(i) for i in range(meta.num_columns)}
        assert "RLE_DICTIONARY" in cols["kind"].encodings and "RLE_DICTIONARY" in cols["tensor"].encodings, seg
        assert cols["w_norm"].compression == "LZ4" and "RLE_DICTIONARY" not in cols["w_norm"].encodings
        assert cols["tensor"].compression == "ZSTD"
    with open_store(run) as s:
        assert s.rows("SELECT kind, count(*) FROM tensor_stats GROUP BY ALL ORDER BY 1") == [
            ("attn_k", 650), ("attn_q", 700), ("mlp_up", 650)]


@pytest.mark.parametrize("codec", ["zstd", "snappy"])
def test_an_explicit_codec_applies_to_every_column(tmp_path, codec):
    # the writer's own segments (a fold at rest rewrites a run's files with the default codecs)
    with RunWriter(tmp_path / "r", compression=codec, fold=False) as w:
        w.append("scalars", {"step": 1, "key": "loss", "value": 0.5})
    seg = next(p for p in (tmp_path / "r" / "scalars").glob("writer=r0*/*.parquet"))
    meta = pq.ParquetFile(seg).metadata.row_group(0)
    assert {meta.column(i).compression for i in range(meta.num_columns)} == {codec.upper()}


@pytest.mark.parametrize("first,last,max_points", [(0, 99, 3), (5, 104, 3), (0, 24_999, 400), (7, 7, 400),
                                                   (0, 399, 400), (3, 6402, 400), (100, 130, 2),
                                                   (0, 1598, 400), (0, 1599, 400)])
def test_heat_buckets_cover_every_step_in_at_most_max_points(first, last, max_points):
    from dynascope.dashboard.queries.params import heat_buckets
    s0, w = heat_buckets(first, last, max_points)
    buckets = {s0 + (s - s0) // w * w for s in range(first, last + 1)}
    assert s0 <= first and len(buckets) <= max_points
    steps = last - first + 1  # whole blocks when 100 columns of them fit, or when buckets are that wide anyway
    assert (w >= ROLLUP_BLOCK_STEPS) == (steps >= 100 * ROLLUP_BLOCK_STEPS or -(-steps // max_points) >= ROLLUP_BLOCK_STEPS)
    if w >= ROLLUP_BLOCK_STEPS:  # whole, aligned blocks: each layer-rollup row falls in one bucket
        assert w % ROLLUP_BLOCK_STEPS == 0 and s0 % ROLLUP_BLOCK_STEPS == 0
    else:
        assert s0 == first


@pytest.mark.parametrize("max_points", [3, 400])  # wide buckets read tensor_stats_by_layer; narrow ones, raw rows
def test_heat_cells_from_the_layer_rollup_equal_the_raw_rows(tmp_path, monkeypatch, max_points):
    import polars as pl

    from dynascope.dashboard.queries.params import heat_buckets, param_cube
    issued: list[str] = []
    real_frame = StoreConnection.frame
    monkeypatch.setattr(StoreConnection, "frame",
                        lambda store, sql, params=None: issued.append(sql) or real_frame(store, sql, params))
    rng = np.random.default_rng(2)
    run = tmp_path / "r"
    batches = {step: _batch(rng, step, 9, with_drift=step >= 40) for step in range(5, 105)}
    for rank in (0, 1):  # DDP: every rank holds the same tensors, so records the same values
        with RunWriter(run, rank=rank, world_size=2, flush_secs=60) as w:
            for step in range(5, 105):
                w.append("tensor_stats", batches[step])
                if step % 7 == 0:
                    w.flush()
    with open_store(run) as s:
        run_id = s.rows("SELECT any_value(run_id) FROM tensor_stats")[0][0]
        cube = param_cube(s, run_id, max_points=max_points).filter(~pl.col("per_step"))
        raw = s.frame("SELECT * FROM tensor_stats")
    s0, width = heat_buckets(5, 104, max_points)

    def sql_sum(e: pl.Expr) -> pl.Expr:  # SQL's sum: NULL when every value is NULL (polars gives 0)
        return pl.when(e.count() > 0).then(e.sum())
    assert (width >= ROLLUP_BLOCK_STEPS) == (max_points == 3)
    assert any("FROM tensor_stats_by_layer" in q for q in issued) == (max_points == 3)
    want = (raw.with_columns(bucket=s0 + (pl.col("step") - s0) // width * width,
                             layer=pl.col("layer").fill_null(-1), kind=pl.col("kind").fill_null("other"))
            .group_by("bucket", "layer", "kind", "stage")
            .agg(update_sq=sql_sum(pl.col("update_norm") ** 2),
                 update_w_sq=sql_sum(pl.when(pl.col("update_norm").is_not_null()).then(pl.col("w_norm") ** 2)),
                 changed_count=sql_sum(pl.col("changed_count").cast(pl.Float64)),
                 changed_numel=sql_sum(pl.when(pl.col("changed_count").is_not_null()).then(pl.col("numel"))
                                       .cast(pl.Float64)),
                 drift_sq=sql_sum(pl.col("drift_norm") ** 2),
                 drift_w_sq=sql_sum(pl.when(pl.col("drift_norm").is_not_null()).then(pl.col("w_norm") ** 2))))
    key = ["bucket", "layer", "kind", "stage"]
    got, want = cube.sort(key), want.sort(key)
    assert got.height == want.height > 0 and got.select(key).equals(want.select(key).cast(got.select(key).schema))
    # What a cell shows is a figure, a ratio of two sums: the layer rollup pools each rank's rows (a copy
    # scales both sums alike), narrow buckets read tensor_stats_global (one copy); both give the figure of
    # every rank's rows pooled.
    for num, den in (("update_sq", "update_w_sq"), ("changed_count", "changed_numel"), ("drift_sq", "drift_w_sq")):
        g, w = (got[num] / got[den]).to_list(), (want[num] / want[den]).to_list()
        assert [v is None for v in g] == [v is None for v in w], num  # NULL cells match exactly
        assert [v for v in g if v is not None] == pytest.approx([v for v in w if v is not None], rel=1e-12), num
