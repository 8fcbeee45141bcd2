"""dynascope: see what happens inside LLM training.

    scope = dynascope.watch(model, optimizer, run="runs/x")   # probes: ΔW, gradients, phase timings
    con = dynascope.open_store("runs/x")                       # DuckDB views over the run's tables

Importing any part of the package runs this file first, so it imports only ``core.version``: ``open_store``
comes from the store (DuckDB, pyarrow) and ``watch``, ``Scope`` and ``WatchSettings`` from the probes
(torch) when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynascope.core.version import __version__

if TYPE_CHECKING:
    from dynascope.alerts.attach import watch
    from dynascope.probes.scope import Scope
    from dynascope.probes.settings import WatchSettings
    from dynascope.store import open_store


def __getattr__(name: str) -> Any:
    if name == "open_store":
        from dynascope.store import open_store as value
    elif name == "watch":
        from dynascope.alerts.attach import watch as value
    elif name == "Scope":
        from dynascope.probes.scope import Scope as value
    elif name == "WatchSettings":
        from dynascope.probes.settings import WatchSettings as value
    else:
        raise AttributeError(f"module 'dynascope' has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = ["Scope", "WatchSettings", "__version__", "open_store", "watch"]
