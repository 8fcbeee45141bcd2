"""A torchrun worker for tests/test_deepspeed.py: real DeepSpeed ZeRO on gloo, CPU, one case per engine.

    torchrun --nproc_per_node 2 tests/deepspeed_worker.py OUT CASE [CASE ...]

Each case trains a small MLP (odd tensor sizes, so partitions are padded and tensors straddle partition
boundaries) for ``STEPS`` engine steps under ``dynascope.watch`` into ``OUT/<case>``, and rank 0 saves
what a single process needs to recompute every statistic: θ₀ and, per step, the full fp32 masters after
the step and the full gradients the optimizer stepped with (gathered with DeepSpeed's own
``safe_get_full_fp32_param``/``safe_get_full_grad``: collectives the test may make, the probe never does).
"""

from __future__ import annotations

import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

import dynascope

STEPS = 3
LR = 1e-2
# case → (ZeRO stage, bf16, how watch() is called, extra zero_optimization settings, watch() kwargs)
CASES: dict[str, tuple[int, bool, str, dict, dict]] = {
    "z1-fp32-module-opt": (1, False, "module+optimizer", {}, {}),
    "z2-fp32": (2, False, "engine", {}, {}),
    "z2-bf16-inner": (2, True, "module+inner", {}, {}),
    "z3-fp32-subgroups": (3, False, "engine", {"sub_group_size": 300}, {}),
    "z3-bf16": (3, True, "engine", {}, {}),
    "z3-budget": (3, False, "engine", {}, {"memory_budget": 0.4, "time_budget": None, "drift_every": 1}),
}


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 17), nn.ReLU(), nn.Linear(17, 1))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * step + rank))


def run_case(out: Path, case: str) -> None:
    stage, bf16, how, zero_extra, kw = CASES[case]
    model = build_model()
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": bf16},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero_extra}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                      config=config)
    watched = {"engine": (engine, None), "module+optimizer": (engine.module, engine.optimizer),
               "module+inner": (engine.module, engine.optimizer.optimizer)}[how]
    kw = {"memory_budget": None, **kw}
    scope = dynascope.watch(*watched, run=out / case, system_interval_s=None, **kw)
    params = list(engine.module.named_parameters())
    full = lambda: {n: safe_get_full_fp32_param(p).detach().clone() for n, p in params}  # noqa: E731
    record = {"theta0": full(), "grads": [], "weights": []}
    rank = dist.get_rank()
    for step in range(STEPS):
        x = batch(step, rank).to(torch.bfloat16 if bf16 else torch.float32)
        engine.backward(engine(x).float().pow(2).mean())
        record["grads"].append({n: safe_get_full_grad(p).detach().float().clone() for n, p in params})
        engine.step()
        record["weights"].append(full())
    scope.close()
    if rank == 0:
        torch.save(record, out / f"{case}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    for case in sys.argv[2:]:
        run_case(out, case)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
