"""The demo's closing "Slowest rank" line: a flagged rank is named with how much slower it is; when no rank
is flagged the line says none stands out instead of calling a rank "1.0× slower"."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from dynascope import analyses, open_store
from dynascope.demo.report import slowest_rank_sentence

from helpers.planted_timings import plant


def _line(run: Path) -> tuple[str, set[str]]:
    with open_store(run) as con:
        scores = analyses.straggler_scores(con)
    console = Console(record=True, width=400)
    worst = max(scores.iter_rows(named=True), key=lambda r: (r["median_ms"] - r["cross_rank_median_ms"]) * r["steps"])
    console.print(slowest_rank_sentence(worst))
    return console.export_text().strip(), set(scores["status"])


def test_even_ranks_stand_out_in_nothing(tmp_path):
    plant(tmp_path / "even", ranks=2)
    line, statuses = _line(tmp_path / "even")
    assert statuses == {"ok"}
    assert line.startswith("Slowest rank: none stands out") and "slower" not in line, line


def test_a_slow_rank_is_named(tmp_path):
    plant(tmp_path / "slow", ranks=3, slow={1: 3.0})
    line, statuses = _line(tmp_path / "slow")
    assert "persistent" in statuses
    assert line.startswith("Slowest rank: rank 1 ") and "× slower" in line and "persistent" in line, line
