"""The full-coverage weight pass's own CPU per step, on the reference workload.

``watch(memory_budget=None, time_budget=None, bf16_k=2)`` on benchmarks/probe_overhead.py's reference model
(6 layers, d=256, 5.79M fp32 weights): the post-step pass (``probes.weight_pass.weight_pass``: every chunked
statistic of every tensor in one fused pass, and the copies for the next steps) is wrapped with
``time.thread_time``, so what is counted is the CPU of the thread that runs it, whatever else loads the
machine. Each round is a fresh process (a fresh kernel load and arena), ``--steps`` steps, the first
``--drop`` left out; the figure is the median of the rounds' medians, with their min and max. The floor
beside it: one single-threaded read pass (``torch.linalg.vector_norm``) over the same weights.

    flock /tmp/dynascope-bench.lock python3 benchmarks/weight_pass_cpu.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def child(steps: int, drop: int) -> dict[str, float]:
    import probe_ab
    import torch

    import dynascope
    from dynascope.probes import tensors

    ap = argparse.ArgumentParser()
    probe_ab.model_args(ap)
    loop = probe_ab.Loop(ap.parse_args([]))
    cpu_ms: list[float] = []
    inner = tensors.weight_pass

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            cpu_ms.append((time.thread_time() - t0) * 1e3)

    tensors.weight_pass = timed
    with tempfile.TemporaryDirectory() as run:
        scope = dynascope.watch(loop.model, loop.opt, run=run, memory_budget=None, time_budget=None, bf16_k=2)
        for _ in range(steps):
            loop.step()
        scope.close()
    flat = torch.cat([p.detach().reshape(-1) for p in loop.model.parameters()])
    torch.set_num_threads(1)
    floor = []
    for _ in range(9):
        t0 = time.perf_counter()
        torch.linalg.vector_norm(flat)
        floor.append((time.perf_counter() - t0) * 1e3)
    return {"pass_cpu_ms": statistics.median(cpu_ms[drop:]), "floor_ms": statistics.median(floor),
            "numel": flat.numel()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--drop", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.steps, args.drop)))
        return
    rounds = []
    for _ in range(args.rounds):
        done = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps), "--drop", str(args.drop)],
                              capture_output=True, text=True, check=True)
        rounds.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cpu = [r["pass_cpu_ms"] for r in rounds]
    floor = [r["floor_ms"] for r in rounds]
    print(f"weight pass, thread CPU per step: {statistics.median(cpu):.1f} ms ({min(cpu):.1f}–{max(cpu):.1f}) over "
          f"{args.rounds} processes; one read pass over {rounds[0]['numel']:,} weights {statistics.median(floor):.2f} ms")


if __name__ == "__main__":
    main()
