"""Weight and step-update statistics: ‖W‖, ‖ΔW‖, changed fractions, sign flips (two-step probe).

The maths is the pure function ``weight_update_stats(new, old)``; the checkpoint diff calls it on two
checkpoints and the live probe on the pre-step snapshot and the post-step weights, so both report the
same numbers. ``UpdateStats`` is the thin two-step wrapper: ``before`` snapshots, ``after`` computes.

Changed fractions, two ways:
* bit-exact: the element's bits differ in the parameter's own dtype (an update smaller than half an
  ulp is rounded away and does not count — the quantity low-precision training actually sees);
* bf16-relative ("The Path Not Taken", 2025): |ŵ − w| > η·max(|w|, |ŵ|), η = 1e-3, i.e. a change a
  bf16 copy of the weight could resolve, whatever the master dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["UPDATE_STAT_COLUMNS", "UPDATE_REDUCTIONS", "UpdateStats", "norms", "wide", "weight_update_stats"]

UPDATE_STAT_COLUMNS = ("w_norm", "dw_norm", "changed_count", "changed_bf16_count", "sign_flip_count",
                       "w_nan", "w_inf")

# How each state combines across ranks when a tensor is sharded (FSDP/DTensor): "norm" = root of the
# sum of squares, "sum" = plain sum. Used by dynascope.probes.combine.
UPDATE_REDUCTIONS = {"w_norm": "norm", "dw_norm": "norm", "changed_count": "sum", "changed_bf16_count": "sum",
                     "sign_flip_count": "sum", "w_nan": "sum", "w_inf": "sum"}

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def wide(t: Tensor) -> Tensor:
    """``t`` in a dtype wide enough to difference and accumulate (fp32 for 16-bit floats)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def norms(tensors: list[Tensor]) -> Tensor:
    """L2 norms of ``tensors`` as float64 [n], batched with ``torch._foreach_norm``.

    16-bit tensors accumulate in fp32 (``dtype=``) so a bf16 weight's norm is not itself rounded to bf16.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    if all(t.dtype == torch.float32 for t in tensors):  # the common case: one batched call, one cast
        return torch.stack(torch._foreach_norm(tensors)).to(torch.float64)
    out: list[Tensor | None] = [None] * len(tensors)
    groups: dict[bool, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype in (torch.float32, torch.float64), []).append(i)
    for native, idx in groups.items():
        ts = [tensors[i] for i in idx]
        res = torch._foreach_norm(ts) if native else torch._foreach_norm(ts, 2, dtype=torch.float32)
        for i, r in zip(idx, res, strict=False):
            out[i] = r
    return torch.stack([o.to(torch.float64) for o in out])  # type: ignore[union-attr]


def _bit_changed(new: Tensor, old: Tensor) -> Tensor:
    if new.dtype != old.dtype or new.element_size() not in _INT_VIEW:
        return torch.full((), float("nan"), dtype=torch.float64, device=new.device)  # undefined → NULL
    iv = _INT_VIEW[new.element_size()]
    return torch.count_nonzero(new.reshape(-1).view(iv) != old.reshape(-1).view(iv))


def weight_update_stats(new: list[Tensor], old: list[Tensor], eta: float = 1e-3, *,
                        signs: bool = True) -> Tensor:
    """Per-tensor statistics of the update ``new − old``: float64 [n, 7] on the tensors' device.

    Columns are ``UPDATE_STAT_COLUMNS``. ``old`` is the earlier weights (same shapes). Counts are exact
    integers held in float64; ``changed_count`` is NaN (unknown) when the two dtypes differ, since a
    bit-exact comparison is then undefined. ``signs=False`` skips the sign-flip, NaN and Inf passes
    (NaN in those columns) for callers that do not record them (drift). Nothing is copied to the host.
    """
    if len(new) != len(old):
        raise ValueError(f"weight_update_stats: {len(new)} new tensors vs {len(old)} old")
    if not new:
        return torch.zeros((0, len(UPDATE_STAT_COLUMNS)), dtype=torch.float64)
    with torch.no_grad():
        new = [t.detach() for t in new]
        old = [t.detach() for t in old]
        w_norm = norms(new)
        # One tensor at a time below: the temporaries (ΔW in fp32, masks) stay the size of one tensor
        # instead of the whole set, and every result stays on device until the single stack.
        dw, changed, rel, flips, nans, infs = [], [], [], [], [], []
        for a, b in zip(new, old, strict=False):
            if a.shape != b.shape:
                raise ValueError(f"weight_update_stats: shape {tuple(a.shape)} vs {tuple(b.shape)}")
            aw = wide(a)
            bw = wide(b).to(aw.dtype)
            d = aw - bw
            dw.append(torch.linalg.vector_norm(d))
            changed.append(_bit_changed(a, b))
            scale = aw.abs()
            torch.maximum(scale, bw.abs(), out=scale)
            scale.mul_(eta)
            rel.append(torch.count_nonzero(d.abs_() > scale))
            del d, scale
            if signs:
                flips.append(torch.count_nonzero(torch.sign(a) * torch.sign(b) < 0))
                nans.append(torch.count_nonzero(torch.isnan(a)))
                infs.append(torch.count_nonzero(torch.isinf(a)))
            else:
                flips.append(unknown := torch.full((), float("nan"), dtype=torch.float64, device=a.device))
                nans.append(unknown)
                infs.append(unknown)
        cols = [w_norm.to(new[0].device)] + [torch.stack([x.to(torch.float64) for x in c])
                                             for c in (dw, changed, rel, flips, nans, infs)]
        return torch.stack(cols, dim=1)


class UpdateStats:
    """Two-step probe for one optimizer step: ``before(params)`` snapshots, ``after(params)`` computes.

    The snapshot lives in buffers allocated for this step only and released by ``after``, so the extra
    memory is the size of the tensors handed to ``before`` (the scope hands it a budgeted window).
    """

    columns = UPDATE_STAT_COLUMNS
    reductions = UPDATE_REDUCTIONS

    def __init__(self, eta: float = 1e-3) -> None:
        self.eta = float(eta)
        self._snap: list[Tensor] | None = None

    @property
    def pending(self) -> bool:
        return self._snap is not None

    @torch.no_grad()
    def before(self, params: list[Tensor]) -> None:
        self._snap = [torch.empty_like(p) for p in params]
        if params:
            torch._foreach_copy_(self._snap, params)

    @torch.no_grad()
    def after(self, params: list[Tensor]) -> Tensor:
        snap, self._snap = self._snap, None
        if snap is None or len(snap) != len(params):
            raise RuntimeError("UpdateStats.after without a matching before")
        return weight_update_stats(params, snap, self.eta)

    def reset(self) -> None:
        self._snap = None
