"""Lazy, tensor-by-tensor access to checkpoints, and a streaming safetensors writer.

Readers never load a whole state dict: safetensors files are opened with ``safe_open`` (memory-mapped)
and torch ``.pt``/``.bin`` files with ``torch.load(mmap=True, weights_only=True)``, so a model larger
than RAM can be read one tensor at a time. Every failure becomes a one-line ``StoreError``.

Accepted inputs: a ``.safetensors`` file; a folder with ``model.safetensors.index.json`` (sharded HF),
``pytorch_model.bin.index.json``, a single ``*.safetensors`` or a single ``*.bin``/``*.pt``; a torch
``.pt``/``.bin``/``.pth`` state dict (also nested under a ``state_dict`` or ``model`` key).
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import Tensor

from dynascope.core.errors import StoreError, first_line

__all__ = ["SAFETENSORS_DTYPES", "Checkpoint", "open_checkpoint", "write_safetensors"]

# safetensors' dtype codes (the header's "dtype" field) → torch dtypes
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_ST_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_TORCH_SUFFIXES = (".pt", ".bin", ".pth")


class Checkpoint:
    """A read-only view of one checkpoint: names, shapes and dtypes up front, tensors on demand."""

    def __init__(self, path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], loader, closer) -> None:
        self.path = path
        self.specs = specs  # name → (shape, dtype), in file order
        self._loader = loader
        self._closer = closer

    def names(self) -> list[str]:
        return list(self.specs)

    def get(self, name: str) -> Tensor:
        """The tensor ``name`` (read now; the caller drops it when done)."""
        try:
            return self._loader(name)
        except KeyError:
            raise StoreError(f"{self.path}: no tensor named {name!r}") from None
        except Exception as exc:  # a truncated data section surfaces only when the bytes are read
            raise StoreError(f"{self.path}: could not read tensor {name!r}: {first_line(exc)[:200]}") from None

    def close(self) -> None:
        self._closer()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint file or folder lazily; raise ``StoreError`` (one line) if it cannot be used."""
    p = Path(path).expanduser()
    if not p.exists():
        raise StoreError(f"{p}: no such checkpoint file or folder")
    if p.is_dir():
        return _open_folder(p)
    if p.suffix == ".safetensors":
        return _open_safetensors([p], p)
    if p.suffix in _TORCH_SUFFIXES:
        return _open_torch(p)
    raise StoreError(f"{p}: unknown checkpoint format (expected .safetensors, .pt, .bin, .pth or an HF folder)")


def _open_folder(p: Path) -> Checkpoint:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = p / index_name
        if index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                shards = sorted({p / f for f in weight_map.values()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise StoreError(f"{index}: unreadable shard index ({first_line(exc)[:200]})") from None
            missing = [s.name for s in shards if not s.exists()]
            if missing:
                raise StoreError(f"{index}: shard file(s) missing: {', '.join(missing[:5])}")
            if index_name.startswith("model.safetensors"):
                return _open_safetensors(shards, p)
            return _open_torch_shards(shards, p)
    singles = sorted(p.glob("*.safetensors")) or sorted(f for s in _TORCH_SUFFIXES for f in p.glob(f"*{s}"))
    if len(singles) == 1:
        return open_checkpoint(singles[0])
    what = "several checkpoint files but no shard index" if singles else "no checkpoint file"
    raise StoreError(f"{p}: folder holds {what} (expected model.safetensors.index.json or one file)")


def _open_safetensors(files: list[Path], label: Path) -> Checkpoint:
    from safetensors import safe_open

    stack = ExitStack()
    handles, specs, owner = {}, {}, {}
    try:
        for f in files:
            h = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            handles[f] = h
            for name in h.keys():
                sl = h.get_slice(name)
                dtype = SAFETENSORS_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise StoreError(f"{f}: tensor {name!r} has unsupported dtype {sl.get_dtype()}")
                specs[name] = (tuple(sl.get_shape()), dtype)
                owner[name] = h
    except StoreError:
        stack.close()
        raise
    except Exception as exc:
        stack.close()
        raise StoreError(f"{label}: not a readable safetensors checkpoint ({first_line(exc)[:200]})") from None
    return Checkpoint(label, specs, lambda name: owner[name].get_tensor(name), stack.close)


def _load_torch(p: Path) -> dict[str, Tensor]:
    try:
        obj = torch.load(p, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:
        raise StoreError(f"{p}: not a readable torch state dict ({first_line(exc)[:200]})") from None
    for key in ("state_dict", "model"):  # common wrappers around the state dict
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        raise StoreError(f"{p}: holds a {type(obj).__name__}, not a state dict")
    tensors = {k: v for k, v in obj.items() if isinstance(v, Tensor)}
    if not tensors:
        raise StoreError(f"{p}: state dict holds no tensors")
    return tensors


def _open_torch(p: Path) -> Checkpoint:
    sd = _load_torch(p)
    specs = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
    return Checkpoint(p, specs, lambda name: sd[name], sd.clear)


def _open_torch_shards(shards: list[Path], label: Path) -> Checkpoint:
    # Shards are mmapped, so holding all of them open costs address space, not memory.
    merged: dict[str, Tensor] = {}
    for s in shards:
        merged.update(_load_torch(s))
    specs = {k: (tuple(v.shape), v.dtype) for k, v in merged.items()}
    return Checkpoint(label, specs, lambda name: merged[name], merged.clear)


def write_safetensors(path: str | os.PathLike, specs: list[tuple[str, tuple[int, ...], torch.dtype]],
                      tensors: Iterable[Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Write a safetensors file tensor by tensor (memory: one tensor at a time).

    ``specs`` gives every (name, shape, dtype) in order so the header can be written first; ``tensors``
    yields the tensors in that order. The file appears atomically (tmp + rename).
    """
    path = Path(path)
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, shape, dtype in specs:
        if dtype not in _ST_NAMES:
            raise StoreError(f"{name}: dtype {dtype} cannot be written to safetensors")
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the format asks for 8-byte alignment of the data section
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")  # two writers never share one
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            it: Iterator[Tensor] = iter(tensors)
            for name, shape, dtype in specs:
                t = next(it)
                if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise StoreError(f"{name}: got {tuple(t.shape)} {t.dtype}, header says {tuple(shape)} {dtype}")
                fh.write(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path

