"""The rotating window: which tensors get the windowed statistics at a record, within two budgets.

Memory: ``memory_budget`` is the share of parameter bytes the probe may hold at its peak, i.e. the
window's pre-step snapshot plus one chunk's temporaries (θ₀ and the S_k snapshot, when resident, count
against it first). At the default 0.1 each tensor gets the full set every ~13 windows; ``memory_budget
>= 2`` (θ₀ resident + a full snapshot) or None gives every statistic for every tensor at every record.

Time: ``time_budget`` is the share of wall-clock step time the windows may take: a window is taken only
while their measured host time stays under that share of the time since the previous record, so on a
small or fast model the full set comes less often instead of slowing every step. None lifts it.

Drift, the costliest part of a window (θ₀ is read back), comes at every ``drift_every``-th window a tensor
is in, so drift is refreshed once per ``drift_every`` rotations.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from dynascope.probes.params import Tracked
from dynascope.stats.engine import DEFAULT_CHUNK_ELEMS

__all__ = ["MIN_CHUNK_ELEMS", "RESERVE", "Window"]

# Share of the budget a window's snapshot leaves to one chunk's temporaries (ΔW, masks, θ₀'s chunk).
# The chunk is sized from whatever the snapshot leaves over, so a tensor alone in its window (often the
# embedding: ~10% of a small model) may take more than 1 − RESERVE and still fit. A larger reserve means
# larger chunks, i.e. fewer op launches per byte, at the price of more windows per rotation.
RESERVE = 1 / 4
MIN_CHUNK_ELEMS = 1024


class Window:
    """Plans the windows of one probe: ``plan(tracked, resident)`` → the next window's tensor indices,
    and ``chunk``, the chunk size its statistics run in. ``per_elem(element_size)``: bytes of temporaries
    per chunk element (the largest declared statistic's)."""

    def __init__(self, memory_budget: float | None, time_budget: float | None, drift_every: int,
                 per_elem: Callable[[int], int]) -> None:
        self.memory_budget = memory_budget
        self.time_budget = None if memory_budget is None else time_budget
        self.drift_every = int(drift_every)
        self.per_elem = per_elem
        self.cursor = 0
        self.chunk: int | None = DEFAULT_CHUNK_ELEMS  # chunk size of the last planned window
        self._debt_s = 0.0  # window time spent beyond what time_budget × elapsed time allows
        self._last_t: float | None = None
        self._drift_visits: dict[str, int] = {}  # tensor name → windows it has been in

    def budget_bytes(self, tracked: list[Tracked], resident: float = 0.0) -> float:
        """Bytes the windowed statistics may hold at peak: snapshot + one chunk's temporaries, less the
        ``resident`` bytes θ₀ and the S_k snapshot take."""
        if self.memory_budget is None:
            return math.inf
        return self.memory_budget * sum(t.nbytes for t in tracked) - resident

    def tick(self) -> None:
        """Earn back window time: ``time_budget`` of the wall time since the previous record."""
        now = time.perf_counter()
        if self._last_t is not None and self.time_budget is not None:
            elapsed = now - self._last_t
            self._debt_s = max(self._debt_s - self.time_budget * elapsed, -self.time_budget * elapsed)
        self._last_t = now

    def charge(self, t0: float) -> None:
        """Count the time since ``t0`` (``time.perf_counter``) against the time budget."""
        self._debt_s += time.perf_counter() - t0

    @property
    def open(self) -> bool:
        """Whether the time budget allows a window now."""
        return self.time_budget is None or self._debt_s <= 0

    def plan(self, tracked: list[Tracked], resident: float = 0.0) -> list[int]:
        """Next window and the chunk size of its statistics.

        A budget that holds every tensor (``memory_budget >= 2`` with θ₀ resident, or None) takes them
        all, in chunks of ``DEFAULT_CHUNK_ELEMS``. Otherwise tensors from the rotating cursor join while
        their snapshot fits ``(1 − RESERVE)`` of the budget (always at least one), and the chunk is sized
        so the temporaries fit what the snapshot leaves: the peak stays within the budget as long as
        each tensor leaves room for a chunk of ``MIN_CHUNK_ELEMS`` (~22 KiB of fp32 temporaries).
        """
        n = len(tracked)
        if n == 0:
            return []
        budget = self.budget_bytes(tracked, resident)
        sizes = [t.nbytes for t in tracked]
        if budget >= sum(sizes):
            self.chunk = DEFAULT_CHUNK_ELEMS
            return list(range(n))
        limit, used, out = budget * (1 - RESERVE), 0, []
        start = self.cursor % n
        for j in range(n):
            i = (start + j) % n
            if out and used + sizes[i] > limit:
                break
            out.append(i)
            used += sizes[i]
        self.cursor = start + len(out)
        per_elem = self.per_elem(max(tracked[i].local().element_size() for i in out))
        self.chunk = int(min(max((budget - used) // per_elem, MIN_CHUNK_ELEMS), DEFAULT_CHUNK_ELEMS))
        return sorted(out)

    def drift_due(self, name: str, every_tensor: bool = False) -> bool:
        """Whether this window computes ``name``'s drift: at every ``drift_every``-th window the tensor is
        in, its first one included, and always when the window holds every tensor (the full set)."""
        n = self._drift_visits.get(name, 0)
        self._drift_visits[name] = n + 1
        return every_tensor or n % self.drift_every == 0
