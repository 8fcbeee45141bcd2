"""Live alert rules over a run's store: ``Rule``, the defaults, the monitor that evaluates them."""

from dynascope.alerts.monitor import Firing, Monitor
from dynascope.alerts.rules import ACTIONS, DEFAULT_RULES, Rule, load_rules, rules_from

__all__ = ["ACTIONS", "DEFAULT_RULES", "Firing", "Monitor", "Rule", "load_rules", "rules_from"]
