"""dynascope: see what happens inside LLM training.

    scope = dynascope.watch(model, optimizer, run="runs/x")   # probes: ΔW, gradients, phase timings
    con = dynascope.open_store("runs/x")                       # DuckDB views over the run's tables
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from dynascope.store import open_store  # noqa: E402

if TYPE_CHECKING:
    from dynascope.probes.scope import Scope as Run


def watch(model: Any, optimizer: Any = None, **kwargs: Any):
    """Attach dynascope's probes to ``model``/``optimizer``; see ``dynascope.probes.scope.watch``."""
    from dynascope.probes.scope import watch as _watch

    return _watch(model, optimizer, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Run":
        from dynascope.probes.scope import Scope

        return Scope
    raise AttributeError(name)


__all__ = ["Run", "__version__", "open_store", "watch"]
