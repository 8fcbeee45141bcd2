"""A record of one step's tensor statistics, and its ``tensor_stats`` rows.

The training thread fills a ``Record`` with device results, one ``Block`` per pass of statistics (the
tracked tensors it covers, the column names of its values), packed into one float64 vector that is
copied to the host once. The resolver thread unpacks it by name (``tensor_stats_batch``) and hands the
named values to ``stats.rows.tensor_stats_columns``, the row derivation ``dynascope diff`` uses too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch

from dynascope.core.clock import now_us
from dynascope.probes.params import Tracked
from dynascope.stats.engine import DEFAULT_CHUNK_ELEMS
from dynascope.stats.registry import REGISTRY
from dynascope.stats.rows import PartialResults, tensor_stats_columns

__all__ = ["Block", "Record", "summarize", "tensor_stats_batch", "tracked_columns"]


class Block(NamedTuple):
    """One pass's results in a record: ``columns`` per row, one row per tracked index in ``rows``."""

    columns: tuple[str, ...]
    rows: list[int]


class Record:
    """What the training thread hands to the resolver: one host vector plus the index bookkeeping."""

    def __init__(self, step: int, stage: str | None, tracked: list[Tracked]) -> None:
        self.step, self.stage, self.tracked = step, stage, tracked
        self.time_us = now_us()
        self.window: list[int] = []
        self.chunk_elems: int | None = DEFAULT_CHUNK_ELEMS
        self.blocks: dict[str, Block] = {}
        self.values: dict[str, torch.Tensor] = {}  # device results, [len(rows), len(columns)] per block
        self.constants: dict[str, Any] = {}  # per-record values of the rows a block covers (bf16_k_steps)
        self.host: torch.Tensor | None = None
        self.event: Any = None
        self.done: Any = None  # the future of a pass still computing this record's values (probes.background)
        self.notes: list[tuple[str, str]] = []  # (event, message): what became NULL or changed and why
        self.found_inf: torch.Tensor | None = None  # a GradScaler's flag: set where a fused step was a no-op
        self.update_keys: list[str] = []  # the blocks that describe the update (NULL where the step was skipped)

    def add(self, key: str, columns: tuple[str, ...], rows: list[int], values: torch.Tensor) -> None:
        self.blocks[key] = Block(columns, rows)
        self.values[key] = values.reshape(len(rows), len(columns))

    def drop_rows(self, keys: list[str], tensors: set[int]) -> None:
        """Remove ``tensors`` (tracked indices) from the blocks ``keys``: their values become NULL."""
        for key in keys:
            block = self.blocks.get(key)
            if block is None:
                continue
            keep = [j for j, i in enumerate(block.rows) if i not in tensors]
            self.blocks[key] = Block(block.columns, [block.rows[j] for j in keep])
            self.values[key] = self.values[key][keep]

    def wait(self) -> None:
        """Until this record's values are on the host (its pass done, its device copy arrived)."""
        if self.done is not None:
            self.done.result()  # the pass's error, if any, is the resolver's to report
            self.done = None
        if self.event is not None:
            self.event.synchronize()

    def pack(self, device: torch.device) -> None:
        """Every block's values into one float64 vector and its single copy to the host (pinned memory and
        a CUDA event behind it on a GPU, so nothing waits for the device here)."""
        parts = [v.to(device=device, dtype=torch.float64).reshape(-1) for v in self.values.values()]
        if self.found_inf is not None:  # last, one value: read on the resolver thread (``skipped``)
            parts.append(self.found_inf.to(device=device, dtype=torch.float64).reshape(1))
        flat = torch.cat(parts)
        if flat.is_cuda:
            self.host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flat.cpu()  # plain copy (a no-op view on CPU)
        self.values = {k: torch.Size(v.shape) for k, v in self.values.items()}  # type: ignore[misc]


def tracked_columns(tracked: list[Tracked]) -> dict[str, Any]:
    """The columns describing the tracked tensors, which every record of ``tracked`` repeats (names, layer,
    kind, shape, dtype, sharded, numel). The probe builds them once per tracked list and hands the same
    lists to the writer at every record, so its string columns are converted once per flush
    (``store._columns`` dictionary-encodes a list it has seen by identity)."""
    return {"tensor": [t.name for t in tracked], "layer": [t.layer for t in tracked],
            "kind": [t.kind for t in tracked], "shape": [t.shape for t in tracked],
            "dtype": [t.dtype for t in tracked], "sharded": [t.sharded for t in tracked],
            "mesh": [t.mesh for t in tracked], "shard": [t.shard for t in tracked],
            "replica": [t.replica for t in tracked],
            "numel": np.array([int(t.local().numel()) for t in tracked], dtype=np.int64)}


def tensor_stats_batch(recs: list[Record], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``tensor_stats`` batch (column → values) of records of one tracked list, record after record
    (runs on the resolver thread): Arrow arrays typed by the registry, NULL where a tensor had no value.
    ``meta``: ``tracked_columns(tracked)``, when the caller keeps it.

    Vectorised over tensors and records: each column's derivation and Arrow conversion has a fixed cost
    (~45 columns, ~0.5 ms a record), which the resolver pays once for a batch of records instead of once
    per record.
    """
    if not recs or not recs[0].tracked:
        return {}
    n, r_count = len(recs[0].tracked), len(recs)
    parts = PartialResults(n * r_count)
    for r, rec in enumerate(recs):
        if len(rec.tracked) != n:
            raise ValueError(f"records of different tracked lists in one batch ({len(rec.tracked)} != {n})")
        rec.wait()  # the record's pass and its single device→host copy, waited for here
        arr = rec.host.numpy() if rec.host is not None else np.zeros(0)
        skipped = rec.found_inf is not None and arr.size > 0 and arr[-1] != 0
        if skipped:
            rec.notes.append(("step_skipped", "the GradScaler found Inf/NaN gradients and the fused optimizer "
                              "skipped this step: its update statistics are NULL"))
        off = 0
        for key, block in rec.blocks.items():
            size = len(block.rows) * len(block.columns)
            values = arr[off:off + size].reshape(len(block.rows), len(block.columns))
            off += size
            if not block.rows or (skipped and key in rec.update_keys):  # no tensor (e.g. drift outside its
                continue  # turn), or no update: the scaler skipped the step
            idx = np.asarray(block.rows, dtype=np.int64) + r * n
            for j, c in enumerate(block.columns):
                parts.put(c, idx, values[:, j])
                if c in _NORMS and not np.isfinite(values[:, j]).all():
                    bad = int((~np.isfinite(values[:, j])).sum())
                    rec.notes.append(("non_finite", f"{c} of {bad} tensors is not finite (NaN or Inf elements): "
                                      "it, and the figures derived from it, are NULL; the NaN and Inf counts are exact"))
            for c, x in rec.constants.get(key, {}).items():
                parts.put(c, idx, x)
    meta = tracked_columns(recs[0].tracked) if meta is None else meta
    numel = meta["numel"] if r_count == 1 else np.tile(meta["numel"], r_count)
    cols: dict[str, Any] = dict(meta) if r_count == 1 else _repeated(meta, r_count)
    cols.update(tensor_stats_columns(parts, numel))
    if r_count == 1:
        cols.update(step=recs[0].step, time_us=recs[0].time_us, stage=recs[0].stage)
        return cols
    cols["step"] = np.repeat(np.fromiter((rec.step for rec in recs), np.int64, r_count), n)
    cols["time_us"] = np.repeat(np.fromiter((rec.time_us for rec in recs), np.int64, r_count), n)
    stages = [rec.stage for rec in recs]
    cols["stage"] = stages[0] if stages.count(stages[0]) == r_count else _dictionary(stages, np.repeat(
        np.arange(r_count, dtype=np.int32), n))
    return cols


# The norm columns: one that is not finite is stored as NULL (``stats.rows``), with an event saying so.
_NORMS = frozenset(c.name for c in REGISTRY.columns if c.reduce == "norm")


def _repeated(meta: dict[str, Any], times: int) -> dict[str, Any]:
    """``tracked_columns`` repeated for ``times`` records: strings as dictionary arrays over the one list of
    names (the writer stores them dictionary-encoded as they are), the rest tiled."""
    n = len(meta["numel"])
    tiled = np.tile(np.arange(n, dtype=np.int32), times)
    out: dict[str, Any] = {}
    for name, v in meta.items():
        if name in ("tensor", "kind", "shape", "dtype"):
            out[name] = _dictionary(v, tiled)
        elif name == "layer":  # NULL for tensors outside a numbered layer
            out[name] = pa.array(v, type=pa.int32()).take(pa.array(tiled))
        else:
            out[name] = np.tile(np.asarray(v), times)
    return out


def _dictionary(values: list[Any], indices: np.ndarray) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(indices, type=pa.int32()), pa.array(values, type=pa.string()))


def summarize(cols: dict[str, Any]) -> dict[str, float]:
    """Compact per-record summary for listeners: global and per-kind means of the columns the registry
    marks ``summary`` (the headline fractions)."""
    out: dict[str, float] = {}
    kinds = cols.get("kind")
    if not kinds:
        return out
    k = np.array(kinds, dtype=object)
    groups = {kind: np.flatnonzero(k == kind) for kind in dict.fromkeys(kinds)}
    for key in REGISTRY.summary:
        col = cols.get(key)
        if col is None or (isinstance(col, pa.Array) and col.null_count == len(col)):
            continue
        x = col.to_numpy(zero_copy_only=False) if isinstance(col, pa.Array) else np.array(col, dtype=np.float64)
        for kind, idx in (("", None), *groups.items()):
            v = x if idx is None else x[idx]
            v = v[np.isfinite(v)]  # NULL arrives as NaN; non-finite values are left out of the mean
            if v.size:
                out[f"{key}/{kind}" if kind else key] = float(v.mean())
    return out
