"""What a probed block spends where: the probe's in-step time, by statistic family, its threads' CPU, and the
process's page faults and resident memory.

Shared by the in-process A/B (``probe_ab.py``) and the benchmarks built on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

# In-step families: (label, where the callable lives, attribute); "pass:<key>" is the probe's pass of the
# declared statistics with that key (tier:inputs, ``stats.engine.Pass``). Names missing in this version of
# the probes are skipped, so the table shows what the installed probes have.
FAMILIES = (
    ("‖W‖/‖g‖", "pass:every:grad", "run_batched"), ("‖W‖/‖g‖", "pass:cadence:new", "run_batched"),
    ("gradient sparsity", "pass:window:grad", "run"),
    ("ΔW snapshot", "snapshot", "take"), ("ΔW, changed, sign flips", "pass:window:new,old", "run"),
    ("drift", "pass:window:ref,new", "run"), ("S_k", "pass:every:new,k_snapshot", "run"),
    ("spectral", "spectral", "before"), ("spectral", "spectral", "after"),
)


def minor_faults() -> int:
    """Minor page faults of this process so far (every thread)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rss() -> int:
    """This process's resident bytes."""
    import psutil

    return psutil.Process().memory_info().rss


def rss_file() -> int:
    """File-backed resident bytes (library code and data pages; Linux, else 0): shared between the
    processes that map the same library, and dropped by the kernel under memory pressure."""
    try:
        with open("/proc/self/status") as fh:
            return next((int(line.split()[1]) * 1024 for line in fh if line.startswith("RssFile:")), 0)
    except OSError:
        return 0


def tensor_stats_of(scope: Any) -> Any:
    """The scope's tensor-statistics probe (``scope.stats``, or the probe named ``tensor_stats``)."""
    stats = getattr(scope, "stats", None)
    if stats is not None:
        return stats
    for p in getattr(scope, "probes", ()):
        if getattr(p, "name", "") == "tensor_stats":
            return p
    return None


# The in-step clock: wall time by default; ``time.thread_time`` gives the training thread's CPU time,
# which a loaded machine inflates far less (exact with one torch thread, which then does all the work).
CLOCK = time.perf_counter


def _wrap(owner: Any, attr: str, acc: dict[str, float], label: str) -> None:
    fn = getattr(owner, attr, None)
    if fn is None or not callable(fn):
        return

    def timed(*a: Any, **k: Any) -> Any:
        t = CLOCK()
        try:
            return fn(*a, **k)
        finally:
            acc[label] = acc.get(label, 0.0) + CLOCK() - t
    setattr(owner, attr, timed)


def instrument(scope: Any, families: bool) -> tuple[dict[str, float], Callable[[], None]]:
    """Per-step accumulators of in-step probe time: key "probe" (before + after) and, with ``families``,
    one key per statistic family. Returns (accumulator, undo) — undo restores module-level functions (none
    now: the wrapped callables belong to the scope's own probe objects)."""
    acc: dict[str, float] = {}
    stats = tensor_stats_of(scope)
    undo: list[tuple[Any, str, Any]] = []
    if families:
        owners: dict[str, Any] = {"snapshot": getattr(stats, "snapshot", None),
                                  "spectral": getattr(scope, "spectral", None)}
        for p in [*getattr(stats, "grad_passes", ()), *getattr(stats, "weight_passes", ())]:
            owners[f"pass:{p.key}"] = p
        for label, where, attr in FAMILIES:
            owner = owners.get(where)
            if owner is not None and hasattr(owner, attr):
                _wrap(owner, attr, acc, label)
    if stats is not None:
        for attr in ("before", "after"):
            _wrap(stats, attr, acc, "probe")

    def restore() -> None:
        for owner, attr, fn in undo:
            setattr(owner, attr, fn)
    return acc, restore


def _probe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dynascope") and t.ident is not None]


def _thread_cpu(threads: list[threading.Thread]) -> float:
    total = 0.0
    for t in threads:
        try:
            total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))  # type: ignore[arg-type]
        except (OSError, ProcessLookupError, AttributeError):
            pass  # the thread ended (its CPU time is then lost to this count) or the platform lacks it
    return total
