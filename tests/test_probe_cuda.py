"""On a GPU (skipped without one): device statistics equal the CPU ones, CUDA-event timings resolve,
per-step peak memory and NVML system rows land."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import dynascope
from dynascope.stats.builtin.grad import grad_counts, grad_norms
from dynascope.stats.engine import weight_update_stats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_stats_equal_cpu_stats() -> None:
    g = torch.Generator().manual_seed(0)
    old = [torch.randn(64, 32, generator=g), torch.randn(7, generator=g).bfloat16()]
    new = [o + (torch.rand(o.shape, generator=g) < 0.5).to(o.dtype) * 1e-2 for o in old]
    cpu = weight_update_stats(new, old)
    gpu = weight_update_stats([t.cuda() for t in new], [t.cuda() for t in old])
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu()[:, 2:], cpu[:, 2:], rtol=0, atol=0)  # counts: exact
    torch.testing.assert_close(gpu.cpu()[:, :2], cpu[:, :2], rtol=1e-5, atol=1e-7)
    gc = grad_counts([t.cuda() for t in new], grad_norms([t.cuda() for t in new])[:, 0])
    torch.testing.assert_close(gc.cpu(), grad_counts(new), rtol=0, atol=0)


def test_watch_on_cuda(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = tmp_path / "cuda"
    with dynascope.watch(model, opt, run=run, system_interval_s=0.05, memory_budget=None) as scope:
        for _ in range(4):
            with scope.phase("train"):
                model(torch.randn(32, 64, device="cuda")).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    q = lambda sql: dynascope.open_store(run).sql(sql).pl().to_dicts()  # noqa: E731
    stats = q("select * from tensor_stats where step = 3 order by tensor")
    assert len(stats) == 4 and all(r["update_norm"] > 0 and r["ref_covered"] for r in stats)
    t = q("select phase, min(dur_us) as lo, max(device) as dev from timings group by phase")
    by = {r["phase"]: r for r in t}
    assert {"forward", "backward", "optimizer", "train", "step"} <= set(by)
    assert by["forward"]["dev"].startswith("cuda") and by["forward"]["lo"] > 0
    clocks = {r["phase"]: r["clock"] for r in q("select distinct phase, clock from timings")}
    assert clocks["forward"] == "cuda_event" and clocks["step"] == "host"
    mem = q("select value from scalars where key = 'mem/peak_allocated_bytes'")
    assert len(mem) == 4 and all(r["value"] > 0 for r in mem)
    gpus = q("select * from system where device like 'gpu:%'")
    assert gpus and all(r["mem_total_bytes"] > 0 for r in gpus)
