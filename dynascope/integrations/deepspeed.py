"""DeepSpeed: the probes on a ``DeepSpeedEngine`` (ZeRO-1, -2, -3; fp32 or bf16 with fp32 masters).

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    scope = dynascope.integrations.deepspeed.watch(engine, run="runs/zero3")
    for batch in loader:
        engine.backward(engine(batch).loss)
        engine.step()                       # the step boundary: statistics of the fp32 masters
    scope.close()

``dynascope.watch(engine)`` is the same call: ``watch`` recognises an engine, and parameters that
DeepSpeed partitions whatever optimizer it is given (``engine.optimizer``, its inner torch optimizer, or
none), and attaches to the engine's optimizer step (``dynascope.probes.zero``). This module names the
extra to install when DeepSpeed is missing. What each ZeRO stage records: docs/integrations.md.
"""

from __future__ import annotations

import os
from typing import Any

from dynascope.core.extras import require
from dynascope.core.warn import warn
from dynascope.probes.attach import watch as _watch
from dynascope.probes.scope import Scope
from dynascope.probes.zero import is_engine

require("deepspeed", "dynascope.integrations.deepspeed")

__all__ = ["watch"]


def watch(engine: Any, run: str | os.PathLike = "runs/deepspeed", **options: Any) -> Scope:
    """``dynascope.watch(engine, run=run, **options)`` for the engine ``deepspeed.initialize`` returned;
    anything else is watched as a plain model, with a warning."""
    if not is_engine(engine):
        warn(f"dynascope.integrations.deepspeed.watch: expected a DeepSpeedEngine, got "
             f"{type(engine).__name__}; watching it as a model", RuntimeWarning, stacklevel=2)
    return _watch(engine, None, run, **options)
