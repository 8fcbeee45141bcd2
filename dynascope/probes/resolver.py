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

Records are resolved in batches (``collect``): the thread keeps the records that arrive until it holds
``batch`` of them or the oldest has waited ``delay_s``, then hands them to the scope together. Turning a
record into rows has a fixed cost per column (~0.5 ms a record of the reference workload, most of the
thread's CPU), and the writer's flush a fixed cost per buffered batch; a batch pays each once. Rows reach
the writer up to ``delay_s`` later, well inside its own flush interval.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from dynascope.core.warn import warn

__all__ = ["BACKGROUND_NICE", "PUT_WAIT_S", "RESOLVE_BATCH", "RESOLVE_DELAY_S", "Resolver", "lower_priority"]

BACKGROUND_NICE = 10
RESOLVE_BATCH = 64  # records resolved together at most
RESOLVE_DELAY_S = 2.0  # the longest a record waits for others before it is resolved
PUT_WAIT_S = 1.0  # the longest the training thread waits on a full resolver queue before dropping a record


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
    def __init__(self, on_error: Callable[[str, BaseException], None],
                 resolve_batch: Callable[[list[Any]], None] | None = None, max_pending: int = 64,
                 batch: int | None = None, delay_s: float | None = None) -> None:
        self._q: queue.Queue[tuple[Callable[..., Any], tuple] | None] = queue.Queue(maxsize=max_pending)
        self._on_error = on_error
        self._resolve_batch = resolve_batch
        self.batch = max(int(RESOLVE_BATCH if batch is None else batch), 1)
        self.delay_s = float(RESOLVE_DELAY_S if delay_s is None else delay_s)
        self.dropped = 0  # records and jobs dropped because the queue stayed full (see submit)
        self._stuck = False
        self._thread = threading.Thread(target=self._loop, name="dynascope-resolver", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Queue ``fn(*args)``; it runs after every record collected before it is resolved. With
        ``max_pending`` jobs waiting, waits up to ``PUT_WAIT_S`` (back-pressure rather than unbounded pinned
        memory when the host falls behind), then drops the job and counts it (``dropped``); once one was
        dropped, none waits again until the queue has emptied, so a stuck resolver costs training nothing
        per step. Returns whether the job was queued."""
        return self._put((fn, args))

    def collect(self, item: Any) -> bool:
        """Queue ``item`` for ``resolve_batch``, which gets it with the others collected beside it (or drop
        it, as ``submit``)."""
        return self._put((_collect, (item,)))

    def _put(self, item: tuple[Callable[..., Any], tuple]) -> bool:
        try:
            if self._stuck:
                self._q.put_nowait(item)
            else:
                self._q.put(item, timeout=PUT_WAIT_S)
            return True
        except queue.Full:
            self._stuck = True
            self.dropped += 1
            if self.dropped == 1:
                self._on_error("resolver", TimeoutError(
                    f"the resolver is {self._q.maxsize} records behind: records are dropped, and counted, until "
                    "it catches up"))
            return False

    def _loop(self) -> None:
        lower_priority()
        held: list[Any] = []  # collected items not yet resolved
        deadline = 0.0
        while True:
            try:
                item = self._q.get(timeout=max(deadline - time.monotonic(), 0.0) if held else None)
            except queue.Empty:  # the oldest held item has waited delay_s
                held = self._run_batch(held)
                continue
            if self._stuck and self._q.empty():  # caught up: back-pressure may wait again
                self._stuck = False
            try:
                if item is None:
                    self._run_batch(held)
                    return
                fn, args = item
                if fn is _collect:
                    if not held:
                        deadline = time.monotonic() + self.delay_s
                    held.append(args[0])
                    if len(held) >= self.batch:
                        held = self._run_batch(held)
                    continue
                held = self._run_batch(held)
                try:
                    fn(*args)
                except Exception as exc:
                    self._on_error(getattr(fn, "__name__", "resolve"), exc)
            finally:
                self._q.task_done()

    def _run_batch(self, held: list[Any]) -> list[Any]:
        if held and self._resolve_batch is not None:
            try:
                self._resolve_batch(held)
            except Exception as exc:
                self._on_error("resolve", exc)
        return []

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until every submitted job ran and every collected item was resolved (``flush``/``close``)."""
        done = threading.Event()
        deadline = time.monotonic() + timeout_s
        try:  # flush and close may wait (up to their timeout), unlike a training step
            self._q.put((done.set, ()), timeout=timeout_s)
            queued = True
        except queue.Full:
            queued = False
        if not queued or not done.wait(max(deadline - time.monotonic(), 0.0)):
            warn("dynascope: resolver did not drain in time", RuntimeWarning, stacklevel=2)

    def close(self, timeout_s: float = 30.0) -> None:
        """Drain and stop the thread, within ``timeout_s`` in all (a thread still busy then is left: daemon)."""
        deadline = time.monotonic() + timeout_s
        self.drain(timeout_s)
        try:
            self._q.put(None, timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Full:
            return
        self._thread.join(max(deadline - time.monotonic(), 0.01))
        if self.dropped:
            self._on_error("resolver", RuntimeError(f"{self.dropped} records dropped while the resolver was behind"))


def _collect(item: Any) -> None:
    """Marks a queued item for ``resolve_batch`` (never called)."""
