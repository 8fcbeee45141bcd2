"""DeepSpeed ZeRO's tensors: each rank's slice of the fp32 master and of its gradient, found by DeepSpeed's
own metadata, with the user's names; what the probes read through ``Tracked`` (``local``, ``grad``, ``nbytes``).

Under ZeRO the optimizer updates fp32 masters that DeepSpeed keeps outside the model: each rank holds a
flat slice of them, so ``p`` and ``p.grad`` say nothing (ZeRO-3 leaves ``p`` empty between forward
passes; ZeRO-1/2 leave ``p.grad`` None after the backward pass). The statistics describe the fp32
masters, as under FSDP mixed precision, read where DeepSpeed keeps them, without gathering anything:

* ZeRO-3 (``ds_id``, ``ds_numel``, ``ds_shape`` on every parameter): the rank's partition of each tensor
  (the memory ``deepspeed.utils.safe_get_local_fp32_param`` returns) and of its gradient (the partition
  ``safe_get_local_grad`` reads). Partitions are ``ceil(numel / world)`` long and the last rank's is
  padded with elements that belong to no tensor; those are cut off.
* ZeRO-1/2 and DeepSpeed's bf16 optimizer (``_hp_mapping`` on every parameter): the fragment of the
  tensor inside the rank's flat partition (``_hp_mapping.hp_fragment``, a view of the partition the
  optimizer steps) and its gradient fragment (``get_lp_grad_fragment``, readable between
  ``engine.backward()`` and ``engine.step()``). A tensor outside the rank's partition has an empty
  fragment.

Every rank tracks every tensor under the user's name with ``sharded=True``, so its rows are per-rank
partial sums that ``store.combine.combine_shards`` turns into each tensor's statistics when read; a rank
holding none of a tensor writes a zero-element row, whose sums are exactly zero. The budget sizes each
tensor by a rank-invariant bound (ZeRO-3: its partition; ZeRO-1/2: the whole tensor in fp32, the most a
rank's fragment can be), which ``probes.window`` plans the sharded rotation from: every rank's window
holds the same tensors at the same record, and the shards of a windowed statistic combine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dynascope.core.naming import normalize_name, tensor_kind, tensor_layer
from dynascope.probes.params import Tracked

__all__ = ["Zero3Tracked", "Zero12Tracked", "build_reference", "discover", "params_of", "uses_zero"]


def params_of(model: Any) -> list[tuple[str, Tensor]]:
    named = getattr(model, "named_parameters", None)
    return list(named()) if callable(named) else []


def uses_zero(model: Any) -> bool:
    """Whether the model's parameters carry DeepSpeed's partitioning metadata."""
    return any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for _, p in params_of(model))


@dataclass(eq=False)
class _ZeroTracked(Tracked):
    """A tensor whose fp32 master DeepSpeed holds; ``plan_bytes`` is the rank-invariant budget size."""

    plan_bytes: int = 0
    empty: Tensor = field(default_factory=lambda: torch.empty(0))
    full_shape: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.plan_bytes

    @property
    def start(self) -> int:
        """Where the rank's slice begins in the flat tensor."""
        return 0


@dataclass(eq=False)
class Zero3Tracked(_ZeroTracked):
    """ZeRO-3: the rank's partition of the master, its ``real`` leading elements (the rest is padding)."""

    real: int = 0
    offset: int = 0
    opt: Any = None  # DeepSpeedZeroOptimizer_Stage3
    # Where the two slices sit in the optimizer's flat buffers, when ``locate`` found them there: DeepSpeed's
    # accessors cost 25 µs (gradient) and 80 µs (master) a call, read at every record for every tensor.
    master_at: tuple[int, int] | None = None  # (sub-group, offset) in fp32_partitioned_groups_flat
    # (sub-group, offset): in grad_partitions_flat_buffer (sub-group -1), or with optimizer offload in the
    # sub-group's fp32 flat's .grad
    grad_at: tuple[int, int] | None = None
    _views: dict = field(default_factory=dict)  # buffer role → (buffer, its data_ptr, the slice of it)

    def _view(self, role: str, buf: Tensor, lo: int) -> Tensor:
        """``buf[lo:lo + real]``, made once per buffer: the slice costs more than checking that the
        buffer is the same memory (DeepSpeed's offload_states() swaps a buffer's storage in place)."""
        ptr = buf.data_ptr()
        held = self._views.get(role)
        if held is None or held[0] is not buf or held[1] != ptr:
            held = self._views[role] = (buf, ptr, buf.detach()[lo:lo + self.real])
        return held[2]

    @property
    def start(self) -> int:
        return self.offset

    def local(self) -> Tensor:
        at = self.master_at
        if at is not None:
            return self._view("master", self.opt.fp32_partitioned_groups_flat[at[0]], at[1])
        from deepspeed.utils import safe_get_local_fp32_param

        return safe_get_local_fp32_param(self.param).detach().reshape(-1)[:self.real]

    def _grad_buffer(self, group: int) -> Tensor | None:
        if group < 0:
            return getattr(self.opt, "grad_partitions_flat_buffer", None)
        return self.opt.fp32_partitioned_groups_flat[group].grad

    def grad(self) -> Tensor | None:
        at = self.grad_at
        buf = self._grad_buffer(at[0]) if at is not None else None
        if buf is not None:
            return self._view("grad", buf, at[1])  # type: ignore[index]
        g = self._accessor_grad()
        return None if g is None else g.detach().reshape(-1)[:self.real]

    def _accessor_grad(self) -> Tensor | None:
        # The partition safe_get_local_grad reads, in its own dtype: that function returns .float() of it,
        # a copy of every bf16 gradient at every record, which the probe would then hold all at once.
        read = getattr(self.opt, "_get_fp32_grad_state_partition", None)
        if read is not None:
            return read(param=self.param, release_swap_buffers=True)[0]
        from deepspeed.utils import safe_get_local_grad  # pragma: no cover - releases without the accessor

        return safe_get_local_grad(self.param)

    def locate(self) -> None:
        """Find the slices in the flat buffers DeepSpeed's accessors read, kept only where they are the
        memory the accessors return, or its source: with optimizer offload the master accessor copies the
        host slice to the device, and the statistics are computed on the host, where masters and
        gradients both are."""
        opt, p, n = self.opt, self.param, self.real
        self.master_at = self.grad_at = None
        try:
            gi, off, _ = opt.grad_position[opt.get_param_id(p)]
            self.master_at = (gi, off)
            here, there = self.local(), _accessor_master(p)[:n]
            # the accessor's own slice, or (optimizer offload) its copy to the device of that host slice
            if not (_same(here, there) or (here.device != there.device and here.shape == there.shape)):
                self.master_at = None
        except Exception:
            gi, self.master_at = None, None
        g = self._accessor_grad()
        for group in (-1, gi):
            try:
                buf = self._grad_buffer(group) if group is not None else None
                if g is None or buf is None or g.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
                    continue
                self.grad_at = (group, g.storage_offset() - buf.storage_offset())  # type: ignore[assignment]
                if _same(self.grad(), g.reshape(-1)[:n]):  # type: ignore[arg-type]
                    return
            except Exception:
                pass  # a layout this reader does not know: the slice is not found, and the tensor is skipped with its reason
            self.grad_at = None


def _accessor_master(p: Tensor) -> Tensor:
    from deepspeed.utils import safe_get_local_fp32_param

    return safe_get_local_fp32_param(p).detach().reshape(-1)


def _same(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


@dataclass(eq=False)
class Zero12Tracked(_ZeroTracked):
    """ZeRO-1/2 (and the bf16 optimizer): the tensor's fragment of the rank's flat fp32 partition."""

    @property
    def start(self) -> int:
        hp = getattr(self.param, "_hp_mapping", None)
        return 0 if hp is None else int(hp.lp_fragment_address.start)

    def local(self) -> Tensor:
        hp = getattr(self.param, "_hp_mapping", None)
        return self.empty if hp is None else hp.hp_fragment.detach()

    def grad(self) -> Tensor | None:
        p = self.param
        hp = getattr(p, "_hp_mapping", None)
        if hp is None:
            return self.empty
        try:
            g = hp.get_lp_grad_fragment(p._index_in_param_group)
        except (ValueError, KeyError, IndexError):  # outside backward → step: not this step's gradient
            return None
        g = g.detach().reshape(-1)
        address = hp.lp_fragment_address
        if g.numel() != address.numel:  # the bf16 optimizer keeps a whole-tensor buffer on every rank
            g = g.narrow(0, address.start, address.numel)
        return g


def _unreadable(p: Tensor) -> str | None:
    if hasattr(p, "ds_id") and getattr(p, "_z3_optimizer", None) is None:
        return ("partitioned by ZeRO-3, but no DeepSpeed optimizer holds an fp32 master of it (an engine "
                "without an optimizer, as for a frozen reference model): not read")
    opt = getattr(p, "_z3_optimizer", None)
    if opt is not None and getattr(opt, "swap_optimizer", False):
        return "fp32 master offloaded to NVMe (DeepSpeed offload_optimizer.device=nvme): not read"
    if not (hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")):
        return "trainable, but DeepSpeed's optimizer holds no master of it"
    return None


def discover(model: Any) -> tuple[list[Tracked], list[tuple[str, str]]]:
    """(tracked, skipped) for a model whose parameters DeepSpeed partitions; frozen ones are not tracked
    (no master exists for them), as with any optimizer. A tensor whose slice cannot be found is skipped
    with the reason (a ``probe_skip`` event): no row rather than a row of zeros."""
    named = params_of(model)
    fragments = [m.hp_fragment for _, p in named if (m := getattr(p, "_hp_mapping", None)) is not None]
    master = fragments[0].dtype if fragments else torch.float32
    tracked: list[Tracked] = []
    skipped: list[tuple[str, str]] = []
    seen: set[int] = set()
    for raw, p in named:
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        name = normalize_name(raw)
        reason = _unreadable(p)
        if reason is None:
            try:
                tracked.append(_track(name, p, master))
            except Exception as exc:  # metadata of a DeepSpeed release this was not written against
                reason = f"DeepSpeed's slice of it could not be read ({type(exc).__name__}: {exc})"
        if reason is not None:
            skipped.append((name, reason))
    return tracked, skipped


def _track(name: str, p: Any, master: torch.dtype) -> Tracked:
    meta = dict(name=name, param=p, sharded=True, layer=tensor_layer(name), kind=tensor_kind(name))
    if hasattr(p, "ds_id"):
        part = int(p.partition_numel())
        real = max(0, min(part, int(p.ds_numel) - int(p.ds_zero_partition_rank) * part))
        t: _ZeroTracked = Zero3Tracked(**meta, real=real, offset=int(p.ds_zero_partition_rank) * part,
                                       shape=_shape(p.ds_shape), full_shape=tuple(p.ds_shape),
                                       opt=p._z3_optimizer)
        t.locate()
        local = t.local()
        t.plan_bytes = part * local.element_size()
        t.empty = local[:0]
    else:
        t = Zero12Tracked(**meta, shape=_shape(p.shape), full_shape=tuple(p.shape),
                          empty=torch.empty(0, dtype=master, device=p.device))
        t.plan_bytes = p.numel() * t.empty.element_size()
    t.dtype = str(t.local().dtype).replace("torch.", "")
    return t


def _shape(shape: Any) -> str:
    return "x".join(str(int(s)) for s in shape)


def build_reference(spec: Any, named: list[tuple[str, Tensor]], run_dir: Path, rank: int, resident: bool,
                    tracked: list[Tracked], resume: bool = False) -> Any:
    """θ₀ as ``reference.build_reference`` builds it, except that a whole-tensor θ₀ (a state dict or a
    checkpoint path) of ZeRO-tracked tensors is cut to each rank's slice as it is read (a flat range per
    tensor, never a whole tensor), then held or written to disk like ``"init"``: the slices' shapes are
    the ones drift compares against."""
    from dynascope.probes import reference

    zero = {normalize_name(t.name): t for t in tracked if isinstance(t, _ZeroTracked)}
    if not zero or spec is None or (isinstance(spec, str) and spec == "init"):
        return reference.build_reference(spec, named, run_dir, rank, resident, resume)
    source, kind = reference.whole_source(spec)
    slices = []
    for name, local in named:
        key = normalize_name(name)
        t = zero.get(key)
        if t is None or tuple(source.shapes.get(key, (-1,))) != t.full_shape:
            continue  # no θ₀ of this tensor: its drift is NULL, as without ZeRO
        lo = t.start
        slices.append((name, source.read(key, lo, lo + local.numel()).to(local.device).reshape(local.shape)))
    ref = reference.build_reference("init", slices, run_dir, rank, resident)
    if ref is not None:
        ref.kind = kind
    return ref
