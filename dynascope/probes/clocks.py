"""How far this rank's wall clock is from rank 0's, measured once in ``watch()`` and recorded as an event.

Every ``*_us`` column is the host's own wall clock (``core.clock``). Nodes kept by NTP still differ by
milliseconds, and a node whose daemon failed by seconds, which shifts every cross-rank timeline (async
staleness, weight-sync spans, a Perfetto export) by that much. The offset is measured where every rank is
known to run the probe: over the gloo group a sharded run already makes in ``watch()`` for the time
budget (``probes.agreement``), or over one made for it when ``WatchSettings(clock_sync=True)`` says every
rank of the default group runs the probe (a rank that does not would hold ``new_group`` for its timeout).

The method: ``ROUNDS`` times, every rank leaves a barrier and reads its clock at once; one all-gather
brings every rank's readings. The ranks leave a barrier within its release latency of each other
(microseconds on one host, well under a millisecond across a data-centre network), so this rank's
offset is the median over the rounds of its reading minus rank 0's, and ``spread_us`` (the rounds'
range) bounds the method's own error. No wait here is unbounded: the group's timeout bounds each call,
and a failure is an event, never an exception in the user's script.
"""

from __future__ import annotations

import datetime
import statistics
import time
from typing import Any

__all__ = ["ROUNDS", "measure_offset", "record_offset"]

ROUNDS = 5
TIMEOUT_S = 30.0


def measure_offset(group: Any = None, rounds: int = ROUNDS) -> tuple[float, float, int]:
    """(offset_us, spread_us, reference rank) of this rank's clock against the group's first rank."""
    import torch
    import torch.distributed as dist

    mine = []
    for _ in range(rounds):
        dist.barrier(group=group)
        mine.append(time.time_ns() // 1000)
    world = dist.get_world_size(group)
    out = [torch.zeros(rounds, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(out, torch.tensor(mine, dtype=torch.int64), group=group)
    me = dist.get_rank(group)
    diffs = [int(a) - int(b) for a, b in zip(out[me].tolist(), out[0].tolist(), strict=True)]
    ref = dist.get_global_rank(group, 0) if group is not None else 0
    return float(statistics.median(diffs)), float(max(diffs) - min(diffs)), int(ref)


def record_offset(scope: Any, clock_sync: bool) -> None:
    """Measure and record this rank's offset (an ``events`` row ``clock_offset``), where it can be done."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        stats = scope.stats
        group = stats.window.agreement_group() if stats is not None else None
        own = group is None
        if own:
            if not clock_sync:
                return
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
        try:
            offset, spread, ref = measure_offset(group)
        finally:
            if own:  # made for this measurement only (the agreement's group lives on for the time budget)
                dist.destroy_process_group(group)
        scope.writer.event("clock_offset", f"wall clock {offset / 1e3:+.3f} ms from rank {ref}'s "
                           f"(±{spread / 2e3:.3f} ms over {ROUNDS} barrier rounds)", step=scope.step_index,
                           severity="info", offset_us=offset, spread_us=spread, reference_rank=ref)
    except Exception as exc:  # never an exception from watch(): an event and one warning
        scope._report("clock_offset", exc)
