"""Analyses: pure functions over a store (a path or an open ``StoreConnection``) → polars DataFrame.

Each analysis lives in a submodule named for its subject and is re-exported here lazily, so importing
``dynascope.analyses`` stays cheap: ``from dynascope.analyses import straggler_scores`` works for any
public function of any submodule.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

_index: dict[str, str] | None = None


def _build_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        for name in getattr(module, "__all__", ()):
            index.setdefault(name, mod.name)
    return index


def __getattr__(name: str) -> Any:
    global _index
    if name.startswith("__"):
        raise AttributeError(name)
    if _index is None:
        _index = _build_index()
    if name not in _index:
        raise AttributeError(f"dynascope.analyses has no analysis {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_index[name]}"), name)


def __dir__() -> list[str]:
    global _index
    if _index is None:
        _index = _build_index()
    return sorted(_index)
