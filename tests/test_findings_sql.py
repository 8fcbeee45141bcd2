"""Every finding's SQL returns the finding's own numbers, on real runs.

The runs: the demo's quick run (a real SFT → GRPO training, probed), the planted runs the analysis tests
use, and planted runs here for what those lack (a rank slow in every phase, ranks unevenly fast, a loss
spike). Together they raise every kind of finding ``findings_text`` can say. Each finding's query runs the
way a user runs it, ``dynascope sql RUN "<sql>"``: a fresh read-only connection over the run directory.
"""

from __future__ import annotations

import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dashboard_fixtures import make_store

from dynascope.analyses.findings import collect_findings
from dynascope.analyses.findings_text import SENTENCES
from dynascope.store import RunWriter, open_store, run_sql

from helpers.cluster_truth import planted_cluster
from helpers.copy_run import copy_run
from helpers.planted_cluster import T0, write_async_run, write_synthetic_run
from helpers.planted_cluster import write_series as _write_series

# The numbers each finding's SQL must return (first row, same names).
GOODPUT = {"checkpoint_saves", "checkpoint_save_ms", "checkpoint_loads", "checkpoint_load_ms", "faults", "restarts"}
SERIES = {"step", "rank", "value"}
RETURNED = {
    "straggler": {"rank", "steps", "run_median_ms"}, "rank_cost": {"rank", "steps"}, "imbalance": {"steps"},
    "rollout_tail": {"steps", "tail_wait_ms", "step_ms", "tail_wait_pct", "median_tail_wait_ms"},
    "zero_variance_groups": {"groups", "zero_variance_groups", "wasted_samples", "zero_variance_pct"},
    "idle": {"idle_pct", "worst_rank", "worst_rank_idle_pct", "waited_for_rank", "waited_for_pct"},
    "slow_node": {"host", "ranks_count"}, "uninstrumented": {"uninstrumented_pct", "uninstrumented_ms"},
    "staleness": {"mean_staleness", "max_staleness"}, "async_overlap": {"weight_syncs", "weight_sync_ms"},
    "weight_sync": {"weight_syncs", "weight_sync_ms"}, "goodput": GOODPUT,
    "grad_norm_spike": SERIES, "loss_spike": SERIES, "entropy_collapse": SERIES, "nan_inf": SERIES,
    "mfu": {"tokens"}, "rank1_dominance": {"step", "rank1_energy", "tensors"},
    "update_sparsity": {"step_unchanged_frac_a", "step_unchanged_frac_b", "dtype", "bf16_changed_pct_a",
                        "bf16_changed_pct_b", "bf16_steps_a", "bf16_steps_b"},
    "probe_cost": {"steps", "probe_ms", "probe_pct", "recorded_steps", "coverage_pct"},
    "delta_sync": {"stage", "steps", "changed_pct", "delta_pct", "full_bf16_bytes"},
    "schedule": {"steps", "measured_step_ms", "rollout_ms", "weight_sync_ms"},
    "weight_sync_mismatch": {"syncs_checked", "mismatched_syncs", "first_step", "mismatched_tensors",
                             "tensors_checked", "message"},
    "logprob_gap": {"steps", "median_gap_nats", "max_gap_nats", "median_over_pct", "threshold_nats"},
    "kl_to_base": {"kl_sft_nats", "kl_final_nats", "kl_rl_base_nats", "steps", "drift_ratio", "bf16_changed_pct"},
    "gpu_idle": {"ranks", "mean_idle_pct", "worst_rank", "worst_rank_idle_pct", "idle_ms", "kernel_span_ms"},
    "clock_offset": {"ranks", "worst_rank", "worst_role", "offset_ms", "uncertainty_ms", "reference_rank"},
}
# Real multi-GPU Kineto traces (HTA's test data): the GPU-idle finding comes from imported GPU activity.
HTA_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "hta" / "trace_filter"
CLI = [sys.executable, "-c", "from dynascope.cli import app; app()"]  # the console script, without PATH
RANKS, STEPS = 4, 24
FORWARD, BACKWARD, OPTIMIZER, GAP, SYNC = 60.0, 120.0, 30.0, 50.0, 4.0  # ms


def _write_phases(run_dir: Path, slow: dict[tuple[int, int], float], loss_spike_at: int | None = None,
                  probe_ms: float = 0.0, clock_ms: dict[int, float] | None = None) -> Path:
    """A 4-rank synchronous run; ``slow[(step, rank)]`` scales that rank's busy phases in that step. A gap of
    GAP ms per step is left uninstrumented (``probe_ms`` of it is the probe's own phase, with a tensor row
    per rank and step); rank 0 syncs weights each step and logs a loss. ``clock_ms[rank]``: the clock offset
    from rank 0 that rank's probe measured (``probes.clocks``' event)."""
    rng = random.Random(1)
    writers = [RunWriter(run_dir, rank=r, world_size=RANKS, flush_secs=60) for r in range(RANKS)]
    for r, ms in (clock_ms or {}).items():
        writers[r].event("clock_offset", "planted", step=0, offset_us=ms * 1000, spread_us=40.0, reference_rank=0)
    t0 = T0
    for step in range(STEPS):
        busy = {r: {p: int(ms * 1000 * slow.get((step, r), 1.0) * (1 + rng.uniform(-0.002, 0.002)))
                    for p, ms in (("forward", FORWARD), ("backward", BACKWARD))} for r in range(RANKS)}
        top = max(sum(b.values()) for b in busy.values())
        for r in range(RANKS):
            d = {**busy[r], "allreduce": top - sum(busy[r].values()) + int(SYNC * 1000), "optimizer": int(OPTIMIZER * 1000)}
            if r == 0:
                d["weight_sync"] = 2000
            if probe_ms:
                d["dynascope"] = int(probe_ms * 1000)
                writers[r].append("tensor_stats", {"step": [step], "tensor": ["w"], "numel": [16],
                                                   "update_norm": [0.1]})
            t, rows = t0, {"phase": [], "start_us": [], "dur_us": [], "category": [], "step": step}
            for p, us in d.items():
                rows["phase"].append(p)
                rows["start_us"].append(t)
                rows["dur_us"].append(us)
                rows["category"].append("wait" if p == "allreduce" else "phase")
                t += us
            rows["phase"].append("step")
            rows["start_us"].append(t0)
            rows["dur_us"].append(top + int((SYNC + OPTIMIZER + GAP + 2) * 1000))
            rows["category"].append("step")
            writers[r].append("timings", rows)
        loss = 2.0 - 0.01 * step + 0.002 * rng.random() + (1.5 if step == loss_spike_at else 0.0)
        writers[0].append("scalars", {"step": step, "key": "loss", "value": loss, "time_us": t0})
        t0 += top + int((SYNC + OPTIMIZER + GAP + 2) * 1000)
    for w in writers:
        w.close()
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory, quick_demo) -> list[Path]:
    root = tmp_path_factory.mktemp("findings_sql")
    demo = copy_run(quick_demo[0], root / "demo")  # the session's quick demo, copied: we write beside it
    (demo / "demo_stdout.txt").write_text(quick_demo[1], encoding="utf-8")
    _write_series(root / "series")
    store = make_store(root / "store")
    planted = [
        write_synthetic_run(root / "straggler"), write_async_run(root / "async"), root / "series",
        # rank 3 is 1.2× slower in every busy phase: below the straggler score, but a whole rank's cost
        _write_phases(root / "rank_cost", {(s, 3): 1.2 for s in range(STEPS)}, loss_spike_at=15),
        # each step a different rank is 1.3× slower: no rank stands out, yet time is lost to the spread
        _write_phases(root / "imbalance", {(s, s % RANKS): 1.3 for s in range(STEPS)}, probe_ms=20.0,
                      clock_ms={0: 0.0, 1: 3.0, 2: -1250.5, 3: 40.0}),
    ]
    cluster, _ = planted_cluster(root / "cluster")  # 80 ranks on 10 hosts, one of them slow: a node finding
    traces = []
    if HTA_TRACE.is_dir():
        from dynascope.importers.trace import import_traces

        import_traces([HTA_TRACE], root / "kineto")
        traces.append(root / "kineto")
    return [demo, *planted, cluster, *sorted(p for p in store.iterdir() if p.is_dir()), *traces]


def _close(got, want) -> bool:
    """The SQL's value is the finding's number, or rounds to it as the finding rounds (2 or 3 decimals)."""
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return got is not None and (math.isclose(float(got), float(want), rel_tol=1e-3, abs_tol=5e-4)
                                    or float(want) in (round(float(got), 2), round(float(got), 3)))
    return got == want


def test_every_findings_sql_returns_its_numbers(runs):
    seen: dict[str, int] = {}
    for run_dir in runs:
        with open_store(run_dir) as con:
            # the cluster run has two roles timing steps: its MFU is the trainer's, over the samples' tokens once
            found, notes = collect_findings(con, peak_tflops=1.0)
        # Only analyses whose input a run lacks may be skipped: the planted runs record no bf16 S₁ column.
        assert not [n for n in notes if not n.startswith("mfu:") and "no bf16_unchanged_count" not in n], notes
        for f in found:
            with open_store(run_dir) as con:  # as `dynascope sql RUN "<sql>"` runs it: read-only, fresh
                rows = run_sql(con, f.sql).to_pylist()
            assert rows, (f.finding, f.sql)
            row = rows[0]
            want = RETURNED[f.finding]
            assert want <= set(row), (f.finding, set(row), f.sql)
            wrong = {k: (row[k], f.numbers[k]) for k in want if not _close(row[k], f.numbers[k])}
            assert not wrong, (run_dir.name, f.finding, wrong, f.sql)
            seen[f.finding] = seen.get(f.finding, 0) + 1
    expected = set(SENTENCES) - (set() if HTA_TRACE.is_dir() else {"gpu_idle"})
    assert set(seen) == expected, f"kinds never raised: {expected - set(seen)}"


def test_planted_rank_cost_and_imbalance(runs):
    by_name = {p.name: p for p in runs}
    found, _ = collect_findings(by_name["rank_cost"])
    cost = [f for f in found if f.finding == "rank_cost"]
    assert [f.numbers["rank"] for f in cost] == [3] and not [f for f in found if f.finding == "straggler"]
    # 1.2× of the 180 ms busy time, every step: the what-if saves ~36 ms of each ~302 ms step
    assert cost[0].numbers["saved_pct"] == pytest.approx(100 * 36 / (180 * 1.2 + SYNC + OPTIMIZER + GAP + 2), rel=0.05)
    assert "loss_spike" in {f.finding for f in found}
    spread = {f.finding for f in collect_findings(by_name["imbalance"])[0]}
    assert "imbalance" in spread and not spread & {"straggler", "rank_cost"}


def test_demo_runs_and_report_say_the_same_steps_and_shares(runs):
    demo = runs[0]
    printed = (demo / "demo_stdout.txt").read_text(encoding="utf-8")
    listed = subprocess.run([*CLI, "runs", str(demo)], capture_output=True, text=True, timeout=300, check=True).stdout
    report = subprocess.run([*CLI, "report", str(demo)], capture_output=True, text=True, timeout=300, check=True).stdout
    steps = int(re.search(r"(\d+) step\(s\)", report).group(1))
    header, row = (line.split("\t") for line in listed.splitlines()[:2])  # through a pipe: tab-separated values
    assert int(dict(zip(header, row, strict=True))["steps"]) == steps  # a final eval logged at step N is no step
    # Both print every phase's share with dynascope.core.fmt.fmt_pct: the same share reads the same.
    rollout = re.search(r"│ rollout\s+│[^│]+│\s+([\d.]+%)", printed).group(1)
    rl_line = next(line for line in report.splitlines() if line.startswith("  step time, rl "))
    assert f"rollout {rollout}" in rl_line, (rollout, rl_line)


def test_a_kineto_trace_report_names_its_gpu_idle_time(runs):
    """The report on an imported trace says how idle the GPUs were, as temporal_breakdown measures it."""
    if not HTA_TRACE.is_dir():
        pytest.skip(f"shared trace fixtures not found at {HTA_TRACE}")
    from dynascope.analyses import temporal_breakdown

    kineto = [p for p in runs if p.name == "kineto"][0]
    (f,) = [f for f in collect_findings(kineto)[0] if f.finding == "gpu_idle"]
    tb = temporal_breakdown(kineto)
    assert f.numbers["mean_idle_pct"] == pytest.approx(tb["idle_time_pct"].mean(), abs=0.01)
    assert f.numbers["worst_rank_idle_pct"] == pytest.approx(tb["idle_time_pct"].max(), abs=0.01)
    assert f"the GPUs sat idle {tb['idle_time_pct'].mean():.1f}%" in f.sentence
