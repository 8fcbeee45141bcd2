"""The resolver thread: turns each record's device results into store rows, off the training thread.

The training thread submits a job right after issuing the record's single non-blocking device→host
copy (and a CUDA event behind it). Jobs run in order on one daemon thread, which waits on the event,
so the training thread never synchronizes with the device for the probes.

The probe's threads (this one, the writer's, the system sampler) run at a lower CPU priority
(``lower_priority``): their work has no deadline within a step, and on a host where the training threads
take every core, a background thread at the same priority preempts one of them, so every intra-op
parallel region of that step waits for it. At nice +10 the scheduler gives them the gaps the training
threads leave (Python between ops, the loss sync) and about a tenth of a core when there are none. (In
benchmarks/probe_ab.py on the 2-core reference workload: 1.023x and 1.024x at +10, 1.031x and 1.029x at 0.)
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["BACKGROUND_NICE", "Resolver", "lower_priority"]

BACKGROUND_NICE = 10


def lower_priority(thread: threading.Thread | None = None, nice: int = BACKGROUND_NICE) -> bool:
    """Give ``thread`` (default: the calling thread) a nice value of at least ``nice``. Linux only, where a
    nice value belongs to one thread (elsewhere it would lower the whole process); never raises. Returns
    whether the thread now runs at that priority or lower."""
    if not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id() if thread is None else thread.native_id
    if tid is None:  # not started yet
        return False
    try:
        cur = os.getpriority(os.PRIO_PROCESS, tid)
        if cur < nice:  # raising a nice value needs no privilege; never lower one already higher
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except (AttributeError, OSError):
        return False


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
        lower_priority()
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
