"""A table read once into the connection (``StoreConnection.pin``): the same rows as its view, one moment of
the store, and the same report as a reader that lists and opens the live files at every query."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dynascope.core.clock import now_us
from dynascope.report import PINNED, render_run
from dynascope.store import RunWriter, open_store, reader

from helpers.fleet_runs import write_step

RANKS, STEPS = 3, 8


@pytest.fixture
def live(tmp_path: Path):
    """A live run: its writers open, each step flushed (a segment a table and writer), a journal writer too."""
    run = tmp_path / "run"
    writers = [RunWriter(run, rank=r, world_size=RANKS, flush_secs=3600, seal_secs=3600 if r == 0 else None)
               for r in range(RANKS)]
    rng, t = np.random.default_rng(0), now_us() - 3_600_000_000
    for step in range(1, STEPS + 1):
        write_step(writers, rng, step, STEPS, t, 1.5)
        t += 2_000_000
        for w in writers:
            w.flush()
    yield run, writers, rng, t
    for w in writers:
        w.close()


def _all(con, table: str) -> list[tuple]:
    return sorted(con.rows(f"SELECT * FROM {table}"), key=repr)


def test_a_pinned_table_reads_the_rows_of_its_view_at_one_moment(live) -> None:
    run, writers, rng, t = live
    views, pinned = open_store(run), open_store(run)
    assert pinned.pin(PINNED, min_files=10**9) == []  # few files: every table stays a view
    got = pinned.pin(PINNED, min_files=1)
    assert {"runs", "timings", "scalars", "events"} <= set(got) <= set(PINNED)
    for table in got:
        assert _all(pinned, table) == _all(views, table), table
    before = pinned.rows("SELECT count(*) FROM timings")[0][0]
    write_step(writers, rng, STEPS + 1, STEPS + 1, t, 1.5)
    for w in writers:
        w.flush()
    assert pinned.rows("SELECT count(*) FROM timings")[0][0] == before  # the moment it was pinned
    assert views.rows("SELECT count(*) FROM timings")[0][0] > before  # a view reads the flush
    # a query over a pinned and a listed table: the listed one is still bound for each query
    assert pinned.rows("SELECT (SELECT count(*) FROM timings), (SELECT count(*) FROM tensor_stats)")[0][1] == \
        views.rows("SELECT count(*) FROM tensor_stats")[0][0]


def test_the_report_is_the_same_read_once_or_at_every_query(live, monkeypatch: pytest.MonkeyPatch) -> None:
    run = live[0]
    monkeypatch.setattr(reader, "PIN_MIN_FILES", 10**9)
    per_query = render_run(run)
    monkeypatch.setattr(reader, "PIN_MIN_FILES", 1)
    pins: list[list[str]] = []
    real = reader.StoreConnection.pin
    monkeypatch.setattr(reader.StoreConnection, "pin", lambda self, *a, **k: pins.append(real(self, *a, **k)) or pins[-1])
    assert render_run(run) == per_query
    assert pins and "timings" in pins[0]  # the second report did read its tables once
