"""The Streamlit dashboard over a run directory or a store root: ``app.py`` and its pages, served by
``dynascope.dashboard.serve`` (``launch`` is ``dynascope dashboard PATH``)."""

from __future__ import annotations

from typing import Any

__all__ = ["launch"]


def __getattr__(name: str) -> Any:
    # Imported on first use, not here: the server process is ``python -m dynascope.dashboard.serve``, and a
    # package that imported ``serve`` itself would have it in sys.modules before runpy executes it as
    # __main__ (runpy's RuntimeWarning, printed at every dashboard start).
    if name == "launch":
        from dynascope.dashboard.serve import launch

        return launch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
