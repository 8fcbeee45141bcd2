"""The writer's tensor_stats_by_kind rollup against a naive SQL pooling of tensor_stats, and the segment layout
readers depend on for speed (dictionary-encoded strings, LZ4 floats)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from dynascope.store import RunWriter, open_store
from dynascope.store.rollup import tensor_stats_by_kind

KINDS = ["attn_q", "attn_k", "mlp_up", None]

# The same pooling, done the slow way on the raw rows.
NAIVE = """
    SELECT run_id, rank, role, step, stage, kind, max(time_us), count(*), sum(numel),
           sum(w_norm * w_norm), sum(dw_norm * dw_norm), max(update_ratio),
           sum(changed_count), sum(CASE WHEN changed_count IS NOT NULL THEN numel END),
           sum(changed_bf16_count), sum(CASE WHEN changed_bf16_count IS NOT NULL THEN numel END),
           sum(sign_flip_count), sum(w_nan), sum(w_inf),
           sum(drift_norm * drift_norm), sum(CASE WHEN drift_norm IS NOT NULL THEN w_norm * w_norm END),
           sum(drift_changed_count), sum(CASE WHEN drift_norm IS NOT NULL THEN numel END),
           sum(grad_norm * grad_norm), max(grad_max_abs), sum(grad_zero_count), sum(grad_near_zero_count),
           sum(CASE WHEN grad_zero_count IS NOT NULL THEN numel END), sum(grad_nan), sum(grad_inf)
    FROM tensor_stats GROUP BY ALL ORDER BY ALL"""

ROLLED = """
    SELECT run_id, rank, role, step, stage, kind, time_us, tensors, numel, w_sq, dw_sq, update_ratio_max,
           changed_count, changed_numel, changed_bf16_count, changed_bf16_numel, sign_flip_count, w_nan, w_inf,
           drift_sq, drift_w_sq, drift_changed_count, drift_numel, grad_sq, grad_max_abs, grad_zero_count,
           grad_near_zero_count, grad_numel, grad_nan, grad_inf
    FROM tensor_stats_by_kind ORDER BY ALL"""


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def _batch(rng, step: int, n: int, with_drift: bool) -> dict:
    frozen = rng.random(n) < 0.3  # params without grads: every grad column null
    def maybe(values, mask):
        return [None if m else v for v, m in zip(values.tolist(), mask, strict=True)]
    return {
        "step": step, "time_us": 1_000 + step, "stage": "rl" if step % 2 else "sft",
        "tensor": [f"t{i}" for i in range(n)], "layer": np.arange(n) % 3, "kind": [KINDS[i % 4] for i in range(n)],
        "numel": rng.integers(0, 5000, n), "w_norm": rng.random(n), "dw_norm": rng.random(n),
        "update_ratio": rng.random(n), "changed_count": rng.integers(0, 100, n),
        "changed_bf16_count": maybe(rng.integers(0, 9, n), rng.random(n) < 0.5),
        "sign_flip_count": rng.integers(0, 5, n), "w_nan": rng.integers(0, 2, n), "w_inf": 0,
        "drift_norm": rng.random(n) if with_drift else None,
        "drift_changed_count": rng.integers(0, 50, n) if with_drift else None,
        "grad_norm": maybe(rng.random(n), frozen), "grad_max_abs": maybe(rng.random(n), frozen),
        "grad_zero_count": maybe(rng.integers(0, 9, n), frozen),
        "grad_near_zero_count": maybe(rng.integers(0, 9, n), frozen),
        "grad_nan": maybe(rng.integers(0, 2, n), frozen), "grad_inf": maybe(rng.integers(0, 2, n), frozen),
    }


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
        naive = s._con.sql(NAIVE).fetchall()
        rolled = s._con.sql(ROLLED).fetchall()
        assert s._con.sql("SELECT count(*) FROM tensor_stats").fetchall() == [(2 * 6 * 13,)]
    assert len(rolled) == len(naive) == 2 * 6 * 4  # (rank, step, kind incl. null)
    for got, want in zip(rolled, naive, strict=True):
        assert all(_same(g, x) for g, x in zip(got, want, strict=True)), (got, want)


def test_rollup_of_an_empty_table_is_empty():
    from dynascope.store.schema import TABLES
    assert tensor_stats_by_kind(TABLES["tensor_stats"].empty_table()).num_rows == 0


def test_segments_use_the_fast_encodings(tmp_path):
    """A dictionary with repeated values (one kind per tensor) made Parquet fall back to PLAIN strings."""
    run = tmp_path / "r"
    with RunWriter(run, flush_secs=60) as w:
        for step in range(50):
            w.append("tensor_stats", {"step": step, "tensor": [f"t{i}" for i in range(40)],
                                      "kind": [KINDS[i % 3] for i in range(40)], "w_norm": np.random.rand(40)})
    seg = next(p for p in (run / "tensor_stats").glob("writer=r0*/*.parquet"))
    meta = pq.ParquetFile(seg).metadata.row_group(0)
    cols = {meta.column(i).path_in_schema: meta.column(i) for i in range(meta.num_columns)}
    assert "RLE_DICTIONARY" in cols["kind"].encodings and "RLE_DICTIONARY" in cols["tensor"].encodings
    assert cols["w_norm"].compression == "LZ4" and "RLE_DICTIONARY" not in cols["w_norm"].encodings
    assert cols["tensor"].compression == "ZSTD"
    with open_store(run) as s:
        assert s._con.sql("SELECT kind, count(*) FROM tensor_stats GROUP BY ALL ORDER BY 1").fetchall() == [
            ("attn_k", 650), ("attn_q", 700), ("mlp_up", 650)]


@pytest.mark.parametrize("codec", ["zstd", "snappy"])
def test_an_explicit_codec_applies_to_every_column(tmp_path, codec):
    with RunWriter(tmp_path / "r", compression=codec) as w:
        w.append("scalars", {"step": 1, "key": "loss", "value": 0.5})
    seg = next(p for p in (tmp_path / "r" / "scalars").glob("writer=r0*/*.parquet"))
    meta = pq.ParquetFile(seg).metadata.row_group(0)
    assert {meta.column(i).compression for i in range(meta.num_columns)} == {codec.upper()}
