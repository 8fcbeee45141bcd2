"""Which tensors the probes track, under which names, and which they skip (and why).

With an optimizer, the tracked set is what it updates (its param groups, in order); without one, the
model's parameters that require grad. Names come from ``model.named_parameters()``, which lists a tied
weight once, so tied weights are counted once, through ``core.naming.normalize_name``: a model wrapped
by ``torch.compile`` (``_orig_mod.``), DDP (``module.``) or FSDP1 records the names of the bare model, the
names θ₀ and checkpoints are matched by. DTensor (FSDP2) parameters are tracked through their
local shard and marked ``sharded``; parameters DeepSpeed ZeRO partitions, through the rank's slice of
their fp32 master (``probes.zero_params``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dynascope.core.naming import normalize_name, tensor_kind, tensor_layer

__all__ = ["LocalViews", "Tracked", "discover", "optimizer_fingerprint"]

try:  # DTensor moved between torch releases; without it nothing is sharded
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def _is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


@dataclass
class Tracked:
    """One tracked parameter and its row metadata."""

    name: str
    param: Tensor
    sharded: bool = False
    layer: int | None = None
    kind: str = "other"
    shape: str = ""
    dtype: str = ""
    meta: dict = field(default_factory=dict)
    dtensor: bool = False  # a DTensor: sharded, replicated (a TP bias), or both (HSDP)
    mesh: str | None = None  # the mesh's shape, "2x2" (DTensor only)
    shard: str | None = None  # this rank's coordinates along the sharding mesh dimensions
    replica: int | None = None  # its index along the replicating mesh dimensions (0 counts)

    def local(self) -> Tensor:
        """The data this rank holds (the local shard under FSDP2), detached."""
        p = self.param.to_local() if self.dtensor or self.sharded else self.param
        return p.detach()

    def grad(self) -> Tensor | None:
        """The gradient this rank holds (read at every record for every tensor: no detached view unless
        the gradient itself is part of a graph, as with ``create_graph=True``)."""
        g = self.param.grad
        if g is None:
            return None
        if (self.dtensor or self.sharded) and _is_dtensor(g):
            g = g.to_local()
        return g.detach() if g.requires_grad else g

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds, as the budget counts them (read at every record: no detached view, ~0.1 µs
        a tensor). A shard counts the largest shard of its tensor, the same on every rank, so that every
        rank plans the same windows (``probes.window``) even where the tensor does not split evenly."""
        if self.sharded:
            return self.meta.get("plan_bytes") or self.local().nbytes
        return self.param.nbytes


def _skip_reason(p: Tensor) -> str | None:
    if p.layout != torch.strided or getattr(p, "is_sparse", False):
        return f"sparse layout {p.layout}"
    if p.device.type == "meta":
        return "meta tensor (no data)"
    if p.is_complex():
        return f"complex dtype {p.dtype}"
    if not p.is_floating_point():
        return f"non-floating dtype {p.dtype}"
    return None


def optimizer_fingerprint(optimizer: Any) -> tuple:
    """Cheap identity of the optimizer's parameter set; changes when groups or params are added."""
    groups = getattr(optimizer, "param_groups", None) if optimizer is not None else None
    if not groups:
        return ()
    return tuple((len(g["params"]), id(g["params"][0]) if g["params"] else 0) for g in groups)


def discover(model: Any, optimizer: Any) -> tuple[list[Tracked], list[tuple[str, str]]]:
    """(tracked tensors, [(name, reason) for skipped ones])."""
    from dynascope.probes import zero_params

    if zero_params.uses_zero(model):  # DeepSpeed holds the masters: its metadata says where
        return zero_params.discover(model)
    names: dict[int, str] = {}
    if model is not None and hasattr(model, "named_parameters"):
        for n, p in model.named_parameters():  # remove_duplicate=True: tied weights appear once
            names.setdefault(id(p), n)
    groups = getattr(optimizer, "param_groups", None) if optimizer is not None else None
    if groups is not None:  # an optimizer without param_groups (a plain object): the model's parameters
        params: list[tuple[str, Tensor]] = []
        for gi, g in enumerate(groups):
            for pi, p in enumerate(g["params"]):
                params.append((names.get(id(p), f"param_groups.{gi}.{pi}"), p))
    else:
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    seen: set[int] = set()
    tracked, skipped = [], []
    for raw, p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        name = normalize_name(raw)  # the name θ₀ and checkpoints use: no DDP/compile/FSDP1 wrapper prefix
        dtensor = _is_dtensor(p)
        local = p.to_local() if dtensor else p
        reason = _skip_reason(local)
        if reason is not None:
            skipped.append((name, reason))
            continue
        place = placement(p) if dtensor else {}
        sharded = bool(place.get("shard"))
        tracked.append(Tracked(name=name, param=p, sharded=sharded, layer=tensor_layer(name),
                               kind=tensor_kind(name), shape="x".join(str(s) for s in p.shape),
                               dtype=str(local.dtype).replace("torch.", ""),
                               meta={"plan_bytes": _largest_shard_bytes(p)} if sharded else {},
                               dtensor=dtensor, **place))
    return tracked, skipped


def placement(p: Any) -> dict[str, Any]:
    """A DTensor's place on its mesh, as ``tensor_stats`` records it (``mesh``, ``shard``, ``replica``).

    Mesh dimensions whose placement is ``Shard`` split the tensor: this rank's coordinates along them say
    which piece it holds. Dimensions that ``Replicate`` it (HSDP's outer one; every dimension for a TP
    bias) hold copies: the coordinates along them, flattened, are the replica index, and only replica 0's
    rows count when ranks pool. A rank outside the mesh holds nothing: replica -1."""
    mesh = p.device_mesh
    coords = mesh.get_coordinate()
    shape = tuple(mesh.shape)
    shard_dims = [d for d, pl in enumerate(p.placements) if pl.is_shard()]
    rep_dims = [d for d, pl in enumerate(p.placements) if pl.is_replicate()]
    if coords is None:
        return {"mesh": "x".join(map(str, shape)), "shard": "", "replica": -1}
    replica = 0
    for d in rep_dims:
        replica = replica * shape[d] + coords[d]
    return {"mesh": "x".join(map(str, shape)), "shard": ",".join(str(coords[d]) for d in shard_dims),
            "replica": replica}


def _largest_shard_bytes(p: Any) -> int:
    """The largest shard of a DTensor's elements, in bytes: its numel over the mesh dimensions it is
    sharded along, rounded up (FSDP2 pads dim 0 to that)."""
    shards = 1
    for dim, placement in enumerate(p.placements):
        if placement.is_shard():
            shards *= p.device_mesh.size(dim)
    return -(-p.numel() // shards) * p.element_size()


class LocalViews:
    """``tracked[i].local()``, made on first use: most records read the weights of the window's tensors or
    of none (a detached view per tensor per record was ~0.2 ms of the reference step)."""

    def __init__(self, tracked: list[Tracked]) -> None:
        self._tracked = tracked
        self._made: list[torch.Tensor | None] = [None] * len(tracked)

    def __getitem__(self, i: int) -> torch.Tensor:
        w = self._made[i]
        if w is None:
            w = self._made[i] = self._tracked[i].local()
        return w

    def __len__(self) -> int:
        return len(self._tracked)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self._tracked)))
