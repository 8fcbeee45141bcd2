"""Update sparsity against the base weights, as Mukherjee et al. (2025) measure it.

"Reinforcement Learning Finetunes Small Subnetworks in Large Language Models" (arXiv 2505.11711), script
``src/check_sparsity.py`` of github.com/SagnikMukherjee/sparsity_in_rl: both models are loaded in bf16
(``torch_dtype=bfloat16``, its default), ``delta = rl − base`` is taken in bf16, and

* an element is *unchanged* when ``torch.isclose(delta, 0, atol=1e-5)`` (default ``rtol=1e-5``, which a
  zero target makes irrelevant): |Δ| ≤ 1e-5, where, Δ being bf16, the bound is the bf16 nearest to 1e-5
  (1.00136e-5), so a bf16 Δ of 1.00136e-5 is unchanged and the next one up (1.00732e-5) is not;
* the exact-zero share is ``delta == 0`` (PyTorch keeps subnormals, so this is the share of elements whose
  bf16 casts are equal).

"Update sparsity" in the paper is the unchanged share. ``drift_sparsity_counts`` is the whole definition,
per chunk; the live probe (drift against θ₀) and ``dynascope diff`` (each checkpoint against BASE) run it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynascope.stats.base import Chunk, Figure, Statistic, count, frac

if TYPE_CHECKING:
    from torch import Tensor

DRIFT_ATOL = 1e-5  # the paper's tolerance (``--tolerances`` default of check_sparsity.py)


def drift_sparsity_counts(a: Tensor, b: Tensor) -> list[Tensor]:
    """[unchanged, exact zero] element counts (0-d int64) of Δ = bf16(a) − bf16(b), symmetric in a, b.

    ``torch.isclose`` and ``==`` on the bf16 difference, exactly as the paper's script computes them.
    Temporaries: the two bf16 casts (none for bf16 inputs), Δ and ``isclose``'s masks, ~10 bytes/element.
    """
    import torch

    delta = a.to(torch.bfloat16) - b.to(torch.bfloat16)  # never in place: a bf16 input's cast is itself
    zero = delta.new_zeros(())
    return [torch.count_nonzero(torch.isclose(delta, zero, atol=DRIFT_ATOL)), torch.count_nonzero(delta == zero)]


def drift_sparsity(x: Chunk) -> list[Tensor]:
    return drift_sparsity_counts(x.ref, x.new)


DRIFT_SPARSITY = Statistic(
    "drift_sparsity",
    columns=(count("drift_unchanged_count", "Mukherjee et al.: isclose(bf16(W_t) − bf16(W₀), 0, atol=1e-5)"),
             frac("drift_unchanged_count", summary=True),
             count("drift_zero_count", "bf16(W_t) − bf16(W₀) == 0"), frac("drift_zero_count")),
    outputs=("drift_unchanged_count", "drift_zero_count"), inputs=("ref", "new"), kernel=drift_sparsity,
    transient=(0, 10),
    figures=(Figure("drift_unchanged_frac", "unchanged vs θ₀ in bf16 (Mukherjee et al.)", "drift_unchanged_count",
                    "drift_numel"),))

STATISTICS = (DRIFT_SPARSITY,)
