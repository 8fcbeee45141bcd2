"""Preemption: on SIGTERM, write what is buffered within a bounded time, then do what was there before.

SLURM, Kubernetes and torchrun's agent end a job with SIGTERM and, a grace period later, SIGKILL. Python's
default is to die at once, losing the rows a writer buffered since its last flush (up to ``flush_secs``)
and the records the resolver had not yet turned into rows. So the first ``RunWriter`` of a process
installs, from the main thread, a handler that chains to whatever was installed before it (the user's,
the launcher's, or the default):

1. each registered drain (a scope's resolver, ``on_term``) and then each live writer's ``close`` run on a
   thread of their own, all within ``TERM_FLUSH_S`` together;
2. then the previous handler runs: a Python one is called; the default is restored and the signal sent
   again, so the process ends as it would have, with the signal's exit status; an ignored one stays ignored.

The work runs off the interrupted thread and is waited for with a deadline. The signal may arrive while
that thread is inside the writer's or the probes' code, holding a lock the flush needs (during an append):
the flush would wait out its deadline and the process end with nothing written. So a signal that finds
the thread there is sent again ``RETRY_S`` later, when the thread has most likely left (it spends
microseconds a step there), for up to ``DEFER_S``; after that the flush runs anyway, and a lock still
held costs the deadline, never a hang.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["TERM_FLUSH_S", "install", "on_term"]

TERM_FLUSH_S = 5.0  # the whole flush on SIGTERM; SLURM's and Kubernetes' default grace is 30 s
DEFER_S = 1.0  # how long a signal that lands inside the writer's or the probes' code is put off, at most
RETRY_S = 0.01  # the wait before it is sent again
# Where the training thread can hold a lock the flush needs: the writer's (store) and the probes' hooks.
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LOCKING = tuple(os.path.join(_PKG, part) + os.sep for part in ("store", "probes"))
_first_at: float | None = None  # when the first SIGTERM arrived
_drains: list[Callable[[float], None]] = []
_closers: list[Callable[[float], None]] = []
_previous: Any = None
_installed = False


def on_term(drain: Callable[[float], None]) -> None:
    """Run ``drain(timeout_s)`` on SIGTERM before the writers flush (a scope's pending records)."""
    _drains.append(drain)


def install(close_all: Callable[[float], None]) -> bool:
    """Chain the handler in, once per process, from the main thread only (signal's rule); returns whether
    it is in place. ``close_all(timeout_s)`` closes every live writer."""
    global _previous, _installed
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        _previous = signal.signal(signal.SIGTERM, _handle)
    except (ValueError, OSError):  # not the main interpreter, or no signals here
        return False
    _closers.append(close_all)
    _installed = True
    return True


def _flush(deadline: float) -> None:
    for fn in [*_drains, *_closers]:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            fn(left)
        except Exception:  # the job is ending: what could be written was; nothing may raise here
            pass


def _inside_ours(frame: Any) -> bool:
    """Whether the interrupted thread is in the writer's or the probes' code (any frame of its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_LOCKING):
            return True
        frame = frame.f_back
    return False


def _handle(signum: int, frame: Any) -> None:
    global _first_at
    now = time.monotonic()
    _first_at = now if _first_at is None else _first_at
    if now - _first_at < DEFER_S and _inside_ours(frame):
        again = threading.Timer(RETRY_S, os.kill, (os.getpid(), signum))
        again.daemon = True
        try:
            again.start()
            return
        except RuntimeError:  # no thread to be had (the interpreter is shutting down): flush now
            pass
    _first_at = None  # handled: a later SIGTERM (a handler of the user's that went on) is put off anew
    deadline = time.monotonic() + TERM_FLUSH_S
    worker = threading.Thread(target=_flush, args=(deadline,), name="dynascope-sigterm", daemon=True)
    worker.start()
    worker.join(max(deadline - time.monotonic(), 0.0))
    previous = _previous
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL or previous is None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
