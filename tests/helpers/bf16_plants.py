"""Planted fp32 weight pairs around bf16 rounding boundaries, with their exact counts."""

from __future__ import annotations

import torch

HALF_ULP_AT_1 = 2.0 ** -8  # bf16 has 8 significand bits: its ulp on [1, 2) is 2^-7

# S₁ plant: (old, new) fp32 pairs around the bf16 rounding boundary 1 + 2^-8 between 1.0 and 1.0078125.
S1_PAIRS = [
    (1.0, 1.0 + HALF_ULP_AT_1 - 2 ** -20),  # just under half an ulp: bf16 rounds back to 1.0 → unchanged
    (1.0, 1.0 + HALF_ULP_AT_1 + 2 ** -20),  # just over: bf16 rounds up to 1.0078125 → changed
    (1.0, 1.0 + HALF_ULP_AT_1),  # exactly the tie: round-half-even keeps 1.0 → unchanged
    (1.0 + HALF_ULP_AT_1 - 2 ** -20, 1.0 + HALF_ULP_AT_1 + 2 ** -20),  # a 2e-6 step across it → changed
    (1.0 + 2 ** -14, 1.0 + HALF_ULP_AT_1 - 2 ** -14),  # a 3.8e-3 step inside one bf16 bucket → unchanged
    (-3.0, -3.0),  # no update → unchanged
    (0.5, -0.5),  # sign flip → changed
]
S1_UNCHANGED = 4


def pair(pairs: list[tuple[float, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([a for a, _ in pairs]), torch.tensor([b for _, b in pairs])
