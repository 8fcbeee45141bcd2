"""Probe overhead: median step time and peak extra memory, dynascope vs no probe vs peers.

Reference workload (the issue's): 6-layer d=256 pre-norm transformer, vocab 2048, batch 16×64, AdamW,
``torch.set_num_threads(2)``. Each configuration runs in its own child process (same process tree,
run one after another, repeated ``--rounds`` times) so hooks never leak between configurations and
each child's peak memory is its own:

    none            no probe (the loop still reads the loss, as every configuration does)
    ds-default      dynascope.watch(model, opt) — every=1, θ₀="init", memory_budget=0.1
    ds-noref        the same without θ₀ (reference=None)
    ds-full         memory_budget=2: θ₀ resident, every statistic for every tensor at every step
    wandb           wandb.watch(model, log="all", log_freq=1), WANDB_MODE=offline, dir in a tmpdir
    tensorboard     per-tensor weight and gradient histograms every step (torch.utils.tensorboard)

Peak extra memory is reported as a share of parameter bytes: on CUDA from the caching allocator's
peak over the measured steps (exact); on CPU from the child's peak RSS (ru_maxrss) minus its RSS once
every library (dynascope, wandb, tensorboard — imported by every child alike) and the model are
loaded, so import costs cancel out (allocator caching makes it noisy by a few MB).

    python3 benchmarks/probe_overhead.py                 # CPU, reference workload (~5 min)
    python3 benchmarks/probe_overhead.py --quick         # smoke run (< 1 min)
    python3 benchmarks/probe_overhead.py --device cuda   # the same on a GPU (add --d-model 1024 ...)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = ("none", "ds-default", "ds-noref", "ds-full", "wandb", "tensorboard")


def build(args: argparse.Namespace):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d: int, h: int) -> None:
            super().__init__()
            self.h = h
            self.attn_norm, self.mlp_norm = nn.LayerNorm(d), nn.LayerNorm(d)
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
            self.up_proj, self.down_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            y = self.attn_norm(x)
            q, k, v = (p(y).view(b, t, self.h, d // self.h).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.o_proj(a)
            return x + self.down_proj(F.gelu(self.up_proj(self.mlp_norm(x))))

    class LM(nn.Module):
        def __init__(self, v: int, d: int, n: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(v, d)
            self.layers = nn.ModuleList(Block(d, max(d // 64, 1)) for _ in range(n))
            self.norm, self.lm_head = nn.LayerNorm(d), nn.Linear(d, v, bias=False)

        def forward(self, x):
            h = self.embed(x)
            for blk in self.layers:
                h = blk(h)
            return self.lm_head(self.norm(h))

    torch.manual_seed(0)
    model = LM(args.vocab, args.d_model, args.layers).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def child(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    for lib in ("dynascope", "wandb", "torch.utils.tensorboard"):  # same import footprint everywhere
        try:
            __import__(lib)
        except Exception:
            pass
    model, opt = build(args)
    import psutil

    rss0 = psutil.Process().memory_info().rss
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tmp = tempfile.mkdtemp(prefix="ds-bench-")
    scope, tb, wb = None, None, None
    probe_s = [0.0]
    if args.config.startswith("ds-"):
        import dynascope

        kw = {"ds-default": {}, "ds-noref": {"reference": None}, "ds-full": {"memory_budget": 2.0}}[args.config]
        scope = dynascope.watch(model, opt, run=os.path.join(tmp, "run"), **kw)
        # Time the probe's own work inside each step too: on a loaded machine the step-time ratio
        # across processes is noisy, while (step − probe)/step measured in the same steps is not.
        for name in ("before", "after"):
            setattr(scope.stats, name, _timed(getattr(scope.stats, name), probe_s))
    elif args.config == "wandb":
        os.environ.update(WANDB_MODE="offline", WANDB_DIR=tmp, WANDB_SILENT="true")
        import wandb

        wb = wandb.init(project="probe-overhead", dir=tmp)
        wandb.watch(model, log="all", log_freq=1)
    elif args.config == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(tmp)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=dev, generator=g)
    times, probes = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        probe_s[0] = 0.0
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = loss.item()  # every configuration reads the loss (a sync, like any logging loop)
        if wb is not None:
            wb.log({"loss": lv})
        if tb is not None:
            for n, p in model.named_parameters():
                tb.add_histogram(n, p.detach(), i)
                tb.add_histogram(n + ".grad", p.detach(), i)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            probes.append(probe_s[0])
    peak = (torch.cuda.max_memory_allocated() if dev.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0)
    if scope is not None:
        scope.close()
    if wb is not None:
        wb.finish()
    if tb is not None:
        tb.close()
    return {"config": args.config, "times": times, "probe": probes, "peak_bytes": peak,
            "param_bytes": param_bytes}


def _timed(fn, acc: list[float]):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += time.perf_counter() - t
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="few steps, one round: a smoke run")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--child", dest="config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.config:
        print(json.dumps(child(args)))
        return
    if args.quick:
        args.steps, args.warmup, args.rounds = 4, 2, 1
    configs = [c for c in args.configs.split(",") if c]
    passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                   ("device", "steps", "warmup", "threads", "vocab", "d_model", "layers", "batch", "seq")]
    results: dict[str, dict] = {}
    for _ in range(args.rounds):
        for c in configs:  # configurations interleave across rounds, so slow drift hits all of them
            out = subprocess.run([sys.executable, __file__, "--child", c, *passthrough], capture_output=True,
                                 text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=1800)
            if out.returncode != 0:
                print(f"{c}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            agg = results.setdefault(c, {"times": [], "probe": [], "peaks": [], "param_bytes": r["param_bytes"]})
            agg["times"] += r["times"]
            agg["probe"] += r["probe"]
            agg["peaks"].append(r["peak_bytes"])
    if "none" not in results:
        sys.exit("the no-probe baseline failed")
    base_t = statistics.median(results["none"]["times"])
    base_m = min(results["none"]["peaks"])
    pb = results["none"]["param_bytes"]
    print(f"device={args.device} d={args.d_model} layers={args.layers} vocab={args.vocab} "
          f"batch={args.batch}x{args.seq} threads={args.threads} params={pb / 4e6:.2f}M "
          f"steps={args.steps}x{args.rounds} rounds")
    print(f"{'config':<14}{'median step ms':>16}{'ratio':>9}{'in-step probe ratio':>21}"
          f"{'peak extra mem / param bytes':>31}")
    for c in configs:
        if c not in results:
            continue
        t = statistics.median(results[c]["times"])
        m = min(results[c]["peaks"]) - base_m
        # step / (step − probe work), per step, then the median: the probe's cost in the same steps
        own = statistics.median(s / max(s - p, 1e-9) for s, p in zip(results[c]["times"], results[c]["probe"],
                                                                      strict=True))
        own_s = f"{own:.3f}x" if any(results[c]["probe"]) else "-"
        print(f"{c:<14}{t * 1e3:>16.1f}{t / base_t:>8.3f}x{own_s:>21}{m / pb:>30.1%}")


if __name__ == "__main__":
    main()
