"""The chunked statistics keep no allocation alive from one chunk to the next.

Why it matters (issue #3, the probe's fixed memory): with a list of per-chunk 0-d results, each chunk's
small results outlived its large temporaries, glibc carved them out of the holes the temporaries left,
and the next chunk's temporaries had to extend the heap instead — 2-9 MiB of free but resident heap in
one run in two on the reference workload (benchmarks/probe_overhead.py), held for the whole run.
Which runs grew depended on the heap's layout, so this checks the property that prevents it, on the
allocator's own events: the number of live allocations during a call does not grow with its chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dynascope.probes.held_memory import memory_events
from dynascope.stats.builtin.grad import grad_counts, grad_norms
from dynascope.stats.engine import UPDATE_STATS, compute


def tensor_update_stats(new: torch.Tensor, old: torch.Tensor, chunk_elems: int | None) -> torch.Tensor:
    return compute(UPDATE_STATS, {"new": new, "old": old}, chunk_elems=chunk_elems)


def _most_live_allocations(fn: Callable[[], object]) -> int:
    """Largest number of CPU allocations alive at once while ``fn`` runs (profiler memory events)."""
    live = most = 0
    for e in memory_events(fn)[1]:
        live += 1 if e["args"]["Bytes"] > 0 else -1
        most = max(most, live)
    return most


def test_update_stats_hold_no_allocation_across_chunks() -> None:
    torch.manual_seed(0)
    old = torch.randn(4096, 64)
    new = old + 1e-3 * torch.randn_like(old)
    few = _most_live_allocations(lambda: tensor_update_stats(new, old, chunk_elems=old.numel() // 4))
    many = _most_live_allocations(lambda: tensor_update_stats(new, old, chunk_elems=old.numel() // 64))
    assert few > 0  # the profiler saw the temporaries
    # Per-chunk results kept in a list made this grow by 7 per chunk (~420 more for 64 chunks).
    assert many <= few + 2, (few, many)


def test_grad_counts_hold_no_allocation_across_chunks() -> None:
    torch.manual_seed(0)
    g = torch.randn(4096, 64)
    gn = grad_norms([g])[:, 0]
    few = _most_live_allocations(lambda: grad_counts([g], gn, chunk_elems=g.numel() // 4))
    many = _most_live_allocations(lambda: grad_counts([g], gn, chunk_elems=g.numel() // 64))
    assert few > 0
    assert many <= few + 2, (few, many)


def test_chunked_results_match_one_chunk() -> None:
    """The per-chunk rows add up to the same statistics as a single chunk (counts exactly)."""
    torch.manual_seed(1)
    old = torch.randn(1000, 37)
    new = old.clone()
    new[::3] += 1e-2 * torch.randn_like(new[::3])
    new[5, 5] = float("nan")
    one = tensor_update_stats(new, old, chunk_elems=None)
    chunked = tensor_update_stats(new, old, chunk_elems=999)
    torch.testing.assert_close(chunked[2:], one[2:], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(chunked[:2], one[:2], equal_nan=True)
    g = torch.randn(3001)
    g[::7] = 0
    g[10] = float("inf")
    torch.testing.assert_close(grad_counts([g], chunk_elems=100), grad_counts([g], chunk_elems=None), rtol=0, atol=0)
    assert grad_counts([torch.zeros(0)], chunk_elems=100).tolist() == [[0.0, 0.0, 0.0, 0.0, 0.0]]
