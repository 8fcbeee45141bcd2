"""DeepSpeed ZeRO: what ``watch()`` attaches to, whatever it is given, and the engine's timings.

The step boundary is the engine's optimizer step: hooks around the ZeRO wrapper's ``step()``
(``DeepSpeedZeroOptimizer``, ``DeepSpeedZeroOptimizer_Stage3``, ``BF16_Optimizer``), which ``engine.step()``
calls once per gradient-accumulation boundary, whatever ``sub_group_size`` makes the inner optimizer do.
The wrapper is found from the engine, the optimizer passed (or the one accelerate wraps), or the
parameters themselves, so ``watch(engine)``, ``watch(engine.module, engine.optimizer)``,
``watch(engine.module, engine.optimizer.optimizer)`` and ``watch(engine.module)`` all record the same
steps. The tensors and where each rank's slices are read: ``probes.zero_params``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from dynascope.probes.zero_params import params_of, uses_zero

__all__ = ["ZeroAttachment", "is_engine", "resolve"]


def _from_deepspeed(obj: Any) -> bool:
    return any(isinstance(m := getattr(c, "__module__", None), str) and m.startswith("deepspeed.")
               for c in type(obj).__mro__[:-1])


def is_engine(obj: Any) -> bool:
    """Whether ``obj`` is a ``deepspeed.DeepSpeedEngine`` (without importing DeepSpeed)."""
    return any(c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed.")
               for c in type(obj).__mro__)


def _wrapper(model: Any, optimizer: Any) -> Any:
    """DeepSpeed's optimizer wrapper: the one passed or wrapped in what was passed (accelerate's
    ``DeepSpeedOptimizerWrapper``), else the one the parameters point back to (ZeRO-3 ``_z3_optimizer``;
    ZeRO-1/2 set ``_zero_optimizer`` only with CPU offload), else the one holding them (a heap search)."""
    obj = optimizer
    for _ in range(4):
        if obj is None or _from_deepspeed(obj):
            break
        obj = getattr(obj, "optimizer", None)
    if obj is not None and _from_deepspeed(obj):
        return obj
    params = [p for _, p in params_of(model)]
    for p in params:
        found = getattr(p, "_z3_optimizer", None) or getattr(p, "_zero_optimizer", None)
        if found is not None:
            return found
    return _holder(params) or optimizer


def _holder(params: list[Tensor]) -> Any:
    """The DeepSpeed optimizer whose groups hold ``params``: ZeRO-1/2 parameters keep no reference to it,
    and watch(engine.module, engine.optimizer.optimizer) or watch(engine.module) name none. Runs once,
    at watch(), and only then: a pass over the heap's objects, each type looked at once."""
    import gc

    ours = {id(p) for p in params}
    is_ds: dict[type, bool] = {}
    for obj in gc.get_objects():
        t = type(obj)
        hit = is_ds.get(t)
        if hit is None:  # the type first: getattr on any object may run its code
            hit = is_ds[t] = _from_deepspeed(obj)
        if not hit:
            continue
        groups = getattr(obj, "bit16_groups", None) or getattr(obj, "bf16_groups", None) or []
        if any(id(p) in ours for g in groups for p in g):
            return obj
    return None


@dataclass
class ZeroAttachment:
    """What ``watch()`` attaches to under DeepSpeed: the model to name and time, the optimizer whose
    ``step()`` is the boundary, the engine when known, and what was changed from what the user passed."""

    model: Any
    optimizer: Any
    engine: Any = None
    notes: list[str] = field(default_factory=list)
    error: Exception | None = None  # resolving failed: the arguments are watched as given

    def attach(self, scope: Any) -> list[Any]:
        """Engine timings and step numbering on a built scope; returns handles for ``scope.close``."""
        handles: list[Any] = []
        if self.error is not None:
            scope._report("deepspeed", self.error)
            return handles
        for note in self.notes:
            scope.event("probe_attach", note, framework="deepspeed")
        if scope.spectral is not None:
            scope.event("probe_skip", "spectral: needs whole 2-D weights; under ZeRO each rank holds flat "
                        "fragments of the fp32 masters, so no spectra are recorded", reason="zero")
        engine = self.engine
        if engine is None:
            return handles
        done = int(getattr(engine, "global_steps", 0) or 0)
        if done:  # an engine that already stepped (resumed from a checkpoint): continue its numbering
            scope.resume(done)
        if scope.timing is not None:
            handles.append(_time_backward(engine, scope))
        return handles


class _Restore:
    def __init__(self, obj: Any, name: str, wrapper: Any) -> None:
        self.obj, self.name, self.wrapper = obj, name, wrapper

    def remove(self) -> None:
        if vars(self.obj).get(self.name) is self.wrapper:
            delattr(self.obj, self.name)


def _time_backward(engine: Any, scope: Any) -> _Restore:
    """``engine.backward()`` as the ``backward`` phase: autograd's part plus DeepSpeed's gradient
    reduction and partitioning after it (the autograd-hook timing would stop before those)."""
    scope.timing.autograd_backward = False
    original = engine.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        with scope.phase("backward"):
            return original(*args, **kwargs)
    engine.backward = backward
    return _Restore(engine, "backward", backward)


def resolve(model: Any, optimizer: Any) -> ZeroAttachment | None:
    """The DeepSpeed attachment for ``watch(model, optimizer)``, or None when DeepSpeed is not involved.
    Never raises: a failure leaves the arguments as they were and is reported once the scope exists."""
    engine = model if is_engine(model) else None
    if engine is None and not uses_zero(model):
        return None
    try:
        notes = []
        target = _wrapper(model, optimizer if engine is None else (optimizer or engine.optimizer))
        if engine is not None and target is None:
            target = engine.optimizer
        if target is not None and not callable(getattr(target, "step", None)):
            # an engine without an optimizer (ZeRO-3 puts a DeepSpeedZeRoOffload there): nothing steps
            notes.append(f"no optimizer step to hook ({type(target).__name__}): scope.step() closes each step")
            target = None
        elif target is not optimizer and not (engine is not None and optimizer is None):
            what = type(optimizer).__name__ if optimizer is not None else "no optimizer (scope.step())"
            notes.append(f"step boundary: DeepSpeed's {type(target).__name__}.step(), once per engine step, "
                         f"instead of {what}")
        return ZeroAttachment(model, target, engine, notes)
    except Exception as exc:
        return ZeroAttachment(model, optimizer, error=exc)
