"""The step boundary: pre/post hooks around an optimizer's ``step()``, whatever kind of object it is.

A ``torch.optim.Optimizer`` has ``register_step_pre_hook``/``register_step_post_hook``. Other optimizers
have a ``step()`` but not those hooks: DeepSpeed's ZeRO wrappers (``DeepSpeedZeroOptimizer``,
``DeepSpeedZeroOptimizer_Stage3``, ``BF16_Optimizer``) are plain objects, and wrappers that subclass
``Optimizer`` without calling its ``__init__`` (accelerate's ``AcceleratedOptimizer``) lack the hook
state. For those the instance's ``step`` is wrapped: the wrapper calls the hooks exactly where torch
would (pre before, post after a step that returned), with the same arguments: ``(optimizer, args,
kwargs)``, ``args`` starting with the optimizer itself. Removing the handle puts the original back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["StepWrapHandle", "attach_step_hooks"]

Hook = Callable[[Any, tuple, dict], Any]


class StepWrapHandle:
    """Undoes one wrapping of ``obj.step`` (only while the wrapper is still the one installed)."""

    def __init__(self, obj: Any, wrapper: Callable[..., Any], had_own: bool, original: Any) -> None:
        self._obj, self._wrapper, self._had_own, self._original = obj, wrapper, had_own, original

    def remove(self) -> None:
        obj, self._obj = self._obj, None
        if obj is None or vars(obj).get("step") is not self._wrapper:
            return  # already removed, or someone wrapped step again after us: leave theirs in place
        if self._had_own:
            obj.step = self._original
        else:
            del obj.step


def _torch_hooks(optimizer: Any, pre: Hook, post: Hook) -> list[Any] | None:
    register_pre = getattr(optimizer, "register_step_pre_hook", None)
    register_post = getattr(optimizer, "register_step_post_hook", None)
    if not (callable(register_pre) and callable(register_post)):
        return None
    try:
        handle = register_pre(pre)
    except Exception:  # an Optimizer subclass whose __init__ never ran has no hook dictionaries
        return None
    try:
        return [handle, register_post(post)]
    except Exception:
        handle.remove()
        return None


def attach_step_hooks(optimizer: Any, pre: Hook, post: Hook) -> list[Any] | None:
    """Handles (each with ``remove()``) of ``pre``/``post`` around ``optimizer.step()``; None when the
    object has no callable ``step`` or refuses a new attribute (the caller warns and steps by hand)."""
    handles = _torch_hooks(optimizer, pre, post)
    if handles is not None:
        return handles
    original = getattr(optimizer, "step", None)
    if not callable(original):
        return None
    had_own = "step" in getattr(optimizer, "__dict__", {})

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        full = (optimizer, *args)
        pre(optimizer, full, kwargs)
        out = original(*args, **kwargs)
        post(optimizer, full, kwargs)
        return out

    try:
        optimizer.step = step
    except Exception:  # __slots__, a read-only property, a frozen object
        return None
    return [StepWrapHandle(optimizer, step, had_own, original)]
