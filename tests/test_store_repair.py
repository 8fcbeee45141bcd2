"""A source segment and its rollups count together: one commit record per flush makes them atomic, so a
writer killed mid-flush or failing to write its rollups leaves the rollups exact with no repair. Runs
written before commit records get their rollups rebuilt from their sources when they do not account for
every source row (no guessing which rows are missing), once their writers are quiet."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dynascope.cli import app
from dynascope.store import RunWriter, open_store
from dynascope.store import flush as flush_mod
from dynascope.store.compact import compact_store
from dynascope.store.layout import COMMITS, list_segments

from helpers.as_written import as_written  # noqa: F401 - the fixture pytestmark names
from helpers.rollup_reference import NAIVE, NAIVE_BY_LAYER, ROLLED_BY_LAYER
from helpers.rollup_reference import batch as _batch
from helpers.rollup_reference import same as _same

pytestmark = pytest.mark.usefixtures("as_written")  # compaction's input: runs as written

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


def write_run(run: Path) -> None:
    """Two ranks, one flush per step (so one tensor_stats segment per step)."""
    rng = np.random.default_rng(0)
    for rank in (0, 1):
        w = RunWriter(run, rank=rank, world_size=2, flush_secs=3600)
        for step in range(STEPS):
            w.append("tensor_stats", _batch(rng, step, 11, with_drift=step >= 4))
            w.flush()
        w.close()


def legacy(run: Path) -> None:
    """The run as a dynascope without commit records wrote it: no ``_commits``, every segment counts."""
    shutil.rmtree(run / COMMITS)


def drop_rollups_of(run: Path, rank: int, step: int) -> None:
    """Delete the rollup segments of one source segment: what a writer without commit records, killed
    between them, leaves."""
    (wdir, segs), = [(w, s) for w, s in list_segments(run, "tensor_stats").items() if w.name.startswith(f"writer=r{rank}")]
    seq = segs[step][0]  # a flush's segments are numbered source s, its rollups s+1 (by kind) and s+2 (by layer)
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


def test_failing_rollup_writes_hold_back_their_source_until_both_are_written(tmp_path, monkeypatch):
    run = tmp_path / "r"
    real, failing = flush_mod.write_parquet, [False]

    def write_parquet(arrow, path, compression="auto"):
        if failing[0] and "tensors" in arrow.column_names:  # a rollup segment: the disk refuses it
            raise OSError("No space left on device")
        real(arrow, path, compression)

    monkeypatch.setattr(flush_mod, "write_parquet", write_parquet)
    rng = np.random.default_rng(1)
    w = RunWriter(run, flush_secs=3600)
    for step in range(6):
        failing[0] = step in (2, 3)
        w.append("tensor_stats", _batch(rng, step, 7, with_drift=False))
        w.flush()
        counts = rolled_rows(run)
        assert counts["tensor_stats"] == counts["tensor_stats_by_kind"] == counts["tensor_stats_by_layer"]
        assert counts["tensor_stats"] == (2 if step in (2, 3) else step + 1) * 7  # held back, then written
    w.close()
    # step 2's group fails, then again at step 3 (retried as encoded) beside step 3's own: three failed writes
    assert w.write_errors == 3 and w.rows_dropped == 0
    assert_exact(run)
    assert leftover_tmp(run) == []
    age(run)
    assert (compact(run).repaired_segments, compact(run).skipped) == (0, [])
    assert_exact(run)


KILLED = textwrap.dedent("""
    import os, sys
    import numpy as np
    sys.path.insert(0, sys.argv[3])
    from helpers.rollup_reference import batch as _batch
    from dynascope.store import RunWriter, flush
    run, where = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(0)
    w = RunWriter(run, flush_secs=3600)
    for step in range(3):
        w.append("tensor_stats", _batch(rng, step, 5, with_drift=False))
        w.flush()
    real_replace, renamed = os.replace, []
    def replace(src, dst):
        real_replace(src, dst)
        renamed.append(dst)
        if where == "between" and len(renamed) == 1:
            os._exit(9)  # killed between the source segment and its rollups
    flush.os.replace = replace
    if where == "before-commit":
        flush._write_commit = lambda *a: os._exit(9)  # killed after every segment, before the commit record
    w.append("tensor_stats", _batch(rng, 3, 5, with_drift=False))
    w.flush()
""")


def test_a_writer_killed_mid_flush_leaves_the_whole_flush_or_none(tmp_path):
    for where in ("between", "before-commit"):
        run = tmp_path / where
        proc = subprocess.run([sys.executable, "-c", KILLED, str(run), where, str(Path(__file__).parent)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 9, proc.stderr
        on_disk = sum(1 for _ in (run / "tensor_stats").glob("writer=r0-*/*.parquet"))
        assert on_disk == 4  # 3 flushes + the killed flush's source segment (not committed)
        assert rolled_rows(run) == {"tensor_stats": 15, "tensor_stats_by_kind": 15, "tensor_stats_by_layer": 15}
        assert_exact(run)
        age(run)
        stats = compact(run)
        assert (stats.repaired_segments, stats.skipped) == (0, [])
        assert rolled_rows(run) == {"tensor_stats": 15, "tensor_stats_by_kind": 15, "tensor_stats_by_layer": 15}
        left = [p.name for p in (run / "tensor_stats").glob("writer=r0-*/*.parquet")]
        assert len(left) == 1 and ".v" in left[0]  # merged; the uncommitted segment was removed
        assert_exact(run)


def leftover_tmp(run: Path) -> list[str]:
    return [p.name for p in run.rglob("*.tmp")]


def test_a_run_without_commit_records_gets_its_rollups_rebuilt_exactly_once(tmp_path):
    run = tmp_path / "r"
    write_run(run)
    legacy(run)
    drop_rollups_of(run, rank=1, step=4)  # killed between step 4's source and its rollups
    drop_rollups_of(run, rank=0, step=8)
    drop_rollups_of(run, rank=0, step=9)
    counts = rolled_rows(run)
    assert counts == {"tensor_stats": 2 * STEPS * 11, "tensor_stats_by_kind": (2 * STEPS - 3) * 11,
                      "tensor_stats_by_layer": (2 * STEPS - 3) * 11}  # short before the repair
    assert all(got != want for got, want in pooled(run).values())
    age(run)
    stats = compact(run)
    assert stats.skipped == []
    assert stats.repaired_segments == 2 * 2  # two writers, two rollups each
    assert stats.new_segments > 0  # and merged afterwards
    assert set(rolled_rows(run).values()) == {2 * STEPS * 11}
    assert_exact(run)
    before = pooled(run)
    again = compact(run)  # idempotent: nothing left to rebuild, the totals do not move
    assert (again.repaired_segments, again.skipped) == (0, [])
    for table, (got, _) in pooled(run).items():
        assert_same(got, before[table][0], table)


def test_a_merged_source_partly_rolled_up_is_rebuilt_not_guessed(tmp_path):
    """The gap is inside a merged segment: which rows are missing cannot be told, so all are rolled again."""
    run = tmp_path / "r"
    write_run(run)
    legacy(run)
    drop_rollups_of(run, rank=0, step=4)
    compact(run, repair_after_s=3600)  # writers fresh: merged, not rebuilt
    assert all(".v" in s[2].name for w, segs in list_segments(run, "tensor_stats").items()
               if w.name.startswith("writer=r0") for s in segs)
    assert rolled_rows(run)["tensor_stats_by_kind"] == (2 * STEPS - 1) * 11
    age(run)
    stats = compact(run)
    assert (stats.repaired_segments, stats.skipped) == (2, [])
    assert_exact(run)


def test_fresh_writers_are_rebuilt_only_once_quiet(tmp_path):
    run = tmp_path / "r"
    write_run(run)
    legacy(run)
    drop_rollups_of(run, rank=0, step=9)
    age(run)
    os.utime(next((run / "_writers").glob("r0-*.json")))  # rank 0's writer is alive
    stats = compact(run)
    assert stats.repaired_segments == 0
    assert len(stats.skipped) == 2 and all("rebuilt once the writer is quiet" in line for line in stats.skipped)
    age(run)
    stats = compact(run)
    assert (stats.repaired_segments, stats.skipped) == (2, [])
    assert_exact(run)


def test_a_corrupt_source_is_named_and_the_other_writers_are_still_rebuilt(tmp_path):
    run = tmp_path / "r"
    write_run(run)
    legacy(run)
    drop_rollups_of(run, rank=1, step=9)
    (bad,) = [segs[3][2] for w, segs in list_segments(run, "tensor_stats").items() if w.name.startswith("writer=r0")]
    bad.write_bytes(b"not parquet at all")
    age(run)
    stats = compact(run)
    assert stats.repaired_segments == 2  # rank 1, both rollups
    assert any(f"{bad.parent}: rollups not checked: {bad.name}: corrupt segment" in line for line in stats.skipped)
    assert all("\n" not in line for line in stats.skipped)


def test_a_run_written_before_its_rollups_existed_is_left_to_the_fallback(tmp_path):
    run = tmp_path / "r"
    write_run(run)
    legacy(run)
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
    write_run(run)
    legacy(run)
    drop_rollups_of(run, rank=1, step=2)
    age(run)
    out = CliRunner().invoke(app, ["compact", str(run), "--grace-s", "0", "--settle-s", "0.05", "--wait"])
    assert out.exit_code == 0, out.output
    assert "repaired 2 missing rollup segments" in out.stdout
    assert_exact(run)
