"""The statistics' declarations are the one registry: every kernel output, fraction, ratio, cross-rank
reduction, rollup column and pooled figure traces back to a declared column, and a bad declaration fails
when the registry is built, naming what is wrong."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from dynascope.core.errors import UserError
from dynascope.stats import REGISTRY, Column, Figure, Statistic, count
from dynascope.stats.base import F64
from dynascope.stats.registry import Registry
from dynascope.store.combine import REDUCTIONS
from dynascope.store.schema import COLUMN, POOLED, TABLES, TENSOR_STATS_COLUMNS


def test_every_kernel_output_is_a_column_that_combines_across_chunks_as_across_ranks() -> None:
    for s in REGISTRY.statistics:
        for name in s.outputs:
            col = REGISTRY.column[name]
            assert col.reduce in ("sum", "norm", "max"), name  # the engine combines chunks by it, combine_shards ranks
            assert col.stored or any(name in (c.ratio or ()) for c in TENSOR_STATS_COLUMNS), name  # ‖θ₀‖ feeds drift_ratio
    outputs = {o for s in REGISTRY.statistics for o in s.outputs}
    from dynascope.stats.base import TENSOR_COLUMNS  # the tensor's description: name, shape, place on a mesh

    derived = {c.name for c in TENSOR_STATS_COLUMNS if c.derived} | {c.name for c in TENSOR_COLUMNS} | {"bf16_k_steps"}
    assert {c.name for c in TENSOR_STATS_COLUMNS} - derived <= outputs  # every stored value has a kernel
    assert {"bf16_unchanged_count", "drift_unchanged_count", "drift_zero_count", "grad_max_abs"} <= outputs


def test_derived_columns_name_what_they_derive_from_and_counts_are_integers() -> None:
    for c in TENSOR_STATS_COLUMNS:
        if c.frac_of is not None:
            assert COLUMN[c.frac_of].integer and COLUMN[c.frac_of].reduce == "sum" and c.reduce is None
            assert c.name == c.frac_of.removesuffix("_count") + "_frac"
        if c.name.endswith("_count"):
            assert c.integer and c.reduce == "sum" and c.unit == "elements", c.name
        if c.ratio is not None:
            assert c.reduce is None
    # the row's keys, the declared columns, then the writing process's generation (store.lineage)
    assert TABLES["tensor_stats"].names[6:] == [c.name for c in TENSOR_STATS_COLUMNS] + ["generation"]
    assert REDUCTIONS == {c.name: c.reduce for c in TENSOR_STATS_COLUMNS if c.reduce in ("sum", "norm", "max")}


def test_rollup_columns_and_figures_come_from_the_registry() -> None:
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
    pooled = {p[0] for p in POOLED}
    assert REGISTRY.figures and all(f.num in pooled and f.den in pooled for f in REGISTRY.figures)
    assert {f.label for f in REGISTRY.figures if f.heat} >= {"update ratio ‖ΔW‖/‖W‖", "step-changed fraction"}
    assert REGISTRY.summary[:2] == ("update_ratio", "changed_frac")


def _mean(name: str, **kw: object) -> Statistic:
    def kernel(x):  # type: ignore[no-untyped-def]
        return [x.new.mean()]
    return Statistic(name, columns=(Column(name, F64, reduce="sum"),), outputs=(name,), inputs=("new",),
                     kernel=kernel, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("bad", "message"), [
    ([_mean("w_norm")], "declared twice"),
    ([dataclasses.replace(_mean("m"), outputs=("nowhere",))], "no statistic declares"),
    ([Statistic("f", columns=(Column("f_frac", F64, frac_of="nope_count"),))], "no statistic declares"),
    ([dataclasses.replace(_mean("m"), given=("nope",))], "no statistic outputs"),
    ([Statistic("p", columns=(count("grad_zero_count2", "x", "grad_numel"),))], "rollup column is declared twice"),
    ([Statistic("g", figures=(Figure("g", "g", "nope", "numel"),))], "no column's pool declares"),
])
def test_a_bad_declaration_fails_once_with_its_reason(bad: list[Statistic], message: str) -> None:
    with pytest.raises(UserError, match=message):
        Registry([*REGISTRY.statistics, *bad])


def test_a_statistic_declares_a_known_tier_and_inputs() -> None:
    with pytest.raises(ValueError, match="tier"):
        _mean("a", tier="sometimes")
    with pytest.raises(ValueError, match="unknown inputs"):
        dataclasses.replace(_mean("a"), inputs=("weights",))
    with pytest.raises(ValueError, match="gradient"):
        dataclasses.replace(_mean("a"), inputs=("grad", "new"))
    assert Registry([*REGISTRY.statistics, _mean("m")]).column["m"].reduce == "sum"
