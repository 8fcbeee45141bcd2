"""In-process A/B of the probe's step time, the cost of each statistic, and the rotation length.

One process, one model, one batch: blocks of plain steps and blocks of probed steps alternate, the probe
attached by ``dynascope.watch()`` at the start of a probed block and detached by ``close()`` at its end,
so whatever else loads the machine hits both sides alike. Each probed block sits between two plain
blocks; its ratio is its median step over the mean of the two neighbours' medians, and the first
``drop`` steps of every block are left out (a fresh scope's first window, caches). A configuration's
figure is the median of its per-round ratios, shown with their min and max.

Beside the step time, each probed block reports what the probe spends where:
* in-step: the probe's own work inside the training step (``TensorStats.before``/``after``), and for
  the per-statistic table the same split by family (norms, ΔW, gradient sparsity, drift, spectral);
* background: CPU time of the probe's threads (resolver, writer, system sampler) per step, read from
  their per-thread CPU clocks. On a machine with as many busy cores as torch threads, background CPU
  is taken from the training step.

Rotation length: a default-set run of ``--rotation-steps`` steps, read back from its store: the steps
until every tensor had its windowed statistics once, and the longest gap between two records of one
tensor (how stale the per-tensor view gets); and the mean in-step time per step over that run by the
probe's own clock, which, unlike the median steps compared above, includes the windows at their rate.

Used by benchmarks/probe_overhead.py (``--ab-rounds``, ``--stats``, ``--rotation-steps``); runs alone too:

    python3 benchmarks/probe_ab.py --configs ds-default,ds-noref --rounds 7
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

from probe_clock import FAMILIES, _probe_threads, _thread_cpu, instrument, minor_faults, tensor_stats_of

# watch() keyword arguments per configuration. The per-statistic configurations each add one family:
# timings alone (no tensor statistics), + ‖g‖ of every tensor every step and ‖W‖ every 8th (no window after the first),
# + the windowed statistics of every tensor at every step (ΔW snapshot, ‖ΔW‖, changed fractions, sign
# flips, gradient sparsity), + drift with θ₀ streamed from disk, + spectral summaries at every record.
AB_CONFIGS: dict[str, dict[str, Any]] = {
    "ds-default": {},
    "ds-noref": {"reference": None},
    "ds-spectral": {"spectral": True},
    "timings": {"every": 0},
    "norms": {"reference": None, "time_budget": 0.0},
    "window-all": {"reference": None, "memory_budget": 1.9, "time_budget": None},
    "drift-all": {"memory_budget": 1.9, "time_budget": None},
    "spectral-all": {"memory_budget": 1.9, "time_budget": None, "spectral": {"every": 1, "time_budget": None}},
    # Full coverage (benchmarks/full_coverage.py): every statistic of every tensor at every step, S_k included.
    "full": {"memory_budget": None, "time_budget": None, "bf16_k": 2},
    # The writer's own fold (store/own_fold.py) at 200x its default rate: a flush every 50 ms instead of
    # 10 s, so a 16-step block folds several times. The pair differs only in the fold; the difference in
    # step ratio and in background CPU per step is the fold's, at 200x the flushes of a default run.
    "flush-50ms": {"flush_secs": 0.05, "seal_secs": None},
    "flush-50ms-nofold": {"flush_secs": 0.05, "seal_secs": None},
    # The journal (store/journal.py) at 200x its default rates against a segment per flush: a flush every
    # 50 ms appended to the journal, sealed every 1.5 s (the default 300 s / 200).
    "journal-50ms": {"flush_secs": 0.05, "seal_secs": 1.5},
    # The same rates with a node writer (store/node.py) in a process of its own, started on the block's run
    # before watch(): the probed rank's writer is a sender, as 7 of a node's 8 ranks are, and hands its
    # flushes over instead of journaling them. Against journal-50ms, the pair differs in where flushes go.
    "node-sender-50ms": {"flush_secs": 0.05, "seal_secs": 1.5, "node_writer": "ab"},
}
# Configurations whose block runs beside a node writer of its run (NODE_WRITER, a process of its own).
AB_NODE = {"node-sender-50ms"}
NODE_WRITER = """
import sys
from dynascope.store import RunWriter
w = RunWriter(sys.argv[1], rank=1, flush_secs=0.05, seal_secs=1.5, node="ab")
print(type(w.node).__name__, flush=True)
sys.stdin.read()  # until the block ends
w.close()
"""
# Environment a configuration's writer is made under (read when watch() makes it), restored after its block.
AB_ENV: dict[str, dict[str, str]] = {"flush-50ms-nofold": {"DYNASCOPE_FOLD": "0"}}
STAT_CONFIGS = ("timings", "norms", "window-all", "drift-all", "spectral-all")

# ``--malloc-fixed``: glibc's trimming and mmap of large blocks off, so freed memory stays in the heap
# and is reused without page faults. Under glibc's defaults the reference step faults thousands of pages
# of activations back in at every step, and how many depends on where earlier allocations happened to
# land: the count differs 2-3x between fresh processes of one configuration (figures in docs/benchmarks.md).
FIXED_MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_MMAP_THRESHOLD_": str(1 << 40)}


def malloc_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--malloc-fixed", action="store_true",
                    help="timing children with glibc's heap trimming and large-block mmap off (see FIXED_MALLOC)")


def child_env(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """``env`` for a timing child: with ``FIXED_MALLOC`` when ``--malloc-fixed`` asks for it."""
    return dict(env, **FIXED_MALLOC) if args.malloc_fixed else env


class Loop:
    """The reference training step on one fixed batch (as benchmarks/probe_overhead.py's children)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from probe_overhead import build

        torch.set_num_threads(args.threads)
        self.torch, self.dev = torch, torch.device(args.device)
        self.model, self.opt = build(args)
        g = torch.Generator(device=self.dev).manual_seed(1)
        self.x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=self.dev, generator=g)
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def step(self) -> float:
        import torch.nn.functional as F

        t0 = time.perf_counter()
        logits = self.model(self.x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), self.x[:, 1:].flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss.item()  # every block reads the loss (a sync, like any logging loop)
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()
        return time.perf_counter() - t0


def watch_kwargs(config: str) -> dict[str, Any]:
    return dict(AB_CONFIGS[config])


def block(loop: Loop, config: str | None, steps: int, drop: int, tmp: str, families: bool) -> dict[str, Any]:
    """One block: ``steps`` steps plain (config None) or under ``watch(**AB_CONFIGS[config])``."""
    import dynascope

    scope, acc, restore = None, {}, (lambda: None)
    run = tempfile.mkdtemp(prefix="run-", dir=tmp)
    node = None
    if config in AB_NODE:
        node = subprocess.Popen([sys.executable, "-c", NODE_WRITER, run], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        if node.stdout is None or node.stdout.readline().strip() != "NodeServer":
            raise SystemExit(f"{config}: the node writer did not start")
    if config is not None:
        saved = {k: os.environ.get(k) for k in AB_ENV.get(config, {})}
        os.environ.update(AB_ENV.get(config, {}))
        try:
            scope = dynascope.watch(loop.model, loop.opt, run=run, **watch_kwargs(config))
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        acc, restore = instrument(scope, families)
    threads = _probe_threads()
    times: list[float] = []
    inside: dict[str, float] = {}
    cpu0, faults0 = 0.0, 0
    for i in range(steps):
        if i == drop:
            acc.clear()
            cpu0, faults0 = _thread_cpu(threads), minor_faults()
        times.append(loop.step())
    bg = _thread_cpu(threads) - cpu0
    faults = minor_faults() - faults0
    inside = dict(acc)
    merged = _merged_files(run)  # before close: the fold's own merges, not the run's fold at close
    link = getattr(getattr(scope, "writer", None), "node", None)
    if node is not None and (type(link).__name__ != "NodeLink" or link.fallbacks or not link.rows_forwarded):
        raise SystemExit(f"{config}: the probed writer did not hand its flushes to the node writer ({link!r})")
    if scope is not None:
        scope.close()
    if node is not None and node.stdin is not None:
        node.stdin.close()
        node.wait(120)
    restore()
    shutil.rmtree(run, ignore_errors=True)
    kept = times[drop:]
    n = max(len(kept), 1)
    return {"median_s": statistics.median(kept), "bg_s": bg / n, "faults": faults / n,
            "inside": {k: v / n for k, v in inside.items()}, "merged": merged}


def _merged_files(run: str) -> int:
    """Merged segments (``<lo>-<hi>.v<t>.parquet``) under ``run``: how many merges its writer's fold made."""
    return sum(1 for _, _, names in os.walk(run) for n in names if ".v" in n and n.endswith(".parquet"))


def ab_child(args: argparse.Namespace) -> dict[str, Any]:
    """Alternating blocks in this process; per configuration and round: ratio, in-step and background."""
    loop = Loop(args)
    configs = [c for c in args.ab_configs.split(",") if c and c != "none"]
    tmp = tempfile.mkdtemp(prefix="ds-ab-")
    for _ in range(args.warmup):
        loop.step()
    out: dict[str, Any] = {c: {"ratio": [], "step_s": [], "base_s": [], "bg_s": [], "faults": [], "base_faults": [],
                               "inside": [], "merged": []} for c in configs}
    families = bool(args.families)
    try:
        prev = block(loop, None, args.block, args.drop, tmp, families)
        for r in range(args.ab_rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]  # rotate: no config always first
            for c in order:
                probed = block(loop, c, args.block, args.drop, tmp, families)
                nxt = block(loop, None, args.block, args.drop, tmp, families)
                base = (prev["median_s"] + nxt["median_s"]) / 2
                o = out[c]
                o["ratio"].append(probed["median_s"] / base)
                o["step_s"].append(probed["median_s"])
                o["base_s"].append(base)
                o["bg_s"].append(probed["bg_s"])
                o["faults"].append(probed["faults"])
                o["base_faults"].append((prev["faults"] + nxt["faults"]) / 2)
                o["inside"].append(probed["inside"])
                o["merged"].append(probed["merged"])
                prev = nxt
        rotation = rotation_run(loop, args.rotation_steps, tmp) if args.rotation_steps else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"configs": out, "param_bytes": loop.param_bytes, "rotation": rotation}


def rotation_run(loop: Loop, steps: int, tmp: str) -> dict[str, Any]:
    """Run the default set for ``steps`` steps and read its coverage back from the store."""
    import dynascope

    run = os.path.join(tmp, "rotation")
    scope = dynascope.watch(loop.model, loop.opt, run=run)
    windows = windows_per_rotation(scope)
    for _ in range(steps):
        loop.step()
    scope.close()
    return {**coverage(run, steps), "windows_per_rotation": windows}


def windows_per_rotation(scope: Any) -> int | None:
    """Windows the memory budget needs to cover every tensor once: the rotation length in steps when the
    time budget allows a window at every step (planned on a copy, so the scope's own cursor is untouched)."""
    import copy

    stats = tensor_stats_of(scope)
    if stats is None or not scope.tracked:
        return None
    plan = copy.copy(stats.window)
    plan.cursor, seen, windows = 0, set(), 0
    resident = stats._resident_bytes(scope.tracked)
    while len(seen) < len(scope.tracked) and windows < 10 * len(scope.tracked):
        seen.update(plan.plan(scope.tracked, resident))
        windows += 1
    return windows


STEADY_FROM = 3  # the rotation run's steady state starts after its first window (step 0) has been paid back


def coverage(run: str, steps: int) -> dict[str, Any]:
    """Per windowed column: steps until every tensor had it once, and the longest gap between records."""
    from dynascope.store import open_store

    store = open_store(run)
    out: dict[str, Any] = {"steps": steps}
    try:
        for col in ("update_norm", "grad_zero_count", "drift_norm"):
            rows = store.rows(
                f"SELECT tensor, list(step ORDER BY step) FROM tensor_stats WHERE {col} IS NOT NULL "
                "GROUP BY tensor")
            n_tensors = store.rows("SELECT count(DISTINCT tensor) FROM tensor_stats")[0][0]
            covered = {t: s for t, s in rows}
            full = max(s[0] for s in covered.values()) + 1 if covered and len(covered) == n_tensors else None
            gaps = [b - a for s in covered.values() for a, b in zip(s, s[1:], strict=False)]
            out[col] = {"tensors": n_tensors, "covered": len(covered), "first_full_rotation_steps": full,
                        "max_gap_steps": max(gaps) if gaps else None,
                        "median_gap_steps": statistics.median(gaps) if gaps else None}
        # The steady-state cost by the probe's own clock: the mean of its in-step phase per step, beside the
        # mean step, from ``STEADY_FROM`` on (the first window's drift pass and buffers come once). A mean, because
        # windows come on some steps only: the median step that the A/B and the cross-process rounds
        # compare leaves them out, and A/B blocks, each with a fresh scope, take few windows past the first.
        probe_us, step_us, n = store.rows(
            "SELECT sum(dur_us) FILTER (WHERE phase = 'dynascope'), sum(dur_us) FILTER (WHERE phase = 'step'), "
            f"count(*) FILTER (WHERE phase = 'step') FROM timings WHERE step >= {STEADY_FROM}")[0]
        if n:
            out["in_step_mean_ms"], out["step_mean_ms"] = (probe_us or 0) / n / 1e3, step_us / n / 1e3
    finally:
        store.close()
    return out


def run_ab(args: argparse.Namespace, configs: list[str], families: bool = False,
           rotation_steps: int = 0) -> dict[str, Any] | None:
    """The A/B in one fresh child process (this file with ``--ab-child``)."""
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
             ("device", "warmup", "threads", "vocab", "layers", "batch", "seq", "d_model", "ab_rounds", "block",
              "drop")]
    flags += [f"--ab-configs={','.join(configs)}", f"--rotation-steps={rotation_steps}"]
    flags += ["--families=1"] if families else []
    here = os.path.dirname(os.path.abspath(__file__))
    env = child_env(args, dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH", "")) if p)))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--ab-child", *flags], capture_output=True,
                         text=True, env=env, timeout=7200)
    if out.returncode != 0:
        print(f"A/B child failed\n{out.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(xs: list[float]) -> str:
    return f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}"


def print_ab(res: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"== in-process A/B: device={args.device} d={args.d_model} layers={args.layers} "
          f"params={res['param_bytes'] / 4e6:.2f}M, {args.ab_rounds} rounds of blocks of {args.block} steps "
          f"(first {args.drop} dropped), each probed block between two plain blocks")
    print(f"{'config':<14}{'ratio min / median / max':>27}{'plain ms':>10}{'probed ms':>11}"
          f"{'in-step ms':>12}{'bg CPU ms/step':>16}{'faults/step plain':>19}{'probed':>8}{'merges/block':>14}")
    for c, o in res["configs"].items():
        if not o["ratio"]:
            continue
        inside = statistics.median(d.get("probe", 0.0) for d in o["inside"]) * 1e3
        print(f"{c:<14}{spread(o['ratio']):>27}{statistics.median(o['base_s']) * 1e3:>10.1f}"
              f"{statistics.median(o['step_s']) * 1e3:>11.1f}{inside:>12.2f}"
              f"{statistics.median(o['bg_s']) * 1e3:>16.2f}{statistics.median(o['base_faults']):>19.0f}"
              f"{statistics.median(o['faults']):>8.0f}{statistics.median(o.get('merged') or [0]):>14.0f}")


def print_families(res: dict[str, Any]) -> None:
    """In-step ms per step of each family in the configurations that compute it for every tensor."""
    print("== in-step time per statistic family (every tensor every step; ms per step, median over rounds)")
    labels = list(dict.fromkeys(label for label, _, _ in FAMILIES))
    print(f"{'config':<14}" + "".join(f"{lab:>26}" for lab in labels))
    for c, o in res["configs"].items():
        if not o["inside"]:
            continue
        base = statistics.median(o["base_s"])
        cells = []
        for lab in labels:
            v = statistics.median(d.get(lab, 0.0) for d in o["inside"])
            cells.append(f"{v * 1e3:9.2f} ({v / base:6.2%})" if v else "-")
        print(f"{c:<14}" + "".join(f"{x:>26}" for x in cells))


def print_rotation(rot: dict[str, Any] | None, label: str) -> None:
    if not rot:
        return
    print(f"== rotation of the default set ({label}, {rot['steps']} steps; the memory budget alone needs "
          f"{rot.get('windows_per_rotation')} windows, i.e. steps when the time budget allows one every step)")
    print(f"{'column':<18}{'tensors':>9}{'covered':>9}{'steps to cover all once':>25}{'median gap':>12}"
          f"{'max gap':>9}")
    for col in ("update_norm", "grad_zero_count", "drift_norm"):
        r = rot[col]
        full = r["first_full_rotation_steps"]
        print(f"{col:<18}{r['tensors']:>9}{r['covered']:>9}{full if full is not None else '> ' + str(rot['steps']):>25}"
              f"{r['median_gap_steps'] if r['median_gap_steps'] is not None else '-':>12}"
              f"{r['max_gap_steps'] if r['max_gap_steps'] is not None else '-':>9}")
    if rot.get("in_step_mean_ms") is not None:
        print(f"steady state by the probe's clock (mean over steps {STEADY_FROM}-{rot['steps'] - 1}): "
              f"{rot['in_step_mean_ms']:.2f} ms in the step per {rot['step_mean_ms']:.1f} ms step "
              f"({rot['in_step_mean_ms'] / (rot['step_mean_ms'] - rot['in_step_mean_ms']):.2%} of the rest)")


def model_args(ap: argparse.ArgumentParser, **defaults: str) -> None:
    """The reference workload's options (``Loop`` reads them), with ``defaults`` overriding."""
    for name, default in ({"device": "cpu", "warmup": "3", "threads": "2", "vocab": "2048", "layers": "6",
                           "batch": "16", "seq": "64", "d-model": "256"} | defaults).items():
        ap.add_argument(f"--{name}", default=default, type=str if name == "device" else int)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ab-rounds", type=int, default=7, help="A/B rounds (each: every config once)")
    ap.add_argument("--block", type=int, default=16, help="steps per A/B block")
    ap.add_argument("--drop", type=int, default=4, help="warm-up steps dropped at the start of each block")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(ap)
    add_args(ap)
    ap.add_argument("--configs", default="ds-default,ds-noref")
    ap.add_argument("--rotation-steps", type=int, default=0)
    ap.add_argument("--families", type=int, default=0)
    malloc_arg(ap)
    ap.add_argument("--ab-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ab-configs", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ab_child:
        print(json.dumps(ab_child(args)))
        return
    res = run_ab(args, args.configs.split(","), bool(args.families), args.rotation_steps)
    if res is None:
        sys.exit(1)
    print_ab(res, args)
    if args.families:
        print_families(res)
    print_rotation(res["rotation"], f"d={args.d_model}")


if __name__ == "__main__":
    main()
