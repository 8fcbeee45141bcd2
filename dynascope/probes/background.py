"""The post-step weight pass, off the training thread: it runs while the next forward and backward run.

After the optimizer step, the statistics of the weights (ΔW against the pre-step snapshot, drift against
θ₀, S_k) and the spectra of W_t − W₀ (``probes.spectral``) read W_t, which nothing changes until the next optimizer step: the training loop's zero_grad,
forward and backward only read the weights. So on a host, at a record that covers every tensor, the probe
hands that pass to one background thread and returns, and the next step's pre-hook waits for it (``wait``) before anything else: before the
next snapshot overwrites the arena the pass reads, and before the optimizer changes the weights.

What could still change W_t meanwhile is the user's own code between two steps (``load_state_dict``, an
in-place edit of a parameter). Every in-place change of a tensor bumps its version counter, which the pass
reads before and after (``versions``): a tensor whose weights changed underneath loses that record's
weight statistics (NULL) and the record gets a ``weights_changed`` event, rather than a value computed
from half-changed weights. (A write that bypasses autograd's counter, through ``.data`` or a raw pointer,
is not seen; the pass then reads whatever the memory held, as any reader outside the step would.)

The pass thread runs at the training threads' priority and its fused kernels on itself alone
(``stats.fused.serial``): the step waits for it at the next boundary, so starving it would only move its
time into that wait.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["PassThread", "versions"]


def versions(tensors: Sequence[Any]) -> list[int]:
    """Each tensor's version counter (bumped by every in-place change through autograd's view of it)."""
    return [t._version for t in tensors]


class PassThread:
    """One background thread for the post-step passes (the weight pass, the spectra): jobs run in order,
    and ``wait`` returns once every job submitted so far is done."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], Any]) -> Future:
        """Queue ``job`` on the pass thread, after the jobs already queued."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="dynascope-pass")
            fut = self._pool.submit(_serial, job)
            self._pending.append(fut)
            return fut

    def wait(self) -> None:
        """Block until every job queued so far is done (their errors are the resolver's to report)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for fut in pending:
            fut.exception()

    def close(self) -> None:
        self.wait()
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _serial(job: Callable[[], Any]) -> Any:
    from dynascope.stats.fused import serial

    with serial():
        return job()
