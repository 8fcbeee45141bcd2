"""In-process A/B of the probe's step time under sharded engines: DeepSpeed ZeRO-3 beside FSDP2, 2 ranks.

One torchrun launch, 2 gloo ranks on CPU (one torch thread each), the reference model of
benchmarks/probe_overhead.py built twice, once under each engine with every parameter sharded (ZeRO-3
with ``stage3_param_persistence_threshold=0``; FSDP2 ``fully_shard`` on every block and the root), the
same fixed batch per rank. As in benchmarks/probe_ab.py, blocks of plain steps and blocks of probed
steps alternate in each process: ``dynascope.watch()`` attaches at the start of a probed block and
``close()`` detaches at its end. Each probed block's ratio is its median step over the mean of its two
plain neighbours' medians, the first ``--drop`` steps of every block left out; the engines take turns
block by block, so whatever loads the machine hits both. Rank 0's clock is reported (the ranks wait for
each other at every collective, so their steps take the same time). Beside the wall-clock ratio, the
ratio of the training thread's CPU time per step (``time.thread_time``; one torch thread does all of a
rank's compute): on a loaded host it moves far less, and it leaves out the probe's background threads
and any waiting at collectives.

Beside the A/B, a coverage run per engine (the default settings for ``--coverage-steps`` steps): how many
(step, tensor) records of the windowed statistics were taken on both ranks (their shards combine) or on
one only (the combined value is NULL): the windows are picked by the record's index and a time-budget
period the ranks agree on (probes/window.py, probes/agreement.py), so none should be on one rank only.

    flock /tmp/dynascope-bench.lock python3 benchmarks/probe_ab_sharded.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENGINES = ("zero3", "fsdp2")


def build_engine(name: str, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(model to watch, optimizer to watch, step function) of one engine over the reference model."""
    import torch
    import torch.nn.functional as F
    from probe_overhead import build

    model, opt = build(args)
    if name == "zero3":
        import deepspeed

        # the CPU shared-memory all-reduce op serves inference only; unbuilt, nothing is compiled (as in tests)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        config = {"train_micro_batch_size_per_gpu": args.batch,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

        def backward_step(loss: Any) -> None:
            engine.backward(loss)
            engine.step()
        forward, watched = engine, (engine, None)
    else:
        from torch.distributed.fsdp import fully_shard

        for blk in model.layers:
            fully_shard(blk)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # over the sharded parameters fully_shard made

        def backward_step(loss: Any) -> None:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        forward, watched = model, (model, opt)
    rank = torch.distributed.get_rank()
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1 + rank))

    def step() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.thread_time()
        logits = forward(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        backward_step(loss)
        loss.item()
        return time.perf_counter() - t0, time.thread_time() - c0
    return watched, step, model


def block(watched: tuple[Any, Any], step: Any, probed: bool, args: argparse.Namespace, tmp: str) -> dict:
    from probe_clock import instrument

    import dynascope

    scope, acc = None, {}
    if probed:
        scope = dynascope.watch(*watched, run=tempfile.mkdtemp(dir=tmp), system_interval_s=None)
        acc, _ = instrument(scope, families=False)
    times = []
    for i in range(args.block):
        if i == args.drop:
            acc.clear()
        times.append(step())
    inside = acc.get("probe", 0.0) / max(args.block - args.drop, 1)
    if scope is not None:
        scope.close()
    kept = times[args.drop:]
    return {"median_s": statistics.median(t for t, _ in kept), "cpu_s": statistics.median(c for _, c in kept),
            "inside_s": inside}


def coverage(watched: tuple[Any, Any], step: Any, args: argparse.Namespace, tmp: str, **kw: Any) -> dict[str, int]:
    """(step, tensor) records of ‖ΔW‖ taken on both ranks and on one only, under ``watch(**kw)``."""
    import torch.distributed as dist

    import dynascope

    run = [tempfile.mkdtemp(dir=tmp)]
    dist.broadcast_object_list(run, src=0)  # one run directory for both ranks
    scope = dynascope.watch(*watched, run=run[0], system_interval_s=None, **kw)
    for _ in range(args.coverage_steps):
        step()
    scope.close()
    dist.barrier()
    if dist.get_rank() != 0:
        return {}
    con = dynascope.open_store(run[0])
    assert con.rows("SELECT bool_and(sharded) FROM tensor_stats")[0][0], "the probe saw no shards"
    rows = con.rows(
        "SELECT n, count(*) FROM (SELECT count(update_norm) AS n FROM tensor_stats GROUP BY step, tensor) "
        "WHERE n > 0 GROUP BY n")
    return {f"on_{n}_ranks": c for n, c in rows}


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tmp = tempfile.mkdtemp(prefix="ds-ab-sharded-")
    engines = {name: build_engine(name, args) for name in args.engines.split(",")}
    out: dict[str, Any] = {name: {"ratio": [], "cpu_ratio": [], "step_s": [], "inside_s": []} for name in engines}
    prev = {}
    for name, (watched, step, _) in engines.items():
        for _ in range(args.warmup):
            step()
        prev[name] = block(watched, step, False, args, tmp)
    for r in range(args.rounds):
        names = list(engines)
        for name in names[r % len(names):] + names[:r % len(names)]:
            watched, step, _ = engines[name]
            probed = block(watched, step, True, args, tmp)
            nxt = block(watched, step, False, args, tmp)
            base = (prev[name]["median_s"] + nxt["median_s"]) / 2
            out[name]["ratio"].append(probed["median_s"] / base)
            out[name]["cpu_ratio"].append(probed["cpu_s"] / ((prev[name]["cpu_s"] + nxt["cpu_s"]) / 2))
            out[name]["step_s"].append(base)
            out[name]["inside_s"].append(probed["inside_s"])
            prev[name] = nxt
    for name, (watched, step, _) in engines.items():
        if args.coverage_steps:
            out[name]["coverage"] = coverage(watched, step, args, tmp)
            out[name]["coverage_memory_budget_only"] = coverage(watched, step, args, tmp, time_budget=None)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def spread(xs: list[float], scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    return (fmt.format(statistics.median(xs) * scale) + " [" + fmt.format(min(xs) * scale) + ", "
            + fmt.format(max(xs) * scale) + "]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=12, help="steps per block")
    ap.add_argument("--drop", type=int, default=3, help="first steps of each block left out")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--coverage-steps", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8, help="per rank (the reference's 16, split over 2 ranks)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, str(HERE))
        child(args)
        return
    from dynascope.core.net import free_port

    flags = [a for a in sys.argv[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", __file__, "--child", *flags]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    if res.returncode != 0 or line is None:
        print(res.stdout[-3000:] + res.stderr[-3000:], file=sys.stderr)
        sys.exit(1)
    out = json.loads(line[len("RESULT "):])
    print(f"probe step-time ratio, 2 gloo ranks, 1 thread each, d_model={args.d_model}, layers={args.layers}, "
          f"batch {args.batch}/rank; {args.rounds} rounds, blocks of {args.block} (first {args.drop} dropped); "
          "median [min, max] over rounds")
    for name, o in out.items():
        print(f"  {name:6s} ratio {spread(o['ratio'])}  main-thread CPU ratio {spread(o['cpu_ratio'])}  "
              f"plain step {spread(o['step_s'], 1e3, '{:.0f}')} ms  probe in-step "
              f"{spread(o['inside_s'], 1e3, '{:.1f}')} ms")
        for key, label in (("coverage", "default budgets"), ("coverage_memory_budget_only", "time_budget=None")):
            cov = o.get(key)
            if cov:
                print(f"         {label}: (step, tensor) ΔW records on both ranks {cov.get('on_2_ranks', 0)}, "
                      f"on one only {cov.get('on_1_ranks', 0)} ({args.coverage_steps} steps)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
