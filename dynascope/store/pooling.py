"""How ``tensor_stats`` rows of several ranks pool into one per tensor: the rule every reader calls.

A rank's row describes what that rank holds of the tensor:

* a **shard** (``sharded``: FSDP2, HSDP, tensor parallel, ZeRO): the pieces of one replica make the whole
  tensor, so their rows combine (sums, roots of summed squares, maxima, as each column declares);
* a **replica** of a shard (HSDP's replicate dimension, ``replica`` > 0): a copy of what replica 0
  holds, so it never counts;
* a **whole** tensor (DDP, a replicated TP bias, one process): every rank holds the same values, so the
  lowest rank's row stands for it.

And which process's rows count for a step: a rank that restarted and replayed steps (a resume from a
checkpoint) has rows of two processes for them; ``generation`` (the writing process's start) tells them
apart, and the latest one of each (rank, step) counts.

``global_sql`` builds the canonical view ``tensor_stats_global`` from that rule and the column registry:
one row per (run_id, role, stage, step, tensor), the whole logical tensor's statistics. Readers that want one
number per tensor read the view; ``counted_sql`` is the same rule as a condition, for the few readers of
rows that are not statistics (the rollup that compaction writes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dynascope.store.schema import TENSOR_STATS_COLUMNS

__all__ = ["COUNTED_SHARD_SQL", "GLOBAL", "NOT_A_REPLICA_SQL", "counted_rollup_sql", "counted_sql", "global_sql",
           "holds_of", "is_counted_shard"]

GLOBAL = "tensor_stats_global"
# A shard row that counts: of replica 0 (or of no replica group: NULL, runs written before it was recorded).
COUNTED_SHARD_SQL = "(coalesce(sharded, false) AND coalesce(replica, 0) = 0)"
# Every row but a replica's copy of a shard (whole tensors' rows stay, one per rank).
NOT_A_REPLICA_SQL = "(NOT coalesce(sharded, false) OR coalesce(replica, 0) = 0)"
_KEYS = ("run_id", "role", "step", "tensor")


def counted_sql(first_rank: str, prefix: str = "") -> str:
    """SQL: the row counts when pooling ranks: a shard of replica 0, or a whole tensor's row on
    ``first_rank`` (an expression: the lowest rank holding the tensor that step). ``prefix``: a table
    alias with its dot (``"t."``)."""
    p = prefix
    return (f"((coalesce({p}sharded, false) AND coalesce({p}replica, 0) = 0) "
            f"OR (NOT coalesce({p}sharded, false) AND {p}rank = {first_rank}))")


def is_counted_shard(sharded: bool | None, replica: int | None) -> bool:
    """Python's ``COUNTED_SHARD_SQL``, for one row."""
    return bool(sharded) and (replica or 0) == 0


def holds_of(sharded: bool | None, replica: int | None) -> str:
    """How a rank held a tensor_stats row: ``shard`` (of replica 0), ``replica`` (another replica's copy of
    a shard) or ``whole`` (a DDP copy, a replicated bias, one process): the rollups' ``holds``."""
    return ("shard" if is_counted_shard(sharded, replica) else "replica") if sharded else "whole"


def counted_rollup_sql(table: str, where: str = "true", layer: bool = False, quote: Callable[[str], str] | None = None) -> str:
    """SELECT of the rows of a rollup (``tensor_stats_by_kind``, or ``_by_layer`` with ``layer``) that count
    when its sums are pooled across ranks, by the canonical view's rule: shards of replica 0, never a
    replica's copy, whole tensors from the lowest rank holding whole tensors of that (run, role, stage, step,
    kind[, layer]) — DDP and tensor parallel give every rank the same whole tensors — and of a rank's rows
    for a step, the latest ``generation``'s (a replayed step's newest process). Rows written before
    ``holds`` existed count as they are. ``quote``: the engine's identifier quoting (Spark's backticks)."""
    q = quote or _q
    rank, keys = q("rank"), ["run_id", "role", "stage", "step", "kind", *(["layer"] if layer else [])]
    part = ", ".join(q(k) for k in keys)
    return f"""SELECT * FROM (
            SELECT *, min(CASE WHEN holds = 'whole' THEN {rank} END) OVER (PARTITION BY {part}) AS _whole_rank,
                   max(generation) OVER (PARTITION BY run_id, role, {rank}, stage, step) AS _latest
            FROM {table} WHERE {where}) r
        WHERE (holds IS NULL OR holds = 'shard' OR (holds = 'whole' AND {rank} = _whole_rank))
          AND (_latest IS NULL OR generation = _latest)"""


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _typed(expr: str, col: str) -> str:
    """``expr`` cast back to the column's stored type (DuckDB sums integers into HUGEINT)."""
    from dynascope.store.schema import sql_type

    return f"CAST({expr} AS {sql_type(next(c.type for c in TENSOR_STATS_COLUMNS if c.name == col))})"


def global_sql(source: str = "tensor_stats", columns: Iterable[str] | None = None,
               quote: Callable[[str], str] = _q) -> str:
    """SELECT of the canonical rows from ``source`` (the ``tensor_stats`` view, or any relation with its
    columns; ``columns``: those it has, when not all; ``quote``: the engine's identifier quoting, for
    Spark's backticks). Written in the SQL DuckDB and Spark both accept. One row per (run_id, role, stage, step, tensor):

    * shards of replica 0 combine as each column declares (``Column.reduce``); a combined value is NULL
      when any shard's is; ratios and fractions are derived again from the combined values, never
      averaged; a step whose shards hold fewer elements than the tensor's fullest step (a shard's row
      lost) has NULL statistics, not a smaller tensor's;
    * a whole tensor's row comes from the lowest rank holding it;
    * of a rank's rows for a step, only the latest ``generation``'s count (a replayed step's newest);
    * ``shards`` counts the rows pooled, ``generation`` is the latest one that counted.
    """
    _q = quote  # noqa: N806 - shadows the module's quoting for this engine
    have = set(columns) if columns is not None else None
    cols = [c for c in TENSOR_STATS_COLUMNS if have is None or c.name in have]
    names = {c.name for c in cols}
    gen = have is None or "generation" in have
    rep = "replica" if "replica" in names else "CAST(NULL AS INTEGER)"
    # Replicas' copies of a shard never count; what is left of a tensor is either its shards (all count)
    # or whole copies, of which the lowest rank's stands for it: ``min_by(x, rank)``, with no window.
    shards = "bool_or(coalesce(sharded, false))"

    def pooled(expr: str, col: str, how: str) -> str:  # over the shards; NULL when any shard's is NULL
        return (f"CASE WHEN NOT {shards} THEN min_by({col}, rank) WHEN count({col}) < count(*) THEN NULL "
                f"ELSE {expr} END")

    agg: list[str] = []
    for c in cols:
        n = _q(c.name)
        if c.name == "tensor":
            continue
        if c.name == "sharded":
            agg.append(f"{shards} AS sharded")
        elif c.name == "shard":
            agg.append(f"CASE WHEN NOT {shards} THEN min_by(shard, rank) END AS shard")
        elif c.name == "replica":
            agg.append("min(replica) AS replica")
        elif c.reduce == "first":
            agg.append(f"min_by({n}, rank) AS {n}")
        elif c.reduce == "all":
            agg.append(f"{pooled(f'bool_and({n})', n, 'all')} AS {n}")
        elif c.reduce in ("sum", "norm", "max"):
            how = {"sum": f"sum({n})", "max": f"max({n})", "norm": f"sqrt(sum(CAST({n} AS DOUBLE) * {n}))"}[c.reduce]
            agg.append(f"{pooled(_typed(how, c.name), n, c.reduce)} AS {n}")
        else:  # derived below; a whole tensor keeps the value its row was recorded with
            agg.append(f"min_by({n}, rank) AS {_q('_raw_' + c.name)}")
    if {"drift_norm", "drift_ratio", "w_norm"} <= names:
        # ‖W₀‖ of each shard (drift_ratio's denominator), recovered from drift_ratio = ‖W−W₀‖/‖W₀‖.
        ref = "CASE WHEN drift_norm = 0 THEN w_norm WHEN drift_ratio > 0 THEN drift_norm / drift_ratio END"
        agg.append(f"CASE WHEN count({ref}) < count(*) THEN NULL ELSE sqrt(sum(({ref}) * ({ref}))) END AS ref_norm")
    agg += ["min_by(time_us, rank) AS time_us",
            f"CASE WHEN {shards} THEN count(*) ELSE 1 END AS shards"]
    if gen:
        agg.append("max(generation) AS generation")
    # Of a rank's rows for a step, the latest process's (a replayed step): one window, over rank and step.
    latest = "max(generation) OVER (PARTITION BY run_id, role, rank, stage, step)" if gen else "NULL"
    pooled_sql = f"""
        WITH src AS (SELECT *, {latest} AS _latest FROM {source}
                     WHERE step IS NOT NULL AND tensor IS NOT NULL
                       AND (NOT coalesce(sharded, false) OR coalesce({rep}, 0) = 0)),
        p AS (SELECT run_id, role, stage, step, tensor, {', '.join(agg)} FROM src
              WHERE {"_latest IS NULL OR generation = _latest" if gen else "true"}
              GROUP BY run_id, role, stage, step, tensor)"""
    # A shard lost: fewer elements than the tensor's fullest step. Its statistics are NULL, what it is is kept.
    keep = {"tensor", "numel", "sharded", "shard", "replica", *(c.name for c in cols if c.reduce == "first")}
    partial = ("(sharded AND numel < max(numel) OVER (PARTITION BY run_id, role, tensor))"
               if "numel" in names else "false")
    out = ["run_id", "role", "step", "time_us", "stage"]
    for c in cols:
        n, raw = _q(c.name), _q("_raw_" + c.name)
        if c.ratio is not None and set(c.ratio) <= names | {"ref_norm"}:
            num, den = (_q(x) for x in c.ratio)
            expr = f"CASE WHEN NOT sharded THEN {raw} WHEN {den} > 0 THEN {num} / {den} END"
        elif c.frac_of is not None and c.frac_of in names:
            expr = f"CASE WHEN NOT sharded THEN {raw} WHEN numel > 0 THEN CAST({_q(c.frac_of)} AS DOUBLE) / numel END"
        elif c.ratio is not None or c.frac_of is not None:
            expr = raw
        else:
            expr = n
        out.append(n if expr == n and c.name in keep else
                   f"{expr} AS {n}" if c.name in keep else f"CASE WHEN {partial} THEN NULL ELSE {expr} END AS {n}")
    out += ["shards"] + (["generation"] if gen else [])
    return f"{pooled_sql}\n        SELECT {', '.join(out)} FROM p"
