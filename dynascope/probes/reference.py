"""The reference weights θ₀ for drift (initial weights or a base checkpoint), held within a budget.

θ₀ is always exact (same values and dtype as given): a drift column is either computed honestly or
NULL. What the budget changes is *where* θ₀ lives:
* resident: a full copy next to the parameters (needs ~1× parameter bytes of budget);
* on demand: ``"init"`` (the weights when it is set) is written once to ``<run>/reference/theta0-r<rank>.safetensors``
  and the tensors of each record's window are read back one chunk at a time (page cache, then the
  device) and freed; a user state dict or checkpoint path is read the same way without copying it.
So ``memory_budget`` bounds device memory, and ``ref_covered`` says which tensors had θ₀ at a record.
"""

from __future__ import annotations

import json
import os
import struct
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dynascope.core.naming import normalize_name

__all__ = ["LazyRef", "Reference", "build_reference", "pread_source", "whole_source"]


class _Source:
    """θ₀ tensors by normalized name: their shapes, and flat element ranges read on demand."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Callable[[str, int, int], Tensor]) -> None:
        self.shapes, self.read = shapes, read


class Reference:
    """θ₀ by parameter name. ``get(name, like)`` returns it on ``like``'s device, or None if not held;
    ``reader(name, like)`` gives flat element ranges instead, so drift can stream θ₀ a chunk at a time."""

    def __init__(self, kind: str, source: _Source, resident: dict[str, Tensor] | None = None,
                 path: Path | None = None) -> None:
        self.kind, self.path = kind, path
        self._source, self._resident = source, resident

    @property
    def resident(self) -> bool:
        return self._resident is not None

    def has(self, name: str) -> bool:
        return normalize_name(name) in self._source.shapes

    def reader(self, name: str, like: Tensor) -> Callable[[int, int], Tensor] | None:
        """``read(lo, hi)``: θ₀'s flat elements ``[lo, hi)`` on ``like``'s device; None when θ₀ of
        ``name`` is not held or its shape differs from ``like``'s."""
        key = normalize_name(name)
        if tuple(self._source.shapes.get(key, (-1,))) != tuple(like.shape):
            return None
        read, device = self._source.read, like.device

        def chunk(lo: int, hi: int) -> Tensor:
            t = read(key, lo, hi)
            return t.to(device, non_blocking=True) if t.device != device else t
        return chunk

    def get(self, name: str, like: Tensor) -> Tensor | None:
        read = self.reader(name, like)
        return None if read is None else read(0, like.numel()).reshape(like.shape)


class LazyRef:
    """A θ₀ tensor read only when used (``.detach()``), so a probe can check shapes of every tensor
    without loading them all — the spectral probe asks for θ₀ of every 2-D weight, uses a few."""

    def __init__(self, ref: Reference, name: str, like: Tensor) -> None:
        self._ref, self._name, self._like = ref, name, like
        self.shape = like.shape

    def detach(self) -> Tensor:
        t = self._ref.get(self._name, self._like)
        if t is None:
            raise KeyError(f"θ₀ of {self._name} is not held")
        return t


def _load_file(path: Path) -> _Source:
    if path.suffix == ".safetensors":
        return pread_source(path)
    obj: Any = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    for wrapper in ("state_dict", "model", "module"):
        if isinstance(obj, Mapping) and isinstance(obj.get(wrapper), Mapping):
            obj = obj[wrapper]
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: expected a state dict, got {type(obj).__name__}")
    return _dict_source(obj)


def _kept_init(run_dir: Path, rank: int, named: list[tuple[str, Tensor]]) -> Reference | None:
    """The θ₀ an earlier process of this rank wrote, if it holds every tensor with its shape."""
    path = Path(run_dir) / "reference" / f"theta0-r{rank}.safetensors"
    try:
        source = pread_source(path) if path.exists() else None
    except (OSError, ValueError):
        return None
    want = {normalize_name(n): tuple(t.shape) for n, t in named}
    if source is None or any(tuple(source.shapes.get(k, (-1,))) != s for k, s in want.items()):
        return None
    return Reference("init (kept)", source, path=path)


def pread_source(path: Path) -> _Source:
    """Read element ranges of a safetensors file with ``preadv`` straight into a fresh tensor, not mmap:
    mapped pages would count in the training process's resident memory as the window rotates, while
    pread leaves them to the page cache, which the kernel may drop under pressure."""
    from dynascope.core.tensor_io import SAFETENSORS_DTYPES as dtypes

    fd = os.open(path, os.O_RDONLY)
    (hlen,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    header = json.loads(os.pread(fd, hlen, 8))
    header.pop("__metadata__", None)
    by_norm = {normalize_name(k): header[k] for k in header}

    def read(key: str, lo: int, hi: int) -> Tensor:
        info = by_norm[key]
        dtype = dtypes[info["dtype"]]
        out = torch.empty(max(hi - lo, 0), dtype=dtype)
        if out.numel():
            size = out.element_size()
            _pread_into(fd, out.view(torch.uint8).numpy(), 8 + hlen + info["data_offsets"][0] + lo * size)
        return out

    source = _Source({k: tuple(v["shape"]) for k, v in by_norm.items()}, read)
    weakref.finalize(source, os.close, fd)  # the file stays open exactly as long as its source
    return source


def _pread_into(fd: int, buf: Any, offset: int) -> None:
    view, done = memoryview(buf).cast("B"), 0
    while done < len(view):  # a regular file reads fully, but a short read is legal: finish it
        n = os.preadv(fd, [view[done:]], offset + done) if hasattr(os, "preadv") else _pread_copy(
            fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"θ₀ file ended early at byte {offset + done}")
        done += n


def _pread_copy(fd: int, view: memoryview, offset: int) -> int:
    data = os.pread(fd, len(view), offset)  # platforms without preadv: one extra chunk-sized copy
    view[:len(data)] = data
    return len(data)


def _dict_source(sd: Mapping[str, Any]) -> _Source:
    by_norm = {normalize_name(k): v for k, v in sd.items() if isinstance(v, Tensor)}
    return _Source({k: tuple(t.shape) for k, t in by_norm.items()},
                   lambda key, lo, hi: by_norm[key].detach().reshape(-1)[lo:hi])


def whole_source(spec: Any) -> tuple[_Source, str]:
    """(source, kind) of a θ₀ given as whole tensors: a state dict or a checkpoint path."""
    if isinstance(spec, Mapping):
        return _dict_source(spec), "state_dict"
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"reference checkpoint {path} does not exist")
        return _load_file(path), "path"
    raise ValueError(f"reference must be 'init', None, a state dict or a path; got {spec!r}")


def build_reference(spec: Any, named: list[tuple[str, Tensor]], run_dir: Path, rank: int,
                    resident: bool, resume: bool = False) -> Reference | None:
    """θ₀ from ``spec``: ``"init"`` (the weights now), a state dict, a path, or None.

    ``resume``: this process restarts a rank of the run (``store.lineage``). ``"init"`` then keeps the θ₀
    the first process wrote (``reference/theta0-r<rank>.safetensors``) where its tensors match, so drift
    still measures from the run's start, not from the resumed weights."""
    if spec is None:
        return None
    kept = _kept_init(run_dir, rank, named) if resume and isinstance(spec, str) and spec == "init" else None
    if kept is not None:
        return kept
    if isinstance(spec, str) and spec == "init":
        if resident:
            held = {normalize_name(n): t.detach().clone() for n, t in named}
            return Reference(spec, _dict_source(held), resident=held)
        path = Path(run_dir) / "reference" / f"theta0-r{rank}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        from dynascope.core.tensor_io import write_safetensors

        # Streamed tensor by tensor: serialising the whole state dict at once would briefly hold a
        # second full copy of the model in host memory, which is exactly what the budget forbids.
        detached = [(normalize_name(n), t.detach()) for n, t in named]
        write_safetensors(path, [(n, tuple(t.shape), t.dtype) for n, t in detached], (t for _, t in detached))
        return Reference(spec, _load_file(path), path=path)
    source, kind = whole_source(spec)
    if resident:
        by_name = {normalize_name(n): t for n, t in named}
        held = {}
        for k, shape in source.shapes.items():
            if k in by_name:
                flat = source.read(k, 0, torch.Size(shape).numel())
                held[k] = flat.to(by_name[k].device).reshape(shape).clone()
        return Reference(kind, _dict_source(held), resident=held)
    return Reference(kind, source)
