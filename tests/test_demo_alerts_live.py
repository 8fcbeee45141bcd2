"""`dynascope demo --alerts`: the default rules judged while the real demo workload trains.

A rank slowed from the first RL step on fires the straggler rule for its rollout, and a gradient spike
planted at one RL step fires the gradient-norm rule at that step, while the run is still training, each
within two of the writer's flushes of the step it names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynascope import open_store
from dynascope.alerts import DEFAULT_RULES
from dynascope.alerts.monitor import DUTY

from helpers.demo_cli import run_cli

pytestmark = pytest.mark.slow
FLUSH_S = 2.0  # the demo's flush interval with --alerts
INTERVAL_S = 1.0  # the demo's alert interval: the monitor's wait between passes, unless a slow pass spaces it out
PASS_S = 5.0  # the least allowance for the monitor's next pass after the rows land
SPIKE = 22  # the RL step whose gradients the demo scales ×10⁴ (past the default rule's 20-step hold-down
            # from an alert at the SFT → RL switch, where the gradient norm jumps by itself)


def test_a_slow_rank_fires_its_alert_while_the_demo_trains(tmp_path: Path) -> None:
    run = tmp_path / "live"
    # a factor of 6 on one of two ranks: the rollout's score is near 0.6, clear of the 0.75 threshold (see
    # test_demo's two-rank test for why 3 is not)
    out = run_cli("demo", "--quick", "--ranks", "2", "--slow-rank", "1", "--slow-factor", "6", "--alerts",
                  "--spike-step", str(SPIKE), "--run", str(run)).stdout
    window = next(r.window for r in DEFAULT_RULES if r.quantity == "straggler_score")
    with open_store(run) as con:
        alerts = [(t, {**json.loads(f), "step": step}) for t, step, f in con.rows(
            "SELECT time_us, step, fields_json FROM events WHERE event = 'alert' ORDER BY time_us")]
        first_rl, = con.rows("SELECT min(step) FROM timings WHERE rank = 1 AND phase = 'rollout'")[0]
        ends = dict(con.rows("SELECT step, start_us + dur_us FROM timings WHERE rank = 1 AND phase = 'step'"))
        spans = con.rows("SELECT step, start_us + dur_us FROM timings WHERE rank = 1")
        last_end, = con.rows("SELECT max(start_us + dur_us) FROM timings WHERE phase = 'step'")[0]
        (summary,), = con.rows("SELECT fields_json FROM events WHERE event = 'monitor_closed'")
    summary = json.loads(summary)
    slow = [(t, f) for t, f in alerts if f["quantity"] == "straggler_score" and f.get("part") == "rollout"]
    assert slow and {f["rank"] for _, f in slow} == {1}, alerts
    fired_us, f = slow[0]
    # not before the rule's window of slow rollouts has filled (on a busy host a rollout of rank 0's can run
    # long enough to break the first run of five: the test_demo two-rank test holds the step on a quiet one)
    assert first_rl + window - 1 <= f["step"], (f, first_rl)
    # live: before the last step ended, and within two flushes of the time the step it names was complete (its
    # rows, and the first of its rank's rows of a later step, which tell the monitor so) and the monitor's next
    # pass: the pass under way when the rows land, the wait after it (a second, or more to keep the thread
    # busy a fifth of the time at most) and the pass that fires. The monitor's own account gives its slowest
    # pass: on a host whose cores training fills, its niced thread runs slower.
    slowest_s = summary["slowest_pass_ms"] / 1e3
    lag_s = max(PASS_S, max(INTERVAL_S, slowest_s * (1 - DUTY) / DUTY) + 2 * slowest_s)
    bound_us = (2 * FLUSH_S + lag_s) * 1e6
    assert fired_us < last_end, (fired_us, last_end)
    later = [end for step, end in spans if step > f["step"]]
    assert later, f"the alert names rank 1's last step, {f['step']}: not live"
    complete_us = max(ends[f["step"]], min(later))
    assert fired_us - complete_us <= bound_us, ((fired_us - complete_us) / 1e6, summary)
    # the planted spike: the gradient-norm rule names its step within the same bound of the step's end (a
    # detector judges a step without waiting for a later one; this quick run's RL ends a few seconds after
    # the step, so the pass that finds it may be the one at close)
    planted = first_rl + SPIKE
    spiked = [(t, f) for t, f in alerts if f["quantity"] == "grad_norm_spike" and f["step"] == planted]
    assert spiked, [f for _, f in alerts if f["quantity"] == "grad_norm_spike"]
    assert spiked[0][0] - ends[planted] <= bound_us, (spiked[0][0] - ends[planted]) / 1e6
    assert "Alerts judged live:" in out and "straggler rank: straggler_score = " in out, out
