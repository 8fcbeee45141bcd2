"""`dynascope demo` end to end: the real CLI in a subprocess, then the run's store read back.

Each test trains for real (SFT → GRPO on CPU) in --quick mode; assertions are about what the store and
the analyses say, never about wall-clock speed.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from dynascope import analyses, open_store
from dynascope.alerts import DEFAULT_RULES, Monitor
from dynascope.alerts.quantities import series

from helpers.demo_cli import run_cli


def scalar(con, key: str, stage: str) -> float:
    rows = con.rows(f"SELECT value FROM scalars WHERE key = '{key}' AND stage = '{stage}' "
                    "ORDER BY step DESC, time_us DESC LIMIT 1")
    assert rows, f"no {key} scalar in stage {stage}"
    return rows[0][0]


def one(con, sql: str) -> tuple:
    """The first row of a query. ``rows`` runs it again if a file vanished meanwhile: the run's fold at
    rest (``store.at_rest``) is deleting what it merged while these queries run."""
    return con.rows(sql)[0]


def rl_start(con) -> int:
    (step,) = one(con, "SELECT min(step) FROM events WHERE event = 'stage'")
    assert step is not None, "no 'stage' event marking the start of RL"
    return step


def test_quick_demo_single_process(quick_demo: tuple[Path, str]) -> None:
    run, out = quick_demo
    assert f"dynascope dashboard {run}" in out.replace("\n", "")
    assert "Reward (held-out prompts" in out and "Where RL step time went" in out

    with open_store(run) as con:
        start = rl_start(con)
        # Reward rises: held-out greedy accuracy after RL beats the SFT policy RL started from.
        before, after = scalar(con, "eval/accuracy", "sft"), scalar(con, "eval/accuracy", "rl")
        assert 0.0 < before < 0.9, f"SFT should leave the policy partly right, got {before}"
        assert after > before, (before, after)
        for table in ("tensor_stats", "scalars"):
            stages = dict(con.rows(f"SELECT stage, count(*) FROM {table} GROUP BY stage"))
            assert stages.get("sft", 0) > 0 and stages.get("rl", 0) > 0, (table, stages)
        # timings have no stage column: split them at the step where RL began.
        sft_t, rl_t = one(con, f"SELECT count(*) FILTER (step < {start}), count(*) FILTER (step >= {start}) "
                              "FROM timings")
        assert sft_t > 0 and rl_t > 0
        phases = {p for (p,) in con.rows(f"SELECT DISTINCT phase FROM timings WHERE step >= {start}")}
        assert {"rollout", "reward", "ref_logprob", "train", "weight_sync"} <= phases, phases
        # samples are RL rollouts (SFT has demonstrations, not generations), with lengths and groups.
        n, groups, lens = one(con, "SELECT count(*), count(DISTINCT group_id), count(DISTINCT response_len) "
                                  f"FROM samples WHERE step >= {start} AND gen_end_us >= gen_start_us")
        assert n > 0 and groups > 1 and lens > 1
        keys = {k for (k,) in con.rows("SELECT DISTINCT key FROM scalars WHERE stage = 'rl'")}
        assert {"rl/kl", "rl/entropy", "rl/clip_frac", "rl/reward"} <= keys
        assert one(con, "SELECT count(*) FROM spectra WHERE stage = 'rl'")[0] > 0

        cmp = analyses.sparsity_comparison(con, "sft", "rl").filter(pl.col("kind") == "all").row(0, named=True)
    sft_changed, rl_changed = 1 - cmp["step_unchanged_frac_a"], 1 - cmp["step_unchanged_frac_b"]
    assert "changed per step, bit-exact" in out and "changed in bf16 per step (1 − PULSE S₁)" in out
    if sft_changed <= rl_changed:
        # fp32 Adam moves every weight with gradient history: the report must say why, and where to look instead.
        text = out.replace("\n", " ")
        assert "These updates are dense because" in text and "dynascope demo --model smollm2" in text
    assert (run / "theta0_sft.safetensors").exists() and (run / "policy_rank1.safetensors").exists()


@pytest.mark.slow
def test_torchrun_two_ranks_names_the_slow_rank(tmp_path: Path) -> None:
    run = tmp_path / "ddp"
    # Of two ranks the median is their mean: a rank f times slower scores (1 + f) / 2f, under 0.75 only for
    # f > 2. Rollout is more than the forwards SlowDevice repeats, so a factor of 3 lands near 2.3 and at
    # the threshold on a busy host, where each rank's rollout also varies with its own samples' lengths;
    # 6 lands near 4.5 (a score near 0.6), clear of both.
    out = run_cli("demo", "--quick", "--ranks", "2", "--slow-rank", "1", "--slow-factor", "6", "--run", str(run)).stdout
    with open_store(run) as con:
        ranks = {r for (r,) in con.rows("SELECT DISTINCT rank FROM timings")}
        assert ranks == {0, 1}
        comm = one(con, "SELECT count(*) FROM timings WHERE phase = 'grad_allreduce' AND category = 'comm'")
        assert comm[0] > 0
        scores = analyses.straggler_scores(con).filter(pl.col("phase") == "rollout").sort("score")
    worst = scores.row(0, named=True)
    assert worst["rank"] == 1 and worst["status"] != "ok", scores
    assert "Slowest rank: rank 1" in out.replace("\n", " ")
    # The default straggler rule over the same workload's rows names the slow rank in the slowed phase, as
    # soon as its window has filled (the monitor a live run starts judges these rows as they land), and
    # never the other rank there. Both ranks share this host's two cores, so rank 0's own compute after its
    # rollout runs beside rank 1's extra rollout work and is really slower than rank 1's, which runs while
    # rank 0 waits in the all-reduce: the rule may name rank 0 in such a phase, never in the rollout.
    rule = [r for r in DEFAULT_RULES if r.quantity == "straggler_score"]
    fired = Monitor(run, rule).poll(final=True)
    slowed = [f for f in fired if f.part == "rollout"]
    assert slowed and {f.rank for f in slowed} == {1}, fired
    # It fires where the rank's rollout scores first stay under the threshold for a whole window: a streak
    # re-counted here over the series the rule reads. On a loaded host one step's rollout on rank 0 can be
    # descheduled enough to score rank 1 above 0.75 and restart the streak, so the streak is allowed to
    # begin a few steps late, but the slow rank must read slow on most of its rollout steps.
    with open_store(run) as con:
        first, last = one(con, "SELECT min(step), max(step) FROM timings WHERE rank = 1 AND phase = 'rollout'")
        scores = series(con, "straggler_score").filter((pl.col("rank") == 1) & (pl.col("part") == "rollout"))
    window = rule[0].window
    streak, expected = 0, None
    for step, value in scores.sort("step").select("step", "value").iter_rows():
        streak = streak + 1 if rule[0].holds(value) else 0
        if streak >= window:
            expected = step
            break
    below = scores.filter(pl.col("value") < 0.75).height / max(scores.height, 1)
    assert below >= 0.8, scores
    assert min(f.step for f in slowed) == expected, (fired, scores)
    assert first + window - 1 <= expected <= first + 3 * window < last, (fired, first, last, scores)


@pytest.mark.slow
def test_ray_async_records_staleness(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    run = tmp_path / "async"
    out = run_cli("demo", "--quick", "--async", "--run", str(run), timeout=500).stdout
    with open_store(run) as con:
        roles = {r for (r,) in con.rows("SELECT DISTINCT role FROM timings")}
        assert roles == {"trainer", "rollout"}
        stale = analyses.async_staleness(con)
        assert stale["staleness_steps"].max() > 0, stale
        assert stale["staleness_steps"].min() >= 0
        syncs = one(con, "SELECT count(*) FROM timings WHERE phase = 'weight_sync' AND role = 'rollout'")[0]
        assert syncs > 1
    assert "Async: mean staleness" in out
