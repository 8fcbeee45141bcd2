"""Statistics declared outside dynascope (named in ``DYNASCOPE_STATISTICS``), one reading the weights
before and after the step and one reading the gradient: the DeepSpeed tests record them under ZeRO to
show that a statistic added later needs no code for the engine (tests/test_deepspeed.py)."""

from __future__ import annotations

from dynascope.stats import Column, Statistic
from dynascope.stats.base import F64


def update_l1(x):  # type: ignore[no-untyped-def]
    import torch

    return [torch.sum(torch.abs(x.new.double() - x.old.double()))]


def grad_l1(x):  # type: ignore[no-untyped-def]
    import torch

    return [torch.sum(torch.abs(x.grad.double()))]


STATISTICS = (
    Statistic("test_update_l1", columns=(Column("test_update_l1", F64, reduce="sum", doc="Σ|W_t − W_{t−1}|"),),
              outputs=("test_update_l1",), inputs=("new", "old"), kernel=update_l1, transient=(3, 0)),
    Statistic("test_grad_l1", columns=(Column("test_grad_l1", F64, reduce="sum", doc="Σ|g|"),),
              outputs=("test_grad_l1",), inputs=("grad",), kernel=grad_l1, transient=(2, 0)),
)
