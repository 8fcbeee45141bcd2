"""The demo's closing report: what RL did to the reward and to the weights, and where the time went.

Everything is read back from the run's store through ``dynascope.analyses`` (reward figures come from
the ``eval/*`` and ``rl/*`` scalars the training logged); the rank-1 row evaluates a checkpoint that
``dynascope.checkpoints.rank1_reconstruction`` writes from the recorded spectra.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
from rich.console import Console
from rich.table import Table

from dynascope import analyses
from dynascope.analyses.findings import tail_wait_numbers
from dynascope.analyses.findings_text import sentence
from dynascope.analyses.probe_time import DEFAULT_PROBE_COST, PROBE_PHASE
from dynascope.analyses.step_shares import phase_shares
from dynascope.core.fmt import fmt_ms, fmt_pct
from dynascope.demo.distributed import FINAL_FILE, THETA0_FILE
from dynascope.demo.settings import DemoSettings
from dynascope.store import StoreConnection, StoreError, open_store, quote_literal

RANK1_FILE = "policy_rank1.safetensors"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _last_scalar(con: StoreConnection, key: str, stage: str) -> float | None:
    df = con.frame(f"SELECT value FROM scalars WHERE key = {quote_literal(key)} AND stage = {quote_literal(stage)} "
                    "ORDER BY step DESC, time_us DESC LIMIT 1")
    return None if df.is_empty() else float(df["value"][0])


def _rl_reward_ends(con: StoreConnection, n: int = 10) -> tuple[float | None, float | None]:
    """Mean training reward over the first and the last ``n`` RL steps (all ranks)."""
    df = con.frame("SELECT step, avg(value) AS r FROM scalars WHERE key = 'rl/reward' GROUP BY step ORDER BY step")
    if df.height < 2:
        return None, None
    k = min(n, df.height // 2)
    return float(df["r"].head(k).mean()), float(df["r"].tail(k).mean())


def rank1_accuracy(s: DemoSettings, con: StoreConnection) -> float | None:
    """Greedy held-out accuracy of θ₀ + ‖ΔW‖_F·u₁v₁ᵀ (every 2-D weight), written by ``rank1_reconstruction``."""
    from safetensors.torch import load_file

    from dynascope.checkpoints import rank1_reconstruction
    from dynascope.demo.model import TinyLM
    from dynascope.demo.sft import evaluate, heldout
    from dynascope.demo.task import CharTokenizer

    run_dir = Path(s.run_dir)
    rank1_reconstruction(con, run_dir / THETA0_FILE, run_dir / RANK1_FILE)
    model = TinyLM(s.model)
    model.load_state_dict(load_file(str(run_dir / RANK1_FILE)))
    return evaluate(model, CharTokenizer(), s.task, heldout(s.task, s.eval_n, s.seed))


def _reward_table(s: DemoSettings, con: StoreConnection, console: Console) -> None:
    t = Table(title="Reward (held-out prompts, exact match)", title_justify="left")
    for col in ("", "after SFT = θ₀", "after RL", "change"):
        t.add_column(col, justify="right" if col else "left")
    for label, key in (("greedy accuracy", "eval/accuracy"), ("sampled reward (T=1)", "eval/sampled_reward")):
        a, b = _last_scalar(con, key, "sft"), _last_scalar(con, key, "rl")
        delta = f"{100 * (b - a):+.1f} pts" if a is not None and b is not None else "—"
        t.add_row(label, _pct(a), _pct(b), delta)
    first, last = _rl_reward_ends(con)
    if first is not None:
        t.add_row("training reward (first/last 10 RL steps)", _pct(first), _pct(last), f"{100 * (last - first):+.1f} pts")
    try:
        acc = rank1_accuracy(s, con)
        full = _last_scalar(con, "eval/accuracy", "rl")
        t.add_row("rank-1 reconstruction θ₀ + ‖ΔW‖·u₁v₁ᵀ", "", _pct(acc),
                  f"{100 * (acc - full):+.1f} pts vs full RL" if full is not None else "")
    except Exception as exc:  # a report line, not a crash: e.g. no spectra were recorded
        t.add_row("rank-1 reconstruction", "", f"unavailable ({type(exc).__name__}: {exc})", "")
    console.print(t)


def _bf16_changed(con: StoreConnection) -> dict[str, float]:
    """Per stage: the share of elements whose bf16 cast changed in a step (1 − PULSE S₁), median over the
    stage's steps after its first: ``delta_sync_summary``'s ``changed_pct``, as the report says it."""
    try:
        df = analyses.delta_sync_summary(con)
    except StoreError:  # a run recorded without S₁
        return {}
    return {r["stage"]: r["changed_pct"] for r in df.iter_rows(named=True)}


def _dynamics(s: DemoSettings, con: StoreConnection, console: Console) -> None:
    cmp = analyses.sparsity_comparison(con, "sft", "rl").filter(pl.col("kind") == "all")
    t = Table(title="Weight updates: SFT vs RL (all tensors, numel-weighted)", title_justify="left")
    for col in ("", "SFT", "RL"):
        t.add_column(col, justify="right" if col else "left")
    row = cmp.row(0, named=True) if cmp.height else {}
    # What means something here (dense updates): how far weights move per step, and how much of it bf16 sees.
    per_step = con.frame("""
        SELECT stage, median(ratio) AS ratio FROM (
            SELECT stage, step, sqrt(sum(update_norm * update_norm)) / sqrt(sum(w_norm * w_norm)) AS ratio
            FROM tensor_stats_global WHERE stage IN ('sft', 'rl') GROUP BY stage, step)
        GROUP BY stage""")
    med = {r["stage"]: r["ratio"] for r in per_step.iter_rows(named=True)}
    t.add_row("update ratio ‖ΔW‖/‖W‖ per step (median)", *("—" if med.get(st) is None else f"{med[st]:.2e}"
                                                            for st in ("sft", "rl")))
    bf16 = _bf16_changed(con)
    t.add_row("changed in bf16 per step (1 − PULSE S₁), median*",
              *("—" if bf16.get(st) is None else f"{bf16[st]:.2f}%" for st in ("sft", "rl")))

    def changed(key: str) -> tuple[float | None, float | None]:
        a, b = row.get(f"{key}_a"), row.get(f"{key}_b")
        return (None if a is None else 1 - a), (None if b is None else 1 - b)

    t.add_row("changed per step, bit-exact in the fp32 weights", *map(_pct, changed("step_unchanged_frac")))
    t.add_row("changed over the stage vs its θ₀, bit-exact", *map(_pct, changed("unchanged_frac")))
    t.add_row("changed over the stage by > 0.1% of |W| (relative)", *map(_pct, changed("unchanged_rel_frac")))
    r1 = analyses.rank1_dominance(con).filter((pl.col("level") == "overall") & (pl.col("stage") == "rl"))
    if r1.height:
        last = r1.sort("step").row(-1, named=True)
        t.add_row(f"rank-1 energy σ₁²/‖ΔW‖²_F of RL's ΔW (step {last['step']})", "", _pct(last["rank1_energy"]))
        t.add_row("top-k energy of RL's ΔW", "", _pct(last["topk_energy"]))
    console.print(t)
    console.print("[dim]* each stage's first step left out: Adam's first update moves every weight by about lr.[/]")
    console.print(f"[dim]These updates are dense because this small model is trained from scratch in fp32 at lr "
                  f"{s.sft.lr:g} (SFT) and {s.rl.lr:g} (RL): Adam moves nearly every weight at every step (the "
                  "bit-exact row), and most of those moves still show after rounding to bf16 (the PULSE row). For "
                  "the papers' regime (a pretrained model, lr ≈ 1e-6, bf16) run [bold]dynascope demo --model "
                  "smollm2[/].[/]", highlight=False)


# What the tiny demo's probe share means (shown under its step breakdown).
PROBE_NOTE = ("dynascope = the probe's own work on the training thread, and its waits for the probe's "
              "background passes. The demo records every statistic of "
              "every tensor at every step (watch(memory_budget=None): the window holds every tensor); watch()'s "
              f"defaults, a rotating window under a 1% time budget, cost {DEFAULT_PROBE_COST}.")


def _time(con: StoreConnection, console: Console) -> None:
    # The report's definition (analyses.phase_shares): RL-stage steps; rollout actors (async) label no
    # stage and only ever do RL. Every phase is listed, so the shares add up to the step time.
    per = phase_shares(con).filter((pl.col("stage") == "rl") | pl.col("stage").is_null())
    per = per.sort(["role", "share_pct"], descending=[False, True])
    if per.is_empty():
        return
    t = Table(title="Where RL step time went (all ranks, summed)", title_justify="left")
    for col in ("role", "phase", "time", "share"):
        t.add_column(col, justify="right" if col in ("time", "share") else "left")
    for (role,), g in per.group_by("role", maintain_order=True):
        for r in g.iter_rows(named=True):
            t.add_row(r["role"], r["phase"], fmt_ms(r["dur_ms"]), fmt_pct(r["share_pct"]))
        t.add_row(role, f"all ({g['steps'][0]} steps)", fmt_ms(g["step_ms"][0]), fmt_pct(g["share_pct"].sum()),
                  style="bold", end_section=True)
    console.print(t)
    if per.filter(pl.col("phase") == PROBE_PHASE).height:
        console.print(f"[dim]{PROBE_NOTE}[/]", highlight=False)


def slowest_rank_sentence(w: dict) -> str:
    """The rank that costs the most time, from its ``straggler_scores`` row; a rank the scores do not flag
    (status ok) is said to stand out in nothing, rather than be called "1.0× slower"."""
    where = (f"[bold]rank {w['rank']}[/] ({w['role']}) in phase [bold]{w['phase']}[/]: {fmt_ms(w['median_ms'])} "
             f"median vs {fmt_ms(w['cross_rank_median_ms'])} across ranks")
    if w["status"] == "ok":
        return f"Slowest rank: none stands out (the closest, {where}, {w['slowdown_x']:.2f}× the median)."
    return f"Slowest rank: {where} ({w['slowdown_x']:.1f}× slower, score {w['score']:.2f}, {w['status']})."


def costly_rank_sentence(con: StoreConnection) -> str | None:
    """The report's ``rank_cost`` sentence for the rank that stands out as slower (``analyses.rank_busy``)
    whose whole-rank what-if saves the most, when that is at least the report's threshold: a rank slower in
    no single phase beyond its noise can still cost the step time, and the report names it so
    (``analyses.what_if``, one answer for every surface)."""
    from dynascope.analyses.findings import MIN_RANK_COST_PCT

    wi = analyses.what_if(con, by_phase=True)
    run = str(wi["run_id"][0]) if wi.height else ""
    slower = analyses.rank_busy(con, run).filter(pl.col("slow")).select("role", "rank")  # the report's rule
    whole = (wi.filter(pl.col("rank").is_not_null() & pl.col("phase").is_null())
             .join(slower, on=["role", "rank"], how="semi").sort("saved_pct", descending=True))
    if whole.is_empty() or whole["saved_pct"][0] < MIN_RANK_COST_PCT:
        return None
    r = whole.row(0, named=True)
    phases = wi.filter((pl.col("rank") == r["rank"]) & (pl.col("role") == r["role"]) & pl.col("phase").is_not_null())
    n = {"rank": r["rank"], "steps": r["steps"], "saved_ms": r["saved_ms"], "saved_pct": r["saved_pct"],
         "worst_phase": phases["phase"][0] if phases.height else None,
         "worst_phase_saved_pct": phases["saved_pct"][0] if phases.height else None}
    return sentence("rank_cost", n)


def _bottlenecks(con: StoreConnection, console: Console) -> None:
    scores = analyses.straggler_scores(con)
    if scores.is_empty():
        console.print("Slowest rank: one process per role — nothing to compare.")
    else:
        # The rank that costs the most time: excess over the cross-rank median, times the steps it recurs in.
        w = (scores.with_columns(((pl.col("median_ms") - pl.col("cross_rank_median_ms")) * pl.col("steps"))
                                 .alias("excess_ms")).sort("excess_ms", descending=True).row(0, named=True))
        costly = costly_rank_sentence(con) if w["status"] == "ok" else None
        console.print(f"Slowest rank: {costly}." if costly else slowest_rank_sentence(w), highlight=False)
    tail = analyses.rollout_long_tail(con)
    if tail.height:
        console.print(f"Rollout long tail: median step's slowest sample took {tail['gen_tail_x'].median():.1f}× "
                      f"the median sample; responses p50 {tail['response_len_p50_tokens'].median():.0f} tokens, "
                      f"max {tail['response_len_max_tokens'].max():.0f}.", highlight=False)
    tail = analyses.tail_wait_summary(con)
    if tail.height and tail["step_ms"][0]:
        numbers = tail_wait_numbers(tail.row(0, named=True))
        console.print(f"Rollout tail: {sentence('rollout_tail', numbers)}.", highlight=False)
    stale = analyses.async_staleness(con)
    if stale.height and stale["staleness_steps"].max() > 0:
        mean = float((stale["staleness_steps"] * stale["samples"]).sum() / stale["samples"].sum())
        ov = analyses.rollout_train_overlap(con).row(0, named=True)
        console.print(f"Async: mean staleness {mean:.2f} versions (max {stale['staleness_steps'].max()}); rollout and "
                      f"training overlapped {ov['overlap_pct']:.0f}% of wall time; {ov['weight_syncs']} weight syncs "
                      f"took {fmt_ms(ov['weight_sync_ms'])}.", highlight=False)


def _alerts(con: StoreConnection, console: Console) -> None:
    """The alerts the run's monitor fired while it trained: how many, and the first on each series (a rule's
    rank and part: the straggler rule's rank and phase)."""
    rows = con.rows("SELECT fields_json ->> 'rule', fields_json ->> 'rank', fields_json ->> 'part', message "
                    "FROM events WHERE event = 'alert' ORDER BY time_us")
    first: dict[tuple, str] = {}
    for rule, rank, part, message in rows:
        first.setdefault((str(rule), rank, part), str(message))
    console.print(f"Alerts judged live: {len(rows)} fired" + ("; the first of each rule on each rank:" if rows else "."),
                  highlight=False)
    for _, message in sorted(first.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), str(kv[0][2]))):
        console.print(f"  {message}", highlight=False)


def print_report(s: DemoSettings, console: Console, train_s: float, cpu_s: float | None = None) -> None:
    """Print the report for the finished run ``s.run_dir`` (trained in ``train_s`` of wall time and ``cpu_s``
    of CPU time)."""
    from dynascope.demo.clock import trained_in

    run_dir = Path(s.run_dir)
    with open_store(run_dir) as con:
        console.rule(f"dynascope demo — {trained_in(train_s, cpu_s)}")
        _reward_table(s, con, console)
        _dynamics(s, con, console)
        _time(con, console)
        _bottlenecks(con, console)
        if s.alerts:
            _alerts(con, console)
    console.print(f"\nθ₀ (SFT) and the RL policy: {run_dir / THETA0_FILE}, {run_dir / FINAL_FILE}")
    console.print("Explore it:  [bold]dynascope dashboard " + str(run_dir) + "[/]", highlight=False)
    console.print("Findings:    dynascope report " + str(run_dir), highlight=False)
