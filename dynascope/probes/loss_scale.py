"""The loss scale of mixed-precision training, as the gradient statistics see it.

``torch.amp.GradScaler`` multiplies the loss by a scale S, so every ``.grad`` is S·g. Before a plain
optimizer's step it unscales ``.grad`` in place (``unscale_``), and the probe's pre-hook reads g. A fused
optimizer (``Adam(fused=True)``) instead gets S as ``optimizer.grad_scale`` and unscales inside its
kernel, so the pre-hook reads S·g: its norms and max |g| are divided by S here, on device; the counts
(zero, near-zero relative to the same tensor's rms, NaN, Inf) do not depend on S. A step the scaler
found Inf in is a no-op of the fused kernel (``optimizer.found_inf``): its update statistics are NULL.
"""

from __future__ import annotations

from typing import Any

import torch

from dynascope.probes.protocol import StepContext
from dynascope.stats.registry import REGISTRY

__all__ = ["Unscale", "loss_scale"]


def loss_scale(optimizer: Any, kwargs: dict | None) -> tuple[Any, Any, str | None]:
    """At the pre-hook: the loss scale still in ``.grad``, the scaler's found-Inf flag, and why the scale
    cannot be known (else None).

    ``torch.amp.GradScaler.step`` unscales ``.grad`` in place before a plain optimizer's step; a fused one
    (``Adam(fused=True)``) instead gets ``optimizer.grad_scale`` and ``optimizer.found_inf`` and unscales
    inside its kernel, so at the pre-hook the gradients are still multiplied by the scale. (After a manual
    ``scaler.unscale_``, ``grad_scale`` is unset and the gradients are already unscaled.) An optimizer that
    takes the scaler itself (``step(grad_scaler=...)``) decides on its own whether and when it unscales.
    """
    if (kwargs or {}).get("grad_scaler") is not None:
        return None, None, (f"{type(optimizer).__name__}.step() got the GradScaler itself, so the scale of its "
                            "gradients is not known: grad_norm and grad_max_abs are NULL")
    scale = getattr(optimizer, "grad_scale", None)
    return scale, getattr(optimizer, "found_inf", None) if scale is not None else None, None


class Unscale:
    """The gradient statistics of one record as the unscaled gradient's: the values that scale with g
    (norms, max |g|; the counts do not) divided on device by the loss scale still in ``.grad``
    (``StepContext.grad_scale``), or NaN (NULL) where that scale is not known."""

    def __init__(self, ctx: StepContext, device: torch.device) -> None:
        self.unknown = ctx.scale_unknown is not None
        scale = ctx.grad_scale
        self.scale = None if scale is None or self.unknown else torch.as_tensor(scale).to(device, torch.float64)

    def __call__(self, columns: tuple[str, ...], values: torch.Tensor) -> torch.Tensor:
        if self.scale is None and not self.unknown:
            return values
        scaled = [j for j, c in enumerate(columns) if not REGISTRY.column[c].integer]
        if not scaled:
            return values
        out = values.to(torch.float64).clone()
        out[:, scaled] = float("nan") if self.unknown else out[:, scaled] / self.scale
        return out
