"""Trainer-side probes: ``watch()`` composes them behind one protocol (``protocol.Probe``); see DEVELOPERS.md."""

from dynascope.probes.attach import watch
from dynascope.probes.protocol import Probe, StepContext
from dynascope.probes.schedule import as_schedule, every, log_spaced, never
from dynascope.probes.scope import Scope
from dynascope.probes.settings import WatchSettings
from dynascope.stats.engine import (
    DRIFT_STAT_COLUMNS,
    UPDATE_STAT_COLUMNS,
    weight_drift_stats,
    weight_update_stats,
)

__all__ = ["DRIFT_STAT_COLUMNS", "UPDATE_STAT_COLUMNS", "Probe", "Scope", "StepContext", "WatchSettings",
           "as_schedule", "every", "log_spaced", "never", "watch", "weight_drift_stats", "weight_update_stats"]
