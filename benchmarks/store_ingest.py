"""Ingest rate of one metrics stream: dynascope's RunWriter vs wandb offline vs TensorBoard.

The same stream goes to each logger: --steps steps of 100 named float metrics. Each timing runs from the
first log call to the end of close/finish, so everything buffered is on disk when the clock stops.
Goals: dynascope >= 2M rows/s, >= 15x wandb offline.

    python3 benchmarks/store_ingest.py           # 20k steps (2M rows) per logger; wandb gets fewer steps
    python3 benchmarks/store_ingest.py --quick   # < 1 minute
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

METRICS = [f"train/metric_{i:03d}" for i in range(100)]


def stream(steps: int) -> list[list[float]]:
    rng = random.Random(0)
    pool = [[rng.random() for _ in METRICS] for _ in range(64)]  # fresh lists would time the RNG, not the logger
    return [pool[s % 64] for s in range(steps)]


def run_dynascope(steps: int, root: Path) -> tuple[float, float]:
    from dynascope.core.clock import now_us
    from dynascope.store import RunWriter

    values = stream(steps)
    w = RunWriter(root / "dynascope", flush_secs=2.0)
    t0 = time.perf_counter()
    for s in range(steps):
        w.append("scalars", {"step": s, "time_us": now_us(), "key": METRICS, "value": values[s]})
    t_append = time.perf_counter() - t0
    w.close()
    assert w.rows_written >= steps * len(METRICS) and w.rows_dropped == 0, (w.rows_written, w.rows_dropped)
    return time.perf_counter() - t0, t_append


def run_wandb(steps: int, root: Path) -> tuple[float, float]:
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(root), WANDB_CONSOLE="off")
    import wandb

    values = stream(steps)
    run = wandb.init(project="dynascope-bench", dir=str(root), settings=wandb.Settings(console="off"))
    t0 = time.perf_counter()
    for s in range(steps):
        run.log(dict(zip(METRICS, values[s], strict=True)), step=s)
    t_append = time.perf_counter() - t0
    run.finish()
    return time.perf_counter() - t0, t_append


def run_tensorboard(steps: int, root: Path) -> tuple[float, float]:
    from torch.utils.tensorboard import SummaryWriter

    values = stream(steps)
    w = SummaryWriter(log_dir=str(root / "tb"), max_queue=1000, flush_secs=2)
    t0 = time.perf_counter()
    for s in range(steps):
        for k, v in zip(METRICS, values[s], strict=True):
            w.add_scalar(k, v, s)
    t_append = time.perf_counter() - t0
    w.close()
    return time.perf_counter() - t0, t_append


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="steps for dynascope (peers get --peer-steps)")
    ap.add_argument("--peer-steps", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3, help="best of N for dynascope")
    args = ap.parse_args()
    steps = args.steps or (5_000 if args.quick else 20_000)
    peer_steps = args.peer_steps or (300 if args.quick else 2_000)
    loggers: list[tuple[str, Callable, int, int]] = [
        ("dynascope RunWriter", run_dynascope, steps, args.repeat),
        ("wandb offline", run_wandb, peer_steps, 1),
        ("TensorBoard add_scalar", run_tensorboard, peer_steps, 1),
    ]
    results = {}
    for name, fn, n, repeat in loggers:
        best = None
        for _ in range(repeat):
            root = Path(tempfile.mkdtemp(prefix="dynascope-ingest-"))
            try:
                cpu0 = time.process_time()
                total, append = fn(n, root)
                cpu = time.process_time() - cpu0
            except ImportError as exc:
                print(f"{name}: skipped ({exc})")
                break
            finally:
                shutil.rmtree(root, ignore_errors=True)
            if best is None or total < best[0]:
                best = (total, append, cpu)
        if best:
            results[name] = (n * len(METRICS), *best)
    base = results["dynascope RunWriter"][0] / results["dynascope RunWriter"][1]
    print(f"\n{len(METRICS)} metrics per step; rows/s counted to the end of close/finish\n")
    print(f"{'logger':<24} {'rows':>10} {'total s':>9} {'rows/s':>12} {'log-call rows/s':>16} "
          f"{'rows/CPU-s':>12} {'dynascope x':>12}")
    for name, (rows, total, append, cpu) in results.items():
        rate = rows / total
        print(f"{name:<24} {rows:>10,} {total:>9.3f} {rate:>12,.0f} {rows / append:>16,.0f} "
              f"{rows / max(cpu, 1e-9):>12,.0f} {base / rate:>12.1f}")
    print("\nrows/CPU-s counts this process's threads only (wandb's wandb-core service runs apart, so its"
          " figure flatters wandb);\non a busy machine it is the steadier number.")
    print("goals: dynascope >= 2,000,000 rows/s and >= 15x wandb offline")


if __name__ == "__main__":
    main()
