"""The one clock of the store: wall-clock microseconds since the epoch (every ``*_us`` time column)."""

from __future__ import annotations

import time

__all__ = ["now_us"]


def now_us() -> int:
    """Wall-clock time in µs since the epoch."""
    return time.time_ns() // 1000
