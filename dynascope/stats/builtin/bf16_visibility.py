"""PULSE's bf16 visibility of updates (Miahi & Belilovsky, arXiv 2602.03839): S₁ and S_k.

S₁(t) is the share of elements whose bf16 cast is bitwise identical before and after one optimizer step,
S_k(t) the same against the weights k steps back: 1/d Σᵢ 1[bf16(θ_{t}ⁱ) = bf16(θ_{t−k}ⁱ)], whatever the
master dtype (fp32 masters are cast with PyTorch's round-to-nearest-even, as a bf16 forward pass or a
bf16 weight sync casts them). An update smaller than half a bf16 ulp of its weight is invisible to the
next bf16 forward pass; the paper finds ~99% of per-step RL updates are.

The whole definition is one comparison per element of the bf16 bit patterns (``<input>_key``: PyTorch's
round-to-nearest-even cast, every NaN to one pattern, as the cast of a tensor gives it; a bf16 input's
key is its own bits). S_k reads the ``k_snapshot`` input: the
bf16 casts of the weights at step t − k, which the live probe holds (``probes.snapshots.Bf16History``)
for every tensor at the records k steps after a snapshot, and ``dynascope diff`` takes from the
checkpoint k steps back; ``bf16_k_steps`` (k) is filled by whoever holds that snapshot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynascope.stats.base import I32, Column, Figure, Statistic, count, frac

if TYPE_CHECKING:
    from torch import Tensor


def s1(ops: Any, new_key: Any, old_key: Any) -> tuple[Any]:
    # Bits, not values: +0 and −0 differ; every NaN has the one pattern PyTorch's cast of a tensor gives it.
    return (new_key == old_key,)


def s_k(ops: Any, new_key: Any, k_snapshot_key: Any) -> tuple[Any]:
    return (new_key == k_snapshot_key,)  # the snapshot is already bf16: its key is its bits


def bf16_unchanged_count(a: Tensor, b: Tensor) -> list[Tensor]:
    """[count] (0-d float64): elements of ``a`` and ``b`` whose bf16 casts have identical bits (S₁'s kernel)."""
    from dynascope.stats.engine import compute

    return [compute((S1,), {"new": a, "old": b})[0]]


S1 = Statistic(
    "bf16_unchanged",
    columns=(count("bf16_unchanged_count", "PULSE S₁: bf16(W_t) bitwise equal to bf16(W_{t−1})", "bf16_unchanged_numel"),
             frac("bf16_unchanged_count", summary=True)),
    outputs=("bf16_unchanged_count",), inputs=("new", "old"), element=s1, transient=(0, 5),  # two bf16 casts, a mask
    figures=(Figure("bf16_unchanged_frac", "unchanged in bf16 (PULSE S₁)", "bf16_unchanged_count",
                    "bf16_unchanged_numel"),))

S_K = Statistic(
    "bf16_unchanged_k",
    columns=(count("bf16_unchanged_k_count", "PULSE S_k: bf16(W_t) bitwise equal to bf16(W_{t−k})",
                   "bf16_unchanged_k_numel"),
             frac("bf16_unchanged_k_count"),
             Column("bf16_k_steps", I32, "steps", "first", pool=(("bf16_k_steps", "max", None),), doc="k of S_k")),
    # Every tensor the snapshot holds, at the records k steps after it was taken.
    outputs=("bf16_unchanged_k_count",), inputs=("new", "k_snapshot"), element=s_k, tier="every", transient=(0, 5))

STATISTICS = (S1, S_K)
