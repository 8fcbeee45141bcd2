"""A rank faster than the median is never a straggler, and a phase whose differences are within its
step-to-step noise flags nobody: on a planted 4-rank run only the slow rank is named, by the report and by
the dashboard's per-phase straggler table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

import dynascope.analyses.findings as findings
import dynascope.analyses.stragglers as stragglers

from helpers.planted_timings import write_phase_rows

STEPS = 40
# Per phase: each rank's typical duration (ms) and the step-to-step jitter (robust σ, ms). In "train" rank 1
# is faster and rank 3 slower; in "short" every rank is within the phase's noise, yet rank 1's median is
# under 0.75 of the slowest's, which scored as a straggler against the fastest rank.
PHASES = {"train": ([100.0, 70.0, 100.0, 150.0], 1.0), "short": ([6.4, 4.8, 6.2, 6.5], 1.5)}
SLOW, FAST = 3, 1


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("false_stragglers") / "run"
    rng = np.random.default_rng(11)
    # drawn in (rank, step, phase) order, as the rows are written
    return write_phase_rows(run_dir, list(PHASES), 4, STEPS, lambda r, _, p: PHASES[p][0][r] + PHASES[p][1] * rng.standard_normal(),
                            step_us=10**6)


def test_only_the_slower_rank_is_a_straggler(planted):
    df = stragglers.straggler_scores(planted)
    flagged = df.filter(pl.col("status") != "ok")
    assert flagged.select("rank", "phase").rows() == [(SLOW, "train")]
    fast = df.filter((pl.col("rank") == FAST) & (pl.col("phase") == "train")).row(0, named=True)
    assert fast["median_ms"] < fast["cross_rank_median_ms"] and fast["status"] == "ok"
    short = df.filter(pl.col("phase") == "short")
    assert short["noise_ms"][0] == pytest.approx(1.5, rel=0.4)  # measured from the data, not assumed
    # Without the floors the short phase's small differences count again (rank 1 stays out: it is fast).
    bare = stragglers.straggler_scores(planted, noise_k=0, min_effect_ms=0, baseline="median", threshold=0.99)
    assert bare.filter((pl.col("phase") == "short") & (pl.col("status") != "ok")).height >= 1
    assert bare.filter(pl.col("rank") == FAST)["status"].to_list() == ["ok", "ok"]
    with pytest.raises(ValueError, match="noise_k"):
        stragglers.straggler_scores(planted, noise_k=-1)


def test_the_report_names_only_the_slower_rank(planted):
    found = findings.ranked_findings(planted)
    strag = found.filter(pl.col("finding") == "straggler")
    assert strag.height == 1
    assert strag["sentence"][0].startswith(f"rank {SLOW} (trainer) is ")
    assert not any(s.startswith(f"rank {FAST} ") for s in found["sentence"].to_list())


def test_the_live_alert_shares_the_noise_floor(planted):
    """The live straggler rule judges each step with the same floor as ``straggler_scores``: a rank within
    the phase's noise scores 1 but for rare jitter, a faster rank always, and only the slow rank fires."""
    from dynascope.alerts import DEFAULT_RULES, Monitor
    from dynascope.alerts.quantities import series
    from dynascope.store import open_store

    with open_store(planted) as con:
        # one series per phase: a rank's score at a step is its slowest phase's
        df = series(con, "straggler_score", 0).group_by("rank", "step").agg(pl.col("value").min())
    slow, others = df.filter(pl.col("rank") == SLOW), df.filter(~pl.col("rank").is_in([SLOW]))
    assert (slow["value"] < 0.75).all() and slow["value"].median() == pytest.approx(100 / 150, rel=0.05)
    # a step's jitter beyond twice the noise still scores under 1 now and then (a 2σ gate lets ~2% through),
    # never five steps running; the fast rank never
    assert others.filter(pl.col("value") < 1.0).height <= 0.1 * others.height, others.filter(pl.col("value") < 1)
    assert (df.filter(pl.col("rank") == FAST)["value"] == 1.0).all()
    fired = Monitor(planted, [r for r in DEFAULT_RULES if r.quantity == "straggler_score"]).poll(final=True)
    assert {f.rank for f in fired} == {SLOW}


def test_the_probe_phase_is_no_straggler_anywhere(tmp_path: Path) -> None:
    """Rank 0 runs the live monitor, so its probe phase can be 3x the others' on a busy host: that is
    ``probe_cost``'s to report. The analysis, the live rule and the fleet summary all leave it out."""
    from dynascope.alerts.quantities import series
    from dynascope.analyses import PROBE_PHASE
    from dynascope.analyses.fleet import fleet_summary
    from dynascope.store import open_store

    rng = np.random.default_rng(5)
    ms = {"train": [100.0] * 4, PROBE_PHASE: [30.0, 10.0, 10.0, 10.0]}
    run = write_phase_rows(tmp_path / "run", list(ms), 4, STEPS, lambda r, _, p: ms[p][r] + 0.5 * rng.standard_normal(),
                           step_us=10**6)
    df = stragglers.straggler_scores(run)
    assert df["phase"].to_list() != [] and PROBE_PHASE not in df["phase"].to_list()
    assert df.filter(pl.col("status") != "ok").height == 0
    with open_store(run) as con:
        live = series(con, "straggler_score", 0)
    assert live.height > 0 and PROBE_PHASE not in live["part"].unique().to_list()
    assert fleet_summary(run)["slowest_phase"].to_list() == ["train"]
    # the same run with the phase under another name: rank 0 is named, so the rule above is what left it out
    ms["other"] = ms.pop(PROBE_PHASE)
    renamed = write_phase_rows(tmp_path / "renamed", list(ms), 4, STEPS,
                               lambda r, _, p: ms[p][r] + 0.5 * rng.standard_normal(), step_us=10**6)
    assert stragglers.straggler_scores(renamed).filter(pl.col("status") != "ok").select("rank", "phase").rows() == [(0, "other")]
