"""Listeners kept apart from the probe: each runs on a thread of its own, behind a bounded queue.

A listener is user code (a ``wandb.log`` mirror, a callback): it may raise, or block for good on a dead
network. Called on the resolver thread, one that blocks would stop the resolver, whose full queue would
then block ``optimizer.step()``. So each listener gets a daemon worker and a queue of ``maxsize`` steps:

* the resolver only ever ``put_nowait``s; a full queue drops the step's summary and counts it;
* a call that raises is reported (a warning once, a ``probe_error`` event each time) and the next step's
  call goes ahead;
* a call still running ``deadline_s`` after it started is taken for hung: the listener is dropped (no
  more calls; one ``listener_dropped`` event with what it missed), its thread left to finish or not.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from dynascope.probes.protocol import Listener

__all__ = ["LISTENER_DEADLINE_S", "IsolatedListener"]

LISTENER_DEADLINE_S = 30.0  # a wandb.log can take seconds on a slow network; half a minute is a hang
_STOP = object()


class IsolatedListener:
    """``fn(step, summary)`` on its own thread; calling this never blocks and never raises."""

    def __init__(self, fn: Listener, report: Callable[[str, BaseException], None],
                 event: Callable[..., None], deadline_s: float = LISTENER_DEADLINE_S, maxsize: int = 256) -> None:
        self.fn, self.name = fn, getattr(fn, "__name__", type(fn).__name__)
        self._report, self._event = report, event
        self.deadline_s = deadline_s
        self.calls = self.errors = self.dropped = 0
        self.hung = False
        self._busy_since: float | None = None
        self._q: queue.Queue[Any] = queue.Queue(maxsize)
        self._thread = threading.Thread(target=self._loop, name=f"dynascope-listener-{self.name}", daemon=True)
        self._thread.start()

    def __call__(self, step: int, summary: dict[str, float]) -> None:
        if self.hung:
            self.dropped += 1
            return
        since = self._busy_since
        if since is not None and time.monotonic() - since > self.deadline_s:
            self._drop(step)
            return
        try:
            self._q.put_nowait((step, summary))
        except queue.Full:
            self.dropped += 1

    def _drop(self, step: int) -> None:
        self.hung = True
        self.dropped += 1 + self._q.qsize()
        msg = (f"listener {self.name} has not returned in {self.deadline_s:g} s: dropped "
               f"({self.calls} calls made, {self.dropped} steps not delivered)")
        self._report(f"listener:{self.name}", TimeoutError(msg))
        self._event("listener_dropped", msg, step=step, severity="warning", listener=self.name,
                    calls=self.calls, dropped=self.dropped)

    def _loop(self) -> None:
        while (item := self._q.get()) is not _STOP:
            if callable(item):  # the listener's own close(), run here so a hung one cannot hold close()
                self._call(item)
                continue
            self._call(lambda: self.fn(*item))
            self.calls += 1

    def _call(self, fn: Callable[[], Any]) -> None:
        self._busy_since = time.monotonic()
        try:
            fn()
        except Exception as exc:
            self.errors += 1
            self._report(f"listener:{self.name}", exc)
        finally:
            self._busy_since = None

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is queued, then the listener's own ``close()``, waiting at most ``timeout_s``."""
        if not self.hung:
            own = getattr(self.fn, "close", None)
            for item in ([own] if callable(own) else []) + [_STOP]:
                try:
                    self._q.put(item, timeout=timeout_s)
                except queue.Full:
                    break
            self._thread.join(timeout_s)
        if self._thread.is_alive() or self.dropped:
            self._event("listener_closed", f"listener {self.name}: {self.calls} calls, {self.errors} raised, "
                        f"{self.dropped} steps not delivered" + (", still running at close" if
                                                                  self._thread.is_alive() else ""),
                        severity="warning", listener=self.name, calls=self.calls, errors=self.errors,
                        dropped=self.dropped)
