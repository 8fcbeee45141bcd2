"""The real-model demo's report: each paper's headline beside this run's figure under the same definition.

Every figure is read back from the run's store: the probe's ``tensor_stats`` columns for PULSE's S₁
and Mukherjee et al.'s update sparsity, ``alpharl/*`` scalars for AlphaRL's held-out rewards, and
``delta_sync_summary`` for what the sparsity is worth on the wire. docs/sparsity.md gives each formula.
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dynascope.core.fmt import fmt_ms
from dynascope.demo.smollm2 import FINAL_FILE, THETA0_FILE, SmolSettings
from dynascope.store import StoreConnection, open_store, quote_literal


def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}%"


def _columns(con: StoreConnection) -> set[str]:
    return {r[0] for r in con._con.sql("DESCRIBE tensor_stats").fetchall()}


def _per_step(con: StoreConnection, count: str, stage: str) -> list[tuple[int, float]]:
    """(step, Σ count / Σ numel) over the tensors of rank 0, for the steps where every tensor has it."""
    df = con.frame(f"""
        SELECT step, sum({count}) / sum(numel) AS frac FROM tensor_stats
        WHERE stage = {quote_literal(stage)} AND rank = 0 GROUP BY step
        HAVING count({count}) = count(*) ORDER BY step""")
    return [(int(a), float(b)) for a, b in df.iter_rows()]


def _scalar(con: StoreConnection, key: str) -> float | None:
    df = con.frame(f"SELECT value FROM scalars WHERE key = {quote_literal(key)} ORDER BY step DESC, time_us DESC LIMIT 1")
    return None if df.is_empty() else float(df["value"][0])


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def _pulse(con: StoreConnection, cols: set[str]) -> tuple[str, str]:
    if "bf16_unchanged_count" not in cols:
        return "not recorded (probe without bf16_unchanged_*)", ""
    rl = _per_step(con, "bf16_unchanged_count", "rl")
    if not rl:
        return "no RL step recorded", ""
    later = [f for _, f in rl[1:]] or [rl[0][1]]
    return (f"{_pct(_median(later), 2)} median of {len(later)} steps (range {_pct(min(later), 2)}–{_pct(max(later), 2)})",
            f"first RL step {_pct(rl[0][1], 2)} (Adam's first update moves every weight by ≈η)")


def _mukherjee(con: StoreConnection, cols: set[str], stage: str) -> tuple[str, str]:
    if "drift_unchanged_count" not in cols:
        return "not recorded (probe without drift_unchanged_*)", ""
    rows = _per_step(con, "drift_unchanged_count", stage)
    zeros = _per_step(con, "drift_zero_count", stage) if "drift_zero_count" in cols else []
    if not rows:
        return f"no {stage} step recorded", ""
    step, frac = rows[-1]
    zero = dict(zeros).get(step)
    return _pct(frac), f"after {len(rows)} steps; exact-zero share {_pct(zero)}"


def _alpharl(con: StoreConnection) -> tuple[str, str]:
    base, rl = _scalar(con, "alpharl/sft_accuracy"), _scalar(con, "alpharl/rl_accuracy")
    r1, r1_rl = _scalar(con, "alpharl/rank1_accuracy"), _scalar(con, "alpharl/rank1_rest_rl_accuracy")
    if None in (base, rl, r1):
        return "not evaluated", ""
    gain = rl - base
    recovered = f"{100 * (r1 - base) / gain:.0f}% of RL's gain" if gain != 0 else "RL's gain is 0: no share to recover"
    rest = f"; rest with RL's update {_pct(r1_rl)}" if r1_rl is not None else ""
    return (f"base {_pct(base)} → RL {_pct(rl)}; rank-1 {_pct(r1)} ({recovered})",
            f"greedy exact match, held-out problems{rest}")


def _delta_sync(con: StoreConnection) -> tuple[str, str]:
    from dynascope.analyses.delta_sync import delta_sync_summary

    try:
        df = delta_sync_summary(con).filter(stage="rl")
    except Exception as exc:  # e.g. no S₁ columns: a row that says so, not a crash
        return f"unavailable ({exc})", ""
    if df.is_empty():
        return "no RL step recorded", ""
    r = df.row(0, named=True)
    t = (f"; implied sync {fmt_ms(r['delta_sync_ms'])} vs {fmt_ms(r['full_bf16_sync_ms'])} full bf16"
         if r["delta_sync_ms"] is not None else "")
    return f"{r['delta_pct']:.2f}% of bf16 bytes ({r['encoding']})", f"median over {r['steps']} RL steps{t}"


def print_reproduction(s: SmolSettings, console: Console, train_s: float) -> None:
    """Print the reproduction table (and where the checkpoints are) for the finished run ``s.run_dir``."""
    run_dir = Path(s.run_dir)
    regime = (f"SmolLM2-135M-Instruct, fp32 master weights (bf16 by cast), AdamW; SFT {s.sft_steps} steps × "
              f"{s.sft_batch} at lr {s.sft_lr:g}; GRPO {s.rl_steps} steps × {s.prompts}×{s.group} samples at lr "
              f"{s.rl_lr:g}, no KL term; {s.device}")
    with open_store(run_dir) as con:
        cols = _columns(con)
        console.rule(f"dynascope demo --model smollm2 — trained in {fmt_ms(1000 * train_s)}")
        console.print(f"Regime: {regime}", highlight=False)
        t = Table(title="Reproduction: each paper's headline beside this run, same definition", title_justify="left")
        for c in ("measure (definition)", "paper", "this run", "note"):
            t.add_column(c, overflow="fold")
        t.add_row("PULSE S₁ per RL step: share of elements whose bf16 cast is bit-identical across the step",
                  "≈99% invisible in bf16 (arXiv 2602.03839)", *_pulse(con, cols))
        t.add_row("Mukherjee update sparsity, RL vs its base: bf16(W_t) − bf16(W₀), |Δ| ≤ 1e-5",
                  "70–95% (RL updates 5–30%; arXiv 2505.11711)", *_mukherjee(con, cols, "rl"))
        t.add_row("Mukherjee update sparsity, SFT vs pretrained (same definition)",
                  "much lower than RL (SFT updates are dense)", *_mukherjee(con, cols, "sft"))
        t.add_row("AlphaRL rank-1 replacement: held-out reward of base, RL and W_base + ‖ΔW‖_F·u₁v₁ᵀ",
                  "rank-1 recovers >99% of RL's gain (arXiv 2510.00553)", *_alpharl(con))
        t.add_row("bf16 delta weight sync: bytes of changed elements (cheapest of value+index, bitmap, full)",
                  "verl: ~1–3% of parameter bytes per step", *_delta_sync(con))
        console.print(t)
        pre = _scalar(con, "alpharl/pretrained_accuracy")
        console.print(f"Held-out accuracy: pretrained {_pct(pre)}, after SFT {_pct(_scalar(con, 'alpharl/sft_accuracy'))}, "
                      f"after RL {_pct(_scalar(con, 'alpharl/rl_accuracy'))}.", highlight=False)
    console.print(f"\nRL's base and policy: {run_dir / THETA0_FILE}, {run_dir / FINAL_FILE}", highlight=False)
    console.print("Explore it:  [bold]dynascope dashboard " + str(run_dir) + "[/]", highlight=False)
    console.print("Findings:    dynascope report " + str(run_dir), highlight=False)
