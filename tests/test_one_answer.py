"""One question, one answer: what a slow rank costs, how many steps a run has and what share rollout takes
read the same in the report, the dashboard's query functions and ``dynascope fleet``, each saying what it
covers.

The run: four ranks written through the real writer (tests/helpers/fleet_runs.py), a third SFT and the rest
RL with a rollout phase, rank 3 three times slower.
"""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl
import pytest

from dynascope.analyses import phase_shares, what_if
from dynascope.analyses.findings import collect_findings
from dynascope.analyses.fleet import fleet_summary
from dynascope.analyses.rollouts import ROLLOUT_PHASES
from dynascope.core.fmt import fmt_ms, fmt_pct
from dynascope.dashboard.queries import ranks as R
from dynascope.report import build_report, render
from dynascope.store import open_store
from dynascope.store.catalog import list_runs
from dynascope.store.snapshot import snapshot

from helpers.fleet_runs import write_synthetic_run

SLOW = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return write_synthetic_run(tmp_path_factory.mktemp("one_answer") / "run", ranks=4, steps=30, slow=3.0)


def _fleet(run: Path) -> dict:
    """``dynascope fleet``'s row for the run, read as the CLI reads it: under a lease against compaction."""
    with snapshot(run, lease_ttl_s=600, holder="test") as snap:
        return fleet_summary(snap).row(0, named=True)


@pytest.fixture(scope="module")
def report(run) -> str:
    return " ".join(render(build_report(run), "text").split())


def _dashboard_ranks(con, run_id: str) -> pl.DataFrame:
    """The Cluster page's per-rank table as its Stragglers section builds it: the rank table joined with the
    one what-if call it shares with the report."""
    table = R.rank_table(R.relative_busy(R.rank_steps(con, run_id)))
    return R.with_rank_costs(table, what_if(con, run_id, by_phase=True))


def test_what_if_savings_read_the_same(run, report):
    """"What if rank 3 ran at the median": the report's sentence, the Stragglers table and the What-if table."""
    with open_store(run) as con:
        run_id = con.rows("SELECT DISTINCT run_id FROM timings")[0][0]
        found, _ = collect_findings(con, run_id)
        wif = what_if(con, run_id, by_phase=True)
        ranks = _dashboard_ranks(con, run_id)
    whole = wif.filter(pl.col("scenario") == f"rank {SLOW}").row(0, named=True)
    strag = [f for f in found if f.finding == "straggler" and f.numbers["rank"] == SLOW]
    assert strag and {f.numbers["rank"] for f in found if f.finding in ("straggler", "rank_cost")} == {SLOW}
    for f in strag:  # one per slow phase: its own phase's figure, and the whole rank's, the same in each
        n = f.numbers
        phase = wif.filter(pl.col("scenario") == f"rank {SLOW} {n['whatif_phase']}").row(0, named=True)
        assert n["saved_pct"] == pytest.approx(phase["saved_pct"], rel=1e-5)
        assert n["rank_saved_pct"] == pytest.approx(whole["saved_pct"], rel=1e-5)
        assert n["rank_saved_ms"] == pytest.approx(whole["saved_ms"], rel=1e-5)
        # the report says both figures, each with what it covers, as fmt_pct and fmt_ms write them
        said = (f"making its {n['whatif_phase']} median would cut step time {fmt_pct(n['saved_pct'])}"
                f" ({fmt_ms(n['saved_ms'])} over {n['whatif_steps']} steps); the whole rank at the median, "
                f"{fmt_pct(n['rank_saved_pct'])} ({fmt_ms(n['rank_saved_ms'])})")
        assert said in f.sentence and said in report
        # a whole rank's saving differs from its slow phase's: the words tell the two apart
        assert whole["saved_ms"] > phase["saved_ms"] > 0
    row = ranks.filter(pl.col("rank") == SLOW).row(0, named=True)
    assert row["whatif_saved_pct"] == whole["saved_pct"] and row["whatif_saved_ms"] == whole["saved_ms"]
    # ranks at the median cost nothing, in every surface
    assert ranks.filter(pl.col("rank") != SLOW)["whatif_saved_pct"].abs().max() < 0.5


def test_step_counts_read_the_same(run, report):
    """`runs`, the report's header, the dashboard's rank table and stage shares, and fleet: one count."""
    with open_store(run) as con:
        run_id = con.rows("SELECT DISTINCT run_id FROM timings")[0][0]
        ranks = _dashboard_ranks(con, run_id)
        shares = phase_shares(con, run_id)
    steps = list_runs(run).row(0, named=True)["steps"]
    assert steps == 30
    assert f"run {run_id}: 4 rank(s), {steps} step(s)" in report
    assert set(ranks["steps"].to_list()) == {steps}
    assert shares.unique(["role", "stage"])["steps"].sum() == steps
    assert _fleet(run)["steps"] == steps


def test_rollout_share_says_what_it_covers(run, report):
    """The report gives RL's share (phase_shares' RL stage); fleet's column says it covers every step, and
    is phase_shares over every stage. The two differ on a run with an SFT stage, so the label matters."""
    with open_store(run) as con:
        shares = phase_shares(con)
    rl = shares.filter(pl.col("stage") == "rl")
    rl_share = rl.filter(pl.col("phase").is_in(ROLLOUT_PHASES))["share_pct"].sum()
    line = re.search(r"step time, rl \(\d+ steps\): ([^;]*?)(?= step time,| Findings)", report)
    assert line and f"rollout {fmt_pct(rl_share)}" in line.group(1)
    fleet = _fleet(run)
    assert "rollout_pct" not in fleet  # the unlabelled column is gone
    every = shares.unique(["role", "stage"])["step_ms"].sum()
    assert fleet["all_steps_rollout_pct"] == pytest.approx(
        100 * shares.filter(pl.col("phase").is_in(ROLLOUT_PHASES))["dur_ms"].sum() / every, rel=1e-9)
    assert fmt_pct(fleet["all_steps_rollout_pct"]) != fmt_pct(rl_share) and fleet["all_steps_rollout_pct"] < rl_share
