"""The real-model demo's report: each paper's headline beside this run's figure under the same definition.

The figures and their 95% bootstrap intervals come from ``reproduction_figures`` (docs/sparsity.md and
docs/dynamics.md give each formula); ``reproduction_rows`` turns them into (measure, paper, this run, note)
rows, which ``print_reproduction`` prints and ``markdown_table`` writes for the long-run benchmark.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dynascope.core.fmt import fmt_ms
from dynascope.demo.smollm2 import FINAL_FILE, THETA0_FILE, SmolSettings

__all__ = ["markdown_table", "print_reproduction", "reproduction_rows"]

Row = tuple[str, str, str, str]


def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{100 * x + 0.0:.{digits}f}%"  # + 0.0: no "-0%"


def fmt(f: dict[str, Any] | None, digits: int = 1, pct: bool = True, unit: str = "", pts: bool = False,
        sci: bool = False) -> str:
    """'value [low, high]' for an interval dict (``Interval.as_dict``); '—' when there is no value. ``pts``: a
    difference of two shares, in signed percentage points; ``sci``: ``digits`` significant digits, in
    scientific notation (a floor near 10⁻⁷ prints as 0.000000 in fixed point)."""
    if not f or f.get("value") is None:
        return "—"
    if sci:
        show = lambda x: f"{x:.{max(digits - 1, 0)}e}{unit}" if x else f"0{unit}"  # noqa: E731
    elif pts:
        show = lambda x: f"{100 * x + 0.0:+.{digits}f} pts"  # noqa: E731
    elif pct:
        show = lambda x: _pct(x, digits)  # noqa: E731
    else:
        show = lambda x: f"{x:.{digits}f}{unit}"  # noqa: E731
    if f.get("ci_low") is None:
        return show(f["value"])
    return f"{show(f['value'])} [{show(f['ci_low'])}, {show(f['ci_high'])}]"


def _accuracy_row(doc: dict[str, Any]) -> Row:
    acc = doc.get("accuracy", {})
    points = [("pretrained", "pretrained"), ("sft", "after SFT")] + [
        (f"rl@{s}", f"after {s} RL steps") for s in doc.get("rl_steps_evaluated", []) if f"rl@{s}" in acc] + [
        ("rl", "final")]
    shown = "; ".join(f"{name} {fmt(acc.get(k))}" for k, name in points if k in acc)
    return ("Held-out accuracy (greedy exact match) at each evaluation point", "—", shown,
            f"{doc.get('held_out_n', 0)} problems; intervals resample problems")


def _alpharl_row(doc: dict[str, Any]) -> Row:
    acc, rec = doc.get("accuracy", {}), doc.get("recovery", {})
    if "alpharl_rank1" not in acc:
        return ("AlphaRL rank-1 replacement", "rank-1 recovers >99% of RL's gain (arXiv 2510.00553)", "not evaluated", "")
    this = (f"base {fmt(acc.get('sft'))} → RL {fmt(acc.get('rl'))}; rank-1 {fmt(acc['alpharl_rank1'])}, "
            f"recovers {fmt(rec.get('alpharl_rank1'), 0)} of RL's gain")
    return ("AlphaRL rank-1 replacement: held-out reward of base, RL and W_base + ‖ΔW‖_F·u₁v₁ᵀ",
            "rank-1 recovers >99% of RL's gain (arXiv 2510.00553)", this,
            f"RL's gain {fmt(doc.get('rl_gain'), pts=True)}; rest with RL's update {fmt(acc.get('alpharl_rank1_rest_rl'))}")


def _relex_rows(doc: dict[str, Any]) -> list[Row]:
    acc, fit, rows = doc.get("accuracy", {}), doc.get("relex_fit", {}), []
    for label in sorted(k for k in acc if k.startswith("relex")):
        steps, n = fit.get(f"{label}_fit_steps"), fit.get(f"{label}_observed")
        this = (f"{fmt(acc[label])} vs final {fmt(acc.get('rl'))}: {fmt(doc.get('minus_final', {}).get(label), pts=True)} "
                f"(recovers {fmt(doc.get('recovery', {}).get(label), 0)} of RL's gain)")
        note = (f"fit on RL steps 1–{steps:.0f} ({n:.0f} deltas) → step {doc.get('rl_steps')}; trajectory rank-1 share "
                f"{_pct(fit.get(f'{label}_explained_var_median'))}, line R² {fit.get(f'{label}_r2_median', float('nan')):.2f} "
                "(medians over tensors)") if steps is not None else ""
        rows.append((f"RELEX rank-1 extrapolation from the first {label.removeprefix('relex')}% of RL steps",
                     "matches full RLVR from ~15% of the steps, 10–20× beyond the window (arXiv 2605.21468)", this, note))
    return rows or [("RELEX rank-1 extrapolation", "matches full RLVR from ~15% of the steps (arXiv 2605.21468)",
                     "not fitted", "a fit needs 3 or more saved steps in its window: 14 or more RL steps "
                     "(benchmarks/smollm2_long.py runs 200)")]


def _kl_row(doc: dict[str, Any]) -> Row:
    kl, moved = doc.get("forward_kl_nats", {}), doc.get("weights_moved", {})

    def at(label: str, base: str) -> str:
        return fmt(kl.get(label, {}).get(base), 3, pct=False)

    this = (f"KL(π_pretrained‖π): after SFT {at('sft', 'pretrained')}, final {at('rl', 'pretrained')}; "
            f"KL(π_SFT‖π_RL) {at('rl', 'sft')} nats")
    note = (f"over RL the weights moved ‖W−θ₀‖/‖W‖ = {moved['drift_ratio']:.2e}, bf16-visible on "
            f"{_pct(moved['drift_bf16_changed_share'], 2)} of weights" if moved.get("drift_ratio") is not None else "")
    forgot = doc.get("forgetting_nats", {}).get("sft", {}).get("rl")
    if forgot:  # RL's Razor's other side: forgetting on a task the run does not train on
        this += f"; forgetting over RL (prose log-loss rise) {fmt(forgot, 4, pct=False)} nats/token"
    return ("KL to the base on held-out prompts (RL's Razor): E_x KL(π₀‖π), responses sampled from π₀",
            "forgetting follows this KL, not weight change (arXiv 2509.04259)", this, note)


def _gap_row(doc: dict[str, Any]) -> Row:
    g = doc.get("logprob_gap", {})
    if g.get("mean_nats") is None:
        return ("Trainer↔rollout log-prob gap", "—", "not recorded", "")
    this = (f"mean |Δ| {fmt(g['mean_nats'], 4, pct=False)} nats (median of {g['steps']} steps), max "
            f"{g['max_nats']:.3f}; over {g['threshold_nats']:g} nats: {fmt(g['over_share'], 2)} of tokens")
    note = f"{doc.get('regime', {}).get('rollout_dtype', '?')} rollout copy vs fp32 trainer, {g['tokens']} tokens"
    floor = doc.get("gap_floor", {})
    if floor.get("self_mean_nats"):  # the trainer against itself: two fp32 passes over the same tokens
        note += (f"; the trainer against itself (another micro-batch split) {fmt(floor['self_mean_nats'], 2, sci=True)} "
                 f"nats, ratio outside [0.9, 1.1] on {fmt(floor['self_ratio_outside_share'], 2)} of tokens vs the "
                 f"rollout's {fmt(floor['rollout_ratio_outside_share'], 2)}")
    return ("Trainer↔rollout log-prob gap |log π_rollout − log π_trainer| per sampled token",
            "no paper figure (verl rollout_corr/*, AReaL diagnostics)", this, note)


def _layers_row(doc: dict[str, Any]) -> Row:
    layers = [r for r in doc.get("layers", []) if r.get("drift_energy_pct") is not None]
    if not layers:
        return ("Where RL's update lives, per layer", "", "not recorded", "")
    top = sorted(layers, key=lambda r: -r["drift_energy_pct"])[:3]
    name = lambda r: "outside blocks" if r["layer"] is None else f"L{r['layer']}"  # noqa: E731
    this = "; ".join(f"{name(r)} {r['drift_energy_pct']:.1f}% of ‖ΔW‖² ({r['numel_pct']:.1f}% of weights, "
                     f"{r['drift_bf16_changed_pct']:.1f}% of bf16-visible changes)" for r in top)
    return ("Where RL's update lives: per-layer share of ‖ΔW‖² and of bf16-visible changes (top 3)",
            "RL's gain concentrates in one or a few middle layers (arXiv 2607.01232, by training layers alone)",
            this, f"{len(layers)} layer groups; weight-space shares, not the paper's layer contribution")


def _census(m: dict[str, Any]) -> str:
    """Mukherjee et al.'s sparsity is one count over every weight: no sampling unit, so no interval."""
    return f"{fmt(m)} (a count over every weight: no interval)" if m.get("value") is not None else fmt(m)


def reproduction_rows(doc: dict[str, Any]) -> list[Row]:
    """(measure, paper, this run, note) for every figure of ``reproduction_figures``' dict."""
    p, mr, ms, ds = doc["pulse_s1"], doc["mukherjee_rl"], doc["mukherjee_sft"], doc["delta_sync"]
    pulse = (f"{fmt(p, 2)} median of {p['steps']} steps (range {_pct(p['min'], 2)}–{_pct(p['max'], 2)})"
             if p.get("value") is not None else p.get("note", "—"))
    delta = (f"{fmt(ds, 2)} of bf16 bytes ({ds['encoding']})" if ds.get("value") is not None else ds.get("note", "—"))
    sync = (f"; implied sync {fmt_ms(ds['delta_sync_ms'])} vs {fmt_ms(ds['full_bf16_sync_ms'])} full bf16"
            if ds.get("delta_sync_ms") is not None else "")
    rows: list[Row] = [
        ("PULSE S₁ per RL step: share of elements whose bf16 cast is bit-identical across the step",
         "≈99% invisible in bf16 (arXiv 2602.03839)", pulse,
         f"first RL step {_pct(p.get('first_step'), 2)} (Adam's first update moves every weight by ≈η); "
         "interval resamples steps"),
        ("Mukherjee update sparsity, RL vs its base: bf16(W_t) − bf16(W₀), |Δ| ≤ 1e-5",
         "70–95% (RL updates 5–30%; arXiv 2505.11711)", _census(mr),
         f"after {mr.get('steps')} steps; exact-zero share {_pct(mr.get('zero_share'))}"),
        ("Mukherjee update sparsity, SFT vs pretrained (same definition)",
         "much lower than RL (SFT updates are dense)", _census(ms),
         f"after {ms.get('steps')} steps; exact-zero share {_pct(ms.get('zero_share'))}"),
        _alpharl_row(doc), *_relex_rows(doc),
        ("bf16 delta weight sync: bytes of changed elements (cheapest of value+index, bitmap, full)",
         "verl: ~1–3% of parameter bytes per step", delta, f"median over {ds.get('steps')} RL steps{sync}"),
        _kl_row(doc), _gap_row(doc), _layers_row(doc), _accuracy_row(doc),
    ]
    return rows


def markdown_table(doc: dict[str, Any], notes: bool = True) -> str:
    """The reproduction table in Markdown, with the run's regime and size above it; ``notes=False`` is
    README's short form: each measure by its name, without its definition and the note column."""
    r = doc.get("regime", {})
    head = (f"SmolLM2-135M-Instruct, {r.get('dtype')} master weights, {r.get('rollout_dtype')} rollout copy, AdamW; "
            f"SFT {r.get('sft_steps')} steps × {r.get('sft_batch')} at lr {r.get('sft_lr')}; GRPO {doc['rl_steps']} "
            f"steps × {r.get('prompts')}×{r.get('group')} samples at lr {r.get('rl_lr')}, T={r.get('temperature')}; "
            f"seed {r.get('seed')}; {doc.get('held_out_n')} held-out problems; {r.get('device')}. "
            "Brackets: 95% bootstrap intervals.")
    if doc.get("command"):
        step = doc.get("rl_step_s", {}).get("step")
        head += (f"\n\nCommand: `{doc['command']}` ({doc.get('wall_s', 0) / 3600:.1f} h"
                 + (f", {step:.0f} s per RL step" if step else "") + ").")
    cols = 4 if notes else 3
    names = ("measure (definition)", "paper", "this run", "note") if notes else ("measure", "paper", "this run")
    lines = [head, "", "| " + " | ".join(names) + " |",
             "|" + "---|" * cols]
    rows = [row if notes else (row[0].split(": ")[0], *row[1:3]) for row in reproduction_rows(doc)]  # short: no definition
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row[:cols]) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def print_reproduction(s: SmolSettings, console: Console, train_s: float, cpu_s: float | None = None) -> None:
    """Print the reproduction table (and where the checkpoints are, and their size on disk) for the finished
    run ``s.run_dir``, trained in ``train_s`` of wall time and ``cpu_s`` of CPU time."""
    from dynascope.demo.clock import trained_in
    from dynascope.demo.reproduction_figures import reproduction_figures

    run_dir = Path(s.run_dir)
    doc = reproduction_figures(run_dir)
    regime = (f"SmolLM2-135M-Instruct, fp32 master weights (bf16 by cast), {s.rollout_dtype} rollout copy, AdamW; "
              f"SFT {s.sft_steps} steps × {s.sft_batch} at lr {s.sft_lr:g}; GRPO {s.rl_steps} steps × "
              f"{s.prompts}×{s.group} samples at lr {s.rl_lr:g}, no KL term; {s.eval_n} held-out problems; {s.device}")
    console.rule(f"dynascope demo --model smollm2 — {trained_in(train_s, cpu_s)}")
    console.print(f"Regime: {regime}", highlight=False)
    t = Table(title="Reproduction: each paper's headline beside this run, same definition "
                    "(brackets: 95% bootstrap intervals)", title_justify="left")
    for c in ("measure (definition)", "paper", "this run", "note"):
        t.add_column(c, overflow="fold")
    for row in reproduction_rows(doc):
        t.add_row(*row)
    console.print(t)
    console.print(f"\nRL's base and policy: {run_dir / THETA0_FILE}, {run_dir / FINAL_FILE}", highlight=False)
    console.print(checkpoints_line(run_dir), highlight=False)
    console.print("Explore it:  [bold]dynascope dashboard " + str(run_dir) + "[/]", highlight=False)
    console.print("Findings:    dynascope report " + str(run_dir), highlight=False)


def checkpoints_line(run_dir: Path) -> str:
    """What the run's checkpoints take on disk (each a full fp32 copy of the model), measured."""
    files = sorted(run_dir.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    return (f"Checkpoints: {len(files)} files, {total / 1e9:.2f} GB on disk ({', '.join(f.name for f in files)}); "
            f"removing the run directory frees them.")
