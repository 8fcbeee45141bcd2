"""PULSE's bf16 visibility of updates (Miahi & Belilovsky, arXiv 2602.03839): S₁ and S_k.

S₁(t) is the share of elements whose bf16 cast is bitwise identical before and after one optimizer step,
S_k(t) the same against the weights k steps back: 1/d Σᵢ 1[bf16(θ_{t}ⁱ) = bf16(θ_{t−k}ⁱ)], whatever the
master dtype (fp32 masters are cast with PyTorch's round-to-nearest-even, as a bf16 forward pass or a
bf16 weight sync casts them). An update smaller than half a bf16 ulp of its weight is invisible to the
next bf16 forward pass; the paper finds ~99% of per-step RL updates are.

``bf16_unchanged_count`` is the whole definition, per flat chunk; the live probe calls it on the pre-step
snapshot and the post-step weights (S₁) and on the snapshot held by ``Bf16History`` (S_k), and
``dynascope diff`` calls it on consecutive checkpoints and on checkpoints k steps apart.

``Bf16History`` holds the bf16 casts of step t−k like θ₀ is held: resident (next to the parameters) when
the memory budget covers it beside a full window, otherwise written tensor by tensor to
``<run>/reference/bf16-k-r<rank>.safetensors`` and read back one chunk at a time. A snapshot is taken
only at a step s whose s + k the schedule records, and dropped once compared (or once that step passed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from dynascope.core.tensor_io import write_safetensors

__all__ = ["Bf16History", "bf16_unchanged_count"]


def bf16_unchanged_count(a: Tensor, b: Tensor) -> list[Tensor]:
    """[count] (0-d int64): elements whose bf16 casts of ``a`` and ``b`` have identical bits.

    Bits, not values: +0 and −0 differ, and a NaN equals itself when its payload does.
    """
    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
    return [torch.count_nonzero(ab.view(torch.int16) == bb.view(torch.int16))]


class Bf16History:
    """The bf16 casts of the weights at one earlier step, for S_k (see the module docstring).

    ``take(step, named, resident)`` replaces the snapshot; ``reader(name, like)`` gives flat bf16 ranges on
    ``like``'s device; ``step`` is the step whose post-step weights are held (None: none held).
    """

    def __init__(self, k: int, path: Path) -> None:
        if int(k) < 1:
            raise ValueError(f"bf16_k needs k >= 1, got {k}")
        self.k, self.path = int(k), Path(path)
        self.step: int | None = None
        self._read: dict[str, Callable[[int, int], Tensor]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.resident_bytes = 0

    def due(self, step: int) -> bool:
        """Whether the snapshot held is exactly k steps before ``step``."""
        return self.step is not None and step - self.step == self.k

    def drop(self) -> None:
        self.step, self._read, self._shapes, self.resident_bytes = None, {}, {}, 0

    @torch.no_grad()
    def take(self, step: int, named: list[tuple[str, Tensor]], resident: bool) -> None:
        """Hold bf16 casts of ``named`` (normalised name, tensor) as the weights of ``step``."""
        from dynascope.probes.reference import pread_source  # θ₀'s chunked reader, shared

        self.drop()
        self._shapes = {n: tuple(t.shape) for n, t in named}
        if resident:
            held = {n: t.detach().to(torch.bfloat16, copy=True).reshape(-1) for n, t in named}
            self._read = {n: (lambda lo, hi, f=f: f[lo:hi]) for n, f in held.items()}
            self.resident_bytes = sum(f.numel() * 2 for f in held.values())
        else:
            # Tensor by tensor, so at most one tensor's bf16 copy is in host memory at a time.
            write_safetensors(self.path, [(n, tuple(t.shape), torch.bfloat16) for n, t in named],
                              (t.detach().to(torch.bfloat16) for _, t in named))
            source = pread_source(self.path)
            self._read = {n: (lambda lo, hi, n=n: source.read(n, lo, hi)) for n in self._shapes}
        self.step = int(step)

    def reader(self, name: str, like: Tensor) -> Callable[[int, int], Tensor] | None:
        """``read(lo, hi)``: the held bf16 elements ``[lo, hi)`` of ``name`` on ``like``'s device, or None
        when ``name`` is not held or its shape differs from ``like``'s."""
        read = self._read.get(name)
        if read is None or self._shapes.get(name) != tuple(like.shape):
            return None
        device = like.device

        def chunk(lo: int, hi: int) -> Tensor:
            t = read(lo, hi)
            return t.to(device, non_blocking=True) if t.device != device else t
        return chunk
