"""A writer whose clock runs ahead of the reader's: its flushes are visible at once to a read of the
present (within ``MAX_CLOCK_SKEW_US``), while a read at a given moment and compaction's settle rule stay exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynascope.core.clock import now_us
from dynascope.store import RunWriter, live_files, open_store
from dynascope.store.live import MAX_CLOCK_SKEW_US

AHEAD_US = 30_000_000  # NTP skew across nodes: seconds are common, 30 s is a badly kept host


@pytest.fixture
def ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    real = now_us
    monkeypatch.setattr("dynascope.store.flush.now_us", lambda: real() + AHEAD_US)  # the commit record's clock


def test_rows_of_a_writer_ahead_are_visible_at_once(tmp_path: Path, ahead: None) -> None:
    assert AHEAD_US < MAX_CLOCK_SKEW_US
    w = RunWriter(tmp_path / "run", flush_secs=3600)
    w.append("scalars", {"step": list(range(10)), "key": "loss", "value": 1.0, "time_us": 1})
    w.flush()
    with open_store(tmp_path / "run") as store:
        assert store.rows("SELECT count(*) FROM scalars") == [(10,)]
    # the files Spark/Trino get agree: the writer's segment beside the empty schema file
    assert [f for f in live_files(tmp_path / "run", "scalars") if "writer=_schema" not in f] != []
    with open_store(tmp_path / "run", at_us=now_us()) as store:  # the store as it was at a moment: exact
        assert store.rows("SELECT count(*) FROM scalars") == [(0,)]
    w.close()
