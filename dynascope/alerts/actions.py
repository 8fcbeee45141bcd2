"""What a firing does besides its ``events`` row: a warning line, a webhook POST, a stop request.

A webhook is posted from a thread of its own with a timeout, through a bounded queue: a receiver that
hangs or is down costs dropped posts (counted), never a wait in the monitor or in training.
A stop request is a flag the process's scope reads (``Scope.should_stop``) and, for the other ranks and
for a follower in another process, a file in the run directory: ``_control/stop.json`` with the step to
stop at. Every rank that watches the run stops at that step, so no rank is left waiting in a collective
for one that stopped a step earlier.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import urllib.request
from pathlib import Path
from typing import Any

from dynascope.core.clock import now_us

__all__ = ["STOP_FILE", "Webhooks", "read_stop", "write_stop"]

STOP_FILE = Path("_control") / "stop.json"


class Webhooks:
    """POSTs JSON bodies from one daemon thread; at most ``maxsize`` waiting, each try ``timeout_s`` long."""

    def __init__(self, timeout_s: float = 5.0, maxsize: int = 64) -> None:
        self.timeout_s = timeout_s
        self.sent = self.failed = self.dropped = 0
        self.last_error: str | None = None
        self._q: queue.Queue[tuple[str, bytes] | None] = queue.Queue(maxsize)
        self._thread: threading.Thread | None = None

    def post(self, url: str, body: dict[str, Any]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dynascope-webhook", daemon=True)
            self._thread.start()
        try:
            self._q.put_nowait((url, json.dumps(body, default=str).encode()))
        except queue.Full:
            self.dropped += 1

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            url, data = item
            req = urllib.request.Request(url, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 - user's URL
                    resp.read(1 << 16)
                self.sent += 1
            except Exception as exc:  # a receiver's failure is counted, never raised
                self.failed += 1
                self.last_error = f"{type(exc).__name__}: {exc}"

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread after what is queued, waiting at most ``timeout_s`` (a hung post is abandoned)."""
        if self._thread is None:
            return
        try:
            self._q.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)


def write_stop(run_dir: Path, step: int, reason: str) -> None:
    """Ask every rank of the run to stop at ``step`` (written whole: a temporary file, then renamed)."""
    path = run_dir / STOP_FILE
    path.parent.mkdir(exist_ok=True)
    if read_stop(run_dir) is not None:  # the first request stands: a later one must not move the step
        return
    tmp = path.with_name(f".stop.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({"stop_at_step": int(step), "reason": reason, "time_us": now_us()}))
    os.replace(tmp, path)


def read_stop(run_dir: Path) -> dict[str, Any] | None:
    """The run's stop request, or None (no file, or one not yet whole)."""
    try:
        doc = json.loads((run_dir / STOP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("stop_at_step"), int) else None
