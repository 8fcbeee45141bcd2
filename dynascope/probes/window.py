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

Sharded runs (FSDP2, DeepSpeed ZeRO) record per-rank partial sums of each tensor's slices, and a windowed
statistic combines only if every rank computed it at the same record. Left to itself, each rank's time
budget decides from its own clock, the ranks' cursors part within a few records, and almost no windowed
statistic combines (docs/benchmarks.md, "DeepSpeed"). So when the tracked tensors are shards, the window
is a function of the record's index ``k`` and of a period the ranks agree on:

* the rotation is planned once, from cursor 0, from rank-invariant sizes (``Tracked.nbytes``) into ``R``
  windows, made odd by taking the first window twice when ``R`` is even; record ``k`` holds window ``k mod R``;
* the time budget takes a window at the records that are multiples of a period ``P``, a power of two each
  rank derives from its own measurements (window time over the budget's share of the time between records),
  with hysteresis. Near a boundary the ranks' measurements give different periods (``P`` and ``2P``), and
  at the odd multiples of ``P`` one rank would take the window alone, so the period used at record ``k``
  is the largest the ranks derived at record ``k − 1`` (``probes.agreement``: one asynchronous all-reduce
  of one integer per record on a group of its own, read a record later, when it has long completed).
  ``P`` a power of two and ``R`` odd make the windows taken at multiples of ``P`` visit every window of
  the rotation;
* drift comes at the rotations ``m = (k − w) / R`` of window ``w`` that are multiples of ``drift_every``
  made odd, so again every window gets it and every rank agrees on when.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from dynascope.probes.agreement import RankMax
from dynascope.probes.params import Tracked
from dynascope.stats.engine import DEFAULT_CHUNK_ELEMS

__all__ = ["MIN_CHUNK_ELEMS", "RESERVE", "Window"]

# Share of the budget a window's snapshot leaves to one chunk's temporaries (ΔW, masks, θ₀'s chunk).
# The chunk is sized from whatever the snapshot leaves over, so a tensor alone in its window (often the
# embedding: ~10% of a small model) may take more than 1 − RESERVE and still fit. A larger reserve means
# larger chunks, i.e. fewer op launches per byte, at the price of more windows per rotation.
RESERVE = 1 / 4
MIN_CHUNK_ELEMS = 1024
# Sharded runs' period: weight of the newest measurement in the running means of a window's time and of
# the time between records, and the share of the budget below which the period halves (hysteresis).
EMA = 0.2
LOWER = 0.4

Planned = tuple[list[int], int | None]  # (tensor indices, chunk size) of one window


class Window:
    """Plans the windows of one probe. Per record: ``tick()`` when it starts, ``next(tracked, resident)``
    its window (``chunk``: the chunk size its statistics run in), ``charge(t0)`` the time spent on it,
    ``drift_due(name)`` per tensor. ``per_elem(element_size)``: bytes of temporaries per chunk element
    (the largest declared statistic's)."""

    def __init__(self, memory_budget: float | None, time_budget: float | None, drift_every: int,
                 per_elem: Callable[[int], int], agreement: RankMax | None = None) -> None:
        self.memory_budget = memory_budget
        self.time_budget = None if memory_budget is None else time_budget
        self.drift_every = int(drift_every)
        self.per_elem = per_elem
        self.cursor = 0
        self.chunk: int | None = DEFAULT_CHUNK_ELEMS  # chunk size of the last planned window
        self.records = 0  # records started (tick), the index a sharded run's windows are chosen by
        self._debt_s = 0.0  # window time spent beyond what time_budget × elapsed time allows
        self._last_t: float | None = None
        self._drift_visits: dict[str, int] = {}  # tensor name → windows it has been in
        # sharded runs (module docstring): the rotation, its key, the period and what sets it
        self.period = 1  # the period this record uses (sharded runs: agreed across ranks)
        self.local_period = 1  # the period this rank's own measurements ask for
        self._agreement = agreement if agreement is not None else RankMax()
        self._rotation: list[Planned] = []
        self._key: tuple | None = None
        self._sharded: tuple[int, bool] | None = None
        self._cost: float | None = None  # running mean of one window's time (s)
        self._interval: float | None = None  # running mean of the time between records (s)
        self._spent, self._took = 0.0, False
        self._slot: tuple[int, int, int] | None = None  # (record, window, rotation length) of the last take

    def budget_bytes(self, tracked: list[Tracked], resident: float = 0.0) -> float:
        """Bytes the windowed statistics may hold at peak: snapshot + one chunk's temporaries, less the
        ``resident`` bytes θ₀ and the S_k snapshot take."""
        if self.memory_budget is None:
            return math.inf
        return self.memory_budget * sum(t.nbytes for t in tracked) - resident

    # ---- time ----------------------------------------------------------------------------------------
    def tick(self) -> None:
        """A record starts: earn back window time (``time_budget`` of the wall time since the previous
        record) and, for sharded runs, set the period from the previous record's window time."""
        now = time.perf_counter()
        elapsed = None if self._last_t is None else now - self._last_t
        if elapsed is not None and self.time_budget is not None:
            self._debt_s = max(self._debt_s - self.time_budget * elapsed, -self.time_budget * elapsed)
        self._last_t = now
        self.records += 1
        self._set_period(elapsed)

    def charge(self, t0: float) -> None:
        """Count the time since ``t0`` (``time.perf_counter``) against the time budget."""
        dt = time.perf_counter() - t0
        self._debt_s += dt
        self._spent += dt

    def _set_period(self, interval: float | None) -> None:
        if self._took:
            self._cost = self._spent if self._cost is None else (1 - EMA) * self._cost + EMA * self._spent
        self._spent, self._took = 0.0, False
        if interval is not None and interval > 0:
            self._interval = interval if self._interval is None else (1 - EMA) * self._interval + EMA * interval
        if self.time_budget is None or self._cost is None or self._interval is None:
            self.local_period = 1
        else:
            need = self._cost / (self.time_budget * self._interval)  # records per window the budget allows
            while need > self.local_period:
                self.local_period *= 2
            while self.local_period > 1 and need < LOWER * self.local_period:
                self.local_period //= 2
        self.period = self.local_period
        if self.time_budget is not None and self._sharded is not None and self._sharded[1]:
            # the same at every record on every rank: from the record after the first window on
            self.period = self._agreement.exchange(self.local_period)

    def close(self) -> None:
        """Free what the ranks' agreement on the period holds (its process group)."""
        self._agreement.close()

    def agreement_group(self) -> Any:
        """The ranks' gloo group, where ``prepare`` made one (``probes.clocks`` measures over it too)."""
        return self._agreement.group

    def take_notice(self) -> str | None:
        """Why the ranks stopped agreeing on the period, once (then None): for the record's events."""
        note, self._agreement.notice = self._agreement.notice, None
        return note

    # ---- the window ------------------------------------------------------------------------------------
    def next(self, tracked: list[Tracked], resident: float = 0.0, timed: bool = True) -> list[int]:
        """The window of the record ``tick()`` started: no tensors where the time budget (if ``timed``)
        skips it. Sharded tensors take window ``k mod R`` of their rotation, others the next one."""
        if not self._is_sharded(tracked):
            return self.plan(tracked, resident) if not timed or self.time_budget is None or self._debt_s <= 0 else []
        key = (id(tracked), len(tracked), self.budget_bytes(tracked, resident))
        if key != self._key:
            self._key, self._rotation = key, self._rotate(tracked, resident)
        k = self.records - 1
        if not self._rotation or (timed and k % self.period):
            return []
        r = len(self._rotation)
        w = k % r
        self._took, self._slot = True, (k, w, r)
        window, self.chunk = self._rotation[w]
        return window

    def prepare(self, tracked: list[Tracked]) -> None:
        """Before the first step: a sharded run's ranks make the group they agree on periods over."""
        if self.time_budget is not None and self._is_sharded(tracked):
            self._agreement.prepare()

    def _is_sharded(self, tracked: list[Tracked]) -> bool:
        if self._sharded is None or self._sharded[0] != id(tracked):  # looked at once per tracked list
            self._sharded = (id(tracked), any(t.sharded for t in tracked))
        return self._sharded[1]

    def _rotate(self, tracked: list[Tracked], resident: float) -> list[Planned]:
        """Consecutive windows from cursor 0 until every tensor had one, made an odd number of windows."""
        out: list[Planned] = []
        cursor = 0
        while cursor < len(tracked):
            window, _ = self._plan_from(cursor, tracked, resident)
            window = [i for i in window if i >= cursor]  # the last window stops at the end, not wrapping round
            out.append((window, self.chunk))
            cursor += len(window)
        if len(out) % 2 == 0 and out:
            out.append(out[0])
        return out

    def plan(self, tracked: list[Tracked], resident: float = 0.0) -> list[int]:
        """Next window and the chunk size of its statistics.

        A budget that holds every tensor (``memory_budget >= 2`` with θ₀ resident, or None) takes them
        all, in chunks of ``DEFAULT_CHUNK_ELEMS``. Otherwise tensors from the rotating cursor join while
        their snapshot fits ``(1 − RESERVE)`` of the budget (always at least one), and the chunk is sized
        so the temporaries fit what the snapshot leaves: the peak stays within the budget as long as
        each tensor leaves room for a chunk of ``MIN_CHUNK_ELEMS`` (~22 KiB of fp32 temporaries).
        """
        out, self.cursor = self._plan_from(self.cursor, tracked, resident)
        return out

    def _plan_from(self, cursor: int, tracked: list[Tracked], resident: float) -> tuple[list[int], int]:
        """(the window starting at ``cursor``, the cursor after it); sets ``chunk``."""
        n = len(tracked)
        if n == 0:
            return [], cursor
        budget = self.budget_bytes(tracked, resident)
        sizes = [t.nbytes for t in tracked]
        if budget >= sum(sizes):
            self.chunk = DEFAULT_CHUNK_ELEMS
            return list(range(n)), cursor + n
        limit, used, out = budget * (1 - RESERVE), 0, []
        start = cursor % n
        for j in range(n):
            i = (start + j) % n
            if out and used + sizes[i] > limit:
                break
            out.append(i)
            used += sizes[i]
        per_elem = self.per_elem(max(tracked[i].local().element_size() for i in out))
        self.chunk = int(min(max((budget - used) // per_elem, MIN_CHUNK_ELEMS), DEFAULT_CHUNK_ELEMS))
        return sorted(out), start + len(out)

    def drift_due(self, name: str, every_tensor: bool = False) -> bool:
        """Whether this window computes ``name``'s drift: always when the window holds every tensor (the
        full set); else at every ``drift_every``-th window the tensor is in, its first one included (for
        shards: at the window's rotations that are multiples of ``drift_every`` made odd)."""
        if self._slot is not None and self._sharded is not None and self._sharded[1]:
            k, w, r = self._slot
            return every_tensor or ((k - w) // r) % (self.drift_every | 1) == 0
        n = self._drift_visits.get(name, 0)
        self._drift_visits[name] = n + 1
        return every_tensor or n % self.drift_every == 0
