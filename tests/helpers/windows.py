"""Windows planned by one rank against a planted clock (``probes.window.Window`` over stand-in shards):
each window costs what the caller says, records come ``interval`` seconds apart. Used by
tests/test_probe_windows.py in one process and by tests/helpers/deepspeed_worker.py on each gloo rank."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

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


def simulate(cost: list[float], interval: float = 1.0, budget: float | None = 0.01, records: int = 800,
             drift_every: int = 4, sharded: bool = True, agreement: Any = None
             ) -> list[tuple[int, tuple[int, ...], bool]]:
    """(record, window, drift due) of every window one rank takes, its windows costing ``cost[k]`` seconds.
    ``agreement``: how the ranks agree on the period (``probes.agreement.RankMax`` when None)."""
    clock = Clock()
    real, time.perf_counter = time.perf_counter, clock  # the window's clock; RankMax waits by time.monotonic
    try:
        win = Window(0.4, budget, drift_every, lambda e: 4 * e, agreement)
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
    finally:
        time.perf_counter = real
