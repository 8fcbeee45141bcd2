"""Analyses: pure functions over a store (a path or an open ``StoreConnection``) → polars DataFrame.

Each analysis lives in a submodule named for its subject and is re-exported here lazily, so importing
``dynascope.analyses`` stays cheap: ``from dynascope.analyses import straggler_scores`` works for any
public function of any submodule.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path
from typing import Any

_index: dict[str, str] | None = None


def _build_index() -> dict[str, str]:
    # Read each submodule's literal __all__ without importing it: some analyses need torch, and a
    # lookup of a SQL-only analysis should not pay for that import.
    index: dict[str, str] = {}
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("_"):
            continue
        source = Path(__path__[0], f"{mod.name}.py").read_text(encoding="utf-8")
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                for name in ast.literal_eval(node.value):
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
