"""A run written with store schema v1 (tests/fixtures/v1run, made by dynascope 0.1.0 before the v2 renames)
still opens: renamed columns read their v1 values under the new names, and compaction keeps them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dynascope import analyses, open_store
from dynascope.store.compact import compact_store
from dynascope.store.schema import RENAMED, SCHEMA_VERSION

FIXTURE = Path(__file__).parent / "fixtures" / "v1run"


@pytest.fixture
def v1run(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "v1run"))


def _raw(run: Path, table: str, column: str) -> list:
    """The v1 column as written, straight from the Parquet segments (the writer's, not the empty schema one)."""
    values = []
    for f in sorted((run / table).glob("writer=r0-*/*.parquet")):
        t = pq.read_table(f)
        values += t.column(column).to_pylist()
    return values


def test_fixture_is_v1_and_uses_the_old_names(v1run: Path) -> None:
    assert SCHEMA_VERSION == 3
    assert '"schema_version": 1' in (v1run / "dynascope.json").read_text()
    assert "dw_norm" in pq.read_schema(next((v1run / "tensor_stats").glob("writer=r0-*/*.parquet"))).names


@pytest.mark.parametrize("table", sorted(RENAMED))
def test_renamed_columns_read_their_v1_values(v1run: Path, table: str) -> None:
    with open_store(v1run) as con:
        for new, old in RENAMED[table].items():
            got = [r[0] for r in con.sql(f'SELECT "{new}" FROM {table} WHERE rank = 0 AND role = \'trainer\' '
                                         "ORDER BY ALL").fetchall()]
            want = sorted(_raw(v1run, table, old), key=lambda v: (v is None, v))
            assert got == want, (table, new)
            assert len(got) > 0 and any(v is not None for v in got), (table, new)


def test_v1_values_are_real_numbers(v1run: Path) -> None:
    with open_store(v1run) as con:
        (n, nonnull) = con.sql("SELECT count(*), count(update_norm) FROM tensor_stats").fetchall()[0]
        assert n == 16 and nonnull == 16  # 4 tensors × 4 steps, every statistic (memory_budget=None)
        assert con.sql("SELECT count(*) FROM events WHERE event = 'checkpoint_save'").fetchall() == [(1,)]
        assert con.sql("SELECT min(drift_norm) > 0 FROM spectra").fetchall() == [(True,)]
    sp = analyses.sparsity_over_training(v1run)
    assert sp.height > 0


def test_compaction_of_a_v1_run_keeps_renamed_values(v1run: Path) -> None:
    with open_store(v1run) as con:
        before = con.sql("SELECT step, tensor, update_norm, grad_nan_count FROM tensor_stats ORDER BY ALL").fetchall()
        ev_before = con.sql("SELECT event FROM events ORDER BY ALL").fetchall()
    stats = compact_store(v1run, grace_s=0, settle_s=0, wait=True, repair_after_s=0)
    assert stats.merged_segments >= 2  # the two events segments merge into one (via conform)
    with open_store(v1run) as con:
        assert con.sql("SELECT step, tensor, update_norm, grad_nan_count FROM tensor_stats ORDER BY ALL").fetchall() == before
        assert con.sql("SELECT event FROM events ORDER BY ALL").fetchall() == ev_before
