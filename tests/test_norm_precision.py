"""‖W‖ and ‖g‖ are one float64-accumulated estimator on every record, held against float64 references.

The tensors are large and offset from zero, where an fp32 accumulator shows its error (an fp32 BLAS dot
of 2^24 such elements is ~1e-4 off); the float64 sum of the fp32 squares is ~1e-11 off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import dynascope
from dynascope.stats.builtin.grad import grad_norms
from dynascope.stats.builtin.weights import W_NORM, w_norms
from dynascope.stats.engine import compute

from helpers.probe_runs import rows

N = 1 << 24


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_norms_are_float64_accurate(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNASCOPE_FUSED", "sync")  # the fused kernel compiled before its first use
    torch.manual_seed(0)
    t = (torch.randn(N) * 0.02 + 0.01).to(dtype)
    small = torch.randn(37).to(dtype)
    ref = [float(x.double().norm()) for x in (t, small)]
    for got in (w_norms([t, small])[:, 0], grad_norms([t, small])[:, 0]):
        assert got.dtype == torch.float64
        assert float(got[0]) == pytest.approx(ref[0], rel=1e-9)
        # each square is rounded to fp32 before the float64 sum: a few terms keep that rounding (~6e-8 each),
        # many average it out
        assert float(got[1]) == pytest.approx(ref[1], rel=1e-7)
    # the same estimator as the chunked pass that gives the window's ‖W‖
    assert float(w_norms([t])[0, 0]) == pytest.approx(float(compute((W_NORM,), {"new": t})[0]), rel=1e-12)


def test_w_norm_of_every_record_matches_float64(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records at and between the every-tensor cadence, tensors in and out of the window: every ‖W‖ is
    the float64 norm of the weights after the step, so its step-to-step change is the real one."""
    monkeypatch.setenv("DYNASCOPE_FUSED", "sync")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 16))
    with torch.no_grad():
        model[0].weight.add_(0.01)  # offset from zero, as trained weights are
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    truth: list[dict[str, float]] = []
    names = {id(p): n for n, p in model.named_parameters()}
    opt.register_step_post_hook(lambda o, a, k: truth.append(
        {names[id(p)]: float(p.detach().double().norm()) for p in model.parameters()}))
    run = tmp_path / "wnorm"
    with dynascope.watch(model, opt, run=run, system_interval_s=None, time_budget=None, memory_budget=0.3):
        for _ in range(10):
            opt.zero_grad()
            model(torch.randn(4, 2048)).pow(2).mean().backward()
            opt.step()
    got = rows(run, "select step, tensor, w_norm from tensor_stats where w_norm is not null order by step")
    steps = {r["step"] for r in got}
    assert {0, 8} <= steps and len(steps) > 2  # the cadence records and windowed ones between them
    numel = {n: p.numel() for n, p in model.named_parameters()}
    for r in got:  # 1e-9 where there are elements enough to average the squares' fp32 rounding out
        rel = 1e-9 if numel[r["tensor"]] >= 1 << 20 else 1e-7
        assert r["w_norm"] == pytest.approx(truth[r["step"]][r["tensor"]], rel=rel), r
    series = [r for r in got if r["tensor"] == "0.weight"]
    for a, b in zip(series, series[1:], strict=False):
        want = truth[b["step"]]["0.weight"] - truth[a["step"]]["0.weight"]
        assert abs((b["w_norm"] - a["w_norm"]) - want) < 1e-9 * a["w_norm"]
