"""The real-model reproduction at a length that decides something: SmolLM2-135M-Instruct, SFT then ≥200 GRPO steps.

    python benchmarks/smollm2_long.py                       # the long run → benchmarks/results/smollm2_long.json
    python benchmarks/smollm2_long.py --steps 4 --eval-n 32 --out /tmp/s.json --run /tmp/s   # a short check
    python benchmarks/smollm2_long.py --render benchmarks/results/smollm2_long.json          # README table
    python benchmarks/smollm2_long.py --render-seeds benchmarks/results/smollm2_seeds         # multi-seed tables

It runs ``dynascope demo --model smollm2``'s training (``run_smollm2``) with the long run's settings: a
held-out set of 256 problems scored at the pretrained model, after SFT, every 50 RL steps and at the end,
with the forward KL to the pretrained and SFT bases at each point; AlphaRL's rank-1 replacement and RELEX
fitted over the first 15% and 25% of the RL steps, scored on the same problems. Every figure of the
reproduction table gets a 95% bootstrap interval (``dynascope.demo.intervals``). The results file holds
the figures, the regime, the command, the wall time and what was recorded at which cadence; ``--render``
prints the Markdown table README shows, from that file alone; ``--render-seeds`` prints, from a folder of
one results file per seed, each measure per seed and across seeds, each paper verdict at every seed and the
rank correlations of forgetting with its candidate predictors (``dynascope.demo.reproduction_seeds``).

The run takes ``/tmp/dynascope-smollm2.lock`` (one SmolLM2 process at a time on a shared machine: ~7.5 GB), or
the lock ``flock /tmp/dynascope-smollm2.lock python benchmarks/smollm2_long.py ...`` already holds for it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shlex
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "smollm2_long.json"
LOCK = "/tmp/dynascope-smollm2.lock"


def recorded(s) -> dict[str, str]:
    """What the run records, at which cadence (the statistics' cost is what bounds a long CPU run)."""
    from dynascope.demo.smollm2_prose import prose_source

    stats = "every step" if s.stats_every == 1 else f"every {s.stats_every} steps"
    return {
        "tensor_stats": f"{stats}, every tensor (no rotating window): ‖ΔW‖, ‖W‖, update ratio, bit-exact and "
                        f"η-relative changes, sign flips, PULSE S₁ and S_k (k = {s.bf16_k}), drift and Mukherjee "
                        "update sparsity against θ₀, gradient norms and sparsity",
        "spectra": (f"every {s.spectral_every} steps, every 2-D weight: top-8 singular values and u₁, v₁ of W_t − θ₀"
                    if s.spectral_every else "off"),
        "samples": f"every RL step, {s.prompts * s.group} samples: reward, lengths, log-prob gap (bf16 rollout vs fp32)",
        "trainer_self": "every RL step: the trainer's fp32 log-probs of the step's tokens computed again in "
                        f"two micro-batches of {s.prompts * s.group // 2} samples (each cut to its own padding), gap to the first pass",
        "prose": (f"{s.prose_n} windows of {s.prose_tokens} tokens of {prose_source()} at each logged evaluation "
                  "point: mean next-token log-loss per window (forgetting)" if s.prose_n else "off"),
        "weight_sync_check": "after every weight sync, every tensor (bit checksums of the bf16 copy)",
        "held_out": f"{s.eval_n} problems at pretrained, after SFT, every {s.eval_every} RL steps and final: greedy "
                    "accuracy and the forward KL to the pretrained and SFT bases, per problem",
        "relex_deltas": (f"θ_t − θ₀ in float16 every {s.relex_every} RL step(s) up to step "
                         f"{max(s.relex_steps())} (deleted after the extrapolation)" if s.relex_steps() else "off"),
    }


def step_seconds(run_dir: Path) -> dict[str, float]:
    """Median RL step and its largest phases, from the run's own timings."""
    from dynascope.store import open_store

    with open_store(run_dir) as con:
        rows = con.rows("""
            WITH rl AS (SELECT DISTINCT step FROM timings WHERE phase = 'rollout')
            SELECT phase, median(dur_us) / 1e6 FROM (
                SELECT step, phase, sum(dur_us) AS dur_us FROM timings
                WHERE step IN (SELECT step FROM rl) AND category IN ('step', 'phase') AND coalesce(parent, '') IN ('', 'step')
                GROUP BY step, phase)
            GROUP BY phase ORDER BY 2 DESC""")
    return {phase: round(float(s), 3) for phase, s in rows}


@contextlib.contextmanager
def smollm2_lock(path: str = LOCK):
    """Hold the SmolLM2 lock, or the one ``flock LOCK python ...`` already holds for this process.

    flock(1) passes its locked descriptor to the command; a second open of the same file is a second lock
    that waits for the first, held by our own parent, for ever. A descriptor on the lock file that the
    process inherited is locked through itself (a no-op when the parent holds it).
    """
    target = os.path.realpath(path)
    for fd in sorted(map(int, os.listdir("/proc/self/fd"))) if os.path.isdir("/proc/self/fd") else []:
        with contextlib.suppress(OSError):
            if fd > 2 and os.readlink(f"/proc/self/fd/{fd}") == target:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
                return
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run(args: argparse.Namespace) -> dict:
    from rich.console import Console

    from dynascope.demo.reproduction_figures import reproduction_figures
    from dynascope.demo.smollm2 import SmolSettings
    from dynascope.demo.smollm2_train import run_smollm2

    overrides = dict(eval_n=args.eval_n, eval_every=args.eval_every, stats_every=args.stats_every,
                     spectral_every=args.spectral_every, relex_every=args.relex_every,
                     relex_fracs=tuple(args.relex_fracs), prose_n=args.prose_n)
    run_dir = Path(args.run)
    t0 = time.perf_counter()
    with smollm2_lock():
        run_smollm2(run_dir, steps=args.steps, device=args.device, seed=args.seed, console=Console(), **overrides)
    wall = time.perf_counter() - t0
    s = SmolSettings(run_dir=str(run_dir), seed=args.seed, device=args.device, rl_steps=args.steps, **overrides)
    doc = reproduction_figures(run_dir)
    doc.update(command=" ".join(["python", "benchmarks/smollm2_long.py", *map(shlex.quote, sys.argv[1:])]),
               wall_s=round(wall), rl_step_s=step_seconds(run_dir), recorded=recorded(s))
    return doc


def render_seeds(folder: str | Path) -> str:
    """The multi-seed Markdown (docs/dynamics.md holds it): every ``seed*.json`` of ``folder``, by seed."""
    from dynascope.demo.reproduction_seeds import load_seed_files, render

    return render(load_seed_files(folder))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--render", metavar="JSON", help="print the Markdown table of a results file and exit")
    p.add_argument("--render-seeds", metavar="DIR", help="print the multi-seed tables of a folder of results files")
    p.add_argument("--short", action="store_true", help="with --render: without the note column (README's form)")
    p.add_argument("--steps", type=int, default=200, help="GRPO steps after SFT")
    p.add_argument("--eval-n", type=int, default=256, help="held-out problems")
    p.add_argument("--eval-every", type=int, default=50, help="RL steps between held-out evaluations")
    p.add_argument("--stats-every", type=int, default=1, help="tensor statistics every N steps")
    p.add_argument("--spectral-every", type=int, default=10, help="spectra every N steps (0: off)")
    p.add_argument("--relex-every", type=int, default=2, help="save θ_t − θ₀ for RELEX every N RL steps")
    p.add_argument("--relex-fracs", type=float, nargs="*", default=[0.15, 0.25], help="RELEX observation windows")
    p.add_argument("--prose-n", type=int, default=32, help="prose windows scored for forgetting (0: off)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run", default="runs/smollm2-long", help="run directory (must not exist or be empty)")
    p.add_argument("--out", default=str(RESULTS), help="results file")
    args = p.parse_args(argv)
    from dynascope.demo.reproduction import markdown_table

    if args.render:
        print(markdown_table(json.loads(Path(args.render).read_text()), notes=not args.short), end="")
        return
    if args.render_seeds:
        print(render_seeds(args.render_seeds), end="")
        return
    doc = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {out} ({doc['rl_steps']} RL steps, {doc['held_out_n']} held-out problems, {doc['wall_s']} s)\n")
    print(markdown_table(doc), end="")


if __name__ == "__main__":
    main()
