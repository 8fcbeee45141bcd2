"""How ``tensor_stats`` rows of several ranks pool into one per tensor: the rule every reader calls.

A rank's row describes what that rank holds of the tensor:

* a **shard** (``sharded``: FSDP2, HSDP, tensor parallel, ZeRO): the pieces of one replica make the whole
  tensor, so their rows combine (sums, roots of summed squares, maxima, as each column declares);
* a **replica** of a shard (HSDP's replicate dimension, ``replica`` > 0): a copy of what replica 0
  holds, so it never counts;
* a **whole** tensor (DDP, a replicated TP bias, one process): every rank holds the same values, so the
  lowest rank's row stands for it.

``counted_sql`` is that rule as a SQL condition; ``combine_shards`` (Python) and the SQL readers all use it,
so a reader never sums a replica as if it were a shard.
"""

from __future__ import annotations

__all__ = ["COUNTED_SHARD_SQL", "NOT_A_REPLICA_SQL", "counted_sql", "is_counted_shard"]

# A shard row that counts: of replica 0 (or of no replica group: NULL, runs written before it was recorded).
COUNTED_SHARD_SQL = "(coalesce(sharded, false) AND coalesce(replica, 0) = 0)"
# Every row but a replica's copy of a shard (whole tensors' rows stay, one per rank).
NOT_A_REPLICA_SQL = "(NOT coalesce(sharded, false) OR coalesce(replica, 0) = 0)"


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
