"""What the writer holds after a failed write: the encoded groups, kept as they are, and when to try again.

A group whose segment write failed (a full disk, an NFS error) is retried at the next flush as the same
Arrow tables and rollups: re-encoding the whole backlog on every failed flush would cost CPU and hold the
GIL beside training for as long as the disk stays full. The backlog is bounded with the buffer it came from
(the writer's ``max_buffer_rows`` / ``max_buffer_bytes``): the largest table's oldest groups go first, and
are counted.

``Backoff`` spaces the retries: after ``k`` failed flushes in a row the writer waits ``base * 2**k``
seconds (at most ``cap_s``) before the next, so a full disk is not hit every ``flush_secs`` by every rank
of a node; a flush that succeeds resets it.
"""

from __future__ import annotations

import time
from collections import deque

from dynascope.store.flush import Group


def group_rows(g: Group) -> int:
    """The rows a group stands for: its table's own (its rollups' are derived)."""
    return g.parts[0][1].num_rows


def group_bytes(g: Group) -> int:
    """Memory the group's Arrow tables hold."""
    return sum(a.nbytes for _, a in g.parts)


class Backlog:
    """Failed groups, oldest first, with their rows and bytes."""

    __slots__ = ("groups", "nbytes", "rows")

    def __init__(self) -> None:
        self.groups: deque[tuple[Group, int, int]] = deque()
        self.rows = 0
        self.nbytes = 0

    def keep(self, g: Group) -> None:
        g.buffered = None  # the Python batches it came from are not needed again: release them
        n, b = group_rows(g), group_bytes(g)
        self.groups.append((g, n, b))
        self.rows += n
        self.nbytes += b

    def take(self) -> list[Group]:
        """Every group, oldest first, leaving the backlog empty."""
        out = [g for g, _, _ in self.groups]
        self.groups.clear()
        self.rows = self.nbytes = 0
        return out

    def drop_oldest(self, rows: int, nbytes: int) -> dict[str, tuple[int, int]]:
        """Drop the oldest groups of the table holding the most bytes (as the buffers do: a run's own rows
        and events outlast a flood of statistics) until ``rows`` rows and ``nbytes`` bytes are gone, or none
        is left; the rows and bytes dropped per table."""
        dropped: dict[str, tuple[int, int]] = {}
        while (rows > 0 or nbytes > 0) and self.groups:
            held: dict[str, int] = {}
            for g, _, b in self.groups:
                held[g.table] = held.get(g.table, 0) + b
            victim = max(held, key=held.__getitem__)
            i = next(i for i, (g, _, _) in enumerate(self.groups) if g.table == victim)
            g, n, b = self.groups[i]
            del self.groups[i]
            self.rows -= n
            self.nbytes -= b
            rows, nbytes = rows - n, nbytes - b
            r0, b0 = dropped.get(g.table, (0, 0))
            dropped[g.table] = (r0 + n, b0 + b)
        return dropped


class Backoff:
    """When the next flush may run after failures: ``base_s * 2**failures``, at most ``cap_s``."""

    __slots__ = ("base_s", "cap_s", "failures", "retry_at")

    def __init__(self, base_s: float, cap_s: float = 30.0) -> None:
        self.base_s, self.cap_s = max(float(base_s), 0.01), float(cap_s)
        self.failures = 0
        self.retry_at = 0.0  # time.monotonic(); 0: no wait

    def record(self, ok: bool) -> float:
        """Count a flush that wrote everything (``ok``: no wait after it) or failed; seconds until the next try."""
        if ok:
            self.failures, self.retry_at = 0, 0.0
            return 0.0
        self.failures += 1
        delay = min(self.base_s * 2.0 ** self.failures, self.cap_s)
        self.retry_at = time.monotonic() + delay
        return delay

    def wait_s(self) -> float:
        """Seconds until a retry is due (0 when it is)."""
        return max(self.retry_at - time.monotonic(), 0.0)
