"""The writers open in this process: closed within a deadline at exit, and forgotten in a forked child.

A DataLoader worker or a forked rollout process inherits the parent's writers (their rows the parent's,
their threads and any lock held at the fork gone): after ``fork`` each is made inert (``_forget``), never
written or waited on; a ``RunWriter`` the child makes is its own. At interpreter exit the writers still
open are closed, all within ``EXIT_TIMEOUT_S`` together, so a stalled file system cannot hang the exit.
"""

from __future__ import annotations

import atexit
import os
import time
import weakref
from typing import Any

EXIT_TIMEOUT_S = 10.0  # what the writers still open at exit may take, all together

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def add(writer: Any) -> None:
    _LIVE.add(writer)


def discard(writer: Any) -> None:
    _LIVE.discard(writer)


def _forget_in_child() -> None:
    for w in list(_LIVE):
        w._forget()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def close_all(timeout_s: float = EXIT_TIMEOUT_S) -> None:
    """Close every live writer, all within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for w in list(_LIVE):
        try:
            w.close(timeout_s=max(deadline - time.monotonic(), 0.1))
        except Exception:
            pass
