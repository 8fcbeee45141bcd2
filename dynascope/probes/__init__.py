"""Trainer-side probes: ``watch()`` attaches them; one probe per module (see DEVELOPERS.md)."""

from dynascope.probes.schedule import as_schedule, every, log_spaced, never
from dynascope.probes.scope import Scope, watch
from dynascope.probes.update_stats import UPDATE_STAT_COLUMNS, weight_update_stats

__all__ = ["UPDATE_STAT_COLUMNS", "Scope", "as_schedule", "every", "log_spaced", "never", "watch",
           "weight_update_stats"]
