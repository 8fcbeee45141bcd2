"""verl's own ``AgentLoopManager._performance_metrics`` (the rollout's ``timing_s/agent_loop/*`` summaries),
compiled from the installed verl's source. Importing its module needs hydra, ray and the rollout servers,
which the light install (``pip install --no-deps verl``) lacks; the method itself uses only numpy and the
``DataProto`` it is given (it never reads ``self``)."""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def performance_metrics() -> Callable[[Any, list, Any], dict[str, float]] | None:
    """The function, called as ``fn(None, metrics, output)``; None when this verl has no agent loop."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "experimental" / "agent_loop" / "agent_loop.py"
    if not path.exists():
        return None
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "AgentLoopManager":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "_performance_metrics":
                    from verl import DataProto

                    namespace: dict[str, Any] = {"np": np, "DataProto": DataProto}
                    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
                    return namespace["_performance_metrics"]
    return None
