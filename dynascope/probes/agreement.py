"""The largest of the ranks' values of a per-record setting, one record late: how a sharded run's ranks
agree on the time budget's period (``probes.window``).

Each rank measures its own window time and step time, so the power-of-two period each derives from them
differs between ranks whenever the budget sits near a boundary: one rank's ``need`` is 1.9 records per
window, another's 2.1, their periods 2 and 4, and at the odd multiples of 2 only the first rank takes the
window. Its partial sums then have no partner and those statistics do not combine. So every rank posts
its period at each record as an asynchronous MAX all-reduce of one int64, on a gloo group of its own
(the training's collectives, on whatever backend, never see it), and uses at its next record the result
of the previous post: the same on every rank, and the largest, so no rank goes over its budget. The group
is made in ``watch()`` (``prepare``), never inside a step, over the default group: every rank of it must
run the probe (rollout workers joined to the default group for weight sync would make that one call wait
``timeout_s``, then the time budget falls back to no timed windows on this rank).

Reading it costs no wait in a training loop: between two records the training's own collectives
(gradient reduction, ZeRO-3's parameter gathers) cannot complete until every rank has passed the earlier
record, so every rank has posted before any rank reads. A rank that stopped posting (its probe failed or
was closed) is waited for up to ``timeout_s`` once; then this rank takes no more time-budgeted windows,
which is what the other ranks' failed waits lead them to as well, and the failure is reported.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

__all__ = ["NEVER", "RankMax"]

# The period of a rank that can no longer agree with the others: no timed window after the failure.
NEVER = 1 << 62
POLL_S = 0.0005


class RankMax:
    """``exchange(value)`` posts this rank's value and returns the largest value the ranks posted at the
    previous call (``first`` at the first call). ``notice`` holds the one-line reason after a failure."""

    def __init__(self, first: int = 1, timeout_s: float = 30.0) -> None:
        self.first = first
        self.timeout_s = timeout_s
        self.notice: str | None = None
        self.failed = False
        self._group: Any = None
        self._work: Any = None
        self._buf: Any = None
        self._world: int | None = None

    def prepare(self) -> None:
        """Make the group now (``watch()`` calls this for a sharded run, before the first step): creating a
        process group is a collective over the default group, so every rank of it must be running the
        probe; a rank that is not costs this call one wait of ``timeout_s``, after which this rank takes no
        time-budgeted windows (reported), never a stall inside a training step."""
        try:
            self._world_size()
        except Exception as exc:
            self.failed = True
            self.notice = (f"time budget: no process group for the ranks' window period ({type(exc).__name__}: "
                           f"{exc}); no time-budgeted windows on this rank")

    @property
    def group(self) -> Any:
        """The gloo group made by ``prepare`` (None: not made, or failed)."""
        return None if self.failed else self._group

    def _world_size(self) -> int:
        if self._world is None:
            import torch.distributed as dist

            on = dist.is_available() and dist.is_initialized()
            self._world = dist.get_world_size() if on else 1
            if self._world > 1:  # collective: every rank makes it at the same record (its first exchange)
                self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._world

    def exchange(self, value: int) -> int:
        if self.failed:
            return NEVER
        try:
            if self._world_size() == 1:
                return value
            agreed = self.first if self._work is None else self._take()
            self._post(value)
            return agreed
        except Exception as exc:  # the period can no longer be agreed: no more timed windows on this rank
            self.failed, self._work = True, None
            self.notice = (f"time budget: the ranks' window period could not be agreed ({type(exc).__name__}: "
                           f"{exc}); no more time-budgeted windows on this rank")
            return NEVER

    def _take(self) -> int:
        deadline = time.monotonic() + self.timeout_s
        while not self._work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"another rank posted no period within {self.timeout_s:g} s")
            time.sleep(POLL_S)
        self._work.wait()  # raises the collective's own error, if it failed
        return int(self._buf[0])

    def close(self, timeout_s: float = 5.0) -> None:
        """Free the group once the last post has completed (every rank closes after the same record)."""
        work, group, self._work, self._group = self._work, self._group, None, None
        if group is None:
            return
        try:
            import torch.distributed as dist

            deadline = time.monotonic() + timeout_s
            while work is not None and not work.is_completed() and time.monotonic() < deadline:
                time.sleep(POLL_S)
            if work is None or work.is_completed():  # a group with a post in flight is left to the process's end
                dist.destroy_process_group(group)
        except Exception:  # closing never raises into the user's script; the group then lives to the end
            pass

    def _post(self, value: int) -> None:
        import torch
        import torch.distributed as dist

        self._buf = torch.tensor([value], dtype=torch.int64)
        self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
