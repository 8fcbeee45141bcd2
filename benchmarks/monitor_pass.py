"""In-process A/B: one pass of the default alert rules over a finished run, as the monitor runs it now
(one DuckDB thread, the four detectors sharing one ``detect_instability``) against the way it ran before
(DuckDB's default threads, each detector rule running the analysis again). Wall and CPU per pass, median
and range over rounds, the two alternating.

    dynascope demo --quick --ranks 2 --slow-rank 1 --slow-factor 6 --run /tmp/mp-run
    python3 benchmarks/monitor_pass.py /tmp/mp-run --rounds 7
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
import warnings
from pathlib import Path

from dynascope.alerts import DEFAULT_RULES
from dynascope.alerts.quantities import series
from dynascope.store import open_store


def one_pass(run: Path, shared: bool, threads: int | None) -> tuple[float, float]:
    """Every default rule's quantity read once over the whole run, as a monitor's first pass reads them."""
    began, cpu = time.perf_counter(), _cpu()
    with open_store(run, threads=threads) as store:
        cache: dict = {}
        for rule in DEFAULT_RULES:
            series(store, rule.quantity, 0, cache if shared else {})
    return time.perf_counter() - began, _cpu() - cpu


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process, DuckDB's included
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    one_pass(a.run, True, 1)  # warm the imports and the page cache
    now: list[tuple[float, float]] = []
    before: list[tuple[float, float]] = []
    for _ in range(a.rounds):
        now.append(one_pass(a.run, shared=True, threads=1))
        before.append(one_pass(a.run, shared=False, threads=None))
    for name, xs in (("now (1 thread, shared detectors)", now), ("before (default threads, per rule)", before)):
        wall, cpu = [x[0] for x in xs], [x[1] for x in xs]
        print(f"{name}: wall {statistics.median(wall):.3f} s ({min(wall):.3f}-{max(wall):.3f}), "
              f"CPU {statistics.median(cpu):.3f} s ({min(cpu):.3f}-{max(cpu):.3f})")
    ratio = [b[1] / n[1] for n, b in zip(now, before, strict=True) if n[1] > 0]
    print(f"CPU per pass, before over now: median {statistics.median(ratio):.2f}x "
          f"({min(ratio):.2f}-{max(ratio):.2f}) over {len(ratio)} rounds")


if __name__ == "__main__":
    main()
