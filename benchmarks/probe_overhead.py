"""Probe overhead: median step time and peak extra memory, dynascope vs no probe vs peers.

Reference workload: 6-layer d=256 pre-norm transformer, vocab 2048, batch 16×64, AdamW,
``torch.set_num_threads(2)``. Every measurement runs in a fresh child process (one after another,
configurations interleaved across ``--rounds``, in reverse order every other round), so hooks never leak
and each peak is the child's own:

    none            no probe (the loop still reads the loss, as every configuration does)
    ds-default      dynascope.watch(model, opt) — every=1, θ₀="init", memory_budget=0.1
    ds-noref        the same without θ₀ (reference=None)
    ds-full         memory_budget=2: θ₀ resident, every statistic for every tensor at every step
    wandb           wandb.watch(model, log="all", log_freq=1), WANDB_MODE=offline, dir in a tmpdir
    tensorboard     per-tensor weight and gradient histograms every step (torch.utils.tensorboard)
    ds-fixed        the default set's per-step part only: time_budget=0, so no window after the first (not
                    in the default list)
    ds-closed       watch() then close() before the first step, so no probe runs (not in the default
                    list): how far the heap layout an attached-then-detached probe leaves moves the step

Parts:
1. Step time at the reference size, every configuration, across processes: median step-time ratio to
   ``none`` over all steps, each round's ratio (its child's median over the baseline child's) with the
   min / median / max over ``--rounds``, and the probe's own share measured inside the same steps.
2. The in-process A/B (benchmarks/probe_ab.py, ``--ab-configs``): one process alternates plain and
   probed blocks, attaching with ``watch()`` and detaching with ``close()``, so machine noise hits both
   sides alike; per-round ratios with their spread, in-step time and the probe threads' CPU per step.
   ``--stats`` adds the per-statistic configurations and the in-step split by statistic family. Then
   the rotation length of the default set (``--rotation-steps``), read back from its store, and one
   table that puts the A/B beside the cross-process rounds.
   Both step-time parts also count the process's minor page faults per measured step. Under glibc's
   defaults the reference step returns freed activation memory to the OS and faults it back in,
   thousands of pages a step, and how many depends on where earlier allocations landed, so the count
   differs 2-3x between processes of one configuration. ``--malloc-fixed`` runs the timing children
   with trimming and large-block mmap off (``probe_ab.FIXED_MALLOC``), which removes those faults as a
   caching allocator (jemalloc, tcmalloc) would, to tell the heap's share of the spread from the host's;
   the default is glibc's own behaviour, what a user's process gets.
3. Memory at several model sizes (``--sizes``, d_model values; benchmarks/probe_memory.py): for each
   ``--mem-configs`` configuration, the process's peak over ``none`` ("extra") and the probe's own
   peak at the allocator ("held": snapshot + θ₀ chunks + temporaries), each fitted as
   ``fixed + k · param_bytes``. k is the part that grows with the model — the goal, ≤ 10% at
   ``memory_budget=0.1``, applies to it; fixed is what a probe costs whatever the model (writer and
   resolver threads, Parquet codec state, buffers). These children take a window at every step
   (``time_budget=None``) for a full rotation through the model: the worst case for the budget.

Every child imports the same libraries (torch, dynascope, pyarrow, wandb, tensorboard) and initialises
pyarrow's runtime (its first array builds the type and kernel registries, ~35 MiB of RSS) before its
baseline RSS is taken, so these one-time costs, shared by anything that uses pyarrow, are not charged
to the probe; the output says how large they were. On CPU the process peak is the child's peak RSS
(ru_maxrss) minus its RSS once libraries and model are loaded; memory children run with a fixed glibc
mmap threshold so freed blocks go back to the OS and RSS follows live memory (``--malloc-default`` to
measure under glibc's own tuning, which keeps freed blocks: ±10 MiB of noise between children). On
CUDA, the allocator's peak over the measured steps (exact).

    python3 benchmarks/probe_overhead.py                   # CPU: reference timing + 3-size memory fit
    python3 benchmarks/probe_overhead.py --sizes '' --configs none,ds-default,ds-noref   # step time only
    python3 benchmarks/probe_overhead.py --sizes '' --configs none,ds-default --rounds 9 \
        --ab-configs ds-default --ab-rounds 41 --block 8 --drop 3 --rotation-steps 160   # docs/benchmarks.md's figures
    python3 benchmarks/probe_overhead.py --sizes '' --configs '' --ab-configs ds-default --stats
    python3 benchmarks/probe_overhead.py --quick           # smoke run (a few minutes on 2 cores)
    python3 benchmarks/probe_overhead.py --device cuda --d-model 1024 --sizes 1024,1536,2048 --layers 12
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

import probe_ab
import probe_clock

CONFIGS = ("none", "ds-default", "ds-noref", "ds-full", "wandb", "tensorboard")
DS_KWARGS = {"ds-default": {}, "ds-noref": {"reference": None}, "ds-full": {"memory_budget": 2.0},
             "ds-fixed": {"time_budget": 0.0}}
MiB = 2**20


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
    rss_start = probe_clock.rss()
    for lib in ("dynascope", "wandb", "torch.utils.tensorboard"):  # same import footprint everywhere
        try:
            __import__(lib)
        except Exception:
            pass
    import pyarrow as pa

    rss_imported = probe_clock.rss()
    pa.array([0])  # pyarrow's one-time runtime init, paid by every configuration alike
    rss_arrow = probe_clock.rss()
    model, opt = build(args)
    rss0, file0 = probe_clock.rss(), probe_clock.rss_file()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tmp = tempfile.mkdtemp(prefix="ds-bench-")
    scope, tb, wb = None, None, None
    probe_s = [0.0]
    if args.config == "ds-closed":  # attached and detached before the steps: what only the heap remembers
        import dynascope

        dynascope.watch(model, opt, run=os.path.join(tmp, "run")).close()
    elif args.config.startswith("ds-"):
        import dynascope

        kw = dict(DS_KWARGS[args.config])
        if args.memory_run:
            kw["time_budget"] = None  # a window every step: the worst case for memory
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
    cuda_peak = [0]
    if scope is not None and dev.type == "cuda":  # the scope resets the CUDA peak at each record: read it first
        scope.memory.read = _before(scope.memory.read, lambda: _note_cuda_peak(cuda_peak))

    def one_step(i: int) -> None:
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

    times, probes = [], []
    faults0 = 0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            faults0 = probe_clock.minor_faults()
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                cuda_peak[0] = 0
        t0 = time.perf_counter()
        probe_s[0] = 0.0
        one_step(i)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            probes.append(probe_s[0])
    faults = (probe_clock.minor_faults() - faults0) / max(args.steps, 1)
    if dev.type == "cuda":
        _note_cuda_peak(cuda_peak)
    peak = cuda_peak[0] if dev.type == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    code = probe_clock.rss_file() - file0  # pages of code first run during the steps: part of the peak RSS above
    held = None
    if scope is not None and args.memory_run:  # after the peak above was read: this pass perturbs it
        from probe_memory import held_peak

        held = held_peak(scope.stats, lambda: one_step(0), args.steps, dev)
    if scope is not None:
        scope.close()
    if wb is not None:
        wb.finish()
    if tb is not None:
        tb.close()
    return {"config": args.config, "times": times, "probe": probes, "faults": faults, "peak_bytes": peak, "code_bytes": code, "held_bytes": held,
            "param_bytes": param_bytes, "imports_bytes": rss_imported - rss_start,
            "arrow_init_bytes": rss_arrow - rss_imported}


def _note_cuda_peak(acc: list[int]) -> None:
    import torch

    acc[0] = max(acc[0], torch.cuda.max_memory_allocated())


def _before(fn, first):
    def wrapper(*a, **k):
        first()
        return fn(*a, **k)
    return wrapper


def _timed(fn, acc: list[float]):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += time.perf_counter() - t
    return wrapper


def run_child(args: argparse.Namespace, config: str, d_model: int, steps: int, memory_run: bool) -> dict | None:
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
             ("device", "warmup", "threads", "vocab", "layers", "batch", "seq")]
    flags += [f"--d-model={d_model}", f"--steps={steps}"] + (["--memory-run"] if memory_run else [])
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if not memory_run:
        env = probe_ab.child_env(args, env)
    elif not args.malloc_default:
        # A fixed mmap threshold: glibc then returns every large freed block at once instead of keeping
        # it (its default raises the threshold as blocks are freed), so RSS tracks live memory and two
        # configurations differ by what they hold, not by where glibc happened to keep free space.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    out = subprocess.run([sys.executable, __file__, "--child", config, *flags], capture_output=True, text=True,
                         env=env, timeout=3600)
    if out.returncode != 0:
        print(f"{config} d={d_model}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def timing_part(args: argparse.Namespace, configs: list[str]) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for i in range(args.rounds):
        medians: dict[str, float] = {}
        # Configurations interleave across rounds, so slow drift hits all of them, and every other round runs
        # them in reverse order: a drift within a round then biases its ratio one way in one round and the
        # other way in the next, instead of always in favour of the configuration that runs first.
        for c in configs if i % 2 == 0 else configs[::-1]:
            r = run_child(args, c, args.d_model, args.steps, memory_run=False)
            if r is None:
                continue
            agg = results.setdefault(c, {"times": [], "probe": [], "peaks": [], "round_ratios": [], "faults_all": [],
                                         **r})
            agg["faults_all"].append(r["faults"])
            agg["times"] += r["times"]
            agg["probe"] += r["probe"]
            agg["peaks"].append(r["peak_bytes"])
            medians[c] = statistics.median(r["times"])
        for c, m in medians.items():  # this round's ratio: its child's median step over the baseline child's
            if "none" in medians:
                results[c]["round_ratios"].append(m / medians["none"])
    if "none" not in results:
        sys.exit("the no-probe baseline failed")
    base_t = statistics.median(results["none"]["times"])
    base_m = statistics.median(results["none"]["peaks"])
    pb = results["none"]["param_bytes"]
    print(f"== step time: device={args.device} d={args.d_model} layers={args.layers} vocab={args.vocab} "
          f"batch={args.batch}x{args.seq} threads={args.threads} params={pb / 4e6:.2f}M "
          f"steps={args.steps}x{args.rounds} rounds")
    print(f"{'config':<14}{'median step ms':>16}{'ratio':>9}{'per-round ratio min / median / max':>36}"
          f"{'in-step probe ratio':>21}{'peak extra MiB':>16}{'/ param bytes':>15}{'faults/step min/med/max':>25}")
    for c in configs:
        if c not in results:
            continue
        t = statistics.median(results[c]["times"])
        m = statistics.median(results[c]["peaks"]) - base_m
        # step / (step − probe work), per step, then the median: the probe's cost in the same steps
        own = statistics.median(s / max(s - p, 1e-9) for s, p in zip(results[c]["times"], results[c]["probe"],
                                                                      strict=True))
        own_s = f"{own:.3f}x" if any(results[c]["probe"]) else "-"
        rr = results[c]["round_ratios"]
        rr_s = f"{min(rr):.3f} / {statistics.median(rr):.3f} / {max(rr):.3f}" if rr else "-"
        fa = results[c]["faults_all"]
        fa_s = f"{min(fa):.0f} / {statistics.median(fa):.0f} / {max(fa):.0f}"
        print(f"{c:<14}{t * 1e3:>16.1f}{t / base_t:>8.3f}x{rr_s:>36}{own_s:>21}{m / MiB:>16.1f}{m / pb:>15.1%}"
              f"{fa_s:>25}")
    return results


def summary(timing: dict[str, dict], ab: dict) -> None:
    """One line per configuration measured both ways: the in-process A/B beside the cross-process rounds."""
    both = [c for c in ab["configs"] if c in timing and timing[c].get("round_ratios") and ab["configs"][c]["ratio"]]
    if not both:
        return
    print("== step-time ratio, both ways (min / median / max)")
    print(f"{'config':<14}{'in-process A/B':>26}{'cross-process rounds':>26}")
    for c in both:
        print(f"{c:<14}{probe_ab.spread(ab['configs'][c]['ratio']):>26}{probe_ab.spread(timing[c]['round_ratios']):>26}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="few steps, one round, small sizes: a smoke run")
    # 40: a fresh process's median over 20 steps still moves by a few percent on a loaded 2-core host, so the
    # cross-process median of 9 rounds spread over 1.02-1.05x for one build; 40 steps held it within 1.011-1.014x
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5, help="cross-process rounds (fresh processes, interleaved)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="step-time part ('' skips it)")
    ap.add_argument("--sizes", default="256,512,768", help="d_model values of the memory fit ('' skips it)")
    ap.add_argument("--mem-configs", default="ds-default,ds-noref")
    ap.add_argument("--mem-steps", type=int, default=16, help="≥ one rotation of the window, ~1/(0.75·budget)")
    ap.add_argument("--mem-rounds", type=int, default=1)
    ap.add_argument("--malloc-default", action="store_true", help="memory runs under glibc's default tuning")
    probe_ab.malloc_arg(ap)
    ap.add_argument("--ab-configs", default="ds-default,ds-noref", help="in-process A/B configurations ('' skips it)")
    probe_ab.add_args(ap)
    ap.add_argument("--stats", action="store_true",
                    help="per-statistic table: A/B of each family at full coverage, in-step split by family")
    ap.add_argument("--rotation-steps", type=int, default=120,
                    help="steps of the default-set run whose store gives the rotation length (0 skips it)")
    ap.add_argument("--child", dest="config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--memory-run", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.config:
        print(json.dumps(child(args)))
        return
    if args.quick:
        args.steps, args.warmup, args.rounds = 4, 2, 1
        args.ab_rounds, args.block, args.drop, args.rotation_steps = 1, 6, 2, 12
        if args.sizes == ap.get_default("sizes"):  # the smallest where the embedding fits the budget
            args.sizes, args.mem_configs = "256,320,384", "ds-default"
    configs = [c for c in args.configs.split(",") if c]
    timing = timing_part(args, ["none", *[c for c in configs if c != "none"]]) if configs else {}
    ab_configs = [c for c in args.ab_configs.split(",") if c]
    ab_configs += [c for c in probe_ab.STAT_CONFIGS if args.stats and c not in ab_configs]
    if ab_configs or args.rotation_steps:
        ab = probe_ab.run_ab(args, ab_configs, families=args.stats, rotation_steps=args.rotation_steps)
        if ab is not None:
            probe_ab.print_ab(ab, args)
            if args.stats:
                probe_ab.print_families(ab)
            probe_ab.print_rotation(ab["rotation"], f"d={args.d_model}")
            summary(timing, ab)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if sizes:
        from probe_memory import memory_part

        memory_part(args, [c for c in args.mem_configs.split(",") if c and c != "none"], sizes, run_child)


if __name__ == "__main__":
    main()
