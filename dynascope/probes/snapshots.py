"""The copies of earlier weights the statistics compare against: the pre-step snapshot and S_k's bf16 one.

``StepSnapshot`` holds the window's weights as they were before the optimizer step (the ``old`` input of
the update statistics), carved from a ``SnapshotArena`` on the host. ``Bf16History`` holds the bf16 casts
of every weight at step t − k (the ``k_snapshot`` input of PULSE's S_k) the way θ₀ is held: resident
(next to the parameters) when the memory budget covers it beside a full window, otherwise written tensor
by tensor to ``<run>/reference/bf16-k-r<rank>.safetensors`` and read back one chunk at a time. An S_k
snapshot is taken only at a step s whose s + k the schedule records, and dropped once compared (or once
that step passed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from dynascope.core.tensor_io import write_safetensors

__all__ = ["Bf16History", "SnapshotArena", "StepSnapshot"]


class SnapshotArena:
    """Host memory for the pre-step snapshots: one flat buffer that every window's snapshot is carved
    from, kept between windows and grown only when a window needs more than any before.

    Why not a fresh buffer per window on CPU: glibc returns a freed multi-MiB block to the OS (trim or
    munmap), so every window's snapshot was faulted in again page by page, and blocks held across the
    optimizer step and then freed reshaped the heap the training step allocates from. A buffer that stays
    put costs its pages once; its size is the largest window's snapshot, within ``memory_budget``.
    Accelerator snapshots stay per window: the caching allocator reuses their blocks without faults, and
    freeing them after the step leaves that memory to the next forward's activations.
    """

    ALIGN = 64  # bytes: every view starts aligned for any dtype and for vectorised kernels

    def __init__(self) -> None:
        self._buf: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def views(self, params: list[Tensor]) -> list[Tensor]:
        """Contiguous uninitialised tensors shaped and typed like ``params``, on their devices (views of
        the buffer for host tensors, fresh ones elsewhere)."""
        sizes = [p.numel() * p.element_size() if p.device.type == "cpu" else -1 for p in params]
        offsets, need = [], 0
        for n in sizes:
            offsets.append(need)
            need += -(-max(n, 0) // self.ALIGN) * self.ALIGN
        buf = self._buf
        if buf is None or buf.numel() < need:
            buf = self._buf = None  # free the smaller buffer before allocating its successor
            buf = self._buf = torch.empty(need, dtype=torch.uint8)
        return [torch.empty(p.shape, dtype=p.dtype, device=p.device) if n < 0 else
                buf[off:off + n].view(p.dtype).view(p.shape)
                for p, n, off in zip(params, sizes, offsets, strict=True)]

    def release(self) -> None:
        self._buf = None


class StepSnapshot:
    """The window's weights before one optimizer step: ``take(params)`` copies them, ``pop()`` hands the
    copies to the update statistics once the step is done. The extra memory is the largest window taken
    (the probe's budget sizes it) plus, on the host, nothing more: the copies live in a ``SnapshotArena``."""

    def __init__(self) -> None:
        self.arena = SnapshotArena()
        self._snap: list[Tensor] | None = None
        self._carried: tuple[list[Tensor], list[tuple[int, int, int]]] | None = None
        self._carrying: tuple[list[Tensor], list[tuple[int, int, int]]] | None = None

    @property
    def pending(self) -> bool:
        return self._snap is not None

    @torch.no_grad()
    def take(self, params: list[Tensor], before_copy: Callable[[], None] | None = None) -> None:
        """Copy ``params`` (before the optimizer step), unless ``carry`` copied exactly these since their
        last change: every in-place write bumps a tensor's version counter, the optimizer's included.
        ``before_copy`` runs before the arena is written (the spectra may still be reading the carried copies)."""
        carried, self._carried = self._carried, None
        if carried is not None and carried[1] == _identity(params) and all(
                c.shape == p.shape and c.dtype == p.dtype for c, p in zip(carried[0], params, strict=True)):
            self._snap = carried[0]
            return
        if before_copy is not None:
            before_copy()
        self._snap = self.arena.views(params)
        if params:
            torch._foreach_copy_(self._snap, params)

    def carry_views(self, params: list[Tensor]) -> list[Tensor]:
        """The arena's views for ``params``, which the caller fills with them now (the post-step pass, as it
        reads the previous copy there) and then hands to the next ``take`` with ``carried``: with every
        tensor recorded at every step, the next pre-step snapshot is these weights unless something writes
        them before that step, which ``take`` sees by their versions."""
        self._carrying = (self.arena.views(params), _identity(params))  # identity first: a write after it shows
        return self._carrying[0]

    def carried(self) -> None:
        """The views of ``carry_views`` are filled: the next ``take`` may use them."""
        self._carried, self._carrying = self._carrying, None

    def pop(self, expected: int) -> list[Tensor]:
        """The copies of the ``expected`` tensors taken before the step (the pending snapshot is cleared)."""
        snap, self._snap = self._snap, None
        if snap is None or len(snap) != expected:
            raise RuntimeError("StepSnapshot.pop without a matching take")
        return snap

    def reset(self) -> None:
        self._snap = self._carried = self._carrying = None

    def close(self) -> None:
        """Drop the pending snapshot and give the arena's memory back."""
        self._snap = self._carried = self._carrying = None
        self.arena.release()


def _identity(params: list[Tensor]) -> list[tuple[int, int, int]]:
    """What says a tensor's data is unchanged: its version counter, storage address and element count."""
    return [(p._version, p.data_ptr(), p.numel()) for p in params]


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
        self._held: dict[str, Tensor] = {}
        self._spare: dict[str, Tensor] = {}

    def due(self, step: int) -> bool:
        """Whether the snapshot held is exactly k steps before ``step``."""
        return self.step is not None and step - self.step == self.k

    def wanted(self, step: int, schedule: Callable[[int], bool]) -> bool:
        """A snapshot is needed at ``step``: none is held (or the one held is used up) and ``schedule``
        records step + k."""
        return (self.step is None or step - self.step >= self.k) and bool(schedule(step + self.k))

    def refresh(self, step: int, schedule: Callable[[int], bool], named: Callable[[], list[tuple[str, Tensor]]],
                resident: Callable[[], bool]) -> bool:
        """At ``step``: drop the snapshot once used up, take the next one if ``wanted`` (of ``named()``,
        resident if ``resident()`` says the budget holds it, else on disk). Returns whether one was taken."""
        if self.step is not None and step - self.step >= self.k:
            self._spare = self._held
            self.drop()
        try:
            if not self.wanted(step, schedule):
                return False
            self.take(step, named(), resident())
            return True
        finally:
            self._spare = {}

    def buffers(self, step: int, schedule: Callable[[int], bool], named: list[tuple[str, Tensor]],
                resident: Callable[[], bool]) -> dict[str, Tensor] | None:
        """Flat bf16 buffers for the snapshot ``refresh`` would take at ``step`` when it is held in memory (the
        used-up snapshot's, where they fit), for the caller to fill with the casts of ``named`` and hand to
        ``adopt``; None when no resident snapshot is due."""
        if not self.wanted(step, schedule) or not resident():
            return None
        out = {}
        for n, t in named:
            buf = self._held.get(n)
            out[n] = buf if buf is not None and buf.numel() == t.numel() and buf.device == t.device else torch.empty(
                t.numel(), dtype=torch.bfloat16, device=t.device)
        return out

    def adopt(self, step: int, named: list[tuple[str, Tensor]], held: dict[str, Tensor]) -> None:
        """Hold ``held`` (from ``buffers``, filled) as the bf16 snapshot of ``named`` at ``step``."""
        self.drop()
        self._shapes = {n: tuple(t.shape) for n, t in named}
        self._held = held
        self._read = {n: (lambda lo, hi, f=f: f[lo:hi]) for n, f in held.items()}
        self.resident_bytes = sum(f.numel() * 2 for f in held.values())
        self.step = int(step)

    def drop(self) -> None:
        """Forget the snapshot (``refresh`` keeps its resident buffers for a ``take`` in the same call: a
        fresh 2 bytes per weight at every snapshot were faulted in page by page)."""
        self.step, self._read, self._shapes, self.resident_bytes, self._held = None, {}, {}, 0, {}

    @torch.no_grad()
    def take(self, step: int, named: list[tuple[str, Tensor]], resident: bool) -> None:
        """Hold bf16 casts of ``named`` (normalised name, tensor) as the weights of ``step``."""
        from dynascope.probes.reference import pread_source  # θ₀'s chunked reader, shared

        self.drop()
        self._shapes = {n: tuple(t.shape) for n, t in named}
        if resident:
            spare = self._spare
            held = {}
            for n, t in named:
                buf = spare.get(n)
                if buf is None or buf.numel() != t.numel() or buf.device != t.device:
                    buf = torch.empty(t.numel(), dtype=torch.bfloat16, device=t.device)
                held[n] = buf.copy_(t.detach().reshape(-1))  # PyTorch's cast, into the buffer
            self._held = held
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
