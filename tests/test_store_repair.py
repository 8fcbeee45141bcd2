"""Compaction repairs rollup segments a writer never wrote (killed between a tensor_stats segment and its
rollups, or its rollup writes failing until it closed), exactly once and never for a writer still at work."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from dynascope.cli import app
from dynascope.store import RunWriter, open_store
from dynascope.store import compact as compact_mod
from dynascope.store.compact import compact_store
from dynascope.store.layout import list_segments
from dynascope.store.repair import RepairResult
from dynascope.store.rollup import ROLLUP_TABLES

from helpers.rollup_reference import NAIVE, NAIVE_BY_LAYER, ROLLED_BY_LAYER
from helpers.rollup_reference import batch as _batch
from helpers.rollup_reference import same as _same

ROLLUPS = ("tensor_stats_by_kind", "tensor_stats_by_layer")
# tensor_stats_by_kind summed per group, in NAIVE's column order: a step may have rows in several segments.
POOLED_BY_KIND = """
    SELECT run_id, rank, role, step, stage, kind, max(time_us), sum(tensors), sum(numel), sum(w_sq), sum(update_sq),
           max(update_ratio_max), sum(changed_count), sum(changed_numel), sum(changed_rel_count),
           sum(changed_rel_numel), sum(sign_flip_count), sum(w_nan_count), sum(w_inf_count), sum(drift_sq), sum(drift_w_sq),
           sum(drift_changed_count), sum(drift_numel), sum(grad_sq), max(grad_max_abs), sum(grad_zero_count),
           sum(grad_near_zero_count), sum(grad_numel), sum(grad_nan_count), sum(grad_inf_count)
    FROM tensor_stats_by_kind GROUP BY ALL ORDER BY ALL"""
STEPS = 10


def write_run(run: Path, fail_rollups_from: dict[int, int] | None = None) -> None:
    """Two ranks, one flush per step (so one segment per step); rank r's rollup writes fail from step
    ``fail_rollups_from[r]`` until it closes, as when a rollup write keeps failing until the process ends."""
    rng = np.random.default_rng(0)
    for rank in (0, 1):
        w = RunWriter(run, rank=rank, world_size=2, flush_secs=3600)
        real, failing = w._write_segment, [False]
        w._write_segment = lambda table, arrow, real=real, failing=failing: (
            False if failing[0] and table in ROLLUP_TABLES else real(table, arrow))
        for step in range(STEPS):
            failing[0] = step >= (fail_rollups_from or {}).get(rank, STEPS)
            w.append("tensor_stats", _batch(rng, step, 11, with_drift=step >= 4))
            w.flush()
        w.close()


def drop_rollups_of(run: Path, rank: int, step: int) -> None:
    """Delete the rollup segments of one source segment: what a writer killed between them leaves."""
    (wdir, segs), = [(w, s) for w, s in list_segments(run, "tensor_stats").items() if w.name.startswith(f"writer=r{rank}")]
    seq = segs[step][0]  # sources are seq s, their rollups s+1 (by kind) and s+2 (by layer)
    for k, table in enumerate(ROLLUPS, start=1):
        (run / table / wdir.name / f"{seq + k:012d}-{seq + k:012d}.parquet").unlink()


def age(run: Path, seconds: float = 3600.0) -> None:
    """Every file of the run (segments, heartbeats) last touched ``seconds`` ago: the writers are long gone."""
    past = time.time() - seconds
    for p in run.rglob("*"):
        os.utime(p, (past, past))


def pooled(run: Path) -> dict[str, tuple[list, list]]:
    """(rollup pooled over the store, the same pooling by SQL from tensor_stats) per rollup."""
    with open_store(run) as s:
        sql = s.sql
        return {"tensor_stats_by_kind": (sql(POOLED_BY_KIND).fetchall(), sql(NAIVE).fetchall()),
                "tensor_stats_by_layer": (sql(ROLLED_BY_LAYER).fetchall(), sql(NAIVE_BY_LAYER).fetchall())}


def rolled_rows(run: Path) -> dict[str, int]:
    """Source rows each rollup accounts for (its ``tensors``), and tensor_stats' own row count."""
    with open_store(run) as s:
        return {t: s.sql(f"SELECT coalesce(sum({'tensors' if t != 'tensor_stats' else 1}), 0) FROM {t}")
                .fetchall()[0][0] for t in ("tensor_stats", *ROLLUPS)}


def assert_same(got: list, want: list, table: str) -> None:
    """Row for row, floats to 1e-12 (DuckDB sums in whatever order its threads meet the rows)."""
    assert len(got) == len(want) > 0, table
    for g, x in zip(got, want, strict=True):
        assert all(_same(a, b) for a, b in zip(g, x, strict=True)), (table, g, x)


def assert_exact(run: Path) -> None:
    for table, (got, want) in pooled(run).items():
        assert_same(got, want, table)


def compact(run: Path, **kw):
    return compact_store(run, grace_s=0.0, settle_s=0.05, wait=True, **kw)


def test_killed_and_failing_writers_are_repaired_exactly_once(tmp_path):
    run = tmp_path / "r"
    write_run(run, fail_rollups_from={0: 8})  # rank 0: steps 8 and 9 never rolled up
    drop_rollups_of(run, rank=1, step=4)  # rank 1: killed between step 4's source and its rollups
    counts = rolled_rows(run)
    assert counts == {"tensor_stats": 2 * STEPS * 11, "tensor_stats_by_kind": (2 * STEPS - 3) * 11,
                      "tensor_stats_by_layer": (2 * STEPS - 3) * 11}  # short before the repair
    assert all(got != want for got, want in pooled(run).values())
    age(run)
    stats = compact(run)
    assert stats.skipped == []
    assert stats.repaired_segments == 3 * 2  # three sources, two rollups each
    assert stats.new_segments > 0  # and merged afterwards
    assert set(rolled_rows(run).values()) == {2 * STEPS * 11}
    assert_exact(run)
    before = pooled(run)
    again = compact(run)  # idempotent: nothing left to repair, the totals do not move
    assert (again.repaired_segments, again.skipped) == (0, [])
    for table, (got, _) in pooled(run).items():
        assert_same(got, before[table][0], table)
    age(run)
    assert compact(run).repaired_segments == 0


def test_a_rollup_the_writer_wrote_late_is_not_repaired_again(tmp_path):
    """Rollup writes failing for a while, then retried by the writer itself at later sequence numbers."""
    run = tmp_path / "r"
    rng = np.random.default_rng(1)
    w = RunWriter(run, flush_secs=3600)
    real, failing = w._write_segment, [False]
    w._write_segment = lambda table, arrow: False if failing[0] and table in ROLLUP_TABLES else real(table, arrow)
    for step in range(6):
        failing[0] = step in (2, 3)
        w.append("tensor_stats", _batch(rng, step, 7, with_drift=False))
        w.flush()
    w.close()
    age(run)
    stats = compact(run)
    assert (stats.repaired_segments, stats.skipped) == (0, [])
    assert_exact(run)


def test_fresh_sources_and_live_writers_are_left_alone_and_not_merged(tmp_path):
    run = tmp_path / "r"
    write_run(run, fail_rollups_from={0: 9, 1: 9})
    age(run)
    (fresh,) = [s[2] for w, segs in list_segments(run, "tensor_stats").items() if w.name.startswith("writer=r0")
                for s in segs[-1:]]
    os.utime(fresh)  # rank 0's last source was just written: its writer may still write the rollups
    heartbeat = next((run / "_writers").glob("r1-*.json"))
    os.utime(heartbeat)  # rank 1's writer is alive: it retries failed rollups at every flush
    stats = compact(run)
    assert stats.repaired_segments == 0
    assert len(stats.skipped) == 4 and all("has no tensor_stats_by_" in line for line in stats.skipped)
    assert any(fresh.name in line and "writer=r0" in line for line in stats.skipped)
    for table in ("tensor_stats", *ROLLUPS):  # not merged: a merge would join rollups across the gap
        assert all(".v" not in s[2].name for segs in list_segments(run, table).values() for s in segs), table
    assert not (run / "tensor_stats_by_kind" / fresh.parent.name / fresh.name).exists()
    assert rolled_rows(run)["tensor_stats_by_kind"] == 2 * (STEPS - 1) * 11
    age(run)  # both writers are gone now
    stats = compact(run)
    assert (stats.repaired_segments, stats.skipped) == (4, [])
    assert_exact(run)


def test_a_corrupt_source_is_named_and_the_other_writers_are_still_repaired(tmp_path):
    run = tmp_path / "r"
    write_run(run, fail_rollups_from={0: 9, 1: 9})
    (bad,) = [segs[3][2] for w, segs in list_segments(run, "tensor_stats").items() if w.name.startswith("writer=r0")]
    bad.write_bytes(b"not parquet at all")
    age(run)
    stats = compact(run)
    assert stats.repaired_segments == 2  # rank 1's last source, both rollups
    assert any(f"{bad.parent}: rollups not checked: {bad.name}: corrupt segment" in line for line in stats.skipped)
    assert all("\n" not in line for line in stats.skipped)


def test_a_merged_source_partly_rolled_up_is_reported_not_guessed(tmp_path, monkeypatch):
    """A store compacted by a dynascope without the repair: the gap is inside a merged segment now."""
    run = tmp_path / "r"
    write_run(run)
    drop_rollups_of(run, rank=0, step=4)
    age(run)
    with monkeypatch.context() as m:
        m.setattr(compact_mod, "repair_rollups", lambda run_dir, after: RepairResult())
        m.setattr(compact_mod, "done_writers", lambda run_dir, quiet_s: {})  # nor folding across writers
        compact(run)
    before = rolled_rows(run)
    stats = compact(run)
    assert stats.repaired_segments == 0
    lines = [line for line in stats.skipped if "writer=r0" in line]
    assert len(lines) == 2 and all("is only partly rolled up" in line and ".v" in line and "not repaired" in line
                                   for line in lines)
    assert not any("writer=r1" in line for line in stats.skipped)
    assert rolled_rows(run) == before


def test_a_merged_source_with_no_rollup_at_all_is_repaired_under_its_name(tmp_path, monkeypatch):
    run = tmp_path / "r"
    write_run(run, fail_rollups_from={0: 0})  # rank 0 never wrote a rollup; rank 1 did
    age(run)
    with monkeypatch.context() as m:
        m.setattr(compact_mod, "repair_rollups", lambda run_dir, after: RepairResult())
        m.setattr(compact_mod, "done_writers", lambda run_dir, quiet_s: {})  # nor folding across writers
        compact(run)  # merged by a dynascope without the repair
    (merged,) = [s[2] for w, segs in list_segments(run, "tensor_stats").items() if w.name.startswith("writer=r0")
                 for s in segs]
    assert ".v" in merged.name
    age(run)
    stats = compact(run)
    assert (stats.repaired_segments, stats.skipped) == (2, [])
    for table in ROLLUPS:
        assert (run / table / merged.parent.name / merged.name).exists()
    assert_exact(run)


def test_a_run_written_before_its_rollups_existed_is_left_to_the_fallback(tmp_path):
    run = tmp_path / "r"
    write_run(run)
    for table in ROLLUPS:
        for wdir in (run / table).glob("writer=r*"):
            for f in wdir.iterdir():
                f.unlink()
    age(run)
    stats = compact(run)
    assert (stats.repaired_segments, stats.skipped) == (0, [])
    assert rolled_rows(run)["tensor_stats_by_kind"] == 0


def test_cli_compact_prints_the_repaired_count(tmp_path):
    run = tmp_path / "r"
    write_run(run, fail_rollups_from={1: 9})
    age(run)
    out = CliRunner().invoke(app, ["compact", str(run), "--grace-s", "0", "--settle-s", "0.05", "--wait"])
    assert out.exit_code == 0, out.output
    assert "repaired 2 missing rollup segments" in out.stdout
    assert_exact(run)
