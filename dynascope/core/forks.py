"""Forked children and DuckDB.

DuckDB crashes when a forked child frees a connection its parent made (the parent's threads and locks did
not come along). The common way to get there is garbage: a connection held in a reference cycle (frames
kept by an exception's traceback, a closure) that the parent had not collected yet when it forked. The
child's first cyclic collection frees it and the child dies with SIGSEGV: a DataLoader worker forked by a
trainer that reads its own store for alerts, or a rank process forked by a launcher.

So the parent freezes its objects just before it forks and unfreezes them just after (``gc.freeze``, two
list splices): the child inherits them frozen, and its cyclic collector never visits them, only what the
child allocates itself. Freezing in the child's own fork hook would be too late: ``threading``'s runs
first and can start a collection. CPython's documentation recommends the same for copy-on-write memory in
forked children; the cost is that a child keeps the parent's uncollected garbage (whose pages it shares
with the parent anyway). A child that drops its last reference to an inherited connection still frees it;
the journal's connections are kept for that reason (``store.journal``).

Importing this module registers the hooks (``dynascope.store`` imports it); an import runs once a process.
"""

from __future__ import annotations

import gc
import os
import threading

_thawed = threading.local()  # per forking thread: whether the parent had nothing frozen before this fork


def _freeze() -> None:
    _thawed.value = gc.get_freeze_count() == 0
    gc.freeze()


def _unfreeze() -> None:
    # A program that froze objects itself (the copy-on-write recipe) keeps them frozen: unfreezing would
    # thaw its objects too, so what this fork froze stays frozen with them.
    if getattr(_thawed, "value", False):
        gc.unfreeze()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_freeze, after_in_parent=_unfreeze)
