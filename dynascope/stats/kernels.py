"""Numerics that several statistics share: widening, batched norms, and the norms-and-changes kernel.

The statistic files import this module inside their kernels (it imports torch; their declarations must
not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from dynascope.stats.base import Statistic

__all__ = ["INT_VIEW", "batched_norms", "norms", "norms_and_changes", "wide"]

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def wide(t: Tensor) -> Tensor:
    """``t`` in a dtype wide enough to difference and accumulate (fp32 for 16-bit floats)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def norms(tensors: list[Tensor], statistic: Statistic | None = None) -> Tensor:
    """L2 norms of ``tensors`` as float64 [n], every element's square summed in float64.

    One estimator for every record and every tier: ``statistic``'s own pass over the elements
    (``stats.engine.Pass.run_many``: on a host the fused kernel, or its chunk-tensor form while that
    compiles; on an accelerator the chunk-tensor form, float64 sums of each chunk), the pass that gives ‖W‖
    of the window's tensors. (``torch._foreach_norm`` accumulates in the input's width, fp32 for fp32
    tensors, even with a float64 ``dtype``.) Without ``statistic``: ``torch._foreach_norm``.
    Tensors on several devices (a model spread over them in one process) get each device's norms, gathered
    on the first tensor's device without waiting for any.
    An fp32 accumulator is not enough: an fp32 BLAS dot of 33.5M elements is ~2.6e-4 off a float64 reference,
    which at lr 1e-6 is larger than a step's change of ‖W‖; the float64 sum is ~1e-11 off.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    first = tensors[0].device
    if any(t.device != first for t in tensors):  # one model over several devices: each device's own, gathered
        groups: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault(t.device, []).append(i)
        out: list[Tensor] = [torch.empty(0)] * len(tensors)
        for idx in groups.values():
            res = norms([tensors[i] for i in idx], statistic).to(first, non_blocking=True)
            for j, i in enumerate(idx):
                out[i] = res[j]
        return torch.stack(out)
    if statistic is not None:
        from dynascope.stats.engine import flat_reader
        from dynascope.stats.fused_many import Item

        name = statistic.inputs[0]
        items = [Item({name: flat_reader(t)}, t.numel(), {}) for t in tensors]
        return _pass(statistic).run_many(items)[:, 0].to(torch.float64)
    return torch.stack([torch.linalg.vector_norm(t, dtype=None if t.dtype in (torch.float32, torch.float64)
                                                 else torch.float32) for t in tensors]).to(torch.float64)


_PASSES: dict[str, Any] = {}


def _pass(statistic: Statistic) -> Any:
    """The one-statistic pass ``norms`` runs (built once per statistic)."""
    got = _PASSES.get(statistic.name)
    if got is None:
        from dynascope.stats.engine import Pass

        got = _PASSES[statistic.name] = Pass([statistic])
    return got


def batched_norms(tensors: list[Tensor], statistic: Statistic | None = None) -> Tensor:
    """``norms`` as the [n, 1] result of a batched statistic (``statistic``: the one asking, whose element
    function squares its input)."""
    return norms(tensors, statistic).unsqueeze(1)


def norms_and_changes(a: Tensor, b: Tensor, eta: float) -> list[Tensor]:
    """‖a‖, ‖a−b‖, then the bit-exact changed and the η-relative changed counts of one chunk pair.

    Bit-exact: the element's bits differ in the parameter's own dtype (NaN, i.e. undefined, when the two
    dtypes differ). Relative ("The Path Not Taken", 2025): |a − b| > η·max(|a|, |b|).
    """
    aw = wide(a)
    bw = wide(b).to(aw.dtype)
    d = aw - bw
    out = [torch.linalg.vector_norm(aw), torch.linalg.vector_norm(d)]
    if a.dtype != b.dtype or a.element_size() not in INT_VIEW:
        out.append(torch.full((), float("nan"), dtype=torch.float64, device=a.device))  # undefined → NULL
    else:
        iv = INT_VIEW[a.element_size()]
        out.append(torch.count_nonzero(a.view(iv) != b.view(iv)))
    # |d| > η·max(|a|, |b|), the scale built in one buffer (bw's own copy when it was widened).
    scale = bw.abs_() if bw is not b else bw.abs()
    torch.maximum(scale, aw.abs(), out=scale)
    scale.mul_(eta)
    out.append(torch.count_nonzero(d.abs_() > scale))
    return out
