"""The read-only query behind each finding: its first row returns the finding's numbers, same names.

Each query recomputes the numbers from the raw rows where the analysis is plain SQL, and returns the
inputs it ranked on (per-rank medians, step counts) where the analysis is a model such as the what-if
simulation. ``tests/test_findings_sql.py`` runs every finding's query on real runs and compares.
"""

from __future__ import annotations

from typing import Any

from dynascope.analyses.goodput import checkpoints_sql
from dynascope.analyses.rollouts import weight_syncs_sql
from dynascope.analyses.steps import STEP_ROW, scan_sql
from dynascope.store import quote_literal
from dynascope.store.pooling import GLOBAL

q = quote_literal


def straggler_sql(run: str, role: str, rank: int, path: str) -> str:
    """Per-rank step count and whole-run median of one phase path (``backward`` or ``train/backward``),
    over the steps at least two ranks ran it (as ``straggler_scores`` compares them); the named rank first."""
    parent, _, leaf = path.rpartition("/")
    where = f"phase = {q(leaf)}" + (f" AND parent = {q(parent)}" if parent else " AND coalesce(parent, '') IN ('', 'step')")
    return f"""WITH d AS (SELECT rank, step, SUM(dur_us) AS us FROM timings WHERE run_id = {q(run)}
        AND coalesce(role, '') = {q(role)} AND {where} AND step IS NOT NULL AND stream IS NULL
        AND coalesce(category, 'phase') = 'phase' GROUP BY rank, step),
        n AS (SELECT *, COUNT(*) OVER (PARTITION BY step) AS nranks FROM d)
        SELECT rank, COUNT(*) AS steps, median(us) / 1000.0 AS run_median_ms FROM n WHERE nranks >= 2
        GROUP BY rank ORDER BY rank = {int(rank)} DESC, run_median_ms DESC"""


def rank_cost_sql(run: str, role: str, rank: int) -> str:
    return f"""SELECT rank, COUNT(*) AS steps, median(dur_us) / 1000.0 AS median_step_ms FROM timings
        WHERE run_id = {q(run)} AND coalesce(role, '') = {q(role)} AND rank = {int(rank)} AND {STEP_ROW}
        GROUP BY rank"""


def imbalance_sql(run: str) -> str:
    return f"""SELECT COUNT(DISTINCT step) AS steps, COUNT(DISTINCT rank) AS ranks FROM timings
        WHERE run_id = {q(run)} AND {STEP_ROW}"""


def tail_sql(run: str) -> str:
    """Tail wait per step (last sample done − median sample done) over the step row, else the rollout span."""
    return f"""WITH s AS (SELECT step, (MAX(gen_end_us) - quantile_cont(gen_end_us, 0.5)) / 1000.0 AS tail_ms,
        (MAX(gen_end_us) - MIN(gen_start_us)) / 1000.0 AS span_ms FROM samples WHERE run_id = {q(run)}
        AND step IS NOT NULL AND gen_end_us IS NOT NULL GROUP BY step),
        st AS (SELECT step, MAX(dur_us) / 1000.0 AS step_ms FROM timings WHERE run_id = {q(run)} AND
        {STEP_ROW} GROUP BY step)
        SELECT COUNT(*) AS steps, SUM(tail_ms) AS tail_wait_ms, SUM(coalesce(st.step_ms, span_ms)) AS
        step_ms, 100 * SUM(tail_ms) / SUM(coalesce(st.step_ms, span_ms)) AS tail_wait_pct,
        median(tail_ms) AS median_tail_wait_ms FROM s LEFT JOIN st USING (step)"""


def zero_variance_sql(run: str) -> str:
    return f"""WITH g AS (SELECT step, group_id, COUNT(*) AS n, MAX(reward) = MIN(reward) AS zero FROM samples
        WHERE run_id = {q(run)} AND step IS NOT NULL AND group_id IS NOT NULL AND reward IS NOT NULL
        AND isfinite(reward) GROUP BY step, group_id HAVING COUNT(*) >= 2)
        SELECT COUNT(*) AS groups, COUNT(*) FILTER (zero) AS zero_variance_groups,
        coalesce(SUM(n) FILTER (zero), 0) AS wasted_samples,
        100.0 * COUNT(*) FILTER (zero) / COUNT(*) AS zero_variance_pct FROM g"""


def idle_sql(run: str) -> str:
    """Idle = the measured wait in collectives, or the wait implied by the slowest rank's busy time,
    whichever is more; worst rank (the one that waits most) first, beside the rank waited for
    (``waited_for_sql``)."""
    return f"""WITH {scan_sql(run)},
        per AS (SELECT run_id, role, rank, step, coalesce(SUM(dur_us) FILTER (NOT sync), 0) AS busy,
        coalesce(SUM(dur_us) FILTER (sync), 0) AS wait FROM ph GROUP BY ALL),
        i AS (SELECT *, greatest(wait, MAX(busy) OVER (PARTITION BY run_id, role, step) - busy) AS idle
        FROM per), r AS (SELECT rank, SUM(idle) AS idle, SUM(step_us) AS step_us FROM i JOIN st
        USING (run_id, role, rank, step) GROUP BY rank)
        SELECT rank AS worst_rank, 100 * idle / step_us AS worst_rank_idle_pct,
        100 * SUM(idle) OVER () / SUM(step_us) OVER () AS idle_pct, cause.*
        FROM r LEFT JOIN ({_waited_for(run)}) AS cause ON TRUE ORDER BY worst_rank_idle_pct DESC"""


def uninstrumented_sql(run: str) -> str:
    """Step time outside every top-level row, per rank and step (floored at 0), summed."""
    return f"""WITH {scan_sql(run)},
        c AS (SELECT run_id, role, rank, step, SUM(dur_us) AS us FROM ph GROUP BY ALL),
        rem AS (SELECT greatest(step_us - us, 0) AS rem_us, step_us FROM st JOIN c USING
        (run_id, role, rank, step)) SELECT SUM(rem_us) / 1000.0 AS uninstrumented_ms,
        100 * SUM(rem_us) / SUM(step_us) AS uninstrumented_pct FROM rem"""


def probe_cost_sql(run: str, phase: str) -> str:
    """The probe's phase over the step time of the timed steps (every rank's, summed), and its coverage: the
    tensors carrying ``update_norm`` over all tensors of the recorded steps (``tensor_stats_global``)."""
    return f"""WITH {scan_sql(run)}, pr AS (SELECT run_id, role, rank, step, SUM(dur_us) AS us
        FROM ph WHERE phase = {q(phase)} GROUP BY ALL)
        SELECT COUNT(DISTINCT st.step) AS steps, SUM(pr.us) / 1000.0 AS probe_ms,
        100.0 * SUM(pr.us) / SUM(st.step_us) AS probe_pct,
        (SELECT COUNT(DISTINCT step) FROM {GLOBAL} WHERE run_id = {q(run)}) AS recorded_steps,
        (SELECT 100.0 * COUNT(update_norm) / COUNT(*) FROM {GLOBAL} WHERE run_id = {q(run)}) AS coverage_pct FROM st LEFT JOIN pr USING (run_id, role, rank, step)"""


def staleness_sql(run: str) -> str:
    return f"""SELECT avg(trainer_version - policy_version) AS mean_staleness,
        max(trainer_version - policy_version) AS max_staleness FROM samples WHERE run_id = {q(run)}
        AND trainer_version IS NOT NULL AND policy_version IS NOT NULL"""


def weight_sync_sql(run: str) -> str:
    return f"""SELECT COUNT(*) AS weight_syncs, coalesce(SUM(span_us), 0) / 1000.0 AS weight_sync_ms
        FROM ({weight_syncs_sql(f" AND run_id = {q(run)}")})"""


def goodput_sql(run: str) -> str:
    ev = "time_us IS NOT NULL AND event = "
    parts = checkpoints_sql(f"(SELECT * FROM events WHERE run_id = {q(run)} AND time_us IS NOT NULL "
                            "AND event IN ('checkpoint_save', 'checkpoint_load'))")
    return f"""WITH ck AS ({parts}), c AS (SELECT COUNT(*) FILTER (event = 'checkpoint_save') AS checkpoint_saves,
        coalesce(SUM(span_us) FILTER (event = 'checkpoint_save'), 0) / 1000.0 AS checkpoint_save_ms,
        COUNT(*) FILTER (event = 'checkpoint_load') AS checkpoint_loads,
        coalesce(SUM(span_us) FILTER (event = 'checkpoint_load'), 0) / 1000.0 AS checkpoint_load_ms FROM ck)
        SELECT c.*, COUNT(*) FILTER ({ev}'fault') AS faults, COUNT(*) FILTER ({ev}'restart') AS restarts
        FROM c, events WHERE run_id = {q(run)} GROUP BY ALL"""


def instability_sql(run: str, first: dict[str, Any], steps: list[int]) -> str:
    """The series behind the first event of a kind, at its flagged steps: (step, rank, value), it first."""
    rank = "rank IS NULL" if first["rank"] is None else f"rank = {int(first['rank'])}"
    where = (f"run_id = {q(run)} AND coalesce(role, '') = {q(first['role'])} AND {rank} "
             f"AND step IN ({', '.join(map(str, steps))})")
    table, _, what = first["source"].partition(":")
    if first["event"] == "nan_inf" and table == "tensor_stats":
        return f"""SELECT step, rank, SUM(coalesce(grad_nan_count, 0) + coalesce(grad_inf_count, 0) +
            coalesce(w_nan_count, 0) + coalesce(w_inf_count, 0))::DOUBLE AS value FROM tensor_stats
            WHERE {where} GROUP BY step, rank HAVING value > 0 ORDER BY step"""
    if first["event"] == "nan_inf":
        return f"""SELECT step, rank, COUNT(*)::DOUBLE AS value FROM scalars WHERE {where} AND value IS NOT NULL
            AND NOT isfinite(value) GROUP BY step, rank ORDER BY step"""
    if table == "tensor_stats":  # the global gradient norm rebuilt from the whole tensors' norms
        steps_in = ", ".join(map(str, steps))
        return f"""SELECT step, NULL AS rank, sqrt(SUM(grad_norm * grad_norm)) AS value FROM {GLOBAL}
            WHERE run_id = {q(run)} AND coalesce(role, '') = {q(first['role'])} AND step IN ({steps_in})
            AND grad_norm IS NOT NULL GROUP BY step ORDER BY step"""
    return f"""SELECT step, rank, AVG(value) AS value FROM scalars WHERE {where} AND key = {q(what)}
        GROUP BY step, rank ORDER BY step"""


def mfu_sql(run: str) -> str:
    return f"""SELECT SUM(coalesce(prompt_len, 0) + coalesce(response_len, 0))::DOUBLE AS tokens FROM samples
        WHERE run_id = {q(run)} AND step IS NOT NULL"""


def rank1_sql(run: str) -> str:
    return f"""SELECT step, SUM(sigma[1] * sigma[1]) / SUM(drift_norm * drift_norm) AS rank1_energy,
        COUNT(*) AS tensors FROM spectra WHERE run_id = {q(run)} AND drift_norm > 0
        GROUP BY step ORDER BY step DESC"""


def _bf16_steps(run: str) -> str:
    """CTEs ending in ``c``: per step whose every tensor has S₁ and whose rows hold the run's full element
    count, its stage, numel, elements whose bf16 cast changed and the bitmap bytes, a tensor counted once
    (``tensor_stats_global``), with ``first`` the stage's first such step (as
    ``delta_sync_bytes`` and ``delta_sync_summary``)."""
    return f"""s AS (SELECT step, any_value(stage) AS stage, sum(numel) AS numel,
        sum(numel - bf16_unchanged_count) AS changed, sum(ceil(numel / 8.0)) AS bitmap,
        count(bf16_unchanged_count) = count(*) AS complete FROM {GLOBAL} WHERE run_id = {q(run)} GROUP BY step),
        c AS (SELECT *, min(step) OVER (PARTITION BY stage) AS first FROM s
              WHERE complete AND numel = (SELECT max(numel) FROM s))"""


def update_sparsity_sql(run: str, a: str, b: str, bf16: bool) -> str:
    """Per stage, as columns _a and _b: the numel-weighted share of parameters one step left bit-identical,
    the stored dtype, and (``bf16``: the run records S₁) the median share of elements whose bf16 cast changed
    in a step (1 − PULSE S₁) over the stage's steps after its first, with the number of those steps."""
    def side(stage: str, col: str) -> str:
        cond = f"stage = {q(stage)} AND changed_count IS NOT NULL"
        return f"1 - SUM(changed_count) FILTER ({cond})::DOUBLE / SUM(numel) FILTER ({cond}) AS step_unchanged_frac_{col}"

    def visible(stage: str, col: str) -> str:
        if not bf16:
            return f"NULL::DOUBLE AS bf16_changed_pct_{col}, NULL::BIGINT AS bf16_steps_{col}"
        later = f"FROM c WHERE step > first AND stage = {q(stage)}"
        return (f"(SELECT median(100.0 * changed / numel) {later}) AS bf16_changed_pct_{col}, "
                f"(SELECT COUNT(*) {later}) AS bf16_steps_{col}")

    with_ = f"WITH {_bf16_steps(run)} " if bf16 else ""
    return f"""{with_}SELECT {side(a, 'a')}, {side(b, 'b')}, mode(dtype) AS dtype, {visible(a, 'a')}, {visible(b, 'b')}
        FROM {GLOBAL} WHERE run_id = {q(run)}"""


def delta_sync_sql(run: str, stage: str) -> str:
    """The stage's median share of elements whose bf16 cast changed and of delta-sync bytes, over its
    steps where every tensor has S₁, leaving out the stage's first step (as ``delta_sync_summary``)."""
    return f"""WITH {_bf16_steps(run)}
        SELECT stage, COUNT(*) AS steps, median(100.0 * changed / numel) AS changed_pct,
        median(100.0 * least(6 * changed, bitmap + 2 * changed, 2 * numel) / (2 * numel)) AS delta_pct,
        median(2 * numel)::BIGINT AS full_bf16_bytes FROM c WHERE step > first AND stage = {q(stage)}
        GROUP BY stage"""


def schedule_sql(run: str, rollout_phases: tuple[str, ...], sync_phases: tuple[str, ...]) -> str:
    """The measured pieces the schedule replay starts from, per RL step (a step with a rollout phase): the
    wall-clock time per step, and the slowest rank's rollout and weight sync, averaged over those steps."""
    ro = ", ".join(q(p) for p in rollout_phases)
    ws = ", ".join(q(p) for p in sync_phases)
    return f"""WITH {scan_sql(run, with_run=False)}, t AS (SELECT role, rank, step,
        SUM(dur_us) FILTER (WHERE phase IN ({ro})) AS ro, coalesce(SUM(dur_us) FILTER (WHERE phase IN ({ws})), 0) AS ws
        FROM ph GROUP BY ALL HAVING bool_or(phase IN ({ro}))),
        k AS (SELECT * FROM t JOIN st USING (role, rank, step)),
        s AS (SELECT step, MAX(ro) AS ro, MAX(ws) AS ws FROM k GROUP BY step)
        SELECT (SELECT COUNT(*) FROM s) AS steps,
               (SELECT (MAX(start_us + step_us) - MIN(start_us)) / 1000.0 / COUNT(DISTINCT step) FROM k) AS measured_step_ms,
               (SELECT AVG(ro) / 1000.0 FROM s) AS rollout_ms, (SELECT AVG(ws) / 1000.0 FROM s) AS weight_sync_ms"""


def weight_sync_check_sql(run: str) -> str:
    """Checks and mismatched checks over the run; the first mismatched step with its counts and message."""
    return f"""WITH s AS (SELECT step, max(value) FILTER (WHERE key = 'weight_sync/tensors_checked') AS checked,
        max(value) FILTER (WHERE key = 'weight_sync/mismatched_tensors') AS bad FROM scalars
        WHERE run_id = {q(run)} AND key IN ('weight_sync/tensors_checked', 'weight_sync/mismatched_tensors')
        AND step IS NOT NULL GROUP BY step),
        e AS (SELECT step, string_agg(message, ' | ' ORDER BY time_us) AS message FROM events
        WHERE run_id = {q(run)} AND event = 'weight_sync_mismatch' GROUP BY step)
        SELECT (SELECT count(*) FROM s) AS syncs_checked, (SELECT count(*) FROM s WHERE bad > 0) AS mismatched_syncs,
        s.step AS first_step, s.bad AS mismatched_tensors, s.checked AS tensors_checked, e.message
        FROM s LEFT JOIN e USING (step) WHERE s.bad > 0 ORDER BY s.step LIMIT 1"""


def logprob_gap_sql(run: str) -> str:
    """Per-step log-prob gaps (Σ|Δ|/Σtokens, max, share over the threshold), then their medians over steps."""
    return f"""WITH g AS (SELECT step, sum(logprob_gap_sum_nats) / sum(logprob_gap_tokens_count) AS gap,
        max(logprob_gap_max_nats) AS mx, 100.0 * sum(logprob_gap_over_count) / sum(logprob_gap_tokens_count) AS over,
        max(logprob_gap_threshold_nats) AS threshold FROM samples
        WHERE run_id = {q(run)} AND step IS NOT NULL AND logprob_gap_sum_nats IS NOT NULL GROUP BY step)
        SELECT count(*) AS steps, median(gap) AS median_gap_nats, max(mx) AS max_gap_nats,
        median(over) AS median_over_pct, max(threshold) AS threshold_nats FROM g"""


def kl_to_base_sql(run: str) -> str:
    """The forward KL to the pretrained and SFT bases at the first and the last RL-stage evaluation (the
    ``eval/forward_kl_*_nats`` scalars), forgetting between them (the rise of ``eval/prose_nll_nats``, a
    log-loss on text the run does not train on; NULL unless logged), and how far the weights moved by the
    last RL step with drift.

    The drift figures are over the rows that carry them (under a memory budget the drift columns cover the
    window's tensors only): each a ratio of sums over the same rows, never over the step's every row."""
    kl = "'eval/forward_kl_pretrained_nats', 'eval/forward_kl_sft_nats', 'eval/prose_nll_nats'"
    return f"""WITH e AS (SELECT step, key, arg_max(value, time_us) AS v FROM scalars WHERE run_id = {q(run)}
        AND key IN ({kl}) GROUP BY step, key),
        rl AS (SELECT min(step) AS first, max(step) AS last FROM e WHERE key = 'eval/forward_kl_sft_nats'),
        w AS (SELECT max(step) AS step FROM {GLOBAL} WHERE run_id = {q(run)} AND stage = 'rl'
              AND drift_norm IS NOT NULL AND w_norm IS NOT NULL),
        t AS (SELECT * FROM {GLOBAL} WHERE run_id = {q(run)} AND stage = 'rl' AND step = (SELECT step FROM w)),
        d AS (SELECT sqrt(sum(drift_norm * drift_norm) FILTER (WHERE w_norm IS NOT NULL))
                     / sqrt(sum(w_norm * w_norm) FILTER (WHERE drift_norm IS NOT NULL)) AS drift_ratio,
              100.0 * sum(numel - drift_zero_count) / sum(numel) FILTER (WHERE drift_zero_count IS NOT NULL)
                  AS bf16_changed_pct
              FROM t)
        SELECT (SELECT v FROM e WHERE key = 'eval/forward_kl_pretrained_nats' AND step = rl.first) AS kl_sft_nats,
        (SELECT v FROM e WHERE key = 'eval/forward_kl_pretrained_nats' AND step = rl.last) AS kl_final_nats,
        (SELECT v FROM e WHERE key = 'eval/forward_kl_sft_nats' AND step = rl.last) AS kl_rl_base_nats,
        rl.last - rl.first AS steps,
        (SELECT v FROM e WHERE key = 'eval/prose_nll_nats' AND step = rl.last)
            - (SELECT v FROM e WHERE key = 'eval/prose_nll_nats' AND step = rl.first) AS forgetting_nats,
        d.drift_ratio, d.bf16_changed_pct FROM rl, d"""


def node_ranks_sql(run: str, role: str, host: str) -> str:
    """The host and how many ranks of ``role`` it holds (``runs`` rows)."""
    return f"""SELECT host, COUNT(DISTINCT rank) AS ranks_count FROM runs WHERE run_id = {q(run)}
        AND coalesce(role, '') = {q(role)} AND host = {q(host)} AND rank IS NOT NULL GROUP BY host"""


def waited_for_sql(run: str) -> str:
    """Per (role, step, waiting phase) the rank with the least wait arrived last; the others' wait beyond
    it is charged to that rank. The rank charged most, its host, and its share of the ranks' step time."""
    return f"WITH {scan_sql(run, with_run=False)} {_waited_for(run)}"


def _waited_for(run: str) -> str:
    """``waited_for_sql`` over the ``ph`` and ``st`` of a ``scan_sql`` around it (``idle_sql`` shares its scan)."""
    return f"""SELECT top.role AS waited_for_role, waited_for_rank, (SELECT any_value(host) FROM runs
               WHERE run_id = {q(run)} AND rank = waited_for_rank AND coalesce(role, '') = top.role) AS waited_for_host,
               phase AS waited_for_phase, charged_us / 1000.0 AS waited_for_ms,
               100.0 * charged_us / t.step_us AS waited_for_pct, t.ranks AS ranks
        FROM (SELECT role, late AS waited_for_rank, SUM(charged_us) AS charged_us,
                     arg_max(phase, charged_us) AS phase
              FROM (SELECT role, step, phase, arg_min(rank, dur_us) AS late,
                           SUM(dur_us) - COUNT(*) * MIN(dur_us) AS charged_us
                    FROM ph WHERE sync AND rank IS NOT NULL GROUP BY ALL HAVING COUNT(*) >= 2)
              GROUP BY ALL ORDER BY charged_us DESC LIMIT 1) AS top,
             (SELECT SUM(step_us) AS step_us, COUNT(DISTINCT (role, rank)) AS ranks FROM st) AS t"""
