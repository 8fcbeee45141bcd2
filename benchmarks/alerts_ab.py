"""In-process A/B: what live monitoring costs the training step, under its worst receivers.

One process, one model: blocks of steps probed with the defaults (``watch(model, opt)``) alternate with
blocks probed with every live part on (``alerts=True`` plus a webhook rule whose receiver accepts the
connection and never answers, ``metrics_port`` served but never scraped, a rule firing on every judged
step so the webhook queue fills). Each monitored block sits between two plain-probe blocks; its ratio is
its median step over the mean of its neighbours' medians; the figure is the median of the per-round
ratios with their min and max. The rows are flushed every 0.2 s so the rules run on fresh rows all along.

    python3 benchmarks/alerts_ab.py --rounds 7 --steps 60
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

import dynascope
from dynascope.alerts import DEFAULT_RULES, Rule
from dynascope.store import RunWriter


def hung_receiver() -> tuple[str, socket.socket]:
    """A TCP listener that accepts connections and never reads or answers (a webhook that hangs)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(srv.accept()[0]) for _ in iter(int, 1)], daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}/hook", srv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def block(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, run: Path, steps: int,
          drop: int, monitored: bool, url: str, args_interval: float = 2.0) -> float:
    writer = RunWriter(run, flush_secs=0.2)
    extra = {}
    if monitored:
        rules = [*DEFAULT_RULES, Rule("loss", "> -1", hold_down=0, action="webhook", url=url)]
        extra = {"alerts": rules, "alert_interval_s": args_interval, "metrics_port": free_port()}
    scope = dynascope.watch(model, opt, run, writer=writer, system_interval_s=None, **extra)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        scope.log(step=step, loss=loss.detach())
        times.append(time.perf_counter() - t0)
    scope.close()
    writer.close()
    return statistics.median(times[drop:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--drop", type=int, default=5)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--interval-s", type=float, default=2.0, help="the monitor's poll interval (watch's default: 2)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, args.width)
    url, _srv = hung_receiver()
    ratios, plain_ms, live_ms = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        before = block(model, opt, x, Path(tmp) / "warm", args.steps, args.drop, False, url)
        for r in range(args.rounds):
            live = block(model, opt, x, Path(tmp) / f"live{r}", args.steps, args.drop, True, url, args.interval_s)
            after = block(model, opt, x, Path(tmp) / f"plain{r}", args.steps, args.drop, False, url)
            ratios.append(live / ((before + after) / 2))
            plain_ms.append((before + after) / 2 * 1e3)
            live_ms.append(live * 1e3)
            before = after
    print(f"steps per block {args.steps} (first {args.drop} dropped), {args.rounds} rounds, "
          f"model 4 x Linear({args.width}), batch 64, 1 torch thread")
    print(f"median step, probe only:          {statistics.median(plain_ms):.2f} ms")
    print(f"median step, probe + live parts:  {statistics.median(live_ms):.2f} ms")
    print(f"ratio: median {statistics.median(ratios):.3f}x  min {min(ratios):.3f}x  max {max(ratios):.3f}x  "
          f"(per round: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
