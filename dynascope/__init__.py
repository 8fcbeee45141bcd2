"""dynascope: see what happens inside LLM training.

    scope = dynascope.watch(model, optimizer, run="runs/x")   # probes: ΔW, gradients, phase timings
    con = dynascope.open_store("runs/x")                       # DuckDB views over the run's tables
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynascope.core.version import __version__
from dynascope.store import open_store

if TYPE_CHECKING:
    from dynascope.probes.scope import Scope


def watch(model: Any, optimizer: Any = None, **kwargs: Any):
    """Attach dynascope's probes to ``model``/``optimizer``; see ``dynascope.probes.scope.watch``."""
    from dynascope.probes.scope import watch as _watch

    if kwargs.get("wandb") or "wandb" in kwargs.get("listeners", ()):
        try:
            import dynascope.integrations.wandb  # noqa: F401  registers the "wandb" listener
        except Exception:  # the scope reports the missing listener as a warning and an event
            pass
    return _watch(model, optimizer, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Scope":
        from dynascope.probes.scope import Scope

        return Scope
    raise AttributeError(name)


__all__ = ["Scope", "__version__", "open_store", "watch"]
