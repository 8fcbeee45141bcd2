"""Turn the writer's buffered batches into one Arrow table per flush, fast.

The writer keeps each ``append`` call's dict untouched (so ``append`` stays a few hundred ns) and pays the
conversion once per flush. Converting Python lists element by element with ``pa.array`` costs ~0.5 µs
per string, which made flushing the bottleneck; so each column is assembled from *pieces* instead (one per
batch that gives the column):

- a scalar broadcast over a batch (``step=7``, ``run_id``) becomes a run in a NumPy repeat, never a list;
- string columns are dictionary-encoded: a value list passed again and again (the same list of tensor or
  metric names every step) is converted once and referenced by index, then expanded in C++ by a cast;
  a dictionary array (the probe's rows of several steps) gives its codes as they are;
- NumPy and Arrow arrays are taken as they are (an Arrow array keeps its NULLs, which a NumPy float array
  cannot tell from NaN); other Python lists are concatenated and converted in one call.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# Piece kinds: ("s", value, n) scalar broadcast, ("l", seq, n) Python sequence, ("a", ndarray, n) array,
# ("p", pa.Array, n) Arrow array.
# A column's pieces carry their first row; rows no piece covers are NULL (the batch did not give the column).
Piece = tuple[int, str, Any, int]


def classify(offset: int, value: Any, n: int) -> Piece:
    """How one batch, starting at row ``offset`` of the flush, supplies one column."""
    if isinstance(value, (list, tuple)):
        return (offset, "l", value, n)
    if isinstance(value, np.ndarray) and value.ndim > 0:
        return (offset, "a", value, n)
    if isinstance(value, pa.Array):
        return (offset, "p", value, n)
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) > 0:  # torch tensors and friends
        return (offset, "l", value.tolist(), n)
    if isinstance(value, np.generic):
        value = value.item()
    return (offset, "s", value, n)


def build_column(pieces: Sequence[Piece], typ: pa.DataType, total: int) -> pa.Array:
    """One Arrow array of ``total`` rows of type ``typ`` from a column's pieces (sorted by offset)."""
    pieces = [p for p in pieces if not (p[1] == "s" and p[2] is None)]
    if not pieces:
        return pa.nulls(total, typ)
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return _strings(pieces, typ, total)
    if (pa.types.is_integer(typ) or pa.types.is_floating(typ)) and all(p[1] == "s" for p in pieces):
        return _repeat_scalars(pieces, typ, total)
    return _generic(pieces, typ, total)


def _repeat_scalars(pieces: Sequence[Piece], typ: pa.DataType, total: int) -> pa.Array:
    # Convert the per-batch values through Arrow so out-of-range or non-numeric values raise here.
    values = pa.array([p[2] for p in pieces], type=typ).to_numpy(zero_copy_only=False)
    counts = np.fromiter((p[3] for p in pieces), dtype=np.int64, count=len(pieces))
    if int(counts.sum()) == total:  # every batch gave the column, in order: one C-level repeat
        return pa.array(np.repeat(values, counts), type=typ)
    out = np.zeros(total, dtype=values.dtype)
    valid = np.zeros(total, dtype=bool)
    for (off, _, _, n), v in zip(pieces, values, strict=True):
        out[off:off + n] = v
        valid[off:off + n] = True
    return pa.array(out, type=typ, mask=None if valid.all() else ~valid)


def _strings(pieces: Sequence[Piece], typ: pa.DataType, total: int) -> pa.Array:
    """A dictionary array: Parquet stores it dictionary-encoded and readers see plain strings."""
    dictionary: list[Any] = []
    scalar_index: dict[Any, int] = {}
    seq_index: dict[int, np.ndarray] = {}  # id(list) -> its index range; the list is alive until the flush ends
    indices = np.full(total, -1, dtype=np.int32)
    for off, kind, value, n in pieces:
        if kind == "s":
            i = scalar_index.get(value)
            if i is None:
                i = scalar_index[value] = len(dictionary)
                dictionary.append(value)
            indices[off:off + n] = i
            continue
        if kind == "p" and pa.types.is_dictionary(value.type):  # already encoded: take its codes as they are
            words = value.dictionary.to_pylist()
            remap = np.arange(len(dictionary), len(dictionary) + len(words), dtype=np.int32)
            dictionary.extend("" if v is None else v for v in words)
            if None in words:
                remap[[j for j, v in enumerate(words) if v is None]] = -1
            codes = remap[value.indices.fill_null(0).to_numpy(zero_copy_only=False)]  # nulls masked below
            if value.null_count:
                codes[~value.is_valid().to_numpy(zero_copy_only=False)] = -1
            indices[off:off + n] = codes
            continue
        idx = seq_index.get(id(value))
        if idx is None:
            seq = value.tolist() if kind == "a" else value.to_pylist() if kind == "p" else value
            idx = np.arange(len(dictionary), len(dictionary) + len(seq), dtype=np.int32)
            dictionary.extend("" if v is None else v for v in seq)  # None rows are masked below
            if None in seq:
                idx = np.where(np.fromiter((v is None for v in seq), bool, len(seq)), -1, idx)
            seq_index[id(value)] = idx
        indices[off:off + n] = idx
    null = indices < 0
    has_null = bool(null.any())
    dict_values = pa.array([v if v is None or isinstance(v, str) else str(v) for v in dictionary], type=typ)
    # Lists repeat values (a kind per tensor): a dictionary with duplicates makes Parquet fall back to PLAIN
    # encoding, which made scans of such columns ~10x slower. Dedupe it (it is small next to the rows).
    unique = dict_values.dictionary_encode(null_encoding="encode")
    if len(unique.dictionary) < len(dict_values):
        indices = unique.indices.to_numpy(zero_copy_only=False)[indices]
        dict_values = unique.dictionary
    return pa.DictionaryArray.from_arrays(
        pa.array(np.where(null, 0, indices) if has_null else indices, mask=null if has_null else None), dict_values)


def _generic(pieces: Sequence[Piece], typ: pa.DataType, total: int) -> pa.Array:
    arrays: list[pa.Array] = []
    pending: list[Any] = []  # consecutive Python values, converted in one call
    row = 0

    def spill() -> None:
        if pending:
            arrays.append(pa.array(pending, type=typ))
            pending.clear()

    for off, kind, value, n in pieces:
        if off > row:  # rows whose batch did not give this column
            spill()
            arrays.append(pa.nulls(off - row, typ))
        row = off + n
        if kind == "p":
            spill()
            arrays.append(value if value.type == typ else value.cast(typ))
        elif kind == "a" and value.dtype != object and not pa.types.is_nested(typ):
            spill()
            arrays.append(pa.array(value, type=typ) if value.dtype.kind != "f" or pa.types.is_floating(typ)
                          else pa.array(value.tolist(), type=typ))
        elif kind == "s":
            if n > 64 and not pa.types.is_nested(typ):
                spill()
                arrays.append(pa.array([value], type=typ).take(np.zeros(n, dtype=np.int64)))
            else:
                pending.extend([value] * n)
        else:
            pending.extend(value.tolist() if kind == "a" else value)
    spill()
    if total > row:
        arrays.append(pa.nulls(total - row, typ))
    return arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)


# Rows per row group of a merged file: its sources' small row groups are gathered up to it. A row group is
# a unit of a scan's work (its footer entry, a read per column), so a merged file of one row group per
# source cost a live query as many units as its sources did.
ROW_GROUP_ROWS = 262_144


def parquet_options(schema: pa.Schema, compression: str | dict[str, str] = "auto") -> dict[str, Any]:
    """``pq.write_table`` options for a segment of ``schema``: what readers scan fastest.

    ``auto``: float columns LZ4 (metric mantissas are close to random, so zstd saved ~6% of bytes and cost
    2-3x the decode time), everything else zstd. Dictionary encoding only where values repeat (strings,
    integers, booleans): on floats pyarrow would build a dictionary per page, then throw it away.
    """
    floats = {f.name for f in schema if pa.types.is_floating(f.type)
              or (pa.types.is_list(f.type) and pa.types.is_floating(f.type.value_type))}
    codec: str | dict[str, str] = compression
    if compression == "auto":
        codec = {f.name: ("lz4" if f.name in floats else "zstd") for f in schema}
    return {"compression": codec, "use_dictionary": [f.name for f in schema if f.name not in floats],
            "store_schema": False}


def codecs_like(path: str | os.PathLike, schema: pa.Schema) -> dict[str, str] | str:
    """Per column of ``schema``, the codec the Parquet file ``path`` was written with: a merge keeps what its
    writer chose (``RunWriter(compression=...)``) rather than ``auto``'s. A column the file lacks gets
    ``auto``'s codec; a file without row groups, or unreadable, gives ``auto``."""
    try:
        md = pq.ParquetFile(path).metadata
    except (OSError, pa.ArrowException):
        return "auto"
    if md.num_row_groups == 0:
        return "auto"
    rg = md.row_group(0)
    found = {rg.column(i).path_in_schema.split(".")[0]: rg.column(i).compression for i in range(rg.num_columns)}
    auto = parquet_options(schema)["compression"]
    return {f.name: ("none" if found[f.name] == "UNCOMPRESSED" else found[f.name].lower()) if f.name in found
            else auto[f.name] for f in schema}
