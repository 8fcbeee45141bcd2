"""When a probe records: ``schedule(step) -> bool`` callables.

Every probe takes one, so cheap probes can run every step and costly ones sparsely. ``as_schedule``
turns the ``every=`` argument of ``watch`` (an int or a callable) into one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

Schedule = Callable[[int], bool]

__all__ = ["Schedule", "as_schedule", "every", "log_spaced", "never"]


class every:  # lower case: reads as a phrase, every(10)
    """Record at steps 0, n, 2n, … (optionally starting at ``start``)."""

    def __init__(self, n: int = 1, start: int = 0) -> None:
        if int(n) < 1:
            raise ValueError(f"every(n) needs n >= 1, got {n}")
        self.n, self.start = int(n), int(start)

    def __call__(self, step: int) -> bool:
        return step >= self.start and (step - self.start) % self.n == 0

    def __repr__(self) -> str:
        return f"every({self.n})"


class log_spaced:
    """Record densely early and sparsely later: about ``per_decade`` steps per factor of 10, plus step 0.

    Early training moves fastest, so a log grid spends the records where the dynamics are; ``min_every``
    keeps late runs from going silent (0 disables it).
    """

    def __init__(self, per_decade: int = 10, min_every: int = 0) -> None:
        if int(per_decade) < 1:
            raise ValueError("log_spaced needs per_decade >= 1")
        self.per_decade, self.min_every = int(per_decade), int(min_every)
        self._grid: set[int] = {0}
        self._grid_to = 0

    def _extend(self, upto: int) -> None:
        # Rounded points 10^(i/per_decade); duplicates collapse, so early steps are all recorded.
        i = 0
        while True:
            s = int(round(10 ** (i / self.per_decade)))
            if s > upto:
                break
            self._grid.add(s)
            i += 1
        self._grid_to = upto

    def __call__(self, step: int) -> bool:
        if step > self._grid_to:
            self._extend(max(step, 2 * self._grid_to, 1000))
        return step in self._grid or (self.min_every > 0 and step % self.min_every == 0)

    def __repr__(self) -> str:
        return f"log_spaced({self.per_decade})"


def never(step: int) -> bool:
    """A schedule that never records (turns a probe off)."""
    return False


def as_schedule(spec: int | Schedule | None) -> Schedule:
    """``None``/0 → never, an int n → ``every(n)``, a callable → itself."""
    if spec is None or spec is False or (isinstance(spec, int) and not isinstance(spec, bool) and spec == 0):
        return never
    if isinstance(spec, bool):
        return every(1)
    if isinstance(spec, int):
        return every(spec)
    if isinstance(spec, float) and math.isfinite(spec) and spec >= 1:
        return every(int(spec))
    if callable(spec):
        return spec
    raise ValueError(f"a schedule is an int or a callable step -> bool, got {spec!r}")
