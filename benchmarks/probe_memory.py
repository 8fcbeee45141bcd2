"""Memory half of benchmarks/probe_overhead.py: the model-size sweep and fit, and the probe's exact peak.

``memory_part`` runs ``none`` and each dynascope configuration at several model sizes, each in a fresh
child, and fits two quantities as ``fixed + k · param_bytes``:
* extra: the process's peak memory over ``none`` (peak RSS on CPU, the allocator's peak on CUDA) —
  what a run costs, fixed costs (threads, Parquet codec state, buffers) included; on CPU the output
  also says how much of it is library code first run by the probe (torch kernels, Parquet writer,
  codecs: file-backed pages, shared by a node's processes and evictable, unlike the rest);
* held (``held_peak``): the largest number of bytes the windowed statistics hold at once, from
  ``TensorStats.before`` (the ΔW snapshot is taken) to the end of ``TensorStats.after`` (snapshot,
  θ₀ chunks and every temporary freed) — what ``memory_budget`` bounds. The probe works during the
  optimizer step, rarely the process's peak, so peak RSS alone would not show it.

``held_peak`` (``dynascope.probes.held_memory``, shared with the tests) measures on CUDA with
``memory_allocated``/``max_memory_allocated`` around each half, on CPU under ``torch.profiler``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable

from dynascope.probes.held_memory import held_peak, memory_events

__all__ = ["held_peak", "memory_events", "memory_part"]  # the first two: dynascope.probes.held_memory

MiB = 2**20


def memory_part(args: argparse.Namespace, configs: list[str], sizes: list[int], run_child: Callable[..., dict | None]) -> None:
    """Run ``none`` and ``configs`` at each d_model in ``sizes`` (``run_child(args, config, d, steps,
    memory_run=True)``), print extra and held bytes per size and their fits ``fixed + k·param_bytes``."""
    steps = max(args.mem_steps, 4)
    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.mem_rounds):
        for d in sizes:
            for c in ["none", *configs]:
                r = run_child(args, c, d, steps, memory_run=True)
                if r is not None:
                    runs.setdefault((c, d), []).append(r)
    sizes = [d for d in sizes if ("none", d) in runs]
    if not sizes:
        sys.exit("the no-probe baseline failed")
    r0 = runs[("none", sizes[0])][0]
    malloc = "glibc defaults" if args.malloc_default else "MALLOC_MMAP_THRESHOLD_=128 KiB"
    print(f"\n== memory: {steps} steps with a window every step (time_budget=None), median of {args.mem_rounds} "
          f"round(s), device={args.device}, {malloc}")
    print(f"   not charged, paid by every configuration before its baseline: imports beyond torch "
          f"{r0['imports_bytes'] / MiB:.0f} MiB, pyarrow runtime init {r0['arrow_init_bytes'] / MiB:.0f} MiB")
    print("   extra: process peak over no probe (RSS on CPU); code: the part of extra that is library code paged in "
          "(file-backed RSS over no probe: shared by the processes of a node, evictable); private: extra − code, "
          "the memory the process allocated for the probe (threads, buffers, statistics); held: the probe's "
          "own peak at the allocator (snapshot + θ₀ chunks + temporaries), whenever it happens")
    print(f"{'config':<14}{'d_model':>8}{'param MiB':>11}{'extra MiB':>11}{'/ params':>10}{'code MiB':>10}"
          f"{'private MiB':>13}{'/ params':>10}{'held MiB':>10}{'/ params':>10}")
    for c in configs:
        pts: list[tuple[int, float, float, float]] = []
        for d in sizes:
            if (c, d) not in runs:
                continue
            pb = r0["param_bytes"] if d == sizes[0] else runs[("none", d)][0]["param_bytes"]
            extra = (statistics.median(r["peak_bytes"] for r in runs[(c, d)])
                     - statistics.median(r["peak_bytes"] for r in runs[("none", d)]))
            held = statistics.median(r["held_bytes"] for r in runs[(c, d)])
            code = (statistics.median(r.get("code_bytes", 0) for r in runs[(c, d)])
                    - statistics.median(r.get("code_bytes", 0) for r in runs[("none", d)]))
            cuda = args.device.startswith("cuda")  # the CUDA peak is the allocator's: no library code in it
            private = extra if cuda else extra - code
            pts.append((pb, extra, held, private))
            code_s = "-" if cuda else f"{code / MiB:.1f}"
            print(f"{c:<14}{d:>8}{pb / MiB:>11.1f}{extra / MiB:>11.1f}{extra / pb:>10.1%}{code_s:>10}"
                  f"{private / MiB:>13.1f}{private / pb:>10.1%}{held / MiB:>10.2f}{held / pb:>10.1%}")
        if len(pts) >= 2:
            for label, col in (("extra", 1), ("private", 3), ("held", 2)):
                xs, ys = [p[0] for p in pts], [p[col] for p in pts]
                k, fixed = _fit(xs, ys)
                resid = max(abs(y - fixed - k * x) for x, y in zip(xs, ys, strict=True))
                print(f"{c:<14}{label:>8} = {fixed / MiB:6.1f} MiB fixed + {k:6.1%} of param bytes "
                      f"(fit over {len(pts)} sizes, max residual {resid / MiB:.1f} MiB)")
    print("   goal: ≤ 10% of parameter bytes at memory_budget=0.1 — the private column: what the probe allocates "
          "(the code column is library text the kernel maps in, shared and evictable, not allocated memory)")


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line ``y = fixed + k·x``: (k, fixed)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else math.nan
    return k, my - k * mx
