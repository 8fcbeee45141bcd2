"""Wait for a condition with a deadline, never for a fixed time: a loaded CI machine is slow, not wrong."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str, timeout_s: float = 60.0, interval_s: float = 0.01) -> T:
    """Call ``condition`` until it returns something truthy and return that; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)
