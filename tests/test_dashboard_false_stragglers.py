"""The Cluster page names only a slower rank, as the report does: on a planted 4-rank run where rank 1 trains
in half the time and rank 3 in twice the time, the page's rank table, its sentence, the names on its
distribution chart and its "slowest ranks" table name rank 3 and never rank 1, and the heat map's colour
scale makes rank 3 a red row however extreme a single cell is."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from dynascope.analyses.findings import ranked_findings
from dynascope.dashboard import charts
from dynascope.dashboard.queries import ranks as R
from dynascope.dashboard.views.cluster_ranks import label, slowest_said
from dynascope.store import open_store

import helpers.planted_timings as planted_timings

FAST, SLOW = 1, 3


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("dash_false_stragglers") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(planted_timings, "STEPS", 30)  # enough steps for the rank table's test to decide
        planted_timings.plant(run, ranks=4, slow={FAST: 0.5, SLOW: 2.0}, train_ms=60.0)
    return run


@pytest.fixture(scope="module")
def tables(planted) -> tuple[pl.DataFrame, pl.DataFrame]:
    with open_store(planted) as con:
        rel = R.relative_busy(R.rank_steps(con, "run"))
    return rel, R.rank_table(rel)


def test_only_the_slower_rank_stands_out(tables):
    _, ranks = tables
    by_rank = {r["rank"]: r for r in ranks.iter_rows(named=True)}
    assert [r for r, row in by_rank.items() if row["slow"]] == [SLOW]
    # signed figures: the fast rank reads as faster, the slow one as slower, the others at the median
    assert by_rank[FAST]["score_pct"] < -10 < 10 < by_rank[SLOW]["score_pct"]
    assert abs(by_rank[0]["score_pct"]) < 5 and abs(by_rank[2]["score_pct"]) < 5


def test_the_page_names_only_the_slower_rank(tables):
    _, ranks = tables
    apart = R.apart_from_node(ranks.with_columns(pl.lit(None, pl.String).alias("host")),
                              R.node_table(ranks, pl.DataFrame(schema={"role": pl.String, "rank": pl.Int32,
                                                                       "host": pl.String})))
    apart = apart.with_columns(pl.format("rank {}", "rank").alias("rank_name"))
    said = slowest_said(apart)
    assert said.startswith(f"Slowest rank: rank {SLOW} ") and f"rank {FAST}" not in said
    # the "slowest ranks" table lists ranks above their role's median only
    assert FAST not in apart.filter(pl.col("score_pct") > 0)["rank"].to_list()
    # the distribution chart labels the ranks that stand out, as the page passes them
    shown = ranks.with_columns(pl.struct("role", "rank").map_elements(lambda r: label(r["role"], r["rank"], 1),
                                                                      return_dtype=pl.String).alias("name"))
    fig = charts.deviation_strip(shown, "score_pct", "role", "name", "t", "x",
                                 named=shown.filter(pl.col("slow"))["name"].to_list())
    assert [a.text for a in fig.layout.annotations] == [f"rank {SLOW}"]
    # and a page with nothing planted says so instead of naming the least fast rank
    assert slowest_said(apart.with_columns(pl.lit(False).alias("slow"))).startswith("No rank stands out")


def test_the_heat_map_draws_the_slow_rank_as_a_red_row(tables):
    rel, _ = tables
    # one wild cell, as a checkpoint or a page fault makes: rank 0 once 40× the step's median
    rel = rel.with_columns(pl.when((pl.col("rank") == 0) & (pl.col("step") == 7)).then(3900.0)
                           .otherwise(pl.col("rel_pct")).alias("rel_pct"))
    cells = R.heat_cells(rel, pl.DataFrame(schema={"role": pl.String, "rank": pl.Int32, "host": pl.String}), False)
    heat = charts.deviation_heatmap(cells, "t", "vs median").data[0]
    z, rows = np.asarray(heat.z, dtype=float), list(heat.y)
    slow, fast = z[rows.index(f"rank {SLOW}")], z[rows.index(f"rank {FAST}")]
    assert np.nanmax(z) > 10 * heat.zmax  # the planted single-cell outlier does not set the scale...
    assert np.nanmedian(slow) >= heat.zmax  # ...so the slow rank's row reaches the red end
    assert np.nanmedian(fast) < -0.3 * heat.zmax  # and the fast rank reads blue


def test_the_report_names_only_the_slower_rank(planted):
    found = ranked_findings(planted)
    named = found.filter(pl.col("finding").is_in(["straggler", "rank_cost"]))
    assert named.height >= 1 and all(s.startswith(f"rank {SLOW} ") for s in named["sentence"])
    assert not any(f"rank {FAST} " in s for s in found["sentence"].to_list())
