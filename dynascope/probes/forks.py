"""Scopes across ``fork`` and SIGTERM: the child's inherited copies are inert; a terminated process
resolves its pending records before its writers flush (``store.preempt``).

A DataLoader worker or a forked rollout process inherits the parent's scopes, but not their threads
(resolver, writer, listeners): a queue there has nobody reading it, and the rows buffered are the parent's.
So after a fork every scope alive in the parent is marked ``forked`` in the child, and its hooks and
``close`` do nothing; ``watch()`` in the child makes a scope and a writer of its own. The writers do the
same for themselves (``store.open_writers``).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from dynascope.store import preempt

__all__ = ["track"]

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def track(scope: Any) -> None:
    """Mark ``scope`` inert in any child forked from now on, and drain its resolver on SIGTERM (until it
    is collected)."""
    _LIVE.add(scope)
    ref = weakref.ref(scope)

    def drain(timeout_s: float) -> None:
        s = ref()
        if s is not None and not s.forked and not getattr(s, "_closed", False):
            s.resolver.drain(timeout_s)

    preempt.on_term(drain)


def _inert_in_child() -> None:
    for scope in list(_LIVE):
        scope.forked = True
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_inert_in_child)
