"""Sharded runs' windows (``probes.window.Window`` over shards): ranks that measure different times still
take the same window at shared records, every window of the rotation comes round, drift comes to each
window and every rank agrees when, and the windows keep to the time budget. Unsharded tensors keep the
free-running rotation. One process, one rank: the ranks' agreement on the period (``probes.agreement``) is
held on two gloo ranks in tests/test_deepspeed.py."""

from __future__ import annotations

import math

import pytest

from helpers.windows import N, simulate


def test_ranks_with_different_clocks_agree_where_both_take_a_window() -> None:
    a = simulate([0.05] * 800)  # 5 records of budget per window: period 8
    b = simulate([0.05 * (1 + 0.8 * math.sin(k / 40)) for k in range(800)])  # period 2 to 16
    by_record = {k: (w, d) for k, w, d in a}
    shared = [(k, w, d) for k, w, d in b if k in by_record]
    assert len(shared) >= len(a) // 4  # the records of the coarser period are shared
    for k, w, d in shared:
        assert by_record[k] == (w, d), k  # the same tensors, and drift or not, on both ranks
    assert len(b) > len(a)  # b's cheaper stretches took more windows, all within its own budget


@pytest.mark.parametrize("cost", [0.005, 0.03, 0.05, 0.2])
def test_every_window_comes_round_within_the_budget(cost: float) -> None:
    taken = simulate([cost] * 800)
    windows = {w for _, w, _ in taken}
    assert set().union(*windows) == set(range(N))
    spent = cost * len(taken)
    assert spent <= 0.01 * 800 * 1.1  # the windows' time over the run: within the budget's share
    assert spent >= 0.01 * 800 * 0.3 or cost * 800 <= 0.01 * 800  # and not starved far below it
    drifted = {w for _, w, d in taken if d}
    assert drifted == windows  # drift comes to every window (drift_every made odd, the period a power of two)


def test_without_a_time_budget_every_record_takes_the_next_window() -> None:
    taken = simulate([100.0] * 5, budget=None, records=5)
    assert [w for _, w, _ in taken] == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9,), (0, 1, 2)]


def test_unsharded_tensors_rotate_from_the_cursor_under_the_time_debt() -> None:
    """Without shards the window runs on: each starts where the last one ended (wrapping round), and the
    time budget takes one whenever the time spent is paid back."""
    taken = simulate([0.05] * 40, records=40, sharded=False)
    assert [w for _, w, _ in taken[:4]] == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 1, 9)]
    assert [k for k, _, _ in taken[:3]] == [0, 5, 10]  # 0.05 s at 1% of 1 s a record: every 5th
