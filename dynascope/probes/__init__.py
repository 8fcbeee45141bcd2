"""Trainer-side probes: ``watch()`` composes them behind one protocol (``protocol.Probe``); see DEVELOPERS.md."""

from dynascope.probes.protocol import Probe, StepContext, register_listener
from dynascope.probes.schedule import as_schedule, every, log_spaced, never
from dynascope.probes.scope import Scope, watch
from dynascope.probes.update_stats import (
    DRIFT_STAT_COLUMNS,
    UPDATE_STAT_COLUMNS,
    weight_drift_stats,
    weight_update_stats,
)

__all__ = ["DRIFT_STAT_COLUMNS", "UPDATE_STAT_COLUMNS", "Probe", "Scope", "StepContext", "as_schedule", "every",
           "log_spaced", "never", "register_listener", "watch", "weight_drift_stats", "weight_update_stats"]
