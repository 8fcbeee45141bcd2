"""The tensor_stats column registry is the one declaration: every probe output, fraction, ratio, cross-rank
reduction and rollup column traces back to it, and nothing else declares a reduction."""

from __future__ import annotations

import pyarrow as pa

from dynascope.probes.grad_stats import GRAD_COUNT_COLUMNS, GRAD_NORM_COLUMNS
from dynascope.probes.update_stats import BF16_K_STATS, DRIFT_STATS, UPDATE_STATS, columns_of
from dynascope.store.combine import REDUCTIONS
from dynascope.store.schema import COLUMN, POOLED, TABLES, TENSOR_STATS_COLUMNS


def test_every_probe_output_is_a_registry_column_whose_reduction_matches_its_chunk_combination() -> None:
    for stats in (UPDATE_STATS, DRIFT_STATS, BF16_K_STATS):
        for family in stats:
            for name, how in zip(family.columns, family.combine, strict=True):
                if name == "ref_norm":  # ‖θ₀‖: only drift_ratio's denominator, never stored
                    assert COLUMN["drift_ratio"].ratio == ("drift_norm", "ref_norm")
                    continue
                assert COLUMN[name].reduce == how, name  # chunks and shards combine the same way
    for name in GRAD_NORM_COLUMNS + GRAD_COUNT_COLUMNS:
        assert COLUMN[name].reduce in ("norm", "max", "sum"), name
    assert set(columns_of(UPDATE_STATS)) >= {"bf16_unchanged_count"}
    assert set(columns_of(DRIFT_STATS)) >= {"drift_unchanged_count", "drift_zero_count"}


def test_derived_columns_name_what_they_derive_from_and_counts_are_integers() -> None:
    for c in TENSOR_STATS_COLUMNS:
        if c.frac_of is not None:
            assert COLUMN[c.frac_of].integer and COLUMN[c.frac_of].reduce == "sum" and c.reduce is None
            assert c.name == c.frac_of.removesuffix("_count") + "_frac"
        if c.name.endswith("_count"):
            assert c.integer and c.reduce == "sum" and c.unit == "elements", c.name
        if c.ratio is not None:
            assert c.reduce is None
    assert TABLES["tensor_stats"].names[6:] == [c.name for c in TENSOR_STATS_COLUMNS]
    assert REDUCTIONS == {c.name: c.reduce for c in TENSOR_STATS_COLUMNS if c.reduce in ("sum", "norm", "max")}


def test_rollup_columns_come_from_the_registry() -> None:
    for table in ("tensor_stats_by_kind", "tensor_stats_by_layer"):
        schema = TABLES[table]
        for name, how, src, where in POOLED:
            assert src in COLUMN and (where is None or where in COLUMN)
            assert how in ("sq", "sum", "max", "numel")
            want = {"sq": pa.float64(), "numel": pa.int64()}.get(
                how, pa.int64() if how == "sum" and COLUMN[src].integer else COLUMN[src].type)
            assert schema.field(name).type == want, (table, name)
        for new in ("bf16_unchanged_count", "bf16_unchanged_numel", "bf16_unchanged_k_count",
                    "bf16_unchanged_k_numel", "drift_unchanged_count", "drift_zero_count"):
            assert new in schema.names, (table, new)
