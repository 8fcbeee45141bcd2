"""Sharded runs' windows (``probes.window.Window`` over shards): ranks that measure different times still
take the same window at shared records, every window of the rotation comes round, drift comes to each
window and every rank agrees when, and the windows keep to the time budget. Unsharded tensors keep the
free-running rotation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from dynascope.probes import window as window_mod
from dynascope.probes.window import Window

N = 10  # ten tensors of 1,000 bytes under a 0.4 budget: windows of three, 4 windows made 5 (odd)


@dataclass
class Shard:
    """What the window reads of a tracked tensor: its name, budget size, whether it is a shard, its data."""

    name: str
    sharded: bool = True
    nbytes: int = 1000

    def local(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.float32)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(cost: list[float], monkeypatch: pytest.MonkeyPatch, interval: float = 1.0, budget: float = 0.01,
             records: int = 800, drift_every: int = 4, sharded: bool = True
             ) -> list[tuple[int, tuple[int, ...], bool]]:
    """(record, window, drift due) of every window one rank takes, its windows costing ``cost[k]`` seconds."""
    clock = Clock()
    monkeypatch.setattr(window_mod.time, "perf_counter", clock)
    win = Window(0.4, budget, drift_every, lambda e: 4 * e)
    tracked = [Shard(f"t{i}", sharded) for i in range(N)]
    taken = []
    for k in range(records):
        clock.now = k * interval
        win.tick()
        window = win.next(tracked)  # type: ignore[arg-type]
        if window:
            taken.append((k, tuple(window), win.drift_due(tracked[window[0]].name)))
            clock.now += cost[k]
            win.charge(k * interval)
    return taken


def test_ranks_with_different_clocks_agree_where_both_take_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    a = simulate([0.05] * 800, monkeypatch)  # 5 records of budget per window: period 8
    b = simulate([0.05 * (1 + 0.8 * math.sin(k / 40)) for k in range(800)], monkeypatch)  # period 2 to 16
    by_record = {k: (w, d) for k, w, d in a}
    shared = [(k, w, d) for k, w, d in b if k in by_record]
    assert len(shared) >= len(a) // 4  # the records of the coarser period are shared
    for k, w, d in shared:
        assert by_record[k] == (w, d), k  # the same tensors, and drift or not, on both ranks
    assert len(b) > len(a)  # b's cheaper stretches took more windows, all within its own budget


@pytest.mark.parametrize("cost", [0.005, 0.03, 0.05, 0.2])
def test_every_window_comes_round_within_the_budget(cost: float, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = simulate([cost] * 800, monkeypatch)
    windows = {w for _, w, _ in taken}
    assert set().union(*windows) == set(range(N))
    spent = cost * len(taken)
    assert spent <= 0.01 * 800 * 1.1  # the windows' time over the run: within the budget's share
    assert spent >= 0.01 * 800 * 0.3 or cost * 800 <= 0.01 * 800  # and not starved far below it
    drifted = {w for _, w, d in taken if d}
    assert drifted == windows  # drift comes to every window (drift_every made odd, the period a power of two)


def test_without_a_time_budget_every_record_takes_the_next_window(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = simulate([100.0] * 5, monkeypatch, budget=None, records=5)  # type: ignore[arg-type]
    assert [w for _, w, _ in taken] == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9,), (0, 1, 2)]


def test_unsharded_tensors_rotate_from_the_cursor_under_the_time_debt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without shards the window runs on: each starts where the last one ended (wrapping round), and the
    time budget takes one whenever the time spent is paid back."""
    taken = simulate([0.05] * 40, monkeypatch, records=40, sharded=False)
    assert [w for _, w, _ in taken[:4]] == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 1, 9)]
    assert [k for k, _, _ in taken[:3]] == [0, 5, 10]  # 0.05 s at 1% of 1 s a record: every 5th
