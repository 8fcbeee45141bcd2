"""PULSE's bf16 visibility of updates (Miahi & Belilovsky, arXiv 2602.03839): S₁ and S_k.

S₁(t) is the share of elements whose bf16 cast is bitwise identical before and after one optimizer step,
S_k(t) the same against the weights k steps back: 1/d Σᵢ 1[bf16(θ_{t}ⁱ) = bf16(θ_{t−k}ⁱ)], whatever the
master dtype (fp32 masters are cast with PyTorch's round-to-nearest-even, as a bf16 forward pass or a
bf16 weight sync casts them). An update smaller than half a bf16 ulp of its weight is invisible to the
next bf16 forward pass; the paper finds ~99% of per-step RL updates are.

``bf16_unchanged_count`` is the whole definition, per flat chunk. S_k reads the ``k_snapshot`` input: the
bf16 casts of the weights at step t − k, which the live probe holds (``probes.snapshots.Bf16History``)
for every tensor at the records k steps after a snapshot, and ``dynascope diff`` takes from the
checkpoint k steps back; ``bf16_k_steps`` (k) is filled by whoever holds that snapshot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynascope.stats.base import I32, Chunk, Column, Figure, Statistic, count, frac

if TYPE_CHECKING:
    from torch import Tensor


def bf16_unchanged_count(a: Tensor, b: Tensor) -> list[Tensor]:
    """[count] (0-d int64): elements whose bf16 casts of ``a`` and ``b`` have identical bits.

    Bits, not values: +0 and −0 differ, and a NaN equals itself when its payload does.
    """
    import torch

    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
    return [torch.count_nonzero(ab.view(torch.int16) == bb.view(torch.int16))]


def s1(x: Chunk) -> list[Tensor]:
    return bf16_unchanged_count(x.new, x.old)


def s_k(x: Chunk) -> list[Tensor]:
    return bf16_unchanged_count(x.new, x.k_snapshot)  # the snapshot is already bf16: its cast is itself


S1 = Statistic(
    "bf16_unchanged",
    columns=(count("bf16_unchanged_count", "PULSE S₁: bf16(W_t) bitwise equal to bf16(W_{t−1})", "bf16_unchanged_numel"),
             frac("bf16_unchanged_count", summary=True)),
    outputs=("bf16_unchanged_count",), inputs=("new", "old"), kernel=s1, transient=(0, 5),  # two bf16 casts, a mask
    figures=(Figure("bf16_unchanged_frac", "unchanged in bf16 (PULSE S₁)", "bf16_unchanged_count",
                    "bf16_unchanged_numel"),))

S_K = Statistic(
    "bf16_unchanged_k",
    columns=(count("bf16_unchanged_k_count", "PULSE S_k: bf16(W_t) bitwise equal to bf16(W_{t−k})",
                   "bf16_unchanged_k_numel"),
             frac("bf16_unchanged_k_count"),
             Column("bf16_k_steps", I32, "steps", "first", pool=(("bf16_k_steps", "max", None),), doc="k of S_k")),
    # Every tensor the snapshot holds, at the records k steps after it was taken.
    outputs=("bf16_unchanged_k_count",), inputs=("new", "k_snapshot"), kernel=s_k, tier="every", transient=(0, 5))

STATISTICS = (S1, S_K)
