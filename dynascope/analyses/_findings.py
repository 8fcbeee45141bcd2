"""What every finding is made of, shared by the modules that raise findings (``findings``,
``findings_dynamics``): the ``Finding`` record and how one is built from its numbers."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from dynascope.analyses._common import frame
from dynascope.analyses.findings_text import sentence


@dataclass
class Finding:
    """One finding: a sentence, the time at stake, the numbers behind it and a query that shows them."""

    run_id: str
    finding: str
    severity: str
    sentence: str
    at_stake_ms: float = 0.0
    at_stake_pct: float | None = None
    numbers: dict[str, Any] = field(default_factory=dict)
    sql: str = ""


def found(run: str, finding: str, severity: str, numbers: dict[str, Any], sql: str, at_stake_ms: float = 0.0,
           at_stake_pct: float | None = None) -> Finding:
    """A finding whose sentence is written from ``numbers``, with its SQL on one line."""
    sql = re.sub(r"\s*\n\s*", " ", sql).strip()  # one line: the analyses' SQL blocks are indented for reading
    return Finding(run, finding, severity, sentence(finding, numbers), at_stake_ms, at_stake_pct, numbers, sql)


def rnd(x: Any, nd: int = 3) -> Any:
    """A float for a finding's numbers: ``nd`` decimals, or more where it takes them to keep six significant
    digits, so that the sentence's figure, formatted from it, is the one its SQL's value formats to (rounding
    twice, 3.0549 → 3.05 → "3.0%", would not be); None, bools, strings and ints as they are."""
    if x is None or isinstance(x, (bool, str, int)):
        return x
    v = float(x)
    if v == 0 or not math.isfinite(v):
        return v
    return round(v, max(nd, 5 - math.floor(math.log10(abs(v)))))


def first_row(con, sql: str) -> dict[str, Any]:
    """The first row of a query as a dict (empty when it returns none)."""
    rows = frame(con, sql)
    return rows.row(0, named=True) if rows.height else {}
