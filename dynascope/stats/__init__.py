"""Per-tensor statistics, each declared once (``Statistic``): the store, the probe, ``dynascope diff`` and
the dashboard all work from the declarations in ``REGISTRY``. Importing this package never imports torch:
the engine (``stats.engine``) and the kernels import it when they run. See docs/statistics.md."""

from dynascope.stats.base import Chunk, Column, Figure, Settings, Statistic, count, frac
from dynascope.stats.registry import REGISTRY

__all__ = ["REGISTRY", "Chunk", "Column", "Figure", "Settings", "Statistic", "count", "frac"]
