"""The resolver thread: turns each record's device results into store rows, off the training thread.

The training thread submits a job right after issuing the record's single non-blocking device→host
copy (and a CUDA event behind it). Jobs run in order on one daemon thread, which waits on the event,
so the training thread never synchronizes with the device for the probes.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["Resolver"]


class Resolver:
    def __init__(self, on_error: Callable[[str, BaseException], None], max_pending: int = 64) -> None:
        self._q: queue.Queue[tuple[Callable[..., Any], tuple] | None] = queue.Queue(maxsize=max_pending)
        self._on_error = on_error
        self._thread = threading.Thread(target=self._loop, name="dynascope-resolver", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)``. Blocks only if ``max_pending`` records are waiting (back-pressure
        rather than unbounded pinned memory when the host falls behind)."""
        self._q.put((fn, args))

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                fn, args = item
                try:
                    fn(*args)
                except Exception as exc:
                    self._on_error(getattr(fn, "__name__", "resolve"), exc)
            finally:
                self._q.task_done()

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until every submitted job ran (used by ``flush``/``close`` and tests)."""
        done = threading.Event()
        self.submit(done.set)
        if not done.wait(timeout_s):
            warnings.warn("dynascope: resolver did not drain in time", RuntimeWarning, stacklevel=2)

    def close(self, timeout_s: float = 30.0) -> None:
        self.drain(timeout_s)
        self._q.put(None)
        self._thread.join(timeout_s)
