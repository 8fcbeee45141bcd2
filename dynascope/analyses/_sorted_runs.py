"""Grouping by sorting, for the what-ifs: rows sorted by their keys form runs of equal keys, and every
aggregate is a ``reduceat`` over those runs (hash aggregation would pay for each aggregate over all rows).
Also reading Arrow columns into NumPy without pyarrow's pandas-importing conversion."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl
import pyarrow as pa

Arrays = dict[str, np.ndarray]


def runs_of(*keys: np.ndarray) -> np.ndarray:
    """Start index of each run of equal ``keys`` in arrays sorted by them."""
    n = len(keys[0])
    new = np.zeros(n, dtype=bool)
    if n:
        new[0] = True
        for k in keys:
            new[1:] |= k[1:] != k[:-1]
    return np.flatnonzero(new)


def at_runs(starts: np.ndarray, n: int) -> np.ndarray:
    """For each of ``n`` positions, the index of the run (from ``runs_of``) it belongs to. (One array of
    ``n``: a fresh array's pages cost more than filling it, at millions of rows.)"""
    if not len(starts):
        return np.zeros(n, dtype=np.int64)
    return np.repeat(np.arange(len(starts), dtype=np.int64), np.diff(starts, append=n))


def ends_of(starts: np.ndarray, n: int) -> np.ndarray:
    """The last index of each run that ``starts`` begins, in arrays of length ``n``."""
    return np.append(starts[1:], n) - 1


def pack(*keys: np.ndarray) -> tuple[np.ndarray, list[int]] | None:
    """``keys`` (most significant first) packed into one int64 that orders like them, and each key's bit
    width; None when they are not all integer-valued or need more than 62 bits."""
    if any(k.dtype.kind == "f" and not np.all(k == np.floor(k)) for k in keys):
        return None
    lo = [int(k.min()) if len(k) else 0 for k in keys]
    bits = [int(int(k.max()) - m).bit_length() if len(k) else 0 for k, m in zip(keys, lo, strict=True)]
    if sum(bits) > 62:
        return None
    packed = np.zeros(len(keys[0]), dtype=np.int64)
    part = np.empty_like(packed)  # one buffer for every key's offsets
    for k, m, b in zip(keys, lo, bits, strict=True):
        if b:  # a constant key orders nothing
            packed <<= b
            np.subtract(k, m, out=part, casting="unsafe")
            packed |= part
    return packed, bits


def sort_order(*keys: np.ndarray) -> np.ndarray:
    """``np.lexsort`` order of ``keys`` (most significant first): one integer sort when the keys, all
    integer-valued, pack into 63 bits, which is several times faster than sorting on each key in turn."""
    p = pack(*keys)
    return np.lexsort(keys[::-1]) if p is None else stable_order(p[0], sum(p[1]))


def stable_order(packed: np.ndarray, bits: int) -> np.ndarray:
    """``np.argsort(packed, kind="stable")`` of non-negative keys below 2**bits. When the keys leave room
    for each one's position in their low bits, the keys are distinct and a plain ``np.sort`` of them (a
    vectorised quicksort, several times faster than the stable argsort's merge sort) gives the same order."""
    n = len(packed)
    at = max(n - 1, 0).bit_length()
    if bits + at > 63:
        return np.argsort(packed, kind="stable")
    key = packed << at
    key |= np.arange(n, dtype=np.int64)
    key.sort()
    key &= (1 << at) - 1
    return key


def order_in_runs(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The order that sorts each run (from ``starts``) of ``values`` by value, stably, runs in place: as
    ``np.lexsort((values, run index))``. When the runs are of about one size (a step's ranks) and hold no
    NaN, the runs become the rows of a grid padded with +inf (after any value, stably), sorted along its
    rows at once: several times faster than the lexsort."""
    n = len(values)
    if not n:
        return np.zeros(0, dtype=np.int64)
    sizes = np.diff(starts, append=n)
    width = int(sizes.max())
    run = at_runs(starts, n)
    if len(starts) * width > 2 * n + 1024 or np.isnan(values).any():
        return np.lexsort((values, run))
    at = np.arange(n) - starts[run]
    grid = np.full((len(starts), width), np.inf)
    grid[run, at] = values
    pos = grid.argsort(axis=1, kind="stable")
    pos += starts[:, None]
    return pos[np.arange(width) < sizes[:, None]]


def sorted_in_runs(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``values`` with each run (from ``starts``) sorted, runs in place: ``values[order_in_runs(values,
    starts)]``, for a caller that needs the values only (a grid's rows sorted by value, no order kept)."""
    n = len(values)
    if not n:
        return values[:0].copy()
    sizes = np.diff(starts, append=n)
    width = int(sizes.max())
    if len(starts) * width > 2 * n + 1024 or np.isnan(values).any():
        return values[order_in_runs(values, starts)]
    run = at_runs(starts, n)
    grid = np.full((len(starts), width), np.inf)
    grid[run, np.arange(n) - starts[run]] = values
    grid.sort(axis=1)
    return grid[np.arange(width) < sizes[:, None]]


def sum_by(keys: list[np.ndarray], weights: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Sums of ``weights`` per distinct combination of ``keys`` (small integer codes: ranks, phases,
    groups): the combinations, in the order of their combined code, and their sums."""
    code = np.zeros(len(weights), dtype=np.int64)
    span = 1
    for k in keys:  # the keys' offsets from their minimum, combined
        lo, width = (int(k.min()), int(k.max() - k.min()) + 1) if len(k) else (0, 1)
        code, span = code * width + (k - lo), span * width
    if span > 4 * len(code) + 1024:  # sparse: number the combinations present
        _, code = np.unique(code, return_inverse=True)
        span = int(code.max(initial=-1)) + 1
    sums = np.bincount(code.ravel(), weights=weights, minlength=span)
    present = np.bincount(code.ravel(), minlength=span) > 0
    first = np.zeros(span, dtype=np.int64)
    first[code[::-1]] = np.arange(len(code))[::-1]  # a row of each combination
    return [k[first[present]] for k in keys], sums[present]


def lookup(table: Sequence[np.ndarray], query: Sequence[np.ndarray]) -> np.ndarray:
    """For each query row, the index of the equal row of ``table`` (its rows sorted and distinct), or -1."""
    n = len(table[0])
    p = pack(*(np.concatenate([a, b]) for a, b in zip(table, query, strict=True)))  # one packing for both
    if p is None:  # too wide to pack: polars joins them
        t = pl.DataFrame({str(i): a for i, a in enumerate(table)}).with_row_index("at")
        q = pl.DataFrame({str(i): a for i, a in enumerate(query)})
        return q.join(t, on=[str(i) for i in range(len(table))], how="left", maintain_order="left")[
            "at"].fill_null(-1).to_numpy().astype(np.int64)
    tk, qk = p[0][:n], p[0][n:]
    if not n:
        return np.full(len(qk), -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(tk, qk), n - 1)
    return np.where(tk[at] == qk, at, -1)


_NUMPY = {pa.bool_(): np.bool_, pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32,
          pa.int64(): np.int64, pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32,
          pa.uint64(): np.uint64, pa.float32(): np.float32, pa.float64(): np.float64}


def as_numpy(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A primitive Arrow column as NumPy, read from its buffers. (pyarrow's own conversion imports pandas
    the first time a process uses it: 0.4 s of a first what-if.) Columns with NULLs take pyarrow's."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    parts = []
    for c in chunks:
        if c.null_count or c.type not in _NUMPY:
            parts.append(c.to_numpy(zero_copy_only=False))
        elif c.type == pa.bool_():  # bit-packed
            bits = np.unpackbits(np.frombuffer(c.buffers()[1], dtype=np.uint8), bitorder="little")
            parts.append(bits[c.offset:c.offset + len(c)].view(np.bool_))
        else:
            dtype = np.dtype(_NUMPY[c.type])
            parts.append(np.frombuffer(c.buffers()[1], dtype=dtype, count=len(c), offset=c.offset * dtype.itemsize))
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=_NUMPY.get(col.type, np.float64))
