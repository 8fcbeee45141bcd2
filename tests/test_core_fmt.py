"""How durations and shares read on every surface (``dynascope.core.fmt``), and the probe phase's name the
analyses use (they cannot import the probe that writes it)."""

from __future__ import annotations

import pytest

from dynascope.analyses.probe_time import PROBE_PHASE as ANALYSED
from dynascope.core.fmt import fmt_ms, fmt_pct, significant
from dynascope.probes.timing import PROBE_PHASE


@pytest.mark.parametrize(("ms", "text"), [
    (0, "0 ms"), (0.109, "0.109 ms"), (0.175, "0.175 ms"), (0.0001234, "0.000123 ms"), (85.04, "85 ms"),
    (85.46, "85.5 ms"), (850.3, "850 ms"), (999.7, "1 s"), (1234, "1.23 s"), (12_345, "12.3 s"),
    (150_000, "2.5 min"), (7_300_000, "2.03 h"), (-5.5, "-5.5 ms"), (None, "—"), (float("nan"), "—")])
def test_durations_keep_three_significant_digits(ms, text):
    assert fmt_ms(ms) == text


@pytest.mark.parametrize(("pct", "text"), [
    (0, "0%"), (0.0123, "0.012%"), (0.812, "0.81%"), (0.996, "1.0%"), (5.25, "5.2%"), (9.96, "10%"),
    (25.91, "26%"), (100, "100%"), (None, "—")])
def test_shares_read_by_size(pct, text):
    assert fmt_pct(pct) == text


def test_significant_matches_python_rounding():
    for x in (0.000123456, 1.0, 12.3456, 987.654, 0.5, 3.14159, -2.71828):
        assert float(significant(x, 3)) == float(f"{x:.3g}")
    assert significant(98765.4321, 3) == "98765"  # whole digits are kept, in fixed point


def test_analyses_name_the_probe_phase_as_the_probe_writes_it():
    assert ANALYSED == PROBE_PHASE
