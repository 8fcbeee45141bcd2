"""Live alert rules over a run's store: ``Rule``, the defaults, the monitor that evaluates them.

``Monitor`` and ``Firing`` are imported on first use: they read the store through the analyses, which a
``dynascope.watch`` without ``alerts=`` should not pay for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynascope.alerts.rules import ACTIONS, DEFAULT_RULES, Rule, load_rules, rules_from

if TYPE_CHECKING:
    from dynascope.alerts.monitor import Firing, Monitor

__all__ = ["ACTIONS", "DEFAULT_RULES", "Firing", "Monitor", "Rule", "load_rules", "rules_from"]


def __getattr__(name: str) -> Any:
    if name in ("Firing", "Monitor"):
        from dynascope.alerts import monitor

        return getattr(monitor, name)
    raise AttributeError(f"module 'dynascope.alerts' has no attribute {name!r}")
