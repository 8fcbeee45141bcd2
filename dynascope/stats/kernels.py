"""Numerics that several statistics share: widening, batched norms, and the norms-and-changes kernel.

The statistic files import this module inside their kernels (it imports torch; their declarations must
not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    """L2 norms of ``tensors`` as float64 [n].

    On a host, with ``statistic`` (the one asking, whose element function squares its input): its fused
    kernel, the pass that gives ‖W‖ of the window's tensors, each element's square summed in float64, one
    estimator for every record and tier (~1e-11 relative off a float64 reference at 33.5M elements, where an
    fp32 BLAS dot is ~2.6e-4 off: at lr 1e-6 more than a step's change of ‖W‖). While that kernel compiles,
    without numba, and on accelerators, ``_plain_norms``, which allocate nothing (the batched norms are
    outside the memory budget) and accumulate in fp32. Tensors on several devices (a model spread over them
    in one process) get each device's norms, gathered on the first tensor's device without waiting for any.
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
    if statistic is not None and all(t.device.type == "cpu" for t in tensors):
        from dynascope.stats.base import DEFAULT_CHUNK_ELEMS, Settings
        from dynascope.stats.engine import flat_reader
        from dynascope.stats.fused_many import Item, run_many

        name = statistic.inputs[0]
        items = [Item({name: flat_reader(t)}, t.numel(), {}) for t in tensors]
        fused, done = run_many((statistic,), statistic.inputs, items, Settings(), DEFAULT_CHUNK_ELEMS)
        got = torch.from_numpy(fused[:, 0]).to(torch.float64)
        if not done.all():  # while the kernel compiles (or without numba)
            rest = [k for k in range(len(tensors)) if not done[k]]
            got[rest] = _plain_norms([tensors[k] for k in rest])
        return got
    return _plain_norms(tensors)


def _plain_norms(tensors: list[Tensor]) -> Tensor:
    """Norms without temporaries (the batched norms are outside the memory budget): an fp32 BLAS dot per
    contiguous fp32 host tensor, ``torch._foreach_norm`` elsewhere (fp32 accumulation for 16-bit inputs)."""
    if all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return torch.stack([torch.dot(t.view(-1), t.view(-1)) for t in tensors]).to(torch.float64).sqrt()
    parts: list[Tensor | None] = [None] * len(tensors)
    kinds: dict[bool, list[int]] = {}
    for i, t in enumerate(tensors):
        kinds.setdefault(t.dtype in (torch.float32, torch.float64), []).append(i)
    for native, idx in kinds.items():
        ts = [tensors[i] for i in idx]
        for i, r in zip(idx, torch._foreach_norm(ts) if native else torch._foreach_norm(ts, 2, dtype=torch.float32),
                        strict=False):
            parts[i] = r
    return torch.stack([o.to(torch.float64) for o in parts])  # type: ignore[union-attr]


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
