"""How many bytes a probe holds at once: what ``memory_budget`` bounds, measured at the allocator.

The probe works during the optimizer step, rarely the process's peak, so peak RSS alone would not show it.
``held_peak`` wraps ``TensorStats.before`` (the ΔW snapshot is taken) and ``after`` (snapshot, θ₀ chunks and
every temporary freed) and returns the largest number of bytes they held at once. On CUDA it reads
``memory_allocated``/``max_memory_allocated`` around each half; on CPU, where torch keeps no allocator
counters, each half runs under ``torch.profiler`` with ``profile_memory=True``, whose ``[memory]`` events
carry a running total of the bytes allocated while profiling and not yet freed, and only the probe's
halves are profiled. Used by ``tests/test_probe_memory.py`` and ``benchmarks/probe_memory.py``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["held_peak", "memory_events"]


def memory_events(fn: Callable[[], Any]) -> tuple[Any, list[dict]]:
    """Run ``fn`` under the profiler with ``profile_memory``; (its result, its ``[memory]`` events in time
    order, each with ``args`` ``Bytes`` (+ allocated, − freed) and ``Total Allocated``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    finally:
        os.unlink(path)
    return out, sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])


def _profiled_totals(fn: Callable[[], Any]) -> tuple[Any, list[int]]:
    """Run ``fn`` under the profiler; (its result, [running total after each allocation or free])."""
    out, mem = memory_events(fn)
    if not mem:
        return out, []
    first = mem[0]["args"]
    # The total before the first event: what earlier profiled calls left alive (the snapshot, in after).
    return out, [first["Total Allocated"] - first["Bytes"]] + [e["args"]["Total Allocated"] for e in mem]


def held_peak(stats: Any, step: Callable[[], None], steps: int, device: torch.device) -> int:
    """Largest bytes the probe held at once over ``steps`` calls of ``step`` (one training step each)."""
    orig_before, orig_after = stats.before, stats.after
    st = {"peak": 0, "base": 0, "held": 0}  # base: the level when ``before`` began; held: after it

    if device.type == "cuda":
        def before(*a: Any, **k: Any) -> Any:
            torch.cuda.synchronize()
            st["base"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = orig_before(*a, **k)
            torch.cuda.synchronize()
            st["peak"] = max(st["peak"], torch.cuda.max_memory_allocated() - st["base"])
            st["held"] = torch.cuda.memory_allocated() - st["base"]  # the snapshot, kept across the step
            return out

        def after(*a: Any, **k: Any) -> Any:
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()  # the optimizer ran in between: measure from here
            torch.cuda.reset_peak_memory_stats()
            out = orig_after(*a, **k)
            torch.cuda.synchronize()
            st["peak"] = max(st["peak"], st["held"] + torch.cuda.max_memory_allocated() - start)
            return out
    else:
        def before(*a: Any, **k: Any) -> Any:
            out, totals = _profiled_totals(lambda: orig_before(*a, **k))
            if totals:
                st["base"] = totals[0]
                st["peak"] = max(st["peak"], max(totals) - st["base"])
            return out

        def after(*a: Any, **k: Any) -> Any:
            out, totals = _profiled_totals(lambda: orig_after(*a, **k))
            if totals:  # totals already include what before left alive, and nothing else allocated
                st["peak"] = max(st["peak"], max(totals) - st["base"])
            return out

    stats.before, stats.after = before, after
    try:
        for _ in range(steps):
            step()
    finally:
        stats.before, stats.after = orig_before, orig_after
    return st["peak"]
