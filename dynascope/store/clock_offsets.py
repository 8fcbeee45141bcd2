"""Each (run, role, rank)'s measured wall-clock offset from its reference rank: the one rule every reader of
the ``clock_offset`` events uses (``probes.clocks`` records them; the Perfetto export aligns tracks by them,
``analyses.clocks`` and the report show them).

A rank measured more than once (a restarted process measures again) counts its latest measurement: the
later process's clock is the one its later rows carry.
"""

from __future__ import annotations

__all__ = ["OFFSETS_SQL"]

OFFSETS_SQL = """
SELECT run_id, role, rank, arg_max(offset_us, time_us) AS offset_us, arg_max(spread_us, time_us) AS spread_us,
       arg_max(reference_rank, time_us) AS reference_rank
FROM (SELECT run_id, role, rank, time_us,
             TRY_CAST(json_extract_string(fields_json, '$.offset_us') AS DOUBLE) AS offset_us,
             TRY_CAST(json_extract_string(fields_json, '$.spread_us') AS DOUBLE) AS spread_us,
             TRY_CAST(json_extract_string(fields_json, '$.reference_rank') AS BIGINT) AS reference_rank
      FROM events WHERE event = 'clock_offset')
WHERE offset_us IS NOT NULL AND rank IS NOT NULL
GROUP BY run_id, role, rank
"""
