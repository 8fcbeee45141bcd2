"""The memory budget at the allocator: snapshot + θ₀ chunks + temporaries ≤ memory_budget × parameter
bytes at every moment of a full rotation; θ₀ streamed from disk a chunk at a time, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import dynascope
from dynascope.probes.held_memory import held_peak
from dynascope.probes.params import Tracked
from dynascope.probes.reference import build_reference
from dynascope.probes.tensors import TensorStats
from dynascope.stats.engine import DRIFT_STATS, Pass, transient_bytes, weight_drift_stats


@pytest.mark.parametrize("bf16_k", [None, 3])  # with S_k: its snapshot goes to disk, compared chunk by chunk
def test_probe_holds_at_most_its_budget(tmp_path: Path, bf16_k: int | None) -> None:
    # 16 equal weights (64 KiB each): the largest tensor fits the budget with room for its temporaries.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(128, 128) for _ in range(16)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(8, 128)

    def step() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW allocates its state at the first step: not the probe's
    with dynascope.watch(model, opt, run=tmp_path / "run", memory_budget=0.1, time_budget=None,
                         system_interval_s=None, bf16_k=bf16_k) as scope:
        assert scope.stats.reference is not None and not scope.stats.reference.resident
        peak = held_peak(scope.stats, step, 20, torch.device("cpu"))
        if bf16_k:
            assert scope.stats.history.resident_bytes == 0 and scope.stats.history.path.exists()
    covered = dynascope.open_store(tmp_path / "run").sql(
        "select count(distinct tensor) from tensor_stats where update_norm is not null and ref_covered").fetchall()
    assert covered == [(32,)]  # the rotation reached every tensor, ΔW and drift alike
    assert 0.05 * param_bytes < peak <= 0.1 * param_bytes, peak / param_bytes
    if bf16_k:
        k_steps = dynascope.open_store(tmp_path / "run").sql(
            "select distinct step from tensor_stats where bf16_unchanged_k_count is not null order by 1").fetchall()
        assert k_steps == [(3,), (6,), (9,), (12,), (15,), (18,)]  # every k-th step, within the same budget


def test_window_chunk_is_sized_from_what_the_snapshot_leaves() -> None:
    params = [nn.Parameter(torch.zeros(1 << 14)) for _ in range(20)]  # 64 KiB each
    tracked = [Tracked(name=f"p{i}", param=p) for i, p in enumerate(params)]
    stats = TensorStats(0.1, None)
    budget = 0.1 * 20 * (1 << 16)
    window = stats.plan(tracked)
    chunk = stats.window.chunk
    assert chunk is not None
    snapshot = sum(tracked[i].nbytes for i in window)
    assert snapshot <= 0.75 * budget and len(window) == 1
    # the largest chunk whose temporaries fit what the snapshot leaves of the budget
    assert snapshot + transient_bytes(chunk) <= budget < snapshot + transient_bytes(chunk + 1)
    assert TensorStats(1.0, None).plan(tracked) == list(range(20))  # a budget that holds it all takes it all


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_theta0_streams_from_disk_in_exact_chunks(tmp_path: Path, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w0 = {"a.weight": torch.randn(33, 17, generator=g).to(dtype), "b": torch.randn(0).to(dtype)}
    ref = build_reference("init", list(w0.items()), tmp_path, 0, resident=False)
    assert ref is not None and ref.path is not None and ref.path.exists()
    read = ref.reader("a.weight", w0["a.weight"])
    assert read is not None and ref.reader("a.weight", torch.zeros(3)) is None  # shape mismatch: not held
    flat = w0["a.weight"].reshape(-1)
    for lo, hi in [(0, 1), (5, 200), (550, 561), (0, 561)]:
        assert torch.equal(read(lo, hi), flat[lo:hi])
    assert ref.get("b", w0["b"]).numel() == 0
    cur = w0["a.weight"] + (torch.rand(33, 17, generator=g) < 0.3).to(dtype)
    want = weight_drift_stats([cur], [w0["a.weight"]])[0]
    fc = cur.reshape(-1)
    got = Pass(DRIFT_STATS).run({"ref": read, "new": lambda lo, hi: fc[lo:hi]}, fc.numel(), fc.device, chunk_elems=50)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0, equal_nan=True)
