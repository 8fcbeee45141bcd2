"""A torchrun worker for tests/test_deepspeed.py: real DeepSpeed ZeRO on gloo, CPU, one case per engine.

    torchrun --nproc_per_node 2 tests/helpers/deepspeed_worker.py OUT CASE [CASE ...]

Each case trains a small MLP (odd tensor sizes, so partitions are padded and tensors straddle partition
boundaries) for ``STEPS`` engine steps under ``dynascope.watch`` into ``OUT/<case>``, and rank 0 saves
what a single process needs to recompute every statistic: θ₀ and, per step, the full fp32 masters after
the step and the full gradients the optimizer stepped with (gathered with DeepSpeed's own
``safe_get_full_fp32_param``/``safe_get_full_grad``: collectives the test may make, the probe never does).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

import dynascope
import dynascope.integrations.deepspeed

# On CPU, DeepSpeed's first init_distributed JIT-compiles a shared-memory all-reduce op (g++, ~2 min on 2
# cores) that only inference_all_reduce uses: training's collectives are torch.distributed's (gloo here).
# Marked incompatible, it is not built, so the tests need neither a compiler nor the build time.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

STEPS = 3
LR = 1e-2
# A time budget far below a window's share of a step here (a window takes ~2-4% of one): the period grows.
TIME_BUDGET = {"memory_budget": 0.4, "time_budget": 0.005, "drift_every": 1}
# The planted boundary: windows costing 1.9% and 2.1% of a record's time under a 1% budget ask for periods
# of 2 and 4 records; each rank plans them against its own planted clock (tests/helpers/windows.py).
PLANTED_COST = (0.019, 0.021)
PLANTED_RECORDS = 64
# case → stage (ZeRO stage), bf16, watch (what watch() is given: "engine" (default), "module" (engine.module
# alone), "module+optimizer" (and engine.optimizer), "module+inner" (and the inner torch optimizer),
# "integration" (dynascope.integrations.deepspeed.watch)), gas (micro-batches per step), zero (more
# zero_optimization settings; the persistence threshold is 0 unless given: every tensor partitioned),
# reference ("state_dict": θ₀ as the whole initial weights, cut to each rank's slice), kw (watch kwargs,
# given to the single-process reference too), budget (watch kwargs of a budgeted run, checked on its own)
CASES: dict[str, dict[str, Any]] = {
    "z1-fp32-module-opt": {"stage": 1, "watch": "module+optimizer", "reference": "state_dict"},
    "z1-bf16": {"stage": 1, "bf16": True},
    # bf16 parameters with fp32 gradient accumulation under ZeRO-1: DeepSpeed's BF16_Optimizer
    "z1-bf16-fp32acc": {"stage": 1, "bf16": True, "data_types": {"grad_accum_dtype": "fp32"}, "kw": {"bf16_k": 2}},
    "z2-fp32-gas2": {"stage": 2, "watch": "module", "gas": 2, "kw": {"bf16_k": 2}},
    "z2-bf16-inner": {"stage": 2, "bf16": True, "watch": "module+inner"},
    "z3-fp32-subgroups": {"stage": 3, "zero": {"sub_group_size": 300}, "reference": "state_dict"},
    "z3-fp32-persistent": {"stage": 3, "zero": {"stage3_param_persistence_threshold": 100_000}},
    "z3-bf16": {"stage": 3, "bf16": True, "watch": "integration", "kw": {"bf16_k": 2}},
    "z2-offload": {"stage": 2, "zero": {"offload_optimizer": {"device": "cpu"}}},
    "z3-offload": {"stage": 3, "zero": {"offload_optimizer": {"device": "cpu"}}},
    "z3-budget": {"stage": 3, "budget": {"memory_budget": 0.4, "time_budget": None, "drift_every": 1}},
    "z2-time-budget": {"stage": 2, "steps": 8, "budget": TIME_BUDGET},
    "z3-time-budget": {"stage": 3, "steps": 8, "budget": TIME_BUDGET},
}


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 17), nn.ReLU(), nn.Linear(17, 1))


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))


def run_case(out: Path, case: str) -> None:
    opts = CASES[case]
    bf16, gas = opts.get("bf16", False), opts.get("gas", 1)
    model = build_model()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "bf16": {"enabled": bf16},
              "zero_force_ds_cpu_optimizer": False,  # offload with torch's AdamW: nothing to compile
              "zero_optimization": {"stage": opts["stage"], "stage3_param_persistence_threshold": 0,
                                    **opts.get("zero", {})}, **({"data_types": opts["data_types"]} if "data_types" in opts else {})}
    theta0 = {n: p.detach().clone() for n, p in model.state_dict().items()}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                      config=config)
    kw = {"memory_budget": None, **opts.get("kw", {}), **opts.get("budget", {})}
    if opts.get("reference") == "state_dict":
        kw["reference"] = theta0
    how = opts.get("watch", "engine")
    if how == "integration":
        scope = dynascope.integrations.deepspeed.watch(engine, run=out / case, system_interval_s=None, **kw)
    else:
        watched = {"engine": (engine, None), "module": (engine.module, None),
                   "module+optimizer": (engine.module, engine.optimizer),
                   "module+inner": (engine.module, engine.optimizer.optimizer)}[how]
        scope = dynascope.watch(*watched, run=out / case, system_interval_s=None, **kw)
    if opts["stage"] == 3:  # the masters and gradients are read from DeepSpeed's flat buffers directly
        assert all(t.master_at is not None and t.grad_at is not None for t in scope.tracked)
    params = list(engine.module.named_parameters())
    full = lambda: {n: safe_get_full_fp32_param(p).detach().clone() for n, p in params}  # noqa: E731
    record = {"theta0": full(), "grads": [], "weights": []}
    rank = dist.get_rank()
    for step in range(opts.get("steps", STEPS)):
        for micro in range(gas):
            x = batch(step, micro, rank).to(torch.bfloat16 if bf16 else torch.float32)
            engine.backward(engine(x).float().pow(2).mean())
            if micro < gas - 1:
                engine.step()  # not a boundary: DeepSpeed accumulates, the optimizer does not step
        record["grads"].append({n: safe_get_full_grad(p).detach().float().clone() for n, p in params})
        engine.step()
        record["weights"].append(full())
    scope.close()
    assert "backward" not in vars(engine) and "step" not in vars(engine.optimizer)  # the hooks are gone
    if rank == 0:
        torch.save(record, out / f"{case}.pt")


def run_without_optimizer(out: Path) -> None:
    """A ZeRO-3 engine without an optimizer (how a frozen reference model is served in RL post-training):
    its parameters are partitioned but no fp32 master exists, and nothing steps. ``watch(engine)`` must
    neither raise nor record figures: each tensor is skipped with its reason, ``scope.step()`` closes steps."""
    engine, *_ = deepspeed.initialize(model=build_model(), config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    scope = dynascope.watch(engine, run=out / "z3-no-optimizer", system_interval_s=None)
    for step in range(STEPS):
        with torch.no_grad():
            engine(batch(step, 0, dist.get_rank()))
        scope.step()
    scope.close()


def run_hf(out: Path, stage: int) -> None:
    """A Hugging Face Trainer under accelerate's DeepSpeed plugin with DynascopeCallback: a tiny GPT-2
    from config on random tokens; a second callback gathers the fp32 masters at the start and after
    every step (rank 0 saves them)."""
    import transformers

    from dynascope.integrations.hf import DynascopeCallback

    class Gather(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.weights: list[dict[str, torch.Tensor]] = []

        def _full(self, model: nn.Module) -> None:
            self.weights.append({n: safe_get_full_fp32_param(p).detach().clone() for n, p in model.named_parameters()})

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self._full(model)

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self._full(model)

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    args = transformers.TrainingArguments(
        output_dir=str(out / "hf-out"), per_device_train_batch_size=2, max_steps=STEPS, learning_rate=1e-2,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, deepspeed=ds)
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    transformers.set_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 40, (16, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    gather = Gather()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[
        DynascopeCallback(run=str(out / f"hf-z{stage}"), system_interval_s=None, memory_budget=None), gather])
    trainer.train()
    if dist.get_rank() == 0:
        torch.save({"weights": gather.weights}, out / f"hf-z{stage}.pt")


def run_planted_period(out: Path) -> None:
    """Each rank plans the windows of a planted clock whose costs straddle a power of two, with the ranks'
    agreement on the period (``probes.agreement.RankMax``, over this gloo world) and with each rank's own
    period; rank 0 saves both ranks' windows of both."""
    from dynascope.probes.agreement import RankMax

    from helpers.windows import simulate

    class OwnPeriod(RankMax):
        def exchange(self, value: int) -> int:
            return value

    cost = [PLANTED_COST[dist.get_rank()]] * PLANTED_RECORDS
    got = {"agreed": simulate(cost, records=PLANTED_RECORDS),
           "own": simulate(cost, records=PLANTED_RECORDS, agreement=OwnPeriod())}
    both: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(both, got)
    if dist.get_rank() == 0:
        torch.save(both, out / "planted-period.pt")


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    for case in sys.argv[2:]:
        if case.startswith("hf-z"):
            run_hf(out, int(case[4:]))
        elif case == "z3-no-optimizer":
            run_without_optimizer(out)
        elif case == "planted-period":
            run_planted_period(out)
        else:
            run_case(out, case)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
