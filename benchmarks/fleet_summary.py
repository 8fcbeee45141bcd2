"""Fleet summary time on DuckDB and on Spark for 10, 100 and 1,000 runs, and how each grows.

Synthetic small runs (2 ranks, 12 steps, written by the real RunWriter: tests/helpers/fleet_runs.py) under
one root; the 10- and 100-run roots are the first runs of the 1,000-run one (symlinks). Each round is one
``fleet_summary(root, engine)`` call: listing the store, registering the tables on the engine, running the
summary's three queries. Spark runs in one local session (``local[2]``, 1 GB heap) started before the
rounds (its start-up and first, JIT-cold call are reported apart). Both engines' frames are checked equal.

    flock /tmp/dynascope-bench.lock python3 benchmarks/fleet_summary.py            # 10, 100, 1000 runs, 5 rounds
    flock /tmp/dynascope-bench.lock python3 benchmarks/fleet_summary.py --quick    # 10 and 100 runs, 3 rounds
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the synthetic runs the tests use

from polars.testing import assert_frame_equal  # noqa: E402

from dynascope.analyses.fleet import fleet_summary  # noqa: E402
from dynascope.store.engines import local_spark  # noqa: E402

from helpers.fleet_runs import write_synthetic_run  # noqa: E402


def build(base: Path, sizes: list[int]) -> dict[int, Path]:
    """A root of max(sizes) runs, and one root per smaller size linking to its first runs."""
    big = max(sizes)
    full = base / f"runs{big}"
    t0 = time.perf_counter()
    for i in range(big):
        write_synthetic_run(full / f"run{i:04d}", ranks=2, steps=12, seed=i)
    print(f"wrote {big} runs in {time.perf_counter() - t0:.0f} s "
          f"({sum(1 for _ in full.rglob('*.parquet'))} segment files)", flush=True)
    roots = {big: full}
    for n in sizes:
        if n != big:
            roots[n] = base / f"runs{n}"
            roots[n].mkdir()
            for i in range(n):
                (roots[n] / f"run{i:04d}").symlink_to(full / f"run{i:04d}", target_is_directory=True)
    return roots


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default=None, help="comma-separated run counts (default 10,100,1000)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--spark-rounds-max", type=int, default=None,
                    help="rounds for Spark on the largest fleet (default: --rounds)")
    ap.add_argument("--no-spark", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in (args.sizes or ("10,100" if args.quick else "10,100,1000")).split(",")]
    rounds = args.rounds or (3 if args.quick else 5)
    base = Path(tempfile.mkdtemp(prefix="dynascope-fleet-"))
    try:
        roots = build(base, sizes)
        spark = None
        if not args.no_spark:
            t_start, spark = timed(local_spark)
            t_first, _ = timed(lambda: fleet_summary(roots[min(sizes)], "spark", spark=spark))
            print(f"spark session start {t_start:.1f} s; first (JIT-cold) summary of {min(sizes)} runs {t_first:.1f} s")
        results: dict[tuple[str, int], list[float]] = {}
        for n in sizes:
            frames = {}
            for engine in ("duckdb", "spark") if spark is not None else ("duckdb",):
                k = rounds if engine == "duckdb" or n != max(sizes) else (args.spark_rounds_max or rounds)
                times = []
                for _ in range(k):
                    t, frames[engine] = timed(lambda e=engine, n=n: fleet_summary(roots[n], e, spark=spark))
                    times.append(t)
                results[(engine, n)] = times
                print(f"{engine:<6} {n:>5} runs: median {statistics.median(times):7.2f} s "
                      f"(min {min(times):.2f}, max {max(times):.2f}, {k} rounds)", flush=True)
            if "spark" in frames:
                assert_frame_equal(frames["duckdb"], frames["spark"], rel_tol=1e-9, abs_tol=0.0)
                assert frames["duckdb"].height == n
        print("\nengine   runs   median s   s per run   growth vs previous size")
        for engine in ("duckdb", "spark"):
            prev = None
            for n in sizes:
                if (engine, n) not in results:
                    continue
                med = statistics.median(results[(engine, n)])
                growth = "" if prev is None else f"x{med / prev[1]:.1f} for x{n / prev[0]:.0f} runs"
                print(f"{engine:<6} {n:>6} {med:>10.2f} {med / n:>11.4f}   {growth}")
                prev = (n, med)
        if spark is not None:
            spark.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
