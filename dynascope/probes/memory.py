"""Memory per recorded step, as ``scalars`` rows: CUDA peak allocated since the last record, or RSS.

The CUDA peak comes from the caching allocator's counters (host-side, no device sync). Reading a
per-step peak means resetting the peak counter after each read, so a user's own
``torch.cuda.max_memory_allocated()`` then reports the peak since dynascope's last record.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dynascope.core.clock import now_us
from dynascope.probes.protocol import Probe, Rows, StepContext
from dynascope.probes.schedule import Schedule, every

__all__ = ["MemoryProbe"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemoryProbe(Probe):
    """``mem/*`` scalars at each step its schedule (the tensor statistics' one, in ``watch``) records."""

    name = "memory"

    def __init__(self, device: torch.device | None, schedule: Schedule | None = None) -> None:
        self._schedule = schedule if schedule is not None else every(1)
        self.cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self._proc: Any = None
        self._statm: int | None = None
        if not self.cuda:
            try:  # Linux: RSS from /proc/self/statm, one read of an open file (psutil's call costs ~10x)
                self._statm = os.open("/proc/self/statm", os.O_RDONLY)
            except OSError:
                import psutil

                self._proc = psutil.Process()

    def read(self) -> dict[str, float]:
        """Scalars for this step; resets the CUDA peak so the next read covers the next step only."""
        if self.cuda:
            out = {"mem/peak_allocated_bytes": float(torch.cuda.max_memory_allocated(self.device)),
                   "mem/allocated_bytes": float(torch.cuda.memory_allocated(self.device)),
                   "mem/reserved_bytes": float(torch.cuda.memory_reserved(self.device))}
            torch.cuda.reset_peak_memory_stats(self.device)
            return out
        if self._statm is not None:
            return {"mem/rss_bytes": float(int(os.pread(self._statm, 128, 0).split()[1]) * _PAGE)}
        if self._proc is None:  # closed
            return {}
        return {"mem/rss_bytes": float(self._proc.memory_info().rss)}

    def close(self) -> None:
        if self._statm is not None:
            os.close(self._statm)
            self._statm = None

    def schedule(self, step: int) -> bool:
        return bool(self._schedule(step))

    def after(self, ctx: StepContext) -> Rows:
        mem = self.read()
        return {"scalars": {"step": ctx.step, "time_us": now_us(), "stage": ctx.stage, "key": list(mem),
                            "value": list(mem.values())}}
