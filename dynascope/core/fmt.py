"""How durations and shares read on every screen: the report, the demo, the dashboard and the CLI.

One helper per kind of number, so a quantity shown in two places reads the same in both. A duration keeps
three significant digits whatever its size (0.109 ms, 85.4 ms, 12.3 s): rounding to whole milliseconds
made a 0.1 ms sync read "0 ms".
"""

from __future__ import annotations

import math

__all__ = ["fmt_ms", "fmt_pct", "significant"]


def significant(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits in fixed-point notation, trailing zeros dropped; a number with
    more digits before the point keeps them all (98765, never 9.88e+04)."""
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    text = f"{x:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


# (unit, milliseconds per unit, the unit's upper bound in its own unit): a value moves to the next unit
# once it would read as this bound or more.
_UNITS = (("ms", 1.0, 1000.0), ("s", 1e3, 120.0), ("min", 6e4, 120.0), ("h", 3.6e6, math.inf))


def fmt_ms(ms: float | None, digits: int = 3) -> str:
    """A duration given in milliseconds: '0.109 ms', '850 ms', '12.3 s', '4.2 min', '3.05 h'; '—' if unknown."""
    if ms is None or not math.isfinite(ms):
        return "—"
    if ms == 0:
        return "0 ms"
    for unit, scale, bound in _UNITS:
        value = ms / scale
        text = significant(value, digits)
        if abs(float(text)) < bound:
            return f"{text} {unit}"
    raise AssertionError("unreachable: the last unit has no bound")


def fmt_pct(pct: float | None) -> str:
    """A share given in percent: no decimal from 10%, one below, two significant digits below 1%."""
    if pct is None or not math.isfinite(pct):
        return "—"
    a = abs(pct)
    if a >= 9.95:
        return f"{pct:.0f}%"
    if a == 0:
        return "0%"
    if a >= 0.995:
        return f"{pct:.1f}%"
    return f"{significant(pct, 2)}%"
