"""The reference weights θ₀ for drift (initial weights or a base checkpoint), held within a budget.

θ₀ is always exact (same values and dtype as given): a drift column is either computed honestly or
NULL. What the budget changes is *where* θ₀ lives:
* resident: a full copy next to the parameters (needs ~1× parameter bytes of budget);
* on demand: ``"init"``/``"current"`` are written once to ``<run>/reference/theta0-r<rank>.safetensors``
  and the tensors of each record's window are read back (page cache, then the device) and freed;
  a user state dict or checkpoint path is read the same way without copying it.
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

__all__ = ["LazyRef", "Reference", "build_reference", "normalize_name"]

_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def normalize_name(name: str) -> str:
    """Strip wrapper prefixes (DDP ``module.``, ``torch.compile``, FSDP1) so checkpoints and models match."""
    for p in _PREFIXES:
        name = name.replace(p, "")
    return name


class Reference:
    """θ₀ by parameter name. ``get(name, like)`` returns it on ``like``'s device, or None if not held."""

    def __init__(self, kind: str, loader: Callable[[str], Tensor | None], names: set[str],
                 resident: dict[str, Tensor] | None = None, path: Path | None = None) -> None:
        self.kind, self.path = kind, path
        self._loader, self._names, self._resident = loader, names, resident

    @property
    def resident(self) -> bool:
        return self._resident is not None

    def has(self, name: str) -> bool:
        return normalize_name(name) in self._names

    def get(self, name: str, like: Tensor) -> Tensor | None:
        key = normalize_name(name)
        if key not in self._names:
            return None
        t = self._resident[key] if self._resident is not None else self._loader(key)
        if t is None or tuple(t.shape) != tuple(like.shape):
            return None
        return t.to(like.device, non_blocking=True) if t.device != like.device else t


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


def _load_file(path: Path) -> tuple[Callable[[str], Tensor | None], set[str]]:
    if path.suffix == ".safetensors":
        return _pread_safetensors(path)
    obj: Any = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    for wrapper in ("state_dict", "model", "module"):
        if isinstance(obj, Mapping) and isinstance(obj.get(wrapper), Mapping):
            obj = obj[wrapper]
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: expected a state dict, got {type(obj).__name__}")
    return _dict_loader(obj)


def _pread_safetensors(path: Path) -> tuple[Callable[[str], Tensor | None], set[str]]:
    """Read single tensors of a safetensors file with ``pread``, not mmap: mapped pages would count in
    the training process's resident memory as the window rotates, while pread leaves them to the page
    cache, which the kernel may drop under pressure."""
    from dynascope.importers.checkpoint_io import _ST_DTYPES as dtypes

    fd = os.open(path, os.O_RDONLY)
    (hlen,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    header = json.loads(os.pread(fd, hlen, 8))
    header.pop("__metadata__", None)
    by_norm = {normalize_name(k): k for k in header}

    def load(key: str) -> Tensor | None:
        if key not in by_norm:
            return None
        info = header[by_norm[key]]
        lo, hi = info["data_offsets"]
        buf = bytearray(os.pread(fd, hi - lo, 8 + hlen + lo))
        dtype = dtypes[info["dtype"]]
        if not buf:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])

    weakref.finalize(load, os.close, fd)  # the file stays open exactly as long as its loader
    return load, set(by_norm)


def _dict_loader(sd: Mapping[str, Any]) -> tuple[Callable[[str], Tensor | None], set[str]]:
    by_norm = {normalize_name(k): v for k, v in sd.items() if isinstance(v, Tensor)}
    return (lambda key: by_norm.get(key)), set(by_norm)


def build_reference(spec: Any, named: list[tuple[str, Tensor]], run_dir: Path, rank: int,
                    resident: bool) -> Reference | None:
    """θ₀ from ``spec``: ``"init"``/``"current"`` (the weights now), a state dict, a path, or None."""
    if spec is None:
        return None
    if isinstance(spec, str) and spec in ("init", "current"):
        if resident:
            held = {normalize_name(n): t.detach().clone() for n, t in named}
            return Reference(spec, held.get, set(held), resident=held)
        path = Path(run_dir) / "reference" / f"theta0-r{rank}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        from dynascope.importers.checkpoint_io import write_safetensors

        # Streamed tensor by tensor: serialising the whole state dict at once would briefly hold a
        # second full copy of the model in host memory, which is exactly what the budget forbids.
        detached = [(normalize_name(n), t.detach()) for n, t in named]
        write_safetensors(path, [(n, tuple(t.shape), t.dtype) for n, t in detached], (t for _, t in detached))
        loader, names = _load_file(path)
        return Reference(spec, loader, names, path=path)
    if isinstance(spec, Mapping):
        loader, names = _dict_loader(spec)
        kind = "state_dict"
    elif isinstance(spec, (str, os.PathLike)):
        path = Path(spec).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"reference checkpoint {path} does not exist")
        loader, names = _load_file(path)
        kind = "path"
    else:
        raise ValueError(f"reference must be 'init', 'current', None, a state dict or a path; got {spec!r}")
    if resident:
        by_name = {normalize_name(n): t for n, t in named}
        held = {}
        for k in names:
            t = loader(k)
            if t is not None and k in by_name:
                held[k] = t.to(by_name[k].device).clone()
        return Reference(kind, held.get, set(held), resident=held)
    return Reference(kind, loader, names)
