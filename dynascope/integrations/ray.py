"""Probes inside Ray actors: several actors (trainer, rollout workers…) writing to one run.

    @ray.remote
    class Rollout:
        def __init__(self, run, rank):
            self.scope = actor_scope(run, role="rollout", rank=rank, model=self.policy)

Each actor gets its own ``RunWriter`` (its own segment directory), so actors never contend for a file;
the run's rows are told apart by ``role`` and ``rank``. The actor's Ray identity (actor id, name, node,
job, pid) is recorded as a ``ray_actor`` event so rows can be joined back to Ray's own tooling.
"""

from __future__ import annotations

import os
import re
from typing import Any

from dynascope.core.extras import require


def actor_context() -> dict[str, Any]:
    """Ray's identity of the calling process: actor id/name (None on the driver), node, job, pid."""
    ray = require("ray", "dynascope.integrations.ray")
    if not ray.is_initialized():
        raise RuntimeError("actor_scope needs a running Ray worker (call it inside an actor or task)")
    ctx = ray.get_runtime_context()
    info: dict[str, Any] = {"pid": os.getpid()}
    for key, getter in (("actor_id", "get_actor_id"), ("actor_name", "get_actor_name"),
                        ("node_id", "get_node_id"), ("job_id", "get_job_id")):
        try:
            info[key] = getattr(ctx, getter)()
        except Exception:  # older Ray versions lack some getters
            info[key] = None
    return info


def actor_scope(run: str | os.PathLike, *, role: str, model: Any = None, optimizer: Any = None,
                rank: int | None = None, world_size: int | None = None, **watch_kwargs: Any) -> Any:
    """``dynascope.watch`` for the current Ray actor, identified by ``role`` and ``rank``.

    Args:
        run: run directory shared by all actors (a path every actor can reach, e.g. a shared filesystem).
        role: what this actor does ("trainer", "rollout", "reward"…); written on every row.
        model, optimizer: what to probe; without a model only phases, samples, scalars and events are recorded.
        rank: this actor's index within its role. Default: a number at the end of the actor's name
            ("rollout-3" → 3), else 0 — pass it when several actors share a role.
        world_size: number of actors in the role (recorded in ``runs``).
    """
    import dynascope

    info = actor_context()
    if rank is None:
        match = re.search(r"(\d+)$", info.get("actor_name") or "")
        rank = int(match.group(1)) if match else 0
    if model is None:
        import torch

        model = torch.nn.Module()  # no parameters: the scope records phases, samples, scalars and events only
    config = watch_kwargs.pop("config", None) or {}
    scope = dynascope.watch(model, optimizer, run=run, rank=rank, role=role, world_size=world_size,
                            config={**config, "ray": info}, **watch_kwargs)
    scope.event("ray_actor", f"{role} rank {rank} in Ray actor {info.get('actor_id')}", **info)
    return scope
