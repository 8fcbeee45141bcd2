"""Update sparsity against the base weights, as Mukherjee et al. (2025) measure it.

"Reinforcement Learning Finetunes Small Subnetworks in Large Language Models" (arXiv 2505.11711), script
``src/check_sparsity.py`` of github.com/SagnikMukherjee/sparsity_in_rl: both models are loaded in bf16
(``torch_dtype=bfloat16``, its default), ``delta = rl − base`` is taken in bf16, and

* an element is *unchanged* when ``torch.isclose(delta, 0, atol=1e-5)`` (default ``rtol=1e-5``, which a
  zero target makes irrelevant): |Δ| ≤ 1e-5, where, Δ being bf16, the bound is the bf16 nearest to 1e-5
  (1.00136e-5), so a bf16 Δ of 1.00136e-5 is unchanged and the next one up (1.00732e-5) is not;
* the exact-zero share is ``delta == 0`` (PyTorch keeps subnormals, so this is the share of elements whose
  bf16 casts are equal).

"Update sparsity" in the paper is the unchanged share. ``drift_sparsity`` is the whole definition, per
element: Δ is the fp32 difference of the two bf16 values rounded to bf16, which is how PyTorch subtracts
two bf16 tensors, and ``isclose``'s bound is compared in bf16's values; the live probe (drift against θ₀) and ``dynascope diff`` (each checkpoint against BASE) run it.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from dynascope.stats.base import Figure, Statistic, count, frac

if TYPE_CHECKING:
    from torch import Tensor

DRIFT_ATOL = 1e-5  # the paper's tolerance (``--tolerances`` default of check_sparsity.py)


def _bf16_nearest(x: float) -> float:
    """``x`` as the bf16 value nearest its fp32 value (round to nearest even), as a Python float."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


# isclose(Δ, 0, atol) on bf16 Δ: |Δ| ≤ atol + rtol·|0|, that bound itself a bf16 value (1.00136e-5).
DRIFT_ATOL_BF16 = _bf16_nearest(DRIFT_ATOL)


def drift_sparsity(ops: Any, ref_key: Any, new_key: Any) -> tuple[Any, Any]:
    """Unchanged (``isclose(Δ, 0, atol=1e-5)``) and exact zero (Δ == 0) for Δ = bf16(ref) − bf16(new)."""
    delta = ops.bf16_round(ops.bf16_value(ref_key) - ops.bf16_value(new_key))
    zero = delta == 0
    return zero | (abs(delta) <= DRIFT_ATOL_BF16), zero  # NaN and ±Inf: never close


def drift_sparsity_counts(a: Tensor, b: Tensor) -> list[Tensor]:
    """[unchanged, exact zero] element counts (0-d float64) of Δ = bf16(a) − bf16(b), symmetric in a, b."""
    from dynascope.stats.engine import compute

    return list(compute((DRIFT_SPARSITY,), {"ref": a, "new": b}).unbind())


DRIFT_SPARSITY = Statistic(
    "drift_sparsity",
    columns=(count("drift_unchanged_count", "Mukherjee et al.: isclose(bf16(W_t) − bf16(W₀), 0, atol=1e-5)"),
             frac("drift_unchanged_count", summary=True),
             count("drift_zero_count", "bf16(W_t) − bf16(W₀) == 0"), frac("drift_zero_count")),
    outputs=("drift_unchanged_count", "drift_zero_count"), inputs=("ref", "new"), element=drift_sparsity,
    transient=(4, 8),  # on chunk tensors: the two casts and their fp32 values, Δ; the masks
    figures=(Figure("drift_unchanged_frac", "unchanged vs θ₀ in bf16 (Mukherjee et al.)", "drift_unchanged_count",
                    "drift_numel"),))

STATISTICS = (DRIFT_SPARSITY,)
