"""Wall and CPU time of a demo's training, for the rule that opens its closing report.

Wall time alone says little on a loaded machine (the same run took 5 and 14 minutes on two days); the
CPU time beside it is the work done. It counts this process and the child processes it waited for
(torchrun's ranks), not Ray's workers, which the Ray runtime starts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dynascope.core.fmt import fmt_ms


def cpu_s() -> float:
    """User + system CPU seconds of this process and its waited-for children so far (0 off POSIX)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0.0
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class Clock:
    """Started where training starts: the wall time since, and the CPU time at the start."""

    wall0: float = field(default_factory=time.perf_counter)
    cpu0: float = field(default_factory=cpu_s)

    def wall_s(self) -> float:
        return time.perf_counter() - self.wall0

    def cpu_s(self) -> float:
        return cpu_s() - self.cpu0


def trained_in(wall_s: float, cpu: float | None) -> str:
    """"trained in 44.0 s (CPU 81.2 s)"; without a CPU figure, the wall time alone."""
    text = f"trained in {fmt_ms(1000 * wall_s)}"
    return text if not cpu else f"{text} (CPU {fmt_ms(1000 * cpu)})"
