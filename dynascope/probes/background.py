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
time into that wait. Its torch ops run on one OpenMP thread too, unless a job asks for more (the spectra's
SVDs): a parallel op gives the calling thread an OpenMP team of its own, whose worker spins after each
region on a core the training step needs (on 2 cores that cost the reference workload ~20% of its step at
full coverage; docs/benchmarks.md). The count is set with the OpenMP runtime's ``omp_set_num_threads``,
which sets the calling thread's count only, where ``torch.set_num_threads`` would also set the count of
every thread the process starts later.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["PassThread", "set_openmp_threads", "versions"]


def versions(tensors: Sequence[Any]) -> list[int]:
    """Each tensor's version counter (bumped by every in-place change through autograd's view of it)."""
    return [t._version for t in tensors]


class PassThread:
    """One background thread for the post-step passes (the weight pass, the spectra): jobs run in order.
    ``wait`` returns once every job that reads the live weights (``holds``) submitted so far is done, and
    so every job before it; ``wait(everything=True)`` once every job is."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[tuple[Future, bool]] = []
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], Any], threads: int | None = 1, holds: bool = True) -> Future:
        """Queue ``job`` on the pass thread, after the jobs already queued; its torch ops may use ``threads``
        OpenMP threads (None: as many as the calling thread's). ``holds``: the job reads the live weights,
        so the next optimizer step waits for it; a job that reads only copies does not hold the step."""
        if threads is None:
            import torch

            threads = torch.get_num_threads()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="dynascope-pass")
            fut = self._pool.submit(_serial, job, threads)
            self._pending.append((fut, holds))
            return fut

    def wait(self, everything: bool = False) -> None:
        """Block until every job queued so far that holds the step is done, or every job (``everything``);
        their errors are the resolver's to report. Jobs run in order: a later job that holds the step is
        waited for after every job before it."""
        with self._lock:
            last = len(self._pending) if everything else max(
                (k + 1 for k, (_, holds) in enumerate(self._pending) if holds), default=0)
            pending, self._pending = self._pending[:last], self._pending[last:]
        for fut, _ in pending:
            fut.exception()

    def close(self) -> None:
        self.wait(everything=True)
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _serial(job: Callable[[], Any], threads: int) -> Any:
    import torch

    from dynascope.stats.fused import serial

    torch.get_num_threads()  # torch sets a thread's OpenMP count when it first asks for it: before ours
    set_openmp_threads(threads)
    with serial():
        return job()


def set_openmp_threads(n: int) -> bool:
    """Set the calling thread's OpenMP thread count (no other thread's); False where no OpenMP runtime is
    loaded in this process (torch built without it, or a platform without ``/proc``)."""
    fn = _omp_set_num_threads()
    if fn is None:
        return False
    fn(max(int(n), 1))
    return True


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch loaded (libgomp, or LLVM's/Intel's libomp); the
    one in torch's own directory first, where another package brought a second runtime."""
    try:
        import torch

        home = os.path.dirname(torch.__file__)
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = sorted({line.split()[-1] for line in maps if "omp" in line},
                           key=lambda p: (not p.startswith(home), p))
        for path in paths:
            if os.path.basename(path).startswith(("libgomp", "libomp", "libiomp")):
                fn = ctypes.CDLL(path).omp_set_num_threads
                fn.argtypes, fn.restype = [ctypes.c_int], None
                return fn
    except (OSError, AttributeError):
        pass
    return None
