"""Training step time when the store writer cannot keep up: append must never block the step.

A small PyTorch MLP trains on CPU and appends one tensor_stats-like batch (--rows-per-step rows) per step.
Three configurations, interleaved in rounds so machine noise hits them alike:

- ``no writer``: the loop alone;
- ``writer``: a normal RunWriter;
- ``writer 10x slow``: every segment write also sleeps 10x the training time its rows took to produce, so
  the writer drains 10x slower than training fills it; the bounded buffer drops the oldest rows (counted).

Goal: median step time with the slow writer / without a writer <= 1.02.

    python3 benchmarks/writer_backpressure.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dynascope.store import RunWriter, open_store


class SlowWriter(RunWriter):
    """A writer whose disk is ``factor`` times slower than the training that feeds it."""

    def __init__(self, *args, factor: float, step_s: list[float], rows_per_step: int, **kwargs) -> None:
        self.factor, self.step_s, self.rows_per_step = factor, step_s, rows_per_step
        super().__init__(*args, **kwargs)

    def _commit(self, groups):
        rows = sum(g.parts[0][1].num_rows for g in groups if g.table == "tensor_stats")
        if rows:
            per_step = statistics.median(self.step_s[-50:]) if self.step_s else 0.01
            time.sleep(self.factor * per_step * rows / self.rows_per_step)
        return super()._commit(groups)


def train(steps: int, writer: RunWriter | None, rows: int, out: list[float]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    names = [f"layers.{i % 24}.w{i}" for i in range(rows)]
    rng = np.random.default_rng(0)
    for step in range(steps):
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        # The probes' numbers exist whether or not they are stored: only the append differs between configs.
        batch = {"step": step, "tensor": names, "update_norm": rng.random(rows), "update_ratio": rng.random(rows),
                 "grad_norm": loss.item()}
        if writer is not None:
            writer.append("tensor_stats", batch)
        out.append(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="steps per configuration per round")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--rows-per-step", type=int, default=2000)
    ap.add_argument("--factor", type=float, default=10.0)
    args = ap.parse_args()
    steps = args.steps or (100 if args.quick else 600)
    rounds = args.rounds or (2 if args.quick else 4)
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"no writer": [], "writer": [], f"writer {args.factor:g}x slow": []}
    dropped = written = 0
    root = Path(tempfile.mkdtemp(prefix="dynascope-backpressure-"))
    for r in range(rounds):
        for name, out in times.items():
            writer = None
            if name == "writer":
                writer = RunWriter(root / f"normal{r}", flush_secs=0.5)
            elif name != "no writer":
                writer = SlowWriter(root / f"slow{r}", flush_secs=0.5, max_buffer_rows=50 * args.rows_per_step,
                                    factor=args.factor, step_s=out, rows_per_step=args.rows_per_step)
            train(steps, writer, args.rows_per_step, out)
            if isinstance(writer, SlowWriter):
                writer.close(timeout_s=0)  # the slow disk would take minutes to drain; count what it kept
                dropped += writer.rows_dropped
                written += writer.rows_written
            elif writer is not None:
                writer.close()
    base = statistics.median(times["no writer"])
    print(f"\n{rounds} rounds x {steps} steps per configuration, {args.rows_per_step} rows per step\n")
    print(f"{'configuration':<22} {'median step ms':>15} {'p90 step ms':>12} {'ratio':>7}")
    for name, ts in times.items():
        med = statistics.median(ts)
        p90 = statistics.quantiles(ts, n=10)[-1]
        print(f"{name:<22} {med * 1e3:>15.3f} {p90 * 1e3:>12.3f} {med / base:>7.3f}")
    events = open_store(root).sql(
        "SELECT count(*), coalesce(sum(CAST(json_extract(fields_json, '$.dropped') AS BIGINT)), 0) "
        "FROM events WHERE event = 'rows_dropped'").fetchall()[0]
    print(f"\nslow writer: {written:,} rows written, {dropped:,} dropped (oldest first); "
          f"{events[0]} rows_dropped events recording {events[1]:,} rows")
    print("goal: slow-writer / no-writer median step ratio <= 1.02")


if __name__ == "__main__":
    main()
