"""The Streamlit dashboard over a run directory or a store root: ``app.py`` and its pages, served by
``dynascope.dashboard.serve`` (``launch`` is ``dynascope dashboard PATH``)."""

from __future__ import annotations

from dynascope.dashboard.serve import launch

__all__ = ["launch"]
